"""Float64 NumPy references of every op: the oracle of the tests, and the CPU
path of :mod:`cupy_dwgn.host`.

Each function takes the GPU op's signature (less ``out=`` / ``stream=``) and
runs the GPU op's very argument checks (:mod:`cupy_dwgn._checks`, with NumPy
arrays as the array kind), so bad input raises the same exception with the
same message as ``cupy_dwgn.depthwise_conv2d`` & co. and ``cupy_dwgn.host``:

* arrays: C-contiguous ``numpy.ndarray`` of float16, float32, float64 or
  bfloat16 (``ml_dtypes.bfloat16``), related dtypes as the GPU op requires
  them (e.g. weight in x's dtype);
* the computation runs in float64 whatever the input dtype, and every array
  returned is float64 and C-contiguous (``cupy_dwgn.host`` casts to the
  GPU op's output dtypes).

Vectorized NumPy: a loop over the filter taps at most (never over pixels or
channels); an 8x64x56x56 3x3 depthwise forward or a 2x64x64x320 GroupNorm
forward takes a fraction of a second on one CPU core.  Importing this module
does not import CuPy.

Example:
    >>> import numpy
    >>> from cupy_dwgn import reference
    >>> x = numpy.random.randn(2, 8, 16, 16).astype(numpy.float32)     # NCHW
    >>> w = numpy.random.randn(8, 1, 3, 3).astype(numpy.float32)
    >>> reference.depthwise_conv2d(x, w, padding=1).dtype
    dtype('float64')
    >>> h = numpy.random.randn(2, 4, 4, 32).astype(numpy.float16)      # NHWC
    >>> y, mean, rstd = reference.group_norm(h, 8, activation="silu", return_stats=True)
    >>> y.shape, mean.shape
    ((2, 4, 4, 32), (2, 8))
"""

import math

import numpy

from . import _checks

_NDARRAY = numpy.ndarray


def _f64(a):
    """A float64 copy (or a C-contiguous float64 input itself, never written)."""
    return None if a is None else numpy.asarray(a, dtype=numpy.float64)


# ---------------------------------------------------------------------------
# Depthwise convolution.  The math runs on NCHW float64 copies, as
# (N, C, M, OH, OW) with output channel c*M + m reading input channel c; NHWC
# arguments are transposed in and the results back out.


def _to_nchw(a, layout):
    return a.transpose(0, 3, 1, 2) if layout == "NHWC" else a


def _from_nchw(a, layout):
    return numpy.ascontiguousarray(a.transpose(0, 2, 3, 1) if layout == "NHWC" else a)


def _padded_extent(g):
    """(rows, columns) of the zero-padded input: at least the padded input, and
    enough for every tap window (bottom/right padding may exceed what the
    outputs read, and a stride may leave the last rows unread)."""
    rows = max(
        g.pad_top + g.height + g.pad_bottom,
        g.stride_h * (g.out_height - 1) + g.dilation_h * (g.filter_height - 1) + 1,
    )
    columns = max(
        g.pad_left + g.width + g.pad_right,
        g.stride_w * (g.out_width - 1) + g.dilation_w * (g.filter_width - 1) + 1,
    )
    return rows, columns


#: The references keep the whole padded plane unless it holds more than this
#: many times the rows (columns) the taps read; then only those: a valid call
#: with padding and dilation of 60000 on an 8x8 input (an 8x8 output) would
#: otherwise ask for a 120008 x 120008 plane (107 GiB).
_FRAME_SLACK = 16


class _Axis:
    """One axis (rows or columns) of the padded frame the references compute
    in: its ``length`` (all of the padded extent, or the sorted coordinates
    the taps read), ``input_part`` (the frame positions holding the input and
    the input indices there; input index i is padded coordinate pad + i), and
    per filter tap the frame positions its outputs read (a slice, or an index
    array on a compressed frame)."""

    def __init__(self, extent, pad, size, out_size, filter_size, stride, dilation):
        reads = (dilation * numpy.arange(filter_size)[:, None] + stride * numpy.arange(out_size)[None, :])
        self.whole = extent <= _FRAME_SLACK * max(1, reads.size)
        self.size = size
        if self.whole:
            self.length = extent
            self.input_part = slice(pad, pad + size), slice(None)
            self.taps = [slice(dilation * k, dilation * k + stride * (out_size - 1) + 1, stride)
                         for k in range(filter_size)]
        else:
            kept = numpy.unique(reads)
            source = kept - pad
            inside = (source >= 0) & (source < size)
            self.length = len(kept)
            self.input_part = numpy.nonzero(inside)[0], source[inside]  # frame positions, input indices there
            self.taps = [numpy.searchsorted(kept, reads[k]) for k in range(filter_size)]


def _frame(g):
    """The (rows, columns) _Axis pair of ``g``'s padded frame."""
    rows, columns = _padded_extent(g)
    return (_Axis(rows, g.pad_top, g.height, g.out_height, g.filter_height, g.stride_h, g.dilation_h),
            _Axis(columns, g.pad_left, g.width, g.out_width, g.filter_width, g.stride_w, g.dilation_w))


def _grid(rows, cols):
    """``rows`` and ``cols`` (slices or index arrays) as one 2-D index."""
    if isinstance(rows, slice) or isinstance(cols, slice):
        return rows, cols
    return rows[:, None], cols[None, :]


def _pad(x, frame):
    """x (N, C, H, W) inside a zero (N, C, rows, columns) float64 frame."""
    row_axis, col_axis = frame
    out = numpy.zeros(x.shape[:2] + (row_axis.length, col_axis.length))
    (row_at, row_from), (col_at, col_from) = row_axis.input_part, col_axis.input_part
    rows, cols = _grid(row_at, col_at)
    out[:, :, rows, cols] = x[(slice(None), slice(None)) + _grid(row_from, col_from)]
    return out


def _unpad(framed, frame):
    """The input's part of an (N, C, rows, columns) frame, as (N, C, H, W)."""
    row_axis, col_axis = frame
    (row_at, row_from), (col_at, col_from) = row_axis.input_part, col_axis.input_part
    rows, cols = _grid(row_at, col_at)
    if row_axis.whole and col_axis.whole:
        return framed[:, :, rows, cols]
    out = numpy.zeros(framed.shape[:2] + (row_axis.size, col_axis.size))
    out[(slice(None), slice(None)) + _grid(row_from, col_from)] = framed[:, :, rows, cols]
    return out


def _taps(g, frame):
    """For every filter tap (kh, kw): (kh, kw, index), the index of the frame's
    last two axes that tap reads for the whole (OH, OW) output."""
    row_axis, col_axis = frame
    for kh in range(g.filter_height):
        for kw in range(g.filter_width):
            yield kh, kw, _grid(row_axis.taps[kh], col_axis.taps[kw])


def depthwise_conv2d(x, weight, bias=None, *, stride=1, padding=0, dilation=1, layout="NCHW"):
    """Depthwise 2-D convolution (cross-correlation) in float64; arguments and
    checks as :func:`cupy_dwgn.depthwise_conv2d`.

    Args:
        x: (N, C, H, W) for ``layout="NCHW"``, (N, H, W, C) for "NHWC".
        weight: (C*M, 1, KH, KW) in both layouts (M: depth multiplier), x's dtype.
        bias: optional (C*M,), x's dtype.
        stride, dilation: int or (h, w).  padding: int, (h, w),
            ((top, bottom), (left, right)), "same" or "valid".

    Returns:
        float64 (N, C*M, OH, OW) ("NHWC": (N, OH, OW, C*M)).

    Example:
        >>> y = reference.depthwise_conv2d(x, w, b, stride=2, padding=1)
    """
    g = _checks.check_depthwise_forward(x, weight, bias, stride, padding, dilation, layout, None, _NDARRAY)
    frame = _frame(g)
    xp = _pad(_to_nchw(_f64(x), layout), frame)[:, :, None]  # (N, C, 1, rows, columns)
    w = _f64(weight).reshape(g.channels, g.multiplier, g.filter_height, g.filter_width)
    y = numpy.zeros((g.batch, g.channels, g.multiplier, g.out_height, g.out_width))
    product = numpy.empty_like(y)
    for kh, kw, (rows, cols) in _taps(g, frame):
        numpy.multiply(xp[:, :, :, rows, cols], w[:, :, kh, kw, None, None], out=product)
        y += product
    y = y.reshape(g.batch, g.channels * g.multiplier, g.out_height, g.out_width)
    if bias is not None:
        y += _f64(bias)[:, None, None]
    return _from_nchw(y, layout)


def depthwise_conv2d_backward_input(grad_out, weight, input_shape, *, stride=1, padding=0, dilation=1, layout="NCHW"):
    """Gradient of :func:`depthwise_conv2d` with respect to x, in float64;
    arguments and checks as :func:`cupy_dwgn.depthwise_conv2d_backward_input`.

    Args:
        grad_out: (N, C*M, OH, OW) ("NHWC": (N, OH, OW, C*M)).
        weight: (C*M, 1, KH, KW), grad_out's dtype.
        input_shape: the forward x's shape, in ``layout``'s order.
        stride, padding, dilation, layout: as in the forward call.

    Returns:
        float64 array of shape ``input_shape``.

    Example:
        >>> dx = reference.depthwise_conv2d_backward_input(dy, w, x.shape, padding=1)
    """
    g = _checks.check_depthwise_backward_input(
        grad_out, weight, input_shape, stride, padding, dilation, layout, None, _NDARRAY
    )
    dy = _to_nchw(_f64(grad_out), layout).reshape(g.batch, g.channels, g.multiplier, g.out_height, g.out_width)
    w = _f64(weight).reshape(g.channels, g.multiplier, g.filter_height, g.filter_width)
    frame = _frame(g)
    dxp = numpy.zeros((g.batch, g.channels, frame[0].length, frame[1].length))
    # One tap's (row, column) positions are distinct, so += adds every product.
    if g.multiplier == 1:
        dy = dy[:, :, 0]
        product = numpy.empty_like(dy)
        for kh, kw, (rows, cols) in _taps(g, frame):
            numpy.multiply(dy, w[:, 0, kh, kw, None, None], out=product)
            dxp[:, :, rows, cols] += product
    else:
        for kh, kw, (rows, cols) in _taps(g, frame):
            dxp[:, :, rows, cols] += numpy.einsum("ncmhw,cm->nchw", dy, w[:, :, kh, kw])
    return _from_nchw(_unpad(dxp, frame), layout)


def depthwise_conv2d_backward_weight(grad_out, x, weight_shape, *, stride=1, padding=0, dilation=1, layout="NCHW"):
    """Gradient of :func:`depthwise_conv2d` with respect to weight, in float64;
    arguments and checks as :func:`cupy_dwgn.depthwise_conv2d_backward_weight`.

    Args:
        grad_out: (N, C*M, OH, OW) ("NHWC": (N, OH, OW, C*M)).
        x: the forward input, (N, C, H, W) ("NHWC": (N, H, W, C)), grad_out's dtype.
        weight_shape: (C*M, 1, KH, KW).
        stride, padding, dilation, layout: as in the forward call.

    Returns:
        float64 array of shape ``weight_shape``.  (The bias gradient is
        ``grad_out.sum(axis=(0, 2, 3))``, NHWC ``axis=(0, 1, 2)``.)

    Example:
        >>> dw = reference.depthwise_conv2d_backward_weight(dy, x, w.shape, padding=1)
    """
    g = _checks.check_depthwise_backward_weight(
        grad_out, x, weight_shape, stride, padding, dilation, layout, None, _NDARRAY
    )
    dy = _to_nchw(_f64(grad_out), layout).reshape(g.batch, g.channels, g.multiplier, g.out_height, g.out_width)
    frame = _frame(g)
    xp = _pad(_to_nchw(_f64(x), layout), frame)
    # (C, M, N*OH*OW) x (C, N*OH*OW) per tap: one batched matrix-vector product.
    dy = numpy.ascontiguousarray(dy.transpose(1, 2, 0, 3, 4)).reshape(g.channels, g.multiplier, -1)
    dw = numpy.zeros((g.channels, g.multiplier, g.filter_height, g.filter_width))
    for kh, kw, (rows, cols) in _taps(g, frame):
        window = numpy.ascontiguousarray(xp[:, :, rows, cols].transpose(1, 0, 2, 3)).reshape(g.channels, -1, 1)
        dw[:, :, kh, kw] = numpy.matmul(dy, window)[:, :, 0]
    return dw.reshape(tuple(int(s) for s in weight_shape))


# ---------------------------------------------------------------------------
# Channels-last GroupNorm (x: (N, *spatial, C)) with a fused activation.

_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
# Phi(z) = 0.5 + z * pdf(z) * sum_n z**(2n) / (2n+1)!! (every term > 0) for
# |z| <= _SERIES_LIMIT; beyond, the continued fraction of erfc.  The term
# counts give float64 accuracy (tests/test_group_norm_reference.py checks
# against math.erfc); the loops run over terms, each on whole arrays.
_SERIES_LIMIT = 2.75
_SERIES_COEFFICIENTS = [1.0]
for _n in range(1, 31):
    _SERIES_COEFFICIENTS.append(_SERIES_COEFFICIENTS[-1] / (2 * _n + 1))
_FRACTION_TERMS = 60


def _normal_pdf(z):
    """exp(-z**2 / 2) / sqrt(2 pi), with z**2 split so its rounding costs no digits."""
    z = numpy.clip(z, -64.0, 64.0)  # the pdf is 0 from |z| = 39 on; no overflow in z * 16
    s = numpy.round(z * 16.0) / 16.0  # s*s is exact
    return numpy.exp(-0.5 * s * s) * numpy.exp(-0.5 * (z - s) * (z + s)) * _INV_SQRT_2PI


def _normal_cdf(z, pdf):
    """Phi(z) = (1 + erf(z / sqrt(2))) / 2 to float64 accuracy, vectorized
    (NumPy has no erf; math.erf would be a Python call per element)."""
    cdf = numpy.empty_like(z)
    near = numpy.abs(z) <= _SERIES_LIMIT
    zn = z[near]
    u = zn * zn
    series = numpy.full_like(zn, _SERIES_COEFFICIENTS[-1])
    for c in _SERIES_COEFFICIENTS[-2::-1]:
        series *= u
        series += c
    cdf[near] = 0.5 + zn * pdf[near] * series
    far = ~near
    zf = z[far]
    # erfc(t) = exp(-t**2) / sqrt(pi) / (t + (1/2) / (t + 1 / (t + (3/2) / (t + ...)))), t = |z| / sqrt(2)
    t = numpy.abs(zf) * _SQRT_HALF
    fraction = t.copy()
    for k in range(_FRACTION_TERMS, 0, -1):
        fraction = t + (0.5 * k) / fraction
    tail = pdf[far] / (math.sqrt(2.0) * fraction)  # Phi(-|z|)
    cdf[far] = numpy.where(zf < 0, tail, 1.0 - tail)
    return cdf


def _gn_activation(z, activation, slope=True):
    """act(z), and act'(z) too (a pair) when ``slope``; float64."""
    if activation == "identity":
        return (z, numpy.ones_like(z)) if slope else z
    if activation == "relu":
        y = numpy.maximum(z, 0.0)
        return (y, (z > 0).astype(numpy.float64)) if slope else y
    if activation == "silu":
        s = 0.5 * (1.0 + numpy.tanh(0.5 * z))  # = 1 / (1 + exp(-z)), no overflow
        return (z * s, s * (1.0 + z * (1.0 - s))) if slope else z * s
    if activation == "gelu":
        pdf = _normal_pdf(z)
        cdf = _normal_cdf(z, pdf)
        return (z * cdf, cdf + z * pdf) if slope else z * cdf
    if activation == "gelu_tanh":
        k0, k1 = 0.7978845608028654, 0.044715
        t = numpy.tanh(k0 * (z + k1 * z**3))
        y = 0.5 * z * (1.0 + t)
        return (y, 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * k0 * (1.0 + 3.0 * k1 * z * z)) if slope else y
    _checks.check_activation(activation)  # raises
    raise AssertionError(activation)


def _gn_affine(weight, bias, groups, per_group):
    """weight and bias as float64 (G, D) arrays (1 and 0 where absent)."""
    w = numpy.ones(groups * per_group) if weight is None else _f64(weight)
    b = numpy.zeros(groups * per_group) if bias is None else _f64(bias)
    return w.reshape(groups, per_group), b.reshape(groups, per_group)


def group_norm(x, num_groups, weight=None, bias=None, *, eps=1e-5, activation="identity", return_stats=False):
    """Channels-last GroupNorm + activation in float64,
    ``y = act((x - mean) * rstd * weight + bias)``; arguments and checks as
    :func:`cupy_dwgn.group_norm`.

    Args:
        x: (N, *spatial, C), 0 to 3 spatial dims.
        num_groups: a divisor of C; group g is channels [g*C/G, (g+1)*C/G).
        weight, bias: optional (C,), x's dtype (or float32 for float16/bfloat16 x).
        eps: added to the (biased) variance.
        activation: "identity", "relu", "silu", "gelu" (erf) or "gelu_tanh".
        return_stats: also return mean and rstd = 1 / sqrt(var + eps).

    Returns:
        y, float64 of x's shape; with ``return_stats`` (y, mean, rstd), mean
        and rstd float64 (N, num_groups) (the GPU op's are float32 unless x
        is float64).  With no spatial positions mean and rstd are NaN.

    Example:
        >>> y, mean, rstd = reference.group_norm(h, 32, gamma, beta, activation="silu", return_stats=True)
    """
    batch, rows, channels, groups = _checks.check_group_norm_forward(
        x, num_groups, weight, bias, eps, activation, None, _NDARRAY
    )
    per_group = channels // groups
    xg = _f64(x).reshape(batch, rows, groups, per_group)
    with numpy.errstate(invalid="ignore", divide="ignore"):  # no rows: NaN statistics, as on the GPU
        count = rows * per_group
        # The mean in two terms: a large |mean| / std (x = 1e4 + randn)
        # rounded to one float64 would cost y ulp(mean) / std of relative
        # error (4e-12 at 1e4, past the float64 bound); the centered sum
        # recovers what the rounding lost.
        mean = xg.sum(axis=(1, 3)) / count
        centered = xg - mean[:, None, :, None]
        low = centered.sum(axis=(1, 3)) / count
        centered -= low[:, None, :, None]
        mean += low
        var = numpy.square(centered).sum(axis=(1, 3)) / count
        rstd = 1.0 / numpy.sqrt(var + eps)
    w, b = _gn_affine(weight, bias, groups, per_group)
    centered *= rstd[:, None, :, None]  # xhat
    centered *= w
    centered += b
    y = _gn_activation(centered, activation, slope=False).reshape(x.shape)
    return (y, mean, rstd) if return_stats else y


def group_norm_backward(grad_out, x, mean, rstd, num_groups, weight=None, bias=None, *, activation="identity"):
    """Gradients of :func:`group_norm` in float64, computed from the given
    mean/rstd as :func:`cupy_dwgn.group_norm_backward` does; arguments and
    checks as that function.

    ``mean``/``rstd`` must have the GPU op's statistics dtype: float64 for
    float64 x, float32 otherwise (the same check, the same message).  For a
    float64-exact oracle pass float64 x and its float64 statistics; for other
    dtypes pass ``mean.astype(numpy.float32)`` / ``rstd.astype(numpy.float32)``
    of :func:`group_norm`'s float64 statistics (or the GPU op's own): rounding
    the statistics to float32 moves the gradients by about
    ulp_float32(mean) / std relative (1e-7 for x of mean 3 and std 1, far
    inside the float32 tolerance of 1e-5; 1.6e-5 at mean 1000): for x of
    large mean pass the GPU op's own statistics, which is what its kernels
    use.

    Args:
        grad_out: (N, *spatial, C), the gradient of y; x's dtype.
        x: the forward input.
        mean, rstd: (N, num_groups) from the forward (``return_stats=True``).
        num_groups, weight, bias, activation: as in the forward call (bias
            matters through the activation's derivative and for the
            presence of its gradient).

    Returns:
        (dx, dw, db): dx float64 of x's shape; dw/db float64 (C,), or None
        when weight/bias is None.

    Example:
        >>> y, mean, rstd = reference.group_norm(x, 8, w, b, activation="gelu", return_stats=True)
        >>> dx, dw, db = reference.group_norm_backward(dy, x, mean, rstd, 8, w, b, activation="gelu")
    """
    batch, rows, channels, groups = _checks.check_group_norm_backward(
        grad_out, x, mean, rstd, num_groups, weight, bias, activation, _NDARRAY
    )
    per_group = channels // groups
    shape = (batch, rows, groups, per_group)
    mean = _f64(mean)[:, None, :, None]
    rstd = _f64(rstd)[:, None, :, None]
    xhat = (_f64(x).reshape(shape) - mean) * rstd
    w, b = _gn_affine(weight, bias, groups, per_group)
    _, slope = _gn_activation(xhat * w + b, activation)
    dz = _f64(grad_out).reshape(shape) * slope
    dw = None if weight is None else (dz * xhat).sum(axis=(0, 1)).reshape(channels)
    db = None if bias is None else dz.sum(axis=(0, 1)).reshape(channels)
    dz *= w  # the gradient of xhat
    count = rows * per_group
    with numpy.errstate(invalid="ignore", divide="ignore"):  # no rows: dx is empty anyway
        mean_g = dz.sum(axis=(1, 3), keepdims=True) / count
        mean_gx = (dz * xhat).sum(axis=(1, 3), keepdims=True) / count
    xhat *= mean_gx
    dz -= mean_g
    dz -= xhat
    dz *= rstd
    return dz.reshape(numpy.shape(x)), dw, db
