"""The command line works on a machine without a GPU."""

import subprocess
import sys


def _run(*args):
    return subprocess.run([sys.executable, "-m", "cupy_dwgn", *args], capture_output=True, text=True)


def test_info_reports_without_failing():
    result = _run("info")
    assert result.returncode == 0, result.stderr
    assert "cupy-dwgn" in result.stdout and "kernels:" in result.stdout


def test_check_prints_the_ptxas_report_and_passes():
    result = _run("check", "--ops", "depthwise_conv2d", "--arch", "90")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "dwgn_dwconv2d_fwd<float, 3, 3, int>" in result.stdout
    assert "<-- stack/spill" not in result.stdout
