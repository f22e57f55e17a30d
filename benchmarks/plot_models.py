"""Plot a models.py result.  Top: training-step speedup of the converted model
over torch in its faster memory format, one bar per (model, precision mode)
(log scale, above 1 = converted faster; bar labels: ms per step, torch -> ours).
Bottom: relative error norm against the float64 model of the output, the input
gradient and the parameter gradients, torch's layers (plain bars) next to the
converted model's (hatched), log scale; a black tick over each of ours marks
2x torch's error (the target: our bar at or below it).

    python benchmarks/plot_models.py results/models_h200_<date>.json out.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

MODE_COLORS = {"float32": "tab:blue", "bfloat16-autocast": "tab:green", "bfloat16-cast": "tab:orange"}
ERROR_KINDS = (("out", "output"), ("dx", "input grad"), ("dparam", "param grads"))
ERROR_SHADES = {"out": 1.0, "dx": 0.7, "dparam": 0.45}
ERROR_FACTOR = 2.0


def _plain(value, _position):
    return f"{value:g}"


def _shade(color, factor):
    r, g, b, _ = matplotlib.colors.to_rgba(color)
    return (1 - factor * (1 - r), 1 - factor * (1 - g), 1 - factor * (1 - b)) if factor < 1 else (r, g, b)


def plot(results, out):
    """Write the figure for ``results`` (a models.py result dict) to ``out``."""
    rows = [r for r in results["rows"] if "speedup" in r]
    models = list(dict.fromkeys(r["op"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    cell = {(r["op"], r["mode"]): r for r in rows}
    width = 0.8 / max(1, len(modes))
    offsets = [(m - (len(modes) - 1) / 2) * width for m in range(len(modes))]

    fig, (ax_speed, ax_err) = plt.subplots(2, 1, figsize=(max(9, 2.6 * len(models) + 2), 9))
    for mode, offset in zip(modes, offsets):
        color = MODE_COLORS.get(mode, "gray")
        for i, model in enumerate(models):
            row = cell.get((model, mode))
            if row is None:
                continue
            x = i + offset
            if row.get("speedup"):
                bar = ax_speed.bar([x], [row["speedup"] - 1], width * 0.9, bottom=1.0, color=color)
                ax_speed.bar_label(bar, labels=[f"{row['torch_us'] / 1e3:.1f}\n-> {row['ours_us'] / 1e3:.1f}"],
                                   fontsize=6, padding=1)
            else:
                ax_speed.scatter([x], [1.0], marker="x", color=color, zorder=3)
            # Errors: 3 kinds x (torch, ours) bars inside this (model, mode) slot.
            sub = width * 0.9 / (2 * len(ERROR_KINDS))
            for k, (kind, _label) in enumerate(ERROR_KINDS):
                for s, impl in enumerate(("torch", "ours")):
                    value = row.get(f"{kind}_err_{impl}")
                    xs = x - width * 0.45 + sub * (2 * k + s + 0.5)
                    if value is None or not value > 0:
                        ax_err.scatter([xs], [1e-9], marker="x", color=color, s=12, zorder=3)
                        continue
                    ax_err.bar([xs], [value], sub, color=_shade(color, ERROR_SHADES[kind]),
                               hatch="////" if impl == "ours" else "", edgecolor="white", linewidth=0.3)
                    if impl == "ours" and row.get(f"{kind}_err_torch"):
                        limit = ERROR_FACTOR * row[f"{kind}_err_torch"]
                        ax_err.hlines(limit, xs - sub / 2, xs + sub / 2, color="black", linewidth=1.2, zorder=3)
    ax_speed.axhline(1.0, color="black", linewidth=0.9)
    ax_speed.set_yscale("log")
    speedups = [r["speedup"] for r in rows if r.get("speedup")] + [1.0]
    ax_speed.set_ylim(min(speedups) / 1.3, max(speedups) * 1.3)  # room for the bar labels
    ax_speed.yaxis.set_major_formatter(FuncFormatter(_plain))
    ax_speed.yaxis.set_minor_formatter(FuncFormatter(_plain))
    ax_speed.tick_params(axis="y", which="minor", labelsize=7)
    ax_speed.set_ylabel("training-step speedup\n(torch best format / converted; log)")
    ax_speed.set_title("training step (fwd + bwd + SGD): > 1 = converted model faster; labels: ms torch -> ours",
                       fontsize=10)
    ax_err.set_yscale("log")
    ax_err.set_ylabel("relative error norm vs float64 (log)")
    ax_err.set_title("accuracy against a float64 copy of the model: output, input grad, param grads; "
                     "plain = torch, hatched = converted, tick = 2x torch", fontsize=10)
    for ax in (ax_speed, ax_err):
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels(models, fontsize=9)
        ax.set_xlim(-0.5, len(models) - 0.5)
        for boundary in range(1, len(models)):
            ax.axvline(boundary - 0.5, color="0.85", linewidth=0.6, zorder=0)
        ax.grid(axis="y", which="major", color="0.92", linewidth=0.5, zorder=0)
        ax.set_axisbelow(True)
    handles = [Patch(facecolor=MODE_COLORS.get(m, "gray"), label=m) for m in modes]
    handles += [Patch(facecolor=_shade("gray", ERROR_SHADES[k]), label=f"{label} (error panel)")
                for k, label in ERROR_KINDS]
    handles += [Patch(facecolor="white", edgecolor="black", hatch="////", label="converted (error panel)"),
                plt.Line2D([], [], color="black", linewidth=1.2, label="2x torch's error")]
    fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), 5), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 0.955))
    versions = results.get("versions", {})
    commit = f", commit {results['commit']}" if results.get("commit") else ""
    fig.suptitle(
        f"converted models (cupy_dwgn.torch.convert) vs torch: {results['device']}, {results['date']}{commit}; "
        f"torch {versions.get('torch', '?')}, timm {results.get('timm', '?')}"
        + (" (--quick)" if results.get("quick") else "") + (" (CPU DRY RUN)" if results.get("cpu_dry_run") else ""),
        fontsize=10, y=0.99,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(path, out):
    with open(path) as f:
        plot(json.load(f), out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
