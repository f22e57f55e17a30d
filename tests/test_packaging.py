"""Packaging: the wheel ships the kernels; a source checkout reads the live ones."""

import pathlib
import subprocess
import sys
import zipfile

import pytest

import cupy_dwgn
from cupy_dwgn import _compile

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    pytest.importorskip("build", reason="the wheel tests need the test extra (pip install -e '.[test]')")
    pytest.importorskip("hatchling", reason="the wheel tests need the test extra (pip install -e '.[test]')")
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (path,) = out.glob("cupy_dwgn-*.whl")
    return path


def test_wheel_contains_every_kernel_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for source in (ROOT / "kernels").iterdir():
        assert f"cupy_dwgn/_kernels/{source.name}" in names
    assert "cupy_dwgn/__init__.py" in names


def test_wheel_metadata_pins_cupy_extras(wheel):
    with zipfile.ZipFile(wheel) as archive:
        (meta,) = [n for n in archive.namelist() if n.endswith("METADATA")]
        text = archive.read(meta).decode()
    assert f"Version: {cupy_dwgn.__version__}" in text
    assert "Requires-Dist: numpy" in text and "Requires-Dist: ml-dtypes" in text
    assert "cupy-cuda12x>=14.2; extra == 'cuda12'" in text
    assert "cupy-cuda13x>=14.2; extra == 'cuda13'" in text


def test_source_checkout_reads_the_live_kernels():
    # An editable install or a plain checkout has no _kernels copy: edits to
    # kernels/ are seen without reinstalling.
    assert _compile.kernel_dir() == ROOT / "kernels"


def test_reference_imports_without_touching_cupy():
    code = "import sys, cupy_dwgn.reference; assert 'cupy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
