"""Channels-last (NHWC) direct kernel (kernels/depthwise_nhwc_direct.cu):
3x3 and 5x5 filters, forward at stride 1 or 2 and backward-input at stride 1
(the forward correlation with the rotated filter), dilation 1, depth
multiplier 1, 16-byte channel vectors, float32, float16 and bfloat16.  No
input staging: each thread loads its inputs straight from global memory.

Launch rule (no user tuning), from the shape only:

* TW output columns per thread, per (filter, stride, element size): ``COLUMNS``
  (``columns_per_thread``: of several compiled, the one padding the row least);
  every filter row's loads in flight at once (``ALL_ROWS``) for float32 3x3
  at stride 2.
* Block: BX channel vectors (16 bytes each; the channel vectors split into
  nearly equal tiles of at most 32, as _depthwise_nhwc._block) x BY items,
  at most 256 threads; grid.x = channel tiles, grid.y = the items (image,
  output row, strip of TW columns) over BY x ``items_per_thread`` (1 or 2),
  at most 65535 (the kernel walks the rest grid-stride).
* Shared memory: the channel tile's K * K taps as float, BX * 16 / itemsize
  * K * K * 4 bytes.

The ops take it where ``preferred`` says so (float32 on destinations up to
28 columns wide, 38 for 5x5 at stride 1 on grids of 2 items a thread,
float16 3x3 at stride 2); ``MODE`` overrides that for tests and benchmarks.
"""

import contextlib
import functools

import numpy

from . import _compile, _depthwise_nhwc, _dtypes, _launch, _validate
from ._launch import i32

#: "rule": the ops take this kernel where ``preferred`` says it wins;
#: "always": wherever it serves the call (tests, the sanitizer workload,
#: benchmarks); "never": not at all.
MODE = "rule"

KERNEL_FILE = "depthwise_nhwc_direct.cu"
KERNEL = "dwgn_dwconv_nhwc_direct"
FILTER_SIZES = ((3, 3), (5, 5))
DTYPES = (numpy.dtype(numpy.float32), numpy.dtype(numpy.float16), _dtypes.bfloat16)
#: (stride, backward) compiled per filter size and dtype.
VARIANTS = ((1, False), (2, False), (1, True))
#: (K, stride, element size) -> TW output columns per thread, the fastest of
#: 2 / 4 / 8 on the H200 (benchmarks/depthwise_nhwc_direct.py, 2026-12-01):
#: float32 8 (4 for 5x5 stride 2: 64x672x28 73.9 against 83.4 with 8;
#: 2 for 3x3 stride 2 since 2026-12-07, with ALL_ROWS, measured on H100s
#: only: see ALL_ROWS), float16 stride 2 two (64x96x112 66.9 against 90.8
#: with 4), else 4.  A
#: tuple: every TW compiled, the plan taking the one ``columns_per_thread`` gives:
#: float32 5x5 stride 1, 7 or 8 (H100, 2026-12-07, GPU us per launch at 2
#: items a thread, forward, TW 7 / 8 / 4 / 5: 64x240x28 54.5 / 56.3 / 64.5
#: / 64.0, 64x576x19 63.4 / 66.4 / 77.0 / 68.8, 64x288x38 116.3 / 107.2 /
#: 146.1 / 130.2, 64x672x14 40.1 / 41.2 / 52.6 / 45.1, 64x480x14 30.4 / 31.8
#: / 40.0 / 35.2; backward-input alike:
#: results/depthwise_nhwc_5x5_direct_ab_h100_2026-12-07.txt).
COLUMNS = {(3, 1, 2): 4, (3, 1, 4): 8, (3, 2, 2): 2, (3, 2, 4): 2,
           (5, 1, 2): 4, (5, 1, 4): (7, 8), (5, 2, 2): 4, (5, 2, 4): 4}
#: (K, stride, element size) -> items a thread walks (the grid shrunk to
#: match), overriding ``items_per_thread``'s rule (benchmarks, tests).
ITEMS_PER_THREAD = {}
#: (K, stride, element size) -> (BX channel vectors, BY items) of a block,
#: overriding _depthwise_nhwc._block's (benchmarks, tests; BX * BY <= 256).
#: E.g. (4, 49) at 64x576x14 float32 stride 2, TW 1, one item a thread
#: (ITEMS_PER_THREAD 1): a block holds one image's whole 7x7 destination
#: plane for 16 channels, so the rows and columns its outputs share are
#: re-read on one SM (from L1), in 2304 blocks of 196 threads: the grid of
#: cuDNN's kernel there (Nsight Compute, 2026-12-06).
BLOCK = {}
#: (K, stride, element size) -> True: the kernel loads every filter row's
#: inputs before applying the first (K * IW vector loads in flight, the
#: kernel's ALL_ROWS), for every TW of that key: float32 3x3 stride 2, with
#: TW 2.  Where cuDNN is faster (64x576x14 float32 stride 2, 14.0 us
#: against 17-19) it keeps about 5x our TW 1-2 kernels' input bytes in
#: flight per SM (Nsight Compute,
#: results/depthwise_stride2_ncu_h100_2026-12-06c.txt).  Measured on three
#: H100s (2026-12-06 and 12-07, GPU us per launch, TW 2 with ALL_ROWS
#: against TW 8 without, the rule before, 2 items a thread:
#: results/depthwise_nhwc_direct_all_rows_h100_2026-12-07b.txt): 64x144x56
#: 53.9 / 59.6, 64x288x38 49.7 / 57.6, 64x240x28 25.4 / 27.0, 64x192x28
#: 21.6 / 23.0, 64x576x14 18.1 / 18.7; through the ops, eager, 54.4 / 59.5,
#: 49.9 / 57.5, 25.9 / 27.2, 21.6 / 22.6, 17.4 / 18.1.  cuDNN (PyTorch
#: channels-last) is still faster on all five (52.2, 47.5, 24.3, 19.4,
#: 14.6); no block shape or TW 1 closed that (same file).  Not measured on
#: an H200, where TW 8 without ran 64x144x56 in 45.0 us (2026-12-01).
#: Slower at stride 1 and in float16 (its registers halve the blocks a SM;
#: results/depthwise_nhwc_direct_all_rows_h100_2026-12-06.txt).
ALL_ROWS = {(3, 2, 4): True}
VECTOR_BYTES = 16


@contextlib.contextmanager
def overridden(key, columns, items_per_thread=0, block=None, all_rows=False):
    """COLUMNS, ITEMS_PER_THREAD, BLOCK and ALL_ROWS set for ``key`` = (K,
    stride, element size) inside the block (items_per_thread 0 / block None:
    the rule's), plan's memo cleared on the way in and out (benchmarks, the
    Nsight Compute workload)."""
    tables = (COLUMNS, ITEMS_PER_THREAD, BLOCK, ALL_ROWS)
    saved = [dict(table) for table in tables]
    COLUMNS[key], ITEMS_PER_THREAD[key] = columns, items_per_thread
    for table, value in ((BLOCK, block), (ALL_ROWS, all_rows or None)):
        table.pop(key, None)
        if value is not None:
            table[key] = value
    plan.cache_clear()
    try:
        yield
    finally:
        for table, kept in zip(tables, saved):
            table.clear()
            table.update(kept)
        plan.cache_clear()


def _widths(key):
    """Every TW compiled for ``key`` = (K, stride, element size)."""
    widths = COLUMNS[key]
    return widths if isinstance(widths, tuple) else (widths,)


def columns_per_thread(key, dst_width):
    """TW for ``key`` onto destination rows ``dst_width`` wide: of the
    widths compiled, the one whose strips pad the row least (ties: the
    wider; float32 5x5: 7 for 14 and 28 wide, 8 for 38)."""
    return min(_widths(key), key=lambda tw: (-(-dst_width // tw) * tw, -tw))


def _expression(dtype, k, stride, backward, index, tw):
    key = (k, stride, numpy.dtype(dtype).itemsize)
    return _compile.name_expression(KERNEL, _dtypes.ctype(dtype), k, stride, tw,
                                    "true" if backward else "false", "true" if ALL_ROWS.get(key) else "false", index)


def specializations(dtypes=None, filter_sizes=None, backward=None, large_index=(False, True)):
    """``(file, name expression)`` of every direct-kernel specialization
    (every TW compiled).

    backward: None (both), False (forward) or True (backward-input)."""
    def expression_of(choice):  # the choice-th TW of each key (its last where it has fewer)
        def expression(dtype, k, stride, is_backward, index):
            widths = _widths((k, stride, numpy.dtype(dtype).itemsize))
            return _expression(dtype, k, stride, is_backward, index, widths[min(choice, len(widths) - 1)])
        return expression

    choices = max(len(_widths(key)) for key in COLUMNS)
    return list(dict.fromkeys(
        spec for choice in range(choices)
        for spec in _compile.direction_specializations(KERNEL_FILE, expression_of(choice), DTYPES, FILTER_SIZES,
                                                       VARIANTS, dtypes, filter_sizes, backward, large_index)))


def preferred(g, dtype, backward):
    """Whether the ops take the direct kernel for ``g`` (where it serves the
    call): float32 on destinations at most 28 columns wide (3x3, and 5x5 at
    stride 2), float32 5x5 at stride 1 on rows under 14 wide, and 15 to 38
    wide where the grid holds 2 items a thread (``items_per_thread``), and
    float16 3x3 at stride 2.  Measured on
    an H200 (2026-12-01, benchmarks/depthwise_nhwc_direct.py, GPU time per
    launch, us, direct against the kernel the ops took before: the tiled
    kernel, or the window kernel where its rule takes it):

    * float32: 64x384x28 3x3 forward 52.6 / 57.8, backward-input 51.8 /
      57.3; 64x960x7 12.7 / 13.1; 64x576x14 25.4 / 25.7; 64x1152x7 5x5 19.4 /
      24.0; stride 2: 64x144x56 3x3 45.0 / 53.0, 64x240x56 5x5 96.1 / 128.5,
      64x672x28 5x5 73.9 / 89.6.  Wider destinations about even or slower
      (64x144x56 3x3 78.9 / 80.9, 64x192x56 102.0 / 100.6, 64x32x112 66.6 /
      65.0, 64x96x112 stride 2 105.1 / 102.4), as is 5x5 where the window
      kernel's rule takes it (64x480x14 30.7 / 26.9, 64x240x28 56.2 / 57.7).
    * float32 5x5 stride 1 against the window kernel at channel group 2 (the
      tiled kernel at 38 wide), with TW 7 or 8 (``columns_per_thread``) and
      2 items a thread (H100, 2026-12-07, benchmarks/depthwise_nhwc_direct.py,
      forward: results/depthwise_nhwc_5x5_direct_ab_h100_2026-12-07.txt):
      64x240x28 54.5 / 70.4, 64x576x19 63.4 / 75.0, 64x288x38 107.2 /
      116.3, 64x672x14 40.1 / 48.3, 64x480x14 30.4 / 30.3 (backward-input
      alike; TW 8 and one item a thread, as first taken: 58.8, 70.6, 116.6,
      42.9, 32.4; on an H200, 12-01: 64x240x28 56.2 / 57.7, 64x288x38 114 /
      121, 64x480x14 30.7 / 26.9).  Rows 14 wide stay on the window kernel:
      the H200 ran it 12% faster than TW 8 at one item there (64x480x14
      above); the H100 runs it even with TW 7 at 480 channels, 17% slower
      at 672.  Small batches, whose grid keeps one item a thread (the
      configuration not measured against the window kernel but at
      8x240x28: eager 10.9 / 10.1 on one H100, within eager noise on
      another), stay on the window kernel too; 64x1152x7 (rows under 14,
      direct before) went 19.1 -> 16.6 with TW 7 at 2 items.
    * float16 3x3 stride 2: 64x96x112 66.9 / 73.5, 64x144x56 31.1 / 34.2.
      Not bfloat16 (77.2 / 74.0, 34.1 / 34.0), nor 5x5 stride 2 (91.9 /
      92.8, 73.4 / 73.2), nor half types at stride 1, where the window
      kernel wins but on 56x56 with 144 channels (64x384x28 48.8 / 36.2,
      64x192x56 90.0 / 79.2, 64x144x56 66.4 / 72.8).
    """
    dtype = numpy.dtype(dtype)
    k, stride = g.filter_height, g.stride_h
    dst_width = g.width if backward else g.out_width
    if dtype == numpy.float32 and k == 5 and stride == 1:
        if dst_width < 14:
            return True
        if not 14 < dst_width <= 38 or g.channels < VECTOR_BYTES // dtype.itemsize:
            return False  # (fewer channels than a vector: not served; the grid below would have no tile)
        # Where its one-item grid is too small for 2 items a thread (small batches), the window kernel
        _, _, dst_h, _, _, _ = _validate.correlation_frame(g, backward)
        _, _, items, tiles, _, by = _grid(g, dtype, (k, stride, dtype.itemsize), dst_h, dst_width)
        return tiles * -(-items // by) >= TWO_ITEMS_MIN_BLOCKS
    if dtype == numpy.float32:
        return dst_width <= 28 and (k == 3 or stride == 2)
    return dtype == numpy.float16 and k == 3 and stride == 2


#: The fewest blocks a one-item grid must have for items_per_thread to give 2:
#: every measured case had 280 or more (two a SM on an H100's 132 SMs is 264);
#: a smaller grid (small batches) halved would leave SMs idle.
TWO_ITEMS_MIN_BLOCKS = 256


def items_per_thread(k, stride, dtype, dst_width, blocks=TWO_ITEMS_MIN_BLOCKS):
    """Items a thread walks (the grid holds 1 / that many of them): 2 for
    float32 3x3, float32 5x5 at stride 1 and float16 3x3 at stride 2 onto
    destinations at most 14 wide, where the one-item grid has ``blocks`` >=
    TWO_ITEMS_MIN_BLOCKS, else 1.  A block then stages its filter once for
    twice the work.
    Measured on an H100 (2026-12-06, benchmarks/depthwise_nhwc_direct.py
    --items-per-thread 1 2, GPU us per launch, 1 / 2 items, the same in 2-3
    runs to 0.3 us): float32 TW 8 64x576x14 stride 2 19.7 / 18.3, 64x672x14
    21.6 / 20.4, 64x192x28 23.6 / 23.0, 64x240x28 27.5 / 27.0, 64x960x7
    stride 1 14.4 / 14.0 (backward-input 14.0 / 13.7), 64x384x28 61.0 / 60.4
    (60.7 / 60.2); float16 TW 2 stride 2 64x576x14 14.8 / 13.4, 64x672x14
    16.2 / 14.6, 64x240x28 18.6 / 17.5, 64x192x28 16.0 / 15.2, but 64x144x56
    35.2 / 36.5 and 64x96x112 76.5 / 77.2 (bfloat16, which the ops do not
    take here at stride 2: 64x576x14 16.1 / 17.4, one run).  Float32 5x5
    at stride 1 (H100, 2026-12-07; TW 7, then TW 8): 64x240x28 57.3 /
    54.5, 58.8 / 56.3; 64x576x19 68.0 / 63.4, 70.6 / 66.4; 64x288x38 (TW
    8) 116.6 / 107.2; 64x672x14 41.7 / 40.1; 64x480x14 31.8 / 30.4."""
    if blocks < TWO_ITEMS_MIN_BLOCKS:
        return 1
    dtype = numpy.dtype(dtype)
    if k == 5:
        return 2 if dtype == numpy.float32 and stride == 1 else 1
    if dtype == numpy.float32 or (dtype == numpy.float16 and stride == 2 and dst_width <= 14):
        return 2
    return 1


def _grid(g, dtype, key, dst_h, dst_w):
    """(TW, strips a row, items, channel tiles, BX, BY) of the launch for
    ``g`` onto a ``dst_h`` x ``dst_w`` destination."""
    vec = VECTOR_BYTES // dtype.itemsize
    tw = columns_per_thread(key, dst_w)
    strips = -(-dst_w // tw)
    tiles, bx, by = _depthwise_nhwc._block(g.channels // vec)
    if key in BLOCK:
        bx, by = BLOCK[key]
        if not (bx >= 1 and by >= 1 and bx * by <= 256):
            raise ValueError(f"BLOCK[{key}]: expected (BX, BY) with BX * BY <= 256, got {(bx, by)}")
        tiles = -(-(g.channels // vec) // bx)
    return tw, strips, g.batch * dst_h * strips, tiles, bx, by


def select(g, dtype, backward, index, src_alignment, dst_alignment):
    """``plan(...)`` when the ops take this kernel (per ``MODE``), else None."""
    if MODE == "never" or (MODE == "rule" and not preferred(g, dtype, backward)):
        return None
    return plan(g, dtype, backward, index, src_alignment, dst_alignment)


@functools.lru_cache(maxsize=1024)
def plan(g, dtype, backward, index, src_alignment, dst_alignment):
    """The Launch for this signature (arrays: src, weight, bias or NULL,
    dst), or None when this kernel does not serve it.  ``*_alignment``: the
    largest of 16, 8, 4, 2, 1 dividing the address."""
    dtype = numpy.dtype(dtype)
    size = (g.filter_height, g.filter_width)
    stride = g.stride_h
    vec = VECTOR_BYTES // dtype.itemsize
    if (
        size not in FILTER_SIZES
        or not _validate.plain_stride_one_or_two(g, backward)
        or dtype not in DTYPES
        or g.channels % vec != 0
        or src_alignment % VECTOR_BYTES != 0
        or dst_alignment % VECTOR_BYTES != 0
    ):
        return None
    k = size[0]
    src_h, src_w, dst_h, dst_w, offset_top, offset_left = _validate.correlation_frame(g, backward)
    if min(g.batch, src_h, src_w, dst_h, dst_w) <= 0:
        return None
    key = (k, stride, dtype.itemsize)
    tw, strips, items, tiles, bx, by = _grid(g, dtype, key, dst_h, dst_w)
    one_item_blocks = tiles * -(-items // by)
    per_thread = ITEMS_PER_THREAD.get(key) or items_per_thread(k, stride, dtype, dst_w, one_item_blocks)
    blocks_y = max(1, min(-(-items // (by * per_thread)), _launch.MAX_GRID_Y))
    shared = k * k * bx * vec * 4
    scalars = (
        i32(src_h), i32(src_w), i32(dst_h), i32(dst_w), i32(g.channels), i32(offset_top), i32(offset_left),
        i32(strips), _launch.index_scalar(index, items),
    )
    return _launch.Launch(KERNEL_FILE, _expression(dtype, k, stride, backward, index, tw), (tiles, blocks_y), (bx, by),
                          shared, scalars)
