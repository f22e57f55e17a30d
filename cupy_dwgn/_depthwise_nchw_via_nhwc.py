"""NCHW weight gradient by way of the NHWC register-tap kernel: grad_out and x
are transposed into NHWC workspace (kernels/layout_transpose.cu, the
transpose of _depthwise_nhwc_large) and _depthwise_nhwc_wgrad runs there,
then its shared split-order finalize writes the (C, 1, K, K) weight gradient,
which has no layout.  Deterministic like the kernel it wraps.

Why: the NCHW register weight gradient (_depthwise_nchw_wgrad_regs) reads
VW output columns per lane, VW the widest power of two dividing the widths
and the padding offset; at odd widths (EfficientNet's 19, 75, 150/2 ...) VW
is 1 and it reads 2- or 4-byte values, at 12-30% of the copy bandwidth.  The
NHWC kernel reads 32-byte channel tiles whatever the width; the two
transposes move 2 x (grad_out + x) bytes, at 1.6-2 TB/s for 2-byte types.

Rule (``preferred``; ``MODE`` overrides it for tests and benchmarks): 5x5
filters at stride 1 in half types where the NCHW register kernel would take
VW = 1.  Measured on an H200 (2026-12-02,
benchmarks/depthwise_nchw_wgrad_via_nhwc.py --quick, N = 64, float16, GPU
time per call, us, NCHW kernels / this path / the NHWC kernel alone):

* won: 64x576x19 5x5 172.4 / 122.5 / 58.9, 64x816x19 5x5 246.5 / 162.8 /
  76.0 (EfficientNet-B3's 19-wide stage);
* within 10% either way (not taken): 64x576x19 3x3 104.9 / 96.3 / 31.6,
  64x96x65 3x3 156.1 / 153.0 / 41.7, 64x192x75 3x3 347.4 / 368.6 / 90.2;
* lost: 64x288x38 3x3 s2 73.2 / 107.9, 64x816x19 5x5 s2 91.0 / 108.4,
  64x144x150 3x3 s2 351.9 / 749.7, 64x384x15 7x7 63.7 / 76.7, 64x1392x9 3x3
  46.4 / 59.8.

float32 (4-byte words transpose at a better fraction of the bandwidth) is
not measured yet and keeps the NCHW kernels.

Cost: workspace for the NHWC copies of grad_out and x, and the partial sums
(so tensors of 2**31 elements and more keep the NCHW kernels).
"""

import numpy

from . import _depthwise_nchw_wgrad_regs, _depthwise_nhwc_large, _depthwise_nhwc_wgrad

#: "rule": the ops take this path where ``preferred`` says so; "always":
#: wherever it serves the call (tests, benchmarks); "never": not at all.
MODE = "rule"


def specializations(dtypes=None, filter_sizes=None, large_index=(False, True)):
    """``(file, name expression)`` of every kernel this path launches: the
    transposes and the NHWC weight-gradient kernels (the finalize is
    _depthwise_nchw's, compiled with the NCHW weight gradient)."""
    dtypes = _depthwise_nhwc_wgrad.DTYPES if dtypes is None else [
        d for d in (numpy.dtype(d) for d in dtypes) if d in _depthwise_nhwc_wgrad.DTYPES]
    if not dtypes:
        return []
    transposes = [spec for spec in _depthwise_nhwc_large.specializations(dtypes, large_index)
                  if spec[0] == _depthwise_nhwc_large.KERNEL_FILE]
    return transposes + _depthwise_nhwc_wgrad.specializations(dtypes, filter_sizes, large_index)


def preferred(g, dtype, grad_out_alignment, x_alignment):
    """Whether the ops take this path (module docstring): 5x5 at stride 1 in
    half types, where the NCHW register kernel would read one column per
    lane."""
    dtype = numpy.dtype(dtype)
    if (
        dtype.itemsize != 2 or dtype not in _depthwise_nhwc_wgrad.DTYPES
        or (g.filter_height, g.filter_width) != (5, 5) or (g.stride_h, g.stride_w) != (1, 1)
    ):
        return False
    return _depthwise_nchw_wgrad_regs.vector_width(g, dtype, grad_out_alignment, x_alignment) == 1


def backward_weight_steps(g, dtype, index, grad_out_alignment, x_alignment):
    """``(launches with their argument positions, temporaries)`` for a Steps
    (call addresses: grad_out, x, NULL, grad_weight; temporaries: NHWC
    grad_out 4, NHWC x 5, partial sums 6), or None where the ops do not take
    this path (per ``MODE``), ``index`` is not "int" (tensors of 2**31
    elements and more) or the NHWC kernel does not serve ``g``."""
    if MODE == "never" or (MODE == "rule" and not preferred(g, dtype, grad_out_alignment, x_alignment)):
        return None
    if index != "int":
        # Tensors of 2**31 elements and more keep the NCHW kernels: the NHWC
        # copies would double the call's memory where it is largest (and
        # this composition is not tested with 64-bit offsets).
        return None
    # Workspace buffers are 256-byte aligned: the NHWC copies are too.
    planned = _depthwise_nhwc_wgrad.plan(g, dtype, index, 16, 16)
    if planned is None:
        return None
    (partial, finalize), partial_sums = planned
    dtype = numpy.dtype(dtype)
    out_channels = g.channels * g.multiplier  # multiplier 1: the NHWC kernel serves no other
    grad_out_nhwc = (g.batch, g.out_height, g.out_width, out_channels)
    x_nhwc = (g.batch, g.height, g.width, g.channels)
    transpose = _depthwise_nhwc_large.transpose
    launches = (
        # NCHW (N, C, H*W) -> NHWC (N, H*W, C): rows = C, cols = H*W.
        (transpose(g.batch, out_channels, g.out_height * g.out_width, dtype.itemsize), (0, 4)),
        (transpose(g.batch, g.channels, g.height * g.width, dtype.itemsize), (1, 5)),
        (partial, (4, 5, 6)),
        (finalize, (6, 3)),
    )
    return launches, ((grad_out_nhwc, dtype), (x_nhwc, dtype), partial_sums)
