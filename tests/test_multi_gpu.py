"""Several GPUs (issue 8, item 6): arrays on any GPU run there, and a
DistributedDataParallel run of examples/ddp_train.py matches one GPU.

(a) In one process, every op runs on arrays of device 0 and of device 1,
    interleaved, each call made while the OTHER device is current: the kernels
    must be loaded (and their launch plans cached) per device, the launch must
    go to the arrays' device, and the results must live there.  Each result is
    compared with the float64 NumPy reference (tests/_helpers.py bounds), outputs
    NaN-poisoned before the call.
    The same for the PyTorch bridge: cupy_dwgn.torch forward + backward on cuda:1 and cuda:0
    tensors with torch's current device the other one, against torch's layers in float64.
(b) examples/ddp_train.py: 2 processes under DDP (NCCL, cuda:0 and cuda:1)
    against one process on cuda:0 with the same global batch and seed, float32
    with TF32 off.  GroupNorm normalizes per sample and DDP averages the
    gradients of equal slices, so both runs take the same steps up to float32
    rounding (reduction order in the weight gradients, the all-reduce): on the
    CPU (gloo) the curves agree to 2e-7 per step.  The bound, ddp_train.LOSS_RTOL
    = 1e-3 relative per step, leaves 3+ orders of margin for that and for
    nondeterministic (atomic) reductions, yet stays under what a real fault
    does (measured on the CPU over these 20 steps: gradients summed instead of
    averaged, max 0.25; both ranks on the same half of the batch, max 1.1e-2,
    4e-3 already at step 0).

Skipped, with the reason, unless CuPy sees at least 2 GPUs (the torch tests also need torch).
"""

import pathlib
import sys

import numpy
import pytest

from cupy_dwgn import reference

from _helpers import TOLERANCE, poisoned, random, record_errors, relative_error
from conftest import GPU_COUNT

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPU_COUNT < 2, reason=f"needs 2 GPUs in one process; CuPy sees {GPU_COUNT}"),
]

F16 = numpy.dtype(numpy.float16)
F32 = numpy.dtype(numpy.float32)
EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"

#: (N, C, H, W, KH, KW, depth multiplier, stride, padding, dilation): odd sizes, a non-square filter,
#: a stride-2 case and a depth multiplier.
DEPTHWISE_CASES = [
    (2, 24, 17, 13, 3, 3, 1, 1, 1, 1),
    (3, 10, 15, 19, 5, 3, 2, 2, (2, 1), 1),
]


def _on(device_id, fn):
    """``fn()`` with device ``device_id`` current."""
    import cupy

    with cupy.cuda.Device(device_id):
        return fn()


def _device_of(array):
    return array.device.id


def _depthwise_inputs(case, dtype, layout, rng):
    n, c, h, w, kh, kw, m, stride, padding, dilation = case
    x = random(rng, (n, c, h, w), dtype)
    weight = random(rng, (c * m, 1, kh, kw), dtype)
    bias = random(rng, (c * m,), dtype)
    conv = dict(stride=stride, padding=padding, dilation=dilation, layout=layout)
    if layout == "NHWC":
        x = numpy.ascontiguousarray(x.transpose(0, 2, 3, 1))
    y_ref = reference.depthwise_conv2d(x, weight, bias, **conv)
    dy = random(rng, y_ref.shape, dtype)
    return x, weight, bias, dy, conv, y_ref


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
def test_depthwise_runs_on_the_arrays_device(dtype, layout, rng):
    """Forward and both backwards on device 0 and 1 alternately, the other device current."""
    import cupy

    import cupy_dwgn

    # Two rounds x two devices, in the order 1, 0, 0, 1: each device's first call
    # comes while the other device already holds the kernels (and then the reverse).
    for device in (1, 0, 0, 1):
        other = 1 - device
        for case in DEPTHWISE_CASES:
            x, weight, bias, dy, conv, y_ref = _depthwise_inputs(case, dtype, layout, rng)
            dx_ref = reference.depthwise_conv2d_backward_input(dy, weight, x.shape, **conv)
            dw_ref = reference.depthwise_conv2d_backward_weight(dy, x, weight.shape, **conv)
            x_d, w_d, b_d, dy_d = (_on(device, lambda a=a: cupy.asarray(a)) for a in (x, weight, bias, dy))
            y_out, dx_out, dw_out = (_on(device, lambda s=s: poisoned(s, dtype))
                                     for s in (y_ref.shape, x.shape, weight.shape))
            with cupy.cuda.Device(other):
                y = cupy_dwgn.depthwise_conv2d(x_d, w_d, b_d, out=y_out, **conv)
                dx = cupy_dwgn.depthwise_conv2d_backward_input(dy_d, w_d, x.shape, out=dx_out, **conv)
                dw = cupy_dwgn.depthwise_conv2d_backward_weight(dy_d, x_d, weight.shape, out=dw_out, **conv)
                assert cupy.cuda.Device().id == other, "the call changed the current device"
            for name, got in (("y", y), ("dx", dx), ("dw", dw)):
                assert _device_of(got) == device, f"{name} on device {_device_of(got)}, inputs on {device}"
            _on(device, lambda: cupy.cuda.Device().synchronize())
            errors = {
                "y": relative_error(y, y_ref),
                "dx": relative_error(dx, dx_ref),
                "dw": relative_error(dw, dw_ref),
            }
            record_errors(f"multi-GPU depthwise {dtype} {layout}", f"device {device}", errors)
            for name, error in errors.items():
                assert error <= TOLERANCE[dtype], f"{name} on device {device}: {error:.2e} > {TOLERANCE[dtype]:g}"


@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
def test_group_norm_runs_on_the_arrays_device(dtype, rng):
    """GroupNorm+SiLU forward (with statistics) and backward on device 0 and 1
    alternately, the other device current, every output given (poisoned)."""
    import cupy

    import cupy_dwgn

    n, h, w, c, groups = 2, 9, 11, 96, 32
    affine = F32  # float32 weight/bias for float16 x (mixed precision), float32 for float32
    stats = numpy.dtype(numpy.float32)
    for device in (1, 0, 0, 1):
        other = 1 - device
        x = random(rng, (n, h, w, c), dtype, offset=3.0)
        dy = random(rng, x.shape, dtype)
        weight = (1.0 + 0.1 * rng.standard_normal(c)).astype(affine)
        bias = (0.1 * rng.standard_normal(c)).astype(affine)
        ref_y, ref_mean, ref_rstd = reference.group_norm(x, groups, weight, bias, activation="silu", return_stats=True)
        ref_dx, ref_dw, ref_db = reference.group_norm_backward(
            dy, x, ref_mean.astype(stats), ref_rstd.astype(stats), groups, weight, bias, activation="silu"
        )
        x_d, dy_d, w_d, b_d = (_on(device, lambda a=a: cupy.asarray(a)) for a in (x, dy, weight, bias))
        y_out, dx_out = (_on(device, lambda: poisoned(x.shape, dtype)) for _ in range(2))
        mean_out, rstd_out = (_on(device, lambda: poisoned((n, groups), stats)) for _ in range(2))
        dw_out, db_out = (_on(device, lambda: poisoned((c,), affine)) for _ in range(2))
        with cupy.cuda.Device(other):
            y, mean, rstd = cupy_dwgn.group_norm(x_d, groups, w_d, b_d, activation="silu", out=y_out,
                                                 mean_out=mean_out, rstd_out=rstd_out, return_stats=True)
            dx, dw, db = cupy_dwgn.group_norm_backward(dy_d, x_d, mean, rstd, groups, w_d, b_d, activation="silu",
                                                       out=dx_out, grad_weight_out=dw_out, grad_bias_out=db_out)
            assert cupy.cuda.Device().id == other, "the call changed the current device"
        results = {"y": (y, ref_y), "mean": (mean, ref_mean), "rstd": (rstd, ref_rstd),
                   "dx": (dx, ref_dx), "dweight": (dw, ref_dw), "dbias": (db, ref_db)}
        for name, (got, _) in results.items():
            assert _device_of(got) == device, f"{name} on device {_device_of(got)}, inputs on {device}"
        assert y is y_out and dx is dx_out
        _on(device, lambda: cupy.cuda.Device().synchronize())
        errors = {name: relative_error(got, ref) for name, (got, ref) in results.items()}
        record_errors(f"multi-GPU group_norm {dtype}", f"device {device}", errors)
        for name, error in errors.items():
            assert error <= TOLERANCE[dtype], f"{name} on device {device}: {error:.2e} > {TOLERANCE[dtype]:g}"


@pytest.mark.parametrize("memory_format", ["channels_last", "contiguous_format"])
def test_torch_bridge_runs_on_the_tensors_device(memory_format):
    """cupy_dwgn.torch on cuda:1 and cuda:0 tensors (forward + backward through a depthwise
    conv and a GroupNorm+SiLU), torch's current device the other one; compared with
    torch's own layers in float64 on the same device."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs visible to PyTorch; it sees {torch.cuda.device_count()}")
    import cupy_dwgn.torch as dwt

    fmt = getattr(torch, memory_format)
    for device in (1, 0, 0, 1):
        dev = torch.device("cuda", device)
        gen = torch.Generator(device=dev).manual_seed(10 + device)
        x = torch.randn(2, 64, 15, 17, device=dev, generator=gen).contiguous(memory_format=fmt)
        w = torch.randn(64, 1, 3, 3, device=dev, generator=gen)
        b = torch.randn(64, device=dev, generator=gen)
        gw = 1 + 0.1 * torch.randn(64, device=dev, generator=gen)
        gb = 0.1 * torch.randn(64, device=dev, generator=gen)
        dy = torch.randn(2, 64, 15, 17, device=dev, generator=gen)
        leaves = [t.requires_grad_() for t in (x, w, b, gw, gb)]
        with torch.cuda.device(1 - device):
            y = dwt.group_norm(dwt.depthwise_conv2d(x, w, b, padding=1), 32, gw, gb, activation="silu")
            grads = torch.autograd.grad(y, leaves, dy)
            assert torch.cuda.current_device() == 1 - device
        assert y.device == dev and all(g.device == dev for g in grads)
        ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
        rx, rw, rb, rgw, rgb = ref_leaves
        ref_y = torch.nn.functional.silu(torch.nn.functional.group_norm(
            torch.nn.functional.conv2d(rx, rw, rb, padding=1, groups=64), 32, rgw, rgb))
        ref_grads = torch.autograd.grad(ref_y, ref_leaves, dy.double())
        errors = {"y": ((y.double() - ref_y).norm() / ref_y.norm()).item()}
        for name, got, ref in zip(("dx", "dw", "db", "dgamma", "dbeta"), grads, ref_grads):
            errors[name] = ((got.double() - ref).norm() / ref.norm()).item()
        record_errors(f"multi-GPU torch bridge {memory_format}", f"device {device}", errors)
        for name, error in errors.items():
            assert error <= TOLERANCE[F32], f"{name} on cuda:{device}: {error:.2e}"


@pytest.fixture
def ddp_train(monkeypatch):
    """examples/ddp_train.py as a module; examples/ stays on sys.path while the test runs,
    so the processes torch.multiprocessing.spawn starts can import it too."""
    pytest.importorskip("torch", reason="PyTorch is not installed (the DDP example needs it)")
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs visible to PyTorch; it sees {torch.cuda.device_count()}")
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import importlib

    module = importlib.import_module("ddp_train")
    yield module
    sys.modules.pop("ddp_train", None)


def test_ddp_on_two_gpus_matches_one_gpu(ddp_train):
    steps, batch = 20, 32
    ddp = ddp_train.train_ddp(2, steps, batch)
    single = ddp_train.train_single(steps, batch, "cuda:0")
    assert len(ddp) == len(single) == steps
    difference = ddp_train.max_relative_difference(ddp, single)
    record_errors("DDP 2 GPUs vs 1 GPU", "loss curve", {"max rel diff": difference})
    curves = "\n".join(f"{i:3d} {a:.6f} {b:.6f}" for i, (a, b) in enumerate(zip(ddp, single)))
    assert ddp_train.loss_fell(ddp), f"DDP loss did not fall:\n{curves}"
    assert ddp_train.loss_fell(single), f"single-GPU loss did not fall:\n{curves}"
    assert difference <= ddp_train.LOSS_RTOL, f"loss curves differ by {difference:.2e}:\n{curves}"
