"""NCHW forward (stride 1 or 2) and stride-1 backward-input with the filter
in registers and no shared-memory staging (kernels/depthwise_nchw_forward_regs.cu,
the "register row walk"): square 3x3, 5x5 and 7x7 filters, dilation 1,
depth multiplier 1, any padding, float32, float16 and bfloat16.  The ops take
it where ``preferred`` says so; ``MODE`` overrides that for tests and
benchmarks.

Launch rule (no user tuning), from the shape only:

* VW destination columns per thread: the widest power of two with VW *
  itemsize <= 16 bytes and VW <= MAX_VECTOR[(K, itemsize)] (registers) such
  that VW divides the destination width, and XV = min(VW * stride, 16 bytes
  of elements), the source vector, divides the source width and pad_left -
  K // 2 (of the correlation: the backward-input's is K - 1 - pad_left),
  and both arrays' byte alignments allow them (56-wide fp16 3x3: VW 8; a
  stride-2 112 -> 56 float32 row: VW 4, two 16-byte source vectors).
* Lane groups: ceil(OW / VW) lanes per destination row, cut into segments
  of at most 32 lanes (as the register weight gradient); a warp holds
  32 // G groups.  Row strips of at most MAX_STRIP_ROWS[(K, itemsize,
  stride)] destination rows (balanced), halved (down to MIN_STRIP_ROWS)
  while the grid would hold fewer than _launch.LONG_STRIP_MIN_THREADS
  threads.  Units: (plane, row strip, segment), one per worker (warp,
  group): a grid of ceil(units / workers) blocks of THREADS.
"""

import functools

import numpy

from . import _compile, _dtypes, _launch, _validate
from ._launch import i32

#: "rule": the ops take this kernel where ``preferred`` says it wins;
#: "always": wherever it serves the call (tests, the sanitizer workload,
#: benchmarks); "never": not at all.
MODE = "rule"

KERNEL_FILE = "depthwise_nchw_forward_regs.cu"
KERNEL = "dwgn_nchw_forward_regs"
FILTER_SIZES = ((3, 3), (5, 5), (7, 7))
DTYPES = (numpy.dtype(numpy.float32), numpy.dtype(numpy.float16), _dtypes.bfloat16)
#: (stride, backward) compiled.
VARIANTS = ((1, False), (2, False), (1, True))

THREADS = 128  # kernel: kThreads
VECTOR_BYTES = 16
#: (K, element size) -> the widest VW compiled (2-byte 5x5 at VW 8 spilled
#: at its 128 registers).
MAX_VECTOR = {(3, 2): 8, (3, 4): 4, (5, 2): 4, (5, 4): 4, (7, 2): 4, (7, 4): 4}
#: (K, element size, stride) -> destination rows per strip at most.  H200,
#: 2026-12-03, strips of 4 / 7 / 14 rows: float32 64x96x112 3x3 stride 2
#: 101.0 / 94.7 / 98.1 us, 64x144x56 42.5 / 40.2 / 41.2; float16 59.6 /
#: 57.2 / 56.6 and 30.8 / 29.0 / 28.1; 5x5 stride 2 64x240x56 float16 78.5 /
#: 72.1 / 66.0, float32 99.6 / 97.4 / 93.6 (a strip re-reads K - S source
#: rows); stride 1 fp16 64x144x56 3x3 (16 / 28 rows) 44.2 / 44.4.
MAX_STRIP_ROWS = {(3, 4, 2): 7, (3, 2, 2): 14, (5, 4, 2): 14, (5, 2, 2): 14, (7, 4, 2): 14, (7, 2, 2): 14,
                  (3, 4, 1): 16, (3, 2, 1): 16, (5, 4, 1): 16, (5, 2, 1): 16, (7, 4, 1): 28, (7, 2, 1): 28}
MIN_STRIP_ROWS = 4
#: The narrowest destination of a float32 3x3 stride-2 forward the ops take
#: the walk for with 8-byte source vectors (``preferred``).
_MIN_WIDTH_8_BYTE_SOURCE = 24
#: The widest destination of a half-type 3x3 stride-2 forward the ops take
#: the walk for with 8-byte source vectors (``preferred``).
_MAX_WIDTH_8_BYTE_HALF = 14
#: float32 7x7 on 8-wide rows at stride 1: the walk from this many planes
#: (N * C) on (``takes_narrow_float32``).
_MIN_PLANES_NARROW_7X7 = 24576


def takes_narrow_float32(g, dtype, backward, vw):
    """Whether the ops take the walk at ``vw`` for a float32 stride-1 forward
    or backward-input onto 8-wide rows (the row kernel yields these to it,
    ``yields_narrow_float32``): at VW 4 (16-byte aligned tensors), 3x3 and
    5x5 always, 7x7 from _MIN_PLANES_NARROW_7X7 planes.  Measured on an
    H100 (2026-12-06, benchmarks/depthwise_candidates.py, rows / walk, us,
    forward; backward-input alike but where named;
    results/depthwise_fp32_narrow_h100_2026-12-06.txt): 7x7 64x1176x8 53.4
    / 36.3 (backward-input 53.0 / 40.4; an H200's forward 53.2 / 35.9),
    128x512x8 47.6 / 35.8, 48x1176x8 41.9 / 33.8, 40x1024x8 31.4 / 25.0,
    32x1176x8 28.5 / 23.8, 64x512x8 26.0 / 23.4 (backward-input 25.4 /
    25.4), 24x1024x8 24.6 / 19.7; but on fewer planes the walk's lane pair
    per plane leaves the GPU short of threads, each walking 8 rows of 49
    taps: 16x1176x8 17.4 / 17.8, 32x512x8 14.4 / 18.3.  5x5 64x1176x8 38.7
    / 28.1, 32x1176x8 22.8 / 18.4, 64x512x8 20.9 / 13.2, 16x1176x8 13.3 /
    12.6, 32x512x8 11.4 / 8.1; 3x3 64x1176x8 27.7 / 21.4, 32x512x8 8.6 /
    6.2.  Not at narrower VW (views 4 bytes into their buffers: VW 1, 8
    lanes a plane; the ops' eager time, CUDA events, rows / walk, us):
    64x1176x8 7x7 59.8 / 77.0, 24x1024x8 26.4 / 30.6, 64x512x8 5x5 25.1 /
    26.7, 32x512x8 3x3 14.8 / 15.9 (aligned: 59.0 / 42.3, 29.1 / 25.5,
    25.3 / 18.0, 15.2 / 12.7)."""
    dst_width = g.width if backward else g.out_width
    return (
        numpy.dtype(dtype) == numpy.float32 and g.stride_h == 1 and dst_width == 8 and vw == 4
        and (g.filter_height, g.filter_width) in FILTER_SIZES
        and (g.filter_height < 7 or g.batch * g.channels >= _MIN_PLANES_NARROW_7X7)
    )


def yields_narrow_float32(g, dtype, backward, src_alignment, dst_alignment):
    """Whether the row kernel leaves this call to the walk
    (``takes_narrow_float32`` at the VW the walk would launch)."""
    if numpy.dtype(dtype) != numpy.float32 or g.stride_h != 1:
        return False
    launch = plan(g, dtype, backward, src_alignment, dst_alignment)
    return launch is not None and takes_narrow_float32(g, dtype, backward, launch_vector_width(launch))


def vector_widths(k, itemsize):
    """Every VW compiled for this filter size and element size."""
    top = min(MAX_VECTOR[(k, itemsize)], VECTOR_BYTES // itemsize)
    return tuple(1 << i for i in range(top.bit_length()))


def _expression(dtype, k, stride, vw, backward):
    return _compile.name_expression(KERNEL, _dtypes.ctype(dtype), k, stride, vw, "true" if backward else "false")


def specializations(dtypes=None, filter_sizes=None, backward=None, large_index=(False, True)):
    """``(file, name expression)`` of every specialization.  backward: None
    (both), False (forward) or True (backward-input).  large_index is
    accepted for symmetry: plane offsets are 64-bit in this kernel."""
    del large_index
    dtypes = DTYPES if dtypes is None else [numpy.dtype(d) for d in dtypes if numpy.dtype(d) in DTYPES]
    sizes = FILTER_SIZES if filter_sizes is None else [tuple(s) for s in filter_sizes if tuple(s) in FILTER_SIZES]
    return [
        (KERNEL_FILE, _expression(dtype, size[0], stride, vw, is_backward))
        for dtype in dtypes for size in dict.fromkeys(sizes)
        for stride, is_backward in VARIANTS if backward is None or is_backward == backward
        for vw in vector_widths(size[0], dtype.itemsize)
    ]


def vector_width(k, stride, itemsize, src_w, dst_w, offset_left, src_alignment, dst_alignment):
    """VW: the widest compiled width whose destination vector divides the
    destination width and alignment and whose source vector XV divides the
    source width, offset_left - K // 2 and the source alignment (in
    elements); None when not even VW = 1 fits (stride 2 on odd widths)."""
    for vw in reversed(vector_widths(k, itemsize)):
        xv = source_vector(vw, stride, itemsize)
        if (
            dst_w % vw == 0 and src_w % xv == 0 and (offset_left - k // 2) % xv == 0
            and src_alignment % (xv * itemsize) == 0 and dst_alignment % (vw * itemsize) == 0
        ):
            return vw
    return None


def source_vector(vw, stride, itemsize):
    """XV, the source columns one load reads (kernel: XV): VW * stride, at
    most 16 bytes of them."""
    return min(vw * stride, VECTOR_BYTES // itemsize)


def preferred(g, dtype, backward, vw):
    """Whether the ops take this kernel for ``g`` (where it serves the call
    at ``vw``): the stride-2 forward of 3x3 and 5x5 filters with 16-byte
    source vectors, the stride-1 2-byte 3x3 forward and backward-input
    with 16-byte rows of 8 (56-wide planes), and float32 onto 16-byte rows
    of 8 at stride 1 (``takes_narrow_float32``).  Measured on an H200
    (2026-12-03, us, this kernel against the kernels the ops took before:
    the shared-memory window and whole-plane kernels): stride 2 float32
    64x96x112 94.7 / 109.6, 64x144x56 40.2 / 55.3, 64x240x56 5x5 93.6 /
    106.7; float16 56.6 / 64.5, 26.5 / 35.8, 66.0 / 84.5 (bfloat16 alike);
    stride 1 fp16 64x144x56 forward 44.2 / 46.3, backward-input 43.8 /
    51.8.  Not taken: the stride-1 float32 3x3 (64x144x56 71.6 / 69.1,
    64x384x28 53.1 / 52.5), 2-byte rows of 4 (64x384x28 fp16 38.0 / 35.5),
    5x5 (64x240x28 fp16 41.0 / 37.3, float32 50.9 / 43.5) and 7x7 (64x96x56
    fp16 99.9 / 74.7, 64x384x14 float32 46.7 / 36.8) at stride 1: their
    shared-memory kernels reuse each staged row across more taps than the
    walk's registers hold.

    Also the float32 3x3 stride-2 forward with 8-byte source vectors (even
    source widths whose destinations are not a multiple of 2 wide), on
    destinations at least _MIN_WIDTH_8_BYTE_SOURCE wide (2026-12-04, us,
    walk / the best other kernel): 64x144x150 359.7 / 443.2 (window),
    64x192x50 60.8 / 80.6 (plane), 64x128x62 55.0 / 63.2 (window); about even
    on narrower ones (64x288x38 64.7 / 64.4, 64x192x30 24.4 / 23.8).  Not
    half types at those vectors on wide planes (64x144x150 fp16 295.3 /
    273.8, 64x192x50 49.5 / 44.4), nor 5x5 (64x144x150 float32 694.4 /
    522.5).  But half types on destinations of 11 to _MAX_WIDTH_8_BYTE_HALF
    (28-wide sources; narrower ones are the row kernel's), where the plane
    kernel took them: measured on an H100 in two calls (2026-12-06,
    benchmarks/depthwise_candidates.py, walk / plane, us) 64x192x28 fp16
    14.9 / 19.0 and 15.4 / 19.0, bf16 14.8 / 22.3; 64x240x28 fp16 22.3 /
    22.3 and 22.0 / 21.9, bf16 22.1 / 25.5."""
    itemsize = numpy.dtype(dtype).itemsize
    k = g.filter_height
    if g.stride_h == 2:
        if backward or k not in (3, 5):
            return False
        source_bytes = source_vector(vw, 2, itemsize) * itemsize
        if source_bytes == 8 and k == 3:
            return g.out_width >= _MIN_WIDTH_8_BYTE_SOURCE if itemsize == 4 else (
                itemsize == 2 and g.out_width <= _MAX_WIDTH_8_BYTE_HALF)
        return source_bytes == VECTOR_BYTES
    return (k == 3 and itemsize == 2 and vw == 8) or takes_narrow_float32(g, dtype, backward, vw)


def select(g, dtype, backward, src_alignment, dst_alignment):
    """``plan(...)`` when the ops take this kernel (per ``MODE``), else None."""
    if MODE == "never":
        return None
    launch = plan(g, dtype, backward, src_alignment, dst_alignment)
    if launch is None or MODE == "always" or preferred(g, dtype, backward, launch_vector_width(launch)):
        return launch
    return None


def launch_vector_width(launch):
    """The VW of a launch of this kernel (its last template argument but one)."""
    return int(launch.expression.rsplit(",", 2)[1])


@functools.lru_cache(maxsize=1024)
def plan(g, dtype, backward, src_alignment, dst_alignment):
    """The Launch for this signature (arguments: src, weight, bias or the
    null pointer, dst), or None when this kernel does not serve it.
    ``*_alignment``: the largest of 16, 8, 4, 2, 1 dividing the address."""
    dtype = numpy.dtype(dtype)
    size = (g.filter_height, g.filter_width)
    stride = g.stride_h
    if size not in FILTER_SIZES or not _validate.plain_stride_one_or_two(g, backward) or dtype not in DTYPES:
        return None
    src_h, src_w, dst_h, dst_w, offset_top, offset_left = _validate.correlation_frame(g, backward)
    if min(g.batch, g.channels, src_h, src_w, dst_h, dst_w) <= 0:
        return None
    if (
        src_h * src_w >= _launch.PLANE_LIMIT or dst_h * dst_w >= _launch.PLANE_LIMIT
        or src_h + abs(offset_top) + size[0] >= _launch.PLANE_LIMIT
        or src_w + abs(offset_left) + size[0] >= _launch.PLANE_LIMIT
    ):
        return None
    k = size[0]
    vw = vector_width(k, stride, dtype.itemsize, src_w, dst_w, offset_left, src_alignment, dst_alignment)
    if vw is None:
        return None
    lanes = -(-dst_w // vw)
    segments = -(-lanes // 32)
    group_lanes = -(-lanes // segments)
    groups_per_warp = 32 // group_lanes
    workers = THREADS // 32 * groups_per_warp
    planes = g.batch * g.channels
    row_strip, row_strips = _launch.row_strips(dst_h, MAX_STRIP_ROWS[(k, dtype.itemsize, stride)])
    # Shorter strips where the long ones leave the grid small (as the
    # register weight gradients; one unit per worker here).
    while row_strip > MIN_STRIP_ROWS and planes * row_strips * segments * group_lanes < _launch.LONG_STRIP_MIN_THREADS:
        row_strip, row_strips = _launch.row_strips(dst_h, max(MIN_STRIP_ROWS, row_strip // 2))
    units = planes * row_strips * segments
    blocks = -(-units // workers)
    if blocks >= 2**31:
        return None
    return _launch.Launch(
        KERNEL_FILE, _expression(dtype, k, stride, vw, backward), (blocks,), (THREADS,), 0,
        (i32(src_h), i32(src_w), i32(g.channels), i32(dst_h), i32(dst_w), i32(offset_top), i32(offset_left),
         i32(row_strip), i32(row_strips), i32(segments), i32(group_lanes), numpy.int64(units)),
    )
