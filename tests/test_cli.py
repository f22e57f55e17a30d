"""The command line: plain messages (never a traceback) for user errors and a
missing GPU or CuPy, validated options, help under both program names, the
`check` summary line; the GPU-status reasons; the selftest table logic (run
on the CPU with a stand-in for the GPU ops)."""

import io
import pathlib
import re
import subprocess
import sys
import types

import numpy
import pytest

from conftest import GPU_COUNT
from cupy_dwgn import __main__ as cli
from cupy_dwgn import _device, _selftest, reference

SCRIPT = pathlib.Path(sys.executable).with_name("cupy-dwgn")
SUMMARY = re.compile(
    r"^(\d+) specializations x 1 arch \(sm_90\) compiled, worst: (\d+) registers, 0 B stack/spill: OK$"
)
no_gpu = pytest.mark.skipif(GPU_COUNT > 0, reason="a GPU is present: these commands run for real")


def _run(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "cupy_dwgn", *args], capture_output=True, text=True, env=env, timeout=600
    )


def _plain(result):
    """No traceback anywhere; stderr is at most one paragraph."""
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    assert "\n\n" not in result.stderr.strip(), result.stderr


# --- every command on this machine -------------------------------------------


def test_info_reports_versions_gpus_and_folders(tmp_path):
    env = dict(__import__("os").environ, CUPY_CACHE_DIR=str(tmp_path / "cache"))
    result = _run("info", env=env)
    assert result.returncode == 0, result.stderr
    _plain(result)
    labels = [line.split(":", 1)[0] for line in result.stdout.splitlines()]
    for label in ("cupy-dwgn", "Python", "NumPy", "CuPy", "CUDA runtime", "NVRTC", "NVIDIA driver", "cupy_dwgn.host", "kernels", "kernel cache"):
        assert label in labels, result.stdout
    assert ("GPU 0" in labels) == bool(GPU_COUNT) and ("GPUs" in labels) == (not GPU_COUNT)
    assert str(tmp_path / "cache") in result.stdout
    if GPU_COUNT:
        assert re.search(r"^GPU 0: .* \(sm_\d+, ", result.stdout, re.MULTILINE)


@no_gpu
@pytest.mark.parametrize("command", ["precompile", "selftest"])
def test_gpu_commands_explain_a_missing_gpu(command):
    result = _run(command)
    assert result.returncode == 1
    _plain(result)
    assert result.stdout == ""
    message = result.stderr.strip()
    assert message.startswith(f"python -m cupy_dwgn {command}: needs a CUDA GPU")
    assert "\n" not in message and "nvidia-smi" in message


@pytest.mark.gpu
def test_selftest_passes_on_the_gpu():
    result = _run("selftest", "--seed", "0")
    assert result.returncode == 0, result.stdout + result.stderr
    _plain(result)
    lines = result.stdout.splitlines()
    assert lines[-1].startswith("selftest: all 32 checks passed on GPU 0 ("), result.stdout
    assert sum(line.split()[-1] == "pass" or "pass  (" in line for line in lines) == 32, result.stdout


@pytest.mark.gpu
def test_precompile_on_the_gpu():
    result = _run("precompile", "--ops", "group_norm", "--dtypes", "float16", "--activations", "silu", "--quiet")
    assert result.returncode == 0, result.stdout + result.stderr
    _plain(result)
    assert re.fullmatch(r"\d+ kernels ready on GPU 0 \(.+, sm_\d+\)\n", result.stdout), result.stdout
    assert result.stderr == ""


@pytest.mark.gpu
def test_precompile_in_several_processes(tmp_path):
    # --jobs 2 into an empty cache: two spawned processes compile the
    # kernels into CUPY_CACHE_DIR, then the command loads them from there.
    import os

    env = dict(os.environ, CUPY_CACHE_DIR=str(tmp_path))
    result = _run("precompile", "--ops", "group_norm", "--dtypes", "float16", "--activations", "silu", "--jobs", "2",
                  env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    count = int(re.fullmatch(r"(\d+) kernels ready on GPU 0 \(.+, sm_\d+\)\n", result.stdout).group(1))
    assert f"[{count}/{count}] kernels compiled into the cache by 2 processes" in result.stderr, result.stderr
    assert len([f for f in tmp_path.rglob("*") if f.is_file()]) >= count  # one cache entry per kernel


@no_gpu
def test_debug_variable_shows_the_traceback():
    result = _run("precompile", env=dict(__import__("os").environ, CUPY_DWGN_DEBUG="1"))
    assert result.returncode != 0 and "Traceback" in result.stderr and "CommandError" in result.stderr


def test_check_ends_with_one_summary_line():
    result = _run("check", "--ops", "group_norm", "--arch", "90", "--quiet")
    assert result.returncode == 0, result.stdout + result.stderr
    _plain(result)
    assert result.stderr == ""
    (line,) = result.stdout.splitlines()
    match = SUMMARY.match(line)
    assert match, line
    assert int(match.group(1)) > 0 and 0 < int(match.group(2)) <= 255


def test_check_prints_the_ptxas_report_then_the_summary():
    result = _run("check", "--ops", "depthwise_conv2d", "--dtypes", "float32", "--arch", "90")
    assert result.returncode == 0, result.stdout + result.stderr
    _plain(result)
    lines = result.stdout.splitlines()
    assert any(line.endswith("dwgn_dwconv2d_fwd<float, 3, 3, int>") for line in lines)
    assert "<-- stack/spill" not in result.stdout
    assert SUMMARY.match(lines[-1]), lines[-1]
    assert int(SUMMARY.match(lines[-1]).group(1)) == len(lines) - 1  # one report line per specialization
    assert "specializations for sm_90 ..." in result.stderr  # progress goes to stderr


# --- option validation ------------------------------------------------------


@pytest.mark.parametrize(
    "args, allowed",
    [
        (["precompile", "--dtypes", "int8"], ["float16", "float32", "float64", "bfloat16"]),
        (["check", "--dtypes", "float8"], ["float16", "float32", "float64", "bfloat16"]),
        (["selftest", "--dtypes", "int32"], ["float16", "bfloat16"]),
        (["precompile", "--ops", "conv2d"], list(cli.OPS)),
        (["check", "--ops", "groupnorm"], list(cli.OPS)),
        (["precompile", "--layouts", "NWHC"], ["NCHW", "NHWC"]),
        (["precompile", "--activations", "swish"], ["identity", "silu", "gelu_tanh"]),
        (["precompile", "--filter-sizes", "3y3"], ["3x3"]),
        (["precompile", "--jobs", "0"], ["positive number"]),
        (["check", "--arch", "sm90"], ["invalid int value"]),
        (["info", "--verbose"], ["unrecognized arguments"]),
        (["frobnicate"], ["info", "precompile", "check", "selftest"]),
    ],
)
def test_bad_option_values_name_the_allowed_ones(args, allowed, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(args)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for value in allowed:
        assert value in err, err


@pytest.mark.parametrize("arch", [70, 75, 91, 200])
def test_check_rejects_architectures_nvrtc_or_the_kernels_cannot_target(arch, capsys):
    assert cli.main(["check", "--arch", "90", str(arch)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m cupy_dwgn check: --arch {arch}: choose from 80 ")
    assert " 90 " in err and "sm_80 or newer" in err


def test_an_unexpected_error_is_one_line_with_the_debug_hint(monkeypatch, capsys):
    from cupy_dwgn import _compile

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(_compile, "nvrtc_compile", broken)
    monkeypatch.delenv("CUPY_DWGN_DEBUG", raising=False)
    assert cli.main(["check", "--ops", "group_norm", "--arch", "90", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == (
        "python -m cupy_dwgn check: RuntimeError: boom "
        "(unexpected: run again with CUPY_DWGN_DEBUG=1 for the traceback and report it)"
    )
    monkeypatch.setenv("CUPY_DWGN_DEBUG", "1")
    with pytest.raises(RuntimeError, match="boom"):
        cli.main(["check", "--ops", "group_norm", "--arch", "90", "--quiet"])


def test_without_cupy_every_command_says_so_plainly():
    code = (
        "import sys\n"
        "sys.modules['cupy'] = sys.modules['cupy_backends'] = None  # import cupy -> ImportError\n"
        "from cupy_dwgn.__main__ import main\n"
        "codes = [main([c] + extra) for c, extra in "
        "[('info', []), ('precompile', []), ('selftest', []), ('check', ['--ops', 'group_norm', '--quiet'])]]\n"
        "print('codes', codes)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in result.stderr, result.stderr
    assert "codes [0, 1, 1, 1]" in result.stdout, result.stdout + result.stderr
    assert "CuPy:" in result.stdout and "not importable" in result.stdout
    messages = result.stderr.strip().splitlines()
    assert len(messages) == 3, messages
    assert all("pip install -e '.[cuda13]'" in m for m in messages), messages
    assert messages[0].startswith("python -m cupy_dwgn precompile: needs a CUDA GPU (`check` compiles every kernel "
                                  "without one): CuPy is not installed")


# --- help under both program names ------------------------------------------


def _help_texts(launch):
    texts = [launch("--help")]
    texts += [launch(command, "--help") for command in ("info", "precompile", "check", "selftest")]
    return texts


@pytest.mark.parametrize("program", ["python -m cupy_dwgn", "cupy-dwgn"])
def test_help_renders_cleanly_under_both_program_names(program):
    if program == "cupy-dwgn":
        if not SCRIPT.exists():
            pytest.skip(f"no console script at {SCRIPT} (package not installed into this environment)")
        command = [str(SCRIPT)]
    else:
        command = [sys.executable, "-m", "cupy_dwgn"]

    def launch(*args):
        result = subprocess.run(command + list(args), capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        return result.stdout

    texts = _help_texts(launch)
    assert texts[0].startswith(f"usage: {program} [-h] [--version] COMMAND")
    for command_name, text in zip(("info", "precompile", "check", "selftest"), texts[1:]):
        assert text.startswith(f"usage: {program} {command_name}"), text
    for text in texts:
        assert "``" not in text and "Traceback" not in text
        assert max(len(line) for line in text.splitlines()) <= 100, text
    other = "cupy-dwgn " if program != "cupy-dwgn" else "python -m cupy_dwgn"
    assert other not in texts[0]
    assert f"{program} check --ops group_norm --arch 90 --quiet" in texts[0]


def test_program_name_follows_argv0(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/cupy-dwgn"])
    assert cli._prog() == "cupy-dwgn"
    monkeypatch.setattr(sys, "argv", ["/site-packages/cupy_dwgn/__main__.py"])
    assert cli._prog() == "python -m cupy_dwgn"


# --- why there is no GPU ----------------------------------------------------


class _FakeRuntime:
    def __init__(self, driver, runtime=13020):
        self.driver, self.runtime = driver, runtime

    def driverGetVersion(self):
        if isinstance(self.driver, Exception):
            raise self.driver
        return self.driver

    def runtimeGetVersion(self):
        return self.runtime


class CUDARuntimeError(RuntimeError):
    pass


INSUFFICIENT = CUDARuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version")


@pytest.mark.parametrize("driver", [0, OSError("libcuda.so.1: cannot open shared object file")])
def test_no_driver_is_not_called_an_old_driver(driver):
    reason = _device.explain_no_gpu(_FakeRuntime(driver), INSUFFICIENT)
    assert reason.startswith("no NVIDIA driver found (libcuda not loadable): ")
    assert "insufficient" not in reason and "nvidia-smi" in reason


def test_old_driver_names_both_versions_and_the_minimum():
    reason = _device.explain_no_gpu(_FakeRuntime(12040, 13020), INSUFFICIENT)
    assert reason.startswith("NVIDIA driver too old for CUDA runtime 13.2 (needs >= 580, for CUDA 13.0): ")
    assert "supports CUDA 12.4" in reason and "cuda12 extra" in reason


def test_old_driver_within_one_major():
    reason = _device.explain_no_gpu(_FakeRuntime(12000, 12080), INSUFFICIENT)
    assert reason.startswith("NVIDIA driver too old for CUDA runtime 12.8 (needs >= 525.60.13, for CUDA 12.0): ")


def test_driver_without_devices():
    error = CUDARuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
    reason = _device.explain_no_gpu(_FakeRuntime(13000), error)
    assert reason.startswith("no CUDA GPU found: the NVIDIA driver (CUDA 13.0) sees no device")


def test_install_hint_works_from_where_the_user_stands():
    assert "pip install 'cupy-dwgn[" not in _device.INSTALL_HINT  # no package index serves it
    assert "from a checkout of this repository, pip install -e '.[cuda13]'" in _device.INSTALL_HINT
    assert "'cupy-cuda13x>=14.2'" in _device.INSTALL_HINT


# --- selftest on the CPU, with a stand-in for the GPU ops -------------------


def _stand_in(broken=None, raises=None):
    """Reference ops whose results come back rounded to the input dtype (what a
    correct GPU kernel returns); ``broken`` adds a large error to one op,
    ``raises`` makes one op raise."""

    def wrap(name):
        function = getattr(reference, name)

        def op(*args, **kwargs):
            if name == raises:
                raise RuntimeError("kernel launch failed\nsecond line")
            out = function(*args, **kwargs)
            dtype = args[0].dtype
            if name == "group_norm":
                y, mean, rstd = out
                stats = numpy.float32 if dtype.itemsize == 2 else dtype
                y = y.astype(dtype) + (1.0 if name == broken else 0)
                return y, mean.astype(stats), rstd.astype(stats)
            if name == "group_norm_backward":
                dx, dw, db = out
                return dx.astype(dtype), dw.astype(args[5].dtype), db.astype(args[6].dtype)
            out = out.astype(dtype)
            return out * 1.5 if name == broken else out

        return op

    names = _selftest.DEPTHWISE_OPS + _selftest.GROUP_NORM_OPS
    return types.SimpleNamespace(**{name: wrap(name) for name in names})


def _selftest_run(ops, dtypes=_selftest.DTYPES):
    out = io.StringIO()
    failed = _selftest.run(dtypes, ops=ops, to_device=numpy.asarray, to_host=numpy.asarray,
                           reference=reference, seed=3, out=out)
    return failed, out.getvalue().splitlines()


def test_selftest_passes_results_within_the_dtype_bounds():
    failed, lines = _selftest_run(_stand_in())
    assert failed == 0, "\n".join(lines)
    rows = lines[2:]
    assert len(rows) == len(_selftest.cases()) == 32
    assert all(row.split()[-1] == "pass" for row in rows), rows
    ops = {(row.split()[0], row.split()[1], row.split()[2]) for row in rows}
    for dtype in ("float32", "float16", "bfloat16", "float64"):
        for layout in ("NCHW", "NHWC"):
            assert ("depthwise_conv2d_backward_weight", layout, dtype) in ops
        assert ("group_norm_backward", "NHWC", dtype) in ops


def test_selftest_reports_a_wrong_op_and_a_raising_one():
    failed, lines = _selftest_run(_stand_in(broken="depthwise_conv2d"), dtypes=("float32",))
    assert failed == 2, "\n".join(lines)  # NCHW and NHWC
    assert [row.split()[-1] for row in lines[2:]].count("FAIL") == 2
    failed, lines = _selftest_run(_stand_in(raises="group_norm_backward"), dtypes=("float16",))
    assert failed == 1
    (row,) = [row for row in lines if "FAIL" in row]
    assert row.startswith("group_norm_backward") and row.endswith("FAIL (RuntimeError: kernel launch failed)")
