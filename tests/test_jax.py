"""cupy_dwgn.jax: JAX arrays in and out, jax.grad through the custom_vjp
rules, jit through buffer_callback.

GPU tests (marked `gpu`, and skipped when JAX has no GPU backend) run the
real kernels against the float64 references.  The CPU tests run the very
same JAX plumbing (custom_vjp, eager vs traced dispatch, buffer_callback,
vmap) with the CuPy ops swapped for the NumPy references, plus the error
messages.
"""

import contextlib
import os
import subprocess
import sys
import types

import numpy
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

# JAX takes 75% of the GPU at start by default, which would starve CuPy (and
# every other test in this process): allocate on demand instead.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import cupy_dwgn.jax as dwj  # noqa: E402
from cupy_dwgn import reference  # noqa: E402

from _helpers import BFLOAT16, TOLERANCE, random, relative_error  # noqa: E402

F16 = numpy.dtype(numpy.float16)
F32 = numpy.dtype(numpy.float32)


def _jax_gpus():
    # Opening JAX's GPU backend leaves the last GPU's context current on this
    # thread (XLA makes each device's context current as it opens it), so
    # CuPy would put every later array of the test session on that GPU (seen
    # on 2 GPUs: the device-mismatch tests of other files then ran on GPU 1
    # only).  Put back the CUDA device that was current.
    try:
        from cupy.cuda import runtime
        current = runtime.getDevice()
    except Exception:  # no CuPy or no GPU: nothing to put back
        runtime = None
    try:
        return jax.devices("gpu")
    except RuntimeError:  # no GPU backend (jax without the CUDA plugin, or no GPU)
        return []
    finally:
        if runtime is not None:
            runtime.setDevice(current)


JAX_GPUS = _jax_gpus()
needs_jax_gpu = pytest.mark.skipif(
    not JAX_GPUS, reason="JAX has no GPU backend here (install jax[cuda13] or jax[cuda12] on a GPU machine)"
)
CPU = jax.devices("cpu")[0]


def _stats_dtype(dtype):
    return numpy.dtype(numpy.float64) if dtype == numpy.float64 else F32


def _affine_dtype(dtype):
    return F32 if numpy.dtype(dtype).itemsize == 2 else numpy.dtype(dtype)


def _np(a):
    return None if a is None else numpy.asarray(a)


# ---------------------------------------------------------------------------
# CPU: the JAX plumbing with the NumPy references standing in for the CuPy ops


def _store(out, value, dtype):
    value = numpy.asarray(value).astype(dtype)
    if out is None:
        return value
    out[...] = value
    return out


def _gn_reference_grads(ct, x, num_groups, weight, bias, *, eps=1e-5, activation):
    """The float64 reference gradients, from the reference forward's statistics
    rounded to the op's statistics dtype (what the backward op is handed)."""
    _, mean, rstd = reference.group_norm(x, num_groups, weight, bias, eps=eps, activation=activation, return_stats=True)
    stats = _stats_dtype(x.dtype)
    return reference.group_norm_backward(
        ct, x, mean.astype(stats), rstd.astype(stats), num_groups, weight, bias, activation=activation
    )


class _FakeCore:
    """cupy_dwgn's GPU ops on NumPy arrays (the float64 references, rounded to
    the op's output dtypes, written into out= arrays as the GPU ops do)."""

    def __init__(self):
        self.calls = []

    def depthwise_conv2d(self, x, weight, bias=None, *, stride, padding, dilation, layout, out=None):
        self.calls.append("depthwise_conv2d")
        y = reference.depthwise_conv2d(x, weight, bias, stride=stride, padding=padding, dilation=dilation, layout=layout)
        return _store(out, y, x.dtype)

    def depthwise_conv2d_backward_input(self, grad, weight, input_shape, *, out=None, **options):
        self.calls.append("depthwise_conv2d_backward_input")
        return _store(out, reference.depthwise_conv2d_backward_input(grad, weight, input_shape, **options), grad.dtype)

    def depthwise_conv2d_backward_weight(self, grad, x, weight_shape, *, out=None, **options):
        self.calls.append("depthwise_conv2d_backward_weight")
        return _store(out, reference.depthwise_conv2d_backward_weight(grad, x, weight_shape, **options), x.dtype)

    def group_norm(self, x, num_groups, weight=None, bias=None, *, eps, activation, out=None, mean_out=None,
                   rstd_out=None, return_stats=False):
        self.calls.append("group_norm")
        y, mean, rstd = reference.group_norm(x, num_groups, weight, bias, eps=eps, activation=activation, return_stats=True)
        stats = _stats_dtype(x.dtype)
        result = (_store(out, y, x.dtype), _store(mean_out, mean, stats), _store(rstd_out, rstd, stats))
        return result if return_stats else result[0]

    def group_norm_backward(self, grad, x, mean, rstd, num_groups, weight=None, bias=None, *, activation,
                            out=None, grad_weight_out=None, grad_bias_out=None):
        self.calls.append("group_norm_backward")
        dx, dw, db = reference.group_norm_backward(grad, x, mean, rstd, num_groups, weight, bias, activation=activation)
        return (
            _store(out, dx, x.dtype),
            None if weight is None else _store(grad_weight_out, dw, weight.dtype),
            None if bias is None else _store(grad_bias_out, db, bias.dtype),
        )


@pytest.fixture
def fake(monkeypatch):
    """Swap CuPy out of cupy_dwgn.jax: NumPy views of (CPU) JAX arrays and
    buffers, the reference ops.  ``fake.eager`` / ``fake.traced`` count the
    calls each path made."""
    core = _FakeCore()
    state = types.SimpleNamespace(core=core, eager=0, traced=0)

    def to_numpy(array):
        state.eager += 1
        return numpy.asarray(array)

    def view(buffer):
        state.traced += 1
        return numpy.asarray(buffer)

    monkeypatch.setattr(dwj, "_core", lambda: core)
    monkeypatch.setattr(dwj, "_device_id", lambda array: 0)
    monkeypatch.setattr(dwj, "_on_device", lambda device_id: contextlib.nullcontext())
    monkeypatch.setattr(dwj, "_to_cupy", to_numpy)
    monkeypatch.setattr(dwj, "_from_cupy", lambda a: jax.device_put(a, CPU))
    monkeypatch.setattr(dwj, "_hold_until_done", lambda views: None)
    monkeypatch.setattr(dwj, "_callback_context", lambda ctx, buffers: contextlib.nullcontext())
    monkeypatch.setattr(dwj, "_view", view)
    with jax.default_device(CPU):
        yield state


def _cpu(array):
    return jax.device_put(array, CPU)


DW_CASES = [
    # (x shape, layout, weight shape, options)
    ((2, 4, 9, 8), "NCHW", (4, 1, 3, 3), {"padding": 1}),
    ((2, 9, 8, 4), "NHWC", (8, 1, 3, 2), {"stride": 2, "padding": ((1, 0), (0, 1)), "dilation": (1, 2)}),
]


def _dw_inputs(rng, shape, layout, w_shape, dtype=F32, bias=True):
    x = random(rng, shape, dtype)
    w = random(rng, w_shape, dtype)
    b = random(rng, (w_shape[0],), dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("shape, layout, w_shape, options", DW_CASES, ids=["NCHW", "NHWC"])
def test_depthwise_eager_and_grad_with_reference_ops(fake, rng, shape, layout, w_shape, options):
    x, w, b = _dw_inputs(rng, shape, layout, w_shape)
    y = dwj.depthwise_conv2d(_cpu(x), _cpu(w), _cpu(b), layout=layout, **options)
    assert isinstance(y, jax.Array) and y.dtype == jnp.float32
    ref = reference.depthwise_conv2d(x, w, b, layout=layout, **options)
    assert relative_error(y, ref) < TOLERANCE[F32]
    assert fake.eager == 3 and fake.traced == 0

    ct = random(rng, ref.shape, F32)
    grads = jax.grad(
        lambda x, w, b: jnp.sum(dwj.depthwise_conv2d(x, w, b, layout=layout, **options) * ct), argnums=(0, 1, 2)
    )(_cpu(x), _cpu(w), _cpu(b))
    assert fake.traced == 0, "eager jax.grad must not go through buffer_callback"
    assert fake.core.calls[-2:] == ["depthwise_conv2d_backward_input", "depthwise_conv2d_backward_weight"]
    axes = (0, 2, 3) if layout == "NCHW" else (0, 1, 2)
    expected = (
        reference.depthwise_conv2d_backward_input(ct, w, x.shape, layout=layout, **options),
        reference.depthwise_conv2d_backward_weight(ct, x, w.shape, layout=layout, **options),
        ct.astype(numpy.float64).sum(axis=axes),
    )
    for got, want in zip(grads, expected):
        assert relative_error(got, want) < TOLERANCE[F32]


def test_depthwise_without_bias_grad(fake, rng):
    x, w, _ = _dw_inputs(rng, (1, 3, 6, 6), "NCHW", (6, 1, 3, 3), bias=False)
    gx, gw = jax.grad(lambda x, w: dwj.depthwise_conv2d(x, w, padding="same").sum(), argnums=(0, 1))(_cpu(x), _cpu(w))
    ones = numpy.ones((1, 6, 6, 6), w.dtype)
    assert relative_error(gx, reference.depthwise_conv2d_backward_input(ones, w, x.shape, padding="same")) < 1e-5
    assert relative_error(gw, reference.depthwise_conv2d_backward_weight(ones, x, w.shape, padding="same")) < 1e-5


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no-affine"])
def test_group_norm_eager_and_grad_with_reference_ops(fake, rng, affine):
    x = random(rng, (2, 5, 3, 16), F32)
    w = random(rng, (16,), F32, offset=1.0) if affine else None
    b = random(rng, (16,), F32) if affine else None
    y = dwj.group_norm(_cpu(x), 4, _cpu(w) if affine else None, _cpu(b) if affine else None, eps=1e-4,
                       activation="silu")
    ref = reference.group_norm(x, 4, w, b, eps=1e-4, activation="silu")
    assert relative_error(y, ref) < TOLERANCE[F32]

    ct = random(rng, x.shape, F32)
    argnums = (0, 1, 2) if affine else (0,)
    grads = jax.grad(
        lambda x, w, b: jnp.sum(dwj.group_norm(x, 4, w, b, eps=1e-4, activation="silu") * ct), argnums=argnums
    )(_cpu(x), _cpu(w) if affine else None, _cpu(b) if affine else None)
    assert fake.traced == 0
    expected = _gn_reference_grads(ct, x, 4, w, b, eps=1e-4, activation="silu")
    for got, want in zip(grads, expected):
        assert relative_error(got, want) < 1e-5


def _fuzzer():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "scripts"))
    import fuzz_gpu

    return fuzz_gpu


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_fuzzer_runs_both_ops_through_jax_vjp(fake, rng, jit):
    """scripts/fuzz_gpu.py's jax / jax_jit array kinds (run on GPU machines, against PyTorch in float64):
    y and each present input's gradient under the oracle's names, none for an absent weight or bias, here
    through the reference ops."""
    if jit and dwj._buffer_callback is None:
        pytest.skip("this JAX has no jax.experimental.buffer_callback")
    fuzz = _fuzzer()
    shape, layout, w_shape, options = DW_CASES[1]
    x, w, b = _dw_inputs(rng, shape, layout, w_shape)
    ct = random(rng, reference.depthwise_conv2d(x, w, b, layout=layout, **options).shape, F32)
    for bias in (b, None):
        got = fuzz._through_jax(jit, lambda ops, *arrays: ops.depthwise_conv2d(*arrays, layout=layout, **options),
                                (x, w, bias), ct)
        assert set(got) == {"y", "dx", "dw"} | ({"db"} if bias is not None else set())
        assert relative_error(got["y"], reference.depthwise_conv2d(x, w, bias, layout=layout, **options)) < 1e-5
        assert relative_error(got["dx"], reference.depthwise_conv2d_backward_input(
            ct, w, x.shape, layout=layout, **options)) < 1e-5
        assert relative_error(got["dw"], reference.depthwise_conv2d_backward_weight(
            ct, x, w.shape, layout=layout, **options)) < 1e-5
    x, ct = random(rng, (2, 5, 16), F32), random(rng, (2, 5, 16), F32)
    b = random(rng, (16,), F32)
    got = fuzz._through_jax(jit, lambda ops, x, w, b: ops.group_norm(x, 4, w, b, eps=1e-4, activation="gelu"),
                            (x, None, b), ct)
    assert set(got) == {"y", "dx", "db"}
    assert relative_error(got["y"], reference.group_norm(x, 4, None, b, eps=1e-4, activation="gelu")) < 1e-5
    dx, _, db = _gn_reference_grads(ct, x, 4, None, b, eps=1e-4, activation="gelu")
    assert relative_error(got["dx"], dx) < 1e-5 and relative_error(got["db"], db) < 1e-5
    assert (fake.traced > 0) == jit


def test_jit_runs_the_ops_as_xla_custom_calls(fake, rng):
    if dwj._buffer_callback is None:
        pytest.skip("this JAX has no jax.experimental.buffer_callback (jit raises TypeError, tested below)")
    shape, layout, w_shape, options = DW_CASES[1]
    x, w, b = _dw_inputs(rng, shape, layout, w_shape)
    x, w, b = _cpu(x), _cpu(w), _cpu(b)

    def loss(x, w, b):
        y = dwj.depthwise_conv2d(x, w, b, layout=layout, **options)
        return jnp.sum(dwj.group_norm(y, 2, activation="gelu") ** 2)

    eager_value = loss(x, w, b)
    eager_grads = jax.grad(loss, argnums=(0, 1, 2))(x, w, b)
    assert fake.traced == 0
    jit_value = jax.jit(loss)(x, w, b)
    assert fake.traced > 0, "jit must go through buffer_callback"
    numpy.testing.assert_allclose(jit_value, eager_value, rtol=1e-5)
    for transform in (lambda f: jax.jit(jax.grad(f, argnums=(0, 1, 2))), lambda f: jax.grad(jax.jit(f), argnums=(0, 1, 2))):
        for got, want in zip(transform(loss)(x, w, b), eager_grads):
            numpy.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("affine", ["both", "weight", "bias", "none"])
def test_jitted_group_norm_gradients_of_every_affine_form(fake, rng, affine):
    """Under jit the backward's output buffers are dx's and those of the parameters present only: a bias
    without a weight has its buffer second (it was handed to the op as the weight's, and the bias gradient
    came back unwritten)."""
    if dwj._buffer_callback is None:
        pytest.skip("this JAX has no jax.experimental.buffer_callback")
    x, ct = random(rng, (2, 5, 3, 16), F32), random(rng, (2, 5, 3, 16), F32)
    w = random(rng, (16,), F32, offset=1.0) if affine in ("both", "weight") else None
    b = random(rng, (16,), F32) if affine in ("both", "bias") else None
    leaves = {name: _cpu(value) for name, value in (("x", x), ("w", w), ("b", b)) if value is not None}

    def loss(*values):
        given = dict(zip(leaves, values))
        y = dwj.group_norm(given["x"], 4, given.get("w"), given.get("b"), eps=1e-4, activation="silu")
        return jnp.sum(y * ct)

    argnums = tuple(range(len(leaves)))
    grads = jax.jit(jax.grad(loss, argnums=argnums))(*leaves.values())
    assert fake.traced > 0
    dx, dw, db = _gn_reference_grads(ct, x, 4, w, b, eps=1e-4, activation="silu")
    expected = {"x": dx, "w": dw, "b": db}
    for name, got in zip(leaves, grads):
        assert relative_error(got, expected[name]) < 1e-5, name


def _vjp_through_jax(jit, apply, inputs, cotangent):
    """y and {input index: gradient} of ``apply(ops, x, weight, bias)`` under jax.vjp, eagerly or under
    jax.jit, through the fuzzer's own helper (scripts/fuzz_gpu.py; absent inputs None, no gradient)."""
    got = _fuzzer()._through_jax(jit, apply, inputs, cotangent)
    return got.pop("y"), {("dx", "dw", "db").index(name): grad for name, grad in got.items()}


_padding_forms = st.one_of(
    st.integers(0, 4), st.tuples(st.integers(0, 4), st.integers(0, 4)),
    st.tuples(st.tuples(st.integers(0, 4), st.integers(0, 4)), st.tuples(st.integers(0, 4), st.integers(0, 4))),
    st.sampled_from(["same", "valid"]),
)
_with_fixtures = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_with_fixtures
@given(
    jit=st.booleans(), batch=st.integers(1, 2), channels=st.integers(1, 4), multiplier=st.integers(1, 3),
    kernel=st.tuples(st.integers(1, 5), st.integers(1, 5)), stride=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    dilation=st.tuples(st.integers(1, 3), st.integers(1, 3)), size=st.tuples(st.integers(1, 9), st.integers(1, 9)),
    padding=_padding_forms, layout=st.sampled_from(["NCHW", "NHWC"]), has_bias=st.booleans(),
    dtype=st.sampled_from([F32, F16, BFLOAT16]), seed=st.integers(0, 2**32 - 1),
)
def test_depthwise_any_call_through_jax_eager_and_jitted(fake, jit, batch, channels, multiplier, kernel, stride,
                                                         dilation, size, padding, layout, has_bias, dtype, seed):
    """Any geometry, either layout and dtype, with or without bias, eagerly and under jit: y and every
    present input's gradient (in its input's dtype) are the reference ops' (the same kernels' results on
    a GPU); a geometry the reference refuses is refused."""
    assume(not jit or dwj._buffer_callback is not None)
    if padding == "same":
        stride = (1, 1)
    rng = numpy.random.default_rng(seed)
    x = random(rng, (batch, channels) + size if layout == "NCHW" else (batch,) + size + (channels,), dtype)
    w = random(rng, (channels * multiplier, 1) + kernel, dtype)
    b = random(rng, (channels * multiplier,), dtype) if has_bias else None
    geo = dict(stride=stride, padding=padding, dilation=dilation, layout=layout)
    try:
        ref = reference.depthwise_conv2d(x, w, b, **geo)
    except ValueError:
        with pytest.raises(ValueError):
            _vjp_through_jax(jit, lambda ops, *arrays: ops.depthwise_conv2d(*arrays, **geo), (x, w, b), x)
        return
    ct = random(rng, ref.shape, dtype)
    y, grads = _vjp_through_jax(jit, lambda ops, *arrays: ops.depthwise_conv2d(*arrays, **geo), (x, w, b), ct)
    tolerance = TOLERANCE[dtype]
    assert y.dtype == dtype and relative_error(y, ref) < tolerance
    assert sorted(grads) == ([0, 1, 2] if has_bias else [0, 1])
    assert all(grads[i].dtype == dtype for i in grads)
    assert relative_error(grads[0], reference.depthwise_conv2d_backward_input(ct, w, x.shape, **geo)) < tolerance
    assert relative_error(grads[1], reference.depthwise_conv2d_backward_weight(ct, x, w.shape, **geo)) < tolerance
    if has_bias:
        axes = (0, 2, 3) if layout == "NCHW" else (0, 1, 2)
        assert relative_error(grads[2], ct.astype(numpy.float64).sum(axis=axes)) < tolerance


@_with_fixtures
@given(
    jit=st.booleans(), batch=st.integers(1, 3), groups=st.integers(1, 4), group_channels=st.integers(1, 4),
    spatial=st.lists(st.integers(1, 5), min_size=0, max_size=3),
    affine=st.sampled_from(["both", "weight", "bias", "none"]),
    activation=st.sampled_from(["identity", "relu", "silu", "gelu", "gelu_tanh"]),
    eps=st.sampled_from([1e-6, 1e-5, 0.1]), dtype=st.sampled_from([F32, F16, BFLOAT16]),
    float32_parameters=st.booleans(), seed=st.integers(0, 2**32 - 1),
)
def test_group_norm_any_call_through_jax_eager_and_jitted(fake, jit, batch, groups, group_channels, spatial, affine,
                                                          activation, eps, dtype, float32_parameters, seed):
    """Any rank (0-3 spatial dims), group size, affine form, activation and dtype (half types with
    float32 parameters too), eagerly and under jit: y and every present input's gradient are the
    reference ops' from the statistics the forward returns, each gradient in its input's dtype."""
    assume(not jit or dwj._buffer_callback is not None)
    rng = numpy.random.default_rng(seed)
    channels = groups * group_channels
    shape = (batch, *spatial, channels)
    param_dtype = F32 if float32_parameters else dtype
    x, ct = random(rng, shape, dtype), random(rng, shape, dtype)
    w = random(rng, (channels,), param_dtype, offset=1.0) if affine in ("both", "weight") else None
    b = random(rng, (channels,), param_dtype) if affine in ("both", "bias") else None
    y, grads = _vjp_through_jax(
        jit, lambda ops, x, w, b: ops.group_norm(x, groups, w, b, eps=eps, activation=activation), (x, w, b), ct)
    assert y.dtype == dtype
    assert relative_error(y, reference.group_norm(x, groups, w, b, eps=eps, activation=activation)) < TOLERANCE[dtype]
    expected = _gn_reference_grads(ct, x, groups, w, b, eps=eps, activation=activation)
    inputs = (x, w, b)
    assert sorted(grads) == [i for i, value in enumerate(inputs) if value is not None]
    # dx of one or two values a group is a small remainder of terms that cancel (zero, or about eps / var
    # of their size), where rounding it to x's dtype (subnormal in float16) is large relative to it: it
    # is judged against the size of the terms, rstd * |w| * |grad|, as scripts/fuzz_gpu.py judges it.
    _, _, rstd = reference.group_norm(x, groups, w, b, eps=eps, activation=activation, return_stats=True)
    terms = numpy.linalg.norm(ct.astype(numpy.float64)) * rstd.max() * (1.0 if w is None else numpy.abs(w).max())
    for i, got in grads.items():
        assert got.dtype == inputs[i].dtype, i
        got = numpy.asarray(got, numpy.float64)
        assert numpy.isfinite(got).all(), i
        scale = max(numpy.linalg.norm(expected[i]), terms if i == 0 else 0.0)
        assert numpy.linalg.norm(got - expected[i]) <= TOLERANCE[dtype] * scale, i


# ---------------------------------------------------------------------------
# Higher-order derivatives: against the same functions written in JAX's ops.


def _lax_depthwise(x, w, b, *, layout, stride=1, padding=0, dilation=1):
    """A depthwise convolution in jax.lax (explicit padding sides), the independent reference."""
    pair = lambda v: (v, v) if isinstance(v, int) else tuple(v)  # noqa: E731
    pads = tuple(pair(p) if not isinstance(p, int) else (p, p) for p in
                 (((padding, padding), (padding, padding)) if isinstance(padding, int) else padding))
    channels = x.shape[1] if layout == "NCHW" else x.shape[-1]
    y = jax.lax.conv_general_dilated(x, w, pair(stride), pads, rhs_dilation=pair(dilation),
                                     dimension_numbers=(layout, "OIHW", layout), feature_group_count=channels,
                                     precision=jax.lax.Precision.HIGHEST)
    if b is None:
        return y
    return y + (b[:, None, None] if layout == "NCHW" else b)


def _two_pass_group_norm(x, num_groups, w, b, *, eps, activation):
    """GroupNorm + activation of (N, *spatial, C) x in plain jnp (two passes), the independent reference."""
    groups = x.reshape(x.shape[0], -1, num_groups, x.shape[-1] // num_groups)
    centred = groups - groups.mean(axis=(1, 3), keepdims=True)
    y = (centred / jnp.sqrt((centred ** 2).mean(axis=(1, 3), keepdims=True) + eps)).reshape(x.shape)
    y = y if w is None else y * w
    y = y if b is None else y + b
    return {"identity": lambda t: t, "relu": jax.nn.relu, "silu": lambda t: t * jax.nn.sigmoid(t),
            "gelu": lambda t: 0.5 * t * (1 + jax.scipy.special.erf(t / numpy.sqrt(2.0))),
            "gelu_tanh": lambda t: jax.nn.gelu(t, approximate=True)}[activation](y)


def _penalty_grads(function, inputs, v, jit):
    """The gradients, with respect to every present input, of a gradient penalty
    sum(v * dL/dx) + sum((dL/dx)^2) with L = sum(function(*inputs)^2) (second
    order), then a third-order term: the gradient of sum((d penalty / d inputs[1])^2)
    with respect to inputs[1]."""
    present = [i for i, a in enumerate(inputs) if a is not None]

    def penalty(*arrays):
        def loss(x):
            return jnp.sum(function(x, *arrays[1:]) ** 2)
        grad_x = jax.grad(loss)(arrays[0])
        return jnp.sum(v * grad_x) + jnp.sum(grad_x ** 2)

    second = jax.grad(penalty, argnums=present)
    third = jax.grad(lambda *arrays: jnp.sum(second(*arrays)[1] ** 2), argnums=1)
    if jit:
        second, third = jax.jit(second), jax.jit(third)
    return tuple(second(*inputs)) + (third(*inputs),)


def _dw_penalty_grads(rng, place, shape, layout, w_shape, options, jit):
    """(ours, jax.lax's) _penalty_grads of a depthwise case, its arrays put by ``place``."""
    x, w, b = (place(a) for a in _dw_inputs(rng, shape, layout, w_shape))
    v = place(random(rng, shape, F32))
    got = _penalty_grads(lambda x, w, b: dwj.depthwise_conv2d(x, w, b, layout=layout, **options), (x, w, b), v, jit)
    return got, _penalty_grads(lambda x, w, b: _lax_depthwise(x, w, b, layout=layout, **options), (x, w, b), v, False)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("shape, layout, w_shape, options", DW_CASES, ids=["NCHW", "NHWC"])
def test_depthwise_higher_order_matches_lax(fake, rng, shape, layout, w_shape, options, jit):
    # Second- and third-order derivatives through the ops (their backward's own rule is the same
    # kernels again: here the reference ops) against jax.lax's convolution.
    if jit and dwj._buffer_callback is None:
        pytest.skip("this JAX has no jax.experimental.buffer_callback")
    got, want = _dw_penalty_grads(rng, _cpu, shape, layout, w_shape, options, jit)
    for got_grad, want_grad in zip(got, want):
        assert relative_error(got_grad, numpy.asarray(want_grad, numpy.float64)) < 1e-4
    assert "depthwise_conv2d_backward_weight" in fake.core.calls and (fake.traced > 0) == jit


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("affine", ["both", "weight", "bias"])
@pytest.mark.parametrize("activation", ["identity", "silu", "gelu_tanh"])
def test_group_norm_higher_order_matches_two_pass(fake, rng, affine, activation, jit):
    if jit and dwj._buffer_callback is None:
        pytest.skip("this JAX has no jax.experimental.buffer_callback")
    x = _cpu(random(rng, (2, 5, 3, 16), F32))
    w = _cpu(random(rng, (16,), F32, offset=1.0)) if affine in ("both", "weight") else None
    b = _cpu(random(rng, (16,), F32)) if affine in ("both", "bias") else None
    v = _cpu(random(rng, x.shape, F32))
    options = dict(eps=1e-4, activation=activation)
    # the third-order term differentiates the second input: the weight, else the bias
    inputs = (x, w, b) if w is not None else (x, b, None)
    bias_first = w is None

    def ours(x, first, second):
        return dwj.group_norm(x, 4, None if bias_first else first, first if bias_first else second, **options)

    def theirs(x, first, second):
        return _two_pass_group_norm(x, 4, None if bias_first else first, first if bias_first else second, **options)

    got = _penalty_grads(ours, inputs, v, jit)
    want = _penalty_grads(theirs, inputs, v, False)
    for got_grad, want_grad in zip(got, want):
        assert relative_error(got_grad, numpy.asarray(want_grad, numpy.float64)) < 1e-4
    assert "group_norm_backward" in fake.core.calls and (fake.traced > 0) == jit


def test_vmap_runs_one_example_at_a_time(fake, rng):
    if dwj._buffer_callback is None:
        pytest.skip("this JAX has no jax.experimental.buffer_callback")
    x = _cpu(random(rng, (3, 2, 4, 6, 6), F32))
    w = _cpu(random(rng, (4, 1, 3, 3), F32))
    batched = jax.vmap(lambda x: dwj.depthwise_conv2d(x, w, padding=1))(x)
    assert batched.shape == (3, 2, 4, 6, 6)
    for i in range(3):
        assert relative_error(batched[i], reference.depthwise_conv2d(_np(x[i]), _np(w), padding=1)) < 1e-5


def test_jit_without_buffer_callback_raises_a_clear_type_error(fake, rng, monkeypatch):
    monkeypatch.setattr(dwj, "_buffer_callback", None)
    x = _cpu(random(rng, (1, 2, 5, 5), F32))
    w = _cpu(random(rng, (2, 1, 3, 3), F32))
    with pytest.raises(TypeError) as info:
        jax.jit(lambda x, w: dwj.depthwise_conv2d(x, w, padding=1))(x, w)
    message = str(info.value)
    for words in ("cupy_dwgn.jax.depthwise_conv2d", "tracer", "jax.jit", "buffer_callback", "concrete",
                  "register_ffi_target", "pure_callback", "eager jax.grad"):
        assert words in message, (words, message)
    with pytest.raises(TypeError, match="cupy_dwgn.jax.group_norm"):
        jax.jit(lambda x: dwj.group_norm(x, 1))(x.reshape(1, 25, 2))
    # Eager calls and eager jax.grad are unaffected.
    jax.grad(lambda x: dwj.depthwise_conv2d(x, w, padding=1).sum())(x)


def test_traced_group_norm_checks_num_groups(fake, rng):
    x = _cpu(random(rng, (2, 4, 6), F32))
    with pytest.raises(ValueError, match="num_groups"):
        jax.jit(lambda x: dwj.group_norm(x, 4))(x)


def test_buffer_pointer_reads_cpu_buffers_too():
    """_buffer_pointer's DLPack fallback (bfloat16 has no CUDA typestr) gives
    the buffer's address: checked against NumPy's view of CPU buffers."""
    if dwj._buffer_callback is None:
        pytest.skip("this JAX has no jax.experimental.buffer_callback")
    seen = []

    def callback(ctx, out, x):
        for buffer in (x, out):
            seen.append((dwj._buffer_pointer(buffer), numpy.asarray(buffer).__array_interface__["data"][0]))
        numpy.asarray(out)[...] = numpy.asarray(x)

    for dtype in (jnp.float32, jnp.bfloat16):
        x = jax.device_put(jnp.arange(12, dtype=dtype).reshape(3, 4), CPU)
        call = dwj._buffer_callback(callback, jax.ShapeDtypeStruct(x.shape, x.dtype))
        numpy.testing.assert_array_equal(numpy.asarray(call(x), numpy.float32), numpy.asarray(x, numpy.float32))
    assert len(seen) == 4 and all(got == want for got, want in seen)


def test_cpu_arrays_are_rejected_with_a_clear_message(rng):
    x = _cpu(random(rng, (1, 2, 5, 5), F32))
    w = _cpu(random(rng, (2, 1, 3, 3), F32))
    with pytest.raises(ValueError, match="on a CUDA GPU, got one on .*cpu"):
        dwj.depthwise_conv2d(x, w)
    with pytest.raises(ValueError, match="on a CUDA GPU"):
        dwj.group_norm(x.reshape(1, 25, 2), 1)


def test_import_error_says_how_to_install_jax():
    code = (
        "import sys; sys.modules['jax'] = None\n"
        "try:\n"
        "    import cupy_dwgn.jax\n"
        "except ImportError as error:\n"
        "    print(error)\n"
        "else:\n"
        "    print('imported')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "cupy_dwgn.jax needs JAX" in result.stdout and "pip install" in result.stdout
    assert "jax[cuda13]" in result.stdout


# ---------------------------------------------------------------------------
# GPU: the real kernels


def _gpu(array, device=None):
    return jax.device_put(array, device or JAX_GPUS[0])


def _check_jax_out(result, like):
    assert isinstance(result, jax.Array), type(result)
    assert result.devices() == like.devices(), (result.devices(), like.devices())


GPU_DTYPES = [F32, F16, BFLOAT16]


@pytest.mark.gpu
@needs_jax_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("shape, layout, w_shape, options", DW_CASES, ids=["NCHW", "NHWC"])
def test_gpu_depthwise_values_and_grad(rng, dtype, shape, layout, w_shape, options):
    x, w, b = _dw_inputs(rng, shape, layout, w_shape, dtype)
    xj, wj, bj = _gpu(x), _gpu(w), _gpu(b)
    y = dwj.depthwise_conv2d(xj, wj, bj, layout=layout, **options)
    _check_jax_out(y, xj)
    assert y.dtype == dtype
    ref = reference.depthwise_conv2d(x, w, b, layout=layout, **options)
    assert relative_error(_np(y), ref) < TOLERANCE[dtype]

    ct = random(rng, ref.shape, dtype)
    ctj = _gpu(ct)
    grads = jax.grad(
        lambda x, w, b: jnp.sum((dwj.depthwise_conv2d(x, w, b, layout=layout, **options) * ctj).astype(jnp.float32)),
        argnums=(0, 1, 2),
    )(xj, wj, bj)
    axes = (0, 2, 3) if layout == "NCHW" else (0, 1, 2)
    expected = (
        reference.depthwise_conv2d_backward_input(ct, w, x.shape, layout=layout, **options),
        reference.depthwise_conv2d_backward_weight(ct, x, w.shape, layout=layout, **options),
        ct.astype(numpy.float64).sum(axis=axes),
    )
    for got, want, like in zip(grads, expected, (x, w, b)):
        _check_jax_out(got, xj)
        assert got.dtype == like.dtype and got.shape == like.shape
        assert relative_error(_np(got), want) < TOLERANCE[dtype]


@pytest.mark.gpu
@needs_jax_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no-affine"])
def test_gpu_group_norm_values_and_grad(rng, dtype, affine):
    x = random(rng, (2, 6, 5, 32), dtype, offset=0.5)
    w = random(rng, (32,), _affine_dtype(dtype), offset=1.0) if affine else None
    b = random(rng, (32,), _affine_dtype(dtype)) if affine else None
    xj, wj, bj = _gpu(x), _gpu(w) if affine else None, _gpu(b) if affine else None
    y = dwj.group_norm(xj, 8, wj, bj, activation="silu")
    _check_jax_out(y, xj)
    assert y.dtype == dtype
    ref = reference.group_norm(x, 8, w, b, activation="silu")
    assert relative_error(_np(y), ref) < TOLERANCE[dtype]

    ct = random(rng, x.shape, dtype)
    ctj = _gpu(ct)
    argnums = (0, 1, 2) if affine else (0,)
    grads = jax.grad(
        lambda x, w, b: jnp.sum((dwj.group_norm(x, 8, w, b, activation="silu") * ctj).astype(jnp.float32)),
        argnums=argnums,
    )(xj, wj, bj)
    expected = _gn_reference_grads(ct, x, 8, w, b, activation="silu")
    for got, want, like in zip(grads, expected, (x, w, b)):
        _check_jax_out(got, xj)
        assert got.dtype == like.dtype
        assert relative_error(_np(got), want) < TOLERANCE[dtype]


@pytest.mark.gpu
@needs_jax_gpu
@pytest.mark.parametrize("dtype", [F32, BFLOAT16], ids=str)
def test_gpu_jit_and_grad_of_jit(rng, dtype):
    """Under jit the ops are XLA custom calls (buffer_callback) on XLA's stream;
    without buffer_callback, jit raises the TypeError that says why."""
    x = random(rng, (2, 16, 12, 12), dtype)
    w = random(rng, (16, 1, 3, 3), dtype)
    gamma = random(rng, (16,), _affine_dtype(dtype), offset=1.0)
    ct = random(rng, (2, 12, 12, 16), dtype)
    xj, wj, gj, ctj = _gpu(x), _gpu(w), _gpu(gamma), _gpu(ct)

    def model(x, w, gamma):
        y = dwj.depthwise_conv2d(x, w, padding=1)                       # NCHW
        h = jnp.transpose(y, (0, 2, 3, 1))                               # NHWC for GroupNorm
        return dwj.group_norm(h, 4, gamma, None, activation="relu")

    def loss(x, w, gamma):
        return jnp.sum((model(x, w, gamma) * ctj).astype(jnp.float32))

    if dwj._buffer_callback is None:
        with pytest.raises(TypeError, match="tracer"):
            jax.jit(model)(xj, wj, gj)
        return
    out = jax.jit(model)(xj, wj, gj)
    _check_jax_out(out, xj)
    y_ref = reference.depthwise_conv2d(x, w, padding=1).astype(dtype)  # the op's own rounding between the two
    h_ref = numpy.ascontiguousarray(y_ref.transpose(0, 2, 3, 1))
    ref = reference.group_norm(h_ref, 4, gamma, None, activation="relu")
    assert relative_error(_np(out), ref) < TOLERANCE[dtype]

    eager = jax.grad(loss, argnums=(0, 1, 2))(xj, wj, gj)
    for grads in (jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(xj, wj, gj),
                  jax.grad(jax.jit(loss), argnums=(0, 1, 2))(xj, wj, gj)):
        for got, want in zip(grads, eager):
            _check_jax_out(got, xj)
            assert got.dtype == want.dtype
            assert relative_error(_np(got), _np(want).astype(numpy.float64)) < TOLERANCE[dtype]


@pytest.mark.gpu
@needs_jax_gpu
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("shape, layout, w_shape, options", DW_CASES, ids=["NCHW", "NHWC"])
def test_gpu_depthwise_and_group_norm_higher_order(rng, shape, layout, w_shape, options, jit):
    """Second- and third-order derivatives through the kernels (float32) against jax.lax's
    convolution and a two-pass GroupNorm in jnp, on the same GPU."""
    if jit and dwj._buffer_callback is None:
        pytest.skip("this JAX has no jax.experimental.buffer_callback")
    got, want = _dw_penalty_grads(rng, _gpu, shape, layout, w_shape, options, jit)
    h = _gpu(random(rng, (2, 6, 5, 32), F32))
    gamma, beta = _gpu(random(rng, (32,), F32, offset=1.0)), _gpu(random(rng, (32,), F32))
    u = _gpu(random(rng, h.shape, F32))
    got += _penalty_grads(lambda h, g, b: dwj.group_norm(h, 8, g, b, activation="silu"), (h, gamma, beta), u, jit)
    want += _penalty_grads(lambda h, g, b: _two_pass_group_norm(h, 8, g, b, eps=1e-5, activation="silu"),
                           (h, gamma, beta), u, False)
    for got_grad, want_grad in zip(got, want):
        _check_jax_out(got_grad, h)
        assert relative_error(_np(got_grad), _np(want_grad).astype(numpy.float64)) < 1e-4


@pytest.mark.gpu
@needs_jax_gpu
def test_gpu_inputs_dropped_right_after_the_call_stay_valid(rng):
    """The views of JAX buffers are held until the kernels reading them are
    done: freeing each input right away (and allocating over it) changes no result."""
    w_np = random(rng, (64, 1, 7, 7), F32)
    w = _gpu(w_np)
    inputs = [random(rng, (4, 64, 96, 96), F32) for _ in range(8)]
    results = []
    for x_np in inputs:
        x = _gpu(x_np)
        results.append(dwj.depthwise_conv2d(x, w, padding=3))
        del x
        jnp.full((4, 64, 96, 96), jnp.nan, jnp.float32).block_until_ready()  # reuses freed memory, if any
    for x_np, y in zip(inputs, results):
        assert relative_error(_np(y), reference.depthwise_conv2d(x_np, w_np, padding=3)) < TOLERANCE[F32]


@pytest.mark.gpu
@pytest.mark.skipif(len(JAX_GPUS) < 2, reason="needs two GPUs visible to JAX")
def test_gpu_arrays_on_the_second_gpu_stay_there(rng):
    x = random(rng, (2, 8, 10, 10), F32)
    w = random(rng, (8, 1, 3, 3), F32)
    xj, wj = _gpu(x, JAX_GPUS[1]), _gpu(w, JAX_GPUS[1])
    ref = reference.depthwise_conv2d(x, w, padding=1)
    calls = [lambda x, w: dwj.depthwise_conv2d(x, w, padding=1)]
    if dwj._buffer_callback is not None:
        calls.append(jax.jit(calls[0]))
    for call in calls:
        y = call(xj, wj)
        _check_jax_out(y, xj)
        assert relative_error(_np(y), ref) < TOLERANCE[F32]
    gw = jax.grad(lambda w: dwj.depthwise_conv2d(xj, w, padding=1).sum())(wj)
    _check_jax_out(gw, xj)
    assert relative_error(_np(gw), reference.depthwise_conv2d_backward_weight(numpy.ones(ref.shape, x.dtype), x, w.shape, padding=1)) < TOLERANCE[F32]
