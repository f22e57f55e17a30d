"""GroupNorm on the GPU against the float64 reference (bounds: tests/_helpers.py).

Every test is marked `gpu` (skipped, and reported, without one).  The
parametrizations are grouped so that few kernel specializations compile: the
full dtype x activation x affine grid runs on one shape whose channels are a
multiple of 8 (vectorized path); the edge cases run float32/identity and
float16/silu (mixed-precision weights), which between them hit both the
vectorized and the scalar path.
"""

import numpy
import pytest

from cupy_dwgn import _dtypes, reference

from _helpers import (
    BFLOAT16, DTYPES, TOLERANCE, poisoned, random, record_errors, relative_error, programmatic_settings,
    replay_on_new_data,
)

from cupy_dwgn import _group_norm as gn
from cupy_dwgn import _launch

pytestmark = pytest.mark.gpu

ACTIVATIONS = gn.ACTIVATIONS
F16 = numpy.dtype(numpy.float16)
F32 = numpy.dtype(numpy.float32)
F64 = numpy.dtype(numpy.float64)


def _check(x, num_groups, weight, bias, activation, *, dy=None, misalign=False, tolerance=None, offset_note=""):
    """Run forward and backward on NumPy inputs and compare each output with the
    float64 reference computed from the very same (dtype-rounded) inputs."""
    import cupy

    dtype = x.dtype
    tol = TOLERANCE[dtype] if tolerance is None else tolerance
    dy = random(numpy.random.default_rng(x.size), x.shape, dtype) if dy is None else dy

    def dev(a):
        if a is None:
            return None
        if not misalign:
            return cupy.asarray(a)
        base = cupy.empty(a.size + 1, dtype=a.dtype)  # data pointer 1 element past 16 bytes
        view = base[1:].reshape(a.shape)
        view[...] = cupy.asarray(a)
        assert view.data.ptr % 16 != 0 and view.flags.c_contiguous
        return view

    x_d, dy_d, w_d, b_d = dev(x), dev(dy), cupy.asarray(weight) if weight is not None else None, (
        cupy.asarray(bias) if bias is not None else None
    )
    out = poisoned(x.shape, dtype)
    if misalign:
        out = dev(numpy.full(x.shape, numpy.nan, dtype=numpy.float32).astype(dtype))
    y, mean, rstd = gn.group_norm(
        x_d, num_groups, w_d, b_d, activation=activation, out=out, return_stats=True
    )
    assert y is out and y.dtype == dtype
    assert mean.shape == rstd.shape == (x.shape[0], num_groups)
    assert mean.dtype == rstd.dtype == _dtypes.accumulator_dtype(dtype)
    ref_y, ref_mean, ref_rstd = reference.group_norm(x, num_groups, weight, bias, activation=activation, return_stats=True)
    errors = {
        "y": relative_error(y, ref_y),
        "mean": relative_error(mean, ref_mean),
        "rstd": relative_error(rstd, ref_rstd),
    }
    dx, dw, db = gn.group_norm_backward(
        dy_d, x_d, mean, rstd, num_groups, w_d, b_d, activation=activation
    )
    # The reference backward from the very statistics the GPU backward got.
    ref_dx, ref_dw, ref_db = reference.group_norm_backward(
        dy, x, mean.get(), rstd.get(), num_groups, weight, bias, activation=activation
    )
    assert dx.dtype == dtype and dx.shape == x.shape
    errors["dx"] = relative_error(dx, ref_dx)
    for name, got, ref, given in (("dw", dw, ref_dw, weight), ("db", db, ref_db, bias)):
        if given is None:
            assert got is None, f"{name} should be None without its parameter"
        else:
            assert got.dtype == given.dtype and got.shape == given.shape
            errors[name] = relative_error(got, ref)
    record_errors(f"group_norm {dtype}", activation, errors)
    worst = max(errors.values())
    assert worst <= tol, f"{offset_note}relative errors {errors} exceed {tol}"
    return errors


def _affine(rng, channels, wdtype, affine):
    if affine == "none":
        return None, None
    weight = (1.0 + 0.5 * rng.standard_normal(channels)).astype(wdtype)
    bias = (0.5 * rng.standard_normal(channels)).astype(wdtype)
    return weight, (bias if affine == "both" else None)


# (dtype, weight dtype, affine) rows: weights of x's dtype, float32 for halves, and none.
_AFFINE_CASES = [(d, d, "both") for d in DTYPES] + [(d, F32, "both") for d in (F16, BFLOAT16)] + [
    (d, d, "none") for d in DTYPES
] + [(F32, F32, "weight")]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize(
    "dtype,wdtype,affine", _AFFINE_CASES, ids=[f"{d}-w{w}-{a}" for d, w, a in _AFFINE_CASES]
)
def test_matches_reference(rng, dtype, wdtype, affine, activation):
    x = random(rng, (2, 5, 7, 24), dtype, offset=3.0)
    weight, bias = _affine(rng, 24, wdtype, affine)
    _check(x, 4, weight, bias, activation)


# Two configurations reused by every edge case: (dtype, weight dtype, activation).
_EDGE_CONFIGS = [(F32, F32, "identity"), (F16, F32, "silu")]
_EDGE_IDS = ["float32-identity", "float16-wfloat32-silu"]

EDGE_SHAPES = [  # (shape, num_groups)
    ((2, 3, 3, 136), 17),  # C=136, G=17: the seed's early-return-before-barrier case
    ((2, 1, 97, 32), 8),  # prime H*W
    ((2, 5, 3, 40), 8),  # H*W % 8 != 0
    ((2, 4, 4, 16), 16),  # C == G (InstanceNorm)
    ((2, 4, 4, 16), 1),  # G == 1
    ((1, 6, 6, 32), 4),  # N == 1
    ((2, 5, 5, 12), 4),  # 3 channels per group (C % 8 != 0: scalar path for fp16)
    ((2, 3, 7, 20), 4),  # 5 channels per group
    ((2, 3, 3, 262), 2),  # 131 channels per group, C odd multiple of 2
    ((4, 24), 6),  # no spatial dims
    ((2, 33, 24), 3),  # 1 spatial dim
    ((2, 3, 4, 5, 24), 6),  # 3 spatial dims
    ((3, 9, 1), 1),  # one channel
    ((1, 4, 4, 2560), 32),  # C > one block of columns
    ((2, 5, 5, 600), 1),  # a group wider than the finalize block (dw/db columns in 3 passes)
    ((2, 128, 128, 32), 8),  # many row chunks
    ((70000, 3, 8), 2),  # N > 65535: the sample loops must iterate
]


@pytest.mark.parametrize("config", _EDGE_CONFIGS, ids=_EDGE_IDS)
@pytest.mark.parametrize("shape,num_groups", EDGE_SHAPES, ids=lambda v: str(v))
def test_edge_shapes(rng, shape, num_groups, config):
    dtype, wdtype, activation = config
    x = random(rng, shape, dtype, offset=3.0)
    weight, bias = _affine(rng, shape[-1], wdtype, "both")
    _check(x, num_groups, weight, bias, activation)


@pytest.mark.parametrize("config", _EDGE_CONFIGS, ids=_EDGE_IDS)
@pytest.mark.parametrize("shape", [(2, 6, 6, 32), (2, 5, 5, 12)], ids=str)
def test_misaligned_views(rng, shape, config):
    # x, grad_out and out are contiguous views whose data pointer is not
    # 16-byte aligned: the kernels must take the scalar path, not misread.
    dtype, wdtype, activation = config
    x = random(rng, shape, dtype, offset=3.0)
    weight, bias = _affine(rng, shape[-1], wdtype, "both")
    _check(x, 4, weight, bias, activation, misalign=True)


@pytest.mark.parametrize("dtype", [F32, F64, F16], ids=str)
def test_large_mean_offset(rng, dtype):
    # 1000 + randn: a naive E[x^2] - E[x]^2 in float32 loses every digit.
    # (bfloat16 is left out: its spacing at 1000 is 8, so the rounded input
    # carries almost no variance.)
    import cupy

    x = random(rng, (2, 9, 11, 32), dtype, offset=1000.0)
    weight, bias = _affine(rng, 32, dtype, "both")
    ref_y, ref_mean, ref_rstd = reference.group_norm(x, 8, weight, bias, return_stats=True)
    y, mean, rstd = gn.group_norm(
        cupy.asarray(x), 8, cupy.asarray(weight), cupy.asarray(bias),
        out=poisoned(x.shape, dtype), return_stats=True,
    )
    tol = TOLERANCE[dtype]
    assert relative_error(y, ref_y) <= tol
    assert relative_error(mean, ref_mean) <= tol
    assert relative_error(rstd, ref_rstd) <= tol
    dy = random(rng, x.shape, dtype)
    dx, dw, db = gn.group_norm_backward(
        cupy.asarray(dy), cupy.asarray(x), mean, rstd, 8, cupy.asarray(weight), cupy.asarray(bias)
    )
    # The float32 mean handed to the backward is itself rounded (its spacing
    # at 1000 is 6e-5 of a standard deviation), which moves dw = sum(dz * xhat)
    # by about 2e-5 relative whatever the kernel does: the reference backward
    # starts from the statistics actually given, as the op does.
    ref_dx, ref_dw, ref_db = reference.group_norm_backward(dy, x, mean.get(), rstd.get(), 8, weight, bias)
    assert relative_error(dx, ref_dx) <= tol
    assert relative_error(db, ref_db) <= tol
    assert relative_error(dw, ref_dw) <= tol


@pytest.mark.parametrize("config", _EDGE_CONFIGS, ids=_EDGE_IDS)
def test_random_shapes(config):
    dtype, wdtype, activation = config
    rng = numpy.random.default_rng(20240611)
    primes = [2, 3, 5, 7, 11, 13, 17, 31, 61, 97, 127]
    for _ in range(8):
        batch = int(rng.integers(1, 9))
        ndim = int(rng.integers(0, 4))
        spatial = []
        for _ in range(ndim):
            spatial.append(int(rng.choice(primes)) if rng.random() < 0.5 else int(rng.integers(1, 129)))
        while numpy.prod(spatial, dtype=numpy.int64) * batch > 2**20:  # keep each case small
            spatial[int(numpy.argmax(spatial))] //= 2
        num_groups = int(rng.choice([1, 2, 3, 4, 8, 16, 32]))
        per_group = int(rng.choice([1, 2, 3, 5, 8, 16, 40, 80]))
        channels = min(num_groups * per_group, 2560)
        shape = (batch, *spatial, channels)
        x = random(rng, shape, dtype, offset=3.0)
        weight, bias = _affine(rng, channels, wdtype, "both")
        _check(x, num_groups, weight, bias, activation, offset_note=f"shape {shape}, G={num_groups}: ")


def test_deterministic(rng):
    import cupy

    x = cupy.asarray(random(rng, (2, 64, 64, 320), F16, offset=3.0))
    dy = cupy.asarray(random(rng, x.shape, F16))
    w = cupy.asarray(rng.standard_normal(320).astype(F32))
    b = cupy.asarray(rng.standard_normal(320).astype(F32))
    runs = []
    for _ in range(2):
        y, mean, rstd = gn.group_norm(x, 32, w, b, activation="silu", return_stats=True)
        runs.append((y, mean, rstd) + gn.group_norm_backward(dy, x, mean, rstd, 32, w, b, activation="silu"))
    for a, b_ in zip(*runs):
        assert cupy.array_equal(a, b_)


@pytest.fixture
def set_paths():
    """Set gn.FORWARD_PATH and gn.BACKWARD_PATH for one test (both are part
    of the memoized Steps keys)."""
    old = gn.FORWARD_PATH, gn.BACKWARD_PATH

    def set_(path):
        gn.FORWARD_PATH = gn.BACKWARD_PATH = path

    yield set_
    gn.FORWARD_PATH, gn.BACKWARD_PATH = old


def _launch_counts(path):
    """Launches of every Steps resolved under ``path`` so far."""
    return {len(steps.launches) for entry in gn._SIGNATURES.values() for key, steps in entry.steps.items()
            if key[-1] == path}


# Shapes for the path comparison: SD-size, C/G odd, H*W prime, the scalar
# path (C not a multiple of the vector), one row per sample, several samples.
_PATH_CASES = [
    ((2, 64, 64, 320), 32, F16, F32, "silu"),
    ((2, 31, 29, 99), 33, F32, F32, "identity"),
    ((3, 97, 12), 4, F16, F16, "gelu"),
    ((5, 1, 1, 40), 8, BFLOAT16, F32, "relu"),
    ((8, 8, 8, 1024), 32, F32, F32, "gelu_tanh"),
]


@pytest.mark.parametrize("case", _PATH_CASES, ids=lambda c: f"{c[0]}-G{c[1]}-{numpy.dtype(c[2])}")
def test_every_path_agrees_with_the_reference(rng, set_paths, case):
    # "cluster" (what "auto" takes for these shapes on an sm_90 GPU where
    # the vector path applies) reads x (and grad_out) once in one launch of
    # thread-block clusters per direction; "resident" (opt-in) reads x (and
    # grad_out) once in one cooperative launch per direction; "fused" (what
    # "auto" takes otherwise) runs two launches per direction, the
    # column kernel doing its finalize after a grid barrier; "split" three;
    # "onepass" the cooperative one-launch kernels.  Each matches the
    # reference at the dtype's bound (statistics to float32 rounding), run to
    # run bit-identical.
    import cupy

    shape, groups, dtype, wdtype, activation = case
    x_host = random(rng, shape, dtype, offset=3.0)
    dy_host = random(rng, shape, dtype)
    w_host = (1.0 + 0.5 * rng.standard_normal(shape[-1])).astype(wdtype)
    b_host = (0.5 * rng.standard_normal(shape[-1])).astype(wdtype)
    ref_y, ref_mean, ref_rstd = reference.group_norm(x_host, groups, w_host, b_host, activation=activation,
                                                     return_stats=True)
    x, dy, w, b = (cupy.asarray(a) for a in (x_host, dy_host, w_host, b_host))
    gn._SIGNATURES.clear()  # _launch_counts reads every signature's Steps: this case's only
    assert _launch.cooperative_supported()  # else "fused" and "onepass" quietly run the three launches
    stats_tol = 1e-12 if dtype == F64 else 1e-6
    vec = gn._vector_width(dtype, shape[-1], True)
    rows = int(numpy.prod(shape[1:-1]))
    clustered = gn._cluster_geometry(shape[0], rows, shape[-1], groups, dtype, vec, forced=True) is not None
    clustered_backward = gn._cluster_geometry(shape[0], rows, shape[-1], groups, dtype, vec, True, True) is not None
    assert clustered == clustered_backward == (vec > 1)  # these small shapes fit wherever the vector path applies
    for path in ("cluster", "small", "resident", "fused", "onepass", "split"):
        set_paths(path)
        acc = _dtypes.accumulator_dtype(dtype)
        y, mean, rstd = poisoned(shape, dtype), poisoned((shape[0], groups), acc), poisoned((shape[0], groups), acc)
        gn.group_norm(x, groups, w, b, activation=activation, out=y, mean_out=mean, rstd_out=rstd)
        assert relative_error(y, ref_y) <= TOLERANCE[dtype], path
        assert relative_error(mean, ref_mean) <= stats_tol and relative_error(rstd, ref_rstd) <= stats_tol, path
        dx, dw, db = poisoned(shape, dtype), poisoned(shape[-1:], wdtype), poisoned(shape[-1:], wdtype)
        gn.group_norm_backward(dy, x, mean, rstd, groups, w, b, activation=activation, out=dx,
                               grad_weight_out=dw, grad_bias_out=db)
        ref_dx, ref_dw, ref_db = reference.group_norm_backward(dy_host, x_host, mean.get(), rstd.get(), groups,
                                                               w_host, b_host, activation=activation)
        for name, got, ref in (("dx", dx, ref_dx), ("dw", dw, ref_dw), ("db", db, ref_db)):
            assert relative_error(got, ref) <= TOLERANCE[dtype], (path, name)
        assert cupy.array_equal(gn.group_norm(x, groups, w, b, activation=activation), y), f"{path}: y changed"
        again = gn.group_norm_backward(dy, x, mean, rstd, groups, w, b, activation=activation)
        for got, first in zip(again, (dx, dw, db)):
            assert cupy.array_equal(got, first), f"{path}: backward not bit-identical run to run"
        # The cluster forward and backward are one launch each; small groups one forward, two backward.
        want = {"cluster": {1} if clustered else {2}, "small": {1, 2}, "resident": {1}, "onepass": {1}, "fused": {2},
                "split": {3}}
        assert _launch_counts(path) == want[path], path


@pytest.mark.parametrize("activation", ["identity", "relu", "silu"])
@pytest.mark.parametrize("case", _PATH_CASES[:3], ids=lambda c: f"{c[0]}-G{c[1]}-{numpy.dtype(c[2])}")
def test_non_finite_input_fills_its_group_only(rng, set_paths, case, activation):
    # An inf or NaN in x makes its (sample, group)'s statistics and every output of that group
    # NaN, as in the reference and PyTorch (relu included: NaN passes it), on every path; the
    # other groups are finite and match the reference.  Outputs start at a finite sentinel, so
    # an unwritten element of a bad group fails too.
    import cupy

    shape, groups, dtype, wdtype, _ = case
    channels, per_group = shape[-1], shape[-1] // groups
    x_host = random(rng, shape, dtype, offset=3.0)
    w_host = (1.0 + 0.5 * rng.standard_normal(channels)).astype(wdtype)
    b_host = (0.5 * rng.standard_normal(channels)).astype(wdtype)
    spatial = tuple(s // 2 for s in shape[1:-1])
    bad = {(0, 1): numpy.inf, (shape[0] - 1, groups - 1): numpy.nan}
    for (n, g), value in bad.items():
        x_host[(n,) + spatial + (g * per_group + per_group // 2,)] = value
    bad_mask = numpy.zeros((shape[0], groups), bool)
    for n, g in bad:
        bad_mask[n, g] = True
    element_bad = numpy.repeat(bad_mask, per_group, axis=1)[:, None, :]  # (N, 1, C): broadcast over rows
    element_bad = numpy.broadcast_to(element_bad.reshape((shape[0],) + (1,) * (len(shape) - 2) + (channels,)), shape)
    good_host = numpy.where(element_bad, 0, x_host).astype(dtype)  # the good groups' reference input
    ref_y = reference.group_norm(good_host, groups, w_host, b_host, activation=activation)
    x, w, b = (cupy.asarray(a) for a in (x_host, w_host, b_host))
    acc = _dtypes.accumulator_dtype(dtype)
    for path in ("auto", "cluster", "small", "fused", "split"):
        set_paths(path)
        y = cupy.full(shape, 12345.0, dtype=numpy.float32).astype(dtype)
        mean, rstd = cupy.zeros((shape[0], groups), acc), cupy.zeros((shape[0], groups), acc)
        gn.group_norm(x, groups, w, b, activation=activation, out=y, mean_out=mean, rstd_out=rstd)
        y_host = cupy.asnumpy(y).astype(numpy.float64)
        assert numpy.isnan(y_host[element_bad]).all(), (path, "a bad group's output is not NaN")
        assert numpy.isfinite(y_host[~element_bad]).all(), (path, "a good group's output is not finite")
        assert relative_error(y_host[~element_bad], ref_y[~element_bad]) <= TOLERANCE[dtype], path
        assert numpy.array_equal(~numpy.isfinite(cupy.asnumpy(rstd)), bad_mask), path


@pytest.mark.parametrize("case", [((2, 64, 64, 320), 32, F16, "silu"), ((2, 31, 29, 99), 33, F32, "identity"),
                                  ((4, 24, 24, 256), 32, BFLOAT16, "gelu")],
                         ids=["sd-fp16", "elements-fp32", "bf16"])
def test_programmatic_launches_match_ordinary_ones(rng, monkeypatch, set_paths, case):
    # The fused path's second kernels (dwgn_gn_fwd_apply, dwgn_gn_bwd_dx)
    # are programmatic dependent launches on sm_90 (_launch.PROGRAMMATIC):
    # placed while the cooperative column kernel finalizes, each waits for
    # it before touching memory.  Eager and in a captured CUDA graph
    # replayed on new data, the results are those of ordinary launches bit
    # for bit, and match the reference.
    import cupy

    shape, groups, dtype, activation = case
    set_paths("fused")
    problems = [(random(rng, shape, dtype, offset=3.0), random(rng, shape, dtype)) for _ in range(2)]
    w, b = cupy.asarray(rng.standard_normal(shape[-1]).astype(F32)), None
    if dtype == F32:
        b = cupy.asarray(rng.standard_normal(shape[-1]).astype(F32))

    def run(x, dy, outputs=None):
        y, mean, rstd, dx, dw, db = outputs or (None,) * 6
        y, mean, rstd = gn.group_norm(x, groups, w, b, activation=activation, return_stats=True, out=y,
                                      mean_out=mean, rstd_out=rstd)
        return (y, mean, rstd) + gn.group_norm_backward(dy, x, mean, rstd, groups, w, b, activation=activation,
                                                        out=dx, grad_weight_out=dw, grad_bias_out=db)

    results = {}
    for programmatic in programmatic_settings(monkeypatch, gn._SIGNATURES):
        x, dy = (cupy.asarray(a) for a in problems[0])
        eager = run(x, dy)
        assert any(launch.programmatic for entry in gn._SIGNATURES.values() for steps in entry.steps.values()
                   for launch in steps.launches)
        captured = tuple(None if a is None else cupy.empty_like(a) for a in eager)  # the graph's outputs
        replay_on_new_data(lambda: run(x, dy, captured), (x, dy), problems[1], [a for a in captured if a is not None])
        results[programmatic] = (eager, captured)
    # The replayed graph computed the second problem.
    w_host, b_host = (None if a is None else a.get() for a in (w, b))
    y, mean, rstd, dx = results[True][1][:4]
    assert relative_error(y, reference.group_norm(problems[1][0], groups, w_host, b_host,
                                                  activation=activation)) <= TOLERANCE[dtype]
    ref_dx = reference.group_norm_backward(problems[1][1], problems[1][0], mean.get(), rstd.get(), groups, w_host,
                                           b_host, activation=activation)[0]
    assert relative_error(dx, ref_dx) <= TOLERANCE[dtype]
    for how in (0, 1):  # eager, graph
        for name, off, on in zip(("y", "mean", "rstd", "dx", "dw", "db"), results[False][how], results[True][how]):
            assert (off is None and on is None) or cupy.array_equal(off, on), (("eager", "graph")[how], name)


def test_grid_barrier_word_flips_once_per_barrier(rng, set_paths):
    # The cooperative kernels' grid barrier (dwgn::grid_barrier) uses a word
    # at the start of the stream's workspace: each barrier flips its top bit
    # and leaves its lower bits zero for the next one.  One forward and one
    # backward call per path: one barrier each on the fused path, two on the
    # one-pass path, none on the split path.
    import cupy

    from cupy_dwgn import _workspace

    x = cupy.asarray(random(rng, (2, 16, 16, 64), F32, offset=3.0))
    key = (cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr)
    for path, barriers in (("resident", 1), ("fused", 1), ("onepass", 2), ("split", 0)):
        set_paths(path)
        y, mean, rstd = gn.group_norm(x, 8, return_stats=True)  # sizes the buffer
        gn.group_norm_backward(x, x, mean, rstd, 8)
        buffer = _workspace._BUFFERS[key]

        def word():
            return int(buffer[:4].view(cupy.uint32).get()[0])

        for call in (lambda: gn.group_norm(x, 8, return_stats=True),
                     lambda: gn.group_norm_backward(x, x, mean, rstd, 8)):
            before = word()
            assert before & 0x7FFFFFFF == 0, (path, hex(before))
            call()
            assert _workspace._BUFFERS[key] is buffer
            assert word() == before ^ (0x80000000 * (barriers % 2)), (path, hex(before), hex(word()))


@pytest.mark.parametrize("aligned", [True, False], ids=["vectors", "elements"])
@pytest.mark.parametrize(
    "shape, groups, dtype",
    [((2, 64, 64, 320), 32, F16), ((3, 33, 17, 96), 32, F32), ((2, 19, 23, 132), 11, F32), ((1, 40, 40, 64), 1, BFLOAT16),
     ((2, 16, 16, 1280), 32, F16), ((2, 16, 16, 1280), 32, F32)],
    # ragged: several column blocks of whole groups, the last one narrower
    # (fp16 vectors 55 + 55 + 50 columns, fp32 vectors 5 x 60 + 20, elements 5 x 240 + 80)
    ids=["sd-fp16", "D3-fp32", "D12-odd-rows", "D64-one-group", "ragged-fp16", "ragged-fp32"],
)
def test_group_and_channel_partial_sums_agree(rng, monkeypatch, set_paths, shape, groups, dtype, aligned):
    # The statistics kernel writes per-group partial sums for tensors of
    # _GROUPED_BYTES and more (gn::group_partials; _stats_split), else
    # per-channel ones.  Both layouts (forced here on small tensors), on the
    # fused and split paths, reading vectors and (from a misaligned view)
    # elements, match the reference with a large mean offset (the M2
    # combines must keep the variance), bit-identical run to run.
    import cupy

    x_host = random(rng, shape, dtype, offset=1000.0 if dtype != F16 else 30.0)
    ref_y, ref_mean, ref_rstd = reference.group_norm(x_host, groups, return_stats=True)
    if aligned:
        x = cupy.asarray(x_host)
    else:  # a view 1 element past an allocation's start: 16-byte loads are off the table
        x = cupy.empty(x_host.size + 1, dtype)[1:].reshape(shape)
        x[...] = cupy.asarray(x_host)
    vec = gn._vector_width(dtype, shape[-1], aligned)
    rows = int(numpy.prod(shape[1:-1]))
    for grouped in (True, False):
        monkeypatch.setattr(gn, "_GROUPED_BYTES", 0 if grouped else 2**62)
        gn._forward_plan.cache_clear()
        gn._SIGNATURES.clear()
        assert gn._stats_split(shape[0], rows, shape[-1] // vec, vec, shape[-1] // groups, grouped)[4] == grouped
        for path in ("fused", "split"):
            set_paths(path)
            acc = _dtypes.accumulator_dtype(dtype)
            y, mean, rstd = poisoned(shape, dtype), poisoned((shape[0], groups), acc), poisoned((shape[0], groups), acc)
            gn.group_norm(x, groups, out=y, mean_out=mean, rstd_out=rstd)
            assert relative_error(y, ref_y) <= TOLERANCE[dtype], (grouped, path)
            assert relative_error(mean, ref_mean) <= 1e-6 and relative_error(rstd, ref_rstd) <= 1e-6, (grouped, path)
            again = gn.group_norm(x, groups, return_stats=True)
            assert all(cupy.array_equal(a, b) for a, b in zip(again, (y, mean, rstd))), "not bit-identical run to run"
    gn._forward_plan.cache_clear()
    gn._SIGNATURES.clear()


@pytest.mark.parametrize(
    "shape, groups, dtype, aligned, max_blocks",
    [
        ((2, 64, 64, 320), 32, F16, True, None),  # the SD shape the rule gives 1 vector a thread
        # 11628 vectors on 5888 threads at U = 2: the last threads have no second vector
        ((3, 17, 19, 96), 8, F16, True, None),
        ((2, 13, 11, 40), 4, F16, False, None),  # elements (a misaligned view)
        ((2, 31, 33, 64), 8, F16, True, 3),  # grids of 3 blocks: every thread walks several steps
    ],
    ids=["sd-fp16", "tail-fp16", "elements-fp16", "steps-fp16"],
)
def test_elementwise_vectors_per_thread_give_the_same_bits(rng, monkeypatch, set_paths, shape, groups, dtype, aligned,
                                                            max_blocks):
    # dwgn_gn_fwd_apply / dwgn_gn_bwd_dx take 1 or 2 vectors a thread per
    # step (_elementwise_vectors: 2 for float16 tensors of at least
    # _ELEMENTWISE_BATCH_BYTES; both forced here on small ones).  Each
    # element's arithmetic is the same, so y (also in place) and dx are
    # bit-identical at both counts, on the fused (programmatic) and split
    # paths, and match the reference.
    import cupy

    if max_blocks is not None:  # grid_1d's cap, read at each plan's build
        monkeypatch.setattr(_launch, "MAX_BLOCKS", max_blocks)
    x_host = random(rng, shape, dtype, offset=3.0)
    dy_host = random(rng, shape, dtype)
    ref_y = reference.group_norm(x_host, groups, activation="silu")

    def on_device(host):
        if aligned:
            return cupy.asarray(host)
        view = cupy.empty(host.size + 1, dtype)[1:].reshape(shape)
        view[...] = cupy.asarray(host)
        return view

    def clear_plans():
        gn._forward_plan.cache_clear()
        gn._backward_plan.cache_clear()
        gn._SIGNATURES.clear()

    x, dy = on_device(x_host), on_device(dy_host)
    results = {}
    try:
        for u in (1, 2):
            monkeypatch.setattr(gn, "_elementwise_vectors", lambda *args, u=u: u)
            clear_plans()
            for path in ("fused", "split"):
                set_paths(path)
                acc = _dtypes.accumulator_dtype(dtype)
                y = poisoned(shape, dtype)
                mean, rstd = poisoned((shape[0], groups), acc), poisoned((shape[0], groups), acc)
                gn.group_norm(x, groups, activation="silu", out=y, mean_out=mean, rstd_out=rstd)
                assert relative_error(y, ref_y) <= TOLERANCE[dtype], (u, path)
                in_place = on_device(x_host)
                assert gn.group_norm(in_place, groups, activation="silu", out=in_place) is in_place
                assert cupy.array_equal(in_place, y), (u, path, "in place")
                dx = poisoned(shape, dtype)
                gn.group_norm_backward(dy, x, mean, rstd, groups, activation="silu", out=dx)
                ref_dx = reference.group_norm_backward(dy_host, x_host, mean.get(), rstd.get(), groups,
                                                       activation="silu")[0]
                assert relative_error(dx, ref_dx) <= TOLERANCE[dtype], (u, path)
                launches = _elementwise_launches()
                assert launches and all(launch.expression.endswith(f", {u}>") for launch in launches)
                if max_blocks is not None:
                    assert all(launch.grid[0] == max_blocks for launch in launches)
                results[u, path] = (y, dx)
        for path in ("fused", "split"):
            for one, two in zip(results[1, path], results[2, path]):
                assert cupy.array_equal(one, two), path
    finally:
        clear_plans()  # the plans built under the forced U (and grid cap) must not serve later tests


def _elementwise_launches():
    """The dwgn_gn_fwd_apply / dwgn_gn_bwd_dx launches of every Steps resolved so far."""
    return [launch for entry in gn._SIGNATURES.values() for steps in entry.steps.values()
            for launch in steps.launches if launch.expression.startswith(("dwgn_gn_fwd_apply", "dwgn_gn_bwd_dx"))]


def _kernels():
    """The kernels (by family) of every Steps resolved so far."""
    return {launch.expression.split("<")[0] for entry in gn._SIGNATURES.values()
            for steps in entry.steps.values() for launch in steps.launches}


def _forward_matches_reference(x, x_host, groups, weight, bias, weight_host, bias_host, activation, label):
    """group_norm on the device array x (x_host its host copy) into poisoned
    y, mean and rstd: each within its bound of the float64 reference (y at
    the dtype's tolerance, the statistics at 1e-6, 1e-12 for float64), and a
    second call bit-identical.  Returns (y, mean, rstd)."""
    import cupy

    dtype, shape = x.dtype, x.shape
    ref_y, ref_mean, ref_rstd = reference.group_norm(x_host, groups, weight_host, bias_host, activation=activation,
                                                     return_stats=True)
    acc = _dtypes.accumulator_dtype(dtype)
    y, mean, rstd = poisoned(shape, dtype), poisoned((shape[0], groups), acc), poisoned((shape[0], groups), acc)
    gn.group_norm(x, groups, weight, bias, activation=activation, out=y, mean_out=mean, rstd_out=rstd)
    stats_tol = 1e-12 if dtype == F64 else 1e-6
    errors = {"y": relative_error(y, ref_y), "mean": relative_error(mean, ref_mean),
              "rstd": relative_error(rstd, ref_rstd)}
    record_errors(f"group_norm {label} {dtype}", activation, errors)
    assert errors["y"] <= TOLERANCE[dtype] and max(errors["mean"], errors["rstd"]) <= stats_tol, errors
    again = gn.group_norm(x, groups, weight, bias, activation=activation, return_stats=True)
    assert all(cupy.array_equal(a, b) for a, b in zip(again, (y, mean, rstd))), "not bit-identical run to run"
    return y, mean, rstd


def _backward_matches_reference(dy, x, mean, rstd, dy_host, x_host, groups, weight_pair, bias_pair, activation,
                                label):
    """group_norm_backward with weight and bias, one of them, or neither
    (weight_pair, bias_pair: (device, host) arrays), each twice into fresh
    poisoned dx, dw, db: the outputs are the ones given, each within the
    dtype's bound of the float64 reference from the same statistics, and
    the two runs bit-identical (so a run that left an output unwritten, as
    a ticket left off 0 would, fails)."""
    import cupy

    dtype, shape = x.dtype, x.shape
    mean_host, rstd_host = mean.get(), rstd.get()
    for given in ("both", "weight", "bias", "neither"):
        weight, weight_host = weight_pair if given in ("both", "weight") else (None, None)
        bias, bias_host = bias_pair if given in ("both", "bias") else (None, None)
        ref_dx, ref_dw, ref_db = reference.group_norm_backward(
            dy_host, x_host, mean_host, rstd_host, groups, weight_host, bias_host, activation=activation)
        runs = []
        for _ in range(2):
            dx = poisoned(shape, dtype)
            dw = None if weight is None else poisoned(shape[-1:], weight.dtype)
            db = None if bias is None else poisoned(shape[-1:], bias.dtype)
            got = gn.group_norm_backward(dy, x, mean, rstd, groups, weight, bias, activation=activation, out=dx,
                                         grad_weight_out=dw, grad_bias_out=db)
            assert got[0] is dx and got[1] is dw and got[2] is db
            runs.append(got)
        errors = {"dx": relative_error(runs[0][0], ref_dx)}
        if weight is not None:
            errors["dw"] = relative_error(runs[0][1], ref_dw)
        if bias is not None:
            errors["db"] = relative_error(runs[0][2], ref_db)
        record_errors(f"group_norm {label} {dtype}", activation, errors)
        assert max(errors.values()) <= TOLERANCE[dtype], (given, errors)
        assert all(a is None and b is None or cupy.array_equal(a, b) for a, b in zip(*runs)), (
            f"{given}: not bit-identical run to run")


_RESIDENT_CASES = [  # (shape, groups, dtype, weight dtype, activation, offset, aligned)
    ((2, 64, 64, 320), 32, F16, F32, "silu", 3.0, True),  # SD-size: 64 tiles of 64 rows per sample
    ((2, 64, 64, 320), 32, F32, F32, "identity", 1000.0, True),  # 1000 + randn in float32
    ((2, 1, 4093, 320), 32, BFLOAT16, BFLOAT16, "gelu", 3.0, True),  # prime S: a short last tile
    ((8, 8, 8, 1280), 32, F16, F16, "gelu_tanh", 3.0, True),  # 3 lanes of 160 vectors, 4 rows a tile
    ((3, 31, 29, 99), 33, F16, F32, "relu", 30.0, True),  # C/G = 3, C % 8 != 0: 2-byte element copies
    ((2, 33, 17, 96), 32, F32, F32, "silu", 1000.0, False),  # misaligned: element path, 4-byte copies
    ((130, 4, 4, 64), 8, F32, F32, "identity", 3.0, True),  # N > 128: one tile a sample, 130 blocks
    ((1, 2560, 1024), 1024, F32, F32, "identity", 1000.0, True),  # D = 1; backward: 2 x 80 KB tiles (the cap)
    ((1, 40, 40, 64), 1, F64, F64, "silu", 1000.0, True),  # one group, float64
]


@pytest.mark.parametrize("case", _RESIDENT_CASES,
                         ids=lambda c: f"{'x'.join(map(str, c[0]))}-G{c[1]}-{numpy.dtype(c[2])}-{c[4]}")
def test_resident_kernels_match_the_reference(rng, set_paths, case):
    # The resident kernels (dwgn_gn_fwd_resident, dwgn_gn_bwd_resident:
    # each block keeps its tiles of rows in shared memory, one grid barrier,
    # x and grad_out read once) on ragged last tiles, every vector width and
    # element path, large means, D = 1 and one group: y, mean, rstd, dx, dw
    # and db match the reference, bit-identical run to run, and the forward
    # in place (out is x) gives the same y.
    import cupy

    shape, groups, dtype, wdtype, activation, offset, aligned = case
    set_paths("resident")
    gn._SIGNATURES.clear()
    x_host = random(rng, shape, dtype, offset=offset)
    w_host = (1.0 + 0.5 * rng.standard_normal(shape[-1])).astype(wdtype)
    b_host = (0.5 * rng.standard_normal(shape[-1])).astype(wdtype)

    def to_device():
        if aligned:
            return cupy.asarray(x_host)
        view = cupy.empty(x_host.size + 1, dtype)[1:].reshape(shape)  # one element past an allocation's start
        view[...] = cupy.asarray(x_host)
        return view

    x = to_device()
    w, b = cupy.asarray(w_host), cupy.asarray(b_host)
    y, mean, rstd = _forward_matches_reference(x, x_host, groups, w, b, w_host, b_host, activation, "resident")
    in_place = to_device()
    assert gn.group_norm(in_place, groups, w, b, activation=activation, out=in_place) is in_place
    assert cupy.array_equal(in_place, y), "in place differs"
    dy_host = random(rng, shape, dtype)
    dy = cupy.asarray(dy_host)
    dx, dw, db = poisoned(shape, dtype), poisoned(shape[-1:], wdtype), poisoned(shape[-1:], wdtype)
    gn.group_norm_backward(dy, x, mean, rstd, groups, w, b, activation=activation, out=dx, grad_weight_out=dw,
                           grad_bias_out=db)
    ref_dx, ref_dw, ref_db = reference.group_norm_backward(dy_host, x_host, mean.get(), rstd.get(), groups, w_host,
                                                           b_host, activation=activation)
    errors = {"dx": relative_error(dx, ref_dx), "dw": relative_error(dw, ref_dw), "db": relative_error(db, ref_db)}
    record_errors(f"group_norm resident {dtype}", activation, errors)
    assert max(errors.values()) <= TOLERANCE[dtype], errors
    again = gn.group_norm_backward(dy, x, mean, rstd, groups, w, b, activation=activation)
    assert all(cupy.array_equal(a, b_) for a, b_ in zip(again, (dx, dw, db))), "backward not bit-identical"
    dx_only = gn.group_norm_backward(dy, x, mean, rstd, groups, activation=activation)[0]  # no affine: no dw, db
    ref_dx_only = reference.group_norm_backward(dy_host, x_host, mean.get(), rstd.get(), groups, activation=activation)[0]
    assert relative_error(dx_only, ref_dx_only) <= TOLERANCE[dtype]
    assert _kernels() == {"dwgn_gn_fwd_resident", "dwgn_gn_bwd_resident"}


def test_resident_kernels_never_run_a_partial_grid(rng, set_paths):
    # 600 samples want 600 blocks of 512 threads: more than an H200 holds at
    # once (4 blocks of 512 per SM at most).  Both directions take the
    # two-launch path instead of a trimmed grid (each resident block owns a
    # tile), and a Launch that needs its whole grid refuses to be trimmed.
    import cupy

    set_paths("resident")
    gn._SIGNATURES.clear()
    shape, groups = (600, 4, 4, 64), 8
    x_host = random(rng, shape, F32, offset=3.0)
    plan = gn._forward_plan(600, 16, 64, groups, F32, F32, "identity", 1e-5, True, "resident")
    device = cupy.cuda.Device().id
    assert plan.resident is not None and not gn._resident_fits(device, plan.resident)
    with pytest.raises(RuntimeError, match="needs its whole grid"):
        plan.resident.grid_on(device)
    x = cupy.asarray(x_host)
    y, mean, rstd = gn.group_norm(x, groups, out=poisoned(shape, F32), return_stats=True)
    assert relative_error(y, reference.group_norm(x_host, groups)) <= TOLERANCE[F32]
    dy_host = random(rng, shape, F32)
    dx = gn.group_norm_backward(cupy.asarray(dy_host), x, mean, rstd, groups, out=poisoned(shape, F32))[0]
    ref_dx = reference.group_norm_backward(dy_host, x_host, mean.get(), rstd.get(), groups)[0]
    assert relative_error(dx, ref_dx) <= TOLERANCE[F32]
    assert _kernels() == {"dwgn_gn_stats", "dwgn_gn_fwd_apply", "dwgn_gn_bwd_reduce", "dwgn_gn_bwd_dx"}


_CLUSTER_CASES = [  # (shape, groups, dtype, weight dtype, activation, offset, cluster size the rule gives)
    ((2, 64, 64, 320), 32, F16, F32, "silu", 3.0, 16),  # SD-size: 40-channel sets, 16 CTAs of 256 rows each
    ((2, 32, 32, 640), 32, BFLOAT16, BFLOAT16, "gelu", 3.0, 8),
    ((2, 16, 16, 1280), 32, F32, F32, "gelu_tanh", 1000.0, 4),  # 1000 + randn in float32
    ((8, 8, 8, 1280), 32, F16, F16, "relu", 3.0, 1),  # a CTA per (sample, set)
    ((1, 128, 128, 128), 32, F32, F32, "identity", 1000.0, 16),
    ((2, 5, 7, 24), 4, F16, F32, "silu", 3.0, 16),  # 35 rows over 16 CTAs of 3: the last four hold none
    ((3, 31, 29, 96), 32, F32, F32, "silu", 30.0, 16),  # C/G = 3: sets of 12 channels (4 groups), prime rows
    ((5, 1, 1, 40), 8, BFLOAT16, F32, "identity", 3.0, 16),  # one row a sample: 15 of 16 CTAs empty
    ((4, 3, 3, 64), 1, F64, F64, "silu", 1000.0, 16),  # one group of 64 channels (the whole row a set), float64
    ((16, 9, 9, 256), 8, F32, F32, "identity", 3.0, 2),  # 128 clusters of 2
    ((1, 97, 12), 4, F32, F32, "gelu", 30.0, 16),  # blocks of 33 threads: a partial warp, 4 groups a set
    ((2, 5, 5, 1016), 1, F16, F32, "silu", 3.0, 16),  # a set of 1016 channels on 127 threads (set_group_sums' strides)
    ((1, 24, 32, 1024), 1, F16, F16, "gelu_tanh", 3.0, 16),  # 96 KB tiles: over 113 KB a CTA, one CTA per SM
]


def _cluster_inputs(rng, set_paths, case):
    """For a cluster test case (shape, groups, dtype, weight dtype, activation,
    offset, cluster size): skips without thread-block clusters, forces the
    "cluster" path (what "auto" takes only for small clusters) on fresh
    Steps, and returns host x (about offset), weight and bias."""
    import cupy

    shape, _, dtype, wdtype, _, offset, _ = case
    if _launch.compute_capability_major(cupy.cuda.Device().id) < 9:
        pytest.skip("thread-block clusters need compute capability 9.0")
    set_paths("cluster")
    gn._SIGNATURES.clear()
    x_host = random(rng, shape, dtype, offset=offset)
    w_host = (1.0 + 0.5 * rng.standard_normal(shape[-1])).astype(wdtype)
    b_host = (0.5 * rng.standard_normal(shape[-1])).astype(wdtype)
    return x_host, w_host, b_host

@pytest.mark.parametrize("case", _CLUSTER_CASES,
                         ids=lambda c: f"{'x'.join(map(str, c[0]))}-G{c[1]}-{numpy.dtype(c[2])}-{c[4]}")
def test_cluster_forward_matches_the_reference(rng, set_paths, case):
    # The cluster forward (dwgn_gn_fwd_cluster: a cluster of CTAs per
    # (sample, channel set), each CTA's rows held in shared memory, the
    # group sums reduced through distributed shared memory) at every
    # cluster size, with empty CTAs, C/G odd, large means, float64, and
    # without weight and bias: y, mean and rstd match the reference,
    # bit-identical run to run, the same in place (out is x); the backward
    # from its statistics matches too.
    import cupy

    shape, groups, dtype, wdtype, activation, offset, cluster = case
    x_host, w_host, b_host = _cluster_inputs(rng, set_paths, case)
    x, w, b = cupy.asarray(x_host), cupy.asarray(w_host), cupy.asarray(b_host)
    _forward_matches_reference(x, x_host, groups, None, None, None, None, activation, "cluster")
    y, mean, rstd = _forward_matches_reference(x, x_host, groups, w, b, w_host, b_host, activation, "cluster")
    in_place = cupy.asarray(x_host)
    assert gn.group_norm(in_place, groups, w, b, activation=activation, out=in_place) is in_place
    assert cupy.array_equal(in_place, y), "in place differs"
    launches = {launch.expression: launch for entry in gn._SIGNATURES.values() for steps in entry.steps.values()
                for launch in steps.launches}
    assert {e.split("<")[0] for e in launches} == {"dwgn_gn_fwd_cluster"}
    assert {launch.cluster for launch in launches.values()} == {cluster}
    assert all(e.endswith(f", {cluster}>") for e in launches)
    vec = gn._vector_width(dtype, shape[-1], True)
    auto = gn._forward_plan(shape[0], int(numpy.prod(shape[1:-1])), shape[-1], groups, dtype, wdtype, activation,
                            1e-5, True, "auto")
    small = gn._small_serves(shape[0], int(numpy.prod(shape[1:-1])), shape[-1], groups, "auto")  # taken first
    assert (auto.cluster is not None) == (cluster <= gn._CLUSTER_AUTO_MAX_SIZE and not small) and vec > 1  # < 16 MB
    dy_host = random(rng, shape, dtype)
    dx = gn.group_norm_backward(cupy.asarray(dy_host), x, mean, rstd, groups, activation=activation)[0]
    ref_dx = reference.group_norm_backward(dy_host, x_host, mean.get(), rstd.get(), groups, activation=activation)[0]
    assert relative_error(dx, ref_dx) <= TOLERANCE[dtype]



_CLUSTER_BACKWARD_CASES = [  # (shape, groups, dtype, weight dtype, activation, offset, cluster size the rule gives)
    ((2, 32, 32, 640), 32, F16, F32, "silu", 3.0, 4),  # SD-size: 16 sets of 40 channels, 4 CTAs of 256 rows
    ((8, 8, 8, 1280), 32, BFLOAT16, BFLOAT16, "gelu", 3.0, 1),  # a CTA per (sample, set)
    ((2, 16, 16, 1280), 32, F32, F32, "gelu_tanh", 1000.0, 2),  # 1000 + randn in float32
    ((1, 64, 64, 320), 32, F16, F16, "relu", 3.0, 8),  # one sample: every set's ticket wraps at N = 1
    ((2, 5, 7, 24), 4, F16, F32, "silu", 3.0, 8),  # 35 rows over 8 CTAs of 5: the last holds none
    ((3, 31, 29, 96), 32, F32, F32, "silu", 30.0, 8),  # C/G = 3: sets of 12 channels (4 groups), prime rows
    ((130, 2, 2, 64), 8, F32, F32, "identity", 3.0, 1),  # N = 130 samples a ticket, 8 sets
    ((3000, 1, 2, 64), 8, F16, F32, "silu", 3.0, 1),  # 3000 samples: the last cluster's whole CTA adds them
    ((4, 3, 3, 64), 1, F64, F64, "silu", 1000.0, 8),  # one group of 64 channels (the whole row a set), float64
    ((1, 97, 12), 4, F32, F32, "gelu", 30.0, 8),  # blocks of 39 threads: a partial warp
    ((2, 5, 5, 1016), 1, F16, F32, "silu", 3.0, 8),  # a set of 1016 channels on 127 threads
]


@pytest.mark.parametrize("case", _CLUSTER_BACKWARD_CASES,
                         ids=lambda c: f"{'x'.join(map(str, c[0]))}-G{c[1]}-{numpy.dtype(c[2])}-{c[4]}")
def test_cluster_backward_matches_the_reference(rng, set_paths, case):
    # The cluster backward (dwgn_gn_bwd_cluster: tiles of x and grad_out in
    # a cluster's shared memory, the dx coefficients reduced through
    # distributed shared memory, the weight gradients by the last cluster of
    # each channel set, found by a ticket) at every cluster size, with empty
    # CTAs, C/G odd, a partial warp, many samples, float64, with weight and
    # bias, one of them, or neither: dx, dw and db match the reference into
    # poisoned outputs, bit-identical run to run (each run into fresh
    # poisoned outputs: a ticket left off 0 would leave them unwritten), and
    # every ticket is back at 0 after the calls.
    import cupy

    from cupy_dwgn import _workspace

    shape, groups, dtype, wdtype, activation, offset, cluster = case
    x_host, w_host, b_host = _cluster_inputs(rng, set_paths, case)
    dy_host = random(rng, shape, dtype)
    x, dy, w, b = (cupy.asarray(a) for a in (x_host, dy_host, w_host, b_host))
    _, mean, rstd = gn.group_norm(x, groups, w, b, activation=activation, return_stats=True)
    _backward_matches_reference(dy, x, mean, rstd, dy_host, x_host, groups, (w, w_host), (b, b_host), activation,
                                "cluster backward")
    launches = {launch.expression: launch for entry in gn._SIGNATURES.values() for steps in entry.steps.values()
                for launch in steps.launches}
    assert {e.split("<")[0] for e in launches} == {"dwgn_gn_fwd_cluster", "dwgn_gn_bwd_cluster"}
    assert {launch.cluster for e, launch in launches.items() if "bwd" in e} == {cluster}
    header = _workspace._BUFFERS[cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr]
    tickets = header[_workspace.ALIGNMENT:_workspace.HEADER].view(numpy.uint32)
    assert not tickets.any(), f"tickets left at {tickets[tickets != 0]}"
    auto = gn._backward_plan(shape[0], int(numpy.prod(shape[1:-1])), shape[-1], groups, dtype, wdtype, activation,
                             True, "auto")
    small = gn._small_serves(shape[0], int(numpy.prod(shape[1:-1])), shape[-1], groups, "auto")  # taken first
    assert (auto.cluster is not None) == (cluster <= gn._CLUSTER_BWD_AUTO_MAX_SIZE and not small)  # all < 16 MB



_SMALL_CASES = [  # (shape, groups, dtype, weight dtype, activation, offset)
    ((4096, 64), 8, F32, F32, "silu", 1000.0),  # (N, C): 8 elements a group, 1000 + randn in float32
    ((3000, 1, 2, 64), 8, F16, F32, "gelu", 3.0),  # D = 8: 4 lanes a channel (K = 4)
    ((257, 3, 5, 99), 33, BFLOAT16, BFLOAT16, "gelu_tanh", 3.0),  # D = 3: K = 10, 2 lanes idle
    ((64, 2, 2, 96), 4, F32, F32, "relu", 30.0),  # D = 24: one lane a channel, 8 idle
    ((100, 3, 3, 64), 4, F16, F16, "silu", 3.0),  # D = 16: K = 2, no lane idle
    ((50, 2, 5, 128), 4, F32, F32, "gelu", 3.0),  # D = 32: one lane a channel, none idle
    ((33, 1, 7, 320), 4, F16, F16, "silu", 3.0),  # D = 80 > 32: a lane walks channels d, d + 32, ...
    ((16, 2, 3, 1024), 1024, F64, F64, "silu", 1000.0),  # D = 1: 32 lanes a channel (6 rows), float64
    ((2, 64, 64, 320), 32, F16, F32, "identity", 3.0),  # forced on an SD shape: 40960 elements a group
]


@pytest.mark.parametrize("case", _SMALL_CASES, ids=lambda c: f"{'x'.join(map(str, c[0]))}-G{c[1]}-{numpy.dtype(c[2])}")
def test_small_groups_match_the_reference(rng, set_paths, case):
    # The small-group kernels (a warp per (sample, group); backward the
    # samples' per-channel sums, then dwgn_gn_bwd_weights) over every lane
    # layout of the backward (K lanes a channel, idle lanes, a lane walking
    # several channels), the scalar and vector paths, large means, float64:
    # y, mean, rstd, dx, dw, db match the reference into poisoned outputs,
    # with weight and bias, one of them or neither, bit-identical run to
    # run, the forward in place too; "auto" takes them where _small_serves
    # says.
    import cupy

    shape, groups, dtype, wdtype, activation, offset = case
    set_paths("small")
    gn._SIGNATURES.clear()
    x_host = random(rng, shape, dtype, offset=offset)
    dy_host = random(rng, shape, dtype)
    w_host = (1.0 + 0.5 * rng.standard_normal(shape[-1])).astype(wdtype)
    b_host = (0.5 * rng.standard_normal(shape[-1])).astype(wdtype)
    x, dy, w, b = (cupy.asarray(a) for a in (x_host, dy_host, w_host, b_host))
    _forward_matches_reference(x, x_host, groups, None, None, None, None, activation, "small")
    y, mean, rstd = _forward_matches_reference(x, x_host, groups, w, b, w_host, b_host, activation, "small")
    in_place = cupy.asarray(x_host)
    assert gn.group_norm(in_place, groups, w, b, activation=activation, out=in_place) is in_place
    assert cupy.array_equal(in_place, y), "in place differs"
    _backward_matches_reference(dy, x, mean, rstd, dy_host, x_host, groups, (w, w_host), (b, b_host), activation,
                                "small")
    assert _kernels() == {"dwgn_gn_fwd_small", "dwgn_gn_bwd_small", "dwgn_gn_bwd_weights"}
    rows = int(numpy.prod(shape[1:-1]))
    auto = gn._forward_plan(shape[0], rows, shape[-1], groups, dtype, wdtype, activation, 1e-5, True, "auto")
    assert (auto.small is not None) == (rows * (shape[-1] // groups) <= gn._SMALL_MAX_GROUP)


def test_zero_size():
    import cupy

    for shape in [(0, 4, 4, 8), (0, 8)]:
        x = cupy.empty(shape, F32)
        y, mean, rstd = gn.group_norm(x, 4, cupy.ones(8, F32), cupy.zeros(8, F32), return_stats=True)
        assert y.shape == shape and mean.shape == rstd.shape == (0, 4)
        dx, dw, db = gn.group_norm_backward(x, x, mean, rstd, 4, cupy.ones(8, F32), cupy.zeros(8, F32))
        assert dx.shape == shape
        assert (dw == 0).all() and (db == 0).all() and dw.shape == (8,)
        # Given outputs (poisoned) are written: the gradients of no samples are zero.
        dw, db = poisoned((8,), F32), poisoned((8,), F32)
        gn.group_norm_backward(x, x, mean, rstd, 4, cupy.ones(8, F32), cupy.zeros(8, F32), grad_weight_out=dw,
                               grad_bias_out=db)
        assert (dw == 0).all() and (db == 0).all()
    # S == 0: y is empty, the statistics of nothing are NaN, gradients zero.
    x = cupy.empty((2, 0, 3, 8), F16)
    y, mean, rstd = gn.group_norm(x, 2, return_stats=True)
    assert y.shape == x.shape and mean.shape == (2, 2) and bool(cupy.isnan(mean).all())
    dx, dw, db = gn.group_norm_backward(x, x, mean, rstd, 2, cupy.ones(8, F16))
    assert dx.shape == x.shape and db is None and (dw == 0).all()
    dw = poisoned((8,), F16)
    gn.group_norm_backward(x, x, mean, rstd, 2, cupy.ones(8, F16), grad_weight_out=dw)
    assert (dw == 0).all()


def test_host_wrappers_round_trip_numpy(rng):
    import cupy_dwgn.host as host

    x = random(rng, (2, 5, 5, 16), F32, offset=3.0)
    w, b = _affine(rng, 16, F32, "both")
    y, mean, rstd = host.group_norm(x, 4, w, b, activation="gelu", return_stats=True)
    assert all(isinstance(a, numpy.ndarray) for a in (y, mean, rstd))
    ref_y = reference.group_norm(x, 4, w, b, activation="gelu")
    assert numpy.linalg.norm(y - ref_y) / numpy.linalg.norm(ref_y) <= TOLERANCE[F32]
    dx, dw, db = host.group_norm_backward(x, x, mean, rstd, 4, w, None, activation="gelu")
    assert isinstance(dx, numpy.ndarray) and isinstance(dw, numpy.ndarray) and db is None


def test_return_types_without_stats(rng):
    import cupy

    x = cupy.asarray(random(rng, (2, 3, 3, 8), F32, offset=3.0))
    y = gn.group_norm(x, 2)
    assert isinstance(y, cupy.ndarray) and y.shape == x.shape


@pytest.mark.slow
def test_sample_of_2_31_minus_1_rows():
    # One sample of S = 2**31 - 1 rows (32-bit indices: fewer than 2**31
    # elements): its last chunk starts within rows_per_chunk of 2**31, where
    # row0 + rows_per_chunk wraps an int (the last lane would read row S and
    # divide by a wrong row count).  Statistics against float64 CuPy
    # reductions; y checked at the last rows.
    import cupy

    rows = 2**31 - 1
    cupy.random.seed(11)
    x = (cupy.random.standard_normal((1, rows, 1), dtype=cupy.float32) + 3.0).astype(cupy.float16)
    rows_per_chunk, num_chunks, _, _, _ = gn._stats_split(1, rows, 1, 1, 1, True)
    assert (num_chunks - 1) * rows_per_chunk + rows_per_chunk >= 2**31  # the wrap this test is for
    y, mean, rstd = gn.group_norm(x, 1, return_stats=True)
    x64 = x.astype(cupy.float64)
    ref_mean = float(x64.mean())
    ref_rstd = 1.0 / float(cupy.sqrt(((x64 - ref_mean) ** 2).mean() + 1e-5))
    del x64
    assert abs(float(mean[0, 0]) - ref_mean) <= 1e-6 * abs(ref_mean)
    assert abs(float(rstd[0, 0]) - ref_rstd) <= 1e-6 * ref_rstd
    tail = x[0, -4096:, 0].astype(cupy.float64)
    ref_tail = (tail - ref_mean) * ref_rstd
    assert relative_error(y[0, -4096:, 0], ref_tail.get()) <= TOLERANCE[F16]
    # dy = 1 (identity, no affine): dx = rstd * (1 - mean(dy) - xhat * mean(dy * xhat)) = 0 up to
    # rounding; a wrong row count in the last chunk would leave a term of order rstd.
    dy = cupy.ones_like(x)
    dx, _, _ = gn.group_norm_backward(dy, x, mean, rstd, 1)
    assert float(cupy.abs(dx[0, -4096:].astype(cupy.float32)).max()) < 1e-3


@pytest.mark.slow
def test_large_tensor_64bit_indexing():
    # 2**31 + 2**16 elements of float16 (4 GiB per tensor, ~20 GB peak).
    # Samples at the start and past the 2**31 boundary are checked against
    # the reference computed on the CPU for those samples only.
    import cupy

    batch, rows, channels, groups = 2**31 // (1024 * 64) + 1, 1024, 64, 8
    shape = (batch, rows, channels)
    assert batch * rows * channels >= 2**31
    cupy.random.seed(7)
    x = (cupy.random.standard_normal(shape, dtype=cupy.float32) + 3.0).astype(cupy.float16)
    dy = cupy.random.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
    weight = cupy.asarray((1.0 + 0.5 * numpy.random.default_rng(1).standard_normal(channels)).astype(F32))
    bias = cupy.asarray((0.5 * numpy.random.default_rng(2).standard_normal(channels)).astype(F32))
    y, mean, rstd = gn.group_norm(x, groups, weight, bias, activation="silu", return_stats=True)
    dx, dw, db = gn.group_norm_backward(dy, x, mean, rstd, groups, weight, bias, activation="silu")
    # dw/db sum over every element: an independent float64 computation with
    # plain CuPy array expressions, sample by sample, stands in for the
    # NumPy reference (which would take minutes on 2**31 elements).
    ref_dw = cupy.zeros(channels, cupy.float64)
    ref_db = cupy.zeros(channels, cupy.float64)
    w64, b64 = weight.astype(cupy.float64), bias.astype(cupy.float64)
    for n0 in range(0, batch, 1024):
        xg = x[n0 : n0 + 1024].astype(cupy.float64).reshape(-1, rows, groups, channels // groups)
        mu = xg.mean(axis=(1, 3), keepdims=True)
        var = ((xg - mu) ** 2).mean(axis=(1, 3), keepdims=True)
        xhat = ((xg - mu) / cupy.sqrt(var + 1e-5)).reshape(-1, rows, channels)
        del xg
        z = xhat * w64 + b64
        sig = 1.0 / (1.0 + cupy.exp(-z))
        dz = dy[n0 : n0 + 1024].astype(cupy.float64) * sig * (1.0 + z * (1.0 - sig))
        ref_dw += (dz * xhat).sum(axis=(0, 1))
        ref_db += dz.sum(axis=(0, 1))
        del z, sig, dz, xhat
    assert relative_error(dw, ref_dw.get()) <= TOLERANCE[F32]
    assert relative_error(db, ref_db.get()) <= TOLERANCE[F32]
    w_h, b_h = cupy.asnumpy(weight), cupy.asnumpy(bias)
    for n in (0, batch // 2, batch - 1):
        x_n = cupy.asnumpy(x[n : n + 1])
        dy_n = cupy.asnumpy(dy[n : n + 1])
        ref_y, ref_mean, ref_rstd = reference.group_norm(x_n, groups, w_h, b_h, activation="silu", return_stats=True)
        ref_dx, _, _ = reference.group_norm_backward(
            dy_n, x_n, mean[n : n + 1].get(), rstd[n : n + 1].get(), groups, w_h, b_h, activation="silu"
        )
        assert relative_error(y[n : n + 1], ref_y) <= TOLERANCE[F16]
        assert relative_error(mean[n : n + 1], ref_mean) <= 1e-5
        assert relative_error(rstd[n : n + 1], ref_rstd) <= 1e-5
        assert relative_error(dx[n : n + 1], ref_dx) <= TOLERANCE[F16]


def test_in_place_out_is_x(rng):
    import cupy

    x_host = random(rng, (2, 6, 6, 32), F16, offset=3.0)
    x = cupy.asarray(x_host)
    y = gn.group_norm(x, 8, activation="silu", out=x)
    assert y is x
    ref_y = reference.group_norm(x_host, 8, activation="silu")
    assert relative_error(y, ref_y) <= TOLERANCE[F16]


def test_partially_overlapping_out_is_rejected():
    import cupy

    base = cupy.zeros(2 * 4 * 8 + 8, F32)
    x = base[:64].reshape(2, 4, 8)
    out = base[8:72].reshape(2, 4, 8)
    with pytest.raises(ValueError, match=r"out: expected memory separate from x"):
        gn.group_norm(x, 2, out=out)


@pytest.mark.parametrize("spike", [64.0, 512.0])
def test_outlier_at_the_first_position_keeps_float32_statistics_exact(rng, spike):
    # Sums shifted by x[n, 0, c] lost every digit when that one element was
    # an outlier (8.6e-3 error at +256 sigma); Welford/Chan summaries do not.
    import cupy

    x = random(rng, (1, 65536, 8), F32, offset=3.0)
    x[0, 0, :] += spike
    y, mean, rstd = gn.group_norm(cupy.asarray(x), 2, return_stats=True, out=poisoned(x.shape, F32))
    ref_y, ref_mean, ref_rstd = reference.group_norm(x, 2, return_stats=True)
    errors = {"y": relative_error(y, ref_y), "mean": relative_error(mean, ref_mean), "rstd": relative_error(rstd, ref_rstd)}
    assert max(errors.values()) <= TOLERANCE[F32], errors


@pytest.mark.parametrize(
    "shape,offset,spikes",
    [
        ((1, (1 << 21) + 3, 8), 1000.0, ()),  # whole batches plus a remainder in lane 0
        ((1, 1 << 21, 8), 3.0, ((0, 512.0), (12345, -300.0), ((1 << 21) - 1, 256.0))),
        ((2, 512, 512, 32), 1000.0, ((7, 100.0),)),
    ],
    ids=["remainder-1000+randn", "spikes", "2-samples-1000+randn"],
)
def test_long_lanes_keep_float32_statistics_exact(rng, shape, offset, spikes):
    # Each statistics thread reads its rows (of float32 4-channel vectors) in
    # batches of gn::row_batch<4> (8): a batch's own mean and M2, then one
    # Chan merge; the rest (fewer than 8) loaded together, then one Welford
    # step each.
    # These shapes give every lane several batches (checked below, so the
    # test keeps its point if the split changes) with a large mean offset
    # and outliers inside and at the ends of batches.
    import cupy

    batch, channels = shape[0], shape[-1]
    rows = int(numpy.prod(shape[1:-1]))
    vec = gn._vector_width(F32, channels, True)
    large = batch * rows * channels * 4 >= gn._GROUPED_BYTES
    rows_per_chunk, _, _, cols, _ = gn._stats_split(batch, rows, channels // vec, vec, channels // 2, large)
    lanes = gn._COLUMN_BLOCK // cols
    assert rows_per_chunk // lanes >= 2 * 8

    x = random(rng, shape, F32, offset=offset)
    flat = x.reshape(batch, rows, channels)
    for row, value in spikes:
        flat[0, row, :] += value
    y, mean, rstd = gn.group_norm(cupy.asarray(x), 2, return_stats=True, out=poisoned(x.shape, F32))
    ref_y, ref_mean, ref_rstd = reference.group_norm(x, 2, return_stats=True)
    errors = {"y": relative_error(y, ref_y), "mean": relative_error(mean, ref_mean), "rstd": relative_error(rstd, ref_rstd)}
    assert max(errors.values()) <= TOLERANCE[F32], errors
