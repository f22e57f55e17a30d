"""Is there a GPU to run on?  One answer for the CLI, the examples and the tests."""

import os

#: Oldest NVIDIA driver (Linux) that runs each CUDA major version's runtime, by
#: CUDA minor-version compatibility (NVIDIA's CUDA Compatibility guide and the
#: CUDA Toolkit release notes): CUDA 12.x needs >= 525.60.13, CUDA 13.x the R580 branch.
MINIMUM_DRIVER = {12: "525.60.13", 13: "580"}

INSTALL_HINT = (
    "install CuPy for your NVIDIA driver's CUDA major version (`nvidia-smi` shows it): from a "
    "checkout of this repository, pip install -e '.[cuda13]' (or '.[cuda12]'); elsewhere, "
    "pip install 'cupy-cuda13x>=14.2' 'nvidia-cuda-nvrtc>=13,<14' 'nvidia-cuda-runtime>=13,<14' "
    "(for CUDA 12: 'cupy-cuda12x>=14.2' nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12)"
)

#: What works without a GPU, said at the end of every "no GPU" reason.
_WITHOUT_GPU = "cupy_dwgn.reference (float64 NumPy) and cupy_dwgn.host run without one."


def reason_without_alternatives(reason):
    """A :func:`gpu_status` reason without its closing pointer to the
    GPU-less modules (for messages raised by one of them)."""
    return reason.removesuffix(" " + _WITHOUT_GPU).removesuffix(_WITHOUT_GPU).rstrip()


def cuda_version_text(version):
    """CUDA's integer version (13020) as text ("13.2")."""
    return f"{version // 1000}.{version % 1000 // 10}"


def driver_cuda_version(runtime):
    """The newest CUDA version the installed driver supports (e.g. 13000), 0 when
    no driver can be loaded (cudaDriverGetVersion reports 0 then, or fails)."""
    try:
        return int(runtime.driverGetVersion())
    except Exception:  # no libcuda at all, or a broken installation
        return 0


def runtime_cuda_version(runtime):
    """The CUDA runtime version CuPy runs on (e.g. 13020), or None."""
    try:
        return int(runtime.runtimeGetVersion())
    except Exception:
        return None


def driver_release():
    """The NVIDIA kernel driver's release ("580.65.06") from /proc (Linux), or None."""
    try:
        with open("/proc/driver/nvidia/version") as file:
            first = file.readline()
    except OSError:
        return None
    for word in first.split():
        if word[:1].isdigit() and "." in word:
            return word
    return None


def explain_no_gpu(runtime, error):
    """The reason, in plain words, why ``runtime.getDeviceCount()`` raised ``error``.

    Tells "no driver at all" apart from "driver too old for this CUDA runtime"
    (CuPy says "CUDA driver version is insufficient" for both).
    """
    driver = driver_cuda_version(runtime)
    cuda = runtime_cuda_version(runtime)
    name = type(error).__name__
    if not driver:
        return (
            "no NVIDIA driver found (libcuda not loadable): cupy-dwgn runs its kernels on an NVIDIA "
            "GPU; use a machine with one and its driver (`nvidia-smi` checks both). " + _WITHOUT_GPU
        )
    if cuda is not None and (driver // 1000 < cuda // 1000 or "InsufficientDriver" in str(error)):
        major = cuda // 1000
        needs = MINIMUM_DRIVER.get(major)
        needs = f" (needs >= {needs}, for CUDA {major}.0)" if needs else ""
        older = max((m for m in MINIMUM_DRIVER if m * 1000 <= driver), default=None)
        other = (
            f", or use CuPy for CUDA {older} (the cuda{older} extra)" if older and older != major else ""
        )
        return (
            f"NVIDIA driver too old for CUDA runtime {cuda_version_text(cuda)}{needs}: the driver "
            f"supports CUDA {cuda_version_text(driver)}. Upgrade the driver{other}; `nvidia-smi` "
            f"shows its version. " + _WITHOUT_GPU
        )
    if "NoDevice" in str(error) or "NoDevice" in name:
        return (
            f"no CUDA GPU found: the NVIDIA driver (CUDA {cuda_version_text(driver)}) sees no device "
            "(`nvidia-smi` lists the GPUs; check CUDA_VISIBLE_DEVICES). " + _WITHOUT_GPU
        )
    return (
        f"no usable CUDA GPU ({name}: {error}); the NVIDIA driver supports CUDA "
        f"{cuda_version_text(driver)} (check the GPUs with `nvidia-smi`). " + _WITHOUT_GPU
    )


def gpu_status():
    """``(number of usable CUDA GPUs, reason)``; the reason says, in plain words,
    why there is none (and how to get going) when the number is 0.

    Example:
        >>> count, reason = cupy_dwgn.gpu_status()
        >>> if not count: print(reason)
    """
    try:
        import cupy
    except ImportError:
        return 0, f"CuPy is not installed: {INSTALL_HINT}."
    except Exception as error:  # a broken CuPy installation (e.g. two CuPy wheels)
        return 0, f"CuPy cannot be imported ({type(error).__name__}: {error}): {INSTALL_HINT}."
    runtime = cupy.cuda.runtime
    try:
        count = runtime.getDeviceCount()
    except Exception as error:  # CUDA runtime or driver errors, e.g. no driver at all
        return 0, explain_no_gpu(runtime, error)
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hidden = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return 0, f"no CUDA GPU found (0 devices{hidden}): use a machine with an NVIDIA GPU. " + _WITHOUT_GPU
    return count, ""
