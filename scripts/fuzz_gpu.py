"""Differential fuzzing of every GPU op against PyTorch in float64 on the GPU.

Draws random depthwise convolutions (every layout, dtype, filter size 1-31,
stride, dilation, padding form, depth multiplier, bias, misaligned views,
torch tensors through DLPack, channels-last torch tensors under
``layout="NCHW"``) and random GroupNorm calls (0-3 spatial dims, any group
size, every activation, affine forms, mixed-precision parameters), runs the
forward and backward ops into NaN-poisoned outputs (GroupNorm also in place,
both ops through the autograd functions of cupy_dwgn.torch, and through
cupy_dwgn.jax's custom_vjp functions under ``jax.vjp``, eager and under
``jax.jit``, where JAX is installed), and compares
each result with float64 on the GPU under PyTorch's autograd
(``conv2d(groups=C)``; GroupNorm's textbook formula) on the same
dtype-rounded inputs, at the tests' error-norm bounds (tests/_helpers.TOLERANCE).
PyTorch is the independent oracle here; the test suite's is cupy_dwgn.reference.

    PYTHONPATH=. python scripts/fuzz_gpu.py [--seconds 240] [--seed 0] [--ops depthwise group_norm]
        [--log fuzz.jsonl]

Prints progress, then one line per (op, dtype, layout) with the cases run and
the worst error as a fraction of its bound, and every failing case in full
(its arguments are enough to rerun it: ``--replay '<json>'``).  Exit status 1
when any case fails.  Fill the kernel cache first on a fresh machine
(scripts/warm_kernel_cache.py) or the first minutes go to compiling.
"""

import argparse
import collections
import importlib.util
import json
import os
import pathlib
import sys
import time

import numpy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from _helpers import BFLOAT16  # noqa: E402
from _helpers import TOLERANCE as _TOLERANCE  # noqa: E402

DTYPES = ("float32", "float16", "bfloat16", "float64")
#: The array kinds a call's arrays are drawn as (the JAX ones where JAX is installed), and their weights.
DEPTHWISE_ARRAYS = {"cupy": 0.40, "cupy_misaligned": 0.12, "torch": 0.08, "torch_channels_last": 0.12,
                    "torch_bridge": 0.12, "jax": 0.08, "jax_jit": 0.08}
GROUP_NORM_ARRAYS = {"cupy": 0.42, "cupy_misaligned": 0.12, "cupy_in_place": 0.08, "torch": 0.08,
                     "torch_bridge": 0.14, "jax": 0.08, "jax_jit": 0.08}
HAVE_JAX = importlib.util.find_spec("jax") is not None
#: ||ours - torch|| / ||torch|| bounds by dtype name: the GPU tests' own.
TOLERANCE = {str(dtype): bound for dtype, bound in _TOLERANCE.items()}
#: Sides that real models give depthwise layers and GroupNorm (plus primes and odd sizes drawn separately).
MODEL_SIDES = (7, 8, 14, 16, 19, 28, 32, 38, 56, 64, 75, 112)
FILTERS = (1, 2, 3, 3, 3, 4, 5, 5, 7, 7, 9, 11, 13, 15, 21, 31)
MAX_ELEMENTS = 6_000_000  # per tensor: keeps a case well under a second


def numpy_dtype(name):
    return BFLOAT16 if name == "bfloat16" else numpy.dtype(name)


def _side(r, low=1, high=130):
    return int(r.choice(MODEL_SIDES)) if r.random() < 0.4 else int(r.integers(low, high + 1))


def draw_depthwise(r):
    """One random valid depthwise call, as a JSON-able dict."""
    while True:
        kh = int(r.choice(FILTERS))
        kw = kh if r.random() < 0.85 else int(r.choice(FILTERS))
        stride = [1, 1] if r.random() < 0.6 else ([2, 2] if r.random() < 0.7 else [int(r.integers(1, 4)), int(r.integers(1, 4))])
        dilation = [1, 1] if r.random() < 0.85 else [int(r.integers(1, 4)), int(r.integers(1, 4))]
        form = r.choice(["half", "int", "pair", "four", "same", "valid"], p=[0.45, 0.15, 0.1, 0.15, 0.1, 0.05])
        reach = [dilation[0] * (kh - 1), dilation[1] * (kw - 1)]
        if form == "same" and stride != [1, 1]:
            form = "half"
        if form == "half":
            padding = [reach[0] // 2, reach[1] // 2]
        elif form == "int":
            padding = int(r.integers(0, max(reach) + 2))
        elif form == "pair":
            padding = [int(r.integers(0, reach[0] + 2)), int(r.integers(0, reach[1] + 2))]
        elif form == "four":
            padding = [[int(r.integers(0, reach[0] + 2)), int(r.integers(0, reach[0] + 2))],
                       [int(r.integers(0, reach[1] + 2)), int(r.integers(0, reach[1] + 2))]]
        else:
            padding = str(form)
        height = _side(r)
        width = height if r.random() < 0.7 else _side(r)
        channels = int(r.integers(1, 17)) if r.random() < 0.3 else int(r.choice([24, 32, 40, 48, 64, 96, 144, 192, 240, 288, 384, 480, 576, 960])) if r.random() < 0.5 else int(r.integers(1, 1200))
        multiplier = 1 if r.random() < 0.85 else int(r.integers(2, 4))
        batch = int(r.integers(1, 9))
        case = {
            "op": "depthwise", "dtype": str(r.choice(DTYPES, p=[0.35, 0.3, 0.25, 0.1])),
            "layout": str(r.choice(["NCHW", "NHWC"])), "x_shape": [batch, channels, height, width],
            "filter": [kh, kw], "multiplier": multiplier, "stride": stride, "padding": padding, "dilation": dilation,
            "bias": bool(r.random() < 0.6), "array": _array_kind(r, DEPTHWISE_ARRAYS),
            "seed": int(r.integers(2**31)),
        }
        out_hw = _output_size(case)
        elements = batch * channels * multiplier * max(height * width, out_hw[0] * out_hw[1])
        if min(out_hw) >= 1 and elements <= MAX_ELEMENTS:
            return case


def _array_kind(r, weights):
    """One of ``weights``' array kinds, drawn by weight (no JAX kind without JAX)."""
    kinds = [kind for kind in weights if HAVE_JAX or not kind.startswith("jax")]
    p = numpy.array([weights[kind] for kind in kinds])
    return str(r.choice(kinds, p=p / p.sum()))


def padding_argument(case):
    """The case's padding as the ops take it (JSON keeps pairs as lists)."""
    padding = case["padding"]
    if isinstance(padding, (str, int)):
        return padding
    return tuple(tuple(p) if isinstance(p, list) else p for p in padding)


def _pads(case):
    """((top, bottom), (left, right)) of a depthwise case, worked out here rather than taken from the library's
    own normalization (cupy_dwgn._validate), so the oracle's padding is independent of the code under test."""
    padding, (kh, kw), dil = case["padding"], case["filter"], case["dilation"]
    if padding == "valid":
        return (0, 0), (0, 0)
    if padding == "same":
        totals = (dil[0] * (kh - 1), dil[1] * (kw - 1))
        return tuple((t // 2, t - t // 2) for t in totals)
    if isinstance(padding, int):
        return (padding, padding), (padding, padding)
    if isinstance(padding[0], list):
        return tuple(tuple(p) for p in padding)
    return (padding[0], padding[0]), (padding[1], padding[1])


def _output_size(case):
    (top, bottom), (left, right) = _pads(case)
    _, _, height, width = case["x_shape"]
    (kh, kw), dil, stride = case["filter"], case["dilation"], case["stride"]
    return ((height + top + bottom - dil[0] * (kh - 1) - 1) // stride[0] + 1,
            (width + left + right - dil[1] * (kw - 1) - 1) // stride[1] + 1)


def draw_group_norm(r):
    """One random valid GroupNorm call, as a JSON-able dict."""
    while True:
        groups = int(r.choice([1, 2, 4, 8, 16, 32, 32, 32])) if r.random() < 0.8 else int(r.integers(1, 65))
        per_group = int(r.choice([1, 2, 4, 8, 10, 16, 20, 40, 80])) if r.random() < 0.6 else int(r.integers(1, 97))
        channels = groups * per_group
        rank = int(r.choice([0, 1, 2, 2, 2, 3]))
        spatial = [_side(r, 1, 130) if rank < 3 else int(r.integers(1, 24)) for _ in range(rank)]
        shape = [int(r.integers(1, 9))] + spatial + [channels]
        if r.random() < 0.1:
            shape = [2, 64, 64, 320] if r.random() < 0.5 else [int(r.integers(1, 5)), 32, 32, 640]
            channels, groups = shape[-1], 32
        if numpy.prod(shape) > MAX_ELEMENTS:
            continue
        dtype = str(r.choice(DTYPES, p=[0.35, 0.3, 0.25, 0.1]))
        return {
            "op": "group_norm", "dtype": dtype, "shape": [int(s) for s in shape], "num_groups": groups,
            "affine": str(r.choice(["both", "weight", "bias", "none"], p=[0.7, 0.1, 0.1, 0.1])),
            "param_dtype": "float32" if dtype in ("float16", "bfloat16") and r.random() < 0.5 else dtype,
            "activation": str(r.choice(["identity", "silu", "relu", "gelu", "gelu_tanh"])),
            "eps": float(r.choice([1e-5, 1e-6, 1e-3])), "offset": float(r.choice([0.0, 0.0, 0.0, 5.0])),
            "array": _array_kind(r, GROUP_NORM_ARRAYS),
            "seed": int(r.integers(2**31)),
        }


class _Arrays:
    """Moves NumPy inputs to the device as a case's array kind, and makes its NaN-filled out= arrays."""

    def __init__(self, kind):
        self.kind = kind

    def to_device(self, host, channels_last=False):
        import cupy
        import torch

        if host is None:
            return None
        if self.kind == "cupy_misaligned":
            base = cupy.empty(host.size + 1, dtype=host.dtype)  # 1 element past the allocation's alignment
            view = base[1:].reshape(host.shape)
            view[...] = cupy.asarray(host)
            return view
        array = cupy.asarray(host)
        if self.kind.startswith("torch"):
            tensor = torch.from_dlpack(array)
            return tensor.contiguous(memory_format=torch.channels_last) if channels_last else tensor
        return array

    def poisoned(self, shape, dtype):
        """A NaN-filled ``out=`` array for the cupy kinds; None (the op allocates) for torch."""
        if self.kind.startswith("torch"):
            return None
        return self.to_device(numpy.full(shape, numpy.nan, numpy.float32).astype(dtype))


def _as_torch64(value):
    import cupy
    import torch

    if isinstance(value, cupy.ndarray):
        value = torch.from_dlpack(value)
    elif not isinstance(value, torch.Tensor):  # a jax.Array (bfloat16 too, through ml_dtypes)
        value = torch.from_numpy(numpy.asarray(value).astype(numpy.float64)).cuda()
    return value.to(torch.float64)


def _error(got, ref, scale=0.0, slack=0.0):
    """||got - ref|| / (max(||ref||, scale) + slack); the absolute norm where that is 0; inf for a non-finite
    result.  ``slack``: an allowed absolute difference over the tolerance, so that the error is within the
    tolerance where ||got - ref|| <= tolerance * max(||ref||, scale) + allowed difference."""
    import torch

    got = _as_torch64(got)
    assert tuple(got.shape) == tuple(ref.shape), (tuple(got.shape), tuple(ref.shape))
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    norm = max(float(torch.linalg.vector_norm(ref.detach())), scale) + slack
    diff = float(torch.linalg.vector_norm(got - ref.detach()))
    return diff / norm if norm else diff


def run_depthwise(case):
    """{output name: relative error} for one depthwise case."""
    import torch

    r = numpy.random.default_rng(case["seed"])
    dtype = numpy_dtype(case["dtype"])
    batch, channels, height, width = case["x_shape"]
    (kh, kw), multiplier, layout = case["filter"], case["multiplier"], case["layout"]
    out_h, out_w = _output_size(case)
    out_channels = channels * multiplier
    nhwc = layout == "NHWC"
    x = r.standard_normal((batch, height, width, channels) if nhwc else (batch, channels, height, width)).astype(dtype)
    weight = r.standard_normal((out_channels, 1, kh, kw)).astype(dtype)
    bias = r.standard_normal(out_channels).astype(dtype) if case["bias"] else None
    y_shape = (batch, out_h, out_w, out_channels) if nhwc else (batch, out_channels, out_h, out_w)
    grad_out = r.standard_normal(y_shape).astype(dtype)

    geometry = dict(stride=tuple(case["stride"]), dilation=tuple(case["dilation"]), padding=padding_argument(case))
    if case["array"] == "torch_bridge":
        got = _depthwise_through_bridge(x, weight, bias, grad_out, nhwc, geometry)
    elif case["array"].startswith("jax"):
        got = _through_jax(case["array"] == "jax_jit",
                           lambda dwj, *arrays: dwj.depthwise_conv2d(*arrays, layout=layout, **geometry),
                           (x, weight, bias), grad_out)
    else:
        got = _depthwise_through_ops(case["array"], x, weight, bias, grad_out, y_shape, layout, geometry)

    def to_nchw(a):
        t = torch.from_numpy(a.astype(numpy.float64)).cuda()
        return t.permute(0, 3, 1, 2) if nhwc else t

    x64 = to_nchw(x).requires_grad_(True)
    w64 = torch.from_numpy(weight.astype(numpy.float64)).cuda().requires_grad_(True)
    b64 = None if bias is None else torch.from_numpy(bias.astype(numpy.float64)).cuda()
    (top, bottom), (left, right) = _pads(case)
    padded = torch.nn.functional.pad(x64, (left, right, top, bottom))
    ref_y = torch.nn.functional.conv2d(padded, w64, b64, stride=tuple(case["stride"]),
                                       dilation=tuple(case["dilation"]), groups=channels)
    ref_dx, ref_dw = torch.autograd.grad(ref_y, (x64, w64), to_nchw(grad_out))

    def back(t):  # the ops' results are in the case's layout, the bridge's NCHW-shaped
        return t.permute(0, 2, 3, 1) if nhwc and case["array"] != "torch_bridge" else t

    refs = {"y": back(ref_y.detach()), "dx": back(ref_dx), "dw": ref_dw, "db": to_nchw(grad_out).sum(dim=(0, 2, 3))}
    return {name: _error(value, refs[name]) for name, value in got.items()}


def _depthwise_through_ops(kind, x, weight, bias, grad_out, y_shape, layout, geometry):
    """y, dx, dw from the three public ops on ``kind`` arrays."""
    import torch

    import cupy_dwgn

    arrays = _Arrays(kind)
    channels_last = kind == "torch_channels_last"  # NCHW shape, NHWC memory: the ops take the NHWC kernels
    if channels_last and layout == "NHWC":
        arrays, channels_last = _Arrays("torch"), False
    x_d, w_d = arrays.to_device(x, channels_last), arrays.to_device(weight)
    b_d, dy_d = arrays.to_device(bias), arrays.to_device(grad_out, channels_last)
    y = cupy_dwgn.depthwise_conv2d(x_d, w_d, b_d, out=arrays.poisoned(y_shape, x.dtype), layout=layout, **geometry)
    dx = cupy_dwgn.depthwise_conv2d_backward_input(dy_d, w_d, x.shape, out=arrays.poisoned(x.shape, x.dtype),
                                                   layout=layout, **geometry)
    dw = cupy_dwgn.depthwise_conv2d_backward_weight(dy_d, x_d, weight.shape, out=arrays.poisoned(weight.shape, x.dtype),
                                                    layout=layout, **geometry)
    # NCHW-shaped results keep channels-last memory where the array they follow has it only (1x1 planes or one
    # channel make an array both contiguous and channels-last; PyTorch then returns contiguous memory too)
    for result, source, name in ((y, x_d, "y"), (dx, dy_d, "dx")):
        if channels_last and not source.is_contiguous():
            assert result.is_contiguous(memory_format=torch.channels_last), f"{name} lost the channels-last memory format"
    return {"y": y, "dx": dx, "dw": dw}


def _leaf(host, nhwc=False):
    """A float tensor of ``host`` (any dtype, bfloat16 included) that autograd differentiates; an NHWC array
    becomes the NCHW-shaped view of its channels-last memory, as a channels_last tensor is."""
    import cupy
    import torch

    if host is None:
        return None
    tensor = torch.from_dlpack(cupy.asarray(host))
    return (tensor.permute(0, 3, 1, 2) if nhwc else tensor).detach().requires_grad_(True)


def _depthwise_through_bridge(x, weight, bias, grad_out, nhwc, geometry):
    """y, dx, dw, db through cupy_dwgn.torch.depthwise_conv2d and autograd (NCHW-shaped; channels_last when
    the case is NHWC)."""
    import torch

    from cupy_dwgn import torch as bridge

    x_t, w_t, b_t = _leaf(x, nhwc), _leaf(weight), _leaf(bias)
    y = bridge.depthwise_conv2d(x_t, w_t, b_t, **geometry)
    if nhwc and not x_t.is_contiguous():  # (as in _depthwise_through_ops)
        assert y.is_contiguous(memory_format=torch.channels_last), "y lost the channels-last memory format"
    leaves = [t for t in (x_t, w_t, b_t) if t is not None]
    grads = torch.autograd.grad(y, leaves, _leaf(grad_out, nhwc).detach())
    return dict(zip(("y", "dx", "dw", "db"), (y.detach(),) + grads))


def run_group_norm(case):
    """{output name: relative error} for one GroupNorm case."""
    import torch

    r = numpy.random.default_rng(case["seed"])
    dtype, param_dtype = numpy_dtype(case["dtype"]), numpy_dtype(case["param_dtype"])
    shape, groups, activation = tuple(case["shape"]), case["num_groups"], case["activation"]
    channels = shape[-1]
    x = (case["offset"] + r.standard_normal(shape)).astype(dtype)
    grad_out = r.standard_normal(shape).astype(dtype)
    weight = (1 + 0.5 * r.standard_normal(channels)).astype(param_dtype) if case["affine"] in ("both", "weight") else None
    bias = (0.5 * r.standard_normal(channels)).astype(param_dtype) if case["affine"] in ("both", "bias") else None
    if activation == "relu":
        # ReLU's slope jumps at 0: an element whose float32 z and float64 z straddle 0 takes the other slope,
        # and one such element moves a float32 dx of n elements by ~1/sqrt(n).  grad_out is 0 there.
        grouped = x.astype(numpy.float64).reshape(shape[0], -1, groups, channels // groups)
        centered = grouped - grouped.mean(axis=(1, 3), keepdims=True)
        xhat = (centered / numpy.sqrt((centered ** 2).mean(axis=(1, 3), keepdims=True) + case["eps"])).reshape(shape)
        z = xhat * (1.0 if weight is None else weight.astype(numpy.float64)) + (0.0 if bias is None else bias.astype(numpy.float64))
        grad_out[numpy.abs(z) < 1e-4] = 0

    if case["array"] == "torch_bridge":
        got = _group_norm_through_bridge(x, groups, weight, bias, grad_out, case["eps"], activation)
    elif case["array"].startswith("jax"):
        got = _through_jax(case["array"] == "jax_jit",
                           lambda dwj, x, w, b: dwj.group_norm(x, groups, w, b, eps=case["eps"], activation=activation),
                           (x, weight, bias), grad_out)
    else:
        got = _group_norm_through_ops(case["array"], x, groups, weight, bias, grad_out, case["eps"], activation)

    def t64(a, grad=False):
        return None if a is None else torch.from_numpy(a.astype(numpy.float64)).cuda().requires_grad_(grad)

    # The oracle is the textbook float64 formula under autograd (torch's own group_norm refuses one value per
    # group with N = 1, and its bias-only backward fails): a group of one value gives exact zeros here.
    x64, w64, b64 = t64(x, True), t64(weight, weight is not None), t64(bias, bias is not None)
    batch, per_group = shape[0], channels // groups
    grouped = x64.reshape(batch, -1, groups, per_group)
    ref_mean = grouped.mean(dim=(1, 3), keepdim=True)
    ref_rstd = torch.rsqrt(((grouped - ref_mean) ** 2).mean(dim=(1, 3), keepdim=True) + case["eps"])
    act = {"identity": lambda v: v * 1, "silu": torch.nn.functional.silu, "relu": torch.nn.functional.relu,
           "gelu": torch.nn.functional.gelu, "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh")}
    given = {"dx": x64, "dw": w64, "db": b64}
    wanted = {name: v for name, v in given.items() if v is not None}

    def oracle(mean):
        """y, xhat, the gradient of z and {dx, dw, db} of the formula with the group means ``mean``."""
        xhat = ((grouped - mean) * ref_rstd).reshape(shape)
        z = xhat * (1 if w64 is None else w64) + (0 if b64 is None else b64)
        y = act[activation](z)
        grads = torch.autograd.grad(y, [z] + list(wanted.values()), t64(grad_out), retain_graph=True)
        return y, xhat, grads[0], dict(zip(wanted, grads[1:]))

    ref_y, xhat, grad_z, grads = oracle(ref_mean)
    # The backward takes the statistics as the forward returns them (float32 below float64 x), and from a
    # rounded mean it rebuilds each xhat off by up to ulp(mean) * rstd: where a group's mean is large against
    # its spread (an offset of 5 and a spread of 0.01, a group of two values) that alone moves dw, db and dx
    # past the tests' bound, for any kernel that keeps the mean in float32 (PyTorch's included;
    # reference.group_norm_backward's docstring).  So a gradient may differ from the exact one by what one ulp
    # of every group's mean moves it, on top of the bound.
    stats_dtype = numpy.float64 if dtype == numpy.float64 else numpy.float32
    mean_ulp = torch.from_numpy(numpy.spacing(numpy.abs(ref_mean.detach().cpu().numpy()).astype(stats_dtype))
                                .astype(numpy.float64)).cuda()
    moved = oracle(ref_mean + mean_ulp)[3]
    slack = {name: float(torch.linalg.vector_norm(moved[name] - grads[name])) / TOLERANCE[case["dtype"]]
             for name in grads}
    # Where a gradient is a small remainder of terms that cancel (groups of one or two values: dx is zero or
    # nearly so), its error is measured against the root-sum-square of those terms, as any float32 formula
    # leaves rounding of that size behind (PyTorch's own included).  On random data without such
    # cancellation that norm is about the gradient's own, so the bound is the tests' bound there.
    rstd_full = ref_rstd.detach().expand(grouped.shape).reshape(shape)
    terms = {
        "dx": torch.linalg.vector_norm(rstd_full * (1 if w64 is None else w64.detach()) * grad_z),
        "dw": torch.linalg.vector_norm(grad_z * xhat.detach()),
        "db": torch.linalg.vector_norm(grad_z),
    }
    refs = dict(grads, y=ref_y.detach(), mean=ref_mean.reshape(batch, groups), rstd=ref_rstd.reshape(batch, groups))
    for name in ("dw", "db"):
        if name not in grads:
            assert got.pop(name, None) is None, f"{name} returned without its parameter"
    return {name: _error(value, refs[name], float(terms.get(name, 0.0)), slack.get(name, 0.0))
            for name, value in got.items()}


def _group_norm_through_ops(kind, x, groups, weight, bias, grad_out, eps, activation):
    """y, mean, rstd, dx, dw, db from the two public ops on ``kind`` arrays."""
    import cupy_dwgn

    in_place = kind == "cupy_in_place"  # out=x: y overwrites a copy of x; the backward reads another copy
    arrays = _Arrays("cupy" if in_place else kind)
    x_d, dy_d, w_d, b_d = (arrays.to_device(a) for a in (x, grad_out, weight, bias))
    out = arrays.to_device(x) if in_place else arrays.poisoned(x.shape, x.dtype)
    y, mean, rstd = cupy_dwgn.group_norm(out if in_place else x_d, groups, w_d, b_d, eps=eps, activation=activation,
                                         out=out, return_stats=True)
    assert out is None or y is out, "y is not the out= array"
    dx, dw, db = cupy_dwgn.group_norm_backward(dy_d, x_d, mean, rstd, groups, w_d, b_d, activation=activation,
                                               out=arrays.poisoned(x.shape, x.dtype))
    return {"y": y, "mean": mean, "rstd": rstd, "dx": dx, "dw": dw, "db": db}


def _group_norm_through_bridge(x, groups, weight, bias, grad_out, eps, activation):
    """y, dx, dw, db through cupy_dwgn.torch.group_norm and autograd, on the (N, C, *spatial) view of the
    channels-last memory (the layout the bridge runs its kernels on)."""
    import torch

    from cupy_dwgn import torch as bridge

    x_t, w_t, b_t = _leaf(x).detach().movedim(-1, 1).requires_grad_(True), _leaf(weight), _leaf(bias)
    y = bridge.group_norm(x_t, groups, w_t, b_t, eps=eps, activation=activation)
    leaves = {name: t for name, t in (("dx", x_t), ("dw", w_t), ("db", b_t)) if t is not None}
    grads = torch.autograd.grad(y, list(leaves.values()), _leaf(grad_out).detach().movedim(-1, 1))
    got = {name: g.movedim(1, -1) if name == "dx" else g for name, g in zip(leaves, grads)}
    return dict(got, y=y.detach().movedim(1, -1))


def _set_up_jax():
    """Before JAX's first import (main): no preallocation of most of the GPU's memory (CuPy and PyTorch
    share the GPU in this process; as tests/test_jax.py), and float64 on for the float64 cases."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    jax.config.update("jax_enable_x64", True)


def _through_jax(jit, apply, inputs, grad_out):
    """y, dx, dw, db of ``apply(cupy_dwgn.jax, x, weight, bias)`` under jax.vjp (the op's custom_vjp rules),
    eagerly or under jax.jit (the traced path: XLA's buffers through jax.experimental.buffer_callback).
    ``inputs``: NumPy (x, weight, bias), weight or bias None where absent (and then no gradient of it)."""
    import jax
    import jax.numpy as jnp

    from cupy_dwgn import jax as dwj

    present = [i for i, value in enumerate(inputs) if value is not None]

    def call(*leaves):
        arrays = [None] * len(inputs)
        for i, leaf in zip(present, leaves):
            arrays[i] = leaf
        return apply(dwj, *arrays)

    y, vjp = jax.vjp(jax.jit(call) if jit else call, *(jnp.asarray(inputs[i]) for i in present))
    grads = vjp(jnp.asarray(grad_out))
    return dict({("dx", "dw", "db")[i]: grad for i, grad in zip(present, grads)}, y=y)


RUNNERS = {"depthwise": (draw_depthwise, run_depthwise), "group_norm": (draw_group_norm, run_group_norm)}


def _key(case):
    return (case["op"], case["dtype"], case.get("layout", "NHWC"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=240.0, help="stop drawing cases after this long (default 240)")
    parser.add_argument("--cases", type=int, default=0, help="stop after this many cases (default: no limit)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ops", nargs="+", choices=sorted(RUNNERS), default=sorted(RUNNERS))
    parser.add_argument("--log", help="write every case and its errors here, one JSON object a line")
    parser.add_argument("--replay", help="run this one case (a JSON object as printed for a failure)")
    args = parser.parse_args(argv)
    if args.seconds <= 0:
        parser.error(f"--seconds: expected a positive number, got {args.seconds}")

    import torch

    if not torch.cuda.is_available():
        parser.error("needs PyTorch with a CUDA device: it is the float64 oracle")
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    if HAVE_JAX:
        _set_up_jax()

    rng = numpy.random.default_rng(args.seed)
    cases = [json.loads(args.replay)] if args.replay else None
    log = open(args.log, "w") if args.log else None
    worst = collections.defaultdict(lambda: [0, 0.0])
    failures = []
    start = time.perf_counter()
    count = 0
    while True:
        if cases is not None:
            if count == len(cases):
                break
            case = cases[count]
        else:
            if time.perf_counter() - start > args.seconds or (args.cases and count >= args.cases):
                break
            case = RUNNERS[args.ops[int(rng.integers(len(args.ops)))]][0](rng)
        count += 1
        try:
            errors = RUNNERS[case["op"]][1](case)
            bound = TOLERANCE[case["dtype"]]
            ratio = max(errors.values()) / bound
            problem = None if ratio <= 1.0 else f"error {errors} over the bound {bound}"
        except Exception as error:  # a valid call that raises is a failure to report, not to stop on
            errors, ratio, problem = {}, float("inf"), f"{type(error).__name__}: {error}"
        entry = worst[_key(case)]
        entry[0] += 1
        entry[1] = max(entry[1], ratio)
        if problem:
            failures.append((case, problem))
            print(f"FAIL {json.dumps(case)}\n     {problem}", flush=True)
        if log:
            log.write(json.dumps({"case": case, "errors": errors, "problem": problem}) + "\n")
        if count % 100 == 0:
            print(f"{count} cases, {len(failures)} failing, {time.perf_counter() - start:.0f} s", flush=True)
    print(f"\n{count} cases in {time.perf_counter() - start:.0f} s, {len(failures)} failing")
    print(f"{'op':<11} {'dtype':<9} {'layout':<6} {'cases':>6} {'worst error / bound':>20}")
    for (op, dtype, layout), (n, ratio) in sorted(worst.items()):
        print(f"{op:<11} {dtype:<9} {layout:<6} {n:>6} {ratio:>20.3g}")
    if log:
        log.close()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
