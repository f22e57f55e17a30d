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

from depthwise_nhwc_wgrad import compare, torch_us  # the shared loop, the cases (SHAPES, DTYPES), PyTorch's timing

from cupy_dwgn import _depthwise_nchw_wgrad_regs as wgrad


def _view(channels_last):
    """NCHW cupy array -> torch tensor (a channels_last copy when asked)."""
    def view(a):
        import torch

        t = torch.from_dlpack(a)
        return t.contiguous(memory_format=torch.channels_last) if channels_last else t

    return view


def main(quick=False, with_torch=False):
    def torch_columns(dys, xs, k, stride, c):
        return {fmt: torch_us(dys, xs, k, stride, c, _view(fmt == "channels_last")) for fmt in ("NCHW", "channels_last")}

    compare(wgrad, "NCHW", "staged", torch_columns, quick, with_torch)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv[1:], with_torch="--torch" in sys.argv[1:])
