"""Weight gradient on the tensor cores (kernels/depthwise_wgrad_mma.cu):
float16 and bfloat16, NCHW or NHWC, 3x3 / 5x5 / 7x7 filters at stride 1,
dilation 1, depth multiplier 1, planes small enough that a block's buffers
fit in shared memory.  For one channel and one input row, the products of
that row with the grad_out rows it meets are one m16n8k16 matrix product
(filter rows x output columns times output columns x filter columns), so
the taps' sums run on the tensor cores in float32.  It writes
partial[split][tap][channel] and the shared finalize
(_depthwise_nhwc.with_finalize) adds the splits in a fixed order:
deterministic, bit-identical run to run.  The ops take it where
``preferred`` says so; ``MODE`` overrides that for tests and benchmarks.

Launch rule (no user tuning), from the shape only:

* A block of 256 threads (8 warps) owns a group of 8 channels and a split:
  a contiguous range of images; the (16-column chunk, input row) units of
  an image are dealt to the warps, each running all 8 channels.  Grid: x =
  channel groups, y = splits = ``_launch.unit_splits`` over the images with
  about ``TARGET_BLOCKS`` blocks and at least ``MIN_IMAGES_PER_SPLIT`` images
  a split (constants, not the SM count: the summation order depends on the
  shape only).
* Shared memory: ``stages`` raw buffers (x and grad_out of 8 channels of one
  image, as copied; ``stages_and_shared``), at least the 16 KB of the final
  reduction; the plan is refused past ``MAX_SHARED``.
* Padding rows at most K - 1 on each side (every grad_out row meets a row
  of the plane; the kernel's header says why).
* NCHW copies whole plane ranges in pieces of 16, 8 or 4 bytes (the largest
  dividing the planes' bytes and both addresses' alignment) and needs an
  even out_w (A's pairs are 32-bit loads); NHWC copies 16-byte pixel vectors
  (C a multiple of 8, both arrays 16-byte aligned).
"""

import functools

import numpy

from . import _compile, _depthwise_nhwc, _dtypes, _launch
from ._launch import i32

#: "rule": the ops take this kernel where ``preferred`` says it wins;
#: "always": wherever it serves the call (tests, the sanitizer workload,
#: benchmarks); "never": not at all.
MODE = "rule"

KERNEL_FILE = "depthwise_wgrad_mma.cu"
KERNEL = "dwgn_dwconv_wgrad_mma"
FILTER_SIZES = ((3, 3), (5, 5), (7, 7))
DTYPES = (numpy.dtype(numpy.float16), _dtypes.bfloat16)
LAYOUTS = ("NCHW", "NHWC")

WARPS = 8  # kernel: kWarps (= channels per block)
THREADS = 32 * WARPS
#: Raw buffers a block cycles through: as many as fit STAGE_BYTES, 2 to
#: MAX_STAGES (2 blocks share an SM: about 128 registers a thread; 2, 3 and
#: 8 buffers measured within 5% of each other at 14x14, 64x384x14 7x7 float16
#: NHWC 34.3 / 33.4 / 34.4 us).
MAX_STAGES = 8  # kernel: kMaxStages (cp.async.wait_group immediates up to 6)
STAGE_BYTES = 72 * 1024
REDUCTION_BYTES = WARPS * WARPS * 32 * 8  # kernel: red[warp][channel][lane][2] floats
#: Shared memory a block may take: the opt-in limit of every sm_80+ GPU but
#: the A100/H100/H200 class (sm_86/89: 99 KB), so plans do not depend on the device.
MAX_SHARED = 99 * 1024
TARGET_BLOCKS = 1056
MIN_IMAGES_PER_SPLIT = 2
#: ``preferred``: outputs narrower than this leave most of a 16-column chunk idle.
MIN_WIDTH = 12


def _expression(dtype, k, layout, index):
    return _compile.name_expression(KERNEL, _dtypes.ctype(dtype), k, str(layout == "NHWC").lower(), index)


def specializations(dtypes=None, filter_sizes=None, large_index=(False, True), layouts=LAYOUTS):
    """``(file, name expression)`` of every specialization."""
    layouts = (layouts,) if isinstance(layouts, str) else tuple(layouts)
    return _compile.filter_size_specializations(
        KERNEL_FILE, lambda dtype, size, index, layout: _expression(dtype, size[0], layout, index),
        DTYPES, FILTER_SIZES, dtypes, filter_sizes, large_index, [(layout,) for layout in LAYOUTS if layout in layouts])


def preferred(g, dtype, layout):
    """Whether the ops take this kernel for ``g`` (where it serves the call):
    7x7 filters on outputs at least ``MIN_WIDTH`` wide, and 5x5 in NCHW on
    outputs of one chunk (<= 16 wide).  Measured on an H200 (2026-12-03,
    benchmarks/depthwise_wgrad_mma.py, N = 64, float16, us, this kernel
    against the one the ops took before, NCHW / NHWC; bfloat16 alike;
    benchmarks/results/depthwise_wgrad_mma_h200_2026-12-03.txt): 7x7
    64x384x14 37.3 / 33.0 against 50.2 / 46.8, 64x768x14 62.4 / 54.6
    against 93.9 / 87.4, 64x192x28 43.1 / 43.3 against 50.1 / 69.4; 5x5
    64x672x14 55.3 against 58.6 (NCHW; NHWC 48.0 against 41.0); since the
    padding-row rule of the kernel's header (bcc0e4f) 64x384x14 38.4 / 35.4,
    64x768x14 64.3 / 59.3, 64x192x28 44.0 / 44.5.  Slower
    elsewhere: 7x7 on 7-wide outputs (64x768x7 NHWC 39.9 against 31.2),
    5x5 on 28x28 (56.1 / 49.8 against 45.6 / 47.7), every 3x3 (64x384x28
    78.9 / 71.0 against 47.3 / 38.4): a tile holds K x K useful products
    of its 16 x 8 x 16, and its fragments cost about 15 instructions
    (Nsight Compute: 0.7 instructions issued per scheduler per cycle, DRAM
    at 12-20%)."""
    k = g.filter_height
    if k == 7:
        return g.out_width >= MIN_WIDTH
    return k == 5 and layout == "NCHW" and MIN_WIDTH <= g.out_width <= 16


def select(g, dtype, layout, index, grad_out_alignment, x_alignment):
    """``plan(...)`` when the ops take this kernel (per ``MODE``), else None."""
    if MODE == "never" or (MODE == "rule" and not preferred(g, dtype, layout)):
        return None
    return plan(g, dtype, layout, index, grad_out_alignment, x_alignment)


def stages_and_shared(g, stages=None):
    """(raw buffers, dynamic shared memory) of the kernel for ``g``: as many
    buffers as fit STAGE_BYTES (2 to MAX_STAGES; ``stages``: that many
    instead), at least the final reduction's bytes."""
    raw = WARPS * (g.height * g.width + g.out_height * g.out_width) * 2
    if stages is not None and not 2 <= stages <= MAX_STAGES:
        # One buffer would be read before its copies land (the kernel waits on stages - 2 groups).
        raise ValueError(f"stages: expected 2 to {MAX_STAGES} raw buffers, got {stages}")
    stages = stages or max(2, min(MAX_STAGES, STAGE_BYTES // raw))
    return stages, max(stages * raw, REDUCTION_BYTES)


@functools.lru_cache(maxsize=1024)
def plan(g, dtype, layout, index, grad_out_alignment, x_alignment, target_blocks=None, stages=None):
    """``((partial launch, finalize launch), (shape, dtype) of the partial
    sums))`` (partial arguments: grad_out, x, partial; finalize: partial,
    grad_weight), or None when this kernel does not serve the call.
    ``*_alignment``: the largest of 16, 8, 4, 2, 1 dividing the address.
    ``target_blocks``, ``stages``: instead of the rule's (benchmarks)."""
    dtype = numpy.dtype(dtype)
    k = g.filter_height
    if (
        (g.filter_height, g.filter_width) not in FILTER_SIZES
        or (g.stride_h, g.stride_w) != (1, 1)
        or (g.dilation_h, g.dilation_w) != (1, 1)
        or g.multiplier != 1
        or dtype not in DTYPES
        or min(g.batch, g.channels, g.height, g.width, g.out_height, g.out_width) <= 0
        or g.pad_top < 0 or g.pad_left < 0
        # A grad_out row that meets padding rows must meet a plane row too
        # (the kernel flags its non-finite values from the edge rows' tiles).
        or g.pad_top > k - 1 or g.pad_bottom > k - 1
    ):
        return None
    x_plane, dy_plane = g.height * g.width, g.out_height * g.out_width
    if layout == "NHWC":
        if g.channels % WARPS or min(grad_out_alignment, x_alignment) < 16:
            return None
        piece = 16
    else:
        if g.out_width % 2:
            return None
        piece = next((p for p in (16, 8, 4) if (2 * x_plane) % p == 0 and (2 * dy_plane) % p == 0
                      and grad_out_alignment % p == 0 and x_alignment % p == 0), None)
        if piece is None:
            return None
    stages, shared = stages_and_shared(g, stages)
    if shared > MAX_SHARED:
        return None
    grid_x = -(-g.channels // WARPS)
    split = _launch.unit_splits(g.batch, grid_x, 1, target_blocks or TARGET_BLOCKS, MIN_IMAGES_PER_SPLIT)
    if split is None:
        return None
    splits, per_split = split
    scalars = (
        i32(g.height), i32(g.width), i32(g.channels), i32(g.out_height), i32(g.out_width), i32(g.pad_top),
        i32(g.pad_left), i32(g.batch), i32(per_split), i32(-(-g.out_width // 16)), i32(piece),
        i32(stages),
    )
    partial = _launch.Launch(KERNEL_FILE, _expression(dtype, k, layout, index), (grid_x, splits), (THREADS,), shared,
                             scalars)
    return _depthwise_nhwc.with_finalize(partial, dtype, g.channels, k * k, splits)
