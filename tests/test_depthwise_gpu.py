"""Depthwise convolution on the GPU against the float64 reference: all three ops,
all dtypes, NaN-poisoned outputs, the DESIGN.md §5 edge cases, seeded random
geometries, and one test per seed bug of DESIGN.md §7."""

import numpy
import pytest

from cupy_dwgn import reference

from _helpers import DTYPE_IDS, DTYPES, TOLERANCE, poisoned, random, record_errors, relative_error

cupy = pytest.importorskip("cupy")
import cupy_dwgn  # noqa: E402

pytestmark = pytest.mark.gpu

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


def _run_all_three(case, dtype, rng, bias=True):
    _, x_shape, w_shape, stride, padding, dilation = case
    conv = dict(stride=stride, padding=padding, dilation=dilation)
    x = random(rng, x_shape, dtype)
    w = random(rng, w_shape, dtype)
    b = random(rng, w_shape[0], dtype) if bias else None
    y_ref = reference.depthwise_conv2d(x, w, b, **conv)
    dy = random(rng, y_ref.shape, dtype)
    dx_ref = reference.depthwise_conv2d_backward_input(dy, w, x_shape, **conv)
    dw_ref = reference.depthwise_conv2d_backward_weight(dy, x, w_shape, **conv)

    x_gpu, w_gpu, dy_gpu = cupy.asarray(x), cupy.asarray(w), cupy.asarray(dy)
    b_gpu = None if b is None else cupy.asarray(b)
    y = cupy_dwgn.depthwise_conv2d(x_gpu, w_gpu, b_gpu, out=poisoned(y_ref.shape, dtype), **conv)
    dx = cupy_dwgn.depthwise_conv2d_backward_input(dy_gpu, w_gpu, x_shape, out=poisoned(x_shape, dtype), **conv)
    dw = cupy_dwgn.depthwise_conv2d_backward_weight(dy_gpu, x_gpu, w_shape, out=poisoned(w_shape, dtype), **conv)
    for result in (y, dx, dw):
        assert result.dtype == dtype
    return {
        "forward": relative_error(y, y_ref),
        "backward_input": relative_error(dx, dx_ref),
        "backward_weight": relative_error(dw, dw_ref),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_all_ops_match_reference(case, dtype, rng):
    errors = _run_all_three(case, dtype, rng)
    record_errors("depthwise (all cases)", str(numpy.dtype(dtype)), errors)
    worst = max(errors.values())
    assert worst <= TOLERANCE[dtype], errors


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_forward_without_bias_and_default_out(dtype, rng):
    x = random(rng, (2, 6, 14, 14), dtype)
    w = random(rng, (6, 1, 3, 3), dtype)
    y = cupy_dwgn.depthwise_conv2d(cupy.asarray(x), cupy.asarray(w), padding=1)
    assert relative_error(y, reference.depthwise_conv2d(x, w, padding=1)) <= TOLERANCE[dtype]


def test_zero_size_inputs_give_empty_outputs():
    x = cupy.zeros((0, 3, 8, 8), cupy.float32)
    w = cupy.ones((3, 1, 3, 3), cupy.float32)
    assert cupy_dwgn.depthwise_conv2d(x, w, padding=1).shape == (0, 3, 8, 8)
    dy = cupy.zeros((0, 3, 8, 8), cupy.float32)
    assert cupy_dwgn.depthwise_conv2d_backward_input(dy, w, (0, 3, 8, 8), padding=1).shape == (0, 3, 8, 8)
    dw = cupy_dwgn.depthwise_conv2d_backward_weight(dy, x, (3, 1, 3, 3), padding=1)
    assert dw.shape == (3, 1, 3, 3) and not cupy.any(dw)


def test_zero_height_input_with_padding_gives_bias_only(rng):
    x = cupy.zeros((1, 2, 0, 5), cupy.float32)
    w = cupy.asarray(random(rng, (2, 1, 1, 1), numpy.float32))
    b = cupy.asarray(numpy.array([1.5, -2.0], numpy.float32))
    y = cupy_dwgn.depthwise_conv2d(x, w, b, padding=(1, 0))
    assert y.shape == (1, 2, 2, 5)
    numpy.testing.assert_array_equal(y.get()[0, 1], -2.0)


def test_host_wrappers_round_trip_numpy(rng):
    import cupy_dwgn.host as host

    x = random(rng, (2, 4, 9, 9), numpy.float32)
    w = random(rng, (4, 1, 3, 3), numpy.float32)
    y = host.depthwise_conv2d(x, w, padding=1)
    assert isinstance(y, numpy.ndarray)
    assert relative_error(cupy.asarray(y), reference.depthwise_conv2d(x, w, padding=1)) <= 1e-5
    dx = host.depthwise_conv2d_backward_input(y, w, x.shape, padding=1)
    dw = host.depthwise_conv2d_backward_weight(y, x, w.shape, padding=1)
    assert isinstance(dx, numpy.ndarray) and isinstance(dw, numpy.ndarray)


def test_launches_on_the_current_stream(rng):
    x = cupy.asarray(random(rng, (4, 16, 64, 64), numpy.float32))
    w = cupy.asarray(random(rng, (16, 1, 3, 3), numpy.float32))
    expected = cupy_dwgn.depthwise_conv2d(x, w, padding=1)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        y = cupy_dwgn.depthwise_conv2d(x, w, padding=1)
        dw = cupy_dwgn.depthwise_conv2d_backward_weight(y, x, w.shape, padding=1)
    stream.synchronize()
    cupy.testing.assert_array_equal(y, expected)
    assert cupy.isfinite(dw).all()


def test_weight_gradient_with_more_elements_than_one_grid(rng):
    # 1.9M filters of 3x3 = 17.1M weights, more than the 65536 x 256 threads
    # of a capped launch grid: the finalize pass must loop, not stop short.
    x = random(rng, (1, 1_900_000, 3, 3), numpy.float32)
    dy = random(rng, (1, 1_900_000, 3, 3), numpy.float32)
    shape = (1_900_000, 1, 3, 3)
    out = poisoned(shape, numpy.float32)
    cupy_dwgn.depthwise_conv2d_backward_weight(cupy.asarray(dy), cupy.asarray(x), shape, padding=1, out=out)
    assert relative_error(out, reference.depthwise_conv2d_backward_weight(dy, x, shape, padding=1)) <= 1e-5


def test_precompile_loads_the_kernels_it_names(capsys):
    count = cupy_dwgn.precompile(["depthwise_conv2d"], dtypes=[numpy.float32], filter_sizes=[(3, 3)])
    assert count == 2  # the direct kernel and the stride-1 tiled kernel
    err = capsys.readouterr().err
    assert "dwgn_dwconv2d_fwd<float, 3, 3, int>" in err
    assert "dwgn_dwconv2d_tiled<float, 3, 3, false, int>" in err


# --- seed bugs (DESIGN.md §7), each with the input that broke the seed --------


@pytest.mark.parametrize("filter_size", [(3, 5), (5, 3), (1, 7), (7, 1)])
def test_seed_bug_non_square_weight_gradient_and_no_write_past_the_end(filter_size, rng):
    # The seed's Small backward-filter kernel used filter_height for
    # filter_width: 100%+ error on 3x5 and a write past the buffer on 5x3.
    kh, kw = filter_size
    x = random(rng, (2, 8, 16, 16), numpy.float32)
    dy = random(rng, (2, 8, 16, 16), numpy.float32)
    conv = dict(padding=(kh // 2, kw // 2))
    size = 8 * kh * kw
    guard = cupy.full(size + 64, numpy.nan, cupy.float32)
    guard[size:] = 123.0
    out = guard[:size].reshape(8, 1, kh, kw)
    cupy_dwgn.depthwise_conv2d_backward_weight(cupy.asarray(dy), cupy.asarray(x), out.shape, out=out, **conv)
    ref = reference.depthwise_conv2d_backward_weight(dy, x, out.shape, **conv)
    assert relative_error(out, ref) <= 1e-5
    assert bool((guard[size:] == 123.0).all()), "wrote past the end of grad_weight"


def test_seed_bug_many_slices_no_stale_accumulators(rng):
    # The seed zeroed its shared accumulators once per block: with a capped
    # grid each block's later slices summed on top of stale values.
    x = random(rng, (64, 96, 8, 8), numpy.float32)
    dy = random(rng, (64, 96, 8, 8), numpy.float32)
    dw = cupy_dwgn.depthwise_conv2d_backward_weight(cupy.asarray(dy), cupy.asarray(x), (96, 1, 3, 3), padding=1)
    assert relative_error(dw, reference.depthwise_conv2d_backward_weight(dy, x, (96, 1, 3, 3), padding=1)) <= 1e-5


@pytest.mark.parametrize("dtype", [numpy.float16, DTYPES[3]], ids=["float16", "bfloat16"])
def test_seed_bug_half_types_accumulate_in_float32(dtype, rng):
    # 2 * 96 * 96 = 18432 positive products per weight: a half accumulator
    # stops growing long before (and half atomics lose the rest).
    x = (1.0 + rng.random((2, 4, 96, 96))).astype(dtype)
    dy = (1.0 + rng.random((2, 4, 96, 96))).astype(dtype)
    dw = cupy_dwgn.depthwise_conv2d_backward_weight(cupy.asarray(dy), cupy.asarray(x), (4, 1, 3, 3), padding=1)
    ref = reference.depthwise_conv2d_backward_weight(dy, x, (4, 1, 3, 3), padding=1)
    assert relative_error(dw, ref) <= TOLERANCE[numpy.dtype(dtype)]
    w = (rng.random((4, 1, 7, 7)) / 49).astype(dtype)
    y = cupy_dwgn.depthwise_conv2d(cupy.asarray(x), cupy.asarray(w), padding=3)
    assert relative_error(y, reference.depthwise_conv2d(x, w, padding=3)) <= TOLERANCE[numpy.dtype(dtype)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("filter_size", [(3, 3), (7, 7), (4, 6)])
def test_seed_bug_weight_gradient_is_bit_identical_run_to_run(filter_size, dtype, rng):
    # The seed's weight gradients summed with atomics in arbitrary order.
    x = cupy.asarray(random(rng, (16, 24, 40, 40), dtype))
    dy = cupy.asarray(random(rng, (16, 24, 40, 40), dtype))
    shape = (24, 1) + filter_size
    conv = dict(padding="same")
    first = cupy_dwgn.depthwise_conv2d_backward_weight(dy, x, shape, **conv).view(cupy.uint8).get()
    for _ in range(4):
        again = cupy_dwgn.depthwise_conv2d_backward_weight(dy, x, shape, **conv).view(cupy.uint8).get()
        numpy.testing.assert_array_equal(again, first)


def test_seed_bug_backward_input_overwrites_instead_of_accumulating(rng):
    # The seed's backward-data kernel did `in_grad[i] += sum`: a caller buffer
    # that was not zeroed leaked into the result.  NaN-poisoned out must not.
    x_shape = (2, 3, 15, 15)
    w = random(rng, (3, 1, 3, 3), numpy.float32)
    dy = random(rng, (2, 3, 8, 8), numpy.float32)
    out = poisoned(x_shape, numpy.float32)
    cupy_dwgn.depthwise_conv2d_backward_input(cupy.asarray(dy), cupy.asarray(w), x_shape, stride=2, padding=1, out=out)
    ref = reference.depthwise_conv2d_backward_input(dy, w, x_shape, stride=2, padding=1)
    assert relative_error(out, ref) <= 1e-5


# --- 64-bit indexing ----------------------------------------------------------


@pytest.mark.slow
def test_tensors_over_2_31_elements_use_64_bit_indexing():
    # 1 x 2056 x 1024 x 1024 float16 = 2**31 + 2**23 elements (4.02 GiB):
    # the last channels start past offset 2**31, where int32 offsets wrap.
    shape = (1, 2056, 1024, 1024)
    assert numpy.prod(shape) >= 2**31
    rng = numpy.random.default_rng(7)
    x = cupy.random.default_rng(7).standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
    w_host = random(rng, (2056, 1, 3, 3), numpy.float16)
    w = cupy.asarray(w_host)
    y = cupy_dwgn.depthwise_conv2d(x, w, padding=1)
    checks = []
    for channel in (0, 2047, 2055):  # first, last below 2**31, last above
        xc = x[:, channel : channel + 1].get()
        wc = w_host[channel : channel + 1]
        checks.append((channel, xc, wc))
        assert relative_error(y[:, channel : channel + 1], reference.depthwise_conv2d(xc, wc, padding=1)) <= 2e-3
    del y
    # An independent grad_out keeps the 2**20-term weight-gradient sums within float16 range.
    dy = cupy.random.default_rng(8).standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
    dx = cupy_dwgn.depthwise_conv2d_backward_input(dy, w, shape, padding=1)
    dw = cupy_dwgn.depthwise_conv2d_backward_weight(dy, x, w.shape, padding=1)
    for channel, xc, wc in checks:
        dyc = dy[:, channel : channel + 1].get()
        assert relative_error(dx[:, channel : channel + 1], reference.depthwise_conv2d_backward_input(dyc, wc, xc.shape, padding=1)) <= 2e-3
        assert relative_error(dw[channel : channel + 1], reference.depthwise_conv2d_backward_weight(dyc, xc, wc.shape, padding=1)) <= 2e-3
    del dx, dy
    # Stride 2 takes the direct (non-tiled) forward and backward-input kernels.
    s2 = dict(stride=2, padding=1)
    y2 = cupy_dwgn.depthwise_conv2d(x, w, **s2)
    dx2 = cupy_dwgn.depthwise_conv2d_backward_input(y2, w, shape, **s2)
    for channel, xc, wc in checks:
        y_ref = reference.depthwise_conv2d(xc, wc, **s2)
        assert relative_error(y2[:, channel : channel + 1], y_ref) <= 2e-3
        y2c = y2[:, channel : channel + 1].get()
        assert relative_error(dx2[:, channel : channel + 1], reference.depthwise_conv2d_backward_input(y2c, wc, xc.shape, **s2)) <= 2e-3
