"""The NCHW forward and backward-input kernels that serve one geometry, side
by side: the row kernel (_depthwise_nchw_rows), the whole-plane kernel
(_depthwise_nchw_plane), the register window kernel (_depthwise_nchw_window),
the register row walk (_depthwise_nchw_forward_regs, "walk") and the
shared-memory tiled kernel; GPU time per launch (CUDA events around
20 launches over 3 rotating copies, after a warm-up pass; the smallest shapes
stay in L2) and the largest difference of the row and plane kernels and the
walk from the window (or tiled) kernel, relative to the largest output.
Stride 1 both directions, stride 2 forward.  The figures behind
_depthwise_nchw_rows.preferred() and _depthwise_nchw_plane.preferred() come
from it (about 20 s on an H200).

    PYTHONPATH=. python benchmarks/depthwise_kernels.py [--shapes 64x768x12x3x1 ...] [--dtypes float16 ...]
        [--forward-only] [--kernels plane ...] [--walk-strips 4 7 14]

--shapes: N x C x H(=W) x filter size x stride instead of SHAPES (a sweep
of plane sizes, say); --forward-only: no backward-input rows; --kernels:
only these candidates.  Where the plane kernel is compiled for several
destination rows per thread (_depthwise_nchw_plane.row_choices) each also
runs forced (2-byte 5x5: "plane4", "plane7"), beside the rule's pick ("plane").
--walk-strips: the walk also with row strips of exactly these many destination rows ("walk7": no
MAX_STRIP_ROWS cap, no halving), beside the rule's ("walk"): on small planes the rule's long strips
can leave a grid just over one wave of blocks (ncu, H100, 64x240x28 fp16 stride 2: 960 blocks,
1.04 waves, SMs active 68% of the time).
"""
import argparse

import cupy
import harness
import numpy

from cupy_dwgn import _validate, _launch, _depthwise_nchw_plane as plane, _depthwise_nchw_window as window
from cupy_dwgn import _depthwise_nchw_rows as rows
from cupy_dwgn import _depthwise_nchw_forward_regs as walk
from cupy_dwgn import _depthwise_nchw as generic
from cupy_dwgn._dtypes import bfloat16

# (N, C, H = W, filter size, stride); padding K // 2.
SHAPES = [(64, 384, 28, 3, 1), (64, 240, 28, 5, 1), (64, 384, 14, 7, 1), (64, 960, 7, 3, 1), (64, 144, 56, 3, 1),
          (64, 96, 56, 7, 1), (64, 256, 32, 3, 1), (64, 512, 16, 3, 1), (16, 64, 64, 3, 1), (64, 672, 14, 5, 1),
          (64, 192, 28, 7, 1), (8, 32, 112, 3, 1), (64, 960, 7, 5, 1), (64, 384, 14, 3, 1), (64, 1152, 7, 5, 1),
          (256, 960, 7, 3, 1), (8, 960, 7, 3, 1), (64, 512, 8, 3, 1), (64, 672, 14, 5, 2), (64, 576, 14, 3, 2),
          (64, 240, 28, 3, 2), (64, 768, 12, 3, 1), (64, 320, 10, 3, 1)]
DTYPES = [numpy.float16, bfloat16, numpy.float32]



def time_launch(launch, arrays_list, reps=20):
    """Mean GPU time per launch (us); one Steps is built for all of them."""
    return harness.steps_time_us(_launch.Steps(((launch, (0, 1, 2, 3)),)), arrays_list, reps)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=harness.conv_shape, nargs="+", default=SHAPES)
    parser.add_argument("--dtypes", nargs="+", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument("--kernels", nargs="+", choices=["rows", "plane", "window", "walk", "tiled"],
                        help="only these candidates (default: all)")
    parser.add_argument("--walk-strips", type=int, nargs="+", default=[], metavar="ROWS",
                        help="the walk also with row strips of exactly these many rows")
    args = parser.parse_args()
    copy_bytes_per_us = harness.announced_copy_bandwidth()
    dtypes = [d for d in DTYPES if args.dtypes is None or numpy.dtype(d).name in args.dtypes]
    for n, c, hw, k, stride in args.shapes:
        g = _validate.conv_geometry((n, c, hw, hw), (c, 1, k, k), stride, k // 2, 1)
        out_shape = (n, c, g.out_height, g.out_width)
        for dtype in dtypes:
            dt = numpy.dtype(dtype)
            for backward in (False, True) if stride == 1 and not args.forward_only else (False,):
                copies = 3
                src_shape, dst_shape = ((n, c, hw, hw), out_shape)[::-1 if backward else 1]
                xs = [cupy.random.standard_normal(src_shape, dtype=cupy.float32).astype(dt) for _ in range(copies)]
                w = cupy.random.standard_normal((c, 1, k, k), dtype=cupy.float32).astype(dt)
                b = None if backward else cupy.random.standard_normal((c,), dtype=cupy.float32).astype(dt)
                ys = [cupy.full(dst_shape, numpy.nan, dtype=dt) for _ in range(copies)]
                index = _launch.index_type(xs[0].size, ys[0].size)
                cands = {"rows": rows.plan(g, dt, backward, index),
                         "plane": plane.plan(g, dt, backward, index, 16, 16),
                         "window": window.plan(g, dt, backward, index, 16, True),
                         "walk": walk.plan(g, dt, backward, 16, 16),
                         "tiled": (generic._tiled_plan(g, dt, index, backward)
                                   if stride == 1 and generic._use_tiled(g, dt) else None)}
                if cands["walk"] is not None:
                    cands.update({f"walk{rows_}": _walk_with_strips(g, dt, backward, rows_) for rows_ in args.walk_strips})
                choices = plane.row_choices(dt.itemsize, k, stride)
                if cands["plane"] is not None and len(choices) > 1:
                    cands.update({f"plane{r}": plane.plan(g, dt, backward, index, 16, 16, r) for r in choices})
                cands = {name: launch for name, launch in cands.items()
                         if args.kernels is None or name.rstrip("0123456789") in args.kernels}
                res, outs = {}, {}
                for name, launch in cands.items():
                    if launch is None:
                        continue
                    arrays = [(x, w, 0 if b is None else b, y) for x, y in zip(xs, ys)]
                    for y in ys: y.fill(numpy.nan)
                    res[name] = time_launch(launch, arrays)
                    outs[name] = ys[0].astype(numpy.float32).copy()
                # The reference: the window (or tiled) kernel, else the rule's plane kernel for the forced ones.
                # (--kernels without those: the first candidate that ran).
                ref_name = next((name for name in ("window", "tiled", "plane") if name in outs), next(iter(outs), None))
                ref = outs.get(ref_name)
                checks = []
                for name in outs:
                    if name not in ("window", "tiled", ref_name):
                        diff = float(cupy.max(cupy.abs(outs[name] - ref)) / (cupy.max(cupy.abs(ref)) + 1e-30))
                        checks.append(f"{name} reldiff {diff:.1e} unwritten {int(cupy.isnan(outs[name]).sum())}")
                floor = (xs[0].nbytes + ys[0].nbytes) / copy_bytes_per_us
                best = min(res, key=res.get)
                print(f"{n}x{c}x{hw} {k}x{k} s{stride} {dt.name:8} {'bwd' if backward else 'fwd'} floor {floor:6.1f} "
                      + " ".join(f"{kname} {v:6.1f}" for kname, v in res.items())
                      + f"  best {best}  " + "; ".join(checks), flush=True)
                del xs, ys


def _walk_with_strips(g, dtype, backward, strip_rows):
    """The walk's Launch with row strips of exactly ``strip_rows`` destination rows."""
    key = (g.filter_height, dtype.itemsize, g.stride_h)
    saved = walk.MAX_STRIP_ROWS[key], walk.MIN_STRIP_ROWS
    walk.MAX_STRIP_ROWS[key] = walk.MIN_STRIP_ROWS = strip_rows
    try:
        return walk.plan.__wrapped__(g, dtype, backward, 16, 16)  # not the memo: these strips are not the rule's
    finally:
        walk.MAX_STRIP_ROWS[key], walk.MIN_STRIP_ROWS = saved


if __name__ == "__main__":
    main()
