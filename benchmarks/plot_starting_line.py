"""Bar chart of a starting_line.py result: each timing as a multiple of the
memory floor (bytes / measured copy bandwidth), lower is better.

    python benchmarks/plot_starting_line.py results/starting_line_h200_2026-11-30.json out.png
"""

import json
import sys
import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SERIES = [  # (label, key of the timing, key of its floor)
    ("cupy-dwgn", ("cupy_dwgn_us", "cupy_dwgn_fwd_us"), ("floor_us", "fwd_floor_us")),
    ("PyTorch NCHW", ("torch_nchw_us",), ("floor_us",)),
    ("PyTorch channels_last", ("torch_channels_last_us", "torch_channels_last_fwd_us"), ("floor_us", "fwd_floor_us")),
]


def _first(case, keys):
    return next((case[k] for k in keys if k in case), None)


def main(path, out):
    with open(path) as f:
        result = json.load(f)
    cases = result["cases"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(SERIES)
    for s, (label, time_keys, floor_keys) in enumerate(SERIES):
        xs, ys = [], []
        for i, case in enumerate(cases):
            us, floor = _first(case, time_keys), _first(case, floor_keys)
            if us is not None and floor is not None:
                xs.append(i + (s - 1) * width)
                ys.append(us / floor)
        ax.bar(xs, ys, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="memory floor")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([textwrap.fill(c["case"], 20) for c in cases], fontsize=7)
    ax.set_ylabel("time / memory floor (lower is better)")
    ax.set_title(
        f"Forward passes, {result['device']}, {result['date']} "
        f"(copy {result['copy_bandwidth_TBps']:.2f} TB/s, torch {result['torch']})",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:3])
