"""Where a training step's time goes: benchmarks/models.py's model and step (same batch, mode
and memory format), torch's own layers against the model converted with cupy_dwgn.torch.convert,
under torch.profiler.  Per variant:

* the host time to issue a step and its GPU time (CUDA events), so a host-bound step shows as GPU
  time well above its kernel time, with Python's garbage collector on and off, and the
  collections it ran (a step that creates many Python objects pays for full collections);
* the sum of kernel time per step and the top kernels by GPU time per step (ours: the dwgn_*
  kernels; torch's depthwise: cuDNN / ATen convolution kernels), with launch counts;
* the CPU-side operators with the most self time per step (what the host spends);
* with --cprofile, the Python functions with the most own time per step (cProfile; the host's time
  between torch operators, which torch.profiler attributes to none).

    PYTHONPATH=.:benchmarks python benchmarks/profile_model.py [--configs mobilenetv2_100:float32 ...]
        [--format channels_last] [--steps 3] [--rows 25] [--timing-only] [--graphed] [--cprofile]

A config is MODEL:MODE (models.py's MODELS and MODES).  Needs a GPU, torch and (for the timm
models) timm.
"""
import argparse
import copy
import cProfile
import io
import pstats
import gc
import statistics
import time

import models


def _timed_steps(torch, step, steps, collector):
    """Per step: host time to issue it (ms), its GPU time (ms, CUDA events), and over all steps
    the collections of each generation a step and the ms a step spent in them; the garbage
    collector enabled ("on") or disabled ("off") during the steps."""
    times = {}

    def on_collection(phase, info):
        if phase == "start":
            times["start"] = time.perf_counter()
        else:
            generation = info["generation"]
            counts[generation] += 1
            counts[3] += (time.perf_counter() - times.pop("start", time.perf_counter())) * 1e3

    counts = [0, 0, 0, 0.0]
    walls, gpus = [], []
    gc.callbacks.append(on_collection)
    if collector == "off":
        gc.disable()
    try:
        for _ in range(steps):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            step()
            stop.record()
            host = time.perf_counter() - t0
            torch.cuda.synchronize()
            walls.append(host * 1e3)
            gpus.append(start.elapsed_time(stop))
    finally:
        gc.enable()
        gc.callbacks.remove(on_collection)
    return walls, gpus, [c / steps for c in counts]


def _python_profile(torch, step, steps, rows):
    """cProfile of ``steps`` steps: the functions with the most own time (ms a step)."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(rows)
    print(f"   cProfile over {steps} steps (seconds in all; profiler overhead included):")
    print("\n".join("   " + line for line in text.getvalue().splitlines() if line.strip()))


def _profile_variant(torch, dwt, name, mode, memory_format, impl, steps, rows, warmup, timing_only, graphed,
                     python_profile=False):
    device = torch.device("cuda")
    base = models.build_model(torch, name)
    _, batch, shape, _ = models.MODELS[name]
    out_shape = models.output_shape(torch, base, shape, device)
    model = copy.deepcopy(base)
    if impl == "ours":
        model = dwt.convert(model)
    model = models.place(torch, model, mode, memory_format, device)
    step = models.make_step(torch, model, name, mode, memory_format, device, batch, out_shape, graphed)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    for collector in ("on", "off"):
        walls, gpus, collected = _timed_steps(torch, step, steps, collector)
        label = f"{name} {mode} {memory_format} {impl}{', graphed' if graphed else ''}"
        print(f"== {label}, Python's garbage collector {collector}: host time to "
              f"issue a step {statistics.median(walls):.2f} ms, GPU time {statistics.median(gpus):.2f} ms (CUDA "
              f"events); collections a step by generation {collected[0]:.1f} / {collected[1]:.1f} / "
              f"{collected[2]:.1f}, {collected[3]:.2f} ms in them", flush=True)
    if python_profile:
        _python_profile(torch, step, steps, rows)
    if timing_only:
        return
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
               or (getattr(e, "self_device_time_total", 0) > 0 and getattr(e, "cpu_time_total", 0) == 0)]
    kernel_us = sum(e.self_device_time_total for e in kernels) / steps
    print(f"   kernels (torch.profiler) {kernel_us / 1e3:.2f} ms a step", flush=True)
    print("   top kernels (us a step, launches a step):")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:rows]:
        print(f"   {e.self_device_time_total / steps:9.1f} {e.count / steps:6.1f}  {e.key[:150]}")
    ops = [e for e in events if e.self_cpu_time_total > 0 and e not in kernels]
    print("   top host operators (self CPU us a step, calls a step):")
    for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:rows // 2]:
        print(f"   {e.self_cpu_time_total / steps:9.1f} {e.count / steps:6.1f}  {e.key[:150]}")
    del model, step
    torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=["mobilenetv2_100:float32"], metavar="MODEL:MODE")
    parser.add_argument("--format", choices=models.FORMATS, default="channels_last")
    parser.add_argument("--impls", nargs="+", choices=("torch", "ours"), default=["torch", "ours"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--timing-only", action="store_true", help="no torch.profiler tables")
    parser.add_argument("--graphed", action="store_true",
                        help="the models' forward and backward as CUDA graphs (make_graphed_callables): kernel time "
                             "without the host's (not for bfloat16-autocast)")
    parser.add_argument("--cprofile", action="store_true", help="also the Python functions with the most own time")
    args = parser.parse_args()
    configs = []
    for text in args.configs:
        name, _, mode = text.partition(":")
        if name not in models.MODELS or mode not in models.MODES:
            parser.error(f"--configs: expected MODEL:MODE with MODEL in {list(models.MODELS)} and MODE in "
                         f"{list(models.MODES)}, got {text!r}")
        configs.append((name, mode))

    import torch

    import cupy_dwgn.torch as dwt

    torch.backends.cudnn.benchmark = True
    for name, mode in configs:
        for impl in args.impls:
            _profile_variant(torch, dwt, name, mode, args.format, impl, args.steps, args.rows, args.warmup,
                              args.timing_only, args.graphed, args.cprofile)


if __name__ == "__main__":
    main()
