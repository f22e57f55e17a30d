"""NCHW weight gradient two ways, side by side: the register kernel
(_depthwise_nchw_wgrad_regs, MODE "always") against the current NCHW path
(_depthwise_nchw_wgrad's staged kernel, MODE "never"), each with its
finalize; GPU time per call (harness.steps_time_us: CUDA events around 20
calls over 3 rotating input copies after a warm-up pass; the Steps, with
their partial-sum workspace, are built once), the fraction of the memory
floor (x + grad_out read once at the copy bandwidth measured in this run),
the largest difference between the two relative to the largest output, and
with --torch PyTorch's NCHW and channels_last weight gradients
(aten.convolution_backward, weight only) on the same data.  The cases and the
loop: depthwise_nhwc_wgrad.compare.

    PYTHONPATH=.:benchmarks python3 benchmarks/depthwise_nchw_wgrad.py [--quick] [--torch]

--quick: float16 only.  Prints one line per (case, dtype).
"""
import sys

import harness
from depthwise_nhwc_wgrad import compare  # the shared comparison loop and the cases (SHAPES, DTYPES)

from cupy_dwgn import _depthwise_nchw_wgrad_regs as wgrad


def _torch_us(dys, xs, k, stride, c, channels_last):
    import torch

    def view(a):  # NCHW cupy array -> torch tensor (a channels_last copy when asked)
        t = torch.from_dlpack(a)
        return t.contiguous(memory_format=torch.channels_last) if channels_last else t

    w = torch.zeros((c, 1, k, k), dtype=view(xs[0]).dtype, device="cuda")
    mask = [False, True, False]
    pairs = [(view(dy), view(x)) for dy, x in zip(dys, xs)]
    calls = [
        (lambda dy=dy, x=x: torch.ops.aten.convolution_backward(
            dy, x, w, None, [stride, stride], [k // 2, k // 2], [1, 1], False, [0, 0], c, mask))
        for dy, x in pairs
    ]
    return harness.time_us(harness.rotating(calls))


def main(quick=False, with_torch=False):
    def torch_columns(dys, xs, k, stride, c):
        return {fmt: _torch_us(dys, xs, k, stride, c, fmt == "channels_last") for fmt in ("NCHW", "channels_last")}

    compare(wgrad, "NCHW", "staged", torch_columns, quick, with_torch)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv[1:], with_torch="--torch" in sys.argv[1:])
