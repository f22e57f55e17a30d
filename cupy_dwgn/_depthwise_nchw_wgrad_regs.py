"""NCHW weight gradient with the filter taps in registers and no shared-memory
staging (kernels/depthwise_nchw_wgrad_regs.cu): square 3x3, 5x5 and 7x7
filters, stride 1 or 2 (both axes), dilation 1, depth multiplier 1, any
padding, float32, float16 and bfloat16 (float64 and everything else stay on
_depthwise_nchw_wgrad).  It writes partial[split][tap][channel] in float32
and the shared finalize (_depthwise_nhwc.with_finalize) adds the splits in a
fixed order: deterministic, bit-identical run to run.  The ops take it where
``preferred`` says so; ``MODE`` overrides that for tests and benchmarks.

Launch rule (no user tuning), from the shape only:

* VW output columns per thread: the widest power of two with VW * itemsize
  <= 16 bytes and VW <= MAX_VECTOR[(K, itemsize)] (the register budget:
  ptxas needs 110-198 registers at VW = 8 for 7x7 and 5x5) that divides OW,
  W and pad_left - K // 2 and both arrays' byte alignment, so every row
  start of x and grad_out is VW-aligned and each thread's x vectors start
  at a multiple of VW (e.g. 56x56 fp16 3x3: 8; 28x28 fp16: 4; 14x14: 2;
  7x7: 1; pad_left 0 with 3x3: 1).
* Lane groups: L = OW / VW lanes per output row, cut into segments =
  ceil(L / 32) segments of G = ceil(L / segments) lanes; a warp holds
  32 // G groups.  Row strips of RS = ceil(OH / ceil(OH / MAX_STRIP_ROWS[K,
  itemsize, S])) output rows (balanced; SHORT_STRIPS where the grid would
  hold fewer than _launch.LONG_STRIP_MIN_THREADS threads).  Units: (image,
  row strip, segment).
* Block: THREADS = 128 threads, one channel (grid.x = C); grid.y = splits,
  a contiguous range of units each, worker w (warp * groups per warp +
  group) of a block taking every workers-th.  splits =
  ceil(TARGET_BLOCKS / C), at most units / (workers *
  MIN_UNITS_PER_WORKER[K, itemsize, S] or SHORT_STRIPS) and 65535, then balanced so every split
  is non-empty.
* Shared memory: the block reduction, 4 warps * K * K floats (static).
"""

import functools

import numpy

from . import _compile, _depthwise_nhwc, _dtypes, _launch
from ._launch import i32

#: "rule": the ops take this kernel where ``preferred`` says it wins;
#: "always": wherever it serves the call (tests, the sanitizer workload,
#: benchmarks); "never": not at all (_depthwise_nchw_wgrad).
MODE = "rule"

KERNEL_FILE = "depthwise_nchw_wgrad_regs.cu"
KERNEL = "dwgn_nchw_wgrad_regs"
FILTER_SIZES = ((3, 3), (5, 5), (7, 7))
STRIDES = (1, 2)
DTYPES = (numpy.dtype(numpy.float32), numpy.dtype(numpy.float16), _dtypes.bfloat16)

THREADS = 128  # kernel: kThreads
VECTOR_BYTES = 16
#: (K, element size) -> the widest VW compiled (registers at the kernel's
#: launch bounds, NVRTC sm_90, no spills: fp16 3x3 VW 8: 96, 5x5 VW 4: 111,
#: 7x7 VW 4: 153; without the cap 5x5 VW 8 needed 145 and 7x7 VW 8 192;
#: since the row cursors and clean blocks, NVRTC 13.0: 95, 115, 160; with two steps of
#: loads in flight for 5x5, 95, 123, 162).
MAX_VECTOR = {(3, 2): 8, (3, 4): 4, (5, 2): 4, (5, 4): 2, (7, 2): 4, (7, 4): 2}
#: Output rows per strip at most and work units per worker at least, per
#: (K, element size, stride); about TARGET_BLOCKS blocks (a
#: constant, not the SM count: the split, hence the summation order,
#: depends on the shape only; 4096 leaves the units-per-worker floor in
#: charge).  From a sweep on an H200 (2026-12-01, scratch sweep of strip
#: rows {4..56} x units per worker {1, 2, 4} x target blocks {256..4096}
#: over 15 shapes x 3 dtypes: the 7 benchmark shapes and 32x144x56 3x3,
#: 16x240x28 5x5, 128x672x14 5x5, 32x192x28 7x7, 64x576x14 3x3 s2,
#: 16x32x112, 256x960x7, 8x64x128): time over the best of the sweep,
#: geometric mean (worst) 1.04 (1.30) for half types, 1.05 (1.17) for
#: float32, against 1.24 (2.37) and 1.11 (1.36) for the former rule (32 /
#: 16 rows, 2 units per worker, 1024 blocks); e.g. fp16 8x64x128 41.8 ->
#: 17.7 us, 32x192x28 7x7 57.5 -> 41.6, 64x96x112 s2 82.4 -> 73.4,
#: 64x96x56 7x7 126.8 -> 118.9, float32 s2 120.5 -> 103.3.  7x7 keeps
#: whole planes (a strip re-reads K - S rows).  3x3 at stride 1 since
#: 2026-12-03 (H200, N = 64 unless given): strips of 28 rows, and for
#: float32 one unit per worker, once the 2-byte VW 4 walk kept 3 steps of
#: loads in flight (kernel: lookahead): fp16 64x384x28 42.8 -> 41.3 us
#: (bfloat16 alike), 64x144x56 52.6 -> 52.0; float32 64x384x28 58.5 ->
#: 56.2, 64x144x56 76.5 -> 73.2, 64x240x28 40.5 -> 38.9, 32x96x112 95.2 ->
#: 91.4, 64x192x28 38.5 -> 36.2.  2-byte 5x5 at stride 1 also strips of 28
#: rows (a 14-row strip re-read 4 of every 18 rows): fp16 64x240x28 44.8 ->
#: 38.8 (bfloat16 alike), 64x120x56 80.4 -> 68.0.  Those long strips halve
#: the units: where their grid would hold fewer than
#: _launch.LONG_STRIP_MIN_THREADS threads, SHORT_STRIPS (the earlier rule)
#: keeps more workers busy: GPU time (CUDA graph) fp16 8x384x28 11.1 us
#: with long strips against 8.5, 16x32x112 21.2 / 14.9, 8x144x56 17.8 /
#: 11.4, 16x240x28 5x5 15.5 / 13.3, float32 8x384x28 16.5 / 11.9.
MAX_STRIP_ROWS = {(3, 2, 1): 28, (3, 2, 2): 14, (3, 4, 1): 28, (3, 4, 2): 14, (5, 2, 1): 28, (5, 2, 2): 14,
                  (5, 4, 1): 14, (5, 4, 2): 14, (7, 2, 1): 56, (7, 2, 2): 56, (7, 4, 1): 56, (7, 4, 2): 56}
MIN_UNITS_PER_WORKER = {key: 1 if key[1] == 2 or key == (3, 4, 1) else 2 for key in MAX_STRIP_ROWS}
#: (K, itemsize, stride) -> (strip rows, units per worker) where the long strips' grid is small.
SHORT_STRIPS = {(3, 2, 1): (14, 1), (3, 4, 1): (14, 2), (5, 2, 1): (14, 1)}
TARGET_BLOCKS = 4096
#: In-plane offsets are int in the kernel.
PLANE_LIMIT = 2**30


def vector_widths(k, itemsize):
    """Every VW compiled for this filter size and element size."""
    top = min(MAX_VECTOR[(k, itemsize)], VECTOR_BYTES // itemsize)
    return tuple(1 << i for i in range(top.bit_length()))


def _expression(dtype, k, stride, vw):
    return _compile.name_expression(KERNEL, _dtypes.ctype(dtype), k, stride, vw)


def specializations(dtypes=None, filter_sizes=None, large_index=(False, True)):
    """``(file, name expression)`` of every specialization (both strides,
    every VW).  large_index is accepted for symmetry: plane offsets are
    64-bit in this kernel, in-plane offsets int, whatever the tensor size."""
    del large_index
    dtypes = DTYPES if dtypes is None else [numpy.dtype(d) for d in dtypes if numpy.dtype(d) in DTYPES]
    sizes = FILTER_SIZES if filter_sizes is None else [tuple(s) for s in filter_sizes if tuple(s) in FILTER_SIZES]
    return [
        (KERNEL_FILE, _expression(dtype, size[0], stride, vw))
        for dtype in dtypes for size in dict.fromkeys(sizes) for stride in STRIDES
        for vw in vector_widths(size[0], dtype.itemsize)
    ]


def vector_width(g, dtype, grad_out_alignment, x_alignment):
    """VW: the widest compiled width dividing OW, W, pad_left - K // 2 and
    both alignments (in elements)."""
    itemsize = numpy.dtype(dtype).itemsize
    k = g.filter_height
    for vw in reversed(vector_widths(k, itemsize)):
        if (
            g.out_width % vw == 0 and g.width % vw == 0 and (g.pad_left - k // 2) % vw == 0
            and grad_out_alignment % (vw * itemsize) == 0 and x_alignment % (vw * itemsize) == 0
        ):
            return vw
    return 1


#: float32 5x5 and 7x7 with at least this many output columns stay on the
#: staged kernel (their VW is capped at 2 by registers; see ``preferred``).
STAGED_FLOAT32_MIN_OUT_WIDTH = 28


def preferred(g, dtype):
    """Whether the ops take this kernel for ``g`` (where it serves the call):
    everywhere except float32 5x5 and 7x7 with >= 28 output columns.
    Measured on an H200 (2026-12-01, benchmarks/depthwise_nchw_wgrad.py,
    N = 64, this kernel against dwgn_nchw_wgrad_small, us): float32
    64x144x56 3x3 86.7 / 123.5, 64x384x28 67.7 / 78.8, 64x96x112 s2 120.7 /
    198.3, 64x384x14 7x7 60.9 / 72.1, 64x960x7 26.6 / 30.9, but 64x240x28
    5x5 115.6 / 71.6 and 64x96x56 7x7 223.5 / 163.7 (VW = 2: a 16-byte
    vector of 4 floats needs more registers than the 5x5/7x7 budget);
    float16 54.2 / 103.4, 68.4 / 114.1, s2 87.0 / 169.5, 5x5 56.6 / 95.8,
    7x7 150.7 / 160.3 and 57.5 / 68.8, 25.6 / 28.5 (bfloat16 alike)."""
    return not (numpy.dtype(dtype) == numpy.float32 and g.filter_height >= 5
                and g.out_width >= STAGED_FLOAT32_MIN_OUT_WIDTH)


def select(g, dtype, grad_out_alignment, x_alignment):
    """``plan(...)`` when the ops take this kernel (per ``MODE``), else None."""
    if MODE == "never" or (MODE == "rule" and not preferred(g, dtype)):
        return None
    return plan(g, dtype, grad_out_alignment, x_alignment)


@functools.lru_cache(maxsize=1024)
def plan(g, dtype, grad_out_alignment, x_alignment):
    """``((partial launch, finalize launch), (shape, dtype) of the partial
    sums))`` (partial arguments: grad_out, x, partial; finalize: partial,
    grad_weight), or None when this kernel does not serve the call.
    ``*_alignment``: the largest of 16, 8, 4, 2, 1 dividing the address."""
    dtype = numpy.dtype(dtype)
    size = (g.filter_height, g.filter_width)
    stride = g.stride_h
    if (
        size not in FILTER_SIZES
        or g.stride_w != stride or stride not in STRIDES
        or (g.dilation_h, g.dilation_w) != (1, 1)
        or g.multiplier != 1
        or dtype not in DTYPES
    ):
        return None
    if min(g.batch, g.channels, g.height, g.width, g.out_height, g.out_width) <= 0:
        return None
    if (
        g.height * g.width >= PLANE_LIMIT or g.out_height * g.out_width >= PLANE_LIMIT
        or g.height + g.pad_top + g.pad_bottom >= PLANE_LIMIT or g.width + g.pad_left + g.pad_right >= PLANE_LIMIT
    ):
        return None
    k = size[0]
    vw = vector_width(g, dtype, grad_out_alignment, x_alignment)
    lanes = g.out_width // vw
    segments = -(-lanes // 32)
    group_lanes = -(-lanes // segments)
    groups_per_warp = 32 // group_lanes
    workers = THREADS // 32 * groups_per_warp
    key = (k, dtype.itemsize, stride)
    (row_strip, row_strips), units, split = _launch.walk_units(
        g.out_height, g.batch * segments, g.channels, workers, THREADS, TARGET_BLOCKS,
        (MAX_STRIP_ROWS[key], MIN_UNITS_PER_WORKER[key]), SHORT_STRIPS.get(key))
    if split is None:
        return None
    splits, per_split = split
    scalars = (
        i32(g.height), i32(g.width), i32(g.channels), i32(g.out_height), i32(g.out_width), i32(g.pad_top),
        i32(g.pad_left), i32(row_strip), i32(row_strips), i32(segments), i32(group_lanes), i32(units),
        i32(per_split),
    )
    partial = _launch.Launch(KERNEL_FILE, _expression(dtype, k, stride, vw), (g.channels, splits), (THREADS,), 0,
                             scalars)
    return _depthwise_nhwc.with_finalize(partial, dtype, g.channels, k * k, splits)
