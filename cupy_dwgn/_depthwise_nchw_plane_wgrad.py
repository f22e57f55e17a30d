"""NCHW weight gradient on the whole-plane kernel's units
(kernels/depthwise_nchw_plane.cu, dwgn_nchw_plane_wgrad): 3x3, 5x5 and 7x7
filters, stride 1 or 2 (both axes), dilation 1, depth multiplier 1, any
padding, float32, float16 and bfloat16, both arrays 16-byte aligned.  It
writes partial[split][tap][channel] in float32 and the shared finalize
(_depthwise_nhwc.with_finalize) adds the splits in a fixed order:
deterministic, bit-identical run to run.  The ops take it where
``preferred`` says so; ``MODE`` overrides that for tests and benchmarks.

Launch rule (no user tuning), from the shape only:

* A thread owns the same R x V = 4 x 4 output positions of every unit it
  visits and keeps K x K float sums of grad_out x the source values each tap
  pairs them with (its grad_out values are zero past the plane's edge).
* Planes of at most 256 items whose buffers fit: units of P consecutive
  channels' planes of one image (one contiguous range of x and one of
  grad_out), P = the most that fit 256 threads and the buffers, then evened
  out over the channels (ceil(C / ceil(C / P))).  Larger planes: units of one
  band of rows of one plane (_depthwise_nchw_plane.band_count), the fewest
  bands whose items fit 256 threads and whose x and grad_out rows fit the
  buffers.  A block's threads are its items rounded up to a warp.
* Buffers: three, each the unit's x rows then its grad_out rows (each range
  with 16 bytes of rounding and 16 for a copy from the 16-byte boundary
  below it), at most 48 KB in all.
* Grid: (ceil(C / P) channel groups, splits); a split takes a contiguous run
  of the (image, band) units, splits = ceil(TARGET_BLOCKS / groups), at most
  units / MIN_UNITS_PER_SPLIT (a block's first copy and its reduction are
  paid once per split: 64x384x14 7x7 float16 at 2 units a split 67 us, at 6
  46; 64x960x7 3x3 at 1 18.3, at 4 14.9; H200, 2026-12-03), evened out so
  that none is empty.  TARGET_BLOCKS and MIN_UNITS_PER_SPLIT are constants,
  not the SM count: the split, hence the summation order, depends on the
  shape only.
"""

import functools

import numpy

from . import _depthwise_nchw_plane as plane
from . import _depthwise_nchw_wgrad_regs as regs
from . import _compile, _depthwise_nhwc, _dtypes, _launch
from ._launch import i32

#: "rule": the ops take this kernel where ``preferred`` says it wins;
#: "always": wherever it serves the call (tests, the sanitizer workload,
#: benchmarks); "never": not at all.
MODE = "rule"

KERNEL = "dwgn_nchw_plane_wgrad"
STRIDES = (1, 2)
TARGET_BLOCKS = 1056
#: Units per split at least (module docstring; a block's prologue and
#: reduction are paid once per split).
MIN_UNITS_PER_SPLIT = 4


def _expression(dtype, k, stride):
    return _compile.name_expression(KERNEL, _dtypes.ctype(dtype), k, stride)


def specializations(dtypes=None, filter_sizes=None, large_index=(False, True)):
    """``(file, name expression)`` of every specialization (offsets are
    64-bit where they can pass int: no index template parameter)."""
    del large_index
    dtypes = plane.DTYPES if dtypes is None else [d for d in map(numpy.dtype, dtypes) if d in plane.DTYPES]
    sizes = plane.FILTER_SIZES if filter_sizes is None else [s for s in map(tuple, filter_sizes)
                                                             if s in plane.FILTER_SIZES]
    return [(plane.KERNEL_FILE, _expression(dtype, size[0], stride))
            for dtype in dtypes for size in sizes for stride in STRIDES]


def preferred(g, dtype):
    """Whether the ops take this kernel where it serves the call: where the
    NCHW register kernel would not (float32 5x5/7x7 of 28 columns and more:
    the staged kernel or the NHWC detour take those), or would read one
    column per lane (VW = 1: odd widths, stride 2 onto odd widths), or two
    columns (VW = 2) with a 3x3 or 5x5 filter.  The register kernel keeps
    VW >= 4 (its rows stream as 8- and 16-byte vectors) and 7x7 at VW = 2.
    Measured on an H200 (2026-12-03, benchmarks/depthwise_nchw_plane_wgrad.py,
    N = 64, us, this kernel / the others; results/depthwise_nchw_plane_wgrad_h200_2026-12-03.txt):
    VW = 1 float16 64x192x75 151 / 349, 5x5 s2 130 / 316, 64x576x19 39.8 /
    103, 5x5 66.6 / 123 (NHWC detour), 64x144x150 s2 294 / 355, 64x960x7
    19.1 / 24.9, float32 64x192x75 182 / 341 but 64x144x150 s2 437 / 404;
    VW = 2 float16 64x40x150 133 / 179, 64x288x38 5x5 123 / 212, 64x1392x10
    32.7 / 39.5, 5x5 56.2 / 71.1, float32 64x1392x10 44.8 / 40.4, 7x7
    64x384x14 67.3 / 50.6; VW >= 4 float16 64x144x56 72.5 / 52.9, 64x96x112
    s2 99.6 / 59.9, 64x384x28 48.2 / 47.1, 5x5 64x240x28 59.2 / 45.0, 7x7
    64x96x56 151 / 83.5; the staged kernel's float32 64x240x28 5x5 68.4 /
    72.4, 7x7 64x96x56 142 / 165 (bfloat16 as float16 throughout)."""
    if numpy.dtype(dtype) not in plane.DTYPES or (g.filter_height, g.filter_width) not in plane.FILTER_SIZES:
        return False  # not served: plan() says None
    if not regs.preferred(g, dtype):
        return True
    vw = regs.vector_width(g, dtype, 16, 16)
    return vw == 1 or (vw == 2 and g.filter_height < 7)


def select(g, dtype, grad_out_alignment, x_alignment):
    """``plan(...)`` when the ops take this kernel (per ``MODE``), else None."""
    if MODE == "never" or (MODE == "rule" and not preferred(g, dtype)):
        return None
    return plan(g, dtype, grad_out_alignment, x_alignment)


def _buffer_bytes(x_bytes, grad_bytes):
    """One buffer: the x range, then the grad_out range, each with 16 bytes
    of rounding and 16 for a copy from the boundary below."""
    return plane.round16(x_bytes) + 16 + plane.round16(grad_bytes) + 16


def units_of(g, itemsize):
    """(P, num_bands, row blocks a unit, col_blocks, x bytes, grad_out bytes
    of a unit) or None (module docstring)."""
    k, stride = g.filter_height, g.stride_h
    item_rows = plane.wgrad_rows(itemsize, k)
    row_blocks, col_blocks = -(-g.out_height // item_rows), -(-g.out_width // plane.COLUMNS)
    if col_blocks > plane.MAX_THREADS:
        return None
    items = row_blocks * col_blocks
    x_plane = g.height * g.width * itemsize
    grad_plane = g.out_height * g.out_width * itemsize
    if items <= plane.MAX_THREADS and plane.BUFFERS * _buffer_bytes(x_plane, grad_plane) <= plane.SHARED_LIMIT:
        most = min(plane.MAX_THREADS // items, g.channels)
        while most > 1 and plane.BUFFERS * _buffer_bytes(most * x_plane, most * grad_plane) > plane.SHARED_LIMIT:
            most -= 1
        per_unit = -(-g.channels // -(-g.channels // most))
        return per_unit, 1, row_blocks, col_blocks, per_unit * x_plane, per_unit * grad_plane

    def byte_counts(band_blocks):
        x_rows = plane.band_source_rows(band_blocks, item_rows, stride, k, g.height)
        return x_rows * g.width * itemsize, band_blocks * item_rows * g.out_width * itemsize

    bands = plane.band_count(row_blocks, col_blocks,
                             lambda band_blocks: plane.BUFFERS * _buffer_bytes(*byte_counts(band_blocks))
                             <= plane.SHARED_LIMIT)
    if bands is None:
        return None
    num_bands, band_blocks = bands
    return (1, num_bands, band_blocks, col_blocks, *byte_counts(band_blocks))


@functools.lru_cache(maxsize=1024)
def plan(g, dtype, grad_out_alignment, x_alignment):
    """``((partial launch, finalize launch), (shape, dtype) of the partial
    sums))`` (partial arguments: grad_out, x, partial; finalize: partial,
    grad_weight), or None when this kernel does not serve the call.
    ``*_alignment``: the largest of 16, 8, 4, 2, 1 dividing the address
    (cp.async copies 16-byte vectors: both must be 16)."""
    dtype = numpy.dtype(dtype)
    k, stride = g.filter_height, g.stride_h
    if (
        (k, g.filter_width) not in plane.FILTER_SIZES
        or stride not in STRIDES or g.stride_w != stride
        or (g.dilation_h, g.dilation_w) != (1, 1)
        or g.multiplier != 1
        or dtype not in plane.DTYPES
        or grad_out_alignment % 16 or x_alignment % 16
    ):
        return None
    if min(g.batch, g.channels, g.height, g.width, g.out_height, g.out_width) <= 0:
        return None
    # In-unit offsets (P planes, band rows) are int; plane offsets 64-bit.
    largest_plane = max(g.height * g.width, g.out_height * g.out_width)
    if g.batch * g.channels >= 2**31 or largest_plane * plane.MAX_THREADS >= 2**31:
        return None
    units = units_of(g, dtype.itemsize)
    if units is None:
        return None
    per_unit, num_bands, row_blocks, col_blocks, x_bytes, grad_bytes = units
    groups = -(-g.channels // per_unit)
    total_units = g.batch * num_bands
    if total_units >= 2**31:
        return None
    splits = max(1, min(-(-TARGET_BLOCKS // groups), total_units // MIN_UNITS_PER_SPLIT, _launch.MAX_GRID_Y))
    per_split = -(-total_units // splits)
    splits = -(-total_units // per_split)  # every split non-empty
    threads = -(-per_unit * row_blocks * col_blocks // 32) * 32
    raw_bytes = _buffer_bytes(x_bytes, grad_bytes)
    # The reduction reuses the buffers: 2 * K * threads floats.
    shared = max(plane.BUFFERS * raw_bytes, 2 * k * threads * 4)
    assert shared <= plane.SHARED_LIMIT
    scalars = (
        i32(g.channels), i32(g.height), i32(g.width), i32(g.out_height), i32(g.out_width), i32(g.pad_top),
        i32(g.pad_left), i32(per_unit), i32(num_bands), i32(row_blocks), i32(col_blocks), i32(raw_bytes),
        i32(plane.round16(x_bytes) + 16), i32(total_units), i32(per_split),
    )
    partial = _launch.Launch(plane.KERNEL_FILE, _expression(dtype, k, stride), (groups, splits), (threads,), shared,
                             scalars)
    return _depthwise_nhwc.with_finalize(partial, dtype, g.channels, k * k, splits)
