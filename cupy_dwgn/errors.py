"""Exceptions raised by cupy-dwgn (argument errors are plain TypeError/ValueError)."""


class KernelCompileError(RuntimeError):
    """NVRTC could not compile a kernel specialization.

    Carries everything needed to reproduce the failure: the name expression,
    the compile options, the CuPy version and NVRTC's log.
    """

    def __init__(self, name_expression, options, cupy_version, log):
        self.name_expression = name_expression
        self.options = tuple(options)
        self.cupy_version = cupy_version
        self.log = log
        hint = ""
        if "cannot open source file" in log:
            from ._device import INSTALL_HINT

            hint = (
                "\nhint: the CUDA runtime headers were not found (they come in the "
                f"nvidia-cuda-runtime wheel); {INSTALL_HINT}; or set CUDA_PATH to a CUDA toolkit."
            )
        super().__init__(
            f"NVRTC failed to compile {name_expression!r} "
            f"(options {self.options}, CuPy {cupy_version}):\n{log}{hint}\n"
            "Set CUPY_DUMP_CUDA_SOURCE_ON_ERROR=1 to print the numbered source."
        )

    def __reduce__(self):
        # Rebuilt from its four fields (the default pickling passes only the
        # message): precompile(jobs=N) gets it back from a worker process.
        return type(self), (self.name_expression, self.options, self.cupy_version, self.log)


class CPUFallbackWarning(RuntimeWarning):
    """cupy_dwgn.host found no usable CUDA GPU and runs the NumPy references on
    the CPU instead (correct results, far slower than the GPU kernels).

    Warned once per process.  Set ``CUPY_DWGN_DEVICE=cpu`` to choose the CPU
    path without the warning, or filter it::

        warnings.filterwarnings("ignore", category=cupy_dwgn.CPUFallbackWarning)
    """
