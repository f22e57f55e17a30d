"""Large-filter depthwise convolution, NCHW, stride 1: forward and backward-input.

Kernel: ``dwgn_dwconv2d_large`` in kernels/depthwise_nchw_large.cu (read its
header comment for the algorithm).  Selection rule for the caller:

* ``filter_height * filter_width >= MIN_TAPS`` (9x9 and larger; 1-D-ish
  filters such as 1x81 are served correctly but gain little),
* stride 1 and dilation 1 (anything else: ``forward`` / ``backward_input``
  return False and the caller keeps its direct kernel),
* a band of at least 2 destination rows, its source rows and the filter fit
  the device's opt-in shared memory per block, and a destination row has at
  most 4096 columns.

Any padding (per side, larger than the filter too), depth multiplier, bias,
dtype and 64-bit indexing are served.
"""

import functools

import numpy

from . import _compile, _dtypes, _launch
from ._launch import i32

KERNEL_FILE = "depthwise_nchw_large.cu"
_KERNEL = "dwgn_dwconv2d_large"

#: Filters with at least this many taps (9x9) take this path.
MIN_TAPS = 81

# Must match dwgn_large::kVW, kVH, kStep, kMaxThreads in the .cu file.
_VW = 8
_VH = 2
_STEP = 4
_MAX_THREADS = 512
# Threads per block the plan aims for (items of kVH x kVW outputs).
_TARGET_THREADS = 256


def specializations(dtypes=None, large_index=(False, True)):
    """``(file, name expression)`` of every kernel this path can launch."""
    dtypes = _dtypes.CTYPES if dtypes is None else dtypes
    large_index = (large_index,) if isinstance(large_index, bool) else tuple(large_index)
    specs = []
    for dtype in dtypes:
        for backward in (False, True):
            for large in large_index:
                specs.append((KERNEL_FILE, _expression(dtype, backward, "long long" if large else "int")))
    return specs


def _expression(dtype, backward, index):
    return _compile.name_expression(_KERNEL, _dtypes.ctype(dtype), "true" if backward else "false", index)


def served(g):
    """A large filter (>= MIN_TAPS taps) at stride 1 and dilation 1 (the shape
    limits are checked by the plan); smaller filters belong to the window
    kernel, which is faster there."""
    return (
        g.filter_height * g.filter_width >= MIN_TAPS
        and (g.stride_h, g.stride_w, g.dilation_h, g.dilation_w) == (1, 1, 1, 1)
    )


# A device's opt-in shared-memory limit per block (cached: plan() asks on every call).
_shared_limit = _launch.max_shared_per_block


_BANKS = 32


def _congruent(v, residue):
    """Smallest value >= v that is congruent to ``residue`` modulo the 32 banks."""
    return v + (residue - v) % _BANKS


def _grouped_pitches(row_pitch, groups, planes):
    """(group pitch, plane pitch) of rows stored in groups of kVH, for planes
    numbered fastest in the items: the plane pitch is c and the group pitch
    planes * c modulo 32 for an odd c (the one that wastes least), so that
    lane p + planes * g of a warp addresses p * c + g * planes * c = lane * c
    (mod 32): 32 different banks."""
    best = None
    for c in range(1, _BANKS, 2):
        group_pitch = _congruent(_VH * row_pitch, planes * c % _BANKS)
        plane_pitch = _congruent(groups * group_pitch, c)
        if best is None or plane_pitch < best[1]:
            best = (group_pitch, plane_pitch)
    return best


def _layout(src_size, dst_size, filter_size, offset, planes, row_groups, acc_bytes):
    """Shared-memory pitches (in Acc elements) and bytes for one block."""
    (src_h, src_w), (_, dst_w), (kh, kw) = src_size, dst_size, filter_size
    band_rows = row_groups * _VH
    strips = -(-dst_w // _VW)
    # Zero columns left of the image the kw loop can read: up to kVW - 1
    # outputs left of column 0 plus kStep - 1 for the aligned start.
    halo_left = min(max(offset[1], 0), _VW + _STEP - 2)
    src_pitch = halo_left + src_w + _VW - 1
    rows = min(src_h, band_rows - 1 + kh)
    src_group_pitch, src_plane_pitch = _grouped_pitches(src_pitch, -(-rows // _VH), planes)
    filter_pitch = -(-kw // _STEP) * _STEP
    if (filter_pitch // _STEP) % 2 == 0:
        filter_pitch += _STEP  # 16-byte rows an odd number apart: two rows in one wavefront
    out_row_pitch = strips * _VW
    out_group_pitch, out_plane_pitch = _grouped_pitches(out_row_pitch, row_groups, planes)
    elements = (kh + 2 * (_VH - 1)) * filter_pitch + planes * max(src_plane_pitch, out_plane_pitch)
    return {
        "halo_left": halo_left,
        "src_pitch": src_pitch,
        "src_group_pitch": src_group_pitch,
        "src_plane_pitch": src_plane_pitch,
        "filter_pitch": filter_pitch,
        "out_row_pitch": out_row_pitch,
        "out_group_pitch": out_group_pitch,
        "out_plane_pitch": out_plane_pitch,
        "bytes": elements * acc_bytes,
    }


@functools.lru_cache(maxsize=1024)
def _plan(g, dtype_name, backward, shared_limit):
    """The Launch for one signature, or None when this path does not serve it."""
    if not served(g):
        return None
    dtype = numpy.dtype(dtype_name) if dtype_name != "bfloat16" else _dtypes.bfloat16
    acc_bytes = _dtypes.accumulator_dtype(dtype).itemsize
    if backward:
        src_size, dst_size = (g.out_height, g.out_width), (g.height, g.width)
        # The rotated filter's correlation: offset = filter size - 1 - padding (may be < 0).
        offset = (g.filter_height - 1 - g.pad_top, g.filter_width - 1 - g.pad_left)
        filters = g.channels
    else:
        src_size, dst_size = (g.height, g.width), (g.out_height, g.out_width)
        offset = (g.pad_top, g.pad_left)
        filters = g.channels * g.multiplier
    dst_h, dst_w = dst_size
    strips = -(-dst_w // _VW)
    all_row_groups = -(-dst_h // _VH)
    if strips > _MAX_THREADS:
        return None
    plane_items = strips * all_row_groups
    if plane_items >= _TARGET_THREADS:
        # Large plane: one plane per block, a band of rows.
        planes = 1
        row_groups = max(1, min(all_row_groups, _TARGET_THREADS // strips))
    else:
        # Small plane: whole planes, several batch items sharing the filter.
        planes = max(1, min(g.batch, _TARGET_THREADS // plane_items))
        row_groups = all_row_groups
    filter_size = (g.filter_height, g.filter_width)
    while True:
        layout = _layout(src_size, dst_size, filter_size, offset, planes, row_groups, acc_bytes)
        if layout["bytes"] <= shared_limit:
            break
        if planes > 1:
            planes = -(-planes // 2)
        elif row_groups > 1:
            row_groups = -(-row_groups // 2)
        else:
            return None
    bands = -(-all_row_groups // row_groups)
    if bands > _launch.MAX_GRID_Y:
        return None
    batch_groups = -(-g.batch // planes)
    threads = -(-(planes * row_groups * strips) // 32) * 32
    x_size = g.batch * g.channels * g.height * g.width
    y_size = g.batch * g.channels * g.multiplier * g.out_height * g.out_width
    index = _launch.index_type(x_size, y_size)
    scalars = (
        i32(g.batch), i32(g.channels), i32(g.multiplier), i32(src_size[0]), i32(src_size[1]),
        i32(dst_h), i32(dst_w), i32(g.filter_height), i32(g.filter_width),
        i32(offset[0]), i32(offset[1]), i32(planes), i32(row_groups * _VH), i32(batch_groups),
        i32(layout["halo_left"]), i32(layout["src_pitch"]), i32(layout["src_group_pitch"]),
        i32(layout["src_plane_pitch"]), i32(layout["filter_pitch"]), i32(layout["out_row_pitch"]),
        i32(layout["out_group_pitch"]), i32(layout["out_plane_pitch"]),
    )
    return _launch.Launch(
        KERNEL_FILE, _expression(dtype, backward, index),
        (filters * batch_groups, bands), (threads,), layout["bytes"], scalars,
    )


def _dtype_name(dtype):
    dtype = numpy.dtype(dtype)
    return "bfloat16" if dtype == _dtypes.bfloat16 else dtype.name


def plan(g, dtype, backward):
    """The Launch this path would use for ``g`` on the current device (the
    forward kernel's arguments: src, weight, bias or NULL, dst), or None
    when it does not serve ``g``."""
    if not served(g):
        return None
    from cupy.cuda import runtime

    return _plan(g, _dtype_name(dtype), backward, _shared_limit(runtime.getDevice()))
