"""The argument checks of every op, in one CuPy-free module.

Each check is duck-typed over the array class (``kind``): the GPU ops run it
on CuPy arrays (``kind=None``), ``cupy_dwgn.host`` and ``cupy_dwgn.reference``
on NumPy arrays (``kind=numpy.ndarray``), so the same bad input gets the same
exception and message through every front door.  Importing this module does
not import CuPy (the references must work on machines without it).

depthwise.py and _group_norm.py re-export these under their historical names
(``depthwise.check_forward_args``, ``_group_norm.check_forward_args``, ...).
"""

import functools
import numbers

import numpy

from . import _dtypes, _validate
from ._launch import INT32_LIMIT, MAX_GRID_Y, PLANE_LIMIT, check_plane_size

# ---------------------------------------------------------------------------
# Depthwise convolution

_WEIGHT_DOC = "(C*M, 1, KH, KW)"


def check_depthwise_forward(x, weight, bias, stride, padding, dilation, layout, out, kind=None):
    """Validate depthwise_conv2d's arguments; returns the ConvGeometry."""
    layout = _validate.check_layout(layout)
    _validate.check_array("x", x, 4, _validate.layout_doc(layout), kind)
    _validate.check_array("weight", weight, 4, _WEIGHT_DOC, kind)
    _validate.check_same_dtype("weight", weight, "x", x)
    g = _validate.conv_geometry(x.shape, weight.shape, stride, padding, dilation, layout=layout)
    check_depthwise_limits("x", g)
    out_channels = g.channels * g.multiplier
    if bias is not None:
        _validate.check_array("bias", bias, 1, "(C*M,)", kind)
        _validate.check_same_dtype("bias", bias, "x", x)
        _validate.check_shape("bias", bias, (out_channels,), " (C*M,)")
    out_shape = _validate.layout_shape(layout, g.batch, out_channels, g.out_height, g.out_width)
    _validate.check_out(out, out_shape, x.dtype, kind)
    _validate.check_same_device(x=x, weight=weight, bias=bias, out=out)
    _validate.check_no_overlap(out, x=x, weight=weight, bias=bias)
    return g


def check_depthwise_backward_input(grad_out, weight, input_shape, stride, padding, dilation, layout, out, kind=None):
    """Validate depthwise_conv2d_backward_input's arguments; returns the ConvGeometry."""
    layout = _validate.check_layout(layout)
    _validate.check_array("grad_out", grad_out, 4, _validate.layout_doc(layout, "C*M", ("OH", "OW")), kind)
    _validate.check_array("weight", weight, 4, _WEIGHT_DOC, kind)
    _validate.check_same_dtype("weight", weight, "grad_out", grad_out)
    input_shape = _validate.check_int_shape("input_shape", input_shape, 4)
    g = _validate.conv_geometry(input_shape, weight.shape, stride, padding, dilation, "input_shape", layout=layout)
    check_depthwise_limits("input_shape", g)
    check_depthwise_grad_out(grad_out, g, layout)
    _validate.check_out(out, input_shape, grad_out.dtype, kind)
    _validate.check_same_device(grad_out=grad_out, weight=weight, out=out)
    _validate.check_no_overlap(out, grad_out=grad_out, weight=weight)
    return g


def check_depthwise_backward_weight(grad_out, x, weight_shape, stride, padding, dilation, layout, out, kind=None):
    """Validate depthwise_conv2d_backward_weight's arguments; returns the ConvGeometry."""
    layout = _validate.check_layout(layout)
    _validate.check_array("grad_out", grad_out, 4, _validate.layout_doc(layout, "C*M", ("OH", "OW")), kind)
    _validate.check_array("x", x, 4, _validate.layout_doc(layout), kind)
    _validate.check_same_dtype("x", x, "grad_out", grad_out)
    weight_shape = _validate.check_int_shape("weight_shape", weight_shape, 4)
    g = _validate.conv_geometry(x.shape, weight_shape, stride, padding, dilation, layout=layout,
                                weight_name="weight_shape")
    check_depthwise_limits("x", g, "weight_shape")
    check_depthwise_grad_out(grad_out, g, layout)
    _validate.check_out(out, weight_shape, x.dtype, kind)
    _validate.check_same_device(grad_out=grad_out, x=x, out=out)
    _validate.check_no_overlap(out, grad_out=grad_out, x=x)
    return g


def check_depthwise_limits(name, g, weight_name="weight"):
    """Sizes the kernels' 32-bit in-plane indexing and grid can take."""
    check_plane_size(name, g.height * g.width)
    if g.out_height * g.out_width >= PLANE_LIMIT:
        raise ValueError(
            f"padding, stride, dilation: expected an output plane of fewer than 2**30 elements, got "
            f"{g.out_height} x {g.out_width} (from a {g.height} x {g.width} plane of {name})"
        )
    taps = g.filter_height * g.filter_width
    if g.channels * g.multiplier * taps >= INT32_LIMIT or taps > MAX_GRID_Y:
        raise ValueError(
            f"{weight_name}: expected fewer than 2**31 elements and at most {MAX_GRID_Y} taps "
            f"per filter, got {g.channels * g.multiplier} filters of "
            f"{g.filter_height}x{g.filter_width}"
        )
    if g.batch * g.channels * g.multiplier >= INT32_LIMIT:
        raise ValueError(f"{name}: expected N*C*M < 2**31, got {g.batch * g.channels * g.multiplier}")


def check_depthwise_grad_out(grad_out, g, layout):
    expected = _validate.layout_shape(layout, g.batch, g.channels * g.multiplier, g.out_height, g.out_width)
    _validate.check_shape("grad_out", grad_out, expected, " (the forward output shape)")


# ---------------------------------------------------------------------------
# Channels-last GroupNorm

#: Activations, in the order of their template code in group_norm.cu.
ACTIVATIONS = ("identity", "relu", "silu", "gelu", "gelu_tanh")

#: Block size of the GroupNorm column kernels.  C is limited to
#: COLUMN_BLOCK * MAX_GRID_Y channels: the limit of their former grid.z layout
#: (their work items are a 1-D loop now), kept as the tested range.
COLUMN_BLOCK = 256

_X_DOC = "(N, *spatial, C) with 0 to 3 spatial dims"
# Normal float32 range: eps inside it is finite and > 0 in either statistics dtype.
_FLOAT32_TINY = float(numpy.finfo(numpy.float32).tiny)
_FLOAT32_MAX = float(numpy.finfo(numpy.float32).max)


@functools.lru_cache(maxsize=None)
def weight_dtypes(dtype):
    """The weight/bias dtypes accepted with inputs of ``dtype``: the same dtype,
    and float32 too for float16/bfloat16 (mixed precision)."""
    dtype = numpy.dtype(dtype)
    if dtype.itemsize == 2:
        return (dtype, numpy.dtype(numpy.float32))
    return (dtype,)


def affine_dtype(weight, bias, x):
    """The dtype of the affine parameters (and of their gradients)."""
    return weight.dtype if weight is not None else (bias.dtype if bias is not None else x.dtype)


def check_activation(activation):
    if not isinstance(activation, str):
        raise TypeError(
            f"activation: expected a str, one of {', '.join(map(repr, ACTIVATIONS))}, "
            f"got {type(activation).__name__}"
        )
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"activation: expected one of {', '.join(map(repr, ACTIVATIONS))}, got {activation!r}"
        )


def _check_num_groups(num_groups, channels):
    if not isinstance(num_groups, numbers.Integral) or isinstance(num_groups, bool):
        raise TypeError(f"num_groups: expected an int, got {type(num_groups).__name__}")
    if num_groups <= 0:
        raise ValueError(f"num_groups: expected a positive int, got {num_groups}")
    if channels % num_groups != 0:
        raise ValueError(
            f"num_groups: expected a divisor of C = {channels} (the last dim of x), got {num_groups}"
        )
    return int(num_groups)


def _check_eps(eps, dtype):
    """eps must stay finite and > 0 in the statistics dtype (float32 unless x is float64)."""
    if type(eps) is float and _FLOAT32_TINY <= eps <= _FLOAT32_MAX:  # the common case, cheaply
        return
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool):
        raise TypeError(f"eps: expected a float, got {type(eps).__name__}")
    acc = _dtypes.accumulator_dtype(dtype)
    try:
        with numpy.errstate(over="ignore"):  # overflow gives inf, rejected below
            value = acc.type(float(eps))
    except OverflowError:  # beyond even float64 (e.g. 10**400)
        value = acc.type(numpy.inf)
    # float32 statistics: at least the smallest normal float32, since the
    # kernels are compiled with flush-to-zero, which would make a subnormal
    # eps 0 (rstd = inf for a constant group, where the reference is finite).
    smallest = _FLOAT32_TINY if acc == numpy.float32 else 0.0
    if not (numpy.isfinite(value) and value > 0 and value >= smallest):
        shown = repr(eps) if len(repr(eps)) <= 32 else repr(eps)[:24] + "..."
        limit = f">= {smallest:.6g} (the smallest normal float32: the kernels flush smaller values to 0)" if smallest else "> 0"
        raise ValueError(f"eps: expected a finite value {limit} in {acc} (the statistics dtype), got {shown}")


def _check_x(name, x, kind):
    _validate.check_array(name, x, None, "", kind)
    if not 2 <= x.ndim <= 5:
        raise ValueError(f"{name}: expected a 2-D to 5-D array {_X_DOC}, got shape {tuple(x.shape)}")
    channels = x.shape[-1]
    if channels == 0:
        raise ValueError(f"{name}: expected at least one channel (last dim), got shape {tuple(x.shape)}")
    batch = x.shape[0]
    rows = 1
    for s in x.shape[1:-1]:
        rows *= s
    if channels > COLUMN_BLOCK * MAX_GRID_Y:
        raise ValueError(
            f"{name}: expected at most {COLUMN_BLOCK * MAX_GRID_Y} channels, got {channels}"
        )
    if rows >= INT32_LIMIT or batch * channels >= INT32_LIMIT:
        raise ValueError(
            f"{name}: expected fewer than 2**31 spatial positions and N*C < 2**31, got shape "
            f"{tuple(x.shape)}"
        )
    return batch, rows, channels


def _check_affine(weight, bias, x, channels, kind):
    allowed = weight_dtypes(x.dtype)
    for name, a in (("weight", weight), ("bias", bias)):
        if a is None:
            continue
        _validate.check_array(name, a, 1, "(C,)", kind)
        if a.dtype not in allowed:
            allowed_doc = " or ".join(str(d) for d in allowed)
            raise TypeError(
                f"{name}: expected dtype {allowed_doc} (for x of dtype {x.dtype}), got {a.dtype}"
            )
        _validate.check_shape(name, a, (channels,), " (C,), C the last dim of x")
    if weight is not None and bias is not None:
        _validate.check_same_dtype("bias", bias, "weight", weight)


def check_group_norm_forward(x, num_groups, weight, bias, eps, activation, out, kind=None, *, mean_out=None, rstd_out=None):
    """Validate group_norm's arguments; returns (N, S, C, num_groups)."""
    batch, rows, channels = _check_x("x", x, kind)
    groups = _check_num_groups(num_groups, channels)
    _check_affine(weight, bias, x, channels, kind)
    _check_eps(eps, x.dtype)
    check_activation(activation)
    _validate.check_out(out, x.shape, x.dtype, kind)
    _validate.check_same_device(x=x, weight=weight, bias=bias, out=out)
    # out may be x itself (in place: each element is read before it is
    # overwritten, by the same thread), but no other overlap.
    if out is not None and not _validate.same_memory(out, x):
        _validate.check_no_overlap(out, x=x, weight=weight, bias=bias)
    stats_dtype = _dtypes.accumulator_dtype(x.dtype)
    for name, array in (("mean_out", mean_out), ("rstd_out", rstd_out)):
        _validate.check_out(array, (batch, groups), stats_dtype, kind, name)
    if mean_out is not None or rstd_out is not None:
        _validate.check_same_device(x=x, mean_out=mean_out, rstd_out=rstd_out)
        _validate.check_no_overlap(mean_out, "mean_out", x=x, weight=weight, bias=bias, out=out, rstd_out=rstd_out)
        _validate.check_no_overlap(rstd_out, "rstd_out", x=x, weight=weight, bias=bias, out=out)
    return batch, rows, channels, groups


def check_group_norm_backward(grad_out, x, mean, rstd, num_groups, weight, bias, activation, kind=None, *, out=None, grad_weight_out=None, grad_bias_out=None):
    """Validate group_norm_backward's arguments; returns (N, S, C, num_groups)."""
    _validate.check_array("grad_out", grad_out, None, "", kind)
    batch, rows, channels = _check_x("x", x, kind)
    _validate.check_same_dtype("grad_out", grad_out, "x", x)
    _validate.check_shape("grad_out", grad_out, x.shape, " (the shape of x)")
    groups = _check_num_groups(num_groups, channels)
    acc_dtype = _dtypes.accumulator_dtype(x.dtype)
    for name, a in (("mean", mean), ("rstd", rstd)):
        _validate.check_array(name, a, 2, "(N, num_groups)", kind)
        if a.dtype != acc_dtype:
            raise TypeError(
                f"{name}: expected dtype {acc_dtype} (the statistics dtype for x of dtype "
                f"{x.dtype}), got {a.dtype}"
            )
        _validate.check_shape(name, a, (batch, groups), " (N, num_groups)")
    _check_affine(weight, bias, x, channels, kind)
    check_activation(activation)
    _validate.check_same_device(
        x=x, grad_out=grad_out, mean=mean, rstd=rstd, weight=weight, bias=bias
    )
    _validate.check_out(out, x.shape, x.dtype, kind)
    w_dtype = affine_dtype(weight, bias, x)
    for name, array, param in (("grad_weight_out", grad_weight_out, "weight"), ("grad_bias_out", grad_bias_out, "bias")):
        if array is not None and (weight if param == "weight" else bias) is None:
            raise ValueError(f"{name}: expected None because {param} is None (there is no {param} gradient)")
        _validate.check_out(array, (channels,), w_dtype, kind, name)
    outputs = {"out": out, "grad_weight_out": grad_weight_out, "grad_bias_out": grad_bias_out}
    if any(a is not None for a in outputs.values()):
        _validate.check_same_device(x=x, **outputs)
        inputs = {"grad_out": grad_out, "x": x, "mean": mean, "rstd": rstd, "weight": weight, "bias": bias}
        names = list(outputs)
        for index, name in enumerate(names):
            others = {n: outputs[n] for n in names[:index]}
            _validate.check_no_overlap(outputs[name], name, **inputs, **others)
    return batch, rows, channels, groups
