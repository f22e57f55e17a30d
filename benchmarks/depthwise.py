"""Depthwise convolution, every cell of the depthwise table (benchmarks/README.md): cupy-dwgn next to
PyTorch (both memory formats, cudnn.benchmark on) in one process on one GPU.

Cells: 8 cases (N x C x H=W, filter, stride; padding = filter // 2) x
{float32, float16, bfloat16} x our layout {NCHW, NHWC} x {forward,
backward_input, backward_weight}.  PyTorch runs on the very same buffers:
our NCHW arrays are its contiguous tensors, our NHWC arrays its
channels_last tensors (one allocation, two views).  PyTorch's time does not
depend on our layout, so it is measured once per (case, dtype, direction)
and shared by the two layout rows.

Timing: harness.time_us (CUDA events around batches of eager calls, warm-up,
median), everything on the legacy default stream, which CuPy and PyTorch
both use unless told otherwise (checked at start).  Inputs smaller than 2x
the L2 rotate through enough copies that no call finds its input in L2.

Floor per cell: max(bytes / copy bandwidth, FMAs / FP32 FMA rate), with
  bytes = each input read once + each output written once
          (forward: x + y + weight; backward_input: dy + dx + weight;
           backward_weight: x + dy + grad_weight), in the cell's dtype;
  FMAs  = N * C * (valid taps along H summed over output rows)
              * (valid taps along W summed over output columns),
          i.e. only the taps that land inside the image (a padding tap
          multiplies a zero no kernel has to multiply; at 31x31 on a 16x16
          image only 256 of 961 taps are inside);
  FP32 FMA rate = SMs x FP32 lanes per SM x max SM clock, from the CUDA
          device attributes (H200 SXM: 132 x 128 x 1.98 GHz = 33.5 TFMA/s).
The copy bandwidth is measured in the same run (harness.run_facts).

Correctness, not timed: every result of ours is compared with PyTorch in
float64 on the same (rounded) data; the relative error norm is printed
and stored, with the test suite's bound (f32 1e-5, f16 2e-3,
bf16 1.6e-2) flagged when exceeded.

    PYTHONPATH=.:benchmarks python benchmarks/depthwise.py [--json F] [--png F]
        [--cases 3x3 31x31] [--dtypes float16] [--layouts NHWC]
        [--directions forward] [--quick] [--shapes 64x144x75x3x1 ...]

--shapes runs other cases than the table's (N x C x H=W x filter size x
stride; padding filter // 2), e.g. EfficientNet-B3's widths at 300 pixels:
--shapes 64x144x75x3x1 64x192x38x5x1 64x672x19x5x1 64x96x150x3x1.

Without --json the result goes to benchmarks/results/depthwise_<gpu>_<date>.json
(--json - writes none).  A call of ours that raises (a layout not
implemented yet) gives ours_us null and an "error" string; the run goes on.
"""

import argparse
import datetime
import math
import sys
import traceback

import cupy

import cupy_dwgn
from cupy_dwgn import _dtypes
from harness import conv_shape, plot_safely, results_document, results_path, rotating, run_facts, time_us, write_json

#: (N, C, H=W, filter size, stride); padding is filter // 2 on every side.
CASES = [
    (64, 144, 56, 3, 1),   # MobileNetV2
    (64, 96, 112, 3, 2),   # MobileNetV2, strided
    (64, 384, 28, 3, 1),   # MobileNetV2
    (64, 960, 7, 3, 1),    # MobileNetV2 / EfficientNet tail (small planes, many channels)
    (64, 240, 28, 5, 1),   # EfficientNet
    (64, 96, 56, 7, 1),    # ConvNeXt
    (64, 384, 14, 7, 1),   # ConvNeXt
    (16, 512, 16, 31, 1),  # RepLKNet
]
DTYPES = ("float32", "float16", "bfloat16")
LAYOUTS = ("NCHW", "NHWC")
DIRECTIONS = ("forward", "backward_input", "backward_weight")

#: Relative error-norm bounds of the GPU tests (tests/_helpers.py).
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}

#: Lower bound on the L2 size used for the rotation (H200: 60 MB).
L2_BYTES_AT_LEAST = 60 * 2**20

#: FP32 lanes (FMA units) per SM by compute capability; 128 for anything not listed.
FP32_LANES_PER_SM = {(7, 0): 64, (7, 5): 64, (8, 0): 64}



def case_name(n, c, hw, k, stride):
    return f"{n}x{c}x{hw} {k}x{k} s{stride}"


def out_size(size, k, stride, pad):
    return (size + 2 * pad - k) // stride + 1


def valid_taps(size, k, stride, pad):
    """Taps of a k-wide window that land inside ``size``, summed over every output position."""
    total = 0
    for o in range(out_size(size, k, stride, pad)):
        start = o * stride - pad
        total += max(0, min(k, size - start) - max(0, -start))
    return total


def cell_work(n, c, hw, k, stride, itemsize):
    """{direction: bytes moved at the floor}, the FMA count (the same in every
    direction) and, for comparison only, the FMA count with the padding taps."""
    pad = k // 2
    o = out_size(hw, k, stride, pad)
    x, y, w = n * c * hw * hw * itemsize, n * c * o * o * itemsize, c * k * k * itemsize
    nbytes = {"forward": x + y + w, "backward_input": y + x + w, "backward_weight": x + y + w}
    taps = valid_taps(hw, k, stride, pad)
    return nbytes, n * c * taps * taps, n * c * o * o * k * k


def fma_rate_per_us():
    """Peak FP32 FMAs per microsecond of device 0, and how it was obtained."""
    props = cupy.cuda.runtime.getDeviceProperties(0)
    sms = props["multiProcessorCount"]
    major, minor = props["major"], props["minor"]
    lanes = FP32_LANES_PER_SM.get((major, minor), 128)
    clock_khz = props.get("clockRate", 0)  # max (boost) SM clock, kHz
    source = "device properties clockRate"
    if not clock_khz:
        clock_khz, source = 1_980_000, "H200 SXM boost clock (the device reported none)"
    rate = sms * lanes * clock_khz * 1e-3  # FMAs per us
    text = f"{sms} SMs x {lanes} FP32 lanes x {clock_khz / 1e3:.0f} MHz ({source}) = {rate / 1e6:.1f} TFMA/s"
    return rate, text


def l2_bytes():
    """The larger of the reported L2 size and 60 MiB (too many copies only cost memory)."""
    try:
        return max(cupy.cuda.runtime.getDeviceProperties(0)["l2CacheSize"], L2_BYTES_AT_LEAST)
    except Exception:
        return L2_BYTES_AT_LEAST


def check_streams(torch):
    """CuPy's and PyTorch's current streams must both be the legacy default
    stream, so the CUDA events of time_us bracket PyTorch's kernels too."""
    cupy_stream = cupy.cuda.get_current_stream().ptr
    torch_stream = torch.cuda.current_stream().cuda_stream
    if cupy_stream != 0 or torch_stream != 0:
        raise SystemExit(f"expected both on the legacy default stream (0): CuPy {cupy_stream:#x}, "
                         f"PyTorch {torch_stream:#x} (CUPY_CUDA_PER_THREAD_DEFAULT_STREAM set?)")
    if torch.cuda.current_device() != cupy.cuda.Device().id:
        raise SystemExit("CuPy and PyTorch are on different devices")
    text = "CuPy and PyTorch both on the legacy default stream (0) of device 0"
    print(text)
    return text


def to_cupy(torch, tensor):
    """Zero-copy view (DLPack); bfloat16 travels as int16, the one 2-byte type
    every DLPack implementation knows, and is viewed back on the other side."""
    if tensor.dtype == torch.bfloat16:
        return cupy.from_dlpack(tensor.view(torch.int16)).view(_dtypes.bfloat16)
    return cupy.from_dlpack(tensor)


def to_torch(torch, array):
    if array.dtype == _dtypes.bfloat16:
        return torch.from_dlpack(array.view(cupy.int16)).view(torch.bfloat16)
    return torch.from_dlpack(array)


class CaseData:
    """One (case, dtype): rotating copies of x and dy, contiguous NCHW and
    channels_last (PyTorch) with our NCHW / NHWC arrays viewing the same memory."""

    def __init__(self, torch, n, c, hw, k, stride, dtype, copies):
        pad = k // 2
        o = out_size(hw, k, stride, pad)
        tdtype = getattr(torch, dtype)
        gen = torch.Generator(device="cuda").manual_seed(0)

        def randn(*shape):
            return torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(tdtype)

        x, dy = randn(n, c, hw, hw), randn(n, c, o, o)
        w = randn(c, 1, k, k)
        # The weight as each memory format has it after model.to(memory_format=...):
        # (C, 1, K, K) contiguous, and channels_last strides (K*K, 1, K, 1).
        self.w = {"NCHW": w, "channels_last": torch.empty_like(w, memory_format=torch.channels_last).copy_(w)}
        # The copies hold the same values: the correctness check can use any of them.
        self.x = {"NCHW": [x] + [x.clone() for _ in range(copies - 1)]}
        self.dy = {"NCHW": [dy] + [dy.clone() for _ in range(copies - 1)]}
        cl = torch.channels_last
        self.x["channels_last"] = [t.contiguous(memory_format=cl) for t in self.x["NCHW"]]
        self.dy["channels_last"] = [t.contiguous(memory_format=cl) for t in self.dy["NCHW"]]
        # Our arrays: NCHW = the contiguous tensors; NHWC = the channels_last
        # tensors permuted to (N, H, W, C), which are C-contiguous.
        self.ours_x = {
            "NCHW": [to_cupy(torch, t) for t in self.x["NCHW"]],
            "NHWC": [to_cupy(torch, t.permute(0, 2, 3, 1)) for t in self.x["channels_last"]],
        }
        self.ours_dy = {
            "NCHW": [to_cupy(torch, t) for t in self.dy["NCHW"]],
            "NHWC": [to_cupy(torch, t.permute(0, 2, 3, 1)) for t in self.dy["channels_last"]],
        }
        self.ours_w = to_cupy(torch, w)  # (C, 1, K, K) contiguous in both layouts
        self.c, self.stride, self.pad, self.copies = c, stride, pad, copies


def torch_call(torch, data, direction, memory_format, i):
    """PyTorch's eager call for one cell on copy ``i`` (``memory_format``: NCHW or channels_last)."""
    x, dy, w = data.x[memory_format][i], data.dy[memory_format][i], data.w[memory_format]
    s, p, c = [data.stride] * 2, [data.pad] * 2, data.c
    if direction == "forward":
        return lambda: torch.nn.functional.conv2d(x, w, None, s, p, [1, 1], c)
    mask = [True, False, False] if direction == "backward_input" else [False, True, False]
    return lambda: torch.ops.aten.convolution_backward(dy, x, w, None, s, p, [1, 1], False, [0, 0], c, mask)


def ours_call(data, direction, layout, i):
    x, dy, w = data.ours_x[layout][i], data.ours_dy[layout][i], data.ours_w
    conv = dict(padding=data.pad, stride=data.stride, layout=layout)
    if direction == "forward":
        return lambda: cupy_dwgn.depthwise_conv2d(x, w, **conv)
    if direction == "backward_input":
        # input_shape in the layout's own order: (N, C, H, W) or (N, H, W, C).
        return lambda: cupy_dwgn.depthwise_conv2d_backward_input(dy, w, x.shape, **conv)
    return lambda: cupy_dwgn.depthwise_conv2d_backward_weight(dy, x, w.shape, **conv)


def reference(torch, data, direction):
    """PyTorch in float64 on copy 0 (NCHW): y, dx or dw."""
    x, dy, w = data.x["NCHW"][0].double(), data.dy["NCHW"][0].double(), data.w["NCHW"].double()
    s, p, c = [data.stride] * 2, [data.pad] * 2, data.c
    if direction == "forward":
        return torch.nn.functional.conv2d(x, w, None, s, p, [1, 1], c)
    mask = [True, False, False] if direction == "backward_input" else [False, True, False]
    grads = torch.ops.aten.convolution_backward(dy, x, w, None, s, p, [1, 1], False, [0, 0], c, mask)
    return grads[0] if direction == "backward_input" else grads[1]


def relative_error(torch, ours, layout, direction, ref):
    got = to_torch(torch, ours)
    if layout == "NHWC" and direction != "backward_weight":
        got = got.permute(0, 3, 1, 2)  # (N, H, W, C) -> the logical (N, C, H, W)
    if tuple(got.shape) != tuple(ref.shape):
        return float("nan")
    return ((got.double() - ref).norm() / ref.norm()).item()  # NaN when an output is NaN


def fmt(value, spec=".1f", width=8):
    return f"{'-':>{width}}" if value is None else f"{value:{width}{spec}}"


def cell_line(row):
    best = row.get("torch_best_us")
    text = (f"{row['case']:17} {row['dtype']:8} {row['layout']:4} {row['direction']:15} "
            f"ours {fmt(row['ours_us'])}  torch NCHW {fmt(row['torch_nchw_us'])} "
            f"CL {fmt(row['torch_channels_last_us'])}  floor {fmt(row['floor_us'])}")
    if row["ours_us"] is not None and best is not None:
        verdict = "faster" if row["ours_us"] < best else "SLOWER"
        text += (f"  | vs PyTorch best ({row['torch_best_format']}) x{row['ratio_vs_torch_best']:.2f} {verdict}"
                 f", {100 * row['fraction_of_floor']:.0f}% of floor")
    if row.get("rel_error") is not None:
        text += f", err {row['rel_error']:.1e}{'' if row['rel_error_ok'] else ' EXCEEDS ' + str(TOLERANCE[row['dtype']])}"
    if row.get("error"):
        text += f"  ERROR {row['error']}"
    return text


def final_table(rows):
    print()
    print(f"{'case':17} {'dtype':8} {'lay':4} {'direction':15} {'ours':>8} {'NCHW':>8} {'CL':>8} "
          f"{'floor':>8} {'speedup':>8} {'%floor':>7} {'rel err':>8}")
    for r in rows:
        speedup = r.get("ratio_vs_torch_best")
        frac = r.get("fraction_of_floor")
        err = r.get("rel_error")
        print(f"{r['case']:17} {r['dtype']:8} {r['layout']:4} {r['direction']:15} {fmt(r['ours_us'])} "
              f"{fmt(r['torch_nchw_us'])} {fmt(r['torch_channels_last_us'])} {fmt(r['floor_us'])} "
              f"{fmt(speedup, '.2f')} {fmt(None if frac is None else 100 * frac, '.0f', 7)} "
              f"{fmt(err, '.1e')}" + ("  " + r["error"][:60] if r.get("error") else ""))
    timed = [r for r in rows if r.get("ratio_vs_torch_best") is not None]
    won = sum(r["ratio_vs_torch_best"] > 1 for r in timed)
    print(f"\nours faster than PyTorch's best format in {won} of {len(timed)} timed cells; "
          f"{len(rows) - len(timed)} cells without a time of ours")
    if timed:
        geo = math.exp(sum(math.log(r["ratio_vs_torch_best"]) for r in timed) / len(timed))
        print(f"geometric mean speedup over PyTorch's best: {geo:.2f}x")
    bad = [r for r in rows if r.get("rel_error_ok") is False]
    print(f"cells over the error bound: {len(bad)}")


def run_case(torch, args, bandwidth, fma_rate, l2, case, dtype, timing, rows, progress):
    n, c, hw, k, stride = case
    name = case_name(*case)
    itemsize = 4 if dtype == "float32" else 2
    nbytes, fmas, fmas_with_padding = cell_work(n, c, hw, k, stride, itemsize)
    o = out_size(hw, k, stride, k // 2)
    # The smallest tensor one call reads decides how many copies keep every read out of L2.
    smallest_read = n * c * min(hw, o) ** 2 * itemsize
    copies = max(1, -(-2 * l2 // smallest_read))
    data = CaseData(torch, n, c, hw, k, stride, dtype, copies)
    for direction in args.directions:
        torch_us = {}
        for memory_format in ("NCHW", "channels_last"):
            try:
                torch_us[memory_format] = time_us(
                    rotating([torch_call(torch, data, direction, memory_format, i) for i in range(copies)]), **timing)
            except Exception as error:
                torch_us[memory_format] = None
                torch_us.setdefault("error", f"{memory_format}: {type(error).__name__}: {error}")
        timed_torch = {f: t for f, t in torch_us.items() if f != "error" and t is not None}
        best_format = min(timed_torch, key=timed_torch.get) if timed_torch else None
        try:
            ref = reference(torch, data, direction)
        except Exception as error:
            ref = None
            ref_error = f"{type(error).__name__}: {error}"
        memory_floor, fma_floor = nbytes[direction] / bandwidth, fmas / fma_rate
        floor = max(memory_floor, fma_floor)
        for layout in args.layouts:
            progress[0] += 1
            row = {
                "op": "depthwise_conv2d", "case": name, "dtype": dtype, "layout": layout,
                "direction": direction, "timing": "eager",
                "ours_us": None, "torch_nchw_us": torch_us["NCHW"],
                "torch_channels_last_us": torch_us["channels_last"], "floor_us": floor,
                "ratio_vs_torch_best": None, "fraction_of_floor": None,
                "torch_best_us": timed_torch.get(best_format), "torch_best_format": best_format,
                "torch_best_fraction_of_floor": floor / timed_torch[best_format] if best_format else None,
                "memory_floor_us": memory_floor, "fma_floor_us": fma_floor,
                "bytes": nbytes[direction], "fmas": fmas, "fmas_with_padding": fmas_with_padding,
                "rotating_copies": copies,
                "rel_error": None, "rel_error_ok": None,
            }
            if "error" in torch_us:
                row["torch_error"] = torch_us["error"]
            try:
                out = ours_call(data, direction, layout, 0)()
                if ref is not None:
                    row["rel_error"] = relative_error(torch, out, layout, direction, ref)
                    row["rel_error_ok"] = bool(row["rel_error"] <= TOLERANCE[dtype])  # False for NaN
                else:
                    row["reference_error"] = ref_error
                del out
                row["ours_us"] = time_us(rotating([ours_call(data, direction, layout, i) for i in range(copies)]), **timing)
            except Exception as error:
                row["error"] = f"{type(error).__name__}: {error}"
                if args.traceback:
                    traceback.print_exc()
            if row["ours_us"] is not None:
                row["fraction_of_floor"] = floor / row["ours_us"]
                if best_format:
                    row["ratio_vs_torch_best"] = row["torch_best_us"] / row["ours_us"]
            rows.append(row)
            print(f"[{progress[0]}/{progress[1]}] " + cell_line(row), flush=True)
        del ref
    del data
    # Give the memory back between cases, so neither pool starves the other.
    torch.cuda.empty_cache()
    cupy.get_default_memory_pool().free_all_blocks()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", metavar="SUBSTRING",
                        help='keep the cases whose name ("64x144x56 3x3 s1") contains any of these')
    parser.add_argument("--shapes", nargs="+", type=conv_shape, metavar="NxCxHxKxS",
                        help="these cases (N x C x H=W x filter size x stride, e.g. 64x144x75x3x1) instead of the "
                             "table's; --cases still filters them")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--directions", nargs="+", choices=DIRECTIONS, default=list(DIRECTIONS))
    parser.add_argument("--json", help="results file (default benchmarks/results/depthwise_<gpu>_<date>.json; - for none)")
    parser.add_argument("--png", help="also plot the results here (plot_depthwise.py)")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run, not for the record)")
    parser.add_argument("--traceback", action="store_true", help="print the traceback of each failing call of ours")
    args = parser.parse_args()
    table = args.shapes or CASES
    cases = [case for case in table if not args.cases or any(s in case_name(*case) for s in args.cases)]
    if not cases:
        parser.error(f"no case matches {args.cases}; cases: {[case_name(*c) for c in table]}")

    import torch

    torch.backends.cudnn.benchmark = True
    stream = check_streams(torch)
    bandwidth, facts = run_facts(torch)  # bytes per us
    fma_rate, fma_text = fma_rate_per_us()
    l2 = l2_bytes()
    print(f"FP32 FMA rate: {fma_text}; L2 {l2 / 2**20:.0f} MiB")
    timing = dict(warmup=3, repeat=10, min_batch_us=1000.0) if args.quick else {}
    results = results_document(
        facts, [],
        fp32_fma_rate_TFMAps=fma_rate / 1e6, fp32_fma_rate=fma_text,
        l2_bytes=l2, stream=stream, quick=args.quick,
        torch_settings={"cudnn.benchmark": True, "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32},
    )
    json_path = results_path(args.json, "depthwise", facts)
    progress = [0, len(cases) * len(args.dtypes) * len(args.layouts) * len(args.directions)]
    start = datetime.datetime.now()
    with torch.no_grad():
        for case in cases:
            for dtype in args.dtypes:
                run_case(torch, args, bandwidth, fma_rate, l2, case, dtype, timing, results["rows"], progress)
                write_json(json_path, results)  # after every case: a cut-short run keeps what it measured
    final_table(results["rows"])
    print(f"wall time {(datetime.datetime.now() - start).total_seconds():.0f} s" + (f"; results in {json_path}" if json_path else ""))
    if args.png:
        plot_safely("plot_depthwise", results, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
