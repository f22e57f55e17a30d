"""Timing helpers: CUDA events, warm-up, median of repeats, and the measured
device-to-device copy bandwidth that every figure is compared with."""

import statistics

import cupy


def time_us(fn, *, warmup=10, repeat=50):
    """Median GPU time of ``fn()`` in microseconds (CUDA events on the current stream)."""
    for _ in range(warmup):
        fn()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(repeat):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3)
    return statistics.median(times)


def copy_bandwidth_bytes_per_us(nbytes=2 * 2**30):
    """Device-to-device copy rate, counting bytes read plus bytes written."""
    src = cupy.empty(nbytes // 4, cupy.float32)
    dst = cupy.empty_like(src)
    src.fill(1.0)
    us = time_us(lambda: dst.__setitem__(Ellipsis, src), warmup=3, repeat=20)
    del src, dst
    return 2 * nbytes / us
