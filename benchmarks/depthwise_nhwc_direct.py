"""The NHWC direct kernel (_depthwise_nhwc_direct) against the kernel the ops
launch without it (the register-window or tiled kernel, whichever the rule
picks), forward at stride 1 and 2 and backward-input at stride 1, for each
TW (output columns per thread) in --columns; GPU time per launch (CUDA
events around 20 launches over 3 rotating copies, after a warm-up pass), the
memory floor (source + destination bytes at the copy bandwidth measured at the start), and the
direct kernel's largest difference from the other relative to the largest
output, plus its unwritten (NaN) outputs.  The figures behind
_depthwise_nhwc_direct.preferred() and COLUMNS come from it.

    PYTHONPATH=.:benchmarks python benchmarks/depthwise_nhwc_direct.py [--quick] [--columns 2 4 8]
        [--items-per-thread 1 2 4] [--shapes 64x576x14x3x2 ...] [--dtypes float32 ...]

--quick: float16 only.  --shapes (NxCxHxKxSTRIDE, padding K // 2) replaces SHAPES, --dtypes DTYPES.
--items-per-thread: each TW with a grid that gives a thread that many items (suffix xN; the
default, 0, is the rule's own choice, _depthwise_nhwc_direct.items_per_thread, with no suffix).
--blocks: each TW also with blocks of BX channel vectors x BY items (suffix bBXxBY; the default,
none, is _depthwise_nhwc._block's shape), e.g. 4x49 with --columns 1 --items-per-thread 1 on
64x576x14x3x2 float32: one image's 7x7 plane a block (cuDNN's grid there).
--all-rows: each variant also with every filter row's inputs loaded before the first is applied
(the kernel's ALL_ROWS; suffix r).
"""
import argparse

import cupy
import harness
import numpy

from cupy_dwgn import _depthwise_nhwc_direct as direct
from cupy_dwgn import _launch, _validate
from cupy_dwgn._dtypes import bfloat16

# (N, C, H = W, filter size, stride); padding K // 2.  The depthwise table's
# NHWC 3x3/5x5 cells and MobileNet/EfficientNet layers.
SHAPES = [(64, 144, 56, 3, 1), (64, 384, 28, 3, 1), (64, 96, 112, 3, 2), (64, 240, 28, 5, 1), (64, 960, 7, 3, 1),
          (64, 32, 112, 3, 1), (64, 192, 56, 3, 1), (64, 576, 14, 3, 1), (64, 144, 56, 3, 2), (64, 240, 56, 5, 2),
          (64, 672, 28, 5, 2), (64, 480, 14, 5, 1), (64, 1152, 7, 5, 1), (8, 256, 64, 3, 1)]
DTYPES = {"float16": numpy.float16, "bfloat16": bfloat16, "float32": numpy.float32}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--columns", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--shapes", type=harness.conv_shape, nargs="+", default=SHAPES, metavar="NxCxHxKxS")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--items-per-thread", type=int, nargs="+", default=[0])
    parser.add_argument("--blocks", type=_block_shape, nargs="+", default=[], metavar="BXxBY")
    parser.add_argument("--all-rows", action="store_true")
    args = parser.parse_args()
    copy_bytes_per_us = harness.announced_copy_bandwidth()
    variants = [(tw, per_thread, block, all_rows) for tw in args.columns for per_thread in args.items_per_thread
                for block in [None] + args.blocks for all_rows in ((False, True) if args.all_rows else (False,))]
    dtypes = [numpy.float16] if args.quick else [DTYPES[name] for name in args.dtypes]
    for n, c, hw, k, stride in args.shapes:
        g = _validate.conv_geometry((n, hw, hw, c), (c, 1, k, k), stride, k // 2, 1, layout="NHWC")
        for dtype in dtypes:
            dt = numpy.dtype(dtype)
            for backward in (False, True) if stride == 1 else (False,):
                arrays, other, other_us, ref = harness.nhwc_kernel_baseline(direct, g, dt, backward)
                times = {other: other_us}
                src, dst = arrays[0][0], arrays[0][3]
                diff, nans = 0.0, 0
                for tw, per_thread, block, all_rows in variants:
                    with direct.overridden((k, stride, dt.itemsize), tw, per_thread, block, all_rows):
                        launch = direct.plan(g, dt, backward, _launch.index_type(src.size, dst.size), 16, 16)
                    for a in arrays:
                        a[3].fill(numpy.nan)
                    name = (f"direct{tw}{f'x{per_thread}' if per_thread else ''}"
                            + (f"b{block[0]}x{block[1]}" if block else "") + ("r" if all_rows else ""))
                    times[name] = harness.steps_time_us(_launch.Steps(((launch, (0, 1, 2, 3)),)), arrays)
                    got = dst.astype(numpy.float32)
                    diff = max(diff, float(cupy.max(cupy.abs(got - ref)) / (cupy.max(cupy.abs(ref)) + 1e-30)))
                    nans += int(cupy.isnan(got).sum())
                floor = (src.nbytes + dst.nbytes) / copy_bytes_per_us
                best = min((v, name) for name, v in times.items() if name.startswith("direct"))
                print(f"{n}x{c}x{hw} {k}x{k} s{stride} {dt.name:8} {'bwd' if backward else 'fwd'} floor {floor:6.1f} "
                      + " ".join(f"{name} {v:6.1f}" for name, v in times.items())
                      + f"  best {best[1]} x{times[other] / best[0]:.2f}  reldiff {diff:.1e} unwritten {nans}",
                      flush=True)
                del arrays, src, dst


def _block_shape(text):
    """'BXxBY' -> (BX, BY), as argparse's type."""
    try:
        bx, by = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BXxBY (e.g. 4x49), got {text!r}") from None
    if bx < 1 or by < 1 or bx * by > 256:
        raise argparse.ArgumentTypeError(f"expected BX, BY >= 1 with BX * BY <= 256, got {text!r}")
    return bx, by


if __name__ == "__main__":
    main()
