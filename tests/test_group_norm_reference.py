"""The float64 GroupNorm references, checked on the CPU against an independent
computation: a plain per-(n, g) loop for the forward, central finite
differences of the forward for the backward."""

import fractions
import math

import numpy
import pytest

from cupy_dwgn import reference

ACTIVATIONS = ("identity", "relu", "silu", "gelu", "gelu_tanh")

_SCALAR_ACT = {
    "identity": lambda z: z,
    "relu": lambda z: max(z, 0.0),
    "silu": lambda z: z / (1.0 + math.exp(-z)),
    "gelu": lambda z: 0.5 * z * (1.0 + math.erf(z / math.sqrt(2.0))),
    "gelu_tanh": lambda z: 0.5 * z * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z**3))),
}


def _loop_group_norm(x, num_groups, weight, bias, eps, activation):
    """Per (n, g) with Python scalars: two-pass mean/variance, then each element."""
    batch, channels = x.shape[0], x.shape[-1]
    flat = x.reshape(batch, -1, channels)
    per_group = channels // num_groups
    act = _SCALAR_ACT[activation]
    y = numpy.empty_like(flat)
    mean = numpy.empty((batch, num_groups))
    rstd = numpy.empty((batch, num_groups))
    for n in range(batch):
        for g in range(num_groups):
            cs = range(g * per_group, (g + 1) * per_group)
            values = [float(flat[n, s, c]) for s in range(flat.shape[1]) for c in cs]
            m = math.fsum(values) / len(values)
            v = math.fsum((u - m) ** 2 for u in values) / len(values)
            r = 1.0 / math.sqrt(v + eps)
            mean[n, g], rstd[n, g] = m, r
            for s in range(flat.shape[1]):
                for c in cs:
                    w = 1.0 if weight is None else float(weight[c])
                    b = 0.0 if bias is None else float(bias[c])
                    y[n, s, c] = act((flat[n, s, c] - m) * r * w + b)
    return y.reshape(x.shape), mean, rstd


SHAPES = [  # (shape, num_groups)
    ((2, 6), 3),  # no spatial dims
    ((2, 5, 6), 2),  # 1 spatial dim
    ((1, 3, 4, 9), 3),  # 2 spatial dims, 3 channels per group
    ((2, 2, 3, 2, 4), 4),  # 3 spatial dims, C == G
    ((3, 7, 5), 1),  # G == 1, prime S
]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape,num_groups", SHAPES)
@pytest.mark.parametrize("affine", ["both", "none", "weight"])
def test_forward_matches_loop(rng, shape, num_groups, activation, affine):
    x = 3.0 + rng.standard_normal(shape)
    channels = shape[-1]
    weight = rng.standard_normal(channels) if affine in ("both", "weight") else None
    bias = rng.standard_normal(channels) if affine == "both" else None
    y, mean, rstd = reference.group_norm(x, num_groups, weight, bias, eps=1e-3, activation=activation, return_stats=True)
    y2, mean2, rstd2 = _loop_group_norm(x, num_groups, weight, bias, 1e-3, activation)
    y_only = reference.group_norm(x, num_groups, weight, bias, eps=1e-3, activation=activation)
    assert isinstance(y_only, numpy.ndarray) and numpy.array_equal(y_only, y)
    assert y.dtype == mean.dtype == rstd.dtype == numpy.float64
    numpy.testing.assert_allclose(mean, mean2, rtol=1e-13)
    numpy.testing.assert_allclose(rstd, rstd2, rtol=1e-12)
    numpy.testing.assert_allclose(y, y2, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("offset", [1e3, 1e4, 1e6])
def test_forward_large_offset_is_exact(rng, offset):
    # Against exact rational arithmetic (fractions.Fraction: the mean and the
    # centered values exact, one rounding at the end): the float64 bound
    # holds even where mean / std is 1e6 (a one-term float64 mean costs y
    # ulp(mean) / std: 4e-12 at 1e4, 3e-10 at 1e6).
    x = offset + rng.standard_normal((2, 16, 8))
    y, mean, rstd = reference.group_norm(x, 4, return_stats=True)
    groups = x.reshape(2, 16, 4, 2)
    for n in range(2):
        for g in range(4):
            values = [fractions.Fraction(v) for v in groups[n, :, g, :].ravel()]
            exact_mean = sum(values) / len(values)
            centered = [v - exact_mean for v in values]
            var = sum(c * c for c in centered) / len(values)
            exact_rstd = 1.0 / math.sqrt(float(var + fractions.Fraction(1e-5)))
            assert abs(mean[n, g] - float(exact_mean)) <= 1e-15 * abs(float(exact_mean))
            assert abs(rstd[n, g] - exact_rstd) <= 1e-14 * exact_rstd
            exact_y = numpy.array([float(c) * exact_rstd for c in centered])
            got = y[n, :, g * 2:(g + 1) * 2].ravel()
            assert numpy.linalg.norm(got - exact_y) <= 1e-13 * numpy.linalg.norm(exact_y)


def _numeric_gradients(x, dy, num_groups, weight, bias, activation, step=1e-6):
    def loss(x_, w_, b_):
        y = reference.group_norm(x_, num_groups, w_, b_, eps=1e-3, activation=activation)
        return float(numpy.sum(y * dy))

    def central(array, rebuild):
        grad = numpy.zeros_like(array)
        for index in numpy.ndindex(array.shape):
            plus = array.copy()
            minus = array.copy()
            plus[index] += step
            minus[index] -= step
            grad[index] = (loss(*rebuild(plus)) - loss(*rebuild(minus))) / (2 * step)
        return grad

    dx = central(x, lambda a: (a, weight, bias))
    dw = None if weight is None else central(weight, lambda a: (x, a, bias))
    db = None if bias is None else central(bias, lambda a: (x, weight, a))
    return dx, dw, db


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("affine", ["both", "none", "bias"])
@pytest.mark.parametrize("shape,num_groups", [((2, 3, 6), 2), ((1, 2, 2, 3), 1), ((2, 4), 2)])
def test_backward_matches_finite_differences(rng, shape, num_groups, activation, affine):
    x = 3.0 + rng.standard_normal(shape)
    dy = rng.standard_normal(shape)
    channels = shape[-1]
    weight = rng.standard_normal(channels) if affine == "both" else None
    bias = rng.standard_normal(channels) if affine in ("both", "bias") else None
    if activation == "relu":  # keep z away from the kink, where the derivative jumps
        y = reference.group_norm(x, num_groups, weight, bias, eps=1e-3)
        assert numpy.abs(y).min() > 1e-4, "resample: z too close to 0 for relu"
    _, mean, rstd = reference.group_norm(x, num_groups, weight, bias, eps=1e-3, return_stats=True)
    dx, dw, db = reference.group_norm_backward(dy, x, mean, rstd, num_groups, weight, bias, activation=activation)
    ndx, ndw, ndb = _numeric_gradients(x, dy, num_groups, weight, bias, activation)
    numpy.testing.assert_allclose(dx, ndx, rtol=1e-6, atol=1e-7)
    assert (dw is None) == (weight is None) and (db is None) == (bias is None)
    if dw is not None:
        numpy.testing.assert_allclose(dw, ndw, rtol=1e-6, atol=1e-7)
    if db is not None:
        numpy.testing.assert_allclose(db, ndb, rtol=1e-6, atol=1e-7)


def test_reference_rejects_unknown_activation():
    with pytest.raises(ValueError, match="gelu_tanh"):
        reference.group_norm(numpy.ones((1, 4)), 2, activation="tanh")


def test_normal_cdf_matches_math_erfc():
    # gelu's Phi(z) = erfc(-z / sqrt(2)) / 2, vectorized (series near 0, continued fraction beyond).
    z = numpy.concatenate([numpy.linspace(-40.0, 40.0, 160001), numpy.linspace(-3.0, 3.0, 60001)])
    want = numpy.array([0.5 * math.erfc(-v / math.sqrt(2.0)) for v in z])
    pdf = reference._normal_pdf(z)
    got = reference._normal_cdf(z, pdf)
    numpy.testing.assert_allclose(pdf, numpy.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi), rtol=1e-13, atol=1e-300)
    assert numpy.abs(got - want).max() <= 4e-16  # 2 ulp of values near 1
    tail = want > 1e-300
    assert (numpy.abs(got - want)[tail] / want[tail]).max() <= 1e-12
    # Non-finite and huge arguments: no overflow, NaN stays NaN.
    edge = numpy.array([-numpy.inf, -1e300, 1e300, numpy.inf, numpy.nan])
    with numpy.errstate(over="raise", invalid="raise"):
        got = reference._normal_cdf(edge, reference._normal_pdf(edge))
    numpy.testing.assert_array_equal(got[:4], [0.0, 0.0, 1.0, 1.0])
    assert numpy.isnan(got[4])


def test_backward_uses_the_given_statistics(rng):
    # float32 statistics (what a float32 x must come with) move the float64
    # gradients by ~1e-7 relative: far inside the float32 tolerance.
    x = (3.0 + rng.standard_normal((2, 5, 7, 16))).astype(numpy.float32)
    dy = rng.standard_normal(x.shape).astype(numpy.float32)
    w = rng.standard_normal(16).astype(numpy.float32)
    x64, dy64, w64 = x.astype(numpy.float64), dy.astype(numpy.float64), w.astype(numpy.float64)
    _, mean, rstd = reference.group_norm(x64, 4, w64, None, activation="gelu", return_stats=True)
    exact = reference.group_norm_backward(dy64, x64, mean, rstd, 4, w64, None, activation="gelu")
    rounded = reference.group_norm_backward(
        dy, x, mean.astype(numpy.float32), rstd.astype(numpy.float32), 4, w, None, activation="gelu"
    )
    for a, b in zip(exact[:2], rounded[:2]):
        error = numpy.linalg.norm(a - b) / numpy.linalg.norm(a)
        assert 0 < error < 1e-6
    with pytest.raises(TypeError, match=r"^mean: expected dtype float32 \(the statistics dtype for x of dtype float32\), got float64$"):
        reference.group_norm_backward(dy, x, mean, rstd, 4, w, None, activation="gelu")


@pytest.mark.parametrize("activation", ["identity", "relu", "silu", "gelu", "gelu_tanh"])
def test_non_finite_input_makes_its_group_nan(rng, activation):
    # README "Numerics": an inf or NaN makes its (sample, group)'s statistics and outputs NaN,
    # whatever the activation (relu included, as PyTorch's), and leaves the other groups alone.
    x = rng.standard_normal((2, 3, 4, 6))
    x[0, 1, 2, 0] = numpy.inf    # sample 0, group 0 (channels 0-2)
    x[1, 2, 3, 5] = numpy.nan    # sample 1, group 1 (channels 3-5)
    with numpy.errstate(invalid="ignore"):
        y, mean, rstd = reference.group_norm(x, 2, activation=activation, return_stats=True)
    bad = numpy.zeros(y.shape, bool)
    bad[0, ..., 0:3] = bad[1, ..., 3:6] = True
    assert numpy.isnan(y[bad]).all() and numpy.isfinite(y[~bad]).all()
    assert numpy.isnan(rstd[[0, 1], [0, 1]]).all() and numpy.isfinite(rstd[[0, 1], [1, 0]]).all()
