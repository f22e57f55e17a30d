"""GPU check of the GroupNorm paths with cooperative launches, against the
float64 reference and the three-launch path: "fused" (two launches per
direction: the column kernel with its finalize after a grid barrier, then
apply / dx; what "auto" takes) and "onepass" (dwgn_gn_fwd_onepass,
dwgn_gn_bwd_onepass: one launch each, opt-in).

    PYTHONPATH=. python scripts/check_group_norm_onepass.py            # correctness + timing
    PYTHONPATH=. python scripts/check_group_norm_onepass.py --no-time  # correctness only
    ... --paths fused                                                  # one path only

1. correctness: many shapes/dtypes/activations, outputs NaN-poisoned, each
   forced path, relative error vs cupy_dwgn.reference within tests/_helpers
   TOLERANCE (y) and 1e-6 (mean/rstd; 1e-12 for float64); in-place (out=x);
   misaligned pointers (scalar path); x = 1000 + randn in float32;
2. determinism: 5 runs bit-identical (y, mean, rstd), and the same bits when
   the cooperative grid is forced to 1, 7 and 33 blocks (the kernel must not
   depend on the grid size);
   the backward likewise (dx, dw, db from the forward's statistics, outputs
   poisoned; bit-identical over runs and forced grids);
3. the plans take two launches per direction for the SD shapes on the
   fused path ("auto"), three on "split" and one on "onepass";
4. timing (CUDA events, median of 200 after warm-up; eager calls): fused
   vs the three-launch path vs torch.nn.functional.group_norm (+ silu) in
   both memory formats when torch is importable; GPU time by CUDA-graph
   replay of 20 calls.
Exit status 1 on any correctness failure.
"""

import argparse
import sys

import cupy
import numpy

from cupy_dwgn import _dtypes, _launch, reference
from cupy_dwgn import _group_norm as gn

TOL = {
    numpy.dtype(numpy.float64): 1e-12,
    numpy.dtype(numpy.float32): 1e-5,
    numpy.dtype(numpy.float16): 2e-3,
    _dtypes.bfloat16: 1.6e-2,
}
F16, F32, F64, BF16 = numpy.dtype(numpy.float16), numpy.dtype(numpy.float32), numpy.dtype(numpy.float64), _dtypes.bfloat16

CASES = [
    # (shape N,*spatial,C, G, dtype, weight dtype or None, activation, offset)
    ((2, 64, 64, 320), 32, F16, F32, "silu", 0.0),
    ((2, 32, 32, 640), 32, F16, F16, "identity", 0.0),
    ((2, 16, 16, 1280), 32, F16, F32, "silu", 0.0),
    ((8, 8, 8, 1280), 32, BF16, BF16, "gelu", 0.0),
    ((2, 64, 64, 320), 32, F32, F32, "gelu_tanh", 0.0),
    ((1, 37, 41, 96), 32, F16, F32, "relu", 0.0),  # D = 3, S prime-ish
    ((3, 97, 99), 33, F32, None, "identity", 0.0),  # C odd: scalar path, D = 3
    ((1, 13, 15), 5, F32, F32, "silu", 1000.0),  # 1000 + randn, scalar
    ((1, 1009, 40), 8, F32, F32, "identity", 1000.0),
    ((1, 1, 8), 2, F32, F32, "relu", 0.0),
    ((4, 31, 31, 24), 8, F64, F64, "silu", 0.0),
    ((2, 23, 29, 200), 40, BF16, F32, "relu", 0.0),  # D = 5
    ((1, 128, 128, 128), 32, F16, F16, "silu", 0.0),
    ((1, 7, 2048), 32, F16, F16, "identity", 0.0),  # widest fp16 row (cols 256)
    ((2, 5, 512), 512, F32, F32, "identity", 0.0),  # D = 1
    ((600, 4, 16), 4, F32, F32, "silu", 0.0),  # N large: per-sample chunks = 1
]


def relative_error(out, ref):
    got = cupy.asnumpy(out).astype(numpy.float64)
    ref = numpy.asarray(ref, dtype=numpy.float64)
    if not numpy.isfinite(got).all():
        return float("inf")
    return float(numpy.linalg.norm(got - ref) / max(numpy.linalg.norm(ref), 1e-300))


def run(x, g, w, b, act, out=None):
    y, mean, rstd = gn.group_norm(x, g, w, b, activation=act, out=out, return_stats=True)
    cupy.cuda.get_current_stream().synchronize()
    return y, mean, rstd


def forced(path):
    class _Force:
        def __enter__(self):
            self.old = gn.FORWARD_PATH, gn.BACKWARD_PATH
            gn.FORWARD_PATH = gn.BACKWARD_PATH = path

        def __exit__(self, *exc):
            gn.FORWARD_PATH, gn.BACKWARD_PATH = self.old

    return _Force()


def force_grid(blocks):
    """Forces every cooperative Launch built from now on to at most
    ``blocks`` blocks (by capping the cached capacity)."""
    gn._forward_plan.cache_clear()
    gn._backward_plan.cache_clear()
    gn._SIGNATURES.clear()  # their Steps hold the launch grids per device
    _launch._CAPACITY.clear()
    original = _launch.cooperative_capacity

    def capped(*args):
        return min(blocks, original(*args))

    _launch.cooperative_capacity = capped
    return original


def correctness(paths):
    return sum(correctness_of(path) for path in paths)


def correctness_of(path):
    print(f"\n== path {path}")
    rng = numpy.random.default_rng(1)
    failures = 0
    for shape, g, dtype, w_dtype, act, offset in CASES:
        x_h = (offset + rng.standard_normal(shape)).astype(dtype)
        c = shape[-1]
        w_h = (1 + 0.1 * rng.standard_normal(c)).astype(w_dtype) if w_dtype is not None else None
        b_h = (0.1 * rng.standard_normal(c)).astype(w_dtype) if w_dtype is not None else None
        ref_y, ref_m, ref_r = reference.group_norm(x_h, g, w_h, b_h, activation=act, return_stats=True)
        x = cupy.asarray(x_h)
        w = cupy.asarray(w_h) if w_h is not None else None
        b = cupy.asarray(b_h) if b_h is not None else None
        stat_tol = 1e-12 if dtype == F64 else 1e-6
        with forced(path):
            n, s = shape[0], int(numpy.prod(shape[1:-1]))
            vec = 16 // dtype.itemsize if c % (16 // dtype.itemsize) == 0 else 1
            geometry = gn._onepass_geometry(n, s, c, g, dtype, vec, path) or gn._split(n, s, c // vec)
            results = []
            for misalign in (False, True):
                if misalign:
                    base = cupy.empty(x.size + 1, dtype=x.dtype)
                    xx = base[1:].reshape(x.shape)
                    xx[...] = x
                    out = cupy.empty(x.size + 1, dtype=x.dtype)[1:].reshape(x.shape)
                    out.fill(numpy.nan)
                else:
                    xx = x
                    out = cupy.full(x.shape, numpy.nan, dtype=x.dtype)
                y, m, r = run(xx, g, w, b, act, out)
                errs = (relative_error(y, ref_y), relative_error(m, ref_m), relative_error(r, ref_r))
                ok = errs[0] <= TOL[dtype] and errs[1] <= stat_tol and errs[2] <= stat_tol
                failures += not ok
                print(f"{'ok  ' if ok else 'FAIL'} {shape} G={g} {dtype.name} w={getattr(w_dtype, 'name', None)} {act} "
                      f"+{offset:g} misalign={misalign} geometry={geometry} errors y/mean/rstd "
                      f"{errs[0]:.2e}/{errs[1]:.2e}/{errs[2]:.2e}")
                results.append(y)
            # In place (x == y).
            xi = x.copy()
            y, _, _ = run(xi, g, w, b, act, out=xi)
            ok = relative_error(y, ref_y) <= TOL[dtype]
            failures += not ok
            if not ok:
                print(f"FAIL in place {shape}")
            # Determinism: repeated runs and other grid sizes give the same bits.
            y0, m0, r0 = run(x, g, w, b, act)
            bits = lambda a: cupy.asnumpy(a).view(numpy.uint8)
            for attempt in range(4):
                y1, m1, r1 = run(x, g, w, b, act)
                same = all(numpy.array_equal(bits(a), bits(a1)) for a, a1 in ((y0, y1), (m0, m1), (r0, r1)))
                if not same:
                    failures += 1
                    print(f"FAIL nondeterministic {shape} run {attempt}")
            for blocks in (1, 7, 33):
                original = force_grid(blocks)
                try:
                    y1, m1, r1 = run(x, g, w, b, act)
                finally:
                    _launch.cooperative_capacity = original
                    _launch._CAPACITY.clear()
                    gn._forward_plan.cache_clear()
                    gn._backward_plan.cache_clear()
                    gn._SIGNATURES.clear()
                same = all(numpy.array_equal(bits(a), bits(a1)) for a, a1 in ((y0, y1), (m0, m1), (r0, r1)))
                if not same:
                    failures += 1
                    print(f"FAIL grid {blocks} changed the bits {shape}")
            failures += check_backward(x_h, x, g, w_h, w, b_h, b, act, m0, r0, rng)
        # The split path agrees within tolerance (not bitwise: another order).
        with forced("split"):
            ys, _, _ = run(x, g, w, b, act)
        print(f"     split vs {path} rel diff {relative_error(ys, cupy.asnumpy(y0).astype(numpy.float64)):.2e}")
    return failures


def check_backward(x_h, x, g, w_h, w, b_h, b, act, mean, rstd, rng):
    """The backward of the forced path against the reference from the same
    statistics, outputs NaN-poisoned; bit-identical over runs and grids."""
    dtype = x.dtype
    dy_h = rng.standard_normal(x.shape).astype(dtype)
    dy = cupy.asarray(dy_h)
    ref = reference.group_norm_backward(dy_h, x_h, cupy.asnumpy(mean), cupy.asnumpy(rstd), g, w_h, b_h, activation=act)

    def backward():
        outs = dict(out=cupy.full(x.shape, numpy.nan, dtype))
        if w is not None:
            outs.update(grad_weight_out=cupy.full(w.shape, numpy.nan, w.dtype),
                        grad_bias_out=cupy.full(b.shape, numpy.nan, b.dtype))
        got = gn.group_norm_backward(dy, x, mean, rstd, g, w, b, activation=act, **outs)
        cupy.cuda.get_current_stream().synchronize()
        return got

    failures = 0
    first = backward()
    errors = [relative_error(got, want) for got, want in zip(first, ref) if want is not None]
    ok = max(errors) <= TOL[dtype]
    failures += not ok
    print(f"{'ok  ' if ok else 'FAIL'}   backward dx/dw/db errors {' '.join(f'{e:.2e}' for e in errors)}")
    bits = lambda a: cupy.asnumpy(a).view(numpy.uint8)
    for blocks in (None, 1, 7, 33):
        original = force_grid(blocks) if blocks else None
        try:
            again = backward()
        finally:
            if original is not None:
                _launch.cooperative_capacity = original
                _launch._CAPACITY.clear()
                gn._backward_plan.cache_clear()
                gn._SIGNATURES.clear()
        if not all(numpy.array_equal(bits(a), bits(a1)) for a, a1 in zip(first, again) if a is not None):
            failures += 1
            print(f"FAIL backward bits changed (grid {blocks or 'default'}) {x.shape}")
    return failures


SD_SHAPES = [(2, 64, 64, 320), (2, 32, 32, 640), (2, 16, 16, 1280), (8, 8, 8, 1280), (1, 128, 128, 128)]


def check_launch_counts():
    """Launches per direction: "fused" (what "auto" takes on a device with
    cooperative launches, but for the cluster forward on sm_90) two, "split"
    three, "onepass" one."""
    failures = 0
    expected = {"fused": (2, 2), "split": (3, 3), "onepass": (1, 1)}
    for shape in SD_SHAPES:
        n, s, c = shape[0], shape[1] * shape[2], shape[3]
        counts = {}
        for path in expected:
            plan = gn._forward_plan(n, s, c, 32, F16, F32, "silu", 1e-5, True, path)
            back = gn._backward_plan(n, s, c, 32, F16, F32, "silu", True, path)
            counts[path] = (len(gn._forward_steps(plan, True, True).launches),
                            len(gn._backward_steps(back).launches))
        auto = gn._path("auto", cupy.cuda.Device().id)  # "auto" (sm_90: the cluster forward where it applies)
        print(f"{shape} fp16: launches (forward, backward) {counts}; auto takes {auto}")
        failures += counts != expected or auto not in ("auto", "fused")
    return failures


def time_gpu(fn, reps=200):
    for _ in range(10):
        fn()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) * 1000)
    return float(numpy.median(times))


def time_graph(fn, calls=20, reps=50):
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fn()  # sizes the workspace of this stream
        stream.synchronize()
        stream.begin_capture()
        for _ in range(calls):
            fn()
        graph = stream.end_capture()
        graph.upload(stream)
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        times = []
        for _ in range(reps):
            start.record(stream)
            graph.launch(stream)
            stop.record(stream)
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop) * 1000 / calls)
    return float(numpy.median(times))


def timing():
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        torch = None
    print(f"\n{'shape':22s} {'dtype':8s} {'act':8s} {'fused':>9s} {'split':>9s} {'graph 2':>9s} {'graph 3':>9s} {'torch NCHW':>10s} {'torch CL':>9s} {'bwd gr 2':>9s} {'bwd gr 3':>9s}  (us)")
    for shape in SD_SHAPES:
        for dtype in (F16, F32):
            for act in ("identity", "silu"):
                x = cupy.random.standard_normal(shape, dtype=numpy.float32).astype(dtype)
                w = cupy.ones(shape[-1], dtype=dtype)
                b = cupy.zeros(shape[-1], dtype=dtype)
                out = cupy.empty_like(x)
                call = lambda: gn.group_norm(x, 32, w, b, activation=act, out=out)
                _, mean, rstd = gn.group_norm(x, 32, w, b, activation=act, return_stats=True)
                dx, dw, db = cupy.empty_like(x), cupy.empty_like(w), cupy.empty_like(b)
                back = lambda: gn.group_norm_backward(x, x, mean, rstd, 32, w, b, activation=act, out=dx,
                                                      grad_weight_out=dw, grad_bias_out=db)
                row = {}
                for path in ("fused", "split"):
                    with forced(path):
                        row[path] = time_gpu(call)
                        row["graph " + path] = time_graph(call)
                        row["bwd graph " + path] = time_graph(back)
                t_nchw = t_cl = float("nan")
                if torch is not None:
                    xt = torch.from_dlpack(x).permute(0, 3, 1, 2)  # channels_last view
                    wt, bt = torch.from_dlpack(w), torch.from_dlpack(b)
                    xn = xt.contiguous()

                    def torch_call(t):
                        y = F.group_norm(t, 32, wt, bt)
                        return F.silu(y) if act == "silu" else y

                    t_nchw = time_gpu(lambda: torch_call(xn))
                    t_cl = time_gpu(lambda: torch_call(xt))
                print(f"{str(shape):22s} {dtype.name:8s} {act:8s} {row['fused']:9.1f} {row['split']:9.1f} "
                      f"{row['graph fused']:9.1f} {row['graph split']:9.1f} {t_nchw:10.1f} {t_cl:9.1f} "
                      f"{row['bwd graph fused']:9.1f} {row['bwd graph split']:9.1f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-time", action="store_true")
    parser.add_argument("--paths", nargs="+", choices=("fused", "onepass"), default=["fused", "onepass"])
    args = parser.parse_args()
    print(cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "cooperative:", _launch.cooperative_supported())
    failures = correctness(args.paths) + check_launch_counts()
    print(f"\ncorrectness: {'all pass' if not failures else f'{failures} FAIL'}")
    if not args.no_time:
        timing()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
