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


#: NCHW 7x7 at stride 1, by plane side: the kernel family the ops take, per
#: ROUTE_DTYPES (the rules of 2026-12-06 in _depthwise_nchw_rows,
#: _depthwise_nchw_plane and _depthwise_conv_mma.preferred; the H200 width
#: sweep in benchmarks/results/depthwise_7x7_widths_h200_2026-12-06.txt).
ROUTE_DTYPES = [numpy.dtype(numpy.float32), numpy.dtype(numpy.float16), BFLOAT16]
ROUTES_7X7 = {
    7: ("plane", "plane", "plane"), 8: ("rows", "rows", "rows"), 10: ("rows", "plane", "plane"),
    13: ("plane", "plane", "plane"),
    16: ("window", "plane", "mma"), 17: ("plane", "plane", "plane"), 20: ("window", "plane", "plane"),
    21: ("plane", "plane", "plane"), 26: ("plane", "mma", "mma"), 28: ("window", "mma", "mma"),
}
#: float32 onto 8-wide rows at stride 1: (N, C), filter size, the family the
#: ops take (forward and backward-input; the register row walk's rule,
#: _depthwise_nchw_forward_regs.takes_narrow_float32: 7x7 from 24576 planes).
NARROW_FLOAT32_ROUTES = [
    ((2, 12), 3, "walk"), ((2, 12), 5, "walk"), ((2, 12), 7, "rows"),
    ((2, 12287), 7, "rows"), ((2, 12288), 7, "walk"),
]


def route_kernel(family):
    """The kernel-name prefix of a family of ROUTES_7X7 or NARROW_FLOAT32_ROUTES."""
    from cupy_dwgn import (_depthwise_conv_mma, _depthwise_nchw_forward_regs, _depthwise_nchw_plane,
                           _depthwise_nchw_rows, _depthwise_nchw_window)

    return {"rows": _depthwise_nchw_rows.KERNEL, "plane": _depthwise_nchw_plane.KERNEL,
            "window": _depthwise_nchw_window.KERNEL, "mma": _depthwise_conv_mma.KERNEL,
            "walk": _depthwise_nchw_forward_regs.KERNEL}[family]



def dispatch_stand_in(size, dtype, address=256):
    """An object the depthwise dispatch can plan for without a device: it
    reads an array's size, dtype and address only."""
    import types

    return types.SimpleNamespace(size=size, dtype=dtype, data=types.SimpleNamespace(ptr=address))


SM90_SHARED_OPT_IN = 232448  # cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_90


def h200_device_facts(patch):
    """Answers the device queries the depthwise plans make as an H200 would,
    through ``patch`` (a pytest MonkeyPatch: the fixture, or
    MonkeyPatch.context() where hypothesis runs many cases in one test
    call): the opt-in shared memory per block (the large-filter plans, the
    NHWC ring's long rows) and the current device, so the dispatch plans
    without a GPU.  The large-filter plans' memo is cleared here; a caller
    whose plans must not outlive it clears it again after."""
    from cupy.cuda import runtime

    from cupy_dwgn import _depthwise_nchw_large, _launch

    patch.setattr(_depthwise_nchw_large, "_shared_limit", lambda device: SM90_SHARED_OPT_IN)
    patch.setattr(_launch, "max_shared_per_block", lambda device: SM90_SHARED_OPT_IN)
    patch.setattr(runtime, "getDevice", lambda: 0)
    _depthwise_nchw_large._plan.cache_clear()


def nchw_launch_expressions(g, x):
    """The kernel expressions the NCHW ops launch for ``g`` with ``x`` as
    source and destination (an array or ``dispatch_stand_in``): forward,
    backward-input."""
    from cupy_dwgn import depthwise

    return tuple(steps(g, "NCHW", x, x).launches[0].expression
                 for steps in (depthwise._forward_steps, depthwise._backward_input_steps))

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


def programmatic_settings(monkeypatch, signatures):
    """False, then True, with cupy_dwgn._launch.PROGRAMMATIC set so for the
    caller's loop body: the per-device answers and ``signatures`` (an op's
    call-signature cache, whose Steps bind once) are cleared each time, and
    programmatic_on agrees (on only on sm_90 and later)."""
    import cupy

    from cupy_dwgn import _launch

    device = cupy.cuda.Device().id
    for programmatic in (False, True):
        monkeypatch.setattr(_launch, "PROGRAMMATIC", programmatic)
        monkeypatch.setattr(_launch, "_PROGRAMMATIC_DEVICES", {})
        signatures.clear()
        assert _launch.programmatic_on(device) == (programmatic and _launch.compute_capability_major(device) >= 9)
        yield programmatic
    signatures.clear()


def replay_on_new_data(call, inputs, new_inputs, outputs):
    """Capture ``call()`` (which reads the device arrays ``inputs`` and writes
    the given ``outputs``) in a CUDA graph on a new stream, after one call
    there (the workspace is sized on that stream); copy ``new_inputs`` (host
    arrays) into ``inputs``, poison ``outputs`` with NaN and replay."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        call()
        stream.synchronize()
        stream.begin_capture()
        call()
        graph = stream.end_capture()
        for array, value in zip(inputs, new_inputs):
            array.set(value, stream=stream)
        for array in outputs:
            array.fill(numpy.nan)
        graph.launch(stream)
        stream.synchronize()


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
