"""Shared test setup: the `gpu` marker skips (visibly) without a CUDA GPU."""

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

    stats = _compile.load_stats
    if stats["kernels"]:
        terminalreporter.write_line(
            f"cupy_dwgn: {stats['kernels']} kernel specializations loaded in "
            f"{stats['seconds']:.1f} s (NVRTC compile or CuPy disk cache)"
        )
