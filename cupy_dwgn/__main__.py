"""Command line: cupy-dwgn COMMAND (or python -m cupy_dwgn COMMAND).

    info         versions, driver, GPUs, kernel folder, kernel cache folder
    precompile   compile (or load from the disk cache) kernels on a GPU
    check        compile every specialization with NVRTC alone (no GPU needed)
                 and print the ptxas resource report
    selftest     every op on the GPU against the float64 NumPy reference

A user error or a missing GPU/CuPy prints one plain message on stderr and
exits non-zero; CUPY_DWGN_DEBUG=1 shows the traceback instead.
"""

import argparse
import os
import platform
import sys
import textwrap

from . import __version__, _compile, _device

DTYPES = ("float16", "float32", "float64", "bfloat16")
OPS = tuple(_compile._OP_MODULES)
LAYOUTS = ("NCHW", "NHWC")
ACTIVATIONS = ("identity", "relu", "silu", "gelu", "gelu_tanh")
#: The kernels use cp.async (sm_80+); `check` compiles for these by default.
MIN_ARCH = 80
DEFAULT_ARCHS = (80, 90)

_DEBUG = "CUPY_DWGN_DEBUG"


class CommandError(Exception):
    """A failure to report as one plain paragraph, with exit status ``code``."""

    def __init__(self, message, code=1):
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------- info


def _cupy_or_none():
    try:
        import cupy
    except Exception:
        return None
    return cupy


def _distribution(module):
    """The installed distribution that provides ``module`` (e.g. cupy-cuda13x)."""
    try:
        from importlib.metadata import packages_distributions

        names = packages_distributions().get(module) or []
    except Exception:
        names = []
    return ", ".join(sorted(set(names)))


def _nvrtc():
    """(NVRTC version text, architectures it compiles for) or raises ImportError."""
    from cupy_backends.cuda.libs import nvrtc

    major, minor = nvrtc.getVersion()
    try:
        archs = tuple(int(a) for a in nvrtc.getSupportedArchs())
    except Exception:  # an NVRTC without the query
        archs = ()
    return f"{major}.{minor}", archs


def _cache_dir():
    if os.environ.get("CUPY_CACHE_IN_MEMORY", "0") not in ("", "0"):
        return "in memory only (CUPY_CACHE_IN_MEMORY is set): nothing is kept between processes"
    folder = os.environ.get("CUPY_CACHE_DIR")
    if folder:
        return f"{folder} (CuPy's disk cache, from CUPY_CACHE_DIR)"
    return f"{os.path.expanduser('~/.cupy/kernel_cache')} (CuPy's disk cache; CUPY_CACHE_DIR moves it)"


def _info(args):
    import numpy

    rows = [
        ("cupy-dwgn", __version__),
        ("Python", f"{platform.python_version()} ({sys.executable})"),
        ("NumPy", numpy.__version__),
    ]
    try:
        import ml_dtypes

        rows.append(("ml_dtypes", ml_dtypes.__version__))
    except ImportError:
        rows.append(("ml_dtypes", "not installed"))
    cupy = _cupy_or_none()
    if cupy is None:
        rows.append(("CuPy", "not importable (how to install it: see GPUs below)"))
        release = _device.driver_release()
        rows.append(("NVIDIA driver", f"{release} (its CUDA version needs CuPy to ask)" if release else "unknown (no CuPy to ask)"))
    else:
        wheel = _distribution("cupy")
        rows.append(("CuPy", cupy.__version__ + (f" ({wheel})" if wheel else "")))
        runtime = cupy.cuda.runtime
        cuda = _device.runtime_cuda_version(runtime)
        rows.append(("CUDA runtime", (_device.cuda_version_text(cuda) + " (the one CuPy runs on)") if cuda else "unknown"))
        try:
            version, archs = _nvrtc()
            shown = (
                f" (targets sm_{archs[0]} to sm_{archs[-1]}; cupy-dwgn's kernels need sm_{MIN_ARCH} or newer)"
                if archs else ""
            )
            rows.append(("NVRTC", version + shown))
        except Exception as error:
            rows.append(("NVRTC", f"not loadable ({type(error).__name__}: {error})"))
        driver = _device.driver_cuda_version(runtime)
        if driver:
            release = _device.driver_release()
            rows.append(("NVIDIA driver", (f"{release}, " if release else "") + f"supports CUDA {_device.cuda_version_text(driver)}"))
        else:
            rows.append(("NVIDIA driver", "none found (libcuda not loadable)"))
    count, reason = _device.gpu_status()
    if count:
        for device in range(count):
            props = cupy.cuda.runtime.getDeviceProperties(device)
            memory = props["totalGlobalMem"] / 2**30
            rows.append((f"GPU {device}", f"{props['name'].decode()} (sm_{props['major']}{props['minor']}, {memory:.0f} GiB)"))
    else:
        rows.append(("GPUs", f"none: {reason}"))
    rows.append(("cupy_dwgn.host", _host_path()))
    try:
        rows.append(("kernels", str(_compile.kernel_dir())))
    except FileNotFoundError as error:
        rows.append(("kernels", f"not found: {error}"))
    rows.append(("kernel cache", _cache_dir()))
    width = max(len(label) for label, _ in rows) + 2
    for label, value in rows:
        print(f"{label + ':':{width}}{value}")
    return 0


# --------------------------------------------------------------- precompile


def _gpu_or_fail(command, device):
    count, reason = _device.gpu_status()
    if not count:
        extra = " (`check` compiles every kernel without one)" if command == "precompile" else ""
        raise CommandError(f"needs a CUDA GPU{extra}: {reason}")
    if device is not None and not 0 <= device < count:
        raise CommandError(f"--device {device}: this machine has {count} GPU(s), 0 to {count - 1}", code=2)
    import cupy

    index = 0 if device is None else device
    props = cupy.cuda.runtime.getDeviceProperties(index)
    return cupy, index, f"GPU {index} ({props['name'].decode()}, sm_{props['major']}{props['minor']})"


def _filter_size(text):
    """'3x3', '7' -> (KH, KW)."""
    parts = text.lower().split("x")
    try:
        sizes = tuple(int(p) for p in parts)
    except ValueError:
        sizes = ()
    if len(sizes) == 1:
        sizes = sizes * 2
    if len(sizes) != 2 or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected KHxKW such as 3x3 or 7x7 (or one size, 5), got {text!r}")
    return sizes


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _host_path():
    """Which path cupy_dwgn.host takes here, and why (CUPY_DWGN_DEVICE)."""
    from . import host

    setting = f"{host.DEVICE_VARIABLE}={os.environ.get(host.DEVICE_VARIABLE) or 'auto'}"
    try:
        path = host.device()
    except (ValueError, RuntimeError) as error:
        return f"error: {error}"
    where = "the CUDA kernels" if path == "gpu" else "the float64 NumPy references on the CPU"
    return f"{where} ({setting})"


def _precompile(args):
    cupy, index, where = _gpu_or_fail("precompile", args.device)
    with cupy.cuda.Device(index):
        count = _compile.precompile(
            args.ops or None,
            dtypes=args.dtypes or None,
            filter_sizes=args.filter_sizes or None,
            activations=args.activations or None,
            layouts=args.layouts or None,
            large_index=args.large_index,
            progress=not args.quiet,
            jobs=args.jobs,
        )
    print(f"{count} kernels ready on {where}")
    return 0


# -------------------------------------------------------------------- check


def _check(args):
    try:
        nvrtc_version, supported = _nvrtc()
    except ImportError as error:
        raise CommandError(f"needs CuPy's NVRTC ({error}): {_device.INSTALL_HINT}") from error
    usable = [a for a in supported if a >= MIN_ARCH] if supported else None
    archs = list(dict.fromkeys(args.arch or DEFAULT_ARCHS))
    wrong = [a for a in archs if a < MIN_ARCH or (usable is not None and a not in usable)]
    if wrong:
        allowed = " ".join(map(str, usable)) if usable else f"{MIN_ARCH} and newer"
        raise CommandError(
            f"--arch {' '.join(map(str, wrong))}: choose from {allowed} (the SM versions NVRTC "
            f"{nvrtc_version} compiles for from sm_{MIN_ARCH} up; the kernels use cp.async, sm_80 or newer)",
            code=2,
        )
    specs = _compile.specializations(args.ops or None, dtypes=args.dtypes or None, large_index=(False, True))
    files = list(dict.fromkeys(f for f, _ in specs))
    registers = stack = spill = 0
    flagged = set()
    for filename in files:
        expressions = [e for f, e in specs if f == filename]
        for arch in archs:
            if not args.quiet:
                print(f"{filename}: {len(expressions)} specializations for sm_{arch} ...", file=sys.stderr, flush=True)
            reports = _compile.nvrtc_compile(filename, expressions, arch)
            for expression in expressions:
                r = reports[expression]
                bad = r["stack_frame"] or r["spill_stores"] or r["spill_loads"]
                if bad:
                    flagged.add((arch, expression))
                registers = max(registers, r["registers"])
                stack = max(stack, r["stack_frame"])
                spill = max(spill, r["spill_stores"] + r["spill_loads"])
                if not args.quiet:
                    print(f"sm_{arch} {r['registers']:4d} regs  {r['stack_frame']:4d} B stack  "
                          f"{r['spill_stores']:4d}/{r['spill_loads']:4d} B spill  {expression}"
                          f"{'  <-- stack/spill' if bad else ''}")
    arch_text = f"{len(archs)} arch{'s' if len(archs) > 1 else ''} ({', '.join(f'sm_{a}' for a in archs)})"
    if flagged:
        worst = f"{stack} B stack, {spill} B spill: {len(flagged)} use stack or spill (marked <-- stack/spill above)"
    else:
        worst = "0 B stack/spill: OK"
    print(f"{len(specs)} specializations x {arch_text} compiled, worst: {registers} registers, {worst}")
    return 1 if flagged else 0


# ----------------------------------------------------------------- selftest


def _selftest(args):
    cupy, index, where = _gpu_or_fail("selftest", args.device)
    from . import _selftest, reference

    import cupy_dwgn

    print(f"cupy-dwgn {__version__} selftest on {where}, CuPy {cupy.__version__}; "
          "relative error ||out - ref|| / ||ref|| against the float64 NumPy reference")
    dtypes = args.dtypes or _selftest.DTYPES
    with cupy.cuda.Device(index):
        failed = _selftest.run(
            dtypes, ops=cupy_dwgn, to_device=cupy.asarray, to_host=cupy.asnumpy, reference=reference, seed=args.seed
        )
    total = len(_selftest.cases(dtypes))
    if failed:
        print(f"selftest: {failed} of {total} checks FAILED on {where}")
        return 1
    print(f"selftest: all {total} checks passed on {where}")
    return 0


# --------------------------------------------------------------------- main


def _prog():
    """'cupy-dwgn' when run as the console script, else 'python -m cupy_dwgn'."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "cupy-dwgn" if name.lower().startswith("cupy-dwgn") else "python -m cupy_dwgn"


def _parser(prog):
    parser = argparse.ArgumentParser(
        prog=prog,
        description=textwrap.fill(
            "cupy-dwgn: depthwise convolution and channels-last GroupNorm GPU kernels. "
            "Commands to inspect the installation, warm the kernel cache, compile every kernel "
            "without a GPU and test the kernels on the GPU."
        ),
        epilog=(
            "examples:\n"
            f"  {prog} info\n"
            f"  {prog} precompile --ops group_norm --dtypes float16\n"
            f"  {prog} check --ops group_norm --arch 90 --quiet\n"
            f"  {prog} selftest\n"
            "\n"
            + textwrap.fill(
                f"A user error or a missing GPU prints one message and exits non-zero; {_DEBUG}=1 shows the traceback."
            )
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"cupy-dwgn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    info = sub.add_parser(
        "info", help="versions, driver, GPUs, kernel and cache folders",
        description="Print the package, Python, NumPy, CuPy, CUDA runtime, NVRTC and driver versions, "
        "the GPUs with their compute capability, the kernel folder and CuPy's kernel cache folder.",
    )
    info.set_defaults(run=_info)

    def selection(p, what):
        p.add_argument("--ops", nargs="+", choices=OPS, metavar="OP",
                       help=f"ops to {what} (default: all): {', '.join(OPS)}")
        p.add_argument("--dtypes", nargs="+", choices=DTYPES, metavar="DTYPE",
                       help=f"element types (default: all): {', '.join(DTYPES)}")

    pre = sub.add_parser(
        "precompile", help="compile kernels on a GPU (or load them from CuPy's disk cache)",
        description="Compile, or load from CuPy's disk cache, the kernels of the chosen ops on a GPU, "
        "so that later calls (CUDA-graph capture, timing) compile nothing. Needs a GPU.",
    )
    selection(pre, "warm")
    pre.add_argument("--filter-sizes", nargs="+", type=_filter_size, metavar="KHxKW",
                     help="depthwise filter sizes, e.g. 3x3 7x7 (default: every specialized size and the generic kernels)")
    pre.add_argument("--layouts", nargs="+", choices=LAYOUTS, metavar="LAYOUT",
                     help=f"depthwise layouts (default: both): {', '.join(LAYOUTS)}")
    pre.add_argument("--activations", nargs="+", choices=ACTIVATIONS, metavar="ACTIVATION",
                     help=f"GroupNorm activations (default: all): {', '.join(ACTIVATIONS)}")
    pre.add_argument("--large-index", action="store_true", help="also the 64-bit-index kernels (tensors of 2**31 elements or more)")
    pre.add_argument("--device", type=int, metavar="N", help="GPU index (default: 0)")
    pre.add_argument("--quiet", action="store_true", help="print only the final count, not one line per kernel")
    pre.add_argument("--jobs", type=_positive_int, default=1, metavar="N",
                     help="compile in N processes at once first (default: 1; about the core count cuts a first "
                     "run's compile time the most)")
    pre.set_defaults(run=_precompile)

    check = sub.add_parser(
        "check", help="NVRTC compile of every specialization, no GPU needed",
        description="Compile every kernel specialization (both index widths) with NVRTC alone and print "
        "ptxas' registers, stack frame and spills per kernel, then one summary line. Needs no GPU. "
        "Exits 1 when a kernel uses stack or spills. All ops for two archs take a few minutes.",
    )
    selection(check, "compile")
    check.add_argument("--arch", nargs="+", type=int, metavar="SM",
                       help="SM versions to compile for, sm_80 or newer as NVRTC supports, "
                            "e.g. 80 86 89 90 100 120 (default: 80 90)")
    check.add_argument("--quiet", action="store_true", help="print only the summary line")
    check.set_defaults(run=_check)

    selftest = sub.add_parser(
        "selftest", help="every op on the GPU against the float64 reference",
        description="Run depthwise forward / backward-input / backward-weight (NCHW and NHWC) and "
        "GroupNorm + SiLU forward / backward on small random inputs on the GPU, compare each with the "
        "float64 NumPy reference and print a pass/fail table (relative error norm against the bound "
        "of its dtype). Exits 1 on any failure. The first run compiles the kernels it uses.",
    )
    selftest.add_argument("--dtypes", nargs="+", choices=DTYPES, metavar="DTYPE",
                          help=f"element types (default: all): {', '.join(DTYPES)}")
    selftest.add_argument("--device", type=int, metavar="N", help="GPU index (default: 0)")
    selftest.add_argument("--seed", type=int, help="random seed (default: a fresh one, printed)")
    selftest.set_defaults(run=_selftest)
    return parser


def _message(error):
    """(one-paragraph message, exit status) for an exception a command raised."""
    if isinstance(error, CommandError):
        return str(error), error.code
    text = str(error).strip()
    name = type(error).__name__
    if isinstance(error, ImportError):
        return f"{name}: {text}: {_device.INSTALL_HINT}", 1
    if name in ("CUDARuntimeError", "CUDADriverError"):
        count, reason = _device.gpu_status()
        return f"{name}: {text}" + (f" ({reason})" if reason else ""), 1
    if name == "KernelCompileError":
        return text, 1
    return f"{name}: {text} (unexpected: run again with {_DEBUG}=1 for the traceback and report it)", 1


def main(argv=None):
    prog = _prog()
    args = _parser(prog).parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        if os.environ.get(_DEBUG, "0") not in ("", "0"):
            raise
        print(f"{prog} {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if os.environ.get(_DEBUG, "0") not in ("", "0"):
            raise
        message, code = _message(error)
        print(f"{prog} {args.command}: {message}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
