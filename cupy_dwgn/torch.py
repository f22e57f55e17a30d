"""PyTorch bridge: cupy-dwgn's depthwise convolution and channels-last GroupNorm as
autograd-capable PyTorch functions, ``nn.Module``\\ s and ``torch.library`` custom ops.

Needs PyTorch (an optional extra; ``import cupy_dwgn.torch`` raises ImportError
without it).  CUDA tensors run the cupy-dwgn kernels, zero-copy, on PyTorch's
current stream, with outputs allocated by PyTorch's caching allocator; CPU
tensors run the float64 NumPy references of :mod:`cupy_dwgn.reference` (slow;
for tests, CI and ``gradcheck``), cast back to the input dtype.

* :func:`depthwise_conv2d`, :func:`group_norm`: functionals, like
  ``torch.nn.functional.conv2d(groups=C)`` and ``group_norm`` + an activation.
* :class:`DepthwiseConv2d`, :class:`GroupNorm`: modules (subclasses of
  ``nn.Conv2d`` / ``nn.GroupNorm`` with the same parameters and state_dict
  keys), each with ``from_module``.
* :func:`convert`: swaps the depthwise convolutions and GroupNorms of an
  existing model for these, fusing a directly following ReLU/SiLU/GELU.
* Custom ops ``torch.ops.cupy_dwgn.{depthwise_conv2d,
  depthwise_conv2d_backward_input, depthwise_conv2d_backward_weight,
  group_norm, group_norm_backward}`` with fake (meta) and autograd
  implementations: what ``torch.compile`` traces.  Eager calls take a leaner
  ``torch.autograd.Function`` path around the same implementation functions
  (the custom-op dispatcher costs tens of microseconds of host time per call).

Memory formats: a ``channels_last`` input of the depthwise convolution runs the
NHWC kernels zero-copy and gives a ``channels_last`` output; a contiguous one
runs the NCHW kernels; any other strides are copied to contiguous first.  The
GroupNorm kernels are channels-last: an input whose channels are the fastest
dimension in memory (``channels_last`` / ``channels_last_3d``, any (N, C), or
(N, C, L) with C fastest) runs them zero-copy and the output keeps that memory
format; a contiguous (N, C, *spatial) input with more than one spatial position
falls back to ``torch.nn.functional.group_norm`` + the activation (PyTorch's own
kernels are made for that format; converting costs two transposes per pass).

Autocast (``torch.autocast("cuda", dtype=torch.float16 / bfloat16)``): the
depthwise convolution casts x, weight and bias to the autocast dtype, as
PyTorch does for convolutions.  GroupNorm keeps x's dtype and passes float32
affine parameters as they are: the kernels take float16/bfloat16 x with float32
weight/bias and accumulate in float32, so a half-precision activation stays
half precision (PyTorch's autocast instead runs group_norm in float32 and
returns float32).

Higher-order gradients (a backward under ``create_graph=True``: gradient
penalties, Hessian-vector products, ``gradgradcheck``): the depthwise
backward ops are differentiable (their gradients are the same three kernels),
so any order runs on cupy-dwgn's kernels; GroupNorm's backward under
``create_graph=True`` differentiates PyTorch's ``group_norm`` + activation,
recomputed from the saved inputs in float32 (float64 for float64 x).
``torch.func`` transforms (``grad``, ``vjp``, ``jacrev``, ``vmap``, per-example
gradients as ``vmap(grad(...))``) work on the eager path: the vmap rules fold
the vmapped axis into the batch or the channels of one kernel call.  Forward
mode (``jvp``, ``jacfwd``) is not implemented.

CUDA graphs: the calls can be captured (``torch.cuda.graph``,
``torch.cuda.make_graphed_callables``, ``torch.compile(mode="reduce-overhead")``),
also as the first call on the capture's stream (its workspace is then allocated
and zeroed outside the graph).  A model of many small layers whose eager step
is bound by the host's time to issue it runs at its kernels' speed once
captured (``examples/torch_cuda_graphs.py``).  Eagerly, a depthwise call
repeated with the same shapes, strides, dtypes, devices and geometry launches
the first call's kernels straight from the tensors' addresses.

Example::

    import torch
    import cupy_dwgn.torch as dwt

    model = torch.nn.Sequential(
        torch.nn.Conv2d(32, 32, 3, padding=1, groups=32),   # depthwise
        torch.nn.GroupNorm(8, 32), torch.nn.SiLU(),
        torch.nn.Conv2d(32, 64, 1),
    ).cuda().to(memory_format=torch.channels_last)
    dwt.convert(model)            # DepthwiseConv2d, GroupNorm(activation="silu"), Identity
    x = torch.randn(8, 32, 56, 56, device="cuda").to(memory_format=torch.channels_last)
    model(x).sum().backward()

    y = dwt.depthwise_conv2d(x, model[0].weight, model[0].bias, padding="same")
"""

try:
    import torch
except ImportError as error:  # torch is an optional extra
    raise ImportError("cupy_dwgn.torch needs PyTorch: pip install torch") from error

import numbers
import typing

import ml_dtypes
import numpy
from torch import nn
from torch.nn import functional as F

from . import _checks, _interop, _validate, reference as _reference

__all__ = [
    "DepthwiseConv2d",
    "GroupNorm",
    "convert",
    "depthwise_conv2d",
    "group_norm",
]

#: Activations the GroupNorm kernels fuse (names of cupy_dwgn.group_norm).
ACTIVATIONS = ("identity", "relu", "silu", "gelu", "gelu_tanh")

_NUMPY_DTYPES = {
    torch.float16: numpy.dtype(numpy.float16),
    torch.float32: numpy.dtype(numpy.float32),
    torch.float64: numpy.dtype(numpy.float64),
    torch.bfloat16: numpy.dtype(ml_dtypes.bfloat16),
}
_HALF = (torch.float16, torch.bfloat16)
# Tensors autocast casts to its lower-precision dtype (float64 is left alone, as in PyTorch).
_AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)

_is_compiling = torch.compiler.is_compiling
_is_grad_enabled = torch.is_grad_enabled
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor  # a torch.func transform's tensor


# ---------------------------------------------------------------------------
# CUDA plumbing: streams and zero-copy CuPy views.

_cupy = None
_dw = None  # cupy_dwgn.depthwise, imported on the first CUDA call (it imports CuPy)
_gn = None  # cupy_dwgn._group_norm
_current_device = None  # CUDA's current device id (cupy_backends' runtime.getDevice)


def _load_core():
    global _cupy, _dw, _gn, _current_device
    import cupy
    from cupy_backends.cuda.api import runtime

    from . import _group_norm, depthwise

    _cupy, _dw, _gn, _current_device = cupy, depthwise, _group_norm, runtime.getDevice


try:
    # 0.1 us, against 5 us for torch.cuda.current_stream(); present since PyTorch 1.x
    # (inductor's generated code calls it).
    _raw_stream = torch._C._cuda_getCurrentRawStream
except AttributeError:  # pragma: no cover - a build without CUDA support or a future rename

    def _raw_stream(device):
        return torch.cuda.current_stream(device).cuda_stream


#: One CuPy stream object per (device, cudaStream_t).  Holds no resources: a
#: CuPy external stream is just the handle and its device, so a handle reused
#: by a later torch stream is still described correctly.
_STREAMS = {}


def _stream(device):
    """What to pass as ``stream=`` to launch on PyTorch's current stream on
    ``device`` (an int): None when CuPy's current stream there is that very
    stream (the usual case: both on the legacy default stream), which keeps
    the core on its fast path; else a CuPy view of the torch stream."""
    ptr = _raw_stream(device)
    if ptr == _cupy.cuda.get_current_stream(device).ptr:
        return None
    stream = _STREAMS.get((device, ptr))
    if stream is None:
        stream = _new_stream(device, ptr)
    return stream


def _new_stream(device, ptr):
    if _cupy is None:
        _load_core()
    stream = _interop.external_stream(_cupy, ptr, device)
    if len(_STREAMS) >= 256:
        _STREAMS.clear()
    _STREAMS[(device, ptr)] = stream
    return stream


# Zero-copy CuPy views of torch tensors, memoized.
#
# A view is ``cupy.ndarray(shape, dtype, MemoryPointer(UnownedMemory(ptr, nbytes,
# owner=None, device)))``: C-contiguous, and a pure function of the key (ptr,
# shape, dtype, device) -- it holds no reference to the tensor and no state of
# its own.  Why reusing a memoized view is safe:
#
# * Only tensors whose memory is dense and C-contiguous in the order of
#   ``shape`` are wrapped (callers make sure: a contiguous tensor with its own
#   shape, a channels_last one with (N, H, W, C)), so (ptr, shape, dtype,
#   device) fixes every byte the view reads or writes: two tensors with
#   the same key describe exactly the same memory in exactly the same way, so a
#   view made for one is the view of the other.  If the first tensor has been
#   freed and its block reused by the second, the view now addresses the second
#   -- the tensor that was passed in, which is what the call wants.
# * owner=None: the view does not keep the tensor alive.  The caller holds the
#   tensor for the duration of the call, and the kernels are queued on PyTorch's
#   current stream; PyTorch's caching allocator is stream-ordered (a freed block
#   is reused by later work on the same stream, or after record_stream events
#   on others), exactly as for PyTorch's own kernels.  The same holds for a
#   fresh view, so memoizing changes nothing.
# * The ops only read ``.data.ptr``, shape and dtype of their arguments and
#   never mutate an argument array object (reshaping in place through
#   ``a.shape = ...`` would corrupt the memo; the core must not do that).
# * A tensor on another device (or the CPU) cannot share a pointer with one on
#   this device (unified virtual addressing), and the device is in the key; the
#   first wrap of each key checks that the tensor is on the expected device.
#
# Bounded: cleared when it reaches _WRAP_LIMIT entries (a training loop reuses
# a few hundred blocks of the caching allocator; the memo then stays warm).
_WRAPS = {}
_WRAP_LIMIT = 4096


def _wrap(t, shape, device):
    """A CuPy view of the CUDA tensor ``t`` on ``device`` whose memory is dense
    and C-contiguous in the order of ``shape`` (t.shape for a contiguous
    tensor, (N, H, W, C) for a channels_last one): no copy, no torch call but
    data_ptr / dtype on a memo hit."""
    key = (t.data_ptr(), shape, t.dtype, device)
    view = _WRAPS.get(key)
    if view is None:
        view = _new_wrap(t, key)
    return view


def _new_wrap(t, key):
    ptr, shape, dtype, device = key
    if t.get_device() != device:
        raise ValueError(
            f"cupy_dwgn.torch: expected every tensor on cuda:{device} (the device of x), "
            f"got one on {t.device}"
        )
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if np_dtype is None:
        raise TypeError(f"cupy_dwgn.torch: expected dtype float16, float32, float64 or bfloat16, got {dtype}")
    cupy = _cupy
    shape = tuple(int(s) for s in shape)
    memory = cupy.cuda.UnownedMemory(ptr, t.numel() * np_dtype.itemsize, None, device)
    # strides=None: the C-contiguous strides of ``shape``, the tensor's memory.
    view = cupy.ndarray(shape, np_dtype, cupy.cuda.MemoryPointer(memory, 0))
    if len(_WRAPS) >= _WRAP_LIMIT:
        _WRAPS.clear()
    _WRAPS[key] = view
    return view


def _wrap_optional(t, device):
    return None if t is None else _wrap(t, t.shape, device)


# Depthwise launches from raw addresses.  After a call has gone through the
# core's API (its checks, or its signature cache), the core's Steps for that
# signature and the two pointer alignments its kernel choice reads
# (depthwise.prepared_steps) are kept here under a key that fixes everything
# the core's signature holds -- shapes and strides, dtypes, devices, the
# geometry -- so the next such call launches them from the tensors'
# addresses, skipping the views, the signature key and the array checks
# (about half of a bridge call's host time; benchmarks/bridge_overhead.py).
# False: a call that launches nothing (empty tensors) keeps the API path.
# Bounded as _PLANS.
_LAUNCHES = {}


def _launch_prepared(key, device, addresses):
    """Launch the Steps kept under ``key`` with ``addresses`` on PyTorch's
    current stream; False (nothing launched) when there are none or
    ``device`` is not CUDA's current device (the core's API enters it)."""
    steps = _LAUNCHES.get(key)
    if not steps or device != _current_device():
        return False
    stream = _stream(device)
    if stream is None:
        steps.run(device, addresses)
    else:
        with stream:
            steps.run(device, addresses)
    return True


def _keep_launch(key, op, first, second, third, out, stride, padding, dilation, layout):
    """Keep the Steps the core's call ``op`` that just ran (these CuPy views,
    these arguments) launches, under ``key``."""
    if len(_LAUNCHES) >= _PLAN_LIMIT:
        _LAUNCHES.clear()
    _LAUNCHES[key] = _dw.prepared_steps(op, first, second, third, out, stride, padding, dilation, layout) or False


# ---------------------------------------------------------------------------
# Argument normalization (Python ints, done once per module / functional call).


def _int_pair(name, value, minimum):
    """The core's int-or-pair rule (and messages), also taking PyTorch's
    one-element form (k,) and any sequence (torch.Size, list)."""
    if type(value) is not int and not isinstance(value, str):
        try:
            value = tuple(value)
        except TypeError:
            pass
        else:
            value = value * 2 if len(value) == 1 else value
    return _validate.int_pair(name, value, minimum)


def _explicit_padding(padding, kernel_size, stride, dilation):
    """int | (h, w) | ((top, bottom), (left, right)) | "same" | "valid" ->
    (top, bottom, left, right), by the core's own rule and messages
    (PyTorch's one-element form (p,) is taken too)."""
    if isinstance(padding, (tuple, list)) and len(padding) == 1:
        padding = padding[0]
    return _validate._padding(padding, tuple(kernel_size), tuple(dilation), tuple(stride))


def _core_padding(pads):
    return ((pads[0], pads[1]), (pads[2], pads[3]))


# ---------------------------------------------------------------------------
# Memory formats.  Outputs are made with new_empty_strided (one torch call)
# with the strides PyTorch gives that memory format; the fake kernels use the
# very same helpers, so fake and real outputs agree on strides.


def _is_nhwc(t):
    """4-D and channels_last in memory but not (also) contiguous: runs the NHWC kernels."""
    return not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def _channels_last_order(shape):
    """(N, C, *spatial) -> (N, *spatial, C)."""
    return (shape[0],) + tuple(shape[2:]) + (shape[1],)


def _channels_last_strides(shape):
    """PyTorch's strides of a (N, C, *spatial) tensor whose channels are fastest."""
    channels = shape[1]
    strides = [0] * len(shape)
    strides[1] = 1
    step = max(channels, 1)
    for d in range(len(shape) - 1, 1, -1):
        strides[d] = step
        step *= max(shape[d], 1)
    strides[0] = step
    return tuple(strides)


def _contiguous_strides(shape):
    strides = [0] * len(shape)
    step = 1
    for d in range(len(shape) - 1, -1, -1):
        strides[d] = step
        step *= max(shape[d], 1)
    return tuple(strides)


def _empty(like, shape, channels_last, dtype=None):
    """An empty tensor of ``shape`` (N, C, ...) on like's device: channels fastest
    in memory when ``channels_last``, else contiguous."""
    strides = _channels_last_strides(shape) if channels_last else _contiguous_strides(shape)
    return like.new_empty_strided(shape, strides, dtype=like.dtype if dtype is None else dtype)


def _has_channels_last_memory(t):
    """Whether the channels of t (N, C, *spatial) are its fastest dimension, dense
    (so (N, *spatial, C) is C-contiguous): what the GroupNorm kernels read."""
    ndim = t.dim()
    if ndim == 4:
        return t.is_contiguous(memory_format=torch.channels_last)
    if ndim == 2:
        return t.is_contiguous()
    if ndim == 5:
        return t.is_contiguous(memory_format=torch.channels_last_3d)
    if ndim == 3:
        shape, strides = t.shape, t.stride()
        expected = 1
        for d in (1, 2, 0):
            if shape[d] != 1:
                if strides[d] != expected:
                    return False
                expected *= shape[d]
        return True
    return False


def _to_channels_last(t):
    """t (N, C, *spatial) with its channels fastest in memory (copied only if needed)."""
    if _has_channels_last_memory(t):
        return t
    out = _empty(t, tuple(t.shape), True)
    return out.copy_(t)


def _check_float(name, t, like=None):
    if t.dtype not in _NUMPY_DTYPES:
        raise TypeError(f"{name}: expected dtype float16, float32, float64 or bfloat16, got {t.dtype}")
    if like is not None and t.dtype != like.dtype:
        raise TypeError(f"{name}: expected dtype {like.dtype} (the dtype of x), got {t.dtype}")


def _as_float64(t):
    """A C-contiguous float64 NumPy copy of t, in t's logical order."""
    return None if t is None else t.detach().to("cpu", torch.float64).contiguous().numpy()


def _nhwc_numpy(t):
    """A float64 NumPy copy of t (N, C, *spatial) in (N, *spatial, C) order."""
    return numpy.ascontiguousarray(numpy.moveaxis(_as_float64(t), 1, -1))


def _from_nhwc_numpy(a):
    """(N, *spatial, C) NumPy -> a (N, C, *spatial) torch view."""
    return torch.from_numpy(numpy.moveaxis(a, -1, 1))


# ---------------------------------------------------------------------------
# Depthwise convolution: the implementations (one per direction), shared by
# the eager autograd.Function and the custom ops.  x/grad_out/out are NCHW
# tensors; nhwc picks the kernels on their channels_last memory.


# Per-signature plans.  Everything the CUDA and CPU branches derive from
# shapes, strides and the geometry (output size and strides, the memory
# layout, the shapes the kernels see) is computed once per signature and
# looked up afterwards: about 1.5 us less per call than recomputing it.  Keys
# hold only ints and tuples of ints (the fake kernels, which may see symbolic
# sizes, call the builders directly and never touch the memo).
_PLANS = {}
_PLAN_LIMIT = 4096


def _remember(key, plan):
    if len(_PLANS) >= _PLAN_LIMIT:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


def _forward_geometry(x, weight, pads, stride, dilation):
    """((N, C*M, OH, OW), nhwc) of the forward; nhwc when x is channels_last."""
    if x.dim() != 4 or weight.dim() != 4:
        raise ValueError(
            f"x, weight: expected 4-D (N, C, H, W) and (C*M, 1, KH, KW), got shapes "
            f"{tuple(x.shape)} and {tuple(weight.shape)}"
        )
    batch, _, height, width = x.shape
    out_channels, _, kh, kw = weight.shape
    oh = (height + pads[0] + pads[1] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (width + pads[2] + pads[3] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    if oh <= 0 or ow <= 0:
        raise ValueError(
            f"x: the output size would be {oh}x{ow}: the padded input must be at least as large "
            f"as the dilated filter"
        )
    return (batch, out_channels, oh, ow), _is_nhwc(x)


def _forward_output(x, weight, pads, stride, dilation):
    """The empty forward output (the fake kernel; the real one uses the plan)."""
    size, nhwc = _forward_geometry(x, weight, pads, stride, dilation)
    return _empty(x, size, nhwc)


def _layout_shapes(nhwc, *shapes):
    """The shapes the kernels see: (N, H, W, C) for NHWC, as given for NCHW."""
    if nhwc:
        return tuple((s[0], s[2], s[3], s[1]) for s in shapes)
    return tuple(tuple(s) for s in shapes)


def _forward_plan(key, x, weight, stride, pads, dilation):
    size, nhwc = _forward_geometry(x, weight, pads, stride, dilation)
    strides = _channels_last_strides(size) if nhwc else _contiguous_strides(size)
    copy = not nhwc and not x.is_contiguous()
    x_shape, out_shape = _layout_shapes(nhwc, tuple(x.shape), size)
    layout = "NHWC" if nhwc else "NCHW"
    return _remember(key, (size, strides, copy, x_shape, out_shape, layout, _core_padding(pads)))


def _dw_forward(x, weight, bias, stride, pads, dilation):
    key = ("dw", x.shape, x.stride(), weight.shape, stride, pads, dilation)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _forward_plan(key, x, weight, stride, pads, dilation)
    size, strides, copy, x_shape, out_shape, layout, padding = plan
    if copy:
        x = x.contiguous()
    if not weight.is_contiguous():
        weight = weight.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    out = x.new_empty_strided(size, strides)
    if x.is_cuda:
        if _dw is None:
            _load_core()
        device = x.get_device()
        x_ptr, out_ptr = x.data_ptr(), out.data_ptr()
        fast = (key, x.dtype, weight.dtype, weight.get_device(), None if bias is None else
                (bias.shape, bias.dtype, bias.get_device()), device, x_ptr & 15, out_ptr & 15)
        if _launch_prepared(fast, device, (x_ptr, weight.data_ptr(), 0 if bias is None else bias.data_ptr(), out_ptr)):
            return out
        views = (_wrap(x, x_shape, device), _wrap(weight, weight.shape, device), _wrap_optional(bias, device),
                 _wrap(out, out_shape, device))
        _dw.depthwise_conv2d(*views[:3], stride=stride, padding=padding, dilation=dilation, layout=layout,
                             out=views[3], stream=_stream(device))
        if fast not in _LAUNCHES:
            _keep_launch(fast, "fwd", *views, stride, padding, dilation, layout)
        return out
    _check_float("x", x)
    _check_float("weight", weight, x)
    if bias is not None:
        _check_float("bias", bias, x)
    ref = _reference.depthwise_conv2d(
        _as_float64(x), _as_float64(weight), _as_float64(bias), stride=stride, padding=padding, dilation=dilation,
    )
    return out.copy_(torch.from_numpy(ref))


def _backward_input_output(grad_out, input_shape):
    """The empty input gradient (the fake kernel): its layout follows grad_out's memory."""
    return _empty(grad_out, tuple(input_shape), _is_nhwc(grad_out))


def _backward_input_plan(key, grad_out, input_shape, pads):
    nhwc = _is_nhwc(grad_out)
    size = tuple(int(s) for s in input_shape)
    strides = _channels_last_strides(size) if nhwc else _contiguous_strides(size)
    copy = not nhwc and not grad_out.is_contiguous()
    dy_shape, out_shape = _layout_shapes(nhwc, tuple(grad_out.shape), size)
    layout = "NHWC" if nhwc else "NCHW"
    return _remember(key, (size, strides, copy, dy_shape, out_shape, layout, _core_padding(pads)))


def _dw_backward_input(grad_out, weight, input_shape, stride, pads, dilation):
    key = ("dx", grad_out.shape, grad_out.stride(), input_shape, pads)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _backward_input_plan(key, grad_out, input_shape, pads)
    size, strides, copy, dy_shape, out_shape, layout, padding = plan
    if copy:
        grad_out = grad_out.contiguous()
    if not weight.is_contiguous():
        weight = weight.contiguous()
    out = grad_out.new_empty_strided(size, strides)
    if grad_out.is_cuda:
        if _dw is None:
            _load_core()
        device = grad_out.get_device()
        dy_ptr, out_ptr = grad_out.data_ptr(), out.data_ptr()
        fast = (key, weight.shape, stride, dilation, grad_out.dtype, weight.dtype, weight.get_device(), device,
                dy_ptr & 15, out_ptr & 15)
        if _launch_prepared(fast, device, (dy_ptr, weight.data_ptr(), 0, out_ptr)):
            return out
        views = (_wrap(grad_out, dy_shape, device), _wrap(weight, weight.shape, device), _wrap(out, out_shape, device))
        _dw.depthwise_conv2d_backward_input(
            *views[:2], out_shape, stride=stride, padding=padding, dilation=dilation, layout=layout, out=views[2],
            stream=_stream(device),
        )
        if fast not in _LAUNCHES:
            _keep_launch(fast, "bwd_input", views[0], views[1], out_shape, views[2], stride, padding, dilation, layout)
        return out
    _check_float("grad_out", grad_out)
    _check_float("weight", weight, grad_out)
    ref = _reference.depthwise_conv2d_backward_input(
        _as_float64(grad_out), _as_float64(weight), size, stride=stride, padding=padding, dilation=dilation,
    )
    return out.copy_(torch.from_numpy(ref))


def _backward_weight_plan(key, x, grad_out, pads):
    nhwc = _is_nhwc(x)
    copy = not nhwc and not x.is_contiguous()
    x_shape, dy_shape = _layout_shapes(nhwc, tuple(x.shape), tuple(grad_out.shape))
    layout = "NHWC" if nhwc else "NCHW"
    return _remember(key, (nhwc, copy, x_shape, dy_shape, layout, _core_padding(pads)))


def _dw_backward_weight(grad_out, x, weight_shape, stride, pads, dilation):
    key = ("dw_w", x.shape, x.stride(), grad_out.shape, pads)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _backward_weight_plan(key, x, grad_out, pads)
    nhwc, copy, x_shape, dy_shape, layout, padding = plan
    if copy:
        x = x.contiguous()
    # grad_out in x's layout (returns grad_out itself when it already is)
    grad_out = grad_out.contiguous(memory_format=torch.channels_last if nhwc else torch.contiguous_format)
    out = x.new_empty(weight_shape)
    if x.is_cuda:
        if _dw is None:
            _load_core()
        device = x.get_device()
        dy_ptr, x_ptr = grad_out.data_ptr(), x.data_ptr()
        fast = (key, weight_shape, stride, dilation, x.dtype, grad_out.dtype, grad_out.get_device(), device,
                dy_ptr & 15, x_ptr & 15)
        if _launch_prepared(fast, device, (dy_ptr, x_ptr, 0, out.data_ptr())):
            return out
        views = (_wrap(grad_out, dy_shape, device), _wrap(x, x_shape, device), _wrap(out, out.shape, device))
        _dw.depthwise_conv2d_backward_weight(
            *views[:2], out.shape, stride=stride, padding=padding, dilation=dilation, layout=layout, out=views[2],
            stream=_stream(device),
        )
        if fast not in _LAUNCHES:
            _keep_launch(fast, "bwd_weight", views[0], views[1], out.shape, views[2], stride, padding, dilation, layout)
        return out
    _check_float("x", x)
    _check_float("grad_out", grad_out, x)
    ref = _reference.depthwise_conv2d_backward_weight(
        _as_float64(grad_out), _as_float64(x), tuple(int(s) for s in weight_shape),
        stride=stride, padding=padding, dilation=dilation,
    )
    return out.copy_(torch.from_numpy(ref))


def _dw_grads(grad_out, x, weight, has_bias, needs, stride, pads, dilation, backward_input, backward_weight):
    """(grad_x, grad_weight, grad_bias) for the needed ones; grad_out takes x's memory
    format (as PyTorch's convolution backward does)."""
    grad_out = grad_out.contiguous(memory_format=torch.channels_last if _is_nhwc(x) else torch.contiguous_format)
    grad_x = grad_weight = grad_bias = None
    if needs[0]:
        grad_x = backward_input(grad_out, weight, x.shape, stride, pads, dilation)
    if needs[1]:
        grad_weight = backward_weight(grad_out, x, weight.shape, stride, pads, dilation)
    if has_bias and needs[2]:
        grad_bias = grad_out.sum((0, 2, 3))
    return grad_x, grad_weight, grad_bias


# Higher-order gradients.  The two backward ops are depthwise convolutions
# too, each linear in both of its tensors, and their gradients are the three
# ops again: for a gradient gg_x of grad_x = backward_input(grad_out, weight),
#   grad_out gets forward(gg_x, weight) and weight backward_weight(grad_out, gg_x);
# for a gradient gg_w of grad_weight = backward_weight(grad_out, x),
#   grad_out gets forward(x, gg_w) and x backward_input(grad_out, gg_w).
# So a backward under create_graph=True (gradient penalties, second-order
# methods, gradgradcheck) records a graph of the same kernels, to any order.
# ``ops`` is (forward, backward_input, backward_weight): the eager functions
# below or the custom ops.


def _save_backward_op(ctx, inputs, output=None):
    """setup_context of a backward op (eager Function or custom op): inputs
    (first, second, shape, stride, pads, dilation)."""
    first, second, _, stride, pads, dilation = inputs
    ctx.save_for_backward(first, second)
    ctx.geometry = (tuple(stride), tuple(pads), tuple(dilation))


# torch.func.vmap: each op's vmap rule moves the vmapped axis (size B) into
# the batch where only the images are vmapped, else into the channels: a
# depthwise convolution treats every channel alone, so B examples' C channels
# and filters are one convolution over B * C channels (the weight gradient's
# rule always takes that form: one weight gradient per example).


def _along(t, dim, batch):
    """t with the vmapped axis first (expanded where t is not vmapped: dim None)."""
    if dim is None:
        return t.unsqueeze(0).expand((batch,) + tuple(t.shape))
    return t.movedim(dim, 0)


def _into_channels(t, dim, batch):
    """(B, N, C, ...) -> (N, B * C, ...) of a vmapped image-shaped t."""
    return _along(t, dim, batch).movedim(0, 1).flatten(1, 2)


def _grads_of_backward_input(ctx, grad_grad_x, ops):
    """(grad_out's, weight's) gradients of backward_input(grad_out, weight), then
    None for its four non-tensor arguments."""
    grad_out, weight = ctx.saved_tensors
    stride, pads, dilation = ctx.geometry
    needs = ctx.needs_input_grad
    forward, _, backward_weight = ops
    return (
        forward(grad_grad_x, weight, None, stride, pads, dilation) if needs[0] else None,
        backward_weight(grad_out, grad_grad_x, tuple(weight.shape), stride, pads, dilation) if needs[1] else None,
        None, None, None, None,
    )


def _grads_of_backward_weight(ctx, grad_grad_weight, ops):
    """(grad_out's, x's) gradients of backward_weight(grad_out, x), then None for
    its four non-tensor arguments."""
    grad_out, x = ctx.saved_tensors
    stride, pads, dilation = ctx.geometry
    needs = ctx.needs_input_grad
    forward, backward_input, _ = ops
    return (
        forward(x, grad_grad_weight, None, stride, pads, dilation) if needs[0] else None,
        backward_input(grad_out, grad_grad_weight, tuple(x.shape), stride, pads, dilation) if needs[1] else None,
        None, None, None, None,
    )


class _DepthwiseFunction(torch.autograd.Function):
    """The eager path: the implementation functions without the dispatcher."""

    @staticmethod
    def forward(x, weight, bias, stride, pads, dilation):
        return _dw_forward(x, weight, bias, stride, pads, dilation)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, stride, pads, dilation = inputs
        ctx.save_for_backward(x, weight)
        ctx.geometry = (stride, pads, dilation, bias is not None)

    @staticmethod
    def vmap(info, in_dims, x, weight, bias, stride, pads, dilation):
        batch = info.batch_size
        x_dim, weight_dim, bias_dim = in_dims[:3]
        if weight_dim is None and bias_dim is None:  # the vmapped axis joins the batch
            y = _eager_forward(x.movedim(x_dim, 0).flatten(0, 1), weight, bias, stride, pads, dilation)
            return y.unflatten(0, (batch, -1)), 0
        weight = _along(weight, weight_dim, batch).flatten(0, 1)
        bias = None if bias is None else _along(bias, bias_dim, batch).flatten(0, 1)
        y = _eager_forward(_into_channels(x, x_dim, batch), weight, bias, stride, pads, dilation)
        return y.unflatten(1, (batch, -1)), 1

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        stride, pads, dilation, has_bias = ctx.geometry
        grads = _dw_grads(
            grad_out, x, weight, has_bias, ctx.needs_input_grad, stride, pads, dilation,
            _eager_backward_input, _eager_backward_weight,
        )
        return grads + (None, None, None)


class _BackwardInputFunction(torch.autograd.Function):
    """backward_input as a differentiable function of (grad_out, weight): what a
    backward under create_graph=True records on the eager path."""

    @staticmethod
    def forward(grad_out, weight, input_shape, stride, pads, dilation):
        return _dw_backward_input(grad_out, weight, input_shape, stride, pads, dilation)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _save_backward_op(ctx, inputs)

    @staticmethod
    def backward(ctx, grad_grad_x):
        return _grads_of_backward_input(ctx, grad_grad_x, _EAGER_OPS)

    @staticmethod
    def vmap(info, in_dims, grad_out, weight, input_shape, stride, pads, dilation):
        batch = info.batch_size
        grad_dim, weight_dim = in_dims[:2]
        batch_size, channels = input_shape[:2]
        if weight_dim is None:  # the vmapped axis joins the batch
            grad_x = _eager_backward_input(grad_out.movedim(grad_dim, 0).flatten(0, 1), weight,
                                           (batch * batch_size,) + tuple(input_shape[1:]), stride, pads, dilation)
            return grad_x.unflatten(0, (batch, batch_size)), 0
        grad_x = _eager_backward_input(
            _into_channels(grad_out, grad_dim, batch), _along(weight, weight_dim, batch).flatten(0, 1),
            (batch_size, batch * channels) + tuple(input_shape[2:]), stride, pads, dilation)
        return grad_x.unflatten(1, (batch, channels)), 1


class _BackwardWeightFunction(torch.autograd.Function):
    """backward_weight as a differentiable function of (grad_out, x)."""

    @staticmethod
    def forward(grad_out, x, weight_shape, stride, pads, dilation):
        return _dw_backward_weight(grad_out, x, weight_shape, stride, pads, dilation)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _save_backward_op(ctx, inputs)

    @staticmethod
    def backward(ctx, grad_grad_weight):
        return _grads_of_backward_weight(ctx, grad_grad_weight, _EAGER_OPS)

    @staticmethod
    def vmap(info, in_dims, grad_out, x, weight_shape, stride, pads, dilation):
        # A weight gradient per vmapped example: the vmapped axis joins the channels.
        batch = info.batch_size
        grad_weight = _eager_backward_weight(
            _into_channels(grad_out, in_dims[0], batch), _into_channels(x, in_dims[1], batch),
            (batch * weight_shape[0],) + tuple(weight_shape[1:]), stride, pads, dilation)
        return grad_weight.unflatten(0, (batch, weight_shape[0])), 0


def _records(first, second=None, third=None):
    """Whether an eager op goes through its autograd Function: grad mode on (in
    a backward: create_graph=True) and a tensor argument that requires grad, or
    a torch.func transform's tensor (the Functions hold the vmap rules; the
    implementation functions need real storage).  Written out: the forward's
    host time."""
    return (_is_grad_enabled() and (
        first.requires_grad or (second is not None and second.requires_grad)
        or (third is not None and third.requires_grad)
    )) or _is_wrapped(first) or (second is not None and _is_wrapped(second)) or (
        third is not None and _is_wrapped(third))


def _eager_forward(x, weight, bias, stride, pads, dilation):
    if _records(x, weight, bias):
        return _DepthwiseFunction.apply(x, weight, bias, stride, pads, dilation)
    return _dw_forward(x, weight, bias, stride, pads, dilation)


def _eager_backward_input(grad_out, weight, input_shape, stride, pads, dilation):
    if _records(grad_out, weight):
        return _BackwardInputFunction.apply(grad_out, weight, input_shape, stride, pads, dilation)
    return _dw_backward_input(grad_out, weight, input_shape, stride, pads, dilation)


def _eager_backward_weight(grad_out, x, weight_shape, stride, pads, dilation):
    if _records(grad_out, x):
        return _BackwardWeightFunction.apply(grad_out, x, weight_shape, stride, pads, dilation)
    return _dw_backward_weight(grad_out, x, weight_shape, stride, pads, dilation)


_EAGER_OPS = (_eager_forward, _eager_backward_input, _eager_backward_weight)


# ---------------------------------------------------------------------------
# GroupNorm implementations.  x is (N, C, *spatial), 2-D to 5-D; the kernels see
# its memory as (N, *spatial, C), which must be C-contiguous (else x is copied
# to that format: only the custom op meets such inputs, the functional falls
# back to PyTorch first).  y and grad_x have the channels-fastest format.


def _stats_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _affine_dtype(x, weight, bias):
    return weight.dtype if weight is not None else (bias.dtype if bias is not None else x.dtype)


def _check_group_norm_x(x):
    if not 2 <= x.dim() <= 5:
        raise ValueError(f"x: expected a 2-D to 5-D tensor (N, C, *spatial), got shape {tuple(x.shape)}")


def _check_group_norm_cpu(x, weight, bias):
    _check_float("x", x)
    allowed = (x.dtype, torch.float32) if x.dtype in _HALF else (x.dtype,)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype not in allowed:
            raise TypeError(
                f"{name}: expected dtype {' or '.join(map(str, allowed))} for x of dtype {x.dtype}, got {t.dtype}"
            )
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        raise TypeError(f"bias: expected dtype {weight.dtype} (the dtype of weight), got {bias.dtype}")


def _group_norm_outputs(x, num_groups):
    """Empty (y, mean, rstd) (the fake kernel; the real one uses the plan)."""
    shape = tuple(x.shape)
    stats = _stats_dtype(x)
    return (
        _empty(x, shape, True),
        x.new_empty((shape[0], num_groups), dtype=stats),
        x.new_empty((shape[0], num_groups), dtype=stats),
    )


def _group_norm_plan(x):
    """(copy, channels-last strides, (N, *spatial, C)) for x's shape and strides."""
    key = ("gn", x.shape, x.stride())
    plan = _PLANS.get(key)
    if plan is None:
        _check_group_norm_x(x)
        shape = tuple(x.shape)
        plan = _remember(
            key, (not _has_channels_last_memory(x), _channels_last_strides(shape), _channels_last_order(shape))
        )
    return plan


def _gn_forward(x, num_groups, weight, bias, eps, activation, need_stats=True):
    """(y, mean, rstd); without ``need_stats`` (no backward will run) on CUDA
    the statistics stay in the core's workspace and mean/rstd are None."""
    copy, strides, shape = _group_norm_plan(x)
    if copy:
        x = _to_channels_last(x)
    y = x.new_empty_strided(x.shape, strides)
    if x.is_cuda and not need_stats:
        if _gn is None:
            _load_core()
        device = x.get_device()
        _gn.group_norm(
            _wrap(x, shape, device), num_groups, _wrap_optional(weight, device), _wrap_optional(bias, device),
            eps=eps, activation=activation, out=_wrap(y, shape, device), stream=_stream(device),
        )
        return y, None, None
    stats = torch.float64 if x.dtype == torch.float64 else torch.float32
    mean = x.new_empty((shape[0], num_groups), dtype=stats)
    rstd = x.new_empty((shape[0], num_groups), dtype=stats)
    if x.is_cuda:
        if _gn is None:
            _load_core()
        device = x.get_device()
        _gn.group_norm(
            _wrap(x, shape, device), num_groups, _wrap_optional(weight, device), _wrap_optional(bias, device),
            eps=eps, activation=activation, out=_wrap(y, shape, device),
            mean_out=_wrap(mean, mean.shape, device), rstd_out=_wrap(rstd, rstd.shape, device),
            return_stats=True, stream=_stream(device),
        )
        return y, mean, rstd
    _check_group_norm_cpu(x, weight, bias)
    y_ref, mean_ref, rstd_ref = _reference.group_norm(
        _nhwc_numpy(x), num_groups, _as_float64(weight), _as_float64(bias), eps=eps, activation=activation,
        return_stats=True,
    )
    y.copy_(_from_nhwc_numpy(y_ref))
    mean.copy_(torch.from_numpy(mean_ref))
    rstd.copy_(torch.from_numpy(rstd_ref))
    return y, mean, rstd


def _group_norm_grads(x, weight, bias):
    """Empty (grad_x, grad_weight, grad_bias) (the fake kernel); an absent weight /
    bias gets an empty (0,) gradient."""
    channels = x.shape[1]
    w_dtype = _affine_dtype(x, weight, bias)
    return (
        _empty(x, tuple(x.shape), True),
        x.new_empty((channels if weight is not None else 0,), dtype=w_dtype),
        x.new_empty((channels if bias is not None else 0,), dtype=w_dtype),
    )


def _gn_backward(grad_out, x, mean, rstd, num_groups, weight, bias, eps, activation):
    """(grad_x, grad_weight, grad_bias) from the forward's mean/rstd (eps is
    part of the op's schema but used by neither kernel)."""
    copy, strides, shape = _group_norm_plan(x)
    if copy:
        x = _to_channels_last(x)
    if grad_out.stride() != x.stride():
        grad_out = _to_channels_last(grad_out)
    channels = shape[-1]
    w_dtype = weight.dtype if weight is not None else (bias.dtype if bias is not None else x.dtype)
    dx = x.new_empty_strided(x.shape, strides)
    dw = x.new_empty((channels if weight is not None else 0,), dtype=w_dtype)
    db = x.new_empty((channels if bias is not None else 0,), dtype=w_dtype)
    if x.is_cuda:
        if _gn is None:
            _load_core()
        device = x.get_device()
        if not mean.is_contiguous():
            mean = mean.contiguous()
        if not rstd.is_contiguous():
            rstd = rstd.contiguous()
        _gn.group_norm_backward(
            _wrap(grad_out, shape, device), _wrap(x, shape, device), _wrap(mean, mean.shape, device),
            _wrap(rstd, rstd.shape, device), num_groups,
            _wrap_optional(weight, device), _wrap_optional(bias, device), activation=activation,
            out=_wrap(dx, shape, device),
            grad_weight_out=None if weight is None else _wrap(dw, dw.shape, device),
            grad_bias_out=None if bias is None else _wrap(db, db.shape, device),
            stream=_stream(device),
        )
        return dx, dw, db
    _check_group_norm_cpu(x, weight, bias)
    # The reference backward from the forward's mean/rstd (as the CUDA kernels
    # do), in float64 like every CPU argument.
    dx_ref, dw_ref, db_ref = _reference.group_norm_backward(
        _nhwc_numpy(grad_out), _nhwc_numpy(x), _as_float64(mean), _as_float64(rstd), num_groups,
        _as_float64(weight), _as_float64(bias), activation=activation,
    )
    dx.copy_(_from_nhwc_numpy(dx_ref))
    if weight is not None:
        dw.copy_(torch.from_numpy(dw_ref))
    if bias is not None:
        db.copy_(torch.from_numpy(db_ref))
    return dx, dw, db


class _GroupNormFunction(torch.autograd.Function):
    """The eager path of the channels-last GroupNorm."""

    @staticmethod
    def forward(x, num_groups, weight, bias, eps, activation):
        return _gn_forward(x, num_groups, weight, bias, eps, activation)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _group_norm_setup_context(ctx, inputs, output)

    @staticmethod
    def backward(ctx, grad_out, grad_mean, grad_rstd):
        return _gn_grads(ctx, grad_out, _gn_backward)

    @staticmethod
    def vmap(info, in_dims, x, num_groups, weight, bias, eps, activation):
        # As the depthwise rules: the vmapped axis joins the batch (parameters not vmapped) or
        # the channels (B * num_groups groups of the same size); mean and rstd follow.
        batch = info.batch_size
        x_dim, _, weight_dim, bias_dim = in_dims[:4]
        if weight_dim is None and bias_dim is None:
            outputs = _GroupNormFunction.apply(x.movedim(x_dim, 0).flatten(0, 1), num_groups, weight, bias, eps,
                                               activation)
            return tuple(t.unflatten(0, (batch, -1)) for t in outputs), (0, 0, 0)
        weight = None if weight is None else _along(weight, weight_dim, batch).flatten(0, 1)
        bias = None if bias is None else _along(bias, bias_dim, batch).flatten(0, 1)
        outputs = _GroupNormFunction.apply(_into_channels(x, x_dim, batch), batch * num_groups, weight, bias, eps,
                                           activation)
        return tuple(t.unflatten(1, (batch, -1)) for t in outputs), (1, 1, 1)


def _gn_grads(ctx, grad_out, backward):
    """GroupNorm's gradients for (x, num_groups, weight, bias, eps, activation)
    from ``backward`` (the implementation function or the custom op); under
    create_graph=True, as a graph of PyTorch's ops instead."""
    x, weight, bias, mean, rstd = ctx.saved_tensors
    num_groups, eps, activation = ctx.args
    needs = ctx.needs_input_grad
    if _is_grad_enabled() or _is_wrapped(grad_out) or _is_wrapped(x):
        dx, dw, db = _group_norm_recorded_grads(grad_out, x, num_groups, weight, bias, eps, activation, needs)
    else:
        dx, dw, db = backward(grad_out, x, mean, rstd, num_groups, weight, bias, eps, activation)
    return (
        dx if needs[0] else None, None,
        dw if weight is not None and needs[2] else None,
        db if bias is not None and needs[3] else None,
        None, None,
    )


def _group_norm_recorded_grads(grad_out, x, num_groups, weight, bias, eps, activation, needs):
    """(dx, dw, db) as differentiable functions of grad_out and the inputs, for a
    backward under create_graph=True (double backward) or inside a torch.func
    transform: PyTorch's group_norm and activation, recomputed from the saved
    inputs (which keep their own history) in the kernels' precision (float32
    for half types), through torch.func.vjp (which composes with both).  The
    first-order values are PyTorch's, not our kernels'; those have no
    second-order form."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    shape = (1, x.shape[1]) + (1,) * (x.dim() - 2)
    wanted = [i for i, (t, need) in enumerate(zip((x, weight, bias), needs[0:1] + needs[2:4]))
              if t is not None and need]

    def group_norm(*tensors):
        inputs = [x, weight, bias]
        for i, t in zip(wanted, tensors):
            inputs[i] = t
        y = F.group_norm(inputs[0].to(compute), num_groups, None, None, eps)
        if inputs[1] is not None:
            y = y * inputs[1].to(compute).reshape(shape)
        if inputs[2] is not None:
            y = y + inputs[2].to(compute).reshape(shape)
        return _torch_activation(y, activation)

    _, vjp = torch.func.vjp(group_norm, *[(x, weight, bias)[i] for i in wanted])
    grads = dict(zip(wanted, vjp(grad_out.to(compute))))
    return tuple(grads.get(i) for i in range(3))


# ---------------------------------------------------------------------------
# Custom ops (what torch.compile traces).  The "cuda" and "cpu" kernels are the
# implementation functions above (which branch on the device: our kernels, or
# the NumPy references); the fake kernels build the same empty outputs (shapes,
# dtypes and strides) without computing.

_DEVICES = ("cuda", "cpu")

_IntList = typing.Sequence[int]
_OptTensor = typing.Optional[torch.Tensor]


@torch.library.custom_op("cupy_dwgn::depthwise_conv2d", mutates_args=(), device_types=_DEVICES)
def _op_depthwise(
    x: torch.Tensor, weight: torch.Tensor, bias: _OptTensor, stride: _IntList, padding: _IntList,
    dilation: _IntList,
) -> torch.Tensor:
    """Depthwise convolution; padding is (top, bottom, left, right)."""
    return _dw_forward(x, weight, bias, tuple(stride), tuple(padding), tuple(dilation))


@torch.library.custom_op("cupy_dwgn::depthwise_conv2d_backward_input", mutates_args=(), device_types=_DEVICES)
def _op_depthwise_backward_input(
    grad_out: torch.Tensor, weight: torch.Tensor, input_shape: _IntList, stride: _IntList,
    padding: _IntList, dilation: _IntList,
) -> torch.Tensor:
    return _dw_backward_input(grad_out, weight, tuple(input_shape), tuple(stride), tuple(padding), tuple(dilation))


@torch.library.custom_op("cupy_dwgn::depthwise_conv2d_backward_weight", mutates_args=(), device_types=_DEVICES)
def _op_depthwise_backward_weight(
    grad_out: torch.Tensor, x: torch.Tensor, weight_shape: _IntList, stride: _IntList,
    padding: _IntList, dilation: _IntList,
) -> torch.Tensor:
    return _dw_backward_weight(grad_out, x, tuple(weight_shape), tuple(stride), tuple(padding), tuple(dilation))


@torch.library.custom_op("cupy_dwgn::group_norm", mutates_args=(), device_types=_DEVICES)
def _op_group_norm(
    x: torch.Tensor, num_groups: int, weight: _OptTensor, bias: _OptTensor, eps: float, activation: str,
) -> typing.Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GroupNorm + activation of x (N, C, *spatial) -> (y, mean, rstd)."""
    return _gn_forward(x, num_groups, weight, bias, eps, activation)


@torch.library.custom_op("cupy_dwgn::group_norm_backward", mutates_args=(), device_types=_DEVICES)
def _op_group_norm_backward(
    grad_out: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, num_groups: int,
    weight: _OptTensor, bias: _OptTensor, eps: float, activation: str,
) -> typing.Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight, grad_bias); absent weight/bias give empty (0,) gradients.
    eps is used by the CPU kernel only (the reference recomputes its statistics)."""
    return _gn_backward(grad_out, x, mean, rstd, num_groups, weight, bias, eps, activation)


@_op_depthwise.register_fake
def _(x, weight, bias, stride, padding, dilation):
    return _forward_output(x, weight, tuple(padding), tuple(stride), tuple(dilation))


@_op_depthwise_backward_input.register_fake
def _(grad_out, weight, input_shape, stride, padding, dilation):
    return _backward_input_output(grad_out, input_shape)


@_op_depthwise_backward_weight.register_fake
def _(grad_out, x, weight_shape, stride, padding, dilation):
    return x.new_empty(tuple(weight_shape))


@_op_group_norm.register_fake
def _(x, num_groups, weight, bias, eps, activation):
    _check_group_norm_x(x)
    return _group_norm_outputs(x, num_groups)


@_op_group_norm_backward.register_fake
def _(grad_out, x, mean, rstd, num_groups, weight, bias, eps, activation):
    _check_group_norm_x(x)
    return _group_norm_grads(x, weight, bias)


def _depthwise_setup_context(ctx, inputs, output):
    x, weight, bias, stride, padding, dilation = inputs
    ctx.save_for_backward(x, weight)
    ctx.geometry = (tuple(stride), tuple(padding), tuple(dilation), bias is not None)


def _depthwise_backward(ctx, grad_out):
    x, weight = ctx.saved_tensors
    stride, pads, dilation, has_bias = ctx.geometry
    grads = _dw_grads(
        grad_out, x, weight, has_bias, ctx.needs_input_grad, stride, pads, dilation,
        _op_depthwise_backward_input, _op_depthwise_backward_weight,
    )
    return grads + (None, None, None)


def _group_norm_setup_context(ctx, inputs, output):
    x, num_groups, weight, bias, eps, activation = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.args = (num_groups, eps, activation)
    ctx.mark_non_differentiable(mean, rstd)


def _group_norm_backward(ctx, grad_out, grad_mean, grad_rstd):
    return _gn_grads(ctx, grad_out, _op_group_norm_backward)


_CUSTOM_OPS = (_op_depthwise, _op_depthwise_backward_input, _op_depthwise_backward_weight)
_op_depthwise.register_autograd(_depthwise_backward, setup_context=_depthwise_setup_context)
_op_depthwise_backward_input.register_autograd(
    lambda ctx, grad_grad_x: _grads_of_backward_input(ctx, grad_grad_x, _CUSTOM_OPS),
    setup_context=_save_backward_op)
_op_depthwise_backward_weight.register_autograd(
    lambda ctx, grad_grad_weight: _grads_of_backward_weight(ctx, grad_grad_weight, _CUSTOM_OPS),
    setup_context=_save_backward_op)
_op_group_norm.register_autograd(_group_norm_backward, setup_context=_group_norm_setup_context)


# ---------------------------------------------------------------------------
# Functionals.


def _autocast_conv(x, weight, bias):
    """Cast to the CUDA autocast dtype as PyTorch does for convolutions."""
    if torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
        if x.dtype in _AUTOCAST_ELIGIBLE and x.dtype != dtype:
            x = x.to(dtype)
        if weight.dtype in _AUTOCAST_ELIGIBLE and weight.dtype != dtype:
            weight = weight.to(dtype)
        if bias is not None and bias.dtype in _AUTOCAST_ELIGIBLE and bias.dtype != dtype:
            bias = bias.to(dtype)
    return x, weight, bias


def _depthwise(x, weight, bias, stride, pads, dilation):
    """stride, dilation: (h, w) ints; pads: (top, bottom, left, right) ints."""
    if _is_compiling():
        if x.is_cuda:
            x, weight, bias = _autocast_conv(x, weight, bias)
        return _op_depthwise(x, weight, bias, stride, pads, dilation)
    if x.is_cuda:
        x, weight, bias = _autocast_conv(x, weight, bias)
    return _eager_forward(x, weight, bias, stride, pads, dilation)


def depthwise_conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1):
    """Depthwise 2-D convolution, ``F.conv2d(x, weight, bias, stride, padding, dilation,
    groups=C)``, differentiable in x, weight and bias.

    Args:
        x: (N, C, H, W) float16, float32, float64 or bfloat16 tensor, CUDA (the
            cupy-dwgn kernels) or CPU (the float64 NumPy reference, slow).
            ``channels_last`` memory runs the NHWC kernels zero-copy and gives a
            ``channels_last`` output; other non-contiguous strides are copied.
        weight: (C*M, 1, KH, KW), x's dtype; M >= 1 is the depth multiplier
            (output channel c*M + m reads input channel c).
        bias: optional (C*M,), x's dtype.
        stride, dilation: int or (h, w).
        padding: int, (h, w), ((top, bottom), (left, right)), "same" (stride 1;
            an odd total puts the extra row/column after, as PyTorch) or "valid".

    Returns:
        (N, C*M, OH, OW) of x's dtype (under CUDA autocast: the autocast dtype).

    Example:
        >>> x = torch.randn(8, 32, 56, 56, device="cuda").to(memory_format=torch.channels_last)
        >>> w = torch.randn(32, 1, 3, 3, device="cuda", requires_grad=True)
        >>> y = depthwise_conv2d(x, w, padding="same")      # (8, 32, 56, 56), channels_last
        >>> y.sum().backward()
    """
    stride = _int_pair("stride", stride, 1)
    dilation = _int_pair("dilation", dilation, 1)
    if weight.dim() != 4:
        raise ValueError(f"weight: expected a 4-D tensor (C*M, 1, KH, KW), got shape {tuple(weight.shape)}")
    pads = _explicit_padding(padding, tuple(weight.shape[2:]), stride, dilation)
    return _depthwise(x, weight, bias, stride, pads, dilation)


def _fit_affine(x, weight, bias):
    """weight/bias in a dtype the kernels take: x's, or float32 for half x."""
    allowed = (x.dtype, torch.float32) if x.dtype in _HALF else (x.dtype,)
    w_dtype = weight.dtype if weight is not None else None
    b_dtype = bias.dtype if bias is not None else None
    if (w_dtype is None or w_dtype in allowed) and (b_dtype is None or b_dtype in allowed) and (
        w_dtype is None or b_dtype is None or w_dtype == b_dtype
    ):
        return weight, bias
    target = torch.float32 if x.dtype in _HALF else x.dtype
    return (
        None if weight is None else weight.to(target),
        None if bias is None else bias.to(target),
    )


def _torch_activation(y, activation):
    if activation == "identity":
        return y
    if activation == "relu":
        return F.relu(y)
    if activation == "silu":
        return F.silu(y)
    if activation == "gelu":
        return F.gelu(y)
    if activation == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    raise ValueError(f"activation: expected one of {', '.join(map(repr, ACTIVATIONS))}, got {activation!r}")


def _group_norm(x, num_groups, weight, bias, eps, activation):
    # A torch.func transform's x goes to the Function (its vmap rule; the kernels copy it to
    # channels-last where needed): vmap does not answer the memory-format query.
    wrapped = not _is_compiling() and _is_wrapped(x)  # (dynamo does not trace the query)
    if not wrapped and not _has_channels_last_memory(x):
        # Contiguous NCHW(D) with spatial > 1: PyTorch's own kernels (ours are channels-last).
        if weight is None and bias is not None:
            # A bias without a weight is added after PyTorch's group_norm: its own backward of
            # that form fails in torch 2.11 ("tensor does not have a device", seen on the CPU).
            shape = (1, x.shape[1]) + (1,) * (x.dim() - 2)
            y = F.group_norm(x, num_groups, None, None, eps) + bias.reshape(shape)
            return _torch_activation(y.to(x.dtype), activation)
        return _torch_activation(F.group_norm(x, num_groups, weight, bias, eps), activation)
    weight, bias = _fit_affine(x, weight, bias)
    if _is_compiling():
        return _op_group_norm(x, num_groups, weight, bias, eps, activation)[0]
    if _records(x, weight, bias):
        return _GroupNormFunction.apply(x, num_groups, weight, bias, eps, activation)[0]
    return _gn_forward(x, num_groups, weight, bias, eps, activation, need_stats=False)[0]


def _check_activation(activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {', '.join(map(repr, ACTIVATIONS))}, got {activation!r}")


def group_norm(x, num_groups, weight=None, bias=None, eps=1e-5, activation="identity"):
    """GroupNorm followed by an activation, ``act(F.group_norm(x, num_groups, weight,
    bias, eps))``, differentiable in x, weight and bias.

    Args:
        x: (N, C, *spatial) tensor (0 to 3 spatial dims; PyTorch's convention,
            channels at dim 1), float16, float32, float64 or bfloat16, CUDA or
            CPU (the float64 NumPy reference, slow).  When the channels are the
            fastest dimension in memory (``channels_last``, ``channels_last_3d``,
            (N, C), or no spatial extent) the channels-last kernels run
            zero-copy and y keeps x's memory format; a contiguous input with
            spatial > 1 falls back to PyTorch's group_norm + activation.
        num_groups: int dividing C.
        weight, bias: optional (C,), x's dtype, or float32 for float16/bfloat16
            x (other dtypes are cast to that).
        eps: added to the variance (biased, as in PyTorch).
        activation: "identity", "relu", "silu", "gelu" (erf) or "gelu_tanh".

    Returns:
        y of x's shape and dtype (also under autocast: see the module docstring).

    Example:
        >>> x = torch.randn(2, 320, 64, 64, device="cuda", dtype=torch.float16)
        >>> x = x.to(memory_format=torch.channels_last)
        >>> w = torch.ones(320, device="cuda"); b = torch.zeros(320, device="cuda")
        >>> y = group_norm(x, 32, w, b, activation="silu")   # (2, 320, 64, 64) float16, channels_last
    """
    _check_activation(activation)
    if not isinstance(num_groups, numbers.Integral) or isinstance(num_groups, bool):
        raise TypeError(f"num_groups: expected an int, got {type(num_groups).__name__}")
    if x.dim() < 2:
        raise ValueError(f"x: expected an (N, C, *spatial) tensor, got shape {tuple(x.shape)}")
    if num_groups <= 0 or x.shape[1] % num_groups != 0:
        raise ValueError(
            f"num_groups: expected a positive divisor of C (dim 1 of x, shape {tuple(x.shape)}), got {num_groups}"
        )
    # The core's eps check on every path (contiguous NCHW goes to PyTorch, which takes eps = 0 or a str).
    _checks._check_eps(eps, _eps_dtype(x.dtype))
    return _group_norm(x, int(num_groups), weight, bias, float(eps), activation)


def _eps_dtype(dtype):
    """The dtype whose statistics eps is checked in (cupy_dwgn._checks._check_eps) for a torch dtype."""
    return numpy.float64 if dtype == torch.float64 else numpy.float32


# ---------------------------------------------------------------------------
# Modules.


class DepthwiseConv2d(nn.Conv2d):
    """Depthwise 2-D convolution on cupy-dwgn's kernels: an ``nn.Conv2d`` with
    ``groups=in_channels`` (same parameters, state_dict keys and initialization)
    whose forward is :func:`depthwise_conv2d`.

    Args:
        in_channels: C.
        kernel_size: int or (KH, KW).
        stride, dilation: int or (h, w).
        padding: int, (h, w), ((top, bottom), (left, right)) (asymmetric),
            "same" or "valid".
        depth_multiplier: M; out_channels = C*M.
        bias: add a learnable (C*M,) bias.
        device, dtype: of the parameters.

    Shapes: x (N, C, H, W) -> (N, C*M, OH, OW); channels_last in, channels_last out.
    weight (C*M, 1, KH, KW).

    Example:
        >>> conv = DepthwiseConv2d(32, 3, padding=1, device="cuda")
        >>> y = conv(torch.randn(8, 32, 56, 56, device="cuda"))
        >>> conv = DepthwiseConv2d.from_module(torch.nn.Conv2d(32, 64, 5, padding=2, groups=32))
    """

    def __init__(self, in_channels, kernel_size, stride=1, padding=0, dilation=1, depth_multiplier=1,
                 bias=True, device=None, dtype=None):
        kernel_size = _int_pair("kernel_size", kernel_size, 1)
        stride = _int_pair("stride", stride, 1)
        dilation = _int_pair("dilation", dilation, 1)
        if not isinstance(depth_multiplier, numbers.Integral) or isinstance(depth_multiplier, bool):
            raise TypeError(f"depth_multiplier: expected an int, got {type(depth_multiplier).__name__}")
        if depth_multiplier < 1:
            raise ValueError(f"depth_multiplier: expected an int >= 1, got {depth_multiplier!r}")
        depth_multiplier = int(depth_multiplier)
        pads = _explicit_padding(padding, kernel_size, stride, dilation)
        symmetric = isinstance(padding, str) or (pads[0] == pads[1] and pads[2] == pads[3])
        super().__init__(
            in_channels, in_channels * depth_multiplier, kernel_size, stride=stride,
            padding=padding if isinstance(padding, str) else ((pads[0], pads[2]) if symmetric else 0),
            dilation=dilation, groups=in_channels, bias=bias, padding_mode="zeros", device=device, dtype=dtype,
        )
        if not symmetric:
            self.padding = _core_padding(pads)  # nn.Conv2d has no asymmetric padding; shown by repr
        self.depth_multiplier = depth_multiplier
        self._pads = pads

    def forward(self, x):
        return _depthwise(x, self.weight, self.bias, self.stride, self._pads, self.dilation)

    def extra_repr(self):
        s = f"{self.in_channels}, kernel_size={self.kernel_size}, stride={self.stride}"
        if self.padding != (0, 0):
            s += f", padding={self.padding!r}"
        if self.dilation != (1, 1):
            s += f", dilation={self.dilation}"
        if self.depth_multiplier != 1:
            s += f", depth_multiplier={self.depth_multiplier}"
        if self.bias is None:
            s += ", bias=False"
        return s

    @classmethod
    def from_module(cls, conv):
        """A DepthwiseConv2d sharing ``conv``'s parameters (same tensors: same values,
        device and dtype; an optimizer holding them keeps working).

        conv: an ``nn.Conv2d`` with ``groups == in_channels`` and ``padding_mode="zeros"``.
        """
        if not isinstance(conv, nn.Conv2d):
            raise TypeError(f"conv: expected a torch.nn.Conv2d, got {type(conv).__name__}")
        if conv.groups != conv.in_channels or conv.padding_mode != "zeros":
            raise ValueError(
                "conv: expected a depthwise convolution (groups == in_channels) with "
                f"padding_mode='zeros', got groups={conv.groups}, in_channels={conv.in_channels}, "
                f"padding_mode={conv.padding_mode!r}"
            )
        new = cls(
            conv.in_channels, conv.kernel_size, stride=conv.stride, padding=conv.padding,
            dilation=conv.dilation, depth_multiplier=conv.out_channels // conv.in_channels,
            bias=conv.bias is not None, device="meta", dtype=conv.weight.dtype,
        )
        new.weight = conv.weight
        new.bias = conv.bias
        new.train(conv.training)
        return new


class GroupNorm(nn.GroupNorm):
    """GroupNorm + fused activation on cupy-dwgn's channels-last kernels: an
    ``nn.GroupNorm`` (same parameters, state_dict keys and initialization: weight
    1, bias 0) whose forward is :func:`group_norm` with ``activation``.

    Args:
        num_groups: dividing num_channels.
        num_channels: C.
        eps: added to the variance.
        affine: learnable (C,) weight and bias.
        activation: "identity", "relu", "silu", "gelu" or "gelu_tanh", applied
            after the affine transform.
        device, dtype: of the parameters (float32 parameters with float16 /
            bfloat16 inputs are mixed precision, supported as they are).

    Shapes: x (N, C, *spatial) -> the same; channels_last(_3d) runs the kernels
    zero-copy (a contiguous input with spatial > 1 falls back to PyTorch).

    Example:
        >>> gn = GroupNorm(32, 320, activation="silu", device="cuda")
        >>> x = torch.randn(2, 320, 64, 64, device="cuda").to(memory_format=torch.channels_last)
        >>> y = gn(x)                                  # silu(group_norm(x)), channels_last
        >>> gn = GroupNorm.from_module(torch.nn.GroupNorm(32, 320), activation="silu")
    """

    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True, activation="identity",
                 device=None, dtype=None):
        _check_activation(activation)
        _checks._check_eps(eps, _eps_dtype(dtype))
        super().__init__(num_groups, num_channels, eps=eps, affine=affine, device=device, dtype=dtype)
        self.activation = activation

    def forward(self, x):
        return _group_norm(x, self.num_groups, self.weight, self.bias, float(self.eps), self.activation)

    def extra_repr(self):
        s = super().extra_repr()
        if self.activation != "identity":
            s += f", activation={self.activation!r}"
        return s

    @classmethod
    def from_module(cls, group_norm, activation="identity"):
        """A GroupNorm sharing ``group_norm``'s parameters (same tensors), with ``activation``."""
        if not isinstance(group_norm, nn.GroupNorm):
            raise TypeError(f"group_norm: expected a torch.nn.GroupNorm, got {type(group_norm).__name__}")
        new = cls(
            group_norm.num_groups, group_norm.num_channels, eps=group_norm.eps, affine=group_norm.affine,
            activation=activation, device="meta",
            dtype=group_norm.weight.dtype if group_norm.affine else None,
        )
        if group_norm.affine:
            new.weight = group_norm.weight
            new.bias = group_norm.bias
        new.train(group_norm.training)
        return new


# ---------------------------------------------------------------------------
# convert()


def _qualified_name(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


# nn.GroupNorm subclasses whose forward is plain F.group_norm (timm's, the
# "fast norm" variant included: it computes the same GroupNorm).
_PLAIN_GROUP_NORMS = {"timm.layers.norm.GroupNorm", "timm.layers.norm.GroupNorm1"}
# timm's GroupNorm with a built-in activation (GroupNorm -> drop -> act).
_GROUP_NORM_ACTS = {"timm.layers.norm_act.GroupNormAct", "timm.layers.norm_act.GroupNorm1Act"}
# Activation modules that map to a fused activation.
_ACTIVATION_NAMES = {
    "timm.layers.activations.GELU": "gelu",
    "timm.layers.activations.GELUTanh": "gelu_tanh",
}


def _activation_of(module):
    """The fused activation name equivalent to ``module``, or None."""
    cls = type(module)
    if cls is nn.ReLU:
        return "relu"
    if cls is nn.SiLU:
        return "silu"
    if cls is nn.GELU:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(module.approximate)
    if cls is nn.Identity:
        return "identity"
    return _ACTIVATION_NAMES.get(_qualified_name(cls))


def _plain(m):
    """No parametrization, no hooks, real Parameters: swapping the module keeps its behavior
    (a weight-normalized or spectral-normed layer, or one with hooks, is left alone)."""
    return (
        not torch.nn.utils.parametrize.is_parametrized(m)
        and not m._forward_hooks
        and not m._forward_pre_hooks
        and all(
            p is None or isinstance(p, nn.Parameter) for p in (getattr(m, "weight", None), getattr(m, "bias", None))
        )
    )


def _convertible_conv(m):
    return (
        isinstance(m, nn.Conv2d)
        and not isinstance(m, DepthwiseConv2d)
        and _plain(m)
        and type(m).forward is nn.Conv2d.forward  # a subclass with its own forward (e.g. timm's
        and type(m)._conv_forward is nn.Conv2d._conv_forward  # Conv2dSame) is left alone
        and m.groups == m.in_channels
        and m.in_channels > 0
        and m.padding_mode == "zeros"
        and not isinstance(m.weight, nn.parameter.UninitializedParameter)
        and m.weight.dtype in _NUMPY_DTYPES
    )


def _convertible_group_norm(m):
    if not isinstance(m, nn.GroupNorm) or isinstance(m, GroupNorm) or not _plain(m):
        return None
    if m.affine and m.weight.dtype not in _NUMPY_DTYPES:
        return None
    cls = type(m)
    if cls.forward is nn.GroupNorm.forward or _qualified_name(cls) in _PLAIN_GROUP_NORMS:
        return "identity"
    if _qualified_name(cls) in _GROUP_NORM_ACTS and type(getattr(m, "drop", None)) is nn.Identity:
        return _activation_of(getattr(m, "act", None))
    return None


def convert(model, fuse_activations=True):
    """Swap the depthwise convolutions and GroupNorms of ``model`` for cupy-dwgn's, in place.

    * every ``nn.Conv2d`` with ``groups == in_channels`` and ``padding_mode="zeros"``
      (whose class keeps nn.Conv2d's forward) -> :class:`DepthwiseConv2d`;
    * every ``nn.GroupNorm`` (and timm's GroupNorm / GroupNorm1 / GroupNormAct with
      a ReLU/SiLU/GELU) -> :class:`GroupNorm`;
    * with ``fuse_activations``, an ``nn.ReLU`` / ``nn.SiLU`` / ``nn.GELU`` directly
      after a GroupNorm in an ``nn.Sequential`` is fused into it and replaced by
      ``nn.Identity`` (indices stay valid).  Fusion needs that structure: a
      GroupNorm called from a custom forward keeps its separate activation.

    The new modules share the old ones' parameters (same tensors, values, device
    and dtype; an optimizer built before keeps working) and training mode; a module
    used at several places stays one shared module.  Other convolutions and modules
    are left alone.

    Returns:
        model (converted in place; returned for chaining), or the converted module
        when ``model`` itself is one of the swapped types.

    Example:
        >>> model = torchvision.models.mobilenet_v3_small()
        >>> convert(model).cuda().to(memory_format=torch.channels_last)
    """
    counts = {}
    for _, m in model.named_modules(remove_duplicate=False):
        counts[id(m)] = counts.get(id(m), 0) + 1
    done = {}
    root = _convert_module(model, done, counts)
    _convert_children(root, done, fuse_activations, counts)
    return root


def _convert_module(m, done, counts):
    entry = done.get(id(m))
    if entry is not None:
        return entry[1]
    new = m
    if _convertible_conv(m):
        new = DepthwiseConv2d.from_module(m)
    else:
        activation = _convertible_group_norm(m)
        if activation is not None:
            new = GroupNorm.from_module(m, activation=activation)
    done[id(m)] = (m, new)  # holds m: its id stays unique while we work
    counts[id(new)] = counts.get(id(m), 1)
    return new


def _convert_children(module, done, fuse, counts, visited=None):
    visited = set() if visited is None else visited
    if id(module) in visited:
        return
    visited.add(id(module))
    for name, child in list(module.named_children()):
        new = _convert_module(child, done, counts)
        if new is not child:
            setattr(module, name, new)
        _convert_children(new, done, fuse, counts, visited)
    if fuse and isinstance(module, nn.Sequential):
        items = list(module._modules.items())
        for (_, norm), (next_name, act) in zip(items, items[1:]):
            if (
                isinstance(norm, GroupNorm)
                and norm.activation == "identity"
                and counts.get(id(norm), 1) == 1  # fusing a shared module would change its other uses
                and act is not None
                and type(act) is not nn.Identity
                and _activation_of(act) is not None
            ):
                norm.activation = _activation_of(act)
                module._modules[next_name] = nn.Identity()
