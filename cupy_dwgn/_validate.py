"""Argument checks and normalization shared by every op.

Pure Python/NumPy (no CuPy import), so the NumPy references use the same
rules.  Every error names the argument, the expected and the actual value,
and is raised before any launch: TypeError for the kind or dtype of an
argument, ValueError for its shape, layout, device or value.
"""

import collections
import numbers

import numpy

from . import _dtypes
from ._launch import INT32_LIMIT


def _type_name(obj):
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}" if cls.__module__ != "builtins" else cls.__name__


def _kind_name(kind):
    return f"{kind.__module__.split('.')[0]}.{kind.__name__}"


def cupy_ndarray():
    import cupy

    return cupy.ndarray


def check_array(name, array, ndim=None, shape_doc="", kind=None):
    """A C-contiguous array of a supported dtype (and rank ``ndim``).

    kind: the array class expected (default cupy.ndarray; cupy_dwgn.host
    passes numpy.ndarray so NumPy inputs get the very same checks).
    """
    kind = cupy_ndarray() if kind is None else kind
    if not isinstance(array, kind):
        hint = ""
        expected = _kind_name(kind)
        if kind is not numpy.ndarray:
            expected += " or a CUDA array with __dlpack__ (torch tensor, JAX array)"
            if isinstance(array, numpy.ndarray):
                hint = " (for NumPy arrays use cupy_dwgn.host)"
            elif hasattr(array, "__dlpack_device__"):
                hint = f" on a non-CUDA device (DLPack device {array.__dlpack_device__()})"
        raise TypeError(f"{name}: expected a {expected}, got {_type_name(array)}{hint}")
    check_dtype(name, array.dtype)
    if ndim is not None and array.ndim != ndim:
        raise ValueError(
            f"{name}: expected a {ndim}-D array {shape_doc}, got shape {tuple(array.shape)}".replace(
                "  ", " "
            )
        )
    if not array.flags.c_contiguous:
        raise ValueError(
            f"{name}: expected a C-contiguous array, got strides {array.strides} for shape "
            f"{tuple(array.shape)}; pass {_kind_name(kind).split('.')[0]}.ascontiguousarray({name})"
        )
    return array


def check_dtype(name, dtype):
    if dtype not in _dtypes.CTYPES:
        raise TypeError(
            f"{name}: expected dtype {', '.join(_dtypes.SUPPORTED_NAMES)}, got {dtype}"
        )


def check_same_dtype(name, array, reference_name, reference):
    if array.dtype != reference.dtype:
        raise TypeError(
            f"{name}: expected dtype {reference.dtype} (the dtype of {reference_name}), "
            f"got {array.dtype}"
        )


def check_same_device(**arrays):
    """All non-None arrays on one CUDA device; returns that device (None for
    host arrays, which have no CUDA device)."""
    items = [(name, a) for name, a in arrays.items() if a is not None]
    if not hasattr(getattr(items[0][1], "device", None), "id"):  # NumPy (1.x has no .device)
        return None
    first_name, first = items[0]
    first_id = _device_id(first)
    for name, array in items[1:]:
        if _device_id(array) != first_id:
            raise ValueError(
                f"{name}: expected an array on device {first_id} (the device of "
                f"{first_name}), got device {_device_id(array)}"
            )
    return first.device


def _device_id(array):
    """The device of the array's memory (its MemoryPointer's), as the ops'
    signature caches and launches see it."""
    device_id = getattr(getattr(array, "data", None), "device_id", None)
    return array.device.id if device_id is None else device_id


def check_shape(name, array, expected, what=""):
    if tuple(array.shape) != tuple(expected):
        raise ValueError(
            f"{name}: expected shape {tuple(expected)}{what}, got {tuple(array.shape)}"
        )


def check_out(out, shape, dtype, kind=None, name="out"):
    """Check a caller-given output array (None passes)."""
    if out is None:
        return
    kind = cupy_ndarray() if kind is None else kind
    if not isinstance(out, kind):
        raise TypeError(f"{name}: expected a {_kind_name(kind)} or None, got {_type_name(out)}")
    check_shape(name, out, shape)
    if out.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {numpy.dtype(dtype)}, got {out.dtype}")
    if not out.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array, got strides {out.strides}")


def _byte_range(array):
    start = array.data.ptr if hasattr(array.data, "ptr") else array.__array_interface__["data"][0]
    return start, start + array.nbytes


def same_memory(a, b):
    """a and b are the very same bytes (e.g. ``out=x`` for an in-place op)."""
    return _byte_range(a) == _byte_range(b)


def check_no_overlap(out, name="out", /, **inputs):
    """``out`` must not share memory with an input the kernel still reads
    while writing it (an in-place call would read half-written values)."""
    if out is None or out.nbytes == 0:
        return
    out_start, out_end = _byte_range(out)
    for input_name, array in inputs.items():
        if array is None or array.nbytes == 0:
            continue
        start, end = _byte_range(array)
        if start < out_end and out_start < end:
            raise ValueError(
                f"{name}: expected memory separate from {input_name}, got an overlapping array "
                "(this op cannot run in place)"
            )


def empty_unless_given(out, shape, dtype):
    """``out`` (already checked) or a new cupy array, on the current device."""
    if out is not None:
        return out
    global _cupy_empty
    if _cupy_empty is None:
        import cupy

        _cupy_empty = cupy.empty
    return _cupy_empty(shape, dtype=dtype)


_cupy_empty = None


def _is_int(value):
    # Exact ints first: the common case, and far cheaper than the ABC check.
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def int_pair(name, value, minimum):
    """An int or a pair of ints, each >= minimum -> (a, b)."""
    # Fast paths: a plain int or a tuple of two plain ints, in range.
    if type(value) is int:
        if minimum <= value < INT32_LIMIT:
            return value, value
    elif type(value) is tuple and len(value) == 2:
        a, b = value
        if type(a) is int and type(b) is int and minimum <= a < INT32_LIMIT and minimum <= b < INT32_LIMIT:
            return a, b
    pair = (value, value) if _is_int(value) else value
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(map(_is_int, pair))):
        raise TypeError(f"{name}: expected an int or a pair of ints, got {value!r}")
    if min(pair) < minimum or max(pair) >= INT32_LIMIT:
        raise ValueError(f"{name}: expected values >= {minimum} and < 2**31, got {value!r}")
    return int(pair[0]), int(pair[1])


#: The layouts every depthwise op takes; weights are (C*M, 1, KH, KW) in both.
LAYOUTS = ("NCHW", "NHWC")


def check_layout(layout):
    """``layout`` if it is exactly "NCHW" or "NHWC", else ValueError."""
    if isinstance(layout, str) and (layout == "NCHW" or layout == "NHWC"):
        return layout
    raise ValueError(f"layout: expected 'NCHW' or 'NHWC', got {layout!r}")


def layout_shape(layout, batch, channels, height, width):
    """The 4-D shape of an activation in ``layout``'s axis order."""
    if layout == "NHWC":
        return (batch, height, width, channels)
    return (batch, channels, height, width)


def layout_doc(layout, channels_name="C", spatial_names=("H", "W")):
    """The shape of an activation in ``layout`` as error messages spell it:
    "(N, C, H, W)" / "(N, H, W, C)" (e.g. ``channels_name="C*M"``,
    ``spatial_names=("OH", "OW")`` for an output)."""
    height, width = spatial_names
    if layout == "NHWC":
        return f"(N, {height}, {width}, {channels_name})"
    return f"(N, {channels_name}, {height}, {width})"


ConvGeometry = collections.namedtuple(
    "ConvGeometry",
    "batch channels height width multiplier filter_height filter_width out_height out_width "
    "stride_h stride_w pad_top pad_bottom pad_left pad_right dilation_h dilation_w",
)
ConvGeometry.__doc__ = "Every size of one depthwise convolution, normalized."


def correlation_frame(g, backward):
    """``(src_h, src_w, dst_h, dst_w, offset_top, offset_left)`` of the
    correlation a stride-1 kernel computes for ``g``: the forward pass (x ->
    y, offsets = the padding), or the backward-input pass as the forward
    correlation of grad_out with the filter rotated by 180 degrees (grad_out
    -> grad_in, offsets = dilated filter - 1 - padding: negative when the
    padding exceeds the filter).  Destination value (y, x) reads source
    (y * stride - offset_top + kh * dilation, likewise x)."""
    if backward:
        return (g.out_height, g.out_width, g.height, g.width,
                (g.filter_height - 1) * g.dilation_h - g.pad_top, (g.filter_width - 1) * g.dilation_w - g.pad_left)
    return g.height, g.width, g.out_height, g.out_width, g.pad_top, g.pad_left


def plain_stride_one_or_two(g, backward):
    """Whether ``g`` is what the direct-style kernels serve: the same stride
    on both axes, 1 or 2 for the forward and 1 for the backward-input (their
    stride-1 correlation), dilation 1, depth multiplier 1."""
    return (g.stride_w == g.stride_h and g.stride_h in ((1,) if backward else (1, 2))
            and (g.dilation_h, g.dilation_w) == (1, 1) and g.multiplier == 1)


def _padding(padding, filter_size, dilation, stride):
    """int | (h, w) | ((top, bottom), (left, right)) | 'same' | 'valid' -> 4 ints."""
    # Fast paths: plain in-range ints as an int, (h, w) or ((top, bottom), (left, right)).
    if type(padding) is int:
        if 0 <= padding < INT32_LIMIT:
            return padding, padding, padding, padding
    elif type(padding) is tuple and len(padding) == 2:
        h, w = padding
        if type(h) is int and type(w) is int:
            if 0 <= h < INT32_LIMIT and 0 <= w < INT32_LIMIT:
                return h, h, w, w
        elif type(h) is tuple and type(w) is tuple and len(h) == 2 and len(w) == 2:
            sides = h + w
            if all(type(v) is int and 0 <= v < INT32_LIMIT for v in sides):
                return sides
    if isinstance(padding, str):
        if padding == "valid":
            return 0, 0, 0, 0
        if padding == "same":
            if stride != (1, 1):
                raise ValueError(
                    f"padding: 'same' needs stride 1, got stride {stride} "
                    "(the output size would not equal the input size)"
                )
            sides = []
            for k, d in zip(filter_size, dilation):
                total = d * (k - 1)  # the extra row/column goes after, as in PyTorch
                sides += [total // 2, total - total // 2]
            return tuple(sides)
        raise ValueError(f"padding: expected an int, a pair, 'same' or 'valid', got {padding!r}")
    if _is_int(padding):
        sides = (padding,) * 4
    elif isinstance(padding, (tuple, list)) and len(padding) == 2 and all(map(_is_int, padding)):
        sides = (padding[0], padding[0], padding[1], padding[1])
    elif (
        isinstance(padding, (tuple, list))
        and len(padding) == 2
        and all(isinstance(p, (tuple, list)) and len(p) == 2 for p in padding)
        and all(_is_int(v) for p in padding for v in p)
    ):
        sides = (padding[0][0], padding[0][1], padding[1][0], padding[1][1])
    else:
        raise TypeError(
            "padding: expected an int, (pad_h, pad_w), ((top, bottom), (left, right)), "
            f"'same' or 'valid', got {padding!r}"
        )
    if min(sides) < 0 or max(sides) >= INT32_LIMIT:
        raise ValueError(f"padding: expected values >= 0 and < 2**31, got {padding!r}")
    return tuple(int(v) for v in sides)


def conv_geometry(input_shape, weight_shape, stride, padding, dilation, input_name="x", layout="NCHW",
                  weight_name="weight"):
    """Normalize the arguments of a depthwise convolution.

    input_shape: (N, C, H, W) for layout "NCHW", (N, H, W, C) for "NHWC";
    weight_shape: (C*M, 1, KH, KW) in both.  The ConvGeometry is logical: the
    same for both layouts (``channels`` is C whatever its axis).  The names
    are the arguments the errors speak of (the backward-weight op's is
    ``weight_shape``).
    """
    if layout == "NCHW":
        batch, channels, height, width = input_shape
    elif layout == "NHWC":
        batch, height, width, channels = input_shape
    else:
        check_layout(layout)  # raises
    if channels == 0:
        raise ValueError(f"{input_name}: expected at least one channel (C >= 1), got {layout} {tuple(input_shape)}")
    out_channels, one, filter_height, filter_width = weight_shape
    if one != 1 or out_channels % channels != 0 or out_channels == 0:
        raise ValueError(
            f"{weight_name}: expected shape (C*M, 1, KH, KW) with C = {channels} (channels of "
            f"{input_name}, {layout} {tuple(input_shape)}) and depth multiplier M >= 1, got "
            f"{tuple(weight_shape)}"
        )
    if filter_height < 1 or filter_width < 1:
        raise ValueError(f"{weight_name}: expected a filter of at least 1x1, got {tuple(weight_shape)}")
    stride = int_pair("stride", stride, 1)
    dilation = int_pair("dilation", dilation, 1)
    pad_top, pad_bottom, pad_left, pad_right = _padding(
        padding, (filter_height, filter_width), dilation, stride
    )
    span_h = dilation[0] * (filter_height - 1) + 1
    span_w = dilation[1] * (filter_width - 1) + 1
    out_height = (height + pad_top + pad_bottom - span_h) // stride[0] + 1
    out_width = (width + pad_left + pad_right - span_w) // stride[1] + 1
    if out_height <= 0 or out_width <= 0:
        raise ValueError(
            f"{input_name}: the output size would be {out_height}x{out_width}: the padded input "
            f"({height + pad_top + pad_bottom}x{width + pad_left + pad_right}) must be at least "
            f"as large as the dilated filter ({span_h}x{span_w})"
        )
    return ConvGeometry(
        batch, channels, height, width, out_channels // channels, filter_height, filter_width,
        out_height, out_width, stride[0], stride[1], pad_top, pad_bottom, pad_left, pad_right,
        dilation[0], dilation[1],
    )


def check_int_shape(name, shape, ndim):
    if not (
        isinstance(shape, (tuple, list)) and len(shape) == ndim and all(map(_is_int, shape))
    ):
        raise TypeError(f"{name}: expected a tuple of {ndim} ints, got {shape!r}")
    if min(shape) < 0:
        raise ValueError(f"{name}: expected sizes >= 0, got {tuple(shape)}")
    return tuple(int(s) for s in shape)
