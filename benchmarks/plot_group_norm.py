"""Plot a group_norm.py result.  Top two rows: our speedup over PyTorch's faster
memory format (log scale, above 1 = ours faster), forward and
forward+backward, eager timing then GPU (CUDA-graph) timing; one group of bars
per shape, one bar per dtype x activation.  Bottom row: our GPU time as a
fraction of the memory floor, forward (target line 0.70) and backward (0.60).

    python benchmarks/plot_group_norm.py results/group_norm_h200_<date>.json out.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

DTYPE_COLORS = {"float32": "tab:blue", "float16": "tab:green", "bfloat16": "tab:orange"}
PANELS = [  # (row key, direction, timing, y label, target line)
    ("ratio_vs_torch_best", "forward", "eager", "PyTorch best / ours, eager", 1.0),
    ("ratio_vs_torch_best", "forward_backward", "eager", "PyTorch best / ours, eager", 1.0),
    ("ratio_vs_torch_best", "forward", "gpu", "PyTorch best / ours, GPU time", 1.0),
    ("ratio_vs_torch_best", "forward_backward", "gpu", "PyTorch best / ours, GPU time", 1.0),
    ("fraction_of_floor", "forward", "gpu", "floor / ours, GPU time", 0.70),
    ("fraction_of_floor", "backward", "gpu", "floor / ours, GPU time", 0.60),
]


def plot(results, out):
    """Write the figure for ``results`` (a group_norm.py result dict) to ``out``."""
    rows = [r for r in results["rows"] if r.get("op") == "group_norm"]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    series = list(dict.fromkeys((r["dtype"], r["activation"]) for r in rows))
    fig, axes = plt.subplots(3, 2, figsize=(16, 12))
    width = 0.8 / max(1, len(series))
    for ax, (key, direction, timing, label, target) in zip(axes.flat, PANELS):
        for s, (dtype, activation) in enumerate(series):
            values = {
                r["case"]: r[key] for r in rows
                if (r["dtype"], r["activation"], r["direction"], r["timing"]) == (dtype, activation, direction, timing)
                and r.get(key) is not None
            }
            xs = [i + (s - (len(series) - 1) / 2) * width for i, c in enumerate(cases) if c in values]
            ys = [values[c] for c in cases if c in values]
            ax.bar(xs, ys, width, color=DTYPE_COLORS.get(dtype, "gray"),
                   hatch="//" if activation != "identity" else None, edgecolor="white", linewidth=0.3,
                   label=f"{dtype} {activation}")
        ax.axhline(target, color="black", linewidth=0.8, linestyle="--")
        if key == "ratio_vs_torch_best":
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
            ax.yaxis.set_minor_formatter(FuncFormatter(lambda value, _: f"{value:g}" if value in (0.5, 2, 3, 5) else ""))
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([c.replace(" G32", "") for c in cases], rotation=30, ha="right", fontsize=7)
        ax.set_ylabel(label, fontsize=8)
        ax.set_title(f"{direction.replace('_', '+')}, {timing}", fontsize=9)
    axes.flat[0].legend(fontsize=7, ncol=3)
    fig.suptitle(
        f"GroupNorm (G={results.get('groups', 32)}), NHWC: {results['device']}, {results['date']}, "
        f"commit {results['commit']} (copy {results['copy_bandwidth_TBps']:.2f} TB/s, "
        f"torch {results['versions']['torch']}); dashed: target",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(path, out):
    with open(path) as f:
        plot(json.load(f), out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
