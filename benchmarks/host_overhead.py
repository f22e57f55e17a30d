"""Host cost per call on tiny tensors (what an eager Python loop sees), next to
PyTorch and to CuPy's own floor (a bare RawKernel launch, a cupy.empty), and
a cProfile of our calls so the slow steps have names.

    PYTHONPATH=.:benchmarks python benchmarks/host_overhead.py [--json out.json] [--profile]
"""

import argparse
import cProfile
import io
import pstats
import sys

import cupy

import cupy_dwgn
from harness import host_us, results_document, run_facts, write_json

#: What one call of each measured op launches and allocates today (kernels,
#: cupy.empty calls; temporaries come from the reusable workspace), read from
#: its code: the "bare" cost the host-cost target compares with is that
#: many bare launches and allocations.  Update it when an op's plan changes.
CALL_NEEDS = {
    "group_norm": (2, 1),  # stats with its finalize (cooperative), apply; y (mean/rstd unasked: workspace)
    "group_norm_backward": (2, 3),  # reduce with its finalize (cooperative), dx; dx, dw, db
    "depthwise_conv2d": (1, 1),  # one NCHW 3x3 kernel; y
    "depthwise_conv2d_backward_input": (1, 1),
    "depthwise_conv2d_backward_weight": (2, 1),  # partial sums, finalize; dw
    # Every output given (out=, mean_out=, ...): launches only.
    "group_norm[out]": (2, 0),
    "group_norm_backward[out]": (2, 0),
    "depthwise_conv2d[out]": (1, 0),
}
#: PyTorch's call beside each of ours.
TORCH_KEYS = {
    "group_norm": "torch_group_norm_silu_us",
    "depthwise_conv2d": "torch_depthwise_conv2d_us",
    "depthwise_conv2d_torch_bridge": "torch_depthwise_conv2d_us",
    "group_norm_torch_bridge": "torch_group_norm_silu_channels_last_us",
}
#: Calls with torch tensors: (row, the plain CuPy call it wraps).
TORCH_CALLS = {
    "depthwise_conv2d_dlpack": "depthwise_conv2d",
    "depthwise_conv2d_torch_bridge": "depthwise_conv2d",
    "group_norm_torch_bridge": "group_norm",
}


def schema_rows(results):
    """The timing="host" rows of the results schema (benchmarks/README.md) from the measurements."""
    launch, empty = results["cupy_bare_launch_us"], results["cupy_empty_us"]
    rows = []
    for op, (launches, allocations) in CALL_NEEDS.items():
        key = f"cupy_dwgn_{op}_us"
        if key not in results:
            continue
        row = {
            "op": op, "case": "tiny", "timing": "host", "ours_us": results[key],
            "bare_us": launches * launch + allocations * empty, "launches": launches, "allocations": allocations,
        }
        if op in TORCH_KEYS:
            row["torch_us"] = results[TORCH_KEYS[op]]
        rows.append(row)
    for op, plain in TORCH_CALLS.items():
        key = f"cupy_dwgn_{op}_us"
        if key not in results:
            continue
        # The cost over the plain CuPy call (the bridge target is <= 10 us);
        # timing "host_over_cupy": these rows compare with the CuPy call, not bare launches.
        row = {
            "op": op, "case": "tiny", "timing": "host_over_cupy", "ours_us": results[key],
            "plain_cupy_us": results[f"cupy_dwgn_{plain}_us"],
            "over_plain_us": results[key] - results[f"cupy_dwgn_{plain}_us"],
        }
        if op in TORCH_KEYS:
            row["torch_us"] = results[TORCH_KEYS[op]]
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of each of our calls")
    args = parser.parse_args()
    import torch

    _, facts = run_facts(torch)
    x_gn = cupy.random.standard_normal((1, 4, 4, 32), dtype=cupy.float32).astype(cupy.float16)
    w_gn = cupy.ones(32, cupy.float32)
    b_gn = cupy.zeros(32, cupy.float32)
    _, mean, rstd = cupy_dwgn.group_norm(x_gn, 8, w_gn, b_gn, return_stats=True)
    x_dw = cupy.random.standard_normal((1, 8, 8, 8), dtype=cupy.float32)
    w_dw = cupy.random.standard_normal((8, 1, 3, 3), dtype=cupy.float32)
    y_dw = cupy.empty_like(x_dw)
    y_gn, mean_out, rstd_out = cupy.empty_like(x_gn), cupy.empty_like(mean), cupy.empty_like(rstd)
    dx_gn, dw_gn, db_gn = cupy.empty_like(x_gn), cupy.empty_like(w_gn), cupy.empty_like(b_gn)
    noop = cupy.RawKernel('extern "C" __global__ void noop(float* p) {}', "noop")
    ours = {
        "group_norm": lambda: cupy_dwgn.group_norm(x_gn, 8, w_gn, b_gn, activation="silu"),
        "group_norm_backward": lambda: cupy_dwgn.group_norm_backward(
            x_gn, x_gn, mean, rstd, 8, w_gn, b_gn, activation="silu"
        ),
        "depthwise_conv2d": lambda: cupy_dwgn.depthwise_conv2d(x_dw, w_dw, padding=1),
        "depthwise_conv2d_backward_input": lambda: cupy_dwgn.depthwise_conv2d_backward_input(
            x_dw, w_dw, x_dw.shape, padding=1
        ),
        "depthwise_conv2d_backward_weight": lambda: cupy_dwgn.depthwise_conv2d_backward_weight(
            x_dw, x_dw, w_dw.shape, padding=1
        ),
        "group_norm[out]": lambda: cupy_dwgn.group_norm(
            x_gn, 8, w_gn, b_gn, activation="silu", out=y_gn, mean_out=mean_out, rstd_out=rstd_out
        ),
        "group_norm_backward[out]": lambda: cupy_dwgn.group_norm_backward(
            x_gn, x_gn, mean, rstd, 8, w_gn, b_gn, activation="silu", out=dx_gn, grad_weight_out=dw_gn,
            grad_bias_out=db_gn,
        ),
        "depthwise_conv2d[out]": lambda: cupy_dwgn.depthwise_conv2d(x_dw, w_dw, padding=1, out=y_dw),
    }
    tx_gn = torch.from_dlpack(x_gn).permute(0, 3, 1, 2)  # channels_last (N, C, H, W)
    tw_gn, tb_gn = torch.from_dlpack(w_gn).half(), torch.from_dlpack(b_gn).half()
    tx_dw, tw_dw = torch.from_dlpack(x_dw), torch.from_dlpack(w_dw)
    tx_gn32, tw32, tb32 = tx_gn.float(), torch.from_dlpack(w_gn), torch.from_dlpack(b_gn)
    ours["depthwise_conv2d_dlpack"] = lambda: cupy_dwgn.depthwise_conv2d(tx_dw, tw_dw, padding=1)
    try:
        import cupy_dwgn.torch as dwt
    except ImportError as error:
        print(f"no PyTorch bridge rows: {error}")
    else:
        ours["depthwise_conv2d_torch_bridge"] = lambda: dwt.depthwise_conv2d(tx_dw, tw_dw, padding=1)
        ours["group_norm_torch_bridge"] = lambda: dwt.group_norm(tx_gn, 8, tw32, tb32, activation="silu")
    results = {
        "cupy_bare_launch_us": host_us(lambda: noop((1,), (32,), (x_dw,))),
        "cupy_empty_us": host_us(lambda: cupy.empty((4, 4), cupy.float32)),
        "torch_group_norm_silu_us": host_us(
            lambda: torch.nn.functional.silu(torch.nn.functional.group_norm(tx_gn, 8, tw_gn, tb_gn))
        ),
        "torch_group_norm_silu_channels_last_us": host_us(
            lambda: torch.nn.functional.silu(torch.nn.functional.group_norm(tx_gn32, 8, tw32, tb32))
        ),
        "torch_depthwise_conv2d_us": host_us(
            lambda: torch.nn.functional.conv2d(tx_dw, tw_dw, padding=1, groups=8)
        ),
    }
    for name, fn in ours.items():
        results[f"cupy_dwgn_{name}_us"] = host_us(fn)
    for key, value in results.items():
        print(f"{key:36} {value:8.2f}")
    if args.profile:
        profiled = ("group_norm", "group_norm_backward", "depthwise_conv2d", "depthwise_conv2d_backward_weight",
                    "depthwise_conv2d_torch_bridge", "group_norm_torch_bridge", "depthwise_conv2d_dlpack")
        for name, fn in [(name, ours[name]) for name in profiled if name in ours]:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(2000):
                fn()
            profiler.disable()
            cupy.cuda.Device().synchronize()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
            print(f"== cProfile of 2000 calls of {name} (sorted by own time)")
            print(text.getvalue())
    write_json(args.json, results_document(facts, schema_rows(results), measurements=results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
