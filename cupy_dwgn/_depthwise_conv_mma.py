"""Forward (stride 1 or 2) and backward-input on the tensor cores, NCHW or NHWC
(kernels/depthwise_conv_mma.cu): float16 and bfloat16, 3x3 / 5x5 / 7x7
filters at dilation 1, depth multiplier 1, float32 accumulation.  Per
channel and filter row, a tile of 16 x 8 outputs is one matrix product of
16 image rows (S apart) with a banded matrix of the filter row (the
kernel's header says why and how); a strip that meets a non-finite value is recomputed
output by output, so infs and NaNs reach exactly the outputs whose windows
hold them.  The ops take it where ``preferred`` says so; ``MODE`` overrides
that for tests and benchmarks.

Launch rule (no user tuning), from the shape only:

* A persistent grid (at most the blocks resident at once) of 128-thread
  blocks (4 warps), each walking the units grid-size apart; a unit's
  (channel, 16-row tile) items are dealt to the warps.  NCHW: P whole
  planes (P = ceil(4 * ``ITEMS_PER_WARP`` / row tiles), about two items a
  warp), fewer where the shared memory passes ``SHARED_TARGET`` or where
  the call would have fewer than ``MIN_UNITS`` units; a plane whose buffers
  pass ``SHARED_TARGET`` goes in bands of rows (units of one band of one
  plane).  NHWC: (sample, band of rows, group of 8 channels), whole planes
  where they fit ``SHARED_TARGET``, else the tallest bands (multiples of 16
  rows) that do.  16-row bands of rows too wide for that may take up to
  ``MAX_SHARED``.
* Shared memory: the unit's zero-padded images (one per channel: every row
  a tile reads; ``LEFT`` zero columns, the source row, zeros to the last
  tile's window; rows of an odd number of 16-byte vectors), twice for NCHW
  where that fits (``units``: the next unit's rows in flight while the warps
  work), for NHWC once with a raw area for the next unit's pixels in flight
  where that fits, and its destination rows, staged for 16-byte stores.
* NCHW rows are copied in cp.async pieces of 16, 8 or 4 bytes (the largest
  that divides the row bytes and the source address), else the range's
  4-byte words (loads, a few a thread in flight, split into the rows);
  NHWC takes C a multiple of 8 and both arrays 16-byte aligned (pixels of
  8 channels in 16-byte loads and stores).
* Served where the correlation's offsets lie in [0, LEFT] (padding at most
  the filter size minus one for the backward-input); the forward at stride
  1 or 2, the backward-input at stride 1.
"""

import functools

import numpy

from . import _compile, _dtypes, _launch, _validate
from ._launch import i32

#: "rule": the ops take this kernel where ``preferred`` says it wins;
#: "always": wherever it serves the call (tests, the sanitizer workload,
#: benchmarks); "never": not at all.
MODE = "rule"

KERNEL_FILE = "depthwise_conv_mma.cu"
KERNEL = "dwgn_dwconv2d_mma"
FILTER_SIZES = ((3, 3), (5, 5), (7, 7))
DTYPES = (numpy.dtype(numpy.float16), _dtypes.bfloat16)
LAYOUTS = ("NCHW", "NHWC")
#: (stride, backward) of the specializations: the backward-input is a stride-1 correlation.
VARIANTS = ((1, False), (2, False), (1, True))

WARPS = 4  # kernel: kWarps
THREADS = 32 * WARPS
LEFT = 8  # kernel: kLeft, the image column of source column 0
NHWC_CHANNELS = 8  # channels of an NHWC unit (one 16-byte pixel vector)
#: Shared memory a block aims at (4 blocks an SM) and may take (the opt-in
#: limit of every sm_80+ GPU but the A100/H100/H200 class), so plans do not
#: depend on the device.
SHARED_TARGET = 48 * 1024
MAX_SHARED = 99 * 1024
#: (channel, row tile) items per warp an NCHW unit of whole planes aims at.
ITEMS_PER_WARP = 2
#: Image buffers of an NCHW block (1: zero, copy, work, store, one unit after another).
NCHW_BUFFERS = 2
#: NHWC: 2, the next unit's pixels copied ahead (cp.async) into a raw area,
#: split into the one image buffer once landed; 1: loaded and split unit by unit.
NHWC_BUFFERS = 2
#: Units per call the NCHW planes per unit leave at least (2 blocks on each
#: of an H200's 132 SMs), where there are that many planes.
MIN_UNITS = 264
_MAX_GRID = 2**31 - 1


def _expression(dtype, k, stride, backward, layout, index):
    return _compile.name_expression(KERNEL, _dtypes.ctype(dtype), k, stride, str(backward).lower(),
                                    str(layout == "NHWC").lower(), index)


def specializations(dtypes=None, filter_sizes=None, backward=None, large_index=(False, True), layouts=LAYOUTS):
    """``(file, name expression)`` of every specialization.

    backward: None (both), False (forward) or True (backward-input)."""
    layouts = (layouts,) if isinstance(layouts, str) else tuple(layouts)
    variants = [(stride, is_backward, layout) for stride, is_backward in VARIANTS
                if backward is None or is_backward == backward for layout in LAYOUTS if layout in layouts]
    return _compile.filter_size_specializations(
        KERNEL_FILE, lambda dtype, size, index, stride, is_backward, layout: _expression(
            dtype, size[0], stride, is_backward, layout, index),
        DTYPES, FILTER_SIZES, dtypes, filter_sizes, large_index, variants)


#: Output plane sides (rows and columns) between which the ops take the
#: kernel for NCHW 7x7 at stride 1 (``preferred``).
RULE_SIDES = (24, 112)
#: The side at which bfloat16 also takes it (16-row tiles exactly; ``preferred``).
_BFLOAT16_SIDE = 16


def preferred(g, dtype, backward, layout):
    """Whether the ops take this kernel for ``g`` (where it serves the
    call): NCHW 7x7 at stride 1 (forward and backward-input) on output
    planes of ``RULE_SIDES`` rows and columns, where a tile's 16 x 8 x 24
    products hold the most useful taps and every warp item has full strips.

    Measured on an H200 (2026-12-05, benchmarks/depthwise_candidates.py,
    N = 64, float16, us, this kernel against the fastest other kernel;
    bfloat16 within 2%): 64x96x56 7x7 NCHW forward 63.9 against the register
    window's 75.9, backward-input 63.0 against 80.9; 64x192x28 36.9 / 36.5
    against the whole-plane kernel's 49.2 / 49.0; 32x96x112 (bands of rows)
    125.6 / 123.5 against the register window's 156.4 / 158.5.  Ties or slower
    elsewhere: 7x7 on 14x14 (NCHW 37.3 against the whole-plane kernel's
    36.4; NHWC 42.6 against 28.0), NHWC 7x7 56x56 (87.6 against 80.0), 5x5
    (64x240x28 NCHW 39.2 against 37.6; 64x288x38 116 against 101), every
    3x3 (1.3-6x slower: 64x144x56 64.2 against 43.6) and stride 2 (1.7-3.3x).
    Nsight Compute (64x144x56 3x3 NCHW, 63 us): 58% of issue slots busy,
    29% occupancy (registers: 5 blocks of 4 warps), 31% of DRAM peak; about
    940 warp instructions per (plane, 16-row tile) item of two 16 x 32
    strips: ~160 its setup (the filter's B fragments, 18 predicated 2-byte
    loads packed, and index math), ~220 the two strips' products (the
    partial one predicated), ~150 their votes and stage stores, the rest the
    unit's row copies, 16-byte stores and index math.  The tensor cores are
    not the bound; small planes (one strip an item) pay the same setup for
    fewer outputs.

    bfloat16 also on 16x16 planes (ConvNeXt's third stage at 256x256
    inputs), where the whole-plane kernel, which reads bfloat16 from shared
    memory one 2-byte value at a time (float16 in 4-byte pairs), falls
    behind: H200, 2026-12-06, 64x294x16 forward, us, this kernel / plane /
    window: bf16
    29.5 / 41.1 / 46.2, fp16 29.5 / 27.8 / 45.6
    (results/depthwise_7x7_widths_h200_2026-12-06.txt).  Below 24 it
    loses elsewhere (bf16 18: 45.3 / 39.9, 21: 44.7 / 31.9; 22 about even,
    34.7 / 36.4)."""
    return (
        layout == "NCHW"
        and g.filter_height == 7
        and g.stride_h == 1
        and all(RULE_SIDES[0] <= side <= RULE_SIDES[1]
                or (side == _BFLOAT16_SIDE and numpy.dtype(dtype) == _dtypes.bfloat16)
                for side in (g.out_height, g.out_width))
    )


def select(g, dtype, backward, index, src_alignment, dst_alignment, layout):
    """``plan(...)`` when the ops take this kernel (per ``MODE``), else None
    (the other direct kernels' select signature, then the layout)."""
    if MODE == "never" or (MODE == "rule" and not preferred(g, dtype, backward, layout)):
        return None
    return plan(g, dtype, backward, layout, index, src_alignment, dst_alignment)


def _chunks(stride):
    """8-column chunks a tile's window takes (kernel: kChunks)."""
    return 3 if stride == 1 else 4


def row_stride(g, backward):
    """Values a row of an image takes (kernel header): ``LEFT`` zeros, the
    source row, zeros to the end of the last tile's window (24 columns from
    column 8 * S * tile; S = 2: 32), rounded to 8 values, with an odd number
    of 16-byte vectors."""
    _, src_w, _, dst_w, _, _ = _validate.correlation_frame(g, backward)
    s = g.stride_h
    stride = -(-max(8 * s * (-(-dst_w // 8) - 1) + 8 * _chunks(s), LEFT + src_w) // 8) * 8
    return stride + 8 if stride // 8 % 2 == 0 else stride


def image_rows(g, out_rows, whole_planes, backward):
    """Rows of an image for a unit of ``out_rows`` destination rows: every
    row its 16-row tiles read (S * (16 t - 1) + K), and for units of whole
    planes every source row (they are one range of src)."""
    src_h, _, _, _, offset_top, _ = _validate.correlation_frame(g, backward)
    rows = g.stride_h * (16 * -(-out_rows // 16) - 1) + g.filter_height
    return max(rows, offset_top + src_h) if whole_planes else rows


def _shared(planes, image_rows, stride, out_rows, dst_w, layout, buffers, src_w):
    """Dynamic shared memory of a block: its image buffers (NHWC with pixels
    copied ahead: one, and the raw pixels of up to ``image_rows`` source
    rows) and its staged outputs (NCHW: 16 bytes more for a range that starts
    between 16-byte boundaries)."""
    stage = planes * out_rows * dst_w * 2
    if layout == "NHWC":
        return planes * image_rows * stride * 2 + (image_rows * src_w * 16 if buffers == 2 else 0) + stage
    return buffers * planes * image_rows * stride * 2 + -(-stage // 16) * 16 + 16


def units(g, backward, layout):
    """(planes per unit, num_bands, band_rows, image_rows, shared memory,
    image buffers) of the kernel for ``g`` (the module docstring's rule), or
    None when no unit fits ``MAX_SHARED``.  Each layout takes its
    ``*_BUFFERS`` where a unit fits with them, else one (rows too wide)."""
    wanted = NCHW_BUFFERS if layout == "NCHW" else NHWC_BUFFERS
    for buffers in ((wanted, 1) if wanted != 1 else (1,)):
        planned = _units(g, backward, layout, buffers)
        if planned is not None:
            return (*planned, buffers)
    return None


def _units(g, backward, layout, buffers):
    """units() for ``buffers`` image buffers a block."""
    _, src_w, dst_h, dst_w, _, _ = _validate.correlation_frame(g, backward)
    stride = row_stride(g, backward)
    row_tiles = -(-dst_h // 16)
    if layout == "NCHW":
        planes = g.batch * g.channels
        rows = image_rows(g, dst_h, True, backward)
        per_unit = max(1, min(-(-ITEMS_PER_WARP * WARPS // row_tiles), -(-planes // MIN_UNITS)))
        while per_unit > 1 and _shared(per_unit, rows, stride, dst_h, dst_w, layout, buffers, src_w) > SHARED_TARGET:
            per_unit -= 1
        shared = _shared(per_unit, rows, stride, dst_h, dst_w, layout, buffers, src_w)
        if shared <= SHARED_TARGET:
            return per_unit, 1, dst_h, rows, shared
        per_band = 1
    else:
        per_band = NHWC_CHANNELS
    # Bands of 16 * t rows: the tallest that fits SHARED_TARGET (a band reads
    # only the source rows of its own tiles), at least two for NCHW.
    tiles_cap = row_tiles - 1 if layout == "NCHW" else row_tiles
    # (no taller band fits: 16 rows of images (and NHWC raw pixels) alone take the bytes below)
    tiles_cap = min(tiles_cap, SHARED_TARGET // _shared(per_band, 16, stride, 0, dst_w, layout, buffers, src_w))
    for tiles in range(max(tiles_cap, 1), 0, -1):
        band_rows = 16 * tiles
        rows = image_rows(g, band_rows, False, backward)
        shared = _shared(per_band, rows, stride, min(band_rows, dst_h), dst_w, layout, buffers, src_w)
        if shared <= SHARED_TARGET or (tiles == 1 and shared <= MAX_SHARED):
            return per_band, -(-dst_h // band_rows), band_rows, rows, shared
    return None


@functools.lru_cache(maxsize=1024)
def plan(g, dtype, backward, layout, index, src_alignment, dst_alignment):
    """The Launch for this signature (arguments: src, weight, bias or the
    null pointer, dst), or None when this kernel does not serve it.
    ``*_alignment``: the largest of 16, 8, 4, 2, 1 dividing the address."""
    dtype = numpy.dtype(dtype)
    if (
        (g.filter_height, g.filter_width) not in FILTER_SIZES
        or dtype not in DTYPES
        or layout not in LAYOUTS
        or (g.stride_h, backward) not in VARIANTS
        or (g.stride_w, g.dilation_h, g.dilation_w, g.multiplier) != (g.stride_h, 1, 1, 1)
        or min(g.batch, g.channels, g.height, g.width, g.out_height, g.out_width) <= 0
        or src_alignment % 2 or dst_alignment % 2
        or (layout == "NHWC" and (g.channels % NHWC_CHANNELS or src_alignment % 16 or dst_alignment % 16))
    ):
        return None
    src_h, src_w, dst_h, dst_w, offset_top, offset_left = _validate.correlation_frame(g, backward)
    if not (0 <= offset_top and 0 <= offset_left <= LEFT):
        return None
    if g.batch * g.channels >= 2**31:
        return None
    planned = units(g, backward, layout)
    if planned is None:
        return None
    per_unit, num_bands, band_rows, image_rows, shared, buffers = planned
    if layout == "NCHW":
        num_units = -(-g.batch * g.channels // per_unit) * num_bands
        num_planes = g.batch * g.channels
    else:
        num_units = g.batch * num_bands * (g.channels // NHWC_CHANNELS)
        num_planes = g.batch
    if num_units > _MAX_GRID:
        return None
    # NCHW row copies (NHWC copies 16-byte pixels; the kernel ignores it)
    piece = 16 if layout == "NHWC" else next(
        (p for p in (16, 8, 4) if (2 * src_w) % p == 0 and src_alignment % p == 0), 2)
    return _launch.Launch(
        KERNEL_FILE,
        _expression(dtype, g.filter_height, g.stride_h, backward, layout, index),
        (num_units,),
        (THREADS,),
        shared,
        (
            i32(g.channels), i32(num_planes), i32(src_h), i32(src_w), i32(dst_h), i32(dst_w), i32(offset_top),
            i32(offset_left), i32(per_unit), i32(num_bands), i32(band_rows), i32(image_rows),
            i32(row_stride(g, backward)), i32(piece), i32(num_units), i32(buffers),
        ),
        persistent=True,
    )
