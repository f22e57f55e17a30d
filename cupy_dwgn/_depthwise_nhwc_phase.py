"""Channels-last (NHWC) stride-2 backward-input, phase-decomposed
(kernels/depthwise_nhwc_phase.cu): 3x3, 5x5 and 7x7 filters at stride 2 on
both axes, dilation 1, depth multiplier 1, channels in 16-byte vectors (C a
multiple of VEC = 16 / itemsize), grad_out and grad_in 16-byte aligned; all
four dtypes.  Everything else goes to the gather kernel of _depthwise_nhwc.

Why: the gather kernel writes one grad_in pixel per thread-item and finds
its taps with run-time remainders and tap loops; at stride 2 it measured
515 / 323 / 332 us (float32 / float16 / bfloat16) on an H200 for grad_out
(64, 56, 56, 96) -> grad_in (64, 112, 112, 96), 18% of the copy floor.  Here
a grad_in pixel's parity fixes its taps at compile time (the kernel's
header comment has the algebra).

Launch rule (no user tuning):

* Item = one image's 2 x 2*TW block of grad_in pixels whose top-left has
  even (ih + pad_top) and (iw + pad_left).  TW (column pairs per item) is
  the widest that keeps every specialization at or under 128 registers
  with no spills under NVRTC for sm_80 and sm_90 (``__launch_bounds__(256,
  2)``; tests/test_compile.py reads the ptxas reports): float32 and
  float64 TW = 4 (16 accumulated vectors of 4 registers, plus the row of
  TW + R - 1 columns: 112-128 registers); float16 and bfloat16 TW = 2 (16
  accumulated vectors of 8 floats: 118-128 registers), but TW = 1 for 7x7
  with 64-bit indices (bfloat16 spills 8 bytes there on sm_90 at TW = 2).
  TW = 3 (half) or 6 (float32) spill 80-600 bytes.  A thread reads
  R = ceil(K/2) grad_out rows of TW + R - 1 vectors for 4*TW grad_in
  pixels; the re-reads of neighbouring items hit L1/L2 (the unique
  grad_out is a quarter of grad_in's bytes).
* Block = (BX channel vectors, BY items): the channel vectors split into
  nearly equal tiles of at most 32 (C = 96 float32 -> one tile of 24; the
  tile's weights stay under 48 KB), BY = 256 // BX, so a warp reads
  whole pixels' channel runs (C = 96 float16: 12 vectors = 192 bytes per
  pixel, 21 items per block).  grid.x = channel tiles.
* Items (n, row pair, column block) are numbered row-major; each block owns
  a contiguous range of ``per_block`` items, a multiple of BY (no idle
  threads but in the last block), about _TARGET_BLOCKS blocks in all: a
  range covers one or a few neighbouring row pairs, whose shared grad_out
  rows/columns are read again from L1/L2, not DRAM.
* Weights: the tile's K*K taps as [tap][channel] in T in shared memory
  (7x7 with 32 vectors: 25 KB, under the 48 KB that needs no opt-in),
  converted to float at use (exact).  A 16-byte read serves TW * VEC FMAs
  (16 for every dtype but 7x7 half with 64-bit indices); half-type weights
  as floats would need two reads and bound the half-type 5x5/7x7 kernels
  on shared-memory bandwidth (and took the registers TW = 2 needs).
"""

import functools

import numpy

from . import _compile, _dtypes, _launch
from ._launch import i32

#: "rule": the ops take this kernel where ``preferred`` says it wins;
#: "always": wherever it serves the call (tests, the sanitizer workload);
#: "never": not at all (the gather kernel serves every stride-2 call).
MODE = "rule"

KERNEL_FILE = "depthwise_nhwc_phase.cu"
KERNEL = "dwgn_dwconv_nhwc_bwd_input_s2"
FILTER_SIZES = ((3, 3), (5, 5), (7, 7))
DTYPES = (numpy.dtype(numpy.float32), numpy.dtype(numpy.float16), _dtypes.bfloat16, numpy.dtype(numpy.float64))
STRIDE = 2
_VECTOR_BYTES = 16
_MAX_THREADS = 256
#: About this many blocks per launch (as _depthwise_nhwc): several waves of
#: two 256-thread blocks per SM on any GPU, short tails.
_TARGET_BLOCKS = 2048
_MAX_TILE_VECTORS = 32
_SHARED_LIMIT = 48 * 1024


def vec(dtype):
    """Elements per 16-byte vector: 4 float32, 8 float16/bfloat16, 2 float64."""
    return _VECTOR_BYTES // numpy.dtype(dtype).itemsize


def columns(dtype, k, index="int"):
    """TW, column pairs per item (module docstring: registers <= 128, no spills)."""
    if numpy.dtype(dtype).itemsize == 2:
        return 1 if (k, index) == (7, "long long") else 2
    return 4


def _expression(dtype, k, index):
    return _compile.name_expression(KERNEL, _dtypes.ctype(dtype), k, columns(dtype, k, index), index)


def specializations(dtypes=None, filter_sizes=None, large_index=(False, True)):
    """``(file, name expression)`` of every specialization (backward-input only)."""
    return _compile.filter_size_specializations(
        KERNEL_FILE, lambda dtype, size, index: _expression(dtype, size[0], index), DTYPES, FILTER_SIZES,
        dtypes, filter_sizes, large_index)


def serves(g, dtype):
    """Whether this kernel computes the call (the alignment aside)."""
    return (
        (g.filter_height, g.filter_width) in FILTER_SIZES
        and (g.stride_h, g.stride_w, g.dilation_h, g.dilation_w) == (STRIDE, STRIDE, 1, 1)
        and g.multiplier == 1
        and numpy.dtype(dtype) in DTYPES
        and g.channels % vec(dtype) == 0
        and min(g.batch, g.height, g.width, g.channels, g.out_height, g.out_width) > 0
    )


def preferred(g, dtype):
    """Whether the ops take this kernel over the gather kernel: wherever it
    serves the call.  Measured on an H200 (2026-12-01,
    benchmarks/depthwise_nhwc_phase.py, N = 64, phase against gather, us):
    64x96x112 3x3 float32 113.4 / 512.3 (81% of the copy floor), float16
    64.8 / 321.3; 64x240x56 5x5 float32 77.7 / 446.1, float16 74.3 / 338.9;
    64x96x56 7x7 float32 60.6 / 267.8, float16 48.9 / 200.7; 64x144x56 3x3
    45.6 / 187.1; 64x192x28 5x5 23.2 / 104.0: 4.1x to 5.7x faster in every
    cell, bfloat16 alike."""
    return serves(g, dtype)


def select(g, dtype, index, aligned):
    """The Launch the ops take for this backward-input call (per ``MODE``), or
    None.  ``aligned``: grad_out and grad_in are 16-byte aligned."""
    if MODE == "never" or (MODE == "rule" and not preferred(g, dtype)):
        return None
    return plan(g, dtype, index, aligned)


def block(vectors, dtype, k):
    """(tiles, BX, BY) per the module's rule: nearly equal tiles of at most
    32 vectors whose K*K weights fit in 48 KB, BY = 256 // BX."""
    per_vector = k * k * _VECTOR_BYTES
    most = min(_MAX_TILE_VECTORS, _SHARED_LIMIT // per_vector)
    tiles = -(-vectors // most)
    bx = -(-vectors // tiles)
    return tiles, bx, max(1, _MAX_THREADS // bx)


def geometry(g, dtype, index="int"):
    """(TW, row pairs, column pairs, column blocks) of the item grid."""
    k = g.filter_height
    tw = columns(dtype, k, index)
    row_pairs = (g.height - 1 + g.pad_top) // 2 - g.pad_top // 2 + 1
    col_pairs = (g.width - 1 + g.pad_left) // 2 - g.pad_left // 2 + 1
    return tw, row_pairs, col_pairs, -(-col_pairs // tw)


@functools.lru_cache(maxsize=1024)
def plan(g, dtype, index, aligned):
    """The Launch (arrays: grad_out, weight, grad_in) for this signature, or
    None when this kernel does not serve it."""
    dtype = numpy.dtype(dtype)
    if not aligned or not serves(g, dtype):
        return None
    k = g.filter_height
    tw, row_pairs, _, col_blocks = geometry(g, dtype, index)
    vectors = g.channels // vec(dtype)
    tiles, bx, by = block(vectors, dtype, k)
    items = g.batch * row_pairs * col_blocks
    per_block = by * -(-items // (by * max(1, _TARGET_BLOCKS // tiles)))
    blocks_y = -(-items // per_block)
    if blocks_y > _launch.MAX_GRID_Y:  # not reached: blocks_y <= _TARGET_BLOCKS
        return None
    shared = k * k * bx * _VECTOR_BYTES
    scalars = (
        i32(g.height), i32(g.width), i32(g.channels), i32(g.out_height), i32(g.out_width), i32(g.pad_top),
        i32(g.pad_left), i32(row_pairs), i32(col_blocks),
        _launch.index_scalar(index, items), _launch.index_scalar(index, per_block),
    )
    return _launch.Launch(KERNEL_FILE, _expression(dtype, k, index), (tiles, blocks_y), (bx, by), shared, scalars)
