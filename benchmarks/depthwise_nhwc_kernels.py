"""The NHWC stride-1 kernels that serve one geometry, side by side: the
register-window kernel (_depthwise_nhwc_window, design P2 of the NHWC review;
taken by the ops where preferred() says so) against the kernels the ops launch
otherwise (_depthwise_nhwc: the shared-memory tiled kernel for 3x3/5x5/7x7),
forward and backward-input, GPU time per launch (CUDA events around 20
launches over 3 rotating copies, after a warm-up pass), the memory floor
(input + output bytes at the copy bandwidth measured at the start) and the window kernel's largest
difference from the current kernel relative to the largest output, plus its
unwritten (NaN) outputs.  Shapes: the NHWC review's cells (N = 64).

    PYTHONPATH=. python benchmarks/depthwise_nhwc_kernels.py [--quick]

--quick: float16 only.  --sweep: MobileNet/EfficientNet/ConvNeXt layers, forward,
float16 and float32 (the dispatch rule is read from it).
"""
import sys

import cupy
import harness
import numpy

from cupy_dwgn import _depthwise_nhwc as nhwc
from cupy_dwgn import _depthwise_nhwc_window as window
from cupy_dwgn import _launch, _validate
from cupy_dwgn._dtypes import bfloat16

# (N, C, H = W, filter size): the review's table.
SHAPES = [(64, 144, 56, 3), (64, 384, 28, 3), (64, 240, 28, 5), (64, 96, 56, 7), (64, 960, 7, 3)]
DTYPES = [numpy.float16, bfloat16, numpy.float32]
# Channel tiles per group of the window kernel (its unit order), side by side.
GROUPS = (1, 2, 4)


def time_launch(launch, arrays_list, reps=20):
    """Mean GPU time per launch (us); one Steps is built for all of them."""
    return harness.steps_time_us(_launch.Steps(((launch, (0, 1, 2, 3)),)), arrays_list, reps)


def candidates(g, dt, backward, index):
    """{name: Launch} of the kernels that serve this geometry."""
    current = (nhwc.backward_input_plan(g, dt, index, True)[0] if backward
               else nhwc.forward_plan(g, dt, index, True)[0])
    launches = {f"group{group}": window.plan(g, dt, backward, index, 16, 16, group) for group in GROUPS}
    return {**launches, "current": current}


# --sweep: the layers of MobileNetV2/V3, EfficientNet and ConvNeXt at N = 64
# (C, H = W) for every filter size, forward only (backward-input is the same
# kernel on a rotated filter): what the dispatch rule is read from.
SWEEP_PLANES = [(32, 112), (96, 112), (144, 56), (192, 56), (96, 56), (192, 28), (240, 28), (384, 28),
                (480, 14), (576, 14), (672, 14), (384, 14), (960, 7), (1152, 7), (768, 7)]


def main(quick=False, sweep=False):
    dtypes = [numpy.float16] if quick else DTYPES
    shapes = SHAPES
    if sweep:
        dtypes = [numpy.float16, numpy.float32]
        shapes = [(64, c, hw, k) for k in (3, 5, 7) for c, hw in SWEEP_PLANES]
    copy_bytes_per_us = harness.announced_copy_bandwidth()
    for n, c, hw, k in shapes:
        g = _validate.conv_geometry((n, hw, hw, c), (c, 1, k, k), 1, k // 2, 1, layout="NHWC")
        shape = (n, hw, hw, c)  # "same" padding: source and destination alike
        for dtype in dtypes:
            dt = numpy.dtype(dtype)
            for backward in (False,) if sweep else (False, True):
                copies = 3
                srcs = [cupy.random.standard_normal(shape, dtype=cupy.float32).astype(dt) for _ in range(copies)]
                w = cupy.random.standard_normal((c, 1, k, k), dtype=cupy.float32).astype(dt)
                b = None if backward else cupy.random.standard_normal((c,), dtype=cupy.float32).astype(dt)
                dsts = [cupy.full(shape, numpy.nan, dtype=dt) for _ in range(copies)]
                index = _launch.index_type(srcs[0].size, dsts[0].size)
                times, outs = {}, {}
                for name, launch in candidates(g, dt, backward, index).items():
                    if launch is None:
                        continue
                    arrays = [(s, w, 0 if b is None else b, d) for s, d in zip(srcs, dsts)]
                    for d in dsts:
                        d.fill(numpy.nan)
                    times[name] = time_launch(launch, arrays)
                    outs[name] = dsts[0].astype(numpy.float32).copy()
                diff = nans = float("nan")
                ref = outs["current"]
                for name in outs:
                    if name != "current":
                        d = float(cupy.max(cupy.abs(outs[name] - ref)) / (cupy.max(cupy.abs(ref)) + 1e-30))
                        diff = d if diff != diff else max(diff, d)
                        nans = (0 if nans != nans else nans) + int(cupy.isnan(outs[name]).sum())
                floor = 2 * srcs[0].nbytes / copy_bytes_per_us
                plan = window.plan(g, dt, backward, index, 16, 16)
                tile = (f"tile {int(plan.scalars[9])}x{int(plan.scalars[10])} threads, block {plan.block[0]}, "
                        f"{plan.shared_mem} B shared") if plan else "window: n/a"
                speedup = times["current"] / min((v for name, v in times.items() if name != "current"),
                                                 default=numpy.nan)
                print(f"{n}x{c}x{hw} {k}x{k} {dt.name:8} {'bwd' if backward else 'fwd'} floor {floor:6.1f} "
                      + " ".join(f"{name} {v:6.1f}" for name, v in times.items())
                      + f"  x{speedup:.2f}  reldiff {diff:.1e} unwritten {nans}  ({tile})", flush=True)
                del srcs, dsts


if __name__ == "__main__":
    main(quick="--quick" in sys.argv[1:], sweep="--sweep" in sys.argv[1:])
