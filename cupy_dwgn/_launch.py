"""Launch helpers shared by the ops: grid sizes, index type, typed scalars."""

import numpy

BLOCK = 256
# Grid-stride kernels cap their grid here; beyond it each thread loops.
MAX_BLOCKS = 65536
INT32_LIMIT = 2**31

#: Null pointer for optional array arguments (passed by value as 8 bytes).
NULL = numpy.uintp(0)

i32 = numpy.int32


def index_type(*sizes):
    """C++ index type: 32-bit unless some tensor has >= 2**31 elements."""
    return "long long" if max(sizes) >= INT32_LIMIT else "int"


#: Kernels index inside one plane (an (n, c) image) with 32-bit ints.
PLANE_LIMIT = 2**30
MAX_GRID_Y = 65535


def index_scalar(index, value):
    """``value`` as the kernel's IndexT (an int argument typed like the index)."""
    return numpy.int64(value) if index == "long long" else numpy.int32(value)


def grid_1d(total, block=BLOCK):
    return (max(1, min(-(-total // block), MAX_BLOCKS)),)


def grid_planes(num_planes, plane_size, block=BLOCK):
    """Grid for the DWGN_FOR_EACH_PLANE / DWGN_FOR_EACH_IN_PLANE loops."""
    return (max(1, -(-plane_size // block)), max(1, min(num_planes, MAX_GRID_Y)))


def check_plane_size(name, plane_size):
    if plane_size >= PLANE_LIMIT:
        raise ValueError(
            f"{name}: expected fewer than 2**30 elements per (n, c) plane, got {plane_size}"
        )


def pointer_or_null(array):
    return NULL if array is None else array
