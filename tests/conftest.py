"""Shared test setup: the `gpu` marker skips (visibly) without a CUDA GPU;
a GPU run of many tests first compiles the kernels they can launch in
several processes at once (CUPY_DWGN_TEST_JOBS)."""

import os
import time
import zlib

import numpy
import pytest

from cupy_dwgn import gpu_status

GPU_COUNT, NO_GPU_REASON = gpu_status()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # Skipped from this one line (not by a mark per test), so the -ra summary
    # folds every GPU test into one "SKIPPED [n] tests/conftest.py" line and the
    # reason, a paragraph, appears once.
    if not GPU_COUNT and "gpu" in item.keywords:
        pytest.skip(f"GPU test, no usable GPU here: {NO_GPU_REASON}")


# Test files whose GPU tests launch each op family's kernels, and the
# selected GPU tests of a family from which the run compiles all of the
# family's specializations (64-bit-index ones aside: few tests use them) in
# CUPY_DWGN_TEST_JOBS processes before the first test, instead of one by one
# as the tests reach them (an H100 host with 16 CPUs: about 313 s for the
# 958 kernels of the whole suite in one process; 16 processes, from an empty
# cache, 2026-12-05: the 642 depthwise kernels in 17.0 s, the 754 GroupNorm
# ones in 15.6 s).  The GroupNorm file holds 179 GPU tests, hence a bar of
# 100 (a run of a few tests compiles only what they use).  CUPY_DWGN_TEST_JOBS=1
# (or 0) compiles lazily; unset, min(16, CPUs).
_OP_FAMILIES = {
    "depthwise": (("test_depthwise_gpu.py",),
                  ("depthwise_conv2d", "depthwise_conv2d_backward_input", "depthwise_conv2d_backward_weight")),
    "group_norm": (("test_group_norm_gpu.py",), ("group_norm", "group_norm_backward")),
}
_PARALLEL_COMPILE_FROM_TESTS = 100
parallel_compile = {}


def _test_jobs():
    value = os.environ.get("CUPY_DWGN_TEST_JOBS", "")
    if not value:
        return min(16, os.cpu_count() or 1)
    if not value.isdigit():
        raise pytest.UsageError(f"CUPY_DWGN_TEST_JOBS: expected a number of processes, got {value!r}")
    return int(value)


@pytest.fixture(scope="session", autouse=True)
def _compile_kernels_in_parallel(request):
    if not GPU_COUNT:
        return
    jobs = _test_jobs()
    if jobs < 2:
        return
    gpu_files = [item.path.name for item in request.session.items if "gpu" in item.keywords]
    ops = [op for files, family_ops in _OP_FAMILIES.values()
           if sum(name in files for name in gpu_files) >= _PARALLEL_COMPILE_FROM_TESTS for op in family_ops]
    if not ops:
        return
    from cupy_dwgn import _compile

    specializations = _compile.specializations(ops, large_index=False)
    start = time.perf_counter()
    try:
        used = _compile.cache_in_processes(specializations, jobs, progress=False)
    except Exception as error:  # noqa: BLE001 - the tests then compile lazily, as without it
        parallel_compile.update(error=f"{type(error).__name__}: {error}")
        return
    parallel_compile.update(kernels=len(specializations), jobs=used, seconds=time.perf_counter() - start)


@pytest.fixture
def rng(request):
    """A NumPy generator seeded from the test's id: fresh inputs per test,
    reproducible run to run."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return numpy.random.default_rng(seed)


@pytest.fixture
def broken_kernel(tmp_path, monkeypatch):
    """A kernel folder whose broken.cu fails to compile (undefined_name);
    yields the file name, restores the real kernels afterwards."""
    from cupy_dwgn import _compile

    (tmp_path / "dwgn_common.cuh").write_text("#pragma once\n")
    (tmp_path / "broken.cu").write_text(
        '#include "dwgn_common.cuh"\n'
        "template <typename T> __global__ void k(T* p) { p[0] = undefined_name; }\n"
    )
    monkeypatch.setenv("CUPY_DWGN_KERNEL_DIR", str(tmp_path))
    _compile.kernel_source.cache_clear()
    yield "broken.cu"
    _compile.kernel_source.cache_clear()


def pytest_report_header(config):
    if GPU_COUNT:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(0)
        return f"cupy {cupy.__version__}, {GPU_COUNT} GPU(s): {props['name'].decode()}"
    return "no usable GPU: the GPU tests will be skipped (the reason is in the skip summary at the end)"


def pytest_terminal_summary(terminalreporter):
    from _helpers import WORST_ERRORS

    from cupy_dwgn import _compile

    for table in sorted({t for t, _, _ in WORST_ERRORS}):
        rows = sorted({r for t, r, _ in WORST_ERRORS if t == table})
        columns = list(dict.fromkeys(c for t, _, c in WORST_ERRORS if t == table))
        terminalreporter.write_line(f"worst relative error vs float64, {table}:")
        terminalreporter.write_line("    " + f"{'':24}" + "".join(f"{c:>17}" for c in columns))
        for row in rows:
            cells = "".join(
                f"{WORST_ERRORS[(table, row, c)]:17.2e}" if (table, row, c) in WORST_ERRORS else f"{'-':>17}"
                for c in columns
            )
            terminalreporter.write_line(f"    {row:24}{cells}")

    if "error" in parallel_compile:
        terminalreporter.write_line(f"cupy_dwgn: compiling in parallel failed ({parallel_compile['error']}); "
                                    "the tests compiled their kernels one by one")
    elif parallel_compile:
        terminalreporter.write_line(
            f"cupy_dwgn: {parallel_compile['kernels']} kernel specializations compiled (or found) in CuPy's disk "
            f"cache by {parallel_compile['jobs']} processes in {parallel_compile['seconds']:.1f} s before the "
            "first test (CUPY_DWGN_TEST_JOBS=1: one by one, as the tests reach them)")
    stats = _compile.load_stats
    if stats["kernels"]:
        terminalreporter.write_line(
            f"cupy_dwgn: {stats['kernels']} kernel specializations loaded in "
            f"{stats['seconds']:.1f} s (NVRTC compile or CuPy disk cache)"
        )
