"""Bar chart of a group_norm.py result: forward and forward+backward times as
multiples of their memory floors (log scale, lower is better).

    python benchmarks/plot_group_norm.py results/group_norm_h200_2026-11-30.json out.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PANELS = [  # (title, direction, [(label, row key)])
    ("forward", "forward", [
        ("cupy-dwgn (NHWC)", "ours_us"),
        ("PyTorch NCHW", "torch_nchw_us"),
        ("PyTorch channels_last", "torch_channels_last_us"),
    ]),
    ("forward + backward", "forward_backward", [
        ("cupy-dwgn (NHWC)", "ours_us"),
        ("PyTorch channels_last", "torch_channels_last_us"),
    ]),
]


def main(path, out):
    with open(path) as f:
        result = json.load(f)
    rows = [r for r in result["rows"] if r.get("op") == "group_norm"]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(12, 4.5))
    for ax, (title, direction, series) in zip(axes, PANELS):
        cases = [r for r in rows if r["direction"] == direction]
        width = 0.8 / len(series)
        for s, (label, key) in enumerate(series):
            xs = [i + (s - (len(series) - 1) / 2) * width for i in range(len(cases))]
            ys = [c[key] / c["floor_us"] for c in cases]
            bars = ax.bar(xs, ys, width, label=label)
            ax.bar_label(bars, labels=[f"{c[key]:.0f}" for c in cases], fontsize=6, padding=1)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="memory floor")
        ax.set_yscale("log")
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([c["case"] for c in cases], fontsize=8)
        ax.set_ylabel("time / memory floor (log; bar labels: us)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"GroupNorm + SiLU, fp16, G=32: {result['device']}, {result['date']}, commit {result['commit']} "
        f"(copy {result['copy_bandwidth_TBps']:.2f} TB/s, torch {result['versions']['torch']})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:3])
