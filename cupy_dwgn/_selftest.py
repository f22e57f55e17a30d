"""``cupy-dwgn selftest``: every op on the GPU against the float64 NumPy reference.

Small random inputs (a fresh seed each run, printed), each op in each dtype,
compared by the relative error norm ||out - ref|| / ||ref|| with the bounds the
test suite holds the kernels to.  NaN or inf in an output never passes.
"""

import sys
import time

import numpy

from . import _dtypes

#: Relative error-norm bounds per dtype (the same as the GPU test suite's).
TOLERANCE = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
DTYPES = ("float32", "float16", "bfloat16", "float64")

DEPTHWISE_OPS = ("depthwise_conv2d", "depthwise_conv2d_backward_input", "depthwise_conv2d_backward_weight")
GROUP_NORM_OPS = ("group_norm", "group_norm_backward")

#: The inputs: an odd-sized image, a 3x3 filter with padding 1; a channels-last
#: GroupNorm with a mean offset (x = 3 + noise) and SiLU.
DEPTHWISE_SHAPE = (2, 16, 17, 17)  # N, C, H, W
FILTER = (3, 3)
CONV = {"stride": 1, "padding": 1, "dilation": 1}
GROUP_NORM_SHAPE = (2, 9, 11, 64)  # N, H, W, C
GROUPS = 8
ACTIVATION = "silu"


def cases(dtypes=DTYPES):
    """(op, layout, dtype name) of every check, in table order."""
    rows = []
    for dtype in dtypes:
        for layout in ("NCHW", "NHWC"):
            rows += [(op, layout, dtype) for op in DEPTHWISE_OPS]
        rows += [(op, "NHWC", dtype) for op in GROUP_NORM_OPS]
    return rows


def relative_error(out, ref):
    """||out - ref|| / ||ref|| in float64 (inf when ``out`` has NaN/inf)."""
    got = numpy.asarray(out).astype(numpy.float64)
    ref = numpy.asarray(ref, dtype=numpy.float64)
    if got.shape != ref.shape or not numpy.isfinite(got).all():
        return float("inf")
    scale = numpy.linalg.norm(ref)
    difference = numpy.linalg.norm(got - ref)
    return float(difference / scale) if scale else float(difference)


def _dtype(name):
    return _dtypes.bfloat16 if name == "bfloat16" else numpy.dtype(name)


def _random(rng, shape, dtype, offset=0.0, scale=1.0):
    return (offset + scale * rng.standard_normal(shape)).astype(dtype)


def _nhwc(a):
    return numpy.ascontiguousarray(a.transpose(0, 2, 3, 1))


def check(op, layout, dtype_name, ops, to_device, to_host, reference, rng):
    """Relative error of ``ops.<op>`` against ``reference.<op>`` on fresh inputs.

    ``ops`` holds the functions under test (cupy_dwgn on the GPU), ``to_device`` /
    ``to_host`` move NumPy arrays to their arrays and back.
    """
    dtype = _dtype(dtype_name)
    if op in DEPTHWISE_OPS:
        n, c, h, w = DEPTHWISE_SHAPE
        x = _random(rng, (n, c, h, w), dtype)
        weight = _random(rng, (c, 1, *FILTER), dtype)
        grad_out = _random(rng, (n, c, h, w), dtype)  # stride 1, "same" padding: y has x's shape
        if layout == "NHWC":
            x, grad_out = _nhwc(x), _nhwc(grad_out)
        conv = dict(CONV, layout=layout)
        if op == "depthwise_conv2d":
            bias = _random(rng, (c,), dtype)
            got = ops.depthwise_conv2d(to_device(x), to_device(weight), to_device(bias), **conv)
            want = reference.depthwise_conv2d(x, weight, bias, **conv)
        elif op == "depthwise_conv2d_backward_input":
            got = ops.depthwise_conv2d_backward_input(to_device(grad_out), to_device(weight), x.shape, **conv)
            want = reference.depthwise_conv2d_backward_input(grad_out, weight, x.shape, **conv)
        else:
            got = ops.depthwise_conv2d_backward_weight(to_device(grad_out), to_device(x), weight.shape, **conv)
            want = reference.depthwise_conv2d_backward_weight(grad_out, x, weight.shape, **conv)
        return relative_error(to_host(got), want)

    # GroupNorm: half inputs take float32 affine parameters (mixed precision).
    affine = numpy.dtype(numpy.float32) if dtype.itemsize == 2 else dtype
    channels = GROUP_NORM_SHAPE[-1]
    x = _random(rng, GROUP_NORM_SHAPE, dtype, offset=3.0)
    weight = _random(rng, (channels,), affine, offset=1.0, scale=0.1)
    bias = _random(rng, (channels,), affine, scale=0.1)
    kw = {"eps": 1e-5, "activation": ACTIVATION}
    x_d, w_d, b_d = to_device(x), to_device(weight), to_device(bias)
    y, mean, rstd = ops.group_norm(x_d, GROUPS, w_d, b_d, return_stats=True, **kw)
    y_ref, mean_ref, rstd_ref = reference.group_norm(x, GROUPS, weight, bias, return_stats=True, **kw)
    if op == "group_norm":
        return relative_error(to_host(y), y_ref)
    grad_out = _random(rng, GROUP_NORM_SHAPE, dtype)
    got = ops.group_norm_backward(to_device(grad_out), x_d, mean, rstd, GROUPS, w_d, b_d, activation=ACTIVATION)
    # The reference backward takes the GPU op's statistics dtype (float32 unless
    # x is float64): its own float64 statistics, rounded to that.
    stats = numpy.float64 if dtype == numpy.float64 else numpy.float32
    want = reference.group_norm_backward(
        grad_out, x, mean_ref.astype(stats), rstd_ref.astype(stats), GROUPS, weight, bias, activation=ACTIVATION
    )
    return max(relative_error(to_host(g), r) for g, r in zip(got, want))


def run(dtypes=DTYPES, *, ops, to_device, to_host, reference, seed=None, out=None):
    """Run every check, print the table on ``out`` (default stdout) row by row.

    Returns the number of failed checks.
    """
    out = sys.stdout if out is None else out
    seed = int(numpy.random.SeedSequence().entropy % 2**32) if seed is None else seed
    rng = numpy.random.default_rng(seed)
    print(
        f"depthwise {'x'.join(map(str, DEPTHWISE_SHAPE))} (N x C x H x W) {FILTER[0]}x{FILTER[1]} padding 1; "
        f"group_norm {'x'.join(map(str, GROUP_NORM_SHAPE))} (N x H x W x C) G={GROUPS} +{ACTIVATION}; "
        f"seed {seed}",
        file=out,
    )
    print(f"{'op':34} {'layout':6} {'dtype':9} {'rel. error':>10} {'bound':>8}  result", file=out, flush=True)
    failed = 0
    for op, layout, dtype_name in cases(dtypes):
        bound = TOLERANCE[dtype_name]
        start = time.perf_counter()
        try:
            error = check(op, layout, dtype_name, ops, to_device, to_host, reference, rng)
        except Exception as exc:  # report, keep going: one broken kernel must not hide the rest
            first = (str(exc).strip().splitlines() or [""])[0]
            detail = f"{type(exc).__name__}: {first}"
            failed += 1
            print(f"{op:34} {layout:6} {dtype_name:9} {'-':>10} {bound:8.1e}  FAIL ({detail[:160]})", file=out, flush=True)
            continue
        ok = error <= bound
        failed += not ok
        seconds = time.perf_counter() - start
        timing = f"  ({seconds:.1f} s, compiling)" if seconds > 1.0 else ""
        print(
            f"{op:34} {layout:6} {dtype_name:9} {error:10.2e} {bound:8.1e}  {'pass' if ok else 'FAIL'}{timing}",
            file=out,
            flush=True,
        )
    return failed
