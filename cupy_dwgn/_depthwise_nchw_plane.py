"""NCHW whole-plane kernel (kernels/depthwise_nchw_plane.cu): forward and
backward-input for 3x3, 5x5 and 7x7 filters at stride 1, dilation 1 and
depth multiplier 1, on planes of at most 256 thread items, in float32,
float16 and bfloat16 (float64 keeps the window kernel).

Launch rule (no user tuning), from the destination plane size:

* A thread owns R x V = 4 x 4 destination values (float64 5x5 and 7x7:
  2 x 4) and reads its window straight from the unit's raw source planes
  (padding skipped or masked in registers).
* A block takes P = min(256 // items, 16 KB // plane bytes) planes, fewer
  when that would leave under _MIN_UNITS units for the whole call (small
  batches still spread over the SMs), rounded down to a multiple that keeps
  every unit 16-byte aligned; its threads are the unit's items rounded up
  to a warp.  The grid is persistent: at most the blocks resident at once
  (Launch.persistent), each walking units grid-size apart.
* Sources are copied with 16-byte cp.async into three raw shared buffers,
  one unit ahead, when the source is 16-byte aligned (a unit that starts
  between 16-byte boundaries is copied from the boundary below it, 16 more
  bytes per buffer); otherwise the threads read them from global memory.
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
_MAX_THREADS = 256
_SHARED_LIMIT = 48 * 1024
# At least this many units per call where planes allow (2 blocks on each of
# an H200's 132 SMs): P shrinks for small batches.
_MIN_UNITS = 264
# Raw source buffers per block (kernel: kBuffers).
_BUFFERS = 3
_MAX_GRID = 2**20



def rows(itemsize, filter_height):
    """Destination rows per thread (kernel: kRows)."""
    return 2 if itemsize == 8 and filter_height > 3 else 4


def preferred(g, dtype, backward):
    """Whether the plane kernel beats the window kernel for this geometry
    (the window kernel also serves it).  Both kernels are sensitive to the
    row width's alignment (the plane kernel stores 4-value vectors only on
    rows of a multiple of 4, the window kernel's 16-byte column vectors
    favour multiples of 8), so the rule goes by width modulo 4 and 8 rather
    than by size alone.  Measured on an H200 (2026-12-02,
    benchmarks/depthwise_kernels.py --shapes: N = 64, "same" padding, about
    64 MB per tensor, widths 10 to 64; plane against window, us, forward;
    backward-input within a few percent of it):

    * half types, 3x3: the plane kernel at widths of a multiple of 4 that
      are not a multiple of 8 from 32 up (12: 60.5 / 138.8, 20: 58.7 /
      110.0, 28: 58.9 / 105.4, 44: 57.4 / 114.5, 60: 59.3 / 99.5; 16: 83.1 /
      101.7, 24: 56.4 / 85.7) and at odd widths from 25 (25: 103.4 / 118.3,
      29: 91.8 / 106.0, 33: 98.3 / 107.9); the window kernel at multiples of
      8 from 32 (32: 55.4 / 48.5, 56: 64.3 / 52.7) and at the other widths
      (14: 147.4 / 123.1, 19: 135.3 / 112.0, 22: 126.1 / 106.4).
    * half types, 5x5: widths 12 to 31 (12: 97.8 / 254.1, 16: 132.4 / 185.5,
      28: 98.7 / 152.1; 32: 94.0 / 87.3, 56: 115.1 / 80.4); 7x7: widths 12
      to 31 but multiples of 8 (12: 167.2 / 266.5, 28: 165.8 / 184.2; 16:
      206.9 / 192.9, 24: 162.4 / 166.9, 32: 161.8 / 111.7).
    * float32, 3x3: widths of a multiple of 4 from 12 to 64 but 16 (12: 79.6
      / 108.4, 28: 75.9 / 82.7, 56: 72.6 / 79.8; 16: 93.3 / 86.4; 14: 170.2 /
      115.3, 30: 133.2 / 106.3); 5x5 and 7x7: width 12 only (5x5 12: 117.2 /
      154.0, 14: 173.9 / 174.4, 16: 141.8 / 113.3; 7x7 12: 176.1 / 196.2, 14:
      232.7 / 213.5).
    * Below width 12 the row kernel (_depthwise_nchw_rows) usually serves;
      where it does not, the window kernel does (no sweep there).

    The earlier rule (2026-12-01: half types at widths 14 to 32, 56x56 3x3
    backward; float32 3x3 at 28 to 56) was measured on a few widths only and
    before the window kernel's grid counted its registers per SM partition
    (its 3x3 backward-input at 56x56 half: 77.8 then, 49.1 now against the
    plane kernel's 57.1).
    """
    width = g.width if backward else g.out_width
    itemsize = numpy.dtype(dtype).itemsize
    size = g.filter_height
    if width < 12:
        return False
    if itemsize == 2:
        if size == 3:
            return (width % 4 == 0 and (width % 8 != 0 or width < 32)) or (width % 2 == 1 and width >= 25)
        if size == 5:
            return width < 32
        return width < 32 and width % 8 != 0
    if itemsize == 4:
        return width % 4 == 0 and width != 16 if size == 3 else width == 12
    return False


def _round16(n):
    return -(-n // 16) * 16


def _expression(dtype, size, backward, index):
    return _compile.name_expression(KERNEL, _dtypes.ctype(dtype), size[0], size[1], "true" if backward else "false", index)


def specializations(dtypes=None, filter_sizes=None, backward=None, large_index=(False, True)):
    """``(file, name expression)`` of every plane-kernel specialization.

    backward: None (both), False (forward) or True (backward-input)."""
    return _compile.filter_size_specializations(
        KERNEL_FILE, lambda dtype, size, index, is_backward: _expression(dtype, size, is_backward, index),
        DTYPES, FILTER_SIZES, dtypes, filter_sizes, large_index,
        [(False,), (True,)] if backward is None else [(backward,)])


@functools.lru_cache(maxsize=512)
def plan(g, dtype, backward, index, src_alignment, dst_alignment):
    """The Launch for this signature, or None when the plane kernel does not
    serve it.  ``src_alignment`` / ``dst_alignment``: the largest of 16, 8,
    4, 2, 1 dividing the source's / destination's address."""
    size = (g.filter_height, g.filter_width)
    if (
        size not in FILTER_SIZES
        or (g.stride_h, g.stride_w, g.dilation_h, g.dilation_w) != (1, 1, 1, 1)
        or g.multiplier != 1
        or numpy.dtype(dtype) not in DTYPES
    ):
        return None
    src_h, src_w, dst_h, dst_w, offset_top, offset_left = _validate.correlation_frame(g, backward)
    planes = g.batch * g.channels
    if min(src_h, src_w, dst_h, dst_w) <= 0 or planes >= 2**31 - _MAX_GRID:
        return None
    itemsize = numpy.dtype(dtype).itemsize
    item_rows = rows(itemsize, g.filter_height)
    row_blocks, col_blocks = -(-dst_h // item_rows), -(-dst_w // COLUMNS)
    items = row_blocks * col_blocks
    if items > _MAX_THREADS:
        return None
    plane_bytes = src_h * src_w * itemsize
    dst_plane_bytes = dst_h * dst_w * itemsize
    pack = min(16, COLUMNS * itemsize)
    vector_stores = int(dst_w % COLUMNS == 0 and dst_alignment % pack == 0)
    # Shared memory per unit plane; with an output buffer also per block
    # (each buffer's rounding and its room for a unit starting between
    # 16-byte boundaries: at most 31 bytes).
    stage_outputs = not vector_stores and src_alignment % 16 == 0
    per_plane, fixed = _BUFFERS * plane_bytes, 0
    if stage_outputs:
        per_plane, fixed = per_plane + dst_plane_bytes, 32 * (_BUFFERS + 1)
        if (_SHARED_LIMIT - fixed) // per_plane == 0:
            stage_outputs, per_plane, fixed = False, _BUFFERS * plane_bytes, 0
    per_unit = min(_MAX_THREADS // items, (_SHARED_LIMIT - fixed) // per_plane, planes)
    per_unit = max(1, min(per_unit, -(-planes // _MIN_UNITS)))
    # Every unit starts 16-byte aligned when P is a multiple of this.
    aligned_step = 16 // math.gcd(plane_bytes, 16)
    if per_unit >= aligned_step:
        per_unit -= per_unit % aligned_step
    if per_unit * src_h * src_w >= 2**31:  # in-unit offsets are int
        return None
    units = -(-planes // per_unit)
    threads = -(-per_unit * items // 32) * 32
    # Units start 16-byte aligned when P planes are a multiple of 16 bytes
    # (and src is aligned); otherwise each buffer has 16 bytes more for the
    # copy from the boundary below.
    raw_bytes = _round16(per_unit * plane_bytes) + (0 if (per_unit * plane_bytes) % 16 == 0 else 16)
    copy_async = src_alignment % 16 == 0 and _BUFFERS * raw_bytes <= _SHARED_LIMIT
    if not copy_async:
        raw_bytes, stage_outputs = 0, False
    out_stage_bytes = _round16(per_unit * dst_plane_bytes) + 16 if stage_outputs else 0
    if _BUFFERS * raw_bytes + out_stage_bytes > _SHARED_LIMIT:
        out_stage_bytes = 0
    return _launch.Launch(
        KERNEL_FILE,
        _expression(dtype, size, backward, index),
        (min(units, _MAX_GRID),),
        (threads,),
        _BUFFERS * raw_bytes + out_stage_bytes,
        (
            i32(g.channels), i32(planes), i32(src_h), i32(src_w), i32(dst_h), i32(dst_w), i32(offset_top),
            i32(offset_left), i32(per_unit), i32(row_blocks), i32(col_blocks), i32(raw_bytes), i32(vector_stores),
            i32(out_stage_bytes),
        ),
        persistent=True,
    )
