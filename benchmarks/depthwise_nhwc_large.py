"""Channels-last large filters two ways, side by side: the NHWC kernels
(_depthwise_nhwc) against the NCHW large-filter kernels between two
transposes (_depthwise_nhwc_large, which the ops take wherever it serves),
forward, backward-input and backward-weight, GPU time per call (CUDA events
around 20 calls over 3 rotating copies after a warm-up pass; the Steps are
built once), and the largest difference between the two relative to the
largest output.  N x C x H=W and the filter: large-kernel nets (RepLKNet,
SLaK, ConvNeXt variants) and the depthwise table's 31x31 cell.

    PYTHONPATH=. python benchmarks/depthwise_nhwc_large.py [--quick]

--quick: float16 only.
"""
import sys

import cupy
import harness
import numpy

from cupy_dwgn import _depthwise_nhwc_large as large
from cupy_dwgn import _launch, _validate, depthwise

# (N, C, H = W, filter size), "same" padding.
SHAPES = [(16, 512, 16, 31), (32, 256, 32, 31), (64, 128, 56, 13), (64, 256, 28, 13), (64, 384, 14, 9),
          (64, 96, 56, 9), (16, 1024, 8, 13)]
DTYPES = [numpy.float16, numpy.float32]
DIRECTIONS = ("forward", "backward_input", "backward_weight")


def _nhwc_steps(g, direction, a, b):
    """The Steps of the NHWC kernels (this path switched off)."""
    large.ENABLED = False
    try:
        if direction == "forward":
            return depthwise._forward_steps(g, "NHWC", a, b)
        if direction == "backward_input":
            return depthwise._backward_input_steps(g, "NHWC", a, b)
        return depthwise._backward_weight_steps(g, "NHWC", a, b)
    finally:
        large.ENABLED = True


def _transposed_steps(g, dtype, direction):
    """The Steps of this path whatever its rule says."""
    if direction == "backward_weight":
        return _launch.Steps(*large.backward_weight_steps(g, dtype, min_taps=0))
    return _launch.Steps(*large.forward_steps(g, dtype, direction == "backward_input"))


def main(quick=False):
    for n, c, hw, k in SHAPES:
        g = _validate.conv_geometry((n, hw, hw, c), (c, 1, k, k), 1, k // 2, 1, layout="NHWC")
        shape = (n, hw, hw, c)
        for dtype in [numpy.float16] if quick else DTYPES:
            dt = numpy.dtype(dtype)
            w = cupy.random.standard_normal((c, 1, k, k), dtype=cupy.float32).astype(dt)
            xs = [cupy.random.standard_normal(shape, dtype=cupy.float32).astype(dt) for _ in range(3)]
            ys = [cupy.random.standard_normal(shape, dtype=cupy.float32).astype(dt) for _ in range(3)]
            for direction in DIRECTIONS:
                if direction == "backward_weight":
                    outs = [cupy.empty(w.shape, dt) for _ in range(3)]
                    arrays = [(y, x, 0, o) for y, x, o in zip(ys, xs, outs)]
                    first, second = ys[0], xs[0]
                else:
                    outs = [cupy.empty(shape, dt) for _ in range(3)]
                    arrays = [(x, w, 0, o) for x, o in zip(xs, outs)]
                    first, second = xs[0], outs[0]
                times, results = {}, {}
                for name, steps in (("nhwc", _nhwc_steps(g, direction, first, second)),
                                    ("transposed", _transposed_steps(g, dt, direction))):
                    times[name] = harness.steps_time_us(steps, arrays)
                    results[name] = outs[0].astype(numpy.float32)
                ref = results["nhwc"]
                diff = float(cupy.max(cupy.abs(results["transposed"] - ref)) / (cupy.max(cupy.abs(ref)) + 1e-30))
                print(f"{n}x{c}x{hw} {k}x{k} {dt.name:8} {direction:15} nhwc {times['nhwc']:8.1f} "
                      f"transposed {times['transposed']:8.1f}  x{times['nhwc'] / times['transposed']:.2f}  "
                      f"reldiff {diff:.1e}", flush=True)
            del xs, ys, outs


if __name__ == "__main__":
    main(quick="--quick" in sys.argv[1:])
