"""The examples run end to end on a GPU, and explain themselves without one."""

import pathlib
import subprocess
import sys

import pytest

from conftest import GPU_COUNT

EXAMPLES = sorted((pathlib.Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


def _run(example):
    return subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(GPU_COUNT > 0, reason="a GPU is present: the examples run for real (test_example_runs)")
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_explains_missing_gpu_without_a_traceback(example):
    """Without a GPU an example either explains why it cannot run, or says
    it runs on the CPU instead (the PyTorch bridge's CPU path) and succeeds."""
    result = _run(example)
    assert "Traceback" not in result.stderr
    assert "nvidia-smi" in result.stderr or "pip install" in result.stderr
    if "Running this example on the CPU instead" in result.stderr:
        assert result.returncode == 0, result.stdout + result.stderr
        assert "relative error" in result.stdout
    else:
        assert "Cannot run this example:" in result.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(example):
    result = _run(example)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "relative error" in result.stdout


@pytest.mark.gpu
def test_readme_quick_start_runs():
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = readme.index("## Quick start")
    code = readme[readme.index("```python", start) + len("```python") : readme.index("```", readme.index("```python", start) + 9)]
    namespace = {}
    exec(compile(code, "README.md quick start", "exec"), namespace)
    assert namespace["y"].shape == (2, 64, 64, 320) and namespace["dw"].shape == (32, 1, 3, 3)
