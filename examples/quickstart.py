"""Quick start: depthwise convolution forward and both backward passes on the GPU,
checked against the float64 NumPy reference.

    python examples/quickstart.py
"""

import sys

import numpy


def gpu_or_exit():
    """Return cupy, or exit with a plain explanation when no CUDA GPU can be used."""
    import cupy_dwgn

    count, reason = cupy_dwgn.gpu_status()
    if not count:
        sys.exit(f"Cannot run this example: {reason}")
    import cupy

    return cupy


# Bounds on the relative error norm ||out - ref|| / ||ref||, as in the GPU tests.
TOLERANCE = {"float32": 1e-5, "float16": 2e-3}


def relative_error(out, ref):
    got = out.get().astype(numpy.float64)
    return float(numpy.linalg.norm(got - ref) / numpy.linalg.norm(ref))


def main():
    cupy = gpu_or_exit()
    import cupy_dwgn
    from cupy_dwgn import reference

    rng = numpy.random.default_rng(0)
    conv = dict(stride=1, padding=1)
    print(f"cupy-dwgn {cupy_dwgn.__version__} on {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print(f"{'dtype':10} {'forward':>10} {'bwd-input':>10} {'bwd-weight':>10}   (worst relative error vs float64)")
    worst = 0.0  # largest error as a fraction of its dtype's bound
    for dtype in (numpy.float32, numpy.float16):
        x = rng.standard_normal((4, 32, 28, 28)).astype(dtype)
        w = rng.standard_normal((32, 1, 3, 3)).astype(dtype)
        b = rng.standard_normal(32).astype(dtype)
        x_gpu, w_gpu, b_gpu = cupy.asarray(x), cupy.asarray(w), cupy.asarray(b)

        y = cupy_dwgn.depthwise_conv2d(x_gpu, w_gpu, b_gpu, **conv)
        dy = cupy.asarray(rng.standard_normal(y.shape).astype(dtype))
        dx = cupy_dwgn.depthwise_conv2d_backward_input(dy, w_gpu, x.shape, **conv)
        dw = cupy_dwgn.depthwise_conv2d_backward_weight(dy, x_gpu, w.shape, **conv)

        errors = (
            relative_error(y, reference.depthwise_conv2d(x, w, b, **conv)),
            relative_error(dx, reference.depthwise_conv2d_backward_input(dy.get(), w, x.shape, **conv)),
            relative_error(dw, reference.depthwise_conv2d_backward_weight(dy.get(), x, w.shape, **conv)),
        )
        print(f"{numpy.dtype(dtype).name:10} " + " ".join(f"{e:10.2e}" for e in errors))
        worst = max(worst, max(errors) / TOLERANCE[numpy.dtype(dtype).name])
    return 0 if worst <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
