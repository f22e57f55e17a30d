"""The NHWC row-ring kernel (_depthwise_nhwc_ring) against the kernel the ops
launch without it (direct, register-window or tiled, whichever the rule
picks) and PyTorch channels_last (cudnn.benchmark on; forward conv2d(groups=C),
backward-input aten.convolution_backward), filters of any size the kernel
takes (padding K // 2; other sizes and strides time as nan; a TW outside
the shipped ones compiles on first use), for each setting in --settings (TW
output columns x threads aimed at x output rows prefetched; "pieces" after a
setting: the block's cp.async copies instead of bulk copies; default: the
plan's own, "plan").  GPU time per launch (CUDA
events around 20 launches over 3 rotating copies, after a warm-up pass), the
memory floor (source + destination bytes at the copy bandwidth measured at the start), and the ring
kernel's largest difference from the other kernel relative to the largest
output, plus its unwritten (NaN) outputs.  The figures behind
_depthwise_nhwc_ring.preferred(), SETTINGS and columns() come from it (the
5x5 and 7x7 sweeps of 2026-12-04 ran a working tree that compiled the kernel
for them at every stride).

    PYTHONPATH=. python benchmarks/depthwise_nhwc_ring.py [--dtypes float16 ...]
        [--shapes 64x144x56x3x1 ...] [--settings 4x256x2 2x256x2 4x256x2pieces] [--no-torch]
        [--max-shared BYTES]
"""
import argparse
import re

import cupy
import harness
import numpy

from cupy_dwgn import _depthwise_nhwc_ring as ring
from cupy_dwgn import _launch, _validate
from cupy_dwgn._dtypes import bfloat16

# (N, C, H = W, filter size, stride); padding K // 2.  The depthwise table's
# NHWC 3x3 cells and MobileNet/EfficientNet layers.
SHAPES = [(64, 144, 56, 3, 1), (64, 96, 112, 3, 2), (64, 384, 28, 3, 1), (64, 960, 7, 3, 1), (64, 192, 56, 3, 1),
          (64, 32, 112, 3, 1), (64, 576, 14, 3, 1), (64, 144, 56, 3, 2), (8, 256, 64, 3, 1)]
DTYPES = {"float16": numpy.dtype(numpy.float16), "bfloat16": bfloat16, "float32": numpy.dtype(numpy.float32)}


def _setting(text):
    match = re.fullmatch(r"(\d+)x(\d+)x(\d+)(pieces)?", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected TWxTHREADSxAHEAD[pieces] (4x256x2), got {text!r}")
    return tuple(int(v) for v in match.groups()[:3]), match.group(4) is None


def _torch_us(torch, g, dt, backward, stride):
    """PyTorch channels_last on the same shape (padding K // 2), or None without torch."""
    n, c, hw, k = g.batch, g.channels, g.height, g.filter_height
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dt.name]
    x = torch.randn(n, c, hw, hw, device="cuda", dtype=tdt).to(memory_format=torch.channels_last)
    w = torch.randn(c, 1, k, k, device="cuda", dtype=tdt)
    b = torch.randn(c, device="cuda", dtype=tdt)
    if not backward:
        return harness.time_us(lambda: torch.nn.functional.conv2d(x, w, b, stride, k // 2, 1, c))
    dy = torch.randn(n, c, g.out_height, g.out_width, device="cuda", dtype=tdt).to(memory_format=torch.channels_last)
    mask = [True, False, False]
    return harness.time_us(lambda: torch.ops.aten.convolution_backward(
        dy, x, w, None, [stride] * 2, [k // 2] * 2, [1, 1], False, [0, 0], c, mask))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["float16", "bfloat16", "float32"])
    parser.add_argument("--shapes", nargs="+", type=harness.conv_shape, default=SHAPES)
    parser.add_argument("--settings", nargs="+", type=_setting, default=None)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--max-shared", type=int, default=ring.MAX_SHARED,
                        help="shared memory a block may take, bytes (the ring shortens to fit)")
    args = parser.parse_args()
    copy_bytes_per_us = harness.announced_copy_bandwidth()
    ring.MAX_SHARED = args.max_shared
    ring.plan.cache_clear()
    torch = None
    if not args.no_torch:
        try:
            import torch

            torch.backends.cudnn.benchmark = True
        except ImportError:
            torch = None
    for n, c, hw, k, stride in args.shapes:
        g = _validate.conv_geometry((n, hw, hw, c), (c, 1, k, k), stride, k // 2, 1, layout="NHWC")
        for name in args.dtypes:
            dt = DTYPES[name]
            for backward in (False, True) if stride == 1 else (False,):
                arrays, other, other_us, ref = harness.nhwc_kernel_baseline(ring, g, dt, backward)
                times = {other: other_us}
                if torch is not None:
                    times["torch_cl"] = _torch_us(torch, g, dt, backward, stride)
                diff, nans, rings = 0.0, 0, set()
                src, dst = arrays[0][0], arrays[0][3]
                index = _launch.index_type(src.size, dst.size)
                for setting, bulk in args.settings or [(None, True)]:  # None: the plan's own
                    for a in arrays:
                        a[3].fill(numpy.nan)
                    # Under the device's opt-in limit where K rows pass MAX_SHARED, as the ops plan it.
                    launch = ring.plan_on_device(g, dt, backward, index, 16, 16, setting, bulk)
                    label = ("x".join(map(str, setting)) if setting else "plan") + ("" if bulk else "p")
                    if launch is None:
                        times[label] = float("nan")
                        continue
                    rings.add(int(launch.scalars[9]))
                    times[label] = harness.steps_time_us(_launch.Steps(((launch, (0, 1, 2, 3)),)), arrays)
                    got = dst.astype(numpy.float32)
                    diff = max(diff, float(cupy.max(cupy.abs(got - ref)) / (cupy.max(cupy.abs(ref)) + 1e-30)))
                    nans += int(cupy.isnan(got).sum())
                floor = (src.nbytes + dst.nbytes) / copy_bytes_per_us
                print(f"{n}x{c}x{hw} {k}x{k} s{stride} {dt.name:8} {'bwd' if backward else 'fwd'} floor {floor:6.1f} "
                      + " ".join(f"{label} {v:6.1f}" for label, v in times.items())
                      + f"  rings {sorted(rings)} reldiff {diff:.1e} unwritten {nans}", flush=True)
                del arrays, src, dst


if __name__ == "__main__":
    main()
