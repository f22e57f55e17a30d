"""Channels-last weight gradient two ways, side by side: the register-tap
kernel (_depthwise_nhwc_wgrad, MODE "always") against the tiled kernel of
_depthwise_nhwc (MODE "never"), each with its finalize; GPU time per call
(harness.steps_time_us: CUDA events around 20 calls over 3 rotating input
copies after a warm-up pass; the Steps, with their partial-sum workspace,
are built once), the fraction of the memory floor (x + grad_out read once at
the copy bandwidth measured in this run), the largest difference between the
two relative to the largest output, and with --torch PyTorch's
channels_last weight gradient (aten.convolution_backward, weight only) on
the same data.  The cases: the depthwise table's NHWC weight-gradient cells.

    PYTHONPATH=. python benchmarks/depthwise_nhwc_wgrad.py [--quick] [--torch]

--quick: float16 only.  Prints one line per (case, dtype).
"""
import sys

import harness
import numpy

from cupy_dwgn import _depthwise_nhwc_wgrad as wgrad
from cupy_dwgn import _dtypes, _validate

# (N, C, H = W, filter size, stride); padding K // 2.
SHAPES = [(64, 144, 56, 3, 1), (64, 384, 28, 3, 1), (64, 96, 112, 3, 2), (64, 240, 28, 5, 1), (64, 96, 56, 7, 1),
          (64, 384, 14, 7, 1), (64, 960, 7, 3, 1)]
DTYPES = [numpy.dtype(numpy.float32), numpy.dtype(numpy.float16), _dtypes.bfloat16]


def torch_us(dys, xs, k, stride, c, view):
    """GPU time of PyTorch's weight gradient (aten.convolution_backward,
    weight only) on ``view(a)`` of each rotating copy (a cupy array -> an
    NCHW-shaped torch tensor in the memory format to time)."""
    import torch

    w = torch.zeros((c, 1, k, k), dtype=view(xs[0]).dtype, device="cuda")
    mask = [False, True, False]
    pairs = [(view(dy), view(x)) for dy, x in zip(dys, xs)]
    calls = [
        (lambda dy=dy, x=x: torch.ops.aten.convolution_backward(
            dy, x, w, None, [stride, stride], [k // 2, k // 2], [1, 1], False, [0, 0], c, mask))
        for dy, x in pairs
    ]
    return harness.time_us(harness.rotating(calls))


def _channels_last_view(a):  # NHWC cupy array -> NCHW-shaped channels_last torch tensor, no copy
    import torch

    return torch.from_dlpack(a).permute(0, 3, 1, 2)


def compare(module, layout, other, torch_columns, quick=False, with_torch=False):
    """Print one line per (case, dtype): ``module``'s register kernel (MODE
    "always") against the layout's other weight-gradient kernel (MODE
    "never", called ``other``), and with ``with_torch`` the columns
    ``torch_columns(dys, xs, k, stride, c)`` returns (name -> us)."""
    bandwidth = harness.announced_copy_bandwidth()
    for n, c, hw, k, stride in SHAPES:
        x_shape = (n, hw, hw, c) if layout == "NHWC" else (n, c, hw, hw)
        g = _validate.conv_geometry(x_shape, (c, 1, k, k), stride, k // 2, 1, layout=layout)
        dy_shape = (n, g.out_height, g.out_width, c) if layout == "NHWC" else (n, c, g.out_height, g.out_width)
        for dt in [numpy.dtype(numpy.float16)] if quick else DTYPES:
            times, results, kernels, (dys, xs, arrays) = harness.compare_wgrad_modes(
                module, (("regs", "always"), (other, "never")), g, layout, x_shape, dy_shape, dt)
            floor_us = (xs[0].nbytes + dys[0].nbytes) / bandwidth
            line = harness.wgrad_comparison_line(f"{n}x{c}x{hw} {k}x{k} s{stride} {dt.name:8}", "regs", other,
                                                 times, results, floor_us)
            if with_torch:
                line += "".join(f"  torch {name} {us:7.1f} us" for name, us in torch_columns(dys, xs, k, stride, c).items())
            print(line, f"[{kernels['regs']}]", flush=True)
            del xs, dys, arrays


def main(quick=False, with_torch=False):
    compare(wgrad, "NHWC", "tiled", lambda *a: {"channels_last": torch_us(*a, _channels_last_view)}, quick, with_torch)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv[1:], with_torch="--torch" in sys.argv[1:])
