"""Channels-last (NHWC) register-window kernel (kernels/depthwise_nhwc_window.cu,
design "P2" of the NHWC review): forward and stride-1 backward-input for 3x3,
5x5 and 7x7 filters at stride 1, dilation 1 and depth multiplier 1, in
float32, float16 and bfloat16.  The ops take it where ``preferred`` (measured
on an H200) says it beats the tiled kernels of _depthwise_nhwc; ``MODE``
overrides that for tests.

Launch rule (no user tuning), from the destination size and the filter:

* Channel tile CT = 32 bytes of channels: 16 for float16/bfloat16 (a lane
  owns a channel pair), 8 for float32 (a lane owns one channel); 8 lanes per
  pixel.  C must be a multiple of CT (else ``plan`` returns None and the
  existing NHWC kernels serve the call).
* A thread computes RO x TW = 2 x 7 destination pixels (TW = 7: the CNN
  widths 112, 56, 28, 14, 7 are multiples of 7).
* A block is a tile_rows x tile_cols grid of such threads (at most 32: 256
  threads), its destination tile (tile_rows*2) x (tile_cols*7) pixels.  Over
  every grid with tile_cols <= ceil(OW / 7), tile_rows <= ceil(OH / 2) whose
  three ring buffers fit in RING_BYTES, balanced over the image (the last
  tile row/column nearly full), ``_tile`` takes the one with the least
  ``tiles * (staged source pixels + K * computed destination pixels)``
  (halo and edge waste against arithmetic), then the most threads.
* The shared row pitch is the smallest multiple of 16 bytes >= the tile row
  whose warps read without bank conflicts (``bank_ways``), else the least
  conflicted.
* Work units: (channel tile, image, tile row, tile column), in groups of
  ``group`` channel tiles (``preferred``), group-major with the group's
  tiles innermost (kernel: advance()); the grid is persistent (at most the blocks resident at once,
  Launch(persistent=True)), each block taking a contiguous, balanced range of
  units and copying each unit's source tile + halo two units ahead through a
  three-stage cp.async ring.
* Requires a 16-byte aligned source (cp.async) and a 4-byte aligned
  destination (one 4-byte store per lane and pixel); else None.
"""

import functools

import numpy

from . import _compile, _dtypes, _launch, _validate
from ._launch import i32

#: "rule": the ops take this kernel where ``preferred`` says it wins;
#: "always": wherever it serves the call (tests, the sanitizer workload);
#: "never": not at all.
MODE = "rule"

KERNEL_FILE = "depthwise_nhwc_window.cu"
KERNEL = "dwgn_dwconv_nhwc_window"
FILTER_SIZES = ((3, 3), (5, 5), (7, 7))
DTYPES = (numpy.dtype(numpy.float32), numpy.dtype(numpy.float16), _dtypes.bfloat16)

LANES = 8  # kernel: kLanes
PIXEL_BYTES = 32  # kernel: kPixelBytes
ROWS = 2  # kernel: kRows (RO)
COLUMNS = 7  # kernel: kColumns (TW)
STAGES = 3  # kernel: kStages
MAX_SPATIAL = 32  # threads' tiles per block: 256 threads
#: Shared memory of the ring (three tiles); with the weights (<= 3 KB) two
#: blocks fit in an A100's 164 KB and an H200's 228 KB.
RING_BYTES = 72 * 1024
#: Channel tiles per group when ``preferred`` names none (MODE "always").
GROUP = 1
_MAX_GRID = 2**20
_BANKS = 32


def channel_tile(dtype):
    """Channels per unit: 16 for 2-byte types, 8 for float32."""
    return PIXEL_BYTES // numpy.dtype(dtype).itemsize


def _expression(dtype, k, index):
    return _compile.name_expression(KERNEL, _dtypes.ctype(dtype), k, index)


def specializations(dtypes=None, filter_sizes=None, large_index=(False, True)):
    """``(file, name expression)`` of every specialization (one kernel serves
    forward and backward-input)."""
    return _compile.filter_size_specializations(
        KERNEL_FILE, lambda dtype, size, index: _expression(dtype, size[0], index), DTYPES, FILTER_SIZES,
        dtypes, filter_sizes, large_index)


def bank_ways(tile_rows, tile_cols, pitch):
    """The worst bank conflict (1: none) of the window reads: every thread of
    a warp reads the 4-byte word at the same offset from its window start
    ((tr*RO)*pitch + (tc*TW)*32 + lane*4), so one offset stands for all."""
    threads = LANES * tile_rows * tile_cols
    worst = 1
    for warp in range(0, threads, 32):
        words = {}
        for t in range(warp, min(warp + 32, threads)):
            lane, s = t % LANES, t // LANES
            tr, tc = divmod(s, tile_cols)
            word = ((tr * ROWS) * pitch + (tc * COLUMNS) * PIXEL_BYTES + lane * 4) // 4
            words.setdefault(word % _BANKS, set()).add(word)
        worst = max(worst, max(len(v) for v in words.values()))
    return worst


@functools.lru_cache(maxsize=4096)
def _pitch(tile_rows, tile_cols, in_w):
    """Row pitch in bytes: the least conflicted of in_w*32 + 16*{0..7}, smallest first."""
    candidates = [in_w * PIXEL_BYTES + 16 * pad for pad in range(8)]
    return min(candidates, key=lambda p: (bank_ways(tile_rows, tile_cols, p), p))


def _tile(dst_h, dst_w, k):
    """(tile_rows, tile_cols, tiles_h, tiles_w, pitch) per the module's rule."""
    col_groups, row_groups = -(-dst_w // COLUMNS), -(-dst_h // ROWS)
    best = None
    for tc in range(1, min(col_groups, MAX_SPATIAL) + 1):
        tiles_w = -(-col_groups // tc)
        cols = -(-col_groups // tiles_w)  # balanced
        if cols != tc:
            continue  # the same grid as a narrower tc
        for tr in range(1, min(row_groups, MAX_SPATIAL // tc) + 1):
            tiles_h = -(-row_groups // tr)
            rows = -(-row_groups // tiles_h)
            if rows != tr:
                continue
            in_h, in_w = tr * ROWS + k - 1, tc * COLUMNS + k - 1
            pitch = _pitch(tr, tc, in_w)
            if STAGES * in_h * pitch > RING_BYTES:
                continue
            cost = tiles_h * tiles_w * (in_h * in_w + k * tr * ROWS * tc * COLUMNS)
            key = (cost, -tr * tc)
            if best is None or key < best[0]:
                best = (key, (tr, tc, tiles_h, tiles_w, pitch))
    return None if best is None else best[1]


def preferred(g, dtype, backward):
    """Channel tiles per group when this kernel beats the tiled NHWC kernels
    for this geometry, else None.  Measured on an H200 (2026-12-01,
    ``benchmarks/depthwise_nhwc_kernels.py --sweep``: forward, N = 64, "same"
    padding, GPU time per launch, us; group 1 / 2 / 4 against the tiled
    kernel; backward-input is the same kernel on a rotated filter):

    * half types, every filter and plane: 28x28 384-channel 3x3 36.0 / 53.8,
      5x5 50.7 / 120.1, 7x7 80.0 / 231.5; 7x7 planes 960 channels 3x3 10.5 /
      12.9, 7x7 23.4 / 46.0; 112x112 32-channel 7x7 92.3 / 169.5.  Group 1,
      except 3x3 filters on planes of 56x56 and more, where group 1 reads
      DRAM up to twice (144 channels at 56x56: 94.6 against 71.8) and group
      4 ties or wins (73.3 / 71.8; 96 channels at 112x112 171.7 / 179.4; 96
      at 56x56 41.3 / 49.1).
    * float32: 7x7 filters, group 1 (28x28 384 channels 110.0 / 139.5; 7x7
      planes 1152 channels 30.2 / 39.3); 5x5 filters on 14x14 to 28x28
      planes, group 2 (28x28 384 channels 68.1 / 87.5, 14x14 480 channels
      26.9 / 32.9); the direct kernel, tried first, takes the 5x5 rows 15
      to 28 wide where its grid holds 2 items a thread, since 2026-12-07
      (_depthwise_nhwc_direct.preferred).  Not 3x3 (28x28 384 channels:
      87.5 at best against 58.0), nor 5x5 on 56x56 and larger (144 channels
      134.7 / 118.4) or on 7x7 planes (1152 channels 24.2 / 23.8).
    """
    k = g.filter_height
    area = (g.height * g.width) if backward else (g.out_height * g.out_width)
    if numpy.dtype(dtype).itemsize == 2:
        return 4 if k == 3 and area >= 56 * 56 else 1
    if k == 7:
        return 1
    if k == 5 and 14 * 14 <= area <= 28 * 28:
        return 2
    return None


def select(g, dtype, backward, index, src_alignment, dst_alignment):
    """The Launch the ops take for this call (per ``MODE``), or None."""
    if MODE == "never":
        return None
    group = preferred(g, dtype, backward)
    if group is None and MODE == "always":
        group = GROUP
    return None if group is None else plan(g, dtype, backward, index, src_alignment, dst_alignment, group)


@functools.lru_cache(maxsize=1024)
def plan(g, dtype, backward, index, src_alignment, dst_alignment, group=GROUP):
    """The Launch for this signature (arrays: src, weight, bias or NULL, dst),
    or None when this kernel does not serve it.  ``src_alignment`` /
    ``dst_alignment``: the largest of 16, 8, 4, 2, 1 dividing the address."""
    dtype = numpy.dtype(dtype)
    size = (g.filter_height, g.filter_width)
    if (
        size not in FILTER_SIZES
        or (g.stride_h, g.stride_w, g.dilation_h, g.dilation_w) != (1, 1, 1, 1)
        or g.multiplier != 1
        or dtype not in DTYPES
        or g.channels % channel_tile(dtype) != 0
        or src_alignment % 16 != 0
        or dst_alignment % 4 != 0
    ):
        return None
    k = size[0]
    src_h, src_w, dst_h, dst_w, offset_top, offset_left = _validate.correlation_frame(g, backward)
    if min(g.batch, src_h, src_w, dst_h, dst_w) <= 0:
        return None
    tile = _tile(dst_h, dst_w, k)
    if tile is None:
        return None
    tile_rows, tile_cols, tiles_h, tiles_w, pitch = tile
    units = (g.channels // channel_tile(dtype)) * g.batch * tiles_h * tiles_w
    if units >= 2**31:
        return None
    stage_bytes = (tile_rows * ROWS + k - 1) * pitch
    channel_tiles = g.channels // channel_tile(dtype)
    group = max(1, min(group, channel_tiles))
    weight_bytes = group * k * k * channel_tile(dtype) * 4
    return _launch.Launch(
        KERNEL_FILE,
        _expression(dtype, k, index),
        (min(units, _MAX_GRID),),
        (LANES * tile_rows * tile_cols,),
        weight_bytes + STAGES * stage_bytes,
        (
            i32(g.batch), i32(src_h), i32(src_w), i32(dst_h), i32(dst_w), i32(g.channels), i32(offset_top),
            i32(offset_left), i32(1 if backward else 0), i32(tile_rows), i32(tile_cols), i32(tiles_h),
            i32(tiles_w), i32(pitch), i32(stage_bytes), i32(units), i32(group),
        ),
        persistent=True,
    )
