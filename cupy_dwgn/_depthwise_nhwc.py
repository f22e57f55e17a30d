"""Channels-last (NHWC) depthwise convolution: launch plans for the kernels of
kernels/depthwise_nhwc.cu.

cupy_dwgn.depthwise validates the arguments, makes the input's device current
and allocates ``out`` (non-empty), then calls forward / backward_input /
backward_weight here.  Each builds its launches through an lru_cached plan
function keyed on (geometry, dtype, has_bias, index type, 16-byte alignment).
"""

import functools
import math

import numpy

from . import _compile, _depthwise_nchw, _dtypes, _launch
from ._launch import i32

KERNEL_FILE = "depthwise_nhwc.cu"

#: Filter sizes with a compile-time specialization; every other size runs the
#: generic kernel (template sizes 0, 0).
SPECIALIZED_FILTER_SIZES = ((3, 3), (5, 5), (7, 7))

_CONV = "dwgn_dwconv_nhwc"
_TILED = "dwgn_dwconv_nhwc_tiled"
_GATHER = "dwgn_dwconv_nhwc_bwd_input"
_WGRAD = "dwgn_dwconv_nhwc_bwd_weight"
_WGRAD_TILED = "dwgn_dwconv_nhwc_bwd_weight_tiled"

_OPS = ("depthwise_conv2d", "depthwise_conv2d_backward_input", "depthwise_conv2d_backward_weight")
_VECTOR_BYTES = 16
_MAX_THREADS = 256
# Dynamic shared memory a block may use without opting in (weights staging).
_SHARED_LIMIT = 48 * 1024
# About this many blocks per launch: enough waves on any GPU that the tail is
# short, few enough that each block amortizes staging its filter tile.  A
# constant (not the device's SM count) so the weight-gradient split, which
# fixes the summation order, depends on the shape only.
_TARGET_BLOCKS = 2048
# Weight gradient: each thread sums at least this many items of its split.
_MIN_ITEMS_PER_THREAD = 4


def _vec(dtype):
    """Elements in one 16-byte vector: 4 float32, 8 float16/bfloat16, 2 float64."""
    return _VECTOR_BYTES // numpy.dtype(dtype).itemsize


def _acc_bytes(dtype):
    return _dtypes.accumulator_dtype(dtype).itemsize


def _template_size(kh, kw):
    return (kh, kw) if (kh, kw) in SPECIALIZED_FILTER_SIZES else (0, 0)


# --- Tile rule (the one place that picks kernel tiles; no user tuning) ------
#
# conv (forward, stride-1 backward-input): an item is RH output rows x TW
# output columns.  Specialized 3x3/5x5/7x7: RH = 2 (an input row loaded once
# serves two output rows; RH = 1 for half types, whose 8-float vectors would
# spill), TW = 4 (each input column serves up to 4 outputs; float32 7x7
# with TW = 8 spills on sm_80 with 64-bit indices).  Generic
# (run-time size): RH = 1, TW = 8 (float32/float64) or 4 (half types, 8
# float accumulators per vector), a TW-slot register ring along the taps.
# Scalar (VEC = 1) kernels are generic, TW = 8.
def _conv_tile(template_size, dtype, vec):
    if template_size == (0, 0):
        return (8 if vec == 1 or vec * _acc_bytes(dtype) <= 16 else 4), 1
    if _vec(dtype) == 8:
        return 4, 1  # 8 float accumulators per vector: RH = 2 spills
    return 4, 2


# backward-weight: accumulators per thread = TAPS x (KW) x VEC, budget 56
# 32-bit registers (more spills under NVRTC): specialized sizes hold TAPS
# whole filter rows (float32 3x3: 3 rows, 5x5: 2, 7x7: 2; half types 3x3: 2,
# 5x5/7x7: 1; float64 as float32); the filter rows are split over blockIdx.x
# "tap groups" when they do not all fit.  Generic: TAPS consecutive taps
# (48 registers vector, 32 scalar), TW = 1.
_WGRAD_ACC_REGISTERS = 56
_WGRAD_TW = 4


def _wgrad_tile(template_size, dtype, vec):
    """(TW, TAPS) of the weight-gradient kernel."""
    words = vec * _acc_bytes(dtype) // 4  # 32-bit registers per accumulated vector
    kh, kw = template_size
    if kh == 0:
        return 1, max(1, (32 if vec == 1 else 48) // words)
    return _WGRAD_TW, max(1, min(kh, _WGRAD_ACC_REGISTERS // (kw * words)))


def _bool(value):
    return "true" if value else "false"


def _conv_expr(dtype, size, vec, backward, index):
    tw, rh = _conv_tile(size, dtype, vec)
    return _compile.name_expression(
        _CONV, _dtypes.ctype(dtype), *size, vec, tw, rh, _bool(backward), index
    )


# Tiled conv (specialized sizes, dilation 1, stride 1 or 2, vector): RO
# output rows per thread.  4 for float32/float64 at stride 1; 2 for half types
# (8 float accumulators per vector) and stride 2 (a longer input window), which
# spill at RO = 4 under the 3-blocks-per-SM register cap (80; float and double
# with 32-bit indices run 4 blocks an SM at 64: the kernel's tiled_min_blocks).
_TILED_STRIDES = (1, 2)
_TILED_MAX_CV = 8  # channel vectors per block: 128 bytes of each pixel
_TILED_THREADS = 256
_TILED_COLUMNS = 8  # output columns per tile


def _tiled_rows(dtype, stride):
    return 4 if _vec(dtype) <= 4 and stride == 1 else 2


def _tiled_expr(dtype, size, stride, index):
    return _compile.name_expression(
        _TILED, _dtypes.ctype(dtype), *size, _vec(dtype), stride, _tiled_rows(dtype, stride), index
    )


def _gather_expr(dtype, vec, index):
    return _compile.name_expression(_GATHER, _dtypes.ctype(dtype), vec, index)


def _wgrad_expr(dtype, size, vec, index):
    tw, taps = _wgrad_tile(size, dtype, vec)
    return _compile.name_expression(_WGRAD, _dtypes.ctype(dtype), *size, vec, tw, taps, index)


def _wgrad_tiled_expr(dtype, size, stride, index):
    return _compile.name_expression(_WGRAD_TILED, _dtypes.ctype(dtype), *size, _vec(dtype), stride, index)


def specializations(op=None, dtypes=None, filter_sizes=None, large_index=(False, True)):
    """``(file, name expression)`` for each NHWC kernel ``op`` can launch
    (default: all three ops); selection as cupy_dwgn.depthwise.specializations.

    Per dtype and index width: tiled 6 (3x3, 5x5, 7x7 x stride 1, 2; stride 1
    also serves backward-input), forward 5 (3x3, 5x5, 7x7, generic vector;
    generic scalar), backward-input 6 (stride-1 vector conv for the 4 sizes;
    gather vector and scalar), backward-weight 11 (tiled: 3x3, 5x5, 7x7 x
    stride 1, 2; register kernel: 3x3, 5x5, 7x7, generic vector, generic
    scalar) (+ the shared finalize of depthwise_conv2d.cu per dtype).
    """
    ops = _OPS if op is None else (op,)
    dtypes = tuple(_dtypes.CTYPES) if dtypes is None else tuple(numpy.dtype(d) for d in dtypes)
    if filter_sizes is None:
        sizes = SPECIALIZED_FILTER_SIZES + ((0, 0),)
    else:
        sizes = tuple(dict.fromkeys(_template_size(*map(int, s)) for s in filter_sizes))
    large_index = (large_index,) if isinstance(large_index, bool) else tuple(large_index)
    specs = []
    for dtype in dtypes:
        vec = _vec(dtype)
        for large in large_index:
            index = "long long" if large else "int"
            for size in sizes:
                if size != (0, 0) and ({"depthwise_conv2d", "depthwise_conv2d_backward_input"} & set(ops)):
                    for stride in _TILED_STRIDES:
                        if stride == 1 or "depthwise_conv2d" in ops:
                            specs.append(_tiled_expr(dtype, size, stride, index))
                if "depthwise_conv2d" in ops:
                    specs.append(_conv_expr(dtype, size, vec, False, index))
                if "depthwise_conv2d_backward_input" in ops:
                    specs.append(_conv_expr(dtype, size, vec, True, index))
                if "depthwise_conv2d_backward_weight" in ops:
                    if size != (0, 0):
                        for stride in _TILED_STRIDES:
                            specs.append(_wgrad_tiled_expr(dtype, size, stride, index))
                    specs.append(_wgrad_expr(dtype, size, vec, index))
            # Scalar/any-stride kernels serve every filter size.
            if "depthwise_conv2d" in ops:
                specs.append(_conv_expr(dtype, (0, 0), 1, False, index))
            if "depthwise_conv2d_backward_input" in ops:
                specs.append(_gather_expr(dtype, vec, index))
                specs.append(_gather_expr(dtype, 1, index))
            if "depthwise_conv2d_backward_weight" in ops:
                specs.append(_wgrad_expr(dtype, (0, 0), 1, index))
    specs = [(KERNEL_FILE, e) for e in dict.fromkeys(specs)]
    if "depthwise_conv2d_backward_weight" in ops:
        specs += _depthwise_nchw.specializations("depthwise_conv2d_backward_weight", dtypes, [(0, 0)], ())
    return specs


# --- plans -----------------------------------------------------------------

def _block(channel_vectors):
    """(BX, BY): BX channel vectors per block (the channel tiles split the
    vectors into nearly equal tiles of at most 32, so C = 144 float32 -> 2
    tiles of 18, not 32 + 4), BY = items side by side, <= 256 threads."""
    tiles = -(-channel_vectors // 32)
    bx = -(-channel_vectors // tiles)
    return tiles, bx, max(1, _MAX_THREADS // bx)


def _blocks_y(items, by, per_x_blocks):
    """Blocks along y: about _TARGET_BLOCKS in all, each with >= 1 item row."""
    return max(1, min(-(-items // by), max(1, _TARGET_BLOCKS // per_x_blocks), _launch.MAX_GRID_Y))


def _vector_ok(channels, multiplier, dtype, aligned):
    return multiplier == 1 and channels % _vec(dtype) == 0 and aligned


def _tiled_cv(vectors):
    """Channel vectors per tiled block: <= _TILED_MAX_CV (and >= 4 when there
    are more than 4), the one wasting the fewest vector slots in the last
    slice (C = 144 float32: 36 vectors -> 6 slices of 6, not 5 of 8)."""
    if vectors <= _TILED_MAX_CV:
        return vectors
    return min(range(_TILED_MAX_CV, 3, -1), key=lambda cv: (-(-vectors // cv) * cv, -cv))


def _tiled_launch(g, dtype, index, aligned, backward):
    """The shared-memory tiled conv launch, or None where it does not apply
    (scalar path, generic filter size, dilation, stride other than 1/2, or
    stride 2 backward) or its smallest tile does not fit in 48 KB."""
    size = (g.filter_height, g.filter_width)
    stride = g.stride_h
    if (not _vector_ok(g.channels, g.multiplier, dtype, aligned)
            or size not in SPECIALIZED_FILTER_SIZES
            or (g.dilation_h, g.dilation_w) != (1, 1)
            or g.stride_w != stride or stride not in (_TILED_STRIDES if not backward else (1,))):
        return None
    kh, kw = size
    if backward:
        src_h, src_w, dst_h, dst_w = g.out_height, g.out_width, g.height, g.width
        offset = (kh - 1 - g.pad_top, kw - 1 - g.pad_left)
    else:
        src_h, src_w, dst_h, dst_w = g.height, g.width, g.out_height, g.out_width
        offset = (g.pad_top, g.pad_left)
    vec = _vec(dtype)
    rows = _tiled_rows(dtype, stride)
    vectors = g.channels // vec
    cv = _tiled_cv(vectors)
    slices = -(-vectors // cv)
    tile_ow = min(_TILED_COLUMNS, dst_w)
    row_groups_needed = -(-dst_h // rows)
    max_groups = max(1, min(_TILED_THREADS // (cv * tile_ow), row_groups_needed))

    def shared_bytes(groups):
        in_h = (groups * rows - 1) * stride + kh
        in_w = (tile_ow - 1) * stride + kw
        return cv * vec * (kh * kw * _acc_bytes(dtype) + in_h * in_w * numpy.dtype(dtype).itemsize)

    while max_groups > 1 and shared_bytes(max_groups) > _SHARED_LIMIT:
        max_groups -= 1
    if shared_bytes(max_groups) > _SHARED_LIMIT:
        return None
    tiles_h = -(-row_groups_needed // max_groups)
    groups = -(-row_groups_needed // tiles_h)  # balanced: the last tile is nearly full
    tiles_w = -(-dst_w // tile_ow)
    blocks = g.batch * slices * tiles_h * tiles_w
    if blocks >= 2**31:
        return None
    scalars = (
        i32(src_h), i32(src_w), i32(dst_h), i32(dst_w), i32(g.channels),
        i32(offset[0]), i32(offset[1]), i32(1 if backward else 0), i32(tile_ow),
        i32(tiles_h), i32(tiles_w), i32(slices),
    )
    return _launch.Launch(
        KERNEL_FILE, _tiled_expr(dtype, size, stride, index), (blocks,),
        (cv, tile_ow * groups), shared_bytes(groups), scalars,
    )


def _conv_launch(g, dtype, index, aligned, backward):
    """Forward (backward=False) or stride-1 backward-input conv launch."""
    tiled = _tiled_launch(g, dtype, index, aligned, backward)
    if tiled is not None:
        return tiled
    if backward:
        src_h, src_w, dst_h, dst_w = g.out_height, g.out_width, g.height, g.width
        dst_channels = g.channels
        offset = ((g.filter_height - 1) * g.dilation_h - g.pad_top,
                  (g.filter_width - 1) * g.dilation_w - g.pad_left)
        stride = (1, 1)
    else:
        src_h, src_w, dst_h, dst_w = g.height, g.width, g.out_height, g.out_width
        dst_channels = g.channels * g.multiplier
        offset = (g.pad_top, g.pad_left)
        stride = (g.stride_h, g.stride_w)
    vec = _vec(dtype) if _vector_ok(g.channels, g.multiplier, dtype, aligned) else 1
    size = _template_size(g.filter_height, g.filter_width) if vec > 1 else (0, 0)
    tw, rh = _conv_tile(size, dtype, vec)
    tiles, bx, by = _block(dst_channels // vec)
    items = g.batch * -(-dst_h // rh) * -(-dst_w // tw)
    blocks_y = _blocks_y(items, by, tiles)
    per_block = -(-items // blocks_y)
    blocks_y = -(-items // per_block)
    tile_bytes = bx * vec * _acc_bytes(dtype)
    if size != (0, 0):
        kw_chunk = g.filter_width
        shared = g.filter_height * g.filter_width * tile_bytes
    else:
        kw_chunk = max(1, min(g.filter_width, _SHARED_LIMIT // tile_bytes))
        shared = kw_chunk * tile_bytes
    scalars = (
        i32(g.batch), i32(src_h), i32(src_w), i32(dst_h), i32(dst_w), i32(dst_channels),
        i32(1 if backward else g.multiplier), i32(g.filter_height), i32(g.filter_width),
        i32(stride[0]), i32(stride[1]), i32(offset[0]), i32(offset[1]),
        i32(g.dilation_h), i32(g.dilation_w), i32(kw_chunk),
        _launch.index_scalar(index, items), _launch.index_scalar(index, per_block),
    )
    return _launch.Launch(
        KERNEL_FILE, _conv_expr(dtype, size, vec, backward, index),
        (tiles, blocks_y), (bx, by), shared, scalars,
    )


# Kernel and tile per shape (forward):
#   vector case (below) with a 3x3/5x5/7x7 filter, dilation 1 and stride 1 or
#   2 (both axes) -> the shared-memory tiled kernel (_tiled_launch: a block =
#   channel slice of <= 8 vectors x an output tile of 8 columns x groups * RO
#   rows, its input tile + halo copied with cp.async, <= 48 KB); stride-1
#   backward-input takes it too (rotated filter).  Otherwise:
#   M == 1, C % VEC == 0 and x, y 16-byte aligned -> vector kernel (VEC =
#   16 bytes of channels), 3x3/5x5/7x7 specialized (stride/dilation 1:
#   streaming register window over RH x TW = 2x4 outputs, 1x4 for half
#   types; else direct taps), any other size generic (RH=1, TW=8 or 4, register
#   ring along the taps at unit W stride/dilation; valid tap range per output
#   otherwise); anything else -> scalar generic kernel.  Channel tiles of at
#   most 32 vectors (BX), BY = 256 // BX items per step, ~2048 blocks each
#   owning a contiguous item range.
@functools.lru_cache(maxsize=1024)
def forward_plan(g, dtype, index, aligned):
    """The forward launches (src, weight, bias or NULL, dst)."""
    return (_conv_launch(g, dtype, index, aligned, backward=False),)


# Kernel per shape (backward-input); the plan is (Launch, whether it is the
# forward conv kernel, which takes a (null) bias argument):
#   stride 1, M == 1, C % VEC == 0, aligned -> the forward conv kernel on
#   grad_out with the rotated filter (same tiles as forward);
#   otherwise the gather kernel (vector when M == 1, C % VEC == 0 and aligned,
#   scalar else): one grad_in pixel per thread-item, taps stepped by
#   stride / gcd(stride, dilation); weights staged in shared memory when the
#   tile's KH*KW*M weights fit in 48 KB, read from global memory otherwise.
@functools.lru_cache(maxsize=1024)
def backward_input_plan(g, dtype, index, aligned):
    vector = _vector_ok(g.channels, g.multiplier, dtype, aligned)
    if vector and (g.stride_h, g.stride_w) == (1, 1):
        return _conv_launch(g, dtype, index, aligned, backward=True), True
    vec = _vec(dtype) if vector else 1
    tiles, bx, by = _block(g.channels // vec)
    items = g.batch * g.height * g.width
    blocks_y = _blocks_y(items, by, tiles)
    per_block = -(-items // blocks_y)
    blocks_y = -(-items // per_block)
    shared = g.filter_height * g.filter_width * g.multiplier * bx * vec * _acc_bytes(dtype)
    staged = shared <= _SHARED_LIMIT
    gh, gw = math.gcd(g.stride_h, g.dilation_h), math.gcd(g.stride_w, g.dilation_w)
    scalars = (
        i32(g.batch), i32(g.height), i32(g.width), i32(g.channels), i32(g.multiplier),
        i32(g.out_height), i32(g.out_width), i32(g.filter_height), i32(g.filter_width),
        i32(g.stride_h), i32(g.stride_w), i32(g.pad_top), i32(g.pad_left),
        i32(g.dilation_h), i32(g.dilation_w), i32(g.stride_h // gh), i32(g.stride_w // gw),
        i32(g.dilation_h // gh), i32(g.dilation_w // gw), i32(1 if staged else 0),
        _launch.index_scalar(index, items), _launch.index_scalar(index, per_block),
    )
    return _launch.Launch(
        KERNEL_FILE, _gather_expr(dtype, vec, index), (tiles, blocks_y), (bx, by),
        shared if staged else 0, scalars,
    ), False


# Kernel and split per shape (backward-weight):
#   vector case with a 3x3/5x5/7x7 filter, dilation 1 and stride 1 or 2 (both
#   axes) -> the shared-memory tiled kernel (_wgrad_tiled_launch: a block =
#   channel slice of <= 8 vectors x a contiguous range of output tiles of
#   tile_oh x tile_ow pixels, double-buffered cp.async staging, <= 64 KB;
#   splits = ceil(1024 / slices) capped so each block loops over >= 4 tiles).
#   Otherwise the register kernel: vector kernel when M == 1, C % VEC == 0, x and grad_out aligned
#   (3x3/5x5/7x7 specialized: TW = 4 output columns per item, TAPS filter rows
#   per tap group, see _wgrad_tile; other sizes generic, TAPS taps per group);
#   scalar generic kernel otherwise.  Items = output-row strips; splits =
#   ceil(_TARGET_BLOCKS / (channel tiles * tap groups)), capped so each thread
#   gets >= _MIN_ITEMS_PER_THREAD items.  Both depend on the shape only: the
#   partial sums and their finalize order are bit-identical run to run.
# Tiled weight gradient (_wgrad_tiled_launch): shared memory per block (two
# tile buffers; 3 blocks fit in an SM's 228 KB), the block count it aims at
# (a constant, so the split count depends on the shape only) and the fewest
# tiles a block loops over (the double buffering needs a few).
_WGRAD_TILED_SHARED = 64 * 1024
_WGRAD_TILED_BLOCKS = 1024
_WGRAD_TILED_MIN_TILES = 4
_WGRAD_TILED_MAX_COLUMNS = 32


def _wgrad_tiled_launch(g, dtype, index, aligned):
    """(partial launch, splits) of the shared-memory tiled weight gradient, or
    None where it does not apply (scalar path, generic size, dilation, stride
    other than 1/2 or unequal strides) or no tile fits."""
    size = (g.filter_height, g.filter_width)
    stride = g.stride_h
    if (not _vector_ok(g.channels, g.multiplier, dtype, aligned)
            or size not in SPECIALIZED_FILTER_SIZES
            or (g.dilation_h, g.dilation_w) != (1, 1)
            or g.stride_w != stride or stride not in _TILED_STRIDES):
        return None
    kh, kw = size
    vec = _vec(dtype)
    vectors = g.channels // vec
    cv = _tiled_cv(vectors)
    slices = -(-vectors // cv)
    pixel_bytes = cv * _VECTOR_BYTES

    def shared_bytes(oh, ow):
        # Two buffers of (input tile + halo, grad_out tile); the final
        # reduction (blockDim.y rows of the slice in Acc) reuses them.
        x_pixels = ((oh - 1) * stride + kh) * ((ow - 1) * stride + kw)
        return max(2 * (x_pixels + oh * ow) * pixel_bytes, oh * kh * cv * vec * _acc_bytes(dtype))

    # Tile: blockDim.y = tile_oh * KH threads per channel vector (<= 256
    # threads); the widest tile_ow <= 32 that fits, fewer rows only when not
    # even min(out_w, 4) columns fit; then both balanced (the last tile is
    # nearly full).
    tile_oh = max(1, min(g.out_height, (_MAX_THREADS // cv) // kh))
    while True:
        tile_ow = min(g.out_width, _WGRAD_TILED_MAX_COLUMNS)
        while tile_ow > 1 and shared_bytes(tile_oh, tile_ow) > _WGRAD_TILED_SHARED:
            tile_ow -= 1
        if tile_oh == 1 or tile_ow >= min(g.out_width, 4):
            break
        tile_oh -= 1
    if shared_bytes(tile_oh, tile_ow) > _WGRAD_TILED_SHARED:
        return None
    tiles_h = -(-g.out_height // tile_oh)
    tile_oh = -(-g.out_height // tiles_h)
    tiles_w = -(-g.out_width // tile_ow)
    tile_ow = -(-g.out_width // tiles_w)
    num_tiles = g.batch * tiles_h * tiles_w
    if num_tiles >= 2**31:
        return None
    splits = max(1, min(-(-_WGRAD_TILED_BLOCKS // slices), num_tiles // _WGRAD_TILED_MIN_TILES,
                        _launch.MAX_GRID_Y))
    per_split = -(-num_tiles // splits)
    splits = -(-num_tiles // per_split)  # every split non-empty
    scalars = (
        i32(g.height), i32(g.width), i32(g.channels), i32(g.out_height), i32(g.out_width),
        i32(g.pad_top), i32(g.pad_left), i32(tile_ow), i32(tiles_h), i32(tiles_w),
        i32(num_tiles), i32(per_split),
    )
    return _launch.Launch(
        KERNEL_FILE, _wgrad_tiled_expr(dtype, size, stride, index), (slices, splits),
        (cv, tile_oh * kh), shared_bytes(tile_oh, tile_ow), scalars,
    ), splits


@functools.lru_cache(maxsize=1024)
def backward_weight_plan(g, dtype, index, aligned):
    """((partial launch, finalize launch), (shape, dtype) of the partial sums)."""
    out_channels = g.channels * g.multiplier
    taps = g.filter_height * g.filter_width
    acc = _dtypes.accumulator_dtype(dtype)
    tiled = _wgrad_tiled_launch(g, dtype, index, aligned)
    if tiled is not None:
        partial, splits = tiled
        return with_finalize(partial, dtype, out_channels, taps, splits)
    vec = _vec(dtype) if _vector_ok(g.channels, g.multiplier, dtype, aligned) else 1
    size = _template_size(g.filter_height, g.filter_width) if vec > 1 else (0, 0)
    tw, group_taps = _wgrad_tile(size, dtype, vec)
    groups = -(-(g.filter_height if size != (0, 0) else taps) // group_taps)
    tiles, bx, by = _block(out_channels // vec)
    items = g.batch * g.out_height * -(-g.out_width // tw)
    splits = max(1, min(
        -(-_TARGET_BLOCKS // (tiles * groups)),
        items // (by * _MIN_ITEMS_PER_THREAD),
        _launch.MAX_GRID_Y,
    ))
    per_split = -(-items // splits)
    splits = -(-items // per_split)  # every split non-empty
    grid_x = tiles * groups
    if grid_x >= 2**31:
        raise ValueError(f"weight: too many tap groups ({groups}) for one launch")
    scalars = (
        i32(g.batch), i32(g.height), i32(g.width), i32(out_channels), i32(g.multiplier),
        i32(g.out_height), i32(g.out_width), i32(g.filter_height), i32(g.filter_width),
        i32(g.stride_h), i32(g.stride_w), i32(g.pad_top), i32(g.pad_left),
        i32(g.dilation_h), i32(g.dilation_w), i32(groups),
        _launch.index_scalar(index, items), _launch.index_scalar(index, per_split),
    )
    partial = _launch.Launch(
        KERNEL_FILE, _wgrad_expr(dtype, size, vec, index), (grid_x, splits), (bx, by),
        by * bx * vec * acc.itemsize, scalars,
    )
    return with_finalize(partial, dtype, out_channels, taps, splits)


def with_finalize(partial, dtype, out_channels, taps, splits):
    """``((partial, finalize), (shape, dtype) of the partial sums)`` for a
    weight-gradient ``partial`` launch that writes partial[split][tap][channel]
    in the accumulator type (this module's kernels and
    _depthwise_nhwc_wgrad): the finalize is the shared split-order sum."""
    finalize = _depthwise_nchw.finalize_launch(dtype, out_channels, taps, splits, 1, taps * out_channels, out_channels)
    return (partial, finalize), ((splits, taps, out_channels), _dtypes.accumulator_dtype(dtype))
