"""NHWC stride-2 backward-input, side by side: the phase-decomposed kernel
(_depthwise_nhwc_phase, MODE "always") against the gather kernel
(_depthwise_nhwc.backward_input_plan, MODE "never"), and PyTorch channels_last
(torch.nn.grad.conv2d_input) when torch is importable.  GPU time per call
(CUDA events around 20 calls over 3 rotating copies after a warm-up pass; the
Steps are built once through cupy_dwgn.depthwise._backward_input_steps), the
memory floor (grad_in written once + grad_out read once at the copy bandwidth
measured here), the fraction of it reached, the largest difference between
the two kernels relative to the largest output, and the phase kernel's
unwritten (NaN) outputs.  Shapes: MobileNetV2's stride-2 3x3 (64x96x112),
EfficientNet's stride-2 5x5 (64x240x56), a ConvNeXt-width 7x7 at stride 2
(64x96x56), "same"-style padding K // 2.

    PYTHONPATH=. python benchmarks/depthwise_nhwc_phase.py [--quick] [--no-torch]

--quick: the 3x3 shape only.
"""
import sys

import cupy
import harness
import numpy

from cupy_dwgn import _depthwise_nhwc_phase as phase
from cupy_dwgn import _validate, depthwise
from cupy_dwgn._dtypes import bfloat16

# (N, C, H = W of grad_in, filter size); stride 2, padding K // 2.
SHAPES = [(64, 96, 112, 3), (64, 240, 56, 5), (64, 96, 56, 7), (64, 144, 56, 3), (64, 192, 28, 5)]
DTYPES = [numpy.float32, numpy.float16, bfloat16]


def _torch_us(torch, n, c, hw, k, dt, g):
    """PyTorch channels_last backward-input (cuDNN), GPU time per call."""
    tdt = {numpy.dtype(numpy.float32): torch.float32, numpy.dtype(numpy.float16): torch.float16,
           numpy.dtype(bfloat16): torch.bfloat16}[numpy.dtype(dt)]
    w = torch.randn(c, 1, k, k, device="cuda", dtype=tdt)
    dys = [torch.randn(n, c, g.out_height, g.out_width, device="cuda", dtype=tdt).to(
        memory_format=torch.channels_last) for _ in range(3)]
    calls = [lambda dy=dy: torch.nn.grad.conv2d_input((n, c, hw, hw), w, dy, stride=2, padding=k // 2, groups=c)
             for dy in dys]
    return harness.time_us(harness.rotating(calls))


def main(quick=False, use_torch=True):
    torch = None
    if use_torch:
        try:
            import torch
            torch.backends.cudnn.benchmark = True
        except ImportError:
            torch = None
    bytes_per_us = harness.announced_copy_bandwidth()
    for n, c, hw, k in SHAPES[:1] if quick else SHAPES:
        x_shape = (n, hw, hw, c)
        g = _validate.conv_geometry(x_shape, (c, 1, k, k), 2, k // 2, 1, layout="NHWC")
        dy_shape = (n, g.out_height, g.out_width, c)
        for dtype in DTYPES:
            dt = numpy.dtype(dtype)
            w = cupy.random.standard_normal((c, 1, k, k), dtype=cupy.float32).astype(dt)
            dys = [cupy.random.standard_normal(dy_shape, dtype=cupy.float32).astype(dt) for _ in range(3)]
            dxs = [cupy.full(x_shape, numpy.nan, cupy.float32).astype(dt) for _ in range(3)]
            arrays = [(dy, w, 0, dx) for dy, dx in zip(dys, dxs)]
            floor = (numpy.prod(x_shape) + numpy.prod(dy_shape)) * dt.itemsize / bytes_per_us
            times, results = {}, {}
            for name, mode in (("phase", "always"), ("gather", "never")):
                steps = harness.steps_with_mode(phase, mode, depthwise._backward_input_steps, g, "NHWC", dys[0], dxs[0])
                expression = steps.launches[0].expression
                assert (name == "phase") == expression.startswith(phase.KERNEL), expression
                for dx in dxs:
                    dx.fill(numpy.nan)
                times[name] = harness.steps_time_us(steps, arrays)
                results[name] = dxs[0].astype(numpy.float32)
            nan = int(cupy.isnan(results["phase"]).sum())
            ref = results["gather"]
            diff = float(cupy.max(cupy.abs(results["phase"] - ref)) / (cupy.max(cupy.abs(ref)) + 1e-30))
            line = (f"{n}x{c}x{hw} {k}x{k} s2 {dt.name:8} floor {floor:6.1f} us  "
                    f"phase {times['phase']:7.1f} us ({floor / times['phase']:4.0%})  "
                    f"gather {times['gather']:7.1f} us ({floor / times['gather']:4.0%})  "
                    f"x{times['gather'] / times['phase']:.2f}")
            if torch is not None:
                t = _torch_us(torch, n, c, hw, k, dt, g)
                line += f"  torch_cl {t:7.1f} us (phase x{t / times['phase']:.2f})"
            print(f"{line}  reldiff {diff:.1e} nan {nan}", flush=True)
            del dys, dxs, arrays, results


if __name__ == "__main__":
    main(quick="--quick" in sys.argv, use_torch="--no-torch" not in sys.argv)
