"""Calls for Nsight Compute: each case runs its calls twice (the first
compiles; ncu profiles both, so every kernel appears twice).

    ncu --clock-control none --profile-from-start off -k regex:dwgn --section ... python3 scripts/ncu_workload.py [CASE ...] > ncu.txt
    python3 scripts/ncu_workload.py --summarize ncu.txt
    python3 scripts/ncu_workload.py --regions ncu_sass.csv [KERNEL_NAME_PART]

(scripts/device_session.sh's ncu step runs the first two.)  --summarize prints one
line per profiled kernel: duration, DRAM throughput, SM throughput, registers,
achieved / theoretical occupancy, the block limits by registers and shared
memory, issue slots busy, cycles per issued instruction, L2 and L1 hit rates.

Cases (default all): gn_large / gn_large32 (1x512x512x128 G32 forward and
backward, float16 / float32), gn_sd (2x64x64x320 float16 SiLU, both
directions), dw_fp16_3x3 (64x144x56 3x3 float16 forward and backward-input,
NCHW and NHWC), dw_28 (28x28 planes, float16 forward, both layouts:
64x384x28 3x3 and 64x240x28 5x5), dw_s2 (64x96x112 3x3 stride-2 forward,
float32 and float16, both layouts), dw_wgrad (weight gradients: 64x384x28 3x3 float32 and float16,
64x384x14 7x7 float16, both layouts), dw_wgrad_mma (the tensor-core weight
gradient, MODE "always": 64x384x14 7x7 and 64x240x28 5x5 float16, both
layouts), dw_plane_wgrad (the NCHW whole-plane
weight gradient, MODE "always", the tensor-core one "never": 64x384x14 7x7,
64x576x19 3x3, 64x192x75 3x3, float16), dw_effnet (EfficientNet-B3's odd
widths in NCHW float16: 64x192x75 3x3 forward and backward-input, the
whole-plane kernel in bands, and its weight gradient; 64x288x38 3x3
stride-2 forward), dw_conv_mma (the tensor-core forward, MODE "always":
64x144x56 3x3 both layouts, 64x96x56 7x7 and 64x960x7 3x3 NCHW, float16),
dw_s2_small (stride-2 forwards on 14- and 28-wide planes, both layouts:
64x576x14 and 64x192x28 float32, 64x240x28 float16; then PyTorch's
channels_last forward of the first and the last, cuDNN's kernels),
dw_s2_nhwc_variants (64x576x14 float32 stride-2 NHWC forward: the direct
kernel at TW 1, 2 and 8, at TW 1 with one image's plane a block (4x49) and
TW 2 with 4x64 blocks, then the tiled kernel, then cuDNN's where torch is installed).
"""
import sys

import numpy

try:
    import cupy

    import cupy_dwgn
except ImportError:  # --summarize and --regions only read ncu's output (e.g. on a machine without a GPU)
    cupy = cupy_dwgn = None


def _rng():
    return cupy.random.default_rng(0)


def gn(shape, dtype, activation):
    rng = _rng()
    x = rng.standard_normal(shape, dtype=cupy.float32).astype(dtype)
    w = rng.standard_normal(shape[-1], dtype=cupy.float32).astype(dtype)
    b = rng.standard_normal(shape[-1], dtype=cupy.float32).astype(dtype)
    for _ in range(2):
        y, mean, rstd = cupy_dwgn.group_norm(x, 32, w, b, activation=activation, return_stats=True)
        cupy_dwgn.group_norm_backward(y, x, mean, rstd, 32, w, b, activation=activation)


def dw(n, c, h, k, stride, dtype, layouts=("NCHW", "NHWC"), directions=("forward", "backward_input")):
    rng = _rng()
    x = rng.standard_normal((n, c, h, h), dtype=cupy.float32).astype(dtype)
    w = rng.standard_normal((c, 1, k, k), dtype=cupy.float32).astype(dtype)
    for layout in layouts:
        xl = x if layout == "NCHW" else cupy.ascontiguousarray(x.transpose(0, 2, 3, 1))
        for _ in range(2):
            y = cupy_dwgn.depthwise_conv2d(xl, w, stride=stride, padding=k // 2, layout=layout)
            if "backward_input" in directions:
                cupy_dwgn.depthwise_conv2d_backward_input(y, w, xl.shape, stride=stride, padding=k // 2, layout=layout)
            if "backward_weight" in directions:
                cupy_dwgn.depthwise_conv2d_backward_weight(y, xl, w.shape, stride=stride, padding=k // 2, layout=layout)


CASES = {
    "gn_large": lambda: gn((1, 512, 512, 128), cupy.float16, "identity"),
    "gn_large32": lambda: gn((1, 512, 512, 128), cupy.float32, "identity"),
    "gn_sd": lambda: gn((2, 64, 64, 320), cupy.float16, "silu"),
    "dw_fp16_3x3": lambda: dw(64, 144, 56, 3, 1, cupy.float16),
    "dw_28": lambda: [dw(64, c, 28, k, 1, cupy.float16, directions=("forward",)) for c, k in ((384, 3), (240, 5))],
    "dw_s2": lambda: [dw(64, 96, 112, 3, 2, t, directions=("forward",)) for t in (cupy.float32, cupy.float16)],
    "dw_effnet": lambda: [dw(64, 192, 75, 3, 1, cupy.float16, layouts=("NCHW",),
                             directions=("forward", "backward_input", "backward_weight")),
                          dw(64, 288, 38, 3, 2, cupy.float16, layouts=("NCHW",), directions=("forward",))],
    "dw_wgrad": lambda: [dw(64, 384, 28, 3, 1, t, directions=("backward_weight",)) for t in (cupy.float32, cupy.float16)]
    + [dw(64, 384, 14, 7, 1, cupy.float16, directions=("backward_weight",))],
    "dw_wgrad_mma": lambda: _always("_depthwise_wgrad_mma",
        lambda: [dw(64, c, h, k, 1, cupy.float16, directions=("backward_weight",))
                 for c, h, k in ((384, 14, 7), (240, 28, 5))]),
    "dw_conv_mma": lambda: _always("_depthwise_conv_mma",
        lambda: [dw(64, c, h, k, 1, cupy.float16, layouts=layouts, directions=("forward",))
                 for c, h, k, layouts in ((144, 56, 3, ("NCHW", "NHWC")), (96, 56, 7, ("NCHW",)),
                                          (960, 7, 3, ("NCHW",)))]),
    "dw_s2_small": lambda: [dw(64, c, h, 3, 2, t, directions=("forward",)) for c, h, t in
                            ((576, 14, cupy.float32), (192, 28, cupy.float32), (240, 28, cupy.float16))]
    + [_torch_channels_last(64, c, h, 3, 2, t) for c, h, t in ((576, 14, "float32"), (240, 28, "float16"))],
    "dw_s2_nhwc_variants": lambda: [
        _nhwc_direct_variants(64, 576, 14, cupy.float32,
                              ((1, 0, None), (2, 0, None), (8, 0, None), (1, 1, (4, 49)), (2, 1, (4, 64)))),
        _torch_channels_last(64, 576, 14, 3, 2, "float32")],
    # The 7x7 cells (issue 7's target: within 1.5x of max(memory, FP32-FMA floor)): the NCHW window kernel
    # (float32 56x56), the tensor-core kernel (float16 56x56), the plane kernel (float32 14x14), the NHWC window.
    "dw_7x7": lambda: [dw(64, 96, 56, 7, 1, cupy.float32, directions=("forward",)),
                       dw(64, 96, 56, 7, 1, cupy.float16, layouts=("NCHW",), directions=("forward",)),
                       dw(64, 384, 14, 7, 1, cupy.float32, layouts=("NCHW",), directions=("forward",))],
    # The 14x14 7x7 cells (3-7x the floor on the H200: 28-40 us against 5.4-9.2) in both dtypes' kernels:
    # the NCHW plane kernel, the NHWC window.
    "dw_7x7_14": lambda: [dw(64, 384, 14, 7, 1, dtype, directions=("forward",)) for dtype in (cupy.float32, cupy.float16)],
    "dw_plane_wgrad": lambda: _always("_depthwise_nchw_plane_wgrad",
        lambda: [dw(64, c, h, k, 1, cupy.float16, layouts=("NCHW",), directions=("backward_weight",))
                 for c, h, k in ((384, 14, 7), (576, 19, 3), (192, 75, 3))],
        off=("_depthwise_wgrad_mma",)),
}


def _torch_channels_last(n, c, h, k, stride, dtype):
    """PyTorch's depthwise forward (cuDNN) on a channels_last tensor, twice, where
    torch is installed: the kernel the ops are compared with (profiled when the
    ncu kernel filter admits it: NCU_KERNELS in scripts/device_session.sh)."""
    try:
        import torch
    except ImportError:
        return
    torch.backends.cudnn.benchmark = True
    dtype = getattr(torch, dtype)
    x = torch.randn(n, c, h, h, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
    w = torch.randn(c, 1, k, k, device="cuda", dtype=dtype)
    # cudnn.benchmark's search launches every candidate algorithm (hundreds of kernels, minutes under ncu):
    # run it outside the profiled range (ncu --profile-from-start off; main starts the range), then the
    # chosen kernel twice inside it.
    torch.cuda.synchronize()
    cupy.cuda.profiler.stop()
    torch.nn.functional.conv2d(x, w, stride=stride, padding=k // 2, groups=c)
    torch.cuda.synchronize()
    cupy.cuda.profiler.start()
    for _ in range(2):
        torch.nn.functional.conv2d(x, w, stride=stride, padding=k // 2, groups=c)
    torch.cuda.synchronize()


def _nhwc_direct_variants(n, c, h, dtype, variants):
    """The NHWC 3x3 stride-2 forward with the direct kernel in each of ``variants``, (TW
    output columns per thread, items per thread (0: the rule's), (BX, BY) block or None:
    the rule's), then with the kernel the ops take without it (the tiled one): which limit
    each meets (L1 hit rate, L2 / DRAM throughput, occupancy) where they all run at ~65% of
    the copy rate (results/depthwise_stride2_sweeps_h100_2026-12-06b.txt); the (4, 49)
    block holds one image's 7x7 plane for 16 channels, as cuDNN's 2304 blocks there do."""
    from cupy_dwgn import _depthwise_nhwc_direct as direct
    from cupy_dwgn import depthwise

    key, mode = (3, 2, numpy.dtype(dtype).itemsize), direct.MODE
    try:
        for tw, per_thread, block in variants:
            with direct.overridden(key, tw, per_thread, block):
                direct.MODE = "always"
                depthwise._SIGNATURES = {}
                dw(n, c, h, 3, 2, dtype, layouts=("NHWC",), directions=("forward",))
        direct.MODE = "never"
        depthwise._SIGNATURES = {}
        dw(n, c, h, 3, 2, dtype, layouts=("NHWC",), directions=("forward",))
    finally:
        direct.MODE = mode
        depthwise._SIGNATURES = {}


def _always(module_name, calls, off=()):
    # `calls` with one kernel module's MODE "always" (it serves wherever it
    # can, whatever its rule prefers; e.g. the whole-plane weight gradient's
    # rule keeps 7x7 at 14x14 on the register kernel) and the modules in
    # `off` (kernels tried before it) "never", the call-signature cache
    # cleared around them.
    import importlib

    from cupy_dwgn import depthwise

    modes = {importlib.import_module(f"cupy_dwgn.{name}"): "never" for name in off}
    modes[importlib.import_module(f"cupy_dwgn.{module_name}")] = "always"
    depthwise._SIGNATURES = {}
    for module, mode in modes.items():
        module.MODE = mode
    try:
        calls()
    finally:
        for module in modes:
            module.MODE = "rule"
        depthwise._SIGNATURES = {}


# (ncu's metric name, the summary's label)
SUMMARY = [("Duration", "us"), ("DRAM Throughput", "dram%"), ("Compute (SM) Throughput", "sm%"),
           ("Registers Per Thread", "regs"), ("Achieved Occupancy", "occ%"), ("Theoretical Occupancy", "theo%"),
           ("Block Limit Registers", "lim_regs"), ("Block Limit Shared Mem", "lim_smem"),
           ("Issue Slots Busy", "issue%"), ("Warp Cycles Per Issued Instruction", "cpi"),
           ("L2 Hit Rate", "l2hit%"), ("L1/TEX Hit Rate", "l1hit%"), ("L1/TEX Cache Throughput", "l1%"),
           ("L2 Cache Throughput", "l2%")]


def summarize(path):
    import re

    text = open(path).read()
    # A kernel's report starts with its signature and launch shape, "name(...) (grid)x(block)".
    for report in re.split(r"\n  (?=\S.*\(\d+, \d+, \d+\)x\(\d+, \d+, \d+\))", text)[1:]:
        fields = []
        for metric, label in SUMMARY:
            match = re.search(r"\n\s+" + re.escape(metric) + r"\s+\S+\s+(\S+)", report)
            if match:
                fields.append(f"{label}={match.group(1)}")
        print(report.split("\n")[0].split("(")[0].replace("void ", ""), " ".join(fields))


def regions(path, kernel="", top=12):
    """Where a kernel's warps wait, from the SASS table (ncu --page source --csv,
    the ncu step's ncu_sass.csv): for the first profiled kernel whose name
    contains ``kernel``, the stall-sample share of each reason, of each run of
    consecutive instructions with one execution count (a loop body, a phase run
    by some of the blocks: the count says which), and the ``top`` instructions.
    A phase run by fewer warps draws fewer samples per microsecond (ncu samples
    each SM sub-partition that holds warps), so compare shares within a phase."""
    import csv

    table = list(csv.reader(open(path)))
    starts = [i for i, row in enumerate(table) if row[:1] == ["Kernel Name"]] + [len(table)]
    first = next(i for i in starts[:-1] if kernel in table[i][1])
    header, body = table[first + 1], table[first + 2:starts[starts.index(first) + 1]]
    column = {name: k for k, name in enumerate(header)}

    def value(row, name):
        try:
            return float(row[column[name]].replace(",", ""))
        except ValueError:
            return 0.0

    samples, executed = "Warp Stall Sampling (All Samples)", "Instructions Executed"
    reasons = [name for name in header if name.startswith("stall_") and "Not Issued" not in name]
    total = sum(value(row, samples) for row in body) or 1.0
    name = table[first][1]
    print(f"{name[:name.find('>(') + 1] or name.split('(')[0]}: {total:.0f} samples")
    shares = {reason: sum(value(row, reason) for row in body) / total for reason in reasons}
    print("  reasons: " + ", ".join(f"{reason[6:]} {100 * share:.1f}%" for reason, share in
                                    sorted(shares.items(), key=lambda kv: -kv[1]) if share >= 0.02))
    runs = []
    for k, row in enumerate(body):
        if not runs or runs[-1][0] != value(row, executed):
            runs.append([value(row, executed), k, k, 0.0])
        runs[-1][2] = k
        runs[-1][3] += value(row, samples)
    for count, start, end, run_samples in runs:
        if run_samples >= 0.01 * total:
            print(f"  instructions {start:5d}-{end:5d} executed {count:8.0f} times: {100 * run_samples / total:5.1f}% "
                  f"({row_source(body[start], column)} ...)")
    for k, row in sorted(enumerate(body), key=lambda kr: -value(kr[1], samples))[:top]:
        reason = max(reasons, key=lambda stall: value(row, stall))
        share = 100 * value(row, samples) / total
        print(f"  {k:5d} {share:5.1f}% {reason[6:]:14s} executed {value(row, executed):8.0f}  {row_source(row, column)}")


def row_source(row, column):
    return " ".join(row[column["Source"]].split())[:60]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--summarize"]:
        summarize(sys.argv[2])
        sys.exit(0)
    if sys.argv[1:2] == ["--regions"]:
        regions(*sys.argv[2:4])
        sys.exit(0)
    # The profiled range (ncu --profile-from-start off): everything but cuDNN's algorithm search.
    cupy.cuda.profiler.start()
    for name in sys.argv[1:] or list(CASES):
        CASES[name]()
    cupy.cuda.Device().synchronize()
