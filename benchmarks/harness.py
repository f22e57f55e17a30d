"""Timing helpers: CUDA events, warm-up, median of repeats, and the measured
device-to-device copy bandwidth that every figure is compared with."""

import datetime
import importlib
import json
import os
import pathlib
import re
import statistics
import subprocess
import time

import cupy


def conv_shape(text):
    """An argparse type: "NxCxHxKxSTRIDE" (64x768x12x3x1: N, C, H = W,
    filter size, stride) as a tuple of five ints."""
    import argparse

    try:
        values = tuple(int(v) for v in text.split("x"))
    except ValueError:
        values = ()
    if len(values) != 5 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected NxCxHxKxSTRIDE of positive integers (64x768x12x3x1), got {text!r}")
    return values


def time_us(fn, *, warmup=5, repeat=30, min_batch_us=2000.0):
    """Median GPU time of one ``fn()`` call in microseconds.

    Calls are enqueued in batches between two CUDA events (batch size chosen
    so a batch lasts >= ``min_batch_us``), so the GPU stays busy and the
    host's own per-call cost overlaps with the kernels instead of being
    counted; the median over ``repeat`` batches is returned.
    """
    for _ in range(warmup):
        fn()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    single = max(cupy.cuda.get_elapsed_time(start, stop) * 1e3, 1.0)
    batch = max(1, min(1000, int(min_batch_us / single)))
    times = []
    for _ in range(repeat):
        start.record()
        for _ in range(batch):
            fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3 / batch)
    return statistics.median(times)


def steps_with_mode(module, mode, build, *args, off=()):
    """``build(*args)`` (e.g. depthwise._backward_input_steps) with
    ``module.MODE`` set to ``mode`` and the modules in ``off`` (kernels the
    ops try before it) "never" meanwhile: the Steps the ops would run under
    that mode, for the kernel comparisons."""
    modes = {other: "never" for other in off}
    modes[module] = mode
    saved = {m: m.MODE for m in modes}
    for m, value in modes.items():
        m.MODE = value
    try:
        return build(*args)
    finally:
        for m, value in saved.items():
            m.MODE = value


def wgrad_kernels_before(module):
    """The weight-gradient kernel modules the ops try before ``module``'s
    (the tensor-core kernel comes first for half types): what a comparison
    of ``module`` switches off."""
    from cupy_dwgn import _depthwise_wgrad_mma

    return () if module is _depthwise_wgrad_mma else (_depthwise_wgrad_mma,)


def nhwc_kernel_baseline(module, g, dtype, backward, copies=3):
    """The NHWC forward / backward-input kernel comparisons' setup: for
    geometry ``g`` (layout NHWC), ``copies`` rotating (src, weight, bias or
    0, dst) argument tuples of random data in ``dtype`` (destinations NaN),
    and the kernel the ops launch with ``module.MODE`` "never" timed on them.
    Returns (arrays, name of that kernel, its GPU us per launch, its output
    as float32)."""
    import numpy

    from cupy_dwgn import depthwise

    n, c, k = g.batch, g.channels, g.filter_height
    x_shape, y_shape = (n, g.height, g.width, c), (n, g.out_height, g.out_width, c)
    src_shape, dst_shape = (y_shape, x_shape) if backward else (x_shape, y_shape)
    srcs = [cupy.random.standard_normal(src_shape, dtype=cupy.float32).astype(dtype) for _ in range(copies)]
    w = cupy.random.standard_normal((c, 1, k, k), dtype=cupy.float32).astype(dtype)
    b = 0 if backward else cupy.random.standard_normal((c,), dtype=cupy.float32).astype(dtype)
    arrays = [(s, w, b, cupy.full(dst_shape, numpy.nan, dtype=dtype)) for s in srcs]
    build = depthwise._backward_input_steps if backward else depthwise._forward_steps
    steps = steps_with_mode(module, "never", build, g, "NHWC", srcs[0], arrays[0][3])
    name = steps.launches[0].expression.split("<")[0].replace("dwgn_dwconv_nhwc_", "")
    return arrays, name, steps_time_us(steps, arrays), arrays[0][3].astype(numpy.float32)


def steps_time_us(steps, arrays_list, reps=20):
    """Mean GPU time (us) of one run of ``steps`` (a cupy_dwgn._launch.Steps,
    built once by the caller) over ``reps`` runs cycling through
    ``arrays_list`` (rotating copies), after one warm-up run of each: the
    kernel comparisons' timer (no host cost per call beyond the enqueue)."""
    from cupy_dwgn import _launch

    for arrays in arrays_list:
        _launch.run(steps, arrays)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for r in range(reps):
        _launch.run(steps, arrays_list[r % len(arrays_list)])
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) * 1000 / reps


def compare_wgrad_modes(module, modes, g, layout, x_shape, dy_shape, dtype, copies=3):
    """The weight-gradient kernel comparisons' measurement: ``copies``
    rotating random (x, grad_out) pairs of ``dtype`` and, per (name, mode) of
    ``modes``, the Steps the ops build with ``module.MODE`` = mode (and the
    kernels tried before it off: wgrad_kernels_before), timed by
    steps_time_us.  Returns (times, results, kernels, (dys, xs, arrays)):
    per name the us per call, the float32 result and the first launch's
    kernel expression (not a layout transpose); the inputs and the argument
    tuples (grad_out, x, NULL, grad_weight) of further timings."""
    import numpy
    from cupy_dwgn import depthwise

    c, k = g.channels, g.filter_height
    xs = [cupy.random.standard_normal(x_shape, dtype=cupy.float32).astype(dtype) for _ in range(copies)]
    dys = [cupy.random.standard_normal(dy_shape, dtype=cupy.float32).astype(dtype) for _ in range(copies)]
    outs = [cupy.empty((c, 1, k, k), dtype) for _ in range(copies)]
    arrays = [(dy, x, 0, o) for dy, x, o in zip(dys, xs, outs)]
    times, results, kernels = {}, {}, {}
    for name, mode in modes:
        steps = steps_with_mode(module, mode, depthwise._backward_weight_steps, g, layout, dys[0], xs[0],
                                off=wgrad_kernels_before(module))
        kernels[name] = next(launch.expression for launch in steps.launches if "transpose" not in launch.expression)
        times[name] = steps_time_us(steps, arrays)
        results[name] = outs[0].astype(numpy.float32)
    return times, results, kernels, (dys, xs, arrays)


def wgrad_comparison_line(label, name, other, times, results, floor_us):
    """The start of a weight-gradient comparison's line (compare_wgrad_modes'
    ``times`` and ``results``): ``name`` against ``other``, each in us and as
    a fraction of the floor, the speedup, the floor and the largest
    difference relative to the largest output of ``other``."""
    ref = results[other]
    diff = float(cupy.max(cupy.abs(results[name] - ref)) / (cupy.max(cupy.abs(ref)) + 1e-30))
    return (f"{label} {name} {times[name]:7.1f} us ({floor_us / times[name]:4.0%})  {other} {times[other]:7.1f} us "
            f"({floor_us / times[other]:4.0%})  x{times[other] / times[name]:.2f}  floor {floor_us:5.1f}  "
            f"reldiff {diff:.1e}")


def parse_comparison(parser, all_dtypes):
    """The weight-gradient comparisons' common start: parse ``parser`` (which
    has --dtypes and --torch), switch cudnn.benchmark on where --torch asks,
    measure and print the copy bandwidth.  Returns (args, the dtypes of
    ``all_dtypes`` that --dtypes keeps, bytes per us)."""
    import numpy

    args = parser.parse_args()
    if args.torch:
        import torch

        torch.backends.cudnn.benchmark = True
    dtypes = [numpy.dtype(d) for d in all_dtypes if args.dtypes is None or numpy.dtype(d).name in args.dtypes]
    return args, dtypes, announced_copy_bandwidth()


def rotating(calls):
    """One callable that calls the next of ``calls`` each time (the calls
    read rotating copies of their inputs, so none finds its data in L2)."""
    state = {"i": 0}

    def call():
        fn = calls[state["i"]]
        state["i"] = (state["i"] + 1) % len(calls)
        return fn()

    return call


def host_us(fn, *, calls=2000):
    """Host time of one call (what a Python loop over tiny tensors sees)."""
    for _ in range(50):
        fn()
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    cupy.cuda.Device().synchronize()
    return elapsed / calls * 1e6


def copy_bandwidth_bytes_per_us(nbytes=2 * 2**30):
    """Device-to-device copy rate, counting bytes read plus bytes written."""
    src = cupy.empty(nbytes // 4, cupy.float32)
    dst = cupy.empty_like(src)
    src.fill(1.0)
    us = time_us(lambda: dst.__setitem__(Ellipsis, src), warmup=3, repeat=10)
    del src, dst
    return 2 * nbytes / us


def announced_copy_bandwidth():
    """copy_bandwidth_bytes_per_us(), also printed ("copy bandwidth X TB/s"):
    the rate a sweep's memory floors are figured at, measured in the run."""
    rate = copy_bandwidth_bytes_per_us()
    print(f"copy bandwidth {rate / 1e6:.2f} TB/s", flush=True)
    return rate


def kernel_profile(torch, fn, *, calls=20):
    """{kernel name: [GPU us, launches]} per ``fn()`` call, from PyTorch's
    CUPTI profiler (it records every kernel of the process, CuPy's
    included).  Template arguments are cut from the names, so kernels of one
    template add up."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    cupy.cuda.Device().synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        cupy.cuda.Device().synchronize()
    kernels = {}
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None)
        if total is None:
            total = getattr(event, "cuda_time_total", 0.0)
        if total:
            name = event.key.split("<")[0].split("(")[0].strip()
            us, launches = kernels.get(name, (0.0, 0.0))
            kernels[name] = [us + total / calls, launches + event.count / calls]
    return kernels


def report(results, json_path=None, key_width=34):
    """Print each case of ``results`` (a dict with "cases") as indented
    key/value lines, and write all of it as JSON when ``json_path`` is given."""
    for case in results["cases"]:
        print(case["case"])
        for key, value in case.items():
            if key != "case":
                print(f"    {key:{key_width}} {value:10.2f}" if isinstance(value, float) else f"    {key:{key_width}} {value}")
    write_json(json_path, results)


def plot_safely(module_name, results, png):
    """Plot ``results`` into ``png`` with benchmarks/<module_name>.py; a
    failing plot is reported and never loses the measurements."""
    try:
        importlib.import_module(module_name).plot(results, png)
        print(f"plot in {png}")
    except Exception as error:
        print(f"no plot: {type(error).__name__}: {error}")


def write_json(path, results):
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)


RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"


def gpu_short_name(device):
    """"NVIDIA H200" -> "h200" (the name in the results file names)."""
    match = re.search(r"\b([A-Z]{1,2}\d{2,4})\b", device)
    return (match.group(1) if match else re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")).lower()


def results_path(json_arg, name, facts):
    """Where a benchmark writes its JSON: ``json_arg`` as given (None for
    "-", no file), else results/<name>_<gpu>_<date>.json."""
    if json_arg == "-":
        return None
    if json_arg is not None:
        return json_arg
    RESULTS_DIR.mkdir(exist_ok=True)
    return str(RESULTS_DIR / f"{name}_{gpu_short_name(facts['device'])}_{facts['date']}.json")


def run_facts(torch):
    """The facts every result file starts with (device, date, versions, the
    measured copy bandwidth in bytes/us under "bandwidth"), printed as one line."""
    bandwidth = copy_bandwidth_bytes_per_us()
    facts = {
        "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
        "date": datetime.date.today().isoformat(),
        "cupy": cupy.__version__, "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
        "copy_bandwidth_TBps": bandwidth / 1e6,
    }
    print(f"{facts['device']}  copy bandwidth {facts['copy_bandwidth_TBps']:.2f} TB/s (read+write)")
    return bandwidth, facts


def git_commit():
    """The checkout's short sha (+"-dirty" with uncommitted changes); $DWGN_COMMIT
    when set (a copy of the tree without .git); None when neither is known."""
    if os.environ.get("DWGN_COMMIT"):
        return os.environ["DWGN_COMMIT"]
    root = pathlib.Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except Exception:
        return None


def results_document(facts, rows, commit=None, **extra):
    """A results file in the results schema (benchmarks/README.md): the run's facts
    (from run_facts), then ``extra`` keys, then one row per measured cell."""
    document = {
        "device": facts["device"], "date": facts["date"],
        "commit": commit if commit is not None else git_commit(),
        "versions": {"cupy": facts["cupy"], "torch": facts["torch"], "cudnn": facts["cudnn"]},
        "copy_bandwidth_TBps": facts["copy_bandwidth_TBps"],
    }
    document.update(extra)
    document["rows"] = rows
    return document
