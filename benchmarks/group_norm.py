"""GroupNorm (channels-last, fused activation) next to PyTorch, on the shapes of
Stable Diffusion / SDXL U-Nets and VAEs (CASES below), G = 32.

Every case x dtype (float32, float16, bfloat16) x activation (identity, silu):

* directions: forward, backward (ours only: PyTorch has no backward-only call)
  and forward+backward;
* two timings (benchmarks/README.md, Results): ``eager``, a Python loop of calls between CUDA
  events (what a training loop sees, host cost included where it exceeds the
  GPU time), and ``gpu``, a CUDA graph of one call per rotating input copy,
  replayed (kernel time without host cost);
* ours on NHWC arrays, and PyTorch ``group_norm`` + activation on an NCHW
  tensor and on a channels_last tensor of the same data;
* floors at the copy bandwidth measured in the same run: forward 2 passes
  (read x, write y), backward 3 (read x and grad_out, write grad_x),
  forward+backward 5;
* our kernel launches per call (PyTorch's CUPTI profiler counts them).

Tensors smaller than 2x the L2 rotate through copies, so no call finds its
input in L2.  The CLIFF cases (H*W prime, C/G odd) are compared per byte with
the aligned case of similar size (target: within 1.5x).

    PYTHONPATH=.:benchmarks python benchmarks/group_norm.py [--json F] [--png F]
        [--cases 2x64x64x320 ...] [--dtypes float16 ...] [--activations silu ...] [--quick]
"""

import argparse
import sys

import cupy
import numpy

import cupy_dwgn
from cupy_dwgn import _dtypes
from harness import (kernel_profile, plot_safely, results_document, results_path, rotating, run_facts, time_us,
                     write_json)

L2_BYTES = 60 * 2**20  # H100/H200 L2 (the copies below only need an upper bound)
GROUPS = 32

#: (N, H, W, C): the issue-9 table (SD 1.x/2.x U-Net 64x64 latents; SDXL
#: 128x128 latents; SD VAE decoder 512x512 and 1024x1024 images).
CASES = [
    (2, 64, 64, 320), (2, 32, 32, 640), (2, 16, 16, 1280), (8, 8, 8, 1280), (1, 512, 512, 128),
    (1, 256, 256, 256), (8, 128, 128, 320), (1, 1024, 1024, 128), (4, 64, 64, 2560),
]
#: Awkward shapes and the aligned case each is compared with (time per byte).
CLIFF = {
    (2, 1, 4093, 320): (2, 64, 64, 320),  # H*W = 4093, prime (and not a multiple of 8)
    (2, 64, 64, 352): (2, 64, 64, 320),  # C/G = 11, odd
    (8, 127, 127, 320): (8, 128, 128, 320),  # H*W = 16129, odd
}
DTYPES = ("float32", "float16", "bfloat16")
ACTIVATIONS = ("identity", "silu")
#: SD-size tensors (2-20 MB): the GPU-time targets apply to these.
SD_BYTES = (2 * 2**20, 20 * 2**20)


def _name(shape):
    return "x".join(map(str, shape))


def _graph_us(calls, warmup_calls=(), repeat=30):
    """GPU time per call of ``calls`` captured once in a CUDA graph on a
    non-blocking CuPy stream and replayed (``warmup_calls`` run first on that
    stream: compiles, sizes the per-stream workspace)."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for call in (*warmup_calls, *calls):
            call()
        stream.synchronize()
        stream.begin_capture()
        for call in calls:
            call()
        graph = stream.end_capture()
        graph.launch(stream)
        us = time_us(lambda: graph.launch(stream), warmup=2, repeat=repeat)
        stream.synchronize()
    return us / len(calls)


def _torch_graph_us(torch, calls, repeat=30):
    """GPU time per call of ``calls`` (PyTorch work) captured in a torch CUDA
    graph (after a warm-up on a side stream, as torch.cuda.graphs asks) and
    replayed on the legacy default stream, which the CuPy events time."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    us = time_us(graph.replay, warmup=2, repeat=repeat)
    del graph
    return us / len(calls)


class Case:
    """The buffers of one (shape, dtype, activation) cell: rotating input
    copies, preallocated outputs (for the graphs), PyTorch views and copies."""

    def __init__(self, torch, shape, dtype, activation):
        self.shape, self.dtype, self.activation = shape, numpy.dtype(dtype), activation
        n, h, w, c = shape
        self.nbytes = n * h * w * c * self.dtype.itemsize
        self.copies = max(1, -(-2 * L2_BYTES // self.nbytes))
        cupy.random.seed(0)

        def random(shape_, offset=0.0):
            return (cupy.random.standard_normal(shape_, dtype=cupy.float32) + offset).astype(self.dtype)

        self.xs = [random(shape, 3.0) for _ in range(self.copies)]
        self.dys = [random(shape) for _ in range(self.copies)]
        w_dtype = numpy.float32 if self.dtype.itemsize == 2 else self.dtype  # our mixed precision
        self.w = (1.0 + 0.1 * cupy.random.standard_normal(c, dtype=cupy.float32)).astype(w_dtype)
        self.b = (0.1 * cupy.random.standard_normal(c, dtype=cupy.float32)).astype(w_dtype)
        stats = (n, GROUPS)
        acc = _dtypes.accumulator_dtype(self.dtype)
        self.ys = [cupy.empty_like(x) for x in self.xs]
        self.means = [cupy.empty(stats, acc) for _ in self.xs]
        self.rstds = [cupy.empty(stats, acc) for _ in self.xs]
        self.dxs = [cupy.empty_like(x) for x in self.xs]
        self.dws = [cupy.empty_like(self.w) for _ in self.xs]
        self.dbs = [cupy.empty_like(self.b) for _ in self.xs]
        for i in range(self.copies):  # statistics for the backward-only calls
            self.forward_into(i)()
        # PyTorch: channels_last tensors on our buffers (NCHW-shaped views of
        # NHWC data), NCHW copies, weights in x's dtype (its group_norm wants them so).
        t_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[self.dtype.name]
        self.t_cl = [torch.from_dlpack(x).permute(0, 3, 1, 2).requires_grad_(True) for x in self.xs]
        self.t_dy_cl = [torch.from_dlpack(dy).permute(0, 3, 1, 2) for dy in self.dys]
        self.t_nchw = [t.detach().contiguous().requires_grad_(True) for t in self.t_cl]
        self.t_dy_nchw = [t.contiguous() for t in self.t_dy_cl]
        self.tw = torch.from_dlpack(self.w).to(t_dtype).requires_grad_(True)
        self.tb = torch.from_dlpack(self.b).to(t_dtype).requires_grad_(True)
        self.torch = torch

    # -- ours ------------------------------------------------------------
    def forward(self, i):
        return lambda: cupy_dwgn.group_norm(self.xs[i], GROUPS, self.w, self.b, activation=self.activation)

    def forward_into(self, i):
        return lambda: cupy_dwgn.group_norm(
            self.xs[i], GROUPS, self.w, self.b, activation=self.activation, out=self.ys[i],
            mean_out=self.means[i], rstd_out=self.rstds[i],
        )

    def backward(self, i, into=False):
        outputs = dict(out=self.dxs[i], grad_weight_out=self.dws[i], grad_bias_out=self.dbs[i]) if into else {}
        return lambda: cupy_dwgn.group_norm_backward(
            self.dys[i], self.xs[i], self.means[i], self.rstds[i], GROUPS, self.w, self.b,
            activation=self.activation, **outputs,
        )

    def forward_backward(self, i, into=False):
        if into:
            forward, backward = self.forward_into(i), self.backward(i, into=True)

            def call():
                forward()
                backward()
            return call

        def call():
            _, mean, rstd = cupy_dwgn.group_norm(
                self.xs[i], GROUPS, self.w, self.b, activation=self.activation, return_stats=True
            )
            cupy_dwgn.group_norm_backward(
                self.dys[i], self.xs[i], mean, rstd, GROUPS, self.w, self.b, activation=self.activation
            )
        return call

    # -- PyTorch ---------------------------------------------------------
    def _torch_y(self, x):
        torch = self.torch
        y = torch.nn.functional.group_norm(x, GROUPS, self.tw, self.tb)
        return torch.nn.functional.silu(y) if self.activation == "silu" else y

    def torch_forward(self, i, channels_last):
        x = (self.t_cl if channels_last else self.t_nchw)[i]

        def call():
            with self.torch.no_grad():
                return self._torch_y(x)
        return call

    def torch_forward_backward(self, i, channels_last):
        x = (self.t_cl if channels_last else self.t_nchw)[i]
        dy = (self.t_dy_cl if channels_last else self.t_dy_nchw)[i]
        return lambda: self.torch.autograd.grad(self._torch_y(x), (x, self.tw, self.tb), dy)


def measure(torch, bandwidth, shape, dtype, activation, repeat):
    """The rows of one cell: forward, backward, forward_backward x eager, gpu."""
    case = Case(torch, shape, dtype, activation)
    r = range(case.copies)
    floors = {"forward": 2, "backward": 3, "forward_backward": 5}
    ours = {
        ("forward", "eager"): time_us(rotating([case.forward(i) for i in r]), repeat=repeat),
        ("backward", "eager"): time_us(rotating([case.backward(i) for i in r]), repeat=repeat),
        ("forward_backward", "eager"): time_us(rotating([case.forward_backward(i) for i in r]), repeat=repeat),
        ("forward", "gpu"): _graph_us([case.forward_into(i) for i in r], repeat=repeat),
        ("backward", "gpu"): _graph_us([case.backward(i, into=True) for i in r], repeat=repeat),
        ("forward_backward", "gpu"): _graph_us([case.forward_backward(i, into=True) for i in r], repeat=repeat),
    }
    theirs = {}
    for channels_last, label in ((False, "torch_nchw_us"), (True, "torch_channels_last_us")):
        fwd = [case.torch_forward(i, channels_last) for i in r]
        fwd_bwd = [case.torch_forward_backward(i, channels_last) for i in r]
        theirs[("forward", "eager", label)] = time_us(rotating(fwd), repeat=repeat)
        theirs[("forward_backward", "eager", label)] = time_us(rotating(fwd_bwd), repeat=repeat)
        theirs[("forward", "gpu", label)] = _torch_graph_us(torch, fwd, repeat=repeat)
        theirs[("forward_backward", "gpu", label)] = _torch_graph_us(torch, fwd_bwd, repeat=repeat)
    kernels = {  # {kernel: [GPU us, launches] per call}
        "forward": kernel_profile(torch, case.forward_into(0)),
        "backward": kernel_profile(torch, case.backward(0, into=True)),
    }
    kernels["forward_backward"] = {**kernels["forward"], **kernels["backward"]}
    rows = []
    for (direction, timing), us in ours.items():
        row = {
            "op": "group_norm", "case": f"{_name(shape)} G{GROUPS}", "shape": list(shape), "dtype": case.dtype.name,
            "layout": "NHWC", "activation": activation, "direction": direction, "timing": timing,
            "ours_us": us, "floor_us": floors[direction] * case.nbytes / bandwidth, "bytes": case.nbytes,
            "rotating_copies": case.copies, "launches": sum(n for _, n in kernels[direction].values()),
            "kernels": kernels[direction],
        }
        for label in ("torch_nchw_us", "torch_channels_last_us"):
            row[label] = theirs.get((direction, timing, label))
        best = min((v for v in (row["torch_nchw_us"], row["torch_channels_last_us"]) if v is not None), default=None)
        row["fraction_of_floor"] = row["floor_us"] / us
        row["ratio_vs_torch_best"] = best / us if best is not None else None
        rows.append(row)
    del case
    torch.cuda.empty_cache()
    cupy.get_default_memory_pool().free_all_blocks()
    return rows


def targets(rows):
    """Lines saying which issue-9 targets each row meets (printed at the end)."""
    lines = []
    by_key = {(tuple(r["shape"]), r["dtype"], r["activation"], r["direction"], r["timing"]): r for r in rows}
    misses = [r for r in rows if r["ratio_vs_torch_best"] is not None and r["ratio_vs_torch_best"] < 1]
    compared = [r for r in rows if r["ratio_vs_torch_best"] is not None]
    lines.append(f"faster than PyTorch's faster format: {len(compared) - len(misses)} of {len(compared)} cells")
    for r in misses:
        lines.append(f"  slower: {r['case']} {r['dtype']} {r['activation']} {r['direction']} {r['timing']}: "
                     f"ours {r['ours_us']:.1f} us, PyTorch {r['ours_us'] * r['ratio_vs_torch_best']:.1f} us")
    for r in rows:
        if r["bytes"] > L2_BYTES and r["timing"] == "gpu":
            need = {"forward": 0.70, "backward": 0.60}.get(r["direction"])
            if need is not None and r["fraction_of_floor"] < need:
                lines.append(f"  below {need:.0%} of the floor: {r['case']} {r['dtype']} {r['activation']} "
                             f"{r['direction']}: {r['fraction_of_floor']:.0%}")
        if SD_BYTES[0] <= r["bytes"] <= SD_BYTES[1] and r["timing"] == "gpu":
            limit = {"forward": 12.0, "forward_backward": 30.0}.get(r["direction"])
            if limit is not None and r["ours_us"] > limit:
                lines.append(f"  SD-size over {limit:.0f} us: {r['case']} {r['dtype']} {r['activation']} "
                             f"{r['direction']}: {r['ours_us']:.1f} us")
            if r["direction"] in ("forward", "backward") and r["launches"] > 2:
                lines.append(f"  more than 2 launches: {r['case']} {r['dtype']} {r['direction']}: {r['launches']}")
    for odd, aligned in CLIFF.items():
        for (shape, dtype, act, direction, timing), r in by_key.items():
            ref = by_key.get((aligned, dtype, act, direction, timing))
            if shape == odd and ref is not None:
                ratio = (r["ours_us"] / r["bytes"]) / (ref["ours_us"] / ref["bytes"])
                if ratio > 1.5:
                    lines.append(f"  cliff {ratio:.2f}x per byte: {_name(odd)} vs {_name(aligned)} {dtype} {act} "
                                 f"{direction} {timing}")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="results file (default results/group_norm_<gpu>_<date>.json; - for none)")
    parser.add_argument("--png", help="also plot the results here (plot_group_norm.py)")
    parser.add_argument("--cases", nargs="+", help="shapes NxHxWxC to run (default: all, cliff cases included)")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--activations", nargs="+", choices=ACTIVATIONS, default=list(ACTIVATIONS))
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    args = parser.parse_args(argv)
    import torch

    shapes = CASES + list(CLIFF)
    if args.cases:
        wanted = {tuple(int(v) for v in name.split("x")) for name in args.cases}
        shapes = [s for s in shapes if s in wanted]
    bandwidth, facts = run_facts(torch)
    json_path = results_path(args.json, "group_norm", facts)
    cells = [(s, d, a) for s in shapes for d in args.dtypes for a in args.activations]
    rows = []
    for k, (shape, dtype, activation) in enumerate(cells, 1):
        new = measure(torch, bandwidth, shape, dtype, activation, repeat=8 if args.quick else 30)
        rows += new
        print(f"[{k}/{len(cells)}] {_name(shape)} {dtype:8} {activation:8} " + "  ".join(
            f"{r['direction'][:7]}/{r['timing']} {r['ours_us']:7.1f}"
            + (f" ({r['ratio_vs_torch_best']:.2f}x)" if r["ratio_vs_torch_best"] else "")
            for r in new), flush=True)
        document = results_document(facts, rows, groups=GROUPS, cliff={_name(k): _name(v) for k, v in CLIFF.items()})
        if json_path is not None:
            write_json(json_path, document)  # rewritten per cell: a run cut short keeps what it measured
    print("\n".join(targets(rows)))
    if args.png:
        plot_safely("plot_group_norm", document, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
