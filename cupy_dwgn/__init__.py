"""cupy-dwgn: depthwise convolution and channels-last GroupNorm kernels for CuPy.

The GPU ops take and return ``cupy.ndarray``; ``cupy_dwgn.host`` has the same
functions for NumPy arrays (on the GPU, or on the CPU through the references
when there is none) and ``cupy_dwgn.reference`` the float64 NumPy references.
CuPy is imported on first use of a GPU op, so the references and the host
functions work on machines without CuPy.
"""

__version__ = "0.1.0"

_LAZY = {
    "depthwise_conv2d": "depthwise",
    "depthwise_conv2d_backward_input": "depthwise",
    "depthwise_conv2d_backward_weight": "depthwise",
    "group_norm": "_group_norm",
    "group_norm_backward": "_group_norm",
    "precompile": "_compile",
    "gpu_status": "_device",
}

__all__ = sorted(_LAZY) + ["CPUFallbackWarning", "KernelCompileError", "__version__"]

from .errors import CPUFallbackWarning, KernelCompileError  # noqa: E402


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'cupy_dwgn' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
