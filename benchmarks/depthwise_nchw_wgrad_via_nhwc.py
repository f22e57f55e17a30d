"""NCHW weight gradient two ways, for the shapes where the NCHW kernels are
slowest (odd widths: the register kernel falls to 1-column vectors): the
NCHW kernels (_depthwise_nchw_via_nhwc.MODE "never") against the path that
transposes grad_out and x into NHWC workspace around the NHWC register-tap
kernel (MODE "always"), both through the public op; also the NHWC kernel
alone on NHWC copies made beforehand.  GPU time per call (harness.time_us),
the largest difference between the two results relative to the largest
value, and the bytes of x + grad_out over each time (TB/s).  The rule of
_depthwise_nchw_via_nhwc comes from it.

    PYTHONPATH=.:benchmarks python3 benchmarks/depthwise_nchw_wgrad_via_nhwc.py [--quick]

--quick: float16 only.
"""
import sys

import cupy
import numpy
from harness import time_us

import cupy_dwgn as dw
from cupy_dwgn import _depthwise_nchw_via_nhwc as route, _dtypes, depthwise

# (N, C, H = W, filter, stride): EfficientNet-B3's odd widths at 300x300 and others.
SHAPES = [(64, 576, 19, 3, 1), (64, 576, 19, 5, 1), (64, 816, 19, 5, 1), (64, 192, 75, 3, 1), (64, 288, 38, 3, 2),
          (64, 816, 19, 5, 2), (64, 144, 150, 3, 2), (64, 96, 65, 3, 1), (64, 384, 15, 7, 1), (64, 1392, 9, 3, 1)]


def main(quick=False):
    dtypes = ["float16"] if quick else ["float16", "bfloat16", "float32"]
    print(f"{'case':22s} {'dtype':8s} {'NCHW kernels':>12s} {'via NHWC':>9s} {'NHWC kernel':>11s}  TB/s nchw/via  rel diff")
    for n, c, h, k, s in SHAPES:
        for name in dtypes:
            dtype = _dtypes.bfloat16 if name == "bfloat16" else numpy.dtype(name)
            x = cupy.random.standard_normal((n, c, h, h), dtype=cupy.float32).astype(dtype)
            oh = (h + 2 * (k // 2) - k) // s + 1
            g = cupy.random.standard_normal((n, c, oh, oh), dtype=cupy.float32).astype(dtype)
            conv = dict(stride=s, padding=k // 2)
            times, results = {}, {}
            for mode in ("never", "always"):
                route.MODE, depthwise._SIGNATURES = mode, {}
                fn = lambda: dw.depthwise_conv2d_backward_weight(g, x, (c, 1, k, k), **conv)
                results[mode] = fn().astype(cupy.float32)
                times[mode] = time_us(fn)
            route.MODE, depthwise._SIGNATURES = "rule", {}
            xt, gt = cupy.ascontiguousarray(x.transpose(0, 2, 3, 1)), cupy.ascontiguousarray(g.transpose(0, 2, 3, 1))
            nhwc = time_us(lambda: dw.depthwise_conv2d_backward_weight(gt, xt, (c, 1, k, k), layout="NHWC", **conv))
            diff = float(cupy.abs(results["never"] - results["always"]).max() / cupy.abs(results["never"]).max())
            nbytes = (x.size + g.size) * x.itemsize
            print(f"{n}x{c}x{h} {k}x{k} s{s}".ljust(22) + f" {name:8s} {times['never']:12.1f} {times['always']:9.1f} "
                  f"{nhwc:11.1f}  {nbytes / times['never'] / 1e6:4.2f}/{nbytes / times['always'] / 1e6:4.2f}  {diff:.1e}",
                  flush=True)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv[1:])
