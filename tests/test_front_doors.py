"""Every bad-input case through the three front doors: cupy_dwgn.reference,
cupy_dwgn.host (whatever path CUPY_DWGN_DEVICE picks) and the GPU op.  Each
raises the same exception with the same message; the GPU op's differs only
where it names its own array kind (cupy.ndarray instead of numpy.ndarray).

The cases are those of test_depthwise_validation.py and
test_group_norm_validation.py, written once as (op, arguments) so each door
can run them: NumPy arrays for reference and host, the same shapes, dtypes
and strides as CuPy arrays for the GPU op (a `gpu` test).
"""

import re

import numpy
import pytest

import cupy_dwgn
import cupy_dwgn.host as host
from cupy_dwgn import reference

from _helpers import BFLOAT16
from test_depthwise_validation import DY, DYN, FORWARD_ERRORS, NHWC, W, WN, X, XN

F16 = numpy.dtype(numpy.float16)
F32 = numpy.dtype(numpy.float32)
F64 = numpy.dtype(numpy.float64)


def z(shape, dtype=F32):
    return numpy.zeros(shape, dtype)


def case(label, op, args, kwargs, error, pattern):
    return pytest.param(op, args, kwargs, error, pattern, id=label)


# --- depthwise ----------------------------------------------------------------

DEPTHWISE = [
    case(label, "depthwise_conv2d", (changes.get("x", X), changes.get("weight", W)),
         {"padding": 1, **{k: v for k, v in changes.items() if k not in ("x", "weight")}}, error, pattern)
    for label, changes, error, pattern in FORWARD_ERRORS
] + [
    case("input_shape not ints", "depthwise_conv2d_backward_input", (DY, W, (2, 3, 8.0, 8)), {"padding": 1},
         TypeError, r"input_shape: expected a tuple of 4 ints, got \(2, 3, 8.0, 8\)"),
    case("input_shape negative", "depthwise_conv2d_backward_input", (DY, W, (2, 3, -8, 8)), {"padding": 1},
         ValueError, r"input_shape: expected sizes >= 0, got \(2, 3, -8, 8\)"),
    case("grad_out shape (input)", "depthwise_conv2d_backward_input", (DY[:, :, :7].copy(), W, X.shape), {"padding": 1},
         ValueError, r"grad_out: expected shape \(2, 3, 8, 8\) \(the forward output shape\), got \(2, 3, 7, 8\)"),
    case("weight dtype (input)", "depthwise_conv2d_backward_input", (DY, W.astype(F16), X.shape), {"padding": 1},
         TypeError, r"weight: expected dtype float32 \(the dtype of grad_out\), got float16"),
    case("grad_out int32 (input)", "depthwise_conv2d_backward_input", (DY.astype(numpy.int32), W, X.shape), {"padding": 1},
         TypeError, r"grad_out: expected dtype float16, float32, float64, bfloat16, got int32"),
    case("weight_shape rank", "depthwise_conv2d_backward_weight", (DY, X, (3, 1, 3)), {"padding": 1},
         TypeError, r"weight_shape: expected a tuple of 4 ints, got \(3, 1, 3\)"),
    case("grad_out shape (weight)", "depthwise_conv2d_backward_weight", (DY, X, (3, 1, 5, 5)), {"padding": 1},
         ValueError, r"grad_out: expected shape \(2, 3, 6, 6\) \(the forward output shape\), got \(2, 3, 8, 8\)"),
    case("x dtype (weight)", "depthwise_conv2d_backward_weight", (DY, X.astype(F64), W.shape), {"padding": 1},
         TypeError, r"x: expected dtype float32 \(the dtype of grad_out\), got float64"),
    case("x rank (weight)", "depthwise_conv2d_backward_weight", (DY, X[0], W.shape), {"padding": 1},
         ValueError, r"x: expected a 4-D array \(N, C, H, W\), got shape \(3, 8, 8\)"),
    # channels-last (NHWC)
    case("NHWC x rank", "depthwise_conv2d", (XN[0], WN), NHWC,
         ValueError, r"x: expected a 4-D array \(N, H, W, C\), got shape \(8, 6, 3\)"),
    case("NHWC x in NCHW order", "depthwise_conv2d", (X, WN), NHWC,
         ValueError, r"weight: expected shape \(C\*M, 1, KH, KW\) with C = 8 \(channels of x, NHWC \(2, 3, 8, 8\)\) .*got \(3, 1, 3, 3\)"),
    case("NHWC weight channel count", "depthwise_conv2d", (XN, z((4, 1, 3, 3))), NHWC,
         ValueError, r"weight: expected shape \(C\*M, 1, KH, KW\) with C = 3 \(channels of x, NHWC \(2, 8, 6, 3\)\) .*got \(4, 1, 3, 3\)"),
    case("NHWC output size", "depthwise_conv2d", (XN, z((3, 1, 3, 9))), NHWC,
         ValueError, r"x: the output size would be 8x0: the padded input \(10x8\) must be at least as large as the dilated filter \(3x9\)"),
    case("NHWC view of NCHW data", "depthwise_conv2d", (X.transpose(0, 2, 3, 1), WN), NHWC,
         ValueError, r"x: expected a C-contiguous array, got strides \(768, 32, 4, 256\) for shape \(2, 8, 8, 3\); pass numpy.ascontiguousarray\(x\)"),
    case("layout string", "depthwise_conv2d", (XN, WN), {"padding": 1, "layout": "channels_last"},
         ValueError, r"layout: expected 'NCHW' or 'NHWC', got 'channels_last'"),
    case("NHWC grad_out rank (input)", "depthwise_conv2d_backward_input", (DYN[0], WN, XN.shape), NHWC,
         ValueError, r"grad_out: expected a 4-D array \(N, OH, OW, C\*M\), got shape \(8, 6, 3\)"),
    case("NHWC grad_out in NCHW order (input)", "depthwise_conv2d_backward_input", (z((2, 3, 8, 6)), WN, XN.shape), NHWC,
         ValueError, r"grad_out: expected shape \(2, 8, 6, 3\) \(the forward output shape\), got \(2, 3, 8, 6\)"),
    case("NHWC stride-1 grad_out at stride 2 (input)", "depthwise_conv2d_backward_input",
         (z((2, 8, 6, 6)), z((6, 1, 3, 3)), XN.shape), {"stride": 2, "padding": 1, "layout": "NHWC"},
         ValueError, r"grad_out: expected shape \(2, 4, 3, 6\) \(the forward output shape\), got \(2, 8, 6, 6\)"),
    case("NHWC input_shape in NCHW order", "depthwise_conv2d_backward_input", (DYN, WN, (2, 3, 8, 6)), NHWC,
         ValueError, r"weight: expected shape \(C\*M, 1, KH, KW\) with C = 6 \(channels of input_shape, NHWC \(2, 3, 8, 6\)\)"),
    case("layout string (input)", "depthwise_conv2d_backward_input", (DYN, WN, XN.shape), {"padding": 1, "layout": "HWC"},
         ValueError, r"layout: expected 'NCHW' or 'NHWC', got 'HWC'"),
    case("NHWC x rank (weight)", "depthwise_conv2d_backward_weight", (DYN, XN[..., 0], WN.shape), NHWC,
         ValueError, r"x: expected a 4-D array \(N, H, W, C\), got shape \(2, 8, 6\)"),
    case("NHWC grad_out without the multiplier (weight)", "depthwise_conv2d_backward_weight", (DYN, XN, (6, 1, 3, 3)), NHWC,
         ValueError, r"grad_out: expected shape \(2, 8, 6, 6\) \(the forward output shape\), got \(2, 8, 6, 3\)"),
    case("NHWC x in NCHW order (weight)", "depthwise_conv2d_backward_weight", (DYN, z((2, 3, 8, 6)), WN.shape), NHWC,
         ValueError, r"weight_shape: expected shape \(C\*M, 1, KH, KW\) with C = 6 \(channels of x, NHWC \(2, 3, 8, 6\)\)"),
    case("layout int (weight)", "depthwise_conv2d_backward_weight", (DYN, XN, WN.shape), {"padding": 1, "layout": 0},
         ValueError, r"layout: expected 'NCHW' or 'NHWC', got 0"),
    case("NHWC grad_out of the other layout (weight)", "depthwise_conv2d_backward_weight", (z((2, 3, 8, 6)), XN, WN.shape), NHWC,
         ValueError, r"grad_out: expected shape \(2, 8, 6, 3\) \(the forward output shape\), got \(2, 3, 8, 6\)"),
]

# --- GroupNorm ----------------------------------------------------------------

GX = z((1, 2, 4))  # C = 4, 2 groups
GN = "group_norm"
GNB = "group_norm_backward"


def _bwd(dtype=F32, shape=(2, 3, 4), groups=2, stats=None):
    stats = stats or (F64 if dtype == F64 else F32)
    return z(shape, dtype), z(shape, dtype), z((shape[0], groups), stats), z((shape[0], groups), stats)


DY_G, X_G, MEAN, RSTD = _bwd()

GROUP_NORM = [
    case("x rank 1", GN, (z((4,)), 2), {}, ValueError, r"x: expected a 2-D to 5-D array \(N, \*spatial, C\) with 0 to 3 spatial dims, got shape \(4,\)"),
    case("x rank 6", GN, (z((1, 2, 3, 4, 5, 4)), 2), {}, ValueError, r"x: expected a 2-D to 5-D array .*got shape \(1, 2, 3, 4, 5, 4\)"),
    case("x not an array", GN, ([[1.0, 2.0]], 2), {}, TypeError, r"x: expected a numpy.ndarray, got list"),
    case("x int32", GN, (z((1, 4), numpy.int32), 2), {}, TypeError, r"x: expected dtype float16, float32, float64, bfloat16, got int32"),
    case("x non-contiguous", GN, (z((2, 3, 8))[:, :, ::2], 2), {}, ValueError, r"x: expected a C-contiguous array, got strides \(96, 32, 8\)"),
    case("x no channels", GN, (z((2, 3, 0)), 2), {}, ValueError, r"x: expected at least one channel \(last dim\), got shape \(2, 3, 0\)"),
    case("groups 3 of C = 4", GN, (GX, 3), {}, ValueError, r"num_groups: expected a divisor of C = 4 \(the last dim of x\), got 3"),
    case("groups 0", GN, (GX, 0), {}, ValueError, r"num_groups: expected a positive int, got 0"),
    case("groups -2", GN, (GX, -2), {}, ValueError, r"num_groups: expected a positive int, got -2"),
    case("groups float", GN, (GX, 2.0), {}, TypeError, r"num_groups: expected an int, got float"),
    case("groups str", GN, (GX, "2"), {}, TypeError, r"num_groups: expected an int, got str"),
    case("groups bool", GN, (GX, True), {}, TypeError, r"num_groups: expected an int, got bool"),
    case("groups None", GN, (GX, None), {}, TypeError, r"num_groups: expected an int, got NoneType"),
    case("weight shape", GN, (GX, 2, z(5)), {}, ValueError, r"weight: expected shape \(4,\) \(C,\), C the last dim of x, got \(5,\)"),
    case("bias shape", GN, (GX, 2, None, z(5)), {}, ValueError, r"bias: expected shape \(4,\) \(C,\), C the last dim of x, got \(5,\)"),
    case("weight rank", GN, (GX, 2, z((1, 4))), {}, ValueError, r"weight: expected a 1-D array \(C,\), got shape \(1, 4\)"),
    case("bias not an array", GN, (GX, 2, None, [0.0] * 4), {}, TypeError, r"bias: expected a numpy.ndarray, got list"),
] + [
    case(f"weight {numpy.dtype(w)} for x {numpy.dtype(d)}", GN, (z((1, 2, 4), d), 2, z(4, w)), {}, TypeError,
         rf"weight: expected dtype {allowed} \(for x of dtype {numpy.dtype(d)}\), got {numpy.dtype(w)}")
    for d, w, allowed in [
        (F32, F16, "float32"), (F32, F64, "float32"), (F64, F32, "float64"), (F16, BFLOAT16, "float16 or float32"),
        (BFLOAT16, F16, "bfloat16 or float32"), (F16, F64, "float16 or float32"),
    ]
] + [
    case("weight and bias dtypes differ", GN, (z((1, 2, 4), F16), 2, z(4, F32), z(4, F16)), {}, TypeError,
         r"bias: expected dtype float32 \(the dtype of weight\), got float16"),
    case("activation unknown", GN, (GX, 2), {"activation": "tanh"}, ValueError,
         r"activation: expected one of 'identity', 'relu', 'silu', 'gelu', 'gelu_tanh', got 'tanh'"),
    case("activation capitalized", GN, (GX, 2), {"activation": "SiLU"}, ValueError, r"activation: expected one of .*got 'SiLU'"),
    case("activation empty", GN, (GX, 2), {"activation": ""}, ValueError, r"activation: expected one of .*got ''"),
    case("activation None", GN, (GX, 2), {"activation": None}, TypeError,
         r"activation: expected a str, one of 'identity', 'relu', 'silu', 'gelu', 'gelu_tanh', got NoneType"),
    case("eps str", GN, (GX, 2), {"eps": "1e-5"}, TypeError, r"eps: expected a float, got str"),
] + [
    case(f"eps {eps!r}"[:24], GN, (GX, 2), {"eps": eps}, ValueError,
         r"eps: expected a finite value >= 1\.17549e-38 \(the smallest normal float32: the kernels flush smaller "
         r"values to 0\) in float32 \(the statistics dtype\), got "
         + re.escape(repr(eps) if len(repr(eps)) <= 32 else repr(eps)[:24] + "..."))
    for eps in (0.0, -1e-5, float("nan"), float("inf"), 1e-46, 1e-40, 1e39, 10**400)
] + [
    case("too many channels", GN, (z((1, 1, 65535 * 256 + 1), F16), 1), {}, ValueError,
         r"x: expected at most 16776960 channels, got 16776961"),
    # backward
    case("grad_out shape", GNB, (DY_G.reshape(2, 4, 3), X_G, MEAN, RSTD, 2), {}, ValueError,
         r"grad_out: expected shape \(2, 3, 4\) \(the shape of x\), got \(2, 4, 3\)"),
    case("grad_out dtype", GNB, (DY_G.astype(F64), X_G, MEAN, RSTD, 2), {}, TypeError,
         r"grad_out: expected dtype float32 \(the dtype of x\), got float64"),
    case("grad_out non-contiguous", GNB, (z((2, 3, 8))[:, :, ::2], X_G, MEAN, RSTD, 2), {}, ValueError,
         r"grad_out: expected a C-contiguous array"),
    case("mean shape", GNB, (DY_G, X_G, z((2, 4)), RSTD, 2), {}, ValueError,
         r"mean: expected shape \(2, 2\) \(N, num_groups\), got \(2, 4\)"),
    case("rstd shape", GNB, (DY_G, X_G, MEAN, z((2, 4)), 2), {}, ValueError,
         r"rstd: expected shape \(2, 2\) \(N, num_groups\), got \(2, 4\)"),
    case("mean rank", GNB, (DY_G, X_G, z((2,)), RSTD, 2), {}, ValueError,
         r"mean: expected a 2-D array \(N, num_groups\), got shape \(2,\)"),
    case("rstd not an array", GNB, (DY_G, X_G, MEAN, 1.0, 2), {}, TypeError, r"rstd: expected a numpy.ndarray, got float"),
] + [
    case(f"stats {numpy.dtype(s)} for x {numpy.dtype(d)}", GNB, _bwd(d)[:2] + (z((2, 2), s), _bwd(d)[3], 2), {}, TypeError,
         rf"mean: expected dtype {want} \(the statistics dtype for x of dtype {numpy.dtype(d)}\), got {numpy.dtype(s)}")
    for d, s, want in [(F16, F16, "float32"), (BFLOAT16, F64, "float32"), (F32, F64, "float32"), (F64, F32, "float64")]
] + [
    case("backward groups", GNB, (DY_G, X_G, MEAN, RSTD, 3), {}, ValueError, r"num_groups: expected a divisor of C = 4"),
    case("backward weight dtype", GNB, (DY_G, X_G, MEAN, RSTD, 2, z(4, F64)), {}, TypeError,
         r"weight: expected dtype float32 \(for x of dtype float32\), got float64"),
    case("backward activation", GNB, (DY_G, X_G, MEAN, RSTD, 2), {"activation": "swish"}, ValueError,
         r"activation: expected one of .*got 'swish'"),
]

CASES = DEPTHWISE + GROUP_NORM


def _raised(call):
    with pytest.raises(Exception) as info:
        call()
    return info.value


@pytest.mark.parametrize("device", ["auto", "cpu", "gpu"])
@pytest.mark.parametrize("op, args, kwargs, error, pattern", CASES)
def test_reference_and_host_raise_the_same(op, args, kwargs, error, pattern, device, monkeypatch):
    # Whatever CUPY_DWGN_DEVICE says (even gpu without one), bad input is
    # reported as bad input, before any path is chosen.
    monkeypatch.setenv("CUPY_DWGN_DEVICE", device)
    from_reference = _raised(lambda: getattr(reference, op)(*args, **kwargs))
    from_host = _raised(lambda: getattr(host, op)(*args, **kwargs))
    for raised in (from_reference, from_host):
        assert type(raised) is error, repr(raised)
        assert re.match(pattern, str(raised)), str(raised)
    assert str(from_host) == str(from_reference)


def _as_cupy(value):
    """A CuPy array with the NumPy array's shape, dtype and strides (any other value as is)."""
    import cupy

    if not isinstance(value, numpy.ndarray):
        return value
    if value.flags.c_contiguous:
        return cupy.asarray(value)
    span = sum((n - 1) * s for n, s in zip(value.shape, value.strides)) + value.itemsize
    buffer = cupy.zeros(span // value.itemsize, value.dtype)
    return cupy.lib.stride_tricks.as_strided(buffer, value.shape, value.strides)


def _gpu_message(message):
    """The host/reference message as the GPU op words it: its own array kind."""
    return message.replace(
        "a numpy.ndarray", "a cupy.ndarray or a CUDA array with __dlpack__ (torch tensor, JAX array)"
    ).replace("numpy.ascontiguousarray", "cupy.ascontiguousarray")


@pytest.mark.gpu
@pytest.mark.parametrize("op, args, kwargs, error, pattern", CASES)
def test_gpu_op_raises_the_same(op, args, kwargs, error, pattern):
    from_reference = _raised(lambda: getattr(reference, op)(*args, **kwargs))
    gpu_kwargs = {name: _as_cupy(value) for name, value in kwargs.items()}
    from_gpu = _raised(lambda: getattr(cupy_dwgn, op)(*map(_as_cupy, args), **gpu_kwargs))
    assert type(from_gpu) is error, repr(from_gpu)
    assert str(from_gpu) == _gpu_message(str(from_reference))
