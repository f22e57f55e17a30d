"""Every snippet of the README's "Use it from your stack" section runs.

A snippet is a fenced ```python block right after an HTML comment
``<!-- snippet: NAME -->``.  On a CPU-only machine the snippets are only
checked to exist and compile; with a GPU each runs (exec in a fresh
namespace) unless its library is missing (torch, JAX with a GPU backend) or,
for the several-GPUs snippet, there are fewer than two GPUs.
"""

import os
import pathlib
import re

import numpy
import pytest

from conftest import GPU_COUNT

# JAX takes 75% of the GPU at start by default; the snippets share the GPU
# with CuPy and PyTorch in this process.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
SECTION = "## Use it from your stack"
EXPECTED = ["numpy", "cupy", "pytorch", "jax", "several-gpus"]
_SNIPPET = re.compile(r"<!-- snippet: ([\w-]+) -->\s*\n```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def snippets():
    """{name: source} of the marked snippets, in README order."""
    found = {}
    for match in _SNIPPET.finditer(README.read_text()):
        name, source = match.groups()
        assert name not in found, f"snippet {name!r} is marked twice in README.md"
        found[name] = source
    return found


def run(name):
    namespace = {"__name__": f"readme_{name.replace('-', '_')}"}
    exec(compile(snippets()[name], f"README.md snippet {name}", "exec"), namespace)
    return namespace


def test_every_stack_has_a_snippet_that_compiles():
    text = README.read_text()
    assert text.count(SECTION) == 1
    section = text.index(SECTION)
    assert text.index("## Quick start") < section < text.index("## Set up on a fresh machine")
    for heading in ("### NumPy", "### CuPy", "### PyTorch", "### JAX", "### Several GPUs"):
        assert section < text.index(heading), heading
    found = snippets()
    assert list(found) == EXPECTED
    for name, source in found.items():
        assert text.index(f"<!-- snippet: {name} -->") > section
        compile(source, f"README.md snippet {name}", "exec")
    # Every fenced python block of the section is marked (so none escapes this test).
    body = text[section : text.index("## Set up on a fresh machine")]
    assert body.count("```python") == len(EXPECTED)


def test_numpy_snippet():
    """Runs anywhere: cupy_dwgn.host takes the CPU path without a GPU."""
    ns = run("numpy")
    numpy_ = ns["numpy"]
    assert type(ns["y"]) is numpy_.ndarray and ns["y"].shape == (2, 16, 32, 32)
    assert type(ns["z"]) is numpy_.ndarray and ns["z"].shape == (2, 32, 32, 64)
    assert numpy.abs(ns["z"] - ns["z_ref"]).max() < 1e-4


@pytest.mark.gpu
def test_cupy_snippet():
    import cupy

    import cupy_dwgn

    ns = run("cupy")
    expected = cupy_dwgn.depthwise_conv2d(ns["x"], ns["w"], padding=1)  # the new x
    assert cupy.array_equal(ns["y"], expected)


@pytest.mark.gpu
def test_pytorch_snippet():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA here")
    ns = run("pytorch")
    assert ns["y"].is_contiguous(memory_format=torch.channels_last)
    assert ns["w"].grad is not None and ns["w"].grad.shape == (32, 1, 3, 3)
    left = {type(m) for m in ns["model"].modules()} & {torch.nn.Conv2d, torch.nn.GroupNorm, torch.nn.SiLU}
    assert not left, ns["model"]  # all swapped for cupy_dwgn.torch modules (the SiLU fused)
    assert ns["error"] < 1e-2  # float32 (PyTorch may use TF32 in its convolution)


@pytest.mark.gpu
def test_jax_snippet():
    jax = pytest.importorskip("jax")
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        pytest.skip("JAX has no GPU backend here (install jax[cuda13] or jax[cuda12])")
    ns = run("jax")
    assert isinstance(ns["y"], jax.Array) and ns["y"].shape == (8, 32, 56, 56)
    assert ns["dh"].dtype == ns["h"].dtype and ns["dgamma"].dtype == ns["gamma"].dtype
    numpy.testing.assert_allclose(
        numpy.asarray(ns["dh_jit"], numpy.float32), numpy.asarray(ns["dh"], numpy.float32), rtol=2e-2, atol=2e-2
    )


@pytest.mark.gpu
@pytest.mark.skipif(GPU_COUNT < 2, reason="needs two GPUs")
def test_several_gpus_snippet():
    import cupy

    import cupy_dwgn

    ns = run("several-gpus")
    assert ns["y"].device.id == 1
    x0, w0 = cupy.asarray(ns["x"].get()), cupy.asarray(ns["w"].get())  # the same data on device 0
    numpy.testing.assert_array_equal(ns["y"].get(), cupy_dwgn.depthwise_conv2d(x0, w0, padding=1).get())
