"""Packaging: the wheel ships the kernels; a source checkout reads the live ones."""

import pathlib
import subprocess
import sys
import tarfile
import zipfile

import pytest

import cupy_dwgn
from cupy_dwgn import _compile

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """The sdist, and the wheel built from that sdist (as pip does): (sdist, wheel)."""
    pytest.importorskip("build", reason="the wheel tests need the test extra (pip install -e '.[test]')")
    pytest.importorskip("hatchling", reason="the wheel tests need the test extra (pip install -e '.[test]')")
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (sdist,) = out.glob("cupy_dwgn-*.tar.gz")
    (wheel,) = out.glob("cupy_dwgn-*.whl")
    return sdist, wheel


@pytest.fixture(scope="module")
def wheel(dist):
    return dist[1]


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


def test_wheel_ships_the_license_and_the_changelog(wheel):
    prefix = f"cupy_dwgn-{cupy_dwgn.__version__}.dist-info/"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        assert prefix + "licenses/LICENSE" in names
        assert archive.read(prefix + "licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
        assert prefix + "extra_metadata/CHANGELOG.md" in names
        meta = archive.read(prefix + "METADATA").decode()
    assert "License-Expression: Apache-2.0" in meta and "License-File: LICENSE" in meta


def test_sdist_ships_the_license_and_the_changelog(dist):
    sdist, _ = dist
    root = f"cupy_dwgn-{cupy_dwgn.__version__}/"
    with tarfile.open(sdist) as archive:
        names = set(archive.getnames())
        for name in ("LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml", "kernels/dwgn_common.cuh"):
            assert root + name in names, name
        assert archive.extractfile(root + "LICENSE").read() == (ROOT / "LICENSE").read_bytes()


def test_license_is_the_apache_2_text_and_the_changelog_covers_this_version():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert f"## {cupy_dwgn.__version__}" in (ROOT / "CHANGELOG.md").read_text()


def test_user_facing_files_cite_nothing_outside_the_repository():
    """No DESIGN.md or ../shared reference in the package, README, changelog,
    examples or benchmarks (they are not in the repository)."""
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "README.md"]
    for folder, pattern in (("cupy_dwgn", "*.py"), ("examples", "*.py"), ("benchmarks", "*.py"), ("kernels", "*")):
        files += sorted((ROOT / folder).glob(pattern))
    for path in files:
        text = path.read_text()
        for needle in ("DESIGN.md", "../shared", "shared/tools"):
            assert needle not in text, f"{path.relative_to(ROOT)} cites {needle}"
