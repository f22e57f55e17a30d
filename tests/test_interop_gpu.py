"""Fit with the caller's stack on the GPU: DLPack arrays in and the caller's
type out (torch, channels_last included), stream ordering against a busy
non-default torch stream, ``stream=``, the signature cache, ``out=`` on every
output with no allocation, and CUDA-graph capture and replay."""

import numpy
import pytest

from cupy_dwgn import reference

from _helpers import TOLERANCE, poisoned, random, relative_error

cupy = pytest.importorskip("cupy")
import cupy_dwgn  # noqa: E402

pytestmark = pytest.mark.gpu

F32 = numpy.dtype(numpy.float32)


def _torch():
    return pytest.importorskip("torch")


class _AllocationCounter(cupy.cuda.MemoryHook):
    """Counts device allocations made through CuPy's memory pool."""

    name = "AllocationCounter"

    def __init__(self):
        self.count = 0

    def malloc_preprocess(self, **kwargs):
        self.count += 1


# ---------------------------------------------------------------- torch tensors


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_depthwise_takes_and_returns_torch_tensors(rng, channels_last):
    torch = _torch()
    x_host = random(rng, (2, 6, 11, 13), F32)
    w_host = random(rng, (12, 1, 3, 3), F32)
    b_host = random(rng, (12,), F32)
    x = torch.from_numpy(x_host).cuda()
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    w, b = torch.from_numpy(w_host).cuda(), torch.from_numpy(b_host).cuda()
    y = cupy_dwgn.depthwise_conv2d(x, w, b, stride=2, padding=1)
    assert isinstance(y, torch.Tensor) and y.device == x.device
    # A channels_last input runs the NHWC kernels and gives channels_last.
    assert y.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    ref = reference.depthwise_conv2d(x_host, w_host, b_host, stride=2, padding=1)
    assert relative_error(cupy.from_dlpack(y.contiguous()), ref) <= TOLERANCE[F32]

    dy_host = random(rng, ref.shape, F32)
    dy = torch.from_numpy(dy_host).cuda()
    if channels_last:
        dy = dy.contiguous(memory_format=torch.channels_last)
    dx = cupy_dwgn.depthwise_conv2d_backward_input(dy, w, tuple(x.shape), stride=2, padding=1)
    dw = cupy_dwgn.depthwise_conv2d_backward_weight(dy, x, tuple(w.shape), stride=2, padding=1)
    assert isinstance(dx, torch.Tensor) and isinstance(dw, torch.Tensor)
    assert dx.shape == x.shape and dw.shape == w.shape
    ref_dx = reference.depthwise_conv2d_backward_input(dy_host, w_host, x_host.shape, stride=2, padding=1)
    ref_dw = reference.depthwise_conv2d_backward_weight(dy_host, x_host, w_host.shape, stride=2, padding=1)
    assert relative_error(cupy.from_dlpack(dx.contiguous()), ref_dx) <= TOLERANCE[F32]
    assert relative_error(cupy.from_dlpack(dw.contiguous()), ref_dw) <= TOLERANCE[F32]


def test_torch_out_is_written_in_place_and_returned(rng):
    torch = _torch()
    x_host, w_host = random(rng, (2, 4, 9, 9), F32), random(rng, (4, 1, 3, 3), F32)
    x, w = torch.from_numpy(x_host).cuda(), torch.from_numpy(w_host).cuda()
    out = torch.full((2, 4, 9, 9), float("nan"), device="cuda")
    y = cupy_dwgn.depthwise_conv2d(x, w, padding=1, out=out)
    assert y is out
    ref = reference.depthwise_conv2d(x_host, w_host, padding=1)
    assert relative_error(cupy.from_dlpack(out), ref) <= TOLERANCE[F32]


def test_mixed_memory_formats_are_refused_by_name(rng):
    torch = _torch()
    x = torch.randn(2, 4, 9, 9, device="cuda").contiguous(memory_format=torch.channels_last)
    dy = torch.randn(2, 4, 9, 9, device="cuda")  # contiguous NCHW
    with pytest.raises(ValueError, match="^x: expected channels-last memory"):
        cupy_dwgn.depthwise_conv2d_backward_weight(x, dy, (4, 1, 3, 3), padding=1)


def _channels_last_view(host):
    """A device copy of an NCHW host array stored channels-last, seen as NCHW (a channels_last tensor's view)."""
    return cupy.asarray(numpy.ascontiguousarray(host.transpose(0, 2, 3, 1))).transpose(0, 3, 1, 2)


def test_arrays_both_contiguous_and_channels_last_follow_the_call(rng):
    # 1x1 planes or one channel make an array C-contiguous and channels-last at once.  Beside a channels-last
    # array of the same call it must run the NHWC kernels, not refuse the other array as non-contiguous
    # (scripts/fuzz_gpu.py found the weight gradient of a stride-2 layer with 1x1 outputs doing that).
    x_host, dy_host = random(rng, (2, 83, 2, 2), F32), random(rng, (2, 83, 1, 1), F32)
    x, dy = _channels_last_view(x_host), cupy.asarray(dy_host)
    assert not x.flags.c_contiguous and dy.flags.c_contiguous and dy.transpose(0, 2, 3, 1).flags.c_contiguous
    dw = cupy_dwgn.depthwise_conv2d_backward_weight(dy, x, (83, 1, 3, 3), stride=2, padding=1)
    ref_dw = reference.depthwise_conv2d_backward_weight(dy_host, x_host, (83, 1, 3, 3), stride=2, padding=1)
    assert relative_error(dw, ref_dw) <= TOLERANCE[F32]

    w_host = random(rng, (83, 1, 3, 3), F32)
    dx = _channels_last_view(numpy.full((2, 83, 2, 2), numpy.nan, F32))
    got = cupy_dwgn.depthwise_conv2d_backward_input(dy, cupy.asarray(w_host), (2, 83, 2, 2), stride=2, padding=1,
                                                    out=dx)
    assert got is dx
    ref_dx = reference.depthwise_conv2d_backward_input(dy_host, w_host, (2, 83, 2, 2), stride=2, padding=1)
    assert relative_error(dx, ref_dx) <= TOLERANCE[F32]

    # one input channel, depth multiplier 3, into a channels-last out
    x1_host, w3_host, b3_host = random(rng, (2, 1, 7, 9), F32), random(rng, (3, 1, 3, 3), F32), random(rng, 3, F32)
    y = _channels_last_view(numpy.full((2, 3, 7, 9), numpy.nan, F32))
    got = cupy_dwgn.depthwise_conv2d(cupy.asarray(x1_host), cupy.asarray(w3_host), cupy.asarray(b3_host), padding=1,
                                     out=y)
    assert got is y
    assert relative_error(y, reference.depthwise_conv2d(x1_host, w3_host, b3_host, padding=1)) <= TOLERANCE[F32]


def test_group_norm_takes_and_returns_torch_tensors(rng):
    torch = _torch()
    x_host = random(rng, (2, 5, 7, 32), F32)
    w_host, b_host = random(rng, (32,), F32), random(rng, (32,), F32)
    x = torch.from_numpy(x_host).cuda()
    w, b = torch.from_numpy(w_host).cuda(), torch.from_numpy(b_host).cuda()
    y, mean, rstd = cupy_dwgn.group_norm(x, 8, w, b, activation="silu", return_stats=True)
    assert all(isinstance(t, torch.Tensor) for t in (y, mean, rstd))
    ref_y = reference.group_norm(x_host, 8, w_host, b_host, activation="silu")
    assert relative_error(cupy.from_dlpack(y), ref_y) <= TOLERANCE[F32]
    dy_host = random(rng, x_host.shape, F32)
    dx, dw, db = cupy_dwgn.group_norm_backward(
        torch.from_numpy(dy_host).cuda(), x, mean, rstd, 8, w, b, activation="silu"
    )
    ref_dx, ref_dw, ref_db = reference.group_norm_backward(
        dy_host, x_host, mean.cpu().numpy(), rstd.cpu().numpy(), 8, w_host, b_host, activation="silu"
    )
    for got, ref in ((dx, ref_dx), (dw, ref_dw), (db, ref_db)):
        assert isinstance(got, torch.Tensor)
        assert relative_error(cupy.from_dlpack(got), ref) <= TOLERANCE[F32]


def test_no_race_with_a_busy_nondefault_torch_stream(rng):
    """x is produced by a long matmul chain on a non-default torch stream and
    consumed at once by our op (on CuPy's stream): the DLPack exchange must
    order the two, every time."""
    torch = _torch()
    side = torch.cuda.Stream()
    w = torch.from_numpy(random(rng, (64, 1, 3, 3), F32)).cuda()
    a = torch.randn(2048, 2048, device="cuda") / 48
    torch.cuda.synchronize()
    for repeat in range(20):
        with torch.cuda.stream(side):
            m = a
            for _ in range(4):
                m = m @ a  # keeps the side stream busy for a while
            x = (m[:1024, :1024].reshape(4, 64, 64, 64) + repeat).contiguous()
            y = cupy_dwgn.depthwise_conv2d(x, w, padding=1)
            expected = torch.nn.functional.conv2d(x, w, padding=1, groups=64)
            error = ((y - expected).norm() / expected.norm()).item()
        assert error <= TOLERANCE[F32], (repeat, error)


# ---------------------------------------------------------------- streams


def test_stream_argument_launches_there(rng):
    x_host, w_host = random(rng, (2, 8, 20, 20), F32), random(rng, (8, 1, 5, 5), F32)
    x, w = cupy.asarray(x_host), cupy.asarray(w_host)
    stream = cupy.cuda.Stream(non_blocking=True)
    y = cupy_dwgn.depthwise_conv2d(x, w, padding=2, stream=stream)
    stream.synchronize()
    assert relative_error(y, reference.depthwise_conv2d(x_host, w_host, padding=2)) <= TOLERANCE[F32]
    xg = cupy.asarray(random(rng, (2, 6, 6, 16), F32))
    y, mean, rstd = cupy_dwgn.group_norm(xg, 4, return_stats=True, stream=stream)
    stream.synchronize()
    ref_y = reference.group_norm(xg.get(), 4)
    assert relative_error(y, ref_y) <= TOLERANCE[F32]


# CuPy 14 deprecates cupy.cuda.ExternalStream; the user must not see that
# warning from our stream wrapping (_interop.external_stream).
@pytest.mark.filterwarnings("error::DeprecationWarning")
def test_raw_stream_address_as_stream_argument(rng):
    x_host, w_host = random(rng, (2, 8, 20, 20), F32), random(rng, (8, 1, 3, 3), F32)
    x, w = cupy.asarray(x_host), cupy.asarray(w_host)
    side = cupy.cuda.Stream(non_blocking=True)
    y = poisoned((2, 8, 20, 20), F32)
    cupy.cuda.Device().synchronize()  # the inputs and the poison are written before `side` runs
    cupy_dwgn.depthwise_conv2d(x, w, padding=1, stream=side.ptr, out=y)
    side.synchronize()
    assert relative_error(y, reference.depthwise_conv2d(x_host, w_host, padding=1)) <= TOLERANCE[F32]


@pytest.mark.filterwarnings("error::DeprecationWarning")
def test_torch_stream_object_as_stream_argument(rng):
    torch = _torch()
    x_host, w_host = random(rng, (2, 8, 20, 20), F32), random(rng, (8, 1, 3, 3), F32)
    x, w = cupy.asarray(x_host), cupy.asarray(w_host)
    side = torch.cuda.Stream()
    y = cupy_dwgn.depthwise_conv2d(x, w, padding=1, stream=side)
    side.synchronize()
    assert relative_error(y, reference.depthwise_conv2d(x_host, w_host, padding=1)) <= TOLERANCE[F32]


def test_stream_of_the_wrong_kind_is_refused():
    x = cupy.zeros((1, 2, 4, 4), cupy.float32)
    w = cupy.zeros((2, 1, 3, 3), cupy.float32)
    with pytest.raises(TypeError, match="^stream: expected"):
        cupy_dwgn.depthwise_conv2d(x, w, stream="default")


# ---------------------------------------------------------------- signature cache


def test_repeated_signature_reads_the_new_arrays(rng):
    """The second call of a signature takes the cached path: it must use its
    own arrays and still refuse an overlapping out."""
    w_host = random(rng, (8, 1, 3, 3), F32)
    w = cupy.asarray(w_host)
    for _ in range(3):
        x_host = random(rng, (2, 8, 12, 12), F32)
        y = cupy_dwgn.depthwise_conv2d(cupy.asarray(x_host), w, padding=1)
        assert relative_error(y, reference.depthwise_conv2d(x_host, w_host, padding=1)) <= TOLERANCE[F32]
    x = cupy.asarray(random(rng, (2, 8, 12, 12), F32))
    with pytest.raises(ValueError, match="^out: expected memory separate from x"):
        cupy_dwgn.depthwise_conv2d(x, w, padding=1, out=x)
    with pytest.raises(TypeError, match="^stride"):
        cupy_dwgn.depthwise_conv2d(x, w, padding=1, stride=True)  # True == 1 must not hit the cache
    with pytest.raises(ValueError, match="C-contiguous"):
        cupy_dwgn.depthwise_conv2d(cupy.asarray(random(rng, (2, 8, 12, 24), F32))[..., ::2], w, padding=1)


# ---------------------------------------------------------------- out= and CUDA graphs


def _problem(rng, dtype=F32):
    """Host inputs for one forward + backward of both ops."""
    return {
        "x": random(rng, (2, 16, 12, 12), dtype),
        "w": random(rng, (16, 1, 3, 3), dtype),
        "b": random(rng, (16,), dtype),
        "dy": random(rng, (2, 16, 12, 12), dtype),
        "gx": random(rng, (2, 6, 6, 64), dtype),
        "gw": random(rng, (64,), dtype),
        "gb": random(rng, (64,), dtype),
        "gdy": random(rng, (2, 6, 6, 64), dtype),
    }


def _references(p):
    y, mean, rstd = reference.group_norm(p["gx"], 8, p["gw"], p["gb"], activation="silu", return_stats=True)
    # The backward from the float64 statistics rounded to the op's float32 ones
    # (~1e-7 relative from the float64 ones: far inside the float32 bound).
    gdx, gdw, gdb = reference.group_norm_backward(
        p["gdy"], p["gx"], mean.astype(F32), rstd.astype(F32), 8, p["gw"], p["gb"], activation="silu"
    )
    return {
        "y": reference.depthwise_conv2d(p["x"], p["w"], p["b"], padding=1),
        "dx": reference.depthwise_conv2d_backward_input(p["dy"], p["w"], p["x"].shape, padding=1),
        "dw": reference.depthwise_conv2d_backward_weight(p["dy"], p["x"], p["w"].shape, padding=1),
        "gy": y, "mean": mean, "rstd": rstd, "gdx": gdx, "gdw": gdw, "gdb": gdb,
    }


def _all_ops(inputs, outputs):
    """Forward and backward of both ops, every output given."""
    i, o = inputs, outputs
    cupy_dwgn.depthwise_conv2d(i["x"], i["w"], i["b"], padding=1, out=o["y"])
    cupy_dwgn.depthwise_conv2d_backward_input(i["dy"], i["w"], i["x"].shape, padding=1, out=o["dx"])
    cupy_dwgn.depthwise_conv2d_backward_weight(i["dy"], i["x"], i["w"].shape, padding=1, out=o["dw"])
    cupy_dwgn.group_norm(
        i["gx"], 8, i["gw"], i["gb"], activation="silu", out=o["gy"], mean_out=o["mean"], rstd_out=o["rstd"]
    )
    cupy_dwgn.group_norm_backward(
        i["gdy"], i["gx"], o["mean"], o["rstd"], 8, i["gw"], i["gb"], activation="silu",
        out=o["gdx"], grad_weight_out=o["gdw"], grad_bias_out=o["gdb"],
    )


def _outputs(references):
    return {k: poisoned(v.shape, F32) for k, v in references.items()}


def _check(outputs, references):
    for name, ref in references.items():
        assert relative_error(outputs[name], ref) <= TOLERANCE[F32], name


def test_every_output_given_allocates_nothing(rng):
    p = _problem(rng)
    refs = _references(p)
    inputs = {k: cupy.asarray(v) for k, v in p.items()}
    outputs = _outputs(refs)
    _all_ops(inputs, outputs)  # compiles, sizes the workspace
    counter = _AllocationCounter()
    with counter:
        for _ in range(3):
            _all_ops(inputs, outputs)
    cupy.cuda.Device().synchronize()
    assert counter.count == 0
    _check(outputs, refs)


def _replay(graph, stream, inputs, outputs, data):
    """New data into the captured input buffers, poisoned outputs, one replay
    on ``stream``, waited for."""
    for name, value in data.items():
        inputs[name].set(value, stream=stream)
    for array in outputs.values():
        array.fill(numpy.nan)
    graph.launch(stream)
    stream.synchronize()


@pytest.mark.parametrize("mode", ["relaxed", "global"])
def test_cuda_graph_capture_on_a_stream_no_call_ran_on(rng, mode):
    """Warm-up on one stream, capture on another (as torch.cuda.graph does: its
    capture stream is its own, and its capture mode global, where cudaMalloc is
    refused): the capturing stream's workspace is made during the capture,
    outside the graph; replays on new data and eager calls on that stream
    afterwards (which need its header zeroed for real, not in the graph) are
    right."""
    capture_mode = {"relaxed": cupy.cuda.runtime.streamCaptureModeRelaxed,
                    "global": cupy.cuda.runtime.streamCaptureModeGlobal}[mode]
    first, second, third = _problem(rng), _problem(rng), _problem(rng)
    refs_second, refs_third = _references(second), _references(third)
    warm_up = cupy.cuda.Stream(non_blocking=True)
    with warm_up:
        inputs = {k: cupy.asarray(v) for k, v in first.items()}
        outputs = _outputs(refs_second)
        _all_ops(inputs, outputs)  # compiles; sizes warm_up's workspace only
        warm_up.synchronize()
    capturing = cupy.cuda.Stream(non_blocking=True)
    with capturing:
        capturing.begin_capture(capture_mode)
        _all_ops(inputs, outputs)
        graph = capturing.end_capture()
        for data, refs in ((second, refs_second), (third, refs_third)):
            _replay(graph, capturing, inputs, outputs, data)
            _check(outputs, refs)
        # Eager calls on the capturing stream use the workspace made in the capture.
        for array in outputs.values():
            array.fill(numpy.nan)
        _all_ops(inputs, outputs)
        capturing.synchronize()
    _check(outputs, refs_third)


def test_cuda_graph_capture_and_replay_on_new_data(rng):
    first, second = _problem(rng), _problem(rng)
    refs_second = _references(second)
    cupy_dwgn.precompile(
        dtypes=[F32], filter_sizes=[(3, 3)], activations=["silu"], layouts=["NCHW"], progress=False
    )
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        inputs = {k: cupy.asarray(v) for k, v in first.items()}
        outputs = _outputs(refs_second)
        _all_ops(inputs, outputs)  # warm-up on the capturing stream: workspace sized there
        stream.synchronize()
        stream.begin_capture()
        _all_ops(inputs, outputs)
        graph = stream.end_capture()
        _replay(graph, stream, inputs, outputs, second)
    _check(outputs, refs_second)
