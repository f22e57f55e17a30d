"""Channels-last GroupNorm with a fused activation, on CuPy arrays: forward and backward.

x is (N, *spatial, C) with 0 to 3 spatial dimensions, C fastest in memory
(NHWC for images; a PyTorch ``channels_last`` tensor seen through DLPack is
one ``transpose(0, 2, 3, 1)`` away).  Statistics are per (sample, group) over
the spatial positions and the C / num_groups channels of the group, with the
biased variance, accumulated in float32 (float64 for float64 inputs).
"""

import dataclasses
import functools
import numbers

import cupy
import numpy

from . import _compile, _dtypes, _launch, _validate
from ._launch import i32

KERNEL_FILE = "group_norm.cu"

#: Activations, in the order of their template code in group_norm.cu.
ACTIVATIONS = ("identity", "relu", "silu", "gelu", "gelu_tanh")
_ACT_CODE = {name: code for code, name in enumerate(ACTIVATIONS)}

#: The keyword arguments of specializations() that cupy_dwgn.precompile forwards.
SELECTION_KEYS = ("dtypes", "activations", "large_index")

_STATS = "dwgn_gn_stats_partial"
_FWD_FINALIZE = "dwgn_gn_fwd_finalize"
_APPLY = "dwgn_gn_fwd_apply"
_BWD_REDUCE = "dwgn_gn_bwd_reduce"
_BWD_FINALIZE = "dwgn_gn_bwd_finalize"
_BWD_DX = "dwgn_gn_bwd_dx"

# Statistics split: about this many blocks in the column-reduction kernels,
# each summing at least _MIN_ROWS_PER_CHUNK rows.  Depends on the shape only
# (never on the device), so results are bit-identical everywhere.
_TARGET_BLOCKS = 1024
_MIN_ROWS_PER_CHUNK = 32
_COLUMN_BLOCK = 256  # block size of the column kernels (their shared scratch is sized for it)


def _vec_width(dtype):
    """Elements per 16-byte access."""
    return 16 // numpy.dtype(dtype).itemsize


@functools.lru_cache(maxsize=None)
def weight_dtypes(dtype):
    """The weight/bias dtypes accepted with inputs of ``dtype``: the same dtype,
    and float32 too for float16/bfloat16 (mixed precision)."""
    dtype = numpy.dtype(dtype)
    if dtype.itemsize == 2:
        return (dtype, numpy.dtype(numpy.float32))
    return (dtype,)


def _acc_ctype(dtype):
    return _dtypes.ctype(_dtypes.accumulator_dtype(dtype))


def specializations(op=None, dtypes=None, activations=None, large_index=(False, True)):
    """``(file, name expression)`` for each kernel specialization of ``op``
    ("group_norm", "group_norm_backward"; default both).

    dtypes: input dtypes (default: all four; the weight dtypes each accepts are
    included); activations: names from ACTIVATIONS (default: all);
    large_index: which index widths (False: 32-bit, True: 64-bit).
    """
    ops = ("group_norm", "group_norm_backward") if op is None else (op,)
    for o in ops:
        if o not in ("group_norm", "group_norm_backward"):
            raise ValueError(f"op: expected 'group_norm' or 'group_norm_backward', got {o!r}")
    dtypes = tuple(_dtypes.CTYPES) if dtypes is None else tuple(numpy.dtype(d) for d in dtypes)
    activations = ACTIVATIONS if activations is None else tuple(activations)
    for name in activations:
        _check_activation(name)
    large_index = (large_index,) if isinstance(large_index, bool) else tuple(large_index)
    indices = ["long long" if large else "int" for large in large_index]
    name = _compile.name_expression
    specs = []
    for dtype in dtypes:
        t = _dtypes.ctype(dtype)
        acc = _acc_ctype(dtype)
        ws = [_dtypes.ctype(w) for w in weight_dtypes(dtype)]
        vecs = (1, _vec_width(dtype))
        for op_name in ops:
            if op_name == "group_norm":
                specs += [name(_STATS, t, i) for i in indices]
                specs += [name(_FWD_FINALIZE, acc, w) for w in ws]
                specs += [
                    name(_APPLY, t, _ACT_CODE[a], v, i)
                    for a in activations for v in vecs for i in indices
                ]
            else:
                specs += [
                    name(_BWD_REDUCE, t, w, _ACT_CODE[a], i)
                    for w in ws for a in activations for i in indices
                ]
                specs += [name(_BWD_FINALIZE, acc, w) for w in ws]
                specs += [
                    name(_BWD_DX, t, _ACT_CODE[a], v, i)
                    for a in activations for v in vecs for i in indices
                ]
    return [(KERNEL_FILE, e) for e in dict.fromkeys(specs)]


def _affine_dtype(weight, bias, x):
    """The dtype of the affine parameters (and their gradients)."""
    return weight.dtype if weight is not None else (bias.dtype if bias is not None else x.dtype)


def _aligned(*arrays):
    return all(a.data.ptr % 16 == 0 for a in arrays)


@dataclasses.dataclass(eq=False)
class _Plan:
    """Everything about one call's launches that depends only on its
    signature (shapes, dtypes, activation, vector path): the three kernels'
    name expressions, grids, blocks and scalar arguments, and the (shape,
    dtype) of the temporaries.  Plans are cached, so a repeated call skips
    this work; the compiled kernels are looked up once per device."""

    expressions: tuple
    grids: tuple
    blocks: tuple
    scalars: tuple
    partial: tuple
    coefficients: tuple
    kernels_by_device: dict = dataclasses.field(default_factory=dict)

    def kernels(self):
        device = cupy.cuda.runtime.getDevice()
        kernels = self.kernels_by_device.get(device)
        if kernels is None:
            kernels = tuple(_compile.get_kernel(KERNEL_FILE, e) for e in self.expressions)
            self.kernels_by_device[device] = kernels
        return kernels


def _vector_width(dtype, channels, aligned):
    """Elements per access: 16 bytes when C is a multiple of it and every
    pointer is 16-byte aligned, else 1 (the scalar path)."""
    vec = _vec_width(dtype)
    return vec if aligned and channels % vec == 0 else 1


def _geometry(batch, rows, channels, dtype, aligned):
    """What both directions derive from a signature: index type, element and
    accumulator types, the column kernels' split, the vector width and the
    flat kernels' vector count."""
    size = batch * rows * channels
    index = _launch.index_type(size)
    vec = _vector_width(dtype, channels, aligned)
    return (
        index, _dtypes.ctype(dtype), _dtypes.accumulator_dtype(dtype), _split(batch, rows, channels),
        vec, _launch.index_scalar(index, size // vec),
    )


@functools.lru_cache(maxsize=1024)
def _forward_plan(batch, rows, channels, groups, dtype, w_dtype, activation, aligned):
    name = _compile.name_expression
    index, t, acc_dtype, split, vec, num_vectors = _geometry(batch, rows, channels, dtype, aligned)
    rows_per_chunk, num_chunks, column_blocks = split
    grid_y = min(batch, _launch.MAX_GRID_Y)
    common = (i32(batch), i32(rows), i32(channels))
    return _Plan(
        expressions=(
            name(_STATS, t, index),
            name(_FWD_FINALIZE, _dtypes.ctype(acc_dtype), _dtypes.ctype(w_dtype)),
            name(_APPLY, t, _ACT_CODE[activation], vec, index),
        ),
        grids=((num_chunks, grid_y, column_blocks), (groups, grid_y), _launch.grid_1d(int(num_vectors))),
        blocks=((_COLUMN_BLOCK,), (_group_block(channels // groups * num_chunks, 512),), (_launch.BLOCK,)),
        scalars=(
            common + (i32(rows_per_chunk),),
            common + (i32(groups), i32(num_chunks), i32(rows_per_chunk)),
            (num_vectors, i32(rows), i32(channels)),
        ),
        # Forward summaries are double whatever x is: the sums keep the mean exact.
        partial=((batch, num_chunks, 2, channels), numpy.dtype(numpy.float64)),
        coefficients=((batch, 3, channels), acc_dtype),
    )


@functools.lru_cache(maxsize=1024)
def _backward_plan(batch, rows, channels, groups, dtype, w_dtype, activation, aligned):
    name = _compile.name_expression
    index, t, acc_dtype, split, vec, num_vectors = _geometry(batch, rows, channels, dtype, aligned)
    rows_per_chunk, num_chunks, column_blocks = split
    w_ctype = _dtypes.ctype(w_dtype)
    act = _ACT_CODE[activation]
    common = (i32(batch), i32(rows), i32(channels), i32(groups))
    return _Plan(
        expressions=(
            name(_BWD_REDUCE, t, w_ctype, act, index),
            name(_BWD_FINALIZE, _dtypes.ctype(acc_dtype), w_ctype),
            name(_BWD_DX, t, act, vec, index),
        ),
        grids=(
            (num_chunks, min(batch, _launch.MAX_GRID_Y), column_blocks),
            (groups, min(batch + 1, _launch.MAX_GRID_Y)),
            _launch.grid_1d(int(num_vectors)),
        ),
        blocks=((_COLUMN_BLOCK,), (_group_block(channels // groups * num_chunks, 256),), (_launch.BLOCK,)),
        scalars=(
            common + (i32(rows_per_chunk),),
            common + (i32(num_chunks),),
            (num_vectors, i32(rows), i32(channels)),
        ),
        partial=((batch, num_chunks, 2, channels), acc_dtype),
        coefficients=((batch, 5, channels), acc_dtype),
    )


def _split(batch, rows, channels):
    """(rows_per_chunk, num_chunks, column blocks) of the column kernels."""
    cols = min(channels, _COLUMN_BLOCK)
    column_blocks = -(-channels // cols)
    per_sample = max(1, -(-_TARGET_BLOCKS // (min(batch, _launch.MAX_GRID_Y) * column_blocks)))
    rows_per_chunk = max(_MIN_ROWS_PER_CHUNK, -(-rows // per_sample))
    num_chunks = -(-rows // rows_per_chunk)
    return rows_per_chunk, num_chunks, column_blocks


def _group_block(pieces, limit):
    """Block size of the finalize kernels, which sum a group's ``pieces``
    (channels x chunks) with the whole block: a multiple of 32 in [32, limit]
    (512 forward, its __launch_bounds__; 256 backward, whose shared scratch
    is sized for it)."""
    return min(limit, max(32, -(-pieces // 32) * 32))


def group_norm(x, num_groups, weight=None, bias=None, *, eps=1e-5, activation="identity", out=None, return_stats=False):
    """Channels-last GroupNorm followed by an activation:
    ``y = act((x - mean) * rstd * weight + bias)``.

    Args:
        x: cupy.ndarray (N, *spatial, C), 0 to 3 spatial dims, C-contiguous;
            float16, float32, float64 or bfloat16.
        num_groups: int dividing C; every group is C // num_groups consecutive
            channels (num_groups == C is InstanceNorm, 1 is LayerNorm over
            (spatial, C)).
        weight, bias: optional (C,) arrays, both of one dtype: x's dtype, or
            float32 for float16/bfloat16 x (mixed precision).  Absent means
            scale 1 / shift 0 (no array is made for them).
        eps: added to the variance, > 0.
        activation: "identity", "relu", "silu", "gelu" (erf form) or
            "gelu_tanh" (tanh approximation), applied after the affine transform.
        out: optional C-contiguous array of x's shape and dtype for y; may be x
            itself (in place), but must not otherwise overlap x, weight or bias.
        return_stats: also return mean and rstd = 1/sqrt(var + eps), each
            (N, num_groups), float32 (float64 for float64 x), for
            :func:`group_norm_backward`.

    Returns:
        y, or (y, mean, rstd) when return_stats.  Statistics are accumulated in
        float32 (float64 for float64); the variance is biased, as in PyTorch.
        With no spatial positions (S == 0) y is empty and mean/rstd are NaN.

    Example:
        >>> x = cupy.random.randn(2, 64, 64, 320).astype(cupy.float16)   # NHWC
        >>> w = cupy.ones(320, cupy.float32); b = cupy.zeros(320, cupy.float32)
        >>> y, mean, rstd = group_norm(x, 32, w, b, activation="silu", return_stats=True)
        >>> y.shape, mean.shape
        ((2, 64, 64, 320), (2, 32))
    """
    batch, rows, channels, groups = check_forward_args(
        x, num_groups, weight, bias, eps, activation, out
    )
    acc_dtype = _dtypes.accumulator_dtype(x.dtype)
    with x.device:
        y = _validate.empty_unless_given(out, x.shape, x.dtype)
        mean = cupy.empty((batch, groups), dtype=acc_dtype)
        rstd = cupy.empty((batch, groups), dtype=acc_dtype)
        if x.size == 0:
            mean.fill(numpy.nan)  # mean of nothing (a no-op when N == 0)
            rstd.fill(numpy.nan)
            return (y, mean, rstd) if return_stats else y
        plan = _forward_plan(
            batch, rows, channels, groups, x.dtype, _affine_dtype(weight, bias, x), activation,
            _aligned(x, y),
        )
        partial = cupy.empty(*plan.partial)
        coefficients = cupy.empty(*plan.coefficients)
        stats, finalize, apply = plan.kernels()
        grids, blocks, scalars = plan.grids, plan.blocks, plan.scalars
        stats(grids[0], blocks[0], (x, partial) + scalars[0])
        finalize(
            grids[1], blocks[1],
            (
                partial, _launch.pointer_or_null(weight), _launch.pointer_or_null(bias), mean, rstd,
                coefficients,
            ) + scalars[1] + (acc_dtype.type(eps),),
        )
        apply(grids[2], blocks[2], (x, coefficients, y, *scalars[2]))
    return (y, mean, rstd) if return_stats else y


def group_norm_backward(grad_out, x, mean, rstd, num_groups, weight=None, bias=None, *, activation="identity"):
    """Gradients of :func:`group_norm` with respect to x, weight and bias.

    Args:
        grad_out: (N, *spatial, C), the gradient of y, x's dtype.
        x: the forward input.
        mean, rstd: (N, num_groups) as returned by ``group_norm(...,
            return_stats=True)``: float32 (float64 for float64 x).
        num_groups, weight, bias, activation: as in the forward call (bias
            only matters through the activation's derivative, and for the
            presence of its gradient).

    Returns:
        (grad_x, grad_weight, grad_bias): grad_x of x's shape and dtype;
        grad_weight/grad_bias (C,) in the weight's dtype, or None when weight /
        bias is None.  Deterministic (no atomics).

    Example:
        >>> y, mean, rstd = group_norm(x, 32, w, b, activation="silu", return_stats=True)
        >>> dx, dw, db = group_norm_backward(dy, x, mean, rstd, 32, w, b, activation="silu")
    """
    batch, rows, channels, groups = check_backward_args(
        grad_out, x, mean, rstd, num_groups, weight, bias, activation
    )
    w_dtype = _affine_dtype(weight, bias, x)
    with x.device:
        grad_in = cupy.empty(x.shape, dtype=x.dtype)
        grad_weight = None if weight is None else cupy.empty((channels,), dtype=w_dtype)
        grad_bias = None if bias is None else cupy.empty((channels,), dtype=w_dtype)
        if x.size == 0:  # sums over nothing
            for g in (grad_weight, grad_bias):
                if g is not None:
                    g.fill(0)
            return grad_in, grad_weight, grad_bias
        plan = _backward_plan(
            batch, rows, channels, groups, x.dtype, w_dtype, activation, _aligned(x, grad_out, grad_in)
        )
        partial = cupy.empty(*plan.partial)
        coefficients = cupy.empty(*plan.coefficients)
        reduce, finalize, dx = plan.kernels()
        grids, blocks, scalars = plan.grids, plan.blocks, plan.scalars
        weight_ptr = _launch.pointer_or_null(weight)
        bias_ptr = _launch.pointer_or_null(bias)
        reduce(grids[0], blocks[0], (grad_out, x, mean, rstd, weight_ptr, bias_ptr, partial) + scalars[0])
        finalize(
            grids[1], blocks[1],
            (
                partial, mean, rstd, weight_ptr, bias_ptr, coefficients,
                _launch.pointer_or_null(grad_weight), _launch.pointer_or_null(grad_bias),
            ) + scalars[1],
        )
        dx(grids[2], blocks[2], (grad_out, x, coefficients, grad_in) + scalars[2])
    return grad_in, grad_weight, grad_bias


# ---------------------------------------------------------------------------
# Argument checks: duck-typed over the array class (``kind``), so
# cupy_dwgn.host runs the very same checks on NumPy inputs before any transfer.

_X_DOC = "(N, *spatial, C) with 0 to 3 spatial dims"
# Normal float32 range: eps inside it is finite and > 0 in either statistics dtype.
_FLOAT32_TINY = float(numpy.finfo(numpy.float32).tiny)
_FLOAT32_MAX = float(numpy.finfo(numpy.float32).max)


def _check_activation(activation):
    if not isinstance(activation, str):
        raise TypeError(
            f"activation: expected a str, one of {', '.join(map(repr, ACTIVATIONS))}, "
            f"got {type(activation).__name__}"
        )
    if activation not in _ACT_CODE:
        raise ValueError(
            f"activation: expected one of {', '.join(map(repr, ACTIVATIONS))}, got {activation!r}"
        )


def _check_num_groups(num_groups, channels):
    if not isinstance(num_groups, numbers.Integral) or isinstance(num_groups, bool):
        raise TypeError(f"num_groups: expected an int, got {type(num_groups).__name__}")
    if num_groups <= 0:
        raise ValueError(f"num_groups: expected a positive int, got {num_groups}")
    if channels % num_groups != 0:
        raise ValueError(
            f"num_groups: expected a divisor of C = {channels} (the last dim of x), got {num_groups}"
        )
    return int(num_groups)


def _check_eps(eps, dtype):
    """eps must stay finite and > 0 in the statistics dtype (float32 unless x is float64)."""
    if type(eps) is float and _FLOAT32_TINY <= eps <= _FLOAT32_MAX:  # the common case, cheaply
        return
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool):
        raise TypeError(f"eps: expected a float, got {type(eps).__name__}")
    acc = _dtypes.accumulator_dtype(dtype)
    try:
        with numpy.errstate(over="ignore"):  # overflow gives inf, rejected below
            value = acc.type(float(eps))
    except OverflowError:  # beyond even float64 (e.g. 10**400)
        value = acc.type(numpy.inf)
    if not (numpy.isfinite(value) and value > 0):
        raise ValueError(
            f"eps: expected a finite value > 0 in {acc} (the statistics dtype), got {eps!r}"
        )


def _check_x(name, x, kind):
    _validate.check_array(name, x, None, "", kind)
    if not 2 <= x.ndim <= 5:
        raise ValueError(f"{name}: expected a 2-D to 5-D array {_X_DOC}, got shape {tuple(x.shape)}")
    channels = x.shape[-1]
    if channels == 0:
        raise ValueError(f"{name}: expected at least one channel (last dim), got shape {tuple(x.shape)}")
    batch = x.shape[0]
    rows = 1
    for s in x.shape[1:-1]:
        rows *= s
    if channels > _COLUMN_BLOCK * _launch.MAX_GRID_Y:
        raise ValueError(
            f"{name}: expected at most {_COLUMN_BLOCK * _launch.MAX_GRID_Y} channels, got {channels}"
        )
    if rows >= _launch.INT32_LIMIT or batch * channels >= _launch.INT32_LIMIT:
        raise ValueError(
            f"{name}: expected fewer than 2**31 spatial positions and N*C < 2**31, got shape "
            f"{tuple(x.shape)}"
        )
    return batch, rows, channels


def _check_affine(weight, bias, x, channels, kind):
    allowed = weight_dtypes(x.dtype)
    for name, a in (("weight", weight), ("bias", bias)):
        if a is None:
            continue
        _validate.check_array(name, a, 1, "(C,)", kind)
        if a.dtype not in allowed:
            allowed_doc = " or ".join(str(d) for d in allowed)
            raise TypeError(
                f"{name}: expected dtype {allowed_doc} (for x of dtype {x.dtype}), got {a.dtype}"
            )
        _validate.check_shape(name, a, (channels,), " (C,), C the last dim of x")
    if weight is not None and bias is not None:
        _validate.check_same_dtype("bias", bias, "weight", weight)


def check_forward_args(x, num_groups, weight, bias, eps, activation, out, kind=None):
    """Validate group_norm's arguments; returns (N, S, C, num_groups)."""
    batch, rows, channels = _check_x("x", x, kind)
    groups = _check_num_groups(num_groups, channels)
    _check_affine(weight, bias, x, channels, kind)
    _check_eps(eps, x.dtype)
    _check_activation(activation)
    _validate.check_out(out, x.shape, x.dtype, kind)
    _validate.check_same_device(x=x, weight=weight, bias=bias, out=out)
    # out may be x itself (in place: each element is read before it is
    # overwritten, by the same thread), but no other overlap.
    if out is not None and not _validate.same_memory(out, x):
        _validate.check_no_overlap(out, x=x, weight=weight, bias=bias)
    return batch, rows, channels, groups


def check_backward_args(grad_out, x, mean, rstd, num_groups, weight, bias, activation, kind=None):
    """Validate group_norm_backward's arguments; returns (N, S, C, num_groups)."""
    _validate.check_array("grad_out", grad_out, None, "", kind)
    batch, rows, channels = _check_x("x", x, kind)
    _validate.check_same_dtype("grad_out", grad_out, "x", x)
    _validate.check_shape("grad_out", grad_out, x.shape, " (the shape of x)")
    groups = _check_num_groups(num_groups, channels)
    acc_dtype = _dtypes.accumulator_dtype(x.dtype)
    for name, a in (("mean", mean), ("rstd", rstd)):
        _validate.check_array(name, a, 2, "(N, num_groups)", kind)
        if a.dtype != acc_dtype:
            raise TypeError(
                f"{name}: expected dtype {acc_dtype} (the statistics dtype for x of dtype "
                f"{x.dtype}), got {a.dtype}"
            )
        _validate.check_shape(name, a, (batch, groups), " (N, num_groups)")
    _check_affine(weight, bias, x, channels, kind)
    _check_activation(activation)
    _validate.check_same_device(
        x=x, grad_out=grad_out, mean=mean, rstd=rstd, weight=weight, bias=bias
    )
    return batch, rows, channels, groups
