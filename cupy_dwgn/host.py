"""NumPy in, NumPy out, on any machine: the ops for callers who hold host arrays.

Each function takes its GPU twin's arguments (less ``out=`` and ``stream=``)
and runs the same argument checks on the NumPy inputs first, so bad input
fails the same way on every machine, before any transfer.  Then:

* with a usable CUDA GPU (``cupy_dwgn.gpu_status()[0] > 0``): the inputs are
  copied to the current device, the CUDA kernel runs, the result is copied
  back;
* without one (no CuPy, no driver, no device): the float64 NumPy references
  of :mod:`cupy_dwgn.reference` run on the CPU (vectorized; the first such
  call warns once with :class:`cupy_dwgn.CPUFallbackWarning`).  Results come
  back in the GPU op's output dtypes: the input's dtype (the weight's for
  GroupNorm's dw/db), mean/rstd float32 (float64 for float64 x): the float64
  result rounded once.

The environment variable ``CUPY_DWGN_DEVICE`` chooses: ``auto`` (default, as
above), ``cpu`` (always the references, no warning) or ``gpu`` (the kernels;
without a usable GPU every call raises RuntimeError saying why).  It is read
at each call; :func:`device` tells which path a call takes now.

Example:
    >>> import numpy, cupy_dwgn.host as host
    >>> x = numpy.random.randn(2, 8, 16, 16).astype(numpy.float32)     # NCHW
    >>> w = numpy.random.randn(8, 1, 3, 3).astype(numpy.float32)
    >>> host.depthwise_conv2d(x, w, padding=1).shape                    # GPU, or CPU with a warning
    (2, 8, 16, 16)
    >>> x_nhwc = numpy.ascontiguousarray(x.transpose(0, 2, 3, 1))      # channels-last
    >>> host.depthwise_conv2d(x_nhwc, w, padding=1, layout="NHWC").shape
    (2, 16, 16, 8)
    >>> host.device()                                                   # which path: "gpu" or "cpu"
    'cpu'
"""

import os
import warnings

import numpy

from . import _checks, _dtypes, reference
from .errors import CPUFallbackWarning

#: The environment variable that chooses the path: "auto", "cpu" or "gpu".
DEVICE_VARIABLE = "CUPY_DWGN_DEVICE"
_CHOICES = ("auto", "cpu", "gpu")

_NDARRAY = numpy.ndarray
_gpu_status = None  # gpu_status(), asked once per process
_warned = False  # the CPUFallbackWarning was given


def _choice():
    value = os.environ.get(DEVICE_VARIABLE, "")
    choice = value.strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"{DEVICE_VARIABLE}: expected 'auto', 'cpu' or 'gpu', got {value!r}")
    return choice


def _status():
    global _gpu_status
    if _gpu_status is None:
        from ._device import gpu_status

        _gpu_status = gpu_status()
    return _gpu_status


def device():
    """The path the host functions take now: ``"gpu"`` (the CUDA kernels) or
    ``"cpu"`` (the NumPy references), from ``CUPY_DWGN_DEVICE`` and
    :func:`cupy_dwgn.gpu_status` (asked once per process).

    Raises:
        ValueError: ``CUPY_DWGN_DEVICE`` is not auto, cpu or gpu.
        RuntimeError: ``CUPY_DWGN_DEVICE=gpu`` and no usable GPU (the message
            says why, as :func:`cupy_dwgn.gpu_status` does).

    Example:
        >>> cupy_dwgn.host.device()
        'gpu'
    """
    choice = _choice()
    if choice == "cpu":
        return "cpu"
    count, reason = _status()
    if count:
        return "gpu"
    if choice == "gpu":
        from ._device import reason_without_alternatives

        raise RuntimeError(
            f"{DEVICE_VARIABLE}=gpu, but cupy_dwgn.host has no GPU to run on: {reason_without_alternatives(reason)} "
            f"(Unset {DEVICE_VARIABLE}, or set it to cpu, to run on the CPU.)"
        ) from None
    return "cpu"


def _on_cpu():
    """True for the CPU path; the first automatic fallback warns."""
    global _warned
    if device() == "gpu":
        return False
    if not _warned and _choice() == "auto":
        _warned = True
        warnings.warn(
            "cupy_dwgn.host runs the float64 NumPy references on the CPU (correct results in the "
            "GPU ops' dtypes, but far slower than the CUDA kernels): " + _status()[1]
            + f" Set {DEVICE_VARIABLE}=cpu to choose the CPU path without this warning, or "
            f"{DEVICE_VARIABLE}=gpu to make a missing GPU an error.",
            CPUFallbackWarning,
            stacklevel=3,
        )
    return True


def _to_device(*arrays):
    import cupy

    return [None if a is None else cupy.asarray(a) for a in arrays]


def _cast(array, dtype):
    """The float64 result rounded once to ``dtype`` (overflow gives inf
    silently, as the kernels' own stores do)."""
    if array is None:
        return None
    with numpy.errstate(over="ignore"):
        return array.astype(dtype, order="C")


def depthwise_conv2d(x, weight, bias=None, *, stride=1, padding=0, dilation=1, layout="NCHW"):
    """:func:`cupy_dwgn.depthwise_conv2d` on NumPy arrays (GPU, or the
    reference on the CPU).

    Args:
        x: (N, C, H, W) for ``layout="NCHW"``, (N, H, W, C) for "NHWC";
            C-contiguous float16, float32, float64 or bfloat16.
        weight: (C*M, 1, KH, KW) (M: depth multiplier), x's dtype.
        bias: optional (C*M,), x's dtype.
        stride, dilation: int or (h, w).  padding: int, (h, w),
            ((top, bottom), (left, right)), "same" or "valid".

    Returns:
        numpy.ndarray (N, C*M, OH, OW) ("NHWC": (N, OH, OW, C*M)), x's dtype.

    Example:
        >>> y = host.depthwise_conv2d(x, w, padding=1)
    """
    _checks.check_depthwise_forward(x, weight, bias, stride, padding, dilation, layout, None, _NDARRAY)
    if _on_cpu():
        y = reference.depthwise_conv2d(x, weight, bias, stride=stride, padding=padding, dilation=dilation, layout=layout)
        return _cast(y, x.dtype)
    from . import depthwise

    x, weight, bias = _to_device(x, weight, bias)
    y = depthwise.depthwise_conv2d(x, weight, bias, stride=stride, padding=padding, dilation=dilation, layout=layout)
    return y.get()


def depthwise_conv2d_backward_input(grad_out, weight, input_shape, *, stride=1, padding=0, dilation=1, layout="NCHW"):
    """:func:`cupy_dwgn.depthwise_conv2d_backward_input` on NumPy arrays.

    Args:
        grad_out: (N, C*M, OH, OW) ("NHWC": (N, OH, OW, C*M)).
        weight: (C*M, 1, KH, KW), grad_out's dtype.
        input_shape: the forward x's shape, in ``layout``'s order.
        stride, padding, dilation, layout: as in the forward call.

    Returns:
        numpy.ndarray of shape ``input_shape``, grad_out's dtype.

    Example:
        >>> dx = host.depthwise_conv2d_backward_input(dy, w, x.shape, padding=1)
    """
    _checks.check_depthwise_backward_input(grad_out, weight, input_shape, stride, padding, dilation, layout, None, _NDARRAY)
    if _on_cpu():
        dx = reference.depthwise_conv2d_backward_input(
            grad_out, weight, input_shape, stride=stride, padding=padding, dilation=dilation, layout=layout
        )
        return _cast(dx, grad_out.dtype)
    from . import depthwise

    grad_out, weight = _to_device(grad_out, weight)
    return depthwise.depthwise_conv2d_backward_input(
        grad_out, weight, input_shape, stride=stride, padding=padding, dilation=dilation, layout=layout
    ).get()


def depthwise_conv2d_backward_weight(grad_out, x, weight_shape, *, stride=1, padding=0, dilation=1, layout="NCHW"):
    """:func:`cupy_dwgn.depthwise_conv2d_backward_weight` on NumPy arrays.

    Args:
        grad_out: (N, C*M, OH, OW) ("NHWC": (N, OH, OW, C*M)).
        x: the forward input, (N, C, H, W) ("NHWC": (N, H, W, C)), grad_out's dtype.
        weight_shape: (C*M, 1, KH, KW).
        stride, padding, dilation, layout: as in the forward call.

    Returns:
        numpy.ndarray of shape ``weight_shape``, x's dtype.

    Example:
        >>> dw = host.depthwise_conv2d_backward_weight(dy, x, w.shape, padding=1)
    """
    _checks.check_depthwise_backward_weight(grad_out, x, weight_shape, stride, padding, dilation, layout, None, _NDARRAY)
    if _on_cpu():
        dw = reference.depthwise_conv2d_backward_weight(
            grad_out, x, weight_shape, stride=stride, padding=padding, dilation=dilation, layout=layout
        )
        return _cast(dw, x.dtype)
    from . import depthwise

    grad_out, x = _to_device(grad_out, x)
    return depthwise.depthwise_conv2d_backward_weight(
        grad_out, x, weight_shape, stride=stride, padding=padding, dilation=dilation, layout=layout
    ).get()


def group_norm(x, num_groups, weight=None, bias=None, *, eps=1e-5, activation="identity", return_stats=False):
    """:func:`cupy_dwgn.group_norm` on NumPy arrays:
    ``y = act((x - mean) * rstd * weight + bias)``, channels-last.

    Args:
        x: (N, *spatial, C), 0 to 3 spatial dims; C-contiguous float16,
            float32, float64 or bfloat16.
        num_groups: a divisor of C.
        weight, bias: optional (C,), x's dtype (or float32 for float16/bfloat16 x).
        eps: added to the (biased) variance.
        activation: "identity", "relu", "silu", "gelu" or "gelu_tanh".
        return_stats: also return mean and rstd.

    Returns:
        y (x's shape and dtype), or (y, mean, rstd) with ``return_stats``:
        mean/rstd (N, num_groups), float32 (float64 for float64 x).

    Example:
        >>> h = numpy.random.randn(2, 32, 32, 64).astype(numpy.float32)   # NHWC
        >>> y, mean, rstd = host.group_norm(h, 8, activation="silu", return_stats=True)
        >>> y.shape, mean.shape, mean.dtype
        ((2, 32, 32, 64), (2, 8), dtype('float32'))
    """
    _checks.check_group_norm_forward(x, num_groups, weight, bias, eps, activation, None, _NDARRAY)
    if _on_cpu():
        result = reference.group_norm(
            x, num_groups, weight, bias, eps=eps, activation=activation, return_stats=return_stats
        )
        if not return_stats:
            return _cast(result, x.dtype)
        y, mean, rstd = result
        stats = _dtypes.accumulator_dtype(x.dtype)
        return _cast(y, x.dtype), _cast(mean, stats), _cast(rstd, stats)
    from . import _group_norm

    x, weight, bias = _to_device(x, weight, bias)
    result = _group_norm.group_norm(
        x, num_groups, weight, bias, eps=eps, activation=activation, return_stats=return_stats
    )
    return tuple(r.get() for r in result) if return_stats else result.get()


def group_norm_backward(grad_out, x, mean, rstd, num_groups, weight=None, bias=None, *, activation="identity"):
    """:func:`cupy_dwgn.group_norm_backward` on NumPy arrays, from the
    forward's mean/rstd.

    Args:
        grad_out: (N, *spatial, C), x's dtype.
        x: the forward input.
        mean, rstd: (N, num_groups) from ``group_norm(..., return_stats=True)``:
            float32 (float64 for float64 x).
        num_groups, weight, bias, activation: as in the forward call.

    Returns:
        (dx, dw, db): dx of x's shape and dtype; dw/db (C,) in the weight's
        dtype, or None when weight/bias is None.

    Example:
        >>> y, mean, rstd = host.group_norm(h, 8, w, b, activation="silu", return_stats=True)
        >>> dx, dw, db = host.group_norm_backward(dy, h, mean, rstd, 8, w, b, activation="silu")
    """
    _checks.check_group_norm_backward(grad_out, x, mean, rstd, num_groups, weight, bias, activation, _NDARRAY)
    if _on_cpu():
        dx, dw, db = reference.group_norm_backward(
            grad_out, x, mean, rstd, num_groups, weight, bias, activation=activation
        )
        w_dtype = _checks.affine_dtype(weight, bias, x)
        return _cast(dx, x.dtype), _cast(dw, w_dtype), _cast(db, w_dtype)
    from . import _group_norm

    arrays = _to_device(grad_out, x, mean, rstd, weight, bias)
    result = _group_norm.group_norm_backward(*arrays[:4], num_groups, *arrays[4:], activation=activation)
    return tuple(None if r is None else r.get() for r in result)
