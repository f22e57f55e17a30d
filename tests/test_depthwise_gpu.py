"""Depthwise convolution on the GPU against the float64 reference: all three ops,
all dtypes, NaN-poisoned outputs, the edge cases (odd and prime sizes, C not a
multiple of 4/8, padding >= filter, ...), seeded random geometries, and one test
per seed bug (CHANGELOG.md, "Fixed, relative to the kernels cupy-dwgn started from")."""

import numpy
import pytest

from cupy_dwgn import (
    _depthwise_nchw_forward_regs, _depthwise_conv_mma, _depthwise_nchw_plane, _depthwise_nchw_plane_wgrad, _depthwise_nchw_window, _depthwise_nchw_rows, _depthwise_nchw_via_nhwc, _depthwise_nchw_wgrad_regs, _depthwise_nhwc, _depthwise_nhwc_direct, _depthwise_nhwc_large, _depthwise_nhwc_phase, _depthwise_nhwc_ring, _depthwise_nhwc_wgrad, _depthwise_nhwc_window, _depthwise_wgrad_mma,
    _depthwise_nchw, _launch, _validate, depthwise, reference,
)

from _helpers import (
    DTYPE_IDS, DTYPES, NARROW_FLOAT32_ROUTES, ROUTE_DTYPES, ROUTES_7X7, TOLERANCE, poisoned, random, record_errors, relative_error,
    nchw_launch_expressions, programmatic_settings, replay_on_new_data, route_kernel,
)

cupy = pytest.importorskip("cupy")
import cupy_dwgn  # noqa: E402

pytestmark = pytest.mark.gpu

LAYOUTS = ["NCHW", "NHWC"]


def _to_layout(a, layout):
    """NCHW host data in ``layout``: NHWC is the same values transposed to
    (N, H, W, C) and made C-contiguous."""
    return numpy.ascontiguousarray(a.transpose(0, 2, 3, 1)) if layout == "NHWC" else a


def _shape(shape, layout):
    """An NCHW activation shape in ``layout``'s axis order."""
    return _validate.layout_shape(layout, shape[0], shape[1], shape[2], shape[3])


def _channels(a, start, stop, layout):
    """Channels [start, stop) of an activation in ``layout`` (a view)."""
    return a[..., start:stop] if layout == "NHWC" else a[:, start:stop]


# (label, x shape, weight shape, stride, padding, dilation)
EDGE_CASES = [
    ("3x3 s1 p1", (2, 8, 16, 16), (8, 1, 3, 3), 1, 1, 1),
    ("5x5 s2 p2", (2, 6, 17, 15), (6, 1, 5, 5), 2, 2, 1),
    ("7x7 p3 odd", (1, 5, 13, 11), (5, 1, 7, 7), 1, 3, 1),
    ("1x1 generic", (2, 7, 9, 9), (7, 1, 1, 1), 1, 0, 1),
    ("3x5 non-square", (2, 4, 16, 16), (4, 1, 3, 5), 1, (1, 2), 1),
    ("5x3 non-square s(2,1)", (2, 4, 16, 16), (4, 1, 5, 3), (2, 1), (2, 1), 1),
    ("31x31 large", (1, 3, 40, 36), (3, 1, 31, 31), 1, 15, 1),
    ("11x11 generic s3", (1, 2, 29, 30), (2, 1, 11, 11), 3, 5, 1),
    ("H*W prime 1x31", (3, 5, 1, 31), (5, 1, 1, 3), 1, (0, 1), 1),
    ("H*W prime 37x1", (1, 3, 37, 1), (3, 1, 3, 1), 1, (1, 0), 1),
    ("C=7 N=1", (1, 7, 10, 12), (7, 1, 3, 3), 1, 1, 1),
    ("padding >= filter", (2, 3, 6, 7), (3, 1, 3, 3), 1, 4, 1),
    ("stride > filter", (2, 3, 19, 17), (3, 1, 3, 3), 4, 1, 1),
    ("1x1 stride 3", (2, 3, 10, 10), (3, 1, 1, 1), 3, 0, 1),
    ("dilation (2,3)", (2, 4, 20, 21), (4, 1, 3, 3), 1, (2, 3), (2, 3)),
    ("dilation 2 5x5 s2", (1, 4, 23, 24), (4, 1, 5, 5), 2, 4, 2),
    ("multiplier 2", (2, 3, 12, 12), (6, 1, 3, 3), 1, 1, 1),
    ("multiplier 3 7x7 s2", (2, 2, 15, 14), (6, 1, 7, 7), 2, 3, 1),
    ("per-side padding", (2, 3, 11, 9), (3, 1, 3, 3), 1, ((1, 2), (0, 3)), 1),
    ("same even filter", (1, 3, 9, 10), (3, 1, 4, 4), 1, "same", 1),
    ("same dilated", (1, 3, 9, 10), (3, 1, 3, 3), 1, "same", 2),
    ("valid", (2, 3, 8, 9), (3, 1, 5, 5), 1, "valid", 1),
    ("output 1x1", (1, 4, 3, 3), (4, 1, 3, 3), 1, 0, 1),
    # The stride-1 shared-memory kernel: ragged tiles, dilated halo, M sources
    # summed in backward-input, asymmetric and oversized padding, and a
    # dilation whose window no longer fits (falls back to the direct kernel).
    ("tiled 3x3 ragged 70x45", (2, 5, 70, 45), (5, 1, 3, 3), 1, 1, 1),
    ("tiled 5x5 dilation 2 M=3", (2, 2, 40, 37), (6, 1, 5, 5), 1, 4, 2),
    ("tiled 7x7 asymmetric padding", (1, 3, 33, 34), (3, 1, 7, 7), 1, ((6, 0), (1, 5)), 1),
    ("tiled 3x3 padding 5", (2, 2, 9, 40), (2, 1, 3, 3), 1, 5, 1),
    ("7x7 dilation 12 untiled", (1, 2, 80, 80), (2, 1, 7, 7), 1, 36, 12),
    # More planes than grid.y (65535): the plane loops must iterate.
    ("70000 planes tiled", (1, 70000, 3, 3), (70000, 1, 3, 3), 1, 1, 1),
    ("70000 planes direct s2", (1, 35000, 5, 5), (70000, 1, 3, 3), 2, 1, 1),
]


def _random_geometry(seed):
    """A seeded random geometry over the whole argument space."""
    r = numpy.random.default_rng(seed)
    kh, kw = (int(r.choice([1, 2, 3, 4, 5, 7, 9])) for _ in range(2))
    if r.random() < 0.5:
        kw = kh
    stride = tuple(int(s) for s in r.integers(1, 4, 2))
    dilation = tuple(int(d) for d in r.choice([1, 1, 2, 3], 2))
    padding = ((int(r.integers(0, kh + 2)), int(r.integers(0, kh + 2))), (int(r.integers(0, kw + 2)), int(r.integers(0, kw + 2))))
    span_h, span_w = dilation[0] * (kh - 1) + 1, dilation[1] * (kw - 1) + 1
    height = int(r.integers(max(1, span_h - sum(padding[0])), 40))
    width = int(r.integers(max(1, span_w - sum(padding[1])), 40))
    channels, multiplier = int(r.integers(1, 12)), int(r.choice([1, 1, 2, 3]))
    batch = int(r.integers(1, 4))
    return (f"random {seed}", (batch, channels, height, width), (channels * multiplier, 1, kh, kw), stride, padding, dilation)


CASES = EDGE_CASES + [_random_geometry(seed) for seed in range(24)]


def _run_all_three(case, dtype, rng, bias=True, layout="NCHW"):
    _, x_shape, w_shape, stride, padding, dilation = case
    conv = dict(stride=stride, padding=padding, dilation=dilation)
    g = _validate.conv_geometry(x_shape, w_shape, stride, padding, dilation)
    y_shape = (g.batch, g.channels * g.multiplier, g.out_height, g.out_width)
    # Random NCHW data; NHWC runs on the same values transposed.
    x = _to_layout(random(rng, x_shape, dtype), layout)
    w = random(rng, w_shape, dtype)
    b = random(rng, w_shape[0], dtype) if bias else None
    dy = _to_layout(random(rng, y_shape, dtype), layout)
    in_shape = _shape(x_shape, layout)
    conv["layout"] = layout
    y_ref = reference.depthwise_conv2d(x, w, b, **conv)
    dx_ref = reference.depthwise_conv2d_backward_input(dy, w, in_shape, **conv)
    dw_ref = reference.depthwise_conv2d_backward_weight(dy, x, w_shape, **conv)
    assert y_ref.shape == _shape(y_shape, layout)

    x_gpu, w_gpu, dy_gpu = cupy.asarray(x), cupy.asarray(w), cupy.asarray(dy)
    b_gpu = None if b is None else cupy.asarray(b)
    y = cupy_dwgn.depthwise_conv2d(x_gpu, w_gpu, b_gpu, out=poisoned(y_ref.shape, dtype), **conv)
    dx = cupy_dwgn.depthwise_conv2d_backward_input(dy_gpu, w_gpu, in_shape, out=poisoned(in_shape, dtype), **conv)
    dw = cupy_dwgn.depthwise_conv2d_backward_weight(dy_gpu, x_gpu, w_shape, out=poisoned(w_shape, dtype), **conv)
    for result in (y, dx, dw):
        assert result.dtype == dtype
    return {
        "forward": relative_error(y, y_ref),
        "backward_input": relative_error(dx, dx_ref),
        "backward_weight": relative_error(dw, dw_ref),
    }


def _model_layer(seed):
    """A seeded depthwise layer as conv nets have them (3x3 / 5x5 / 7x7,
    stride 1 or 2, padding K // 2), at the plane widths where the ops' rules
    pick their specialized kernels (7, 8, 14, 28, 56, ... and odd ones
    between) and channel counts past the vector widths, under about 700K
    elements a tensor: the kernels the rules choose for real models, on
    sizes the tables do not list."""
    r = numpy.random.default_rng(1000 + seed)
    k = int(r.choice([3, 5, 7]))
    stride = int(r.choice([1, 2]))
    widths = [7, 8, 10, 14, 16, 19, 28, 38, 56, 75]
    height = int(r.choice(widths)) if r.random() < 0.5 else int(r.integers(5, 121))
    width = height if r.random() < 0.7 else int(r.integers(5, 121))
    channels = int(r.integers(1, 64)) if r.random() < 0.4 else int(r.integers(64, 400))
    budget = 700_000
    channels = max(1, min(channels, budget // (height * width)))
    batch = int(max(1, min(4, budget // (channels * height * width))))
    name = f"layer {seed} {batch}x{channels}x{height}x{width} {k}x{k} s{stride}"
    return (name, (batch, channels, height, width), (channels, 1, k, k), stride, k // 2, 1)


MODEL_LAYERS = [_model_layer(seed) for seed in range(20)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CASES + MODEL_LAYERS, ids=lambda c: c[0])
def test_all_ops_match_reference(case, dtype, layout, rng):
    errors = _run_all_three(case, dtype, rng, layout=layout)
    family = "model layers" if case in MODEL_LAYERS else "all cases"
    record_errors(f"depthwise {layout} ({family})", str(numpy.dtype(dtype)), errors)
    assert max(errors.values()) <= TOLERANCE[dtype], errors


# Channels-last specifics (cases given in NCHW shapes, run in NHWC): channel
# counts that are not multiples of the 4/8-element channel vectors, depth
# multipliers, 1x1 and 31x31 filters, and enough channels for several blocks.
NHWC_CASES = [
    ("C=1", (2, 1, 9, 9), (1, 1, 3, 3), 1, 1, 1),
    ("C=5 3x3", (2, 5, 9, 10), (5, 1, 3, 3), 1, 1, 1),
    ("C=7 5x5 s2", (2, 7, 13, 11), (7, 1, 5, 5), 2, 2, 1),
    ("C=12 7x7", (1, 12, 15, 14), (12, 1, 7, 7), 1, 3, 1),
    ("C=36 3x3 s2", (2, 36, 17, 16), (36, 1, 3, 3), 2, 1, 1),
    ("C=8 3x3", (2, 8, 11, 9), (8, 1, 3, 3), 1, 1, 1),
    ("C=64 5x5 per-side padding", (1, 64, 10, 12), (64, 1, 5, 5), 1, ((0, 4), (3, 1)), 1),
    ("C=5 M=2", (2, 5, 8, 9), (10, 1, 3, 3), 1, 1, 1),
    ("C=7 M=3 5x3 s(1,2)", (1, 7, 12, 13), (21, 1, 5, 3), (1, 2), (2, 1), 1),
    ("C=12 M=3 dilation 2 s2", (1, 12, 14, 13), (36, 1, 3, 3), 2, 2, 2),
    ("C=36 M=2 7x7", (1, 36, 9, 10), (72, 1, 7, 7), 1, 3, 1),
    ("1x1 C=12", (2, 12, 7, 9), (12, 1, 1, 1), 1, 0, 1),
    ("1x1 C=5 M=2 s2", (2, 5, 9, 9), (10, 1, 1, 1), 2, 0, 1),
    ("31x31 C=12", (1, 12, 33, 35), (12, 1, 31, 31), 1, 15, 1),
    ("31x31 C=5 asymmetric padding", (1, 5, 31, 31), (5, 1, 31, 31), 1, ((15, 14), (0, 30)), 1),
    ("C=960 7x7 image 3x3", (2, 960, 7, 7), (960, 1, 3, 3), 1, 1, 1),
    ("C=960 7x7 image 7x7", (2, 960, 7, 7), (960, 1, 7, 7), 1, 3, 1),
    ("C=960 M=2 5x5 s2", (1, 960, 7, 7), (1920, 1, 5, 5), 2, 2, 1),
    ("C=1000 3x3 s2 dilation 2", (2, 1000, 9, 8), (1000, 1, 3, 3), 2, 2, 2),
    # float32 5x5 stride 1 on rows 15 to 38 wide: the direct kernel at 2 items a thread where the
    # grid is large enough (since 2026-12-07), else the window kernel (one image; 2 images of 17-wide rows)
    ("C=240 5x5 28x28 16 images", (16, 240, 28, 28), (240, 1, 5, 5), 1, 2, 1),
    ("C=576 5x5 19x19 8 images", (8, 576, 19, 19), (576, 1, 5, 5), 1, 2, 1),
    ("C=40 5x5 23x38 56 images", (56, 40, 23, 38), (40, 1, 5, 5), 1, 2, 1),
    ("C=240 5x5 28x28 1 image", (1, 240, 28, 28), (240, 1, 5, 5), 1, 2, 1),
    ("C=24 5x5 20x17 valid", (2, 24, 20, 17), (24, 1, 5, 5), 1, 0, 1),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", NHWC_CASES, ids=lambda c: c[0])
def test_nhwc_cases_match_reference(case, dtype, rng):
    errors = _run_all_three(case, dtype, rng, layout="NHWC")
    record_errors("depthwise NHWC specifics", str(numpy.dtype(dtype)), errors)
    assert max(errors.values()) <= TOLERANCE[dtype], errors


def _misaligned(shape, dtype, values=None):
    """A C-contiguous device array one element past the start of its
    allocation: contiguous, but not 16-byte aligned, so kernels may not use
    16-byte vector loads or stores on it.  NaN-filled unless ``values``."""
    size = int(numpy.prod(shape))
    if values is None:
        flat = poisoned((size + 1,), dtype)
    else:
        host = numpy.zeros(size + 1, dtype)
        host[1:] = values.reshape(-1)
        flat = cupy.asarray(host)
    view = flat[1:].reshape(shape)
    assert view.flags.c_contiguous and view.data.ptr % 16 != 0
    return view


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "case",
    [
        ("C=16 3x3", (2, 16, 9, 10), (16, 1, 3, 3), 1, 1, 1),
        ("C=32 M=2 5x5 s2", (2, 32, 11, 9), (64, 1, 5, 5), 2, 2, 1),
        ("C=24 7x7", (1, 24, 10, 11), (24, 1, 7, 7), 1, 3, 1),
        ("C=16 4x4 generic", (1, 16, 9, 9), (16, 1, 4, 4), 1, "same", 1),
    ],
    ids=lambda c: c[0],
)
@pytest.mark.parametrize("which", ["all", "inputs", "outputs"])
def test_nhwc_misaligned_contiguous_views(case, which, dtype, rng):
    # Every array misaligned, or only the inputs, or only the outputs: a kernel
    # must check the alignment of every pointer it reads or writes in vectors.
    _, x_shape, w_shape, stride, padding, dilation = case
    conv = dict(stride=stride, padding=padding, dilation=dilation, layout="NHWC")
    g = _validate.conv_geometry(x_shape, w_shape, stride, padding, dilation)
    y_shape = _shape((g.batch, g.channels * g.multiplier, g.out_height, g.out_width), "NHWC")
    in_shape = _shape(x_shape, "NHWC")
    x = random(rng, in_shape, dtype)
    w = random(rng, w_shape, dtype)
    b = random(rng, w_shape[0], dtype)
    dy = random(rng, y_shape, dtype)
    if which == "outputs":
        x_gpu, w_gpu, b_gpu, dy_gpu = (cupy.asarray(a) for a in (x, w, b, dy))
    else:
        x_gpu, w_gpu, b_gpu, dy_gpu = (_misaligned(a.shape, dtype, a) for a in (x, w, b, dy))
    out = (lambda shape: poisoned(shape, dtype)) if which == "inputs" else (lambda shape: _misaligned(shape, dtype))
    y = cupy_dwgn.depthwise_conv2d(x_gpu, w_gpu, b_gpu, out=out(y_shape), **conv)
    dx = cupy_dwgn.depthwise_conv2d_backward_input(dy_gpu, w_gpu, in_shape, out=out(in_shape), **conv)
    dw = cupy_dwgn.depthwise_conv2d_backward_weight(dy_gpu, x_gpu, w_shape, out=out(w_shape), **conv)
    errors = {
        "forward": relative_error(y, reference.depthwise_conv2d(x, w, b, **conv)),
        "backward_input": relative_error(dx, reference.depthwise_conv2d_backward_input(dy, w, in_shape, **conv)),
        "backward_weight": relative_error(dw, reference.depthwise_conv2d_backward_weight(dy, x, w_shape, **conv)),
    }
    assert max(errors.values()) <= TOLERANCE[dtype], errors


def _direct_launch_data(x_shape, w_shape, padding, dtype, backward, rng, stride=1, layout="NCHW"):
    """Geometry, random source, weight and bias (forward only), and the
    float64 reference (its shape is the destination's) of a forward (source
    x) or backward-input (source grad_out) in ``layout``, for a kernel
    launched directly."""
    g = _validate.conv_geometry(x_shape, w_shape, stride, padding, 1, layout=layout)
    y_shape = _shape((g.batch, w_shape[0], g.out_height, g.out_width), layout)
    src = random(rng, y_shape if backward else x_shape, dtype)
    w = random(rng, w_shape, dtype)
    b = None if backward else random(rng, w_shape[0], dtype)
    conv = dict(stride=stride, padding=padding, layout=layout)
    if backward:
        want = reference.depthwise_conv2d_backward_input(src, w, x_shape, **conv)
    else:
        want = reference.depthwise_conv2d(src, w, b, **conv)
    return g, src, w, b, want


# The NCHW whole-plane kernel, launched directly (the dispatch takes it only
# where it is measured faster): odd and prime plane sizes, widths that are
# and are not multiples of its 4-column items (vector and element stores),
# every padding form, more planes than one block holds (its persistent walk
# over units, a partial last unit), and the cp.async path (aligned source;
# units that start between 16-byte boundaries where plane sizes are odd)
# against the element path (misaligned source); outputs through the shared
# output buffer where rows are not vector-stored, into an aligned or a
# misaligned destination (guard values on both sides stay untouched).
# Stride 2 (forward only): the EfficientNet / MobileNet planes (38 -> 19,
# 19 -> 10, 75 -> 38), odd and even sources, padding past the filter's half.
PLANE_CASES = [
    # (label, x shape, filter size, padding, takes the cp.async path when aligned[, stride])
    ("28x28 3x3 p1", (4, 40, 28, 28), 3, 1, True),
    ("13x11 3x3 p1", (3, 7, 13, 11), 3, 1, True),
    ("7x7 3x3 p1 many planes", (8, 300, 7, 7), 3, 1, True),
    ("14x14 5x5 p2", (2, 33, 14, 14), 5, 2, None),
    ("29x31 5x5 per-side padding", (2, 5, 29, 31), 5, ((0, 4), (3, 1)), True),
    ("21x21 3x3 p1 odd planes, many", (4, 70, 21, 21), 3, 1, True),
    ("14x14 7x7 p3", (2, 24, 14, 14), 7, 3, None),
    ("17x9 7x7 padding > filter", (1, 6, 17, 9), 7, 8, None),
    ("32x32 3x3 valid", (2, 9, 32, 32), 3, "valid", None),
    ("1x31 3x3 p1", (2, 5, 1, 31), 3, 1, None),
    ("56x56 3x3 p1", (1, 6, 56, 56), 3, 1, True),
    ("5x5 image 7x7 p3", (2, 3, 5, 5), 7, 3, None),
    ("38x38 3x3 p1 s2", (4, 40, 38, 38), 3, 1, True, 2),
    ("19x19 5x5 p2 s2", (3, 50, 19, 19), 5, 2, True, 2),
    ("75x75 5x5 p2 s2", (2, 3, 75, 75), 5, 2, True, 2),  # float32: bands (3 planes pass 48 KB)
    ("28x28 7x7 p3 s2", (2, 6, 28, 28), 7, 3, True, 2),
    ("13x16 3x3 per-side padding s2", (2, 5, 13, 16), 3, ((0, 1), (1, 0)), None, 2),
    ("9x9 5x5 p4 s2", (1, 7, 9, 9), 5, 4, None, 2),
    # bands: planes of more than 256 items (2 and 3 bands of one plane a unit), and float32 planes whose
    # buffers pass 48 KB; padding past the filter's half; stride 2 onto 75 x 75
    ("75x75 3x3 p1 bands", (2, 5, 75, 75), 3, 1, True),
    ("150x44 5x5 p2 bands", (1, 3, 150, 44), 5, 2, True),
    # 5x5 at stride 1 (2-byte items of 4 or 7 rows): a plane not a multiple of either, outputs through the
    # buffer; 16-row planes (vector stores); 7-row bands
    ("17x19 5x5 p2", (2, 6, 17, 19), 5, 2, True),
    ("16x16 5x5 p2", (3, 5, 16, 16), 5, 2, True),
    ("150x100 5x5 per-side padding bands", (1, 2, 150, 100), 5, ((1, 4), (2, 2)), True),
    # float16 reads the shared planes in 4-byte pairs, reaching past the rows: the most left padding
    # they serve (15 columns) and one more (their element path); the stride-2 7x7 overhang on odd rows
    ("9x40 5x5 left padding 15", (1, 3, 9, 40), 5, ((2, 2), (15, 1)), None),
    ("9x40 5x5 left padding 16", (1, 3, 9, 40), 5, ((2, 2), (16, 1)), None),
    ("27x29 7x7 p3 s2", (2, 3, 27, 29), 7, 3, None, 2),
    ("60x61 3x3 p1 float32 bands", (2, 4, 60, 61), 3, 1, True),
    ("70x66 7x7 p8 bands", (1, 3, 70, 66), 7, 8, True),
    # 7x7 at stride 1 (items of 4 or 7 rows): whole 7x7 planes; 4323 14x14 planes, more units of 15 planes
    # than 2 blocks an SM hold (4-row items), so persistent blocks walk two units and some a partial last one
    ("7x7 7x7 p3", (4, 9, 7, 7), 7, 3, True),
    ("14x14 7x7 p3 persistent", (33, 131, 14, 14), 7, 3, True),
    ("150x150 3x3 p1 s2 bands", (1, 3, 150, 150), 3, 1, True, 2),
    # a band wholly in the padding below (above) the image: it stages nothing, its outputs are the bias
    ("20x70 3x3 bottom padding 60 bands", (1, 2, 20, 70), 3, ((0, 60), (1, 1)), True),
    ("20x70 3x3 top padding 60 bands", (1, 2, 20, 70), 3, ((60, 0), (1, 1)), True),
    # backward-input: one row block of dx per plane from a far taller grad_out plane (global reads)
    ("4x90 3x3 bottom padding 100", (1, 3, 4, 90), 3, ((0, 100), (1, 1)), None),
]


@pytest.mark.parametrize("misaligned", ["aligned", "misaligned", "dst_misaligned"])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward_input"])
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d in _depthwise_nchw_plane.DTYPES], ids=str)
@pytest.mark.parametrize("case", PLANE_CASES, ids=lambda c: c[0])
def test_plane_kernel_matches_reference(case, dtype, backward, misaligned, rng):
    _, x_shape, k, padding, copies_async, *more = case
    stride = more[0] if more else 1
    g, src, w, b, want = _direct_launch_data(x_shape, (x_shape[1], 1, k, k), padding, dtype, backward, rng, stride)
    if backward and stride != 1:  # a strided backward-input is no correlation: the plane kernel declines it
        assert _depthwise_nchw_plane.plan(g, numpy.dtype(dtype), True, "int", 16, 16) is None
        return
    src_shape, dst_shape = src.shape, want.shape
    # dst with a NaN guard value on each side, one element past a 16-byte boundary unless aligned
    size = int(numpy.prod(dst_shape))
    lead = 16 // numpy.dtype(dtype).itemsize if misaligned == "aligned" else 1
    src_gpu = _misaligned(src_shape, dtype, src) if misaligned == "misaligned" else cupy.asarray(src)
    index = _launch.index_type(src_gpu.size, size)
    # Every R compiled for this filter (2-byte 5x5 at stride 1: 4 and 7; the rule picks one, forced here).
    for item_rows in _depthwise_nchw_plane.row_choices(numpy.dtype(dtype).itemsize, k, stride):
        guarded = poisoned((lead + size + 1,), dtype)
        dst = guarded[lead:lead + size].reshape(dst_shape)
        launch = _depthwise_nchw_plane.plan(
            g, numpy.dtype(dtype), backward, index, depthwise._alignment(src_gpu), depthwise._alignment(dst), item_rows
        )
        assert launch is not None and _depthwise_nchw_plane.launch_rows(launch) == item_rows
        raw_bytes, vector_stores, out_stage_bytes = (int(v) for v in launch.scalars[12:15])  # raw_bytes 0: the element path
        if misaligned == "misaligned":
            assert raw_bytes == 0 and out_stage_bytes == 0
        elif copies_async is not None:
            assert (raw_bytes > 0) == copies_async
            # outputs through the shared buffer where rows are not vector-stored (planes too large for it: bands)
            assert (out_stage_bytes > 0) == (copies_async and not vector_stores)
        launch(src_gpu, cupy.asarray(w), 0 if b is None else cupy.asarray(b), dst)
        assert bool(cupy.isnan(guarded[lead - 1])) and bool(cupy.isnan(guarded[-1])), ("a store outside dst", item_rows)
        error = relative_error(dst, want)
        record_errors("depthwise NCHW plane kernel", str(numpy.dtype(dtype)),
                      {("backward_input" if backward else "forward"): error})
        assert error <= TOLERANCE[dtype], item_rows


# Units of several whole planes of a multiple of 16 bytes, staged a gap apart
# (the PITCHED kernels: 2-byte 5x5 at stride 1, 4-row items): the
# power-of-two planes of 256-pixel inputs and U-Net latents (16x16, 8x8),
# per-side padding, at every gap the host may pick (and none), a partial
# last unit (planes not a multiple of P), >= 2**31 elements aside.
PITCHED_PLANE_CASES = [
    ("16x16", (3, 203, 16, 16), 2), ("8x8", (5, 121, 8, 8), 2), ("12x12 per-side padding", (4, 150, 12, 12), ((0, 4), (3, 1))),
]


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward_input"])
@pytest.mark.parametrize("dtype", [d for d in DTYPES if numpy.dtype(d).itemsize == 2], ids=str)
@pytest.mark.parametrize("case", PITCHED_PLANE_CASES, ids=lambda c: c[0])
def test_plane_kernel_pitched_units_match_reference(case, dtype, backward, rng):
    _, x_shape, padding = case
    g, src, w, b, want = _direct_launch_data(x_shape, (x_shape[1], 1, 5, 5), padding, dtype, backward, rng)
    src_gpu, w_gpu, b_gpu = cupy.asarray(src), cupy.asarray(w), 0 if b is None else cupy.asarray(b)
    plane_bytes = src.shape[2] * src.shape[3] * numpy.dtype(dtype).itemsize
    assert _depthwise_nchw_plane.pitch_capable(numpy.dtype(dtype).itemsize, 5, 1, 4)
    for gap in (0, *_depthwise_nchw_plane._PITCH_GAPS):
        dst = poisoned(want.shape, dtype)
        launch = _depthwise_nchw_plane.plan(g, numpy.dtype(dtype), backward, "int", 16, 16, 4, gap)
        per_unit, src_pitch = int(launch.scalars[8]), int(launch.scalars[15])
        assert per_unit > 1 and src_pitch * numpy.dtype(dtype).itemsize == plane_bytes + gap
        launch(src_gpu, w_gpu, b_gpu, dst)
        error = relative_error(dst, want)
        record_errors("depthwise NCHW plane kernel", str(numpy.dtype(dtype)),
                      {("backward_input" if backward else "forward"): error})
        assert error <= TOLERANCE[dtype], gap


# The tensor-core forward / backward-input kernel (_depthwise_conv_mma),
# launched directly: the plane kernel's cases (odd, prime and one-row
# planes, every padding form, many planes a call, partial last units; the
# forward at stride 2 on EfficientNet's planes and bands) and planes of several row tiles and column strips (56, 112 and 150
# wide: bands of rows), 14x14 planes (8 a unit), valid correlations; NCHW
# rows copied in 16-, 8-, 4-byte pieces or 2-byte loads (odd widths, a
# misaligned source), into an aligned or a misaligned destination with
# guard values on both sides; NHWC with the channels rounded up to a
# multiple of 8 (misaligned arrays refused).
MMA_CASES = PLANE_CASES + [
    ("56x56 7x7 p3", (2, 5, 56, 56), 7, 3, None),
    ("14x14 3x3 p1 many planes", (4, 70, 14, 14), 3, 1, None),
    ("112x112 3x3 p1", (1, 3, 112, 112), 3, 1, None),
    ("150x150 5x5 p2", (1, 2, 150, 150), 5, 2, None),
    ("19x19 5x5 p2", (2, 9, 19, 19), 5, 2, None),
    ("28x36 5x5 per-side padding", (2, 4, 28, 36), 5, ((2, 0), (4, 1)), None),
    ("40x24 7x7 valid", (1, 3, 40, 24), 7, "valid", None),
    ("100x130 3x3 padding rows at band edges", (1, 2, 100, 130), 3, ((5, 0), (1, 1)), None),
    ("112x112 7x7 p3 s2 bands", (1, 3, 112, 112), 7, 3, None, 2),
    ("30x20 3x3 top padding 100 s2", (1, 2, 30, 20), 3, ((100, 0), (1, 1)), None, 2),
]


def _mma_plan(g, dtype, backward, layout, src, dst):
    index = _launch.index_type(src.size, dst.size)
    return _depthwise_conv_mma.plan(g, numpy.dtype(dtype), backward, layout, index, depthwise._alignment(src),
                                    depthwise._alignment(dst))


def _mma_data(case, dtype, backward, layout, rng):
    """_direct_launch_data of an MMA case in ``layout`` (NHWC: C rounded up
    to a multiple of 8)."""
    _, (n, c, h, w), k, padding, _, *more = case
    if layout == "NHWC":
        c = -(-c // 8) * 8
    x_shape = (n, c, h, w) if layout == "NCHW" else (n, h, w, c)
    return _direct_launch_data(x_shape, (c, 1, k, k), padding, dtype, backward, rng, more[0] if more else 1, layout)


@pytest.mark.parametrize("layout, misaligned", [("NCHW", "aligned"), ("NCHW", "misaligned"), ("NCHW", "dst_misaligned"),
                                                ("NHWC", "aligned"), ("NHWC", "misaligned")])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward_input"])
@pytest.mark.parametrize("dtype", _depthwise_conv_mma.DTYPES, ids=str)
@pytest.mark.parametrize("case", MMA_CASES, ids=lambda c: c[0])
def test_conv_mma_kernel_matches_reference(case, dtype, backward, layout, misaligned, rng):
    g, src, w, b, want = _mma_data(case, dtype, backward, layout, rng)
    size = int(numpy.prod(want.shape))
    lead = 16 // numpy.dtype(dtype).itemsize if misaligned != "dst_misaligned" else 1
    guarded = poisoned((lead + size + 1,), dtype)
    dst = guarded[lead:lead + size].reshape(want.shape)
    src_gpu = _misaligned(src.shape, dtype, src) if misaligned == "misaligned" else cupy.asarray(src)
    launch = _mma_plan(g, dtype, backward, layout, src_gpu, dst)
    if backward and g.stride_h != 1:  # a strided backward-input is no correlation: the kernel declines it
        assert launch is None
        return
    _, _, _, _, offset_top, offset_left = _validate.correlation_frame(g, backward)
    if (not (offset_top >= 0 and 0 <= offset_left <= _depthwise_conv_mma.LEFT)
            or (layout == "NHWC" and misaligned != "aligned") or _depthwise_conv_mma.units(g, backward, layout) is None):
        assert launch is None  # offsets past the image's padding, NHWC pixels not 16-byte aligned, no unit fits
        return
    assert launch is not None
    if layout == "NCHW":
        row_bytes = 2 * src.shape[3]
        piece = 2 if misaligned == "misaligned" else next(p for p in (16, 8, 4, 2) if row_bytes % p == 0)
        assert int(launch.scalars[13]) == piece
    w_gpu, b_gpu = cupy.asarray(w), 0 if b is None else cupy.asarray(b)
    launch(src_gpu, w_gpu, b_gpu, dst)
    assert bool(cupy.isnan(guarded[lead - 1])) and bool(cupy.isnan(guarded[-1])), "a store outside dst"
    error = relative_error(dst, want)
    record_errors(f"depthwise {layout} tensor-core kernel", str(numpy.dtype(dtype)),
                  {("backward_input" if backward else "forward"): error})
    assert error <= TOLERANCE[dtype]
    first = dst.view(cupy.uint16).copy()
    dst.fill(numpy.nan)
    launch(src_gpu, w_gpu, b_gpu, dst)
    assert bool((dst.view(cupy.uint16) == first).all()), "not bit-identical run to run"


# Kernel modules with a MODE (the forward / backward-input ones): forced one at a time.
_FORWARD_MODE_MODULES = (_depthwise_conv_mma, _depthwise_nchw_forward_regs, _depthwise_nchw_rows,
                         _depthwise_nhwc_direct, _depthwise_nhwc_phase, _depthwise_nhwc_ring, _depthwise_nhwc_window)


def _each_forward_kernel(monkeypatch, build, g, layout, src, dst):
    """Yield the kernel names of the forward / backward-input Steps the ops
    take with their rule, with each MODE module forced ("always", the others
    "never") and with all of them "never", once per distinct kernel; the ops
    run that kernel until the next iteration."""
    seen = set()
    variants = [{}] + [{m: "always" if m is module else "never" for m in _FORWARD_MODE_MODULES}
                       for module in _FORWARD_MODE_MODULES] + [{m: "never" for m in _FORWARD_MODE_MODULES}]
    for modes in variants:
        for module in _FORWARD_MODE_MODULES:
            monkeypatch.setattr(module, "MODE", modes.get(module, "rule"))
        monkeypatch.setattr(depthwise, "_SIGNATURES", {})
        name = "+".join(launch.expression.split("<")[0] for launch in build(g, layout, src, dst).launches)
        if name not in seen:
            seen.add(name)
            yield name


# (x shape NCHW, filter size, stride, padding, dilation): the shapes whose rules and forced modes reach
# every forward / backward-input kernel (3x3 to 13x13, stride 2, dilation, C not a multiple of 8).
_NON_FINITE_WEIGHT_CASES = [((2, 16, 14, 14), 3, 1, 1, 1), ((2, 16, 28, 28), 3, 2, 1, 1), ((2, 16, 14, 14), 5, 1, 2, 1),
                            ((2, 16, 14, 14), 7, 1, 3, 1), ((2, 8, 20, 20), 13, 1, 6, 1), ((2, 5, 11, 9), 3, 1, 2, 2),
                            ((2, 8, 17, 17), 3, 2, 1, 1)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward_input"])
@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float16], ids=str)
def test_non_finite_weights_reach_the_outputs_they_multiply(dtype, backward, layout, rng, monkeypatch):
    # README "Numerics": an inf or NaN weight makes non-finite every output where it multiplies an
    # image (grad_out) value, in every kernel; where it meets only the zero padding the result is
    # the kernel's (NaN from 0 * inf, or finite where padded taps are skipped), but never outside
    # its channel, and a finite result there is the convolution without that tap.  Outputs start
    # at a finite sentinel, so an unwritten one fails too.
    for x_shape, k, stride, padding, dilation in _NON_FINITE_WEIGHT_CASES:
        n, c = x_shape[:2]
        w = rng.standard_normal((c, 1, k, k)).astype(dtype)
        bad_taps = {(0, 0, 0): numpy.inf, (1, k - 1, k // 2): numpy.nan, (2, k // 2, k - 1): -numpy.inf}
        indicator = numpy.zeros((c, 1, k, k))
        for (ch, i, j), value in bad_taps.items():
            w[ch, 0, i, j] = value
            indicator[ch, 0, i, j] = 1.0
        w_clean = numpy.where(indicator > 0, 0, w).astype(dtype)
        conv = dict(stride=stride, padding=padding, dilation=dilation, layout=layout)
        g = _validate.conv_geometry(_shape(x_shape, layout), (c, 1, k, k), stride, padding, dilation, layout=layout)
        out_shape = _shape((n, c, g.out_height, g.out_width), layout)
        src = random(rng, out_shape if backward else _shape(x_shape, layout), dtype)
        ones = numpy.ones(src.shape)
        if backward:
            want = reference.depthwise_conv2d_backward_input(src, w_clean, _shape(x_shape, layout), **conv)
            hit = reference.depthwise_conv2d_backward_input(ones, indicator, _shape(x_shape, layout), **conv) > 0
        else:
            want = reference.depthwise_conv2d(src, w_clean, None, **conv)
            hit = reference.depthwise_conv2d(ones, indicator, None, **conv) > 0
        in_bad_channels = numpy.zeros(want.shape, bool)
        _channels(in_bad_channels, 0, 3, layout)[...] = True
        src_gpu, w_gpu = cupy.asarray(src), cupy.asarray(w)
        dst = cupy.empty(want.shape, dtype)
        build = depthwise._backward_input_steps if backward else depthwise._forward_steps
        for name in _each_forward_kernel(monkeypatch, build, g, layout, src_gpu, dst):
            dst.fill(12345.0)
            if backward:
                depthwise.depthwise_conv2d_backward_input(src_gpu, w_gpu, _shape(x_shape, layout), out=dst, **conv)
            else:
                depthwise.depthwise_conv2d(src_gpu, w_gpu, out=dst, **conv)
            got = cupy.asnumpy(dst).astype(numpy.float64)
            finite = numpy.isfinite(got)
            where = (name, x_shape, k, stride)
            assert not finite[hit].any(), (where, "an output that multiplies a non-finite weight is finite")
            assert finite[~in_bad_channels].all(), (where, "a non-finite output outside the bad weights' channels")
            assert relative_error(got[finite], want[finite]) <= TOLERANCE[numpy.dtype(dtype)], where


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward_input"])
@pytest.mark.parametrize("dtype", _depthwise_conv_mma.DTYPES, ids=str)
def test_conv_mma_keeps_non_finite_values_in_their_windows(dtype, backward, layout, rng):
    # A tile's product also meets the values beside each output's window
    # (with B's zeros: 0 * inf is NaN); the kernel recomputes such strips
    # output by output, so exactly the outputs whose windows hold the inf or
    # NaN are non-finite, as in the reference, and the rest match it.
    inf, nan = numpy.inf, numpy.nan
    for k, padding, spots in (
        (3, 1, [((0, 1, 5, 9), inf), ((1, 2, 0, 0), nan)]), (5, 2, [((1, 3, 0, 0), -inf), ((0, 2, 13, 7), inf)]),
        (7, 3, [((1, 0, 6, 13), inf)]), (7, 0, [((0, 4, 5, 2), inf)]),
    ):
        g, src, w, b, _ = _direct_launch_data((2, 8, 14, 18), (8, 1, k, k), padding, dtype, backward, rng)
        for spot, value in spots:
            src[spot] = value
        conv = dict(padding=padding, layout=layout)
        src = _to_layout(src, layout)
        x_shape = _shape((2, 8, 14, 18), layout)
        g = _validate.conv_geometry(x_shape, (8, 1, k, k), 1, padding, 1, layout=layout)
        if backward:
            want = reference.depthwise_conv2d_backward_input(src, w, x_shape, **conv)
        else:
            want = reference.depthwise_conv2d(src, w, b, **conv)
        finite = numpy.isfinite(want)
        assert finite.any() and not finite.all()
        src_gpu = cupy.asarray(src)
        dst = poisoned(want.shape, dtype)
        launch = _mma_plan(g, dtype, backward, layout, src_gpu, dst)
        launch(src_gpu, cupy.asarray(w), 0 if b is None else cupy.asarray(b), dst)
        assert bool((cupy.isfinite(dst).get() == finite).all()), (k, padding, spots)
        assert relative_error(dst.get()[finite], want[finite]) <= TOLERANCE[dtype]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", _depthwise_conv_mma.DTYPES, ids=str)
def test_conv_mma_dispatch_follows_the_mode(dtype, layout, rng, monkeypatch):
    # MODE "always" / "rule" / "never": the ops launch the kernel exactly where
    # the mode says (and its rule where "rule"), with bias, and the results
    # match the reference; stride 3, dilation 2, a depth multiplier, float32
    # and (NHWC) C not a multiple of 8 keep the other kernels under "always".
    for mode in ("always", "rule", "never"):
        monkeypatch.setattr(_depthwise_conv_mma, "MODE", mode)
        monkeypatch.setattr(depthwise, "_SIGNATURES", {})
        # (7x7 on 28x30: NCHW planes the rule takes)
        for k, padding, (h, w_) in ((3, 1, (20, 22)), (5, ((1, 3), (2, 2)), (20, 22)), (7, 3, (20, 22)), (7, 3, (28, 30))):
            shape = _shape((2, 8, h, w_), layout)
            g, x, w, b, want = _direct_launch_data(shape, (8, 1, k, k), padding, dtype, False, rng, layout=layout)
            conv = dict(padding=padding, layout=layout)
            x_gpu, w_gpu = cupy.asarray(x), cupy.asarray(w)
            y = cupy_dwgn.depthwise_conv2d(x_gpu, w_gpu, cupy.asarray(b), out=poisoned(want.shape, dtype), **conv)
            steps = depthwise._forward_steps(g, layout, x_gpu, y)
            taken = steps.launches[0].expression.startswith(_depthwise_conv_mma.KERNEL)
            rule = _depthwise_conv_mma.preferred(g, dtype, False, layout)
            assert taken == (mode == "always" or (mode == "rule" and rule))
            assert relative_error(y, want) <= TOLERANCE[dtype]
            dy = cupy.asarray(random(rng, want.shape, dtype))
            dx = cupy_dwgn.depthwise_conv2d_backward_input(dy, w_gpu, shape, out=poisoned(shape, dtype), **conv)
            steps = depthwise._backward_input_steps(g, layout, dy, dx)
            taken = steps.launches[0].expression.startswith(_depthwise_conv_mma.KERNEL)
            rule = _depthwise_conv_mma.preferred(g, dtype, True, layout)
            assert taken == (mode == "always" or (mode == "rule" and rule))
            want_dx = reference.depthwise_conv2d_backward_input(dy.get(), w, shape, **conv)
            assert relative_error(dx, want_dx) <= TOLERANCE[dtype]
    monkeypatch.setattr(_depthwise_conv_mma, "MODE", "always")
    for (n, c, h, w_), w_shape, stride, dilation, dtype_other in (
        ((2, 8, 20, 22), (8, 1, 3, 3), 3, 1, dtype), ((2, 8, 20, 22), (8, 1, 3, 3), 1, 2, dtype),
        ((2, 8, 20, 22), (16, 1, 3, 3), 1, 1, dtype), ((2, 8, 20, 22), (8, 1, 3, 3), 1, 1, numpy.float32),
    ) + ((((2, 12, 20, 22), (12, 1, 3, 3), 1, 1, dtype),) if layout == "NHWC" else ()):
        shape = _shape((n, c, h, w_), layout)
        g = _validate.conv_geometry(shape, w_shape, stride, 1, dilation, layout=layout)
        x_gpu = cupy.zeros(shape, dtype_other)
        steps = depthwise._forward_steps(g, layout, x_gpu, x_gpu)
        assert not steps.launches[0].expression.startswith(_depthwise_conv_mma.KERNEL)


def test_plane_kernel_rule_and_dispatch():
    # The rule picks it for the measured shapes, and the op then launches it.
    g = _validate.conv_geometry((64, 384, 28, 28), (384, 1, 3, 3), 1, 1, 1)
    assert _depthwise_nchw_plane.preferred(g, numpy.dtype(numpy.float16), False)
    assert not _depthwise_nchw_plane.preferred(g, numpy.dtype(numpy.float64), False)
    x = cupy.zeros((2, 8, 28, 28), numpy.float16)
    g = _validate.conv_geometry(x.shape, (8, 1, 3, 3), 1, 1, 1)
    steps = depthwise._forward_steps(g, "NCHW", x, x)
    assert steps.launches[0].expression.startswith(_depthwise_nchw_plane.KERNEL)
    # stride 2: EfficientNet's 38 -> 19 in half types, through the public op on poisoned outputs
    x = cupy.asarray(random(numpy.random.default_rng(5), (2, 8, 38, 38), numpy.float16))
    w = cupy.asarray(random(numpy.random.default_rng(6), (8, 1, 3, 3), numpy.float16))
    g = _validate.conv_geometry(x.shape, w.shape, 2, 1, 1)
    steps = depthwise._forward_steps(g, "NCHW", x, x)
    assert steps.launches[0].expression == f"{_depthwise_nchw_plane.KERNEL}<__half, 3, 3, 2, false, 4, false, int>"
    y = cupy_dwgn.depthwise_conv2d(x, w, stride=2, padding=1, out=poisoned((2, 8, 19, 19), numpy.float16))
    want = reference.depthwise_conv2d(cupy.asnumpy(x), cupy.asnumpy(w), stride=2, padding=1)
    assert relative_error(y, want) <= TOLERANCE[numpy.dtype(numpy.float16)]
    # Through the ops, forward and backward-input: EfficientNet's 75 x 75
    # planes are whole-plane units (2-byte 3x3 at stride 1: R x 4 items,
    # R of _pick_rows), 150 x 150 ones bands of rows.
    for hw, bands in ((75, 1), (150, 5)):
        x = cupy.asarray(random(numpy.random.default_rng(7), (2, 4, hw, hw), numpy.float16))
        w4 = w[:4]
        g = _validate.conv_geometry(x.shape, w4.shape, 1, 1, 1)
        for steps in (depthwise._forward_steps(g, "NCHW", x, x), depthwise._backward_input_steps(g, "NCHW", x, x)):
            assert steps.launches[0].expression.startswith(_depthwise_nchw_plane.KERNEL)
            assert int(steps.launches[0].scalars[9]) == bands  # num_bands
        y = cupy_dwgn.depthwise_conv2d(x, w4, padding=1, out=poisoned(x.shape, numpy.float16))
        dx = cupy_dwgn.depthwise_conv2d_backward_input(x, w4, x.shape, padding=1, out=poisoned(x.shape, numpy.float16))
        x64, w64 = cupy.asnumpy(x), cupy.asnumpy(w4)
        assert relative_error(y, reference.depthwise_conv2d(x64, w64, padding=1)) <= TOLERANCE[numpy.dtype(numpy.float16)]
        want = reference.depthwise_conv2d_backward_input(x64, w64, x.shape, padding=1)
        assert relative_error(dx, want) <= TOLERANCE[numpy.dtype(numpy.float16)]


@pytest.mark.parametrize("dtype", ROUTE_DTYPES, ids=str)
@pytest.mark.parametrize("side", sorted(ROUTES_7X7))
def test_nchw_7x7_routes_match_reference(side, dtype):
    # Through the public ops on poisoned outputs, forward and backward-input,
    # with a bias and 12 planes: the family taken and the values.
    dtype = numpy.dtype(dtype)
    family = route_kernel(ROUTES_7X7[side][ROUTE_DTYPES.index(dtype)])
    rng = numpy.random.default_rng(side)
    shape = (2, 12, side, side)
    x = cupy.asarray(random(rng, shape, dtype))
    w = cupy.asarray(random(rng, (12, 1, 7, 7), dtype))
    b = cupy.asarray(random(rng, (12,), dtype))
    g = _validate.conv_geometry(shape, w.shape, 1, 3, 1)
    for expression in nchw_launch_expressions(g, x):
        assert expression.startswith(family), expression
    y = cupy_dwgn.depthwise_conv2d(x, w, b, padding=3, out=poisoned(shape, dtype))
    dx = cupy_dwgn.depthwise_conv2d_backward_input(x, w, shape, padding=3, out=poisoned(shape, dtype))
    x64, w64, b64 = cupy.asnumpy(x), cupy.asnumpy(w), cupy.asnumpy(b)
    assert relative_error(y, reference.depthwise_conv2d(x64, w64, b64, padding=3)) <= TOLERANCE[dtype]
    assert relative_error(dx, reference.depthwise_conv2d_backward_input(x64, w64, shape, padding=3)) <= TOLERANCE[dtype]



@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset"])
@pytest.mark.parametrize("route", NARROW_FLOAT32_ROUTES, ids=lambda r: f"{r[0][0]}x{r[0][1]}x8 {r[1]}x{r[1]}")
def test_narrow_float32_routes_match_reference(route, offset):
    # float32 onto 8-wide rows at stride 1 through the public ops on poisoned
    # outputs, forward with a bias and backward-input: the family taken (the
    # register row walk or the row kernel) and the values; "offset" views
    # start 4 bytes into their buffer, where the row kernel keeps them.
    (batch, channels), k, family = route
    family = family if offset == 0 else "rows"
    rng = numpy.random.default_rng(channels + k)
    shape = (batch, channels, 8, 8)
    size = batch * channels * 64
    x = cupy.empty(size + offset, numpy.float32)[offset:].reshape(shape)
    x[...] = cupy.asarray(random(rng, shape, numpy.float32))
    w = cupy.asarray(random(rng, (channels, 1, k, k), numpy.float32))
    b = cupy.asarray(random(rng, (channels,), numpy.float32))
    g = _validate.conv_geometry(shape, w.shape, 1, k // 2, 1)
    for expression in nchw_launch_expressions(g, x):
        assert expression.startswith(route_kernel(family)), expression
    out = cupy.empty(size + offset, numpy.float32)[offset:].reshape(shape)
    out.fill(numpy.nan)
    y = cupy_dwgn.depthwise_conv2d(x, w, b, padding=k // 2, out=out)
    dx = cupy_dwgn.depthwise_conv2d_backward_input(x, w, shape, padding=k // 2, out=poisoned(shape, numpy.float32))
    x64, w64, b64 = cupy.asnumpy(x), cupy.asnumpy(w), cupy.asnumpy(b)
    tolerance = TOLERANCE[numpy.dtype(numpy.float32)]
    assert relative_error(y, reference.depthwise_conv2d(x64, w64, b64, padding=k // 2)) <= tolerance
    assert relative_error(dx, reference.depthwise_conv2d_backward_input(x64, w64, shape, padding=k // 2)) <= tolerance

# The NCHW register-window kernel, launched directly on poisoned outputs:
# its fixed copies (whole planes per unit, row staging by cp.async: each
# thread's copy offsets worked out once) against the general staging, for
# one plane per unit and several with a partial last unit, the backward's M
# source planes per destination plane, padding rows at the top or only at the
# bottom, 16-byte copies at the limit of 4 per thread, 5x5, and shapes the
# fixed copies do not serve (bands, the forward at multiplier 2, narrow
# staging).  (label, x shape, multiplier, filter size, padding, fixed copies
# expected for float16/bfloat16, for float32, for float64 (the forward at
# multiplier > 1: none); None: either.)
WINDOW_CASES = [
    ("56x56 3x3 p1", (1, 6, 56, 56), 1, 3, 1, True, True, False),
    ("32x32 3x3 p1 5 planes", (1, 5, 32, 32), 1, 3, 1, True, False, False),
    ("40x40 3x3 p1 multiplier 2", (2, 3, 40, 40), 2, 3, 1, True, True, True),
    ("56x56 5x5 p2", (1, 4, 56, 56), 1, 5, 2, True, True, False),
    ("48x48 3x3 padding rows top and bottom", (1, 3, 48, 48), 1, 3, ((2, 3), (1, 1)), None, None, None),
    ("48x48 3x3 no top padding", (1, 3, 48, 48), 1, 3, ((0, 1), (1, 1)), True, True, False),
    ("36x36 3x3 p1", (1, 4, 36, 36), 1, 3, 1, False, False, True),
    ("40x40 3x3 valid", (2, 3, 40, 40), 1, 3, "valid", False, False, False),
    ("112x112 3x3 p1 bands", (1, 2, 112, 112), 1, 3, 1, False, False, False),
]


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward_input"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: c[0])
def test_nchw_window_kernel_matches_reference(case, dtype, backward, rng):
    _, x_shape, multiplier, k, padding, *expected = case
    g, src, w, b, want = _direct_launch_data(x_shape, (x_shape[1] * multiplier, 1, k, k), padding, dtype, backward,
                                             rng)
    src_gpu, dst = cupy.asarray(src), poisoned(want.shape, dtype)
    index = _launch.index_type(src_gpu.size, dst.size)
    launch = _depthwise_nchw_window.plan(
        g, numpy.dtype(dtype), backward, index, depthwise._alignment(src_gpu), depthwise._alignment(dst) == 16
    )
    assert launch is not None
    fixed_copies = int(launch.scalars[-1])
    want_fixed = expected[{2: 0, 4: 1, 8: 2}[numpy.dtype(dtype).itemsize]]
    if not backward and multiplier > 1:
        want_fixed = False  # forward source planes repeat M times: not an arithmetic sequence
    if want_fixed is not None:
        assert (fixed_copies > 0) == want_fixed, fixed_copies
    assert fixed_copies <= _depthwise_nchw_window.MAX_FIXED_COPIES
    launch(src_gpu, cupy.asarray(w), 0 if b is None else cupy.asarray(b), dst)
    error = relative_error(dst, want)
    record_errors("depthwise NCHW window kernel", str(numpy.dtype(dtype)),
                  {("backward_input" if backward else "forward"): error})
    assert error <= TOLERANCE[dtype]


# The NCHW window kernel's flat staging of bands (planes too large for one
# unit whose rows are not 4-byte aligned: odd widths of 2-byte types, taken
# flat per FLAT_BANDS_BELOW; the wider types stage them row by row), launched
# directly on poisoned outputs: several planes so that a block walks bands of
# different planes and positions (a band's padding rows held the previous
# band's image rows), padding rows at the top and bottom, per-side padding
# larger than the filter's reach, stride 2, and a 16-byte misaligned source.
# (label, x shape, filter size, stride, padding, source offset in elements)
WINDOW_BAND_CASES = [
    ("75x75 3x3 p1", (2, 3, 75, 75), 3, 1, 1, 0),
    ("99x91 5x5 p2", (1, 3, 99, 91), 5, 1, 2, 0),
    ("95x81 7x7 p3", (1, 2, 95, 81), 7, 1, 3, 0),
    ("75x75 3x3 rows padded 2/3", (1, 3, 75, 75), 3, 1, ((2, 3), (1, 1)), 0),
    ("101x91 5x5 rows padded 0/6", (1, 2, 101, 91), 5, 1, ((0, 6), (2, 2)), 0),
    ("151x151 3x3 s2 p1", (1, 3, 151, 151), 3, 2, 1, 0),
    ("149x133 5x5 s2 p2", (1, 2, 149, 133), 5, 2, 2, 0),
    ("75x75 3x3 p1 source offset 1", (1, 3, 75, 75), 3, 1, 1, 1),
]


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward_input"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", WINDOW_BAND_CASES, ids=lambda c: c[0])
def test_nchw_window_banded_flat_staging(case, dtype, backward, rng):
    _, x_shape, k, stride, padding, offset = case
    if backward and stride != 1:
        pytest.skip("the window kernel's backward-input is stride 1 only")
    g, src, w, b, want = _direct_launch_data(x_shape, (x_shape[1], 1, k, k), padding, dtype, backward, rng, stride)
    # The source at `offset` elements past a 256-byte aligned allocation.
    storage = cupy.empty(src.size + offset, dtype)
    src_gpu = storage[offset:].reshape(src.shape)
    src_gpu[...] = cupy.asarray(src)
    dst = poisoned(want.shape, dtype)
    launch = _depthwise_nchw_window.plan(
        g, numpy.dtype(dtype), backward, "int", depthwise._alignment(src_gpu), depthwise._alignment(dst) == 16
    )
    assert launch is not None
    bands, stage_bytes, flat_elems = (int(launch.scalars[i]) for i in (11, 15, 17))
    assert bands > 1
    assert (flat_elems > 0) == (stage_bytes < _depthwise_nchw_window.FLAT_BANDS_BELOW)
    if numpy.dtype(dtype).itemsize == 2:
        assert flat_elems > 0  # odd widths: rows not 4-byte aligned
    launch(src_gpu, cupy.asarray(w), 0 if b is None else cupy.asarray(b), dst)
    error = relative_error(dst, want)
    record_errors("depthwise NCHW window kernel", str(numpy.dtype(dtype)),
                  {("backward_input" if backward else "forward"): error})
    assert error <= TOLERANCE[dtype]


# The NCHW register row walk (_depthwise_nchw_forward_regs), launched
# directly on NaN-poisoned outputs, forward and (stride 1) backward-input:
# the benchmark planes (56-wide rows of 8 2-byte values, stride-2 rows of
# two 16-byte source vectors, 5x5 stride 2), odd widths (VW 1), per-side
# and oversized padding, 1-row and 7x7 planes, strips cut by the bottom,
# rows wider than a warp (segments: dead lanes, halos loaded at segment
# edges), stride 2 with odd sizes and TensorFlow "same" padding (pad_left -
# K // 2 odd at stride 2: not served), a source 4 bytes off 16 (narrower
# vectors; float32 at stride 2: not served).
FORWARD_REGS_CASES = [
    # (label, NCHW x shape, filter size, stride, padding)
    ("56x56 C=3 3x3 s1 p1", (2, 3, 56, 56), 3, 1, 1),
    ("28x28 C=5 3x3 s1 p1", (1, 5, 28, 28), 3, 1, 1),
    ("13x11 C=3 3x3 s1 p1", (2, 3, 13, 11), 3, 1, 1),
    ("40x12 C=3 3x3 s1 strips", (2, 3, 40, 12), 3, 1, 1),
    ("9x10 C=1 5x5 s1 per-side", (1, 1, 9, 10), 5, 1, ((0, 4), (3, 1))),
    ("36x20 C=2 5x5 s1 strips", (2, 2, 36, 20), 5, 1, 2),
    ("7x7 C=2 7x7 s1 p3", (3, 2, 7, 7), 7, 1, 3),
    ("5x9 C=1 7x7 s1 padding > filter", (1, 1, 5, 9), 7, 1, ((8, 2), (0, 8))),
    ("1x12 C=1 3x3 s1 (1, 0)", (2, 1, 1, 12), 3, 1, (1, 0)),
    ("6x272 C=1 3x3 s1 segments", (1, 1, 6, 272), 3, 1, 1),
    ("3x264 C=1 5x5 s1 segments", (1, 1, 3, 264), 5, 1, 2),
    ("112x112 C=2 3x3 s2 p1", (1, 2, 112, 112), 3, 2, 1),
    ("56x56 C=3 3x3 s2 p1", (2, 3, 56, 56), 3, 2, 1),
    ("56x56 C=2 5x5 s2 p2", (1, 2, 56, 56), 5, 2, 2),
    ("13x14 C=3 3x3 s2 p1", (2, 3, 13, 14), 3, 2, 1),
    ("17x16 C=1 5x5 s2 per-side", (1, 1, 17, 16), 5, 2, ((4, 0), (2, 2))),
    ("15x14 C=2 7x7 s2 p3", (1, 2, 15, 14), 7, 2, 3),
    ("12x16 C=2 3x3 s2 TF same", (1, 2, 12, 16), 3, 2, ((0, 1), (0, 1))),
    ("4x520 C=1 3x3 s2 segments", (1, 1, 4, 520), 3, 2, 1),
]
FORWARD_REGS_DTYPES = [d for d in DTYPES if numpy.dtype(d) in _depthwise_nchw_forward_regs.DTYPES]


def _check_nchw_forward_regs(case, dtype, backward, src_offset, rng):
    label, x_shape, k, stride, padding = case
    if backward and stride != 1:
        pytest.skip("the register row walk's backward-input is stride 1 only")
    g, src, w, b, want = _direct_launch_data(x_shape, (x_shape[1], 1, k, k), padding, dtype, backward, rng, stride)
    src_gpu = _offset_view(src.shape, dtype, src_offset, src)
    dst = poisoned(want.shape, dtype)
    launch = _depthwise_nchw_forward_regs.plan(g, numpy.dtype(dtype), backward, depthwise._alignment(src_gpu),
                                               depthwise._alignment(dst))
    if launch is None:
        # Only a stride-2 walk whose source vectors (>= 2 values) cannot be aligned.
        offset_left = _validate.correlation_frame(g, backward)[5]
        itemsize = numpy.dtype(dtype).itemsize
        assert stride == 2 and ((offset_left - k // 2) % 2 or src_offset % (2 * itemsize) or g.width % 2), label
        return
    launch(src_gpu, cupy.asarray(w), 0 if b is None else cupy.asarray(b), dst)
    error = relative_error(dst, want)
    record_errors("depthwise NCHW register row walk", str(numpy.dtype(dtype)),
                  {("backward_input" if backward else "forward"): error})
    assert error <= TOLERANCE[dtype], label


@pytest.mark.parametrize("src_offset", [0, 4], ids=["aligned", "src+4B"])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward_input"])
@pytest.mark.parametrize("dtype", FORWARD_REGS_DTYPES, ids=str)
@pytest.mark.parametrize("case", FORWARD_REGS_CASES, ids=lambda c: c[0])
def test_nchw_forward_regs_kernel_matches_reference(case, dtype, backward, src_offset, rng):
    _check_nchw_forward_regs(case, dtype, backward, src_offset, rng)


def _random_row_walk_case(seed):
    """A seeded random geometry of the row walk's domain (square 3x3/5x5/7x7,
    stride 1 or 2, any padding per side; widths with and without vectors)."""
    r = numpy.random.default_rng(seed)
    k, stride = int(r.choice([3, 5, 7])), int(r.choice([1, 2]))
    padding = ((int(r.integers(0, k + 2)), int(r.integers(0, k + 2))), (int(r.integers(0, k + 2)), int(r.integers(0, k + 2))))
    height = int(r.integers(max(1, k - sum(padding[0])), 48))
    width = int(r.choice([int(r.integers(max(1, k - sum(padding[1])), 72)), 8, 16, 24, 56, 64, 112]))
    width = max(width, k - sum(padding[1]))
    shape = (int(r.integers(1, 4)), int(r.integers(1, 7)), height, width)
    return (f"random {seed}", shape, k, stride, padding)


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward_input"])
@pytest.mark.parametrize("dtype", FORWARD_REGS_DTYPES, ids=str)
@pytest.mark.parametrize("case", [_random_row_walk_case(seed) for seed in range(16)], ids=lambda c: c[0])
def test_nchw_forward_regs_random_geometries(case, dtype, backward, rng):
    _check_nchw_forward_regs(case, dtype, backward, 0, rng)


# The long row strips, forced on small tensors (the grid rule shortens them there).
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward_input"])
@pytest.mark.parametrize("dtype", FORWARD_REGS_DTYPES, ids=str)
@pytest.mark.parametrize("case", [c for c in FORWARD_REGS_CASES
                                  if c[0].startswith(("56x56", "40x12", "36x20", "112x112"))], ids=lambda c: c[0])
def test_nchw_forward_regs_long_strips(case, dtype, backward, rng, monkeypatch):
    monkeypatch.setattr(_launch, "LONG_STRIP_MIN_THREADS", 0)
    _depthwise_nchw_forward_regs.plan.cache_clear()
    try:
        _check_nchw_forward_regs(case, dtype, backward, 0, rng)
    finally:
        _depthwise_nchw_forward_regs.plan.cache_clear()


@pytest.mark.parametrize("dtype", FORWARD_REGS_DTYPES, ids=str)
def test_nchw_forward_regs_dispatch_follows_the_mode(dtype, rng, monkeypatch):
    # MODE "always" / "rule" / "never": the ops launch the row walk exactly
    # where the mode (and preferred, for "rule") says, with the reference's
    # results; multiplier 2 and dilation 2 keep the other kernels.  (The
    # tensor-core kernel, tried before it, is off: its rule takes 7x7 planes.)
    monkeypatch.setattr(_depthwise_conv_mma, "MODE", "never")
    for mode in ("always", "rule", "never"):
        monkeypatch.setattr(_depthwise_nchw_forward_regs, "MODE", mode)
        monkeypatch.setattr(depthwise, "_SIGNATURES", {})
        for x_shape, k, stride, multiplier, dilation in [
            ((2, 4, 56, 56), 3, 1, 1, 1), ((2, 4, 28, 28), 3, 1, 1, 1), ((1, 3, 112, 112), 3, 2, 1, 1),
            ((2, 3, 56, 56), 5, 2, 1, 1), ((1, 2, 24, 24), 7, 1, 1, 1), ((1, 2, 24, 24), 3, 1, 2, 1),
            ((1, 2, 24, 24), 3, 1, 1, 2),
        ]:
            c = x_shape[1]
            w_shape = (c * multiplier, 1, k, k)
            conv = dict(stride=stride, padding=k // 2 * dilation, dilation=dilation)
            g = _validate.conv_geometry(x_shape, w_shape, stride, conv["padding"], dilation)
            x, w, b = random(rng, x_shape, dtype), random(rng, w_shape, dtype), random(rng, w_shape[0], dtype)
            x_gpu = cupy.asarray(x)
            y = cupy_dwgn.depthwise_conv2d(x_gpu, cupy.asarray(w), cupy.asarray(b), **conv)
            assert relative_error(y, reference.depthwise_conv2d(x, w, b, **conv)) <= TOLERANCE[dtype], (mode, x_shape)
            for backward, src, dst in ((False, x_gpu, y), (True, y, x_gpu)):
                if backward and stride != 1:
                    continue
                steps = (depthwise._backward_input_steps if backward else depthwise._forward_steps)(g, "NCHW", src, dst)
                taken = steps.launches[0].expression.startswith(_depthwise_nchw_forward_regs.KERNEL)
                plan = _depthwise_nchw_forward_regs.plan(g, numpy.dtype(dtype), backward, 16, 16)
                want_taken = plan is not None and (mode == "always" or (
                    mode == "rule" and _depthwise_nchw_forward_regs.preferred(
                        g, dtype, backward, _depthwise_nchw_forward_regs.launch_vector_width(plan))))
                assert taken == want_taken, (mode, x_shape, k, stride, backward)
            if stride == 1:
                dy = random(rng, y.shape, dtype)
                dx = cupy_dwgn.depthwise_conv2d_backward_input(cupy.asarray(dy), cupy.asarray(w), x_shape,
                                                               out=poisoned(x_shape, dtype), **conv)
                want = reference.depthwise_conv2d_backward_input(dy, w, x_shape, **conv)
                assert relative_error(dx, want) <= TOLERANCE[dtype], (mode, x_shape)


# The NCHW row kernel (_depthwise_nchw_rows), launched directly on poisoned
# outputs: (name, x shape, filter size, stride, padding).  Rows of 1 to 16
# values (both compiled widths, the 8 -> 16 boundary), padding larger than
# the filter, per-side padding, planes taller than wide, stride 2 with odd
# sizes, a single row, and enough rows for several blocks with a partial
# last one.
ROWS_CASES = [
    ("7x7 3x3 p1", (3, 37, 7, 7), 3, 1, 1),
    ("7x7 5x5 p2", (2, 19, 7, 7), 5, 1, 2),
    ("7x7 7x7 p3", (2, 11, 7, 7), 7, 1, 3),
    ("8x8 3x3 p1", (2, 13, 8, 8), 3, 1, 1),
    ("9x9 3x3 p1 (W 16)", (2, 13, 9, 9), 3, 1, 1),
    ("14x14 7x7 p3", (2, 24, 14, 14), 7, 1, 3),
    ("16x16 5x5 p2", (1, 9, 16, 16), 5, 1, 2),
    ("20x18 3x3 valid (backward: 18 wide, not served)", (2, 5, 20, 18), 3, 1, "valid"),
    ("1x1 image 3x3 p1", (4, 7, 1, 1), 3, 1, 1),
    ("5x3 7x7 padding > filter", (1, 6, 5, 3), 7, 1, 8),
    ("11x13 5x5 per-side padding", (2, 5, 11, 13), 5, 1, ((0, 4), (3, 1))),
    ("14x14 3x3 s2 p1", (2, 21, 14, 14), 3, 2, 1),
    ("15x15 5x5 s2 p2", (2, 9, 15, 15), 5, 2, 2),
    ("13x16 7x7 s2 p3", (1, 6, 13, 16), 7, 2, 3),
    ("7x7 3x3 s2 valid", (3, 5, 7, 7), 3, 2, "valid"),
]


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward_input"])
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d in _depthwise_nchw_rows.DTYPES], ids=str)
@pytest.mark.parametrize("case", ROWS_CASES, ids=lambda c: c[0])
def test_rows_kernel_matches_reference(case, dtype, backward, rng):
    _, x_shape, k, stride, padding = case
    g, src, w, b, want = _direct_launch_data(x_shape, (x_shape[1], 1, k, k), padding, dtype, backward, rng, stride)
    launch = _depthwise_nchw_rows.plan(g, numpy.dtype(dtype), backward, "int")
    dst_width = want.shape[3]
    if (backward and stride != 1) or dst_width > (8 if stride == 2 else 16):
        assert launch is None  # not served: the plane / window kernels take it
        return
    assert launch is not None
    dst = poisoned(want.shape, dtype)
    launch(cupy.asarray(src), cupy.asarray(w), 0 if b is None else cupy.asarray(b), dst)
    error = relative_error(dst, want)
    record_errors("depthwise NCHW row kernel", str(numpy.dtype(dtype)), {("backward_input" if backward else "forward"): error})
    assert error <= TOLERANCE[dtype]


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward_input"])
def test_rows_kernel_with_64bit_indices(backward, rng):
    # The long long specialization on a small tensor (the >= 2**31-element
    # run is test_nchw_plane_kernels_over_2_31_elements).
    x_shape, k = (2, 7, 7, 7), 3
    g = _validate.conv_geometry(x_shape, (7, 1, k, k), 1, 1, 1)
    src = random(rng, x_shape, numpy.float32)
    w = random(rng, (7, 1, k, k), numpy.float32)
    launch = _depthwise_nchw_rows.plan(g, numpy.dtype(numpy.float32), backward, "long long")
    assert "long long" in launch.expression
    dst = poisoned(x_shape, numpy.float32)
    launch(cupy.asarray(src), cupy.asarray(w), 0, dst)
    if backward:
        want = reference.depthwise_conv2d_backward_input(src, w, x_shape, padding=1)
    else:
        want = reference.depthwise_conv2d(src, w, None, padding=1)
    assert relative_error(dst, want) <= TOLERANCE[numpy.dtype(numpy.float32)]


def test_rows_kernel_dispatch_follows_the_mode(rng, monkeypatch):
    x = cupy.asarray(random(rng, (2, 8, 7, 7), numpy.float16))
    w = cupy.asarray(random(rng, (8, 1, 3, 3), numpy.float16))
    g = _validate.conv_geometry(x.shape, w.shape, 1, 1, 1)
    for mode, taken in (("always", True), ("never", False)):
        monkeypatch.setattr(_depthwise_nchw_rows, "MODE", mode)
        forward = depthwise._forward_steps(g, "NCHW", x, x).launches[0].expression
        backward = depthwise._backward_input_steps(g, "NCHW", x, x).launches[0].expression
        assert forward.startswith(_depthwise_nchw_rows.KERNEL) == taken
        assert backward.startswith(_depthwise_nchw_rows.KERNEL) == taken
        y = cupy_dwgn.depthwise_conv2d(x, w, padding=1)
        assert relative_error(y, reference.depthwise_conv2d(x.get(), w.get(), None, padding=1)) <= TOLERANCE[numpy.dtype(numpy.float16)]


# The NHWC direct kernel (_depthwise_nhwc_direct), launched directly on
# poisoned outputs: (name, x shape (N, H, W, C), filter size, stride,
# padding).  Strips cut by the right edge (widths not a multiple of TW),
# padding larger than the filter, per-side padding, one channel vector, a
# channel count that splits into uneven tiles, a 1x1 image, stride 2 with odd
# sizes.
NHWC_DIRECT_CASES = [
    ("13x11 C=32 3x3 p1", (2, 13, 11, 32), 3, 1, 1),
    ("9x10 C=16 5x5 per-side", (1, 9, 10, 16), 5, 1, ((0, 4), (3, 1))),
    ("5x3 C=8 3x3 padding > filter", (1, 5, 3, 8), 3, 1, 4),
    ("1x1 C=24 3x3 p1", (3, 1, 1, 24), 3, 1, 1),
    ("7x7 C=296 5x5 p2 (uneven tiles)", (2, 7, 7, 296), 5, 1, 2),
    ("12x12 C=16 3x3 valid", (2, 12, 12, 16), 3, 1, "valid"),
    ("15x13 C=40 3x3 s2 p1", (2, 15, 13, 40), 3, 2, 1),
    ("17x16 C=16 5x5 s2 per-side", (1, 17, 16, 16), 5, 2, ((4, 0), (1, 2))),
    ("9x9 C=24 5x5 s2 p2", (2, 9, 9, 24), 5, 2, 2),
    ("6x19 C=24 5x5 p2 (TW 7, ragged strip)", (2, 6, 19, 24), 5, 1, 2),
    ("5x23 C=16 5x5 p2 (TW 8)", (2, 5, 23, 16), 5, 1, 2),
]


@pytest.mark.parametrize("per_thread, block, all_rows", [(0, None, False), (3, None, False), (1, (3, 5), False),
                                                     (0, None, True)],
                         ids=["rule-items", "3-items", "3x5-block", "all-rows"])
@pytest.mark.parametrize("index", ["int", "long long"])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward_input"])
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d in _depthwise_nhwc_direct.DTYPES], ids=str)
@pytest.mark.parametrize("case", NHWC_DIRECT_CASES, ids=lambda c: c[0])
def test_nhwc_direct_kernel_matches_reference(case, dtype, backward, index, per_thread, block, all_rows, rng,
                                              monkeypatch):
    # per_thread 0: the rule's grid (items_per_thread: 1 or 2 items a thread); 3: a grid that gives
    # each thread 3 items (ITEMS_PER_THREAD), the grid-stride walk past a block's first items;
    # block: blocks of 3 channel vectors x 5 items (BLOCK), channel tiles that split the vectors unevenly;
    # all_rows: every filter row's inputs loaded at once, rows outside the image as zeros (ALL_ROWS).
    _, x_shape, k, stride, padding = case
    n, c = x_shape[0], x_shape[3]
    w_shape = (c, 1, k, k)
    g = _validate.conv_geometry(x_shape, w_shape, stride, padding, 1, layout="NHWC")
    y_shape = (n, g.out_height, g.out_width, c)
    key = (k, stride, numpy.dtype(dtype).itemsize)
    if per_thread:
        monkeypatch.setitem(_depthwise_nhwc_direct.ITEMS_PER_THREAD, key, per_thread)
    if block:
        monkeypatch.setitem(_depthwise_nhwc_direct.BLOCK, key, block)
    if all_rows:
        monkeypatch.setitem(_depthwise_nhwc_direct.ALL_ROWS, key, True)
    launch = _depthwise_nhwc_direct.plan.__wrapped__(g, numpy.dtype(dtype), backward, index, 16, 16)
    if backward and stride != 1:
        assert launch is None
        return
    assert launch is not None and launch.expression.endswith(f"{index}>")
    conv = dict(stride=stride, padding=padding, layout="NHWC")
    w = random(rng, w_shape, dtype)
    if backward:
        src = random(rng, y_shape, dtype)
        want = reference.depthwise_conv2d_backward_input(src, w, x_shape, **conv)
        b, dst = None, poisoned(x_shape, dtype)
    else:
        src = random(rng, x_shape, dtype)
        b = random(rng, c, dtype)
        want = reference.depthwise_conv2d(src, w, b, **conv)
        dst = poisoned(y_shape, dtype)
    launch(cupy.asarray(src), cupy.asarray(w), 0 if b is None else cupy.asarray(b), dst)
    error = relative_error(dst, want)
    record_errors("depthwise NHWC direct kernel", str(numpy.dtype(dtype)),
                  {("backward_input" if backward else f"forward s{stride}"): error})
    assert error <= TOLERANCE[numpy.dtype(dtype)]


def _check_nhwc_dispatch_follows_the_mode(module, rng, monkeypatch):
    # With ``module.MODE`` "always" the NHWC ops launch its kernel for 3x3
    # forwards at stride 1 and 2 and the stride-1 backward-input, with
    # "never" another; the results match the reference either way.
    monkeypatch.setattr(depthwise, "_SIGNATURES", {})
    x = cupy.asarray(random(rng, (2, 9, 9, 16), numpy.float16))
    w = cupy.asarray(random(rng, (16, 1, 3, 3), numpy.float16))
    for stride in (1, 2):
        g = _validate.conv_geometry(x.shape, w.shape, stride, 1, 1, layout="NHWC")
        conv = dict(stride=stride, padding=1, layout="NHWC")
        for mode, taken in (("always", True), ("never", False)):
            monkeypatch.setattr(module, "MODE", mode)
            depthwise._SIGNATURES.clear()
            forward = depthwise._forward_steps(g, "NHWC", x, x).launches[0].expression
            assert forward.startswith(module.KERNEL) == taken
            y = cupy_dwgn.depthwise_conv2d(x, w, **conv)
            assert relative_error(y, reference.depthwise_conv2d(x.get(), w.get(), None, **conv)) <= TOLERANCE[
                numpy.dtype(numpy.float16)]
            if stride == 1:
                backward = depthwise._backward_input_steps(g, "NHWC", x, x).launches[0].expression
                assert backward.startswith(module.KERNEL) == taken
                dx = cupy_dwgn.depthwise_conv2d_backward_input(y, w, x.shape, **conv)
                want = reference.depthwise_conv2d_backward_input(y.get(), w.get(), x.shape, **conv)
                assert relative_error(dx, want) <= TOLERANCE[numpy.dtype(numpy.float16)]


def test_nhwc_direct_kernel_dispatch_follows_the_mode(rng, monkeypatch):
    monkeypatch.setattr(_depthwise_nhwc_ring, "MODE", "never")  # ahead of it in the dispatch
    _check_nhwc_dispatch_follows_the_mode(_depthwise_nhwc_direct, rng, monkeypatch)


# The NHWC row-ring kernel (_depthwise_nhwc_ring), launched directly on
# poisoned outputs, with bulk copies (sm_90+) and with the block's cp.async
# pieces, on the plan's persistent grid and on 3 blocks (segments crossing
# images): (name, x shape (N, H, W, C), stride, padding[, filter size, 3 if
# absent]).  Strips cut by the right edge, padding larger than the filter,
# per-side padding, a 1x1 image, one channel vector, 296 channels (74
# vectors: block not a multiple of 32), stride 2 with odd sizes; 5x5 at
# stride 2 (forward only) with the same edges, 1000 channels (250 vectors)
# and 4- and 2-column strips.
NHWC_RING_CASES = [
    ("13x11 C=32 p1", (2, 13, 11, 32), 1, 1),
    ("9x10 C=16 per-side", (1, 9, 10, 16), 1, ((0, 2), (2, 1))),
    ("5x3 C=8 padding > filter", (1, 5, 3, 8), 1, 4),
    ("1x1 C=24 p1", (3, 1, 1, 24), 1, 1),
    ("7x7 C=296 p1", (2, 7, 7, 296), 1, 1),
    ("12x12 C=16 valid", (2, 12, 12, 16), 1, "valid"),
    ("19x6 C=72 p1", (3, 19, 6, 72), 1, 1),
    ("15x13 C=40 s2 p1", (2, 15, 13, 40), 2, 1),
    ("17x16 C=16 s2 per-side", (1, 17, 16, 16), 2, ((2, 0), (1, 2))),
    ("15x13 C=40 5x5 s2 p2", (2, 15, 13, 40), 2, 2, 5),
    ("10x9 C=16 5x5 s2 per-side", (2, 10, 9, 16), 2, ((4, 1), (0, 3)), 5),
    ("3x4 C=8 5x5 s2 padding > filter", (2, 3, 4, 8), 2, 6, 5),
    ("9x6 C=1000 5x5 s2 p2", (2, 9, 6, 1000), 2, 2, 5),
    ("7x20 C=24 5x5 s2 p2 (2-column strips)", (2, 7, 20, 24), 2, 2, 5),
    # 256 threads (the 5x5 launch bound) in 2 column groups of 128 vectors, 3
    # strips of 2 columns on a 5-wide output (the last one cut), odd per-side
    # padding; float32 runs under the device's shared-memory limit (210 KB).
    ("11x10 C=512 5x5 s2 odd per-side", (2, 11, 10, 512), 2, ((1, 2), (3, 0)), 5),
]


@pytest.mark.parametrize("bulk", [True, False], ids=["bulk", "pieces"])
@pytest.mark.parametrize("index", ["int", "long long"])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward_input"])
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d in _depthwise_nhwc_ring.DTYPES], ids=str)
@pytest.mark.parametrize("case", NHWC_RING_CASES, ids=lambda c: c[0])
def test_nhwc_ring_kernel_matches_reference(case, dtype, backward, index, bulk, rng):
    _check_nhwc_ring_kernel(case, dtype, backward, index, bulk, rng)


# Rows whose 3 slots pass MAX_SHARED (29-87 KB a row): the ring under the
# device's opt-in limit (one block per SM): (name, x shape, stride, padding, dtype).
NHWC_RING_WIDE_CASES = [
    ("9x150 C=144 s2 float16", (1, 9, 150, 144), 2, 1, numpy.float16),
    ("9x150 C=96 s2 float32", (1, 9, 150, 96), 2, 1, numpy.float32),
    ("6x77 C=216 float16", (2, 6, 77, 216), 1, 1, numpy.float16),
    ("6x77 C=216 float32", (2, 6, 77, 216), 1, 1, numpy.float32),
]


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward_input"])
@pytest.mark.parametrize("case", NHWC_RING_WIDE_CASES, ids=lambda c: c[0])
def test_nhwc_ring_kernel_wide_rows_under_the_device_limit(case, backward, rng):
    device_limit = _launch.max_shared_per_block(cupy.cuda.runtime.getDevice())
    _check_nhwc_ring_kernel(case[:4], case[4], backward, "int", True, rng, device_limit)


def _skip_where_the_ring_needs_more_shared_memory(g, dtype, backward):
    """Skip where the ring kernel serves ``g`` only with more shared memory
    per block than this GPU lets a block opt into (the wide-row and 5x5
    cases are sized for an H100/H200's 227 KB; an A100 has 163 KB, sm_86 and
    sm_89 99 KB)."""
    ring, dtype = _depthwise_nhwc_ring, numpy.dtype(dtype)
    device_limit = _launch.max_shared_per_block(cupy.cuda.runtime.getDevice())
    if (ring.plan(g, dtype, backward, "int", 16, 16, shared_limit=device_limit) is None
            and ring.plan(g, dtype, backward, "int", 16, 16, shared_limit=ring._NO_LIMIT) is not None):
        pytest.skip(f"the ring kernel needs more than this GPU's {device_limit} bytes of shared memory per block here")


def _check_nhwc_ring_kernel(case, dtype, backward, index, bulk, rng, shared_limit=None):
    _, x_shape, stride, padding = case[:4]
    k = case[4] if len(case) > 4 else 3
    n, c = x_shape[0], x_shape[3]
    w_shape = (c, 1, k, k)
    g = _validate.conv_geometry(x_shape, w_shape, stride, padding, 1, layout="NHWC")
    _skip_where_the_ring_needs_more_shared_memory(g, dtype, backward)
    y_shape = (n, g.out_height, g.out_width, c)
    if shared_limit is None:  # as the ops plan it (5 rows of 1000 channels: under the device's limit)
        launch = _depthwise_nhwc_ring.plan_on_device(g, numpy.dtype(dtype), backward, index, 16, 16, None, bulk)
    else:
        launch = _depthwise_nhwc_ring.plan(g, numpy.dtype(dtype), backward, index, 16, 16, None, bulk, shared_limit)
        if launch is not None:
            assert launch.shared_mem > _depthwise_nhwc_ring.MAX_SHARED  # the case exercises the device limit
    if backward and stride != 1:
        assert launch is None
        return
    assert launch is not None and launch.expression.endswith(f"{index}>") and int(launch.scalars[-1]) == bulk
    conv = dict(stride=stride, padding=padding, layout="NHWC")
    w = cupy.asarray(random(rng, w_shape, dtype))
    if backward:
        src = random(rng, y_shape, dtype)
        want = reference.depthwise_conv2d_backward_input(src, w.get(), x_shape, **conv)
        b, dst_shape = None, x_shape
    else:
        src = random(rng, x_shape, dtype)
        b = random(rng, c, dtype) if index == "int" else None  # the 64-bit runs without a bias
        want = reference.depthwise_conv2d(src, w.get(), b, **conv)
        dst_shape = y_shape
    three = _launch.Launch(launch.file, launch.expression, (3,), launch.block, launch.shared_mem, launch.scalars,
                           persistent=True)
    for run in (launch, three):
        dst = poisoned(dst_shape, dtype)
        run(cupy.asarray(src), w, 0 if b is None else cupy.asarray(b), dst)
        error = relative_error(dst, want)
        record_errors("depthwise NHWC ring kernel", str(numpy.dtype(dtype)),
                      {("backward_input" if backward else f"forward s{stride}"): error})
        assert error <= TOLERANCE[numpy.dtype(dtype)]


def test_nhwc_ring_kernel_dispatch_follows_the_mode(rng, monkeypatch):
    _check_nhwc_dispatch_follows_the_mode(_depthwise_nhwc_ring, rng, monkeypatch)


# The NHWC register-window kernel (_depthwise_nhwc_window), launched
# directly: odd sizes, every padding form (asymmetric, "valid", larger than
# the filter: negative backward offsets), several channel tiles, tiles in
# both directions with partial last tiles, more units than the persistent
# grid holds, a 3-block grid that walks every unit (and across channel
# tiles), every unit order the rule uses (channel-tile groups of 1, 2 and 4,
# with a smaller last group), and destination views 4 bytes off 16 (the
# kernel stores 4 bytes per lane); NaN-poisoned outputs.
NHWC_WINDOW_CASES = [
    # (label, NHWC x shape, filter size, padding)
    ("13x11 C=32 3x3 p1", (2, 13, 11, 32), 3, 1),
    ("9x10 C=16 5x5 per-side", (1, 9, 10, 16), 5, ((0, 4), (3, 1))),
    ("7x7 C=16 7x7 p3", (3, 7, 7, 16), 7, 3),
    ("8x8 C=48 3x3 valid", (2, 8, 8, 48), 3, "valid"),
    ("5x9 C=16 7x7 padding > filter", (1, 5, 9, 16), 7, 8),
    ("1x12 C=16 3x3 (1, 0)", (2, 1, 12, 16), 3, (1, 0)),
    ("150x20 C=16 3x3 tall", (1, 150, 20, 16), 3, 1),
    ("70x40 C=32 5x5 per-side", (2, 70, 40, 32), 5, ((2, 1), (0, 3))),
    ("66x30 C=48 7x7", (1, 66, 30, 48), 7, 3),
    ("28x28 C=384 3x3 many units", (8, 28, 28, 384), 3, 1),
    ("56x56 C=96 7x7", (4, 56, 56, 96), 7, 3),
    ("9x9 C=32 3x3 300 images", (300, 9, 9, 32), 3, 1),
    ("6x5 C=8 3x3 (float32 only)", (2, 6, 5, 8), 3, 1),
]
NHWC_WINDOW_DTYPES = [d for d in DTYPES if d in _depthwise_nhwc_window.DTYPES]


def _offset_view(shape, dtype, offset_bytes, values=None):
    """A C-contiguous device array ``offset_bytes`` past a 256-byte aligned
    allocation (NaN-filled unless ``values``)."""
    itemsize = numpy.dtype(dtype).itemsize
    skip = offset_bytes // itemsize
    size = int(numpy.prod(shape))
    flat = poisoned((size + skip,), dtype)
    if values is not None:
        flat[skip:] = cupy.asarray(values.reshape(-1))
    view = flat[skip:].reshape(shape)
    assert view.data.ptr % 16 == offset_bytes % 16
    return view


def _nhwc_window_case(case, dtype, backward, rng):
    _, x_shape, k, padding = case
    g, src, w, b, want = _direct_launch_data(x_shape, (x_shape[3], 1, k, k), padding, dtype, backward, rng,
                                             layout="NHWC")
    return g, src, w, b, want, want.shape


@pytest.mark.parametrize("dst_offset", [0, 4], ids=["aligned", "dst+4B"])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward_input"])
@pytest.mark.parametrize("dtype", NHWC_WINDOW_DTYPES, ids=str)
@pytest.mark.parametrize("case", NHWC_WINDOW_CASES, ids=lambda c: c[0])
def test_nhwc_window_kernel_matches_reference(case, dtype, backward, dst_offset, rng):
    g, src, w, b, want, dst_shape = _nhwc_window_case(case, dtype, backward, rng)
    src_gpu = _offset_view(src.shape, dtype, 0, src)
    dst = _offset_view(dst_shape, dtype, dst_offset)
    index = _launch.index_type(src_gpu.size, dst.size)
    alignments = (depthwise._alignment(src_gpu), depthwise._alignment(dst))
    if g.channels % _depthwise_nhwc_window.channel_tile(dtype):
        assert _depthwise_nhwc_window.plan(g, numpy.dtype(dtype), backward, index, *alignments) is None
        return
    # A misaligned source goes to the other kernels.
    assert _depthwise_nhwc_window.plan(g, numpy.dtype(dtype), backward, index, 8, 16) is None
    args = (src_gpu, cupy.asarray(w), 0 if b is None else cupy.asarray(b), dst)
    bits = f"u{dst.itemsize}"
    first = None
    for group in (1, 2, 4):
        launch = _depthwise_nhwc_window.plan(g, numpy.dtype(dtype), backward, index, *alignments, group)
        assert launch is not None and launch.persistent
        dst.fill(numpy.nan)
        launch(*args)
        error = relative_error(dst, want)
        record_errors("depthwise NHWC window kernel", str(numpy.dtype(dtype)),
                      {("backward_input" if backward else "forward"): error})
        assert error <= TOLERANCE[dtype], group
        # Deterministic, and independent of the unit order and the grid: every
        # group size, and a 3-block grid (each block walks a third of the
        # units, across channel tiles), write the same bits.
        if first is None:
            first = dst.copy()
        assert bool((dst.view(bits) == first.view(bits)).all()), group
        dst.fill(numpy.nan)
        small = _launch.Launch(launch.file, launch.expression, (min(3, launch.grid[0]),), launch.block,
                               launch.shared_mem, launch.scalars, persistent=True)
        small(*args)
        assert bool((dst.view(bits) == first.view(bits)).all()), group


@pytest.mark.parametrize("dtype", NHWC_WINDOW_DTYPES, ids=str)
def test_nhwc_window_dispatch_when_forced(dtype, rng, monkeypatch):
    # With MODE "always", the NHWC ops launch the window kernel for every stride-1 3x3/5x5/7x7 forward and
    # backward-input (also where the rule prefers the tiled kernels), and match the reference; the other shapes keep
    # their kernels.  (The ring and direct kernels, ahead of it in the dispatch, are off.)
    monkeypatch.setattr(_depthwise_nhwc_window, "MODE", "always")
    monkeypatch.setattr(_depthwise_nhwc_direct, "MODE", "never")
    monkeypatch.setattr(_depthwise_nhwc_ring, "MODE", "never")
    monkeypatch.setattr(depthwise, "_SIGNATURES", {})  # no Steps resolved under the rule
    x_shape = (2, 20, 23, 32)  # NHWC
    for k, padding in ((3, 1), (5, ((1, 3), (2, 2))), (7, 3)):
        g = _validate.conv_geometry(x_shape, (32, 1, k, k), 1, padding, 1, layout="NHWC")
        x = random(rng, x_shape, dtype)
        w = random(rng, (32, 1, k, k), dtype)
        b = random(rng, 32, dtype)
        dy = random(rng, (2, g.out_height, g.out_width, 32), dtype)
        x_gpu, w_gpu, dy_gpu = cupy.asarray(x), cupy.asarray(w), cupy.asarray(dy)
        conv = dict(padding=padding, layout="NHWC")
        y_gpu = poisoned(dy.shape, dtype)
        for steps in (depthwise._forward_steps(g, "NHWC", x_gpu, y_gpu),
                      depthwise._backward_input_steps(g, "NHWC", dy_gpu, x_gpu)):
            assert steps.launches[0].expression.startswith(_depthwise_nhwc_window.KERNEL)
        y = cupy_dwgn.depthwise_conv2d(x_gpu, w_gpu, cupy.asarray(b), out=y_gpu, **conv)
        dx = cupy_dwgn.depthwise_conv2d_backward_input(dy_gpu, w_gpu, x_shape, out=poisoned(x_shape, dtype), **conv)
        assert relative_error(y, reference.depthwise_conv2d(x, w, b, **conv)) <= TOLERANCE[dtype]
        assert relative_error(dx, reference.depthwise_conv2d_backward_input(dy, w, x_shape, **conv)) <= TOLERANCE[dtype]
    # Stride 2 and C % 16 != 0 (half) keep the other kernels.
    g = _validate.conv_geometry(x_shape, (32, 1, 3, 3), 2, 1, 1, layout="NHWC")
    x_gpu = cupy.zeros(x_shape, dtype)
    steps = depthwise._forward_steps(g, "NHWC", x_gpu, x_gpu)
    assert not steps.launches[0].expression.startswith(_depthwise_nhwc_window.KERNEL)


@pytest.mark.parametrize("dtype", NHWC_WINDOW_DTYPES, ids=str)
def test_nhwc_window_dispatch_follows_the_rule(dtype, rng):
    # By default the ops take the window kernel exactly where preferred() names a group, with that group, and the
    # result matches the reference either way.
    assert _depthwise_nhwc_window.MODE == "rule"
    for x_shape, k in (((2, 28, 28, 32), 3), ((2, 14, 14, 32), 5), ((2, 7, 7, 32), 7), ((1, 56, 56, 32), 3)):
        g = _validate.conv_geometry(x_shape, (32, 1, k, k), 1, k // 2, 1, layout="NHWC")
        x = random(rng, x_shape, dtype)
        w = random(rng, (32, 1, k, k), dtype)
        x_gpu = cupy.asarray(x)
        y_gpu = poisoned(x_shape, dtype)
        launch = depthwise._forward_steps(g, "NHWC", x_gpu, y_gpu).launches[0]
        group = _depthwise_nhwc_window.preferred(g, dtype, False)
        assert launch.expression.startswith(_depthwise_nhwc_window.KERNEL) == (group is not None)
        if group is not None:
            assert int(launch.scalars[16]) == min(group, 32 // _depthwise_nhwc_window.channel_tile(dtype))
        y = cupy_dwgn.depthwise_conv2d(x_gpu, cupy.asarray(w), padding=k // 2, layout="NHWC", out=y_gpu)
        assert relative_error(y, reference.depthwise_conv2d(x, w, padding=k // 2, layout="NHWC")) <= TOLERANCE[dtype]


# The NHWC register-tap weight gradient (_depthwise_nhwc_wgrad), launched
# directly (partial sums, then the shared finalize): every filter size and
# stride, odd sizes, per-side and oversized padding, a 1-row plane, several
# channel blocks and tap groups (7x7), channel tiles per block forced to 1,
# 2 and 4 (C = 48: an idle tile in the last block), a channel count off the
# tile (None), x 4 bytes off 16; NaN-poisoned partial sums and output; the
# same bits on a second run.
NHWC_WGRAD_CASES = [
    # (label, NHWC x shape, filter size, stride, padding)
    ("13x11 C=32 3x3 s1 p1", (2, 13, 11, 32), 3, 1, 1),
    ("9x10 C=16 5x5 s1 per-side", (1, 9, 10, 16), 5, 1, ((0, 4), (3, 1))),
    ("7x7 C=16 7x7 s1 p3", (3, 7, 7, 16), 7, 1, 3),
    ("5x9 C=16 7x7 s1 padding > filter", (1, 5, 9, 16), 7, 1, ((8, 2), (0, 8))),
    ("28x3 C=16 7x7 s1 per-side", (2, 28, 3, 16), 7, 1, ((2, 3), (3, 2))),
    ("1x12 C=16 3x3 s1 (1, 0)", (2, 1, 12, 16), 3, 1, (1, 0)),
    ("13x11 C=48 3x3 s2 p1", (2, 13, 11, 48), 3, 2, 1),
    ("17x16 C=16 5x5 s2 per-side", (1, 17, 16, 16), 5, 2, ((4, 0), (1, 2))),
    ("15x15 C=16 7x7 s2 p3", (1, 15, 15, 16), 7, 2, 3),
    ("56x56 C=144 3x3 s1", (4, 56, 56, 144), 3, 1, 1),
    ("28x28 C=384 3x3 s1 many units", (8, 28, 28, 384), 3, 1, 1),
    ("28x28 C=240 5x5 s1", (4, 28, 28, 240), 5, 1, 2),
    ("56x56 C=96 7x7 s1", (4, 56, 56, 96), 7, 1, 3),
    ("112x112 C=96 3x3 s2", (2, 112, 112, 96), 3, 2, 1),
    ("9x9 C=32 3x3 300 images", (300, 9, 9, 32), 3, 1, 1),
    ("6x5 C=8 3x3 (float32 only)", (2, 6, 5, 8), 3, 1, 1),
]
NHWC_WGRAD_DTYPES = [d for d in DTYPES if d in _depthwise_nhwc_wgrad.DTYPES]


def _nhwc_wgrad_case(case, dtype, rng):
    _, x_shape, k, stride, padding = case
    c = x_shape[3]
    g = _validate.conv_geometry(x_shape, (c, 1, k, k), stride, padding, 1, layout="NHWC")
    dy = random(rng, (g.batch, g.out_height, g.out_width, c), dtype)
    x = random(rng, x_shape, dtype)
    want = reference.depthwise_conv2d_backward_weight(dy, x, (c, 1, k, k), stride=stride, padding=padding,
                                                      layout="NHWC")
    return g, dy, x, want


def _run_nhwc_wgrad(planned, dy_gpu, x_gpu, w_shape, dtype):
    """Launch a plan's partial and finalize on NaN-poisoned buffers; returns
    (grad_weight, partial sums)."""
    (partial, finalize), (shape, acc) = planned
    sums = cupy.full(shape, numpy.nan, acc)
    out = poisoned(w_shape, dtype)
    partial(dy_gpu, x_gpu, sums)
    finalize(sums, out)
    return out, sums


@pytest.mark.parametrize("x_offset", [0, 4], ids=["aligned", "x+4B"])
@pytest.mark.parametrize("dtype", NHWC_WGRAD_DTYPES, ids=str)
@pytest.mark.parametrize("case", NHWC_WGRAD_CASES, ids=lambda c: c[0])
def test_nhwc_wgrad_kernel_matches_reference(case, dtype, x_offset, rng):
    _check_nhwc_wgrad_kernel(case, dtype, x_offset, rng)


# The long row strips the register weight gradients take on large grids
# (_launch.LONG_STRIP_MIN_THREADS), forced on small tensors.
@pytest.mark.parametrize("dtype", NHWC_WGRAD_DTYPES, ids=str)
@pytest.mark.parametrize("case", [c for c in NHWC_WGRAD_CASES if c[0].startswith(("28x28", "9x10", "13x11 C=32"))],
                         ids=lambda c: c[0])
def test_nhwc_wgrad_kernel_long_strips(case, dtype, rng, monkeypatch):
    monkeypatch.setattr(_launch, "LONG_STRIP_MIN_THREADS", 0)
    _depthwise_nhwc_wgrad.plan.cache_clear()
    try:
        _check_nhwc_wgrad_kernel(case, dtype, 0, rng)
    finally:
        _depthwise_nhwc_wgrad.plan.cache_clear()


def _check_nhwc_wgrad_kernel(case, dtype, x_offset, rng):
    g, dy, x, want = _nhwc_wgrad_case(case, dtype, rng)
    dy_gpu = _offset_view(dy.shape, dtype, 0, dy)
    x_gpu = _offset_view(x.shape, dtype, x_offset, x)
    w_shape = want.shape
    index = _launch.index_type(dy_gpu.size, x_gpu.size)
    alignments = (depthwise._alignment(dy_gpu), depthwise._alignment(x_gpu))
    if g.channels % _depthwise_nhwc_wgrad.channel_tile(dtype):
        assert _depthwise_nhwc_wgrad.plan(g, numpy.dtype(dtype), index, *alignments) is None
        return
    lc = _depthwise_nhwc_wgrad.config(g.filter_height, g.stride_h, dtype)[0]
    lanes = _depthwise_nhwc_wgrad.channel_tile(dtype) // lc
    bits = f"u{numpy.dtype(dtype).itemsize}"
    for ctb in [None] + [t for t in (1, 2, 4) if lanes * t <= 32]:
        planned = _depthwise_nhwc_wgrad.plan(g, numpy.dtype(dtype), index, *alignments, ctb)
        assert planned is not None
        out, sums = _run_nhwc_wgrad(planned, dy_gpu, x_gpu, w_shape, dtype)
        assert bool(cupy.isfinite(sums).all()), "a partial sum was not written"
        error = relative_error(out, want)
        record_errors("depthwise NHWC register-tap weight gradient", str(numpy.dtype(dtype)),
                      {f"s{g.stride_h}": error})
        assert error <= TOLERANCE[dtype], ctb
        again, _ = _run_nhwc_wgrad(planned, dy_gpu, x_gpu, w_shape, dtype)
        assert bool((again.view(bits) == out.view(bits)).all()), ctb  # deterministic


@pytest.mark.parametrize("dtype", NHWC_WGRAD_DTYPES, ids=str)
@pytest.mark.parametrize("case", [c for c in NHWC_WGRAD_CASES if c[2] == 7 or c[0].startswith("13x11")],
                         ids=lambda c: c[0])
def test_nhwc_wgrad_kernel_with_64bit_indices(case, dtype, rng):
    """The long long specializations on small tensors (7x7 stride 1 has a
    narrower strip there, LARGE_INDEX_TW), against the reference."""
    g, dy, x, want = _nhwc_wgrad_case(case, dtype, rng)
    planned = _depthwise_nhwc_wgrad.plan(g, numpy.dtype(dtype), "long long", 16, 16)
    assert planned is not None
    assert planned[0][0].expression.endswith("long long>")
    out, sums = _run_nhwc_wgrad(planned, cupy.asarray(dy), cupy.asarray(x), want.shape, dtype)
    assert bool(cupy.isfinite(sums).all()), "a partial sum was not written"
    assert relative_error(out, want) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", NHWC_WGRAD_DTYPES, ids=str)
def test_nhwc_wgrad_dispatch_follows_the_mode(dtype, rng, monkeypatch):
    # MODE "always" / "rule" (preferred: float32, measured): the
    # NHWC weight gradient launches this kernel for 3x3/5x5/7x7 at stride 1
    # and 2 and matches the reference, bit-identical on a second call;
    # "never" and the shapes it does not serve (dilation, C off the tile)
    # keep the other kernels.
    x_shape = (2, 20, 23, 32)
    monkeypatch.setattr(_depthwise_wgrad_mma, "MODE", "never")  # it comes first where it serves
    for mode in ("always", "rule", "never"):
        monkeypatch.setattr(_depthwise_nhwc_wgrad, "MODE", mode)
        monkeypatch.setattr(depthwise, "_SIGNATURES", {})  # no Steps resolved under another mode
        for k, stride, padding in ((3, 1, 1), (5, 2, ((1, 3), (2, 2))), (7, 1, 3), (3, 2, 0)):
            g = _validate.conv_geometry(x_shape, (32, 1, k, k), stride, padding, 1, layout="NHWC")
            x = random(rng, x_shape, dtype)
            dy = random(rng, (2, g.out_height, g.out_width, 32), dtype)
            x_gpu, dy_gpu = cupy.asarray(x), cupy.asarray(dy)
            steps = depthwise._backward_weight_steps(g, "NHWC", dy_gpu, x_gpu)
            taken = steps.launches[0].expression.startswith(_depthwise_nhwc_wgrad.KERNEL)
            assert taken == (mode == "always" or (mode == "rule" and _depthwise_nhwc_wgrad.preferred(g, dtype)))
            conv = dict(stride=stride, padding=padding, layout="NHWC")
            w_shape = (32, 1, k, k)
            dw = cupy_dwgn.depthwise_conv2d_backward_weight(dy_gpu, x_gpu, w_shape, out=poisoned(w_shape, dtype), **conv)
            want = reference.depthwise_conv2d_backward_weight(dy, x, w_shape, **conv)
            assert relative_error(dw, want) <= TOLERANCE[dtype], (mode, k, stride)
            again = cupy_dwgn.depthwise_conv2d_backward_weight(dy_gpu, x_gpu, w_shape, **conv)
            bits = f"u{numpy.dtype(dtype).itemsize}"
            assert bool((again.view(bits) == dw.view(bits)).all())
    monkeypatch.setattr(_depthwise_nhwc_wgrad, "MODE", "always")
    for c, dilation in ((32, 2), (24, 1)):
        g = _validate.conv_geometry((2, 20, 23, c), (c, 1, 3, 3), 1, 1, dilation, layout="NHWC")
        x_gpu = cupy.zeros((2, 20, 23, c), dtype)
        steps = depthwise._backward_weight_steps(g, "NHWC", x_gpu, x_gpu)
        served = c % _depthwise_nhwc_wgrad.channel_tile(dtype) == 0 and dilation == 1
        assert steps.launches[0].expression.startswith(_depthwise_nhwc_wgrad.KERNEL) == served
# The NCHW register weight gradient (_depthwise_nchw_wgrad_regs), launched
# directly on NaN-poisoned partial sums and grad_weight: odd widths (VW = 1),
# per-side and oversized padding (pad_left - K // 2 odd: VW = 1), 1-row
# planes, stride 2 with odd sizes, 7x7 on 5x9, C = 1, N = 1, rows wider than
# one warp (segments, dead lanes), the benchmark shapes at small N; x 4 bytes
# off 16 (a narrower VW); a second run must be bit-identical.
NCHW_WGRAD_REGS_CASES = [
    # (label, NCHW x shape, filter size, stride, padding)
    ("13x11 C=3 3x3 s1 p1", (2, 3, 13, 11), 3, 1, 1),
    ("16x16 C=2 3x3 s1 p1", (1, 2, 16, 16), 3, 1, 1),
    ("9x10 C=1 5x5 s1 per-side", (1, 1, 9, 10), 5, 1, ((0, 4), (3, 1))),
    ("7x7 C=2 7x7 s1 p3", (3, 2, 7, 7), 7, 1, 3),
    ("5x9 C=1 7x7 s1 padding > filter", (1, 1, 5, 9), 7, 1, ((8, 2), (0, 8))),
    ("1x12 C=1 3x3 s1 (1, 0)", (2, 1, 1, 12), 3, 1, (1, 0)),
    ("40x12 C=3 3x3 s1 strips", (2, 3, 40, 12), 3, 1, 1),
    ("36x20 C=2 5x5 s1 strips", (2, 2, 36, 20), 5, 1, 2),
    ("13x11 C=3 3x3 s2 p1", (2, 3, 13, 11), 3, 2, 1),
    ("17x16 C=1 5x5 s2 per-side", (1, 1, 17, 16), 5, 2, ((4, 0), (1, 2))),
    ("15x15 C=2 7x7 s2 p3", (1, 2, 15, 15), 7, 2, 3),
    ("12x16 C=2 3x3 s2 TF same", (1, 2, 12, 16), 3, 2, ((1, 1), (0, 1))),
    ("6x272 C=1 3x3 s1 segments", (1, 1, 6, 272), 3, 1, 1),
    ("3x264 C=1 5x5 s1 segments", (1, 1, 3, 264), 5, 1, 2),
    ("56x56 C=144 3x3 s1", (4, 144, 56, 56), 3, 1, 1),
    ("28x28 C=384 3x3 s1", (4, 384, 28, 28), 3, 1, 1),
    ("112x112 C=96 3x3 s2", (2, 96, 112, 112), 3, 2, 1),
    ("28x28 C=240 5x5 s1", (4, 240, 28, 28), 5, 1, 2),
    ("56x56 C=96 7x7 s1", (2, 96, 56, 56), 7, 1, 3),
    ("14x14 C=384 7x7 s1", (4, 384, 14, 14), 7, 1, 3),
    ("7x7 C=960 3x3 s1", (4, 960, 7, 7), 3, 1, 1),
]
NCHW_WGRAD_REGS_DTYPES = [d for d in DTYPES if numpy.dtype(d) in _depthwise_nchw_wgrad_regs.DTYPES]


@pytest.mark.parametrize("x_offset", [0, 4], ids=["aligned", "x+4B"])
@pytest.mark.parametrize("dtype", NCHW_WGRAD_REGS_DTYPES, ids=str)
@pytest.mark.parametrize("case", NCHW_WGRAD_REGS_CASES, ids=lambda c: c[0])
def test_nchw_wgrad_regs_kernel_matches_reference(case, dtype, x_offset, rng):
    _check_nchw_wgrad_kernel(_depthwise_nchw_wgrad_regs, "depthwise NCHW register weight gradient", case, dtype,
                             x_offset, rng)


# The long row strips of large grids, forced on small tensors (as for NHWC above).
@pytest.mark.parametrize("dtype", NCHW_WGRAD_REGS_DTYPES, ids=str)
@pytest.mark.parametrize("case", [c for c in NCHW_WGRAD_REGS_CASES
                                  if c[0].startswith(("40x12", "36x20", "28x28", "56x56 C=144", "13x11 C=3 3x3 s1"))],
                         ids=lambda c: c[0])
def test_nchw_wgrad_regs_long_strips(case, dtype, rng, monkeypatch):
    monkeypatch.setattr(_launch, "LONG_STRIP_MIN_THREADS", 0)
    _depthwise_nchw_wgrad_regs.plan.cache_clear()
    try:
        _check_nchw_wgrad_kernel(_depthwise_nchw_wgrad_regs, "depthwise NCHW register weight gradient", case, dtype,
                                 0, rng)
    finally:
        _depthwise_nchw_wgrad_regs.plan.cache_clear()


def _check_nchw_wgrad_kernel(module, label, case, dtype, x_offset, rng, aligned_only=False):
    # `module`'s plan (an NCHW weight-gradient kernel's host module) launched
    # directly on NaN-poisoned partial sums and grad_weight: every partial
    # written, the result within the tolerance of the reference (recorded
    # under `label`), a second run bit-identical.  aligned_only: the kernel
    # serves 16-byte aligned x only (cp.async copies 16-byte vectors), so a
    # misaligned x must get no plan and the op's own answer is checked.
    _, x_shape, k, stride, padding = case
    c = x_shape[1]
    g = _validate.conv_geometry(x_shape, (c, 1, k, k), stride, padding, 1)
    dy = random(rng, (g.batch, c, g.out_height, g.out_width), dtype)
    x = random(rng, x_shape, dtype)
    want = reference.depthwise_conv2d_backward_weight(dy, x, (c, 1, k, k), stride=stride, padding=padding)
    dy_gpu = _offset_view(dy.shape, dtype, 0, dy)
    x_gpu = _offset_view(x.shape, dtype, x_offset, x)
    alignments = (depthwise._alignment(dy_gpu), depthwise._alignment(x_gpu))
    planned = module.plan(g, numpy.dtype(dtype), *alignments)
    if aligned_only and x_offset:
        assert planned is None
        dw = cupy_dwgn.depthwise_conv2d_backward_weight(dy_gpu, x_gpu, want.shape, stride=stride, padding=padding,
                                                        out=poisoned(want.shape, dtype))
        assert relative_error(dw, want) <= TOLERANCE[dtype]
        return
    assert planned is not None
    out, sums = _run_nhwc_wgrad(planned, dy_gpu, x_gpu, want.shape, dtype)  # same partial/finalize arguments
    assert bool(cupy.isfinite(sums).all()), "a partial sum was not written"
    error = relative_error(out, want)
    record_errors(label, str(numpy.dtype(dtype)), {f"s{stride}": error})
    assert error <= TOLERANCE[dtype]
    again, _ = _run_nhwc_wgrad(planned, dy_gpu, x_gpu, want.shape, dtype)
    bits = f"u{numpy.dtype(dtype).itemsize}"
    assert bool((again.view(bits) == out.view(bits)).all())  # deterministic


def _check_nchw_wgrad_dispatch(module, cases, dtype, rng, monkeypatch):
    # MODE "always" / "rule" / "never" of `module` (an NCHW weight-gradient
    # kernel's host module): the op launches module.KERNEL exactly where the
    # mode says (and module.preferred where it is "rule"), results match the
    # reference and repeat bit for bit.  Dilation 2 and multiplier 2 keep the
    # other kernels even under "always".
    x_shape = (2, 6, 20, 23)
    monkeypatch.setattr(_depthwise_wgrad_mma, "MODE", "never")  # it comes first where it serves
    for mode in ("always", "rule", "never"):
        monkeypatch.setattr(module, "MODE", mode)
        monkeypatch.setattr(depthwise, "_SIGNATURES", {})  # no Steps resolved under another mode
        for k, stride, padding in cases:
            w_shape = (6, 1, k, k)
            g = _validate.conv_geometry(x_shape, w_shape, stride, padding, 1)
            x = random(rng, x_shape, dtype)
            dy = random(rng, (2, 6, g.out_height, g.out_width), dtype)
            x_gpu, dy_gpu = cupy.asarray(x), cupy.asarray(dy)
            steps = depthwise._backward_weight_steps(g, "NCHW", dy_gpu, x_gpu)
            taken = steps.launches[0].expression.startswith(module.KERNEL)
            assert taken == (mode == "always" or (mode == "rule" and module.preferred(g, dtype)))
            conv = dict(stride=stride, padding=padding)
            dw = cupy_dwgn.depthwise_conv2d_backward_weight(dy_gpu, x_gpu, w_shape, out=poisoned(w_shape, dtype),
                                                            **conv)
            want = reference.depthwise_conv2d_backward_weight(dy, x, w_shape, **conv)
            assert relative_error(dw, want) <= TOLERANCE[dtype], (mode, k, stride)
            again = cupy_dwgn.depthwise_conv2d_backward_weight(dy_gpu, x_gpu, w_shape, **conv)
            bits = f"u{numpy.dtype(dtype).itemsize}"
            assert bool((again.view(bits) == dw.view(bits)).all())
    monkeypatch.setattr(module, "MODE", "always")
    for w_shape, dilation in (((6, 1, 3, 3), 2), ((12, 1, 3, 3), 1)):
        g = _validate.conv_geometry(x_shape, w_shape, 1, 1, dilation)
        x_gpu = cupy.zeros(x_shape, dtype)
        dy_gpu = cupy.zeros((2, w_shape[0], g.out_height, g.out_width), dtype)
        steps = depthwise._backward_weight_steps(g, "NCHW", dy_gpu, x_gpu)
        assert not steps.launches[0].expression.startswith(module.KERNEL)


@pytest.mark.parametrize("dtype", NCHW_WGRAD_REGS_DTYPES, ids=str)
def test_nchw_wgrad_regs_dispatch_follows_the_mode(dtype, rng, monkeypatch):
    # The register kernel where it serves (and its rule prefers it), else the
    # staged kernel; the whole-plane weight gradient, which comes first where
    # it serves, off.
    monkeypatch.setattr(_depthwise_nchw_plane_wgrad, "MODE", "never")
    _check_nchw_wgrad_dispatch(_depthwise_nchw_wgrad_regs, ((3, 1, 1), (5, 2, ((1, 3), (2, 2))), (7, 1, 3), (3, 2, 0)),
                               dtype, rng, monkeypatch)


# The NCHW whole-plane weight gradient (_depthwise_nchw_plane_wgrad),
# launched directly on NaN-poisoned partial sums and grad_weight: units of
# several channels' planes (C not a multiple of P: a last group of fewer),
# odd widths (grad_out and x rows between 16-byte boundaries), per-side and
# oversized padding, stride 2 on odd and even sources, bands (75x75, 150x150
# stride 2, 60x70 7x7 with padding past the filter's half, bands wholly in
# the padding), the EfficientNet and benchmark shapes at small N; a second
# run must be bit-identical.
NCHW_PLANE_WGRAD_CASES = [
    # (label, NCHW x shape, filter size, stride, padding)
    ("13x11 C=7 3x3 s1 p1", (2, 7, 13, 11), 3, 1, 1),
    ("9x10 C=5 5x5 s1 per-side", (1, 5, 9, 10), 5, 1, ((0, 4), (3, 1))),
    ("7x7 C=3 7x7 s1 p3", (3, 3, 7, 7), 7, 1, 3),
    ("5x9 C=2 7x7 s1 padding > filter", (1, 2, 5, 9), 7, 1, ((8, 2), (0, 8))),
    ("6x5 C=50 3x3 s1 p1", (3, 50, 6, 5), 3, 1, 1),
    ("4x7 C=5 3x3 s2 valid", (2, 5, 4, 7), 3, 2, 0),
    ("19x19 C=3 5x5 s2 p2", (2, 3, 19, 19), 5, 2, 2),
    ("15x15 C=2 7x7 s2 p3", (1, 2, 15, 15), 7, 2, 3),
    ("12x16 C=2 3x3 s2 TF same", (1, 2, 12, 16), 3, 2, ((1, 1), (0, 1))),
    ("19x19 C=576 3x3 s1", (3, 576, 19, 19), 3, 1, 1),
    ("38x38 C=288 3x3 s2", (2, 288, 38, 38), 3, 2, 1),
    ("10x10 C=1392 5x5 s1", (2, 1392, 10, 10), 5, 1, 2),
    ("14x14 C=384 7x7 s1", (4, 384, 14, 14), 7, 1, 3),
    ("28x28 C=384 3x3 s1", (4, 384, 28, 28), 3, 1, 1),
    ("75x75 C=8 3x3 s1 bands", (3, 8, 75, 75), 3, 1, 1),
    ("7x7 C=3 3x3 s1 9 images: two splits", (9, 3, 7, 7), 3, 1, 1),
    ("60x70 C=1 7x7 s1 p8 bands, 5 images: two splits", (5, 1, 60, 70), 7, 1, 8),
    ("75x75 C=4 5x5 s2 bands", (2, 4, 75, 75), 5, 2, 2),
    ("150x150 C=2 3x3 s2 bands", (2, 2, 150, 150), 3, 2, 1),
    ("60x70 C=1 7x7 s1 p8 bands", (2, 1, 60, 70), 7, 1, 8),
    ("20x70 C=2 3x3 s1 bottom padding 60", (1, 2, 20, 70), 3, 1, ((0, 60), (1, 1))),
    ("20x70 C=2 3x3 s1 top padding 60", (1, 2, 20, 70), 3, 1, ((60, 0), (1, 1))),
]
NCHW_PLANE_WGRAD_DTYPES = [d for d in DTYPES if numpy.dtype(d) in _depthwise_nchw_plane.DTYPES]


@pytest.mark.parametrize("x_offset", [0, 4], ids=["aligned", "x+4B"])
@pytest.mark.parametrize("dtype", NCHW_PLANE_WGRAD_DTYPES, ids=str)
@pytest.mark.parametrize("case", NCHW_PLANE_WGRAD_CASES, ids=lambda c: c[0])
def test_nchw_plane_wgrad_kernel_matches_reference(case, dtype, x_offset, rng):
    _check_nchw_wgrad_kernel(_depthwise_nchw_plane_wgrad, "depthwise NCHW whole-plane weight gradient", case, dtype,
                             x_offset, rng, aligned_only=True)


@pytest.mark.parametrize("dtype", NCHW_PLANE_WGRAD_DTYPES, ids=str)
def test_nchw_plane_wgrad_dispatch_follows_the_mode(dtype, rng, monkeypatch):
    # The whole-plane weight gradient where it serves (and its rule prefers
    # it), else the other kernels.
    _check_nchw_wgrad_dispatch(_depthwise_nchw_plane_wgrad,
                               ((3, 1, 1), (5, 2, ((1, 3), (2, 2))), (7, 1, 3), (3, 2, 0), (5, 1, 2)),
                               dtype, rng, monkeypatch)


# The tensor-core weight gradient (_depthwise_wgrad_mma), launched directly
# (partial sums, then the shared finalize) in both layouts: every filter
# size, per-side padding and padding past the filter (rows r < K - 1 and
# r >= out_h: the border products), 1-row and 3-column planes, out_w past 16
# and 32 (2 and 3 chunks), C = 20 (NCHW: a group of 4 channels; NHWC: no
# plan), odd planes and odd out_w (NCHW: no plan), several splits, units
# fewer than the warps (1-row planes), x 4 bytes off 16
# (NCHW: 4-byte pieces; NHWC: no plan); NaN-poisoned partial sums and
# output; the same bits on a second run.
WGRAD_MMA_CASES = [
    # (label, NCHW x shape, filter size, padding)
    ("14x14 C=16 7x7 p3", (3, 16, 14, 14), 7, 3),
    ("28x28 C=24 5x5 p2", (2, 24, 28, 28), 5, 2),
    ("13x11 C=8 3x3 p1 (odd plane)", (2, 8, 13, 11), 3, 1),
    ("9x10 C=16 5x5 per-side", (1, 16, 9, 10), 5, ((0, 4), (3, 1))),
    ("5x8 C=8 7x7 padding K-1 rows, > K columns", (1, 8, 5, 8), 7, ((6, 2), (0, 9))),
    ("28x3 C=16 7x7 per-side", (2, 16, 28, 3), 7, ((2, 3), (3, 2))),
    ("1x12 C=16 3x3 (1, 0)", (2, 16, 1, 12), 3, (1, 0)),
    ("8x40 C=8 5x5 3 chunks", (2, 8, 8, 40), 5, 2),
    ("30x34 C=20 3x3 p0", (3, 20, 30, 34), 3, 0),
    ("28x28 C=384 3x3", (4, 384, 28, 28), 3, 1),
    ("14x14 C=384 7x7 splits", (24, 384, 14, 14), 7, 3),
    ("10x10 C=32 3x3 300 images", (300, 32, 10, 10), 3, 1),
]
WGRAD_MMA_DTYPES = [d for d in DTYPES if d in _depthwise_wgrad_mma.DTYPES]


def _wgrad_mma_case(case, dtype, layout, rng):
    """(geometry, grad_out, x, float64 reference) in ``layout``."""
    _, x_shape, k, padding = case
    c = x_shape[1]
    g = _validate.conv_geometry(x_shape, (c, 1, k, k), 1, padding, 1)
    dy = random(rng, (g.batch, c, g.out_height, g.out_width), dtype)
    x = random(rng, x_shape, dtype)
    if layout == "NHWC":
        dy, x = (numpy.ascontiguousarray(a.transpose(0, 2, 3, 1)) for a in (dy, x))
        g = _validate.conv_geometry(x.shape, (c, 1, k, k), 1, padding, 1, layout="NHWC")
    want = reference.depthwise_conv2d_backward_weight(dy, x, (c, 1, k, k), padding=padding, layout=layout)
    return g, dy, x, want


def _wgrad_mma_served(g, layout, x_offset):
    if layout == "NHWC":
        return g.channels % 8 == 0 and x_offset == 0
    return g.out_width % 2 == 0 and (g.height * g.width) % 2 == 0


@pytest.mark.parametrize("x_offset", [0, 4], ids=["aligned", "x+4B"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", WGRAD_MMA_DTYPES, ids=str)
@pytest.mark.parametrize("case", WGRAD_MMA_CASES, ids=lambda c: c[0])
def test_wgrad_mma_kernel_matches_reference(case, dtype, layout, x_offset, rng):
    g, dy, x, want = _wgrad_mma_case(case, dtype, layout, rng)
    dy_gpu = _offset_view(dy.shape, dtype, 0, dy)
    x_gpu = _offset_view(x.shape, dtype, x_offset, x)
    index = _launch.index_type(dy_gpu.size, x_gpu.size)
    alignments = (depthwise._alignment(dy_gpu), depthwise._alignment(x_gpu))
    planned = _depthwise_wgrad_mma.plan(g, numpy.dtype(dtype), layout, index, *alignments)
    if not _wgrad_mma_served(g, layout, x_offset):
        assert planned is None
        return
    assert planned is not None
    out, sums = _run_nhwc_wgrad(planned, dy_gpu, x_gpu, want.shape, dtype)
    assert bool(cupy.isfinite(sums).all()), "a partial sum was not written"
    error = relative_error(out, want)
    record_errors(f"depthwise {layout} tensor-core weight gradient", str(numpy.dtype(dtype)), {"s1": error})
    assert error <= TOLERANCE[dtype]
    again, _ = _run_nhwc_wgrad(planned, dy_gpu, x_gpu, want.shape, dtype)
    bits = f"u{numpy.dtype(dtype).itemsize}"
    assert bool((again.view(bits) == out.view(bits)).all())  # deterministic
    if index == "int":  # the 64-bit specialization on the same data
        wide = _depthwise_wgrad_mma.plan(g, numpy.dtype(dtype), layout, "long long", *alignments)
        assert wide[0][0].expression.endswith("long long>")
        out64, _ = _run_nhwc_wgrad(wide, dy_gpu, x_gpu, want.shape, dtype)
        assert bool((out64.view(bits) == out.view(bits)).all())


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_wgrad_mma_ring_depths_give_the_same_bits(layout, rng):
    # One split of 20 images per channel group (target_blocks 1), so every
    # raw buffer of a 2-, 3-, 5- and 8-deep ring is refilled several times
    # while later images are in flight: the sums match the reference and are
    # bit-identical across depths (the summation order does not depend on
    # the ring).
    dtype = numpy.float16
    g, dy, x, want = _wgrad_mma_case(("ring", (20, 16, 14, 14), 7, 3), dtype, layout, rng)
    dy_gpu, x_gpu = cupy.asarray(dy), cupy.asarray(x)
    outs = []
    for stages in (2, 3, 5, 8):
        planned = _depthwise_wgrad_mma.plan(g, numpy.dtype(dtype), layout, "int", 16, 16, 1, stages)
        launch = planned[0][0]
        assert launch.grid[1] == 1 and int(launch.scalars[-1]) == stages
        out, sums = _run_nhwc_wgrad(planned, dy_gpu, x_gpu, want.shape, dtype)
        assert bool(cupy.isfinite(sums).all()), stages
        assert relative_error(out, want) <= TOLERANCE[numpy.dtype(dtype)], stages
        outs.append(out.view(cupy.uint16))
    assert all(bool((o == outs[0]).all()) for o in outs[1:])


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", WGRAD_MMA_DTYPES, ids=str)
def test_wgrad_mma_keeps_unread_non_finite_values_out(dtype, layout, rng):
    # An inf in x where some taps never read it (the last column: read only
    # by taps j >= pad_left + 1 ... ; a top row: not by the bottom filter
    # rows): exactly the taps whose windows hold it are non-finite, as in
    # the reference (the kernel multiplies no value with a tap that does not
    # read it: masked B rows past out_w, border rows summed per lane).  An
    # inf in grad_out: exactly the taps that multiply it, padding included
    # (0 * inf is NaN in the reference: padding_row_poison for the padding
    # rows the kernel does not walk); a middle row's meets no padding row.
    for tensor, k, padding, spot in (
        ("x", 7, 3, (1, 2, 11, 11)), ("x", 7, 3, (0, 5, 0, 4)), ("x", 3, 0, (1, 3, 11, 0)), ("x", 5, 1, (0, 0, 5, 11)),
        ("dy", 7, 3, (0, 0, 0, 0)), ("dy", 7, 3, (1, 5, 11, 7)), ("dy", 5, ((1, 3), (2, 2)), (0, 7, 11, 4)),
        ("dy", 7, 3, (0, 1, 6, 6)),
    ):
        case = ("inf", (2, 8, 12, 12), k, padding)
        g, dy, x, _ = _wgrad_mma_case(case, dtype, "NCHW", rng)
        (x if tensor == "x" else dy)[spot] = numpy.inf
        if layout == "NHWC":
            dy, x = (numpy.ascontiguousarray(a.transpose(0, 2, 3, 1)) for a in (dy, x))
            g = _validate.conv_geometry(x.shape, (8, 1, k, k), 1, padding, 1, layout="NHWC")
        want = reference.depthwise_conv2d_backward_weight(dy, x, (8, 1, k, k), padding=padding, layout=layout)
        finite = numpy.isfinite(want)
        assert finite.any() and not finite.all()
        planned = _depthwise_wgrad_mma.plan(g, numpy.dtype(dtype), layout, "int", 16, 16)
        out, _ = _run_nhwc_wgrad(planned, cupy.asarray(dy), cupy.asarray(x), want.shape, dtype)
        assert bool((cupy.isfinite(out).get() == finite).all()), (tensor, k, padding, spot)
        assert relative_error(out.get()[finite], want[finite]) <= TOLERANCE[dtype]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", WGRAD_MMA_DTYPES, ids=str)
def test_wgrad_mma_dispatch_follows_the_mode(dtype, layout, rng, monkeypatch):
    # MODE "always" / "rule" / "never": the op launches the kernel exactly
    # where the mode says (and its rule where "rule"), results match the
    # reference and repeat bit for bit; stride 2, dilation 2 and a depth
    # multiplier keep the other kernels under "always".
    for mode in ("always", "rule", "never"):
        monkeypatch.setattr(_depthwise_wgrad_mma, "MODE", mode)
        monkeypatch.setattr(depthwise, "_SIGNATURES", {})  # no Steps resolved under another mode
        for k, padding in ((3, 1), (5, ((1, 3), (2, 2))), (7, 3)):
            g, dy, x, want = _wgrad_mma_case(("", (2, 16, 20, 22), k, padding), dtype, layout, rng)
            x_gpu, dy_gpu = cupy.asarray(x), cupy.asarray(dy)
            steps = depthwise._backward_weight_steps(g, layout, dy_gpu, x_gpu)
            taken = steps.launches[0].expression.startswith(_depthwise_wgrad_mma.KERNEL)
            assert taken == (mode == "always" or (mode == "rule" and _depthwise_wgrad_mma.preferred(g, dtype, layout)))
            w_shape = want.shape
            conv = dict(padding=padding, layout=layout)
            dw = cupy_dwgn.depthwise_conv2d_backward_weight(dy_gpu, x_gpu, w_shape, out=poisoned(w_shape, dtype), **conv)
            assert relative_error(dw, want) <= TOLERANCE[dtype], (mode, k)
            again = cupy_dwgn.depthwise_conv2d_backward_weight(dy_gpu, x_gpu, w_shape, **conv)
            bits = f"u{numpy.dtype(dtype).itemsize}"
            assert bool((again.view(bits) == dw.view(bits)).all())
    monkeypatch.setattr(_depthwise_wgrad_mma, "MODE", "always")
    for w_shape, stride, dilation in (((16, 1, 3, 3), 2, 1), ((16, 1, 3, 3), 1, 2), ((32, 1, 3, 3), 1, 1)):
        x_shape = (2, 16, 20, 22) if layout == "NCHW" else (2, 20, 22, 16)
        g = _validate.conv_geometry(x_shape, w_shape, stride, 1, dilation, layout=layout)
        x_gpu = cupy.zeros(x_shape, dtype)
        dy_gpu = cupy.zeros(_validate.layout_shape(layout, 2, w_shape[0], g.out_height, g.out_width), dtype)
        steps = depthwise._backward_weight_steps(g, layout, dy_gpu, x_gpu)
        assert not steps.launches[0].expression.startswith(_depthwise_wgrad_mma.KERNEL)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_wgrad_mma_kernel_over_2_31_elements(layout):
    # x and grad_out (2800, 1024, 28, 28) float16 (NHWC: (2800, 28, 28,
    # 1024)) = 2.25e9 elements: image n starts at n * 802816, past 2**31
    # from n = 2675.  Both are zero but for the last 4 images, so every sum
    # comes from past 2**31; the 64-bit specialization, launched directly,
    # against the reference on those images (a few channels).
    n, c, hw, k = 2800, 1024, 28, 5
    shape = (n, c, hw, hw) if layout == "NCHW" else (n, hw, hw, c)
    assert numpy.prod(shape) >= 2**31 and (n - 4) * c * hw * hw >= 2**31
    g = _validate.conv_geometry(shape, (c, 1, k, k), 1, 2, 1, layout=layout)
    gen = cupy.random.default_rng(17)
    x = cupy.zeros(shape, cupy.float16)
    dy = cupy.zeros(shape, cupy.float16)
    for a in (x, dy):
        a[n - 4 :] = gen.standard_normal((4,) + shape[1:], dtype=cupy.float32).astype(cupy.float16)
    index = _launch.index_type(x.size, dy.size)
    assert index == "long long"
    planned = _depthwise_wgrad_mma.plan(g, numpy.dtype(numpy.float16), layout, index, 16, 16)
    assert planned[0][0].expression.endswith("long long>")
    out, sums = _run_nhwc_wgrad(planned, dy, x, (c, 1, k, k), numpy.float16)
    assert bool(cupy.isfinite(sums).all())
    for ch in (0, 517, c - 1):
        if layout == "NCHW":
            x_c, dy_c = (numpy.ascontiguousarray(a[n - 4 :, ch : ch + 1].get()) for a in (x, dy))
        else:
            x_c, dy_c = (numpy.ascontiguousarray(a[n - 4 :, ..., ch : ch + 1].get()) for a in (x, dy))
        want = reference.depthwise_conv2d_backward_weight(dy_c, x_c, (1, 1, k, k), padding=2, layout=layout)
        assert relative_error(out[ch : ch + 1], want) <= TOLERANCE[numpy.dtype(numpy.float16)], ch
    del x, dy


# The NHWC stride-2 backward-input kernel (_depthwise_nhwc_phase), launched
# directly: every filter size, every padding 0..K-1 class (odd and even pad,
# per-side, "valid", padding such that the last input rows are read by no
# output), odd and tiny planes (1x1, 2x3), C = one vector, C = 96, channel
# counts that split into several tiles with an empty last slot, the
# MobileNetV2 shape; NaN-poisoned grad_in (every pixel must be written).
NHWC_PHASE_CASES = [
    # (label, NHWC x shape, filter size, padding)
    ("112x112 C=96 3x3 p1", (2, 112, 112, 96), 3, 1),
    ("13x11 C=32 3x3 p1", (2, 13, 11, 32), 3, 1),
    ("9x10 C=16 5x5 per-side", (1, 9, 10, 16), 5, ((0, 4), (3, 1))),
    ("7x7 C=16 7x7 p3", (3, 7, 7, 16), 7, 3),
    ("8x8 C=48 3x3 valid", (2, 8, 8, 48), 3, "valid"),
    ("1x1 C=8 3x3 p1", (1, 1, 1, 8), 3, 1),
    ("2x3 C=8 5x5 p2", (2, 2, 3, 8), 5, 2),
    ("10x10 C=8 3x3 p0 unread rows", (1, 10, 10, 8), 3, 0),
    ("29x31 C=264 5x5 p2 tiles", (1, 29, 31, 264), 5, 2),
    ("56x56 C=96 7x7 p3", (2, 56, 56, 96), 7, 3),
    ("15x17 C=40 7x7 p6", (2, 15, 17, 40), 7, 6),
    ("12x9 C=16 5x5 p1 odd pad", (2, 12, 9, 16), 5, 1),
    ("6x5 C=4 3x3 (4-byte types only)", (2, 6, 5, 4), 3, 1),
]


def _nhwc_phase_case(case, dtype, rng):
    _, x_shape, k, padding = case
    c = x_shape[3]
    g = _validate.conv_geometry(x_shape, (c, 1, k, k), 2, padding, 1, layout="NHWC")
    dy = random(rng, (g.batch, g.out_height, g.out_width, c), dtype)
    w = random(rng, (c, 1, k, k), dtype)
    want = reference.depthwise_conv2d_backward_input(dy, w, x_shape, stride=2, padding=padding, layout="NHWC")
    return g, dy, w, want


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", NHWC_PHASE_CASES, ids=lambda c: c[0])
def test_nhwc_phase_kernel_matches_reference(case, dtype, rng):
    g, dy, w, want = _nhwc_phase_case(case, dtype, rng)
    x_shape = case[1]
    dy_gpu = cupy.asarray(dy)
    dx = poisoned(x_shape, dtype)
    index = _launch.index_type(dy_gpu.size, dx.size)
    if g.channels % _depthwise_nhwc_phase.vec(dtype):
        assert _depthwise_nhwc_phase.plan(g, numpy.dtype(dtype), index, True) is None
        return
    assert _depthwise_nhwc_phase.plan(g, numpy.dtype(dtype), index, False) is None  # misaligned: gather kernel
    launch = _depthwise_nhwc_phase.plan(g, numpy.dtype(dtype), index, True)
    assert launch is not None and launch.expression.startswith(_depthwise_nhwc_phase.KERNEL)
    args = (dy_gpu, cupy.asarray(w), dx)
    launch(*args)
    error = relative_error(dx, want)
    record_errors("depthwise NHWC stride-2 backward-input (phase)", str(numpy.dtype(dtype)),
                  {f"{case[2]}x{case[2]}": error})
    assert error <= TOLERANCE[dtype]
    # Deterministic: a second launch over a fresh NaN buffer writes the same bits.
    bits = f"u{dx.itemsize}"
    first = dx.copy()
    dx.fill(numpy.nan)
    launch(*args)
    assert bool((dx.view(bits) == first.view(bits)).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_nhwc_phase_dispatch(dtype, rng, monkeypatch):
    # MODE "rule" (the default) and "always": the NHWC backward-input op launches the phase kernel for stride-2
    # 3x3/5x5/7x7 (preferred() says so for every case it serves) and matches the reference; "never": the gather
    # kernel.  Stride 1, dilation 2, a depth multiplier and a misaligned grad_out keep the other kernels.
    assert _depthwise_nhwc_phase.MODE == "rule"
    x_shape = (2, 21, 18, 32)
    for mode in ("rule", "always", "never"):
        monkeypatch.setattr(_depthwise_nhwc_phase, "MODE", mode)
        monkeypatch.setattr(depthwise, "_SIGNATURES", {})  # no Steps resolved under another mode
        for k, padding in ((3, 1), (5, ((1, 3), (2, 2))), (7, 3)):
            g = _validate.conv_geometry(x_shape, (32, 1, k, k), 2, padding, 1, layout="NHWC")
            dy = random(rng, (2, g.out_height, g.out_width, 32), dtype)
            w = random(rng, (32, 1, k, k), dtype)
            dy_gpu = cupy.asarray(dy)
            out = poisoned(x_shape, dtype)
            steps = depthwise._backward_input_steps(g, "NHWC", dy_gpu, out)
            taken = steps.launches[0].expression.startswith(_depthwise_nhwc_phase.KERNEL)
            assert taken == (mode == "always" or (mode == "rule" and _depthwise_nhwc_phase.preferred(g, dtype)))
            assert taken == (mode != "never")
            assert steps.positions[0] == depthwise._NO_BIAS
            conv = dict(stride=2, padding=padding, layout="NHWC")
            dx = cupy_dwgn.depthwise_conv2d_backward_input(dy_gpu, cupy.asarray(w), x_shape, out=out, **conv)
            want = reference.depthwise_conv2d_backward_input(dy, w, x_shape, **conv)
            assert relative_error(dx, want) <= TOLERANCE[dtype], (mode, k)
    monkeypatch.setattr(_depthwise_nhwc_phase, "MODE", "always")
    for w_shape, stride, dilation in [((32, 1, 3, 3), 1, 1), ((32, 1, 3, 3), 2, 2), ((64, 1, 3, 3), 2, 1),
                                      ((32, 1, 3, 3), (2, 1), 1), ((32, 1, 9, 9), 2, 1), ((32, 1, 3, 5), 2, 1)]:
        g = _validate.conv_geometry(x_shape, w_shape, stride, 1, dilation, layout="NHWC")
        dy_gpu = cupy.zeros((2, g.out_height, g.out_width, w_shape[0]), dtype)
        steps = depthwise._backward_input_steps(g, "NHWC", dy_gpu, cupy.zeros(x_shape, dtype))
        assert not steps.launches[0].expression.startswith(_depthwise_nhwc_phase.KERNEL), (w_shape, stride)
    g = _validate.conv_geometry(x_shape, (32, 1, 3, 3), 2, 1, 1, layout="NHWC")
    dy_misaligned = _misaligned((2, g.out_height, g.out_width, 32), dtype)
    steps = depthwise._backward_input_steps(g, "NHWC", dy_misaligned, cupy.zeros(x_shape, dtype))
    assert not steps.launches[0].expression.startswith(_depthwise_nhwc_phase.KERNEL)


# The NHWC large-filter path (_depthwise_nhwc_large): the NCHW large-filter
# kernels between two transposes, for all three ops: odd sizes, per-side and
# oversized padding, a depth multiplier, a non-square filter, a channel count
# off every tile, NaN-poisoned outputs.
NHWC_LARGE_CASES = [
    # (label, NCHW x shape, weight shape, padding)
    ("9x9 p4", (2, 6, 20, 17), (6, 1, 9, 9), 4),
    ("13x13 per-side M=2", (1, 3, 25, 30), (6, 1, 13, 13), ((2, 9), (6, 0))),
    ("9x15 valid", (2, 5, 19, 40), (5, 1, 9, 15), "valid"),
    ("31x31 padding 20 C=33", (1, 33, 16, 16), (33, 1, 31, 31), 20),
    ("31x31 M=2 per-side", (2, 4, 21, 18), (8, 1, 31, 31), ((3, 16), (15, 0))),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", NHWC_LARGE_CASES, ids=lambda c: c[0])
def test_nhwc_large_filters_run_the_nchw_kernels_between_transposes(case, dtype, rng):
    _, x_nchw, w_shape, padding = case
    x = _to_layout(random(rng, x_nchw, dtype), "NHWC")
    w, b = random(rng, w_shape, dtype), random(rng, w_shape[0], dtype)
    conv = dict(padding=padding, layout="NHWC")
    g = _validate.conv_geometry(x.shape, w_shape, 1, padding, 1, layout="NHWC")
    y_shape = (g.batch, g.out_height, g.out_width, w_shape[0])
    x_gpu, w_gpu = cupy.asarray(x), cupy.asarray(w)
    dy = random(rng, y_shape, dtype)
    dy_gpu = cupy.asarray(dy)
    transpose = _depthwise_nhwc_large.KERNEL_FILE
    for steps in (depthwise._forward_steps(g, "NHWC", x_gpu, dy_gpu),
                  depthwise._backward_input_steps(g, "NHWC", dy_gpu, x_gpu)):
        assert [launch.file for launch in steps.launches] == [transpose, "depthwise_nchw_large.cu", transpose]
    y = cupy_dwgn.depthwise_conv2d(x_gpu, w_gpu, cupy.asarray(b), out=poisoned(y_shape, dtype), **conv)
    assert relative_error(y, reference.depthwise_conv2d(x, w, b, **conv)) <= TOLERANCE[dtype]
    dx = cupy_dwgn.depthwise_conv2d_backward_input(dy_gpu, w_gpu, x.shape, out=poisoned(x.shape, dtype), **conv)
    assert relative_error(dx, reference.depthwise_conv2d_backward_input(dy, w, x.shape, **conv)) <= TOLERANCE[dtype]
    steps = depthwise._backward_weight_steps(g, "NHWC", dy_gpu, x_gpu)
    routed = w_shape[2] * w_shape[3] >= _depthwise_nhwc_large.WEIGHT_GRADIENT_MIN_TAPS[numpy.dtype(dtype).itemsize]
    assert (steps.launches[0].file == transpose) == routed
    dw = cupy_dwgn.depthwise_conv2d_backward_weight(dy_gpu, x_gpu, w_shape, out=poisoned(w_shape, dtype), **conv)
    assert relative_error(dw, reference.depthwise_conv2d_backward_weight(dy, x, w_shape, **conv)) <= TOLERANCE[dtype]
    again = cupy_dwgn.depthwise_conv2d_backward_weight(dy_gpu, x_gpu, w_shape, **conv)
    bits = f"u{dw.itemsize}"
    assert bool((again.view(bits) == dw.view(bits)).all())  # deterministic


# The NCHW weight gradient through NHWC copies (_depthwise_nchw_via_nhwc):
# two transposes, the NHWC register-tap kernel and its finalize, taken by the
# rule for half-type 5x5 at stride 1 where the NCHW register kernel would read
# one column per lane (odd widths), and forced elsewhere; odd and even widths, stride 1 and 2, every
# filter it serves, per-side padding, several images; NaN-poisoned outputs,
# bit-identical to the NHWC op on NHWC copies of the same data and run to run.
# (label, x shape, filter size, stride, padding)
VIA_NHWC_CASES = [
    ("19x19 3x3", (3, 32, 19, 19), 3, 1, 1),
    ("19x19 5x5", (2, 48, 19, 19), 5, 1, 2),
    ("15x15 7x7", (2, 32, 15, 15), 7, 1, 3),
    ("38x38 3x3 s2", (2, 32, 38, 38), 3, 2, 1),
    ("19x19 5x5 s2", (2, 64, 19, 19), 5, 2, 2),
    ("75x75 3x3", (1, 16, 75, 75), 3, 1, 1),
    ("21x17 3x3 per-side", (2, 32, 21, 17), 3, 1, ((0, 2), (1, 1))),
    ("28x28 3x3 (even: forced only)", (2, 32, 28, 28), 3, 1, 1),
]


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d in _depthwise_nhwc_wgrad.DTYPES], ids=str)
@pytest.mark.parametrize("case", VIA_NHWC_CASES, ids=lambda c: c[0])
def test_nchw_weight_gradient_via_nhwc(case, dtype, rng, monkeypatch):
    _, x_shape, k, stride, padding = case
    w_shape = (x_shape[1], 1, k, k)
    g = _validate.conv_geometry(x_shape, w_shape, stride, padding, 1)
    x = random(rng, x_shape, dtype)
    dy = random(rng, (g.batch, g.channels, g.out_height, g.out_width), dtype)
    x_gpu, dy_gpu = cupy.asarray(x), cupy.asarray(dy)
    conv = dict(stride=stride, padding=padding)
    want = reference.depthwise_conv2d_backward_weight(dy, x, w_shape, **conv)
    transpose = _depthwise_nhwc_large.KERNEL_FILE
    routed_by_rule = _depthwise_nchw_via_nhwc.preferred(g, dtype, 16, 16)
    monkeypatch.setattr(_depthwise_nchw_plane_wgrad, "MODE", "never")  # it comes first where it serves
    monkeypatch.setattr(_depthwise_wgrad_mma, "MODE", "never")  # and this one before it
    for mode in ("rule", "always"):
        monkeypatch.setattr(_depthwise_nchw_via_nhwc, "MODE", mode)
        monkeypatch.setattr(depthwise, "_SIGNATURES", {})  # no Steps resolved under another mode
        steps = depthwise._backward_weight_steps(g, "NCHW", dy_gpu, x_gpu)
        routed = mode == "always" or routed_by_rule
        assert (steps.launches[0].file == transpose) == routed
        if not routed:
            continue
        assert [launch.file for launch in steps.launches[:2]] == [transpose] * 2
        assert steps.launches[2].expression.startswith(_depthwise_nhwc_wgrad.KERNEL)
        dw = cupy_dwgn.depthwise_conv2d_backward_weight(dy_gpu, x_gpu, w_shape, out=poisoned(w_shape, dtype), **conv)
        error = relative_error(dw, want)
        record_errors("depthwise NCHW weight gradient via NHWC", str(numpy.dtype(dtype)), {"backward_weight": error})
        assert error <= TOLERANCE[dtype]
        bits = f"u{dw.itemsize}"
        again = cupy_dwgn.depthwise_conv2d_backward_weight(dy_gpu, x_gpu, w_shape, **conv)
        assert bool((again.view(bits) == dw.view(bits)).all())  # deterministic
        nhwc = cupy_dwgn.depthwise_conv2d_backward_weight(
            cupy.ascontiguousarray(dy_gpu.transpose(0, 2, 3, 1)), cupy.ascontiguousarray(x_gpu.transpose(0, 2, 3, 1)),
            w_shape, layout="NHWC", **conv)
        assert bool((nhwc.view(bits) == dw.view(bits)).all())  # the NHWC op's kernel and sums


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_layout_transpose_kernel_moves_every_element_once(dtype, rng):
    # Ragged tiles both ways, one-element and one-row images, several images,
    # and a 3-block grid that walks every tile; every bit compared.
    itemsize = numpy.dtype(dtype).itemsize
    bits = f"u{itemsize}"
    for batch, rows, cols in ((1, 1, 1), (3, 33, 65), (2, 1000, 7), (1, 31, 2049), (5, 64, 32)):
        src = cupy.asarray(random(rng, (batch, rows, cols), dtype))
        want = cupy.ascontiguousarray(src.transpose(0, 2, 1))
        launch = _depthwise_nhwc_large.transpose(batch, rows, cols, itemsize)
        for grid in (launch.grid, (3,)):
            dst = poisoned((batch, cols, rows), dtype)
            _launch.Launch(launch.file, launch.expression, grid, launch.block, launch.shared_mem, launch.scalars)(src, dst)
            assert bool((dst.view(bits) == want.view(bits)).all()), (batch, rows, cols, grid)


@pytest.mark.slow
def test_layout_transpose_kernel_over_2_31_elements():
    # (1, 2**21 + 3, 1024) float16 = 2**31 + 3072 elements: source rows 2**21+
    # and, in the destination, the last columns' rows lie past 2**31.
    rows, cols = 2**21 + 3, 1024
    src = cupy.random.default_rng(3).standard_normal((1, rows, cols), dtype=cupy.float32).astype(cupy.float16)
    dst = cupy.full((1, cols, rows), numpy.nan, cupy.float16)
    launch = _depthwise_nhwc_large.transpose(1, rows, cols, 2)
    assert launch.expression.endswith("long long>")
    launch(src, dst)
    for r in (0, 2**21 - 1, 2**21, rows - 1):
        assert bool((dst[0, :, r] == src[0, r, :]).all()), r
    for c in (0, 511, cols - 1):
        assert bool((dst[0, c, -4096:] == src[0, -4096:, c]).all()), c


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_forward_without_bias_and_default_out(dtype, layout, rng):
    x = _to_layout(random(rng, (2, 6, 14, 14), dtype), layout)
    w = random(rng, (6, 1, 3, 3), dtype)
    y = cupy_dwgn.depthwise_conv2d(cupy.asarray(x), cupy.asarray(w), padding=1, layout=layout)
    assert y.shape == _shape((2, 6, 14, 14), layout) and y.flags.c_contiguous
    assert relative_error(y, reference.depthwise_conv2d(x, w, padding=1, layout=layout)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_zero_size_inputs_give_empty_outputs(layout):
    shape = _shape((0, 3, 8, 8), layout)
    x = cupy.zeros(shape, cupy.float32)
    w = cupy.ones((3, 1, 3, 3), cupy.float32)
    assert cupy_dwgn.depthwise_conv2d(x, w, padding=1, layout=layout).shape == shape
    dy = cupy.zeros(shape, cupy.float32)
    assert cupy_dwgn.depthwise_conv2d_backward_input(dy, w, shape, padding=1, layout=layout).shape == shape
    # No positions to sum: every weight gradient is 0 (written over the NaN).
    out = poisoned((3, 1, 3, 3), numpy.float32)
    dw = cupy_dwgn.depthwise_conv2d_backward_weight(dy, x, (3, 1, 3, 3), padding=1, layout=layout, out=out)
    assert dw.shape == (3, 1, 3, 3) and not cupy.any(dw)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_zero_height_input_with_padding_gives_bias_only(layout, rng):
    x = cupy.zeros(_shape((1, 2, 0, 5), layout), cupy.float32)
    w = cupy.asarray(random(rng, (2, 1, 1, 1), numpy.float32))
    b = cupy.asarray(numpy.array([1.5, -2.0], numpy.float32))
    y = cupy_dwgn.depthwise_conv2d(x, w, b, padding=(1, 0), layout=layout)
    assert y.shape == _shape((1, 2, 2, 5), layout)
    numpy.testing.assert_array_equal(_channels(y, 0, 1, layout).get(), 1.5)
    numpy.testing.assert_array_equal(_channels(y, 1, 2, layout).get(), -2.0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_host_wrappers_round_trip_numpy(layout, rng):
    import cupy_dwgn.host as host

    conv = dict(padding=1, layout=layout)
    x = _to_layout(random(rng, (2, 4, 9, 9), numpy.float32), layout)
    w = random(rng, (4, 1, 3, 3), numpy.float32)
    y = host.depthwise_conv2d(x, w, **conv)
    assert isinstance(y, numpy.ndarray)
    assert relative_error(cupy.asarray(y), reference.depthwise_conv2d(x, w, **conv)) <= 1e-5
    dx = host.depthwise_conv2d_backward_input(y, w, x.shape, **conv)
    dw = host.depthwise_conv2d_backward_weight(y, x, w.shape, **conv)
    assert isinstance(dx, numpy.ndarray) and isinstance(dw, numpy.ndarray)
    assert relative_error(cupy.asarray(dx), reference.depthwise_conv2d_backward_input(y, w, x.shape, **conv)) <= 1e-5
    assert relative_error(cupy.asarray(dw), reference.depthwise_conv2d_backward_weight(y, x, w.shape, **conv)) <= 1e-5


@pytest.mark.parametrize("layout", LAYOUTS)
def test_launches_on_the_current_stream(layout, rng):
    conv = dict(padding=1, layout=layout)
    x = cupy.asarray(_to_layout(random(rng, (4, 16, 64, 64), numpy.float32), layout))
    w = cupy.asarray(random(rng, (16, 1, 3, 3), numpy.float32))
    expected = cupy_dwgn.depthwise_conv2d(x, w, **conv)
    expected_dx = cupy_dwgn.depthwise_conv2d_backward_input(expected, w, x.shape, **conv)
    expected_dw = cupy_dwgn.depthwise_conv2d_backward_weight(expected, x, w.shape, **conv)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        y = cupy_dwgn.depthwise_conv2d(x, w, **conv)
        dx = cupy_dwgn.depthwise_conv2d_backward_input(y, w, x.shape, **conv)
        dw = cupy_dwgn.depthwise_conv2d_backward_weight(y, x, w.shape, **conv)
    stream.synchronize()
    cupy.testing.assert_array_equal(y, expected)
    cupy.testing.assert_allclose(dx, expected_dx, rtol=1e-6, atol=1e-6)
    cupy.testing.assert_array_equal(dw, expected_dw)  # deterministic: bit-identical
    assert cupy.isfinite(dw).all()


# NCHW small-filter weight gradient (_depthwise_nchw_wgrad) with blocks that
# walk several stages: float64 double-buffers its cp.async staging (stage
# s + 1 in flight while stage s is summed), the other types restage one
# buffer.  (x shape, filter, stride): 4-12 stages over 2 splits; 2-5 stages
# in one block, the last one short; stride 2, 2-3 stages, the last one short.
NCHW_MULTI_STAGE = [((12, 528, 56, 56), 3, 1), ((9, 1056, 30, 30), 3, 1), ((11, 1056, 9, 9), 7, 1), ((5, 1056, 40, 40), 5, 2)]


@pytest.mark.parametrize("case", NCHW_MULTI_STAGE, ids=lambda c: f"{c[0]}-k{c[1]}-s{c[2]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_nchw_weight_gradient_blocks_walk_several_stages(case, dtype, rng):
    from cupy_dwgn import _depthwise_nchw_wgrad

    x_shape, k, stride = case
    n, c, h, w = x_shape
    shape = (c, 1, k, k)
    g = _validate.conv_geometry(x_shape, shape, stride, k // 2, 1)
    launches = _depthwise_nchw_wgrad.plan(g, numpy.dtype(dtype))
    partial = launches[0]
    units, per_stage = int(partial.scalars[10]), int(partial.scalars[11])
    assert -(-units // per_stage) > partial.grid[1], "no block walks two stages: the case no longer tests them"
    x = random(rng, x_shape, dtype)
    dy = random(rng, (n, c, g.out_height, g.out_width), dtype)
    conv = dict(stride=stride, padding=k // 2)
    out = poisoned(shape, dtype)
    x_d, dy_d = cupy.asarray(x), cupy.asarray(dy)
    cupy_dwgn.depthwise_conv2d_backward_weight(dy_d, x_d, shape, out=out, **conv)
    error = relative_error(out, reference.depthwise_conv2d_backward_weight(dy, x, shape, **conv))
    record_errors("depthwise NCHW weight gradient, multi-stage blocks", numpy.dtype(dtype).name, {"dw": error})
    assert error <= TOLERANCE[numpy.dtype(dtype)]
    again = cupy_dwgn.depthwise_conv2d_backward_weight(dy_d, x_d, shape, **conv)
    numpy.testing.assert_array_equal(again.view(cupy.uint8).get(), out.view(cupy.uint8).get())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_weight_gradient_with_more_elements_than_one_grid(layout, rng):
    # 1.9M filters of 3x3 = 17.1M weights, more than the 65536 x 256 threads
    # of a capped launch grid: the finalize pass must loop, not stop short
    # (NHWC: 1.9M channels, far more than one grid of channel blocks).
    x = _to_layout(random(rng, (1, 1_900_000, 3, 3), numpy.float32), layout)
    dy = _to_layout(random(rng, (1, 1_900_000, 3, 3), numpy.float32), layout)
    shape = (1_900_000, 1, 3, 3)
    conv = dict(padding=1, layout=layout)
    out = poisoned(shape, numpy.float32)
    cupy_dwgn.depthwise_conv2d_backward_weight(cupy.asarray(dy), cupy.asarray(x), shape, out=out, **conv)
    assert relative_error(out, reference.depthwise_conv2d_backward_weight(dy, x, shape, **conv)) <= 1e-5


def test_precompile_loads_the_kernels_it_names(capsys):
    from cupy_dwgn import _compile

    selection = dict(dtypes=[numpy.float32], filter_sizes=[(3, 3)])
    # precompile() builds the 32-bit-index kernels unless asked for more.
    named = [e for _, e in _compile.specializations(["depthwise_conv2d"], large_index=(False,), **selection)]
    assert named and all("long long" not in e for e in named)
    assert not any(t in e for e in named for t in ("double", "__half", "bfloat16"))
    count = cupy_dwgn.precompile(["depthwise_conv2d"], **selection)
    assert count == len(named)
    err = capsys.readouterr().err
    for expression in named:
        assert expression in err
    # Narrowed to one layout: a proper subset, still all loaded.
    nhwc = [e for _, e in _compile.specializations(["depthwise_conv2d"], large_index=(False,), layouts=["NHWC"], **selection)]
    assert nhwc and set(nhwc) < set(named)
    assert cupy_dwgn.precompile(["depthwise_conv2d"], layouts=["NHWC"], **selection) == len(nhwc)


# --- seed bugs (CHANGELOG.md, Fixed), each with the input that broke the seed --------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("filter_size", [(3, 5), (5, 3), (1, 7), (7, 1)])
def test_seed_bug_non_square_weight_gradient_and_no_write_past_the_end(filter_size, layout, rng):
    # The seed's Small backward-filter kernel used filter_height for
    # filter_width: 100%+ error on 3x5 and a write past the buffer on 5x3.
    kh, kw = filter_size
    x = _to_layout(random(rng, (2, 8, 16, 16), numpy.float32), layout)
    dy = _to_layout(random(rng, (2, 8, 16, 16), numpy.float32), layout)
    conv = dict(padding=(kh // 2, kw // 2), layout=layout)
    size = 8 * kh * kw
    guard = cupy.full(size + 64, numpy.nan, cupy.float32)
    guard[size:] = 123.0
    out = guard[:size].reshape(8, 1, kh, kw)
    cupy_dwgn.depthwise_conv2d_backward_weight(cupy.asarray(dy), cupy.asarray(x), out.shape, out=out, **conv)
    ref = reference.depthwise_conv2d_backward_weight(dy, x, out.shape, **conv)
    assert relative_error(out, ref) <= 1e-5
    assert bool((guard[size:] == 123.0).all()), "wrote past the end of grad_weight"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_seed_bug_many_slices_no_stale_accumulators(layout, rng):
    # The seed zeroed its shared accumulators once per block: with a capped
    # grid each block's later slices summed on top of stale values.
    conv = dict(padding=1, layout=layout)
    x = _to_layout(random(rng, (64, 96, 8, 8), numpy.float32), layout)
    dy = _to_layout(random(rng, (64, 96, 8, 8), numpy.float32), layout)
    dw = cupy_dwgn.depthwise_conv2d_backward_weight(cupy.asarray(dy), cupy.asarray(x), (96, 1, 3, 3), **conv)
    assert relative_error(dw, reference.depthwise_conv2d_backward_weight(dy, x, (96, 1, 3, 3), **conv)) <= 1e-5


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [numpy.float16, DTYPES[3]], ids=["float16", "bfloat16"])
def test_seed_bug_half_types_accumulate_in_float32(dtype, layout, rng):
    # 2 * 96 * 96 = 18432 positive products per weight: a half accumulator
    # stops growing long before (and half atomics lose the rest).
    x = _to_layout((1.0 + rng.random((2, 4, 96, 96))).astype(dtype), layout)
    dy = _to_layout((1.0 + rng.random((2, 4, 96, 96))).astype(dtype), layout)
    conv = dict(padding=1, layout=layout)
    dw = cupy_dwgn.depthwise_conv2d_backward_weight(cupy.asarray(dy), cupy.asarray(x), (4, 1, 3, 3), **conv)
    ref = reference.depthwise_conv2d_backward_weight(dy, x, (4, 1, 3, 3), **conv)
    assert relative_error(dw, ref) <= TOLERANCE[numpy.dtype(dtype)]
    w = (rng.random((4, 1, 7, 7)) / 49).astype(dtype)
    conv = dict(padding=3, layout=layout)
    y = cupy_dwgn.depthwise_conv2d(cupy.asarray(x), cupy.asarray(w), **conv)
    assert relative_error(y, reference.depthwise_conv2d(x, w, **conv)) <= TOLERANCE[numpy.dtype(dtype)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("filter_size", [(3, 3), (7, 7), (4, 6)])
def test_seed_bug_weight_gradient_is_bit_identical_run_to_run(filter_size, dtype, layout, rng):
    # The seed's weight gradients summed with atomics in arbitrary order.
    x = cupy.asarray(_to_layout(random(rng, (16, 24, 40, 40), dtype), layout))
    dy = cupy.asarray(_to_layout(random(rng, (16, 24, 40, 40), dtype), layout))
    shape = (24, 1) + filter_size
    conv = dict(padding="same", layout=layout)
    first = cupy_dwgn.depthwise_conv2d_backward_weight(dy, x, shape, **conv).view(cupy.uint8).get()
    for _ in range(4):
        again = cupy_dwgn.depthwise_conv2d_backward_weight(dy, x, shape, **conv).view(cupy.uint8).get()
        numpy.testing.assert_array_equal(again, first)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("case", [((16, 24, 40, 40), (3, 3), 1), ((8, 16, 28, 28), (7, 7), 1), ((4, 8, 20, 20), (3, 3), 2),
                                  ((2, 8, 16, 16), (11, 11), 1)], ids=["3x3", "7x7", "3x3-s2", "11x11"])
def test_weight_gradient_finalize_as_a_programmatic_launch(case, dtype, layout, rng, monkeypatch):
    # The split-order finalize after every weight-gradient kernel is a
    # programmatic dependent launch on sm_90 (_launch.PROGRAMMATIC): placed
    # while the partial-sum kernel runs, it waits for that grid before reading
    # the partial sums.  Eager and replayed from a CUDA graph on new data,
    # the bits are those of ordinary launches.
    shape, filter_size, stride = case
    w_shape = (shape[1], 1) + filter_size
    conv = dict(stride=stride, padding=filter_size[0] // 2, layout=layout)
    problems = []
    for _ in range(2):
        x = random(rng, shape, dtype)
        dy = random(rng, reference.depthwise_conv2d(x, random(rng, w_shape, dtype), stride=stride,
                                                    padding=filter_size[0] // 2).shape, dtype)
        problems.append((_to_layout(x, layout), _to_layout(dy, layout)))
    results = {}
    for programmatic in programmatic_settings(monkeypatch, depthwise._SIGNATURES):
        x, dy = (cupy.asarray(a) for a in problems[0])
        eager = cupy_dwgn.depthwise_conv2d_backward_weight(dy, x, w_shape, **conv)
        out = cupy.empty(w_shape, dtype)
        replay_on_new_data(lambda: cupy_dwgn.depthwise_conv2d_backward_weight(dy, x, w_shape, out=out, **conv),
                           (x, dy), problems[1], (out,))
        results[programmatic] = (eager, out)
    ref = reference.depthwise_conv2d_backward_weight(problems[1][1], problems[1][0], w_shape, **conv)
    assert relative_error(results[True][1], ref) <= TOLERANCE[numpy.dtype(dtype)]
    for how in (0, 1):
        assert cupy.array_equal(results[False][how], results[True][how]), ("eager", "graph")[how]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_seed_bug_backward_input_overwrites_instead_of_accumulating(layout, rng):
    # The seed's backward-data kernel did `in_grad[i] += sum`: a caller buffer
    # that was not zeroed leaked into the result.  NaN-poisoned out must not.
    x_shape = _shape((2, 3, 15, 15), layout)
    w = random(rng, (3, 1, 3, 3), numpy.float32)
    dy = _to_layout(random(rng, (2, 3, 8, 8), numpy.float32), layout)
    conv = dict(stride=2, padding=1, layout=layout)
    out = poisoned(x_shape, numpy.float32)
    cupy_dwgn.depthwise_conv2d_backward_input(cupy.asarray(dy), cupy.asarray(w), x_shape, out=out, **conv)
    ref = reference.depthwise_conv2d_backward_input(dy, w, x_shape, **conv)
    assert relative_error(out, ref) <= 1e-5


# The NCHW stride-2 backward-input phase kernel (dwgn_dwconv2d_bwd_input_stride2,
# the only NCHW stride-2 backward-input kernel for 3x3/5x5/7x7 at dilation 1):
# work items of two 2x2 blocks side by side (one for float64) in one flat range
# over the planes.  Every padding parity, odd and even sizes (a last item half
# outside the row, a last row pair of one row), planes of fewer items than a
# warp, depth multipliers; the output sits between NaN guards, 16-byte aligned
# or not (the kernel's vector and element stores).
# (name, input shape, filter size, padding, multiplier)
PHASE_CASES = [
    ("7x7 planes 3x3 p1", (3, 5, 7, 7), 3, 1, 1),
    ("14x14 3x3 p0", (2, 3, 14, 14), 3, 0, 1),
    ("13x15 3x3 p(1,2)", (2, 3, 13, 15), 3, (1, 2), 1),
    ("12x9 3x3 p(2,1) M=2", (1, 4, 12, 9), 3, (2, 1), 2),
    ("11x14 5x5 p2", (2, 3, 11, 14), 5, 2, 1),
    ("10x13 5x5 p(3,0) M=3", (1, 2, 10, 13), 5, (3, 0), 3),
    ("17x16 7x7 p3", (1, 3, 17, 16), 7, 3, 1),
    ("9x8 7x7 p(2,5)", (2, 2, 9, 8), 7, (2, 5), 1),
    ("2x2 planes 3x3 p1", (4, 7, 2, 2), 3, 1, 1),
    ("1x5 planes 5x5 p2", (3, 3, 1, 5), 5, 2, 1),
]


@pytest.mark.parametrize("max_blocks", [None, 1], ids=["grid", "one-block"])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "grad_in+1"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", PHASE_CASES, ids=lambda c: c[0])
def test_nchw_phase_kernel_matches_reference(case, dtype, aligned, max_blocks, rng, monkeypatch):
    # max_blocks 1: grid_1d's cap at one block, so every thread walks the
    # kernel's grid-stride loop over the items (what tensors past 2**24
    # items do at the shipped cap of 65536 blocks).
    _, shape, k, padding, multiplier = case
    n, c, h, w = shape
    w_shape = (c * multiplier, 1, k, k)
    g = _validate.conv_geometry(shape, w_shape, 2, padding, 1)
    grad_out_host = random(rng, (n, c * multiplier, g.out_height, g.out_width), dtype)
    w_host = random(rng, w_shape, dtype)
    want = reference.depthwise_conv2d_backward_input(grad_out_host, w_host, shape, stride=2, padding=padding)
    grad_out, weight = cupy.asarray(grad_out_host), cupy.asarray(w_host)
    index = _launch.index_type(grad_out.size, want.size)
    if max_blocks is not None:
        monkeypatch.setattr(_launch, "MAX_BLOCKS", max_blocks)
        _depthwise_nchw.backward_input_plan.cache_clear()
        depthwise._SIGNATURES.clear()
    try:
        launch, _ = _depthwise_nchw.backward_input_plan(g, numpy.dtype(dtype), index)
        assert launch.expression.startswith("dwgn_dwconv2d_bwd_input_stride2<"), launch.expression
        assert max_blocks is None or launch.grid[0] == max_blocks
        # grad_in 16-byte aligned (rows of even width take the vector stores) or
        # one element past (every row the element stores).
        size, lead = want.size, 16 // numpy.dtype(dtype).itemsize if aligned else 1
        guarded = poisoned((lead + size + 1,), dtype)
        out = guarded[lead : lead + size].reshape(shape)
        got = cupy_dwgn.depthwise_conv2d_backward_input(grad_out, weight, shape, stride=2, padding=padding, out=out)
        assert got is out
        assert bool(cupy.isnan(guarded[lead - 1])) and bool(cupy.isnan(guarded[-1])), "a store outside grad_in"
        assert not bool(cupy.isnan(out).any()), "grad_in left unwritten"
        assert relative_error(out, want) <= TOLERANCE[dtype]
    finally:
        if max_blocks is not None:  # the plans built under the cap must not serve later tests
            _depthwise_nchw.backward_input_plan.cache_clear()
            depthwise._SIGNATURES.clear()


# --- 64-bit indexing ----------------------------------------------------------


# (module, NCHW float16 shape, planes checked): just over 2**31 elements
# with planes straddling it, for the plane-kernel families the rule takes.
# 1 x 2739200 x 28 x 28 = 2**31 + 49152 (plane 2739137 straddles 2**31);
# 1 x 43827300 x 7 x 7 = 2**31 + 54052 (plane 43826196 straddles it).
# Checked planes: the first, the last wholly below, the straddling one, the
# first and the last past.
_OVER_2_31_PLANES = [
    (_depthwise_nchw_plane, (1, 2739200, 28, 28), (0, 2739136, 2739137, 2739138, 2739199)),
    (_depthwise_nchw_rows, (1, 43827300, 7, 7), (0, 43826195, 43826196, 43826197, 43827299)),
]


# The NCHW register row walk past 2**31 elements (its plane offsets are
# 64-bit in every specialization): float16 1 x 684800 x 56 x 56 = 2**31 +
# 49152 (plane 684784 straddles 2**31), stride 1 both directions, and
# 1 x 171200 x 112 x 112 = 2**31 + 49152 at stride 2 (plane 171196
# straddles it).  (shape, stride, backward, planes checked)
_OVER_2_31_ROW_WALK = [
    ((1, 684800, 56, 56), 1, False, (0, 684783, 684784, 684785, 684799)),
    ((1, 684800, 56, 56), 1, True, (0, 684783, 684784, 684785, 684799)),
    ((1, 171200, 112, 112), 2, False, (0, 171195, 171196, 171197, 171199)),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", _OVER_2_31_ROW_WALK, ids=lambda c: f"{c[0][2]}-s{c[1]}-{'bwd' if c[2] else 'fwd'}")
def test_nchw_forward_regs_over_2_31_elements(case):
    shape, stride, backward, planes = case
    plane_size = shape[2] * shape[3]
    straddling = planes[2]
    assert numpy.prod(shape) >= 2**31 and (straddling + 1) * plane_size > 2**31 > straddling * plane_size
    g = _validate.conv_geometry(shape, (shape[1], 1, 3, 3), stride, 1, 1)
    w_host = random(numpy.random.default_rng(9), (shape[1], 1, 3, 3), numpy.float16)
    w = cupy.asarray(w_host)
    conv = dict(stride=stride, padding=1)
    if backward:
        src_shape = (1, shape[1], g.out_height, g.out_width)
        src = cupy.random.default_rng(9).standard_normal(src_shape, dtype=cupy.float32).astype(cupy.float16)
        out = cupy_dwgn.depthwise_conv2d_backward_input(src, w, shape, **conv)
        steps = depthwise._backward_input_steps(g, "NCHW", src, out)
    else:
        src = cupy.random.default_rng(9).standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
        out = cupy_dwgn.depthwise_conv2d(src, w, **conv)
        steps = depthwise._forward_steps(g, "NCHW", src, out)
    assert steps.launches[0].expression.startswith(_depthwise_nchw_forward_regs.KERNEL)
    for c in planes:
        plane, wc = src[:, c : c + 1].get(), w_host[c : c + 1]
        if backward:
            want = reference.depthwise_conv2d_backward_input(plane, wc, (1, 1) + shape[2:], **conv)
        else:
            want = reference.depthwise_conv2d(plane, wc, **conv)
        assert relative_error(out[:, c : c + 1], want) <= TOLERANCE[numpy.dtype(numpy.float16)]
    del src, out


@pytest.mark.slow
def test_nchw_phase_kernel_over_2_31_elements():
    # Stride-2 backward-input into float16 1 x 10956800 x 14 x 14 = 2**31 +
    # 49152 elements (grad_in plane 10956549 straddles 2**31): the 64-bit
    # specialization, items packed across planes.
    shape = (1, 10956800, 14, 14)
    planes = (0, 10956548, 10956549, 10956550, 10956799)
    assert numpy.prod(shape) >= 2**31 and (planes[2] + 1) * 196 > 2**31 > planes[2] * 196
    g = _validate.conv_geometry(shape, (shape[1], 1, 3, 3), 2, 1, 1)
    w_host = random(numpy.random.default_rng(9), (shape[1], 1, 3, 3), numpy.float16)
    w = cupy.asarray(w_host)
    src_shape = (1, shape[1], g.out_height, g.out_width)
    src = cupy.random.default_rng(9).standard_normal(src_shape, dtype=cupy.float32).astype(cupy.float16)
    out = cupy_dwgn.depthwise_conv2d_backward_input(src, w, shape, stride=2, padding=1)
    steps = depthwise._backward_input_steps(g, "NCHW", src, out)
    expression = steps.launches[0].expression
    assert expression.startswith("dwgn_dwconv2d_bwd_input_stride2<") and expression.endswith("long long>")
    for c in planes:
        plane, wc = src[:, c : c + 1].get(), w_host[c : c + 1]
        want = reference.depthwise_conv2d_backward_input(plane, wc, (1, 1) + shape[2:], stride=2, padding=1)
        assert relative_error(out[:, c : c + 1], want) <= TOLERANCE[numpy.dtype(numpy.float16)]
    del src, out


@pytest.mark.slow
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward_input"])
@pytest.mark.parametrize("case", _OVER_2_31_PLANES, ids=lambda c: c[0].__name__.split("_", 3)[-1])
def test_nchw_plane_kernels_over_2_31_elements(case, backward):
    # The op (with the rule) launches the family's 64-bit-index kernel.
    module, shape, planes = case
    plane_size = shape[2] * shape[3]
    straddling = planes[2]
    assert numpy.prod(shape) >= 2**31 and (straddling + 1) * plane_size > 2**31 > straddling * plane_size
    g = _validate.conv_geometry(shape, (shape[1], 1, 3, 3), 1, 1, 1)
    src = cupy.random.default_rng(9).standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
    w_host = random(numpy.random.default_rng(9), (shape[1], 1, 3, 3), numpy.float16)
    w = cupy.asarray(w_host)
    if backward:
        out = cupy_dwgn.depthwise_conv2d_backward_input(src, w, shape, padding=1)
        steps = depthwise._backward_input_steps(g, "NCHW", src, out)
    else:
        out = cupy_dwgn.depthwise_conv2d(src, w, padding=1)
        steps = depthwise._forward_steps(g, "NCHW", src, out)
    expression = steps.launches[0].expression
    assert expression.startswith(module.KERNEL) and expression.endswith("long long>")
    for c in planes:
        plane, wc = src[:, c : c + 1].get(), w_host[c : c + 1]
        if backward:
            want = reference.depthwise_conv2d_backward_input(plane, wc, plane.shape, padding=1)
        else:
            want = reference.depthwise_conv2d(plane, wc, padding=1)
        assert relative_error(out[:, c : c + 1], want) <= TOLERANCE[numpy.dtype(numpy.float16)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward_input"])
def test_conv_mma_kernel_over_2_31_elements(backward, layout):
    # The tensor-core kernel with 64-bit offsets, launched directly, 3x3
    # padding 1 float16.  NCHW (1, 2739200, 28, 28): plane 2739137 straddles
    # 2**31 (units of whole planes); NHWC (1, 4793600, 56, 8) = 2**31 + 49152
    # elements: pixel rows from 4793490 lie past 2**31 (units of row bands of
    # the 8 channels).  Checked: NCHW planes whole; NHWC the first 20 rows
    # and the last 120 against the reference of their slab of rows.
    half = numpy.dtype(numpy.float16)
    shape = (1, 2739200, 28, 28) if layout == "NCHW" else (1, 4793600, 56, 8)
    assert numpy.prod(shape) > 2**31
    c = shape[1] if layout == "NCHW" else shape[3]
    g = _validate.conv_geometry(shape, (c, 1, 3, 3), 1, 1, 1, layout=layout)
    src = cupy.random.default_rng(13).standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
    w_host = random(numpy.random.default_rng(13), (c, 1, 3, 3), numpy.float16)
    dst = cupy.full(shape, numpy.nan, cupy.float16)
    launch = _depthwise_conv_mma.plan(g, half, backward, layout, _launch.index_type(src.size, dst.size), 16, 16)
    assert launch.expression.endswith("long long>")
    launch(src, cupy.asarray(w_host), 0, dst)
    conv = reference.depthwise_conv2d_backward_input if backward else reference.depthwise_conv2d
    if layout == "NCHW":
        for plane in (0, 2739136, 2739137, 2739138, 2739199):
            source, wc = src[:, plane : plane + 1].get(), w_host[plane : plane + 1]
            want = conv(source, wc, source.shape, padding=1) if backward else conv(source, wc, padding=1)
            assert relative_error(dst[:, plane : plane + 1], want) <= TOLERANCE[half]
        return
    height = shape[1]
    assert 4793490 * 56 * 8 < 2**31 < 4793491 * 56 * 8
    # (destination rows, source rows, the slab's vertical padding): forward a
    # source row beyond each end of the rows; backward-input the grad_out rows
    # whose forward windows meet them (padding 2 where the slab is inside).
    for rows, source_rows, padding in (
        ((0, 20), (0, 21), (1, 2) if backward else (1, 0)),
        ((height - 120, height), (height - 121, height), (2, 1) if backward else (0, 1)),
    ):
        source = src[:, source_rows[0] : source_rows[1]].get()
        slab_shape = (1, rows[1] - rows[0], 56, 8)
        pad = (padding, (1, 1))
        if backward:
            want = conv(source, w_host, slab_shape, padding=pad, layout="NHWC")
        else:
            want = conv(source, w_host, padding=pad, layout="NHWC")
        assert relative_error(dst[:, rows[0] : rows[1]], want) <= TOLERANCE[half], rows


@pytest.mark.slow
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward_input"])
def test_nhwc_window_kernel_over_2_31_elements(backward):
    # NHWC (1, 1040, 1024, 2048) float16 = 2**31 + 2**25 elements: element
    # (h, w, c) is at (h*1024 + w)*2048 + c, so rows h >= 1024 of every
    # channel lie past 2**31; the window kernel with 64-bit offsets, launched
    # directly.  Checked channels whole and on those rows alone.
    shape = (1, 1040, 1024, 2048)
    assert numpy.prod(shape) >= 2**31 and 1024 * 1024 * 2048 == 2**31
    g = _validate.conv_geometry(shape, (2048, 1, 3, 3), 1, 1, 1, layout="NHWC")
    src = cupy.random.default_rng(11).standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
    w_host = random(numpy.random.default_rng(11), (2048, 1, 3, 3), numpy.float16)
    dst = cupy.full(shape, numpy.nan, cupy.float16)
    index = _launch.index_type(src.size, dst.size)
    assert index == "long long"
    launch = _depthwise_nhwc_window.plan(g, numpy.dtype(numpy.float16), backward, index, 16, 16)
    launch(src, cupy.asarray(w_host), 0, dst)
    for c in (0, 1000, 2047):
        plane, wc = src[..., c : c + 1].get(), w_host[c : c + 1]
        if backward:
            want = reference.depthwise_conv2d_backward_input(plane, wc, plane.shape, padding=1, layout="NHWC")
        else:
            want = reference.depthwise_conv2d(plane, wc, padding=1, layout="NHWC")
        got = dst[..., c : c + 1]
        assert relative_error(got, want) <= TOLERANCE[numpy.dtype(numpy.float16)]
        assert relative_error(got[:, 1024:], want[:, 1024:]) <= TOLERANCE[numpy.dtype(numpy.float16)]


@pytest.mark.slow
@pytest.mark.parametrize("k, stride, backward", [(3, 1, False), (3, 1, True), (5, 2, False)],
                         ids=["3x3-forward", "3x3-backward_input", "5x5-s2-forward"])
def test_nhwc_ring_kernel_over_2_31_elements(k, stride, backward):
    # NHWC (1, 140000, 60, 256) float16 = 2**31 + 2916352 elements: row h
    # starts at h * 15360, so rows 139811 and on lie past 2**31 (a 30 KB
    # row, one bulk copy each); the ring kernel with 64-bit offsets,
    # launched directly (5x5: under the device's shared-memory limit, as the
    # ops plan it).  Checked on channels whole and on the output rows that
    # read only rows past 2**31.
    shape = (1, 140000, 60, 256)
    assert numpy.prod(shape) >= 2**31 and 139811 * 60 * 256 > 2**31
    conv = dict(stride=stride, padding=k // 2, layout="NHWC")
    g = _validate.conv_geometry(shape, (256, 1, k, k), stride, k // 2, 1, layout="NHWC")
    half = numpy.dtype(numpy.float16)
    _skip_where_the_ring_needs_more_shared_memory(g, half, backward)
    src = cupy.random.default_rng(12).standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
    w_host = random(numpy.random.default_rng(12), (256, 1, k, k), numpy.float16)
    b_host = None if backward else random(numpy.random.default_rng(13), 256, numpy.float16)
    dst = cupy.full(shape if backward else (1, g.out_height, g.out_width, 256), numpy.nan, cupy.float16)
    index = _launch.index_type(src.size, dst.size)
    assert index == "long long"
    launch = _depthwise_nhwc_ring.plan_on_device(g, half, backward, index, 16, 16)
    assert launch is not None
    launch(src, cupy.asarray(w_host), 0 if b_host is None else cupy.asarray(b_host), dst)
    first_past = -(-(139811 + k // 2) // stride)  # output rows whose first input row is past 2**31
    for c in (0, 129, 255):
        plane, wc = src[..., c : c + 1].get(), w_host[c : c + 1]
        if backward:
            want = reference.depthwise_conv2d_backward_input(plane, wc, plane.shape, **conv)
        else:
            want = reference.depthwise_conv2d(plane, wc, b_host[c : c + 1], **conv)
        got = dst[..., c : c + 1]
        assert relative_error(got, want) <= TOLERANCE[half]
        assert relative_error(got[:, first_past:], want[:, first_past:]) <= TOLERANCE[half]
    del src, dst


@pytest.mark.slow
@pytest.mark.parametrize("stride", [1, 2])
def test_nhwc_wgrad_kernel_over_2_31_elements(stride):
    # NHWC x (1, 1040, 1024, 2048) float16 = 2**31 + 2**25 elements: element
    # (h, w, c) is at (h*1024 + w)*2048 + c, so rows h >= 1024 of every
    # channel lie past 2**31.  x is zero but for rows 1020 and on, so every
    # tap's sum comes from rows at or past 2**31 (and one row before); the
    # register-tap kernel with 64-bit offsets, launched directly.
    shape = (1, 1040, 1024, 2048)
    assert numpy.prod(shape) >= 2**31 and 1024 * 1024 * 2048 == 2**31
    g = _validate.conv_geometry(shape, (2048, 1, 3, 3), stride, 1, 1, layout="NHWC")
    gen = cupy.random.default_rng(13)
    x = cupy.zeros(shape, cupy.float16)
    x[:, 1020:] = gen.standard_normal((1, 20, 1024, 2048), dtype=cupy.float32).astype(cupy.float16)
    dy = gen.standard_normal((1, g.out_height, g.out_width, 2048), dtype=cupy.float32).astype(cupy.float16)
    index = _launch.index_type(x.size, dy.size)
    assert index == "long long"
    planned = _depthwise_nhwc_wgrad.plan(g, numpy.dtype(numpy.float16), index, 16, 16)
    assert planned[0][0].expression.endswith("long long>")
    out, sums = _run_nhwc_wgrad(planned, dy, x, (2048, 1, 3, 3), numpy.float16)
    assert bool(cupy.isfinite(sums).all())
    rows = slice(1016 // stride, None)  # the output rows whose taps reach rows >= 1020
    first = (1016 // stride) * stride
    for c in (0, 1000, 2047):
        x_c = numpy.ascontiguousarray(x[:, first:, :, c : c + 1].get())
        dy_c = numpy.ascontiguousarray(dy[:, rows, :, c : c + 1].get())
        # The same sums on the cropped plane: padding 1 on top is rows first - 1 (zero).
        want = reference.depthwise_conv2d_backward_weight(dy_c, x_c, (1, 1, 3, 3), stride=stride,
                                                          padding=((1, 1), (1, 1)), layout="NHWC")
        assert relative_error(out[c : c + 1], want) <= TOLERANCE[numpy.dtype(numpy.float16)], c
def test_nhwc_phase_kernel_over_2_31_elements():
    # NHWC grad_in (1, 1040, 1024, 2048) float16 = 2**31 + 2**25 elements:
    # element (h, w, c) is at (h*1024 + w)*2048 + c, so rows h >= 1024 of
    # every channel lie past 2**31; stride 2, 3x3, padding 1 (grad_out (1,
    # 520, 512, 2048)); the phase kernel with 64-bit offsets, launched
    # directly.  Checked channels whole and on those rows alone.
    shape = (1, 1040, 1024, 2048)
    assert numpy.prod(shape) >= 2**31 and 1024 * 1024 * 2048 == 2**31
    g = _validate.conv_geometry(shape, (2048, 1, 3, 3), 2, 1, 1, layout="NHWC")
    dy = cupy.random.default_rng(12).standard_normal(
        (1, g.out_height, g.out_width, 2048), dtype=cupy.float32).astype(cupy.float16)
    w_host = random(numpy.random.default_rng(12), (2048, 1, 3, 3), numpy.float16)
    dx = cupy.full(shape, numpy.nan, cupy.float16)
    index = _launch.index_type(dy.size, dx.size)
    assert index == "long long"
    launch = _depthwise_nhwc_phase.plan(g, numpy.dtype(numpy.float16), index, True)
    assert launch.expression.endswith("long long>")
    launch(dy, cupy.asarray(w_host), dx)
    for c in (0, 1000, 2047):
        plane, wc = dy[..., c : c + 1].get(), w_host[c : c + 1]
        want = reference.depthwise_conv2d_backward_input(plane, wc, shape[:3] + (1,), stride=2, padding=1,
                                                          layout="NHWC")
        got = dx[..., c : c + 1]
        assert relative_error(got, want) <= TOLERANCE[numpy.dtype(numpy.float16)]
        assert relative_error(got[:, 1024:], want[:, 1024:]) <= TOLERANCE[numpy.dtype(numpy.float16)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_tensors_over_2_31_elements_use_64_bit_indexing(layout):
    # 1 x 2056 x 1024 x 1024 float16 = 2**31 + 2**23 elements (4.02 GiB),
    # where int32 offsets wrap.  NCHW: channels 2048+ start past offset 2**31.
    # NHWC (1, 1024, 1024, 2056): element (h, w, c) is at (h*1024 + w)*2056 + c,
    # so rows h >= 1021 of EVERY channel lie past 2**31 (row 1020 straddles it):
    # each checked channel is compared whole and on those rows alone.
    shape = _shape((1, 2056, 1024, 1024), layout)
    assert numpy.prod(shape) >= 2**31
    assert 1021 * 1024 * 2056 >= 2**31 > 1020 * 1024 * 2056

    def channel(a, c):
        return _channels(a, c, c + 1, layout)

    def check(got, ref, first_row_past=1021):
        """The whole channel, then (NHWC) the rows that touch data past 2**31
        alone, so a wrap there cannot hide in the norm of the whole plane."""
        assert relative_error(got, ref) <= 2e-3
        if layout == "NHWC":
            assert got.shape[1] > first_row_past
            assert relative_error(got[:, first_row_past:], ref[:, first_row_past:]) <= 2e-3

    rng = numpy.random.default_rng(7)
    conv = dict(padding=1, layout=layout)
    x = cupy.random.default_rng(7).standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
    w_host = random(rng, (2056, 1, 3, 3), numpy.float16)
    w = cupy.asarray(w_host)
    y = cupy_dwgn.depthwise_conv2d(x, w, **conv)
    assert y.shape == shape
    checks = []
    for c in (0, 2047, 2055):  # NCHW: first, last below 2**31, last above
        xc = channel(x, c).get()
        wc = w_host[c : c + 1]
        checks.append((c, xc, wc))
        check(channel(y, c), reference.depthwise_conv2d(xc, wc, **conv))
    del y
    # An independent grad_out keeps the 2**20-term weight-gradient sums within float16 range.
    dy = cupy.random.default_rng(8).standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
    dx = cupy_dwgn.depthwise_conv2d_backward_input(dy, w, shape, **conv)
    dw = cupy_dwgn.depthwise_conv2d_backward_weight(dy, x, w.shape, **conv)
    for c, xc, wc in checks:
        dyc = channel(dy, c).get()
        check(channel(dx, c), reference.depthwise_conv2d_backward_input(dyc, wc, xc.shape, **conv))
        assert relative_error(dw[c : c + 1], reference.depthwise_conv2d_backward_weight(dyc, xc, wc.shape, **conv)) <= 2e-3
    del dx, dy
    # Stride 2 takes other forward and backward-input kernels (NCHW: the direct ones).
    s2 = dict(stride=2, padding=1, layout=layout)
    y2 = cupy_dwgn.depthwise_conv2d(x, w, **s2)
    dx2 = cupy_dwgn.depthwise_conv2d_backward_input(y2, w, shape, **s2)
    for c, xc, wc in checks:
        # Output row oh reads input rows 2*oh - 1 .. 2*oh + 1: rows >= 510 reach row 1021 and past.
        check(channel(y2, c), reference.depthwise_conv2d(xc, wc, **s2), first_row_past=510)
        y2c = channel(y2, c).get()
        check(channel(dx2, c), reference.depthwise_conv2d_backward_input(y2c, wc, xc.shape, **s2))


# Rule picks of 2026-12-04, through the ops on poisoned outputs: (name,
# layout, x shape, filter size, stride, dtype, the kernel the dispatch takes).
RULE_PICKS = [
    ("NHWC ring, 40 channels", "NHWC", (2, 45, 45, 40), 3, 1, numpy.float16, _depthwise_nhwc_ring.KERNEL),
    ("NHWC ring, 24 channels, 75 wide", "NHWC", (1, 75, 75, 24), 3, 1, DTYPES[3], _depthwise_nhwc_ring.KERNEL),
    ("NHWC ring, 32 channels, odd width", "NHWC", (1, 75, 75, 32), 3, 1, numpy.float16, _depthwise_nhwc_ring.KERNEL),
    ("NHWC ring, 5x5 stride 2", "NHWC", (2, 19, 19, 40), 5, 2, numpy.float16, _depthwise_nhwc_ring.KERNEL),
    ("NHWC tiled, 5x5 stride 2, 16 channels (not the ring)", "NHWC", (2, 23, 23, 16), 5, 2, numpy.float16,
     _depthwise_nhwc._TILED),
    ("NHWC ring, 5x5 stride 2, device limit", "NHWC", (1, 21, 21, 816), 5, 2, DTYPES[3], _depthwise_nhwc_ring.KERNEL),
    ("NHWC ring, 1024 channels, 10 wide", "NHWC", (2, 10, 10, 1024), 3, 1, numpy.float16, _depthwise_nhwc_ring.KERNEL),
    ("NHWC ring, 1344 channels, 19 wide", "NHWC", (1, 19, 19, 1344), 3, 1, DTYPES[3], _depthwise_nhwc_ring.KERNEL),
    ("NCHW walk, float32 8-byte source", "NCHW", (2, 8, 50, 50), 3, 2, numpy.float32,
     _depthwise_nchw_forward_regs.KERNEL),
    ("NCHW plane, half 10 wide", "NCHW", (3, 20, 10, 10), 3, 1, numpy.float16, _depthwise_nchw_plane.KERNEL),
    ("NCHW plane, half 10 wide 5x5", "NCHW", (3, 20, 10, 10), 5, 1, DTYPES[3], _depthwise_nchw_plane.KERNEL),
]


@pytest.mark.parametrize("case", RULE_PICKS, ids=lambda c: c[0])
def test_rule_picks_match_reference(case, rng):
    name, layout, x_shape, k, stride, dtype, kernel = case
    channels = x_shape[3] if layout == "NHWC" else x_shape[1]
    x = cupy.asarray(random(rng, x_shape, dtype))
    w = cupy.asarray(random(rng, (channels, 1, k, k), dtype))
    b = cupy.asarray(random(rng, (channels,), dtype))
    conv = dict(stride=stride, padding=k // 2, layout=layout)
    g = _validate.conv_geometry(x.shape, w.shape, stride, k // 2, 1, layout=layout)
    if kernel == _depthwise_nhwc_ring.KERNEL:
        _skip_where_the_ring_needs_more_shared_memory(g, dtype, False)
    out_shape = ((x_shape[0], g.out_height, g.out_width, channels) if layout == "NHWC"
                 else (x_shape[0], channels, g.out_height, g.out_width))
    y = poisoned(out_shape, dtype)
    assert depthwise._forward_steps(g, layout, x, y).launches[0].expression.startswith(kernel), name
    cupy_dwgn.depthwise_conv2d(x, w, b, out=y, **conv)
    want = reference.depthwise_conv2d(x.get(), w.get(), b.get(), **conv)
    assert relative_error(y, want) <= TOLERANCE[numpy.dtype(dtype)], name
    if stride == 1:
        dx = poisoned(x_shape, dtype)
        assert depthwise._backward_input_steps(g, layout, y, dx).launches[0].expression.startswith(kernel), name
        cupy_dwgn.depthwise_conv2d_backward_input(y, w, x_shape, out=dx, **conv)
        want = reference.depthwise_conv2d_backward_input(y.get(), w.get(), x_shape, **conv)
        assert relative_error(dx, want) <= TOLERANCE[numpy.dtype(dtype)], name
