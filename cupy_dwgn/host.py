"""NumPy in, NumPy out: the GPU ops for callers who hold host arrays.

Each function runs the same argument checks as its GPU twin on the NumPy
inputs first (so bad input fails before any transfer), copies the inputs to
the current CUDA device, runs the op and copies the result back.

Example:
    >>> import numpy, cupy_dwgn.host as host
    >>> x = numpy.random.randn(2, 8, 16, 16).astype(numpy.float32)
    >>> w = numpy.random.randn(8, 1, 3, 3).astype(numpy.float32)
    >>> host.depthwise_conv2d(x, w, padding=1).shape
    (2, 8, 16, 16)
    >>> x_nhwc = numpy.ascontiguousarray(x.transpose(0, 2, 3, 1))  # channels-last
    >>> host.depthwise_conv2d(x_nhwc, w, padding=1, layout="NHWC").shape
    (2, 16, 16, 8)
"""

import numpy

from . import _group_norm, depthwise


def _to_device(*arrays):
    import cupy

    return [None if a is None else cupy.asarray(a) for a in arrays]


def depthwise_conv2d(x, weight, bias=None, *, stride=1, padding=0, dilation=1, layout="NCHW"):
    """:func:`cupy_dwgn.depthwise_conv2d` on NumPy arrays (``layout`` "NCHW" or "NHWC")."""
    depthwise.check_forward_args(x, weight, bias, stride, padding, dilation, layout, None, numpy.ndarray)
    x, weight, bias = _to_device(x, weight, bias)
    y = depthwise.depthwise_conv2d(x, weight, bias, stride=stride, padding=padding, dilation=dilation, layout=layout)
    return y.get()


def depthwise_conv2d_backward_input(grad_out, weight, input_shape, *, stride=1, padding=0, dilation=1, layout="NCHW"):
    """:func:`cupy_dwgn.depthwise_conv2d_backward_input` on NumPy arrays; ``input_shape``
    in ``layout``'s order."""
    depthwise.check_backward_input_args(grad_out, weight, input_shape, stride, padding, dilation, layout, None, numpy.ndarray)
    grad_out, weight = _to_device(grad_out, weight)
    return depthwise.depthwise_conv2d_backward_input(
        grad_out, weight, input_shape, stride=stride, padding=padding, dilation=dilation, layout=layout
    ).get()


def depthwise_conv2d_backward_weight(grad_out, x, weight_shape, *, stride=1, padding=0, dilation=1, layout="NCHW"):
    """:func:`cupy_dwgn.depthwise_conv2d_backward_weight` on NumPy arrays (``layout`` as in the forward call)."""
    depthwise.check_backward_weight_args(grad_out, x, weight_shape, stride, padding, dilation, layout, None, numpy.ndarray)
    grad_out, x = _to_device(grad_out, x)
    return depthwise.depthwise_conv2d_backward_weight(
        grad_out, x, weight_shape, stride=stride, padding=padding, dilation=dilation, layout=layout
    ).get()


def group_norm(x, num_groups, weight=None, bias=None, *, eps=1e-5, activation="identity", return_stats=False):
    """:func:`cupy_dwgn.group_norm` on NumPy arrays (mean/rstd too with ``return_stats``)."""
    _group_norm.check_forward_args(x, num_groups, weight, bias, eps, activation, None, numpy.ndarray)
    x, weight, bias = _to_device(x, weight, bias)
    result = _group_norm.group_norm(
        x, num_groups, weight, bias, eps=eps, activation=activation, return_stats=return_stats
    )
    return tuple(r.get() for r in result) if return_stats else result.get()


def group_norm_backward(grad_out, x, mean, rstd, num_groups, weight=None, bias=None, *, activation="identity"):
    """:func:`cupy_dwgn.group_norm_backward` on NumPy arrays; returns (dx, dw, db)
    with dw/db None when weight/bias are None."""
    _group_norm.check_backward_args(grad_out, x, mean, rstd, num_groups, weight, bias, activation, numpy.ndarray)
    arrays = _to_device(grad_out, x, mean, rstd, weight, bias)
    result = _group_norm.group_norm_backward(*arrays[:4], num_groups, *arrays[4:], activation=activation)
    return tuple(None if r is None else r.get() for r in result)
