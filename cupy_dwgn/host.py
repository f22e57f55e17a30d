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
"""

import numpy

from . import depthwise


def _to_device(*arrays):
    import cupy

    return [None if a is None else cupy.asarray(a) for a in arrays]


def depthwise_conv2d(x, weight, bias=None, *, stride=1, padding=0, dilation=1, layout="NCHW"):
    """:func:`cupy_dwgn.depthwise_conv2d` on NumPy arrays."""
    depthwise.check_forward_args(x, weight, bias, stride, padding, dilation, layout, None, numpy.ndarray)
    x, weight, bias = _to_device(x, weight, bias)
    y = depthwise.depthwise_conv2d(x, weight, bias, stride=stride, padding=padding, dilation=dilation, layout=layout)
    return y.get()


def depthwise_conv2d_backward_input(grad_out, weight, input_shape, *, stride=1, padding=0, dilation=1, layout="NCHW"):
    """:func:`cupy_dwgn.depthwise_conv2d_backward_input` on NumPy arrays."""
    depthwise.check_backward_input_args(grad_out, weight, input_shape, stride, padding, dilation, layout, None, numpy.ndarray)
    grad_out, weight = _to_device(grad_out, weight)
    return depthwise.depthwise_conv2d_backward_input(
        grad_out, weight, input_shape, stride=stride, padding=padding, dilation=dilation, layout=layout
    ).get()


def depthwise_conv2d_backward_weight(grad_out, x, weight_shape, *, stride=1, padding=0, dilation=1, layout="NCHW"):
    """:func:`cupy_dwgn.depthwise_conv2d_backward_weight` on NumPy arrays."""
    depthwise.check_backward_weight_args(grad_out, x, weight_shape, stride, padding, dilation, layout, None, numpy.ndarray)
    grad_out, x = _to_device(grad_out, x)
    return depthwise.depthwise_conv2d_backward_weight(
        grad_out, x, weight_shape, stride=stride, padding=padding, dilation=dilation, layout=layout
    ).get()
