"""Bad input raises TypeError/ValueError naming the argument, the expected and
the actual value, before any launch.  The NumPy host wrappers run the very
same checks, so these run on the CPU; the CuPy-only messages run on the GPU."""

import numpy
import pytest

import cupy_dwgn.host as host
from cupy_dwgn import depthwise

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
    ("output size <= 0", dict(weight=numpy.zeros((3, 1, 11, 3), numpy.float32)), ValueError, r"x: the output size would be 0x8: the padded input \(10x10\) must be at least as large as the dilated filter \(11x3\)"),
    ("bias shape", dict(bias=numpy.zeros(4, numpy.float32)), ValueError, r"bias: expected shape \(3,\) \(C\*M,\), got \(4,\)"),
    ("bias dtype", dict(bias=numpy.zeros(3, numpy.float16)), TypeError, r"bias: expected dtype float32 \(the dtype of x\), got float16"),
    ("layout NHWC", dict(layout="NHWC"), ValueError, r"layout: expected 'NCHW', got 'NHWC'"),
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
    ("grad_out shape (weight)", lambda: host.depthwise_conv2d_backward_weight(DY, X, (3, 1, 5, 5), padding=1), ValueError, r"grad_out: expected shape \(2, 3, 6, 6\) \(the forward output shape\), got \(2, 3, 8, 8\)"),
    ("x dtype (weight)", lambda: host.depthwise_conv2d_backward_weight(DY, X.astype(numpy.float64), W.shape, padding=1), TypeError, r"x: expected dtype float32 \(the dtype of grad_out\), got float64"),
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


# --- CuPy-only messages -------------------------------------------------------


@pytest.mark.gpu
def test_gpu_op_rejects_numpy_input_with_a_hint():
    import cupy

    import cupy_dwgn

    with pytest.raises(TypeError, match=r"x: expected a cupy.ndarray, got numpy.ndarray \(for NumPy arrays use cupy_dwgn.host\)"):
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
    with pytest.raises(ValueError, match=r"weight: expected an array on device 0 \(the device of x\), got device 1"):
        cupy_dwgn.depthwise_conv2d(x, w, padding=1)


def test_stride_one_specialized_sizes_take_the_tiled_kernel():
    from cupy_dwgn import _validate

    def tiled(w_shape, stride=1, dilation=1, dtype=numpy.float32):
        g = _validate.conv_geometry((1, 2, 64, 64), w_shape, stride, 0 if stride != 1 else "same", dilation)
        return depthwise._use_tiled(g, numpy.dtype(dtype))

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
