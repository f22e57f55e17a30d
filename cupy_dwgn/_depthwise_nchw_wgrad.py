"""Deterministic NCHW depthwise weight gradient (kernels/depthwise_nchw_wgrad.cu).

Kernels and the shapes they serve (plan returns None for everything else, and
the caller keeps dwgn_dwconv2d_bwd_weight_partial):

* ``dwgn_nchw_wgrad_small<T, K, S>``: square K in {3, 5, 7}, equal stride
  S in {1, 2}, dilation 1, any padding.
* ``dwgn_nchw_wgrad_large<T>``: stride 1, dilation 1, any other filter with
  KW >= 8 (lanes own filter columns, so a narrower filter would idle most of a
  warp), when the padded input plane plus the grad_out plane fit 96 KB of
  shared memory as accumulators (e.g. 31x31 on 16x16: 9.8 KB) and the filter
  needs at most 16 warps of 32 x 4 taps.
* ``dwgn_dwconv2d_bwd_weight_finalize<T>`` (depthwise_conv2d.cu, shared by
  every weight gradient): adds the splits in split order; launched
  only when a channel's sum is split over several blocks.

Tiling rule of the small kernel (shape only, never the device, so results are
bit-identical on every GPU):

* A thread owns VW = 16 bytes of output columns (float32 4, float16/bfloat16
  8, float64 2) x R output rows (_item_rows: 2 or 4): one work item.
* A unit is one image's band of output rows.  The whole plane is one band when
  its staged input window fits the 32 KB staging budget; otherwise the plane is
  cut into the fewest equal bands of whole row groups (R rows) that fit (a
  row group must fit, else None).
* A stage = P units staged together and the block's thread count t (64..256,
  a multiple of 32) are chosen together to maximize the share of busy thread
  slots, items / (ceil(items / t) * t) with items = P x items per unit,
  P <= 512 / items per unit and within the budget (ties: larger t, then
  smaller P).  E.g. 56x56 fp32: P 1, 392 items, t 224; 28x28 fp32 5x5:
  P 5, t 256; 7x7 planes fp32: P 32, t 256.
* Splits: ceil(1056 / (C*M)) blocks per output channel (about 8 blocks per
  SM of an H100/H200), at most the number of stages; each split takes a
  contiguous, nearly equal run of stages.  One split writes grad_weight
  directly (no finalize launch).

Staging (shape-only, does not change the values): a per-stage table holds
each staged row's 64-bit x offset (8 bytes per staged row, counted in the
32 KB budget).  float64: every element is copied by its own cp.async, and
stages are double-buffered (two regions, up to 64 KB): stage s + 1's copies
are in flight while stage s is summed (float64 64x96x112 3x3 s2 618 -> 430
us on an H200; float32 lost with it).  The other types: one region, groups
of 2**lanes_log2 threads copy rows through registers with 8 rows' loads in
flight per thread (_staging_lanes picks the group width).  Stages
per unit are capped so that there are at least ceil(1056 / (C*M)) stages
(small planes otherwise packed the whole batch into one block per channel).

The large kernel splits the batch the same way: ceil(1056 / (C*M)) splits of
N, at most N.
"""

import functools

import numpy

from . import _compile, _depthwise_nchw, _dtypes, _launch
from ._launch import i32

KERNEL_FILE = "depthwise_nchw_wgrad.cu"
SMALL = "dwgn_nchw_wgrad_small"
LARGE = "dwgn_nchw_wgrad_large"
SMALL_SIZES = (3, 5, 7)
SMALL_STRIDES = (1, 2)

_TARGET_BLOCKS = 1056
_STAGING_BUDGET = 32 * 1024
_MAX_ITEMS_PER_STAGE = 512
_THREAD_CHOICES = tuple(range(64, 257, 32))
# Staged rows each thread copies per load batch (kStageSlots in the .cu) and
# the row-table bytes per staged row (one 64-bit x offset).
_STAGE_SLOTS = 8
_ROW_TABLE_ENTRY = 8
# Large kernel: kh rows per thread (kLargeRows in the .cu), most warps, and
# the shared-memory ceiling for its two staged planes.
_LARGE_ROWS = 4
_LARGE_MAX_WARPS = 16
_LARGE_MIN_WIDTH = 8
_LARGE_SHARED_LIMIT = 96 * 1024
# Keeps every in-plane coordinate (including padding) well inside int32.
_COORD_LIMIT = 2**30


def specializations(dtypes=None, filter_sizes=None, large_index=(False, True)):
    """``(file, name expression)`` of every kernel this module can launch.

    filter_sizes: (KH, KW) pairs; the small kernel is compiled for the square
    3/5/7 sizes among them and the large kernel when any other size is given
    (default: all).  large_index is accepted for symmetry with the other op
    modules: these kernels compute plane offsets in 64-bit and have no index
    template parameter.
    """
    del large_index
    dtypes = _dtypes.CTYPES if dtypes is None else dtypes
    if filter_sizes is None:
        small, large = SMALL_SIZES, True
    else:
        sizes = [tuple(s) for s in filter_sizes]
        small = tuple(k for k in SMALL_SIZES if (k, k) in sizes)
        large = any(s[0] != s[1] or s[0] not in SMALL_SIZES for s in sizes)
    specs = []
    for dtype in dtypes:
        ctype = _dtypes.ctype(dtype)
        for k in small:
            for stride in SMALL_STRIDES:
                for rows in _compiled_item_rows(numpy.dtype(dtype).itemsize, k):
                    specs.append((KERNEL_FILE, _compile.name_expression(SMALL, ctype, k, stride, rows)))
        if large:
            specs.append((KERNEL_FILE, _compile.name_expression(LARGE, ctype)))
    # The split sums run the shared finalize of depthwise_conv2d.cu.
    return specs + _depthwise_nchw.specializations("depthwise_conv2d_backward_weight", dtypes, [(0, 0)], ())


def _coordinates_fit(g):
    return (
        g.height + g.pad_top + g.pad_bottom < _COORD_LIMIT
        and g.width + g.pad_left + g.pad_right < _COORD_LIMIT
    )


def _splits(out_channels, limit):
    return max(1, min(-(-_TARGET_BLOCKS // out_channels), limit, _launch.MAX_GRID_Y))


def _finalize(g, dtype, splits):
    """The shared split-order sum over partial[oc][split][tap]."""
    taps = g.filter_height * g.filter_width
    return _depthwise_nchw.finalize_launch(dtype, g.channels * g.multiplier, taps, splits, splits * taps, taps, 1)


def _stage_shape(items_per_unit, units, max_units):
    """(units per stage, threads) with the fewest idle thread slots (see the
    module docstring)."""
    best = None
    top = max(1, min(units, max_units, _MAX_ITEMS_PER_STAGE // items_per_unit))
    for per_stage in range(1, top + 1):
        items = per_stage * items_per_unit
        for threads in _THREAD_CHOICES:
            busy = items / (-(-items // threads) * threads)
            key = (busy, threads, -per_stage)
            if best is None or key > best[0]:
                best = (key, per_stage, threads)
    return best[1], best[2]


def _staging_lanes(threads, rows, staged_width):
    """log2 of the threads that copy one staged row together: the power of
    two (<= threads) with the fewest load batches of _STAGE_SLOTS rows per
    thread, then the fewest idle lanes (shape-only; it does not change the
    staged values, only who copies them)."""
    best = None
    lanes_log2 = 0
    while (1 << lanes_log2) <= threads:
        lanes = 1 << lanes_log2
        rows_per_pass = threads // lanes
        col_passes = -(-staged_width // lanes)
        batches = col_passes * -(-rows // (rows_per_pass * _STAGE_SLOTS))
        key = (batches, col_passes * lanes * rows_per_pass * _STAGE_SLOTS * -(-rows // (rows_per_pass * _STAGE_SLOTS)))
        if best is None or key < best[0]:
            best = (key, lanes_log2)
        lanes_log2 += 1
    return best[1]


def _round16(nbytes):
    return -(-nbytes // 16) * 16


def _stage_buffers(itemsize):
    """Stage regions in shared memory: two for float64 (cp.async copies of
    stage s + 1 in flight while stage s is summed), one for the others
    (staged through registers; see the kernel for the measurements)."""
    return 2 if itemsize == 8 else 1


def _item_rows(itemsize, k, out_height):
    """Output rows per work item, the kernel's R.  Measured on an H200
    (2026-12-01, N = 64, R = 4 against R = 2, us): float16 64x144x56 3x3
    105.9 against 124.6, 64x96x112 3x3 s2 174.1 against 215.1, 64x240x28
    5x5 98.4 against 112.7 (bfloat16 alike); but 64x384x28 3x3 123.7
    against 121.0 and 64x960x7 31.5 against 27.1, and float32 64x96x112 s2
    242.0 against 199.5 (64x144x56 124.5 / 125.5, 5x5 79.0 / 84.4).  So 4
    for the 2-byte types at 5x5 and at 3x3 with 32 output rows or more, else
    2 (7x7: its 49 accumulators leave no registers for more)."""
    if itemsize == 2 and (k == 5 or (k == 3 and out_height >= 32)):
        return 4
    return 2


def _compiled_item_rows(itemsize, k):
    """The R values compiled per (itemsize, K): 4 only where _item_rows can
    pick it."""
    return (2, 4) if itemsize == 2 and k in (3, 5) else (2,)


def _plan_small(g, dtype):
    k, stride = g.filter_height, g.stride_h
    itemsize = numpy.dtype(dtype).itemsize
    vw = 16 // itemsize
    window = (vw - 1) * stride + k
    loads = -(-window // vw)
    col_groups = -(-g.out_width // vw)
    # The last column group reads `loads` vectors from column (col_groups-1)*vw*stride.
    staged_width = (col_groups - 1) * vw * stride + loads * vw
    row_bytes = staged_width * itemsize
    # Shared bytes per staged row: the row plus its 8-byte row-table entry.
    row_cost = row_bytes + _ROW_TABLE_ENTRY

    rows = _item_rows(itemsize, k, g.out_height)

    def staged_rows(groups):
        return (rows * groups - 1) * stride + k

    total_groups = -(-g.out_height // rows)
    if staged_rows(total_groups) * row_cost <= _STAGING_BUDGET:
        band_rows, bands = g.out_height, 1
    else:
        max_groups = ((_STAGING_BUDGET // row_cost - k + stride) // (rows * stride))
        if max_groups < 1:
            return None
        bands = -(-total_groups // max_groups)
        band_rows = rows * -(-total_groups // bands)
        bands = -(-g.out_height // band_rows)
    groups = -(-band_rows // rows)
    unit_rows = staged_rows(groups)
    unit_bytes = unit_rows * row_bytes
    units = g.batch * bands
    if units >= _launch.INT32_LIMIT:
        return None
    out_channels = g.channels * g.multiplier
    # Enough stages for the wanted splits (small planes would otherwise pack
    # the whole batch into one stage and one block per channel).
    wanted_splits = -(-_TARGET_BLOCKS // out_channels)
    max_units = min(_STAGING_BUDGET // (unit_rows * row_cost), -(-units // wanted_splits))
    per_stage, threads = _stage_shape(groups * col_groups, units, max_units)
    stages = -(-units // per_stage)
    splits = _splits(out_channels, stages)
    lanes_log2 = _staging_lanes(threads, per_stage * unit_rows, staged_width)
    partial = _launch.Launch(
        KERNEL_FILE,
        _compile.name_expression(SMALL, _dtypes.ctype(dtype), k, stride, rows),
        (out_channels, splits),
        (threads,),
        _stage_buffers(itemsize) * _round16(per_stage * (unit_bytes + unit_rows * _ROW_TABLE_ENTRY)),
        (
            i32(g.channels), i32(g.height), i32(g.width), i32(g.multiplier), i32(g.out_height),
            i32(g.out_width), i32(g.pad_top), i32(g.pad_left), i32(band_rows), i32(bands),
            i32(units), i32(per_stage), i32(col_groups), i32(staged_width), i32(lanes_log2),
        ),
    )
    return [partial] if splits == 1 else [partial, _finalize(g, dtype, splits)]


def _plan_large(g, dtype):
    kw_tiles = -(-g.filter_width // 32)
    kh_tiles = -(-g.filter_height // _LARGE_ROWS)
    warps = kw_tiles * kh_tiles
    if warps > _LARGE_MAX_WARPS:
        return None
    rows = g.out_height - 1 + kh_tiles * _LARGE_ROWS
    cols = g.out_width - 1 + kw_tiles * 32
    shared = (rows * cols + g.out_height * g.out_width) * _dtypes.accumulator_dtype(dtype).itemsize
    if shared > _LARGE_SHARED_LIMIT:
        return None
    out_channels = g.channels * g.multiplier
    splits = _splits(out_channels, g.batch)
    partial = _launch.Launch(
        KERNEL_FILE,
        _compile.name_expression(LARGE, _dtypes.ctype(dtype)),
        (out_channels, splits),
        (32 * warps,),
        shared,
        (
            i32(g.batch), i32(g.channels), i32(g.height), i32(g.width), i32(g.multiplier),
            i32(g.out_height), i32(g.out_width), i32(g.filter_height), i32(g.filter_width),
            i32(g.pad_top), i32(g.pad_left),
        ),
    )
    return [partial] if splits == 1 else [partial, _finalize(g, dtype, splits)]


@functools.lru_cache(maxsize=512)
def plan(g, dtype):
    """The launches for this signature (the partial kernel, then the finalize
    when the sum is split), or None when neither kernel serves ``g``.  The
    index type does not change the plan: plane offsets are 64-bit in these
    kernels.  Arguments: partial (grad_out, x, partial sums or NULL, dst),
    finalize (partial sums, dst).
    """
    dtype = numpy.dtype(dtype)
    if (g.dilation_h, g.dilation_w) != (1, 1) or g.stride_h != g.stride_w or not _coordinates_fit(g):
        return None
    if (
        g.filter_height == g.filter_width
        and g.filter_height in SMALL_SIZES
        and g.stride_h in SMALL_STRIDES
    ):
        return _plan_small(g, dtype)
    if g.stride_h == 1 and g.filter_width >= _LARGE_MIN_WIDTH:
        return _plan_large(g, dtype)
    return None
