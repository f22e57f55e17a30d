"""Every forward and backward-input kernel that serves a geometry, side by
side, in both layouts, beside PyTorch: the view the dispatch rules are read
from.  Per (shape, dtype, direction, layout) one line: the GPU time per launch
of each kernel that serves the call (CUDA events around 20 launches over 3
rotating copies, after a warm-up pass), the kernel the ops take and the
fastest one, its fraction of the copy floor (input + output bytes at the
bandwidth measured at the start), PyTorch's time in both memory formats
(conv2d / aten.convolution_backward, cudnn.benchmark on, as depthwise.py
times them: CUDA events around batches over rotating copies, median),
and each kernel's largest difference from the one the ops take, relative to
the largest output, with any output left unwritten (NaN) counted.

    PYTHONPATH=.:benchmarks python benchmarks/depthwise_candidates.py --shapes 64x40x150x3x1 ...
        [--dtypes float16 ...] [--layouts NHWC] [--forward-only] [--no-torch] [--mma-variants 4:48 2:96 2:48:1 ...]

Shapes: N x C x H(=W) x filter size x stride ("same" padding K // 2).  The
NHWC ring kernel is timed as the ops plan it (under the device's opt-in
shared-memory limit where its rows need it).  Results of 2026-12-04:
results/depthwise_kernel_candidates_h200_2026-12-04.txt.
"""
import argparse

import cupy
import depthwise as depthwise_table  # benchmarks/depthwise.py: PyTorch's calls as the table times them
import harness
import numpy

from cupy_dwgn import _launch, _validate, depthwise
from cupy_dwgn import _depthwise_nchw as nchw_generic
from cupy_dwgn import _depthwise_nchw_forward_regs as nchw_walk
from cupy_dwgn import _depthwise_conv_mma as conv_mma
from cupy_dwgn import _depthwise_nchw_plane as nchw_plane
from cupy_dwgn import _depthwise_nchw_rows as nchw_rows
from cupy_dwgn import _depthwise_nchw_window as nchw_window
from cupy_dwgn import _depthwise_nhwc as nhwc_generic
from cupy_dwgn import _depthwise_nhwc_direct as nhwc_direct
from cupy_dwgn import _depthwise_nhwc_ring as nhwc_ring
from cupy_dwgn import _depthwise_nhwc_window as nhwc_window
from cupy_dwgn._dtypes import bfloat16

DTYPES = {"float16": numpy.dtype(numpy.float16), "bfloat16": bfloat16, "float32": numpy.dtype(numpy.float32)}
COPIES = 3


def _nhwc_tiled(g, dtype, backward, index):
    if backward:
        launch, forward_kernel = nhwc_generic.backward_input_plan(g, dtype, index, True)
        return launch if forward_kernel else None  # the gather kernel takes other arguments
    return nhwc_generic.forward_plan(g, dtype, index, True)[0]


# layout -> kernel name -> plan(g, dtype, backward, index) for 16-byte aligned
# arrays (None where the kernel does not serve the call); arguments of every
# launch: (src, weight, bias or 0, dst).
CANDIDATES = {
    "NCHW": {
        "mma": lambda g, dt, bw, index: conv_mma.plan(g, dt, bw, "NCHW", index, 16, 16),
        "rows": lambda g, dt, bw, index: nchw_rows.plan(g, dt, bw, index),
        "walk": lambda g, dt, bw, index: nchw_walk.plan(g, dt, bw, 16, 16),
        "plane": lambda g, dt, bw, index: nchw_plane.plan(g, dt, bw, index, 16, 16),
        "window": lambda g, dt, bw, index: nchw_window.plan(g, dt, bw, index, 16, True),
        "tiled": lambda g, dt, bw, index: (nchw_generic._tiled_plan(g, dt, index, bw)
                                           if g.stride_h == 1 and nchw_generic._use_tiled(g, dt) else None),
    },
    "NHWC": {
        "mma": lambda g, dt, bw, index: conv_mma.plan(g, dt, bw, "NHWC", index, 16, 16),
        "ring": lambda g, dt, bw, index: nhwc_ring.plan_on_device(g, dt, bw, index, 16, 16),
        "direct": lambda g, dt, bw, index: nhwc_direct.plan(g, dt, bw, index, 16, 16),
        # With the channel group its rule gives (what the ops launch; GROUP where the rule declines it):
        # before 2026-12-07 this timed group 1 only, so fp32 5x5 (group 2) and half 3x3 on 56x56 and larger
        # (group 4) read slower than the ops' window (H100 64x240x28 fp32 5x5: 93.6 us against 67.3 in the table).
        "window": lambda g, dt, bw, index: nhwc_window.plan(g, dt, bw, index, 16, 16,
                                                            nhwc_window.preferred(g, dt, bw) or nhwc_window.GROUP),
        "tiled": _nhwc_tiled,
    },
}


def mma_variants(specs):
    """Candidates of the tensor-core kernel with other unit sizes: each spec
    "ITEMS:KB[:BUFFERS]" plans it with ITEMS_PER_WARP = ITEMS, SHARED_TARGET
    = KB kilobytes and NCHW_BUFFERS = NHWC_BUFFERS = BUFFERS (default 2; named
    mma<ITEMS>:<KB>K[:<BUFFERS>b]), for tuning its rule."""
    def planner(items, kilobytes, buffers, layout):
        def plan(g, dt, bw, index):
            names = ("ITEMS_PER_WARP", "SHARED_TARGET", "NCHW_BUFFERS", "NHWC_BUFFERS")
            saved = [getattr(conv_mma, name) for name in names]
            for name, value in zip(names, (items, kilobytes * 1024, buffers, buffers)):
                setattr(conv_mma, name, value)
            try:
                return conv_mma.plan.__wrapped__(g, dt, bw, layout, index, 16, 16)
            finally:
                for name, value in zip(names, saved):
                    setattr(conv_mma, name, value)
        return plan

    for spec in specs:
        items, kilobytes, *rest = (int(v) for v in spec.split(":"))
        buffers = rest[0] if rest else 2
        for layout in CANDIDATES:
            name = f"mma{items}:{kilobytes}K" + (f":{buffers}b" if rest else "")
            CANDIDATES[layout][name] = planner(items, kilobytes, buffers, layout)


def launch_config(launch):
    """What makes two launches one kernel run: the name expression, grid,
    block, dynamic shared memory and scalar arguments (by type and value)."""
    return launch.expression, launch.grid, launch.block, launch.shared_mem, tuple(map(repr, launch.scalars))


def taken_candidate(candidates, taken):
    """The name of the launch among ``candidates`` (name -> Launch or None)
    that is the ops' launch ``taken`` in every setting, or None: the line's
    "ops take" names a candidate only where its time is the ops' time."""
    return next((name for name, launch in candidates.items()
                 if launch is not None and launch_config(launch) == launch_config(taken)), None)


def torch_times(torch, n, c, hw, k, stride, dtype, backward):
    """PyTorch's us per call in each memory format, measured as the table
    measures it (depthwise.py: its CaseData and calls, time_us over rotating
    copies)."""
    data = depthwise_table.CaseData(torch, n, c, hw, k, stride, dtype.name, COPIES)
    direction = "backward_input" if backward else "forward"
    return {fmt: harness.time_us(harness.rotating([depthwise_table.torch_call(torch, data, direction, fmt, i)
                                                   for i in range(COPIES)]))
            for fmt in ("NCHW", "channels_last")}


def measure(n, c, hw, k, stride, dtype, backward, layout, bytes_per_us, torch):
    """One line of the table."""
    g = _validate.conv_geometry((n, c, hw, hw) if layout == "NCHW" else (n, hw, hw, c), (c, 1, k, k), stride, k // 2,
                                1, layout=layout)
    x_shape = (n, c, hw, hw) if layout == "NCHW" else (n, hw, hw, c)
    y_shape = (n, c, g.out_height, g.out_width) if layout == "NCHW" else (n, g.out_height, g.out_width, c)
    src_shape, dst_shape = (y_shape, x_shape) if backward else (x_shape, y_shape)
    srcs = [cupy.random.standard_normal(src_shape, dtype=cupy.float32).astype(dtype) for _ in range(COPIES)]
    w = cupy.random.standard_normal((c, 1, k, k), dtype=cupy.float32).astype(dtype)
    b = 0 if backward else cupy.random.standard_normal((c,), dtype=cupy.float32).astype(dtype)
    arrays = [(s, w, b, cupy.full(dst_shape, numpy.nan, dtype=dtype)) for s in srcs]
    index = _launch.index_type(srcs[0].size, arrays[0][3].size)
    build = depthwise._backward_input_steps if backward else depthwise._forward_steps
    taken = build(g, layout, srcs[0], arrays[0][3]).launches[0]
    launches = {name: plan(g, dtype, backward, index) for name, plan in CANDIDATES[layout].items()}
    taken_name = taken_candidate(launches, taken)
    times, outputs = {}, {}
    for name, launch in launches.items():
        if launch is None:
            continue
        for a in arrays:
            a[3].fill(numpy.nan)
        times[name] = harness.steps_time_us(_launch.Steps(((launch, (0, 1, 2, 3)),)), arrays)
        outputs[name] = arrays[0][3].astype(numpy.float32)
    floor = (srcs[0].nbytes + arrays[0][3].nbytes) / bytes_per_us
    best = min(times, key=times.get)
    ref = outputs.get(taken_name, outputs[best])
    scale = float(cupy.max(cupy.abs(ref))) or 1.0
    checks = [f"{name} {float(cupy.max(cupy.abs(out - ref))) / scale:.0e}"
              + (f" unwritten {int(cupy.isnan(out).sum())}" if cupy.isnan(out).any() else "")
              for name, out in outputs.items() if name != taken_name]
    line = (f"{n}x{c}x{hw} {k}x{k} s{stride} {dtype.name:8} {'bwd' if backward else 'fwd'} {layout} "
            f"floor {floor:6.1f} | " + " ".join(f"{name} {t:6.1f}" for name, t in times.items())
            + f" | ops take {taken_name or taken.expression.split('<')[0]}, best {best} ({floor / times[best]:.0%})")
    if torch is not None:
        pt = torch_times(torch, n, c, hw, k, stride, dtype, backward)
        line += f" | PyTorch NCHW {pt['NCHW']:.1f} CL {pt['channels_last']:.1f} ratio {min(pt.values()) / times[best]:.2f}"
    return line + (" | diff vs the ops' pick: " + ", ".join(checks) if checks else "")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=harness.conv_shape, nargs="+", required=True, metavar="NxCxHxKxS")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["float16", "float32"])
    parser.add_argument("--layouts", nargs="+", choices=list(CANDIDATES), default=list(CANDIDATES))
    parser.add_argument("--forward-only", action="store_true", help="no backward-input lines")
    parser.add_argument("--no-torch", action="store_true", help="leave PyTorch out")
    parser.add_argument("--mma-variants", nargs="+", default=[], metavar="ITEMS:KB[:BUFFERS]",
                        help="also the tensor-core kernel with ITEMS_PER_WARP = ITEMS, SHARED_TARGET = KB kilobytes "
                             "(and NCHW_BUFFERS = BUFFERS)")
    args = parser.parse_args()
    mma_variants(args.mma_variants)
    torch = None
    if not args.no_torch:
        import torch

        torch.backends.cudnn.benchmark = True
    bytes_per_us = harness.announced_copy_bandwidth()
    for n, c, hw, k, stride in args.shapes:
        for dtype_name in args.dtypes:
            for backward in (False,) if stride != 1 or args.forward_only else (False, True):
                for layout in args.layouts:
                    print(measure(n, c, hw, k, stride, DTYPES[dtype_name], backward, layout, bytes_per_us, torch),
                          flush=True)


if __name__ == "__main__":
    main()
