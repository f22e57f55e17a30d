"""Channels-last (NHWC) weight gradient with the filter taps in registers
(kernels/depthwise_nhwc_wgrad.cu): 3x3, 5x5 and 7x7 filters, stride 1 or 2
(both axes), dilation 1, depth multiplier 1, float32, float16 and bfloat16.
It writes partial[split][tap][channel] in float32 and the shared finalize
(_depthwise_nhwc.with_finalize) adds the splits in a fixed order, like the
tiled kernel of _depthwise_nhwc: deterministic, bit-identical run to run.
The ops take it where ``preferred`` says so; ``MODE`` overrides that for
tests and benchmarks.

Launch rule (no user tuning), from the shape only:

* Per (filter size K, stride S, element size) a compile-time configuration
  ``CONFIGS``: LC channels per thread (2: a half-type pair, one 4-byte load;
  else 1), KR filter rows per thread (the K rows split into ceil(K / KR)
  "tap groups", the last masked where KR does not divide K), TW output
  columns per thread, PF (1: the next output row's loads are issued before
  this row's FMAs).  Chosen so that acc[KR][K][LC] + the input-row ring
  [KR][(TW-1)*S + K][LC] + grad_out[TW][LC] (+ with PF the next row's raw
  values) fit in 128 registers with no spills (NVRTC, sm_80 and sm_90, both
  index widths; ``LARGE_INDEX_CONFIGS`` where 64-bit indices need less),
  then by measurement (H200, 2026-12-01, N = 64, us): PF for half-type 3x3
  stride 1 (64x144x56 fp16 66.3 -> 60.7) and 5x5 (64.7 -> 60.1) and
  float32 3x3 stride 2 (127.3 -> 125.5); half-type 3x3 stride 2 with TW = 3
  (64x96x112 fp16 91.8 -> 84.2); not for float32 3x3 stride 1
  (102.1 / 103.2 with TW = 7; TW = 4 or 5 with PF 111.7 / 100.8 but 77.2 /
  70.4 at 64x384x28); 7x7 keeps TW = 4 without PF (TW = 2 with PF 232 us
  against 179 fp16; half pairs, LC = 2, KR = 2: TW = 4 182.2, TW = 3 with
  PF 179.8 against 176.4, 54.0 against 57.5 at 64x384x14); half-type 5x5
  keeps LC = 1 (LC = 2 with KR = 2 or 3: 66.7 / 64.4 against 59.7).
* Channel tile CT = 32 bytes of channels (16 half / 8 float channels), L =
  CT / LC lanes per tile; C must be a multiple of CT and both arrays aligned
  to LC elements (else ``plan`` returns None and the tiled kernel serves the
  call).  A block of 256 threads holds CTB channel tiles (of 1, 2, 4 with
  L * CTB <= 32: the one leaving the fewest idle tiles in the last channel
  block, then the largest) and W = 256 / (L * CTB) spatial workers.
* Work units: (image, row strip, column strip): column strips of TW output
  columns; row strips of RS = ceil(OH / ceil(OH / MAX_STRIP_ROWS[K, itemsize, S]))
  rows (TALL_STRIP_ROWS[itemsize] for 3x3/5x5 when OH > TALL_ROWS,
  SHORT_STRIP_ROWS where the grid would hold fewer than
  _launch.LONG_STRIP_MIN_THREADS threads)
  (balanced).  Grid: x = channel blocks * tap groups, y = splits; a split is
  a contiguous range of units, worker w of the block takes every W-th.
  splits = ceil(TARGET_BLOCKS / grid.x) (TALL_TARGET_BLOCKS when OH >
  TALL_ROWS), capped so every worker gets at
  least MIN_UNITS_PER_WORKER[itemsize] units, then balanced (every split
  non-empty).
* Shared memory: the block reduction, W * KR * K * CTB * CT floats
  (18-28 KB).
"""

import functools

import numpy

from . import _compile, _depthwise_nhwc, _dtypes, _launch
from ._launch import i32

#: "rule": the ops take this kernel where ``preferred`` says it wins;
#: "always": wherever it serves the call (tests, the sanitizer workload,
#: benchmarks); "never": not at all (the tiled kernel of _depthwise_nhwc).
MODE = "rule"

KERNEL_FILE = "depthwise_nhwc_wgrad.cu"
KERNEL = "dwgn_dwconv_nhwc_wgrad"
FILTER_SIZES = ((3, 3), (5, 5), (7, 7))
STRIDES = (1, 2)
DTYPES = (numpy.dtype(numpy.float32), numpy.dtype(numpy.float16), _dtypes.bfloat16)

THREADS = 256  # kernel: kThreads
TILE_BYTES = 32  # kernel: kTileBytes
#: (K, stride, element size) -> (LC, KR, TW, PF); registers per specialization
#: in the module's REPORT (notes) and checked by tests/test_compile.py.
CONFIGS = {
    (3, 1, 2): (2, 3, 4, 1), (3, 1, 4): (1, 3, 7, 0),
    (3, 2, 2): (2, 3, 3, 0), (3, 2, 4): (1, 3, 4, 1),
    (5, 1, 2): (1, 5, 4, 1), (5, 1, 4): (1, 5, 4, 0),
    (5, 2, 2): (1, 5, 2, 0), (5, 2, 4): (1, 5, 2, 0),
    (7, 1, 2): (1, 4, 4, 0), (7, 1, 4): (1, 4, 4, 0),
    (7, 2, 2): (1, 4, 2, 0), (7, 2, 4): (1, 4, 2, 0),
}
#: Where 64-bit indices need a narrower strip or no prefetch to stay in 128
#: registers without spills: (K, stride, element size) -> (LC, KR, TW, PF).
LARGE_INDEX_CONFIGS = {(7, 1, 2): (1, 4, 3, 0), (7, 1, 4): (1, 4, 3, 0), (5, 1, 2): (1, 5, 4, 0)}
#: Output rows per strip at most, per (K, element size), work units per
#: worker at least, per element size, and about TARGET_BLOCKS blocks (a
#: constant, not the SM count: the split, hence the summation order,
#: depends on the shape only; 4096 leaves the units-per-worker floor in
#: charge).  Outputs taller than TALL_ROWS rows have units enough for one
#: wave of long walks instead: TALL_STRIP_ROWS (3x3, 5x5) and
#: TALL_TARGET_BLOCKS.  From a sweep on an H200 (2026-12-01, strip rows
#: {4..56} x units per worker {1, 2, 4} x target blocks {256..4096} over 15
#: shapes x 3 dtypes: the 7 benchmark shapes and 32x144x56 3x3, 16x240x28
#: 5x5, 128x672x14 5x5, 32x192x28 7x7, 64x576x14 3x3 s2, 16x32x112,
#: 256x960x7, 8x64x128): time over the best of the sweep, geometric mean
#: (worst) 1.05 (1.18) for half types and 1.05 (1.15) for float32, against
#: 1.29 (2.72) and 1.17 (1.46) for the former rule (32 / 16 rows, 2 units
#: per worker, 1024 blocks); e.g. fp16 16x240x28 5x5 49.8 -> 19.0 us,
#: 8x64x128 49.6 -> 27.0, 64x384x28 52.4 -> 48.5, 64x96x56 7x7 168.6 ->
#: 155.8, float32 64x144x56 103.9 -> 90.6, 64x96x112 s2 127.3 -> 115.4.
#: 7x7 keeps whole planes (a strip re-reads K - S rows).  At stride 1,
#: 5x5 and float32 3x3 take strips of 28 rows since 2026-12-03 (H200, us):
#: fp16 64x240x28 5x5 47.2 -> 44.8, float32 64x240x28 5x5 60.9 -> 57.2,
#: 64x384x28 3x3 49.0 -> 45.9; 2-byte 3x3 and outputs taller than
#: TALL_ROWS did not move.  Where those strips' grid would hold fewer than
#: _launch.LONG_STRIP_MIN_THREADS threads, SHORT_STRIP_ROWS (the earlier
#: rule) keeps more workers busy: GPU time (CUDA graph) float32 8x384x28
#: 3x3 24.0 with long strips against 15.3, 32x384x28 31.2 / 25.7, 16x240x28
#: 5x5 25.3 / 18.3, fp16 5x5 16.6 / 15.0.
MAX_STRIP_ROWS = {(3, 2, 1): 16, (3, 2, 2): 16, (3, 4, 1): 28, (3, 4, 2): 14, (5, 2, 1): 28, (5, 2, 2): 16,
                  (5, 4, 1): 28, (5, 4, 2): 14, (7, 2, 1): 56, (7, 2, 2): 56, (7, 4, 1): 56, (7, 4, 2): 56}
SHORT_STRIP_ROWS = {(3, 4, 1): 14, (5, 2, 1): 16, (5, 4, 1): 14}
MIN_UNITS_PER_WORKER = {2: 1, 4: 1}
TARGET_BLOCKS = 4096
TALL_ROWS = 28
TALL_STRIP_ROWS = {2: 16, 4: 7}
TALL_TARGET_BLOCKS = 256
_TILES_PER_BLOCK = (4, 2, 1)


def channel_tile(dtype):
    """Channels per tile: 16 for 2-byte types, 8 for float32."""
    return TILE_BYTES // numpy.dtype(dtype).itemsize


def config(k, stride, dtype, index="int"):
    """(LC, KR, TW, PF) of the specialization for this filter, stride, dtype
    and index type ("int" or "long long")."""
    key = (k, stride, numpy.dtype(dtype).itemsize)
    return CONFIGS[key] if index == "int" else LARGE_INDEX_CONFIGS.get(key, CONFIGS[key])


def _expression(dtype, k, stride, index):
    return _compile.name_expression(KERNEL, _dtypes.ctype(dtype), k, stride, *config(k, stride, dtype, index), index)


def specializations(dtypes=None, filter_sizes=None, large_index=(False, True)):
    """``(file, name expression)`` of every specialization (both strides)."""
    return _compile.filter_size_specializations(
        KERNEL_FILE, lambda dtype, size, index, stride: _expression(dtype, size[0], stride, index),
        DTYPES, FILTER_SIZES, dtypes, filter_sizes, large_index, [(stride,) for stride in STRIDES])


def tiles_per_block(channel_tiles, lanes):
    """CTB: of 1, 2, 4 with lanes * CTB <= 32, the fewest idle tiles in the
    last channel block, then the largest."""
    options = [t for t in _TILES_PER_BLOCK if lanes * t <= 32]
    return min(options, key=lambda t: (-(-channel_tiles // t) * t - channel_tiles, -t))


def preferred(g, dtype):
    """Whether the ops take this kernel for ``g`` (where it serves the call):
    always.  Measured on an H200 (2026-12-01, benchmarks/depthwise_nhwc_wgrad.py
    and an A/B of the configurations, N = 64, this kernel against the tiled
    NHWC weight gradient, us): float32 64x144x56 3x3 102.1 / 120.4,
    64x384x28 65.3 / 78.5, 64x96x112 3x3 s2 125.5 / 150.1, 64x240x28 5x5
    70.5 / 89.8, 64x96x56 7x7 175.5 / 196.3, 64x384x14 7x7 57.9 / 57.1,
    64x960x7 20.0 / 20.3; float16 64x144x56 60.7 / 79.5, 64x384x28 51.3 /
    60.3, 64x96x112 s2 90.0 / 109.2, 5x5 60.1 / 80.3, 64x96x56 7x7 179.1 /
    204.0, 64x384x14 7x7 58.5 / 57.1, 64x960x7 13.6 / 17.0 (bfloat16 alike).
    Half types lost everywhere (0.27-0.8x) until each row's loads were all
    issued before any was unpacked (see load_raw in the kernel)."""
    return True


def select(g, dtype, index, grad_out_alignment, x_alignment):
    """``plan(...)`` when the ops take this kernel (per ``MODE``), else None."""
    if MODE == "never" or (MODE == "rule" and not preferred(g, dtype)):
        return None
    return plan(g, dtype, index, grad_out_alignment, x_alignment)


@functools.lru_cache(maxsize=1024)
def plan(g, dtype, index, grad_out_alignment, x_alignment, ctb=None):
    """``((partial launch, finalize launch), (shape, dtype) of the partial
    sums))`` (partial arguments: grad_out, x, partial; finalize: partial,
    grad_weight), or None when this kernel does not serve the call.
    ``*_alignment``: the largest of 16, 8, 4, 2, 1 dividing the address.
    ``ctb``: channel tiles per block instead of the rule's (tests)."""
    dtype = numpy.dtype(dtype)
    size = (g.filter_height, g.filter_width)
    stride = g.stride_h
    if (
        size not in FILTER_SIZES
        or g.stride_w != stride or stride not in STRIDES
        or (g.dilation_h, g.dilation_w) != (1, 1)
        or g.multiplier != 1
        or dtype not in DTYPES
        or g.channels % channel_tile(dtype) != 0
        or g.channels >= 2**24  # column offsets e * C in int
    ):
        return None
    k = size[0]
    lc, kr, tw, _ = config(k, stride, dtype, index)
    if grad_out_alignment % (lc * dtype.itemsize) or x_alignment % (lc * dtype.itemsize):
        return None
    if min(g.batch, g.height, g.width, g.out_height, g.out_width) <= 0:
        return None
    ct = channel_tile(dtype)
    lanes = ct // lc
    channel_tiles = g.channels // ct
    ctb = tiles_per_block(channel_tiles, lanes) if ctb is None else ctb
    assert lanes * ctb <= 32 and THREADS % (lanes * ctb) == 0
    workers = THREADS // (lanes * ctb)
    groups = -(-k // kr)
    col_strips = -(-g.out_width // tw)
    tall = g.out_height > TALL_ROWS
    key = (k, dtype.itemsize, stride)
    min_units = MIN_UNITS_PER_WORKER[dtype.itemsize]
    if tall and k < 7:
        long, short = (TALL_STRIP_ROWS[dtype.itemsize], min_units), None
    else:
        long = (MAX_STRIP_ROWS[key], min_units)
        short = (SHORT_STRIP_ROWS[key], min_units) if key in SHORT_STRIP_ROWS else None
    grid_x = -(-channel_tiles // ctb) * groups
    target_blocks = TALL_TARGET_BLOCKS if tall else TARGET_BLOCKS
    (row_strip, row_strips), units, split = _launch.walk_units(
        g.out_height, g.batch * col_strips, grid_x, workers, THREADS, target_blocks, long, short)
    if split is None:
        return None
    splits, per_split = split
    x_w_limit = min(g.width, (g.out_width - 1) * stride - g.pad_left + k)
    shared = workers * kr * k * ctb * ct * 4
    scalars = (
        i32(g.height), i32(g.width), i32(g.channels), i32(g.out_height), i32(g.out_width), i32(g.pad_top),
        i32(g.pad_left), i32(x_w_limit), i32(row_strip), i32(row_strips), i32(col_strips), i32(units),
        i32(per_split), i32(ctb), i32(groups),
    )
    partial = _launch.Launch(KERNEL_FILE, _expression(dtype, k, stride, index), (grid_x, splits), (THREADS,), shared,
                             scalars)
    return _depthwise_nhwc.with_finalize(partial, dtype, g.channels, k * k, splits)
