"""Channels-last (NHWC) row-ring kernel (kernels/depthwise_nhwc_ring.cu): 3x3
filters, forward at stride 1 or 2 and backward-input at stride 1 (the forward
correlation with the rotated filter), dilation 1, depth multiplier 1, float32,
float16 and bfloat16.  Whole input rows (W x C, contiguous in NHWC) are
copied once each into a ring of shared-memory rows (one cp.async.bulk per
row on sm_90), a few rows ahead of the compute.

Launch rule (no user tuning), from the shape only:

* A thread owns 4 channels (``VEC``) and strips of TW output columns
  (``SETTINGS[k, stride, itemsize]``: TW, threads aimed at, output rows
  prefetched); the block is C / 4 channel vectors x G column groups, G the
  largest count with at most the aimed-at threads (at least 1; C / 4 <= 512).
* Ring: K + ahead * stride rows (ahead output rows prefetched), fewer down to
  K when the ring would pass ``MAX_SHARED`` bytes; None when K rows do not fit.
* Grid: persistent (as many blocks as are resident at once); each block takes
  a contiguous 1/grid share of the (image, output row) sequence.
* Requires C * itemsize % 16 == 0, 16-byte aligned arrays, rows under 1 MB.

The ops take it where ``preferred`` says so; ``MODE`` overrides that for
tests and benchmarks.
"""

import functools

import numpy

from . import _compile, _dtypes, _launch, _validate
from ._launch import i32

#: "rule": the ops take this kernel where ``preferred`` says it wins;
#: "always": wherever it serves the call (tests, the sanitizer workload,
#: benchmarks); "never": not at all.
MODE = "rule"

KERNEL_FILE = "depthwise_nhwc_ring.cu"
KERNEL = "dwgn_dwconv_nhwc_ring"
FILTER_SIZES = ((3, 3),)
DTYPES = (numpy.dtype(numpy.float32), numpy.dtype(numpy.float16), _dtypes.bfloat16)
#: (stride, backward) compiled per filter size and dtype.
VARIANTS = ((1, False), (2, False), (1, True))
VEC = 4  # kernel: VEC, channels per thread
MAX_THREADS = 512  # kernel: __launch_bounds__
#: Dynamic shared memory a block may take: under every sm_80+ GPU's opt-in
#: limit (sm_86/sm_89: 99 KB), and two blocks fit an H200's 228 KB.
MAX_SHARED = 99 * 1024
#: Bulk copies complete an mbarrier transaction count (< 2**20 bytes).
MAX_ROW_BYTES = 2**20 - 16
#: (K, stride, itemsize) -> (TW output columns per strip, threads aimed at,
#: output rows prefetched).
SETTINGS = {(3, 1, 2): (4, 256, 2), (3, 1, 4): (4, 256, 2), (3, 2, 2): (2, 256, 2), (3, 2, 4): (2, 256, 2)}


def _expression(dtype, k, stride, backward, index, columns=None):
    tw = columns or SETTINGS[k, stride, numpy.dtype(dtype).itemsize][0]
    return _compile.name_expression(KERNEL, _dtypes.ctype(dtype), k, stride, tw, "true" if backward else "false", index)


def specializations(dtypes=None, filter_sizes=None, backward=None, large_index=(False, True)):
    """``(file, name expression)`` of every ring-kernel specialization.

    backward: None (both), False (forward) or True (backward-input)."""
    return _compile.filter_size_specializations(
        KERNEL_FILE, lambda dtype, size, index, stride, is_backward: _expression(dtype, size[0], stride, is_backward, index),
        DTYPES, FILTER_SIZES, dtypes, filter_sizes, large_index,
        [v for v in VARIANTS if backward is None or v[1] == backward])


def preferred(g, dtype, backward):
    """Whether the ops take the ring kernel for ``g`` (where it serves the call)."""
    return False


def select(g, dtype, backward, index, src_alignment, dst_alignment):
    """``plan(...)`` when the ops take this kernel (per ``MODE``), else None."""
    if MODE == "never" or (MODE == "rule" and not preferred(g, dtype, backward)):
        return None
    return plan(g, dtype, backward, index, src_alignment, dst_alignment)


@functools.lru_cache(maxsize=1024)
def plan(g, dtype, backward, index, src_alignment, dst_alignment, setting=None, bulk=True):
    """The Launch for this signature (arrays: src, weight, bias or NULL,
    dst), or None when this kernel does not serve it.  ``*_alignment``: the
    largest of 16, 8, 4, 2, 1 dividing the address.  ``setting``: (TW,
    threads, rows ahead) in place of ``SETTINGS``'s; ``bulk``: False copies
    with the block's cp.async pieces even where bulk copies exist (tests)."""
    dtype = numpy.dtype(dtype)
    size = (g.filter_height, g.filter_width)
    stride = g.stride_h
    if (
        size not in FILTER_SIZES
        or g.stride_w != stride
        or stride not in ((1,) if backward else (1, 2))
        or (g.dilation_h, g.dilation_w) != (1, 1)
        or g.multiplier != 1
        or dtype not in DTYPES
        or g.channels * dtype.itemsize % 16 != 0
        or g.channels // VEC > MAX_THREADS
        or src_alignment % 16 != 0
        or dst_alignment % 16 != 0
    ):
        return None
    k = size[0]
    src_h, src_w, dst_h, dst_w, offset_top, offset_left = _validate.correlation_frame(g, backward)
    if min(g.batch, src_h, src_w, dst_h, dst_w) <= 0 or g.batch * dst_h >= 2**31:
        return None
    columns, threads, ahead = setting or SETTINGS[k, stride, dtype.itemsize]
    row_bytes = src_w * g.channels * dtype.itemsize
    if row_bytes > MAX_ROW_BYTES:
        return None
    vectors = g.channels // VEC
    groups = max(1, min(threads // vectors, MAX_THREADS // vectors))
    strips = -(-dst_w // columns)
    groups = -(-strips // -(-strips // groups))  # as few as give each the same strip count
    # Slot columns: `lead` zero columns left of input column 0 (the left
    # padding), then the row, then zeros up to the last column a strip reads.
    lead = max(offset_left, 0)
    slot_pixels = max(lead + src_w, (strips * columns - 1) * stride + k - offset_left + lead)
    slot_bytes = slot_pixels * g.channels * dtype.itemsize
    ring = k + ahead * stride
    while ring > k and -(-ring * 8 // 16) * 16 + ring * slot_bytes > MAX_SHARED:
        ring -= 1
    shared = -(-ring * 8 // 16) * 16 + ring * slot_bytes
    if shared > MAX_SHARED:
        return None
    total_rows = g.batch * dst_h
    scalars = (
        i32(src_h), i32(src_w), i32(dst_h), i32(dst_w), i32(g.channels), i32(offset_top), i32(offset_left),
        i32(lead), i32(slot_pixels), i32(ring), i32(total_rows), i32(1 if bulk else 0),
    )
    return _launch.Launch(KERNEL_FILE, _expression(dtype, k, stride, backward, index, columns), (total_rows,),
                          (vectors * groups,), shared, scalars, persistent=True)
