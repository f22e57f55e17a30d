"""GroupNorm (channels-last, fused activation) next to PyTorch, on the shapes of
Stable Diffusion / SDXL U-Net and VAE blocks (CASES below), fp16, G=32.

For each shape: forward, backward and forward+backward of cupy_dwgn.group_norm
and PyTorch's group_norm on a channels_last tensor of the same data (and the
forward on NCHW), the memory floors (forward 2 passes: read x, write y;
backward 3: read x and grad_out, write grad_x) and the GPU time of each of our
kernels.  Tensors smaller than 2x the L2 rotate through enough copies that
every call reads from DRAM.

    PYTHONPATH=.:benchmarks python benchmarks/group_norm.py [--json out.json]
"""

import argparse
import sys

import cupy

import cupy_dwgn
from harness import kernel_breakdown_us, report, results_document, rotating, run_facts, time_us, write_json

L2_BYTES = 60 * 2**20  # H100/H200 L2 (the copies below only need an upper bound)

#: (name, N, C, H=W); G = 32 throughout, as in the diffusion models.
CASES = [
    ("SD 2x320x64", 2, 320, 64),
    ("SD 2x1280x16", 2, 1280, 16),
    ("VAE 1x128x512", 1, 128, 512),
    ("SDXL 8x320x128", 8, 320, 128),
]
GROUPS = 32


def group_norm_case(torch, bandwidth, name, n, c, hw, activation="silu"):
    shape = (n, hw, hw, c)
    nbytes = n * hw * hw * c * 2
    copies = max(1, -(-2 * L2_BYTES // nbytes))  # every call misses L2
    xs = [cupy.random.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16) for _ in range(copies)]
    dys = [cupy.random.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16) for _ in range(copies)]
    w = cupy.random.standard_normal(c, dtype=cupy.float32)
    b = cupy.random.standard_normal(c, dtype=cupy.float32)
    stats = [cupy_dwgn.group_norm(x, GROUPS, w, b, activation=activation, return_stats=True)[1:] for x in xs]

    def ours_fwd(i):
        return lambda: cupy_dwgn.group_norm(xs[i], GROUPS, w, b, activation=activation)

    def ours_bwd(i):
        mean, rstd = stats[i]
        return lambda: cupy_dwgn.group_norm_backward(dys[i], xs[i], mean, rstd, GROUPS, w, b, activation=activation)

    def ours_fwd_bwd(i):
        def call():
            _, mean, rstd = cupy_dwgn.group_norm(xs[i], GROUPS, w, b, activation=activation, return_stats=True)
            cupy_dwgn.group_norm_backward(dys[i], xs[i], mean, rstd, GROUPS, w, b, activation=activation)
        return call

    # PyTorch on the same buffers: an NCHW-shaped channels_last view of the NHWC data.
    act = {"silu": torch.nn.functional.silu, "identity": lambda t: t}[activation]
    gn = torch.nn.functional.group_norm
    txs = [torch.from_dlpack(x).permute(0, 3, 1, 2).requires_grad_(True) for x in xs]
    tdys = [torch.from_dlpack(dy).permute(0, 3, 1, 2) for dy in dys]
    txs_nchw = [t.detach().contiguous() for t in txs]
    tw = torch.from_dlpack(w).half().requires_grad_(True)
    tb = torch.from_dlpack(b).half().requires_grad_(True)

    def torch_fwd(i, inputs):
        return lambda: act(gn(inputs[i], GROUPS, tw, tb))

    def torch_fwd_bwd(i):
        return lambda: torch.autograd.grad(act(gn(txs[i], GROUPS, tw, tb)), (txs[i], tw, tb), tdys[i])

    r = range(copies)
    result = {
        "case": f"{name} (NHWC {n}x{hw}x{hw}x{c} fp16 G={GROUPS} +{activation})",
        "shape": [n, hw, hw, c],
        "activation": activation,
        "rotating_copies": copies,
        "cupy_dwgn_fwd_us": time_us(rotating([ours_fwd(i) for i in r])),
        "cupy_dwgn_bwd_us": time_us(rotating([ours_bwd(i) for i in r])),
        "cupy_dwgn_fwd_bwd_us": time_us(rotating([ours_fwd_bwd(i) for i in r])),
        "torch_nchw_fwd_us": time_us(rotating([torch_fwd(i, txs_nchw) for i in r])),
        "torch_channels_last_fwd_us": time_us(rotating([torch_fwd(i, txs) for i in r])),
        "torch_channels_last_fwd_bwd_us": time_us(rotating([torch_fwd_bwd(i) for i in r])),
        "fwd_floor_us": 2 * nbytes / bandwidth,
        "bwd_floor_us": 3 * nbytes / bandwidth,
        "fwd_bwd_floor_us": 5 * nbytes / bandwidth,
    }
    result["fwd_fraction_of_floor"] = result["fwd_floor_us"] / result["cupy_dwgn_fwd_us"]
    result["bwd_fraction_of_floor"] = result["bwd_floor_us"] / result["cupy_dwgn_bwd_us"]
    result["speedup_vs_torch_channels_last_fwd_bwd"] = (
        result["torch_channels_last_fwd_bwd_us"] / result["cupy_dwgn_fwd_bwd_us"]
    )
    try:
        for kernel, us in kernel_breakdown_us(torch, rotating([ours_fwd_bwd(i) for i in r])).items():
            result[f"kernel_us {kernel}"] = us
    except Exception as error:  # a diagnostic only: never lose the timings to it
        result["kernel_breakdown_error"] = repr(error)
    return result


def schema_rows(result):
    """The rows of one case in the results schema (benchmarks/README.md): forward and
    forward_backward (eager timing).  PyTorch has no backward-only call to
    compare with, so our backward time rides in the forward_backward row."""
    n, hw, _, c = result["shape"]
    common = {
        "op": "group_norm", "case": f"{n}x{hw}x{hw}x{c} G{GROUPS}", "dtype": "float16", "layout": "NHWC",
        "activation": result["activation"], "timing": "eager", "rotating_copies": result["rotating_copies"],
    }
    kernels = {key.split(" ", 1)[1]: us for key, us in result.items() if key.startswith("kernel_us ")}
    return [
        dict(common, direction="forward", ours_us=result["cupy_dwgn_fwd_us"],
             torch_nchw_us=result["torch_nchw_fwd_us"], torch_channels_last_us=result["torch_channels_last_fwd_us"],
             floor_us=result["fwd_floor_us"]),
        dict(common, direction="forward_backward", ours_us=result["cupy_dwgn_fwd_bwd_us"], torch_nchw_us=None,
             torch_channels_last_us=result["torch_channels_last_fwd_bwd_us"], floor_us=result["fwd_bwd_floor_us"],
             ours_backward_us=result["cupy_dwgn_bwd_us"], backward_floor_us=result["bwd_floor_us"],
             kernel_us=kernels),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    import torch

    bandwidth, facts = run_facts(torch)
    rows = []
    for i, (name, n, c, hw) in enumerate(CASES, 1):
        print(f"[{i}/{len(CASES)}] {name} ...", flush=True)
        result = group_norm_case(torch, bandwidth, name, n, c, hw)
        report({"cases": [result]}, key_width=42)
        rows += schema_rows(result)
    write_json(args.json, results_document(facts, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
