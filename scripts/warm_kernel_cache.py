"""Fill CuPy's kernel disk cache with cupy_dwgn's specializations, several
processes at once, so that a fresh GPU machine's first test run or benchmark
loads every kernel from the cache instead of compiling them one by one
(about 1.5 s each on an H200 host: 160 s for the GroupNorm kernels alone).

    PYTHONPATH=. python scripts/warm_kernel_cache.py [--jobs 12] [--ops group_norm ...] [--large-index]

Each process compiles its share through cupy_dwgn's own loader (the same
RawModule source, options and name expressions as a later call), so the
cache entries are the ones the later process looks up.  Set CUPY_CACHE_DIR
the same way for both.
"""

import argparse
import os
import sys
import time


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1), help="processes (default: min(12, CPUs))")
    parser.add_argument("--ops", nargs="+", help="op names (default: all)")
    parser.add_argument("--large-index", action="store_true", help="also the 64-bit-index kernels")
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error(f"--jobs: expected a positive number, got {args.jobs}")

    from cupy_dwgn import _compile

    specs = _compile.specializations(args.ops, large_index=(False, True) if args.large_index else (False,))
    start = time.perf_counter()
    jobs = _compile.cache_in_processes(specs, args.jobs)
    print(f"cupy_dwgn: {len(specs)} kernels cached by {jobs} processes in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
