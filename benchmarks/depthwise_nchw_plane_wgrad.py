"""NCHW weight gradient: the whole-plane kernel (_depthwise_nchw_plane_wgrad,
MODE "always") against what the ops take without it (MODE "never": the
register kernel, the NHWC detour or the staged kernel), each with its
finalize; GPU time per call (harness.steps_time_us: CUDA events around 20
calls over 3 rotating input copies after a warm-up pass; the Steps, with
their workspace, are built once), the fraction of the memory floor (x +
grad_out read once at the copy bandwidth measured in this run), the largest
difference between the two relative to the largest output, and with
--torch PyTorch's NCHW and channels_last weight gradients
(aten.convolution_backward, weight only, cudnn.benchmark on) on the same
data.  The rule of _depthwise_nchw_plane_wgrad.preferred comes from it.

    PYTHONPATH=.:benchmarks python3 benchmarks/depthwise_nchw_plane_wgrad.py [--shapes 64x192x75x3x1 ...]
        [--dtypes float16 ...] [--torch] [--target-blocks 264 528 ...] [--min-units 1 2 ...]

Prints one line per (shape, dtype).
"""
import argparse

import harness
import numpy
from depthwise_nchw_wgrad import _view
from depthwise_nhwc_wgrad import torch_us

from cupy_dwgn import _depthwise_nchw_plane_wgrad as plane_wgrad
from cupy_dwgn import _validate, depthwise
from cupy_dwgn._dtypes import bfloat16

# (N, C, H = W, filter size, stride); padding K // 2: EfficientNet-B3's
# stages (odd widths, bands at 75 and 150), the depthwise table's cases,
# and widths between.
SHAPES = [
    (64, 40, 150, 3, 1), (64, 144, 150, 3, 2), (64, 192, 75, 3, 1), (64, 192, 75, 5, 2), (64, 288, 38, 5, 1),
    (64, 288, 38, 3, 2), (64, 576, 19, 3, 1), (64, 576, 19, 5, 1), (64, 816, 19, 5, 2), (64, 1392, 10, 3, 1),
    (64, 1392, 10, 5, 1), (64, 144, 56, 3, 1), (64, 96, 112, 3, 2), (64, 384, 28, 3, 1), (64, 960, 7, 3, 1),
    (64, 240, 28, 5, 1), (64, 96, 56, 7, 1), (64, 384, 14, 7, 1), (64, 96, 65, 3, 1), (64, 384, 15, 7, 1),
]
DTYPES = [numpy.float16, bfloat16, numpy.float32]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=harness.conv_shape, nargs="+", default=SHAPES)
    parser.add_argument("--dtypes", nargs="+", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--torch", action="store_true")
    parser.add_argument("--target-blocks", type=int, nargs="+", metavar="BLOCKS",
                        help="also time the plane kernel with each TARGET_BLOCKS (the split's constant)")
    parser.add_argument("--min-units", type=int, nargs="+", metavar="UNITS",
                        help="also time the plane kernel with each MIN_UNITS_PER_SPLIT (with each --target-blocks, "
                             "or the shipped TARGET_BLOCKS)")
    args, dtypes, bandwidth = harness.parse_comparison(parser, DTYPES)
    for n, c, hw, k, stride in args.shapes:
        x_shape = (n, c, hw, hw)
        g = _validate.conv_geometry(x_shape, (c, 1, k, k), stride, k // 2, 1)
        dy_shape = (n, c, g.out_height, g.out_width)
        for dt in dtypes:
            times, results, kernels, (dys, xs, arrays) = harness.compare_wgrad_modes(
                plane_wgrad, (("plane", "always"), ("other", "never")), g, "NCHW", x_shape, dy_shape, dt)
            floor_us = (xs[0].nbytes + dys[0].nbytes) / bandwidth
            variants = [(blocks, units) for blocks in args.target_blocks or [plane_wgrad.TARGET_BLOCKS]
                        for units in args.min_units or [plane_wgrad.MIN_UNITS_PER_SPLIT]
                        if args.target_blocks or args.min_units]
            for blocks, units in variants:
                saved = plane_wgrad.TARGET_BLOCKS, plane_wgrad.MIN_UNITS_PER_SPLIT
                plane_wgrad.TARGET_BLOCKS, plane_wgrad.MIN_UNITS_PER_SPLIT = blocks, units
                plane_wgrad.plan.cache_clear()
                try:
                    steps = harness.steps_with_mode(plane_wgrad, "always", depthwise._backward_weight_steps, g,
                                                    "NCHW", dys[0], xs[0],
                                                    off=harness.wgrad_kernels_before(plane_wgrad))
                    times[f"plane@{blocks}/{units}"] = harness.steps_time_us(steps, arrays)
                finally:
                    plane_wgrad.TARGET_BLOCKS, plane_wgrad.MIN_UNITS_PER_SPLIT = saved
                    plane_wgrad.plan.cache_clear()
            line = harness.wgrad_comparison_line(f"{n}x{c}x{hw} {k}x{k} s{stride} {dt.name:8}", "plane", "other",
                                                 times, results, floor_us)
            if args.torch:
                line += "".join(f"  torch {fmt} {torch_us(dys, xs, k, stride, c, _view(fmt == 'channels_last')):7.1f}"
                                for fmt in ("NCHW", "channels_last"))
            line += "".join(f"  @{key.split('@')[1]} {t:6.1f}" for key, t in times.items() if "@" in key)
            print(line, f"[{kernels['other'].split('<')[0]}]", flush=True)
            del xs, dys, arrays


if __name__ == "__main__":
    main()
