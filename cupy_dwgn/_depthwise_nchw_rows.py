"""NCHW row kernel (kernels/depthwise_nchw_rows.cu): one thread per
destination row of at most 16 values, for 3x3, 5x5 and 7x7 filters at
dilation 1 and depth multiplier 1: forward at stride 1 (rows of up to 16) or
stride 2 (up to 8), backward-input at stride 1 (the forward correlation with
the rotated filter), in float32, float16 and bfloat16.

Launch rule (no user tuning), from the destination width:

* W, the row width compiled: 8 for destination rows of at most 8 values,
  else 16 (stride 1 only).  Columns past the row are computed from masked
  zeros and not stored.
* One thread per destination row (N * C * dst_height rows), blocks of
  THREADS; no shared memory.

The ops take it where ``preferred`` says so (rows of at most 10 values, and
7x7 filters on rows of 13, and of 14 in half types); ``MODE`` overrides that
for tests and benchmarks.
"""

import functools

import numpy

from . import _compile, _depthwise_nchw_forward_regs, _dtypes, _launch, _validate
from ._launch import i32

#: "rule": the ops take this kernel where ``preferred`` says it wins;
#: "always": wherever it serves the call (tests, the sanitizer workload,
#: benchmarks); "never": not at all.
MODE = "rule"

KERNEL_FILE = "depthwise_nchw_rows.cu"
KERNEL = "dwgn_dwconv2d_rows"
FILTER_SIZES = ((3, 3), (5, 5), (7, 7))
DTYPES = (numpy.dtype(numpy.float32), numpy.dtype(numpy.float16), _dtypes.bfloat16)
#: (stride, backward, row width W) compiled per filter size and dtype.
VARIANTS = ((1, False, 8), (1, False, 16), (2, False, 8), (1, True, 8), (1, True, 16))
THREADS = 256


def width(dst_width, stride):
    """W for a destination row of ``dst_width`` values, or None when wider
    than the kernel serves."""
    widest = 8 if stride == 2 else 16
    if dst_width > widest:
        return None
    return 8 if dst_width <= 8 else 16


def _expression(dtype, size, stride, backward, w, index):
    return _compile.name_expression(KERNEL, _dtypes.ctype(dtype), size[0], size[1], stride, w,
                                    "true" if backward else "false", index)


def specializations(dtypes=None, filter_sizes=None, backward=None, large_index=(False, True)):
    """``(file, name expression)`` of every row-kernel specialization.

    backward: None (both), False (forward) or True (backward-input)."""
    return _compile.filter_size_specializations(
        KERNEL_FILE,
        lambda dtype, size, index, stride, is_backward, w: _expression(dtype, size, stride, is_backward, w, index),
        DTYPES, FILTER_SIZES, dtypes, filter_sizes, large_index,
        [v for v in VARIANTS if backward is None or v[1] == backward])


def preferred(g, dtype, backward, src_alignment, dst_alignment):
    """Whether the ops take the row kernel for ``g`` (where it serves the
    call): destination rows of at most 10 values (but half types on 10-wide
    rows at stride 1, 7x7 on rows of at most 7, and float32 on 8-wide rows
    at stride 1 where the register row walk takes them, which depends on the
    tensors' byte alignments ``src_alignment`` and ``dst_alignment``:
    _depthwise_nchw_forward_regs.takes_narrow_float32).  Measured on
    an H200 (2026-12-01,
    benchmarks/depthwise_kernels.py, GPU time per launch, us, rows against
    the best of the whole-plane and window kernels):

    * 7-wide planes: 64x960x7 3x3 fp32 forward 12.0 / 24.4, backward-input
      12.4 / 24.3, fp16 10.2 / 16.2 and 9.8 / 18.4; 5x5 fp32 15.2 / 27.8;
      256x960x7 fp16 29.7 / 48.1; 8x960x7 fp16 7.8 / 8.1; 8-wide 64x512x8
      fp16 8.9 / 9.4 (float32 14.1 / 13.9); 10-wide 64x320x10 fp16 11.0 /
      15.0 (float32 13.7 / 13.5).  Stride 2 onto 7-wide rows: 64x672x14 5x5
      fp16 19.4 / 68.8, 64x576x14 3x3 fp32 19.4 / 37.8.
    * 14-wide 7x7: fp16 64x384x14 38.8 / 42.8, bf16 38.1 / 45.3, but float32
      40.8 / 38.3.  Wider rows with smaller filters lose: each lane reads
      its own row, so a warp's load touches up to 32 sectors and L1
      wavefronts bound the kernel (64x512x16 3x3 fp16 76.8 / 25.6,
      64x768x12 30.3 / 16.9, 64x384x14 3x3 36.0 / 25.2; 64x672x14 5x5
      49.2 / 50.5 even).
    * The plane-size sweep of 2026-12-02 (benchmarks/depthwise_kernels.py
      --shapes, about 64 MB per tensor, forward; backward-input alike;
      after the plane kernel's output buffer): 7x7 on 13-wide rows 221.1
      against the plane kernel's 244.8 (float32 222.2 / 229.4), half types on
      14-wide 215.0 / 221.3.  Not taken: 11-wide 3x3 half 110.9 / 81.5, 5x5
      on 14-wide 154.3 / 137.0, 7x7 on 12-wide 220.2 / 161.0, 15-wide 214.7
      / 194.6, 16-wide 313.4 against the window kernel's 192.9.  10-wide
      rows stay here although half 3x3 lost at that size (96.1 / 90.2
      forward, 97.0 / 88.1 backward; float32 122.2 / 122.5 and 105.7 /
      120.1): the smaller 64x320x10 above, where the row kernel won, was
      measured before the plane kernel's output buffer.  Re-measured
      2026-12-04 (the kernels side by side, rows / plane / walk, us): half
      types on 10-wide rows at stride 1 now go to the plane kernel
      (64x1392x10 fp16 3x3 forward 30.2 / 26.6 / 26.9, backward-input 30.8 /
      25.9 / 25.5; 5x5 49.6 / 41.1 / 45.1 and 48.5 / 41.4 / 44.3); float32
      stays (5x5 46.7 / 53.6 / 60.4; 3x3 39.3 / 39.0 / 33.8, where only the
      walk would win).
    * float16 7x7 on 14-wide planes (ConvNeXt's third stage) go to the
      plane kernel (its packed half2 arithmetic), bfloat16 stayed (until the
      7-row items, below): measured
      on an H100 in two calls (2026-12-06, rows / plane, us, forward;
      backward-input alike): 64x384x14 fp16 39.0 / 31.9 and 39.5 / 32.4,
      32x384x14 23.7 / 16.7, 64x768x14 69.4 / 59.2; bf16 38.9 / 38.1,
      23.3 / 19.7, 70.2 / 71.9 (results/depthwise_candidates_h100_2026-12-06.txt).
      The H200 figures above (2026-12-01, and 215.0 / 221.3 at 64 MB on
      2026-12-02) predate the plane kernel's later items.
    * 7x7 in half types on 7-wide planes (ConvNeXt's last stage) go to the
      plane kernel: measured on an H100 in two calls (2026-12-06,
      benchmarks/depthwise_candidates.py, rows / plane, us): 64x768x7 fp16
      forward 21.0 / 16.8 and 21.7 / 16.9, backward-input 20.2 / 16.9; bf16
      21.0 / 18.6, 20.4 / 18.6 (results/depthwise_layer_shapes_h100_2026-12-06.txt,
      results/depthwise_candidates_h100_2026-12-06.txt).  5x5 (64x1152x7
      fp16 17.6 / 17.7) and 3x3 stay.
    * Since the plane kernel's 7-row items (2026-12-06), 7x7 on 13- and
      14-wide rows in every type and float32 7x7 on 7-wide planes go to the
      plane kernel too.  Measured on an H200 (2026-12-06,
      benchmarks/depthwise_candidates.py, rows / plane, us, forward;
      backward-input alike): 64x445x13 fp16 39.4 / 31.4, bf16 38.5 / 34.3,
      float32 39.1 / 31.4; 64x160x13 fp16 17.5 / 13.6, bf16 17.2 / 15.0,
      float32 17.5 / 13.2; 64x384x14 bf16 37.9 / 33.3 (backward-input 37.9 /
      32.5), 64x768x14 bf16 68.7 / 56.2; 64x768x7 float32 18.8 / 18.1
      (backward-input 19.1 / 17.9).  Half-type 7x7 on 10-wide rows go with
      the half-type 3x3 and 5x5 there (64x753x10 fp16 42.1 / 37.4, bf16 41.3
      / 41.8); float32 stays (40.1 / 44.5), and so does 7x7 on 8-wide rows
      (64x1176x8 fp16 33.8 / 32.4, bf16 33.3 / 46.2, float32 53.2 / 62.0)
      (results/depthwise_7x7_widths_h200_2026-12-06.txt).
    * float32 on 8-wide rows at stride 1 went to the register row walk
      (2026-12-06; 3x3 and 5x5, and 7x7 on enough planes; the measurements
      at _depthwise_nchw_forward_regs.takes_narrow_float32): 64x1176x8 7x7
      53.2 / 35.9 us forward on an H200, rows / walk.
    """
    dst_width = g.width if backward else g.out_width
    dtype = numpy.dtype(dtype)
    itemsize = dtype.itemsize
    if dst_width == 10 and g.stride_h == 1 and itemsize == 2:  # (every filter of FILTER_SIZES)
        return False
    if dst_width <= 7 and g.stride_h == 1 and (g.filter_height, g.filter_width) == (7, 7):
        return False
    if _depthwise_nchw_forward_regs.yields_narrow_float32(g, dtype, backward, src_alignment, dst_alignment):
        return False
    return dst_width <= 10


def select(g, dtype, backward, index, src_alignment, dst_alignment):
    """``plan(...)`` when the ops take this kernel (per ``MODE``), else None.
    ``*_alignment``: the largest of 16, 8, 4, 2, 1 dividing the address."""
    if MODE == "never" or (MODE == "rule" and not preferred(g, dtype, backward, src_alignment, dst_alignment)):
        return None
    return plan(g, dtype, backward, index)


@functools.lru_cache(maxsize=512)
def plan(g, dtype, backward, index):
    """The Launch for this signature (arguments: src, weight, bias or the
    null pointer, dst), or None when the row kernel does not serve it."""
    dtype = numpy.dtype(dtype)
    size = (g.filter_height, g.filter_width)
    stride = g.stride_h
    if (
        size not in FILTER_SIZES
        or not _validate.plain_stride_one_or_two(g, backward)
        or dtype not in DTYPES
    ):
        return None
    src_h, src_w, dst_h, dst_w, offset_top, offset_left = _validate.correlation_frame(g, backward)
    w = width(dst_w, stride)
    if w is None or min(src_h, src_w, dst_h, dst_w) <= 0:
        return None
    num_rows = g.batch * g.channels * dst_h
    blocks = -(-num_rows // THREADS)
    if blocks >= 2**31:
        return None
    return _launch.Launch(
        KERNEL_FILE,
        _expression(dtype, size, stride, backward, w, index),
        (blocks,),
        (THREADS,),
        0,
        (
            i32(g.channels), i32(src_h), i32(src_w), i32(dst_h), i32(dst_w), i32(offset_top), i32(offset_left),
            _launch.index_scalar(index, num_rows),
        ),
    )
