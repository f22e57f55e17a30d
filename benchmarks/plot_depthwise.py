"""Plot a depthwise.py result: one row of panels per direction; left, our
speedup over PyTorch's faster memory format per cell (log scale, above 1 =
ours faster); right, the fraction of the floor each cell reaches (ours as
bars, PyTorch's best as a black line over each dtype's bars).  Bars: one group per case, one bar per
(dtype, layout); a cell where our call failed is marked x at the baseline.

    python benchmarks/plot_depthwise.py results/depthwise_h200_<date>.json out.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

DIRECTIONS = ("forward", "backward_input", "backward_weight")
DTYPE_COLORS = {"float32": "tab:blue", "float16": "tab:orange", "bfloat16": "tab:green"}
LAYOUT_HATCH = {"NCHW": "", "NHWC": "///"}
#: The depthwise target: 3x3 / 5x5 should reach 75% of copy bandwidth.
FLOOR_TARGET = 0.75


def _plain(value, _position):
    return f"{value:g}"


def _plain_minor(value, _position):
    """Label the 2s and 5s of each decade on the log axis, not every minor tick."""
    mantissa = value / 10 ** int(f"{value:e}".split("e")[1])
    return f"{value:g}" if round(mantissa) in (2, 5) and abs(mantissa - round(mantissa)) < 1e-6 else ""


def _ordered(rows, key):
    seen = []
    for row in rows:
        if row[key] not in seen:
            seen.append(row[key])
    return seen


def plot(results, out):
    """Write the figure for ``results`` (a depthwise.py result dict) to ``out``."""
    rows = [r for r in results["rows"] if r.get("op") == "depthwise_conv2d"]
    cases, dtypes, layouts = _ordered(rows, "case"), _ordered(rows, "dtype"), _ordered(rows, "layout")
    directions = [d for d in DIRECTIONS if any(r["direction"] == d for r in rows)]
    cell = {(r["case"], r["dtype"], r["layout"], r["direction"]): r for r in rows}
    series = [(dtype, layout) for dtype in dtypes for layout in layouts]
    width = 0.84 / len(series)
    offsets = [(s - (len(series) - 1) / 2) * width for s in range(len(series))]

    fig, axes = plt.subplots(len(directions), 2, figsize=(max(12, 2.3 * len(cases) + 2), 3.6 * len(directions) + 1.2),
                             squeeze=False)
    for (ax_speed, ax_floor), direction in zip(axes, directions):
        for (dtype, layout), offset in zip(series, offsets):
            xs, speedups, fractions, failed = [], [], [], []
            for i, case in enumerate(cases):
                row = cell.get((case, dtype, layout, direction))
                if row is None:
                    continue
                if row.get("ours_us") is None:
                    failed.append(i + offset)
                    continue
                xs.append(i + offset)
                speedups.append(row.get("ratio_vs_torch_best") or float("nan"))
                fractions.append(row.get("fraction_of_floor") or 0.0)
            style = dict(color=DTYPE_COLORS.get(dtype, "gray"), hatch=LAYOUT_HATCH.get(layout, ".."),
                         edgecolor="white", linewidth=0.3)
            # Speedup bars grow from 1.0: up when ours is faster, down when slower.
            ax_speed.bar(xs, [s - 1 for s in speedups], width, bottom=1.0, **style)
            ax_floor.bar(xs, fractions, width, **style)
            for ax in (ax_speed, ax_floor):
                ax.scatter(failed, [1.0 if ax is ax_speed else 0.0] * len(failed), marker="x",
                           color=DTYPE_COLORS.get(dtype, "gray"), s=30, zorder=3, clip_on=False)
        # PyTorch's best in the floor panel: one tick across each (case, dtype)'s layout bars
        # (its time does not depend on our layout).
        for d, dtype in enumerate(dtypes):
            left = offsets[d * len(layouts)] - width / 2
            right = offsets[(d + 1) * len(layouts) - 1] + width / 2
            for i, case in enumerate(cases):
                fraction = next((cell[key].get("torch_best_fraction_of_floor") for key in
                                 [(case, dtype, layout, direction) for layout in layouts] if key in cell), None)
                if fraction is not None:
                    ax_floor.hlines(fraction, i + left, i + right, color="black", linewidth=1.6, zorder=3)
        ax_speed.axhline(1.0, color="black", linewidth=0.9)
        ax_speed.set_yscale("log")
        ax_speed.yaxis.set_major_formatter(FuncFormatter(_plain))
        ax_speed.yaxis.set_minor_formatter(FuncFormatter(_plain_minor))
        ax_speed.set_ylabel(f"{direction}\nspeedup vs PyTorch best (log)", fontsize=9)
        ax_floor.axhline(FLOOR_TARGET, color="gray", linewidth=0.8, linestyle="--")
        ax_floor.set_ylim(0, max(1.0, ax_floor.get_ylim()[1]))
        ax_floor.set_ylabel(f"{direction}\nfraction of floor", fontsize=9)
        for ax in (ax_speed, ax_floor):
            ax.set_xticks(range(len(cases)))
            ax.set_xticklabels([c.replace(" ", "\n", 1) for c in cases], fontsize=8)
            ax.set_xlim(-0.5, len(cases) - 0.5)
            for boundary in range(1, len(cases)):
                ax.axvline(boundary - 0.5, color="0.85", linewidth=0.6, zorder=0)
            ax.grid(axis="y", which="both", color="0.92", linewidth=0.5, zorder=0)
            ax.set_axisbelow(True)
            ax.tick_params(axis="y", labelsize=8)
    axes[0][0].set_title("ours / PyTorch's faster memory format (> 1: ours faster)", fontsize=10)
    axes[0][1].set_title("fraction of the floor: max(bytes / copy bandwidth, FMAs / FP32 rate)", fontsize=10)

    handles = [Patch(facecolor=DTYPE_COLORS.get(d, "gray"), label=d) for d in dtypes]
    handles += [Patch(facecolor="white", edgecolor="black", hatch=LAYOUT_HATCH.get(l, ".."), label=f"ours {l}")
                for l in layouts]
    handles += [
        plt.Line2D([], [], color="black", linewidth=1.6, label="PyTorch best (floor panel)"),
        plt.Line2D([], [], marker="x", color="gray", linestyle="", label="our call failed"),
        plt.Line2D([], [], color="gray", linestyle="--", label=f"{FLOOR_TARGET:.0%} of floor"),
    ]
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 0.965))
    versions = results.get("versions", {})
    commit = f", commit {results['commit']}" if results.get("commit") else ""
    fig.suptitle(
        f"depthwise_conv2d (eager): {results['device']}, {results['date']}{commit}; "
        f"copy {results['copy_bandwidth_TBps']:.2f} TB/s, FP32 {results.get('fp32_fma_rate_TFMAps', float('nan')):.1f} TFMA/s; "
        f"torch {versions.get('torch', '?')}, cuDNN {versions.get('cudnn', '?')}"
        + (" (--quick)" if results.get("quick") else ""),
        fontsize=11, y=0.99,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(path, out):
    with open(path) as f:
        plot(json.load(f), out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
