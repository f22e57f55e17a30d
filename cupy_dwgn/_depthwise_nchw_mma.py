"""NCHW forward (stride 1) and backward-input on the tensor cores
(kernels/depthwise_nchw_mma.cu): float16 and bfloat16, 3x3 / 5x5 / 7x7
filters at dilation 1, depth multiplier 1, float32 accumulation.  Per
channel and filter row, a tile of 16 x 8 outputs is one matrix product of
16 image rows with a banded matrix of the filter row (the kernel's header
says why and how); a strip that meets a non-finite value is recomputed
output by output, so infs and NaNs reach exactly the outputs whose windows
hold them.  The ops take it where ``preferred`` says so; ``MODE`` overrides
that for tests and benchmarks.

Launch rule (no user tuning), from the shape only:

* A block of 128 threads (4 warps) owns P consecutive planes (a unit); its
  (plane, 16-row tile) items are dealt to the warps.  P gives the warps
  about two items each (P = ceil(8 / row tiles)), fewer where the shared
  memory passes ``SHARED_TARGET`` (at least one plane, up to ``MAX_SHARED``)
  or where the call would have fewer than ``MIN_UNITS`` units.
* Shared memory: P zero-padded images (rows: every row a tile reads,
  columns: ``LEFT`` zeros, the source row, zeros to the last tile's window;
  a row of an odd number of 16-byte vectors) and the unit's destination
  planes, staged for 16-byte stores.
* Rows are copied in cp.async pieces of 16, 8 or 4 bytes (the largest that
  divides the row bytes and the source address), else 2-byte loads.
* Served where the correlation's offsets lie in [0, LEFT] (padding at most
  the filter size minus one for the backward-input).
"""

import functools

import numpy

from . import _compile, _dtypes, _launch, _validate
from ._launch import i32

#: "rule": the ops take this kernel where ``preferred`` says it wins;
#: "always": wherever it serves the call (tests, the sanitizer workload,
#: benchmarks); "never": not at all.
MODE = "rule"

KERNEL_FILE = "depthwise_nchw_mma.cu"
KERNEL = "dwgn_dwconv2d_mma"
FILTER_SIZES = ((3, 3), (5, 5), (7, 7))
DTYPES = (numpy.dtype(numpy.float16), _dtypes.bfloat16)
VARIANTS = ((1, False), (1, True))  # (stride, backward)

WARPS = 4  # kernel: kWarps
THREADS = 32 * WARPS
LEFT = 8  # kernel: kLeft, the image column of source column 0
#: Shared memory a block aims at (4 blocks an SM) and may take (the opt-in
#: limit of every sm_80+ GPU but the A100/H100/H200 class), so plans do not
#: depend on the device.
SHARED_TARGET = 48 * 1024
MAX_SHARED = 99 * 1024
#: Units per call the planes per unit leave at least (2 blocks on each of an
#: H200's 132 SMs), where there are that many planes.
MIN_UNITS = 264
_MAX_GRID = 2**31 - 1


def _expression(dtype, k, stride, backward, index):
    return _compile.name_expression(KERNEL, _dtypes.ctype(dtype), k, str(backward).lower(), index)


def specializations(dtypes=None, filter_sizes=None, backward=None, large_index=(False, True)):
    """``(file, name expression)`` of every specialization.

    backward: None (both), False (forward) or True (backward-input)."""
    return _compile.direction_specializations(KERNEL_FILE, _expression, DTYPES, FILTER_SIZES, VARIANTS, dtypes,
                                              filter_sizes, backward, large_index)


def preferred(g, dtype, backward):
    """Whether the ops take this kernel for ``g`` (where it serves the call)."""
    return False


def select(g, dtype, backward, index, src_alignment, dst_alignment):
    """``plan(...)`` when the ops take this kernel (per ``MODE``), else None."""
    if MODE == "never" or (MODE == "rule" and not preferred(g, dtype, backward)):
        return None
    return plan(g, dtype, backward, index, src_alignment, dst_alignment)


def image_shape(g, backward):
    """(rows, row stride in values) of a plane's zero-padded image (kernel
    header), or None when the correlation's offsets leave [0, LEFT]."""
    src_h, src_w, dst_h, dst_w, offset_top, offset_left = _validate.correlation_frame(g, backward)
    if not (0 <= offset_top and 0 <= offset_left <= LEFT):
        return None
    row_tiles, col_tiles = -(-dst_h // 16), -(-dst_w // 8)
    rows = max(16 * row_tiles + g.filter_height - 1, offset_top + src_h)
    # The last tile's window ends 16 columns past it; an odd number of
    # 16-byte vectors a row keeps ldmatrix's 8 rows in different banks.
    stride = -(-max(8 * col_tiles + 16, LEFT + src_w) // 8) * 8
    if stride // 8 % 2 == 0:
        stride += 8
    return rows, stride


def unit_planes(planes, row_tiles, image_bytes, dst_plane_bytes):
    """(P, dynamic shared memory) of units of P planes, or None when one
    plane passes ``MAX_SHARED``."""
    def shared(p):
        return p * image_bytes + -(-p * dst_plane_bytes // 16) * 16 + 16

    if shared(1) > MAX_SHARED:
        return None
    per_unit = max(1, min(-(-2 * WARPS // row_tiles), -(-planes // MIN_UNITS)))
    while per_unit > 1 and shared(per_unit) > SHARED_TARGET:
        per_unit -= 1
    return per_unit, shared(per_unit)


@functools.lru_cache(maxsize=1024)
def plan(g, dtype, backward, index, src_alignment, dst_alignment):
    """The Launch for this signature (arguments: src, weight, bias or the
    null pointer, dst), or None when this kernel does not serve it.
    ``*_alignment``: the largest of 16, 8, 4, 2, 1 dividing the address."""
    dtype = numpy.dtype(dtype)
    if (
        (g.filter_height, g.filter_width) not in FILTER_SIZES
        or dtype not in DTYPES
        or (g.stride_h, g.stride_w, g.dilation_h, g.dilation_w, g.multiplier) != (1, 1, 1, 1, 1)
        or min(g.batch, g.channels, g.height, g.width, g.out_height, g.out_width) <= 0
        or src_alignment % 2 or dst_alignment % 2
    ):
        return None
    shape = image_shape(g, backward)
    if shape is None:
        return None
    image_rows, row_stride = shape
    src_h, src_w, dst_h, dst_w, offset_top, offset_left = _validate.correlation_frame(g, backward)
    planes = g.batch * g.channels
    if planes >= 2**31:
        return None
    units = unit_planes(planes, -(-dst_h // 16), image_rows * row_stride * 2, dst_h * dst_w * 2)
    if units is None:
        return None
    per_unit, shared = units
    grid = -(-planes // per_unit)
    if grid > _MAX_GRID:
        return None
    row_bytes = 2 * src_w
    piece = next((p for p in (16, 8, 4) if row_bytes % p == 0 and src_alignment % p == 0), 2)
    return _launch.Launch(
        KERNEL_FILE,
        _expression(dtype, g.filter_height, 1, backward, index),
        (grid,),
        (THREADS,),
        shared,
        (
            i32(g.channels), i32(planes), i32(src_h), i32(src_w), i32(dst_h), i32(dst_w), i32(offset_top),
            i32(offset_left), i32(per_unit), i32(image_rows), i32(row_stride), i32(piece),
        ),
    )
