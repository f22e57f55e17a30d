"""Bad input raises TypeError/ValueError naming the argument, the expected and
the actual value, before any launch.  The NumPy host wrappers run the very
same checks, so these run on the CPU; the CuPy-only messages run on the GPU."""

import re

import numpy
import pytest

import cupy_dwgn.host as host
from cupy_dwgn import _validate, depthwise, reference

X = numpy.zeros((2, 3, 8, 8), numpy.float32)
W = numpy.zeros((3, 1, 3, 3), numpy.float32)
DY = numpy.zeros((2, 3, 8, 8), numpy.float32)


def forward(**changes):
    args = dict(x=X, weight=W, padding=1)
    args.update(changes)
    x, weight = args.pop("x"), args.pop("weight")
    return host.depthwise_conv2d(x, weight, **args)


FORWARD_ERRORS = [
    # (label, changes, exception, message pattern)
    ("x not an array", dict(x=[[1.0]]), TypeError, r"x: expected a numpy.ndarray, got list"),
    ("x integer dtype", dict(x=X.astype(numpy.int32)), TypeError, r"x: expected dtype float16, float32, float64, bfloat16, got int32"),
    ("x wrong rank", dict(x=X[0]), ValueError, r"x: expected a 4-D array \(N, C, H, W\), got shape \(3, 8, 8\)"),
    ("x non-contiguous", dict(x=X[:, :, :, ::2]), ValueError, r"x: expected a C-contiguous array, got strides"),
    ("weight non-contiguous", dict(weight=numpy.zeros((3, 1, 3, 6), numpy.float32)[..., ::2]), ValueError, r"weight: expected a C-contiguous array, got strides"),
    ("bias non-contiguous", dict(bias=numpy.zeros(6, numpy.float32)[::2]), ValueError, r"bias: expected a C-contiguous array, got strides"),
    ("weight wrong rank", dict(weight=W[0]), ValueError, r"weight: expected a 4-D array \(C\*M, 1, KH, KW\), got shape \(1, 3, 3\)"),
    ("weight dtype differs", dict(weight=W.astype(numpy.float64)), TypeError, r"weight: expected dtype float32 \(the dtype of x\), got float64"),
    ("weight channel count", dict(weight=numpy.zeros((4, 1, 3, 3), numpy.float32)), ValueError, r"weight: expected shape \(C\*M, 1, KH, KW\) with C = 3 .* got \(4, 1, 3, 3\)"),
    ("weight second dim", dict(weight=numpy.zeros((3, 2, 3, 3), numpy.float32)), ValueError, r"weight: expected shape \(C\*M, 1, KH, KW\) .* got \(3, 2, 3, 3\)"),
    ("weight empty filter", dict(weight=numpy.zeros((3, 1, 0, 3), numpy.float32)), ValueError, r"weight: expected a filter of at least 1x1, got \(3, 1, 0, 3\)"),
    ("stride zero", dict(stride=0), ValueError, r"stride: expected values >= 1 and < 2\*\*31, got 0"),
    ("stride negative pair", dict(stride=(1, -2)), ValueError, r"stride: expected values >= 1 and < 2\*\*31, got \(1, -2\)"),
    ("stride too large", dict(stride=2**31), ValueError, r"stride: expected values >= 1 and < 2\*\*31, got 2147483648"),
    ("padding too large", dict(padding=(0, 2**31)), ValueError, r"padding: expected values >= 0 and < 2\*\*31, got \(0, 2147483648\)"),
    ("stride float", dict(stride=1.5), TypeError, r"stride: expected an int or a pair of ints, got 1.5"),
    ("stride bool", dict(stride=True), TypeError, r"stride: expected an int or a pair of ints, got True"),
    ("dilation zero", dict(dilation=(0, 1)), ValueError, r"dilation: expected values >= 1 and < 2\*\*31, got \(0, 1\)"),
    ("padding negative", dict(padding=-1), ValueError, r"padding: expected values >= 0 and < 2\*\*31, got -1"),
    ("padding negative side", dict(padding=((0, 1), (-1, 0))), ValueError, r"padding: expected values >= 0"),
    ("padding triple", dict(padding=(1, 2, 3)), TypeError, r"padding: expected an int, \(pad_h, pad_w\), \(\(top, bottom\), \(left, right\)\), 'same' or 'valid', got \(1, 2, 3\)"),
    ("padding unknown string", dict(padding="full"), ValueError, r"padding: expected an int, a pair, 'same' or 'valid', got 'full'"),
    ("padding same with stride", dict(padding="same", stride=2), ValueError, r"padding: 'same' needs stride 1, got stride \(2, 2\)"),
    ("no channels", dict(x=numpy.zeros((2, 0, 8, 8), numpy.float32), weight=numpy.zeros((0, 1, 3, 3), numpy.float32)), ValueError, r"x: expected at least one channel \(C >= 1\), got NCHW \(2, 0, 8, 8\)"),
    ("output plane too large", dict(padding=2**30), ValueError, r"padding, stride, dilation: expected an output plane of fewer than 2\*\*30 elements, got 2147483654 x 2147483654 \(from a 8 x 8 plane of x\)"),
    ("output size <= 0", dict(weight=numpy.zeros((3, 1, 11, 3), numpy.float32)), ValueError, r"x: the output size would be 0x8: the padded input \(10x10\) must be at least as large as the dilated filter \(11x3\)"),
    ("bias shape", dict(bias=numpy.zeros(4, numpy.float32)), ValueError, r"bias: expected shape \(3,\) \(C\*M,\), got \(4,\)"),
    ("bias dtype", dict(bias=numpy.zeros(3, numpy.float16)), TypeError, r"bias: expected dtype float32 \(the dtype of x\), got float16"),
    ("layout unknown", dict(layout="NWHC"), ValueError, r"layout: expected 'NCHW' or 'NHWC', got 'NWHC'"),
    ("layout lower case", dict(layout="nhwc"), ValueError, r"layout: expected 'NCHW' or 'NHWC', got 'nhwc'"),
    ("layout None", dict(layout=None), ValueError, r"layout: expected 'NCHW' or 'NHWC', got None"),
]


@pytest.mark.parametrize("label, changes, error, pattern", FORWARD_ERRORS, ids=[c[0] for c in FORWARD_ERRORS])
def test_forward_rejects(label, changes, error, pattern):
    with pytest.raises(error, match=pattern):
        forward(**changes)


BACKWARD_ERRORS = [
    ("input_shape not ints", lambda: host.depthwise_conv2d_backward_input(DY, W, (2, 3, 8.0, 8), padding=1), TypeError, r"input_shape: expected a tuple of 4 ints, got \(2, 3, 8.0, 8\)"),
    ("input_shape negative", lambda: host.depthwise_conv2d_backward_input(DY, W, (2, 3, -8, 8), padding=1), ValueError, r"input_shape: expected sizes >= 0, got \(2, 3, -8, 8\)"),
    ("grad_out shape (input)", lambda: host.depthwise_conv2d_backward_input(DY[:, :, :7].copy(), W, X.shape, padding=1), ValueError, r"grad_out: expected shape \(2, 3, 8, 8\) \(the forward output shape\), got \(2, 3, 7, 8\)"),
    ("grad_out dtype (input)", lambda: host.depthwise_conv2d_backward_input(DY, W.astype(numpy.float16), X.shape, padding=1), TypeError, r"weight: expected dtype float32 \(the dtype of grad_out\), got float16"),
    ("weight_shape rank", lambda: host.depthwise_conv2d_backward_weight(DY, X, (3, 1, 3), padding=1), TypeError, r"weight_shape: expected a tuple of 4 ints, got \(3, 1, 3\)"),
    ("weight_shape second dim", lambda: host.depthwise_conv2d_backward_weight(DY, X, (3, 2, 3, 3), padding=1), ValueError, r"weight_shape: expected shape \(C\*M, 1, KH, KW\) with C = 3 .* got \(3, 2, 3, 3\)"),
    ("weight_shape empty filter", lambda: host.depthwise_conv2d_backward_weight(DY, X, (3, 1, 0, 3), padding=1), ValueError, r"weight_shape: expected a filter of at least 1x1, got \(3, 1, 0, 3\)"),
    ("grad_out shape (weight)", lambda: host.depthwise_conv2d_backward_weight(DY, X, (3, 1, 5, 5), padding=1), ValueError, r"grad_out: expected shape \(2, 3, 6, 6\) \(the forward output shape\), got \(2, 3, 8, 8\)"),
    ("x dtype (weight)", lambda: host.depthwise_conv2d_backward_weight(DY, X.astype(numpy.float64), W.shape, padding=1), TypeError, r"x: expected dtype float32 \(the dtype of grad_out\), got float64"),
    ("grad_out non-contiguous (input)", lambda: host.depthwise_conv2d_backward_input(numpy.zeros((2, 3, 8, 16), numpy.float32)[..., ::2], W, X.shape, padding=1), ValueError, r"grad_out: expected a C-contiguous array, got strides"),
    ("weight non-contiguous (input)", lambda: host.depthwise_conv2d_backward_input(DY, numpy.zeros((3, 1, 3, 6), numpy.float32)[..., ::2], X.shape, padding=1), ValueError, r"weight: expected a C-contiguous array, got strides"),
    ("grad_out non-contiguous (weight)", lambda: host.depthwise_conv2d_backward_weight(numpy.zeros((2, 3, 8, 16), numpy.float32)[..., ::2], X, W.shape, padding=1), ValueError, r"grad_out: expected a C-contiguous array, got strides"),
    ("x non-contiguous (weight)", lambda: host.depthwise_conv2d_backward_weight(DY, X[:, :, :, ::2], W.shape, padding=1), ValueError, r"x: expected a C-contiguous array, got strides"),
]


@pytest.mark.parametrize("label, call, error, pattern", BACKWARD_ERRORS, ids=[c[0] for c in BACKWARD_ERRORS])
def test_backward_rejects(label, call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_plane_limit_is_checked_before_launch():
    from cupy_dwgn import _validate

    geometry = _validate.conv_geometry((1, 1, 32768, 32768), (1, 1, 1, 1), 1, 0, 1)
    with pytest.raises(ValueError, match=r"x: expected fewer than 2\*\*30 elements per \(n, c\) plane, got 1073741824"):
        depthwise._check_limits("x", geometry)


# --- layouts ------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_check_layout_returns_the_layout(layout):
    assert _validate.check_layout(layout) == layout


@pytest.mark.parametrize("layout", ["nchw", "NWHC", "CHWN", "", None, b"NHWC", ("NHWC",)], ids=repr)
def test_check_layout_rejects_anything_else(layout):
    with pytest.raises(ValueError, match=r"^layout: expected 'NCHW' or 'NHWC', got " + re.escape(repr(layout)) + "$"):
        _validate.check_layout(layout)


def test_layout_shape_and_doc_follow_the_axis_order():
    assert _validate.layout_shape("NCHW", 2, 3, 5, 7) == (2, 3, 5, 7)
    assert _validate.layout_shape("NHWC", 2, 3, 5, 7) == (2, 5, 7, 3)
    assert _validate.layout_doc("NCHW") == "(N, C, H, W)"
    assert _validate.layout_doc("NHWC") == "(N, H, W, C)"
    assert _validate.layout_doc("NHWC", "C*M") == "(N, H, W, C*M)"
    assert _validate.layout_doc("NHWC", "C*M", ("OH", "OW")) == "(N, OH, OW, C*M)"
    assert _validate.layout_doc("NCHW", "C*M", ("OH", "OW")) == "(N, C*M, OH, OW)"


GEOMETRIES = [
    # NCHW x shape, weight shape, stride, padding, dilation
    ((2, 3, 8, 8), (3, 1, 3, 3), 1, 1, 1),
    ((1, 5, 11, 7), (10, 1, 3, 5), (2, 1), ((1, 2), (0, 3)), 1),
    ((2, 4, 20, 21), (12, 1, 3, 3), 1, "same", (2, 3)),
    ((3, 2, 9, 4), (2, 1, 1, 1), 3, "valid", 1),
]


@pytest.mark.parametrize("case", GEOMETRIES, ids=str)
def test_conv_geometry_is_the_same_for_both_layouts(case):
    (n, c, h, w), w_shape, stride, padding, dilation = case
    nchw = _validate.conv_geometry((n, c, h, w), w_shape, stride, padding, dilation)
    nhwc = _validate.conv_geometry((n, h, w, c), w_shape, stride, padding, dilation, layout="NHWC")
    assert nhwc == nchw
    assert (nhwc.batch, nhwc.channels, nhwc.height, nhwc.width) == (n, c, h, w)
    assert nhwc.multiplier == w_shape[0] // c


def test_conv_geometry_fast_paths_agree_with_the_general_rules():
    # Plain ints and tuples take a shortcut; lists and NumPy ints the general path.
    shape, weight = (2, 9, 10, 4), (8, 1, 3, 5)
    for fast, general in [
        ((2, 1, 1), ([2, 2], [1, 1], [1, 1])),
        (((1, 2), (0, 1), (2, 1)), ([1, 2], numpy.array([0, 1]).tolist(), [numpy.int64(2), numpy.int32(1)])),
        (((1, 1), ((0, 2), (1, 3)), 1), ((numpy.int64(1), 1), [[0, 2], [1, 3]], numpy.int16(1))),
    ]:
        a = _validate.conv_geometry(shape, weight, *fast, layout="NHWC")
        b = _validate.conv_geometry(shape, weight, *general, layout="NHWC")
        assert a == b
        assert all(type(v) is int for v in a)
    with pytest.raises(ValueError, match=r"stride: expected values >= 1 and < 2\*\*31, got \(1, 0\)"):
        _validate.conv_geometry(shape, weight, (1, 0), 1, 1, layout="NHWC")
    with pytest.raises(ValueError, match=r"padding: expected values >= 0 and < 2\*\*31, got \(\(0, -1\), \(1, 1\)\)"):
        _validate.conv_geometry(shape, weight, 1, ((0, -1), (1, 1)), 1, layout="NHWC")
    with pytest.raises(TypeError, match=r"dilation: expected an int or a pair of ints, got \(1, True\)"):
        _validate.conv_geometry(shape, weight, 1, 1, (1, True), layout="NHWC")


def test_conv_geometry_rejects_an_unknown_layout():
    with pytest.raises(ValueError, match=r"layout: expected 'NCHW' or 'NHWC', got 'NCWH'"):
        _validate.conv_geometry((2, 3, 8, 8), (3, 1, 3, 3), 1, 1, 1, layout="NCWH")


# NHWC arrays: x (N, H, W, C) = (2, 8, 6, 3); weight (C*M, 1, KH, KW) as in NCHW.
XN = numpy.zeros((2, 8, 6, 3), numpy.float32)
DYN = numpy.zeros((2, 8, 6, 3), numpy.float32)
WN = W
NHWC = dict(padding=1, layout="NHWC")


def _z(*shape):
    return numpy.zeros(shape, numpy.float32)


# (label, GPU-op check call, reference call or None, exception, message pattern).
# The check functions are the ones every GPU op and cupy_dwgn.host run first.
NHWC_ERRORS = [
    ("x rank",
     lambda: depthwise.check_forward_args(XN[0], WN, None, 1, 1, 1, "NHWC", None, numpy.ndarray),
     lambda: reference.depthwise_conv2d(XN[0], WN, **NHWC),
     ValueError, r"x: expected a 4-D array \(N, H, W, C\), got shape \(8, 6, 3\)"),
    ("x in NCHW order (channel axis)",
     lambda: depthwise.check_forward_args(X, WN, None, 1, 1, 1, "NHWC", None, numpy.ndarray),
     lambda: reference.depthwise_conv2d(X, WN, **NHWC),
     ValueError, r"weight: expected shape \(C\*M, 1, KH, KW\) with C = 8 \(channels of x, NHWC \(2, 3, 8, 8\)\) .*got \(3, 1, 3, 3\)"),
    ("weight channel count",
     lambda: depthwise.check_forward_args(XN, _z(4, 1, 3, 3), None, 1, 1, 1, "NHWC", None, numpy.ndarray),
     lambda: reference.depthwise_conv2d(XN, _z(4, 1, 3, 3), **NHWC),
     ValueError, r"weight: expected shape \(C\*M, 1, KH, KW\) with C = 3 \(channels of x, NHWC \(2, 8, 6, 3\)\) .*got \(4, 1, 3, 3\)"),
    ("output size from the NHWC axes",
     lambda: depthwise.check_forward_args(XN, _z(3, 1, 3, 9), None, 1, 1, 1, "NHWC", None, numpy.ndarray),
     lambda: reference.depthwise_conv2d(XN, _z(3, 1, 3, 9), **NHWC),
     ValueError, r"x: the output size would be 8x0: the padded input \(10x8\) must be at least as large as the dilated filter \(3x9\)"),
    ("layout string (forward)",
     lambda: depthwise.check_forward_args(XN, WN, None, 1, 1, 1, "channels_last", None, numpy.ndarray),
     lambda: reference.depthwise_conv2d(XN, WN, padding=1, layout="channels_last"),
     ValueError, r"layout: expected 'NCHW' or 'NHWC', got 'channels_last'"),
    ("out in NCHW order",
     lambda: depthwise.check_forward_args(XN, WN, None, 1, 1, 1, "NHWC", _z(2, 3, 8, 6), numpy.ndarray),
     None,
     ValueError, r"out: expected shape \(2, 8, 6, 3\), got \(2, 3, 8, 6\)"),
    ("out without the multiplier",
     lambda: depthwise.check_forward_args(XN, _z(6, 1, 3, 3), None, 2, 1, 1, "NHWC", _z(2, 4, 3, 3), numpy.ndarray),
     None,
     ValueError, r"out: expected shape \(2, 4, 3, 6\), got \(2, 4, 3, 3\)"),
    ("grad_out rank (input)",
     lambda: depthwise.check_backward_input_args(DYN[0], WN, XN.shape, 1, 1, 1, "NHWC", None, numpy.ndarray),
     lambda: reference.depthwise_conv2d_backward_input(DYN[0], WN, XN.shape, **NHWC),
     ValueError, r"grad_out: expected a 4-D array \(N, OH, OW, C\*M\), got shape \(8, 6, 3\)"),
    ("grad_out in NCHW order (input)",
     lambda: depthwise.check_backward_input_args(_z(2, 3, 8, 6), WN, XN.shape, 1, 1, 1, "NHWC", None, numpy.ndarray),
     lambda: reference.depthwise_conv2d_backward_input(_z(2, 3, 8, 6), WN, XN.shape, **NHWC),
     ValueError, r"grad_out: expected shape \(2, 8, 6, 3\) \(the forward output shape\), got \(2, 3, 8, 6\)"),
    ("grad_out of the stride-1 size at stride 2 (input)",
     lambda: depthwise.check_backward_input_args(_z(2, 8, 6, 6), _z(6, 1, 3, 3), XN.shape, 2, 1, 1, "NHWC", None, numpy.ndarray),
     lambda: reference.depthwise_conv2d_backward_input(_z(2, 8, 6, 6), _z(6, 1, 3, 3), XN.shape, stride=2, padding=1, layout="NHWC"),
     ValueError, r"grad_out: expected shape \(2, 4, 3, 6\) \(the forward output shape\), got \(2, 8, 6, 6\)"),
    ("input_shape in NCHW order",
     lambda: depthwise.check_backward_input_args(DYN, WN, (2, 3, 8, 6), 1, 1, 1, "NHWC", None, numpy.ndarray),
     lambda: reference.depthwise_conv2d_backward_input(DYN, WN, (2, 3, 8, 6), **NHWC),
     ValueError, r"weight: expected shape \(C\*M, 1, KH, KW\) with C = 6 \(channels of input_shape, NHWC \(2, 3, 8, 6\)\)"),
    ("layout string (input)",
     lambda: depthwise.check_backward_input_args(DYN, WN, XN.shape, 1, 1, 1, "HWC", None, numpy.ndarray),
     lambda: reference.depthwise_conv2d_backward_input(DYN, WN, XN.shape, padding=1, layout="HWC"),
     ValueError, r"layout: expected 'NCHW' or 'NHWC', got 'HWC'"),
    ("out in NCHW order (input)",
     lambda: depthwise.check_backward_input_args(DYN, WN, XN.shape, 1, 1, 1, "NHWC", _z(2, 3, 8, 6), numpy.ndarray),
     None,
     ValueError, r"out: expected shape \(2, 8, 6, 3\), got \(2, 3, 8, 6\)"),
    ("x rank (weight)",
     lambda: depthwise.check_backward_weight_args(DYN, XN[..., 0], WN.shape, 1, 1, 1, "NHWC", None, numpy.ndarray),
     lambda: reference.depthwise_conv2d_backward_weight(DYN, XN[..., 0], WN.shape, **NHWC),
     ValueError, r"x: expected a 4-D array \(N, H, W, C\), got shape \(2, 8, 6\)"),
    ("grad_out without the multiplier (weight)",
     lambda: depthwise.check_backward_weight_args(DYN, XN, (6, 1, 3, 3), 1, 1, 1, "NHWC", None, numpy.ndarray),
     lambda: reference.depthwise_conv2d_backward_weight(DYN, XN, (6, 1, 3, 3), **NHWC),
     ValueError, r"grad_out: expected shape \(2, 8, 6, 6\) \(the forward output shape\), got \(2, 8, 6, 3\)"),
    ("x in NCHW order (weight)",
     lambda: depthwise.check_backward_weight_args(DYN, _z(2, 3, 8, 6), WN.shape, 1, 1, 1, "NHWC", None, numpy.ndarray),
     lambda: reference.depthwise_conv2d_backward_weight(DYN, _z(2, 3, 8, 6), WN.shape, **NHWC),
     ValueError, r"weight_shape: expected shape \(C\*M, 1, KH, KW\) with C = 6 \(channels of x, NHWC \(2, 3, 8, 6\)\)"),
    ("layout string (weight)",
     lambda: depthwise.check_backward_weight_args(DYN, XN, WN.shape, 1, 1, 1, 0, None, numpy.ndarray),
     lambda: reference.depthwise_conv2d_backward_weight(DYN, XN, WN.shape, padding=1, layout=0),
     ValueError, r"layout: expected 'NCHW' or 'NHWC', got 0"),
]


@pytest.mark.parametrize("label, check, ref, error, pattern", NHWC_ERRORS, ids=[c[0] for c in NHWC_ERRORS])
def test_nhwc_rejects_with_the_same_message_in_gpu_checks_and_reference(label, check, ref, error, pattern):
    with pytest.raises(error, match=pattern) as from_check:
        check()
    if ref is not None:
        with pytest.raises(error, match=pattern) as from_reference:
            ref()
        assert str(from_reference.value) == str(from_check.value)


def test_nhwc_host_wrappers_reject_before_any_transfer():
    with pytest.raises(ValueError, match=r"grad_out: expected shape \(2, 8, 6, 3\) \(the forward output shape\), got \(2, 3, 8, 6\)"):
        host.depthwise_conv2d_backward_weight(_z(2, 3, 8, 6), XN, WN.shape, **NHWC)
    with pytest.raises(ValueError, match=r"x: expected a 4-D array \(N, H, W, C\), got shape \(8, 6, 3\)"):
        host.depthwise_conv2d(XN[0], WN, **NHWC)
    with pytest.raises(ValueError, match=r"x: expected a C-contiguous array"):
        host.depthwise_conv2d(X.transpose(0, 2, 3, 1), WN, **NHWC)  # an NHWC view of NCHW data


@pytest.mark.parametrize("case", GEOMETRIES, ids=str)
def test_nhwc_checks_accept_the_transposed_nchw_arguments(case):
    (n, c, h, w), w_shape, stride, padding, dilation = case
    conv = (stride, padding, dilation)
    x = _z(n, c, h, w)
    weight = _z(*w_shape)
    g = depthwise.check_forward_args(x, weight, None, *conv, "NCHW", None, numpy.ndarray)
    y_nhwc = _z(g.batch, g.out_height, g.out_width, g.channels * g.multiplier)
    x_nhwc = numpy.ascontiguousarray(x.transpose(0, 2, 3, 1))
    assert depthwise.check_forward_args(x_nhwc, weight, None, *conv, "NHWC", _z(*y_nhwc.shape), numpy.ndarray) == g
    assert depthwise.check_backward_input_args(y_nhwc, weight, x_nhwc.shape, *conv, "NHWC", _z(*x_nhwc.shape), numpy.ndarray) == g
    assert depthwise.check_backward_weight_args(y_nhwc, x_nhwc, w_shape, *conv, "NHWC", _z(*w_shape), numpy.ndarray) == g
    # The reference agrees on the output shape.
    assert reference.depthwise_conv2d(x_nhwc, weight, stride=stride, padding=padding, dilation=dilation, layout="NHWC").shape == y_nhwc.shape


# --- CuPy-only messages -------------------------------------------------------


@pytest.mark.gpu
def test_gpu_op_rejects_numpy_input_with_a_hint():
    import cupy

    import cupy_dwgn

    with pytest.raises(TypeError, match=r"x: expected a cupy.ndarray or a CUDA array with __dlpack__ \(torch tensor, JAX array\), got numpy.ndarray \(for NumPy arrays use cupy_dwgn.host\)"):
        cupy_dwgn.depthwise_conv2d(X, cupy.asarray(W))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "out, error, pattern",
    [
        ("numpy", TypeError, r"out: expected a cupy.ndarray or None, got numpy.ndarray"),
        ((2, 3, 8, 7), ValueError, r"out: expected shape \(2, 3, 8, 8\), got \(2, 3, 8, 7\)"),
        ("float64", TypeError, r"out: expected dtype float32, got float64"),
        ("strided", ValueError, r"out: expected a C-contiguous array"),
    ],
    ids=["type", "shape", "dtype", "contiguity"],
)
def test_gpu_op_rejects_bad_out(out, error, pattern):
    import cupy

    import cupy_dwgn

    out = {
        "numpy": numpy.zeros((2, 3, 8, 8), numpy.float32),
        "float64": cupy.zeros((2, 3, 8, 8), cupy.float64),
        "strided": cupy.zeros((2, 3, 8, 16), cupy.float32)[..., ::2],
    }.get(out, None) if isinstance(out, str) else cupy.zeros(out, cupy.float32)
    with pytest.raises(error, match=pattern):
        cupy_dwgn.depthwise_conv2d(cupy.asarray(X), cupy.asarray(W), padding=1, out=out)


@pytest.mark.gpu
def test_gpu_op_rejects_arrays_on_different_devices():
    import cupy

    import cupy_dwgn

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs 2 GPUs")
    x = cupy.asarray(X)
    with cupy.cuda.Device(1):
        w = cupy.asarray(W)
    assert (x.device.id, w.device.id) == (0, 1), "an earlier test left another device current"
    with pytest.raises(ValueError, match=r"weight: expected an array on device 0 \(the device of x\), got device 1"):
        cupy_dwgn.depthwise_conv2d(x, w, padding=1)


def test_stride_one_specialized_sizes_take_the_tiled_kernel():
    from cupy_dwgn import _depthwise_nchw, _validate

    def tiled(w_shape, stride=1, dilation=1, dtype=numpy.float32):
        g = _validate.conv_geometry((1, 2, 64, 64), w_shape, stride, 0 if stride != 1 else "same", dilation)
        return _depthwise_nchw._use_tiled(g, numpy.dtype(dtype))

    assert tiled((2, 1, 3, 3)) and tiled((2, 1, 7, 7), dtype=numpy.float64)
    assert not tiled((2, 1, 3, 3), stride=2)  # strided: direct kernel
    assert not tiled((2, 1, 4, 4))  # generic size: generic kernel
    assert not tiled((2, 1, 7, 7), dilation=12)  # window over the shared-memory budget


@pytest.mark.gpu
def test_gpu_op_rejects_out_overlapping_an_input():
    import cupy

    import cupy_dwgn

    x = cupy.zeros((2, 3, 8, 8), cupy.float32)
    w = cupy.asarray(W)
    with pytest.raises(ValueError, match=r"out: expected memory separate from x, got an overlapping array"):
        cupy_dwgn.depthwise_conv2d(x, w, padding=1, out=x)
    with pytest.raises(ValueError, match=r"out: expected memory separate from grad_out"):
        cupy_dwgn.depthwise_conv2d_backward_input(x, w, x.shape, padding=1, out=x)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "valid, invalid, pattern",
    [
        (dict(padding=1), dict(padding=1.0), r"padding: expected an int"),
        (dict(padding=1), dict(padding=True), r"padding: expected an int"),
        (dict(stride=(1, 1)), dict(stride=(True, 1.0)), r"stride: expected an int or a pair of ints"),
        (dict(dilation=1), dict(dilation=1.0), r"dilation: expected an int or a pair of ints"),
        (dict(padding=((1, 1), (1, 1))), dict(padding=((1.0, 1), (1, 1))), r"padding: expected an int"),
    ],
    ids=["padding-float", "padding-bool", "stride-tuple", "dilation-float", "padding-pairs"],
)
def test_a_remembered_signature_does_not_admit_equal_invalid_arguments(valid, invalid, pattern):
    # 1 == 1.0 == True and (1, 1) == (True, 1.0): the signature cache keys
    # the arguments' types too, so a call that a fresh process rejects is
    # rejected after a valid call of equal values as well.
    import cupy

    import cupy_dwgn

    x = cupy.zeros((2, 3, 8, 8), cupy.float32)
    w = cupy.asarray(W)
    dy = cupy_dwgn.depthwise_conv2d(x, w, **valid)
    for _ in range(2):
        cupy_dwgn.depthwise_conv2d(x, w, **valid)
        cupy_dwgn.depthwise_conv2d_backward_input(dy, w, x.shape, **valid)
        cupy_dwgn.depthwise_conv2d_backward_weight(dy, x, w.shape, **valid)
    with pytest.raises(TypeError, match=pattern):
        cupy_dwgn.depthwise_conv2d(x, w, **invalid)
    with pytest.raises(TypeError, match=pattern):
        cupy_dwgn.depthwise_conv2d_backward_input(dy, w, x.shape, **invalid)
    with pytest.raises(TypeError, match=pattern):
        cupy_dwgn.depthwise_conv2d_backward_weight(dy, x, w.shape, **invalid)


@pytest.mark.gpu
def test_a_remembered_signature_does_not_admit_a_shape_of_equal_invalid_values():
    import cupy

    import cupy_dwgn

    x = cupy.zeros((2, 3, 8, 8), cupy.float32)
    w = cupy.asarray(W)
    dy = cupy_dwgn.depthwise_conv2d(x, w, padding=1)
    for _ in range(2):
        cupy_dwgn.depthwise_conv2d_backward_input(dy, w, (2, 3, 8, 8), padding=1)
        cupy_dwgn.depthwise_conv2d_backward_weight(dy, x, (3, 1, 3, 3), padding=1)
    with pytest.raises(TypeError, match=r"input_shape: expected a tuple of 4 ints, got \(2, 3, 8.0, 8\)"):
        cupy_dwgn.depthwise_conv2d_backward_input(dy, w, (2, 3, 8.0, 8), padding=1)
    with pytest.raises(TypeError, match=r"weight_shape: expected a tuple of 4 ints, got \(3, True, 3, 3\)"):
        cupy_dwgn.depthwise_conv2d_backward_weight(dy, x, (3, True, 3, 3), padding=1)


@pytest.mark.gpu
def test_overlap_is_caught_after_a_separate_out_of_the_same_signature():
    # The fast path remembers the last addresses that passed the overlap
    # check; other addresses with the same shapes must be checked again.
    import cupy

    import cupy_dwgn

    x = cupy.zeros((2, 3, 8, 8), cupy.float32)
    w = cupy.asarray(W)
    separate = cupy.empty_like(x)
    for _ in range(2):
        cupy_dwgn.depthwise_conv2d(x, w, padding=1, out=separate)
    with pytest.raises(ValueError, match=r"out: expected memory separate from x, got an overlapping array"):
        cupy_dwgn.depthwise_conv2d(x, w, padding=1, out=x)
    cupy_dwgn.depthwise_conv2d(x, w, padding=1, out=separate)
    y, mean, rstd = cupy_dwgn.group_norm(x, 2, return_stats=True)
    for _ in range(2):
        cupy_dwgn.group_norm(x, 2, out=y, mean_out=mean, rstd_out=rstd)
    with pytest.raises(ValueError, match=r"mean_out: expected memory separate from rstd_out"):
        cupy_dwgn.group_norm(x, 2, out=y, mean_out=mean, rstd_out=mean)


@pytest.mark.gpu
def test_gpu_op_rejects_bad_nhwc_out():
    import cupy

    import cupy_dwgn

    x, w = cupy.asarray(XN), cupy.asarray(WN)
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 8, 6, 3\), got \(2, 3, 8, 6\)"):
        cupy_dwgn.depthwise_conv2d(x, w, out=cupy.zeros((2, 3, 8, 6), cupy.float32), **NHWC)
    with pytest.raises(ValueError, match=r"out: expected memory separate from x, got an overlapping array"):
        cupy_dwgn.depthwise_conv2d(x, w, out=x, **NHWC)
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 8, 6, 3\), got \(2, 3, 8, 6\)"):
        cupy_dwgn.depthwise_conv2d_backward_input(
            cupy.asarray(DYN), w, XN.shape, out=cupy.zeros((2, 3, 8, 6), cupy.float32), **NHWC
        )
