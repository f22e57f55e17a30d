"""Command line: ``python -m cupy_dwgn {info,precompile,check}``.

    info         versions, devices, kernel folder, kernel cache folder
    precompile   compile (or load from the disk cache) kernels on the current GPU
    check        compile every specialization with NVRTC alone (no GPU needed)
                 and print the ptxas resource report
"""

import argparse
import os
import sys

from . import __version__, _compile


def _info(args):
    print(f"cupy-dwgn {__version__}")
    print(f"kernels: {_compile.kernel_dir()}")
    print(f"kernel cache: {os.environ.get('CUPY_CACHE_DIR', os.path.expanduser('~/.cupy/kernel_cache'))}")
    from ._device import gpu_status

    count, reason = gpu_status()
    if not count:
        print(reason)
        return 0
    import cupy

    print(f"cupy {cupy.__version__}")
    for device in range(count):
        props = cupy.cuda.runtime.getDeviceProperties(device)
        print(f"GPU {device}: {props['name'].decode()} (sm_{props['major']}{props['minor']})")
    return 0


def _precompile(args):
    count = _compile.precompile(
        args.ops or None, dtypes=args.dtypes or None, large_index=args.large_index, progress=True
    )
    print(f"{count} kernels ready")
    return 0


def _check(args):
    specs = _compile.specializations(args.ops or None, large_index=(False, True))
    worst = 0
    for filename in dict.fromkeys(f for f, _ in specs):
        expressions = [e for f, e in specs if f == filename]
        for arch in args.arch:
            print(f"{filename}: {len(expressions)} specializations for sm_{arch} ...", file=sys.stderr, flush=True)
            reports = _compile.nvrtc_compile(filename, expressions, arch)
            for expression in expressions:
                r = reports[expression]
                flag = "" if r["stack_frame"] == r["spill_stores"] == r["spill_loads"] == 0 else "  <-- stack/spill"
                worst = max(worst, r["stack_frame"] + r["spill_stores"])
                print(f"sm_{arch} {r['registers']:4d} regs  {r['stack_frame']:4d} B stack  "
                      f"{r['spill_stores']:4d}/{r['spill_loads']:4d} B spill  {expression}{flag}")
    return 1 if worst else 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m cupy_dwgn", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, devices and folders").set_defaults(run=_info)
    pre = sub.add_parser("precompile", help="warm kernels on the current GPU")
    pre.add_argument("--ops", nargs="*", help="op names (default: all)")
    pre.add_argument("--dtypes", nargs="*", help="float16 float32 float64 bfloat16 (default: all)")
    pre.add_argument("--large-index", action="store_true", help="also the 64-bit-index kernels")
    pre.set_defaults(run=_precompile)
    check = sub.add_parser("check", help="NVRTC compile of every specialization, no GPU needed")
    check.add_argument("--ops", nargs="*", help="op names (default: all)")
    check.add_argument("--arch", nargs="*", type=int, default=[80, 90], help="SM versions (default: 80 90)")
    check.set_defaults(run=_check)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
