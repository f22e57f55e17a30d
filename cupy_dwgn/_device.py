"""Is there a GPU to run on?  One answer for the CLI, the examples and the tests."""

INSTALL_HINT = (
    "install cupy-dwgn with the extra that matches your NVIDIA driver: "
    "pip install 'cupy-dwgn[cuda13]' (or [cuda12]; `nvidia-smi` shows the driver's CUDA version)"
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
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # CUDA runtime or driver errors, e.g. no driver at all
        return 0, (
            f"no usable CUDA GPU ({type(error).__name__}: {error}). cupy-dwgn runs its kernels on "
            "an NVIDIA GPU: use a machine with one and a CUDA driver (check with `nvidia-smi`). "
            "The NumPy references in cupy_dwgn.reference work anywhere."
        )
    if count == 0:
        return 0, "no CUDA GPU found (0 devices): use a machine with an NVIDIA GPU."
    return count, ""
