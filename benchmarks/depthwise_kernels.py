"""The NCHW stride-1 kernels that serve one geometry, side by side: the
whole-plane kernel (_depthwise_nchw_plane), the register window kernel
(_depthwise_nchw_window) and the shared-memory tiled kernel, forward and
backward-input, GPU time per launch (CUDA events around 20 launches over 3
rotating copies, after a warm-up pass; the smallest shapes stay in L2) and the
plane kernel's largest difference from the window (or tiled) kernel, relative
to the largest output.  The figures behind _depthwise_nchw_plane.preferred()
come from it (about 10 s on an H200).

    PYTHONPATH=. python benchmarks/depthwise_kernels.py
"""
import cupy
import harness
import numpy

from cupy_dwgn import _validate, _launch, _depthwise_nchw_plane as plane, _depthwise_nchw_window as window
from cupy_dwgn import _depthwise_nchw as generic
from cupy_dwgn._dtypes import bfloat16

SHAPES = [(64, 384, 28, 3), (64, 240, 28, 5), (64, 384, 14, 7), (64, 960, 7, 3), (64, 144, 56, 3), (64, 96, 56, 7),
          (64, 256, 32, 3), (64, 512, 16, 3), (16, 64, 64, 3), (64, 672, 14, 5), (64, 192, 28, 7), (8, 32, 112, 3)]
DTYPES = [numpy.float16, bfloat16, numpy.float32]



def time_launch(launch, arrays_list, reps=20):
    """Mean GPU time per launch (us); one Steps is built for all of them."""
    return harness.steps_time_us(_launch.Steps(((launch, (0, 1, 2, 3)),)), arrays_list, reps)

# The memory floor printed per row: input + output bytes at 4.2 TB/s (about
# the H200's measured copy bandwidth; benchmarks/depthwise.py measures it).
COPY_BYTES_PER_US = 4.2e6


def main():
    for n, c, hw, k in SHAPES:
        g = _validate.conv_geometry((n, c, hw, hw), (c, 1, k, k), 1, k // 2, 1)
        for dtype in DTYPES:
            dt = numpy.dtype(dtype)
            for backward in (False, True):
                copies = 3
                xs = [cupy.random.standard_normal((n, c, hw, hw), dtype=cupy.float32).astype(dt) for _ in range(copies)]
                w = cupy.random.standard_normal((c, 1, k, k), dtype=cupy.float32).astype(dt)
                b = None if backward else cupy.random.standard_normal((c,), dtype=cupy.float32).astype(dt)
                ys = [cupy.full((n, c, hw, hw), numpy.nan, dtype=dt) for _ in range(copies)]
                index = _launch.index_type(xs[0].size, ys[0].size)
                cands = {"plane": plane.plan(g, dt, backward, index, 16, 16),
                         "window": window.plan(g, dt, backward, index, 16, True, cupy.cuda.runtime.getDevice()),
                         "tiled": generic._tiled_plan(g, dt, index, backward) if generic._use_tiled(g, dt) else None}
                res, outs = {}, {}
                for name, launch in cands.items():
                    if launch is None:
                        continue
                    arrays = [(x, w, 0 if b is None else b, y) for x, y in zip(xs, ys)]
                    for y in ys: y.fill(numpy.nan)
                    res[name] = time_launch(launch, arrays)
                    outs[name] = ys[0].astype(numpy.float32).copy()
                ref = outs.get("window", outs.get("tiled"))
                diff = float(cupy.max(cupy.abs(outs["plane"] - ref)) / (cupy.max(cupy.abs(ref)) + 1e-30)) if "plane" in outs and ref is not None else float("nan")
                nans = int(cupy.isnan(outs["plane"]).sum()) if "plane" in outs else -1
                floor = 2 * xs[0].nbytes / COPY_BYTES_PER_US
                shape = f"block {cands['plane'].block[0]}, {cands['plane'].shared_mem} B shared" if cands["plane"] else "plane: n/a"
                print(f"{n}x{c}x{hw} {k}x{k} {dt.name:8} {'bwd' if backward else 'fwd'} floor {floor:6.1f} "
                      + " ".join(f"{kname} {v:6.1f}" for kname, v in res.items())
                      + f"  reldiff {diff:.1e} unwritten {nans}  ({shape})", flush=True)
                del xs, ys


if __name__ == "__main__":
    main()
