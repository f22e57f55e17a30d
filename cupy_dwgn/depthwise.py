"""Depthwise 2-D convolution on CuPy arrays, NCHW or channels-last (NHWC):
forward and both backward passes.

Each public function validates its arguments, then takes the first kernel
family that serves the call (a plan function returns None / False when its
kernel does not serve the geometry), in this order:

* NCHW forward:   large filter (>= 9x9, stride 1) -> tensor cores (half
                  types, 3x3/5x5/7x7 at stride 1 or 2, where
                  _depthwise_conv_mma.preferred: nowhere until measured) -> rows (destination
                  rows of <= 16 values, where _depthwise_nchw_rows.preferred)
                  -> register row walk (3x3/5x5 at stride 2, 2-byte 3x3 on
                  rows of 8-value vectors at stride 1, where
                  _depthwise_nchw_forward_regs.preferred) -> whole plane
                  (where _depthwise_nchw_plane.preferred) -> register window
                  (3x3/5x5/7x7, dilation 1, stride 1 or 2) -> tiled / direct
* NCHW backward-input: large filter -> tensor cores (where preferred) ->
                  rows (stride 1, where preferred) ->
                  register row walk (stride 1, where preferred) -> whole
                  plane (where preferred) -> register window (stride 1) ->
                  tiled (stride 1) / phase decomposition (3x3/5x5/7x7 at
                  stride 2, dilation 1; _depthwise_nchw.backward_input_plan)
                  / direct gather (any stride)
* backward-weight, both layouts: tensor cores first (half types, 3x3/5x5/7x7
                  at stride 1 on planes whose buffers fit in shared memory,
                  where _depthwise_wgrad_mma.preferred), then:
* NCHW backward-weight: whole plane (3x3/5x5/7x7, stride 1 or 2, where
                  _depthwise_nchw_plane_wgrad.preferred) -> transposed to
                  NHWC around the NHWC register-tap
                  kernel (half-type 5x5 at stride 1 where the NCHW register
                  kernel would read one column per lane,
                  _depthwise_nchw_via_nhwc.preferred) -> register
                  weight gradient (3x3/5x5/7x7, stride 1 or
                  2, where _depthwise_nchw_wgrad_regs.preferred) -> staged
                  small-filter / large-filter kernels (_depthwise_nchw_wgrad)
                  -> two-pass kernel (_depthwise_nchw)
* NHWC, all three ops: large filter (>= 9x9, stride 1: transposed to NCHW
                  around the NCHW large-filter kernels, _depthwise_nhwc_large)
* NHWC forward and backward-input: -> tensor cores (half types, 3x3/5x5/7x7
                  at stride 1 or 2 (backward-input 1), C a multiple of 8, where
                  _depthwise_conv_mma.preferred) -> row ring (3x3, forward stride 1 or
                  2, backward-input stride 1; 5x5 forward stride 2; rows
                  copied whole into shared memory, where
                  _depthwise_nhwc_ring.preferred) -> direct (3x3/5x5, forward
                  stride 1 or 2, backward-input stride 1, 16-byte channel
                  vectors, where
                  _depthwise_nhwc_direct.preferred) -> register window
                  (3x3/5x5/7x7, stride 1, where
                  _depthwise_nhwc_window.preferred) -> (backward-input
                  only) phase-decomposed stride-2 kernel (3x3/5x5/7x7,
                  dilation 1, 16-byte channel vectors, where
                  _depthwise_nhwc_phase.preferred) -> the channel-vector
                  kernels of _depthwise_nhwc (all shapes)
* NHWC backward-weight: -> register taps (3x3/5x5/7x7, stride 1 or 2, where
                  _depthwise_nhwc_wgrad.preferred) -> the tiled / register
                  kernels of _depthwise_nhwc
"""

import typing

from . import (
    _checks,
    _dtypes,
    _launch,
    _depthwise_nchw,
    _depthwise_nchw_forward_regs,
    _depthwise_nchw_large,
    _depthwise_conv_mma,
    _depthwise_nchw_plane,
    _depthwise_nchw_plane_wgrad,
    _depthwise_nchw_rows,
    _depthwise_nchw_via_nhwc,
    _depthwise_nchw_wgrad,
    _depthwise_nchw_wgrad_regs,
    _depthwise_nchw_window,
    _depthwise_nhwc,
    _depthwise_nhwc_direct,
    _depthwise_nhwc_large,
    _depthwise_nhwc_phase,
    _depthwise_nhwc_ring,
    _depthwise_nhwc_wgrad,
    _depthwise_nhwc_window,
    _depthwise_wgrad_mma,
    _interop,
    _validate,
)

try:
    from cupy import ndarray as _ndarray
except ImportError:  # CuPy absent: every call takes the checked path, which says so
    _ndarray = None

#: Filter sizes with compile-time specializations; every other size runs a
#: generic kernel.
SPECIALIZED_FILTER_SIZES = _depthwise_nchw.SPECIALIZED_FILTER_SIZES
LAYOUTS = ("NCHW", "NHWC")

#: The keyword arguments of specializations() that cupy_dwgn.precompile forwards.
SELECTION_KEYS = ("dtypes", "filter_sizes", "large_index", "layouts")

_OPS = ("depthwise_conv2d", "depthwise_conv2d_backward_input", "depthwise_conv2d_backward_weight")


def specializations(op=None, dtypes=None, filter_sizes=None, large_index=(False, True), layouts=LAYOUTS):
    """``(file, name expression)`` for each kernel specialization ``op`` can
    launch (default: all three depthwise ops).

    dtypes: iterable of dtypes (default: all four); filter_sizes: iterable of
    (KH, KW) (default: every specialized size and the generic kernels);
    large_index: which index widths (False: 32-bit, True: 64-bit);
    layouts: "NCHW" and/or "NHWC".
    """
    ops = _OPS if op is None else (op,)
    large_index = (large_index,) if isinstance(large_index, bool) else tuple(large_index)
    layouts = (layouts,) if isinstance(layouts, str) else tuple(layouts)
    sizes = None if filter_sizes is None else [tuple(s) for s in filter_sizes]
    large_filters = sizes is None or any(kh * kw >= _depthwise_nchw_large.MIN_TAPS for kh, kw in sizes)
    specs = []
    for name in ops:
        if "NCHW" in layouts:
            specs += _depthwise_nchw.specializations(name, dtypes, sizes, large_index)
            if name != "depthwise_conv2d_backward_weight":
                backward = name == "depthwise_conv2d_backward_input"
                specs += _depthwise_conv_mma.specializations(dtypes, sizes, backward, large_index, "NCHW")
                specs += _depthwise_nchw_rows.specializations(dtypes, sizes, backward, large_index)
                specs += _depthwise_nchw_forward_regs.specializations(dtypes, sizes, backward, large_index)
                specs += _depthwise_nchw_plane.specializations(dtypes, sizes, backward, large_index)
                specs += _depthwise_nchw_window.specializations(dtypes, sizes, backward, large_index)
                if large_filters:
                    specs += _depthwise_nchw_large.specializations(dtypes, large_index)
            else:
                specs += _depthwise_wgrad_mma.specializations(dtypes, sizes, large_index, "NCHW")
                specs += _depthwise_nchw_plane_wgrad.specializations(dtypes, sizes, large_index)
                specs += _depthwise_nchw_via_nhwc.specializations(dtypes, sizes, large_index)
                specs += _depthwise_nchw_wgrad_regs.specializations(dtypes, sizes, large_index)
                specs += _depthwise_nchw_wgrad.specializations(dtypes, sizes, large_index)
        if "NHWC" in layouts:
            specs += _depthwise_nhwc.specializations(name, dtypes, sizes, large_index)
            if name != "depthwise_conv2d_backward_weight":
                specs += _depthwise_conv_mma.specializations(
                    dtypes, sizes, name == "depthwise_conv2d_backward_input", large_index, "NHWC")
                # One kernel serves forward and backward-input.
                specs += _depthwise_nhwc_window.specializations(dtypes, sizes, large_index)
                specs += _depthwise_nhwc_ring.specializations(
                    dtypes, sizes, name == "depthwise_conv2d_backward_input", large_index)
                specs += _depthwise_nhwc_direct.specializations(
                    dtypes, sizes, name == "depthwise_conv2d_backward_input", large_index)
            else:
                specs += _depthwise_wgrad_mma.specializations(dtypes, sizes, large_index, "NHWC")
                specs += _depthwise_nhwc_wgrad.specializations(dtypes, sizes, large_index)
            if name == "depthwise_conv2d_backward_input":
                specs += _depthwise_nhwc_phase.specializations(dtypes, sizes, large_index)
            if large_filters:
                specs += _depthwise_nhwc_large.specializations(
                    dtypes, large_index, weight_gradient=name == "depthwise_conv2d_backward_weight")
    return list(dict.fromkeys(specs))


def depthwise_conv2d(x, weight, bias=None, *, stride=1, padding=0, dilation=1, layout="NCHW", out=None, stream=None):
    """Depthwise 2-D convolution (cross-correlation, as ``torch.nn.functional.conv2d``
    with ``groups=C``).

    Arrays may be cupy.ndarray or any CUDA array with ``__dlpack__`` (torch
    tensors, JAX arrays): they are used without a copy and the result comes
    back as the caller's type.  For ``layout="NCHW"``, 4-D arrays whose memory
    is channels-last (a torch ``channels_last`` tensor) run the NHWC kernels
    and the result is channels-last too.  ``stream``: launch on this stream
    (a cupy Stream, anything with ``__cuda_stream__``, a torch.cuda.Stream);
    default the current CuPy stream.  Nothing synchronizes the host.

    Args:
        x: cupy.ndarray (N, C, H, W) for ``layout="NCHW"`` or (N, H, W, C) for
            ``layout="NHWC"`` (channels-last), float16, float32, float64 or bfloat16.
        weight: (C*M, 1, KH, KW), same dtype; M >= 1 is the depth multiplier and
            output channel ``c*M + m`` reads input channel ``c``.
        bias: optional (C*M,), same dtype.
        stride, dilation: int or (h, w), >= 1.
        padding: int, (h, w), ((top, bottom), (left, right)), ``"same"``
            (stride 1 only; an odd total puts the extra row/column after) or
            ``"valid"``.
        layout: ``"NCHW"`` or ``"NHWC"`` (x, out in that order; the weight is
            (C*M, 1, KH, KW) in both).  A PyTorch ``channels_last`` tensor is an
            NHWC buffer: ``t.permute(0, 2, 3, 1)`` is C-contiguous.
        out: optional C-contiguous output array of x's dtype, not overlapping
            x, weight or bias (the op cannot run in place).

    Returns:
        (N, C*M, OH, OW) for NCHW, (N, OH, OW, C*M) for NHWC, with ``OH = (H + pad_top + pad_bottom - dilation_h*(KH-1) - 1) // stride_h + 1``
        (likewise OW).  Half types accumulate in float32.

    Example:
        >>> x = cupy.random.randn(8, 32, 56, 56, dtype=cupy.float32)
        >>> w = cupy.random.randn(32, 1, 3, 3, dtype=cupy.float32)
        >>> depthwise_conv2d(x, w, padding=1).shape
        (8, 32, 56, 56)
    """
    if type(x) is _ndarray:
        result = _interop.on_stream(stream, _forward_cached, x, weight, bias, out, stride, padding, dilation, layout)
        if result is not _MISS:
            return result
    return _interop.call(_forward_checked, (x, weight, bias, out), stream, stride, padding, dilation, layout)


def _forward_cached(x, weight, bias, out, stride, padding, dilation, layout):
    """The call through the signature cache, or _MISS (new signature,
    unhashable argument, or an out that needs the full checks)."""
    try:
        entry = _SIGNATURES[_key("fwd", x, weight, _interop.signature(bias), out, stride, padding, dilation, layout)]
    except (KeyError, TypeError):
        return _MISS
    return _interop.on_device(x, _forward, x, weight, bias, out, entry, entry.separate)


def _forward_checked(x, weight, bias, out, stride, padding, dilation, layout):
    result = _forward_cached(x, weight, bias, out, stride, padding, dilation, layout)
    if result is not _MISS:  # e.g. torch tensors, now viewed as cupy arrays
        return result
    if _channels_last_nchw(layout, x, out):
        result = _forward_checked(_as_nhwc(x, "x"), weight, bias, _as_nhwc(out, "out"), stride, padding, dilation, "NHWC")
        return _as_nchw(result) if out is None else out
    g = check_forward_args(x, weight, bias, stride, padding, dilation, layout, out)
    entry = _Entry(g, layout, _validate.layout_shape(layout, g.batch, g.channels * g.multiplier, g.out_height, g.out_width), {}, [None])
    _interop.remember(
        _SIGNATURES, _key("fwd", x, weight, _interop.signature(bias), out, stride, padding, dilation, layout), entry
    )
    return _interop.on_device(x, _forward, x, weight, bias, out, entry, None)


def _output(entry, separate, addresses, out, inputs, dtype):
    """(the output array, the call's addresses with its own last), or
    (_MISS, None) when a given ``out`` may overlap ``inputs``.  ``addresses``:
    the call's three inputs' (NULL for an absent one) and ``out``'s, each read
    once for the overlap memo, the alignment and the launch.  ``separate``:
    the entry's outputs_separate_memo slot where the overlap is still to be
    ruled out (the cached path), None after the full checks."""
    if separate is not None and out is not None and not _interop.outputs_separate_memo(
        separate, addresses, (out,), inputs
    ):
        return _MISS, None
    result = _validate.empty_unless_given(out, entry.out_shape, dtype)
    if result is not out:
        addresses = addresses[:3] + (result.data.ptr,)
    return result, addresses


def _forward(device, x, weight, bias, out, entry, separate):
    """The launches on ``device`` (current); ``separate`` as in :func:`_output`."""
    null = _launch.NULL
    result, addresses = _output(
        entry, separate, (x.data.ptr, weight.data.ptr, null if bias is None else bias.data.ptr,
                          null if out is None else out.data.ptr),
        out, (x, weight, bias), x.dtype,
    )
    if result is not _MISS and result.size:
        _steps(entry, _forward_steps, x, result, addresses[0], addresses[3]).run(device, addresses)
    return result


def depthwise_conv2d_backward_input(grad_out, weight, input_shape, *, stride=1, padding=0, dilation=1, layout="NCHW", out=None, stream=None):
    """Gradient of :func:`depthwise_conv2d` with respect to its input.

    Arrays may be cupy.ndarray or any CUDA array with ``__dlpack__`` (torch
    tensors, JAX arrays): they are used without a copy and the result comes
    back as the caller's type.  For ``layout="NCHW"``, 4-D arrays whose memory
    is channels-last (a torch ``channels_last`` tensor) run the NHWC kernels
    and the result is channels-last too.  ``stream``: launch on this stream
    (a cupy Stream, anything with ``__cuda_stream__``, a torch.cuda.Stream);
    default the current CuPy stream.  Nothing synchronizes the host.

    Args:
        grad_out: (N, C*M, OH, OW) (NHWC: (N, OH, OW, C*M)), the gradient of
            the forward output.
        weight: (C*M, 1, KH, KW), same dtype.
        input_shape: (N, C, H, W) (NHWC: (N, H, W, C)) of the forward input (H and W are needed
            because several input sizes map to one output size when stride > 1).
        stride, padding, dilation, layout: as in the forward call.
        out: optional C-contiguous array of shape ``input_shape``; it is
            overwritten, it does not need to be zeroed.

    Returns:
        grad_in of shape ``input_shape`` and grad_out's dtype.

    Example:
        >>> dx = depthwise_conv2d_backward_input(dy, w, x.shape, padding=1)
    """
    if type(grad_out) is _ndarray:
        result = _interop.on_stream(
            stream, _backward_input_cached, grad_out, weight, out, input_shape, stride, padding, dilation, layout
        )
        if result is not _MISS:
            return result
    return _interop.call(
        _backward_input_checked, (grad_out, weight, out), stream, input_shape, stride, padding, dilation, layout
    )


def _backward_input_cached(grad_out, weight, out, input_shape, stride, padding, dilation, layout):
    try:
        entry = _SIGNATURES[_key("bwd_input", grad_out, weight, input_shape, out, stride, padding, dilation, layout)]
    except (KeyError, TypeError):
        return _MISS
    return _interop.on_device(grad_out, _backward_input, grad_out, weight, out, entry, entry.separate)


def _backward_input_checked(grad_out, weight, out, input_shape, stride, padding, dilation, layout):
    result = _backward_input_cached(grad_out, weight, out, input_shape, stride, padding, dilation, layout)
    if result is not _MISS:
        return result
    if _channels_last_nchw(layout, grad_out, out):
        n, c, h, w = _validate.check_int_shape("input_shape", input_shape, 4)
        result = _backward_input_checked(
            _as_nhwc(grad_out, "grad_out"), weight, _as_nhwc(out, "out"), (n, h, w, c), stride, padding,
            dilation, "NHWC",
        )
        return _as_nchw(result) if out is None else out
    g = check_backward_input_args(grad_out, weight, input_shape, stride, padding, dilation, layout, out)
    entry = _Entry(g, layout, _validate.layout_shape(layout, g.batch, g.channels, g.height, g.width), {}, [None])
    _interop.remember(
        _SIGNATURES, _key("bwd_input", grad_out, weight, input_shape, out, stride, padding, dilation, layout), entry
    )
    return _interop.on_device(grad_out, _backward_input, grad_out, weight, out, entry, None)


def _backward_input(device, grad_out, weight, out, entry, separate):
    """As :func:`_forward`."""
    null = _launch.NULL
    result, addresses = _output(
        entry, separate, (grad_out.data.ptr, weight.data.ptr, null, null if out is None else out.data.ptr),
        out, (grad_out, weight), grad_out.dtype,
    )
    if result is not _MISS and result.size:
        _steps(entry, _backward_input_steps, grad_out, result, addresses[0], addresses[3]).run(device, addresses)
    return result


def depthwise_conv2d_backward_weight(grad_out, x, weight_shape, *, stride=1, padding=0, dilation=1, layout="NCHW", out=None, stream=None):
    """Gradient of :func:`depthwise_conv2d` with respect to its weight.

    Deterministic: no atomics; the same inputs give bit-identical results on
    every run (the reduction order depends on the shapes only).

    Arrays may be cupy.ndarray or any CUDA array with ``__dlpack__`` (torch
    tensors, JAX arrays): they are used without a copy and the result comes
    back as the caller's type.  For ``layout="NCHW"``, 4-D arrays whose memory
    is channels-last (a torch ``channels_last`` tensor) run the NHWC kernels
    and the result is channels-last too.  ``stream``: launch on this stream
    (a cupy Stream, anything with ``__cuda_stream__``, a torch.cuda.Stream);
    default the current CuPy stream.  Nothing synchronizes the host.

    Args:
        grad_out: (N, C*M, OH, OW) (NHWC: (N, OH, OW, C*M)), the gradient of
            the forward output.
        x: (N, C, H, W) (NHWC: (N, H, W, C)), the forward input, same dtype.
        weight_shape: (C*M, 1, KH, KW).
        stride, padding, dilation, layout: as in the forward call.
        out: optional C-contiguous array of shape ``weight_shape``.

    Returns:
        grad_weight of shape ``weight_shape`` and x's dtype (summed in float32
        for half types, float64 for float64).  The bias gradient is
        ``grad_out.sum(axis=(0, 2, 3))`` (NHWC: ``axis=(0, 1, 2)``).

    Example:
        >>> dw = depthwise_conv2d_backward_weight(dy, x, w.shape, padding=1)
    """
    if type(grad_out) is _ndarray:
        result = _interop.on_stream(
            stream, _backward_weight_cached, grad_out, x, out, weight_shape, stride, padding, dilation, layout
        )
        if result is not _MISS:
            return result
    return _interop.call(
        _backward_weight_checked, (grad_out, x, out), stream, weight_shape, stride, padding, dilation, layout
    )


def _backward_weight_cached(grad_out, x, out, weight_shape, stride, padding, dilation, layout):
    try:
        entry = _SIGNATURES[_key("bwd_weight", grad_out, x, weight_shape, out, stride, padding, dilation, layout)]
    except (KeyError, TypeError):
        return _MISS
    return _interop.on_device(x, _backward_weight, grad_out, x, out, entry, entry.separate)


def _backward_weight_checked(grad_out, x, out, weight_shape, stride, padding, dilation, layout):
    result = _backward_weight_cached(grad_out, x, out, weight_shape, stride, padding, dilation, layout)
    if result is not _MISS:
        return result
    if _channels_last_nchw(layout, grad_out, x):
        grad_out, x = _as_nhwc(grad_out, "grad_out"), _as_nhwc(x, "x")
        return _backward_weight_checked(grad_out, x, out, weight_shape, stride, padding, dilation, "NHWC")
    g = check_backward_weight_args(grad_out, x, weight_shape, stride, padding, dilation, layout, out)
    entry = _Entry(g, layout, (g.channels * g.multiplier, 1, g.filter_height, g.filter_width), {}, [None])
    _interop.remember(
        _SIGNATURES, _key("bwd_weight", grad_out, x, weight_shape, out, stride, padding, dilation, layout), entry
    )
    return _interop.on_device(x, _backward_weight, grad_out, x, out, entry, None)


def _backward_weight(device, grad_out, x, out, entry, separate):
    """As :func:`_forward`."""
    null = _launch.NULL
    result, addresses = _output(
        entry, separate, (grad_out.data.ptr, x.data.ptr, null, null if out is None else out.data.ptr),
        out, (grad_out, x), x.dtype,
    )
    if result is _MISS or result.size == 0:
        return result
    if grad_out.size == 0 or x.size == 0:
        result.fill(0)  # no output positions (or an empty input): every tap sums nothing
        return result
    _steps(entry, _backward_weight_steps, grad_out, x, addresses[0], addresses[1]).run(device, addresses)
    return result


def prepared_steps(op, first, second, third, out, stride, padding, dilation, layout):
    """For cupy_dwgn.torch, which keeps its own per-signature memo: the Steps a
    cached call of ``op`` ("fwd", "bwd_input" or "bwd_weight", with the
    public call's arguments: CuPy arrays ``first``, ``second`` and ``out``,
    ``third`` the bias (forward) or the shape argument) launches, for these
    arrays' alignments, so that a later call with the same signature and
    alignments launches it from raw addresses -- (first, second, bias or
    NULL, out), the current device and stream -- without the signature key
    and the array checks.  None unless a call of this signature has passed
    the checks, or where the call launches nothing (an empty output; the
    weight gradient of an empty input, which fills zeros)."""
    entry = _SIGNATURES.get(_key(
        op, first, second, _interop.signature(third) if op == "fwd" else third, out, stride, padding, dilation,
        layout))
    if entry is None or out is None or out.size == 0:
        return None
    if op == "bwd_weight":
        if first.size == 0 or second.size == 0:
            return None
        return _steps(entry, _backward_weight_steps, first, second, first.data.ptr, second.data.ptr)
    resolve = _forward_steps if op == "fwd" else _backward_input_steps
    return _steps(entry, resolve, first, out, first.data.ptr, out.data.ptr)


# ---------------------------------------------------------------------------
# Kernel choice.  A call signature that passed the checks maps to an _Entry;
# its Steps (the launches and their argument positions, see _launch.Steps)
# are resolved on the first call with a given pointer alignment of the two
# arrays the vector kernels care about, then reused, so a repeated call goes
# from the signature lookup straight to its launches.
#
# Argument tuples (positions the Steps refer to; temporaries follow them):
#   forward:          (x, weight, bias or NULL, out)
#   backward-input:   (grad_out, weight, NULL, out)   (NULL: the forward kernels' bias slot)
#   backward-weight:  (grad_out, x, NULL, out), then the partial sums at 4

class _Entry(typing.NamedTuple):
    geometry: _validate.ConvGeometry
    layout: str
    out_shape: tuple
    steps: dict  # (first address % 16, second address % 16) -> _launch.Steps
    separate: list  # _interop.outputs_separate_memo's slot


_ALL4 = (0, 1, 2, 3)
_NO_BIAS = (0, 1, 3)


def _steps(entry, resolve, first, second, first_address, second_address):
    """The entry's Steps for the alignment of ``first`` and ``second`` (at
    those addresses)."""
    alignment = (first_address & 15, second_address & 15)
    steps = entry.steps.get(alignment)
    if steps is None:
        steps = entry.steps[alignment] = resolve(entry.geometry, entry.layout, first, second)
    return steps


def _alignment(array):
    """The largest of 16, 8, 4, 2, 1 bytes that the array's address is aligned to."""
    ptr = array.data.ptr
    return min(16, ptr & -ptr) if ptr else 16


def _vector_aligned(a, b):
    return (a.data.ptr | b.data.ptr) % 16 == 0


def _forward_steps(g, layout, x, out):
    index = _launch.index_type(x.size, out.size)
    if layout == "NHWC":
        routed = _depthwise_nhwc_large.forward_steps(g, x.dtype, False)
        if routed is not None:
            return _launch.Steps(*routed)
        signature = (g, x.dtype, False, index, _alignment(x), _alignment(out))
        launch = (_depthwise_conv_mma.select(*signature, "NHWC") or _depthwise_nhwc_ring.select(*signature)
                  or _depthwise_nhwc_direct.select(*signature) or _depthwise_nhwc_window.select(*signature))
        launches = (launch,) if launch else _depthwise_nhwc.forward_plan(g, x.dtype, index, _vector_aligned(x, out))
    else:
        aligned = (_alignment(x), _alignment(out))
        launch = (
            _depthwise_nchw_large.plan(g, x.dtype, False)
            or _depthwise_conv_mma.select(g, x.dtype, False, index, *aligned, "NCHW")
            or _depthwise_nchw_rows.select(g, x.dtype, False, index, *aligned)
            or _depthwise_nchw_forward_regs.select(g, x.dtype, False, *aligned)
            or (_depthwise_nchw_plane.preferred(g, x.dtype, False)
                and _depthwise_nchw_plane.plan(g, x.dtype, False, index, *aligned))
            or _depthwise_nchw_window.plan(g, x.dtype, False, index, aligned[0], aligned[1] == 16)
            or _depthwise_nchw.forward_plan(g, x.dtype, index)
        )
        launches = (launch,)
    return _launch.Steps(tuple((launch, _ALL4) for launch in launches))


def _backward_input_steps(g, layout, grad_out, out):
    index = _launch.index_type(grad_out.size, out.size)
    if layout == "NHWC":
        routed = _depthwise_nhwc_large.forward_steps(g, grad_out.dtype, True)
        if routed is not None:
            return _launch.Steps(*routed)
        # The stride-1 vector case runs a forward kernel (bias slot: NULL).
        signature = (g, grad_out.dtype, True, index, _alignment(grad_out), _alignment(out))
        launch = (_depthwise_conv_mma.select(*signature, "NHWC") or _depthwise_nhwc_ring.select(*signature)
                  or _depthwise_nhwc_direct.select(*signature) or _depthwise_nhwc_window.select(*signature))
        if launch:
            forward_kernel = True
        else:
            # Stride 2: the phase-decomposed kernel (grad_out, weight, grad_in).
            launch = _depthwise_nhwc_phase.select(g, grad_out.dtype, index, _vector_aligned(grad_out, out))
            forward_kernel = False
            if launch is None:
                launch, forward_kernel = _depthwise_nhwc.backward_input_plan(
                    g, grad_out.dtype, index, _vector_aligned(grad_out, out))
    else:
        aligned = (_alignment(grad_out), _alignment(out))
        launch = (
            _depthwise_nchw_large.plan(g, grad_out.dtype, True)
            or _depthwise_conv_mma.select(g, grad_out.dtype, True, index, *aligned, "NCHW")
            or _depthwise_nchw_rows.select(g, grad_out.dtype, True, index, *aligned)
            or _depthwise_nchw_forward_regs.select(g, grad_out.dtype, True, *aligned)
            or (_depthwise_nchw_plane.preferred(g, grad_out.dtype, True)
                and _depthwise_nchw_plane.plan(g, grad_out.dtype, True, index, *aligned))
            or _depthwise_nchw_window.plan(g, grad_out.dtype, True, index, aligned[0], aligned[1] == 16)
        )
        forward_kernel = launch is not None
        if launch is None:
            launch, forward_kernel = _depthwise_nchw.backward_input_plan(g, grad_out.dtype, index)
    return _launch.Steps(((launch, _ALL4 if forward_kernel else _NO_BIAS),))


def _backward_weight_steps(g, layout, grad_out, x):
    index = _launch.index_type(grad_out.size, x.size)
    if layout == "NHWC":
        routed = _depthwise_nhwc_large.backward_weight_steps(g, x.dtype)
        if routed is not None:
            return _launch.Steps(*routed)
        planned = (_depthwise_wgrad_mma.select(g, x.dtype, layout, index, _alignment(grad_out), _alignment(x))
                   or _depthwise_nhwc_wgrad.select(g, x.dtype, index, _alignment(grad_out), _alignment(x))
                   or _depthwise_nhwc.backward_weight_plan(g, x.dtype, index, _vector_aligned(grad_out, x)))
    else:
        planned = (_depthwise_wgrad_mma.select(g, x.dtype, layout, index, _alignment(grad_out), _alignment(x))
                   or _depthwise_nchw_plane_wgrad.select(g, x.dtype, _alignment(grad_out), _alignment(x)))
        if planned is None:
            routed = _depthwise_nchw_via_nhwc.backward_weight_steps(
                g, x.dtype, index, _alignment(grad_out), _alignment(x))
            if routed is not None:
                return _launch.Steps(*routed)
            planned = _depthwise_nchw_wgrad_regs.select(g, x.dtype, _alignment(grad_out), _alignment(x))
    if planned is not None:  # partial sums + the shared finalize
        (partial, finalize), temporary = planned
        return _launch.Steps(((partial, (0, 1, 4)), (finalize, (4, 3))), (temporary,))
    launches = _depthwise_nchw_wgrad.plan(g, x.dtype)
    if launches is not None:
        if len(launches) == 1:  # one pass: no partial sums
            return _launch.Steps(((launches[0], _ALL4),))
        partial, finalize = launches
        temporary = ((g.channels * g.multiplier, partial.grid[1], g.filter_height * g.filter_width),
                     _dtypes.accumulator_dtype(x.dtype))
        return _launch.Steps(((partial, (0, 1, 4, 3)), (finalize, (4, 3))), (temporary,))
    partial, finalize, temporary = _depthwise_nchw.backward_weight_plan(g, x.dtype, index)
    return _launch.Steps(((partial, (0, 1, 4)), (finalize, (4, 3))), (temporary,))


# Call-signature cache (see _interop): a signature that passed the full checks
# once maps to its ConvGeometry, so a repeated call only checks that out does
# not overlap an input.  Argument types are part of the key, a tuple's
# element by element: True == 1 == 1.0 and (1, 1) == (1.0, True) would
# otherwise hit the entry of a valid call and skip the checks that reject them.
_SIGNATURES = {}
_MISS = _interop.MISS  # what a *_cached function returns when the call needs the checks


def _types(argument):
    """The type of a stride / padding / dilation / shape argument, per element
    for a tuple (per pair for padding's ((top, bottom), (left, right)))."""
    kind = type(argument)
    if kind is not tuple:
        return kind
    size = len(argument)
    if size == 2:  # the usual pair and shape, without map's overhead
        first, second = argument
        kinds = (type(first), type(second))
    elif size == 4:
        first, second, third, fourth = argument
        kinds = (type(first), type(second), type(third), type(fourth))
    else:
        kinds = tuple(map(type, argument))
    return kinds if tuple not in kinds else tuple(map(_types, argument))


def _key(op, first, second, third, out, stride, padding, dilation, layout):
    """The signature-cache key of one call: ``first``/``second`` are its two
    arrays, ``third`` the bias's signature (forward) or the shape argument
    (backward)."""
    signature = _interop.signature
    # Plain ints (the usual arguments) skip the call to _types.
    return (op, signature(first), signature(second), third, signature(out), stride, padding, dilation, layout,
            int if type(stride) is int else _types(stride), int if type(padding) is int else _types(padding),
            int if type(dilation) is int else _types(dilation), None if op == "fwd" else _types(third))


def _channels_last_nchw(layout, *arrays):
    """An NCHW call on channels-last memory (torch channels_last): some array
    of the call is NCHW-shaped and channels-last only.  Any of them decides:
    an array whose planes are 1x1 (or of one channel) is both C-contiguous
    and channels-last, so a stride-2 layer's 1x1 grad_out beside its
    channels-last x, or a one-channel x beside a channels-last out, still
    runs the NHWC kernels (and _as_nhwc rejects an array of the call that is
    not channels-last)."""
    return layout == "NCHW" and any(
        type(array) is _ndarray and array.ndim == 4
        and not array.flags.c_contiguous and array.transpose(0, 2, 3, 1).flags.c_contiguous
        for array in arrays
    )


def _as_nhwc(array, name):
    """The NHWC view of a channels-last NCHW array (None stays None)."""
    if array is None:
        return None
    view = array.transpose(0, 2, 3, 1) if type(array) is _ndarray and array.ndim == 4 else array
    if type(array) is _ndarray and array.ndim == 4 and not view.flags.c_contiguous:
        raise ValueError(
            f"{name}: expected channels-last memory like the call's other arrays (a channels_last "
            f"tensor), got strides {array.strides} for shape {tuple(array.shape)}"
        )
    return view


def _as_nchw(result):
    return result.transpose(0, 3, 1, 2)


# Argument checks: duck-typed over the array class (``kind``) and CuPy-free, so
# cupy_dwgn.host and cupy_dwgn.reference run the very same checks on NumPy inputs.
check_forward_args = _checks.check_depthwise_forward
check_backward_input_args = _checks.check_depthwise_backward_input
check_backward_weight_args = _checks.check_depthwise_backward_weight
_check_limits = _checks.check_depthwise_limits
_check_grad_out = _checks.check_depthwise_grad_out
