"""The one table of supported element types: NumPy dtype <-> CUDA C++ type."""

import ml_dtypes
import numpy

bfloat16 = numpy.dtype(ml_dtypes.bfloat16)

# NumPy dtype -> the C++ type the kernels are instantiated with.
CTYPES = {
    numpy.dtype(numpy.float16): "__half",
    numpy.dtype(numpy.float32): "float",
    numpy.dtype(numpy.float64): "double",
    bfloat16: "__nv_bfloat16",
}

SUPPORTED_NAMES = ("float16", "float32", "float64", "bfloat16")


def accumulator_dtype(dtype):
    """float64 accumulates in float64; everything else in float32."""
    return numpy.dtype(numpy.float64) if dtype == numpy.float64 else numpy.dtype(numpy.float32)


def ctype(dtype):
    return CTYPES[numpy.dtype(dtype)]
