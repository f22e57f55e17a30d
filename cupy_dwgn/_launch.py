"""Launch helpers shared by the ops: grid sizes, index type, typed scalars."""

import numpy

from . import _compile

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


#: Dynamic shared memory any kernel may use without opting in.
_DEFAULT_SHARED = 48 * 1024
#: (kernel object id, bytes) whose opt-in is done; kernel objects are
#: memoized for the life of the process, so their ids stay theirs.
_SHARED_OPTED_IN = set()


class Launch:
    """One kernel launch, fully resolved for one call signature: the kernel
    (file + name expression, looked up per device on use), grid, block,
    dynamic shared memory and the scalar arguments that follow the arrays.

    Build it once per signature (cache the builder with functools.lru_cache)
    and call it with the array arguments: ``launch(x, weight, bias, y)``.
    """

    __slots__ = ("file", "expression", "grid", "block", "shared_mem", "scalars")

    def __init__(self, file, expression, grid, block, shared_mem=0, scalars=()):
        self.file = file
        self.expression = expression
        self.grid = tuple(int(v) for v in grid)
        self.block = tuple(int(v) for v in block)
        self.shared_mem = int(shared_mem)
        self.scalars = tuple(scalars)

    def __call__(self, *arrays):
        kernel = _compile.get_kernel(self.file, self.expression)
        if self.shared_mem > _DEFAULT_SHARED and (id(kernel), self.shared_mem) not in _SHARED_OPTED_IN:
            # Above 48 KB a kernel must opt in, once per kernel and device
            # (the kernel object is per device); the attribute is a driver
            # query, so it is not asked again on every launch.
            if kernel.max_dynamic_shared_size_bytes < self.shared_mem:
                kernel.max_dynamic_shared_size_bytes = self.shared_mem
            _SHARED_OPTED_IN.add((id(kernel), self.shared_mem))
        kernel(self.grid, self.block, arrays + self.scalars, shared_mem=self.shared_mem)

    def __repr__(self):
        return (
            f"Launch({self.expression}, grid={self.grid}, block={self.block}, "
            f"shared_mem={self.shared_mem})"
        )
