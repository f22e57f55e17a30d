"""JAX arrays in, JAX arrays out: cupy-dwgn's depthwise convolution and
channels-last GroupNorm for JAX, differentiable with ``jax.grad``.

Example:
    >>> import jax, jax.numpy as jnp
    >>> import cupy_dwgn.jax as dwj
    >>> k0, k1 = jax.random.split(jax.random.key(0))
    >>> x = jax.random.normal(k0, (8, 32, 56, 56), jnp.float32)       # NCHW, on the GPU
    >>> w = jax.random.normal(k1, (32, 1, 3, 3), jnp.float32)
    >>> y = dwj.depthwise_conv2d(x, w, padding=1)                      # a jax.Array
    >>> dw = jax.grad(lambda w: dwj.depthwise_conv2d(x, w, padding=1).sum())(w)

How a call runs:

* Eagerly (concrete arrays; ``jax.grad`` and ``jax.vjp`` without ``jit``
  stay eager): the JAX arrays are viewed as CuPy arrays without a copy
  (``cupy.from_dlpack``), the kernels launch on the current CuPy stream and
  the results go back through ``jax.numpy.from_dlpack``.  The DLPack
  protocol orders the streams both ways (CuPy's stream waits for JAX's
  producer, JAX waits for our kernels); the views of JAX's buffers are held
  until the kernels that read them have finished.
* Under ``jax.jit`` (and ``vmap``, ``grad`` of ``jit``, ``lax.scan`` ...):
  the values are tracers, with no device buffer to hand to a kernel.  The op
  then becomes an XLA custom call through ``jax.experimental.buffer_callback``:
  at run time XLA calls back into Python with its own device buffers and its
  CUDA stream, and the same kernels launch on that stream writing XLA's output
  buffers in place (no copy, no host round trip; the cost per call is a
  Python callback).  ``vmap`` runs the op once per example.  Where
  ``buffer_callback`` is missing (older JAX) a traced call raises TypeError:
  without it, a jitted program can only reach these kernels through a
  compiled XLA FFI handler registered with ``jax.ffi.register_ffi_target``,
  which cupy-dwgn (NVRTC at run time, no build step) does not ship, or
  through ``jax.pure_callback``, which copies every operand through host
  memory.

The gradients come from ``jax.custom_vjp`` rules that call cupy-dwgn's own
backward kernels (``depthwise_conv2d_backward_input`` / ``_weight``,
``group_norm_backward``); the depthwise bias gradient is a JAX sum.
Higher-order derivatives (``jax.hessian``, ``jax.grad`` of ``jax.grad``,
``jax.jvp`` of a gradient) work: the depthwise backward's own rule is the
same kernels again, to any order; GroupNorm's second-order rules
differentiate the same GroupNorm written in JAX's ops (float32 math for
half types), recomputed from the inputs.  Forward-mode ``jax.jvp`` of the ops
themselves is not defined (``jax.custom_vjp``).
float64 needs ``jax.config.update("jax_enable_x64", True)``.
"""

import collections
import contextlib
import ctypes
import functools
import math
import numbers

import numpy

try:
    import jax
    import jax.numpy as jnp
except ImportError as _error:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        f"cupy_dwgn.jax needs JAX ({_error}). Install JAX with CUDA support, e.g. "
        "pip install -U 'jax[cuda13]' (or 'jax[cuda12]', matching your driver); "
        "the rest of cupy_dwgn (CuPy, NumPy, PyTorch) works without it."
    ) from _error

from . import _dtypes, _interop, _validate

try:
    from jax.experimental.buffer_callback import buffer_callback as _buffer_callback
except ImportError:  # JAX without it: traced calls raise TypeError (see the module docstring)
    _buffer_callback = None

try:
    _Tracer = jax.core.Tracer
except AttributeError:  # pragma: no cover - jax.core pruned in some future JAX
    from jax._src.core import Tracer as _Tracer

__all__ = ["depthwise_conv2d", "group_norm"]

_CUDA_DEVICE_TYPES = (2, 13)  # DLPack kDLCUDA, kDLCUDAManaged
_BFLOAT16 = numpy.dtype(jnp.bfloat16)


def _core():
    """The cupy-dwgn GPU ops (a module attribute lookup, so tests can swap them)."""
    import cupy_dwgn

    return cupy_dwgn


# ---------------------------------------------------------------------------
# Public ops


def depthwise_conv2d(x, weight, bias=None, *, stride=1, padding=0, dilation=1, layout="NCHW"):
    """Depthwise 2-D convolution of JAX arrays (cross-correlation, as
    ``jax.lax.conv_general_dilated`` with ``feature_group_count=C``), with a
    ``jax.custom_vjp`` so ``jax.grad`` works (with respect to x, weight and bias).

    Args:
        x: jax.Array on a CUDA GPU, (N, C, H, W) for ``layout="NCHW"`` or
            (N, H, W, C) for ``layout="NHWC"``; float16, float32, bfloat16
            (float64 with ``jax_enable_x64``).
        weight: (C*M, 1, KH, KW), x's dtype; output channel ``c*M + m`` reads
            input channel ``c``.
        bias: optional (C*M,), x's dtype.
        stride, dilation: int or (h, w).
        padding: int, (h, w), ((top, bottom), (left, right)), ``"same"`` or ``"valid"``.
        layout: ``"NCHW"`` or ``"NHWC"`` (the weight is (C*M, 1, KH, KW) in both).

    Returns:
        jax.Array (N, C*M, OH, OW) (NHWC: (N, OH, OW, C*M)) of x's dtype, on x's device.

    Example:
        >>> y = depthwise_conv2d(x, w, padding=1)                    # (8, 32, 56, 56)
        >>> grads = jax.grad(lambda x, w: depthwise_conv2d(x, w, padding=1).sum(), argnums=(0, 1))(x, w)
    """
    layout = _validate.check_layout(layout)
    op = _static(_depthwise_op, stride=_freeze(stride), padding=_freeze(padding), dilation=_freeze(dilation),
                 layout=layout)
    return op(_as_jax(x), _as_jax(weight), _as_jax(bias))


def group_norm(x, num_groups, weight=None, bias=None, *, eps=1e-5, activation="identity"):
    """Channels-last GroupNorm followed by an activation,
    ``y = act((x - mean) * rstd * weight + bias)``, on JAX arrays, with a
    ``jax.custom_vjp`` so ``jax.grad`` works (with respect to x, weight and bias).

    Args:
        x: jax.Array on a CUDA GPU, (N, *spatial, C) with 0 to 3 spatial dims
            (channels last); float16, float32, bfloat16 (float64 with ``jax_enable_x64``).
        num_groups: int dividing C.
        weight, bias: optional (C,) arrays: x's dtype, or float32 for
            float16/bfloat16 x (mixed precision); their gradients come in their dtype.
        eps: added to the (biased) variance.
        activation: "identity", "relu", "silu", "gelu" or "gelu_tanh".

    Returns:
        y: jax.Array of x's shape and dtype.  Statistics accumulate in float32
        (float64 for float64).

    Example:
        >>> h = jax.random.normal(key, (2, 64, 64, 320), jnp.bfloat16)      # NHWC
        >>> g, b = jnp.ones(320, jnp.float32), jnp.zeros(320, jnp.float32)
        >>> y = group_norm(h, 32, g, b, activation="silu")
        >>> dh, dg, db = jax.grad(lambda h, g, b: group_norm(h, 32, g, b, activation="silu")
        ...                       .astype(jnp.float32).sum(), argnums=(0, 1, 2))(h, g, b)
    """
    op = _static(_group_norm_op, num_groups=num_groups, eps=eps, activation=activation)
    return op(_as_jax(x), _as_jax(weight), _as_jax(bias))


# ---------------------------------------------------------------------------
# The custom_vjp functions, one per static configuration (cached: JAX's own
# caches key on these function objects and on the callbacks they hold).


@functools.lru_cache(maxsize=256)
def _depthwise_op(stride, padding, dilation, layout):
    options = {"stride": stride, "padding": padding, "dilation": dilation, "layout": layout}
    bias_axes = (0, 2, 3) if layout == "NCHW" else (0, 1, 2)

    def forward_body(x, weight, bias, out=None):
        return (_core().depthwise_conv2d(x, weight, bias, out=out, **options),)

    def backward_body(grad, x, weight, grad_x=None, grad_weight=None):
        core = _core()
        return (
            core.depthwise_conv2d_backward_input(grad, weight, x.shape, out=grad_x, **options),
            core.depthwise_conv2d_backward_weight(grad, x, weight.shape, out=grad_weight, **options),
        )

    forward_callback = _callback(forward_body)
    backward_callback = _callback(backward_body)

    def forward(x, weight, bias):
        arrays = (x, weight, bias)
        if _traced(arrays):
            g = _validate.conv_geometry(x.shape, weight.shape, stride, padding, dilation, layout=layout)
            shape = _validate.layout_shape(layout, g.batch, g.channels * g.multiplier, g.out_height, g.out_width)
            return _traced_call("depthwise_conv2d", forward_callback, arrays, [(shape, x.dtype)])[0]
        return _eager_call(forward_body, arrays)[0]

    def backward(grad, x, weight):
        arrays = (grad, x, weight)
        if _traced(arrays):
            specs = [(x.shape, x.dtype), (weight.shape, weight.dtype)]
            return tuple(_traced_call("depthwise_conv2d (backward)", backward_callback, arrays, specs))
        return _eager_call(backward_body, arrays)

    @jax.custom_vjp
    def op(x, weight, bias):
        return forward(x, weight, bias)

    def op_bwd(residuals, grad):
        x, weight, bias = residuals
        grad = _on_device_of(grad, x)
        grad_x, grad_weight = backward_pair(grad, x, weight)
        grad_bias = None
        if bias is not None:
            grad_bias = jnp.sum(grad, axis=bias_axes, dtype=_accumulator(grad.dtype)).astype(bias.dtype)
        return grad_x, grad_weight, grad_bias

    # (backward_input(grad, weight), backward_weight(grad, x)), differentiable:
    # both are linear in each argument, and for cotangents (gg_x, gg_weight)
    # grad gets op(gg_x, weight) + op(x, gg_weight), while x and weight get
    # backward_pair(grad, gg_x, gg_weight) = (backward_input(grad, gg_weight),
    # backward_weight(grad, gg_x)): the same kernels, to any order.
    @jax.custom_vjp
    def backward_pair(grad, x, weight):
        return backward(grad, x, weight)

    def backward_pair_bwd(residuals, cotangents):
        grad, x, weight = residuals
        grad_grad_x, grad_grad_weight = (_on_device_of(c, x) for c in cotangents)
        d_x, d_weight = backward_pair(grad, grad_grad_x, grad_grad_weight)
        return op(grad_grad_x, weight, None) + op(x, grad_grad_weight, None), d_x, d_weight

    # (op itself in its fwd rule, not forward: a higher-order derivative differentiates the rule too)
    op.defvjp(_keeping_inputs(op), op_bwd)
    backward_pair.defvjp(_keeping_inputs(backward_pair), backward_pair_bwd)
    return op


@functools.lru_cache(maxsize=256)
def _group_norm_op(num_groups, eps, activation):
    def forward_body(x, weight, bias, out=None, mean_out=None, rstd_out=None):
        return _core().group_norm(
            x, num_groups, weight, bias, eps=eps, activation=activation,
            out=out, mean_out=mean_out, rstd_out=rstd_out, return_stats=True,
        )

    def primal_body(x, weight, bias):  # eager, no gradient wanted: y only
        return (_core().group_norm(x, num_groups, weight, bias, eps=eps, activation=activation),)

    def backward_body(grad, x, mean, rstd, weight, bias, *outs):
        # outs: none (eager: the op allocates), or XLA's buffers for dx and for the gradients of the
        # parameters present, in that order (a bias without a weight: its buffer comes second).
        outs = list(outs)
        grad_x = outs.pop(0) if outs else None
        grad_weight = outs.pop(0) if outs and weight is not None else None
        grad_bias = outs.pop(0) if outs and bias is not None else None
        return _core().group_norm_backward(
            grad, x, mean, rstd, num_groups, weight, bias, activation=activation,
            out=grad_x, grad_weight_out=grad_weight, grad_bias_out=grad_bias,
        )

    forward_callback = _callback(forward_body)
    backward_callback = _callback(backward_body)

    def forward(x, weight, bias):
        arrays = (x, weight, bias)
        if _traced(arrays):
            if (x.ndim < 2 or not isinstance(num_groups, numbers.Integral) or isinstance(num_groups, bool)
                    or num_groups <= 0 or x.shape[-1] % num_groups):
                raise ValueError(
                    f"num_groups: expected a positive int dividing C = {x.shape[-1] if x.ndim else None} "
                    f"(the last dim of x, shape {tuple(x.shape)}), got {num_groups!r}"
                )
            stats = ((x.shape[0], num_groups), _accumulator(x.dtype))
            return _traced_call("group_norm", forward_callback, arrays, [(x.shape, x.dtype), stats, stats])
        return _eager_call(forward_body, arrays)

    def backward(grad, x, weight, bias, mean, rstd):
        arrays = (grad, x, mean, rstd, weight, bias)
        if _traced(arrays):
            specs = [(x.shape, x.dtype)]
            specs += [(a.shape, a.dtype) for a in (weight, bias) if a is not None]
            grads = list(_traced_call("group_norm (backward)", backward_callback, arrays, specs))
            grad_x = grads.pop(0)
            grad_weight = None if weight is None else grads.pop(0)
            grad_bias = None if bias is None else grads.pop(0)
            return grad_x, grad_weight, grad_bias
        return _eager_call(backward_body, arrays)

    @jax.custom_vjp
    def op(x, weight, bias):
        if _traced((x, weight, bias)):
            return forward(x, weight, bias)[0]
        return _eager_call(primal_body, (x, weight, bias))[0]

    def op_fwd(x, weight, bias):
        y, mean, rstd = forward_with_stats(x, weight, bias)
        return y, (x, weight, bias, mean, rstd)

    def op_bwd(residuals, grad):
        x, weight, bias, mean, rstd = residuals
        return backward_grads(_on_device_of(grad, x), x, weight, bias, mean, rstd)

    # Higher-order derivatives differentiate op_fwd and op_bwd, whose kernels
    # have no second-order form: their rules below differentiate the same
    # GroupNorm written in JAX's ops (_group_norm_in_jax), recomputed from the
    # inputs (the statistics as functions of x, so mean and rstd get no
    # cotangent of their own in backward_grads).
    def in_jax(x, weight, bias):
        return _group_norm_in_jax(x, num_groups, weight, bias, eps, activation)

    @jax.custom_vjp
    def forward_with_stats(x, weight, bias):
        return forward(x, weight, bias)

    def forward_with_stats_bwd(residuals, cotangents):
        return jax.vjp(in_jax, *residuals)[1](cotangents)

    @jax.custom_vjp
    def backward_grads(grad, x, weight, bias, mean, rstd):
        return backward(grad, x, weight, bias, mean, rstd)

    def backward_grads_bwd(residuals, cotangents):
        grad, x, weight, bias, mean, rstd = residuals

        def first_order(grad, x, weight, bias):
            return jax.vjp(lambda *inputs: in_jax(*inputs)[0], x, weight, bias)[1](grad)

        grads = jax.vjp(first_order, grad, x, weight, bias)[1](cotangents)
        return grads + (jnp.zeros_like(mean), jnp.zeros_like(rstd))

    op.defvjp(op_fwd, op_bwd)
    forward_with_stats.defvjp(_keeping_inputs(forward_with_stats), forward_with_stats_bwd)
    backward_grads.defvjp(_keeping_inputs(backward_grads), backward_grads_bwd)
    return op


_JAX_ACTIVATIONS = {
    "identity": lambda y: y,
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "gelu": lambda y: jax.nn.gelu(y, approximate=False),
    "gelu_tanh": lambda y: jax.nn.gelu(y, approximate=True),
}


def _group_norm_in_jax(x, num_groups, weight, bias, eps, activation):
    """(y, mean, rstd) of GroupNorm + activation in JAX's own ops, in the
    kernels' precision (float32 statistics and math for float16 / bfloat16 /
    float32 x, float64 for float64): what higher-order derivatives
    differentiate."""
    compute = _accumulator(x.dtype)
    groups = x.astype(compute).reshape(x.shape[0], -1, num_groups, x.shape[-1] // num_groups)
    mean = groups.mean(axis=(1, 3))
    centred = groups - mean[:, None, :, None]
    rstd = jax.lax.rsqrt((centred * centred).mean(axis=(1, 3)) + jnp.asarray(eps, compute))
    y = (centred * rstd[:, None, :, None]).reshape(x.shape)
    if weight is not None:
        y = y * weight.astype(compute)
    if bias is not None:
        y = y + bias.astype(compute)
    return _JAX_ACTIVATIONS[activation](y).astype(x.dtype), mean, rstd


# ---------------------------------------------------------------------------
# Eager calls: DLPack views of JAX's buffers, kernels on the current CuPy stream.


def _on_device_of(value, like):
    """``value`` on ``like``'s device.  JAX makes an uncommitted cotangent (the
    ones of a ``.sum()``) on the default device, whatever device the primal
    lives on; the backward kernels need both on one GPU."""
    if _traced((value, like)):
        return value
    devices = like.devices()
    if value.devices() != devices:
        value = jax.device_put(value, next(iter(devices)))
    return value


def _eager_call(body, arrays):
    """``body(*cupy views of arrays)`` on the arrays' GPU; its results (a
    tuple, None entries kept) back as JAX arrays."""
    device_ids = [_device_id(a) for a in arrays if a is not None]
    with _on_device(device_ids[0]):
        views = [None if a is None else _to_cupy(a) for a in arrays]
        results = body(*views)
        _hold_until_done(views)
        return tuple(None if r is None else _from_cupy(r) for r in results)


def _device_id(array):
    """The CUDA device of a single-device JAX array (ValueError otherwise)."""
    try:
        device_type, device_id = array.__dlpack_device__()
    except Exception as error:  # e.g. an array sharded over several devices
        raise ValueError(
            f"expected a JAX array on one CUDA GPU, got one on {_devices(array)} ({error})"
        ) from None
    if device_type not in _CUDA_DEVICE_TYPES:
        raise ValueError(
            f"expected a JAX array on a CUDA GPU, got one on {_devices(array)}: cupy-dwgn's kernels "
            "run on NVIDIA GPUs (jax.device_put(x, jax.devices('gpu')[0]))"
        )
    return device_id


def _devices(array):
    try:
        return ", ".join(str(d) for d in array.devices())
    except Exception:
        return type(array).__name__


@contextlib.contextmanager
def _on_device(device_id):
    import cupy

    if device_id is None or cupy.cuda.runtime.getDevice() == device_id:
        yield
    else:
        with cupy.cuda.Device(device_id):
            yield


def _to_cupy(array):
    """A cupy.ndarray viewing a JAX array's device buffer (DLPack, no copy)."""
    import cupy

    try:
        return cupy.from_dlpack(array)
    except Exception:
        if array.dtype != _BFLOAT16:
            raise
        # A CuPy without DLPack bfloat16: view the bits as uint16 (one XLA copy).
        return cupy.from_dlpack(jax.lax.bitcast_convert_type(array, jnp.uint16)).view(_BFLOAT16)


def _jax_from_dlpack(array):
    from_dlpack = getattr(jnp, "from_dlpack", None)
    if from_dlpack is None:  # pragma: no cover - older JAX spelling
        from_dlpack = jax.dlpack.from_dlpack
    return from_dlpack(array)


def _from_cupy(array):
    """A JAX array over a cupy.ndarray's memory (DLPack; JAX's stream waits
    for the current CuPy stream)."""
    try:
        return _jax_from_dlpack(array)
    except Exception:
        if array.dtype != _BFLOAT16:
            raise
        # A CuPy that cannot export bfloat16 through DLPack: move the bits as uint16.
        return jax.lax.bitcast_convert_type(_jax_from_dlpack(array.view(numpy.uint16)), jnp.bfloat16)


#: (event, views) of eager calls whose kernels may still be running: a view
#: holds its JAX buffer (the DLPack capsule), so XLA cannot free and reuse
#: that memory under a kernel still reading it on the CuPy stream.
_PENDING = collections.deque()
_MAX_PENDING = 1024


def _hold_until_done(views):
    import cupy

    event = cupy.cuda.Event(block=False, disable_timing=True)
    event.record()
    _PENDING.append((event, views))
    while _PENDING and _PENDING[0][0].done:
        _PENDING.popleft()
    if len(_PENDING) > _MAX_PENDING:
        _PENDING.popleft()[0].synchronize()


# ---------------------------------------------------------------------------
# Traced calls (jit, vmap, ...): an XLA custom call through buffer_callback.


def _traced(arrays):
    return any(isinstance(a, _Tracer) for a in arrays)


def _traced_call(name, callback, arrays, specs):
    """Bind ``callback`` as an XLA custom call on ``arrays``; returns one JAX
    value per ``(shape, dtype)`` of ``specs``."""
    if _buffer_callback is None:
        tracer = next(a for a in arrays if isinstance(a, _Tracer))
        raise TypeError(
            f"cupy_dwgn.jax.{name}: got a JAX tracer ({type(tracer).__name__}) instead of a concrete "
            "array: it was called under jax.jit (or vmap, scan, ...), which this JAX cannot run it "
            "under. cupy-dwgn launches its kernels through CuPy on concrete device buffers at call "
            "time, while jit traces the function into an XLA program of abstract values; reaching "
            "the kernels from inside that program needs jax.experimental.buffer_callback (in "
            "recent JAX; absent from this one), a compiled XLA FFI handler registered with "
            "jax.ffi.register_ffi_target (cupy-dwgn compiles its kernels with NVRTC at run time and "
            "ships no such handler), or jax.pure_callback (copies every operand through host "
            "memory). Call it outside jit: eager jax.grad works through its custom_vjp. Or "
            "upgrade JAX."
        )
    out_specs = tuple(jax.ShapeDtypeStruct(tuple(shape), dtype) for shape, dtype in specs)
    call = _buffer_callback(callback, out_specs, vmap_method="sequential")
    return call(*arrays)


def _callback(body):
    """A buffer_callback callback running ``body(*input views, *output
    views)`` on XLA's stream, writing XLA's output buffers in place."""

    def callback(ctx, outs, *ins):
        buffers = [b for b in ins if b is not None] + list(outs)
        with _callback_context(ctx, buffers):
            body(*[None if b is None else _view(b) for b in ins], *[_view(b) for b in outs])

    return callback


_STREAMS = {}  # (device, stream address) -> CuPy stream object (_interop.external_stream)


@contextlib.contextmanager
def _callback_context(ctx, buffers):
    """The buffers' device and XLA's stream made CuPy's current ones."""
    import cupy

    device_type, device_id = buffers[0].__dlpack_device__()
    if device_type not in _CUDA_DEVICE_TYPES:
        raise ValueError(
            f"cupy_dwgn.jax: the jitted computation runs on a non-CUDA device (DLPack device type "
            f"{device_type}); cupy-dwgn's kernels run on NVIDIA GPUs only"
        )
    address = ctx.stream
    address = address() if callable(address) else address  # a method in some JAX versions
    key = (device_id, int(address))
    stream = _STREAMS.get(key)
    if stream is None:
        stream = _STREAMS[key] = _interop.external_stream(cupy, int(address), device_id)
    with _on_device(device_id), stream:
        yield


_get_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_capsule_pointer.restype = ctypes.c_void_p
_get_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _view(buffer):
    """A cupy.ndarray over an XLA buffer of a buffer_callback (no copy)."""
    import cupy

    dtype = numpy.dtype(buffer.dtype)
    shape = tuple(buffer.shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return cupy.ndarray(shape, dtype)
    memory = cupy.cuda.UnownedMemory(_buffer_pointer(buffer), nbytes, buffer, buffer.__dlpack_device__()[1])
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0))


def _buffer_pointer(buffer):
    """The device address of a buffer_callback Buffer."""
    try:
        return buffer.__cuda_array_interface__["data"][0]
    except Exception:  # no CUDA typestr for its dtype (bfloat16), or not a CUDA buffer
        # The data field of the (unversioned) DLPack tensor: DLManagedTensor
        # starts with a DLTensor, which starts with ``void* data``.
        capsule = buffer.__dlpack__()
        return ctypes.c_void_p.from_address(_get_capsule_pointer(capsule, b"dltensor")).value


# ---------------------------------------------------------------------------
# Small helpers


def _static(factory, **options):
    """The op for these static options (Python values, part of the cache key)."""
    try:
        return factory(**options)
    except TypeError:  # unhashable: a JAX/NumPy array, a dict, ...
        names = ", ".join(f"{k}={v!r}" for k, v in options.items())
        raise TypeError(
            f"cupy_dwgn.jax: expected Python values (ints, floats, strings, tuples) for the static "
            f"arguments, got {names}"
        ) from None


def _as_jax(value):
    if value is None or isinstance(value, jax.Array):
        return value
    return jnp.asarray(value)


def _freeze(value):
    """Lists (e.g. padding=[1, 1]) as tuples, so a configuration is hashable."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _keeping_inputs(function):
    """A custom_vjp fwd rule: ``function``'s result, with its inputs as the residuals."""
    return lambda *inputs: (function(*inputs), inputs)


def _accumulator(dtype):
    return _dtypes.accumulator_dtype(numpy.dtype(dtype))
