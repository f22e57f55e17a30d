"""SASS of shipped kernel specializations, without a GPU, and a scan for
serialized global loads.

    python scripts/kernel_sass.py dump FILE.cu "EXPRESSION" [--arch 90]
    python scripts/kernel_sass.py loads [--ops depthwise_conv2d_backward_weight ...] [--dtypes float16 ...]

    python scripts/kernel_sass.py fingerprint [--files depthwise_nhwc.cu ...] [--dtypes bfloat16 ...] > F.json
    python scripts/kernel_sass.py fingerprint ... --compare F.json

``dump`` prints the disassembly of one specialization (NVRTC cubin ->
nvdisasm).  ``fingerprint`` compiles every selected specialization of each
kernel file (all in one NVRTC program per file) and prints a hash of each
kernel's machine code; with --compare it prints the kernels whose code
differs from an earlier fingerprint (exit 1 if any): a refactor of kernel
source that must not change the machine code is checked without a GPU.  ``loads`` compiles one specialization per (file, kernel, dtype)
of the selection and counts, for each, the global loads whose result is
read before the next global load issues: a high count means the loads run
one at a time (a conversion or use in the same branch as its load makes
ptxas wait; e.g. dwgn_dwconv_nhwc_wgrad<__half, ...> had 25 of 42 before
its loads were issued together, and ran 2.7x slower).

Needs nvdisasm: on PATH, at $NVDISASM, or from the wheel
``pip install nvidia-cuda-nvdisasm`` (found under site-packages/nvidia/*/bin).
"""

import argparse
import glob
import os
import re
import shutil
import site
import subprocess
import sys
import tempfile

from cupy_dwgn import _compile


def nvdisasm():
    """Path of nvdisasm, or exit with how to get it."""
    candidates = [os.environ.get("NVDISASM"), shutil.which("nvdisasm")]
    for root in site.getsitepackages() + [site.getusersitepackages()]:
        candidates += sorted(glob.glob(os.path.join(root, "nvidia", "*", "bin", "nvdisasm")))
    for path in candidates:
        if path and os.path.isfile(path):
            return path
    sys.exit("nvdisasm not found: put it on PATH, set NVDISASM, or pip install nvidia-cuda-nvdisasm")


def sass(filename, expression, arch=90):
    """The disassembly of one specialization compiled by NVRTC for sm_<arch>."""
    return sass_of(filename, [expression], arch)


def sass_of(filename, expressions, arch=90):
    """The disassembly of the cubin of ``expressions`` of one file (NVRTC, sm_<arch>)."""
    from cupy_backends.cuda.libs import nvrtc

    options = _compile.OPTIONS + (
        f"-arch=sm_{arch}", "-ftz=true", "--device-as-default-execution-space", f"-I{_compile._cuda_include_dir()}",
    ) + _compile._cccl_include_options()
    program = nvrtc.createProgram(_compile.kernel_source(filename), filename, [], [])
    try:
        for expression in expressions:
            nvrtc.addNameExpression(program, expression)
        nvrtc.compileProgram(program, list(options))
        # CuPy's getCUBIN returns the ELF less its last byte (a NUL-terminated
        # string copy); nvdisasm rejects the truncated file.
        cubin = nvrtc.getCUBIN(program) + b"\0"
    finally:
        nvrtc.destroyProgram(program)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm(), "-c", f.name], capture_output=True, text=True, check=True).stdout


_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;")
_GLOBAL_LOAD = re.compile(r"\bLDG\.\S*\s+(R\d+)")


def serialized_loads(disassembly):
    """(global loads, loads whose destination register is read before the
    next global load issues)."""
    instructions = [m.group(1) for m in map(_INSTRUCTION.search, disassembly.splitlines()) if m]
    loads = serialized = 0
    for i, text in enumerate(instructions):
        m = _GLOBAL_LOAD.search(text)
        if not m:
            continue
        loads += 1
        register = re.compile(rf"\b{m.group(1)}\b")
        for later in instructions[i + 1:i + 60]:
            if "LDG" in later:
                break
            operands = later.split(None, 2 if later.startswith("@") else 1)[-1]
            sources = operands.split(",", 1)[1] if "," in operands else ""
            if register.search(sources):
                serialized += 1
                break
    return loads, serialized


_FUNCTION = re.compile(r"^\s*\.text\.(\S+):", re.M)
_LABEL = re.compile(r"\.L_x_\d+\b")


def fingerprints(files=None, dtypes=None, arch=90):
    """{file: {mangled kernel name: sha256 of its instructions}} of every
    shipped specialization of ``files`` (default all) and ``dtypes``."""
    import hashlib

    by_file = {}
    for filename, expression in _compile.specializations(dtypes=dtypes):
        if files is None or filename in files:
            by_file.setdefault(filename, []).append(expression)
    result = {}
    for filename, expressions in sorted(by_file.items()):
        text = sass_of(filename, expressions, arch)
        # Split the listing at each function's section; hash its instruction text
        # (addresses and encodings included: any change of code shows).  nvdisasm
        # numbers branch labels (.L_x_N) across the whole listing, so they are
        # renumbered per function: a kernel that gains a label does not change
        # the text of the kernels listed after it.
        starts = [(m.start(), m.group(1)) for m in _FUNCTION.finditer(text)]
        kernels = {}
        for (start, name), (end, _) in zip(starts, starts[1:] + [(len(text), None)]):
            body = "\n".join(m.group(1) for m in map(_INSTRUCTION.search, text[start:end].splitlines()) if m)
            labels = {}
            body = _LABEL.sub(lambda m: labels.setdefault(m.group(0), f".L_{len(labels)}"), body)
            kernels[name] = hashlib.sha256(body.encode()).hexdigest()[:16]
        result[filename] = kernels
        print(f"{filename}: {len(expressions)} specializations, {len(kernels)} functions", file=sys.stderr, flush=True)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    dump = sub.add_parser("dump", help="disassemble one specialization")
    dump.add_argument("file")
    dump.add_argument("expression")
    dump.add_argument("--arch", type=int, default=90)
    loads = sub.add_parser("loads", help="count serialized global loads per kernel")
    loads.add_argument("--ops", nargs="+", help="ops as in cupy-dwgn precompile (default: all)")
    loads.add_argument("--dtypes", nargs="+", default=["float32", "float16"])
    loads.add_argument("--arch", type=int, default=90)
    fingerprint = sub.add_parser("fingerprint", help="hash each kernel's machine code (or --compare with earlier)")
    fingerprint.add_argument("--files", nargs="+", help="kernel files (default: all)")
    fingerprint.add_argument("--dtypes", nargs="+", help="dtypes (default: all)")
    fingerprint.add_argument("--arch", type=int, default=90)
    fingerprint.add_argument("--compare", help="an earlier fingerprint JSON: print the kernels whose code differs")
    args = parser.parse_args(argv)
    if args.command == "fingerprint":
        import json

        now = fingerprints(args.files, args.dtypes, args.arch)
        if not args.compare:
            print(json.dumps(now, indent=1, sort_keys=True))
            return
        before = json.load(open(args.compare))
        changed = [f"{f}: {k}" for f in now for k in set(now[f]) | set(before.get(f, {}))
                   if now[f].get(k) != before.get(f, {}).get(k)]
        print("\n".join(sorted(changed)) or "machine code unchanged", flush=True)
        print(f"{sum(map(len, now.values()))} kernels compared, {len(changed)} differ")
        sys.exit(1 if changed else 0)
    if args.command == "dump":
        print(sass(args.file, args.expression, args.arch))
        return
    seen = set()
    for filename, expression in _compile.specializations(args.ops, dtypes=args.dtypes, large_index=False):
        key = (filename, expression.split("<")[0], expression.split("<")[1].split(",")[0])
        if key in seen:
            continue
        seen.add(key)
        total, serial = serialized_loads(sass(filename, expression, args.arch))
        print(f"{serial:3d} of {total:3d} loads serialized  {filename}  {expression}", flush=True)


if __name__ == "__main__":
    main()
