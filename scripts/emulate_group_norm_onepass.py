"""NumPy emulation of dwgn_gn_fwd_onepass (kernels/group_norm.cu): the work
split and reduction order of its three phases, float32 where the kernel uses
Acc = float, float64 where it uses double.  Checks that the split (taken from
cupy_dwgn._group_norm._onepass_geometry, the code the plan uses) reproduces
the float64 reference on awkward shapes, that every element is covered once,
and that the result does not depend on the grid size.

No GPU needed:  PYTHONPATH=. python scripts/emulate_group_norm_onepass.py
"""

import sys

import numpy

from cupy_dwgn import _dtypes, reference
from cupy_dwgn import _group_norm as gn

F32 = numpy.float32
TOLERANCE = {  # tests/_helpers.py
    numpy.dtype(numpy.float64): 1e-12,
    numpy.dtype(numpy.float32): 1e-5,
    numpy.dtype(numpy.float16): 2e-3,
    _dtypes.bfloat16: 1.6e-2,
}


def lane_rows(row0, row1, lane, lanes):
    span = row1 - row0 - lane
    return (span + lanes - 1) // lanes if span > 0 else 0


def act(z, name):
    if name == "identity":
        return z
    if name == "relu":
        return numpy.maximum(z, 0)
    if name == "silu":
        return z / (1 + numpy.exp(-z))
    raise ValueError(name)


def act_grad(z, name):
    if name == "identity":
        return numpy.ones_like(z)
    if name == "relu":
        return (z > 0).astype(z.dtype)
    if name == "silu":
        s = 1 / (1 + numpy.exp(-z))
        return s * (1 + z * (1 - s))
    raise ValueError(name)


def phase1_item(x, n, chunk, rows_per_chunk, lanes, rb, acc):
    """One block's (n, chunk) item: per lane Welford in Acc (batches of rb
    rows, one Chan merge per batch) beside the double sum; lanes combined by
    the parallel-axis theorem in double, lane 0 first.  Returns (sum, M2) per
    channel."""
    S, C = x.shape[1], x.shape[2]
    row0 = chunk * rows_per_chunk
    row1 = min(S, row0 + rows_per_chunk)
    lane_sum = numpy.zeros((lanes, C))
    lane_m2 = numpy.zeros((lanes, C), dtype=acc)
    for lane in range(lanes):
        count = lane_rows(row0, row1, lane, lanes)
        if count == 0:
            continue
        rows = x[n, row0 + lane : row1 : lanes].astype(acc)  # this lane's rows, in order
        assert rows.shape[0] == count
        mean = numpy.zeros(C, acc)
        m2 = numpy.zeros(C, acc)
        s = numpy.zeros(C)
        seen = acc(0)
        k = 0
        while k + rb <= count:
            v = rows[k : k + rb]
            previous = seen
            seen = acc(seen + rb)
            weight = acc(acc(rb) * acc(1) / seen)  # __frcp_rn: correctly rounded 1/seen
            batch_sum = numpy.zeros(C, acc)
            batch_wide = numpy.zeros(C)
            for r in range(rb):
                batch_sum = (batch_sum + v[r]).astype(acc)
                batch_wide = batch_wide + v[r].astype(numpy.float64)
            batch_mean = (batch_sum * acc(1.0 / rb)).astype(acc)
            batch_m2 = numpy.zeros(C, acc)
            for r in range(rb):
                d = (v[r] - batch_mean).astype(acc)
                batch_m2 = (batch_m2 + d * d).astype(acc)
            s = s + batch_wide
            delta = (batch_mean - mean).astype(acc)
            mean = (mean + delta * weight).astype(acc)
            m2 = (m2 + (batch_m2 + delta * delta * previous * weight)).astype(acc)
            k += rb
        while k < count:
            value = rows[k]
            s = s + value.astype(numpy.float64)
            seen = acc(seen + 1)
            inv = acc(acc(1) / seen)
            delta = (value - mean).astype(acc)
            mean = (mean + delta * inv).astype(acc)
            m2 = (m2 + delta * (value - mean)).astype(acc)
            k += 1
        lane_sum[lane] = s
        lane_m2[lane] = m2
    total = numpy.zeros(C)
    for j in range(lanes):
        total = total + lane_sum[j]
    m = total / (row1 - row0)
    piece_m2 = numpy.zeros(C)
    for j in range(lanes):
        n_j = lane_rows(row0, row1, j, lanes)
        if n_j > 0:
            d = lane_sum[j] - n_j * m
            piece_m2 = piece_m2 + lane_m2[j].astype(numpy.float64) + d * d / n_j
    return total, piece_m2, row1 - row0


def block_sum(values, block):
    """Thread-strided sums, then the threads in order (the GPU's butterfly
    order differs only in rounding of a double sum)."""
    per_thread = [sum(values[t::block], 0.0) for t in range(block)]
    return float(numpy.sum(per_thread))


def emulate(x, G, weight, bias, eps, activation, grid):
    N, S, C = x.shape
    dtype = x.dtype
    acc = numpy.float64 if dtype == numpy.float64 else F32
    vec = 16 // dtype.itemsize if C % (16 // dtype.itemsize) == 0 else 1
    geometry = gn._onepass_geometry(N, S, C, G, dtype, vec, "onepass")
    assert geometry is not None, (x.shape, dtype)
    block, rows_per_chunk, num_chunks, _ = geometry
    cols = C // vec
    lanes = block // cols
    rb = 4 if vec >= 8 else 8
    assert block % 32 == 0 and lanes >= 1 and lanes * C <= gn._ONEPASS_SLOTS
    # Phase 1, blocks striding over the items in the order block b, b + grid, ...
    partial = numpy.full((N, num_chunks, 2, C), numpy.nan)
    rows_of = numpy.zeros(num_chunks)
    covered = numpy.zeros((N, S), dtype=int)
    for b in range(grid):
        for item in range(b, N * num_chunks, grid):
            n, chunk = divmod(item, num_chunks)
            total, m2, rows = phase1_item(x, n, chunk, rows_per_chunk, lanes, rb, acc)
            partial[n, chunk, 0], partial[n, chunk, 1] = total, m2
            rows_of[chunk] = rows
            covered[n, chunk * rows_per_chunk : chunk * rows_per_chunk + rows] += 1
    assert (covered == 1).all(), "phase 1 must cover every row exactly once"
    assert not numpy.isnan(partial).any()
    # Phase 2 (gn::finalize_group), item (n, g).
    D = C // G
    mean = numpy.zeros((N, G), acc)
    rstd = numpy.zeros((N, G), acc)
    ws = numpy.zeros((N, 3, C), acc)
    for n in range(N):
        for g in range(G):
            items = [(i // D, g * D + i % D) for i in range(D * num_chunks)]
            total = block_sum([partial[n, k, 0, c] for k, c in items], block)
            m = total / (S * D)
            terms = []
            for k, c in items:
                rows = min(S - k * rows_per_chunk, rows_per_chunk)
                d = partial[n, k, 0, c] - rows * m
                terms.append(partial[n, k, 1, c] + d * d / rows)
            var = block_sum(terms, block) / (S * D)
            r = 1.0 / numpy.sqrt(var + float(acc(eps)))
            mean[n, g], rstd[n, g] = m, r
            hi = acc(m)
            lo = m - float(hi)
            for c in range(g * D, (g + 1) * D):
                scale = acc(acc(r) * acc(weight[c])) if weight is not None else acc(r)
                b0 = acc(bias[c]) if bias is not None else acc(0)
                ws[n, :, c] = hi, scale, acc(float(b0) - lo * float(scale))
    # Phase 3.
    z = ((x.astype(acc) - ws[:, None, 0]) * ws[:, None, 1] + ws[:, None, 2]).astype(acc)
    y = act(z, activation).astype(acc).astype(dtype)
    return y, mean, rstd, geometry


def emulate_backward(x, dy, G, weight, bias, mean, rstd, activation, grid):
    """dwgn_gn_bwd_onepass: phase 1 per (n, chunk) item, each lane summing its
    rows in order in Acc, lanes added in order; phase 2 gn::bwd_finalize_item
    per (g, y); phase 3 dx.  Returns (dx, dw, db, geometry)."""
    N, S, C = x.shape
    dtype = x.dtype
    acc = numpy.float64 if dtype == numpy.float64 else F32
    vec = 16 // dtype.itemsize if C % (16 // dtype.itemsize) == 0 else 1
    geometry = gn._onepass_geometry(N, S, C, G, dtype, vec, "onepass", backward=True)
    assert geometry is not None, (x.shape, dtype)
    block, rows_per_chunk, num_chunks, _ = geometry
    cols = C // vec
    lanes = block // cols
    assert block % 32 == 0 and block <= 256 and lanes >= 1 and lanes * C <= gn._ONEPASS_SLOTS
    D = C // G
    group_of = numpy.arange(C) // D
    w = weight.astype(acc) if weight is not None else numpy.ones(C, acc)
    b = bias.astype(acc) if bias is not None else numpy.zeros(C, acc)
    partial = numpy.full((N, num_chunks, 2, C), numpy.nan, acc)
    covered = numpy.zeros((N, S), dtype=int)
    for blk in range(grid):
        for item in range(blk, N * num_chunks, grid):
            n, chunk = divmod(item, num_chunks)
            row0 = chunk * rows_per_chunk
            row1 = min(S, row0 + rows_per_chunk)
            m, r = mean[n, group_of].astype(acc), rstd[n, group_of].astype(acc)
            scale = (r * w).astype(acc)
            lane_a = numpy.zeros((lanes, C), acc)
            lane_b = numpy.zeros((lanes, C), acc)
            for lane in range(lanes):
                for row in range(row0 + lane, row1, lanes):  # this lane's rows, in order
                    covered[n, row] += 1
                    centered = (x[n, row].astype(acc) - m).astype(acc)
                    dz = (dy[n, row].astype(acc) * act_grad((centered * scale + b).astype(acc), activation)).astype(acc)
                    lane_a[lane] = (lane_a[lane] + dz).astype(acc)
                    lane_b[lane] = (lane_b[lane] + dz * (centered * r).astype(acc)).astype(acc)
            total_a = numpy.zeros(C, acc)
            total_b = numpy.zeros(C, acc)
            for j in range(lanes):
                total_a = (total_a + lane_a[j]).astype(acc)
                total_b = (total_b + lane_b[j]).astype(acc)
            partial[n, chunk, 0], partial[n, chunk, 1] = total_a, total_b
    assert (covered == 1).all(), "phase 1 must cover every row exactly once"
    assert not numpy.isnan(partial).any()
    # Phase 2: per (n, g) c1, c2 (block sums; float64 here, the GPU's Acc
    # order differs only in rounding), and dw, db over every (n, chunk) row.
    ws = numpy.zeros((N, 5, C), acc)
    for n in range(N):
        for g in range(G):
            cs = slice(g * D, (g + 1) * D)
            v0 = float((w[cs] * partial[n, :, 0, cs]).astype(numpy.float64).sum())
            v1 = float((w[cs] * partial[n, :, 1, cs]).astype(numpy.float64).sum())
            m, r = acc(mean[n, g]), acc(rstd[n, g])
            ws[n, 0, cs], ws[n, 1, cs], ws[n, 2, cs] = m, (r * w[cs]).astype(acc), b[cs]
            ws[n, 3, cs] = acc(r * v0 / (S * D))
            ws[n, 4, cs] = acc(r * (r * v1 / (S * D)))
    db = partial[:, :, 0].reshape(-1, C).astype(numpy.float64).sum(0)
    dw = partial[:, :, 1].reshape(-1, C).astype(numpy.float64).sum(0)
    # Phase 3.
    centered = (x.astype(acc) - ws[:, None, 0]).astype(acc)
    dz = (dy.astype(acc) * act_grad((centered * ws[:, None, 1] + ws[:, None, 2]).astype(acc), activation)).astype(acc)
    dx = (ws[:, None, 1] * dz - ws[:, None, 3] - centered * ws[:, None, 4]).astype(acc).astype(dtype)
    return dx, dw, db, geometry


def relative_error(got, ref):
    got = numpy.asarray(got, dtype=numpy.float64)
    ref = numpy.asarray(ref, dtype=numpy.float64)
    assert numpy.isfinite(got).all()
    return float(numpy.linalg.norm(got - ref) / max(numpy.linalg.norm(ref), 1e-300))


CASES = [
    # (N, S, C, G, dtype, offset, activation, affine)
    (1, 13, 15, 5, numpy.float32, 0.0, "identity", True),  # scalar path, D = 3, S prime
    (3, 97, 96, 32, numpy.float16, 0.0, "silu", True),  # D = 3, S prime, vec 8
    (1, 1009, 40, 8, numpy.float32, 1000.0, "identity", False),  # 1000 + randn, S prime
    (2, 4096, 320, 32, numpy.float16, 0.0, "silu", True),  # SD 2x64x64x320
    (2, 256, 1280, 32, numpy.float16, 0.0, "identity", True),  # SD 2x16x16x1280
    (1, 1, 8, 2, numpy.float32, 0.0, "relu", True),  # one row
    (5, 33, 99, 33, numpy.float32, 0.0, "identity", True),  # C odd: scalar path, lanes rows uneven
    (1, 777, 24, 8, numpy.float64, 0.0, "silu", True),  # double, D = 3
    (2, 531, 200, 40, _dtypes.bfloat16, 0.0, "relu", True),  # D = 5, cols 25
    (1, 100003, 8, 4, numpy.float32, 5.0, "identity", True),  # long rows, D = 2
]


def main():
    rng = numpy.random.default_rng(0)
    failures = 0
    for N, S, C, G, dtype, offset, activation, affine in CASES:
        dtype = numpy.dtype(dtype)
        x = (offset + rng.standard_normal((N, S, C))).astype(dtype)
        weight = (1 + 0.1 * rng.standard_normal(C)).astype(F32) if affine else None
        bias = (0.1 * rng.standard_normal(C)).astype(F32) if affine else None
        if dtype == numpy.float64 and affine:
            weight, bias = weight.astype(numpy.float64), bias.astype(numpy.float64)
        results = {}
        for grid in (1, 7, 1 << 20):  # the result must not depend on the grid
            results[grid] = emulate(x, G, weight, bias, 1e-5, activation, grid)
        y, mean, rstd, geometry = results[1]
        for grid, (y2, mean2, rstd2, _) in results.items():
            same = (
                numpy.array_equal(y.view(numpy.uint8), y2.view(numpy.uint8))
                and numpy.array_equal(mean, mean2) and numpy.array_equal(rstd, rstd2)
            )
            assert same, f"grid {grid} changed the result"
        ref_y, ref_mean, ref_rstd = reference.group_norm(
            x, G, weight, bias, activation=activation, return_stats=True
        )
        tol = TOLERANCE[dtype]
        errors = (relative_error(y, ref_y), relative_error(mean, ref_mean), relative_error(rstd, ref_rstd))
        # mean/rstd are stored in Acc: their bound is Acc's (float32 or float64).
        stat_tol = 1e-12 if dtype == numpy.float64 else 1e-6
        ok = errors[0] <= tol and errors[1] <= stat_tol and errors[2] <= stat_tol
        failures += not ok
        print(
            f"{'ok  ' if ok else 'FAIL'} N={N} S={S} C={C} G={G} {dtype.name:8s} +{offset:g} {activation:8s} "
            f"(block, rows/chunk, chunks)={geometry}  rel err y {errors[0]:.2e} (tol {tol:g}) "
            f"mean {errors[1]:.2e} rstd {errors[2]:.2e}; grid-independent"
        )
        # The backward, from the emulated forward's statistics.
        if S * N <= 20000:  # the row-by-row emulation is slow
            dy = rng.standard_normal((N, S, C)).astype(dtype)
            back = {grid: emulate_backward(x, dy, G, weight, bias, mean, rstd, activation, grid) for grid in (1, 5)}
            for got, again in zip(back[1][:3], back[5][:3]):
                assert numpy.array_equal(got, again), "grid changed the backward"
            ref = reference.group_norm_backward(dy, x, mean, rstd, G, weight, bias, activation=activation)
            names = ("dx", "dw", "db")
            bwd_errors = {name: relative_error(got, want) for name, got, want in zip(names, back[1][:3], ref)
                          if want is not None}
            bwd_ok = all(e <= tol for e in bwd_errors.values())
            failures += not bwd_ok
            print(f"{'ok  ' if bwd_ok else 'FAIL'}   backward (block, rows/chunk, chunks)={back[1][3]}  "
                  + "  ".join(f"{k} {v:.2e}" for k, v in bwd_errors.items()) + "; grid-independent")
    print("all cases pass" if not failures else f"{failures} cases FAIL")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
