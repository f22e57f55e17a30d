"""Kernel loading: .cu text -> one cupy.RawModule per used specialization.

* The .cu files live in ``kernels/`` (shipped in the wheel as ``cupy_dwgn/_kernels``).
* The shared header is inlined into the source text, because CuPy keys its
  on-disk cubin cache on the source text, not on ``-I`` includes.
* One module per name expression, memoized per device: only what is used is
  compiled, and CuPy >= 14.2 caches each one on disk across processes.
* Name expressions are spelled as the demangler prints them
  (``"dwgn_dwconv2d_fwd<float, 3, 3, int>"``), so the disk cache always hits.
"""

import functools
import os
import pathlib
import re
import sys
import time

from .errors import KernelCompileError

#: Options given to NVRTC for every kernel (CuPy adds -arch, -ftz=true and its
#: include directories).  Spelled out so CuPy 14's defaults cannot drift.
OPTIONS = ("--std=c++17",)

_HEADER = "dwgn_common.cuh"
_INCLUDE_RE = re.compile(r'^#include "([A-Za-z0-9_.]+)"\s*$', re.MULTILINE)


def kernel_dir():
    """Folder holding the .cu files.

    ``CUPY_DWGN_KERNEL_DIR`` overrides; an installed wheel has them in
    ``cupy_dwgn/_kernels``; a source checkout or editable install reads the live
    ``kernels/`` beside the package.
    """
    override = os.environ.get("CUPY_DWGN_KERNEL_DIR")
    if override:
        return pathlib.Path(override)
    package = pathlib.Path(__file__).resolve().parent
    for candidate in (package / "_kernels", package.parent / "kernels"):
        if (candidate / _HEADER).is_file():
            return candidate
    raise FileNotFoundError(
        f"cupy_dwgn kernels not found in {package / '_kernels'} or {package.parent / 'kernels'}; "
        "reinstall cupy-dwgn or set CUPY_DWGN_KERNEL_DIR"
    )


@functools.cache
def kernel_source(filename):
    """Source text of ``filename`` with our own headers inlined."""
    folder = kernel_dir()

    def inline(match):
        return (folder / match.group(1)).read_text()

    return _INCLUDE_RE.sub(inline, (folder / filename).read_text())


def name_expression(kernel, *template_args):
    """``name_expression("k", "float", 3, "int")`` -> ``"k<float, 3, int>"``."""
    return f"{kernel}<{', '.join(str(a) for a in template_args)}>"


def _cupy_version():
    try:
        import cupy

        return cupy.__version__
    except ImportError:  # pragma: no cover - reporting only
        return "not installed"


#: Kernels loaded in this process (compiled, or read from CuPy's disk cache)
#: and the seconds spent doing so; the test suite reports them.
load_stats = {"kernels": 0, "seconds": 0.0}


def _load(filename, expression):
    import cupy

    start = time.perf_counter()
    module = cupy.RawModule(
        code=kernel_source(filename), options=OPTIONS, name_expressions=(expression,)
    )
    try:
        function = module.get_function(expression)
    except cupy.cuda.compiler.CompileException as error:
        raise KernelCompileError(expression, OPTIONS, _cupy_version(), str(error)) from error
    load_stats["kernels"] += 1
    load_stats["seconds"] += time.perf_counter() - start
    return function


def _memoized_loader():
    import cupy

    return cupy.memoize(for_each_device=True)(_load)


_loader = None


def get_kernel(filename, expression):
    """The compiled kernel for one specialization on the current device."""
    global _loader
    if _loader is None:
        _loader = _memoized_loader()
    return _loader(filename, expression)


def load_specializations(specializations, *, progress=True, stream=None, jobs=1):
    """Compile (or load from CuPy's disk cache) each ``(filename, name_expression)``
    on the current device.  Returns how many were loaded; prints one line of
    progress per kernel on ``stream`` (default stderr) when ``progress`` is true.
    With ``jobs`` > 1, ``jobs`` processes first compile them into the disk
    cache (:func:`cache_in_processes`), and this process then loads them from it.
    """
    stream = sys.stderr if stream is None else stream
    specializations = list(dict.fromkeys(specializations))
    start = time.perf_counter()
    if jobs > 1 and len(specializations) > 1:
        cache_in_processes(specializations, jobs, progress=progress, stream=stream)
    for index, (filename, expression) in enumerate(specializations, 1):
        t0 = time.perf_counter()
        get_kernel(filename, expression)
        if progress:
            print(
                f"[{index}/{len(specializations)}] {expression}  "
                f"{time.perf_counter() - t0:.2f} s",
                file=stream,
                flush=True,
            )
    if progress:
        print(
            f"cupy_dwgn: {len(specializations)} kernels ready in "
            f"{time.perf_counter() - start:.1f} s",
            file=stream,
            flush=True,
        )
    return len(specializations)


def cache_in_processes(specializations, jobs, *, progress=True, stream=None):
    """Compile ``specializations`` into CuPy's disk cache from ``jobs``
    spawned processes at once, each on the current device (NVRTC runs on the
    host, one kernel per process at a time: about 0.3-0.8 s each on an H200
    host).  Each goes through the same loader as a later call (the same
    source, options and name expression), so the later lookups hit the
    cache; CUPY_CACHE_DIR reaches the processes through the environment.
    Each process also loads its kernels, so it opens a CUDA context on the
    device (a GPU in exclusive-process mode refuses all but one).
    Prints one line per finished process share on ``stream`` when
    ``progress`` is true.  Returns the number of processes used.  A
    process's error (e.g. KernelCompileError) is raised here; a process
    that dies raises concurrent.futures.process.BrokenProcessPool."""
    import concurrent.futures
    import multiprocessing

    import cupy

    _check_jobs(jobs)
    stream = sys.stderr if stream is None else stream
    specializations = list(dict.fromkeys(specializations))
    jobs = max(1, min(jobs, len(specializations)))
    shares = [specializations[i::jobs] for i in range(jobs)]
    device = cupy.cuda.runtime.getDevice()
    start = time.perf_counter()
    done = 0
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_cache_share, device, share) for share in shares]
        try:
            for future in concurrent.futures.as_completed(futures):
                done += future.result()
                if progress:
                    print(f"[{done}/{len(specializations)}] kernels compiled into the cache by {jobs} processes "
                          f"({time.perf_counter() - start:.0f} s)", file=stream, flush=True)
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    return jobs


def _check_jobs(jobs):
    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
        raise ValueError(f"jobs: expected a positive int, got {jobs!r}")


def _cache_share(device, share):
    import cupy

    with cupy.cuda.Device(device):
        load_specializations(share, progress=False)
    return len(share)


_OP_MODULES = {
    "depthwise_conv2d": "depthwise",
    "depthwise_conv2d_backward_input": "depthwise",
    "depthwise_conv2d_backward_weight": "depthwise",
    "group_norm": "_group_norm",
    "group_norm_backward": "_group_norm",
}


def specializations(ops=None, **selection):
    """Every ``(file, name expression)`` the given ops can launch.

    ops: op names (default: all of them).  ``selection`` narrows the set:
    ``dtypes``, ``filter_sizes`` and ``layouts`` (depthwise), ``activations`` (group_norm),
    ``large_index`` (False, True or both).
    """
    import importlib

    ops = tuple(_OP_MODULES) if ops is None else ((ops,) if isinstance(ops, str) else tuple(ops))
    specs = []
    for op in ops:
        if op not in _OP_MODULES:
            raise ValueError(f"ops: expected names from {sorted(_OP_MODULES)}, got {op!r}")
        module = importlib.import_module(f"cupy_dwgn.{_OP_MODULES[op]}")
        # Each op module names the selection keys it understands.
        own = {k: v for k, v in selection.items() if k in module.SELECTION_KEYS}
        specs += module.specializations(op, **own)
    return list(dict.fromkeys(specs))


def _supported_dtype(dtype):
    """``dtype`` as a NumPy dtype when the kernels support it, else a ValueError
    naming the supported ones."""
    import numpy

    from ._dtypes import CTYPES, SUPPORTED_NAMES

    try:
        resolved = numpy.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved not in CTYPES:
        raise ValueError(f"dtypes: expected names from {', '.join(SUPPORTED_NAMES)}, got {dtype!r}")
    return resolved


def precompile(ops=None, *, dtypes=None, filter_sizes=None, activations=None, layouts=None, large_index=False, progress=True, jobs=1):
    """Compile, or load from the disk cache, every kernel a model needs, on the
    current device, so that no compilation happens later (for example during
    CUDA-graph capture or timing).

    Args:
        ops: op names, e.g. ``["depthwise_conv2d", "group_norm"]`` (default: all).
        dtypes: e.g. ``[cupy.float16]`` (default: all four).
        filter_sizes: depthwise (KH, KW) pairs, e.g. ``[(3, 3), (7, 7)]``
            (default: the specialized sizes and the generic kernel).
        activations: GroupNorm activations (default: all).
        layouts: depthwise layouts, ``["NCHW"]`` and/or ``["NHWC"]`` (default: both).
        large_index: also (True) or only ("only") the 64-bit-index kernels.
        progress: print a line per kernel to stderr.
        jobs: compile in this many processes at once first (into CuPy's disk
            cache, then loaded here): a first run's compile time divided by
            about the core count.  Kernels already in the cache cost nothing
            either way.  The processes are spawned (multiprocessing), so a
            script calls it under ``if __name__ == "__main__":``.

    Returns:
        The number of kernels loaded.

    Example:
        >>> cupy_dwgn.precompile(["depthwise_conv2d"], dtypes=[cupy.float16], filter_sizes=[(3, 3)])
        >>> cupy_dwgn.precompile(["group_norm", "group_norm_backward"], jobs=8)
    """
    _check_jobs(jobs)
    widths = {False: (False,), True: (False, True), "only": (True,)}.get(large_index)
    if widths is None or not isinstance(large_index, (bool, str)):
        raise ValueError(f"large_index: expected False, True or 'only', got {large_index!r}")
    if dtypes is not None:
        dtypes = [_supported_dtype(d) for d in ((dtypes,) if isinstance(dtypes, str) else dtypes)]
    if layouts is not None:
        layouts = (layouts,) if isinstance(layouts, str) else tuple(layouts)
        for layout in layouts:
            if layout not in ("NCHW", "NHWC"):
                raise ValueError(f"layouts: expected 'NCHW' and/or 'NHWC', got {layout!r}")
    selection = {"dtypes": dtypes, "large_index": widths}
    if filter_sizes is not None:
        selection["filter_sizes"] = filter_sizes
    if activations is not None:
        selection["activations"] = activations
    if layouts is not None:
        selection["layouts"] = layouts
    return load_specializations(specializations(ops, **selection), progress=progress, jobs=jobs)


# ---------------------------------------------------------------------------
# Compile without a GPU (CI, `python -m cupy_dwgn check`): NVRTC only.

_PTXAS_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(sm_\d+)'")
_PTXAS_FRAME = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def _cuda_include_dir():
    import cuda.pathfinder

    return cuda.pathfinder.find_nvidia_header_directory("cudart")


def _cccl_include_options():
    """The CCCL include folders CuPy gives NVRTC at run time (libcu++'s
    ``<nv/target>``, needed by ``<cooperative_groups.h>``), so that the
    offline compile sees the same headers as a RawModule does."""
    try:
        from cupy._core import core
    except ImportError:  # pragma: no cover - CuPy without the CCCL bundle
        return ()
    return tuple(core._get_cccl_include_options())


def filter_size_specializations(file, expression, supported_dtypes, supported_sizes, dtypes=None,
                                filter_sizes=None, large_index=(False, True), variants=((),)):
    """``(file, expression(dtype, filter size, index type, *variant))`` for
    every supported dtype and filter size among those asked for (None: all),
    every tuple in ``variants`` (a kernel's other template choices, e.g.
    (stride, backward)) and every index width in ``large_index`` (False:
    int, True: long long): the specializations() of the kernel modules
    compiled per dtype, filter size and index width."""
    import numpy

    dtypes = supported_dtypes if dtypes is None else [
        numpy.dtype(d) for d in dtypes if numpy.dtype(d) in supported_dtypes]
    sizes = supported_sizes if filter_sizes is None else [
        tuple(s) for s in filter_sizes if tuple(s) in supported_sizes]
    large_index = (large_index,) if isinstance(large_index, bool) else tuple(large_index)
    return [
        (file, expression(dtype, size, "long long" if large else "int", *variant))
        for dtype in dtypes for size in dict.fromkeys(sizes) for variant in variants for large in large_index
    ]


def direction_specializations(file, expression, supported_dtypes, supported_sizes, variants, dtypes=None,
                              filter_sizes=None, backward=None, large_index=(False, True)):
    """filter_size_specializations of a kernel whose variants are (stride,
    backward) and whose ``expression(dtype, k, stride, backward, index)``
    names a square-filter specialization; ``backward``: None (both), False
    (forward) or True (backward-input)."""
    return filter_size_specializations(
        file, lambda dtype, size, index, stride, is_backward: expression(dtype, size[0], stride, is_backward, index),
        supported_dtypes, supported_sizes, dtypes, filter_sizes, large_index,
        [v for v in variants if backward is None or v[1] == backward])


def nvrtc_compile(filename, expressions, arch):
    """Compile ``expressions`` of ``filename`` for ``sm_<arch>`` with NVRTC alone.

    Needs no GPU and no driver.  Returns ``{expression: report}`` where report
    holds ``registers``, ``stack_frame``, ``spill_stores`` and ``spill_loads``
    as read from ``-Xptxas=-v``, and ``lowered``, the kernel's mangled name.
    Raises KernelCompileError on failure.
    """
    from cupy_backends.cuda.libs import nvrtc

    options = OPTIONS + (
        f"-arch=sm_{arch}",
        "-ftz=true",
        "--device-as-default-execution-space",
        "-Xptxas=-v",
        f"-I{_cuda_include_dir()}",
    ) + _cccl_include_options()
    program = nvrtc.createProgram(kernel_source(filename), filename, [], [])
    try:
        for expression in expressions:
            nvrtc.addNameExpression(program, expression)
        try:
            nvrtc.compileProgram(program, list(options))
        except nvrtc.NVRTCError as error:
            log = nvrtc.getProgramLog(program)
            shown = expressions[0] if len(expressions) == 1 else (
                f"{expressions[0]} and {len(expressions) - 1} more specializations"
            )
            raise KernelCompileError(shown, options, _cupy_version(), log) from error
        log = nvrtc.getProgramLog(program)
        lowered = {nvrtc.getLoweredName(program, e): e for e in expressions}
    finally:
        nvrtc.destroyProgram(program)
    reports = _parse_ptxas(log, lowered)
    for name, expression in lowered.items():
        reports.setdefault(expression, {})["lowered"] = name
    return reports


def _parse_ptxas(log, lowered):
    reports = {}
    current = None
    for line in log.splitlines():
        if (m := _PTXAS_ENTRY.search(line)) is not None:
            current = reports.setdefault(lowered.get(m.group(1), m.group(1)), {})
        elif current is not None and (m := _PTXAS_FRAME.search(line)) is not None:
            current["stack_frame"], current["spill_stores"], current["spill_loads"] = map(
                int, m.groups()
            )
        elif current is not None and (m := _PTXAS_REGS.search(line)) is not None:
            current["registers"] = int(m.group(1))
    return reports
