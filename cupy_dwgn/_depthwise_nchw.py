"""NCHW depthwise kernels of kernels/depthwise_conv2d.cu: the general ones
that serve every geometry (direct forward / backward-input, the stride-1
shared-memory tiled kernel, the two-pass deterministic weight gradient).
The faster special-purpose kernels (_depthwise_nchw_window, _nchw_large,
_nchw_wgrad) take the shapes they serve first; cupy_dwgn.depthwise picks."""

import functools

import numpy

from . import _compile, _dtypes, _launch
from ._launch import i32

KERNEL_FILE = "depthwise_conv2d.cu"

#: Filter sizes with a compile-time specialization (taps fully unrolled);
#: every other size runs the generic kernel (template sizes 0, 0).
SPECIALIZED_FILTER_SIZES = ((3, 3), (5, 5), (7, 7))

_FINALIZE = "dwgn_dwconv2d_bwd_weight_finalize"
# Its block: up to 8 warps over 32 weight elements (the kernel's warp_sums
# holds 8), one per split when there are fewer (no idle warps: a 31x31 weight
# gradient's finalize is 15376 blocks of 3 splits).
_FINALIZE_WARPS = 8
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
_BWD_INPUT = "dwgn_dwconv2d_bwd_input"
# Stride-2 backward-input by phase decomposition (specialized sizes, dilation 1):
# a thread writes _phase_blocks(dtype) 2x2 blocks of grad_in side by side
# (kernel: V): 2, but 1 for float64 (at 2 its 5x5 spilled on sm_80).
_PHASE = "dwgn_dwconv2d_bwd_input_stride2"

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
                    if kernel == _BWD_INPUT and size != (0, 0):
                        specs.append((KERNEL_FILE, _phase_expression(dtype, size, index)))
                    if kernel in _TILED_OPS and size != (0, 0):
                        specs.append((KERNEL_FILE, _expression(_TILED, dtype, size, index, _TILED_OPS[kernel])))
        if "dwgn_dwconv2d_bwd_weight_partial" in kernels:
            specs.append((KERNEL_FILE, _compile.name_expression(_FINALIZE, ctype)))
    return specs


def _phase_blocks(dtype):
    return 1 if numpy.dtype(dtype).itemsize == 8 else 2


def _phase_expression(dtype, size, index):
    return _compile.name_expression(_PHASE, _dtypes.ctype(dtype), *size, _phase_blocks(dtype), index)


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


@functools.lru_cache(maxsize=1024)
def _tiled_plan(g, dtype, index, backward):
    """The stride-1 shared-memory kernel (see depthwise_conv2d.cu)."""
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
    tiles = -(-dst_size[0] // _TILE) * -(-dst_size[1] // _TILE)
    return _launch.Launch(
        KERNEL_FILE, _expression(_TILED, dtype, _template_size(g), index, backward),
        (tiles, min(planes, _launch.MAX_GRID_Y)), (_TILE, 8), _tile_bytes(g, dtype),
        (i32(g.batch), i32(g.channels), i32(g.multiplier), i32(src_size[0]), i32(src_size[1]),
         i32(dst_size[0]), i32(dst_size[1]), i32(offset[0]), i32(offset[1]), i32(g.dilation_h),
         i32(g.dilation_w)),
    )


def _geometry_args(g):
    return (
        i32(g.batch), i32(g.channels), i32(g.height), i32(g.width), i32(g.multiplier),
        i32(g.out_height), i32(g.out_width), i32(g.filter_height), i32(g.filter_width),
        i32(g.stride_h), i32(g.stride_w), i32(g.pad_top), i32(g.pad_left),
        i32(g.dilation_h), i32(g.dilation_w),
    )


@functools.lru_cache(maxsize=1024)
def forward_plan(g, dtype, index):
    """Tiled kernel at stride 1 (specialized sizes), else the direct kernel."""
    if _use_tiled(g, dtype):
        return _tiled_plan(g, dtype, index, False)
    return _launch.Launch(
        KERNEL_FILE, _expression("dwgn_dwconv2d_fwd", dtype, _template_size(g), index),
        _launch.grid_planes(g.batch * g.channels * g.multiplier, g.out_height * g.out_width),
        (_launch.BLOCK,), 0, _geometry_args(g),
    )


@functools.lru_cache(maxsize=1024)
def backward_input_plan(g, dtype, index):
    """Tiled kernel at stride 1 (specialized sizes), the phase kernel at
    stride 2 (specialized sizes, dilation 1), else the direct gather kernel.
    Returns (launch, whether it takes the forward's (src, weight, bias, dst)
    arguments: the tiled kernel is the forward kernel with a rotated filter)."""
    if _use_tiled(g, dtype):
        return _tiled_plan(g, dtype, index, True), True
    size = _template_size(g)
    if (g.stride_h, g.stride_w, g.dilation_h, g.dilation_w) == (2, 2, 1, 1) and size != (0, 0):
        # Items (plane, row pair, _phase_blocks 2x2 column blocks) in one flat
        # range, a thread each (grid_1d: past MAX_BLOCKS blocks the kernel's
        # grid-stride loop takes the rest).
        column_blocks = -(-g.width // 2)
        blocks_across = -(-column_blocks // _phase_blocks(dtype))
        per_plane = -(-g.height // 2) * blocks_across
        items = g.batch * g.channels * per_plane
        return _launch.Launch(
            KERNEL_FILE, _phase_expression(dtype, size, index),
            _launch.grid_1d(items), (_launch.BLOCK,), 0,
            (i32(g.channels), i32(g.height), i32(g.width), i32(g.multiplier), i32(g.out_height),
             i32(g.out_width), i32(g.pad_top), i32(g.pad_left), i32(blocks_across), i32(per_plane),
             _launch.index_scalar(index, items)),
        ), False
    return _launch.Launch(
        KERNEL_FILE, _expression("dwgn_dwconv2d_bwd_input", dtype, size, index),
        _launch.grid_planes(g.batch * g.channels, g.height * g.width), (_launch.BLOCK,), 0,
        _geometry_args(g),
    ), False


@functools.lru_cache(maxsize=1024)
def backward_weight_plan(g, dtype, index):
    """Two passes: per-(channel, split) partial sums, then a split-order sum;
    returns the two launches and the (shape, dtype) of the partial sums."""
    out_channels = g.channels * g.multiplier
    taps = g.filter_height * g.filter_width
    positions = g.batch * g.out_height * g.out_width
    tap_groups = taps // _taps_per_block(dtype, _template_size(g))
    num_splits = max(1, min(
        -(-_TARGET_BLOCKS // (out_channels * tap_groups)),
        positions // _MIN_POSITIONS_PER_BLOCK,
        65535,
    ))
    partial = _launch.Launch(
        KERNEL_FILE, _expression("dwgn_dwconv2d_bwd_weight_partial", dtype, _template_size(g), index),
        (out_channels, num_splits, tap_groups), (_launch.BLOCK,), 0, _geometry_args(g),
    )
    finalize = finalize_launch(dtype, out_channels, taps, num_splits, num_splits * taps, taps, 1)
    return partial, finalize, ((out_channels, num_splits, taps), _dtypes.accumulator_dtype(dtype))


@functools.lru_cache(maxsize=256)
def finalize_launch(dtype, out_channels, taps, num_splits, channel_stride, split_stride, tap_stride):
    """The fixed-order sum of every weight-gradient kernel (NCHW and NHWC):
    grad_weight[oc, tap] = sum_s partial[s*split_stride + oc*channel_stride + tap*tap_stride],
    a block of min(8, num_splits) warps per 32 weight elements (the warps
    split the splits; with one split per warp the sum is the same as with 8
    warps, the idle ones adding zero)."""
    i64 = numpy.int64
    groups = -(-out_channels * taps // 32)
    warps = max(1, min(_FINALIZE_WARPS, num_splits))
    return _launch.Launch(
        KERNEL_FILE, _compile.name_expression(_FINALIZE, _dtypes.ctype(dtype)),
        (max(1, min(groups, _launch.MAX_BLOCKS)),), (32 * warps,), 0,
        (i32(out_channels), i32(taps), i32(num_splits), i64(split_stride), i64(channel_stride), i64(tap_stride)),
        programmatic=True,  # placed while the weight-gradient kernel runs its last blocks
    )
