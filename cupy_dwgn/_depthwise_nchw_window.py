"""NCHW register sliding-window kernel (kernels/depthwise_nchw_window.cu):
forward at stride 1 or 2 and backward-input at stride 1, for 3x3, 5x5 and 7x7
filters at dilation 1.

Launch rule (no user tuning), from the destination plane size:

* A thread owns VW = 16 bytes of destination columns x RH rows
  (float32 4x4, float16/bfloat16 8x4, float64 2x4, 2x2 for 7x7).
* Outputs are stored straight from registers as 16-byte vectors when the
  destination width is a multiple of VW (and dst 16-byte aligned); otherwise
  each unit's outputs (a contiguous range of dst) go through shared memory
  and leave as aligned 16-byte vectors.
* A plane of at most 256 such items is one band: a block takes as many whole
  planes as fit 256 threads and a 40 KB staging budget (e.g. 64x960x7x7:
  4 items per plane, 64 planes per block), so small planes still fill a block.
* A block is persistent: it walks units grid-size apart, copying the next
  unit's rows into a second shared buffer with cp.async while computing the
  current one; the grid is the number of blocks resident on the device
  (Launch.persistent: the occupancy calculator, which counts registers per
  SM partition; a count of the whole SM's registers had 224-thread blocks
  at 95-96 registers, the 3x3 backward-input, at 3 per SM where 2 fit, so a
  third of the grid ran as a second wave).
* Whole planes per unit staged row by row (16-, 8- or 4-byte cp.async) from
  source planes in arithmetic sequence (forward at multiplier 1, backward):
  each thread's copies of a unit (at most MAX_FIXED_COPIES) sit at the same
  offsets in every unit, so it works them out once ("fixed copies"), and the
  padding rows are zeroed once.
* Small planes (rows under 64 bytes or not 16-byte copyable, whole planes
  per unit, multiplier 1) are staged flat: the unit's planes are one
  contiguous range, copied as 16-byte cp.async vectors into a raw buffer and
  expanded in shared memory into the padded layout (3 barriers per step).
  So are the bands of planes whose rows are not 4-byte aligned (odd widths
  of 2-byte types, FLAT_BANDS_BELOW): a band's image rows are one range.
* A larger plane is cut into bands of 256 // strips item rows (one plane per
  block); planes wider than 1024 float32 (256 strips) are left to the tiled or
  direct kernel (plan returns None), as are shapes whose staged band would
  not fit 48 KB of shared memory (per buffer).
"""

import functools

import numpy

from . import _compile, _dtypes, _launch, _validate
from ._launch import i32

KERNEL_FILE = "depthwise_nchw_window.cu"
KERNEL = "dwgn_dwconv2d_window"
FILTER_SIZES = ((3, 3), (5, 5), (7, 7))
# (stride, backward) variants compiled per filter size and dtype.
VARIANTS = ((1, False), (2, False), (1, True))

_MAX_THREADS = 256
_MAX_STRIPS = 256
#: Copies per thread and unit up to which their offsets are worked out once
#: (kernel: dwgn_window::kMaxFixedCopies).
MAX_FIXED_COPIES = 4
# Staging budget per buffer (a block has two): 2 x 32 KB leaves room for 3
# blocks per SM (228 KB), as many as the registers allow for most variants.
_SHARED_BUDGET = 32 * 1024
_SHARED_LIMIT = 48 * 1024
#: Banded planes are staged flat where row staging would copy rows narrower
#: than this many bytes: 4, the element-wise copies of odd widths of 2-byte
#: types (H200, 64x192x75x75 float16 3x3 forward: 376.7 us row by row).
FLAT_BANDS_BELOW = 4


def _expression(dtype, size, stride, backward, index):
    return _compile.name_expression(
        KERNEL, _dtypes.ctype(dtype), size[0], size[1], stride, "true" if backward else "false", index
    )


def specializations(dtypes=None, filter_sizes=None, backward=None, large_index=(False, True)):
    """``(file, name expression)`` of every window-kernel specialization.

    backward: None (both), False (forward variants) or True (backward-input)."""
    dtypes = _dtypes.CTYPES if dtypes is None else dtypes
    sizes = FILTER_SIZES if filter_sizes is None else [tuple(s) for s in filter_sizes if tuple(s) in FILTER_SIZES]
    specs = []
    for dtype in dtypes:
        for size in sizes:
            for stride, is_backward in VARIANTS:
                if backward is not None and is_backward != backward:
                    continue
                for large in large_index:
                    index = "long long" if large else "int"
                    specs.append((KERNEL_FILE, _expression(dtype, size, stride, is_backward, index)))
    return specs


def _lead(vec, filter_width):
    """Column of a strip's first source value past its 16-byte aligned read
    base (kernel: kLead): where it falls for "same" padding."""
    return -(filter_width // 2) % vec


def _tile(itemsize, filter_height):
    columns = 16 // itemsize
    rows = 2 if (itemsize == 8 and filter_height > 5) or (itemsize == 2 and filter_height == 3) else 4
    return columns, rows


@functools.lru_cache(maxsize=512)
def plan(g, dtype, backward, index, src_alignment, dst_aligned):
    """The Launch for this signature, or None when the window kernel does not
    serve it.  ``src_alignment``: the largest of 16, 8, 4, 2, 1 dividing the
    source's address; ``dst_aligned``: the destination starts 16-byte aligned.
    The grid is persistent (Launch.persistent): at most the blocks resident
    at once on the device it runs on, from the CUDA occupancy calculator."""
    size = (g.filter_height, g.filter_width)
    stride = g.stride_h
    if (
        size not in FILTER_SIZES
        or (g.dilation_h, g.dilation_w) != (1, 1)
        or g.stride_w != stride
        or stride not in (1, 2)
        or (backward and stride != 1)
    ):
        return None
    itemsize = numpy.dtype(dtype).itemsize
    vec = 16 // itemsize
    columns, rows = _tile(itemsize, g.filter_height)
    src_h, src_w, dst_h, dst_w, offset_top, offset_left = _validate.correlation_frame(g, backward)
    planes = g.batch * g.channels * (1 if backward else g.multiplier)
    strips = -(-dst_w // columns)
    groups = -(-dst_h // rows)
    if strips > _MAX_STRIPS:
        return None
    if strips * groups <= _MAX_THREADS:
        band_groups, bands = groups, 1
        planes_per_unit = min(planes, _MAX_THREADS // (strips * groups))
    else:
        band_groups = _MAX_THREADS // strips
        bands = -(-groups // band_groups)
        planes_per_unit = 1
    # Strip s reads image columns from s * columns * stride - offset_left on;
    # the kernel reads them as row_vectors aligned vectors starting at shared
    # column read_base + s * columns * stride (a multiple of vec) with the
    # first value `lead` columns in, so image column 0 sits at
    # left_halo = read_base + lead + offset_left (read_base keeps it >= 0).
    lead = _lead(vec, g.filter_width)
    span = (columns - 1) * stride + g.filter_width
    row_vectors = -(-(lead + span) // vec)
    read_base = max(0, -(-(-(lead + offset_left)) // vec) * vec)
    left_halo = read_base + lead + offset_left
    end_column = read_base + (strips - 1) * columns * stride + row_vectors * vec
    staged_width = -(-max(end_column, left_halo + src_w) // vec) * vec

    def staged_rows(band):
        return (band * rows - 1) * stride + g.filter_height

    plane_bytes = staged_rows(band_groups) * staged_width * itemsize
    if bands == 1:
        planes_per_unit = max(1, min(planes_per_unit, _SHARED_BUDGET // plane_bytes))
    while plane_bytes > _SHARED_LIMIT and band_groups > 1:
        band_groups = max(1, band_groups // 2)
        bands = -(-groups // band_groups)
        plane_bytes = staged_rows(band_groups) * staged_width * itemsize
    if plane_bytes > _SHARED_LIMIT:
        return None
    items = planes_per_unit * band_groups * strips
    threads = min(_MAX_THREADS, -(-items // 32) * 32)
    units = -(-planes // planes_per_unit) * bands
    # Staging access width (cp.async of 16/8/4 bytes): the widest that every
    # source row start (row pitch and base pointer) and its shared column
    # (left_halo) are aligned to, else one element (2-byte types only).
    stage_bytes = next(
        (
            b for b in (16, 8, 4)
            if b >= itemsize and (src_w * itemsize) % b == 0 and src_alignment % b == 0
            and (left_halo * itemsize) % b == 0
        ),
        itemsize,
    )
    # Whole aligned 16-byte strips are stored straight from registers; other
    # widths go through shared memory as one flat range of dst per unit
    # (shifted by < vec elements to match dst's 16-byte boundaries), which
    # must fit one staging buffer: the extra staged rows guarantee it.
    direct_stores = int(dst_w % columns == 0 and dst_aligned)
    unit_rows = dst_h if bands == 1 else band_groups * rows
    assert vec - 1 + planes_per_unit * unit_rows * dst_w <= planes_per_unit * staged_rows(band_groups) * staged_width
    # Flat staging: a unit of whole planes with one source plane each is one
    # contiguous range of src, copied as 16-byte vectors into a raw buffer
    # and expanded in shared memory into the padded layout.  Taken where row
    # staging is narrow (rows under 64 bytes, or not 16-byte copyable): small
    # planes such as 7x7, 14x14 float32 and 28x28 half types.  Shared memory:
    # one padded buffer and two raw buffers, each holding the range (or the
    # unit's outputs) shifted by < vec elements.
    # Bands (one plane per unit, bands > 1) take it where their rows would be
    # copied narrower than FLAT_BANDS_BELOW bytes: a band's image rows are
    # one contiguous range too, and its padding rows are re-zeroed by the
    # expansion.
    if bands == 1:
        flat = g.multiplier == 1 and (src_w * itemsize < 64 or stage_bytes < 16)
        range_elems = planes_per_unit * max(src_h * src_w, dst_h * dst_w)
    else:
        flat = g.multiplier == 1 and stage_bytes < FLAT_BANDS_BELOW
        range_elems = max(staged_rows(band_groups) * src_w, band_groups * rows * dst_w)
    flat_elems = -(-(vec - 1 + range_elems) // vec) * vec
    shared_mem = planes_per_unit * plane_bytes + 2 * flat_elems * itemsize
    # At most 2 x 48 KB like row staging (Launch.kernel raises the kernel's
    # dynamic shared memory limit) and, for whole planes, at most 1.25 x row
    # staging's two buffers (raw planes are smaller than padded ones; 28x28
    # half types need 1.05 x, where registers, not shared memory, bound the
    # blocks per SM).  Bands are at most 48 KB a buffer: below that bound.
    row_shared = 2 * planes_per_unit * plane_bytes
    limit = 2 * _SHARED_LIMIT if bands > 1 else min(2 * _SHARED_LIMIT, row_shared * 5 // 4)
    if not (flat and shared_mem <= limit):
        flat_elems = 0
        # Two staging buffers (the unit being computed and the next one).
        shared_mem = 2 * planes_per_unit * plane_bytes
    # Fixed copies (kernel: dwgn_window::FixedCopies): whole planes per unit
    # staged row by row with cp.async, whose source planes are an arithmetic
    # sequence (the forward at multiplier 1, the backward's M sources), with
    # at most MAX_FIXED_COPIES copies per thread and the unit's source planes
    # inside int offsets: each thread works its copies out once, not per step.
    planes_stride = g.multiplier if backward else 1
    copies = 0
    # (Not for 2-byte 7x7 backward, kItemPerStep, whose registers are full, nor
    # the float32 stride-2 forward: kernel kNoFixedCopies.)
    no_fixed_copies = (itemsize == 2 and g.filter_height == 7 and backward) or (itemsize == 4 and stride == 2)
    if bands == 1 and not flat_elems and stage_bytes >= 4 and (backward or g.multiplier == 1) and not no_fixed_copies:
        copies = -(-(planes_per_unit * staged_rows(band_groups) * (src_w * itemsize // stage_bytes)) // threads)
        if copies > MAX_FIXED_COPIES or planes_per_unit * planes_stride * src_h * src_w >= 2**31:
            copies = 0
    return _launch.Launch(
        KERNEL_FILE,
        _expression(dtype, size, stride, backward, index),
        (units,),
        (threads,),
        shared_mem,
        (
            i32(g.channels), i32(g.multiplier), i32(planes), i32(src_h), i32(src_w), i32(dst_h),
            i32(dst_w), i32(offset_top), i32(read_base), i32(planes_per_unit), i32(band_groups),
            i32(bands), i32(staged_rows(band_groups)), i32(staged_width), i32(left_halo), i32(stage_bytes),
            i32(direct_stores), i32(flat_elems), i32(copies),
        ),
        persistent=True,
    )
