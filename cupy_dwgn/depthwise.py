"""Depthwise 2-D convolution on CuPy arrays (NCHW): forward and both backward passes."""

import cupy
import numpy

from . import _compile, _dtypes, _launch, _validate
from ._launch import i32

KERNEL_FILE = "depthwise_conv2d.cu"

#: Filter sizes with a compile-time specialization (taps fully unrolled);
#: every other size runs the generic kernel (template sizes 0, 0).
SPECIALIZED_FILTER_SIZES = ((3, 3), (5, 5), (7, 7))

_FINALIZE = "dwgn_dwconv2d_bwd_weight_finalize"
# Stride-1 shared-memory kernel (forward and backward-input) for the
# specialized filter sizes; its tile of destination elements per block and
# the largest source window (tile + dilated halo) it stages in shared memory.
_TILED = "dwgn_dwconv2d_tiled"
_TILE = 32
_TILE_SHARED_LIMIT = 32 * 1024
# The templated kernels each public op launches (the weight gradient also
# launches _FINALIZE, templated on the dtype only).
_OP_KERNELS = {
    "depthwise_conv2d": "dwgn_dwconv2d_fwd",
    "depthwise_conv2d_backward_input": "dwgn_dwconv2d_bwd_input",
    "depthwise_conv2d_backward_weight": "dwgn_dwconv2d_bwd_weight_partial",
}

# Weight-gradient split: about this many blocks in pass 1, each summing at
# least _MIN_POSITIONS_PER_BLOCK output positions.  Depends on the shape
# only (never on the device), so results are bit-identical everywhere.
_TARGET_BLOCKS = 2048
_MIN_POSITIONS_PER_BLOCK = 2048


def _template_size(geometry):
    size = (geometry.filter_height, geometry.filter_width)
    return size if size in SPECIALIZED_FILTER_SIZES else (0, 0)


# The ops that take the tiled kernel at stride 1: kernel -> its BACKWARD flag.
_TILED_OPS = {"dwgn_dwconv2d_fwd": False, "dwgn_dwconv2d_bwd_input": True}

#: The keyword arguments of specializations() that cupy_dwgn.precompile forwards.
SELECTION_KEYS = ("dtypes", "filter_sizes", "large_index")


def specializations(op=None, dtypes=None, filter_sizes=None, large_index=(False, True)):
    """``(file, name expression)`` for each kernel specialization of ``op``
    (default: all three depthwise ops).

    dtypes: iterable of dtypes (default: all four); filter_sizes: iterable of
    (KH, KW) (default: the specialized sizes and the generic kernel);
    large_index: which index widths (False: 32-bit, True: 64-bit).
    """
    kernels = tuple(_OP_KERNELS.values()) if op is None else (_OP_KERNELS[op],)
    dtypes = _dtypes.CTYPES if dtypes is None else dtypes
    if filter_sizes is None:
        template_sizes = SPECIALIZED_FILTER_SIZES + ((0, 0),)
    else:
        template_sizes = tuple(
            dict.fromkeys(s if tuple(s) in SPECIALIZED_FILTER_SIZES else (0, 0) for s in filter_sizes)
        )
    large_index = (large_index,) if isinstance(large_index, bool) else large_index
    specs = []
    for dtype in dtypes:
        ctype = _dtypes.ctype(dtype)
        for kernel in kernels:
            for size in template_sizes:
                for large in large_index:
                    index = "long long" if large else "int"
                    specs.append((KERNEL_FILE, _expression(kernel, dtype, size, index)))
                    if kernel in _TILED_OPS and size != (0, 0):
                        specs.append((KERNEL_FILE, _expression(_TILED, dtype, size, index, _TILED_OPS[kernel])))
        if "dwgn_dwconv2d_bwd_weight_partial" in kernels:
            specs.append((KERNEL_FILE, _compile.name_expression(_FINALIZE, ctype)))
    return specs


def _taps_per_block(dtype, template_size):
    """Weight-gradient taps one block accumulates in registers: every tap of a
    specialized filter, one filter row when float64 accumulators would not fit
    (7x7), one tap for the generic kernel."""
    kh, kw = template_size
    if kh == 0:
        return 1
    if _dtypes.accumulator_dtype(dtype) == numpy.float64 and kh * kw > 25:
        return kw
    return kh * kw


def _expression(name, dtype, template_size, index, backward=False):
    args = [_dtypes.ctype(dtype), *template_size]
    if name == "dwgn_dwconv2d_bwd_weight_partial":
        args.append(_taps_per_block(dtype, template_size))
    elif name == _TILED:
        args.append("true" if backward else "false")
    return _compile.name_expression(name, *args, index)


def _tile_bytes(g, dtype):
    window = (_TILE + (g.filter_height - 1) * g.dilation_h) * (_TILE + (g.filter_width - 1) * g.dilation_w)
    return window * _dtypes.accumulator_dtype(dtype).itemsize


def _use_tiled(g, dtype):
    """Stride 1, a specialized filter size, and a source window that fits."""
    return (
        (g.stride_h, g.stride_w) == (1, 1)
        and _template_size(g) != (0, 0)
        and _tile_bytes(g, dtype) <= _TILE_SHARED_LIMIT
    )


def _launch_tiled(src, weight, bias, dst, g, backward):
    """One launch of the stride-1 shared-memory kernel (see depthwise_conv2d.cu)."""
    if backward:
        src_size, dst_size = (g.out_height, g.out_width), (g.height, g.width)
        # Backward-input is the forward correlation with the rotated filter,
        # offset by the dilated span - 1 - padding.
        offset = (
            (g.filter_height - 1) * g.dilation_h - g.pad_top,
            (g.filter_width - 1) * g.dilation_w - g.pad_left,
        )
        planes = g.batch * g.channels
    else:
        src_size, dst_size = (g.height, g.width), (g.out_height, g.out_width)
        offset = (g.pad_top, g.pad_left)
        planes = g.batch * g.channels * g.multiplier
    index = _launch.index_type(src.size, dst.size)
    kernel = _compile.get_kernel(
        KERNEL_FILE, _expression(_TILED, dst.dtype, _template_size(g), index, backward)
    )
    tiles = -(-dst_size[0] // _TILE) * -(-dst_size[1] // _TILE)
    kernel(
        (tiles, min(planes, _launch.MAX_GRID_Y)), (_TILE, 8),
        (src, weight, _launch.pointer_or_null(bias), dst, i32(g.batch), i32(g.channels),
         i32(g.multiplier), i32(src_size[0]), i32(src_size[1]), i32(dst_size[0]),
         i32(dst_size[1]), i32(offset[0]), i32(offset[1]), i32(g.dilation_h), i32(g.dilation_w)),
        shared_mem=_tile_bytes(g, dst.dtype),
    )


def _kernel(name, dtype, geometry, index):
    expression = _expression(name, dtype, _template_size(geometry), index)
    return _compile.get_kernel(KERNEL_FILE, expression)


def _geometry_args(g):
    return (
        i32(g.batch), i32(g.channels), i32(g.height), i32(g.width), i32(g.multiplier),
        i32(g.out_height), i32(g.out_width), i32(g.filter_height), i32(g.filter_width),
        i32(g.stride_h), i32(g.stride_w), i32(g.pad_top), i32(g.pad_left),
        i32(g.dilation_h), i32(g.dilation_w),
    )


def depthwise_conv2d(x, weight, bias=None, *, stride=1, padding=0, dilation=1, layout="NCHW", out=None):
    """Depthwise 2-D convolution (cross-correlation, as ``torch.nn.functional.conv2d``
    with ``groups=C``).

    Args:
        x: cupy.ndarray (N, C, H, W), float16, float32, float64 or bfloat16.
        weight: (C*M, 1, KH, KW), same dtype; M >= 1 is the depth multiplier and
            output channel ``c*M + m`` reads input channel ``c``.
        bias: optional (C*M,), same dtype.
        stride, dilation: int or (h, w), >= 1.
        padding: int, (h, w), ((top, bottom), (left, right)), ``"same"``
            (stride 1 only; an odd total puts the extra row/column after) or
            ``"valid"``.
        layout: ``"NCHW"`` (the only layout implemented so far).
        out: optional C-contiguous (N, C*M, OH, OW) array of x's dtype, not
            overlapping x, weight or bias (the op cannot run in place).

    Returns:
        (N, C*M, OH, OW) with ``OH = (H + pad_top + pad_bottom - dilation_h*(KH-1) - 1) // stride_h + 1``
        (likewise OW).  Half types accumulate in float32.

    Example:
        >>> x = cupy.random.randn(8, 32, 56, 56, dtype=cupy.float32)
        >>> w = cupy.random.randn(32, 1, 3, 3, dtype=cupy.float32)
        >>> depthwise_conv2d(x, w, padding=1).shape
        (8, 32, 56, 56)
    """
    g = check_forward_args(x, weight, bias, stride, padding, dilation, layout, out)
    shape = (g.batch, g.channels * g.multiplier, g.out_height, g.out_width)
    with x.device:
        out = _validate.empty_unless_given(out, shape, x.dtype)
        if out.size == 0:
            return out
        if _use_tiled(g, x.dtype):
            _launch_tiled(x, weight, bias, out, g, backward=False)
            return out
        kernel = _kernel("dwgn_dwconv2d_fwd", x.dtype, g, _launch.index_type(x.size, out.size))
        kernel(
            _launch.grid_planes(g.batch * g.channels * g.multiplier, g.out_height * g.out_width),
            (_launch.BLOCK,),
            (x, weight, _launch.pointer_or_null(bias), out) + _geometry_args(g),
        )
    return out


def depthwise_conv2d_backward_input(grad_out, weight, input_shape, *, stride=1, padding=0, dilation=1, layout="NCHW", out=None):
    """Gradient of :func:`depthwise_conv2d` with respect to its input.

    Args:
        grad_out: (N, C*M, OH, OW), the gradient of the forward output.
        weight: (C*M, 1, KH, KW), same dtype.
        input_shape: (N, C, H, W) of the forward input (H and W are needed
            because several input sizes map to one output size when stride > 1).
        stride, padding, dilation, layout: as in the forward call.
        out: optional C-contiguous array of shape ``input_shape``; it is
            overwritten, it does not need to be zeroed.

    Returns:
        grad_in of shape ``input_shape`` and grad_out's dtype.

    Example:
        >>> dx = depthwise_conv2d_backward_input(dy, w, x.shape, padding=1)
    """
    g = check_backward_input_args(grad_out, weight, input_shape, stride, padding, dilation, layout, out)
    with grad_out.device:
        out = _validate.empty_unless_given(out, tuple(input_shape), grad_out.dtype)
        if out.size == 0:
            return out
        if _use_tiled(g, grad_out.dtype):
            _launch_tiled(grad_out, weight, None, out, g, backward=True)
            return out
        index = _launch.index_type(grad_out.size, out.size)
        kernel = _kernel("dwgn_dwconv2d_bwd_input", grad_out.dtype, g, index)
        kernel(
            _launch.grid_planes(g.batch * g.channels, g.height * g.width),
            (_launch.BLOCK,),
            (grad_out, weight, out) + _geometry_args(g),
        )
    return out


def depthwise_conv2d_backward_weight(grad_out, x, weight_shape, *, stride=1, padding=0, dilation=1, layout="NCHW", out=None):
    """Gradient of :func:`depthwise_conv2d` with respect to its weight.

    Deterministic: no atomics; the same inputs give bit-identical results on
    every run (the reduction order depends on the shapes only).

    Args:
        grad_out: (N, C*M, OH, OW), the gradient of the forward output.
        x: (N, C, H, W), the forward input, same dtype.
        weight_shape: (C*M, 1, KH, KW).
        stride, padding, dilation, layout: as in the forward call.
        out: optional C-contiguous array of shape ``weight_shape``.

    Returns:
        grad_weight of shape ``weight_shape`` and x's dtype (summed in float32
        for half types, float64 for float64).  The bias gradient is
        ``grad_out.sum(axis=(0, 2, 3))``.

    Example:
        >>> dw = depthwise_conv2d_backward_weight(dy, x, w.shape, padding=1)
    """
    g = check_backward_weight_args(grad_out, x, weight_shape, stride, padding, dilation, layout, out)
    out_channels = g.channels * g.multiplier
    taps = g.filter_height * g.filter_width
    with x.device:
        out = _validate.empty_unless_given(out, tuple(weight_shape), x.dtype)
        if out.size == 0:
            return out
        positions = g.batch * g.out_height * g.out_width
        tap_groups = taps // _taps_per_block(x.dtype, _template_size(g))
        num_splits = max(1, min(
            -(-_TARGET_BLOCKS // (out_channels * tap_groups)),
            positions // _MIN_POSITIONS_PER_BLOCK,
            65535,
        ))
        partial = cupy.empty(
            (out_channels, num_splits, taps), dtype=_dtypes.accumulator_dtype(x.dtype)
        )
        index = _launch.index_type(grad_out.size, x.size)
        kernel = _kernel("dwgn_dwconv2d_bwd_weight_partial", x.dtype, g, index)
        kernel(
            (out_channels, num_splits, tap_groups), (_launch.BLOCK,),
            (grad_out, x, partial) + _geometry_args(g),
        )
        finalize = _compile.get_kernel(
            KERNEL_FILE, _compile.name_expression(_FINALIZE, _dtypes.ctype(x.dtype))
        )
        finalize(
            _launch.grid_1d(out.size), (_launch.BLOCK,),
            (partial, out, i32(out_channels), i32(taps), i32(num_splits)),
        )
    return out


# Argument checks: duck-typed over the array class (``kind``), so
# cupy_dwgn.host runs the very same checks on NumPy inputs before any transfer.

def check_forward_args(x, weight, bias, stride, padding, dilation, layout, out, kind=None):
    """Validate depthwise_conv2d's arguments; returns the ConvGeometry."""
    _validate.check_layout(layout)
    _validate.check_array("x", x, 4, "(N, C, H, W)", kind)
    _validate.check_array("weight", weight, 4, "(C*M, 1, KH, KW)", kind)
    _validate.check_same_dtype("weight", weight, "x", x)
    g = _validate.conv_geometry(x.shape, weight.shape, stride, padding, dilation)
    _check_limits("x", g)
    out_channels = g.channels * g.multiplier
    if bias is not None:
        _validate.check_array("bias", bias, 1, "(C*M,)", kind)
        _validate.check_same_dtype("bias", bias, "x", x)
        _validate.check_shape("bias", bias, (out_channels,), " (C*M,)")
    _validate.check_out(out, (g.batch, out_channels, g.out_height, g.out_width), x.dtype, kind)
    _validate.check_same_device(x=x, weight=weight, bias=bias, out=out)
    _validate.check_no_overlap(out, x=x, weight=weight, bias=bias)
    return g


def check_backward_input_args(grad_out, weight, input_shape, stride, padding, dilation, layout, out, kind=None):
    """Validate depthwise_conv2d_backward_input's arguments; returns the ConvGeometry."""
    _validate.check_layout(layout)
    _validate.check_array("grad_out", grad_out, 4, "(N, C*M, OH, OW)", kind)
    _validate.check_array("weight", weight, 4, "(C*M, 1, KH, KW)", kind)
    _validate.check_same_dtype("weight", weight, "grad_out", grad_out)
    input_shape = _validate.check_int_shape("input_shape", input_shape, 4)
    g = _validate.conv_geometry(input_shape, weight.shape, stride, padding, dilation, "input_shape")
    _check_limits("input_shape", g)
    _check_grad_out(grad_out, g)
    _validate.check_out(out, input_shape, grad_out.dtype, kind)
    _validate.check_same_device(grad_out=grad_out, weight=weight, out=out)
    _validate.check_no_overlap(out, grad_out=grad_out, weight=weight)
    return g


def check_backward_weight_args(grad_out, x, weight_shape, stride, padding, dilation, layout, out, kind=None):
    """Validate depthwise_conv2d_backward_weight's arguments; returns the ConvGeometry."""
    _validate.check_layout(layout)
    _validate.check_array("grad_out", grad_out, 4, "(N, C*M, OH, OW)", kind)
    _validate.check_array("x", x, 4, "(N, C, H, W)", kind)
    _validate.check_same_dtype("x", x, "grad_out", grad_out)
    weight_shape = _validate.check_int_shape("weight_shape", weight_shape, 4)
    g = _validate.conv_geometry(x.shape, weight_shape, stride, padding, dilation)
    _check_limits("x", g)
    _check_grad_out(grad_out, g)
    _validate.check_out(out, weight_shape, x.dtype, kind)
    _validate.check_same_device(grad_out=grad_out, x=x, out=out)
    _validate.check_no_overlap(out, grad_out=grad_out, x=x)
    return g


def _check_limits(name, g):
    """Sizes the kernels' 32-bit in-plane indexing and grid can take."""
    _launch.check_plane_size(name, g.height * g.width)
    _launch.check_plane_size(name, g.out_height * g.out_width)
    taps = g.filter_height * g.filter_width
    if g.channels * g.multiplier * taps >= _launch.INT32_LIMIT or taps > _launch.MAX_GRID_Y:
        raise ValueError(
            f"weight: expected fewer than 2**31 elements and at most {_launch.MAX_GRID_Y} taps "
            f"per filter, got {g.channels * g.multiplier} filters of "
            f"{g.filter_height}x{g.filter_width}"
        )
    if g.batch * g.channels * g.multiplier >= _launch.INT32_LIMIT:
        raise ValueError(f"{name}: expected N*C*M < 2**31, got {g.batch * g.channels * g.multiplier}")


def _check_grad_out(grad_out, g):
    expected = (g.batch, g.channels * g.multiplier, g.out_height, g.out_width)
    _validate.check_shape("grad_out", grad_out, expected, " (the forward output shape)")
