"""The float64 depthwise references, checked on the CPU against independent computations."""

import numpy
import pytest
import scipy.signal

from cupy_dwgn import reference

CASES = [
    # x shape, weight shape, stride, padding, dilation
    ((2, 3, 9, 8), (3, 1, 3, 3), 1, 1, 1),
    ((1, 2, 11, 7), (4, 1, 3, 5), (2, 1), ((1, 2), (0, 3)), 1),
    ((2, 2, 10, 10), (6, 1, 2, 3), 1, 0, (2, 3)),
    ((1, 1, 6, 6), (1, 1, 3, 3), 3, 4, 1),
    ((1, 2, 8, 9), (2, 1, 4, 4), 1, "same", 1),
]


def _correlate_valid(x, weight, bias, stride, padding, dilation):
    """Per-channel scipy.signal.correlate2d on the explicitly padded, dilated problem."""
    from cupy_dwgn import _validate

    g = _validate.conv_geometry(x.shape, weight.shape, stride, padding, dilation)
    xp = numpy.pad(x, ((0, 0), (0, 0), (g.pad_top, g.pad_bottom), (g.pad_left, g.pad_right)))
    y = numpy.zeros((g.batch, g.channels * g.multiplier, g.out_height, g.out_width))
    for n in range(g.batch):
        for oc in range(g.channels * g.multiplier):
            kernel = numpy.zeros(((g.filter_height - 1) * g.dilation_h + 1, (g.filter_width - 1) * g.dilation_w + 1))
            kernel[:: g.dilation_h, :: g.dilation_w] = weight[oc, 0]
            full = scipy.signal.correlate2d(xp[n, oc // g.multiplier], kernel, mode="valid")
            y[n, oc] = full[:: g.stride_h, :: g.stride_w][: g.out_height, : g.out_width]
            if bias is not None:
                y[n, oc] += bias[oc]
    return y


@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_matches_scipy_correlate2d(case, rng):
    x_shape, w_shape, stride, padding, dilation = case
    x = rng.standard_normal(x_shape)
    weight = rng.standard_normal(w_shape)
    bias = rng.standard_normal(w_shape[0])
    got = reference.depthwise_conv2d(x, weight, bias, stride=stride, padding=padding, dilation=dilation)
    want = _correlate_valid(x, weight, bias, stride, padding, dilation)
    numpy.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def _problem(case, rng):
    """(x_shape, w_shape, the geometry keywords, x, weight) of a CASES row, random float64 arrays."""
    x_shape, w_shape, stride, padding, dilation = case
    return x_shape, w_shape, dict(stride=stride, padding=padding, dilation=dilation), rng.standard_normal(
        x_shape), rng.standard_normal(w_shape)


def _finite_difference(f, a, direction, h=1e-6):
    return (f(a + h * direction) - f(a - h * direction)) / (2 * h)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_backward_input_matches_finite_differences(case, rng):
    x_shape, w_shape, kw, x, weight = _problem(case, rng)
    grad_out = rng.standard_normal(reference.depthwise_conv2d(x, weight, **kw).shape)
    dx = reference.depthwise_conv2d_backward_input(grad_out, weight, x_shape, **kw)
    for _ in range(3):
        direction = rng.standard_normal(x_shape)
        numeric = _finite_difference(
            lambda a: numpy.vdot(grad_out, reference.depthwise_conv2d(a, weight, **kw)), x, direction
        )
        assert numpy.vdot(dx, direction) == pytest.approx(numeric, rel=1e-7, abs=1e-7)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_backward_weight_matches_finite_differences(case, rng):
    x_shape, w_shape, kw, x, weight = _problem(case, rng)
    grad_out = rng.standard_normal(reference.depthwise_conv2d(x, weight, **kw).shape)
    dw = reference.depthwise_conv2d_backward_weight(grad_out, x, w_shape, **kw)
    for _ in range(3):
        direction = rng.standard_normal(w_shape)
        numeric = _finite_difference(
            lambda a: numpy.vdot(grad_out, reference.depthwise_conv2d(x, a, **kw)), weight, direction
        )
        assert numpy.vdot(dw, direction) == pytest.approx(numeric, rel=1e-7, abs=1e-7)


def test_backward_weight_elementwise_against_a_direct_loop(rng):
    """Each element of a non-square filter's gradient, from its definition
    (the seed indexed 3x5 filters with filter_height in place of filter_width)."""
    x = rng.standard_normal((2, 2, 7, 8))
    weight_shape = (2, 1, 3, 5)
    grad_out = rng.standard_normal((2, 2, 7, 8))
    dw = reference.depthwise_conv2d_backward_weight(grad_out, x, weight_shape, padding=(1, 2))
    xp = numpy.pad(x, ((0, 0), (0, 0), (1, 1), (2, 2)))
    for c in range(2):
        for kh in range(3):
            for kw in range(5):
                want = numpy.sum(grad_out[:, c] * xp[:, c, kh : kh + 7, kw : kw + 8])
                assert dw[c, 0, kh, kw] == pytest.approx(want, rel=1e-12)


# Valid calls whose padded plane is mostly never read (padding and dilation far
# larger than the input): the references keep only the rows / columns the taps
# read (reference._FRAME_SLACK), so these run in O(output) memory; the whole
# padded plane of the first would be 120008 x 120008 (107 GiB).
SPARSE_CASES = [
    # x shape, weight shape, stride, padding, dilation
    ((1, 2, 8, 8), (2, 1, 3, 3), 1, 60000, 60000),  # rows and columns compressed
    ((1, 2, 4, 5), (4, 1, 3, 3), 1, ((1000, 1000), (1, 1)), (1000, 1)),  # rows only, M = 2
    ((1, 1, 5, 5), (1, 1, 2, 2), (3, 1), ((4000, 0), (0, 0)), (3995, 1)),  # stride 3 on a compressed axis
    ((2, 1, 3, 6), (1, 1, 2, 2), (1, 2), ((0, 0), (900, 0)), (1, 895)),  # columns only, asymmetric
]


def _direct(x, weight, *, stride, padding, dilation):
    """The three passes from their definitions, a loop over outputs and taps
    reading only in-range input positions (never a padded plane)."""
    from cupy_dwgn import _validate

    g = _validate.conv_geometry(x.shape, weight.shape, stride, padding, dilation)
    y = numpy.zeros((g.batch, g.channels * g.multiplier, g.out_height, g.out_width))
    taps = []  # (oc, kh, kw, oh, ow, h, w) of every product that reads the input
    for oc in range(g.channels * g.multiplier):
        for kh in range(g.filter_height):
            for kw in range(g.filter_width):
                for oh in range(g.out_height):
                    h = oh * g.stride_h - g.pad_top + kh * g.dilation_h
                    for ow in range(g.out_width):
                        w = ow * g.stride_w - g.pad_left + kw * g.dilation_w
                        if 0 <= h < g.height and 0 <= w < g.width:
                            taps.append((oc, kh, kw, oh, ow, h, w))
    return g, taps


@pytest.mark.parametrize("case", SPARSE_CASES, ids=str)
def test_sparse_padding_matches_the_definition_in_output_memory(case, rng):
    x_shape, w_shape, kw, x, weight = _problem(case, rng)
    g, taps = _direct(x, weight, **kw)
    assert taps, case  # some products read the input
    y = numpy.zeros((g.batch, g.channels * g.multiplier, g.out_height, g.out_width))
    grad_out = rng.standard_normal(y.shape)
    dx, dw = numpy.zeros(x.shape), numpy.zeros(w_shape)
    for oc, kh, kw_, oh, ow, h, w in taps:
        c = oc // g.multiplier
        y[:, oc, oh, ow] += x[:, c, h, w] * weight[oc, 0, kh, kw_]
        dx[:, c, h, w] += grad_out[:, oc, oh, ow] * weight[oc, 0, kh, kw_]
        dw[oc, 0, kh, kw_] += numpy.sum(grad_out[:, oc, oh, ow] * x[:, c, h, w])
    numpy.testing.assert_allclose(reference.depthwise_conv2d(x, weight, **kw), y, rtol=1e-13, atol=1e-13)
    numpy.testing.assert_allclose(reference.depthwise_conv2d_backward_input(grad_out, weight, x_shape, **kw), dx,
                                  rtol=1e-13, atol=1e-13)
    numpy.testing.assert_allclose(reference.depthwise_conv2d_backward_weight(grad_out, x, w_shape, **kw), dw,
                                  rtol=1e-13, atol=1e-13)
    # NHWC: the same numbers, transposed.
    nhwc = dict(kw, layout="NHWC")
    got = reference.depthwise_conv2d(x.transpose(0, 2, 3, 1).copy(), weight, **nhwc)
    numpy.testing.assert_allclose(got, y.transpose(0, 2, 3, 1), rtol=1e-13, atol=1e-13)


# --- channels-last (NHWC) ----------------------------------------------------

NHWC_CASES = CASES + [
    # x shape (NCHW), weight shape, stride, padding, dilation
    ((2, 5, 7, 6), (10, 1, 3, 3), 2, ((0, 2), (1, 0)), 1),  # M = 2, stride 2, asymmetric padding
    ((1, 3, 9, 11), (9, 1, 5, 3), (1, 2), (2, 1), (2, 1)),  # M = 3, dilation, non-square
    ((2, 4, 5, 5), (4, 1, 1, 1), 1, 0, 1),  # 1x1
    ((1, 2, 4, 3), (2, 1, 3, 3), 3, 5, 1),  # padding > filter, stride > filter
]


def _nhwc(a):
    return numpy.ascontiguousarray(a.transpose(0, 2, 3, 1))


def _nhwc_shape(shape):
    n, c, h, w = shape
    return (n, h, w, c)


@pytest.mark.parametrize("case", NHWC_CASES, ids=str)
def test_nhwc_reference_is_the_nchw_reference_transposed(case, rng):
    x_shape, w_shape, kw, x, weight = _problem(case, rng)
    bias = rng.standard_normal(w_shape[0])
    y = reference.depthwise_conv2d(x, weight, bias, **kw)
    y_nhwc = reference.depthwise_conv2d(_nhwc(x), weight, bias, layout="NHWC", **kw)
    assert y_nhwc.shape == _nhwc_shape(y.shape)
    numpy.testing.assert_allclose(y_nhwc, _nhwc(y), rtol=1e-12, atol=1e-12)
    assert y_nhwc.flags.c_contiguous

    dy = rng.standard_normal(y.shape)
    dx = reference.depthwise_conv2d_backward_input(dy, weight, x_shape, **kw)
    dx_nhwc = reference.depthwise_conv2d_backward_input(_nhwc(dy), weight, _nhwc_shape(x_shape), layout="NHWC", **kw)
    assert dx_nhwc.shape == _nhwc_shape(x_shape)
    numpy.testing.assert_allclose(dx_nhwc, _nhwc(dx), rtol=1e-12, atol=1e-12)
    assert dx_nhwc.flags.c_contiguous

    dw = reference.depthwise_conv2d_backward_weight(dy, x, w_shape, **kw)
    dw_nhwc = reference.depthwise_conv2d_backward_weight(_nhwc(dy), _nhwc(x), w_shape, layout="NHWC", **kw)
    assert dw_nhwc.shape == w_shape
    numpy.testing.assert_allclose(dw_nhwc, dw, rtol=1e-12, atol=1e-12)


def test_nhwc_forward_elementwise_against_a_direct_loop(rng):
    """Each output of an NHWC forward with M = 2 from its definition, indexing
    the channels-last arrays directly (independent of the transposes)."""
    x = rng.standard_normal((2, 6, 5, 3))  # (N, H, W, C)
    weight = rng.standard_normal((6, 1, 3, 2))  # C*M = 6, M = 2
    bias = rng.standard_normal(6)
    y = reference.depthwise_conv2d(x, weight, bias, stride=(2, 1), padding=((1, 0), (0, 1)), layout="NHWC")
    xp = numpy.pad(x, ((0, 0), (1, 0), (0, 1), (0, 0)))
    assert y.shape == (2, 3, 5, 6)
    for n in range(2):
        for oh in range(3):
            for ow in range(5):
                for oc in range(6):
                    window = xp[n, 2 * oh : 2 * oh + 3, ow : ow + 2, oc // 2]
                    want = numpy.sum(window * weight[oc, 0]) + bias[oc]
                    assert y[n, oh, ow, oc] == pytest.approx(want, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_reference_results_are_contiguous_float64(layout, rng):
    x = rng.standard_normal((1, 4, 6, 4)).astype(numpy.float16)  # C = 4 in both layouts
    w = rng.standard_normal((4, 1, 3, 3)).astype(numpy.float16)  # x's dtype, as the GPU op requires
    for result in (
        reference.depthwise_conv2d(x, w, padding=1, layout=layout),
        reference.depthwise_conv2d_backward_input(x, w, x.shape, padding=1, layout=layout),
        reference.depthwise_conv2d_backward_weight(x, x, w.shape, padding=1, layout=layout),
    ):
        assert result.dtype == numpy.float64 and result.flags.c_contiguous
    with pytest.raises(TypeError, match=r"^weight: expected dtype float16 \(the dtype of x\), got float32$"):
        reference.depthwise_conv2d(x, w.astype(numpy.float32), padding=1, layout=layout)


# Hypothesis draws geometries over the whole argument space: the reference
# forward and backward passes must be exact adjoints of each other.
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def geometries(draw):
    kh, kw = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    dilation = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    padding = tuple((draw(st.integers(0, 6)), draw(st.integers(0, 6))) for _ in range(2))
    span_h, span_w = dilation[0] * (kh - 1) + 1, dilation[1] * (kw - 1) + 1
    min_height, min_width = max(1, span_h - sum(padding[0])), max(1, span_w - sum(padding[1]))
    height = draw(st.integers(min_height, min_height + 10))
    width = draw(st.integers(min_width, min_width + 10))
    channels, multiplier = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    batch = draw(st.integers(1, 2))
    return (batch, channels, height, width), (channels * multiplier, 1, kh, kw), stride, padding, dilation


@settings(max_examples=60, deadline=None)
@given(geometries(), st.integers(0, 2**32 - 1), st.sampled_from(["NCHW", "NHWC"]))
def test_reference_passes_are_adjoint(geometry, seed, layout):
    x_shape, w_shape, stride, padding, dilation = geometry
    if layout == "NHWC":
        x_shape = _nhwc_shape(x_shape)
    kw = dict(stride=stride, padding=padding, dilation=dilation, layout=layout)
    rng = numpy.random.default_rng(seed)
    x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
    y = reference.depthwise_conv2d(x, w, **kw)
    dy = rng.standard_normal(y.shape)
    inner = numpy.vdot(y, dy)
    dx = reference.depthwise_conv2d_backward_input(dy, w, x_shape, **kw)
    dw = reference.depthwise_conv2d_backward_weight(dy, x, w_shape, **kw)
    assert numpy.vdot(x, dx) == pytest.approx(inner, rel=1e-10, abs=1e-10)
    assert numpy.vdot(w, dw) == pytest.approx(inner, rel=1e-10, abs=1e-10)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_non_finite_weight_semantics(layout, rng):
    # README "Numerics", the reference's side: the forward multiplies the padding's zeros by every
    # tap (an inf tap that meets only padding still gives 0 * inf = NaN: every output of its
    # channel is non-finite, as cuDNN's channels-last forward), while the backward-input adds only
    # the products of real grad_out values (as PyTorch's backward in every case measured), so
    # only the inputs that tap reaches are non-finite.
    x = rng.standard_normal((1, 2, 5, 5))
    w = rng.standard_normal((2, 1, 3, 3))
    w[0, 0, 0, 0] = numpy.inf
    to = (lambda a: numpy.ascontiguousarray(a.transpose(0, 2, 3, 1))) if layout == "NHWC" else (lambda a: a)
    back = (lambda a: a.transpose(0, 3, 1, 2)) if layout == "NHWC" else (lambda a: a)
    with numpy.errstate(invalid="ignore"):
        y = back(reference.depthwise_conv2d(to(x), w, padding=1, layout=layout))
        dx = back(reference.depthwise_conv2d_backward_input(to(numpy.ones_like(x)), w, to(x).shape, padding=1,
                                                            layout=layout))
    assert not numpy.isfinite(y[:, 0]).any() and numpy.isfinite(y[:, 1]).all()
    assert numpy.isnan(y[0, 0, 0, :]).all() and numpy.isnan(y[0, 0, :, 0]).all()  # the tap in the padding
    # Tap (0, 0) of output (oh, ow) reads input (oh - 1, ow - 1): inputs 0-3 along each axis.
    reached = numpy.zeros((5, 5), bool)
    reached[:4, :4] = True
    assert numpy.array_equal(~numpy.isfinite(dx[0, 0]), reached) and numpy.isfinite(dx[:, 1]).all()
