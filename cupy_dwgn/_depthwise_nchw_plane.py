"""NCHW whole-plane kernel (kernels/depthwise_nchw_plane.cu): the forward at
stride 1 or 2 and the backward-input (stride 1) for 3x3, 5x5 and 7x7
filters at dilation 1 and depth multiplier 1, in float32, float16 and
bfloat16 (float64 keeps the window kernel).

Launch rule (no user tuning), from the destination plane size:

* A thread owns R x V = 4 x 4 destination values (float64 5x5 and 7x7:
  2 x 4; 2-byte 3x3 at stride 1: 6, 7 or 8 x 4; 2-byte 5x5 and 2- or
  4-byte 7x7 at stride 1: 4 x 4 or 7 x 4; of several, the one that reads
  the shared source with fewer bank conflicts and less overhang, or for
  7x7 computes fewer rows, _pick_rows) and reads its window
  straight from the unit's raw source rows (padding skipped or masked in
  registers).
* Planes of at most 256 items whose buffers fit 48 KB: a block takes P =
  min(256 // items, 48 KB // (3 source planes + the destination plane when
  outputs go through the shared buffer)) planes, fewer when that would
  leave under _MIN_UNITS units for the whole call (small batches still
  spread over the SMs), rounded down to a multiple that keeps every unit
  16-byte aligned.  Larger planes: units of one band of rows of one plane,
  the fewest bands (as even as they can be) whose items fit 256 threads and
  whose source rows and outputs fit the buffers.  A block's threads are the
  unit's items rounded up to a warp.  The grid is persistent: at most the
  blocks resident at once (Launch.persistent), each walking units
  grid-size apart.
* Sources are copied with 16-byte cp.async into three raw shared buffers,
  one unit ahead, when the source is 16-byte aligned (a unit that starts
  between 16-byte boundaries is copied from the boundary below it, 16 more
  bytes per buffer); otherwise the threads read them from global memory.
  Units of whole planes of a multiple of 16 bytes that, back to back, put
  the planes' rows on the same shared-memory banks (a warp's window reads
  6-way conflicted or worse: 16-wide 2-byte 5x5 planes) land a 16-112-byte
  gap apart instead (_pitch; the PITCHED specializations, pitch_capable).
* Outputs leave as V-value vectors when rows are V-aligned.  Otherwise, on
  the cp.async path, a unit's outputs are gathered in a shared buffer and
  stored as one flat range in 16-byte vectors (when the shared memory for
  P planes allows; else as elements).
"""

import functools
import math

import numpy

from . import _compile, _dtypes, _launch, _validate
from ._launch import i32

KERNEL_FILE = "depthwise_nchw_plane.cu"
KERNEL = "dwgn_dwconv2d_plane"
FILTER_SIZES = ((3, 3), (5, 5), (7, 7))
DTYPES = (numpy.dtype(numpy.float32), numpy.dtype(numpy.float16), _dtypes.bfloat16)

COLUMNS = 4
# A block's threads and shared memory at most (the forward and weight
# gradient kernels alike: __launch_bounds__(256), no opt-in past 48 KB).
MAX_THREADS = 256
SHARED_LIMIT = 48 * 1024
# At least this many units per call where planes allow (2 blocks on each of
# an H200's 132 SMs): P shrinks for small batches.
_MIN_UNITS = 264
# Raw source buffers per block (kernel: kBuffers).
BUFFERS = 3
_MAX_GRID = 2**20
# float16 on the cp.async path reads the shared source in 4-byte pairs
# (kernel: read_window_row_pairs), reaching up to PAIR_PAD bytes before the
# buffers and after them: padding the shared memory holds (kernel: kPairPad).
# Why float16 alone: H100, 2026-12-05, GPU us, one value a load / pairs
# (benchmarks/results/depthwise_nchw_plane_pairs_h100_2026-12-05.txt), fp16
# 64x816x19 5x5 s2 forward 45.8 -> 39.7, 64x288x38 3x3 s2 34.9 -> 32.5,
# 64x672x14 5x5 35.4 -> 33.5 (backward-input 35.1 -> 33.1), 64x1136x22 3x3
# backward-input 75.5 -> 68.7, 64x1024x16 5x5 backward-input 60.1 -> 56.3,
# within 2% elsewhere but 64x384x28 3x3 backward-input (38.9 / 39.4 -> 39.4 /
# 40.5); bfloat16, whose pairs convert in two more instructions than a
# value read alone (a shift and a mask against fp16's HADD2.F32 halves),
# lost up to 5.5% (64x1136x22 3x3 forward 75.6 -> 79.8, 64x192x75 3x3
# 125.0 -> 130.5).
PAIR_PAD = 32
# Rows wider than this keep the window kernel (the widest measured: 150).
_MAX_PREFERRED_WIDTH = 160



def row_choices(itemsize, filter_height, stride):
    """Destination rows per thread the forward and backward-input kernel is
    compiled for (its template parameter R; the kernel's comment on R says
    why): 2-byte 3x3 at stride 1 6, 7 and 8, 2-byte 5x5 at stride 1 4 and 7
    (plan picks one per geometry: _pick_rows), else as the weight gradient."""
    if itemsize == 2 and stride == 1 and filter_height in (3, 5):
        return (6, 7, 8) if filter_height == 3 else (4, 7)
    if itemsize in (2, 4) and stride == 1 and filter_height == 7:
        return (4, 7)
    return (wgrad_rows(itemsize, filter_height),)


def pitch_capable(itemsize, filter_height, stride, item_rows):
    """Whether the kernel of these parameters is also compiled PITCHED (its
    units of whole planes land a gap apart: _pitch): where a gap was
    measured to pay, 2-byte 5x5 at stride 1 in 4-row items (16x16 planes).
    The PITCHED kernels run only where a gap is taken: the pitched copy's
    index math cost the 2-byte kernels up to 7% where it copied flat ranges
    (H100, 64x1344x14 bf16 3x3 forward 44.7 -> 47.7 us)."""
    return itemsize == 2 and filter_height == 5 and stride == 1 and item_rows == 4


def launch_rows(launch):
    """R of a plan's launch (its expression's sixth template argument)."""
    return int(launch.expression.split("<")[1].split(", ")[5])


def wgrad_rows(itemsize, filter_height):
    """grad_out rows per thread of the weight gradient (kernel: kWgradRows)."""
    return 2 if itemsize == 8 and filter_height > 3 else 4


def preferred(g, dtype, backward):
    """Whether the plane kernel beats the window kernel for this geometry
    (the window kernel also serves it).  Both depend on the row width's
    alignment: the window kernel's column vectors favour multiples of 8
    (half types) or 4 (float32), and the plane kernel loses about a quarter
    where its 4x4 items overhang the plane (odd widths).  Measured on an
    H200 (2026-12-02, benchmarks/depthwise_kernels.py --shapes: N = 64,
    about 64 MB per tensor, "same" padding, widths 10 to 64; plane against
    window, us, forward; backward-input alike;
    benchmarks/results/depthwise_kernels_sweep_h200_2026-12-02.txt):

    * half types, 3x3: every width but 32 and the multiples of 8 from 128
      (12: 57.3 / 138.2, 14: 86.4 / 123.0, 16: 83.9 / 102.1, 21: 84.5 /
      114.7, 31: 77.2 / 100.6, 60: 57.5 / 99.9).  The multiples of 8 from
      32 were all the window kernel's (32: 55.4 / 48.5, 56: 61.6 / 52.4)
      before the 6-8-row items and the per-value reads; swept again on an
      H200 (2026-12-06, the plane kernel at _pick_rows' R, fp16 forward /
      backward-input; bf16 alike): 40: 41.0 / 43.7, 44.1 / 48.6; 48: 43.7 /
      45.2, 44.7 / 47.9; 56: 45.0 / 46.0, 47.8 / 51.4 (the ops 44.2 against
      44.2 in the depthwise table's run); 64: 36.8 / 37.1, 39.2 / 40.6; 72:
      43.8 / 64.8, 47.4 / 69.2; 96: 45.2 / 57.2; 112: 42.8 / 52.1; but 32:
      40.5 / 38.4, 43.0 / 40.6 and 128: 43.2 / 40.7, 45.5 / 43.1
      (results/depthwise_nchw_plane_multiples_of_8_h200_2026-12-06.txt; on
      an H100 the plane kernel won at 32 and 128 too, by 4-9%).  5x5:
      below 32 (14: 137.0 / 251.1, 17: 171.1 / 185.0, 31: 118.1 / 147.7; 32:
      94.0 / 87.3).  7x7: below 16 and the multiples of 4 from 20 to 28 (12:
      161.0 / 267.1, 15: 194.6 / 240.1, 24: 157.6 / 167.0; 16: 206.9 /
      192.9, 17: 283.4 / 266.7, 21: 226.6 / 213.0, 32: 161.8 / 111.7).
    * float32, 3x3: every width but 16 (14: 100.8 / 115.3, 28: 77.7 / 82.5,
      56: 72.4 / 79.7; 16: 95.0 / 86.2).  5x5: below 16 and widths that are
      not a multiple of 4 (14: 152.7 / 175.0, 21: 153.9 / 198.5; 16: 142.4 /
      113.4, 24: 120.1 / 108.8).  7x7: up to 15 (12: 171.9 / 196.3, 15:
      201.1 / 208.7; 17: 263.6 / 226.6); 14 was the window kernel's (219.5
      / 214.3, and at 64x384x14 41.6 / 37.8) until it measured 50.6 / 50.8
      there against the plane kernel's 37.5 / 35.6 (2026-12-02, same run,
      twice: the window kernel slowed at this shape since the first sweep,
      with its launch unchanged; not bisected).
    * At width 10 and below the ops try the row kernel first
      (_depthwise_nchw_rows.preferred); below 10, where it is not taken,
      the window kernel (7-wide 3x3 fp16: window 15.8, plane 23.7 us at
      64x960x7), but 7x7 on planes of at most 7 (which the row kernel
      leaves to this one: 64x768x7 fp16 plane 16.8-16.9, rows 20.2-21.7,
      window 39.4 us on an H100, 2026-12-06; float32 on an H200 18.1 / 18.8
      / 39.9).
    * 7x7 since the 7-row items (_pick_rows): swept again on an H200
      (2026-12-06, benchmarks/depthwise_candidates.py, N = 64, about 19 MB
      per half-type tensor, forward, plane / window, us; backward-input
      alike where measured; results/depthwise_7x7_widths_h200_2026-12-06.txt).
      Half types now take every width below 24, where the tensor-core
      kernel takes over (_depthwise_conv_mma.preferred): fp16 15: 29.6 /
      54.9, 16: 27.8 / 45.6, 17: 40.6 / 68.4, 18: 33.7 / 61.1, 19: 33.1 /
      59.6, 21: 31.3 / 53.8 (64x256x21 42.5 / 74.7), 22: 32.9 / 46.7, 23:
      28.1 / 47.6; bf16 alike but 16: 41.1 / 46.2 (the tensor-core kernel's
      29.5 takes it first).  float32 every width below 28 that is not a
      multiple of 4 from 16: 17: 42.6 / 62.8, 18: 38.7 / 54.9, 19: 37.5 /
      55.5, 21: 35.0 / 54.9, 22: 39.0 / 49.6, 23: 36.2 / 46.2, 26: 31.6 /
      46.0; but 16: 38.6 / 28.4, 20: 30.4 / 28.8, 24: 33.1 / 27.6, 28: 29.9
      / 27.3 (25 and 27 not measured).
    * Wider planes, in bands (2026-12-02, benchmarks/depthwise_kernels.py,
      plane / window, forward; backward-input alike;
      benchmarks/results/depthwise_kernels_sweep_stride2_bands_h200_2026-12-02.txt): half types 3x3
      64x192x75 160.6 / 279.7, 64x40x150 133.7 / 143.1, 64x24x150 82.8 /
      87.3, 64x64x100 83.9 / 112.4, 64x96x57 47.6 / 69.8, but 64x32x112
      53.8 / 52.0 (16-byte rows); 5x5 64x192x75 235.0 / 330.3, 64x96x61
      76.2 / 97.7.  float32 3x3 64x192x75 220.8 / 300.4, 64x32x112 63.0 /
      67.1, 64x96x57 74.2 / 74.6, 64x64x100 105.5 / 104.4, but 64x40x150
      173.8 / 165.5 and 64x24x150 110.9 / 101.1; 5x5 64x192x75 311.9 /
      376.3, 64x96x61 93.9 / 96.1.  7x7 wider than 64 and any row over 160
      values: the window kernel (not measured).
    * The sweeps were square planes in float16 and float32; bfloat16
      follows float16 (it did within a few percent in every kernel-to-kernel
      comparison of 2026-12-01 and 2026-12-02, benchmarks/depthwise_kernels.py
      default shapes).

    Earlier rules (2026-12-01: half types at widths 14 to 32; float32 3x3
    at 28 to 56) predate the plane kernel's output buffer and unaligned unit
    copies (odd widths ran 1.5-2x slower: 14-wide fp16 3x3 148.9, 21-wide
    114.4) and the window kernel's register-partition-aware grid.
    """
    width = g.width if backward else g.out_width
    itemsize = numpy.dtype(dtype).itemsize
    size = g.filter_height
    if g.stride_h != 1:
        return _preferred_at_stride_2(g, itemsize)
    if width <= 7 and size == 7:
        return True
    if width < 10 or width > _MAX_PREFERRED_WIDTH:
        return False
    if itemsize == 2:
        if size == 3:
            return not (width % 8 == 0 and (width == 32 or width >= 128))
        if size == 5:
            return width < 32 or width % 8 != 0
        return width < 24 or (width % 4 == 0 and width < 32)
    if itemsize == 4:
        if size == 3:
            return width != 16 and width <= 128
        if size == 5:
            return width < 16 or width % 4 != 0
        return width < 16 or (width < 28 and width % 4 != 0)
    return False


def _preferred_at_stride_2(g, itemsize):
    """The stride-2 forward (the ops ask after the row kernel, which takes
    destinations of at most 10 columns), on sources of at most 160 columns:
    half types where the window kernel cannot stage its rows in 16-byte
    copies (source width not a multiple of 16 bytes, or rows under 32), and
    5x5 and 7x7 filters; float32 likewise where three source planes fit the
    cp.async buffers (whole planes per unit: in bands it lost, 64x192x75 5x5
    207.3 / 189.3, 64x144x150 3x3 497.9 / 437.6).  Measured on an H200
    (2026-12-02, benchmarks/depthwise_kernels.py --forward-only, GPU time per
    launch, us, plane / window; N = 64, "same" padding;
    benchmarks/results/depthwise_kernels_sweep_stride2_bands_h200_2026-12-02.txt):

    * half types (bfloat16 within 1% of float16): 64x288x38 3x3 34.7 / 86.1;
      64x816x19 5x5 45.0 / 188.5; 64x192x75 5x5 129.9 / 331.5; 64x240x28 3x3
      24.6 / 43.9; 64x384x28 5x5 45.9 / 136.3; 64x192x28 7x7 35.1 / 87.5;
      64x240x56 5x5 82.2 / 98.9; in bands 64x144x150 3x3 281.0 / 299.9.  The
      window kernel wins 3x3 on 16-byte rows of 32 values and more:
      64x144x56 38.5 / 35.5, 64x96x112 92.7 / 63.7 (in bands), 64x32x224
      110.0 / 84.3.
    * float32: 64x288x38 3x3 64.3 / 78.1; 64x816x19 5x5 47.2 / 169.0;
      64x672x14 5x5 25.5 / 77.3 (the row kernel takes it: 28.6).  The window
      kernel wins on 16-byte rows: 64x240x28 3x3 33.8 / 31.5, 64x384x28 5x5
      62.0 / 57.9, 64x192x28 7x7 43.9 / 40.0, 64x144x56 3x3 63.2 / 54.0,
      64x240x56 5x5 130.2 / 105.4, 64x512x16 3x3 32.1 / 22.6; and where the
      planes pass 48 KB (64x192x75 5x5 207.2 / 188.9).
    """
    if itemsize not in (2, 4) or g.width > _MAX_PREFERRED_WIDTH:
        return False
    row_bytes = g.width * itemsize
    if itemsize == 2:
        return g.filter_height > 3 or row_bytes % 16 != 0 or g.width < 32
    return row_bytes % 16 != 0 and _shared_bytes(g.height * g.width * itemsize, 0) <= SHARED_LIMIT


def round16(n):
    return -(-n // 16) * 16


def _shared_bytes(src_bytes, dst_bytes):
    """Shared memory of a unit of ``src_bytes`` source and ``dst_bytes``
    staged destination bytes (0: stored from registers): three raw buffers
    and the output buffer, each with 16 bytes of rounding and 16 for a range
    that starts between 16-byte boundaries."""
    return BUFFERS * (round16(src_bytes) + 16) + (round16(dst_bytes) + 16 if dst_bytes else 0)


def band_count(row_blocks, col_blocks, fits):
    """(num_bands, row blocks a band) of units of one band of one plane, or
    None: the fewest bands (as even as they can be) whose items fit a block
    and for whose row blocks ``fits(band_blocks)`` holds; at least two (the
    kernels take num_bands == 1 for units of whole planes)."""
    for wanted in range(max(2, -(-row_blocks * col_blocks // MAX_THREADS)), row_blocks + 1):
        band_blocks = -(-row_blocks // wanted)
        if band_blocks * col_blocks <= MAX_THREADS and fits(band_blocks):
            num_bands = -(-row_blocks // band_blocks)
            assert num_bands > 1
            return num_bands, band_blocks
    return None


def band_source_rows(band_blocks, item_rows, stride, filter_height, src_h):
    """Source rows a band of ``band_blocks`` row blocks reads at most (an
    item reaches (R - 1) * stride + KH rows)."""
    return min(src_h, (band_blocks * item_rows - 1) * stride + filter_height)


def _bands(row_blocks, col_blocks, item_rows, stride, filter_height, src_h, src_w, dst_w, itemsize, stage_outputs,
           copy_async, limit=SHARED_LIMIT):
    """(num_bands, row blocks a band, raw_bytes, out_stage_bytes) of units of
    one band of one plane (band_count) whose source rows and outputs fit the
    buffers (``limit`` bytes), or None."""
    def byte_counts(band_blocks):
        src_bytes = band_source_rows(band_blocks, item_rows, stride, filter_height, src_h) * src_w * itemsize
        return src_bytes, band_blocks * item_rows * dst_w * itemsize if stage_outputs else 0

    bands = band_count(row_blocks, col_blocks,
                       lambda band_blocks: not copy_async or _shared_bytes(*byte_counts(band_blocks)) <= limit)
    if bands is None:
        return None
    src_bytes, dst_bytes = byte_counts(bands[1])
    return (*bands, round16(src_bytes) + 16 if copy_async else 0, round16(dst_bytes) + 16 if stage_outputs else 0)


def _whole_plane_units(planes, items, plane_bytes, dst_plane_bytes, stage_outputs, src_alignment, limit=SHARED_LIMIT,
                       pitch_bytes=None):
    """(P, raw_bytes, out_stage_bytes) of units of P whole planes whose buffers fit ``limit`` bytes;
    ``pitch_bytes``: the planes' spacing in the buffers (default: back to back; else a multiple of 16,
    with plane_bytes one too: _pitch)."""
    if pitch_bytes is None:
        pitch_bytes = plane_bytes
    # Shared memory per unit plane; with an output buffer also per block
    # (each buffer's rounding and its room for a unit starting between
    # 16-byte boundaries: at most 31 bytes).
    per_plane, fixed = BUFFERS * pitch_bytes, 0
    if stage_outputs:
        per_plane, fixed = per_plane + dst_plane_bytes, 32 * (BUFFERS + 1)
        if (limit - fixed) // per_plane == 0:
            stage_outputs, per_plane, fixed = False, BUFFERS * pitch_bytes, 0
    per_unit = min(MAX_THREADS // items, (limit - fixed) // per_plane, planes)
    per_unit = max(1, min(per_unit, -(-planes // _MIN_UNITS)))
    # Every unit starts 16-byte aligned when P is a multiple of this.
    aligned_step = 16 // math.gcd(plane_bytes, 16)
    if per_unit >= aligned_step:
        per_unit -= per_unit % aligned_step
    # Units start 16-byte aligned when P planes are a multiple of 16 bytes
    # (and src is aligned); otherwise each buffer has 16 bytes more for the
    # copy from the boundary below.
    raw_bytes = round16((per_unit - 1) * pitch_bytes + plane_bytes) + (0 if (per_unit * plane_bytes) % 16 == 0 else 16)
    if src_alignment % 16 or BUFFERS * raw_bytes > limit:
        return per_unit, 0, 0
    return per_unit, raw_bytes, round16(per_unit * dst_plane_bytes) + 16 if stage_outputs else 0


def _expression(dtype, size, stride, backward, item_rows, pitched, index):
    return _compile.name_expression(KERNEL, _dtypes.ctype(dtype), size[0], size[1], stride,
                                    "true" if backward else "false", item_rows, "true" if pitched else "false", index)


# (stride, backward) of the specializations: the backward-input is a stride-1 correlation.
VARIANTS = ((1, False), (2, False), (1, True))
# Every R that row_choices names.
_ALL_ROWS = tuple(sorted({rows for dtype in (*DTYPES, numpy.dtype(numpy.float64)) for size, _ in FILTER_SIZES
                          for stride in (1, 2) for rows in row_choices(dtype.itemsize, size, stride)}))


def specializations(dtypes=None, filter_sizes=None, backward=None, large_index=(False, True)):
    """``(file, name expression)`` of every plane-kernel specialization.

    backward: None (both), False (forward, strides 1 and 2) or True (backward-input)."""
    def expression(dtype, size, index, stride, is_backward, item_rows, pitched):
        if item_rows not in row_choices(dtype.itemsize, size[0], stride) or (
                pitched and not pitch_capable(dtype.itemsize, size[0], stride, item_rows)):
            return None
        return _expression(dtype, size, stride, is_backward, item_rows, pitched, index)

    variants = [(stride, is_backward, item_rows, pitched) for stride, is_backward in VARIANTS
                if backward is None or is_backward == backward for item_rows in _ALL_ROWS for pitched in (False, True)]
    return [spec for spec in _compile.filter_size_specializations(
        KERNEL_FILE, expression, DTYPES, FILTER_SIZES, dtypes, filter_sizes, large_index, variants) if spec[1]]


@functools.lru_cache(maxsize=512)
def plan(g, dtype, backward, index, src_alignment, dst_alignment, item_rows=None, pitch_gap=None):
    """The Launch for this signature, or None when the plane kernel does not
    serve it.  ``src_alignment`` / ``dst_alignment``: the largest of 16, 8,
    4, 2, 1 dividing the source's / destination's address.  ``item_rows``:
    R, one of row_choices (tests and the sanitizer workload run each), or
    None for the rule's pick (_pick_rows).  ``pitch_gap``: bytes between the
    staged planes where units of several whole planes of a multiple of 16
    bytes take the cp.async path in a pitch_capable kernel (0 or one of
    _PITCH_GAPS, forced: tests), or None for the rule's pick (_pitch)."""
    if pitch_gap not in (None, 0, *_PITCH_GAPS):
        raise ValueError(f"pitch_gap: expected None, 0 or one of {_PITCH_GAPS}, got {pitch_gap!r}")
    size = (g.filter_height, g.filter_width)
    stride = g.stride_h
    if (
        size not in FILTER_SIZES
        or (stride, backward) not in VARIANTS
        or (g.stride_w, g.dilation_h, g.dilation_w) != (stride, 1, 1)
        or g.multiplier != 1
        or numpy.dtype(dtype) not in DTYPES
    ):
        return None
    src_h, src_w, dst_h, dst_w, offset_top, offset_left = _validate.correlation_frame(g, backward)
    planes = g.batch * g.channels
    if min(src_h, src_w, dst_h, dst_w) <= 0 or planes >= 2**31 - _MAX_GRID or max(src_h * src_w, dst_h * dst_w) >= 2**31:
        return None
    itemsize = numpy.dtype(dtype).itemsize
    pads = pair_pads(dtype, g.filter_height, stride, backward)
    if pads and not _pairs_within_pads(src_w, dst_w, offset_left, stride, g.filter_width):
        src_alignment = 1  # the element path: reads global memory value by value
    pack = min(16, COLUMNS * itemsize)
    vector_stores = int(dst_w % COLUMNS == 0 and dst_alignment % pack == 0)
    frame = (planes, src_h, src_w, dst_h, dst_w, itemsize, stride, g.filter_height, vector_stores, src_alignment, pads,
             offset_top, offset_left, pitch_gap)
    layouts = {r: _units(r, *frame) for r in row_choices(itemsize, g.filter_height, stride)}
    layouts = {r: layout for r, layout in layouts.items() if layout is not None}
    if item_rows is None and layouts:
        item_rows = _pick_rows(layouts, dst_h, src_h, src_w, offset_top, offset_left, itemsize, g.filter_height,
                               pads)
    if item_rows not in layouts:
        return None
    per_unit, num_bands, row_blocks, col_blocks, raw_bytes, out_stage_bytes, src_pitch = layouts[item_rows]
    units = -(-planes // per_unit) * num_bands
    threads, shared = _block_shape(layouts[item_rows], pads)
    # The buffers were bounded with 16 bytes of rounding and 16 for a copy from the boundary below.
    assert shared <= SHARED_LIMIT
    return _launch.Launch(
        KERNEL_FILE,
        _expression(dtype, size, stride, backward, item_rows, src_pitch != src_h * src_w, index),
        (min(units, _MAX_GRID),),
        (threads,),
        shared,
        (
            i32(g.channels), i32(planes), i32(src_h), i32(src_w), i32(dst_h), i32(dst_w), i32(offset_top),
            i32(offset_left), i32(per_unit), i32(num_bands), i32(row_blocks), i32(col_blocks), i32(raw_bytes),
            i32(vector_stores), i32(out_stage_bytes), i32(src_pitch),
        ),
        persistent=True,
    )


def _block_shape(layout, pads):
    """(threads, shared bytes) of a block of units of ``layout`` (an
    _units(...) tuple): its items in whole warps, and the three raw buffers,
    the output buffer and, where the units are staged, ``pads``."""
    per_unit, _, row_blocks, col_blocks, raw_bytes, out_stage_bytes, _ = layout
    threads = -(-per_unit * row_blocks * col_blocks // 32) * 32
    return threads, BUFFERS * raw_bytes + out_stage_bytes + (pads if raw_bytes else 0)


def _units(item_rows, planes, src_h, src_w, dst_h, dst_w, itemsize, stride, filter_height, vector_stores,
           src_alignment, pads, offset_top, offset_left, pitch_gap=None):
    """(P, num_bands, row blocks a unit, column blocks, raw_bytes,
    out_stage_bytes, src_pitch) of the units of items of ``item_rows`` rows,
    or None when they cannot be formed; ``pads``: shared bytes around the
    buffers (pair_pads); src_pitch: values from one staged plane's start to
    the next's (src_h * src_w, or more where units of several planes of a
    multiple of 16 bytes are staged: ``pitch_gap`` bytes more, or _pitch's
    pick for None)."""
    row_blocks, col_blocks = -(-dst_h // item_rows), -(-dst_w // COLUMNS)
    if col_blocks > MAX_THREADS:
        return None
    plane_bytes = src_h * src_w * itemsize
    dst_plane_bytes = dst_h * dst_w * itemsize
    # Reads in pairs reach up to PAIR_PAD bytes past a row: each raw buffer ends in a tail of that many bytes,
    # so a unit's last row never reads into the next buffer while its copy lands, nor into the output buffer
    # (racecheck, H100 2026-12-06: 4 hazards where 16 float16 14x14 planes filled their buffer exactly).
    tail = PAIR_PAD if pads else 0
    limit = SHARED_LIMIT - pads - BUFFERS * tail
    # Outputs through the shared output buffer where rows are not stored as
    # vectors and the source takes the cp.async path (16-byte aligned).
    stage_outputs = not vector_stores and src_alignment % 16 == 0
    whole = row_blocks * col_blocks <= MAX_THREADS and (
        src_alignment % 16 or _shared_bytes(plane_bytes, dst_plane_bytes if stage_outputs else 0) <= limit)
    if not whole and row_blocks == 1:
        # One row block a plane, and the plane passes the buffers (a source
        # far taller than the rows its outputs read: the backward-input with
        # padding past the image): whole planes read from global memory.
        whole, src_alignment, stage_outputs = True, 1, False
    src_pitch = src_h * src_w
    if whole:
        num_bands = 1
        units = functools.partial(_whole_plane_units, planes, row_blocks * col_blocks, plane_bytes, dst_plane_bytes,
                                  stage_outputs, src_alignment, limit)
        per_unit, raw_bytes, out_stage_bytes = units()
        if per_unit * src_h * src_w >= 2**31:  # in-unit offsets are int
            return None
        if (raw_bytes and per_unit > 1 and plane_bytes % 16 == 0 and pitch_gap != 0
                and pitch_capable(itemsize, filter_height, stride, item_rows)):
            pitch_bytes = plane_bytes + pitch_gap if pitch_gap else _pitch(
                units, item_rows, row_blocks, col_blocks, src_h, src_w, offset_top, offset_left, itemsize,
                filter_height, stride)
            pitched = units(pitch_bytes=pitch_bytes)
            if pitched[0] > 1:  # (a gap that leaves one plane a unit separates nothing)
                (per_unit, raw_bytes, out_stage_bytes), src_pitch = pitched, pitch_bytes // itemsize
    else:
        bands = _bands(row_blocks, col_blocks, item_rows, stride, filter_height, src_h, src_w, dst_w, itemsize,
                       stage_outputs, src_alignment % 16 == 0, limit)
        if bands is None:
            return None
        per_unit = 1
        num_bands, row_blocks, raw_bytes, out_stage_bytes = bands
    if -(-planes // per_unit) * num_bands >= 2**31 - _MAX_GRID:
        return None
    return per_unit, num_bands, row_blocks, col_blocks, raw_bytes + (tail if raw_bytes else 0), out_stage_bytes, src_pitch


# Gaps after each staged plane _pitch tries (bytes; cp.async lands 16-byte vectors at 16-byte boundaries).
_PITCH_GAPS = (16, 32, 48, 64, 80, 96, 112)
# The conflict count (_bank_conflicts) from which _pitch staggers the planes.
_PITCH_DEGREE = 6.0


def _pitch(units, item_rows, row_blocks, col_blocks, src_h, src_w, offset_top, offset_left, itemsize, filter_height,
           stride):
    """Bytes from one staged plane's start to the next's, for units of whole
    planes of a multiple of 16 bytes (``units(pitch_bytes=...)``: their
    (P, raw_bytes, out_stage_bytes)): the plane's bytes (back to back), or,
    where the warps' window reads of that layout conflict _PITCH_DEGREE-way
    or more (_bank_conflicts), the plane's bytes plus the gap of _PITCH_GAPS
    whose layout they read with the fewest conflicts per busy lane (ties to
    the smaller gap).

    Only pitch_capable kernels take a gap.  Why the threshold: H100,
    2026-12-05, fp16 NCHW GPU us, back to back / a gap (the count's pick):
    64x1024x16 5x5 forward 60.8 and 59.1 (7 rows back to back, the rule
    then; 4 rows back to back, 7.0-way, 75.1 in the 2026-12-05 sweep) / 50.0
    and 49.3 (4 rows, a 32-byte gap: 3.5-way; 7 rows with a gap 57.6, 2.9 ->
    2.0), backward-input 57.8 / 48.6; but where back to
    back already spread the reads (2.4-3.0-way) gaps moved nothing or lost
    (a prototype that let every kernel pitch): 64x448x24 5x5 4 rows 50.9 /
    51.2 (3.0 -> 2.6), 64x640x20 3x3 36.6 / 37.6 (2.7 -> 2.4), 64x576x20 3x3
    s2 25.2 / 26.7, float32 64x640x20 3x3 53.6 / 54.8 (5.3 -> 4.8).  As
    shipped, H200: 64x1024x16 fp16 forward 58.6 / 48.4, backward-input 55.5
    / 48.4, bf16 61.6 / 52.9 and 61.2 / 53.0 (second runs alike); the 8 MB
    32x512x16 fp16 19.2-20.1 / 16.4-16.5 (an H100: 17.5 / 17.0; its bf16
    runs 17.8 and 20.1 after, 20.5 and 19.6 before: noise at this size);
    results/depthwise_nchw_plane_pitch_2026-12-05.txt."""
    plane_bytes = src_h * src_w * itemsize

    def cost(pitch_bytes):
        per_unit = units(pitch_bytes=pitch_bytes)[0]
        items = per_unit * row_blocks * col_blocks
        degree = _bank_conflicts(item_rows, per_unit, row_blocks, col_blocks, src_h, src_w, offset_top, offset_left,
                                 itemsize, filter_height, stride, pitch_bytes // itemsize)
        return degree / _busy_lane_share(items), degree

    if cost(plane_bytes)[1] < _PITCH_DEGREE:
        return plane_bytes
    candidates = [plane_bytes + gap for gap in _PITCH_GAPS if units(pitch_bytes=plane_bytes + gap)[0] > 1]
    return min((plane_bytes, *candidates), key=lambda pitch: cost(pitch)[0])


# Issue besides the shared-memory window reads, per read, in units of a
# conflict-free read, by filter size (_pick_rows adds it to the conflict
# degree): fitted to sweeps, not derived.  5x5 (R = 4 or 7): 0, the count of
# the conflicts alone (17 heights, H100, 2026-12-05).  3x3 (R = 6, 7 or 8;
# H100, 2026-12-05, fp16 and bf16, forward and backward-input, 33 widths
# 10-150 at 32-130 MB, 104 cells in two runs;
# results/depthwise_nchw_plane_3x3_rows_h100_2026-12-05.txt): with 0 the
# count took 7 rows at 22 (28 computed, 1.9-way against 8 rows' 24 at
# 2.6-way) and lost 5-18% there; from 3 to 8 the picks come within 4% of
# the fastest R at 96-98 of the 104 cells, geomean 0.968-0.969 of 8 rows'
# time (the fastest R each time: 0.960); 4.
_NON_READ_ISSUE = {3: 4.0, 5: 0.0}
# Filter sizes whose taller items need a plane that holds two of them (else
# the shortest R): 5x5, where 7-row items of 10-row planes (half the second
# idle) lost 2-5% to 4-row ones (H100, 2026-12-05).  Not 3x3: there the
# filter cost 11-18% at 13 and 15 rows (6 rows, where 7 and 8 measured
# 40.1 against 46.7-47.3 us at 64x1552x13, 8 rows 35.7-36.2 against 39.1-39.5
# at 64x1168x15 fp16; the same sweep).
_TALL_ITEMS_NEED_TWO = (5,)
# The share of planes a multiprocessor holds at once (_resident_planes: a
# unit's planes over the bands a plane splits into, times the blocks
# resident) to this power divides the count (3x3 only).  Why: at 64x80x63
# fp16 the count alone took 6 rows (1 plane a unit, 192 threads: 4 blocks,
# 4 planes at once) where 8 rows (128 threads: 6 blocks) ran 13% faster on
# an H200 (36.1 against 41.4 us forward) and 9% on an H100, at the same 24
# warps.  Fitted on 168 cells with each R forced (104 H100 cells of
# results/depthwise_nchw_plane_3x3_rows_h100_2026-12-05.txt, 36 of
# results/depthwise_nchw_plane_multiples_of_8_h200_2026-12-06.txt, 28 of
# results/depthwise_nchw_plane_28_2026-12-06.txt's main runs): 0.2 took the
# picks from 1.009 to 1.007 of the fastest R's time (geomean) on the H100
# cells, 1.017 to 1.013 and 1.031 to 1.009 on the H200 ones; 0.1 changed
# nothing, 0.3 lost on the H200 sweep.  Counting whole planes a unit (not
# their share of a banded plane) lost out of sample at 64x40x80 (6 rows in
# two bands: 32.2 us against 26.6 at 7) and 64x32x88 (29.4 / 26.9): the
# share fixed both and changed no in-sample pick (H200, 2026-12-06: 28
# cells at 14 widths where the pick moved, 1.061 -> 1.004 of the fastest
# R).  Out of sample, at the next 14 widths where it moves main's pick
# (H100, 2026-12-06): 1.054 -> 1.009 (25 of 28 cells within 4%, was 10);
# results/depthwise_nchw_plane_in_flight_2026-12-06.txt.  5x5: 0.
_IN_FLIGHT_EXPONENT = {3: 0.2, 5: 0.0}
# The 2-byte 3x3 6-8-row kernels' registers a thread (ptxas: 78-80), and an
# sm_90 multiprocessor's registers, shared memory (less 1 KB a block the
# driver keeps) and threads.
_ITEM_REGISTERS = 80
_SM_REGISTERS, _SM_SHARED, _BLOCK_SHARED_RESERVED, _SM_THREADS = 65536, 227 * 1024, 1024, 2048


def _resident_planes(per_unit, num_bands, threads, shared):
    """The planes a multiprocessor holds at once: a unit's planes (per_unit,
    or the 1 / num_bands of a plane one band is) times the blocks of
    ``threads`` threads and ``shared`` bytes that fit it."""
    blocks = min(_SM_REGISTERS // (threads * _ITEM_REGISTERS), _SM_SHARED // (shared + _BLOCK_SHARED_RESERVED),
                 _SM_THREADS // threads, 32)
    return per_unit / num_bands * max(blocks, 1)


def _pick_rows(layouts, dst_h, src_h, src_w, offset_top, offset_left, itemsize, filter_height, pads=0):
    """R among ``layouts`` ({R: _units(R, ...)}): for 7x7 the one that computes
    the fewest rows (ties to 7); for 3x3 and 5x5 the one whose reads of the
    shared source cost least, counted as the destination rows computed (row
    blocks overhang the plane) times the mean shared-memory bank conflict
    degree of the warps' window reads (_bank_conflicts; 1 on the element
    path, which reads global memory) plus the filter's other issue
    (_NON_READ_ISSUE), over the share of a block's warp lanes that own an
    item and over the planes a multiprocessor holds at once to the power
    _IN_FLIGHT_EXPONENT (``pads``: the shared bytes plan() adds to the
    buffers); ties to the smaller R.

    Why a model: for 2-byte 5x5 at stride 1 (R = 4 or 7) the winner turns
    with the plane size and follows this count.  H100, 2026-12-05, 64xCxHxH
    fp16 forward, "same" padding, about 32 MB a tensor, us at R = 4 / 7 (the
    count at 4 / 7): H = 12 52.0 / 64.6 (2.5 / 3.3), 16 75.1 / 61.3 (7.0 /
    3.9), 17 89.3 / 71.6 (4.4 / 2.5), 19 69.2 / 63.3 (2.7 / 2.6), 24 52.0 /
    55.8 (3.0 / 3.2), 28 49.9 / 57.8 (2.9 / 4.8), 33 70.6 / 63.1 (3.8 / 2.4),
    38 64.8 / 56.1 (3.0 / 2.2); of the 17 heights measured (10 to 75) it
    picks the faster R at every one but 60 (55.1 / 52.7: 4.5% slower) and
    three within 2% (10, 42, 50; 7 is left out below 14 rows, and 10
    measured 2-5% slower at 7 in a second run);
    benchmarks/results/depthwise_nchw_plane_5x5_rows_h100_2026-12-05.txt.
    Without the lanes' share it missed 19 by 9%.  The kernel is issue-bound
    on its shared-memory reads (a 2-byte load per source value: the static
    count of 2026-12-05), so a read conflicting n-way costs about n times
    its issue, and idle lanes issue as busy ones.  (The sweep predates
    float16's reads in pairs, PAIR_PAD: half the loads, of the same words,
    so the same count per load; the rule was not swept again with them.)
    Each R's count is that of its layout, staged planes a gap apart where
    _pitch takes one: at 16 rows 4-row items then count 3.5 against 7-row
    ones' 2.9 over 21 rows computed for 16, and measured 49-50 us against
    57-61 (results/depthwise_nchw_plane_pitch_2026-12-05.txt)."""
    shortest = min(layouts)
    if filter_height == 7:
        # 7x7 (R = 4 or 7): the fewest destination rows computed, ties to 7 (the FMAs dominate the issue, and a
        # 7-row item shares its 49 weights, masks and window reads over 28 outputs, not 16).  H100, 2026-12-06,
        # GPU us forward at R = 4 / 7 (each forced; backward-input alike), 64xCxHxH, "same" padding
        # (results/depthwise_7x7_rows_h100_2026-12-06.txt, part 3): float32 H = 7 23.9 / 19.4, 13 17.8 / 14.6,
        # 14 39.8 / 33.0, 21 56.3 / 49.4, 28 58.9 / 54.7; float16 7 16.9 / 15.4, 13 16.0 / 13.3, 14 32.2 / 29.4,
        # 21 48.0 / 43.2, 28 45.3 / 42.3; at 12 rows (12 computed against 14) float32 33.6 / 37.8, float16
        # 27.0 / 26.2, and at 10 (12 against 14; part 2's build) float32 26.8 / 27.7, float16 22.4 / 23.7.
        return min(sorted(layouts, reverse=True), key=lambda r: -(-dst_h // r) * r)
    if filter_height in _TALL_ITEMS_NEED_TWO:
        layouts = {r: layout for r, layout in layouts.items() if r == shortest or dst_h >= 2 * r}
    if len(layouts) == 1:
        return shortest

    def cost(item_rows):
        per_unit, num_bands, row_blocks, col_blocks, raw_bytes, _, src_pitch = layouts[item_rows]
        rows_computed = -(-dst_h // (row_blocks * item_rows)) * row_blocks * item_rows
        degree = _bank_conflicts(item_rows, per_unit, row_blocks, col_blocks, src_h, src_w, offset_top, offset_left,
                                 itemsize, filter_height, 1, src_pitch) if raw_bytes else 1.0
        items = per_unit * row_blocks * col_blocks
        in_flight = _resident_planes(per_unit, num_bands, *_block_shape(layouts[item_rows], pads))
        return (rows_computed / dst_h * (degree + _NON_READ_ISSUE[filter_height]) / _busy_lane_share(items)
                * in_flight ** -_IN_FLIGHT_EXPONENT[filter_height])

    return min(sorted(layouts), key=cost)


def _busy_lane_share(items):
    """The share of a block's warp lanes that own an item (a thread an item,
    the block rounded up to whole warps): idle lanes issue as busy ones."""
    return items / (-(-items // 32) * 32)


@functools.lru_cache(maxsize=1024)
def _bank_conflicts(item_rows, per_unit, row_blocks, col_blocks, src_h, src_w, offset_top, offset_left, itemsize,
                    filter_height, stride=1, pitch=None):
    """Mean over the warps of a unit and the window reads of the forward
    kernel (per source row t and window column k, one 2- or 4-byte shared
    load a thread) of the largest number of distinct 4-byte words one of the
    32 banks serves (1: conflict-free; threads reading the same word share
    it).  The unit's first band (or its planes, ``pitch`` values apart:
    default src_h * src_w) from the buffer's start; threads whose value lies
    in the padding do not read."""
    span = (COLUMNS - 1) * stride + filter_height
    pitch = src_h * src_w if pitch is None else pitch
    thread = numpy.arange(per_unit * row_blocks * col_blocks)
    plane, item = numpy.divmod(thread, row_blocks * col_blocks)
    row_block, col_block = numpy.divmod(item, col_blocks)
    rows = ((row_block * item_rows * stride - offset_top)[:, None, None]
            + numpy.arange((item_rows - 1) * stride + filter_height)[None, :, None])
    cols = (col_block * COLUMNS * stride - offset_left)[:, None, None] + numpy.arange(span)[None, None, :]
    inside = (rows >= 0) & (rows < src_h) & (cols >= 0) & (cols < src_w)
    words = numpy.where(inside, (plane[:, None, None] * pitch + rows * src_w + cols) * itemsize // 4, -1)
    # (warp, read) groups of 32 lanes, the padding lanes of the last warp not reading
    warps = -(-thread.size // 32)
    words = numpy.concatenate([words, numpy.full((warps * 32 - thread.size,) + words.shape[1:], -1)])
    groups = words.reshape(warps, 32, -1).transpose(0, 2, 1).reshape(-1, 32)
    groups = numpy.sort(groups, axis=1)
    first = numpy.ones(groups.shape, bool)
    first[:, 1:] = groups[:, 1:] != groups[:, :-1]
    distinct = first & (groups >= 0)
    per_bank = numpy.zeros((groups.shape[0], 32), numpy.int64)
    numpy.add.at(per_bank, (numpy.nonzero(distinct)[0], groups[distinct] % 32), 1)
    degree = per_bank.max(axis=1)
    reading = degree > 0
    return float(degree[reading].mean()) if reading.any() else 1.0


def reads_pairs(dtype, filter_height, stride, backward):
    """Whether the kernel reads its shared source rows in 4-byte pairs
    (kernel: kPairedReads): float16, but the 3x3 stride-1 forward (H200,
    2026-12-05: 3-4% slower in pairs, results/depthwise_nchw_plane_pitch_2026-12-05.txt;
    H100: 2% over widths 10-38, results/depthwise_nchw_plane_per_value_h100_2026-12-05.txt)."""
    return numpy.dtype(dtype) == numpy.float16 and not (filter_height == 3 and stride == 1 and not backward)


def pair_pads(dtype, filter_height, stride, backward):
    """Shared bytes around the buffers for reads in pairs (both pads), 0
    where the kernel reads values one by one (reads_pairs)."""
    return 2 * PAIR_PAD if reads_pairs(dtype, filter_height, stride, backward) else 0


def _pairs_within_pads(src_w, dst_w, offset_left, stride, filter_width):
    """Whether a window row's 4-byte words (from one value before its first,
    when that starts a word's upper half, to one past the word holding its
    last) stay within PAIR_PAD bytes of its source row: so before the
    buffers and after them only the pads are read.  Rows reach offset_left
    columns left of the image and the last column block's window past its
    right edge (at stride 2 its overhanging outputs' windows: 9 values past a
    19-wide row for 5x5); a left padding of more than 15 columns (or a right
    overhang of more than 15) takes the element path."""
    pairs = (COLUMNS - 1) * stride + filter_width
    pairs = (pairs + 1) // 2
    first = -offset_left - 1
    last = (-(-dst_w // COLUMNS) - 1) * COLUMNS * stride - offset_left + 2 * pairs + 1
    return -first * 2 <= PAIR_PAD and (last - (src_w - 1)) * 2 <= PAIR_PAD
