"""Cold start: time of the first call of one specialization in a fresh process
with an empty CuPy kernel cache, then in a second process with the cache warm.

    PYTHONPATH=. python benchmarks/cold_start.py
"""

import os
import subprocess
import sys
import tempfile

CHILD = r"""
import time
t0 = time.perf_counter()
import cupy, cupy_dwgn
x = cupy.ones((2, 8, 16, 16), cupy.float32)
w = cupy.ones((8, 1, 3, 3), cupy.float32)
t1 = time.perf_counter()
cupy_dwgn.depthwise_conv2d(x, w, padding=1)
cupy.cuda.Device().synchronize()
t2 = time.perf_counter()
print(f"{t2 - t1:.3f} {t2 - t0:.3f}")
"""


def run(cache_dir):
    env = dict(os.environ, CUPY_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, check=True, capture_output=True, text=True)
    first_call, with_import = (float(v) for v in out.stdout.split())
    return first_call, with_import


def main():
    with tempfile.TemporaryDirectory() as cache_dir:
        cold = run(cache_dir)
        warm = run(cache_dir)
    print(f"first call, empty kernel cache: {cold[0]:.3f} s (process incl. imports {cold[1]:.3f} s)")
    print(f"first call, warm disk cache:    {warm[0]:.3f} s (process incl. imports {warm[1]:.3f} s)")


if __name__ == "__main__":
    main()
