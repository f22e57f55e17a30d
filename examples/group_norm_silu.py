"""GroupNorm(32) + SiLU as in a diffusion U-Net block, channels-last (NHWC), float16
activations with float32 affine parameters (mixed precision), forward and
backward, checked against the float64 NumPy reference.

    python examples/group_norm_silu.py
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


def relative_error(out, ref):
    got = out.get().astype(numpy.float64)
    return float(numpy.linalg.norm(got - ref) / numpy.linalg.norm(ref))


def main():
    cupy = gpu_or_exit()
    import cupy_dwgn
    from cupy_dwgn import reference

    rng = numpy.random.default_rng(0)
    batch, height, width, channels, groups = 2, 64, 64, 320, 32
    # A feature map of a Stable-Diffusion U-Net block, NHWC, float16.
    x_host = (3.0 + rng.standard_normal((batch, height, width, channels))).astype(numpy.float16)
    dy_host = rng.standard_normal(x_host.shape).astype(numpy.float16)
    weight_host = (1.0 + 0.1 * rng.standard_normal(channels)).astype(numpy.float32)
    bias_host = (0.1 * rng.standard_normal(channels)).astype(numpy.float32)

    x, dy = cupy.asarray(x_host), cupy.asarray(dy_host)
    weight, bias = cupy.asarray(weight_host), cupy.asarray(bias_host)

    # Forward: y = silu(group_norm(x)), keeping mean/rstd for the backward.
    y, mean, rstd = cupy_dwgn.group_norm(x, groups, weight, bias, activation="silu", return_stats=True)
    # Backward: gradients of x, weight and bias (through the SiLU).
    dx, dw, db = cupy_dwgn.group_norm_backward(dy, x, mean, rstd, groups, weight, bias, activation="silu")

    # The float64 references take the same arguments (NumPy arrays); the
    # backward starts from the statistics the GPU backward was given.
    ref_y, ref_mean, ref_rstd = reference.group_norm(
        x_host, groups, weight_host, bias_host, activation="silu", return_stats=True
    )
    ref_dx, ref_dw, ref_db = reference.group_norm_backward(
        dy_host, x_host, mean.get(), rstd.get(), groups, weight_host, bias_host, activation="silu"
    )
    errors = {
        "y": relative_error(y, ref_y),
        "mean": relative_error(mean, ref_mean),
        "rstd": relative_error(rstd, ref_rstd),
        "dx": relative_error(dx, ref_dx),
        "dweight": relative_error(dw, ref_dw),
        "dbias": relative_error(db, ref_db),
    }
    print(f"GroupNorm({groups}) + SiLU on x {x.shape} {x.dtype}, weight/bias {weight.dtype}")
    for name, error in errors.items():
        print(f"  {name:8} relative error {error:.2e}")
    worst = max(errors, key=errors.get)
    print(f"worst relative error vs float64 reference: {errors[worst]:.2e} ({worst}; float16 bound 2e-3)")
    return 0 if errors[worst] <= 2e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
