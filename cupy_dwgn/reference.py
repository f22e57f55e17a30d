"""Float64 NumPy references for every op: the oracle of the tests.

Slow and simple on purpose; each takes and returns NumPy arrays (any float
dtype in, float64 out) and follows the same argument rules as the GPU ops
(the depthwise references take the same ``layout="NCHW"`` / ``"NHWC"``).
"""

import numpy

from . import _validate


def _f64(a):
    return numpy.asarray(a).astype(numpy.float64)


def _tap_window(g, kh, kw):
    """Slices of the zero-padded input read by tap (kh, kw) for every output."""
    h0 = kh * g.dilation_h
    w0 = kw * g.dilation_w
    return (
        slice(h0, h0 + g.stride_h * (g.out_height - 1) + 1, g.stride_h),
        slice(w0, w0 + g.stride_w * (g.out_width - 1) + 1, g.stride_w),
    )


def _pad(x, g):
    # Bottom/right padding may be larger than what the outputs read; extend so
    # every tap window is in range, and crop negative extents away.
    padded_h = max(g.pad_top + g.height + g.pad_bottom, g.stride_h * (g.out_height - 1) + g.dilation_h * (g.filter_height - 1) + 1)
    padded_w = max(g.pad_left + g.width + g.pad_right, g.stride_w * (g.out_width - 1) + g.dilation_w * (g.filter_width - 1) + 1)
    out = numpy.zeros(x.shape[:2] + (padded_h, padded_w))
    out[:, :, g.pad_top : g.pad_top + g.height, g.pad_left : g.pad_left + g.width] = x
    return out


# Depthwise convolution.  Each reference runs the GPU op's layout, rank and
# geometry checks, with the same messages, on its float64 copies; the NHWC
# variants transpose to NCHW, run the NCHW math and transpose back.


def _to_nchw(a, layout):
    return a.transpose(0, 3, 1, 2) if layout == "NHWC" else a


def _from_nchw(a, layout):
    return numpy.ascontiguousarray(a.transpose(0, 2, 3, 1)) if layout == "NHWC" else a


def _check_rank(name, a, shape_doc):
    _validate.check_array(name, a, 4, shape_doc, numpy.ndarray)


def _check_grad_out(grad_out, g, layout):
    expected = _validate.layout_shape(layout, g.batch, g.channels * g.multiplier, g.out_height, g.out_width)
    _validate.check_shape("grad_out", grad_out, expected, " (the forward output shape)")


_WEIGHT_DOC = "(C*M, 1, KH, KW)"


def _grad_out_doc(layout):
    return _validate.layout_doc(layout, "C*M", ("OH", "OW"))


def depthwise_conv2d(x, weight, bias=None, *, stride=1, padding=0, dilation=1, layout="NCHW"):
    """Depthwise convolution in float64; arguments as cupy_dwgn.depthwise_conv2d.

    layout: "NCHW" (x (N, C, H, W), result (N, C*M, OH, OW)) or "NHWC"
    (x (N, H, W, C), result (N, OH, OW, C*M)); weight (C*M, 1, KH, KW) in both.
    """
    _validate.check_layout(layout)
    x = _f64(x)
    weight = _f64(weight)
    _check_rank("x", x, _validate.layout_doc(layout))
    _check_rank("weight", weight, _WEIGHT_DOC)
    g = _validate.conv_geometry(x.shape, weight.shape, stride, padding, dilation, layout=layout)
    x = _to_nchw(x, layout)
    # (N, C, M, OH, OW): output channel c*M + m reads input channel c.
    xp = _pad(x, g)
    w = weight.reshape(g.channels, g.multiplier, g.filter_height, g.filter_width)
    y = numpy.zeros((g.batch, g.channels, g.multiplier, g.out_height, g.out_width))
    for kh in range(g.filter_height):
        for kw in range(g.filter_width):
            rows, cols = _tap_window(g, kh, kw)
            y += xp[:, :, None, rows, cols] * w[None, :, :, kh, kw, None, None]
    y = y.reshape(g.batch, g.channels * g.multiplier, g.out_height, g.out_width)
    if bias is not None:
        y += _f64(bias)[None, :, None, None]
    return _from_nchw(y, layout)


def depthwise_conv2d_backward_input(grad_out, weight, input_shape, *, stride=1, padding=0, dilation=1, layout="NCHW"):
    """Adjoint of :func:`depthwise_conv2d` with respect to x, in float64.

    ``input_shape`` and the result are in ``layout``'s order ((N, H, W, C) for
    "NHWC"), as is grad_out ((N, OH, OW, C*M) for "NHWC").
    """
    _validate.check_layout(layout)
    grad_out = _f64(grad_out)
    weight = _f64(weight)
    _check_rank("grad_out", grad_out, _grad_out_doc(layout))
    _check_rank("weight", weight, _WEIGHT_DOC)
    input_shape = _validate.check_int_shape("input_shape", input_shape, 4)
    g = _validate.conv_geometry(input_shape, weight.shape, stride, padding, dilation, "input_shape", layout)
    _check_grad_out(grad_out, g, layout)
    dy = _to_nchw(grad_out, layout).reshape(g.batch, g.channels, g.multiplier, g.out_height, g.out_width)
    w = weight.reshape(g.channels, g.multiplier, g.filter_height, g.filter_width)
    dxp = _pad(numpy.zeros((g.batch, g.channels, g.height, g.width)), g)
    for kh in range(g.filter_height):
        for kw in range(g.filter_width):
            rows, cols = _tap_window(g, kh, kw)
            dxp[:, :, rows, cols] += numpy.einsum("ncmhw,cm->nchw", dy, w[:, :, kh, kw])
    dx = dxp[:, :, g.pad_top : g.pad_top + g.height, g.pad_left : g.pad_left + g.width]
    return numpy.ascontiguousarray(_from_nchw(dx, layout))


def depthwise_conv2d_backward_weight(grad_out, x, weight_shape, *, stride=1, padding=0, dilation=1, layout="NCHW"):
    """Adjoint of :func:`depthwise_conv2d` with respect to weight, in float64.

    grad_out and x in ``layout``'s order; the result is (C*M, 1, KH, KW).
    """
    _validate.check_layout(layout)
    grad_out = _f64(grad_out)
    x = _f64(x)
    _check_rank("grad_out", grad_out, _grad_out_doc(layout))
    _check_rank("x", x, _validate.layout_doc(layout))
    weight_shape = _validate.check_int_shape("weight_shape", weight_shape, 4)
    g = _validate.conv_geometry(x.shape, weight_shape, stride, padding, dilation, layout=layout)
    _check_grad_out(grad_out, g, layout)
    dy = _to_nchw(grad_out, layout).reshape(g.batch, g.channels, g.multiplier, g.out_height, g.out_width)
    xp = _pad(_to_nchw(x, layout), g)
    dw = numpy.zeros((g.channels, g.multiplier, g.filter_height, g.filter_width))
    for kh in range(g.filter_height):
        for kw in range(g.filter_width):
            rows, cols = _tap_window(g, kh, kw)
            dw[:, :, kh, kw] = numpy.einsum("ncmhw,nchw->cm", dy, xp[:, :, rows, cols])
    return dw.reshape(weight_shape)


# ---------------------------------------------------------------------------
# Channels-last GroupNorm (x: (N, *spatial, C)) with a fused activation.

_GN_ACTIVATIONS = ("identity", "relu", "silu", "gelu", "gelu_tanh")


def _gn_activation(z, activation):
    """act(z) and act'(z) in float64."""
    from math import erf, sqrt, pi

    if activation == "identity":
        return z, numpy.ones_like(z)
    if activation == "relu":
        return numpy.maximum(z, 0.0), (z > 0).astype(numpy.float64)
    if activation == "silu":
        s = 0.5 * (1.0 + numpy.tanh(0.5 * z))  # = 1 / (1 + exp(-z)), no overflow
        return z * s, s * (1.0 + z * (1.0 - s))
    if activation == "gelu":
        cdf = 0.5 * (1.0 + numpy.vectorize(erf, otypes=[numpy.float64])(z / sqrt(2.0)))
        return z * cdf, cdf + z * numpy.exp(-0.5 * z * z) / sqrt(2.0 * pi)
    if activation == "gelu_tanh":
        k0, k1 = 0.7978845608028654, 0.044715
        t = numpy.tanh(k0 * (z + k1 * z**3))
        return 0.5 * z * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * k0 * (1.0 + 3.0 * k1 * z * z)
    raise ValueError(f"activation: expected one of {', '.join(map(repr, _GN_ACTIVATIONS))}, got {activation!r}")


def _gn_prepare(x, num_groups, weight, bias, activation):
    if activation not in _GN_ACTIVATIONS:
        _gn_activation(numpy.zeros(0), activation)  # raises the ValueError
    x = _f64(x)
    channels = x.shape[-1]
    if not 2 <= x.ndim <= 5:
        raise ValueError(f"x: expected a 2-D to 5-D array (N, *spatial, C), got shape {x.shape}")
    if num_groups <= 0 or channels % num_groups != 0:
        raise ValueError(f"num_groups: expected a positive divisor of C = {channels}, got {num_groups}")
    batch = x.shape[0]
    xg = x.reshape(batch, -1, num_groups, channels // num_groups)  # (N, S, G, D)
    w = numpy.ones(channels) if weight is None else _f64(weight)
    b = numpy.zeros(channels) if bias is None else _f64(bias)
    return x, xg, w, b


def group_norm(x, num_groups, weight=None, bias=None, *, eps=1e-5, activation="identity"):
    """Channels-last GroupNorm + activation in float64; arguments as
    cupy_dwgn.group_norm.  Returns (y, mean, rstd), mean/rstd of shape
    (N, num_groups), biased variance."""
    x, xg, w, b = _gn_prepare(x, num_groups, weight, bias, activation)
    mean = xg.mean(axis=(1, 3))
    var = ((xg - mean[:, None, :, None]) ** 2).mean(axis=(1, 3))
    rstd = 1.0 / numpy.sqrt(var + eps)
    xhat = ((xg - mean[:, None, :, None]) * rstd[:, None, :, None]).reshape(x.shape)
    y, _ = _gn_activation(xhat * w + b, activation)
    return y, mean, rstd


def group_norm_backward(grad_out, x, num_groups, weight=None, bias=None, *, eps=1e-5, activation="identity"):
    """Gradients of :func:`group_norm` in float64: (dx, dw, db), dw/db None
    when weight/bias is None.  Computes its own float64 statistics."""
    x, xg, w, b = _gn_prepare(x, num_groups, weight, bias, activation)
    dy = _f64(grad_out)
    mean = xg.mean(axis=(1, 3))
    var = ((xg - mean[:, None, :, None]) ** 2).mean(axis=(1, 3))
    rstd = 1.0 / numpy.sqrt(var + eps)
    xhat = ((xg - mean[:, None, :, None]) * rstd[:, None, :, None]).reshape(x.shape)
    _, grad = _gn_activation(xhat * w + b, activation)
    dz = dy * grad
    spatial_axes = tuple(range(x.ndim - 1))
    dw = None if weight is None else (dz * xhat).sum(axis=spatial_axes)
    db = None if bias is None else dz.sum(axis=spatial_axes)
    # d/dxhat, then the normalization's Jacobian per (n, g).
    g = (dz * w).reshape(xg.shape)
    xh = xhat.reshape(xg.shape)
    mean_g = g.mean(axis=(1, 3), keepdims=True)
    mean_gx = (g * xh).mean(axis=(1, 3), keepdims=True)
    dx = rstd[:, None, :, None] * (g - mean_g - xh * mean_gx)
    return dx.reshape(x.shape), dw, db
