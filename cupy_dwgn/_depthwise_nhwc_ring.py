"""Channels-last (NHWC) row-ring kernel (kernels/depthwise_nhwc_ring.cu): 3x3
filters, forward at stride 1 or 2 and backward-input at stride 1 (the forward
correlation with the rotated filter), and 5x5 forward at stride 2; dilation
1, depth multiplier 1, float32, float16 and bfloat16.  Whole input rows (W x
C, contiguous in NHWC) are copied once each into a ring of shared-memory rows
(one cp.async.bulk per row on sm_90), a few rows ahead of the compute.

Launch rule (no user tuning), from the shape only:

* A thread owns 4 channels (``VEC``) and strips of TW output columns
  (``SETTINGS[k, stride, itemsize]``: TW, threads aimed at, output rows
  prefetched; 5x5 takes TW 4 or 2 by ``columns``' instruction count); the
  block is C / 4 channel vectors x G column groups, G the largest count with
  at most the aimed-at threads (at least 1; C / 4 <= ``max_threads(K)``: 512
  for 3x3, 256 for 5x5).
* Ring: K + ahead * stride rows (ahead output rows prefetched), fewer down to
  K when the ring would pass ``MAX_SHARED`` bytes.  Where even K rows pass it
  (wide rows: 64x144x150 fp16 at stride 2, 43 KB a row), the same under the
  device's opt-in limit (227 KB on an H200: one block per SM); None when K
  rows do not fit that either.
* Grid: persistent (as many blocks as are resident at once); each block takes
  a contiguous 1/grid share of the (image, output row) sequence.
* Requires C * itemsize % 16 == 0, 16-byte aligned arrays, rows under 1 MB.

The ops take it where ``preferred`` says so (3x3 at stride 1 on rows at
least 42 wide, and for half types on narrower rows of 1024+ channels whose
width is not a multiple of 7; 3x3 half types at stride 2 on rows at least 28
wide; 5x5 half types at stride 2); ``MODE`` overrides that for tests and
benchmarks.
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
FILTER_SIZES = ((3, 3), (5, 5))
DTYPES = (numpy.dtype(numpy.float32), numpy.dtype(numpy.float16), _dtypes.bfloat16)
#: (stride, backward) compiled per filter size and dtype: 3x3 forward at
#: stride 1 and 2 and backward-input at stride 1; 5x5 forward at stride 2
#: only (at stride 1 the register-window kernel is faster: 64x240x28 float16
#: 38.6 us against the ring's 51.2, 7x7 64x96x56 79.7 against 143.5; the
#: 5x5 taps take 158-182 registers, one 256-thread block per SM).
VARIANTS = {3: ((1, False), (2, False), (1, True)), 5: ((2, False),)}
VEC = 4  # kernel: VEC, channels per thread
MAX_THREADS = 512  # kernel: __launch_bounds__ of the 3x3 kernels


def max_threads(k):
    """The kernel's __launch_bounds__: 512 threads for 3x3; 256 for 5x5, whose
    25 x 4 filter taps stay in registers (158-182 registers on sm_80 and
    sm_90, no spills; under
    512 threads the 128-register cap spilled 56-80 bytes)."""
    return MAX_THREADS if k == 3 else 256
#: Dynamic shared memory a block may take: under every sm_80+ GPU's opt-in
#: limit (sm_86/sm_89: 99 KB), and two blocks fit an H200's 228 KB.
MAX_SHARED = 99 * 1024
#: A shared_limit for plan() that never binds (whether shared memory alone
#: keeps a call from the kernel).
_NO_LIMIT = 2**31
#: Bulk copies complete an mbarrier transaction count (< 2**20 bytes).
MAX_ROW_BYTES = 2**20 - 16
#: (K, stride, itemsize) -> (TW output columns per strip, threads aimed at,
#: output rows prefetched), the fastest on the H200 (benchmarks/depthwise_nhwc_ring.py,
#: 2026-12-03, GPU us per launch): stride 1 prefetches one row (64x144x56
#: float16 forward 46.3 against 47.7 with two, 49.8 with three: the shorter
#: ring lets 3 blocks share an SM; 64x32x112 float32 63.8 against 70.5); 128
#: or 512 threads slower on the 56-wide rows (57.4, 54.7); TW 2 slower at
#: stride 1 (52.5), even at stride 2 (64x96x112 float16 58.0 / 58.3,
#: 64x144x56 29.2 / 28.6).  5x5 at stride 2 (2026-12-04): TW 4 / 2
#: 64x192x75 float16 79.0 / 85.3, 64x240x38 40.1 / 40.4, 64x816x19 46.2 /
#: 42.9 (one row ahead: a ring of 7 rows, 218 KiB at 75 wide).
SETTINGS = {(3, 1, 2): (4, 256, 1), (3, 1, 4): (4, 256, 1), (3, 2, 2): (4, 256, 2), (3, 2, 4): (4, 256, 2),
            (5, 2, 2): (4, 256, 1), (5, 2, 4): (4, 256, 1)}
#: K -> the TW a plan chooses among (``columns``); SETTINGS' TW where absent.
COLUMN_CHOICES = {5: (4, 2)}


def columns(k, stride, dst_width, itemsize):
    """TW for a plan: among ``COLUMN_CHOICES[k]``, the one whose strips cost
    the fewest instructions per output row and filter row: strips x (IW =
    (TW - 1) * S + K vector loads, 4 conversions each for half types, and
    4 x TW x K FMAs) (5x5 half at stride 2: 135 per 4-column strip, 75 per
    2-column one), the wider on a tie.  On the H200 (2026-12-04,
    benchmarks/depthwise_nhwc_ring.py, float16, TW 4 / 2, us) it picks the
    faster one wherever they differ: 64x816x19 (10 columns) 46.6 / 43.2,
    64x480x28 (14) 43.9 / 39.6, 64x672x14 (7) 24.4 / 25.8, 64x192x75 (38)
    78.6 / 85.6, 64x96x150 (75) 138.7 / 152.1; 64x240x38 (19) 40.2 / 40.2."""
    choices = COLUMN_CHOICES.get(k, (SETTINGS[k, stride, itemsize][0],))
    conversions = VEC if itemsize == 2 else 0

    def cost(tw):
        return -(-dst_width // tw) * (((tw - 1) * stride + k) * (1 + conversions) + VEC * tw * k)

    return min(choices, key=lambda tw: (cost(tw), -tw))


def _expression(dtype, k, stride, backward, index, columns=None):
    tw = columns or SETTINGS[k, stride, numpy.dtype(dtype).itemsize][0]
    return _compile.name_expression(KERNEL, _dtypes.ctype(dtype), k, stride, tw, "true" if backward else "false", index)


def specializations(dtypes=None, filter_sizes=None, backward=None, large_index=(False, True)):
    """``(file, name expression)`` of every ring-kernel specialization.

    backward: None (both), False (forward) or True (backward-input)."""
    return [spec for size in FILTER_SIZES for tw in COLUMN_CHOICES.get(size[0], (None,))
            for spec in _compile.direction_specializations(
                KERNEL_FILE, functools.partial(_expression, columns=tw), DTYPES, (size,), VARIANTS[size[0]], dtypes,
                filter_sizes, backward, large_index)]


def preferred(g, dtype, backward):
    """Whether the ops take the ring kernel for ``g`` (where it serves the
    call): 3x3 on destinations at least 42 columns wide at stride 1 (half
    types with at least 64 channels, or 24 to 63 as below; narrower half-type
    rows of at least 1024 channels whose width is not a multiple of 7), and
    half types at stride 2 on destinations at least 28 wide; 5x5 half types
    at stride 2 with at least 24 channels.  Measured on an H200 (2026-12-03,
    benchmarks/depthwise_nhwc_ring.py, GPU us per launch, ring against the
    kernel the ops took before):

    * float16 / bfloat16, stride 1: 64x144x56 forward 46.3 / 72.8 (window
      kernel; PyTorch channels_last 50.4 in the table), bfloat16 48.0 / 73.2,
      backward-input 44.7 / 67.9 and 46.7 / 68.5; 64x192x56 59.9 / 79.3.
      Not 32 channels at 112x112 (50.4 / 46.4: 8 channel vectors a pixel),
      nor 28x28 and smaller (64x384x28 36.4 / 35.1, 64x576x14 24.2 / 17.6,
      64x960x7 10.6 / 10.9) but for rows of 1024 channels and more whose
      width is not a multiple of the window kernel's 7 columns (2026-12-04,
      benchmarks/depthwise_candidates.py, forward; backward-input alike):
      64x1392x10 23.6 / 27.5 (PyTorch channels_last 22.8), 64x1024x10 19.6 /
      22.5, 64x1344x19 66.6 / 103.9; 64x576x19 34.1 / 34.1; multiples of 7
      stay the window kernel's (64x1152x7 13.0 / 12.2, 64x960x14 29.0 /
      24.2, 64x768x14 25.9 / 22.4, 64x672x14 25.3 / 20.3).
    * float16 / bfloat16, stride 2: 64x96x112 58.3 / 67.8 (direct kernel)
      and 59.4 / 74.4 (tiled), 64x144x56 28.6 / 31.5 and 28.7 / 34.7.
    * float16, stride 1, fewer than 64 channels (2026-12-04,
      benchmarks/depthwise_candidates.py, forward / backward-input alike): where the window kernel
      cannot serve (channels not a multiple of 16) the ring beats the tiled
      and direct kernels from 75 columns, and from 56 at 40 channels
      (64x40x150 87.0 / 124.3 direct / 132.5 tiled, 64x24x150 66.0 / 73.8 /
      77.9, 64x40x112 56.3 / 71.4, 64x24x112 41.9 / 42.7, 64x40x75 31.3 /
      35.3, 64x56x75 37.7 / 47.2, 64x40x56 20.9 / 21.3; but 64x24x56 15.6 /
      14.6 direct); where it can, the window kernel keeps rows that are a
      multiple of 8 columns (64x32x112 44.7 / ring 50.1, 64x32x56 15.4 /
      17.3, 64x48x56 19.9 / 23.7) but for 48 channels at 112 (74.7 / 64.9),
      and the ring takes the others (64x32x150 71.8 / 85.6, 64x48x150 102.8
      / 141.2, 64x32x75 26.0 / 27.5; 64x48x75 36.8 / 35.7 forward, 35.4 /
      35.5 backward); 16 channels stay the window kernel's (64x16x150 37.5 /
      46.1).
    * 5x5, float16 / bfloat16, stride 2 (2026-12-04, benchmarks/depthwise_nhwc_ring.py):
      64x192x75 79.0 / 123.5 (tiled; PyTorch channels_last 80.6 in the
      EfficientNet-B3 table), 64x240x38 40.1 / 51.4, 64x816x19 46.2 / 53.3;
      from 24 channels (2026-12-04, benchmarks/depthwise_candidates.py,
      float16): 64x24x112 28.6 / 33.0 (tiled), 64x32x56 13.2 / 17.6, but
      64x16x112 22.6 / 21.6, 64x8x112 20.0 / 13.7, 64x16x56 11.0 / 8.3.
      Not float32 (64x240x38 63.5 / 49.4 direct; wider rows pass the shared
      memory), nor stride 1 (not compiled: see ``VARIANTS``).
    * float32, stride 1: 64x144x56 75.5 / 81.8 (tiled), backward-input 75.4 /
      79.9; 64x32x112 63.8 / 66.0.  Rows wider than a third of MAX_SHARED
      (64x192x56, 64x384x28) are not served; stride 2 about even (64x144x56
      43.8 / 45.1) and not taken.
    """
    dtype = numpy.dtype(dtype)
    stride = g.stride_h
    if g.filter_height == 5:
        return dtype.itemsize == 2 and stride == 2 and not backward and g.channels >= 24
    dst_width = g.width if backward else g.out_width
    if dtype.itemsize == 2:
        if stride == 2:
            return dst_width >= 28
        channels = g.channels
        if dst_width < 42:  # the window kernel's 7-column items, but where widths waste them
            return channels >= 1024 and dst_width % 7 != 0
        if channels < 24:
            return False
        if channels >= 64:
            return True
        if channels % 16:  # the window kernel does not serve these
            return dst_width >= 75 or channels >= 40
        return dst_width % 8 != 0 or (channels >= 48 and dst_width >= 96)
    return dtype == numpy.float32 and stride == 1 and dst_width >= 42


def select(g, dtype, backward, index, src_alignment, dst_alignment):
    """``plan(...)`` when the ops take this kernel (per ``MODE``), else None."""
    if MODE == "never" or (MODE == "rule" and not preferred(g, dtype, backward)):
        return None
    return plan_on_device(g, dtype, backward, index, src_alignment, dst_alignment)


def plan_on_device(g, dtype, backward, index, src_alignment, dst_alignment, setting=None, bulk=True):
    """``plan(...)``, else, where only K rows past ``MAX_SHARED`` stand in the
    way, the same plan under the current device's opt-in shared-memory limit
    per block (one block per SM); None where even that is short or the kernel
    does not serve the signature.  What the ops launch; tests, the sanitizer
    workload and the benchmarks plan through it too."""
    args = (g, dtype, backward, index, src_alignment, dst_alignment, setting, bulk)
    launch = plan(*args)
    if launch is None and plan(*args, _NO_LIMIT):
        from cupy.cuda import runtime

        launch = plan(*args, _launch.max_shared_per_block(runtime.getDevice()))
    return launch


@functools.lru_cache(maxsize=1024)
def plan(g, dtype, backward, index, src_alignment, dst_alignment, setting=None, bulk=True, shared_limit=None):
    """The Launch for this signature (arrays: src, weight, bias or NULL,
    dst), or None when this kernel does not serve it.  ``*_alignment``: the
    largest of 16, 8, 4, 2, 1 dividing the address.  ``setting``: (TW,
    threads, rows ahead) in place of ``SETTINGS``'s; ``bulk``: False copies
    with the block's cp.async pieces even where bulk copies exist (tests);
    ``shared_limit``: the device's opt-in shared memory per block, taken
    where K rows pass ``MAX_SHARED`` (None: MAX_SHARED only)."""
    dtype = numpy.dtype(dtype)
    size = (g.filter_height, g.filter_width)
    stride = g.stride_h
    if (
        size not in FILTER_SIZES
        or not _validate.plain_stride_one_or_two(g, backward)
        or (g.stride_h, backward) not in VARIANTS[size[0]]
        or dtype not in DTYPES
        or g.channels * dtype.itemsize % 16 != 0
        or g.channels // VEC > max_threads(size[0])
        or src_alignment % 16 != 0
        or dst_alignment % 16 != 0
    ):
        return None
    k = size[0]
    src_h, src_w, dst_h, dst_w, offset_top, offset_left = _validate.correlation_frame(g, backward)
    if min(g.batch, src_h, src_w, dst_h, dst_w) <= 0 or g.batch * dst_h >= 2**31:
        return None
    tw, threads, ahead = setting or SETTINGS[k, stride, dtype.itemsize]
    if setting is None:
        tw = columns(k, stride, dst_w, dtype.itemsize)
    row_bytes = src_w * g.channels * dtype.itemsize
    if row_bytes > MAX_ROW_BYTES:
        return None
    vectors = g.channels // VEC
    groups = max(1, min(threads // vectors, max_threads(k) // vectors))
    strips = -(-dst_w // tw)
    groups = -(-strips // -(-strips // groups))  # as few as give each the same strip count
    # Slot columns: `lead` zero columns left of input column 0 (the left
    # padding), then the row, then zeros up to the last column a strip reads.
    lead = max(offset_left, 0)
    slot_pixels = max(lead + src_w, (strips * tw - 1) * stride + k - offset_left + lead)
    slot_bytes = slot_pixels * g.channels * dtype.itemsize

    def shared_bytes(slots):  # the slots' mbarriers (8 bytes each, padded to 16), then the slots
        return -(-slots * 8 // 16) * 16 + slots * slot_bytes

    limit = MAX_SHARED
    if shared_bytes(k) > MAX_SHARED and shared_limit is not None:
        limit = max(MAX_SHARED, shared_limit)
    ring = k + ahead * stride
    while ring > k and shared_bytes(ring) > limit:
        ring -= 1
    shared = shared_bytes(ring)
    if shared > limit:
        return None
    total_rows = g.batch * dst_h
    scalars = (
        i32(src_h), i32(src_w), i32(dst_h), i32(dst_w), i32(g.channels), i32(offset_top), i32(offset_left),
        i32(lead), i32(slot_pixels), i32(ring), i32(total_rows), i32(1 if bulk else 0),
    )
    return _launch.Launch(KERNEL_FILE, _expression(dtype, k, stride, backward, index, tw), (total_rows,),
                          (vectors * groups,), shared, scalars, persistent=True)
