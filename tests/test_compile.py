"""Kernel loading, checked without a GPU: every shipped specialization compiles
with NVRTC for sm_80 and sm_90, with no stack frame and no spills."""

import collections
import concurrent.futures
import functools
import itertools
import math
import multiprocessing
import pickle

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cupy_dwgn import _compile
from cupy_dwgn.errors import KernelCompileError

ARCHS = (80, 90)
ALL_SPECIALIZATIONS = _compile.specializations(large_index=(False, True))
#: Their (file, name expression) pairs, for membership checks.
SHIPPED = frozenset(ALL_SPECIALIZATIONS)


@functools.cache
def _file_reports(filename):
    """{arch: ptxas reports, or the KernelCompileError} of every shipped
    specialization in ``filename``, both archs compiled at once in spawned
    processes: these whole-file compiles are most of the CPU test time (the
    CI machine has 2 cores)."""
    expressions = [e for f, e in ALL_SPECIALIZATIONS if f == filename]
    context = multiprocessing.get_context("spawn")  # no CUDA state inherited on a GPU machine
    with concurrent.futures.ProcessPoolExecutor(len(ARCHS), mp_context=context) as pool:
        futures = {arch: pool.submit(_compile.nvrtc_compile, filename, expressions, arch) for arch in ARCHS}
        concurrent.futures.wait(futures.values())
    return {arch: future.exception() or future.result() for arch, future in futures.items()}


def _reports(filename, arch):
    reports = _file_reports(filename)[arch]
    if isinstance(reports, Exception):
        raise reports
    return reports


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec", ALL_SPECIALIZATIONS, ids=lambda s: s[1])
def test_specialization_compiles_without_stack_or_spills(spec, arch):
    filename, expression = spec
    report = _reports(filename, arch)[expression]
    assert report["registers"] > 0
    assert report["stack_frame"] == 0, report
    assert report["spill_stores"] == 0 and report["spill_loads"] == 0, report


def test_every_op_has_specializations():
    by_op = {op: _compile.specializations(op) for op in _compile._OP_MODULES}
    assert all(by_op.values()), {op: len(s) for op, s in by_op.items()}
    # Every file a specialization names ships in the kernel folder, and every
    # .cu there is used by some specialization (no dead kernel files).
    named = set(collections.Counter(f for f, _ in ALL_SPECIALIZATIONS))
    shipped = {p.name for p in _compile.kernel_dir().glob("*.cu")}
    assert named <= shipped, sorted(named - shipped)
    assert shipped <= named, sorted(shipped - named)
    assert {"depthwise_conv2d.cu", "group_norm.cu"} <= named


def test_name_expressions_are_spelled_like_the_demangler():
    # CuPy >= 14.2 keys its disk cache on the exact spelling; ", " separators.
    for _, expression in ALL_SPECIALIZATIONS:
        assert "<" in expression and expression.endswith(">")
        assert ",," not in expression and "  " not in expression
        inner = expression[expression.index("<") + 1 : -1]
        assert all(part == part.strip() for part in inner.split(", "))
    assert _compile.name_expression("k", "float", 3, "long long") == "k<float, 3, long long>"


def test_header_is_inlined_into_the_source():
    source = _compile.kernel_source("depthwise_conv2d.cu")
    assert '#include "dwgn_common.cuh"' not in source
    assert "namespace dwgn" in source
    assert "#include <cuda_bf16.h>" in source  # system headers stay includes


def test_compile_error_carries_expression_options_and_log(broken_kernel):
    with pytest.raises(KernelCompileError) as info:
        _compile.nvrtc_compile(broken_kernel, ["k<float>"], 90)
    error = info.value
    assert error.name_expression == "k<float>"
    assert "--std=c++17" in error.options
    assert "undefined_name" in error.log and "undefined_name" in str(error)
    assert "CuPy" in str(error)
    # It survives a pickle round trip: precompile(jobs=N) gets it back from a
    # worker process (default exception pickling lost its fields and made the
    # worker pool hang).
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is KernelCompileError and str(again) == str(error)
    assert (again.name_expression, again.options, again.log) == (error.name_expression, error.options, error.log)


def _template_args(expression):
    return expression[expression.index("<") + 1 : -1].split(", ")


@pytest.mark.parametrize("jobs", [0, -2, 1.5, True, "4"])
def test_precompile_jobs_must_be_a_positive_int(jobs):
    # Checked before anything is compiled (so also without a GPU).
    with pytest.raises(ValueError, match="jobs: expected a positive int"):
        _compile.precompile(["group_norm"], jobs=jobs)


def test_precompile_selection_narrows_the_set():
    from cupy_dwgn import _depthwise_nchw_forward_regs
    selection = dict(dtypes=["float16"], filter_sizes=[(3, 3), (2, 9)], large_index=(False,))
    expressions = [e for _, e in _compile.specializations(["depthwise_conv2d"], **selection)]
    everything = {e for _, e in _compile.specializations(["depthwise_conv2d"])}
    assert expressions and set(expressions) < everything
    assert len(expressions) == len(set(expressions))
    for expression in expressions:
        args = _template_args(expression)
        # Only __half; only 32-bit indexing; no other dtype or index width.
        assert "__half" in args, expression
        assert not {"float", "double", "__nv_bfloat16", "long long"} & set(args), expression
        # (the register row walk has no index argument: 64-bit plane offsets in every specialization)
        assert "int" in args or expression.startswith(_depthwise_nchw_forward_regs.KERNEL + "<"), expression
        # Only the selected filter sizes: no unrolled 5x5 or 7x7 kernel.
        assert ", 5, 5" not in expression and ", 7, 7" not in expression, expression
    # The 3x3 specialization and a generic kernel (template size 0, 0) for 2x9.
    assert any(", 3, 3" in e for e in expressions), expressions
    assert any(", 0, 0" in e for e in expressions), expressions
    # Dropping (2, 9) narrows the set further (some generic kernels may stay:
    # fallbacks a 3x3 call can take), keeping the 3x3 specializations.
    only_3x3 = [e for _, e in _compile.specializations(["depthwise_conv2d"], **dict(selection, filter_sizes=[(3, 3)]))]
    assert set(only_3x3) < set(expressions)
    assert {e for e in expressions if ", 3, 3" in e} <= set(only_3x3)
    with pytest.raises(ValueError, match="ops: expected names from"):
        _compile.specializations(["conv3d"])


@pytest.mark.parametrize("plan_name", ["_forward_plan", "_backward_plan"])
def test_group_norm_plans_launch_only_shipped_specializations(plan_name):
    # A call's launch plan names its kernels; each must be one that
    # precompile() builds and the NVRTC test above checks.
    import numpy

    from _helpers import BFLOAT16
    from cupy_dwgn import _group_norm as gn

    shipped = {e for f, e in ALL_SPECIALIZATIONS if f == gn.KERNEL_FILE}
    make_plan = getattr(gn, plan_name)
    signatures = [
        # (N, S, C, G, dtype, weight dtype, activation, aligned)
        (2, 4096, 320, 32, numpy.float16, numpy.float32, "silu", True),
        (2, 4096, 320, 32, BFLOAT16, BFLOAT16, "gelu", False),
        (1, 9, 12, 4, numpy.float32, numpy.float32, "identity", True),
        (3, 7, 5, 5, numpy.float64, numpy.float64, "gelu_tanh", True),
        (1, 2**22, 1024, 32, numpy.float16, numpy.float16, "relu", True),  # 2**32 elements
    ]
    eps = (1e-5,) if plan_name == "_forward_plan" else ()  # the forward plan carries eps
    for n, s, c, g, dtype, w_dtype, activation, aligned in signatures:
        args = (n, s, c, g, numpy.dtype(dtype), numpy.dtype(w_dtype), activation, *eps, aligned)
        plan = make_plan(*args)
        expressions = [launch.expression for launch in (plan.first, plan.finalize, plan.elementwise)]
        assert set(expressions) <= shipped, expressions
        assert ("long long" in expressions[0]) == (n * s * c >= 2**31)
        # The column kernel reads VEC-channel vectors (its template argument
        # before the index type): the split is over C / VEC columns.
        vec = int(_template_args(expressions[0])[-2])
        assert vec in (1, gn._vector_width(numpy.dtype(dtype), c, aligned))
        if plan_name == "_forward_plan":  # per-group partial sums where the statistics blocks hold whole groups
            large = n * s * c * numpy.dtype(dtype).itemsize >= gn._GROUPED_BYTES
            _, num_chunks, _, _, grouped = gn._stats_split(n, s, c // vec, vec, c // g, large,
                                                          numpy.dtype(dtype).itemsize)
            assert plan.temporaries[0][0] == (n, num_chunks, 2, g if grouped else c)
        else:
            num_chunks = gn._split(n, s, c // vec, vec > 1, numpy.dtype(dtype).itemsize)[1]
            assert plan.temporaries[0][0] == (n, num_chunks, 2, c)
        # Repeated signatures reuse the cached plan.
        assert make_plan(*args) is plan


# Depthwise plans that need no GPU to build (the NHWC family, the NCHW
# tiled/direct kernels and weight gradients; the window and large-filter
# plans read the device): every
# kernel a plan launches must be one precompile() builds and the NVRTC test
# above checks, in every dtype, for both index widths and alignments.
_DEPTHWISE_GEOMETRIES = [
    # (x NCHW shape, weight shape, stride, padding, dilation)
    ((64, 144, 56, 56), (144, 1, 3, 3), 1, 1, 1),
    ((64, 96, 112, 112), (96, 1, 3, 3), 2, 1, 1),
    ((64, 240, 28, 28), (240, 1, 5, 5), 1, 2, 1),
    ((64, 96, 56, 56), (96, 1, 7, 7), 1, 3, 1),
    ((16, 512, 16, 16), (512, 1, 31, 31), 1, 15, 1),
    ((2, 7, 13, 11), (14, 1, 3, 5), (2, 1), ((1, 2), (0, 3)), (2, 1)),
    ((1, 5, 9, 9), (5, 1, 11, 11), 3, 5, 1),
]


@pytest.mark.parametrize("case", _DEPTHWISE_GEOMETRIES, ids=lambda c: "x".join(map(str, c[1])))
def test_depthwise_plans_launch_only_shipped_specializations(case):
    import numpy

    from _helpers import DTYPES
    from cupy_dwgn import _depthwise_nchw as nchw
    from cupy_dwgn import _depthwise_nchw_forward_regs as nchw_forward_regs
    from cupy_dwgn import _depthwise_nchw_plane as nchw_plane
    from cupy_dwgn import _depthwise_nchw_rows as nchw_rows
    from cupy_dwgn import _depthwise_nchw_wgrad as nchw_wgrad
    from cupy_dwgn import _depthwise_nchw_wgrad_regs as nchw_wgrad_regs
    from cupy_dwgn import _depthwise_nhwc as nhwc
    from cupy_dwgn import _depthwise_nhwc_direct as nhwc_direct
    from cupy_dwgn import _depthwise_nhwc_ring as nhwc_ring
    from cupy_dwgn import _depthwise_nhwc_wgrad as nhwc_wgrad
    from cupy_dwgn import _depthwise_nhwc_window as nhwc_window
    from cupy_dwgn import _depthwise_wgrad_mma as wgrad_mma
    from cupy_dwgn import _validate

    shipped = SHIPPED
    x_shape, w_shape, stride, padding, dilation = case
    g = _validate.conv_geometry(x_shape, w_shape, stride, padding, dilation)
    for dtype in DTYPES:
        dtype = numpy.dtype(dtype)
        for index in ("int", "long long"):
            launches = []
            for aligned in (True, False):
                launches += nhwc.forward_plan(g, dtype, index, aligned)
                launches.append(nhwc.backward_input_plan(g, dtype, index, aligned)[0])
                launches += nhwc.backward_weight_plan(g, dtype, index, aligned)[0]
            launches.append(nchw.forward_plan(g, dtype, index))
            launches.append(nchw.backward_input_plan(g, dtype, index)[0])
            launches += nchw.backward_weight_plan(g, dtype, index)[:2]
            launches += nchw_wgrad.plan(g, dtype) or []
            for backward in (False, True):
                launches.append(nchw_rows.plan(g, dtype, backward, index))
                for alignment in (16, 4, 2):
                    launches.append(nchw_forward_regs.plan(g, dtype, backward, alignment, alignment))
                launches.append(nhwc_direct.plan(g, dtype, backward, index, 16, 16))
                launches.append(nhwc_ring.plan(g, dtype, backward, index, 16, 16))
                for alignment in (16, 2):
                    launches.append(nchw_plane.plan(g, dtype, backward, index, alignment, alignment))
                    launches.append(nhwc_window.plan(g, dtype, backward, index, alignment, alignment))
                planned = nhwc_wgrad.plan(g, dtype, index, alignment, alignment)
                launches += planned[0] if planned else []
                planned = nchw_wgrad_regs.plan(g, dtype, alignment, alignment)
                launches += planned[0] if planned else []
            for layout in ("NCHW", "NHWC"):
                planned = wgrad_mma.plan(g, dtype, layout, index, 16, 16)
                launches += planned[0] if planned else []
            launches = [launch for launch in launches if launch is not None]
            for launch in launches:
                assert (launch.file, launch.expression) in shipped, launch
                assert all(v > 0 for v in launch.grid + launch.block), launch


def _correlation_case(rng, x_shape, weight, conv, g, backward):
    """(source, bias or None, float64 reference) of a forward (source x) or
    backward-input (source grad_out) call of the direct-style kernels."""
    from cupy_dwgn import reference

    y_shape = (x_shape[0], weight.shape[0], g.out_height, g.out_width)
    src = rng.standard_normal(y_shape if backward else x_shape)
    bias = None if backward else rng.standard_normal(weight.shape[0])
    if backward:
        return src, bias, reference.depthwise_conv2d_backward_input(src, weight, x_shape, **conv)
    return src, bias, reference.depthwise_conv2d(src, weight, bias, **conv)


def _emulation_arrays(src, weight, channels, k, src_h, src_w, dst_h, dst_w, backward):
    """(source planes, filters (rotated for backward-input), NaN destination,
    write counts) in float64 for the direct-style kernels' emulations."""
    import numpy

    planes = src.shape[0] * src.shape[1]
    x = src.astype(numpy.float64).reshape(planes, src_h, src_w)
    w = weight.astype(numpy.float64).reshape(channels, k, k)
    if backward:
        w = w[:, ::-1, ::-1]
    out = numpy.full((planes, dst_h, dst_w), numpy.nan)
    return x, w, out, numpy.zeros(out.shape, numpy.int64)


def _emulate_nchw_rows(launch, src, weight, bias, backward):
    """What kernels/depthwise_nchw_rows.cu computes for ``launch``, in
    float64, following its index math (thread t: destination row t % dst_h
    of plane t / dst_h; W columns, those past dst_w not stored; the rotated
    filter for backward-input); returns the destination and how often each
    value was written."""
    import numpy

    channels, src_h, src_w, dst_h, dst_w, off_top, off_left, num_rows = (int(v) for v in launch.scalars)
    k, _, stride, width = (int(v) for v in launch.expression.split("<")[1].split(", ")[1:5])
    assert launch.grid[0] * launch.block[0] >= num_rows
    x, w, out, writes = _emulation_arrays(src, weight, channels, k, src_h, src_w, dst_h, dst_w, backward)
    for t in range(num_rows):
        plane, y = divmod(t, dst_h)
        channel = plane % channels
        acc = numpy.full(width, 0.0 if bias is None else float(bias[channel]))
        for kh in range(k):
            row = y * stride - off_top + kh
            if not 0 <= row < src_h:
                continue
            for j in range(width):
                for kw in range(k):
                    col = j * stride + kw - off_left
                    if 0 <= col < src_w:
                        acc[j] += w[channel, kh, kw] * x[plane, row, col]
        out[plane, y, :] = acc[:dst_w]
        writes[plane, y, :] += 1
    return out.reshape((src.shape[0], src.shape[1], dst_h, dst_w)), writes


@pytest.mark.parametrize("case", [((2, 3, 7, 7), 3, 1, 1), ((1, 2, 9, 12), 5, 1, ((0, 4), (3, 1))),
                                  ((1, 2, 5, 3), 7, 1, 8), ((2, 3, 13, 16), 7, 1, 3), ((1, 3, 14, 15), 3, 2, 1),
                                  ((1, 2, 9, 9), 5, 2, "valid")],
                         ids=lambda c: f"{'x'.join(map(str, c[0]))}-{c[1]}x{c[1]}-s{c[2]}")
def test_nchw_rows_kernel_index_math_matches_the_reference(case):
    # Every destination value written once and equal to the float64
    # reference, both directions (backward at stride 1), both row widths.
    _check_nchw_rows_index_math(case, seed=13)


@settings(max_examples=200, deadline=None)
@given(x_shape=st.tuples(st.integers(1, 2), st.integers(1, 4), st.integers(1, 24), st.integers(1, 40)),
       k=st.sampled_from([3, 5, 7]), stride=st.sampled_from([1, 2]),
       padding=st.tuples(*[st.tuples(st.integers(0, 9), st.integers(0, 9))] * 2), seed=st.integers(0, 2**32 - 1))
def test_nchw_rows_random_geometries(x_shape, k, stride, padding, seed):
    # The row kernel's emulation on drawn geometries (any padding per side,
    # destination rows of 1 to 16 values and wider, which it declines).
    assume(x_shape[2] + sum(padding[0]) >= k and x_shape[3] + sum(padding[1]) >= k)
    _check_nchw_rows_index_math((x_shape, k, stride, padding), seed)


def _check_nchw_rows_index_math(case, seed):
    import numpy

    from cupy_dwgn import _depthwise_nchw_rows as rows
    from cupy_dwgn import _validate

    x_shape, k, stride, padding = case
    c = x_shape[1]
    g = _validate.conv_geometry(x_shape, (c, 1, k, k), stride, padding, 1)
    rng = numpy.random.default_rng(seed)
    conv = dict(stride=stride, padding=padding)
    weight = rng.standard_normal((c, 1, k, k))
    for backward in (False, True) if stride == 1 else (False,):
        src, bias, want = _correlation_case(rng, x_shape, weight, conv, g, backward)
        launch = rows.plan(g, numpy.dtype(numpy.float32), backward, "int")
        if launch is None:  # rows wider than the kernel's W
            assert rows.width(want.shape[3], stride) is None
            continue
        got, writes = _emulate_nchw_rows(launch, src, weight, bias, backward)
        assert (writes == 1).all()
        numpy.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def _emulate_nchw_forward_regs(launch, src, weight, bias, backward):
    """What kernels/depthwise_nchw_forward_regs.cu computes for ``launch``,
    in float64, following its walk lane by lane: units (plane, row strip,
    segment) over the workers of the grid, each lane's own source vectors
    (zero where wholly outside the row: never loaded), its halo columns from
    the lane of its group that owns them or, at a group edge, loaded itself
    (zero outside the row), the ring slot of each (filter row, destination
    row) pair from the unrolled step phase, and the stores at each row's
    last filter row.  A value the kernel leaves unspecified (a source row
    outside the image: not loaded, its registers stale) is NaN, so using one
    fails.  Returns the destination and how often each value was written."""
    import math

    import numpy

    (src_h, src_w, channels, dst_h, dst_w, pad_top, pad_left, row_strip, row_strips, segments, group_lanes,
     units) = (int(v) for v in launch.scalars)
    ctype, k, stride, vw, is_backward = (v.strip() for v in launch.expression.split("<")[1].rstrip(">").split(","))
    k, stride, vw = int(k), int(stride), int(vw)
    assert (is_backward == "true") == backward
    itemsize = 4 if ctype == "float" else 2
    vs = vw * stride
    xv = min(vs, 16 // itemsize)
    sh, iw = k // 2, (vw - 1) * stride + k
    nh = iw - vs
    ring = -(-k // stride)
    lookahead = 3 if k == 3 else 2 if k == 5 else 1  # kernel: lookahead()
    buffers = lookahead + 1 if itemsize == 4 else lookahead
    period = ring * stride
    unroll = period // math.gcd(period, buffers) * buffers  # kernel: PB
    workers = 4 * (32 // group_lanes)
    assert launch.block == (128, 1, 1) and launch.grid[0] * workers >= units
    assert src_w % xv == 0 and (sh - pad_left) % xv == 0 and dst_w % vw == 0
    assert units == src.shape[0] * src.shape[1] * row_strips * segments
    x, w, out, writes = _emulation_arrays(src, weight, channels, k, src_h, src_w, dst_h, dst_w, backward)
    for u in range(units):
        plane, rest = divmod(u, row_strips * segments)
        strip, seg = divmod(rest, segments)
        c = plane % channels
        oh0 = strip * row_strip
        rows = min(row_strip, dst_h - oh0)
        steps = (rows - 1) * stride + k
        ih0 = oh0 * stride - pad_top
        start = 0.0 if bias is None else float(bias[c])
        ow0 = [(seg * group_lanes + gl) * vw for gl in range(group_lanes)]
        ob = [o * stride - pad_left + sh for o in ow0]
        acc = [[[start] * vw for _ in range(ring)] for _ in range(group_lanes)]
        slot_row = [None] * ring
        for j in range(steps):
            ih = ih0 + j
            row_in = 0 <= ih < src_h
            # Each lane's own columns ob .. ob + VS - 1, as the kernel's xw[SH ..].
            own = []
            for gl in range(group_lanes):
                values = []
                for v in range(vs // xv):
                    first = ob[gl] + v * xv
                    inside = 0 <= first < src_w
                    assert inside == (0 <= first + xv - 1 < src_w)  # vectors wholly inside or outside
                    if not inside:
                        values += [0.0] * xv
                    elif row_in:
                        values += list(x[plane, ih, first:first + xv])
                    else:
                        values += [numpy.nan] * xv
                own.append(values)
            windows = []
            for gl in range(group_lanes):
                window = [None] * iw
                window[sh:sh + vs] = own[gl]
                for h in range(nh):
                    e = h if h < sh else h + vs
                    delta = (e - sh) // vs
                    se = e - sh - delta * vs
                    if 0 <= gl + delta < group_lanes:
                        window[e] = own[gl + delta][se]
                    elif 0 <= ob[gl] + e - sh < src_w:
                        window[e] = x[plane, ih, ob[gl] + e - sh] if row_in else numpy.nan
                    else:
                        window[e] = 0.0
                windows.append(window)
            q = j % unroll
            for kh in range(k):
                if (q - kh) % stride:
                    continue
                slot = ((q - kh) // stride) % ring
                m = (j - kh) // stride
                if not (j >= kh and m < rows):
                    continue
                if kh == 0:
                    assert slot_row[slot] is None, "ring slot still open"
                    slot_row[slot] = m
                assert slot_row[slot] == m, "ring slot of another row"
                for gl in range(group_lanes):
                    if ow0[gl] >= dst_w or not row_in:
                        continue
                    for kw in range(k):
                        for t in range(vw):
                            acc[gl][slot][t] += w[c, kh, kw] * windows[gl][t * stride + kw]
                if kh == k - 1:
                    for gl in range(group_lanes):
                        if ow0[gl] < dst_w:
                            out[plane, oh0 + m, ow0[gl]:ow0[gl] + vw] = acc[gl][slot]
                            writes[plane, oh0 + m, ow0[gl]:ow0[gl] + vw] += 1
                        acc[gl][slot] = [start] * vw
                    slot_row[slot] = None
    return out.reshape((src.shape[0], src.shape[1], dst_h, dst_w)), writes


@pytest.mark.parametrize("case", [
    ((2, 3, 13, 11), 3, 1, 1, 4), ((1, 2, 9, 16), 5, 1, ((0, 4), (3, 1)), 2), ((1, 2, 5, 8), 7, 1, 8, 4),
    ((2, 2, 13, 16), 7, 1, 3, 2), ((1, 3, 14, 16), 3, 2, 1, 4), ((1, 2, 9, 12), 5, 2, 2, 2),
    ((1, 2, 15, 14), 7, 2, 3, 4), ((1, 1, 3, 136), 3, 1, 1, 2), ((1, 1, 4, 264), 3, 2, 1, 4),
    ((1, 2, 20, 16), 3, 1, 1, 2), ((2, 1, 1, 12), 3, 1, (1, 0), 4),
], ids=lambda c: f"{'x'.join(map(str, c[0]))}-{c[1]}x{c[1]}-s{c[2]}-{c[4]}B")
def test_nchw_forward_regs_walk_matches_the_reference(case, monkeypatch):
    # Every destination value written once and equal to the float64
    # reference, both directions (backward at stride 1), float32 and 2-byte
    # vectors, with the long strips forced (several strips per plane) and
    # with the grid rule's short ones; rows wider than a warp (segments).
    import numpy

    from cupy_dwgn import _depthwise_nchw_forward_regs as walk
    from cupy_dwgn import _launch, _validate

    x_shape, k, stride, padding, itemsize = case
    c = x_shape[1]
    g = _validate.conv_geometry(x_shape, (c, 1, k, k), stride, padding, 1)
    rng = numpy.random.default_rng(17)
    conv = dict(stride=stride, padding=padding)
    weight = rng.standard_normal((c, 1, k, k))
    dtype = numpy.dtype(numpy.float32 if itemsize == 4 else numpy.float16)
    for long_strips in (False, True):
        if long_strips:
            monkeypatch.setattr(_launch, "LONG_STRIP_MIN_THREADS", 0)
        walk.plan.cache_clear()
        for backward in (False, True) if stride == 1 else (False,):
            src, bias, want = _correlation_case(rng, x_shape, weight, conv, g, backward)
            launch = walk.plan(g, dtype, backward, 16, 16)
            assert launch is not None
            got, writes = _emulate_nchw_forward_regs(launch, src, weight, bias, backward)
            assert (writes == 1).all()
            numpy.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    walk.plan.cache_clear()


def _draw_nchw_geometry(draw, max_height, extra_heights, extra_widths, max_channels):
    """(x NCHW shape, K, stride, padding per side) of a drawn depthwise call:
    K 3/5/7, stride 1/2, padding 0 to K + 1 a side, heights 1 to
    ``max_height`` or from ``extra_heights``, widths 1 to 40 or from
    ``extra_widths`` (at least one output each way), 1-2 images of 1 to
    ``max_channels`` channels."""
    k = draw(st.sampled_from([3, 5, 7]))
    stride = draw(st.sampled_from([1, 2]))
    padding = tuple((draw(st.integers(0, k + 1)), draw(st.integers(0, k + 1))) for _ in range(2))
    height = draw(st.one_of(st.integers(max(1, k - sum(padding[0])), max_height), *extra_heights))
    width = max(draw(st.one_of(st.integers(max(1, k - sum(padding[1])), 40), extra_widths)), k - sum(padding[1]))
    return (draw(st.integers(1, 2)), draw(st.integers(1, max_channels)), height, width), k, stride, padding


@st.composite
def _row_walk_geometries(draw):
    # Widths that take wide vectors as well as odd ones.
    return _draw_nchw_geometry(draw, 24, (), st.sampled_from([8, 16, 24, 32, 48, 56]), 3)


@settings(max_examples=40, deadline=None)
@given(_row_walk_geometries(), st.sampled_from([2, 4]), st.sampled_from([16, 8, 4, 2]), st.integers(0, 2**32 - 1))
def test_nchw_forward_regs_walk_random_geometries(geometry, itemsize, alignment, seed):
    # The row walk's emulation on drawn geometries (any padding per side,
    # widths with and without vectors, both strides, both directions, the
    # arrays' alignment): every destination value written once and equal to
    # the float64 reference wherever the host plans the kernel; where it
    # does not, only because a stride-2 walk's source vectors (>= 2 values)
    # cannot be aligned.
    import numpy

    from cupy_dwgn import _depthwise_nchw_forward_regs as walk
    from cupy_dwgn import _validate

    x_shape, k, stride, padding = geometry
    c = x_shape[1]
    g = _validate.conv_geometry(x_shape, (c, 1, k, k), stride, padding, 1)
    rng = numpy.random.default_rng(seed)
    conv = dict(stride=stride, padding=padding)
    weight = rng.standard_normal((c, 1, k, k))
    dtype = numpy.dtype(numpy.float32 if itemsize == 4 else numpy.float16)
    alignment = max(alignment, itemsize)
    for backward in (False, True) if stride == 1 else (False,):
        src, bias, want = _correlation_case(rng, x_shape, weight, conv, g, backward)
        launch = walk.plan(g, dtype, backward, alignment, alignment)
        if launch is None:
            offset_left = _validate.correlation_frame(g, backward)[5]
            assert stride == 2 and ((offset_left - k // 2) % 2 or g.width % 2 or alignment < 2 * itemsize)
            continue
        got, writes = _emulate_nchw_forward_regs(launch, src, weight, bias, backward)
        assert (writes == 1).all()
        numpy.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_nchw_forward_regs_rule():
    # Where the ops take the register row walk (preferred's docstring) and
    # the VW / strips it plans; what it does not serve.
    import numpy

    from cupy_dwgn import _depthwise_nchw_forward_regs as walk
    from cupy_dwgn import _validate

    shipped = SHIPPED
    half, single, double = (numpy.dtype(t) for t in (numpy.float16, numpy.float32, numpy.float64))
    for x_shape, k, stride, dtype, backward, want_vw, taken in [
        ((64, 96, 112, 112), 3, 2, single, False, 4, True), ((64, 96, 112, 112), 3, 2, half, False, 8, True),
        ((64, 144, 56, 56), 3, 2, half, False, 4, True), ((64, 240, 56, 56), 5, 2, single, False, 4, True),
        ((64, 144, 56, 56), 3, 1, half, False, 8, True), ((64, 144, 56, 56), 3, 1, half, True, 8, True),
        ((64, 144, 56, 56), 3, 1, single, False, 4, False), ((64, 384, 28, 28), 3, 1, half, False, 4, False),
        ((64, 240, 28, 28), 5, 1, half, False, 4, False), ((64, 96, 56, 56), 7, 1, half, False, 4, False),
        ((8, 96, 75, 75), 3, 2, half, False, None, False), ((64, 32, 28, 28), 7, 2, half, False, 2, False),
        # 8-byte source vectors: float32 3x3 from 24 columns wide, not half types or 5x5.
        ((64, 144, 150, 150), 3, 2, single, False, 1, True), ((64, 192, 50, 50), 3, 2, single, False, 1, True),
        ((64, 192, 30, 30), 3, 2, single, False, 1, False), ((64, 144, 150, 150), 3, 2, half, False, 1, False),
        ((64, 144, 150, 150), 5, 2, single, False, 1, False), ((64, 192, 51, 51), 3, 2, single, False, None, False),
        # half types with 8-byte source vectors on destinations of 11 to 14 (28-wide sources), not wider
        ((64, 192, 28, 28), 3, 2, half, False, 2, True), ((64, 240, 28, 28), 3, 2, half, False, 2, True),
        ((64, 192, 28, 28), 5, 2, half, False, 2, False), ((64, 64, 36, 36), 3, 2, half, False, 2, False),
    ]:
        g = _validate.conv_geometry(x_shape, (x_shape[1], 1, k, k), stride, k // 2, 1)
        launch = walk.plan(g, dtype, backward, 16, 16)
        if want_vw is None:
            assert launch is None
            continue
        assert (launch.file, launch.expression) in shipped
        assert walk.launch_vector_width(launch) == want_vw, (x_shape, k, dtype)
        assert walk.preferred(g, dtype, backward, want_vw) == taken, (x_shape, k, dtype)
        assert (walk.select(g, dtype, backward, 16, 16) is not None) == taken
    g = _validate.conv_geometry((64, 96, 112, 112), (96, 1, 3, 3), 2, 1, 1)
    assert int(walk.plan(g, single, False, 16, 16).scalars[7]) == 7  # rows per strip
    small = _validate.conv_geometry((1, 8, 112, 112), (8, 1, 3, 3), 2, 1, 1)
    assert int(walk.plan(small, half, False, 16, 16).scalars[7]) == walk.MIN_STRIP_ROWS  # a small grid
    for g in (_validate.conv_geometry((1, 4, 16, 16), (8, 1, 3, 3), 1, 1, 1),  # multiplier 2
              _validate.conv_geometry((1, 4, 16, 16), (4, 1, 3, 3), 1, 2, 2),  # dilation 2
              _validate.conv_geometry((1, 4, 16, 16), (4, 1, 3, 3), 2, 1, 1)):  # stride-2 backward-input
        assert walk.plan(g, half, g.stride_h == 2, 16, 16) is None
    assert walk.plan(_validate.conv_geometry((1, 4, 16, 16), (4, 1, 3, 3), 1, 1, 1), double, False, 16, 16) is None


def test_nchw_rows_rule():
    # Where the ops take the row kernel (preferred's docstring), the W it
    # compiles, the grid (one thread per destination row), and what it does
    # not serve: wider rows, stride-2 backward-input, dilation, multiplier 2,
    # float64, other filter sizes.
    import numpy

    from _helpers import dispatch_stand_in, nchw_launch_expressions

    from cupy_dwgn import _depthwise_nchw_rows as rows
    from cupy_dwgn import _dtypes, _validate

    shipped = SHIPPED
    half, single, double = (numpy.dtype(t) for t in (numpy.float16, numpy.float32, numpy.float64))
    for hw, k, stride, dtype, backward, want_w, taken in [
        (7, 3, 1, single, False, 8, True), (7, 3, 1, half, True, 8, True), (8, 5, 1, half, False, 8, True),
        (10, 3, 1, single, True, 16, True), (14, 7, 1, half, False, 16, False), (14, 7, 1, single, False, 16, False),
        (14, 7, 1, numpy.dtype(_dtypes.bfloat16), False, 16, False), (14, 7, 1, numpy.dtype(_dtypes.bfloat16), True, 16, False),
        (14, 3, 1, half, False, 16, False), (16, 7, 1, half, True, 16, False), (14, 5, 2, half, False, 8, True),
        (11, 3, 1, half, False, 16, False), (11, 3, 1, single, True, 16, False), (13, 5, 1, half, True, 16, False),
        (15, 7, 1, half, False, 16, False), (12, 7, 1, half, False, 16, False), (13, 3, 1, half, False, 16, False),
        (13, 7, 1, single, False, 16, False), (13, 7, 1, half, True, 16, False),
        (13, 7, 1, numpy.dtype(_dtypes.bfloat16), False, 16, False),
        (16, 3, 2, single, False, 8, True), (18, 3, 1, half, False, None, False), (18, 3, 2, half, False, None, False),
        (14, 3, 2, half, True, None, False), (7, 3, 1, double, False, None, False),
        # 10-wide half types at stride 1 go to the plane kernel (7x7 since 2026-12-06); float32 stays.
        (10, 3, 1, half, False, 16, False), (10, 5, 1, half, True, 16, False), (10, 7, 1, half, False, 16, False),
        (10, 7, 1, single, True, 16, True),
        (10, 5, 1, single, False, 16, True),
        # 7x7 on 7-wide planes go to the plane kernel; 8-wide stay (2026-12-06)
        (7, 7, 1, half, False, 8, False), (7, 7, 1, half, True, 8, False), (7, 7, 1, single, False, 8, False),
        (7, 7, 1, single, True, 8, False), (8, 7, 1, single, False, 8, True), (8, 7, 1, half, True, 8, True),
    ]:
        g = _validate.conv_geometry((4, 24, hw, hw), (24, 1, k, k), stride, k // 2, 1)
        launch = rows.plan(g, dtype, backward, "int")
        if want_w is None:
            assert launch is None, (hw, k, stride, dtype, backward)
            continue
        assert (launch.file, launch.expression) in shipped
        assert launch.expression.split(", ")[4] == str(want_w) and launch.shared_mem == 0
        dst_h = g.height if backward else g.out_height
        assert int(launch.scalars[-1]) == 4 * 24 * dst_h and launch.grid[0] == -(-4 * 24 * dst_h // rows.THREADS)
        assert rows.preferred(g, dtype, backward, 16, 16) == taken, (hw, k, stride, dtype, backward)
        assert (rows.select(g, dtype, backward, "int", 16, 16) is launch) == taken
        if taken:  # the op launches it (other kernels' plans need a device)
            assert nchw_launch_expressions(g, dispatch_stand_in(4 * 24 * hw * hw, dtype))[backward] == launch.expression
    for x_shape, w_shape, stride, dilation in [((2, 4, 7, 7), (4, 1, 3, 3), 1, 2), ((2, 4, 7, 7), (8, 1, 3, 3), 1, 1),
                                               ((2, 4, 7, 7), (4, 1, 3, 5), 1, 1), ((2, 4, 7, 7), (4, 1, 3, 3), (1, 2), 1)]:
        g = _validate.conv_geometry(x_shape, w_shape, stride, 1, dilation)
        assert rows.plan(g, single, False, "int") is None

def _nhwc_reference_cases(x_shape, k, stride, padding, seed):
    """(dtype, backward, weight, src, bias or None, float64 reference) for
    the NHWC kernels' index-math emulations: float32 and float16, forward
    and (stride 1) backward-input, random data of ``seed``."""
    import numpy

    from cupy_dwgn import _validate, reference

    c = x_shape[3]
    g = _validate.conv_geometry(x_shape, (c, 1, k, k), stride, padding, 1, layout="NHWC")
    rng = numpy.random.default_rng(seed)
    conv = dict(stride=stride, padding=padding, layout="NHWC")
    for dtype in (numpy.dtype(numpy.float32), numpy.dtype(numpy.float16)):
        weight = rng.standard_normal((c, 1, k, k)).astype(dtype)
        for backward in (False, True) if stride == 1 else (False,):
            y_shape = (x_shape[0], g.out_height, g.out_width, c)
            src = rng.standard_normal(y_shape if backward else x_shape).astype(dtype)
            bias = None if backward else rng.standard_normal(c).astype(dtype)
            w64, src64 = weight.astype(numpy.float64), src.astype(numpy.float64)
            if backward:
                want = reference.depthwise_conv2d_backward_input(src64, w64, x_shape, **conv)
            else:
                want = reference.depthwise_conv2d(src64, w64, None if bias is None else bias.astype(numpy.float64), **conv)
            yield dtype, backward, weight, src, bias, want


def _emulate_nhwc_direct(launch, src, weight, bias, backward):
    """What kernels/depthwise_nhwc_direct.cu computes for ``launch``, in
    float64, following its index math (channel tile x vector lane, items
    grid-stride along y, strips of TW columns, the rotated filter for
    backward-input); returns the destination and how often each value was
    written."""
    import numpy

    src_h, src_w, dst_h, dst_w, channels, off_top, off_left, strips, items = (int(v) for v in launch.scalars)
    k, stride, tw = (int(v) for v in launch.expression.split("<")[1].split(", ")[1:4])
    vec = 16 // src.dtype.itemsize
    tiles, blocks_y = launch.grid[0], launch.grid[1]
    bx, by = launch.block[0], launch.block[1]
    n = src.shape[0]
    x = src.astype(numpy.float64)
    w = weight.astype(numpy.float64).reshape(channels, k, k)
    if backward:
        w = w[:, ::-1, ::-1]
    b = numpy.zeros(channels) if bias is None else bias.astype(numpy.float64)
    out = numpy.full((n, dst_h, dst_w, channels), numpy.nan)
    writes = numpy.zeros(out.shape, numpy.int64)
    for tile in range(tiles):
        for lane in range(bx):
            c = (tile * bx + lane) * vec
            if c >= channels:
                continue
            cs = slice(c, c + vec)
            for start in range(by * blocks_y):  # thread (y) of block (blockIdx.y): first item
                for item in range(start, items, by * blocks_y):
                    row_item, strip = divmod(item, strips)
                    img, oh = divmod(row_item, dst_h)
                    ow0 = strip * tw
                    acc = numpy.tile(b[cs], (tw, 1))
                    for kh in range(k):
                        ih = oh * stride - off_top + kh
                        if not 0 <= ih < src_h:
                            continue
                        for t in range(tw):
                            for kw in range(k):
                                iw = ow0 * stride - off_left + t * stride + kw
                                if 0 <= iw < src_w:
                                    acc[t] += w[cs, kh, kw] * x[img, ih, iw, cs]
                    for t in range(tw):
                        if ow0 + t < dst_w:
                            out[img, oh, ow0 + t, cs] = acc[t]
                            writes[img, oh, ow0 + t, cs] += 1
    return out, writes


def _emulate_nhwc_ring(launch, src, weight, bias, backward, blocks):
    """What kernels/depthwise_nhwc_ring.cu computes for ``launch`` on a grid of
    ``blocks`` blocks, in float64, following its stream logic: each block's
    contiguous output rows, the input-row stream per image segment, the ring
    (slot = entry % ring, filled only when the entries it held are done), the
    zeroed padding columns and the strips of TW columns per thread.  Checks
    that every entry a row reads is issued and still in its slot; returns the
    destination and how often each value was written."""
    import numpy

    from cupy_dwgn import _depthwise_nhwc_ring as ring_module

    (src_h, src_w, dst_h, dst_w, channels, off_top, off_left, lead, slot_pixels, ring, total_rows,
     _bulk) = (int(v) for v in launch.scalars)
    k, stride, tw = (int(v) for v in launch.expression.split("<")[1].split(", ")[1:4])
    vectors = channels // 4
    assert launch.block[0] % vectors == 0 and launch.block[0] <= ring_module.max_threads(k)
    groups = launch.block[0] // vectors
    strips = -(-dst_w // tw)
    # Reads stay in the slot: the first column a strip reads (the emulation's
    # numpy indexing would wrap a negative one round to the slot's end).
    assert lead - off_left >= 0
    assert (strips * tw - 1) * stride + k - 1 - off_left + lead < slot_pixels
    x = src.astype(numpy.float64)
    w = weight.astype(numpy.float64).reshape(channels, k, k)
    if backward:
        w = w[:, ::-1, ::-1]
    b = numpy.zeros(channels) if bias is None else bias.astype(numpy.float64)
    out = numpy.full((src.shape[0], dst_h, dst_w, channels), numpy.nan)
    writes = numpy.zeros(out.shape, numpy.int64)

    def segments(begin, end):
        row = begin
        while row < end:
            n, first = divmod(row, dst_h)
            rows = min(dst_h - first, end - row)
            yield n, first, rows
            row += rows

    for block in range(blocks):
        begin, end = block * total_rows // blocks, (block + 1) * total_rows // blocks
        stream = [(n, first * stride - off_top + local)
                  for n, first, rows in segments(begin, end) for local in range((rows - 1) * stride + k)]
        slots = [None] * ring  # (entry, padded row or None for a padding row)
        issued = 0

        def issue_until(limit):
            nonlocal issued
            while issued < min(limit, len(stream)):
                n, ih = stream[issued]
                row = None
                if 0 <= ih < src_h:
                    row = numpy.zeros((slot_pixels, channels))
                    row[lead:lead + src_w] = x[n, ih]
                slots[issued % ring] = (issued, row)
                issued += 1

        issue_until(ring)
        q0 = 0
        for n, first, rows in segments(begin, end):
            for r in range(rows):
                oh = first + r
                q_first = q0 + r * stride
                assert q_first + k <= issued
                for kh in range(k):
                    entry, row = slots[(q_first + kh) % ring]
                    assert entry == q_first + kh and stream[entry] == (n, oh * stride - off_top + kh)
                for group in range(groups):
                    for strip in range(group, strips, groups):
                        ow0 = strip * tw
                        acc = numpy.tile(b, (tw, 1))
                        for kh in range(k):
                            row = slots[(q_first + kh) % ring][1]
                            if row is None:
                                continue
                            for t in range(tw):
                                for kw in range(k):
                                    acc[t] += w[:, kh, kw] * row[(ow0 + t) * stride - off_left + lead + kw]
                        for t in range(tw):
                            if ow0 + t < dst_w:
                                out[n, oh, ow0 + t] = acc[t]
                                writes[n, oh, ow0 + t] += 1
                keep = q_first + stride if r + 1 < rows else q0 + (rows - 1) * stride + k
                issue_until(keep + ring)
            q0 += (rows - 1) * stride + k
        assert issued == len(stream)
    return out, writes


@pytest.mark.parametrize("case", [((2, 9, 11, 16), 1, 1), ((1, 7, 10, 24), 1, ((0, 4), (3, 1))),
                                  ((2, 5, 3, 8), 1, 4), ((3, 9, 13, 40), 2, 1), ((2, 11, 8, 16), 2, ((3, 0), (0, 2))),
                                  ((3, 1, 1, 8), 1, 1), ((2, 12, 12, 16), 1, "valid"),
                                  ((3, 13, 11, 24), 2, 2, 5), ((2, 10, 9, 16), 2, ((4, 1), (0, 3)), 5),
                                  ((2, 3, 4, 8), 2, 6, 5), ((2, 5, 5, 8), 2, "valid", 5)],
                         ids=lambda c: f"{'x'.join(map(str, c[0]))}-s{c[1]}-k{c[3] if len(c) > 3 else 3}")
def test_nhwc_ring_kernel_stream_matches_the_reference(case):
    # Every destination value written once and equal to the float64 reference,
    # both directions, float32 and float16, for grids of 1, 2, 5 and 7 blocks
    # (segments crossing images, blocks with one row or none), with the
    # plan's ring and with the smallest (K rows, nothing prefetched); 3x3,
    # and 5x5 at stride 2 (padding past the filter, per side, none).
    import numpy

    from cupy_dwgn import _depthwise_nhwc_ring as ring
    from cupy_dwgn import _validate

    x_shape, stride, padding = case[:3]
    k = case[3] if len(case) > 3 else 3
    g = _validate.conv_geometry(x_shape, (x_shape[3], 1, k, k), stride, padding, 1, layout="NHWC")
    for dtype, backward, weight, src, bias, want in _nhwc_reference_cases(x_shape, k, stride, padding, 12):
        for setting in (None, (4, 64, 0), (2, 256, 3)):
            launch = ring.plan.__wrapped__(g, dtype, backward, "int", 16, 16, setting)
            assert launch is not None and launch.persistent
            for blocks in (1, 2, 5, 7):
                got, writes = _emulate_nhwc_ring(launch, src, weight, bias, backward, blocks)
                assert (writes == 1).all()
                numpy.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_nhwc_ring_plan():
    # What the ring kernel serves (3x3: forward stride 1/2, backward-input
    # stride 1, C / 4 <= 512; 5x5: forward stride 2, C / 4 <= 256; C *
    # itemsize a multiple of 16, aligned arrays, rows that fit) and its block,
    # ring and shared memory.
    import numpy

    from cupy_dwgn import _depthwise_nhwc_ring as ring
    from cupy_dwgn import _validate

    shipped = SHIPPED
    half, single, double = (numpy.dtype(t) for t in (numpy.float16, numpy.float32, numpy.float64))
    for c, hw, k, stride, dtype, backward, alignment, served in [
        (144, 56, 3, 1, half, False, 16, True), (144, 56, 3, 1, half, True, 16, True),
        (96, 112, 3, 2, half, False, 16, True), (96, 112, 3, 2, half, True, 16, False),
        (144, 56, 3, 1, single, False, 16, True), (2048, 1, 3, 1, half, False, 16, True),
        (2056, 1, 3, 1, half, False, 16, False), (12, 28, 3, 1, half, False, 16, False),
        (12, 28, 3, 1, single, False, 16, True), (144, 56, 3, 1, half, False, 8, False),
        (144, 56, 5, 1, half, False, 16, False), (144, 56, 3, 1, double, False, 16, False),
        (1024, 64, 3, 1, single, False, 16, False),  # three rows pass the shared-memory cap
        # 5x5: forward at stride 2 only, C / 4 <= 256; 7x7 not at all.
        (96, 38, 5, 2, half, False, 16, True), (256, 19, 5, 2, half, False, 16, True),
        (816, 19, 5, 2, half, False, 16, False),  # five rows pass MAX_SHARED (the device's limit serves it)
        (96, 19, 5, 2, single, False, 16, True), (96, 38, 5, 1, half, False, 16, False),
        (96, 38, 5, 1, half, True, 16, False), (96, 38, 7, 2, half, False, 16, False),
        (96, 38, 7, 1, half, False, 16, False),
    ]:
        g = _validate.conv_geometry((4, hw, hw, c), (c, 1, k, k), stride, k // 2, 1, layout="NHWC")
        launch = ring.plan(g, dtype, backward, "int", alignment, alignment)
        assert (launch is not None) == served, (c, hw, k, stride, dtype, backward, alignment)
        if launch is None:
            continue
        assert (launch.file, launch.expression) in shipped
        tw, threads, ahead = ring.SETTINGS[k, stride, dtype.itemsize]
        vectors = c // 4
        assert launch.block[0] % vectors == 0 and launch.block[0] <= ring.max_threads(k)
        assert launch.block[0] == vectors or launch.block[0] <= max(threads, vectors)
        slots = int(launch.scalars[9])
        slot_pixels = int(launch.scalars[8])
        assert k <= slots <= k + ahead * stride
        assert launch.shared_mem == -(-slots * 8 // 16) * 16 + slots * slot_pixels * c * dtype.itemsize <= ring.MAX_SHARED
    # Rows whose K slots pass MAX_SHARED: served only under the device's
    # opt-in limit (227 KB on an H200), with as many slots as fit it; rows
    # that fit MAX_SHARED do not change with the limit.
    h200 = 227 * 1024
    wide = _validate.conv_geometry((4, 150, 150, 144), (144, 1, 3, 3), 2, 1, 1, layout="NHWC")
    assert ring.plan(wide, half, False, "int", 16, 16) is None
    launch = ring.plan(wide, half, False, "int", 16, 16, shared_limit=h200)
    slots, slot_bytes = int(launch.scalars[9]), int(launch.scalars[8]) * 144 * 2
    assert ring.MAX_SHARED < 3 * slot_bytes and slots == 5 and ring.MAX_SHARED < launch.shared_mem <= h200
    assert launch.shared_mem + slot_bytes > h200  # a sixth slot would not fit
    assert ring.plan(wide, half, False, "int", 16, 16, shared_limit=2 * slot_bytes) is None
    # 5x5 at stride 2: TW by columns(), 4 on 38-wide destinations, 2 on 10-wide ones.
    for hw, tw in ((75, 4), (19, 2)):
        g = _validate.conv_geometry((4, hw, hw, 96), (96, 1, 5, 5), 2, 2, 1, layout="NHWC")
        launch = ring.plan(g, half, False, "int", 16, 16, shared_limit=h200)
        assert launch.expression == ring._expression(half, 5, 2, False, "int", tw)
        assert (launch.file, launch.expression) in shipped
    # 5x5: at most 256 channel vectors a block (the kernel's launch bounds).
    for c, served in ((1024, True), (1032, False)):
        g = _validate.conv_geometry((4, 9, 9, c), (c, 1, 5, 5), 2, 2, 1, layout="NHWC")
        launch = ring.plan(g, half, False, "int", 16, 16, shared_limit=h200)
        assert (launch is not None) == served and (launch is None or launch.block[0] == 256)
    small = _validate.conv_geometry((4, 56, 56, 144), (144, 1, 3, 3), 1, 1, 1, layout="NHWC")
    assert (ring.plan(small, half, False, "int", 16, 16, shared_limit=h200).shared_mem
            == ring.plan(small, half, False, "int", 16, 16).shared_mem)
    # 56x56 half: 36 vectors x 7 column groups (2 strips of 4 each), a ring of 4 rows of 58 pixels
    g = _validate.conv_geometry((4, 56, 56, 144), (144, 1, 3, 3), 1, 1, 1, layout="NHWC")
    launch = ring.plan(g, half, False, "int", 16, 16)
    assert launch.block[0] == 252 and [int(v) for v in launch.scalars[7:10]] == [1, 58, 4]


def test_nhwc_ring_rule():
    # Where the ops take the ring kernel (preferred's docstring, the H200
    # sweep of 2026-12-03): (C, H = W, stride, dtype, backward, taken).
    import numpy

    from cupy_dwgn import _depthwise_nhwc_ring as ring
    from cupy_dwgn import _dtypes, _validate

    half, bf16, single = numpy.dtype(numpy.float16), numpy.dtype(_dtypes.bfloat16), numpy.dtype(numpy.float32)
    for c, hw, stride, dtype, backward, taken in [
        (144, 56, 1, half, False, True), (144, 56, 1, bf16, True, True), (192, 56, 1, half, False, True),
        (32, 112, 1, half, False, False), (384, 28, 1, half, False, False), (576, 14, 1, bf16, True, False),
        (960, 7, 1, half, False, False), (96, 112, 2, half, False, True), (144, 56, 2, bf16, False, True),
        (384, 28, 2, half, False, False), (144, 56, 1, single, False, True), (144, 56, 1, single, True, True),
        (32, 112, 1, single, False, True), (384, 28, 1, single, False, False), (144, 56, 2, single, False, False),
        # Half types with 24-63 channels (the sweep of 2026-12-04).
        (40, 150, 1, half, False, True), (40, 56, 1, bf16, True, True), (24, 150, 1, half, True, True),
        (24, 56, 1, half, False, False), (56, 75, 1, half, False, True), (32, 150, 1, half, False, True),
        (32, 75, 1, bf16, False, True), (32, 56, 1, half, False, False), (48, 112, 1, half, False, True),
        (48, 56, 1, half, True, False), (16, 150, 1, half, False, False),
        # Narrow half-type rows of >= 1024 channels, widths not a multiple of 7 (2026-12-04).
        (1392, 10, 1, half, False, True), (1024, 10, 1, bf16, True, True), (1344, 19, 1, half, False, True),
        (576, 19, 1, half, False, False), (1152, 7, 1, half, False, False), (960, 14, 1, bf16, True, False),
        (1392, 10, 1, single, False, False),
    ]:
        g = _validate.conv_geometry((4, hw, hw, c), (c, 1, 3, 3), stride, 1, 1, layout="NHWC")
        selected = _check_ring_rule(ring, g, dtype, backward, taken)
        if (c, hw) == (1024, 10):  # the narrow-row rule's select() on rows that fit MAX_SHARED
            assert selected
    # 5x5: half types at stride 2 with >= 24 channels (the sweeps of 2026-12-04), at any width.
    for c, hw, stride, dtype, backward, taken in [
        (192, 75, 2, half, False, True), (816, 19, 2, bf16, False, True), (240, 38, 2, half, False, True),
        (96, 38, 2, half, False, True),  # rows that fit MAX_SHARED: select() checked too
        (192, 75, 2, single, False, False), (240, 28, 1, half, False, False), (240, 28, 1, half, True, False),
        # From 24 channels (the sweep of 2026-12-04, results/depthwise_nhwc_ring_5x5_small_channels_*).
        (24, 112, 2, half, False, True), (32, 56, 2, bf16, False, True), (16, 112, 2, half, False, False),
        (8, 112, 2, bf16, False, False),
    ]:
        g = _validate.conv_geometry((4, hw, hw, c), (c, 1, 5, 5), stride, 2, 1, layout="NHWC")
        selected = _check_ring_rule(ring, g, dtype, backward, taken)
        assert selected or (c, hw) != (96, 38)


def _check_ring_rule(ring, g, dtype, backward, taken):
    """preferred() says ``taken``; the kernel serves every call it takes, and
    select() returns the plan (where the rows fit MAX_SHARED: past it, select
    asks the device for its limit) or None.  Returns whether select() was
    checked."""
    assert ring.preferred(g, dtype, backward) == taken, (g, dtype, backward)
    launch = ring.plan(g, dtype, backward, "int", 16, 16, None, True)  # the call plan_on_device makes (its cache key)
    if taken:
        assert ring.plan(g, dtype, backward, "int", 16, 16, shared_limit=ring._NO_LIMIT) is not None
    if launch is not None or not taken:
        assert ring.select(g, dtype, backward, "int", 16, 16) is (launch if taken else None)
        return True
    return False


def test_nchw_plane_7x7_rows_compute_the_fewest_rows():
    # 7x7 at stride 1: 7-row items where they compute no more rows than 4-row ones (H100, 2026-12-06:
    # 7 won at 7, 13, 14, 21 and 28 rows, 4 at 10 and 12; _pick_rows), forward and backward-input alike.
    import numpy

    from cupy_dwgn import _depthwise_nchw_plane as plane
    from cupy_dwgn import _validate
    from cupy_dwgn._dtypes import bfloat16

    compiled = {e for _, e in plane.specializations()}
    for hw, channels, rows in [(7, 768, 7), (10, 384, 4), (12, 512, 4), (13, 160, 7), (14, 384, 7), (21, 256, 7),
                               (28, 192, 7), (16, 256, 4)]:
        g = _validate.conv_geometry((64, channels, hw, hw), (channels, 1, 7, 7), 1, 3, 1)
        for dtype in (numpy.dtype(numpy.float32), numpy.dtype(numpy.float16), numpy.dtype(bfloat16)):
            for backward in (False, True):
                launch = plane.plan(g, dtype, backward, "int", 16, 16)
                assert launch.expression in compiled
                assert plane.launch_rows(launch) == rows, (hw, dtype, backward)
    # at stride 2: 4 rows only
    g = _validate.conv_geometry((64, 384, 28, 28), (384, 1, 7, 7), 2, 3, 1)
    assert plane.launch_rows(plane.plan(g, numpy.dtype(numpy.float32), False, "int", 16, 16)) == 4


def test_nchw_plane_rows_follow_the_height_sweep():
    # R of the plane kernel (rows a thread): compiled choices, and the pick
    # among them (_pick_rows) against the faster R of the 2026-12-05 sweep
    # (H100, 64xCxHxH fp16 5x5 forward; results/depthwise_nchw_plane_5x5_rows_h100_2026-12-05.txt),
    # but 16 rows, where 4-row items staged a gap apart (_pitch) beat the sweep's 7 rows back to back
    # (results/depthwise_nchw_plane_pitch_2026-12-05.txt: 49-50 us against 59-61).
    import numpy

    from cupy_dwgn import _depthwise_nchw_plane as plane
    from cupy_dwgn import _validate

    assert plane.row_choices(2, 5, 1) == (4, 7) and plane.row_choices(2, 3, 1) == (6, 7, 8)
    assert plane.row_choices(2, 5, 2) == (4,) and plane.row_choices(4, 5, 1) == (4,)
    assert plane.row_choices(2, 7, 1) == (4, 7) and plane.row_choices(4, 7, 1) == (4, 7)
    assert plane.row_choices(2, 7, 2) == (4,) and plane.row_choices(8, 5, 1) == (2,)
    compiled = {e for _, e in plane.specializations()}
    half = numpy.dtype(numpy.float16)
    for hw, channels, rows in [(10, 2560, 4), (12, 1792, 4), (14, 1344, 7), (16, 1024, 4), (17, 896, 7), (19, 720, 7), (19, 816, 7),
                               (21, 576, 7), (24, 448, 4), (26, 384, 7), (28, 320, 4), (28, 240, 4), (31, 272, 7),
                               (33, 240, 7), (38, 176, 7), (75, 48, 7)]:
        g = _validate.conv_geometry((64, channels, hw, hw), (channels, 1, 5, 5), 1, 2, 1)
        for dtype in (half, numpy.dtype(numpy.float32)):
            for backward in (False, True):
                launch = plane.plan(g, dtype, backward, "int", 16, 16)
                assert launch.expression in compiled
                assert plane.launch_rows(launch) == (rows if dtype == half else 4), (hw, dtype, backward)
    # The count behind the pick: a warp's 32 items of 16-wide fp16 planes (4-row items, 2 planes of 4 x 4
    # items) read 8 distinct words from each of 4 banks (the items' rows, 128 bytes apart, and planes, 512
    # apart, land on the same banks): 8-way, 7 on average with the windows' edges in the padding; staged
    # 32 bytes apart (_pitch) 3.5-way, and then 4 rows beat 7 (16 rows: 7-row items compute 21).
    g = _validate.conv_geometry((64, 1024, 16, 16), (1024, 1, 5, 5), 1, 2, 1)
    src_h, src_w, dst_h, dst_w, top, left = _validate.correlation_frame(g, False)
    per_unit, _, row_blocks, col_blocks, _, _, _ = plane._units(4, 64 * 1024, src_h, src_w, dst_h, dst_w, 2, 1, 5, 1,
                                                                16, 0, top, left, 0)
    assert plane._bank_conflicts(4, per_unit, row_blocks, col_blocks, src_h, src_w, top, left, 2, 5) == 7.0
    # one thread reading one word: conflict-free
    assert plane._bank_conflicts(4, 1, 1, 1, 4, 4, 0, 0, 2, 1) == 1.0
    # The element path (a misaligned source, global reads) counts the overhang alone: 16 rows are 4 blocks
    # of 4 exactly, 3 of 7 overhang.
    assert plane.launch_rows(plane.plan(g, half, False, "int", 2, 16)) == 4


def test_nchw_plane_3x3_rows_follow_the_width_sweep():
    # 2-byte 3x3 at stride 1: R among 6, 7 and 8 (_pick_rows with _NON_READ_ISSUE[3]) against the
    # fastest R of the 2026-12-05 sweeps (H100, fp16 and bf16, forward and backward-input, each R forced;
    # results/depthwise_nchw_plane_3x3_rows_h100_2026-12-05.txt) at the widths where the rule's pick was
    # the fastest in every cell (13 and 15: a single, partly idle 7- or 8-row item beat two of 6 rows).
    # 8 rows of 16-wide planes read 7.2-way conflicting words (2 planes of 2 x 4 items a warp, rows 32
    # bytes apart); 7 rows 2.9-way.
    import numpy

    from cupy_dwgn import _depthwise_nchw_plane as plane
    from cupy_dwgn import _validate
    from cupy_dwgn._dtypes import bfloat16

    compiled = {e for _, e in plane.specializations()}
    for hw, channels, rows in [(10, 1392, 6), (11, 2112, 6), (13, 1552, 7), (14, 1344, 7), (15, 1168, 8), (17, 912, 6),
                               (18, 816, 6), (19, 672, 7), (22, 544, 8), (26, 384, 7), (30, 288, 8), (56, 144, 7),
                               (64, 96, 8), (150, 40, 6)]:
        g = _validate.conv_geometry((64, channels, hw, hw), (channels, 1, 3, 3), 1, 1, 1)
        for dtype in (numpy.dtype(numpy.float16), numpy.dtype(bfloat16)):
            for backward in (False, True):
                launch = plane.plan(g, dtype, backward, "int", 16, 16)
                assert launch.expression in compiled
                assert plane.launch_rows(launch) == rows, (hw, dtype, backward)
        # float32 is compiled at 4 rows only
        assert plane.launch_rows(plane.plan(g, numpy.dtype(numpy.float32), False, "int", 16, 16)) == 4
    # 64x80x63 fp16: 8 rows (one plane a unit, 6 blocks resident) ran 9-13% faster than the count's 6
    # (4 blocks) on an H100 and an H200: the planes held at once (_IN_FLIGHT_EXPONENT) take 8.
    # A band counts as its share of a plane: 64x40x80 6 rows (two bands a plane, 5 blocks) ran 21% slower than 7
    # (one band, 3 blocks), 64x32x88 7 rows 9-17% slower than 8 (H200, 2026-12-06).
    for c, hw, rows in ((80, 63, 8), (40, 80, 7), (32, 88, 8)):
        g = _validate.conv_geometry((64, c, hw, hw), (c, 1, 3, 3), 1, 1, 1)
        for backward in (False, True):
            assert plane.launch_rows(plane.plan(g, numpy.dtype(numpy.float16), backward, "int", 16, 16)) == rows, c
    g = _validate.conv_geometry((64, 1024, 16, 16), (1024, 1, 3, 3), 1, 1, 1)
    src_h, src_w, dst_h, dst_w, top, left = _validate.correlation_frame(g, False)
    degrees = {}
    for rows in (7, 8):
        per_unit, _, row_blocks, col_blocks, _, _, _ = plane._units(rows, 64 * 1024, src_h, src_w, dst_h, dst_w, 2, 1,
                                                                    3, 1, 16, 0, top, left, 0)
        degrees[rows] = plane._bank_conflicts(rows, per_unit, row_blocks, col_blocks, src_h, src_w, top, left, 2, 3)
    assert degrees[8] > 7 and degrees[7] < 3, degrees


def test_nchw_plane_pair_reads_agree_between_host_and_kernel():
    # The kernel reads float16 (kReadsPairs<__half>) in 4-byte pairs, but in its 3x3 stride-1 forward
    # (kPairedReads), into kPairPad bytes of padding the host allocates (reads_pairs, pair_pads,
    # PAIR_PAD): the two sides must name the same type, the same kernels and the same pad.
    import re

    import numpy

    from cupy_dwgn import _compile, _dtypes
    from cupy_dwgn import _depthwise_nchw_plane as plane

    source = (_compile.kernel_dir() / plane.KERNEL_FILE).read_text()
    assert re.findall(r"constexpr int kPairPad = (\d+);", source) == [str(plane.PAIR_PAD)]
    assert re.findall(r"constexpr bool kReadsPairs<([\w]+)> = true;", source) == ["__half"]
    assert re.findall(r"constexpr bool kPairedReads = kReadsPairs<T> && (.*);", source) == [
        "!(KH == 3 && STRIDE == 1 && !BACKWARD)"]
    for dtype in (*plane.DTYPES, numpy.dtype(numpy.float64)):
        for (k, stride, backward) in itertools.product((3, 5, 7), (1, 2), (False, True)):
            kernel_pairs = dtype == numpy.float16 and not (k == 3 and stride == 1 and not backward)
            assert plane.reads_pairs(dtype, k, stride, backward) == kernel_pairs
            assert plane.pair_pads(dtype, k, stride, backward) == (2 * plane.PAIR_PAD if kernel_pairs else 0)
    assert plane.pair_pads(_dtypes.bfloat16, 5, 1, False) == 0


def test_nchw_7x7_routes_by_plane_side():
    # NCHW 7x7 at stride 1: the kernel the ops launch (the whole dispatch, no
    # device needed: the plans read sizes and addresses only), forward and
    # backward-input, against the H200 width sweep of 2026-12-06
    # (results/depthwise_7x7_widths_h200_2026-12-06.txt).  The same table
    # drives the GPU test that runs these launches against the reference.
    from _helpers import ROUTE_DTYPES, ROUTES_7X7, dispatch_stand_in, nchw_launch_expressions, route_kernel

    from cupy_dwgn import _validate

    for side, families in ROUTES_7X7.items():
        for dtype, family in zip(ROUTE_DTYPES, families):
            g = _validate.conv_geometry((2, 12, side, side), (12, 1, 7, 7), 1, 3, 1)
            for expression in nchw_launch_expressions(g, dispatch_stand_in(2 * 12 * side * side, dtype)):
                assert expression.startswith(route_kernel(family)), (side, dtype, family)



def test_narrow_float32_routes_to_the_walk():
    # float32 onto 8-wide rows at stride 1 (NARROW_FLOAT32_ROUTES): the row
    # kernel yields to the register row walk on 16-byte addresses (VW 4),
    # not on 4-byte ones (the walk's VW 1 lost), forward and backward-input;
    # half types keep the row kernel.
    import numpy

    from _helpers import NARROW_FLOAT32_ROUTES, dispatch_stand_in, nchw_launch_expressions, route_kernel

    from cupy_dwgn import _validate

    for (batch, channels), k, family in NARROW_FLOAT32_ROUTES:
        shape = (batch, channels, 8, 8)
        g = _validate.conv_geometry(shape, (channels, 1, k, k), 1, k // 2, 1)
        single, half = numpy.dtype(numpy.float32), numpy.dtype(numpy.float16)
        for dtype, address, want in ((single, 256, family), (single, 260, "rows"), (half, 256, "rows")):
            for expression in nchw_launch_expressions(g, dispatch_stand_in(batch * channels * 64, dtype, address)):
                assert expression.startswith(route_kernel(want)), (shape, k, dtype, address, expression)


def test_nchw_plane_rule_follows_the_width_sweep():
    # _depthwise_nchw_plane.preferred against the 2026-12-02 sweeps' winner
    # (plane or window kernel; benchmarks/results/depthwise_kernels_sweep_*).
    import numpy

    from cupy_dwgn import _depthwise_nchw_plane as plane
    from cupy_dwgn import _dtypes, _validate

    half, single = numpy.dtype(numpy.float16), numpy.dtype(numpy.float32)
    for hw, k, dtype, plane_wins in [
        (12, 3, half, True), (14, 3, half, True), (16, 3, half, True), (19, 3, half, True), (21, 3, half, True),
        (28, 3, half, True), (31, 3, half, True), (44, 3, half, True), (60, 3, half, True), (32, 3, half, False),
        (40, 3, half, True), (56, 3, half, True), (64, 3, half, True), (72, 3, half, True), (128, 3, half, False),
        (12, 5, half, True), (17, 5, half, True), (31, 5, half, True),
        (40, 5, half, False), (12, 7, half, True), (15, 7, half, True), (24, 7, half, True), (16, 7, half, True),
        (17, 7, half, True), (21, 7, half, True), (22, 7, half, True), (23, 7, half, True), (28, 7, half, True),
        (32, 7, half, False), (12, 3, single, True),
        (14, 3, single, True), (30, 3, single, True), (56, 3, single, True), (16, 3, single, False),
        (12, 5, single, True), (21, 5, single, True), (16, 5, single, False), (24, 5, single, False),
        (12, 7, single, True), (14, 7, single, True), (8, 3, half, False),
        # float32 7x7 since the 7-row items (2026-12-06): below 28 but the multiples of 4 from 16
        (17, 7, single, True), (21, 7, single, True), (23, 7, single, True), (26, 7, single, True),
        (16, 7, single, False), (20, 7, single, False), (24, 7, single, False), (28, 7, single, False),
        (7, 7, half, True), (7, 7, single, True), (7, 5, half, False),  # 7x7 at 7 wide: past the row kernel
        # wider planes (bands), the sweep of 2026-12-02
        (75, 3, half, True), (150, 3, half, True), (100, 3, half, True), (57, 3, half, True), (112, 3, half, True),
        (75, 5, half, True), (61, 5, half, True), (75, 3, single, True), (112, 3, single, True),
        (150, 3, single, False), (75, 5, single, True), (61, 5, single, True), (75, 7, half, False),
        (168, 3, half, False), (165, 5, single, False),
    ]:
        for backward in (False, True):
            g = _validate.conv_geometry((64, 96, hw, hw), (96, 1, k, k), 1, k // 2, 1)
            assert plane.preferred(g, dtype, backward) == plane_wins, (hw, k, dtype, backward)
    g = _validate.conv_geometry((64, 96, 28, 28), (96, 1, 3, 3), 1, 1, 1)
    assert not plane.preferred(g, numpy.dtype(numpy.float64), False)
    # short, wide planes (under 256 items, rows past the sweeps) keep the window kernel
    g = _validate.conv_geometry((8, 16, 4, 200), (16, 1, 3, 3), 1, 1, 1)
    assert plane.plan(g, single, False, "int", 16, 16) is not None and not plane.preferred(g, single, False)
    # stride 2 (forward), against the stride-2 sweep of 2026-12-02 (source width, filter, winner)
    bf16 = numpy.dtype(_dtypes.bfloat16)
    for hw, k, dtype, plane_wins in [
        (38, 3, half, True), (19, 5, half, True), (75, 5, half, True), (28, 3, half, True), (28, 5, half, True),
        (28, 7, half, True), (56, 5, half, True), (38, 3, bf16, True), (56, 3, half, False), (112, 3, half, False),
        (38, 3, single, True), (19, 5, single, True), (75, 5, single, False), (28, 3, single, False),
        (28, 5, single, False), (28, 7, single, False), (56, 3, single, False), (56, 5, single, False),
        (112, 3, single, False), (38, 3, numpy.dtype(numpy.float64), False), (150, 3, half, True),
        (150, 3, single, False), (224, 3, half, False), (165, 5, half, False),
    ]:
        g = _validate.conv_geometry((64, 96, hw, hw), (96, 1, k, k), 2, k // 2, 1)
        assert plane.preferred(g, dtype, False) == plane_wins, (hw, k, dtype)
        if plane_wins:  # and serves it from shared memory
            assert int(plane.plan(g, dtype, False, "int", 16, 16).scalars[12]) > 0


@pytest.mark.parametrize("case", [((2, 9, 11, 16), 3, 1, 1), ((1, 7, 10, 24), 5, 1, ((0, 4), (3, 1))),
                                  ((2, 5, 3, 8), 3, 1, 4), ((1, 9, 13, 40), 3, 2, 1), ((1, 11, 8, 16), 5, 2, 2)],
                         ids=lambda c: f"{'x'.join(map(str, c[0]))}-{c[1]}x{c[1]}-s{c[2]}")
def test_nhwc_direct_kernel_index_math_matches_the_reference(case):
    # Every destination value written once and equal to the float64
    # reference, for both directions, float32 and float16 (4 and 8 channels
    # a vector: uneven channel tiles), in every launch form.
    for form in _NHWC_DIRECT_FORMS:
        _check_nhwc_direct_index_math(case, form, seed=11)


# (grid.y cap, items a thread, block or None): the plan's grid, grid.y
# capped at 2 blocks (the kernel's grid-stride walk over items), 3 items a
# thread (ITEMS_PER_THREAD), and a block of 3 channel vectors x 5 items
# (BLOCK: tiles not dividing the vectors).
_NHWC_DIRECT_FORMS = [(None, 1, None), (2, 1, None), (None, 3, None), (None, 1, (3, 5))]


@settings(max_examples=60, deadline=None)
@given(x_shape=st.tuples(st.integers(1, 2), st.integers(1, 20), st.integers(1, 30), st.integers(1, 6).map(lambda v: 8 * v)),
       k=st.sampled_from([3, 5]), stride=st.sampled_from([1, 2]),
       padding=st.tuples(*[st.tuples(st.integers(0, 9), st.integers(0, 9))] * 2),
       form=st.sampled_from(_NHWC_DIRECT_FORMS), seed=st.integers(0, 2**32 - 1))
def test_nhwc_direct_random_geometries(x_shape, k, stride, padding, form, seed):
    # The NHWC direct kernel's emulation on drawn geometries (3x3 and 5x5,
    # any padding per side, 1-6 channel vectors of 8), one drawn launch form.
    assume(x_shape[1] + sum(padding[0]) >= k and x_shape[2] + sum(padding[1]) >= k)
    _check_nhwc_direct_index_math((x_shape, k, stride, padding), form, seed)


def _check_nhwc_direct_index_math(case, form, seed):
    import numpy

    from cupy_dwgn import _depthwise_nhwc_direct as direct
    from cupy_dwgn import _launch, _validate

    x_shape, k, stride, padding = case
    c = x_shape[3]
    g = _validate.conv_geometry(x_shape, (c, 1, k, k), stride, padding, 1, layout="NHWC")
    max_grid_y, per_thread, block = form
    max_grid_y = max_grid_y or _launch.MAX_GRID_Y
    for dtype, backward, weight, src, bias, want in _nhwc_reference_cases(x_shape, k, stride, padding, seed):
        key = (k, stride, dtype.itemsize)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(_launch, "MAX_GRID_Y", max_grid_y)
            patch.setitem(direct.ITEMS_PER_THREAD, key, per_thread)
            if block is None:
                patch.delitem(direct.BLOCK, key, raising=False)
            else:
                patch.setitem(direct.BLOCK, key, block)
            launch = direct.plan.__wrapped__(g, dtype, backward, "int", 16, 16)
        assert launch.grid[1] <= max_grid_y
        assert block is None or tuple(launch.block[:2]) == block
        got, writes = _emulate_nhwc_direct(launch, src, weight, bias, backward)
        assert (writes == 1).all()
        numpy.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_nhwc_direct_items_per_thread_rule():
    # items_per_thread's docstring: 2 for 3x3 float32, 5x5 float32 at stride 1, and 3x3 float16
    # at stride 2 onto destinations at most 14 wide; ITEMS_PER_THREAD overrides it.
    import numpy

    from cupy_dwgn import _depthwise_nhwc_direct as direct
    from cupy_dwgn import _validate

    for k, stride, dtype, dst_width, want in [
        (3, 1, numpy.float32, 28, 2), (3, 2, numpy.float32, 7, 2), (5, 2, numpy.float32, 14, 1),
        (3, 2, numpy.float16, 14, 2), (3, 2, numpy.float16, 28, 1), (3, 1, numpy.float16, 7, 1),
        (3, 2, "bfloat16", 7, 1), (5, 1, numpy.float32, 28, 2), (5, 1, numpy.float32, 38, 2),
        (5, 1, numpy.float16, 28, 1), (5, 1, "bfloat16", 14, 1),
    ]:
        assert direct.items_per_thread(k, stride, dtype, dst_width) == want, (k, stride, dtype, dst_width)
        # a grid too small to halve (small batches) keeps one item a thread
        assert direct.items_per_thread(k, stride, dtype, dst_width, direct.TWO_ITEMS_MIN_BLOCKS - 1) == 1
    small = _validate.conv_geometry((2, 14, 14, 576), (576, 1, 3, 3), 2, 1, 1, layout="NHWC")
    launch = direct.plan.__wrapped__(small, numpy.dtype(numpy.float32), False, "int", 16, 16)
    assert launch.grid[1] == -(-int(launch.scalars[-1]) // launch.block[1])  # one item a thread
    g = _validate.conv_geometry((64, 14, 14, 576), (576, 1, 3, 3), 2, 1, 1, layout="NHWC")
    ruled = direct.plan.__wrapped__(g, numpy.dtype(numpy.float16), False, "int", 16, 16)
    direct.ITEMS_PER_THREAD[3, 2, 2] = 1
    try:
        one = direct.plan.__wrapped__(g, numpy.dtype(numpy.float16), False, "int", 16, 16)
    finally:
        del direct.ITEMS_PER_THREAD[3, 2, 2]
    assert one.grid[1] == 2 * ruled.grid[1] and one.scalars == ruled.scalars


def test_nhwc_direct_columns_per_thread():
    # Of several TW compiled (float32 5x5 stride 1: 7 and 8), the plan takes the one whose strips
    # pad the destination row least, the wider on a tie; every one is shipped, forward and
    # backward-input, both index types; a single TW is taken whatever the width.
    from cupy_dwgn import _depthwise_nhwc_direct as direct

    for width, want in [(28, 7), (14, 7), (19, 7), (7, 7), (38, 8), (23, 8), (8, 8), (56, 8), (1, 7), (49, 7)]:
        assert direct.columns_per_thread((5, 1, 4), width) == want, width
    assert {direct.columns_per_thread((3, 1, 4), width) for width in (7, 14, 28, 21)} == {8}
    shipped = {expression for _, expression in SHIPPED}
    for tw in (7, 8):
        for backward in ("false", "true"):
            for index in ("int", "long long"):
                assert f"dwgn_dwconv_nhwc_direct<float, 5, 1, {tw}, {backward}, false, {index}>" in shipped


def test_nhwc_direct_block_override_is_checked(monkeypatch):
    # BLOCK (benchmarks) sets the block's shape; the channel tiles follow BX, and a block
    # past the kernel's 256-thread launch bound is refused by name.
    import numpy

    from cupy_dwgn import _depthwise_nhwc_direct as direct
    from cupy_dwgn import _validate

    g = _validate.conv_geometry((64, 14, 14, 576), (576, 1, 3, 3), 2, 1, 1, layout="NHWC")
    monkeypatch.setitem(direct.COLUMNS, (3, 2, 4), 1)
    monkeypatch.setitem(direct.BLOCK, (3, 2, 4), (4, 49))
    launch = direct.plan.__wrapped__(g, numpy.dtype(numpy.float32), False, "int", 16, 16)
    assert tuple(launch.block[:2]) == (4, 49) and launch.grid[0] == 36  # 144 vectors / 4
    assert launch.grid[0] * launch.grid[1] * 2 == 2304  # 64 images x 7 x 7 items over 49 a block, 2 a thread
    monkeypatch.setitem(direct.BLOCK, (3, 2, 4), (16, 17))
    with pytest.raises(ValueError, match=r"BLOCK\[\(3, 2, 4\)\].*BX \* BY <= 256"):
        direct.plan.__wrapped__(g, numpy.dtype(numpy.float32), False, "int", 16, 16)


def test_nhwc_direct_rule():
    # Where the ops take the NHWC direct kernel (preferred's docstring), its
    # TW, grid and shared memory, and what it does not serve: misaligned
    # arrays, C not a multiple of the vector, stride-2 backward-input, 7x7,
    # dilation, multiplier 2, float64.
    import numpy

    from cupy_dwgn import _depthwise_nhwc_direct as direct
    from cupy_dwgn import _validate

    shipped = SHIPPED
    half, bf16, single, double = (numpy.dtype(t) for t in (numpy.float16, "bfloat16", numpy.float32, numpy.float64))
    for c, hw, k, stride, dtype, backward, served, taken in [
        (384, 28, 3, 1, single, False, True, True), (384, 28, 3, 1, single, True, True, True),
        (144, 56, 3, 1, single, False, True, False), (144, 56, 3, 2, single, False, True, True),
        (96, 112, 3, 2, single, False, True, False), (1152, 7, 5, 1, single, False, True, True),
        (480, 14, 5, 1, single, False, True, False), (672, 28, 5, 2, single, False, True, True),
        (240, 28, 5, 1, single, False, True, False), (576, 19, 5, 1, single, True, True, False),
        (288, 38, 5, 1, single, False, True, False), (192, 56, 5, 1, single, False, True, False),
        (144, 75, 5, 2, single, False, True, False),
        (96, 112, 3, 2, half, False, True, True), (96, 112, 3, 2, bf16, False, True, False),
        (144, 56, 3, 1, half, False, True, False), (240, 56, 5, 2, half, False, True, False),
        (96, 112, 3, 2, half, True, False, False), (96, 56, 7, 1, single, False, False, False),
        (20, 28, 3, 1, half, False, False, False), (384, 28, 3, 1, double, False, False, False),
    ]:
        g = _validate.conv_geometry((4, hw, hw, c), (c, 1, k, k), stride, k // 2, 1, layout="NHWC")
        launch = direct.plan(g, dtype, backward, "int", 16, 16)
        assert (launch is not None) == served, (c, hw, k, stride, dtype, backward)
        assert direct.select(g, dtype, backward, "int", 16, 16) is (launch if taken else None)
        if launch is None:
            continue
        vec = 16 // dtype.itemsize
        dst_h, dst_w = (hw, hw) if backward else (g.out_height, g.out_width)
        tw = direct.columns_per_thread((k, stride, dtype.itemsize), dst_w)
        assert (launch.file, launch.expression) in shipped and f", {tw}, " in launch.expression
        # every filter row's loads in flight (ALL_ROWS) for float32 3x3 stride 2 only, at TW 2
        all_rows = (k, stride, dtype) == (3, 2, single)
        assert launch.expression.endswith(f"{'true' if all_rows else 'false'}, int>") and (tw == 2 or not all_rows)
        items = 4 * dst_h * -(-dst_w // tw)
        tiles, bx, by = launch.grid[0], launch.block[0], launch.block[1]
        # nearly equal channel tiles of at most 32 vectors (576 float32: 5 tiles of 29 vectors, not 4 x 32 + 16)
        vectors = c // vec
        assert tiles == -(-vectors // 32) and bx == -(-vectors // tiles) and bx * by <= 256
        per_thread = direct.items_per_thread(k, stride, dtype, dst_w, tiles * -(-items // by))
        assert int(launch.scalars[-1]) == items and launch.grid[1] == min(-(-items // (by * per_thread)), 65535)
        assert launch.shared_mem == k * k * bx * vec * 4
        assert direct.plan(g, dtype, backward, "int", 8, 16) is None and direct.plan(g, dtype, backward, "int", 16, 4) is None
    # float32 5x5 stride 1 on rows 15 to 38 wide: taken where the one-item grid holds
    # TWO_ITEMS_MIN_BLOCKS blocks (the 4-image cases above do not), then at 2 items a thread;
    # under 14 wide whatever the batch; 14 wide not.
    for batch, hw, c, backward, taken in [
        (64, 28, 240, False, True), (64, 28, 240, True, True), (16, 28, 240, False, True), (8, 28, 240, False, False),
        (64, 19, 576, True, True), (64, 38, 288, False, True), (64, 14, 672, False, False), (2, 7, 1152, False, True),
    ]:
        g = _validate.conv_geometry((batch, hw, hw, c), (c, 1, 5, 5), 1, 2, 1, layout="NHWC")
        assert direct.preferred(g, single, backward) == taken, (batch, hw, c, backward)
        launch = direct.select(g, single, backward, "int", 16, 16)
        assert (launch is not None) == taken
        if taken and hw > 14:
            assert int(launch.scalars[-1]) > launch.grid[1] * launch.block[1]  # more items than threads along y
    for x_shape, w_shape, stride, dilation in [((2, 7, 7, 16), (16, 1, 3, 3), 1, 2), ((2, 7, 7, 16), (32, 1, 3, 3), 1, 1),
                                               ((2, 7, 7, 16), (16, 1, 3, 3), (1, 2), 1)]:
        g = _validate.conv_geometry(x_shape, w_shape, stride, 1, dilation, layout="NHWC")
        assert direct.plan(g, single, False, "int", 16, 16) is None

def _plane_band_rows(band, band_rows, stride, offset_top, filter_height, src_h, dst_h):
    """(src_row0, src_row1, dst_row0, dst_rows) of band ``band`` in the plane
    kernels (dwgn_plane::band_of): its destination rows, and the source rows
    its items read clipped to the image (a band of padding rows stages none)."""
    dst_row0 = band * band_rows
    src_row0 = min(max(dst_row0 * stride - offset_top, 0), src_h)
    src_row1 = max(src_row0, min((dst_row0 + band_rows - 1) * stride - offset_top + filter_height, src_h))
    return src_row0, src_row1, dst_row0, min(band_rows, dst_h - dst_row0)


def _plane_kernel_emulation(launch, src, weight, bias, backward, grid, dst_offset=0, stride=1):
    """What kernels/depthwise_nchw_plane.cu computes for ``launch`` (a
    NumPy transcription of its thread -> item mapping, its walk over units
    (whole planes, or bands of one plane: dwgn_plane::unit_of) with ``grid``
    blocks, its row skips and column masks and its stores, direct or
    through the unit's shared output buffer and store_unit's flat copy), in
    float64, with a count of the writes to each destination value; every
    source row an item reads inside the image must be one its unit staged.
    ``src``: (planes, H, W) source planes; ``weight``: (C, KH, KW);
    ``dst_offset``: dst's address modulo 16 (src is at a 16-byte boundary
    on the cp.async path); ``stride``: the kernel's STRIDE."""
    import numpy

    from cupy_dwgn import _depthwise_nchw_plane as nchw_plane

    (channels, planes, src_h, src_w, dst_h, dst_w, offset_top, offset_left, per_unit, num_bands, row_blocks,
     col_blocks, raw_bytes, vector_stores, out_stage_bytes, src_pitch) = (int(v) for v in launch.scalars)
    size = src.dtype.itemsize
    # staged planes src_pitch values apart: back to back, or (copy_async_pitched: units of whole planes of a
    # multiple of 16 bytes, on the cp.async path) 16-112 bytes more
    assert src_pitch == src_h * src_w or (
        raw_bytes and num_bands == 1 and src_h * src_w * size % 16 == 0
        and src_pitch * size - src_h * src_w * size in nchw_plane._PITCH_GAPS)
    # float16 reads the shared source in pairs (but the 3x3 stride-1 forward: reads_pairs)
    pads = nchw_plane.pair_pads(src.dtype, weight.shape[1], stride, backward) if raw_bytes else 0
    assert launch.shared_mem == 3 * raw_bytes + out_stage_bytes + pads <= 48 * 1024
    assert raw_bytes % 16 == 0 and (out_stage_bytes == 0 or raw_bytes > 0)
    assert num_bands == 1 or per_unit == 1
    kh_size, kw_size = weight.shape[1:]
    rows, columns = nchw_plane.launch_rows(launch), nchw_plane.COLUMNS
    span = (columns - 1) * stride + kw_size
    items = row_blocks * col_blocks
    band_rows = row_blocks * rows
    assert num_bands == -(-dst_h // band_rows) and (num_bands > 1 or band_rows >= dst_h)
    assert launch.block[0] % 32 == 0 and per_unit * items <= launch.block[0] <= 256
    assert src.shape == (planes, src_h, src_w)
    out = numpy.full((planes, dst_h, dst_w), numpy.nan)
    writes = numpy.zeros(out.shape, numpy.int64)
    num_units = -(-planes // per_unit) * num_bands
    for block in range(grid):
        for unit in range(block, num_units, grid):
            if num_bands == 1:
                first_plane = unit * per_unit
                unit_planes = min(per_unit, planes - first_plane)
                src_row0, src_row1, dst_row0, dst_rows = 0, src_h, 0, dst_h
            else:
                first_plane, band = divmod(unit, num_bands)
                unit_planes = 1
                src_row0, src_row1, dst_row0, dst_rows = _plane_band_rows(band, band_rows, stride, offset_top, kh_size,
                                                                          src_h, dst_h)
            src_count = unit_planes * (src_row1 - src_row0) * src_w
            dst_count = unit_planes * dst_rows * dst_w
            # the staged range lies inside the tensor (a band of padding rows stages nothing past it)
            assert 0 <= src_row0 <= src_row1 <= src_h
            if raw_bytes:  # copy_async's 16-byte vectors from the boundary below the unit fit the buffer
                head = (first_plane * src_h + src_row0) * src_w * size % 16
                assert -(-(head + src_count * size) // 16) * 16 <= raw_bytes
                # and so do copy_async_pitched's, each plane at a 16-byte boundary
                assert src_pitch == src_h * src_w or (
                    head == 0 and (unit_planes - 1) * src_pitch * size + src_h * src_w * size <= raw_bytes)
            # a pitched unit's values as copy_async_pitched lands them (the reads below take them from there)
            staged = (_pitched_copy(src[first_plane:first_plane + unit_planes], raw_bytes, src_pitch)
                      if src_pitch != src_h * src_w else None)
            # the unit's destination rows as a flat range, and its output buffer
            unit_out = numpy.full(dst_count, numpy.nan)
            stage_writes = numpy.zeros(unit_out.shape, numpy.int64)
            for thread in range(launch.block[0]):
                local_plane, item = divmod(thread, items)
                if local_plane >= unit_planes:
                    continue
                rb, cb = divmod(item, col_blocks)
                rb += dst_row0 // rows
                plane = first_plane + local_plane
                w = weight[plane % channels].astype(numpy.float64)
                if backward:
                    w = w[::-1, ::-1]
                acc = numpy.full((rows, columns), 0.0 if bias is None else float(bias[plane % channels]))
                row0, col0 = rb * rows * stride - offset_top, cb * columns * stride - offset_left
                for t in range((rows - 1) * stride + kh_size):
                    source_row = row0 + t
                    if not 0 <= source_row < src_h:
                        continue
                    assert src_row0 <= source_row < src_row1, "a read of a row the unit did not stage"
                    if pads:  # read_window_row_pairs's words: within the pads around the buffers
                        start = head + (local_plane * src_pitch + (source_row - src_row0) * src_w
                                        + col0) * size  # bytes from the buffer's start
                        words = (span + 1) // 2 + 1
                        first = start - start % 4
                        for buffer in range(3):
                            low, high = buffer * raw_bytes + first, buffer * raw_bytes + first + 4 * words
                            assert -nchw_plane.PAIR_PAD <= low and high <= 3 * raw_bytes + out_stage_bytes + nchw_plane.PAIR_PAD
                    if staged is None:
                        row = numpy.array([src[plane, source_row, col0 + k] if 0 <= col0 + k < src_w else 0.0
                                           for k in range(span)], numpy.float64)
                    else:
                        first_value = local_plane * src_pitch + source_row * src_w + col0
                        row = numpy.array([staged[first_value + k] if 0 <= col0 + k < src_w else 0.0
                                           for k in range(span)], numpy.float64)
                    for i in range(rows):
                        kh = t - i * stride
                        if 0 <= kh < kh_size:
                            for kw in range(kw_size):
                                acc[i] += w[kh, kw] * row[kw:kw + (columns - 1) * stride + 1:stride]
                for i in range(rows):
                    y = rb * rows + i
                    if y >= dst_h:
                        break
                    x = numpy.arange(cb * columns, cb * columns + columns)
                    if vector_stores:
                        assert dst_w % columns == 0
                    keep = x < dst_w
                    if out_stage_bytes:
                        flat = (local_plane * dst_rows + y - dst_row0) * dst_w + x[keep]
                        unit_out[flat] = acc[i][keep]
                        stage_writes[flat] += 1
                    else:
                        out[plane, y, x[keep]] = acc[i][keep]
                        writes[plane, y, x[keep]] += 1
            if out_stage_bytes:  # store_unit: every thread's 16-byte chunks of [head, end)
                assert (stage_writes == 1).all()
                first = (first_plane * dst_h + dst_row0) * dst_w
                head = (dst_offset + first * size) % 16
                end = head + unit_out.size * size
                assert end <= out_stage_bytes
                flat_out, flat_writes = out.reshape(-1), writes.reshape(-1)
                for thread in range(launch.block[0]):
                    for o in range(thread * 16, end, launch.block[0] * 16):
                        if o >= head and o + 16 <= end:
                            assert (dst_offset + first * size + o - head) % 16 == 0  # an aligned vector store
                            elements = range((o - head) // size, (o + 16 - head) // size)
                        else:
                            elements = [(b - head) // size for b in range(max(o, head), min(o + 16, end), size)]
                        for e in elements:
                            flat_out[first + e] = unit_out[e]
                            flat_writes[first + e] += 1
    return out, writes


# (x NCHW shape, filter size, padding, stride): odd sizes, every padding
# form, more planes than one unit, widths that are and are not multiples of
# 4; at stride 2 odd and even sources, padding larger than the filter's
# half, and a source narrower than an item's reach.
_PLANE_GEOMETRIES = [
    ((2, 3, 13, 11), 3, 1, 1), ((1, 5, 9, 10), 5, ((0, 4), (3, 1)), 1), ((2, 2, 7, 7), 7, 3, 1),
    ((1, 4, 8, 8), 3, "valid", 1), ((3, 50, 6, 5), 3, 1, 1), ((1, 2, 5, 9), 7, 8, 1), ((1, 3, 1, 12), 3, (1, 0), 1),
    ((2, 3, 19, 19), 3, 1, 2), ((1, 4, 38, 38), 3, 1, 2), ((3, 30, 10, 9), 5, 2, 2), ((1, 2, 13, 12), 7, 3, 2),
    ((1, 3, 9, 11), 5, ((0, 4), (3, 1)), 2), ((2, 5, 4, 7), 3, "valid", 2), ((1, 2, 5, 6), 7, 6, 2),
    # bands (planes of more than 256 items, or whose buffers pass 48 KB): 2 and 3 bands, padding past
    # the filter's half, stride 2, a float32 plane of 240 items too large for the buffers
    ((1, 2, 75, 75), 3, 1, 1), ((1, 1, 150, 30), 5, 2, 1), ((1, 1, 60, 70), 7, 8, 1), ((1, 1, 99, 99), 3, 1, 2),
    ((1, 1, 60, 61), 3, 1, 1), ((1, 1, 150, 44), 3, 1, 1), ((1, 2, 20, 70), 3, ((0, 60), (1, 1)), 1),
    ((1, 2, 20, 70), 3, ((60, 0), (1, 1)), 1), ((1, 1, 4, 90), 3, ((0, 100), (1, 1)), 1),
    # 5x5 at stride 1, whose 2-byte items take 4 or 7 rows: planes not a multiple of 7 rows, 7-row bands
    ((2, 3, 17, 19), 5, 2, 1), ((1, 1, 150, 100), 5, ((1, 4), (2, 2)), 1),
    # float16 reads in pairs: the most left padding they serve (15 columns), one more (the element path),
    # the stride-2 7x7 overhang past odd rows
    ((1, 2, 9, 40), 5, ((2, 2), (15, 1)), 1), ((1, 2, 9, 40), 5, ((2, 2), (16, 1)), 1), ((1, 2, 27, 29), 7, 3, 2),
]


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward_input"])
@pytest.mark.parametrize("case", _PLANE_GEOMETRIES, ids=lambda c: f"{'x'.join(map(str, c[0]))}-{c[1]}x{c[1]}-s{c[3]}")
def test_plane_kernel_index_math_covers_every_output_once(case, backward):
    _check_plane_kernel_index_math(case, backward, seed=3)


@st.composite
def _plane_geometries(draw):
    """(x NCHW shape, filter size, padding per side, stride) the plane kernels serve."""
    # Rows past 64 make planes of more than 256 items: bands.
    x_shape, k, stride, padding = _draw_nchw_geometry(
        draw, 40, (st.sampled_from([66, 75]),), st.sampled_from([10, 14, 16, 28, 56]), 20)
    return x_shape, k, padding, stride


@settings(max_examples=25, deadline=None)
@given(_plane_geometries(), st.booleans(), st.integers(0, 2**32 - 1))
def test_plane_kernel_random_geometries(case, backward, seed):
    # The whole-plane kernel's emulation on drawn geometries (any padding
    # per side, widths with and without 4-column vectors, planes per unit,
    # both strides and directions, every row choice, alignment and load and
    # store form): every destination written once and equal to the float64
    # reference.
    _check_plane_kernel_index_math(case, backward, seed)


def _check_plane_kernel_index_math(case, backward, seed):
    import numpy

    from cupy_dwgn import _depthwise_nchw_plane as nchw_plane
    from cupy_dwgn import _validate

    x_shape, k, padding, stride = case
    n, c = x_shape[:2]
    g = _validate.conv_geometry(x_shape, (c, 1, k, k), stride, padding, 1)
    if backward and stride != 1:  # the backward-input takes the plane kernel at stride 1 only
        assert nchw_plane.plan(g, numpy.dtype(numpy.float32), True, "int", 16, 16) is None
        return
    y_shape = (n, c, g.out_height, g.out_width)
    rng = numpy.random.default_rng(seed)
    for dtype in nchw_plane.DTYPES:
        src_shape = y_shape if backward else x_shape
        src = rng.standard_normal(src_shape).astype(dtype)
        weight = rng.standard_normal((c, 1, k, k)).astype(dtype)
        bias = None if backward else rng.standard_normal(c).astype(dtype)
        itemsize = numpy.dtype(dtype).itemsize
        # every R compiled for this filter (plan picks one: each forced here)
        for item_rows, (src_alignment, dst_alignment) in itertools.product(
                nchw_plane.row_choices(itemsize, k, stride), ((16, 16), (2, 2), (16, 2))):
            launch = nchw_plane.plan(g, dtype, backward, "int", src_alignment, dst_alignment, item_rows)
            assert launch is not None and launch.persistent and nchw_plane.launch_rows(launch) == item_rows
            raw_bytes, vector_stores, out_stage_bytes = (int(v) for v in launch.scalars[12:15])
            # bands where a plane has more than 256 items or (cp.async path) its buffers pass 48 KB;
            # a plane of one row block that passes them is read from global memory (the element path)
            dst_shape = x_shape if backward else y_shape
            row_blocks = -(-dst_shape[2] // item_rows)
            items = row_blocks * -(-dst_shape[3] // 4)
            plane_bytes = src_shape[2] * src_shape[3] * itemsize
            dst_bytes = 0 if vector_stores else dst_shape[2] * dst_shape[3] * itemsize
            pads = nchw_plane.pair_pads(dtype, k, stride, backward)
            too_large = src_alignment == 16 and nchw_plane._shared_bytes(plane_bytes, dst_bytes) > 48 * 1024 - pads
            # float16 reads in pairs reach at most PAIR_PAD bytes past a row (else the element path)
            frame = _validate.correlation_frame(g, backward)
            pairs_fit = not pads or nchw_plane._pairs_within_pads(frame[1], frame[3], frame[5], stride, k)
            element = src_alignment != 16 or (too_large and row_blocks == 1) or not pairs_fit
            assert raw_bytes > 0 if not element else raw_bytes == out_stage_bytes == 0
            # outputs through the shared buffer exactly where rows are not stored as vectors
            assert (out_stage_bytes > 0) == (not element and not vector_stores)
            num_bands = int(launch.scalars[9])
            assert (num_bands > 1) == (items > 256 or (too_large and row_blocks > 1)), (num_bands, items)
            dst_offset = 0 if dst_alignment == 16 else src.dtype.itemsize
            # a grid smaller than the units: blocks walk several
            grid = min(launch.grid[0], 3)
            assert launch.expression.split(", ")[3] == str(stride)  # <T, KH, KW, STRIDE, BACKWARD, R, PITCHED, IndexT>
            got, writes = _plane_kernel_emulation(
                launch, src.reshape(-1, *src.shape[2:]), weight[:, 0], bias, backward, grid, dst_offset, stride
            )
            assert (writes == 1).all()
            want = _plane_reference(src, weight, bias, backward, x_shape, stride, padding)
            numpy.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-12, atol=1e-12)


def _pitched_copy(planes, raw_bytes, src_pitch):
    """The buffer copy_async_pitched (kernels/depthwise_nchw_plane.cu) fills
    from ``planes`` (a unit's whole planes, 16-byte aligned), as values of
    their dtype: vector v (16 bytes) of the unit to byte v * 16 + p * gap,
    p = dwgn::small_div(v, 1 / vectors per plane) in float32 as the kernel
    computes it (__frcp_rn, then one fmaf: an exact product and sum rounded
    once); every destination inside the buffer, 16-byte aligned, written
    once; bytes no copy writes are 0xFF (NaN in every type)."""
    import numpy

    size = planes.dtype.itemsize
    data = numpy.ascontiguousarray(planes).view(numpy.uint8).reshape(-1)
    plane_bytes = planes.shape[1] * planes.shape[2] * size
    gap = src_pitch * size - plane_bytes
    inv = float(numpy.float32(1.0) / numpy.float32(plane_bytes // 16))
    buffer = numpy.full(raw_bytes, 0xFF, numpy.uint8)
    written = numpy.zeros(raw_bytes, bool)
    for v in range(data.size // 16):
        plane = int(numpy.float32(v * inv + 0.5 * inv))  # the exact fma in double, rounded once to float
        to = v * 16 + plane * gap
        assert to % 16 == 0 and to + 16 <= raw_bytes and not written[to:to + 16].any()
        buffer[to:to + 16], written[to:to + 16] = data[v * 16:v * 16 + 16], True
    return buffer.view(planes.dtype)


def _plane_reference(src, weight, bias, backward, x_shape, stride, padding):
    """The float64 reference of what the plane kernel computes from ``src``
    (x, or grad_out for the backward-input)."""
    import numpy

    from cupy_dwgn import reference

    src64, w64 = src.astype(numpy.float64), weight.astype(numpy.float64)
    if backward:
        return reference.depthwise_conv2d_backward_input(src64, w64, x_shape, padding=padding)
    return reference.depthwise_conv2d(src64, w64, None if bias is None else bias.astype(numpy.float64), stride=stride,
                                      padding=padding)


# (x NCHW shape, padding) of 5x5 stride-1 units of several whole planes of a multiple of 16 bytes (enough
# planes that P > 1: _MIN_UNITS), whose planes the PITCHED kernels stage a gap apart (copy_async_pitched).
_PITCHED_PLANE_GEOMETRIES = [
    ((1, 600, 4, 4), 2), ((1, 560, 8, 8), 2), ((2, 300, 8, 12), ((0, 4), (3, 1))), ((1, 530, 6, 8), ((1, 3), (2, 2))),
]


@pytest.mark.parametrize("case", _PITCHED_PLANE_GEOMETRIES, ids=lambda c: "x".join(map(str, c[0])))
def test_plane_kernel_pitched_units_cover_every_output_once(case):
    # Gaps forced (none, the smallest, the largest): the unit's planes land src_pitch values apart, the
    # reads follow them.  Only the 2-byte 5x5 stride-1 4-row kernels are compiled PITCHED (pitch_capable):
    # the others keep flat units whatever gap is asked for.
    import numpy

    from cupy_dwgn import _depthwise_nchw_plane as nchw_plane
    from cupy_dwgn import _validate

    x_shape, padding = case
    k, stride = 5, 1
    n, c = x_shape[:2]
    g = _validate.conv_geometry(x_shape, (c, 1, k, k), stride, padding, 1)
    rng = numpy.random.default_rng(5)
    for dtype, backward in itertools.product(nchw_plane.DTYPES, (False, True)):
        src = rng.standard_normal((n, c, g.out_height, g.out_width) if backward else x_shape).astype(dtype)
        weight = rng.standard_normal((c, 1, k, k)).astype(dtype)
        bias = None if backward else rng.standard_normal(c).astype(dtype)
        want = _plane_reference(src, weight, bias, backward, x_shape, stride, padding)
        plane_values = src.shape[2] * src.shape[3]
        for gap in (0, nchw_plane._PITCH_GAPS[0], nchw_plane._PITCH_GAPS[-1]):
            launch = nchw_plane.plan(g, dtype, backward, "int", 16, 16, 4, gap)
            per_unit, src_pitch = int(launch.scalars[8]), int(launch.scalars[15])
            capable = nchw_plane.pitch_capable(src.dtype.itemsize, k, stride, 4)
            assert per_unit > 1 and src_pitch * src.dtype.itemsize == plane_values * src.dtype.itemsize + capable * gap
            assert launch.expression.endswith(f", 4, {'true' if capable and gap else 'false'}, int>")
            got, writes = _plane_kernel_emulation(launch, src.reshape(-1, *src.shape[2:]), weight[:, 0], bias,
                                                  backward, min(launch.grid[0], 5), 0, stride)
            assert (writes == 1).all()
            numpy.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="pitch_gap"):
        nchw_plane.plan(g, numpy.dtype(numpy.float16), False, "int", 16, 16, pitch_gap=8)
    # _pitched_copy models the kernel's destination formula and reciprocal
    from cupy_dwgn import _compile

    source = (_compile.kernel_dir() / nchw_plane.KERNEL_FILE).read_text()
    assert "return raw + o + dwgn::small_div(o >> 4, inv_plane_vectors) * gap; });" in source
    assert "__frcp_rn(static_cast<float>(src_plane * S / 16))" in source


def test_plane_pitch_rule():
    # _pitch against the count behind it: 16x16 fp16 5x5 planes at 4 rows an item (16 planes a unit, a
    # warp's items the same rows of 2 planes: 7.0-way back to back) get a 32-byte gap (3.5-way), and 4-row
    # items then (H100: 64x1024x16 forward 75.1 -> 50.0 us; 7 rows back to back 60.8); 8x8 fp16 5x5 planes
    # (8.0-way) a gap; planes whose reads spread over the banks back to back
    # (24x24: 3.0-way, under _PITCH_DEGREE; 14x14 fp16: 392 bytes, not a multiple of 16) none; units of
    # one plane none.
    import numpy

    from cupy_dwgn import _depthwise_nchw_plane as plane
    from cupy_dwgn import _validate

    half = numpy.dtype(numpy.float16)

    def pitch_of(shape, k, stride=1):
        g = _validate.conv_geometry(shape, (shape[1], 1, k, k), stride, k // 2, 1)
        launch = plane.plan(g, half, False, "int", 16, 16)
        return plane.launch_rows(launch), (int(launch.scalars[15]) - shape[2] * shape[3]) * 2

    assert pitch_of((64, 1024, 16, 16), 5) == (4, 32)
    assert pitch_of((64, 1280, 8, 8), 5)[0] == 4 and pitch_of((64, 1280, 8, 8), 5)[1] > 0
    # 8-row items count 7.2-way there too, but no 3x3 kernel is PITCHED (pitch_capable): 7-row items, 2.9-way
    assert pitch_of((64, 1024, 16, 16), 3) == (7, 0)
    assert pitch_of((64, 448, 24, 24), 5) == (4, 0)
    assert pitch_of((64, 1344, 14, 14), 5)[1] == 0 and pitch_of((64, 48, 75, 75), 5)[1] == 0
    g = _validate.conv_geometry((64, 1024, 16, 16), (1024, 1, 5, 5), 1, 2, 1)
    src_h, src_w, dst_h, dst_w, top, left = _validate.correlation_frame(g, False)
    layout = plane._units(7, 64 * 1024, src_h, src_w, dst_h, dst_w, 2, 1, 5, 1, 16, 0, top, left)
    per_unit, _, row_blocks, col_blocks = layout[:4]
    flat = plane._bank_conflicts(7, per_unit, row_blocks, col_blocks, src_h, src_w, top, left, 2, 5)
    pitched = plane._bank_conflicts(7, per_unit, row_blocks, col_blocks, src_h, src_w, top, left, 2, 5, 1, 256 + 16)
    assert round(flat, 1) == 2.9 and round(pitched, 1) == 2.0


def _plane_wgrad_emulation(launch, x, grad_out, k, stride, x_offset=0, grad_offset=0):
    """What dwgn_nchw_plane_wgrad (kernels/depthwise_nchw_plane.cu) computes
    for ``launch``: a NumPy transcription of its blocks (channel groups x
    splits), each split's run of (image, band) units (dwgn_plane::planes_of /
    band_of), the staged x and grad_out ranges in one buffer, the thread ->
    item mapping and its masks, in float64; returns the (C, K, K) sums and
    the number of times each grad_out value was counted.  Every x row an
    item reads inside the image must be one its unit staged, and each range
    (from the 16-byte boundary below it; ``*_offset``: the array's address
    modulo 16) must fit its part of the buffer."""
    import numpy

    from cupy_dwgn import _depthwise_nchw_plane as nchw_plane

    (channels, src_h, src_w, dst_h, dst_w, pad_top, pad_left, per_unit, num_bands, row_blocks, col_blocks,
     raw_bytes, grad_at, units, per_split) = (int(v) for v in launch.scalars)
    n = x.shape[0]
    size = x.dtype.itemsize
    assert x.shape == (n, channels, src_h, src_w) and grad_out.shape == (n, channels, dst_h, dst_w)
    assert launch.shared_mem == max(3 * raw_bytes, 2 * k * launch.block[0] * 4) <= 48 * 1024
    assert raw_bytes % 16 == 0 and grad_at % 16 == 0 and grad_at < raw_bytes
    rows, columns = nchw_plane.wgrad_rows(size, k), nchw_plane.COLUMNS
    span = (columns - 1) * stride + k
    items = row_blocks * col_blocks
    band_rows = row_blocks * rows
    assert num_bands == 1 or per_unit == 1
    assert num_bands == -(-dst_h // band_rows) and (num_bands > 1 or band_rows >= dst_h)
    assert units == n * num_bands and launch.block[0] % 32 == 0 and per_unit * items <= launch.block[0] <= 256
    groups, splits = launch.grid[:2]
    assert groups == -(-channels // per_unit) and splits == -(-units // per_split)
    assert (splits - 1) * per_split < units  # every split has a unit
    x64, grad64 = x.astype(numpy.float64), grad_out.astype(numpy.float64)
    total = numpy.zeros((channels, k, k))
    counted = numpy.zeros(grad_out.shape, numpy.int64)
    for group in range(groups):
        first_channel = group * per_unit
        planes = min(per_unit, channels - first_channel)
        for split in range(splits):
            acc = numpy.zeros((launch.block[0], k, k))
            for unit in range(split * per_split, min(units, split * per_split + per_split)):
                image, band = divmod(unit, num_bands)
                if num_bands == 1:
                    src_row0, src_row1, dst_row0, dst_rows = 0, src_h, 0, dst_h
                else:
                    src_row0, src_row1, dst_row0, dst_rows = _plane_band_rows(band, band_rows, stride, pad_top, k,
                                                                              src_h, dst_h)
                assert 0 <= src_row0 <= src_row1 <= src_h
                first_plane = image * channels + first_channel
                x_head = (x_offset + (first_plane * src_h + src_row0) * src_w * size) % 16
                grad_head = (grad_offset + (first_plane * dst_h + dst_row0) * dst_w * size) % 16
                assert -(-(x_head + planes * (src_row1 - src_row0) * src_w * size) // 16) * 16 <= grad_at
                assert grad_at + -(-(grad_head + planes * dst_rows * dst_w * size) // 16) * 16 <= raw_bytes
                for thread in range(launch.block[0]):
                    local_plane, item = divmod(thread, items)
                    if local_plane >= planes:
                        continue
                    rb, cb = divmod(item, col_blocks)
                    rb += dst_row0 // rows
                    c = first_channel + local_plane
                    grad = numpy.zeros((rows, columns))
                    for i in range(rows):
                        y = rb * rows + i
                        for j in range(columns):
                            if y < dst_h and cb * columns + j < dst_w:
                                assert dst_row0 <= y < dst_row0 + dst_rows, "a grad_out row the unit did not stage"
                                grad[i, j] = grad64[image, c, y, cb * columns + j]
                                counted[image, c, y, cb * columns + j] += 1
                    row0, col0 = rb * rows * stride - pad_top, cb * columns * stride - pad_left
                    for t in range((rows - 1) * stride + k):
                        source_row = row0 + t
                        if not 0 <= source_row < src_h:
                            continue
                        assert src_row0 <= source_row < src_row1, "an x row the unit did not stage"
                        row = numpy.array([x64[image, c, source_row, col0 + e] if 0 <= col0 + e < src_w else 0.0
                                           for e in range(span)])
                        for i in range(rows):
                            kh = t - i * stride
                            if 0 <= kh < k:
                                for kw in range(k):
                                    acc[thread, kh, kw] += grad[i] @ row[kw:kw + (columns - 1) * stride + 1:stride]
            for p in range(planes):
                total[first_channel + p] += acc[p * items:(p + 1) * items].sum(axis=0)
    return total, counted


# (x NCHW shape, filter size, padding, stride) for the weight gradient's
# index math: units of several channels' planes (and a last group of
# fewer), bands (2-4, padding past the filter's half, stride 2), widths that
# are and are not multiples of 4, every padding form.
_PLANE_WGRAD_GEOMETRIES = [
    ((2, 7, 13, 11), 3, 1, 1), ((1, 5, 9, 10), 5, ((0, 4), (3, 1)), 1), ((2, 3, 7, 7), 7, 3, 1),
    ((3, 50, 6, 5), 3, 1, 1), ((2, 5, 4, 7), 3, "valid", 2), ((1, 2, 5, 6), 7, 6, 2), ((2, 3, 19, 19), 5, 2, 2),
    ((2, 2, 75, 75), 3, 1, 1), ((1, 1, 150, 30), 5, 2, 1), ((1, 1, 60, 70), 7, 8, 1), ((1, 2, 99, 99), 3, 1, 2),
    ((1, 1, 20, 70), 3, ((0, 60), (1, 1)), 1), ((1, 1, 20, 70), 3, ((60, 0), (1, 1)), 1),
    ((9, 3, 7, 7), 3, 1, 1), ((5, 1, 60, 70), 7, 8, 1),  # two splits of several units (the last one shorter)
]


@pytest.mark.parametrize("case", _PLANE_WGRAD_GEOMETRIES, ids=lambda c: f"{'x'.join(map(str, c[0]))}-{c[1]}x{c[1]}-s{c[3]}")
def test_plane_wgrad_index_math_counts_every_output_once(case):
    _check_plane_wgrad_index_math(case, seed=5)


@settings(max_examples=25, deadline=None)
@given(_plane_geometries(), st.integers(0, 2**32 - 1))
def test_plane_wgrad_random_geometries(case, seed):
    # The whole-plane weight gradient's emulation on drawn geometries (the
    # plane kernel's: any padding per side, widths with and without
    # 4-column vectors, planes per unit, both strides): every (output,
    # tap) pair counted once and the sums equal to the float64 reference.
    _check_plane_wgrad_index_math(case, seed)


def _check_plane_wgrad_index_math(case, seed):
    import numpy

    from cupy_dwgn import _depthwise_nchw_plane_wgrad as plane_wgrad
    from cupy_dwgn import _validate, reference

    x_shape, k, padding, stride = case
    n, c = x_shape[:2]
    g = _validate.conv_geometry(x_shape, (c, 1, k, k), stride, padding, 1)
    rng = numpy.random.default_rng(seed)
    for dtype in (numpy.dtype(numpy.float16), numpy.dtype(numpy.float32)):
        x = rng.standard_normal(x_shape).astype(dtype)
        grad_out = rng.standard_normal((n, c, g.out_height, g.out_width)).astype(dtype)
        (partial, finalize), (partial_shape, partial_dtype) = plane_wgrad.plan(g, dtype, 16, 16)
        assert partial.expression == f"{plane_wgrad.KERNEL}<{'__half' if dtype.itemsize == 2 else 'float'}, {k}, {stride}>"
        assert partial_shape == (partial.grid[1], k * k, c) and partial_dtype == numpy.float32
        assert plane_wgrad.plan(g, dtype, 8, 16) is None and plane_wgrad.plan(g, dtype, 16, 2) is None
        got, counted = _plane_wgrad_emulation(partial, x, grad_out, k, stride)
        assert (counted == 1).all()
        want = reference.depthwise_conv2d_backward_weight(
            grad_out.astype(numpy.float64), x.astype(numpy.float64), (c, 1, k, k), stride=stride, padding=padding)
        numpy.testing.assert_allclose(got, want[:, 0], rtol=1e-12, atol=1e-12)


def test_plane_wgrad_rule():
    # The measured rule (preferred's docstring): the whole-plane weight
    # gradient where the NCHW register kernel would not take the call or would
    # read one or two columns per lane (7x7 at two stays there); the register
    # kernel keeps its 8- and 16-byte vector rows.  The ops' dispatch follows.
    import numpy

    from cupy_dwgn import _depthwise_nchw_plane_wgrad as plane_wgrad
    from cupy_dwgn import _depthwise_nchw_wgrad_regs as regs
    from cupy_dwgn import _dtypes, _validate

    assert plane_wgrad.MODE == "rule"
    half, single = numpy.dtype(numpy.float16), numpy.dtype(numpy.float32)
    plane_cells = {
        (75, 3, 1), (75, 5, 2), (150, 3, 1), (150, 3, 2), (38, 5, 1), (38, 3, 2), (19, 3, 1), (19, 5, 1),
        (19, 5, 2), (10, 3, 1), (10, 5, 1), (7, 3, 1), (65, 3, 1), (15, 7, 1),
    }
    for hw, k, stride in sorted(plane_cells | {(56, 3, 1), (112, 3, 2), (28, 3, 1), (28, 5, 1), (56, 7, 1),
                                                (14, 7, 1)}):
        g = _validate.conv_geometry((64, 32, hw, hw), (32, 1, k, k), stride, k // 2, 1)
        for dtype in (half, _dtypes.bfloat16, single):
            staged = dtype == single and k >= 5 and g.out_width >= 28
            vw = regs.vector_width(g, dtype, 16, 16)
            assert plane_wgrad.preferred(g, dtype) == (staged or vw == 1 or (vw == 2 and k < 7)), (hw, k, stride, dtype)
            assert plane_wgrad.preferred(g, dtype) == ((hw, k, stride) in plane_cells or staged), (hw, k, stride, dtype)
            selected = plane_wgrad.select(g, dtype, 16, 16)
            assert (selected is not None) == plane_wgrad.preferred(g, dtype)
            assert plane_wgrad.select(g, dtype, 8, 16) is None  # cp.async needs 16-byte alignment
    # The index-math geometries include splits of several units.
    walks = []
    for x_shape, k, padding, stride in _PLANE_WGRAD_GEOMETRIES:
        g = _validate.conv_geometry(x_shape, (x_shape[1], 1, k, k), stride, padding, 1)
        (partial, _), _ = plane_wgrad.plan(g, half, 16, 16)
        walks.append((partial.grid[1], int(partial.scalars[-1])))
    assert any(splits > 1 and per_split > 1 for splits, per_split in walks), walks
    # Calls it does not serve: no rule to apply (the register kernel's tables have no such keys).
    for dtype, k in ((numpy.dtype(numpy.float64), 3), (half, 9), (single, 1), (half, 4)):
        g = _validate.conv_geometry((2, 8, 19, 19), (8, 1, k, k), 1, k // 2, 1)
        assert not plane_wgrad.preferred(g, dtype) and plane_wgrad.select(g, dtype, 16, 16) is None


def _column_kernel_coverage(launch, batch, rows, channels, vec, grid):
    """How often the statistics / backward-reduce kernel of ``launch``,
    launched with ``grid`` blocks, reads each (n, row, channel vector) of x
    and writes each (n, chunk, channel) of partial: a NumPy transcription of
    the kernel's index math (the block-stride loop over gn::ColumnItems and
    their decode, gn::ColumnLayout::channels over C / VEC columns,
    gn::ChunkRows, gn::lane_rows)."""
    import numpy

    block = launch.block[0]
    # Scalars (N, S, C, G, num_chunks, rows_per_chunk, cols, ...).
    num_chunks, rows_per_chunk, cols = (int(v) for v in launch.scalars[4:7])
    width = channels // vec
    assert 0 < cols <= block
    column_blocks = -(-width // cols)
    reads = numpy.zeros((batch, rows, width), numpy.int64)
    writes = numpy.zeros((batch, num_chunks, channels), numpy.int64)
    thread = numpy.arange(block)
    lane, col = thread // cols, thread % cols
    lanes = block // cols
    for block_index in range(grid):
        for item in range(block_index, num_chunks * batch * column_blocks, grid):
            rest = item // num_chunks
            chunk, z = item - rest * num_chunks, rest // batch
            n = rest - z * batch
            c = z * cols + col
            valid = (lane < lanes) & (c < width)
            row0, row1 = chunk * rows_per_chunk, min(rows, (chunk + 1) * rows_per_chunk)
            for t in numpy.flatnonzero(valid):
                numpy.add.at(reads[n, :, c[t]], numpy.arange(row0 + lane[t], row1, lanes), 1)
            # The block's channels, slots j < span, one thread each (gn::combine_lanes / sum_lanes).
            first, span = z * cols * vec, vec * min(cols, width - z * cols)
            writes[n, chunk, first:first + span] += 1
    return reads, writes


@pytest.mark.parametrize(
    "batch,rows,channels,dtype,aligned",
    [
        (2, 4096, 320, "float16", True),  # 40 vector columns x 6 lanes (backward; the forward reads elements)
        (4, 8192, 320, "float16", True),  # 20 MB: both read 40 vector columns
        (1, 300, 2560, "float16", True),  # 320 vector columns: 5 column blocks of 64 x 4 lanes
        (1, 10, 1304, "float16", True),  # 163 vector columns: blocks of 55, 55, 53
        (3, 97, 99, "float32", True),  # C % 4 != 0: the scalar path
        (2, 1000, 64, "float32", False),  # misaligned: the scalar path
        (1, 5000, 8, "float64", True),  # 4 vector columns x 64 lanes, a short last chunk
    ],
)
def test_group_norm_column_kernels_cover_every_element_once(batch, rows, channels, dtype, aligned):
    # The statistics and backward-reduce kernels read x (and grad_out) as
    # columns of VEC-channel vectors: every element must be read by exactly
    # one thread and every (n, chunk, channel) of partial written once, or
    # the finalize sums garbage.  Checked for the plans' own grids.
    import numpy

    from cupy_dwgn import _group_norm as gn

    dtype = numpy.dtype(dtype)
    for path in ("split", "fused"):
        forward = gn._forward_plan(batch, rows, channels, 1, dtype, dtype, "silu", 1e-5, aligned, path)
        backward = gn._backward_plan(batch, rows, channels, 1, dtype, dtype, "silu", aligned, path)
        for plan, launch in ((forward, forward.first), (backward, backward.first)):
            # VEC: the template argument before the index type (the statistics
            # of small tensors read elements even where vectors could be read).
            vec = int(_template_args(launch.expression)[-2])
            assert vec in (1, gn._vector_width(dtype, channels, aligned)), launch.expression
            assert (launch is backward.first) <= (vec == gn._vector_width(dtype, channels, aligned))
            assert launch.cooperative == (path == "fused") and (plan.finalize is None) == (path == "fused")
            assert int(launch.scalars[-1]) == (path == "fused")  # the kernel's finalize flag
            # The plan's grid (one block per item), and a cooperative grid
            # trimmed to a few resident blocks: every block takes several items.
            for grid in (launch.grid[0], 7):
                reads, writes = _column_kernel_coverage(launch, batch, rows, channels, vec, grid)
                assert (reads == 1).all(), numpy.argwhere(reads != 1)[:5]
                assert (writes == 1).all(), numpy.argwhere(writes != 1)[:5]
            assert plan.temporaries[0][0] == (batch, int(launch.scalars[4]), 2, channels)


def test_group_norm_onepass_plans_and_rule():
    # The one-pass forward (one cooperative launch), when forced, names a
    # shipped specialization and leaves the 64-bit and too-wide shapes to the
    # column kernels; the "fused" path ("auto") never takes it (the one-pass
    # kernels measured slower: _group_norm's path notes).
    import numpy

    from cupy_dwgn import _group_norm as gn

    shipped = {e for f, e in ALL_SPECIALIZATIONS if f == gn.KERNEL_FILE}
    f16, f32 = numpy.dtype(numpy.float16), numpy.dtype(numpy.float32)
    for n, s, c, g, dtype, vec_ok in [
        (2, 4096, 320, 32, f16, True), (2, 1024, 640, 32, f16, True), (2, 256, 1280, 32, f16, True),
        (8, 64, 1280, 32, f16, True), (3, 97, 99, 33, f32, False),
    ]:
        assert gn._forward_plan(n, s, c, g, dtype, f32, "silu", 1e-5, vec_ok, "fused").onepass is None
        plan = gn._forward_plan(n, s, c, g, dtype, f32, "silu", 1e-5, vec_ok, "onepass")
        assert plan.onepass is not None and plan.first is None, (n, s, c)
        assert plan.onepass.cooperative and plan.onepass.expression in shipped
        assert plan.onepass.block[0] % 32 == 0
    assert gn._forward_plan(1, 512 * 512, 128, 32, f16, f16, "silu", 1e-5, True, "onepass").onepass is not None
    assert gn._forward_plan(4, 4096, 2560, 32, f16, f16, "silu", 1e-5, True, "onepass").onepass is None  # C/8 > 256
    assert gn._forward_plan(1, 16, 513, 1, f32, f32, "identity", 1e-5, True, "onepass").onepass is None  # scalar C > 512
    assert gn._forward_plan(2, 4096, 320, 32, f16, f32, "silu", 1e-5, True, "split").onepass is None
    # The one-pass backward: the same rule with x and grad_out (2 tensors) and blocks <= 256.
    for n, s, c, g, dtype, vec_ok in [
        (2, 4096, 320, 32, f16, True), (2, 1024, 640, 32, f16, True), (2, 256, 1280, 32, f16, True),
        (8, 64, 1280, 32, f16, True), (3, 97, 99, 33, f32, False), (8, 64, 1024, 32, f32, True),
    ]:
        assert gn._backward_plan(n, s, c, g, dtype, f32, "silu", vec_ok, "fused").onepass is None
        plan = gn._backward_plan(n, s, c, g, dtype, f32, "silu", vec_ok, "onepass")
        assert plan.onepass is not None and plan.first is None, (n, s, c)
        assert plan.onepass.cooperative and plan.onepass.expression in shipped
        assert plan.onepass.block[0] % 32 == 0 and plan.onepass.block[0] <= 256
        assert plan.temporaries[1][0] == (n, 5, c)
    assert gn._backward_plan(8, 64, 1280, 32, f32, f32, "silu", True, "onepass").onepass is None  # C/4 > 256
    assert gn._backward_plan(2, 1 << 31 >> 11, 1024, 1, f16, f32, "identity", True, "onepass").onepass is None  # 2**31
    assert gn._backward_plan(2, 4096, 320, 32, f16, f32, "silu", True, "split").onepass is None
    for cols, vec in [(40, 8), (160, 8), (16, 8), (80, 4), (99, 1), (1, 1), (512, 1)]:
        block = gn._onepass_block(cols, vec)
        assert block % 32 == 0 and cols <= block <= min(512, 2048 // vec)
        assert (block // cols) * cols * vec <= gn._ONEPASS_SLOTS


def test_group_norm_resident_plans_and_rule():
    # The resident kernels (opt-in: FORWARD_PATH / BACKWARD_PATH "resident"): one cooperative launch of
    # exactly N * B blocks that must all be resident (whole_grid: never
    # trimmed), tiles of whole rows of at most _RESIDENT_MAX_TILE bytes,
    # every block with rows, a row of C / VEC vectors in one block; the
    # kernel's shared-memory layout sized as the kernel computes it.
    import numpy

    from cupy_dwgn import _dtypes
    from cupy_dwgn import _group_norm as gn

    shipped = {e for f, e in ALL_SPECIALIZATIONS if f == gn.KERNEL_FILE}
    f16, f32, f64 = (numpy.dtype(t) for t in (numpy.float16, numpy.float32, numpy.float64))
    for n, s, c, g, dtype, aligned in [
        (2, 4096, 320, 32, f16, True), (2, 1024, 640, 32, f16, True), (2, 256, 1280, 32, f16, True),
        (8, 64, 1280, 32, f16, True), (2, 4096, 320, 32, f32, True), (3, 97, 99, 33, f32, False),
        (2, 4093, 320, 32, f16, True), (5, 1, 40, 8, f16, False), (130, 16, 64, 8, f32, True),
        (1, 5120, 1024, 1024, f32, True), (1, 65536, 8, 2, f32, True), (2, 16, 16, 16, f64, True),
    ]:
        plan = gn._forward_plan(n, s, c, g, dtype, f64 if dtype == f64 else f32, "silu", 1e-5, aligned, "resident")
        launch = plan.resident
        assert launch is not None and plan.first is None and plan.onepass is None, (n, s, c)
        assert launch.cooperative and launch.whole_grid and launch.expression in shipped
        vec = gn._vector_width(dtype, c, aligned)
        block, per_sample, rows_per_block, shared = gn._resident_geometry(n, s, c, g, dtype, vec)
        assert launch.grid[0] == n * per_sample and launch.block[0] == block and launch.shared_mem == shared
        assert block % 32 == 0 and c // vec <= block <= gn._RESIDENT_MAX_BLOCK
        assert (per_sample - 1) * rows_per_block < s <= per_sample * rows_per_block  # every block has rows
        assert rows_per_block * c * dtype.itemsize <= gn._RESIDENT_MAX_TILE
        lanes = block // (c // vec)
        acc = _dtypes.accumulator_dtype(dtype).itemsize
        assert shared == (-(-rows_per_block * c * dtype.itemsize // 16) * 16 + 2 * lanes * c * acc + 2 * block * 8
                          + g * (16 + acc))
        assert plan.temporaries == (((n, per_sample, 2, g), numpy.dtype(numpy.float64)),)
        steps = gn._forward_steps(plan, True, True)
        assert len(steps.launches) == 1
        # (x, partial, weight, bias, mean, rstd, y, barrier): the temporaries follow the 6 call addresses
        assert steps.positions[0] == (0, 6, 1, 2, 7, 8, 3, 9)
        assert gn._forward_steps(plan, False, False).positions[0] == (0, 6, 1, 2, 4, 5, 3, 7)
    # Past the rule: tiles over _RESIDENT_MAX_TILE, rows wider than a block, 2**31 elements.
    for n, s, c, dtype in [(1, 262144, 128, f16), (8, 16384, 320, f16), (4, 4096, 2560, f32), (1, 16, 4100, f32),
                           (2, 1 << 31 >> 11, 1024, f16)]:
        plan = gn._forward_plan(n, s, c, 4, dtype, f32, "silu", 1e-5, True, "resident")
        assert plan.resident is None and plan.first is not None and plan.finalize is None, (n, s, c)  # fused
    for path in ("fused", "split", "onepass"):
        assert gn._forward_plan(2, 4096, 320, 32, f16, f32, "silu", 1e-5, True, path).resident is None
    # The resident backward: tiles of x and grad_out within the same cap.
    for n, s, c, g, dtype in [(2, 4096, 320, 32, f16), (2, 4096, 320, 32, f32), (8, 64, 1280, 32, f16),
                              (3, 97, 99, 33, f32), (1, 2560, 1024, 1024, f32)]:
        plan = gn._backward_plan(n, s, c, g, dtype, f32, "silu", True, "resident")
        launch = plan.resident
        assert launch is not None and plan.first is None and launch.whole_grid and launch.expression in shipped
        vec = gn._vector_width(dtype, c, True)
        block, per_sample, rows_per_block, shared = gn._resident_geometry(n, s, c, g, dtype, vec, backward=True)
        assert 2 * rows_per_block * c * dtype.itemsize <= gn._RESIDENT_MAX_TILE and launch.shared_mem == shared
        assert plan.temporaries == (((n * per_sample, 2 * (c + g)), _dtypes.accumulator_dtype(dtype)),)
        # (grad_out, x, mean, rstd, weight, bias, partial, dweight, dbias, grad_in, barrier)
        assert gn._backward_steps(plan).positions[0] == (0, 1, 2, 3, 4, 5, 9, 7, 8, 6, 10)
    for n, s, c in [(1, 5120, 1024), (1, 16384, 256)]:  # the forward's tile fits, two do not
        assert gn._forward_plan(n, s, c, 4, f32, f32, "silu", 1e-5, True, "resident").resident is not None
        plan = gn._backward_plan(n, s, c, 4, f32, f32, "silu", True, "resident")
        assert plan.resident is None and plan.first is not None and plan.finalize is None  # fused
    for cols in (1, 16, 40, 80, 99, 160, 320, 512):
        block = gn._resident_block(cols)
        assert block % 32 == 0 and max(64, cols) <= block <= 512
    assert gn._resident_block(40) == 480 and gn._resident_block(513) is None


def test_group_norm_cluster_plans():
    # The cluster forward's rule (_cluster_geometry): sets of whole groups of
    # whole 16-byte vectors with rows of at least _CLUSTER_MIN_SET_BYTES, the
    # least cluster size giving _CLUSTER_TARGET_CTAS CTAs (more where a CTA's
    # rows pass _CLUSTER_MAX_TILE), one launch whose arguments are (x,
    # weight, bias, mean, rstd, y); nothing where it does not serve.
    import numpy

    from cupy_dwgn import _dtypes
    from cupy_dwgn import _group_norm as gn

    f16, f32, f64 = (numpy.dtype(t) for t in (numpy.float16, numpy.float32, numpy.float64))
    bf16 = numpy.dtype(_dtypes.bfloat16)
    shipped = {e for _, e in gn.specializations("group_norm")}
    for n, s, c, g, dtype, want in [
        (2, 4096, 320, 32, f16, (40, 16)), (2, 1024, 640, 32, bf16, (40, 8)), (2, 256, 1280, 32, f32, (40, 4)),
        (8, 64, 1280, 32, f16, (40, 1)), (1, 16384, 128, 32, f16, (16, 16)), (1, 16384, 128, 32, f32, (8, 16)),
        (2, 4096, 320, 32, f32, (20, 8)), (3, 899, 96, 32, f32, (12, 16)), (16, 81, 256, 8, f32, (32, 2)),
        (4, 9, 64, 1, f64, (64, 16)), (1, 17, 136, 17, f16, (136, 16)),  # C / unit = 17 (prime): the whole row
        (8, 16384, 320, 32, f16, (40, 16)),  # 1024 CTAs of 80 KB tiles
        (4, 4096, 2560, 32, f16, (80, 8)),  # clusters of 8, but 84 MB: "auto" leaves it to the two launches
    ]:
        vec = gn._vector_width(dtype, c, True)
        set_channels, cluster, block, rows_per_cta, shared = gn._cluster_geometry(n, s, c, g, dtype, vec, True)
        assert (set_channels, cluster) == want, (n, s, c, g, dtype)
        unit = (c // g) * vec // math.gcd(c // g, vec)
        assert set_channels % unit == 0 and c % set_channels == 0
        assert set_channels * dtype.itemsize >= gn._CLUSTER_MIN_SET_BYTES or set_channels == c
        clusters = n * c // set_channels
        assert cluster == gn.CLUSTER_SIZES[-1] or clusters * cluster >= gn._CLUSTER_TARGET_CTAS
        assert cluster == 1 or clusters * cluster // 2 < gn._CLUSTER_TARGET_CTAS or (
            -(-s // (cluster // 2)) * set_channels * dtype.itemsize > gn._CLUSTER_MAX_TILE)
        assert rows_per_cta == -(-s // cluster) and rows_per_cta * set_channels * dtype.itemsize <= gn._CLUSTER_MAX_TILE
        cols = set_channels // vec
        assert block == cols * min(gn._CLUSTER_BLOCK // cols, max(rows_per_cta, -(-32 // cols))) and block >= 32
        acc = _dtypes.accumulator_dtype(dtype).itemsize
        assert shared == (-(-rows_per_cta * set_channels * dtype.itemsize // 16) * 16
                          + 2 * (block // cols) * set_channels * acc + 16 * max(block, set_channels)
                          + (set_channels // (c // g)) * (40 + acc))
        w_dtype = f32 if dtype.itemsize == 2 else dtype
        # "auto" takes clusters of at most _CLUSTER_AUTO_MAX_SIZE CTAs, else the two launches.
        auto = gn._forward_plan(n, s, c, g, dtype, w_dtype, "silu", 1e-5, True, "auto")
        taken = cluster <= gn._CLUSTER_AUTO_MAX_SIZE and n * s * c * dtype.itemsize <= gn._CLUSTER_AUTO_MAX_BYTES
        small = gn._small_serves(n, s, c, g, "auto")  # small groups: "auto" takes the small-group kernel first
        assert (auto.cluster is not None) == (taken and not small) and (auto.small is not None) == small, (n, s, c)
        assert auto.cluster is not None or auto.small is not None or (auto.first is not None and auto.finalize is None)
        for path in ("cluster", "auto") if auto.cluster is not None else ("cluster",):
            plan = gn._forward_plan(n, s, c, g, dtype, w_dtype, "silu", 1e-5, True, path)
            launch = plan.cluster
            assert launch is not None and plan.first is None and plan.resident is None and launch.expression in shipped
            assert launch.cluster == cluster and launch.grid[0] == clusters * cluster and launch.block[0] == block
            assert launch.expression.endswith(f", {vec}, {cluster}>") and not launch.cooperative
            assert plan.temporaries == ()
            assert gn._forward_steps(plan, False, False).positions[0] == (0, 1, 2, 4, 5, 3)
            # mean and rstd as workspace temporaries (6, 7; the grid-barrier word last, unused)
            assert gn._forward_steps(plan, True, True).positions[0] == (0, 1, 2, 6, 7, 3)
    # Not served: the element path, 2**31 elements, sets whose 16 CTAs' rows still pass _CLUSTER_MAX_TILE.
    for n, s, c, g, dtype, aligned in [(2, 4096, 320, 32, f16, False), (3, 899, 99, 33, f32, True),
                                       (2, 1 << 31 >> 11, 1024, 32, f16, True), (1, 262144, 128, 32, f16, True),
                                       (1, 65536, 256, 32, f32, True)]:
        plan = gn._forward_plan(n, s, c, g, dtype, dtype, "silu", 1e-5, aligned, "cluster")
        assert plan.cluster is None and plan.first is not None and plan.finalize is None, (n, s, c)  # fused
    for path in ("fused", "split", "onepass", "resident"):
        assert gn._forward_plan(2, 4096, 320, 32, f16, f32, "silu", 1e-5, True, path).cluster is None
    # Every cluster size of every activation and weight dtype is a shipped specialization (vector path only).
    for dtype in (f16, bf16, f32, f64):
        names = {e for e in shipped if e.startswith(f"dwgn_gn_fwd_cluster<{_dtypes.ctype(dtype)},")}
        assert len(names) == len(gn.weight_dtypes(dtype)) * len(gn.ACTIVATIONS) * len(gn.CLUSTER_SIZES)
        assert all(e.endswith(tuple(f", {16 // dtype.itemsize}, {size}>" for size in gn.CLUSTER_SIZES)) for e in names)


def test_group_norm_cluster_backward_plans():
    # The cluster backward's rule (_cluster_geometry(..., backward=True)):
    # the forward's sets, clusters of at most 8 CTAs whose two tiles fit
    # _CLUSTER_MAX_TILE, about _CLUSTER_BWD_TARGET_CTAS CTAs; one launch
    # whose arguments are (grad_out, x, mean, rstd, weight, bias, partial,
    # tickets, dw, db, dx) with the samples' per-channel sums (N, 2, C) and
    # the workspace's tickets as temporaries; nothing where it does not serve.
    import numpy

    from cupy_dwgn import _dtypes, _workspace
    from cupy_dwgn import _group_norm as gn

    f16, f32, f64 = (numpy.dtype(t) for t in (numpy.float16, numpy.float32, numpy.float64))
    bf16 = numpy.dtype(_dtypes.bfloat16)
    shipped = {e for _, e in gn.specializations("group_norm_backward")}
    for n, s, c, g, dtype, want in [
        (2, 4096, 320, 32, f16, (40, 8)), (2, 1024, 640, 32, bf16, (40, 4)), (2, 256, 1280, 32, f32, (40, 2)),
        (8, 64, 1280, 32, f16, (40, 1)), (3, 899, 96, 32, f32, (12, 8)), (4, 9, 64, 1, f64, (64, 8)),
        (130, 4, 64, 8, f32, (8, 1)), (1, 96, 1024, 1, f16, (1024, 8)),
    ]:
        vec = gn._vector_width(dtype, c, True)
        set_channels, cluster, block, rows_per_cta, shared = gn._cluster_geometry(n, s, c, g, dtype, vec, True, True)
        assert (set_channels, cluster) == want, (n, s, c, g, dtype)
        assert set_channels == gn._cluster_geometry(n, s, c, g, dtype, vec, True)[0]  # the forward's sets
        clusters = n * c // set_channels
        assert cluster == gn.BWD_CLUSTER_SIZES[-1] or clusters * cluster >= gn._CLUSTER_BWD_TARGET_CTAS
        assert rows_per_cta == -(-s // cluster) and 2 * rows_per_cta * set_channels * dtype.itemsize <= gn._CLUSTER_MAX_TILE
        cols = set_channels // vec
        lanes = block // cols
        max_block = gn._CLUSTER_BWD_BLOCK if dtype.itemsize == 2 else gn._CLUSTER_BWD_WIDE_BLOCK
        assert block == cols * min(max_block // cols, max(rows_per_cta, -(-32 // cols))) and block >= 32
        acc = _dtypes.accumulator_dtype(dtype).itemsize
        tile = -(-rows_per_cta * set_channels * dtype.itemsize // 16) * 16
        assert shared == 2 * tile + (2 * lanes * set_channels + 2 * set_channels + 4 * (set_channels // (c // g))) * acc + 16
        w_dtype = f32 if dtype.itemsize == 2 else dtype
        auto = gn._backward_plan(n, s, c, g, dtype, w_dtype, "silu", True, "auto")
        taken = cluster <= gn._CLUSTER_BWD_AUTO_MAX_SIZE and n * s * c * dtype.itemsize <= gn._CLUSTER_BWD_AUTO_MAX_BYTES
        small = gn._small_serves(n, s, c, g, "auto")  # small groups: "auto" takes the small-group kernels first
        assert (auto.cluster is not None) == (taken and not small) and (auto.small is not None) == small, (n, s, c)
        assert auto.cluster is not None or auto.small is not None or (auto.first is not None and auto.finalize is None)
        for path in ("cluster", "auto") if auto.cluster is not None else ("cluster",):
            plan = gn._backward_plan(n, s, c, g, dtype, w_dtype, "silu", True, path)
            launch = plan.cluster
            assert launch is not None and plan.first is None and plan.resident is None and launch.expression in shipped
            assert launch.expression.startswith("dwgn_gn_bwd_cluster<") and launch.expression.endswith(f", {vec}, {cluster}>")
            assert launch.cluster == cluster and launch.grid[0] == clusters * cluster and launch.block[0] == block
            assert launch.shared_mem == shared and not launch.cooperative
            assert plan.temporaries == (((n, 2, c), _dtypes.accumulator_dtype(dtype)),)
            steps = gn._backward_steps(plan)
            assert steps.positions[0] == (0, 1, 2, 3, 4, 5, 9, 10, 7, 8, 6)
            assert steps.temporaries == plan.temporaries + (_workspace.TICKETS,)
    # Not served: the element path, more channel sets than tickets, tiles past _CLUSTER_MAX_TILE at 8 CTAs;
    # and "fused" / "split" / "onepass" / "resident" never take it.
    for n, s, c, g, dtype, aligned in [(2, 4096, 320, 32, f16, False), (1, 16, 15360, 1920, f32, True),
                                       (1, 16384, 320, 32, f16, True)]:
        plan = gn._backward_plan(n, s, c, g, dtype, dtype, "silu", aligned, "cluster")
        assert plan.cluster is None and plan.first is not None, (n, s, c)
    assert 15360 // 8 > _workspace.TICKET_COUNT
    for path in ("fused", "split", "onepass", "resident"):
        assert gn._backward_plan(2, 1024, 640, 32, f16, f32, "silu", True, path).cluster is None
    for dtype in (f16, bf16, f32, f64):
        names = {e for e in shipped if e.startswith(f"dwgn_gn_bwd_cluster<{_dtypes.ctype(dtype)},")}
        assert len(names) == len(gn.weight_dtypes(dtype)) * len(gn.ACTIVATIONS) * len(gn.BWD_CLUSTER_SIZES)


def test_group_norm_cluster_gpu_cases_cover_the_geometries():
    # The GPU tests' cluster cases (tests/test_group_norm_gpu.py) reach the
    # geometries the kernels' strides and limits hinge on: every cluster
    # size, a CTA with no rows, a partial last warp, a channel set wider
    # than its block (strided loops over the set's channels); forward a CTA
    # of more than 113 KB of shared memory (one CTA per SM), backward one
    # sample and more than 128 (the tickets' modulus); and each case's
    # stated cluster size is the rule's.
    import numpy

    from cupy_dwgn import _group_norm as gn
    from test_group_norm_gpu import _CLUSTER_BACKWARD_CASES, _CLUSTER_CASES

    for cases, backward, sizes, wanted in [
            (_CLUSTER_CASES, False, gn.CLUSTER_SIZES, ["over 113 KB"]),
            (_CLUSTER_BACKWARD_CASES, True, gn.BWD_CLUSTER_SIZES, ["one sample", "over 128 samples"])]:
        seen = collections.Counter()
        for shape, groups, dtype, _, _, _, cluster in cases:
            dtype = numpy.dtype(dtype)
            rows = math.prod(shape[1:-1])
            geometry = gn._cluster_geometry(shape[0], rows, shape[-1], groups, dtype,
                                            gn._vector_width(dtype, shape[-1], True), True, backward)
            assert geometry is not None, shape
            set_channels, size, block, rows_per_cta, shared = geometry
            assert size == cluster, shape
            seen[f"size {size}"] += 1
            seen["empty CTA"] += rows_per_cta * (size - 1) >= rows
            seen["partial warp"] += block % 32 != 0
            seen["set wider than the block"] += set_channels > block
            seen["over 113 KB"] += shared > 113 * 1024
            seen["one sample"] += shape[0] == 1
            seen["over 128 samples"] += shape[0] > 128
        missing = [k for k in [f"size {s}" for s in sizes] + [
            "empty CTA", "partial warp", "set wider than the block"] + wanted if not seen[k]]
        assert not missing, (backward, missing)


def test_group_norm_cluster_path_per_device(monkeypatch):
    # Which devices take the cluster forward (_path, _plan_on, _cluster_fits),
    # with stand-in device facts: compute capability 9 takes it ("auto" by
    # the rule, "cluster" forced), 8 and devices without cooperative launches
    # do not; clusters of 16 only on compute capability 9; a plan whose
    # shared memory passes the device's per-block limit gives way to the two
    # launches.
    import numpy

    from cupy_dwgn import _group_norm as gn
    from cupy_dwgn import _launch

    f16, f32 = numpy.dtype(numpy.float16), numpy.dtype(numpy.float32)
    devices = {0: (9, 232448), 1: (8, 232448), 2: (10, 232448), 3: (9, 16384)}  # (major, shared per block)
    monkeypatch.setattr(_launch, "cooperative_supported", lambda: True)
    monkeypatch.setattr(_launch, "compute_capability_major", lambda device: devices[device][0])
    monkeypatch.setattr(_launch, "max_shared_per_block", lambda device: devices[device][1])
    assert [gn._path("auto", d) for d in (0, 1, 2)] == ["auto", "auto, no clusters", "auto"]
    # The small-group kernels on every device; without cooperative launches the fallback is "split".
    shape = (4096, 1, 64, 8, f32, f32, "silu", 1e-5)
    assert gn._plan_on(1, gn._forward_plan, shape, True, "auto").small is not None
    with monkeypatch.context() as m:
        m.setattr(_launch, "cooperative_supported", lambda: False)
        assert [gn._path(p, 0) for p in ("auto", "small", "fused", "cluster")] == [
            "auto, split", "small, split", "split", "split"]
        assert gn._plan_on(0, gn._forward_plan, shape, True, "auto").small is not None
        assert gn._plan_on(0, gn._backward_plan, shape[:-1], True, "auto").small is not None
        for setting in ("auto", "small"):  # too large a group for "auto": the three launches
            big = (2, 4096, 320, 32, f16, f32, "silu", 1e-5)
            plan = gn._plan_on(0, gn._forward_plan, big, True, setting)
            assert plan.small is None if setting == "auto" else plan.small is not None
        plan = gn._plan_on(0, gn._forward_plan, (2, 4096, 320, 32, f16, f32, "silu", 1e-5), True, "auto")
        assert plan.first is not None and plan.finalize is not None and not plan.first.cooperative
    assert [gn._path("cluster", d) for d in (0, 1)] == ["cluster", "fused"]
    assert gn._path("fused", 0) == "fused" and gn._path("resident", 0) == "resident" and gn._path("split", 0) == "split"
    eight = (2, 1024, 640, 32, f16, f32, "silu", 1e-5)  # clusters of 8, 31 KB of shared memory
    sixteen = (2, 4096, 320, 32, f16, f32, "silu", 1e-5)  # clusters of 16 (forced only)
    assert gn._plan_on(0, gn._forward_plan, eight, True, "auto").cluster.cluster == 8
    assert gn._plan_on(2, gn._forward_plan, eight, True, "auto").cluster.cluster == 8
    for device, setting in ((1, "auto"), (3, "auto"), (0, "fused")):
        plan = gn._plan_on(device, gn._forward_plan, eight, True, setting)
        assert plan.cluster is None and plan.first is not None and plan.finalize is None, (device, setting)
    assert gn._plan_on(0, gn._forward_plan, sixteen, True, "auto").cluster is None  # the rule: at most 8
    assert gn._plan_on(0, gn._forward_plan, sixteen, True, "cluster").cluster.cluster == 16
    assert gn._plan_on(2, gn._forward_plan, sixteen, True, "cluster").cluster is None  # 16 CTAs: compute capability 9
    monkeypatch.setattr(_launch, "cooperative_supported", lambda: False)
    assert gn._path("auto", 0) == "auto, split" and gn._path("cluster", 0) == "split"
    assert gn._plan_on(0, gn._forward_plan, sixteen, True, "auto").first.cooperative is False  # the three launches


def test_group_norm_fused_plans_and_split_rules():
    # The fused path ("auto" on a device with cooperative launches): two
    # launches per direction, the column kernel cooperative with a block per
    # item of its larger phase (statistics items or finalize items); the
    # split rules written at _group_norm's constants.
    import numpy

    from cupy_dwgn import _group_norm as gn

    f16, f32 = numpy.dtype(numpy.float16), numpy.dtype(numpy.float32)
    for n, s, c, g in [(2, 4096, 320, 32), (8, 64, 1280, 32), (1, 16384, 128, 32), (3, 97, 99, 33), (600, 4, 16, 4)]:
        forward = gn._forward_plan(n, s, c, g, f16, f32, "silu", 1e-5, True, "fused")
        backward = gn._backward_plan(n, s, c, g, f16, f32, "silu", True, "fused")
        assert forward.finalize is None and backward.finalize is None
        assert len(gn._forward_steps(forward, True, True).launches) == 2
        assert len(gn._backward_steps(backward).launches) == 2
        for launch, finalize_items in ((forward.first, n * g), (backward.first, g * (n + 1))):
            num_chunks, cols = int(launch.scalars[4]), int(launch.scalars[6])
            width = c // int(_template_args(launch.expression)[-2])
            items = num_chunks * n * -(-width // cols)
            assert launch.cooperative and int(launch.scalars[-1]) == 1
            assert launch.grid[0] == min(max(items, finalize_items), gn._launch.MAX_BLOCKS), (n, s, c, launch)
        split = gn._forward_plan(n, s, c, g, f16, f32, "silu", 1e-5, True, "split")
        assert split.finalize is not None and not split.first.cooperative and int(split.first.scalars[-1]) == 0

    # Statistics and the backward reduce read 16-byte vectors at every size
    # (on the vector path); the statistics' partial sums are per group from
    # _GROUPED_BYTES on, per channel below.
    small = gn._forward_plan(2, 4096, 320, 32, f16, f32, "silu", 1e-5, True, "fused")  # 5 MB
    large = gn._forward_plan(8, 16384, 320, 32, f16, f32, "silu", 1e-5, True, "fused")  # 84 MB
    assert _template_args(small.first.expression)[-2] == "8" and _template_args(large.first.expression)[-2] == "8"
    assert int(small.first.scalars[7]) == 0 and small.temporaries[0][0][-1] == 320
    assert int(large.first.scalars[7]) == 1 and large.temporaries[0][0][-1] == 32
    assert _template_args(gn._backward_plan(2, 4096, 320, 32, f16, f32, "silu", True, "fused").first.expression)[-2] == "8"

    # Column blocks: vector columns in blocks of at most _MAX_COLUMNS, as even
    # as they can be; element columns in blocks of at most _COLUMN_BLOCK.
    for width, vectors, want in [(40, True, (1, 40)), (160, True, (3, 54)), (163, True, (3, 55)), (320, False, (2, 160)),
                                 (16, True, (1, 16)), (99, False, (1, 99))]:
        _, _, column_blocks, cols = gn._split(2, 4096, width, vectors)
        assert (column_blocks, cols) == want, (width, vectors)
        assert cols <= (gn._MAX_COLUMNS if vectors else gn._COLUMN_BLOCK) and column_blocks * cols >= width

    # Statistics blocks sum whole groups (per-group partial sums) when a
    # block's columns can hold them and groups have at most
    # _MAX_GROUPED_CHANNELS channels: the columns per block are then a
    # multiple of D / gcd(D, VEC); about _GROUPED_TARGET_BLOCKS items of at
    # least _GROUPED_MIN_ROWS rows.
    assert not gn._stats_split(2, 4096, 40, 8, 10, False)[4]
    assert gn._stats_split(2, 4096, 40, 8, 10, False)[:4] == gn._split(2, 4096, 40, True)
    for width, vec, group_channels, want in [(320, 1, 10, (2, 160)), (640, 1, 20, (3, 220)), (1280, 1, 40, (6, 240)),
                                             (40, 8, 10, (1, 40)), (160, 8, 40, (3, 55)), (99, 1, 33, (1, 99)),
                                             (33, 4, 12, (1, 33))]:
        rows_per_chunk, num_chunks, column_blocks, cols, grouped = gn._stats_split(2, 4096, width, vec, group_channels,
                                                                                   True)
        assert grouped and (column_blocks, cols) == want, (width, vec, group_channels)
        unit = group_channels // math.gcd(group_channels, vec)
        assert cols % unit == 0 and cols <= (gn._MAX_COLUMNS if vec > 1 else gn._COLUMN_BLOCK)
        # At most _GROUPED_TARGET_BLOCKS items (one wave of the cooperative grid), of at least _GROUPED_MIN_ROWS rows.
        per_sample = max(1, gn._GROUPED_TARGET_BLOCKS // (2 * column_blocks))
        assert rows_per_chunk == max(gn._GROUPED_MIN_ROWS, -(-4096 // per_sample))
        assert 2 * num_chunks * column_blocks <= max(gn._GROUPED_TARGET_BLOCKS, 2 * column_blocks)
    assert not gn._stats_split(2, 4096, 40, 8, 80, True)[4]  # 80 channels per group: per-channel partial sums

    # Chunks: at least 64 rows in samples of _LONG_SAMPLE_ROWS rows or more,
    # else 32 (16 for 2-byte dtypes).
    assert gn._split(2, 4096, 40)[0] == 64 and gn._split(2, 1024, 40)[0] == 32
    assert gn._split(2, 4096, 40, True, 2)[0] == 64 and gn._split(2, 1024, 40, True, 2)[0] == 16
    assert gn._split(1, 262144, 16)[0] == 1024  # 256 items for one sample
    # At most _TARGET_BLOCKS items (one wave), however the samples and column blocks divide it.
    for batch, rows, width in [(3, 4093, 40), (5, 100000, 160), (7, 9999, 99), (300, 4096, 40)]:
        rows_per_chunk, num_chunks, column_blocks, _ = gn._split(batch, rows, width)
        assert batch * num_chunks * column_blocks <= max(gn._TARGET_BLOCKS, batch * column_blocks)
    # Work items beyond the kernels' int counters are refused, with the reason.
    with pytest.raises(ValueError, match="work items"):
        gn._column_launch("dwgn_gn_stats<float, float, 1, int>", 2**31 - 2**10, 1, True, ())


def _nhwc_window_emulation(launch, src, weight, bias, grid):
    """What kernels/depthwise_nhwc_window.cu computes for ``launch``: a NumPy
    transcription of its unit ranges and cursors, its copy assignment (the
    division-free (row, column) stepping, 16-byte halves, zero fill outside
    the source), its three-buffer ring (unit k+2 copied into the buffer of
    unit k-1 before unit k is computed), its [tap][CT] weights (rotated for
    backward), its thread -> window mapping and its stores, in float64 over
    a byte-faithful model of the shared tile (element offsets = bytes /
    itemsize; never-written cells are NaN).  ``grid`` blocks; ``src``:
    (N, src_h, src_w, C); ``weight``: (C, K, K).  Returns (dst, writes)."""
    import numpy

    from cupy_dwgn import _depthwise_nhwc_window as win

    (batch, src_h, src_w, dst_h, dst_w, channels, offset_top, offset_left, flip, tile_rows, tile_cols, tiles_h,
     tiles_w, pitch, stage_bytes, units, group) = (int(v) for v in launch.scalars)
    itemsize = src.dtype.itemsize
    k = weight.shape[1]
    kk = k * k
    ct_size = win.PIXEL_BYTES // itemsize  # channels per tile
    lc = 4 // itemsize  # channels per lane
    ro, tw = win.ROWS, win.COLUMNS
    in_h, in_w = tile_rows * ro + k - 1, tile_cols * tw + k - 1
    pixels = in_h * in_w
    threads = launch.block[0]
    assert threads == win.LANES * tile_rows * tile_cols <= 256
    assert launch.shared_mem == group * kk * ct_size * 4 + win.STAGES * stage_bytes
    assert stage_bytes == in_h * pitch and pitch % 16 == 0 and pitch >= in_w * win.PIXEL_BYTES
    assert src.shape == (batch, src_h, src_w, channels) and channels % ct_size == 0
    assert units == (channels // ct_size) * batch * tiles_h * tiles_w
    src64 = src.astype(numpy.float64)
    dst = numpy.full((batch, dst_h, dst_w, channels), numpy.nan)
    writes = numpy.zeros(dst.shape, numpy.int64)

    t = numpy.arange(threads)
    lane, s = t % win.LANES, t // win.LANES
    tr, tc = s // tile_cols, s % tile_cols
    window = (tr * ro) * pitch + (tc * tw) * win.PIXEL_BYTES + lane * 4  # bytes
    half, p0, step = t & 1, t >> 1, threads >> 1
    row0, col0 = p0 // in_w, p0 % in_w
    step_r, step_c = step // in_w, step % in_w
    per_chunk = 16 // itemsize

    channel_tiles = channels // ct_size

    # Cursor [ct, n, th, tw, first]: groups of `group` channel tiles (the last
    # may be smaller), group-major, the group's tiles innermost.
    def decode(u):
        per_image = tiles_h * tiles_w
        spatial = batch * per_image
        first = u // (group * spatial) * group
        size = min(group, channel_tiles - first)
        position, low = divmod(u - first * spatial, size)
        n, rest = divmod(position, per_image)
        return [first + low, n, *divmod(rest, tiles_w), first]

    def advance(c):
        c[0] += 1
        if c[0] < min(c[4] + group, channel_tiles):
            return
        c[0] = c[4]
        c[3] += 1
        if c[3] == tiles_w:
            c[3] = 0
            c[2] += 1
            if c[2] == tiles_h:
                c[2] = 0
                c[1] += 1
                if c[1] == batch:
                    c[1] = 0
                    c[4] += group
                    c[0] = c[4]

    def copy(buf, cursor):
        ct, n, th, tw_, _ = cursor
        ih0, iw0 = th * tile_rows * ro - offset_top, tw_ * tile_cols * tw - offset_left
        r, c, p = row0.copy(), col0.copy(), p0.copy()
        while (p < pixels).any():
            for i in numpy.flatnonzero(p < pixels):
                ih, iw = ih0 + r[i], iw0 + c[i]
                at = (r[i] * pitch + c[i] * win.PIXEL_BYTES + half[i] * 16) // itemsize
                first = ct * ct_size + half[i] * per_chunk
                inside = 0 <= ih < src_h and 0 <= iw < src_w
                buf[at:at + per_chunk] = src64[n, ih, iw, first:first + per_chunk] if inside else 0.0
            p, r, c = p + step, r + step_r, c + step_c
            wrap = c >= in_w
            c, r = numpy.where(wrap, c - in_w, c), numpy.where(wrap, r + 1, r)

    for block in range(grid):
        begin, end = block * units // grid, (block + 1) * units // grid
        count = end - begin
        if count <= 0:
            continue
        ring = [numpy.full(stage_bytes // itemsize, numpy.nan) for _ in range(win.STAGES)]
        copy_cursor = decode(begin)
        cursor = list(copy_cursor)
        for step_k in range(2):
            if step_k < count:
                copy(ring[step_k], copy_cursor)
                advance(copy_cursor)
        compute_buf, loaded_ct, loaded_first, w_s, b = 0, -1, -1, None, None
        for step_k in range(count):
            copy_buf = 2 if compute_buf == 0 else compute_buf - 1
            if step_k + 2 < count:
                copy(ring[copy_buf], copy_cursor)
                advance(copy_cursor)
            ct, n, th, tw_, first = cursor
            if first != loaded_first:  # the group's filters: [tile][tap][CT]
                w_s = numpy.full(group * kk * ct_size, numpy.nan)
                size = min(group, channel_tiles - first)
                group_w = weight[first * ct_size:(first + size) * ct_size].reshape(-1).astype(numpy.float64)
                for i in range(size * kk * ct_size):
                    j, tap = divmod(i, kk)
                    jt, jc = divmod(j, ct_size)
                    w_s[(jt * kk + (kk - 1 - tap if flip else tap)) * ct_size + jc] = group_w[i]
                loaded_first = first
            w_tile = w_s[(ct - first) * kk * ct_size:]
            if ct != loaded_ct:
                channel = ct * ct_size + lane[:, None] * lc + numpy.arange(lc)  # (threads, lc)
                b = numpy.zeros((threads, lc)) if bias is None else bias.astype(numpy.float64)[channel]
                loaded_ct = ct
            buf = ring[compute_buf]
            acc = numpy.repeat(b[:, None, None, :], ro, 1).repeat(tw, 2)  # (threads, RO, TW, lc)
            for r in range(ro + k - 1):
                # (threads, TW+K-1, lc): LDS at window + r*pitch + e*32, lc elements
                at = (window[:, None] + r * pitch + numpy.arange(tw + k - 1)[None, :] * win.PIXEL_BYTES) // itemsize
                row = buf[at[..., None] + numpy.arange(lc)]
                for j in range(ro):
                    kh = r - j
                    if not 0 <= kh < k:
                        continue
                    for kw in range(k):
                        wv = w_tile[(kh * k + kw) * ct_size + lane[:, None] * lc + numpy.arange(lc)]  # (threads, lc)
                        acc[:, j] += wv[:, None, :] * row[:, kw:kw + tw]
            oh0 = th * tile_rows * ro + tr * ro
            ow0 = tw_ * tile_cols * tw + tc * tw
            for i in range(threads):
                for j in range(ro):
                    if oh0[i] + j >= dst_h:
                        break
                    for col in range(tw):
                        if ow0[i] + col < dst_w:
                            first = ct * ct_size + lane[i] * lc
                            dst[n, oh0[i] + j, ow0[i] + col, first:first + lc] = acc[i, j, col]
                            writes[n, oh0[i] + j, ow0[i] + col, first:first + lc] += 1
            advance(cursor)
            compute_buf = 0 if compute_buf == 2 else compute_buf + 1
    return dst, writes


# (NHWC x shape, filter size, padding): odd sizes, every padding form
# (asymmetric, "valid", larger than the filter: negative backward offsets),
# several channel tiles and tile rows/columns, a partial last tile.
_NHWC_WINDOW_GEOMETRIES = [
    ((2, 13, 11, 32), 3, 1), ((1, 9, 10, 16), 5, ((0, 4), (3, 1))), ((2, 7, 7, 16), 7, 3),
    ((1, 8, 8, 16), 3, "valid"), ((1, 5, 9, 16), 7, 8), ((1, 1, 12, 16), 3, (1, 0)),
    ((1, 61, 23, 16), 3, 1), ((1, 12, 75, 16), 5, 2), ((2, 6, 5, 8), 3, 1),
    ((1, 150, 20, 16), 3, 1), ((2, 70, 40, 16), 5, ((2, 1), (0, 3))), ((1, 66, 30, 48), 7, 3),
]


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward_input"])
@pytest.mark.parametrize("case", _NHWC_WINDOW_GEOMETRIES, ids=lambda c: f"{'x'.join(map(str, c[0]))}-{c[1]}x{c[1]}")
def test_nhwc_window_kernel_index_math_covers_every_output_once(case, backward):
    from cupy_dwgn import _depthwise_nhwc_window as win

    # Channel tiles one at a time, the rule's groups, groups of 3 (an odd
    # count leaves a smaller last group).
    _check_nhwc_window_index_math(case, backward, sorted({1, win.GROUP, 3}), seed=5)


@settings(max_examples=20, deadline=None)
@given(x_shape=st.tuples(st.integers(1, 2), st.one_of(st.integers(1, 30), st.just(70)),
                         st.integers(1, 40), st.integers(1, 6).map(lambda v: 8 * v)),
       k=st.sampled_from([3, 5, 7]), padding=st.tuples(*[st.tuples(st.integers(0, 9), st.integers(0, 9))] * 2),
       backward=st.booleans(), group=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_nhwc_window_random_geometries(x_shape, k, padding, backward, group, seed):
    # The NHWC window kernel's emulation on drawn geometries (any padding per
    # side, tall planes, 1-6 channel vectors of 8), one drawn channel group.
    assume(x_shape[1] + sum(padding[0]) >= k and x_shape[2] + sum(padding[1]) >= k)
    _check_nhwc_window_index_math((x_shape, k, padding), backward, [group], seed)


def _check_nhwc_window_index_math(case, backward, groups, seed):
    import numpy

    from cupy_dwgn import _depthwise_nhwc_window as win
    from cupy_dwgn import _validate

    x_shape, k, padding = case
    n, h, w, c = x_shape
    g = _validate.conv_geometry(x_shape, (c, 1, k, k), 1, padding, 1, layout="NHWC")
    y_shape = (n, g.out_height, g.out_width, c)
    rng = numpy.random.default_rng(seed)
    for dtype in win.DTYPES:
        if c % win.channel_tile(dtype):
            assert win.plan(g, dtype, backward, "int", 16, 16) is None
            continue
        src_shape = y_shape if backward else x_shape
        src = rng.standard_normal(src_shape).astype(dtype)
        weight = rng.standard_normal((c, 1, k, k)).astype(dtype)
        bias = None if backward else rng.standard_normal(c).astype(dtype)
        # Misaligned pointers go to the existing kernels.
        assert win.plan(g, dtype, backward, "int", 8, 16) is None
        assert win.plan(g, dtype, backward, "int", 16, 2) is None
        for group in groups:
            launch = win.plan(g, dtype, backward, "int", 16, 4, group)
            _check_nhwc_window_launch(launch, g, x_shape, padding, backward, src, weight, bias)


def _check_nhwc_window_launch(launch, g, x_shape, padding, backward, src, weight, bias):
    import numpy

    from cupy_dwgn import _depthwise_nhwc_window as win
    from cupy_dwgn import reference

    assert launch is not None and launch.persistent
    assert launch.shared_mem <= win.RING_BYTES + int(launch.scalars[16]) * 49 * 16 * 4
    tile_rows, tile_cols, pitch = (int(launch.scalars[i]) for i in (9, 10, 13))
    assert win.bank_ways(tile_rows, tile_cols, pitch) <= 2
    units = int(launch.scalars[15])
    # The plan's grid, a persistent grid smaller than the units (blocks
    # walk several, across channel tiles), and more blocks than units.
    for grid in sorted({min(launch.grid[0], 64), min(units, 3), units + 2}):
        got, writes = _nhwc_window_emulation(launch, src, weight[:, 0], bias, grid)
        assert (writes == 1).all(), (grid, numpy.argwhere(writes != 1)[:5])
        src64, w64 = src.astype(numpy.float64), weight.astype(numpy.float64)
        if backward:
            want = reference.depthwise_conv2d_backward_input(src64, w64, x_shape, padding=padding, layout="NHWC")
        else:
            want = reference.depthwise_conv2d(src64, w64, None if bias is None else bias.astype(numpy.float64),
                                              padding=padding, layout="NHWC")
        numpy.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_nhwc_window_rule():
    # The report's shapes: conflict-free window reads, two blocks' shared
    # memory per SM, 16-byte aligned buffers; channel counts off the tile,
    # other strides/dilations/multipliers and 9x9 are left to the other kernels.
    import numpy

    from cupy_dwgn import _depthwise_nhwc_window as win
    from cupy_dwgn import _validate

    shipped = SHIPPED
    for n, c, hw, k in [(64, 144, 56, 3), (64, 384, 28, 3), (64, 240, 28, 5), (64, 96, 56, 7), (64, 960, 7, 3),
                        (8, 32, 112, 3), (2, 64, 32, 5), (64, 768, 14, 7)]:
        g = _validate.conv_geometry((n, hw, hw, c), (c, 1, k, k), 1, k // 2, 1, layout="NHWC")
        for dtype in win.DTYPES:
            for backward in (False, True):
                for index in ("int", "long long"):
                    launch = win.plan(g, dtype, backward, index, 16, 16)
                    assert (launch.file, launch.expression) in shipped
                    tile_rows, tile_cols, pitch, stage_bytes = (int(launch.scalars[i]) for i in (9, 10, 13, 14))
                    assert win.bank_ways(tile_rows, tile_cols, pitch) == 1, (n, c, hw, k)
                    assert 2 * (launch.shared_mem + 1024) <= 164 * 1024 and stage_bytes % 16 == 0
                    assert launch.block[0] % 32 == 0 or tile_rows * tile_cols * 8 == launch.block[0]
    g = _validate.conv_geometry((2, 16, 16, 24), (24, 1, 3, 3), 1, 1, 1, layout="NHWC")
    assert win.plan(g, numpy.dtype(numpy.float16), False, "int", 16, 16) is None  # C % 16
    assert win.plan(g, numpy.dtype(numpy.float32), False, "int", 16, 16) is not None
    assert win.plan(g, numpy.dtype(numpy.float64), False, "int", 16, 16) is None
    for w_shape, stride, dilation in [((24, 1, 3, 3), 2, 1), ((24, 1, 3, 3), 1, 2), ((48, 1, 3, 3), 1, 1),
                                      ((24, 1, 9, 9), 1, 1), ((24, 1, 3, 5), 1, 1)]:
        g = _validate.conv_geometry((2, 16, 16, 24), w_shape, stride, 1, dilation, layout="NHWC")
        assert win.plan(g, numpy.dtype(numpy.float32), False, "int", 16, 16) is None
    # The measured rule (preferred's docstring): half types always (group 4
    # for 3x3 on planes of 56x56 and more), float32 7x7 and 5x5 on 14x14 to
    # 28x28 planes; the ops follow it unless MODE says otherwise.
    assert win.MODE == "rule"
    half, single = numpy.dtype(numpy.float16), numpy.dtype(numpy.float32)
    for hw, k, backward, want_half, want_single in [
        (28, 3, False, 1, None), (56, 3, False, 4, None), (112, 3, True, 4, None), (56, 5, False, 1, None),
        (28, 5, True, 1, 2), (14, 5, False, 1, 2), (7, 5, False, 1, None), (7, 7, False, 1, 1), (112, 7, True, 1, 1),
    ]:
        g = _validate.conv_geometry((2, hw, hw, 32), (32, 1, k, k), 1, k // 2, 1, layout="NHWC")
        assert win.preferred(g, half, backward) == want_half, (hw, k)
        assert win.preferred(g, win.DTYPES[2], backward) == want_half, (hw, k)
        assert win.preferred(g, single, backward) == want_single, (hw, k)
        assert (win.select(g, single, backward, "int", 16, 16) is None) == (want_single is None)


def test_nchw_window_grid_is_sized_by_the_occupancy_calculator(monkeypatch):
    """The NCHW window kernel's persistent grid comes from Launch.persistent
    (cudaOccupancyMaxActiveBlocksPerMultiprocessor, which counts registers
    per SM partition), not from a count of its own: such a count put the
    224-thread, 95-register 3x3 backward-input at 3 blocks per SM where the
    hardware holds 2, and a third of the grid waited for a second wave.  The
    plan asks for every unit; the launch takes the resident blocks."""
    import numpy

    from cupy_dwgn import _depthwise_nchw_window as window
    from cupy_dwgn import _launch, _validate

    monkeypatch.setattr(_launch.Launch, "kernel", lambda self, device: 0)  # no compile, no GPU
    monkeypatch.setattr(_launch, "cooperative_capacity", lambda device, kernel, block, shared_mem: 264)
    g = _validate.conv_geometry((64, 144, 56, 56), (144, 1, 3, 3), 1, 1, 1)
    for backward in (False, True):
        launch = window.plan(g, numpy.dtype(numpy.float16), backward, "int", 16, True)
        assert launch.persistent and launch.block == (224, 1, 1)
        assert launch.grid == (64 * 144, 1, 1)  # one unit per plane
        assert launch.grid_on(0) == (264, 1, 1)


# The NCHW register-window kernel's fixed copies (dwgn_window::FixedCopies),
# emulated with the kernel's formulas for every unit and backward source of
# the plan, against its general row staging (staged_source_row /
# stage_rows_async): the same shared cells from the same source elements,
# none of the padding rows (zeroed once) or the planes past the last; each
# cell written by one copy; a thread's copies within the count the host
# passes.  (x NCHW shape, multiplier, filter size, padding.)
_WINDOW_FIXED_GEOMETRIES = [
    ((1, 6, 56, 56), 1, 3, 1), ((1, 5, 32, 32), 1, 3, 1), ((2, 3, 40, 40), 2, 3, 1), ((2, 5, 20, 20), 3, 3, 1),
    ((1, 4, 56, 56), 1, 5, 2), ((1, 3, 48, 48), 1, 3, ((2, 3), (1, 1))), ((1, 3, 48, 48), 1, 3, ((0, 1), (1, 1))),
    ((1, 4, 36, 36), 1, 3, 1), ((1, 2, 60, 60), 1, 3, 1), ((1, 5, 17, 32), 1, 3, 1), ((1, 9, 28, 28), 1, 5, 2),
    ((2, 2, 24, 32), 2, 7, 3),
]


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward_input"])
@pytest.mark.parametrize("case", _WINDOW_FIXED_GEOMETRIES,
                         ids=lambda c: f"{'x'.join(map(str, c[0]))}-M{c[1]}-{c[2]}x{c[2]}-p{c[3]}")
def test_nchw_window_fixed_copies_match_the_general_staging(case, backward):
    import numpy

    from cupy_dwgn import _depthwise_nchw_window as window
    from cupy_dwgn import _dtypes, _validate

    x_shape, multiplier, k, padding = case
    g = _validate.conv_geometry(x_shape, (x_shape[1] * multiplier, 1, k, k), 1, padding, 1)
    taken = 0
    for dtype in (numpy.dtype(numpy.float16), _dtypes.bfloat16, numpy.dtype(numpy.float32),
                  numpy.dtype(numpy.float64)):
        launch = window.plan(g, dtype, backward, "int", 16, True)
        (_, m, planes, src_h, src_w, _, _, offset_top, _, per_unit, _, bands, plane_rows, staged_width, left_halo,
         stage_bytes, _, flat_elems, copies) = (int(v) for v in launch.scalars)
        if not backward and m > 1:
            assert copies == 0  # the forward's source planes repeat M times: not an arithmetic sequence
        if copies == 0:
            continue
        taken += 1
        assert bands == 1 and flat_elems == 0 and stage_bytes >= 4 and (backward or m == 1)
        assert copies <= window.MAX_FIXED_COPIES
        threads, elems = launch.block[0], stage_bytes // dtype.itemsize
        row_vectors, num_rows = src_w // elems, per_unit * plane_rows
        total, stride = num_rows * row_vectors, m if backward else 1
        assert src_w % elems == 0 and total <= copies * threads  # every vector has a copy slot

        def staged_row(i):  # (shared cell, plane in unit, image row) of copy index i
            row, v = divmod(i, row_vectors)
            pb = row // plane_rows
            return row * staged_width + left_halo + v * elems, pb, row - pb * plane_rows - offset_top, v

        fixed = []  # (shared cell, source offset from the unit's base): FixedCopies' constructor
        for t in range(threads):
            for j in range(window.MAX_FIXED_COPIES):
                i = t + j * threads
                if j < copies and i < total:
                    cell, pb, src_row, v = staged_row(i)
                    if 0 <= src_row < src_h:
                        fixed.append((cell, (pb * stride * src_h + src_row) * src_w + v * elems))
        assert len({cell for cell, _ in fixed}) == len(fixed)
        plane_elems = src_h * src_w
        for unit in range(-(-planes // per_unit)):
            first_plane = unit * per_unit
            for source in range(stride if backward else 1):
                base = (first_plane * stride + source) * plane_elems
                limit = min(per_unit, planes - first_plane) * stride * plane_elems
                got = {cell: base + offset for cell, offset in fixed if offset < limit}
                want = {}
                for i in range(total):
                    cell, pb, src_row, v = staged_row(i)
                    plane = first_plane + pb
                    if 0 <= src_row < src_h and plane < planes:  # else staged as zeros
                        src_plane = plane * m + source if backward else plane
                        want[cell] = (src_plane * src_h + src_row) * src_w + v * elems
                assert got == want, (dtype, unit, source)
    assert taken or (not backward and multiplier > 1)  # every other geometry here takes them for some dtype


# The NCHW register-window kernel's row staging for units of one plane (or
# one band of it: stage_rows_async's first loop), which steps each thread's
# (row, vector, shared cell) by blockDim.x copies instead of dividing per
# copy: emulated for every thread of the plan, against the division-based
# mapping of copy i (row i // row_vectors, vector i % row_vectors; source
# element i * E from the band's first row).  Stride-2 forwards, bands of
# large planes, small blocks.  (x NCHW shape, filter size, stride, padding.)
_WINDOW_PLANE_STAGING_GEOMETRIES = [
    ((2, 3, 112, 112), 3, 2, 1), ((1, 2, 150, 150), 3, 1, 1), ((1, 2, 112, 112), 5, 1, 2),
    ((1, 3, 97, 97), 3, 2, "valid"), ((1, 2, 130, 64), 7, 1, 3), ((1, 2, 57, 40), 5, 2, 2),
]


@pytest.mark.parametrize("case", _WINDOW_PLANE_STAGING_GEOMETRIES,
                         ids=lambda c: f"{'x'.join(map(str, c[0]))}-{c[1]}x{c[1]}-s{c[2]}-p{c[3]}")
def test_nchw_window_single_plane_staging_steps_match_the_division(case):
    import numpy

    from cupy_dwgn import _depthwise_nchw_window as window
    from cupy_dwgn import _dtypes, _validate

    x_shape, k, stride, padding = case
    g = _validate.conv_geometry(x_shape, (x_shape[1], 1, k, k), stride, padding, 1)
    taken = 0
    for dtype in (numpy.dtype(numpy.float16), _dtypes.bfloat16, numpy.dtype(numpy.float32),
                  numpy.dtype(numpy.float64)):
        launch = window.plan(g, dtype, False, "int", 16, True)
        if launch is None:
            continue
        (_, _, _, _, src_w, _, _, _, _, per_unit, _, _, plane_rows, staged_width, left_halo, stage_bytes, _,
         flat_elems, copies) = (int(v) for v in launch.scalars)
        if per_unit != 1 or flat_elems or copies or stage_bytes < 4:
            continue  # another staging path
        taken += 1
        elems = stage_bytes // dtype.itemsize
        row_vectors, threads = src_w // elems, launch.block[0]
        total = plane_rows * row_vectors
        step_rows, step_v = divmod(threads, row_vectors)
        to_step, to_wrap = step_rows * staged_width + step_v * elems, staged_width - row_vectors * elems
        seen = numpy.zeros(total, numpy.int64)
        for t in range(min(threads, total)):
            row, v = divmod(t, row_vectors)
            to = row * staged_width + left_halo + v * elems
            for i in range(t, total, threads):
                assert (row, v) == divmod(i, row_vectors), (dtype, t, i)
                assert to == row * staged_width + left_halo + v * elems
                assert i * elems == row * src_w + v * elems  # the source element from the band's first row
                seen[i] += 1
                row, v, to = row + step_rows, v + step_v, to + to_step
                if v >= row_vectors:
                    row, v, to = row + 1, v - row_vectors, to + to_wrap
        assert (seen == 1).all()
    assert taken


# The NHWC register-tap weight gradient (_depthwise_nhwc_wgrad): its NumPy
# emulation (tests/_nhwc_wgrad_emulation.py: the kernel's unit ranges, worker
# stride, ring slots, zero fill, tap-group masks and reduction order) against
# the float64 reference; /work/notes/nhwc_wgrad/emulate.py sweeps wider.
_NHWC_WGRAD_GEOMETRIES = [
    # (NHWC x shape, K, stride, padding, channel tiles per block or None)
    ((2, 13, 11, 32), 3, 1, 1, None), ((1, 9, 10, 16), 5, 1, ((0, 4), (3, 1)), None),
    ((3, 7, 7, 16), 7, 1, 3, None), ((1, 5, 9, 16), 7, 1, ((6, 2), (0, 5)), None),
    ((2, 28, 3, 16), 7, 1, ((2, 3), (3, 2)), None), ((1, 1, 12, 16), 3, 1, (1, 0), None),
    ((2, 13, 11, 48), 3, 2, 1, None), ((1, 17, 16, 16), 5, 2, ((4, 0), (1, 2)), None),
    ((1, 15, 15, 16), 7, 2, 3, None), ((2, 2, 5, 16), 3, 2, 2, None),
    ((1, 6, 13, 48), 3, 1, 1, 4), ((1, 9, 7, 48), 5, 2, 2, 2), ((2, 30, 20, 8), 3, 1, 1, None),
]


@pytest.mark.parametrize("case", _NHWC_WGRAD_GEOMETRIES,
                         ids=lambda c: f"{'x'.join(map(str, c[0]))}-{c[1]}x{c[1]}-s{c[2]}-ctb{c[4]}")
def test_nhwc_wgrad_kernel_index_math_matches_the_reference(case):
    from cupy_dwgn import _depthwise_nhwc_wgrad as wg

    data = _nhwc_wgrad_data(case[:4], seed=7)
    # The rule's split, and one split per unit (idle workers).
    for dtype, one_unit in itertools.product(wg.DTYPES[:2], (False, True)):
        _check_nhwc_wgrad_launch(data, dtype, "int", case[4], one_unit)


@st.composite
def _nhwc_wgrad_geometries(draw):
    """(NHWC x shape, filter size, stride, padding per side): channels in
    float32 tiles of 8 (half types serve multiples of 16)."""
    k = draw(st.sampled_from([3, 5, 7]))
    stride = draw(st.sampled_from([1, 2]))
    padding = tuple((draw(st.integers(0, k + 1)), draw(st.integers(0, k + 1))) for _ in range(2))
    # Rows past 28 are tall (their own strips and split).
    height = draw(st.integers(max(1, k - sum(padding[0])), 40))
    width = draw(st.integers(max(1, k - sum(padding[1])), 30))
    return (draw(st.integers(1, 2)), height, width, 8 * draw(st.integers(1, 8))), k, stride, padding


@settings(max_examples=100, deadline=None)
@given(case=_nhwc_wgrad_geometries(), dtype_index=st.integers(0, 2), index=st.sampled_from(["int", "long long"]),
       ctb=st.sampled_from([None, 1, 2, 4]), one_unit=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_nhwc_wgrad_random_geometries(case, dtype_index, index, ctb, one_unit, seed):
    # The NHWC register-tap weight gradient's emulation on drawn geometries
    # (any padding per side, short and tall planes, 1-8 channel tiles), one
    # drawn dtype (bfloat16 too), index type (the 64-bit configurations
    # differ), channel tiles per block and split each: every (block, unit)
    # walked once, every partial sum written once and equal to the float64
    # reference.
    from cupy_dwgn import _depthwise_nhwc_wgrad as wg

    _check_nhwc_wgrad_launch(_nhwc_wgrad_data(case, seed), wg.DTYPES[dtype_index], index, ctb, one_unit)


def _nhwc_wgrad_data(case, seed):
    """(geometry, grad_out, x, float64 reference weight gradient) of an NHWC case."""
    import numpy

    from cupy_dwgn import _validate, reference

    x_shape, k, stride, padding = case
    n, h, w, c = x_shape
    g = _validate.conv_geometry(x_shape, (c, 1, k, k), stride, padding, 1, layout="NHWC")
    rng = numpy.random.default_rng(seed)
    x = rng.standard_normal(x_shape)
    grad_out = rng.standard_normal((n, g.out_height, g.out_width, c))
    want = reference.depthwise_conv2d_backward_weight(grad_out, x, (c, 1, k, k), stride=stride, padding=padding,
                                                      layout="NHWC")
    return g, grad_out, x, want


def _check_nhwc_wgrad_launch(data, dtype, index, ctb, one_unit):
    """The plan for ``dtype`` (``ctb`` channel tiles per block, or the
    rule's; ``one_unit``: one split per unit instead of the rule's split)
    emulated against the reference, or its refusal where C is not a whole
    number of channel tiles or x is misaligned for its vectors."""
    import numpy

    import _nhwc_wgrad_emulation as emulation
    from cupy_dwgn import _depthwise_nhwc_wgrad as wg

    g, grad_out, x, want = data
    k, c = g.filter_height, g.channels
    if c % wg.channel_tile(dtype):
        assert wg.plan(g, dtype, index, 16, 16) is None
        return
    lc = wg.config(k, g.stride_h, dtype, index)[0]
    assert wg.plan(g, dtype, index, 16, lc * dtype.itemsize // 2) is None  # misaligned x
    lanes = wg.channel_tile(dtype) // lc
    if ctb is not None and lanes * ctb > 32:
        return
    with pytest.MonkeyPatch.context() as patch:
        if one_unit:
            patch.setattr(wg, "MIN_UNITS_PER_WORKER", {2: 1 / 256, 4: 1 / 256})
            patch.setattr(wg, "TARGET_BLOCKS", 10**6)
            patch.setattr(wg, "TALL_TARGET_BLOCKS", 10**6)
        (launch, finalize), (shape, acc) = wg.plan.__wrapped__(g, dtype, index, 16, 16, ctb)
    assert (launch.file, launch.expression) in SHIPPED
    assert shape == (launch.grid[1], k * k, c) and acc == numpy.float32
    assert int(finalize.scalars[2]) == launch.grid[1]
    partial, writes, visits = emulation.emulate(launch, grad_out, x)
    assert (writes == 1).all() and (visits == 1).all()
    numpy.testing.assert_allclose(emulation.finalize(partial), want, rtol=1e-12, atol=1e-12)


def test_nhwc_wgrad_rule():
    # The benchmark shapes: shipped expressions, <= 48 KB of shared memory,
    # a grid within limits, every split non-empty; the ops take it for every
    # dtype it serves (float64 and other geometries go to the tiled kernel).
    import numpy

    from cupy_dwgn import _depthwise_nhwc_wgrad as wg
    from cupy_dwgn import _validate

    shipped = SHIPPED
    assert wg.MODE == "rule"
    for n, c, hw, k, stride in [(64, 144, 56, 3, 1), (64, 384, 28, 3, 1), (64, 240, 28, 5, 1), (64, 96, 56, 7, 1),
                                (64, 384, 14, 7, 1), (64, 96, 112, 3, 2), (64, 960, 7, 3, 1), (1, 16, 1, 3, 2)]:
        g = _validate.conv_geometry((n, hw, hw, c), (c, 1, k, k), stride, k // 2, 1, layout="NHWC")
        for dtype in wg.DTYPES:
            for index in ("int", "long long"):
                (launch, finalize), (shape, _) = wg.plan(g, dtype, index, 16, 16)
                # The measured rule: wherever it serves (preferred's docstring).
                assert wg.preferred(g, dtype)
                assert wg.select(g, dtype, index, 16, 16)[0][0] is launch
                assert (launch.file, launch.expression) in shipped and (finalize.file, finalize.expression) in shipped
                assert launch.shared_mem <= 48 * 1024 and launch.block == (wg.THREADS, 1, 1)
                assert launch.grid[1] <= 65535 and launch.grid[0] * launch.grid[1] <= 4 * wg.TARGET_BLOCKS
                units, per_split = int(launch.scalars[11]), int(launch.scalars[12])
                assert (launch.grid[1] - 1) * per_split < units <= launch.grid[1] * per_split
    half, single = numpy.dtype(numpy.float16), numpy.dtype(numpy.float32)
    g = _validate.conv_geometry((2, 16, 16, 24), (24, 1, 3, 3), 1, 1, 1, layout="NHWC")
    assert wg.plan(g, half, "int", 16, 16) is None  # C % 16
    assert wg.plan(g, single, "int", 16, 16) is not None
    assert wg.plan(g, single, "int", 16, 2) is None  # x not 4-byte aligned
    assert wg.plan(g, numpy.dtype(numpy.float64), "int", 16, 16) is None
    for w_shape, stride, dilation in [((24, 1, 3, 3), 3, 1), ((24, 1, 3, 3), (1, 2), 1), ((24, 1, 3, 3), 1, 2),
                                      ((48, 1, 3, 3), 1, 1), ((24, 1, 9, 9), 1, 1), ((24, 1, 3, 5), 1, 1)]:
        g = _validate.conv_geometry((2, 16, 16, 24), w_shape, stride, 1, dilation, layout="NHWC")
        assert wg.plan(g, single, "int", 16, 16) is None, (w_shape, stride, dilation)
    # C = 144 half: 9 tiles, one per block (no idle tile); C = 384: 4 per block.
    for c, ctb in ((144, 1), (384, 4), (96, 2)):
        g = _validate.conv_geometry((2, 8, 8, c), (c, 1, 3, 3), 1, 1, 1, layout="NHWC")
        assert int(wg.plan(g, half, "int", 16, 16)[0][0].scalars[13]) == ctb
def _nhwc_phase_emulation(launch, grad_out, weight, k):
    """What kernels/depthwise_nhwc_phase.cu computes for ``launch``: a NumPy
    transcription of its grid/block walk, weight staging ([tap][channel of
    the tile], NaN where never staged), the exit of threads past the
    channels, block_range item ranges, the item decode, the m / i / kw / t
    loops with zero-filled column reads outside [0, OW), and the guarded
    stores, in float64 (the weights are staged in T, converted exactly).
    grad_out (N, OH, OW, C), weight (C, K, K).  Returns (grad_in, writes):
    grad_in NaN where never written, writes the store count per element.
    """
    import numpy

    (height, width, channels, out_h, out_w, pad_top, pad_left, row_pairs, col_blocks, items,
     per_block) = (int(v) for v in launch.scalars)
    expr = launch.expression
    args = expr[expr.index("<") + 1:-1].split(", ")
    assert int(args[1]) == k
    tw = int(args[2])
    ctype = args[0]
    vec = {"float": 4, "double": 2, "__half": 8, "__nv_bfloat16": 8}[ctype]
    kk = k * k
    r_rows = (k + 1) // 2
    in_c = tw + r_rows - 1
    bx, by, _ = launch.block
    gx, gy, _ = launch.grid
    batch = grad_out.shape[0]
    assert grad_out.shape == (batch, out_h, out_w, channels)
    assert launch.shared_mem == kk * bx * vec * {"float": 4, "double": 8}.get(ctype, 2)  # weights in T
    tile_channels = bx * vec
    flat_w = weight.reshape(-1)
    g_flat = grad_out.reshape(-1)
    dst = numpy.full(batch * height * width * channels, numpy.nan)
    writes = numpy.zeros(dst.shape, numpy.int64)
    a_first, b_first = pad_top >> 1, pad_left >> 1
    per_image = row_pairs * col_blocks
    v_idx = numpy.arange(vec)
    for block_x in range(gx):
        # Weight staging, every thread of the block: [tap][j].
        w_s = numpy.full(kk * tile_channels, numpy.nan)
        tile_c0 = block_x * tile_channels
        for i in range(kk * tile_channels):
            j, tap = divmod(i, kk)
            c = tile_c0 + j
            w_s[tap * tile_channels + j] = flat_w[c * kk + tap] if c < channels else 0.0
        for block_y in range(gy):
            begin = block_y * per_block
            end = begin + per_block if items - begin > per_block else items
            for tx in range(bx):
                c0 = tile_c0 + tx * vec
                if c0 >= channels:
                    continue
                w_thread = tx * vec
                for ty in range(by):
                    item = begin + ty
                    while item < end:
                        n = item // per_image
                        rest = item - n * per_image
                        pair = rest // col_blocks
                        a = a_first + pair
                        b0 = b_first + (rest - pair * col_blocks) * tw
                        g_img = n * out_h * out_w * channels + c0
                        acc = numpy.zeros((2, 2 * tw, vec))
                        for m in range(r_rows):
                            oh = a - m
                            if oh < 0 or oh >= out_h:
                                continue
                            g_row = g_img + oh * out_w * channels
                            x = numpy.zeros((in_c, vec))
                            for e in range(in_c):
                                iw = b0 - (r_rows - 1) + e
                                if 0 <= iw < out_w:
                                    x[e] = g_flat[g_row + iw * channels + v_idx]
                            for i in range(2):
                                kh = i + 2 * m
                                if kh >= k:
                                    continue
                                for kw in range(k):
                                    j = kw & 1
                                    nn = kw >> 1
                                    w = w_s[w_thread + (kh * k + kw) * tile_channels + v_idx]
                                    for t in range(tw):
                                        acc[i, 2 * t + j] += w * x[t - nn + r_rows - 1]
                        d_img = n * height * width * channels + c0
                        iw0 = 2 * b0 - pad_left
                        for i in range(2):
                            ih = 2 * a + i - pad_top
                            if ih < 0 or ih >= height:
                                continue
                            d_row = d_img + ih * width * channels
                            for col in range(2 * tw):
                                iw = iw0 + col
                                if 0 <= iw < width:
                                    at = d_row + iw * channels + v_idx
                                    dst[at] = acc[i, col]
                                    writes[at] += 1
                        item += by
    return dst.reshape(batch, height, width, channels), writes.reshape(batch, height, width, channels)


def _nhwc_phase_geometries():
    """(x_shape, k, padding, dtype) geometries: every pad 0..K-1 (also
    per-side), odd and even H/W, tiny planes (1, 2, 3), 7, a 112 row, one
    vector of channels, C = 96, C not a multiple of the block's channels."""
    import numpy

    from cupy_dwgn import _depthwise_nhwc_phase as phase
    from cupy_dwgn import _dtypes

    f32, f16, bf16, f64 = (numpy.dtype(numpy.float32), numpy.dtype(numpy.float16), _dtypes.bfloat16,
                           numpy.dtype(numpy.float64))
    out = []
    for k in (3, 5, 7):
        for pad in range(k):
            for hw in [(1, 1), (2, 3), (3, 2), (7, 7), (8, 9), (12, 11)]:
                h, w = hw
                if min(h, w) + 2 * pad - k < 0:
                    continue  # no output: not a valid geometry
                for dtype in (f32, f16):
                    out.append(((1, h, w, phase.vec(dtype)), k, pad, dtype))
        # per-side and asymmetric paddings; "valid"
        out.append(((2, 9, 10, 8), k, ((0, k - 1), (k - 1, 0)), f32))
        out.append(((1, 13, 7, 4), k, ((1, 2), (k - 1, 1)), f32))
        out.append(((1, 11, 12, 2), k, "valid", f64))
        out.append(((3, 7, 5, 16), k, k // 2, bf16))
        # C = 96 (24 float32 vectors, 12 half vectors), batches
        out.append(((2, 14, 13, 96), k, k // 2, f32))
        out.append(((3, 9, 14, 96), k, k // 2, f16))
        # C not a multiple of a 32-vector tile: 33 vectors -> 2 tiles of 17 (one slot empty)
        out.append(((1, 6, 7, 132), k, k // 2, f32))
        out.append(((1, 5, 6, 8 * 37), k, 1, f16))
        # wide rows (the MobileNet width), one vector
        out.append(((1, 3, 112, 4), k, k // 2, f32))
        out.append(((1, 112, 3, 8), k, k // 2, f16))
    # The last input rows read by no output (2*OH < H + 2*pad - K + 1)
    out.append(((1, 10, 10, 4), 3, 0, f32))
    out.append(((2, 8, 8, 8), 5, 0, f16))
    out.append(((1, 16, 9, 2), 7, 1, f64))
    return out


@pytest.mark.parametrize("k", [3, 5, 7])
def test_nhwc_phase_kernel_index_math_writes_every_input_pixel_once(k):
    # The NumPy transcription of the stride-2 NHWC backward-input kernel on
    # every padding 0..K-1 (and per-side, "valid"), odd/even/tiny planes,
    # one channel vector, C = 96, channel tiles with an empty last slot, both
    # index types: every grad_in element written exactly once and equal to
    # the float64 reference (/work/notes-style emulation, no GPU needed).
    import numpy

    rng = numpy.random.default_rng(k)
    cases = [case for case in _nhwc_phase_geometries() if case[1] == k]
    assert len(cases) > 20
    for number, case in enumerate(cases):
        _check_nhwc_phase_index_math(case, "long long" if number % 5 == 0 else "int", rng)


@settings(max_examples=100, deadline=None)
@given(x_shape=st.tuples(st.integers(1, 2), st.integers(1, 24), st.integers(1, 24), st.integers(1, 12).map(lambda v: 8 * v)),
       k=st.sampled_from([3, 5, 7]), padding=st.tuples(*[st.tuples(st.integers(0, 9), st.integers(0, 9))] * 2),
       dtype_index=st.integers(0, 3), index=st.sampled_from(["int", "long long"]), seed=st.integers(0, 2**32 - 1))
def test_nhwc_phase_random_geometries(x_shape, k, padding, dtype_index, index, seed):
    # The stride-2 NHWC backward-input's emulation on drawn geometries
    # (padding per side up to 9, past the filter too, odd and even planes,
    # 8-96 channels), one drawn dtype (float64 too) and index type.
    import numpy

    from cupy_dwgn import _depthwise_nhwc_phase as phase

    assume(x_shape[1] + sum(padding[0]) >= k and x_shape[2] + sum(padding[1]) >= k)
    case = (x_shape, k, padding, phase.DTYPES[dtype_index])
    _check_nhwc_phase_index_math(case, index, numpy.random.default_rng(seed))


def _check_nhwc_phase_index_math(case, index, rng):
    import numpy

    from cupy_dwgn import _depthwise_nhwc_phase as phase
    from cupy_dwgn import _validate, reference

    x_shape, k, padding, dtype = case
    n, h, w, c = x_shape
    g = _validate.conv_geometry(x_shape, (c, 1, k, k), 2, padding, 1, layout="NHWC")
    launch = phase.plan(g, dtype, index, True)
    assert (launch.file, launch.expression) in SHIPPED
    assert phase.plan(g, dtype, index, False) is None
    grad_out = rng.standard_normal((n, g.out_height, g.out_width, c))
    weight = rng.standard_normal((c, 1, k, k))
    got, writes = _nhwc_phase_emulation(launch, grad_out, weight[:, 0], k)
    assert (writes == 1).all(), (x_shape, padding, numpy.argwhere(writes != 1)[:5])
    want = reference.depthwise_conv2d_backward_input(grad_out, weight, x_shape, stride=2, padding=padding,
                                                      layout="NHWC")
    numpy.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_nhwc_phase_rule():
    # The launch rule on the benchmark shapes: <= 256 threads, whole warps of
    # channel vectors where C allows, <= 48 KB of weights, ~2048 blocks with
    # item ranges a multiple of BY; the fallbacks (stride 1, dilation,
    # multiplier, unequal strides, other sizes, C % VEC, misaligned) get None.
    import numpy

    from cupy_dwgn import _depthwise_nhwc_phase as phase
    from cupy_dwgn import _validate

    shipped = SHIPPED
    assert phase.MODE == "rule"
    for n, c, hw, k in [(64, 96, 112, 3), (64, 240, 56, 5), (64, 96, 56, 7), (64, 144, 56, 3), (8, 1024, 14, 7),
                        (1, 8, 3, 3)]:
        g = _validate.conv_geometry((n, hw, hw, c), (c, 1, k, k), 2, k // 2, 1, layout="NHWC")
        for dtype in phase.DTYPES:
            assert phase.preferred(g, dtype)
            for index in ("int", "long long"):
                launch = phase.plan(g, dtype, index, True)
                assert (launch.file, launch.expression) in shipped
                bx, by, _ = launch.block
                threads = bx * by
                assert threads <= 256 and (threads >= 224 or by * bx * phase.vec(dtype) >= c)
                assert launch.shared_mem == k * k * bx * 16  # [tap][channel] weights in the dtype
                assert launch.shared_mem <= 48 * 1024
                items, per_block = int(launch.scalars[-2]), int(launch.scalars[-1])
                assert per_block % by == 0 and launch.grid[1] == -(-items // per_block) <= 2048
                tiles, tile_channels = launch.grid[0], bx * phase.vec(dtype)
                assert (tiles - 1) * tile_channels < c <= tiles * tile_channels  # no empty tile
                # The fewest tiles of <= 32 vectors whose weights fit in 48 KB.
                most = min(32, 48 * 1024 // (k * k * 16))
                assert tiles == -(-(c // phase.vec(dtype)) // most)
    # MobileNetV2 64x96x112 float32: one tile of 24 vectors, 10 items per step.
    g = _validate.conv_geometry((64, 112, 112, 96), (96, 1, 3, 3), 2, 1, 1, layout="NHWC")
    launch = phase.plan(g, numpy.dtype(numpy.float32), "int", True)
    assert launch.block[:2] == (24, 10) and launch.expression.endswith("<float, 3, 4, int>")
    f32 = numpy.dtype(numpy.float32)
    for x_shape, w_shape, stride, dilation in [
        ((2, 16, 16, 24), (24, 1, 3, 3), 1, 1), ((2, 16, 16, 24), (24, 1, 3, 3), 2, 2),
        ((2, 16, 16, 24), (48, 1, 3, 3), 2, 1), ((2, 16, 16, 24), (24, 1, 3, 3), (2, 1), 1),
        ((2, 16, 16, 24), (24, 1, 9, 9), 2, 1), ((2, 16, 16, 24), (24, 1, 3, 5), 2, 1),
        ((2, 16, 16, 6), (6, 1, 3, 3), 2, 1), ((2, 16, 16, 24), (24, 1, 3, 3), 3, 1),
    ]:
        g = _validate.conv_geometry(x_shape, w_shape, stride, 1, dilation, layout="NHWC")
        assert phase.plan(g, f32, "int", True) is None and not phase.preferred(g, f32), (w_shape, stride)
    g = _validate.conv_geometry((2, 16, 16, 20), (20, 1, 3, 3), 2, 1, 1, layout="NHWC")
    assert phase.plan(g, numpy.dtype(numpy.float16), "int", True) is None  # 20 % 8
    assert phase.plan(g, f32, "int", True) is not None
    assert phase.plan(g, f32, "int", False) is None


# The NCHW register weight gradient (_depthwise_nchw_wgrad_regs): its NumPy
# emulation (tests/_nchw_wgrad_regs_emulation.py: unit ranges, worker
# stride, lane groups and segments, own-vector and halo masks, the row
# cursors, the blocks of the walk and their clean and tested paths, the
# loads each issues, the shuffle sources, the grad_out ring slots, the FMA
# conditions, reduction order) against the float64 reference, at the rule's
# VW and narrower ones (alignment 2 bytes forces VW = 1 for half types).
_NCHW_WGRAD_REGS_GEOMETRIES = [
    # (NCHW x shape, K, stride, padding)
    ((2, 3, 13, 11), 3, 1, 1), ((1, 2, 16, 16), 3, 1, 1), ((1, 1, 9, 10), 5, 1, ((0, 4), (3, 1))),
    ((3, 2, 7, 7), 7, 1, 3), ((1, 1, 5, 9), 7, 1, ((6, 2), (0, 5))), ((1, 2, 5, 8), 7, 1, ((1, 1), (7, 7))),
    ((2, 1, 1, 12), 3, 1, (1, 0)), ((1, 2, 1, 16), 3, 1, ((1, 1), (5, 3))), ((2, 3, 13, 11), 3, 2, 1),
    ((1, 1, 17, 16), 5, 2, ((4, 0), (1, 2))), ((1, 2, 15, 15), 7, 2, 3), ((2, 1, 2, 5), 3, 2, 2),
    ((1, 2, 12, 16), 3, 2, ((1, 1), (0, 1))), ((1, 1, 40, 8), 3, 1, 1), ((1, 1, 6, 272), 3, 1, 1),
    ((1, 1, 3, 264), 5, 1, 2), ((1, 2, 8, 16), 7, 2, ((3, 3), (3, 7))), ((1, 1, 4, 8), 5, 1, ((2, 2), (6, 2))),
    ((1, 2, 30, 16), 5, 1, 2), ((1, 1, 24, 8), 7, 1, 3), ((1, 1, 40, 16), 3, 2, 1), ((1, 1, 33, 8), 5, 2, 2),
    ((1, 1, 30, 8), 7, 2, 3), ((1, 1, 17, 8), 5, 1, ((2, 5), (2, 2))), ((1, 2, 40, 12), 3, 1, 1),
]
# Cases whose walks must include clean blocks (the kernel's untested path),
# and what else they must reach there: a clean block's (last) prefetch with
# the next x row outside the image, or the next grad_out row past the strip.
_NCHW_WGRAD_REGS_CLEAN_WALKS = {
    ((1, 2, 16, 16), 3, 1, 1): (), ((1, 1, 40, 8), 3, 1, 1): ("clean_g_past",), ((1, 2, 30, 16), 5, 1, 2): (),
    ((1, 1, 24, 8), 7, 1, 3): (), ((1, 1, 40, 16), 3, 2, 1): (), ((1, 1, 33, 8), 5, 2, 2): ("clean_g_past",),
    ((1, 1, 30, 8), 7, 2, 3): ("clean_g_past",), ((1, 1, 17, 8), 5, 1, ((2, 5), (2, 2))): ("clean_row_outside",),
    ((1, 2, 40, 12), 3, 1, 1): (),
}


@pytest.mark.parametrize("case", _NCHW_WGRAD_REGS_GEOMETRIES,
                         ids=lambda c: f"{'x'.join(map(str, c[0]))}-{c[1]}x{c[1]}-s{c[2]}-p{c[3]}")
def test_nchw_wgrad_regs_kernel_index_math_matches_the_reference(case):
    from cupy_dwgn import _depthwise_nchw_wgrad_regs as wg

    check = _NchwWgradRegsCheck(case, seed=7)
    # The long strips of large grids (_launch.LONG_STRIP_MIN_THREADS) forced too where they differ.
    long_strips = (False, True) if check.g.out_height > 14 else (False,)
    # The rule's split, and one split per unit (idle workers); the kernel's
    # clean blocks where the group is clean, none, and every other one (the
    # warp's vote decides on the GPU).
    for dtype, alignment, forced, one_unit, clean_blocks in itertools.product(
            wg.DTYPES[:2], (16, 4, 2), long_strips, (False, True), ("group", "never", "alternate")):
        check.run(dtype, alignment, forced, one_unit, clean_blocks)
    assert 1 in check.widths
    if case in _NCHW_WGRAD_REGS_CLEAN_WALKS:
        walks = check.walks
        assert walks["clean"] and all(walks[key] for key in _NCHW_WGRAD_REGS_CLEAN_WALKS[case]), walks


@st.composite
def _nchw_wgrad_regs_geometries(draw):
    """(x NCHW shape, filter size, stride, padding per side) the register weight gradient serves."""
    # Widths past 32 lanes of 1 column make segments.
    return _draw_nchw_geometry(draw, 40, (), st.integers(60, 140), 3)


@settings(max_examples=100, deadline=None)
@given(case=_nchw_wgrad_regs_geometries(), dtype_index=st.integers(0, 2), alignment=st.sampled_from([16, 8, 4, 2]),
       long_strips=st.booleans(), one_unit=st.booleans(), clean_blocks=st.sampled_from(["group", "never", "alternate"]),
       seed=st.integers(0, 2**32 - 1))
def test_nchw_wgrad_regs_random_geometries(case, dtype_index, alignment, long_strips, one_unit, clean_blocks, seed):
    # The register weight gradient's emulation on drawn geometries (any
    # padding per side, widths with and without segments, both strides), one
    # drawn dtype, alignment (so VW), strip rule, split and clean-block mode
    # each: every (channel, unit) walked once, every partial sum written once
    # and equal to the float64 reference.
    from cupy_dwgn import _depthwise_nchw_wgrad_regs as wg

    _NchwWgradRegsCheck(case, seed).run(wg.DTYPES[dtype_index], alignment, long_strips, one_unit, clean_blocks)


class _NchwWgradRegsCheck:
    """One geometry of the register weight gradient's emulation against the
    float64 reference; ``run`` checks one launch form."""

    def __init__(self, case, seed):
        import numpy

        from cupy_dwgn import _validate, reference

        x_shape, k, stride, padding = case
        n, c = x_shape[:2]
        self.k, self.channels = k, c
        self.g = _validate.conv_geometry(x_shape, (c, 1, k, k), stride, padding, 1)
        rng = numpy.random.default_rng(seed)
        self.x = rng.standard_normal(x_shape)
        self.grad_out = rng.standard_normal((n, c, self.g.out_height, self.g.out_width))
        self.want = reference.depthwise_conv2d_backward_weight(
            self.grad_out, self.x, (c, 1, k, k), stride=stride, padding=padding)
        self.widths, self.walks = set(), collections.Counter()

    def run(self, dtype, alignment, long_strips, one_unit, clean_blocks):
        """``long_strips``: the long strips forced (no LONG_STRIP_MIN_THREADS
        floor); ``one_unit``: one split per unit (idle workers) instead of
        the rule's split; ``clean_blocks``: the emulation's mode."""
        import numpy

        import _nchw_wgrad_regs_emulation as emulation
        from cupy_dwgn import _depthwise_nchw_wgrad_regs as wg
        from cupy_dwgn import _launch

        k, c = self.k, self.channels
        with pytest.MonkeyPatch.context() as patch:
            if long_strips:
                patch.setattr(_launch, "LONG_STRIP_MIN_THREADS", 0)
            if one_unit:
                patch.setattr(wg, "MIN_UNITS_PER_WORKER", dict.fromkeys(wg.MIN_UNITS_PER_WORKER, 1 / 1024))
                patch.setattr(wg, "TARGET_BLOCKS", 10**6)
            (launch, finalize), (shape, acc) = wg.plan.__wrapped__(self.g, dtype, alignment, alignment)
        assert (launch.file, launch.expression) in SHIPPED
        assert shape == (launch.grid[1], k * k, c) and acc == numpy.float32
        assert int(finalize.scalars[2]) == launch.grid[1]
        self.widths.add(int(launch.expression.split(", ")[3][:-1]))
        partial, writes, visits = emulation.emulate(launch, self.grad_out, self.x, clean_blocks)
        assert (writes == 1).all() and (visits == 1).all()
        numpy.testing.assert_allclose(emulation.finalize(partial), self.want, rtol=1e-12, atol=1e-12)
        self.walks.update(emulation.emulate.blocks_seen)


def test_nchw_wgrad_via_nhwc_rule():
    # The NCHW weight gradient goes through NHWC copies exactly for half-type
    # 5x5 stride 1 where the NCHW register kernel would take VW = 1 (and the
    # NHWC kernel serves: C a multiple of its channel tile), with shipped
    # kernels: two transposes (NCHW rows C, columns H*W), the NHWC register-
    # tap kernel and its finalize; the workspace holds the NHWC copies.
    import numpy

    from cupy_dwgn import _depthwise_nchw_via_nhwc as via
    from cupy_dwgn import _depthwise_nhwc_large, _dtypes, _validate

    shipped = SHIPPED
    assert via.MODE == "rule"
    half, single = numpy.dtype(numpy.float16), numpy.dtype(numpy.float32)
    for (n, c, hw, k, stride), half_routed in [
        ((64, 576, 19, 5, 1), True), ((64, 816, 19, 5, 1), True), ((2, 48, 21, 5, 1), True),
        ((64, 576, 19, 3, 1), False), ((64, 816, 19, 5, 2), False), ((64, 240, 28, 5, 1), False),
        ((64, 384, 15, 7, 1), False), ((2, 40, 19, 5, 1), False),  # C = 40: not a multiple of 16
    ]:
        g = _validate.conv_geometry((n, c, hw, hw), (c, 1, k, k), stride, k // 2, 1)
        for dtype in (half, _dtypes.bfloat16, single, numpy.dtype(numpy.float64)):
            routed = via.backward_weight_steps(g, dtype, "int", 16, 16)
            assert (routed is not None) == (half_routed and dtype.itemsize == 2), (hw, k, stride, c, dtype)
            if routed is None:
                continue
            launches, temporaries = routed
            assert [(l.file, l.expression) in shipped for l, _ in launches] == [True] * 4
            assert [l.file for l, _ in launches[:2]] == [_depthwise_nhwc_large.KERNEL_FILE] * 2
            assert [positions for _, positions in launches] == [(0, 4), (1, 5), (4, 5, 6), (6, 3)]
            assert [int(v) for v in launches[0][0].scalars[:2]] == [c, g.out_height * g.out_width]
            assert temporaries[:2] == (((n, g.out_height, g.out_width, c), dtype), ((n, hw, hw, c), dtype))
    g = _validate.conv_geometry((2, 48, 21, 21), (48, 1, 5, 5), 1, 2, 1)
    assert via.backward_weight_steps(g, half, "int", 16, 2) is not None  # x 2-byte aligned: VW 1
    g = _validate.conv_geometry((2, 48, 24, 24), (48, 1, 5, 5), 1, 2, 1)
    assert via.backward_weight_steps(g, half, "int", 16, 16) is None  # VW 4
    assert via.backward_weight_steps(g, half, "int", 16, 2) is not None  # a 2-byte aligned x: VW 1
    assert via.backward_weight_steps(g, half, "long long", 16, 2) is None  # >= 2**31 elements: NCHW kernels
    via.MODE = "always"
    try:
        assert via.backward_weight_steps(g, single, "int", 16, 16) is not None
        assert via.backward_weight_steps(g, single, "long long", 16, 16) is None
    finally:
        via.MODE = "rule"


def test_nchw_wgrad_regs_rule():
    # The benchmark shapes: shipped expressions, a grid within limits, every
    # split non-empty, the widest VW the row allows; the shapes it does not
    # serve (float64, dilation, multiplier 2, unequal strides, other sizes).
    import numpy

    from cupy_dwgn import _depthwise_nchw_wgrad_regs as wg
    from cupy_dwgn import _validate

    shipped = SHIPPED
    assert wg.MODE == "rule"
    half, single = numpy.dtype(numpy.float16), numpy.dtype(numpy.float32)
    want_vw = {(56, 3, 1, 2): 8, (56, 3, 1, 4): 4, (28, 3, 1, 2): 4, (112, 3, 2, 2): 8, (28, 5, 1, 2): 4,
               (56, 7, 1, 2): 4, (14, 7, 1, 2): 2, (7, 3, 1, 2): 1, (56, 7, 1, 4): 2}
    for n, c, hw, k, stride in [(64, 144, 56, 3, 1), (64, 384, 28, 3, 1), (64, 96, 112, 3, 2), (64, 240, 28, 5, 1),
                                (64, 96, 56, 7, 1), (64, 384, 14, 7, 1), (64, 960, 7, 3, 1), (1, 16, 1, 3, 2),
                                (2, 3, 300, 3, 1)]:
        g = _validate.conv_geometry((n, c, hw, hw), (c, 1, k, k), stride, k // 2, 1)
        for dtype in wg.DTYPES:
            (launch, finalize), (shape, _) = wg.plan(g, dtype, 16, 16)
            # The measured rule (preferred's docstring): all but float32 5x5
            # and 7x7 with >= 28 output columns.
            staged = dtype == single and k >= 5 and g.out_width >= 28
            assert wg.preferred(g, dtype) == (not staged), (hw, k, dtype)
            selected = wg.select(g, dtype, 16, 16)
            assert (selected is None) if staged else (selected[0][0] is launch)
            assert (launch.file, launch.expression) in shipped and (finalize.file, finalize.expression) in shipped
            assert launch.shared_mem == 0 and launch.block == (wg.THREADS, 1, 1)
            assert launch.grid[0] == c and launch.grid[1] <= 65535
            assert launch.grid[0] * launch.grid[1] <= max(4 * wg.TARGET_BLOCKS, c)
            units, per_split = int(launch.scalars[11]), int(launch.scalars[12])
            assert (launch.grid[1] - 1) * per_split < units <= launch.grid[1] * per_split
            group_lanes = int(launch.scalars[10])
            assert 1 <= group_lanes <= 32
            key = (hw, k, stride, dtype.itemsize)
            if key in want_vw:
                assert launch.expression.endswith(f", {want_vw[key]}>"), (key, launch.expression)
    g = _validate.conv_geometry((2, 24, 16, 16), (24, 1, 3, 3), 1, 1, 1)
    assert wg.plan(g, half, 16, 16).__getitem__(0)[0].expression.endswith(", 8>")
    assert wg.plan(g, half, 16, 4)[0][0].expression.endswith(", 2>")  # x 4-byte aligned
    assert wg.plan(g, numpy.dtype(numpy.float64), 16, 16) is None
    g = _validate.conv_geometry((2, 24, 16, 16), (24, 1, 3, 3), 1, ((1, 1), (0, 2)), 1)
    assert wg.plan(g, half, 16, 16)[0][0].expression.endswith(", 1>")  # pad_left - 1 odd
    for w_shape, stride, dilation in [((24, 1, 3, 3), 3, 1), ((24, 1, 3, 3), (1, 2), 1), ((24, 1, 3, 3), 1, 2),
                                      ((48, 1, 3, 3), 1, 1), ((24, 1, 9, 9), 1, 1), ((24, 1, 3, 5), 1, 1)]:
        g = _validate.conv_geometry((2, 24, 16, 16), w_shape, stride, 1, dilation)
        assert wg.plan(g, single, 16, 16) is None, (w_shape, stride, dilation)


def test_serialized_load_scan_counts_loads_used_before_the_next_load():
    # scripts/kernel_sass.py loads: a load whose register is read before the
    # next global load issues counts as serialized; one whose use comes
    # after the next load does not (an nvdisasm-shaped snippet).
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "kernel_sass.py"
    spec = importlib.util.spec_from_file_location("kernel_sass", path)
    kernel_sass = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernel_sass)
    sass = """
        /*0100*/               @P3 LDG.E.CONSTANT R72, desc[UR6][R72.64] ;
        /*0110*/               @P3 HADD2.F32 R43, -RZ, R72.H0_H0 ;
        /*0120*/                   LDG.E.CONSTANT R74, desc[UR6][R70.64] ;
        /*0130*/                   LDG.E.CONSTANT R76, desc[UR6][R78.64] ;
        /*0140*/                   FFMA.FTZ R20, R74, R76, R20 ;
        /*0150*/                   IMAD.WIDE R74, R1, 0x2, R66 ;
    """
    assert kernel_sass.serialized_loads(sass) == (3, 2)
    assert kernel_sass.serialized_loads("") == (0, 0)


def _staged_rows_walk(count, rb, batches, tensors, wait_slack, slots=None):
    """The ring protocol of gn::walk_lane_rows_staged (group_norm.cu), one
    thread: issue(k0) puts rows k0 .. k0 + rb - 1 (those < count) of each
    tensor into slot (row & (slots - 1)) * tensors + t as one copy group;
    cp.async.wait_group<batches - 1> (``wait_slack``) leaves that many of the
    newest groups in flight.  A copy lands at the latest when a wait forces
    it; until then its slot holds the old row.  Returns (rows handed to the
    batch/tail callbacks in order, reads of a slot whose copy had not
    landed, copies issued into a slot whose row was not read yet)."""
    slots = slots or rb * batches
    ring, pending = {}, []  # slot -> row landed; groups in flight: [(slot, row)]
    taken, stale, clobbered = [], 0, 0
    unread = set()

    def issue(k0):
        nonlocal clobbered
        group = []
        for q in range(rb):
            if k0 + q < count:
                for t in range(tensors):
                    slot = ((k0 + q) & (slots - 1)) * tensors + t
                    clobbered += slot in unread
                    unread.add(slot)
                    group.append((slot, k0 + q))
        pending.append(group)

    def wait(slack):
        while len(pending) > slack:
            for slot, row in pending.pop(0):
                ring[slot] = row

    def take(k, t):
        nonlocal stale
        slot = (k & (slots - 1)) * tensors + t
        stale += ring.get(slot) != k
        unread.discard(slot)
        return k

    for b in range(batches):
        issue(b * rb)
    k = 0
    while k + rb <= count:
        wait(wait_slack)
        rows = [take(k + q, t) for q in range(rb) for t in range(tensors)]
        issue(k + slots)
        taken += rows[::tensors]
        k += rb
    if k < count:
        wait(wait_slack)
        taken += [take(k + q, t) for q in range(rb) if k + q < count for t in range(tensors)][::tensors]
    wait(0)
    return taken, stale, clobbered


@pytest.mark.parametrize("count", [0, 1, 3, 4, 5, 7, 8, 9, 16, 17, 64, 131])
@pytest.mark.parametrize("rb, tensors", [(4, 1), (2, 2)])  # statistics (fp16/bf16), backward reduce
def test_group_norm_staged_walk_reads_every_row_once_in_order(count, rb, tensors):
    batches = 2  # group_norm.cu: kStagedBatches
    taken, stale, clobbered = _staged_rows_walk(count, rb, batches, tensors, batches - 1)
    assert taken == list(range(count))
    assert stale == 0 and clobbered == 0
    # The emulation sees a broken protocol: waiting one group too few, or a
    # ring one batch short, reads rows whose copies have not landed.
    if count > rb:
        assert _staged_rows_walk(count, rb, batches, tensors, batches)[1] > 0
        assert _staged_rows_walk(count, rb, batches, tensors, batches - 1, slots=rb)[2] > 0


# The tensor-core weight gradient (_depthwise_wgrad_mma): its NumPy emulation
# (tests/_wgrad_mma_emulation.py: raw copies piece by piece, units dealt to
# the warps, the lanes' A/B fragments by the PTX layout of mma.m16n8k16, the
# load predicates, border rows, the warp-order reduction) against the
# float64 reference, both layouts; an inf in x where some taps never read it
# must reach exactly the taps that do, and an inf in grad_out the taps that
# multiply it (padding included: 0 * inf is NaN in the reference).
_WGRAD_MMA_GEOMETRIES = [
    # (NCHW x shape, K, padding, inf at (n, c, h, w) or None, target blocks or None, stages or None)
    ((3, 8, 14, 14), 7, 3, None, None, None), ((2, 16, 10, 12), 5, 2, None, None, None),
    ((2, 8, 6, 6), 3, 0, None, None, None), ((3, 8, 5, 8), 7, 3, None, None, None),
    ((5, 16, 9, 18), 3, ((0, 2), (1, 1)), None, 100, None), ((1, 8, 5, 8), 7, ((6, 2), (0, 9)), None, None, None),
    ((2, 16, 1, 12), 3, (1, 0), None, None, None), ((2, 8, 8, 40), 5, 2, None, None, None),
    ((3, 20, 10, 12), 3, 1, None, None, None), ((2, 6, 6, 37), 3, 1, None, None, None),
    ((2, 8, 12, 12), 7, 3, ("x", 0, 2, 11, 11), None, None), ((2, 8, 12, 12), 7, 3, ("x", 1, 3, 0, 5), None, None),
    ((2, 8, 12, 12), 3, 0, ("x", 1, 3, 11, 0), None, None),
    # grad_out values that meet padding rows (top, bottom, both, and a middle one that does not)
    ((2, 8, 12, 12), 7, 3, ("dy", 0, 0, 0, 0), None, None), ((2, 8, 12, 12), 7, 3, ("dy", 1, 5, 11, 7), None, None),
    ((2, 8, 4, 12), 7, 3, ("dy", 1, 2, 2, 3), None, None), ((2, 8, 12, 12), 5, ((1, 3), (2, 2)), ("dy", 0, 7, 11, 4), None, None),
    ((2, 8, 12, 12), 7, 3, ("dy", 0, 1, 6, 6), None, None),
    # One split of 12 images: every buffer of a 2-, 3-, 5- and 8-deep ring refilled.
    ((12, 8, 6, 8), 5, 2, None, 1, 2), ((12, 8, 6, 8), 5, 2, None, 1, 3), ((12, 8, 6, 8), 5, 2, None, 1, 5),
    ((12, 8, 6, 8), 5, 2, None, 1, 8),
]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("case", _WGRAD_MMA_GEOMETRIES,
                         ids=lambda c: f"{'x'.join(map(str, c[0]))}-{c[1]}x{c[1]}-{c[3]}-stages{c[5]}")
def test_wgrad_mma_index_math_matches_the_reference(case, layout):
    _check_wgrad_mma_index_math(case, layout, 16, seed=11)


@st.composite
def _wgrad_mma_cases(draw):
    """The parametrized cases' form, drawn: (NCHW x shape, K, padding per
    side (rows up to K - 1 a side, as the kernel serves), an inf in x or
    grad_out or None, target blocks or None, raw buffers or None)."""
    k = draw(st.sampled_from([3, 5, 7]))
    pad_rows = (draw(st.integers(0, k - 1)), draw(st.integers(0, k - 1)))
    pad_cols = (draw(st.integers(0, k + 2)), draw(st.integers(0, k + 2)))
    height = draw(st.integers(max(1, k - sum(pad_rows)), 16))
    width = draw(st.integers(max(1, k - sum(pad_cols)), 40))
    n, c = draw(st.integers(1, 12)), draw(st.integers(1, 24))
    out_shape = (height + sum(pad_rows) - k + 1, width + sum(pad_cols) - k + 1)
    spot = draw(st.sampled_from([None, "x", "dy"]))
    if spot is not None:
        rows, cols = (height, width) if spot == "x" else out_shape
        spot = (spot, draw(st.integers(0, n - 1)), draw(st.integers(0, c - 1)), draw(st.integers(0, rows - 1)),
                draw(st.integers(0, cols - 1)))
    target_blocks = draw(st.sampled_from([None, 1, 2, 100]))
    stages = draw(st.one_of(st.none(), st.integers(2, 8)))
    return (n, c, height, width), k, (pad_rows, pad_cols), spot, target_blocks, stages


@settings(max_examples=2000, deadline=None)
@given(case=_wgrad_mma_cases(), layout=st.sampled_from(["NCHW", "NHWC"]), alignment=st.sampled_from([16, 8, 4, 2]),
       seed=st.integers(0, 2**32 - 1))
def test_wgrad_mma_random_geometries(case, layout, alignment, seed):
    # The tensor-core weight gradient's emulation on drawn geometries (any
    # column padding, row padding up to K - 1 a side, odd and even widths
    # and planes, 1-24 channels, 1-12 images), an inf anywhere in x or
    # grad_out or none, drawn target blocks, raw buffers and alignment (so
    # the raw copies' pieces): where the kernel serves, every partial sum
    # written and the non-finite taps exactly the reference's.
    _check_wgrad_mma_index_math(case, layout, alignment, seed)


def _check_wgrad_mma_index_math(case, layout, alignment, seed):
    import numpy

    import _wgrad_mma_emulation as emulation
    from cupy_dwgn import _depthwise_wgrad_mma as mma
    from cupy_dwgn import _validate, reference

    x_shape, k, padding, spot, target_blocks, stages = case
    c = x_shape[1]
    rng = numpy.random.default_rng(seed)
    x = rng.standard_normal(x_shape).astype(numpy.float16)
    g = _validate.conv_geometry(x_shape, (c, 1, k, k), 1, padding, 1)
    dy = rng.standard_normal((x_shape[0], c, g.out_height, g.out_width)).astype(numpy.float16)
    if spot is not None:
        (x if spot[0] == "x" else dy)[spot[1:]] = numpy.inf
    if layout == "NHWC":
        x, dy = (numpy.ascontiguousarray(a.transpose(0, 2, 3, 1)) for a in (x, dy))
        g = _validate.conv_geometry(x.shape, (c, 1, k, k), 1, padding, 1, layout="NHWC")
    want = reference.depthwise_conv2d_backward_weight(dy, x, (c, 1, k, k), padding=padding, layout=layout)
    planned = mma.plan.__wrapped__(g, numpy.dtype(numpy.float16), layout, "int", alignment, alignment,
                                   target_blocks, stages)
    # What the kernel serves (besides the filter, stride and row padding
    # the cases keep to): NHWC 8-channel vectors at 16-byte alignment; NCHW
    # even output rows and raw pieces of at least 4 bytes (even planes), and
    # raw buffers within MAX_SHARED.
    if layout == "NHWC":
        served = c % 8 == 0 and alignment == 16
    else:
        served = g.out_width % 2 == 0 and (g.height * g.width) % 2 == 0 and alignment >= 4
    served = served and mma.stages_and_shared(g, stages)[1] <= mma.MAX_SHARED
    assert (planned is not None) == served
    if planned is None:
        return
    (launch, finalize), (shape, acc) = planned
    assert shape == (launch.grid[1], k * k, c) and acc == numpy.float32 and int(finalize.scalars[2]) == launch.grid[1]
    assert (launch.file, launch.expression) in SHIPPED
    if stages is not None:
        assert int(launch.scalars[-1]) == stages
        if target_blocks == 1 and g.batch > stages:
            assert launch.grid[1] * stages < g.batch  # every buffer of the ring refilled
    partial = emulation.emulate(launch, dy, x)
    if spot is None:  # (with an inf, NaN sums are answers)
        assert not numpy.isnan(partial).any(), "a partial sum was not written"
    got = partial.sum(axis=0).T.reshape(c, 1, k, k)
    assert (numpy.isfinite(got) == numpy.isfinite(want)).all()
    finite = numpy.isfinite(want)
    numpy.testing.assert_allclose(got[finite], want[finite], rtol=1e-12, atol=1e-12)


def test_wgrad_mma_plan():
    # What the tensor-core weight gradient serves (half types, 3x3/5x5/7x7
    # at stride 1, dilation 1, multiplier 1; NCHW: even out_w and 4-byte
    # pieces; NHWC: C a multiple of 8, 16-byte aligned; buffers within
    # MAX_SHARED) and its grid, stages and shared memory.
    import numpy

    from cupy_dwgn import _depthwise_wgrad_mma as mma
    from cupy_dwgn import _dtypes, _validate

    shipped = SHIPPED
    half, bf16, single = numpy.dtype(numpy.float16), numpy.dtype(_dtypes.bfloat16), numpy.dtype(numpy.float32)
    for layout, c, hw, k, stride, dilation, m, dtype, alignment, served in [
        ("NCHW", 384, 14, 7, 1, 1, 1, half, 16, True), ("NHWC", 384, 14, 7, 1, 1, 1, bf16, 16, True),
        ("NCHW", 240, 28, 5, 1, 1, 1, half, 16, True), ("NCHW", 384, 28, 3, 1, 1, 1, half, 4, True),
        ("NCHW", 384, 28, 3, 1, 1, 1, half, 2, False), ("NHWC", 384, 28, 3, 1, 1, 1, half, 8, False),
        ("NCHW", 20, 14, 7, 1, 1, 1, half, 16, True), ("NHWC", 20, 14, 7, 1, 1, 1, half, 16, False),
        ("NCHW", 64, 13, 3, 1, 1, 1, half, 16, False), ("NHWC", 64, 13, 3, 1, 1, 1, half, 16, True),
        ("NCHW", 64, 14, 7, 2, 1, 1, half, 16, False), ("NCHW", 64, 14, 3, 1, 2, 1, half, 16, False),
        ("NCHW", 64, 14, 3, 1, 1, 2, half, 16, False), ("NCHW", 64, 14, 3, 1, 1, 1, single, 16, False),
        ("NCHW", 64, 14, 9, 1, 1, 1, half, 16, False), ("NHWC", 64, 56, 3, 1, 1, 1, half, 16, False),
    ]:
        x_shape = (64, c, hw, hw) if layout == "NCHW" else (64, hw, hw, c)
        g = _validate.conv_geometry(x_shape, (c * m, 1, k, k), stride, k // 2, dilation, layout=layout)
        planned = mma.plan(g, dtype, layout, "int", alignment, alignment)
        assert (planned is not None) == served, (layout, c, hw, k, stride, dilation, m, dtype, alignment)
        if planned is None:
            continue
        (launch, _), _ = planned
        assert (launch.file, launch.expression) in shipped
        stages, shared = mma.stages_and_shared(g)
        raw = 8 * (g.height * g.width + g.out_height * g.out_width) * 2
        assert 2 <= stages <= mma.MAX_STAGES and shared == max(stages * raw, mma.REDUCTION_BYTES) <= mma.MAX_SHARED
        assert launch.shared_mem == shared and int(launch.scalars[-1]) == stages
        assert launch.grid[0] == -(-c // 8) and launch.block == (256, 1, 1)
        splits, per_split = launch.grid[1], int(launch.scalars[8])
        assert splits * per_split >= g.batch > (splits - 1) * per_split and per_split >= mma.MIN_IMAGES_PER_SPLIT
    # Padding rows up to K - 1 a side (the edge rows' tiles see every
    # grad_out row that meets padding rows); columns any.
    for padding, served in [(((6, 6), (3, 3)), True), (((7, 0), (3, 3)), False), (((0, 7), (3, 3)), False),
                            (((3, 3), (9, 9)), True)]:
        g7 = _validate.conv_geometry((4, 16, 14, 14), (16, 1, 7, 7), 1, padding, 1)
        assert (mma.plan(g7, half, "NCHW", "int", 16, 16) is not None) == served, padding
    for stages in (0, 1, mma.MAX_STAGES + 1):  # a buffer would be read before its copies land
        with pytest.raises(ValueError, match="stages"):
            mma.plan(g, half, "NCHW", "int", 16, 16, None, stages)


# The tensor-core forward / backward-input (_depthwise_conv_mma), NCHW and
# NHWC: its NumPy emulation (tests/_conv_mma_emulation.py: units of planes,
# bands and channel groups, zero-padded images, items dealt to the warps,
# ldmatrix chunks, the lanes' banded B fragments by the PTX layouts of
# mma.m16n8k16 / m16n8k8, the D layout into the stage, the strip recomputed
# tap by tap where a result is not finite) against the float64 reference:
# every output staged once, every read inside the image, an inf or NaN
# reaching exactly the outputs whose windows hold it.
_CONV_MMA_GEOMETRIES = [
    # (NCHW x shape, K, padding, backward, inf at (n, c, h, w) of the source or None)
    ((2, 8, 28, 28), 5, 2, False, None), ((2, 8, 28, 28), 5, 2, True, None), ((1, 8, 56, 56), 7, 3, False, None),
    ((1, 8, 56, 56), 7, 3, True, None), ((3, 16, 14, 14), 3, 1, False, None), ((3, 9, 14, 14), 3, 1, True, None),
    ((2, 4, 13, 11), 3, 1, False, None), ((2, 8, 19, 19), 5, 2, True, None), ((1, 8, 1, 31), 3, 1, False, None),
    ((1, 8, 5, 5), 7, 3, False, None), ((1, 8, 5, 5), 7, 3, True, None), ((1, 8, 29, 31), 5, ((0, 4), (3, 1)), False, None),
    ((1, 8, 29, 31), 5, ((0, 4), (3, 1)), True, None), ((1, 8, 40, 24), 7, "valid", False, None),
    ((1, 8, 40, 24), 7, "valid", True, None), ((1, 8, 17, 9), 7, 8, False, None), ((1, 8, 70, 66), 3, 1, False, None),
    ((2, 8, 28, 36), 5, ((2, 0), (4, 1)), True, None), ((1, 8, 33, 45), 7, ((1, 5), (6, 0)), False, None),
    # bands of rows: 150-wide 5x5 (NCHW and NHWC), 112-wide 7x7 backward, padding rows at a band's edge
    ((1, 8, 150, 150), 5, 2, False, None), ((1, 8, 112, 112), 7, 3, True, None),
    ((1, 8, 100, 130), 3, ((5, 0), (1, 1)), False, None), ((1, 8, 100, 130), 3, ((0, 2), (1, 1)), True, None),
    # bands wholly in the padding above the image (they copy nothing), padding past the right edge,
    # a partial last unit of planes (601 planes, 3 a unit)
    ((1, 8, 30, 20), 3, ((100, 0), (1, 1)), False, None), ((1, 8, 30, 20), 3, ((40, 0), (1, 1)), False, None),
    ((1, 8, 30, 20), 5, ((2, 2), (0, 9)), True, None), ((601, 1, 9, 9), 3, 1, False, None),
    ((2, 8, 14, 18), 5, 2, False, (1, 3, 0, 0)), ((2, 8, 14, 18), 7, 0, False, (0, 4, 5, 2)),
    ((2, 8, 14, 18), 3, 1, True, (0, 1, 5, 9)), ((2, 8, 14, 18), 7, 3, True, (1, 0, 6, 13)),
    ((1, 8, 70, 140), 5, 2, False, (0, 6, 47, 139)),
    # stride 2 (forward): EfficientNet's 38 -> 19 and 75 -> 38, odd and even sources, per-side padding,
    # padding past the filter's half, bands (150 -> 75), an inf
    ((2, 8, 38, 38), 3, 1, False, None, 2), ((2, 8, 75, 75), 5, 2, False, None, 2), ((1, 8, 19, 19), 5, 2, False, None, 2),
    ((1, 8, 28, 28), 7, 3, False, None, 2), ((2, 8, 13, 16), 3, ((0, 1), (1, 0)), False, None, 2),
    ((1, 8, 9, 9), 5, 4, False, None, 2), ((1, 8, 150, 150), 3, 1, False, None, 2), ((1, 8, 112, 112), 7, 3, False, None, 2),
    ((2, 8, 14, 18), 5, 2, False, (1, 3, 4, 9), 2), ((1, 8, 40, 24), 7, "valid", False, None, 2),
]


def _conv_mma_case(case, layout, rng):
    import numpy

    from cupy_dwgn import _validate, reference

    x_shape, k, padding, backward, spot, *more = case
    stride = more[0] if more else 1
    c = x_shape[1]
    g = _validate.conv_geometry(x_shape, (c, 1, k, k), stride, padding, 1)
    y_shape = (x_shape[0], c, g.out_height, g.out_width)
    src = rng.standard_normal(y_shape if backward else x_shape).astype(numpy.float16)
    w = rng.standard_normal((c, 1, k, k)).astype(numpy.float16)
    b = None if backward else rng.standard_normal(c).astype(numpy.float16)
    if spot is not None:
        src[spot] = numpy.inf
    if layout == "NHWC":
        src = numpy.ascontiguousarray(src.transpose(0, 2, 3, 1))
        x_shape = (x_shape[0], x_shape[2], x_shape[3], c)
        g = _validate.conv_geometry(x_shape, (c, 1, k, k), stride, padding, 1, layout="NHWC")
    with numpy.errstate(invalid="ignore"):
        if backward:
            want = reference.depthwise_conv2d_backward_input(src, w, x_shape, padding=padding, layout=layout)
        else:
            want = reference.depthwise_conv2d(src, w, b, stride=stride, padding=padding, layout=layout)
    return g, src, w, b, want


@pytest.mark.parametrize("layout, piece", [("NCHW", 16), ("NCHW", 4), ("NCHW", 2), ("NHWC", 16)])
@pytest.mark.parametrize("case", _CONV_MMA_GEOMETRIES,
                         ids=lambda c: f"{'x'.join(map(str, c[0]))}-{c[1]}x{c[1]}-{c[2]}-{'bwd' if c[3] else 'fwd'}-{c[4]}"
                                       + (f"-s{c[5]}" if len(c) > 5 else ""))
def test_conv_mma_index_math_matches_the_reference(case, layout, piece):
    finite = _check_conv_mma_index_math(case, layout, piece, seed=12)
    assert case[4] is None or finite is None or not finite.all()  # the inf reaches some output


@st.composite
def _conv_mma_cases(draw):
    """The parametrized cases' form, drawn: (NCHW x shape, K, padding per
    side, backward, an inf at (n, c, h, w) of the source or None, stride);
    stride 2 forward only (the backward-input takes it at stride 1)."""
    k = draw(st.sampled_from([3, 5, 7]))
    backward = draw(st.booleans())
    stride = 1 if backward else draw(st.sampled_from([1, 2]))
    padding = tuple((draw(st.integers(0, k + 2)), draw(st.integers(0, k + 2))) for _ in range(2))
    # Rows past 64 make bands.
    height = draw(st.one_of(st.integers(max(1, k - sum(padding[0])), 40), st.sampled_from([70, 100])))
    width = draw(st.integers(max(1, k - sum(padding[1])), 64))
    # NHWC serves whole 8-channel vectors.
    n, c = draw(st.integers(1, 2)), draw(st.one_of(st.integers(1, 16), st.sampled_from([8, 16])))
    spot = None
    if draw(st.booleans()):
        rows, cols = height, width
        if backward:
            rows, cols = height + sum(padding[0]) - k + 1, width + sum(padding[1]) - k + 1
        spot = (draw(st.integers(0, n - 1)), draw(st.integers(0, c - 1)), draw(st.integers(0, rows - 1)),
                draw(st.integers(0, cols - 1)))
    return (n, c, height, width), k, padding, backward, spot, stride


@settings(max_examples=40, deadline=None)
@given(case=_conv_mma_cases(), layout_piece=st.sampled_from([("NCHW", 16), ("NCHW", 8), ("NCHW", 4), ("NCHW", 2),
                                                              ("NHWC", 16)]),
       seed=st.integers(0, 2**32 - 1))
def test_conv_mma_random_geometries(case, layout_piece, seed):
    # The tensor-core forward / backward-input's emulation on drawn
    # geometries (any padding per side, bands, 1-16 channels, stride 2
    # forward), with or without an inf (which may sit where no window
    # reaches), at a drawn alignment: where the kernel serves, every output
    # equal to the float64 reference and the non-finite outputs exactly the
    # reference's.
    _check_conv_mma_index_math(case, *layout_piece, seed)


def _check_conv_mma_index_math(case, layout, piece, seed):
    """Which outputs of the reference are finite, or None where the kernel
    does not serve the case (and the plan says so)."""
    import numpy

    import _conv_mma_emulation as emulation
    from cupy_dwgn import _depthwise_conv_mma as mma
    from cupy_dwgn import _validate

    g, src, w, b, want = _conv_mma_case(case, layout, numpy.random.default_rng(seed))
    backward = case[3]
    launch = mma.plan.__wrapped__(g, numpy.dtype(numpy.float16), backward, layout, "int", piece, 16)
    _, src_w, _, _, offset_top, offset_left = _validate.correlation_frame(g, backward)
    if (not (offset_top >= 0 and 0 <= offset_left <= mma.LEFT) or (layout == "NHWC" and g.channels % 8)
            or mma.units(g, backward, layout) is None):  # (NHWC 150 -> 75: a 16-row band of 8 channels passes MAX_SHARED)
        assert launch is None
        return None
    assert (launch.file, launch.expression) in SHIPPED
    if layout == "NCHW":  # row copies in the largest piece the row bytes and the address allow
        assert int(launch.scalars[13]) == next(p for p in (16, 8, 4, 2) if p <= piece and (2 * src_w) % p == 0)
    # four resident blocks: each walks several units, its image buffers reused (NCHW: two, refilled in turn)
    got = emulation.emulate(launch, src, w, b, resident=4)
    finite = numpy.isfinite(want)
    assert (numpy.isfinite(got) == finite).all()
    numpy.testing.assert_allclose(got[finite], want[finite], rtol=1e-12, atol=1e-12)
    return finite


def test_conv_mma_plan():
    # What the tensor-core forward / backward-input serves (half types,
    # 3x3/5x5/7x7 at stride 1, dilation 1, multiplier 1; the correlation's
    # offsets in [0, 8]; NHWC: C a multiple of 8, 16-byte aligned), its
    # units (NCHW planes or bands, NHWC bands of 8 channels) and shared memory.
    import numpy

    from cupy_dwgn import _depthwise_conv_mma as mma
    from cupy_dwgn import _dtypes, _validate

    shipped = SHIPPED
    half, bf16, single = numpy.dtype(numpy.float16), numpy.dtype(_dtypes.bfloat16), numpy.dtype(numpy.float32)
    for layout, n, c, hw, k, stride, dilation, m, padding, dtype, backward, alignment, served in [
        ("NCHW", 64, 240, 28, 5, 1, 1, 1, 2, half, False, 16, True), ("NHWC", 64, 240, 28, 5, 1, 1, 1, 2, bf16, True, 16, True),
        ("NCHW", 64, 96, 56, 7, 1, 1, 1, 3, half, False, 16, True), ("NHWC", 64, 96, 56, 7, 1, 1, 1, 3, half, False, 16, True),
        ("NCHW", 64, 384, 14, 7, 1, 1, 1, 3, bf16, True, 16, True), ("NCHW", 64, 144, 56, 3, 1, 1, 1, 1, half, False, 2, True),
        ("NCHW", 2, 3, 150, 5, 1, 1, 1, 2, half, False, 16, True), ("NHWC", 2, 16, 112, 3, 1, 1, 1, 1, half, False, 16, True),
        ("NHWC", 2, 16, 224, 3, 1, 1, 1, 1, half, False, 16, False),  # a 16-row band of 8 channels passes MAX_SHARED
        ("NCHW", 1, 3, 1000, 3, 1, 1, 1, 1, half, False, 16, True), ("NCHW", 1, 3, 3000, 3, 1, 1, 1, 1, half, False, 16, False),
        ("NHWC", 64, 20, 28, 5, 1, 1, 1, 2, half, False, 16, False), ("NHWC", 64, 24, 28, 5, 1, 1, 1, 2, half, False, 8, False),
        ("NCHW", 64, 96, 112, 3, 2, 1, 1, 1, half, False, 16, True), ("NHWC", 64, 192, 75, 5, 2, 1, 1, 2, bf16, False, 16, True),
        ("NCHW", 64, 96, 56, 3, 2, 1, 1, 1, half, True, 16, False),  # a strided backward-input is no correlation
        ("NCHW", 64, 96, 56, 3, 3, 1, 1, 1, half, False, 16, False), ("NCHW", 64, 96, 56, 3, 1, 2, 1, 2, half, False, 16, False),
        ("NCHW", 64, 96, 56, 3, 1, 1, 2, 1, half, False, 16, False), ("NCHW", 64, 96, 56, 3, 1, 1, 1, 1, single, False, 16, False),
        ("NCHW", 64, 96, 56, 9, 1, 1, 1, 4, half, False, 16, False), ("NCHW", 8, 16, 20, 3, 1, 1, 1, 9, half, False, 16, False),
        ("NCHW", 8, 16, 20, 3, 1, 1, 1, 3, half, True, 16, False),  # backward-input offsets 2 - 3 < 0
        ("NCHW", 8, 16, 20, 7, 1, 1, 1, 8, half, False, 16, True), ("NCHW", 8, 16, 20, 3, 1, 1, 1, 1, half, False, 1, False),
    ]:
        x_shape = (n, c, hw, hw) if layout == "NCHW" else (n, hw, hw, c)
        g = _validate.conv_geometry(x_shape, (c * m, 1, k, k), stride, padding, dilation, layout=layout)
        launch = mma.plan(g, dtype, backward, layout, "int", alignment, alignment)
        assert (launch is not None) == served, (layout, n, c, hw, k, stride, dilation, m, padding, dtype, backward)
        if launch is None:
            continue
        assert (launch.file, launch.expression) in shipped
        (channels, planes, src_h, src_w, dst_h, dst_w, offset_top, offset_left, per_unit, num_bands, band_rows,
         image_rows, row_stride, piece, num_units, buffers) = (int(v) for v in launch.scalars)
        assert channels == c and launch.block == (mma.THREADS, 1, 1)
        assert launch.persistent and launch.grid[0] == num_units and buffers in (2, 1)
        # two buffers (NHWC: pixels copied ahead) unless no unit fits with them
        assert buffers == 1 or mma._units(g, backward, layout, 2) is not None
        assert buffers == 2 or mma._units(g, backward, layout, 2) is None
        chunks = 3 if stride == 1 else 4
        assert row_stride % 8 == 0 and row_stride // 8 % 2 == 1
        assert row_stride >= max(8 + src_w, 8 * stride * (-(-dst_w // 8) - 1) + 8 * chunks)
        assert launch.shared_mem <= mma.SHARED_TARGET or (band_rows == 16 and launch.shared_mem <= mma.MAX_SHARED)
        if layout == "NHWC":
            assert planes == n and per_unit == 8 and launch.grid[0] == n * num_bands * c // 8 and piece == 16
        else:
            assert planes == n * c and launch.grid[0] == -(-planes // per_unit) * num_bands
            assert num_bands == 1 or (per_unit == 1 and num_bands >= 2)
            assert piece == next(p for p in (16, 8, 4, 2) if (2 * src_w) % p == 0 and alignment % p == 0)
        assert num_bands * band_rows >= dst_h > (num_bands - 1) * band_rows
        if num_bands > 1:  # the tallest bands that fit: 16 more rows would not
            taller = mma._shared(per_unit, stride * (band_rows + 15) + k, row_stride, band_rows + 16, dst_w, layout,
                                 buffers, src_w)
            assert band_rows + 16 >= dst_h or taller > mma.SHARED_TARGET
    # NCHW whole planes: about two items a warp, fewer planes only for shared memory or a small call
    for n, c, hw in ((64, 240, 28), (64, 384, 14), (2, 24, 28), (64, 96, 56)):
        g = _validate.conv_geometry((n, c, hw, hw), (c, 1, 5, 5), 1, 2, 1)
        launch = mma.plan(g, half, False, "NCHW", "int", 16, 16)
        per_unit, num_bands = int(launch.scalars[8]), int(launch.scalars[9])
        wanted = min(-(-mma.ITEMS_PER_WARP * mma.WARPS // -(-hw // 16)), -(-n * c // mma.MIN_UNITS))
        assert num_bands == 1 and per_unit <= max(1, wanted)
    g = _validate.conv_geometry((2, 8, 28, 28), (8, 1, 5, 5), 1, 2, 1)
    assert mma.plan(g, half, False, "NCHW", "long long", 16, 16).expression == f"{mma.KERNEL}<__half, 5, 1, false, false, long long>"
    assert mma.plan(g, half, True, "NCHW", "int", 16, 16).expression == f"{mma.KERNEL}<__half, 5, 1, true, false, int>"
    g = _validate.conv_geometry((2, 28, 28, 8), (8, 1, 3, 3), 2, 1, 1, layout="NHWC")
    assert mma.plan(g, bf16, False, "NHWC", "int", 16, 16).expression == f"{mma.KERNEL}<__nv_bfloat16, 3, 2, false, true, int>"


def test_conv_mma_rule():
    # Where the ops take the tensor-core forward / backward-input (preferred's
    # docstring, the H200 candidates of 2026-12-05): (layout, C, H = W, K, stride, taken).
    import numpy

    from cupy_dwgn import _depthwise_conv_mma as mma
    from cupy_dwgn import _dtypes, _validate

    half = numpy.dtype(numpy.float16)
    assert mma.MODE == "rule"
    for layout, c, hw, k, stride, taken in [
        ("NCHW", 96, 56, 7, 1, True), ("NCHW", 192, 28, 7, 1, True), ("NCHW", 384, 14, 7, 1, False),
        ("NCHW", 96, 112, 7, 1, True), ("NCHW", 32, 150, 7, 1, False), ("NHWC", 96, 56, 7, 1, False), ("NCHW", 240, 28, 5, 1, False),
        ("NCHW", 144, 56, 3, 1, False), ("NCHW", 96, 112, 7, 2, False), ("NCHW", 960, 7, 3, 1, False),
        ("NCHW", 294, 16, 7, 1, False), ("NCHW", 171, 21, 7, 1, False),
    ]:
        x_shape = (64, c, hw, hw) if layout == "NCHW" else (64, hw, hw, c)
        g = _validate.conv_geometry(x_shape, (c, 1, k, k), stride, k // 2, 1, layout=layout)
        for backward in (False, True) if stride == 1 else (False,):
            assert mma.preferred(g, half, backward, layout) == taken, (layout, c, hw, k, stride, backward)
            planned = mma.select(g, half, backward, "int", 16, 16, layout)
            assert (planned is not None) == taken
    # bfloat16 also on 16x16 planes (2026-12-06), not on other sides below 24 nor on 16 x 48
    bf16 = numpy.dtype(_dtypes.bfloat16)
    for hw, width, taken in [(16, 16, True), (14, 14, False), (21, 21, False), (56, 56, True), (16, 48, True),
                             (16, 20, False)]:
        g = _validate.conv_geometry((64, 96, hw, width), (96, 1, 7, 7), 1, 3, 1)
        assert mma.preferred(g, bf16, False, "NCHW") == taken, (hw, width)
        assert mma.preferred(g, half, False, "NCHW") == (taken and hw != 16 and width != 16), (hw, width)
    # float32 is not served, whatever the rule says
    g = _validate.conv_geometry((64, 96, 56, 56), (96, 1, 7, 7), 1, 3, 1)
    assert mma.select(g, numpy.dtype(numpy.float32), False, "int", 16, 16, "NCHW") is None


def test_wgrad_mma_rule():
    # Where the ops take the tensor-core weight gradient (preferred's
    # docstring, the H200 sweeps of 2026-12-03): (layout, C, H = W, K, taken).
    import numpy

    from cupy_dwgn import _depthwise_wgrad_mma as mma
    from cupy_dwgn import _validate

    half = numpy.dtype(numpy.float16)
    assert mma.MODE == "rule"
    for layout, c, hw, k, taken in [
        ("NCHW", 384, 14, 7, True), ("NHWC", 384, 14, 7, True), ("NHWC", 768, 14, 7, True), ("NCHW", 192, 28, 7, True),
        ("NHWC", 768, 7, 7, False), ("NCHW", 672, 14, 5, True), ("NHWC", 672, 14, 5, False),
        ("NCHW", 240, 28, 5, False), ("NHWC", 240, 28, 5, False), ("NCHW", 384, 28, 3, False),
        ("NHWC", 960, 7, 3, False),
    ]:
        x_shape = (64, c, hw, hw) if layout == "NCHW" else (64, hw, hw, c)
        g = _validate.conv_geometry(x_shape, (c, 1, k, k), 1, k // 2, 1, layout=layout)
        assert mma.preferred(g, half, layout) == taken, (layout, c, hw, k)
        planned = mma.select(g, half, layout, "int", 16, 16)
        assert (planned is not None) == taken
