"""Comparison helpers shared by the GPU tests."""

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy

BFLOAT16 = numpy.dtype(ml_dtypes.bfloat16)
DTYPES = [numpy.dtype(numpy.float32), numpy.dtype(numpy.float64), numpy.dtype(numpy.float16), BFLOAT16]
DTYPE_IDS = [str(d) for d in DTYPES]

#: Relative error-norm bounds ||out - ref|| / ||ref|| against the float64 reference.
TOLERANCE = {
    numpy.dtype(numpy.float64): 1e-12,
    numpy.dtype(numpy.float32): 1e-5,
    numpy.dtype(numpy.float16): 2e-3,
    BFLOAT16: 1.6e-2,
}


def random(rng, shape, dtype, offset=0.0):
    """Random normal data rounded to ``dtype`` (a NumPy array of that dtype)."""
    return (offset + rng.standard_normal(shape)).astype(dtype)


def relative_error(out, ref):
    """||out - ref|| / ||ref|| in float64; fails on any NaN/inf in ``out``."""
    import cupy

    got = cupy.asnumpy(out).astype(numpy.float64)
    ref = numpy.asarray(ref, dtype=numpy.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert numpy.isfinite(got).all(), f"{(~numpy.isfinite(got)).sum()} non-finite outputs (unwritten?)"
    denominator = numpy.linalg.norm(ref)
    if denominator == 0:
        return float(numpy.linalg.norm(got))
    return float(numpy.linalg.norm(got - ref) / denominator)


def poisoned(shape, dtype):
    """A device array full of NaN, to catch elements a kernel fails to write."""
    import cupy

    return cupy.full(shape, numpy.nan, dtype=numpy.float32).astype(dtype)


#: Worst relative error seen per (table, row, column) in this session; the
#: terminal summary prints it (evidence for issue notes, not an assertion).
WORST_ERRORS = {}


def record_errors(table, row, errors):
    """Keep the worst of ``errors`` ({column: relative error}) for ``row``."""
    for column, error in errors.items():
        key = (table, row, column)
        WORST_ERRORS[key] = max(WORST_ERRORS.get(key, 0.0), error)


def run_in_fresh_process(code, timeout=300):
    """Run ``code`` in a new Python process (no kernel loaded, nothing
    cached) that imports this checkout's cupy_dwgn; returns the JSON its last
    stdout line prints."""
    path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=dict(os.environ, PYTHONPATH=path)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
