"""GroupNorm argument checks.

The validators are duck-typed over the array class, so the CPU tests run them
on NumPy arrays (kind=numpy.ndarray, exactly what cupy_dwgn.host does); the
few CuPy-specific messages (NumPy array given, devices) are GPU tests.
"""

import re

import ml_dtypes
import numpy
import pytest

from cupy_dwgn import _group_norm as gn

F16 = numpy.float16
F32 = numpy.float32
F64 = numpy.float64
BF16 = numpy.dtype(ml_dtypes.bfloat16)


def fwd(x, num_groups=2, weight=None, bias=None, eps=1e-5, activation="identity", out=None):
    return gn.check_forward_args(x, num_groups, weight, bias, eps, activation, out, kind=numpy.ndarray)


def bwd(grad_out, x, mean, rstd, num_groups=2, weight=None, bias=None, activation="identity"):
    return gn.check_backward_args(
        grad_out, x, mean, rstd, num_groups, weight, bias, activation, kind=numpy.ndarray
    )


def z(shape, dtype=F32):
    return numpy.zeros(shape, dtype=dtype)


# -- accepted ---------------------------------------------------------------

@pytest.mark.parametrize("shape", [(2, 4), (2, 3, 4), (2, 3, 5, 4), (2, 3, 5, 7, 4)])
def test_ranks_2_to_5_accepted(shape):
    batch, rows, channels, groups = fwd(z(shape))
    assert (batch, channels, groups) == (2, 4, 2)
    assert rows == int(numpy.prod(shape[1:-1]))


@pytest.mark.parametrize("dtype,wdtype", [(F32, F32), (F64, F64), (F16, F16), (F16, F32), (BF16, BF16), (BF16, F32)])
def test_weight_dtypes_accepted(dtype, wdtype):
    fwd(z((1, 3, 4), dtype), 2, z(4, wdtype), z(4, wdtype))
    fwd(z((1, 3, 4), dtype), 2, None, z(4, wdtype))


def test_numpy_integer_groups_and_zero_size_accepted():
    assert fwd(z((0, 3, 4)), numpy.int64(4))[3] == 4
    assert fwd(z((2, 0, 4)))[1] == 0


# -- forward errors ---------------------------------------------------------

@pytest.mark.parametrize("shape", [(4,), (1, 2, 3, 4, 5, 4)])
def test_wrong_rank(shape):
    with pytest.raises(ValueError, match=r"x: expected a 2-D to 5-D array .*got shape"):
        fwd(z(shape))


def test_not_an_array():
    with pytest.raises(TypeError, match="x: expected a numpy.ndarray, got list"):
        fwd([[1.0, 2.0]])


def test_unsupported_dtype():
    with pytest.raises(TypeError, match="x: expected dtype .*got int32"):
        fwd(z((1, 4), numpy.int32))


def _strided(shape, dtype=F32):
    """A non-contiguous array of ``shape`` (every other element of a row twice as long)."""
    return numpy.zeros(shape[:-1] + (2 * shape[-1],), dtype)[..., ::2]


@pytest.mark.parametrize("name", ["grad_out", "weight", "bias", "mean", "rstd"])
def test_every_array_argument_must_be_contiguous(name):
    # DESIGN.md: non-contiguous inputs are rejected (the op never copies
    # behind the caller's back); each array argument by its own name.
    shapes = dict(grad_out=(2, 6, 4), x=(2, 6, 4), mean=(2, 2), rstd=(2, 2), weight=(4,), bias=(4,))
    args = {key: z(shape) for key, shape in shapes.items()}
    args[name] = _strided(shapes[name])
    with pytest.raises(ValueError, match=f"{name}: expected a C-contiguous array"):
        bwd(args["grad_out"], args["x"], args["mean"], args["rstd"], 2, args["weight"], args["bias"])
    if name in ("weight", "bias"):
        with pytest.raises(ValueError, match=f"{name}: expected a C-contiguous array"):
            fwd(args["x"], 2, args["weight"], args["bias"])


def test_non_contiguous():
    x = z((2, 3, 8))[:, :, ::2]
    with pytest.raises(ValueError, match="x: expected a C-contiguous array"):
        fwd(x)


def test_zero_channels():
    with pytest.raises(ValueError, match="x: expected at least one channel"):
        fwd(z((2, 3, 0)))


@pytest.mark.parametrize("num_groups", [3, 5])
def test_groups_must_divide_channels(num_groups):
    with pytest.raises(ValueError, match=rf"num_groups: expected a divisor of C = 4 .*got {num_groups}"):
        fwd(z((1, 2, 4)), num_groups)


@pytest.mark.parametrize("num_groups", [0, -2])
def test_groups_must_be_positive(num_groups):
    with pytest.raises(ValueError, match=f"num_groups: expected a positive int, got {num_groups}"):
        fwd(z((1, 2, 4)), num_groups)


@pytest.mark.parametrize("num_groups", [2.0, "2", True, None])
def test_groups_must_be_int(num_groups):
    with pytest.raises(TypeError, match="num_groups: expected an int"):
        fwd(z((1, 2, 4)), num_groups)


@pytest.mark.parametrize("name", ["weight", "bias"])
def test_affine_shape(name):
    kwargs = {name: z(5)}
    with pytest.raises(ValueError, match=rf"{name}: expected shape \(4,\).*got \(5,\)"):
        fwd(z((1, 2, 4)), **kwargs)
    kwargs = {name: z((1, 4))}
    with pytest.raises(ValueError, match=rf"{name}: expected a 1-D array"):
        fwd(z((1, 2, 4)), **kwargs)


@pytest.mark.parametrize(
    "dtype,wdtype", [(F32, F16), (F32, F64), (F64, F32), (F16, BF16), (BF16, F16), (F16, F64)]
)
def test_affine_dtype(dtype, wdtype):
    with pytest.raises(TypeError, match=rf"weight: expected dtype .*got {numpy.dtype(wdtype)}"):
        fwd(z((1, 2, 4), dtype), 2, z(4, wdtype))


def test_weight_and_bias_same_dtype():
    with pytest.raises(TypeError, match="bias: expected dtype float32 .*weight.*got float16"):
        fwd(z((1, 2, 4), F16), 2, z(4, F32), z(4, F16))


@pytest.mark.parametrize("activation", ["tanh", "SiLU", ""])
def test_unknown_activation_lists_allowed(activation):
    with pytest.raises(ValueError, match=r"activation: expected one of 'identity', 'relu', 'silu', 'gelu', 'gelu_tanh', got"):
        fwd(z((1, 2, 4)), activation=activation)


def test_activation_must_be_str():
    with pytest.raises(TypeError, match="activation: expected a str"):
        fwd(z((1, 2, 4)), activation=None)


@pytest.mark.parametrize("eps", [0.0, -1e-5, float("nan"), float("inf"), 1e-46, 1e-40, 1e-39, 1e39, 10**400])
@pytest.mark.parametrize("dtype", [F32, F16])
def test_eps_must_be_normal_and_finite_in_float32(eps, dtype):
    # 1e-46 rounds to 0, 1e-40 and 1e-39 are float32 subnormals (the kernels
    # flush them to 0: rstd = inf for a constant group) and 1e39 overflows in
    # the float32 statistics.
    with pytest.raises(ValueError, match=r"eps: expected a finite value >= 1.17549e-38 \(the smallest normal float32"):
        fwd(z((1, 2, 4), dtype), eps=eps)


def test_eps_error_shortens_a_huge_int():
    with pytest.raises(ValueError, match=re.escape(f"got {str(10**400)[:24]}...") + "$"):
        fwd(z((1, 2, 4)), eps=10**400)


def test_smallest_normal_float32_eps_is_accepted():
    fwd(z((1, 2, 4)), eps=float(numpy.finfo(numpy.float32).tiny))


def test_tiny_eps_is_fine_in_float64():
    fwd(numpy.zeros((1, 2, 4), F64), eps=1e-46)


def test_channel_count_limit():
    # The column kernels put ceil(C / 256) blocks in grid.z (at most 65535).
    x = numpy.zeros((1, 1, 65535 * 256 + 1), F16)
    with pytest.raises(ValueError, match=r"x: expected at most 16776960 channels, got 16776961"):
        fwd(x, num_groups=1)


def test_eps_must_be_a_number():
    with pytest.raises(TypeError, match="eps: expected a float, got str"):
        fwd(z((1, 2, 4)), eps="1e-5")


def test_out_shape_and_dtype():
    with pytest.raises(ValueError, match=r"out: expected shape \(1, 2, 4\), got \(1, 8\)"):
        fwd(z((1, 2, 4)), out=z((1, 8)))
    with pytest.raises(TypeError, match="out: expected dtype float32, got float64"):
        fwd(z((1, 2, 4)), out=z((1, 2, 4), F64))


# -- backward errors --------------------------------------------------------

def _bwd_args(dtype=F32, shape=(2, 3, 4), groups=2):
    acc = F64 if dtype == F64 else F32
    return z(shape, dtype), z(shape, dtype), z((shape[0], groups), acc), z((shape[0], groups), acc)


def test_backward_accepts_valid():
    assert bwd(*_bwd_args()) == (2, 3, 4, 2)
    assert bwd(*_bwd_args(F16), 2, z(4, F32), z(4, F32)) == (2, 3, 4, 2)


def test_backward_grad_out_shape():
    dy, x, mean, rstd = _bwd_args()
    with pytest.raises(ValueError, match=r"grad_out: expected shape \(2, 3, 4\) \(the shape of x\), got \(2, 4, 3\)"):
        bwd(dy.reshape(2, 4, 3), x, mean, rstd)


def test_backward_grad_out_dtype():
    dy, x, mean, rstd = _bwd_args()
    with pytest.raises(TypeError, match="grad_out: expected dtype float32 .*got float64"):
        bwd(dy.astype(F64), x, mean, rstd)


@pytest.mark.parametrize("name", ["mean", "rstd"])
def test_backward_stats_shape(name):
    args = dict(zip(["grad_out", "x", "mean", "rstd"], _bwd_args()))
    args[name] = z((2, 4))
    with pytest.raises(ValueError, match=rf"{name}: expected shape \(2, 2\) \(N, num_groups\), got \(2, 4\)"):
        bwd(**args)


@pytest.mark.parametrize("dtype,stats_dtype", [(F16, F16), (BF16, F64), (F32, F64), (F64, F32)])
def test_backward_stats_dtype(dtype, stats_dtype):
    dy, x, mean, rstd = _bwd_args(dtype)
    with pytest.raises(TypeError, match=rf"mean: expected dtype float(32|64) .*got {numpy.dtype(stats_dtype)}"):
        bwd(dy, x, mean.astype(stats_dtype), rstd)


def test_backward_checks_groups_affine_activation():
    dy, x, mean, rstd = _bwd_args()
    with pytest.raises(ValueError, match="num_groups: expected a divisor"):
        bwd(dy, x, mean, rstd, 3)
    with pytest.raises(TypeError, match="weight: expected dtype"):
        bwd(dy, x, mean, rstd, 2, z(4, F64))
    with pytest.raises(ValueError, match="activation: expected one of"):
        bwd(dy, x, mean, rstd, 2, activation="swish")


def test_specializations_selection():
    specs = gn.specializations("group_norm", dtypes=[F16], activations=["silu"], large_index=False)
    names = [e for _, e in specs]
    # The apply kernel at both vectors-per-thread counts, on both paths.
    for vec in (8, 1):
        for u in (1, 2):
            assert f"dwgn_gn_fwd_apply<__half, 2, {vec}, int, {u}>" in names
    assert "dwgn_gn_fwd_finalize<float, float>" in names and "dwgn_gn_fwd_finalize<float, __half>" in names
    assert not any("long long" in n for n in names)
    with pytest.raises(ValueError, match="activation"):
        gn.specializations(activations=["swish"])
    # float16 with 64-bit indices (tensors of 2**31 elements and more, past
    # the bound) compiles U = 2 only; bfloat16, float32 and float64 U = 1 only.
    wide = [e for _, e in gn.specializations("group_norm_backward", dtypes=[F16], large_index=True)]
    assert "dwgn_gn_bwd_dx<__half, 2, 8, long long, 2>" in wide
    assert not any(e.startswith(("dwgn_gn_bwd_dx", "dwgn_gn_fwd_apply")) and e.endswith("long long, 1>") for e in wide)
    for dtype in (ml_dtypes.bfloat16, F32, numpy.float64):
        names = [e for _, e in gn.specializations(dtypes=[dtype])]
        elementwise = [e for e in names if e.startswith(("dwgn_gn_bwd_dx", "dwgn_gn_fwd_apply"))]
        assert elementwise and all(e.endswith(", 1>") for e in elementwise)


@pytest.mark.parametrize(
    "shape, dtype, expected",
    [
        ((2, 64, 64, 320), F16, 1),  # 5 MB: SD-size
        ((2, 32, 32, 640), F32, 1),  # 5 MB
        ((1, 128, 128, 511), F16, 1),  # 1 element short of 16 MB: below the bound
        ((1, 128, 128, 512), F16, 2),  # 16 MB
        ((1, 512, 512, 128), F16, 2),  # 64 MB
        ((8, 128, 128, 320), ml_dtypes.bfloat16, 1),  # 84 MB, but bfloat16 (measured slower at 2)
        ((1, 256, 256, 256), F32, 1),  # 64 MB, but 4-byte elements
        ((2, 64, 64, 1024), numpy.float64, 1),
    ],
)
def test_elementwise_vectors_per_thread_rule(shape, dtype, expected):
    """The apply / dx kernels take 2 vectors a thread for float16 tensors of
    at least _ELEMENTWISE_BATCH_BYTES, else 1; the plan's launch names that U
    and a grid of a thread per U vectors."""
    n, h, w, c = shape
    dtype = numpy.dtype(dtype)
    large = n * h * w * c * dtype.itemsize >= gn._ELEMENTWISE_BATCH_BYTES
    assert expected == (2 if dtype == F16 and large else 1)
    vectors = n * h * w * c // gn._vector_width(dtype, c, True)
    forward = gn._forward_plan(n, h * w, c, 32, dtype, dtype, "silu", 1e-5, True, "fused").elementwise
    backward = gn._backward_plan(n, h * w, c, 32, dtype, dtype, "silu", True, "fused").elementwise
    for launch, kernel in ((forward, "dwgn_gn_fwd_apply"), (backward, "dwgn_gn_bwd_dx")):
        assert launch.expression.startswith(kernel) and launch.expression.endswith(f", {expected}>")
        assert launch.grid == (-(-vectors // (256 * expected)), 1, 1)


# -- CuPy-specific messages (need a GPU) -----------------------------------

@pytest.mark.gpu
def test_numpy_input_points_to_host():
    with pytest.raises(TypeError, match=r"x: expected a cupy.ndarray or a CUDA array with __dlpack__ \(torch tensor, JAX array\), got numpy.ndarray \(for NumPy arrays use cupy_dwgn.host\)"):
        gn.group_norm(numpy.zeros((1, 2, 4), F32), 2)


@pytest.mark.gpu
def test_gpu_errors_raised_before_launch():
    import cupy

    x = cupy.zeros((1, 2, 4), F32)
    with pytest.raises(ValueError, match="num_groups"):
        gn.group_norm(x, 3)
    with pytest.raises(ValueError, match="x: expected a C-contiguous"):
        gn.group_norm(cupy.zeros((1, 2, 8), F32)[:, :, ::2], 2)
    with pytest.raises(TypeError, match="weight: expected a cupy.ndarray"):
        gn.group_norm(x, 2, numpy.ones(4, F32))
    y, mean, rstd = gn.group_norm(x + 1, 2, return_stats=True)
    with pytest.raises(TypeError, match="mean: expected dtype float32"):
        gn.group_norm_backward(x, x, mean.astype(F64), rstd, 2)


@pytest.mark.gpu
def test_arrays_on_different_devices():
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs 2 GPUs")
    x = cupy.zeros((1, 2, 4), F32)
    with cupy.cuda.Device(1):
        w = cupy.ones(4, F32)
    assert (x.device.id, w.device.id) == (0, 1), "an earlier test left another device current"
    with pytest.raises(ValueError, match="weight: expected an array on device 0 .*got device 1"):
        gn.group_norm(x, 2, w)
    with cupy.cuda.Device(1):
        dy = cupy.ones((1, 2, 4), F32)
    y, mean, rstd = gn.group_norm(x, 2, return_stats=True)
    with pytest.raises(ValueError, match="grad_out: expected an array on device 0"):
        gn.group_norm_backward(dy, x, mean, rstd, 2)


# -- caller-given statistics and gradient outputs ---------------------------

def test_stats_outputs_checked_by_name():
    x = z((2, 3, 4))
    gn.check_forward_args(x, 2, None, None, 1e-5, "identity", None, numpy.ndarray, mean_out=z((2, 2)), rstd_out=z((2, 2)))
    with pytest.raises(ValueError, match=r"^mean_out: expected shape \(2, 2\)"):
        gn.check_forward_args(x, 2, None, None, 1e-5, "identity", None, numpy.ndarray, mean_out=z((2, 3)))
    with pytest.raises(TypeError, match=r"^rstd_out: expected dtype float32"):
        gn.check_forward_args(x, 2, None, None, 1e-5, "identity", None, numpy.ndarray, rstd_out=z((2, 2), F16))
    stats = z((2, 2))
    with pytest.raises(ValueError, match=r"^mean_out: expected memory separate from rstd_out"):
        gn.check_forward_args(x, 2, None, None, 1e-5, "identity", None, numpy.ndarray, mean_out=stats, rstd_out=stats)


def test_gradient_outputs_checked_by_name():
    x, stats = z((2, 3, 4)), z((2, 2))
    w = z(4)

    def check(**outputs):
        return gn.check_backward_args(x, x, stats, stats, 2, w, None, "identity", numpy.ndarray, **outputs)

    check(out=z((2, 3, 4)), grad_weight_out=z(4))
    with pytest.raises(ValueError, match=r"^grad_bias_out: expected None because bias is None"):
        check(grad_bias_out=z(4))
    with pytest.raises(ValueError, match=r"^grad_weight_out: expected shape \(4,\)"):
        check(grad_weight_out=z(5))
    with pytest.raises(ValueError, match=r"^out: expected memory separate from x"):
        gn.check_backward_args(z((2, 3, 4)), x, stats, stats, 2, w, None, "identity", numpy.ndarray, out=x)


def test_elementwise_vectors_with_int32_counts_and_every_pick_compiled():
    # A vector count near 2**31 held in an int32 scalar does not overflow the
    # size check (U = 2 for a float16 tensor of 2**31 - 8 elements);
    # bfloat16, float32 and float64 tensors of any size take U = 1.
    assert gn._elementwise_vectors(numpy.int32((2**31 - 8) // 8), 8, F16) == 2
    assert gn._elementwise_vectors(numpy.int32(1000), 8, F16) == 1
    assert gn._elementwise_vectors(numpy.int32((2**31 - 8) // 8), 8, ml_dtypes.bfloat16) == 1
    assert gn._elementwise_vectors(numpy.int64(2**30), 4, F32) == 1
    # Every plan names a compiled U: both index widths, every dtype, vectors and elements.
    for dtype in (F16, ml_dtypes.bfloat16, F32, numpy.float64):
        dtype = numpy.dtype(dtype)
        names = {e for _, e in gn.specializations(dtypes=[dtype])}
        for n, rows, c in ((2, 64 * 64, 320), (8, 128 * 128, 320), (1, 2**31 // 64 + 1, 64)):
            for aligned in (True, False):
                forward = gn._forward_plan(n, rows, c, 32, dtype, dtype, "silu", 1e-5, aligned, "fused").elementwise
                backward = gn._backward_plan(n, rows, c, 32, dtype, dtype, "silu", aligned, "fused").elementwise
                assert {forward.expression, backward.expression} <= names, (dtype, n, rows, c, aligned)
