"""Side by side: several runs of benchmarks/depthwise.py (their printed
cell lines, e.g. the ab_*.txt files scripts/ab_compare.sh writes, one per
tree), one row per cell, one column per file: our time in each, PyTorch's
best memory format from the first file, and a mark where some file differs
from the first by more than --threshold; then each file's geometric-mean
time relative to the first over the cells all files hold.  A cell measured
more than once in a file (the same tree run twice) shows its median.  CPU
only: it reads text.

    python3 benchmarks/ab_table.py ab_0_main.txt ab_1_7902a37.txt [--names main fix] [--threshold 0.04]
"""

import argparse
import math
import re
import statistics
import sys

# A cell line of benchmarks/depthwise.py (cell_line): "[3/48] 64x144x56 3x3 s1  float16  NHWC forward  ours  67.6
# torch NCHW  95.2 CL  49.1 ..."
CELL = re.compile(
    r"^\[\d+/\d+\] (?P<case>.+?)\s+(?P<dtype>float32|float16|bfloat16)\s+(?P<layout>NCHW|NHWC)\s+(?P<direction>\w+)"
    r"\s+ours\s+(?P<ours>[\d.]+)\s+torch NCHW\s+(?P<nchw>[\d.]+)\s+CL\s+(?P<cl>[\d.]+)")


def parse(lines):
    """{(case, dtype, layout, direction): ([our times], [PyTorch best times])}
    from the cell lines among ``lines``."""
    cells = {}
    for line in lines:
        m = CELL.match(line.strip())
        if m:
            key = (m["case"].strip(), m["dtype"], m["layout"], m["direction"])
            ours, best = cells.setdefault(key, ([], []))
            ours.append(float(m["ours"]))
            best.append(min(float(m["nchw"]), float(m["cl"])))
    return cells


def table(runs, names, threshold=0.04):
    """The comparison as text lines; ``runs``: one parse() result per file."""
    first = runs[0]
    keys = [k for k in first if all(k in run for run in runs[1:])]
    width = max([len(" ".join(k)) for k in keys] + [4])
    lines = [f"{'cell':{width}s}" + "".join(f"{name[:9]:>10s}" for name in names) + f"{'PyTorch':>10s}"]
    logs = [0.0] * len(runs)
    for key in keys:
        times = [statistics.median(run[key][0]) for run in runs]
        for i, t in enumerate(times):
            logs[i] += math.log(t / times[0])
        mark = " *" if any(abs(t / times[0] - 1) > threshold for t in times[1:]) else ""
        lines.append(f"{' '.join(key):{width}s}" + "".join(f"{t:10.1f}" for t in times)
                     + f"{statistics.median(first[key][1]):10.1f}{mark}")
    if keys:
        lines.append(f"{'geomean time / first':{width}s}" + "".join(f"{math.exp(v / len(keys)):10.3f}" for v in logs))
    missing = sum(1 for run in runs for k in run if k not in first) + len(first) - len(keys)
    if missing:
        lines.append(f"({missing} cells not in every file left out)")
    lines.append(f"(* : some file differs from the first by more than {threshold:.0%})")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="outputs of benchmarks/depthwise.py (text)")
    parser.add_argument("--names", nargs="+", help="column names (default: the file names)")
    parser.add_argument("--threshold", type=float, default=0.04, help="mark cells differing by more (default 0.04)")
    args = parser.parse_args(argv)
    names = args.names or [f.rsplit("/", 1)[-1].removesuffix(".txt") for f in args.files]
    if len(names) != len(args.files):
        parser.error(f"--names: {len(args.files)} names expected, got {len(names)}")
    runs = []
    for path in args.files:
        with open(path) as f:
            run = parse(f)
        if not run:
            parser.error(f"{path}: no cell lines of benchmarks/depthwise.py")
        runs.append(run)
    print("\n".join(table(runs, names, args.threshold)))


if __name__ == "__main__":
    sys.exit(main())
