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
import multiprocessing
import os
import sys
import time


def _load(share):
    from cupy_dwgn import _compile

    _compile.load_specializations(share, progress=False)
    return len(share)


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
    jobs = min(args.jobs, len(specs))
    shares = [specs[i::jobs] for i in range(jobs)]
    start = time.perf_counter()
    done = 0
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        for count in pool.imap_unordered(_load, shares):
            done += count
            print(f"[{done}/{len(specs)}] kernels cached ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    print(f"cupy_dwgn: {len(specs)} kernels cached by {jobs} processes in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
