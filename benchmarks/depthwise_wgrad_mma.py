"""Weight gradient on the tensor cores (_depthwise_wgrad_mma, MODE "always")
against what the ops take without it (MODE "never": the NCHW plane /
register / staged kernels or the NHWC register-tap / tiled kernels), NCHW
and NHWC, each with its finalize; GPU time per call (harness.steps_time_us:
CUDA events around 20 calls over 3 rotating input copies after a warm-up
pass), the fraction of the memory floor (x + grad_out read once at the copy
bandwidth measured in this run), the largest difference between the two
relative to the largest output, and with --torch PyTorch's weight gradient
(aten.convolution_backward, weight only, cudnn.benchmark on) in the faster
of its two memory formats, on the same data.  The rule of
_depthwise_wgrad_mma.preferred comes from it.

    PYTHONPATH=.:benchmarks python3 benchmarks/depthwise_wgrad_mma.py [--shapes 64x384x14x7x1 ...]
        [--dtypes float16 ...] [--layouts NCHW ...] [--torch] [--target-blocks 264 528 ...] [--stages 2 3 ...]

Prints one line per (shape, dtype, layout).
"""
import argparse

import cupy
import harness
import numpy
from depthwise_nchw_wgrad import _view
from depthwise_nhwc_wgrad import torch_us

from cupy_dwgn import _depthwise_wgrad_mma as mma
from cupy_dwgn import _validate, depthwise
from cupy_dwgn._dtypes import bfloat16

# (N, C, H = W, filter size, stride 1); padding K // 2: the depthwise
# table's stride-1 cases that fit, EfficientNet/MobileNet/ConvNeXt stages.
SHAPES = [
    (64, 384, 14, 7, 1), (64, 240, 28, 5, 1), (64, 384, 28, 3, 1), (64, 960, 7, 3, 1), (64, 576, 14, 3, 1),
    (64, 672, 14, 5, 1), (64, 1152, 7, 5, 1), (64, 144, 28, 3, 1), (64, 768, 14, 7, 1), (64, 192, 28, 7, 1),
    (32, 96, 56, 3, 1), (64, 288, 19, 5, 1),
]
DTYPES = [numpy.float16, bfloat16]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=harness.conv_shape, nargs="+", default=SHAPES)
    parser.add_argument("--dtypes", nargs="+", choices=["float16", "bfloat16"])
    parser.add_argument("--layouts", nargs="+", choices=["NCHW", "NHWC"], default=["NCHW", "NHWC"])
    parser.add_argument("--torch", action="store_true")
    parser.add_argument("--target-blocks", type=int, nargs="+", metavar="BLOCKS",
                        help="also time the kernel with each TARGET_BLOCKS (the split's constant)")
    parser.add_argument("--stages", type=int, nargs="+", help="also time the kernel with each number of raw buffers")
    args, dtypes, bandwidth = harness.parse_comparison(parser, DTYPES)
    for n, c, hw, k, stride in args.shapes:
        for dt in dtypes:
            torch_best = None
            for layout in args.layouts:
                x_shape = (n, c, hw, hw) if layout == "NCHW" else (n, hw, hw, c)
                g = _validate.conv_geometry(x_shape, (c, 1, k, k), stride, k // 2, 1, layout=layout)
                dy_shape = _validate.layout_shape(layout, n, c, g.out_height, g.out_width)
                if mma.plan(g, dt, layout, "int", 16, 16) is None:
                    print(f"{n}x{c}x{hw} {k}x{k} s{stride} {dt.name:8} {layout}: not served", flush=True)
                    continue
                times, results, kernels, (dys, xs, arrays) = harness.compare_wgrad_modes(
                    mma, (("mma", "always"), ("other", "never")), g, layout, x_shape, dy_shape, dt)
                floor_us = (xs[0].nbytes + dys[0].nbytes) / bandwidth
                variants = [(f"@{b}", dict(target_blocks=b)) for b in args.target_blocks or ()]
                variants += [(f"@{s}stages", dict(stages=s)) for s in args.stages or ()]
                for label, override in variants:
                    launches = mma.plan(g, dt, layout, "int", 16, 16, **override)
                    if launches is None:
                        continue
                    steps = depthwise._launch.Steps(
                        ((launches[0][0], (0, 1, 4)), (launches[0][1], (4, 3))), (launches[1],))
                    times[f"mma{label}"] = harness.steps_time_us(steps, arrays)
                line = harness.wgrad_comparison_line(f"{n}x{c}x{hw} {k}x{k} s{stride} {dt.name:8} {layout}", "mma",
                                                     "other", times, results, floor_us)
                if args.torch:
                    if torch_best is None:  # PyTorch on NCHW data, both memory formats, once per (shape, dtype)
                        nchw = [xa if layout == "NCHW" else cupy.ascontiguousarray(xa.transpose(0, 3, 1, 2))
                                for xa in (*dys, *xs)]
                        torch_best = min(torch_us(nchw[:3], nchw[3:], k, stride, c, _view(fmt == "channels_last"))
                                         for fmt in ("NCHW", "channels_last"))
                    line += f"  torch best {torch_best:7.1f} (x{torch_best / times['mma']:.2f})"
                line += "".join(f"  @{key.split('@')[1]} {t:6.1f}" for key, t in times.items() if "@" in key)
                print(line, f"[{kernels['other'].split('<')[0]}]", flush=True)
                del xs, dys, arrays


if __name__ == "__main__":
    main()
