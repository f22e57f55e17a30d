"""Starting-line timings (no targets yet): cupy-dwgn next to PyTorch on the same
GPU, in one process, with CUDA events, warm-up and the median of repeats.

    PYTHONPATH=. python benchmarks/starting_line.py [--json results.json]
"""

import argparse
import sys

import cupy

import cupy_dwgn
from cupy_dwgn import depthwise
from harness import host_us, kernel_breakdown_us, report, run_facts, time_us


def depthwise_case(torch, bandwidth, n=64, c=144, hw=56, k=3, stride=1):
    x = cupy.random.standard_normal((n, c, hw, hw), dtype=cupy.float32)
    w = cupy.random.standard_normal((c, 1, k, k), dtype=cupy.float32)
    conv_args = dict(padding=k // 2, stride=stride)
    y = cupy_dwgn.depthwise_conv2d(x, w, **conv_args)
    ours = time_us(lambda: cupy_dwgn.depthwise_conv2d(x, w, **conv_args))
    # The same call with the stride-1 shared-memory kernel switched off.
    use_tiled = depthwise._use_tiled
    depthwise._use_tiled = lambda g, dtype: False
    try:
        direct = time_us(lambda: cupy_dwgn.depthwise_conv2d(x, w, **conv_args))
    finally:
        depthwise._use_tiled = use_tiled
    tx, tw = torch.from_dlpack(x), torch.from_dlpack(w)
    conv = torch.nn.functional.conv2d
    torch_nchw = time_us(lambda: conv(tx, tw, groups=c, **conv_args))
    tx_cl = tx.contiguous(memory_format=torch.channels_last)
    torch_cl = time_us(lambda: conv(tx_cl, tw, groups=c, **conv_args))
    floor = (x.nbytes + y.nbytes) / bandwidth
    tiny_x, tiny_w = x[:1, :8, :8, :8].copy(), w[:8].copy()
    return {
        "case": f"depthwise fwd {n}x{c}x{hw}x{hw} {k}x{k} s{stride} fp32",
        "cupy_dwgn_us": ours, "cupy_dwgn_direct_kernel_us": direct, "torch_nchw_us": torch_nchw, "torch_channels_last_us": torch_cl,
        "floor_us": floor, "fraction_of_copy_bandwidth": floor / ours,
        "cupy_dwgn_host_us_per_call_tiny": host_us(lambda: cupy_dwgn.depthwise_conv2d(tiny_x, tiny_w, padding=k // 2)),
        "torch_host_us_per_call_tiny": host_us(lambda: conv(torch.from_dlpack(tiny_x), torch.from_dlpack(tiny_w), padding=k // 2, groups=8)),
    }


def group_norm_case(torch, bandwidth, n=1, hw=512, c=128, groups=32):
    x = cupy.random.standard_normal((n, hw, hw, c), dtype=cupy.float32).astype(cupy.float16)
    w = cupy.ones(c, cupy.float32)
    b = cupy.zeros(c, cupy.float32)
    dy = cupy.random.standard_normal(x.shape, dtype=cupy.float32).astype(cupy.float16)

    def fwd_bwd():
        y, mean, rstd = cupy_dwgn.group_norm(x, groups, w, b, return_stats=True)
        cupy_dwgn.group_norm_backward(dy, x, mean, rstd, groups, w, b)

    ours_fwd = time_us(lambda: cupy_dwgn.group_norm(x, groups, w, b))
    ours_fwd_bwd = time_us(fwd_bwd)
    # PyTorch on the same buffer: an NCHW-shaped channels_last view of the NHWC data.
    tx = torch.from_dlpack(x).permute(0, 3, 1, 2).requires_grad_(True)
    tw = torch.from_dlpack(w).half().requires_grad_(True)
    tb = torch.from_dlpack(b).half().requires_grad_(True)
    tdy = torch.from_dlpack(dy).permute(0, 3, 1, 2)
    gn = torch.nn.functional.group_norm
    torch_fwd = time_us(lambda: gn(tx, groups, tw, tb))
    torch_fwd_bwd = time_us(lambda: torch.autograd.grad(gn(tx, groups, tw, tb), (tx, tw, tb), tdy))
    try:
        breakdown = {f"kernel_us {name}": us for name, us in kernel_breakdown_us(torch, fwd_bwd).items()}
    except Exception as error:  # the profiler is a diagnostic; never lose the timings to it
        breakdown = {"kernel_breakdown_error": repr(error)}
    return {
        "case": f"group_norm NHWC {n}x{hw}x{hw}x{c} fp16 G={groups}",
        "cupy_dwgn_fwd_us": ours_fwd, "cupy_dwgn_fwd_bwd_us": ours_fwd_bwd,
        "torch_channels_last_fwd_us": torch_fwd, "torch_channels_last_fwd_bwd_us": torch_fwd_bwd,
        "fwd_floor_us": 2 * x.nbytes / bandwidth, "fwd_bwd_floor_us": 5 * x.nbytes / bandwidth,
        **breakdown,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--skip-group-norm", action="store_true")
    args = parser.parse_args()
    import torch

    bandwidth, results = run_facts(torch)
    results["cases"] = [
        depthwise_case(torch, bandwidth),
        depthwise_case(torch, bandwidth, 64, 96, 112, 3, 2),
        depthwise_case(torch, bandwidth, 64, 240, 28, 5),
        depthwise_case(torch, bandwidth, 64, 96, 56, 7),
    ]
    if not args.skip_group_norm:
        results["cases"].append(group_norm_case(torch, bandwidth))
    report(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
