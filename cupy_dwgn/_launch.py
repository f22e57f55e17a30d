"""Launch helpers shared by the ops: grid sizes, index type, typed scalars."""

import ctypes
import operator
import struct
import threading
import typing

import numpy

from . import _compile

BLOCK = 256
# Grid-stride kernels cap their grid here; beyond it each thread loops.
MAX_BLOCKS = 65536
INT32_LIMIT = 2**31

#: Null pointer for optional array arguments (an 8-byte address).
NULL = 0

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


#: Dynamic shared memory any kernel may use without opting in.
_DEFAULT_SHARED = 48 * 1024

# cuLaunchKernel's ``extra`` markers: the arguments travel as one packed buffer.
_PARAM_BUFFER_POINTER, _PARAM_BUFFER_SIZE, _PARAM_END = 1, 2, 0


class Launch:
    """One kernel launch, fully resolved for one call signature: the kernel
    (file + name expression, looked up per device on use), grid, block,
    dynamic shared memory and the scalar arguments that follow the arrays.

    Build it once per signature (cache the builder with functools.lru_cache)
    and call it with the array arguments: ``launch(x, weight, bias, y)``.
    Each array argument is a cupy.ndarray or a raw device address (an int;
    0 is the null pointer, e.g. for an absent bias).

    The launch goes straight to ``cuLaunchKernel`` on the current CuPy
    stream with the arguments packed in one buffer: the scalars are packed
    once, per call only the addresses are written.  A CuPy kernel call
    converts every argument on every call (about 0.3 us per scalar; 8.6 us
    for 4 arrays + 10 ints against 5.9 for a bare launch on an H200).
    """

    __slots__ = (
        "file", "expression", "grid", "block", "shared_mem", "scalars",
        "_kernels", "_buffer", "_extra", "_lock", "_dims",
    )

    def __init__(self, file, expression, grid, block, shared_mem=0, scalars=()):
        self.file = file
        self.expression = expression
        self.grid = tuple(int(v) for v in grid) + (1,) * (3 - len(grid))
        self.block = tuple(int(v) for v in block) + (1,) * (3 - len(block))
        self.shared_mem = int(shared_mem)
        self.scalars = tuple(scalars)
        self._kernels = {}  # device id -> kernel address
        self._buffer = None
        self._lock = threading.Lock()
        # cuLaunchKernel's grid, block and shared-memory arguments, in order.
        self._dims = (*self.grid, *self.block, self.shared_mem)

    def _kernel(self, device):
        """The kernel's CUfunction address on ``device`` (compiled or loaded on first use)."""
        kernel = _compile.get_kernel(self.file, self.expression)
        if self.shared_mem > _DEFAULT_SHARED and kernel.max_dynamic_shared_size_bytes < self.shared_mem:
            # Above 48 KB a kernel must opt in, once per kernel and device.
            kernel.max_dynamic_shared_size_bytes = self.shared_mem
        # The CUfunction of the current device; the memoized RawKernel keeps
        # its module loaded for the life of the process.
        address = self._kernels[device] = kernel.kernel.ptr
        return address

    def _pack(self, num_pointers):
        """The argument buffer: ``num_pointers`` 8-byte addresses, then the
        scalars, each at its natural alignment (the kernel ABI's layout).
        The scalars are written once; each call writes the addresses."""
        layout = []
        offset = 8 * num_pointers
        for value in self.scalars:
            raw = numpy.asarray(value).tobytes()
            offset = -(-offset // len(raw)) * len(raw)
            layout.append((offset, raw))
            offset += len(raw)
        buffer = (ctypes.c_ubyte * max(8, offset))()
        for start, raw in layout:
            ctypes.memmove(ctypes.addressof(buffer) + start, raw, len(raw))
        size = ctypes.c_size_t(offset)
        extra = (ctypes.c_void_p * 5)(
            _PARAM_BUFFER_POINTER, ctypes.addressof(buffer), _PARAM_BUFFER_SIZE, ctypes.addressof(size), _PARAM_END
        )
        # Referenced by this object: the driver reads them on every launch.
        self._buffer = (buffer, size, extra, num_pointers, struct.Struct(f"{num_pointers}Q"))
        self._extra = ctypes.addressof(extra)

    def __call__(self, *arrays):
        if _runtime is None:
            _import_cuda()
        self.launch(_runtime.getDevice(), _cupy.cuda.get_current_stream().ptr, arrays)

    def launch(self, device, stream, arrays):
        """Launch on ``device`` (the current one) and ``stream`` (an address)
        with ``arrays`` as the array arguments (see the class docstring)."""
        self.launch_addresses(
            device, stream, [a if type(a) is int else a.data.ptr if type(a) is _ndarray else _address(a) for a in arrays]
        )

    def launch_addresses(self, device, stream, addresses):
        """:meth:`launch` with the array arguments given as device addresses (ints)."""
        kernel = self._kernels.get(device) or self._kernel(device)
        packed = self._buffer
        if packed is None or packed[3] != len(addresses):
            self._pack(len(addresses))
            packed = self._buffer
        # The buffer is shared by every caller of this plan: write and launch
        # as one step (cuLaunchKernel copies the arguments before returning).
        with self._lock:
            packed[4].pack_into(packed[0], 0, *addresses)
            _driver.launchKernel(kernel, *self._dims, stream, 0, self._extra)

    def __repr__(self):
        return (
            f"Launch({self.expression}, grid={self.grid}, block={self.block}, "
            f"shared_mem={self.shared_mem})"
        )


class Steps(typing.NamedTuple):
    """One call's work, resolved once per call signature (and pointer
    alignment): its launches, each with a picker of its array arguments from
    the call's argument addresses, and the temporaries, ``(shape, dtype)``
    each, whose workspace addresses are appended to those in order.

    An op builds its argument tuple (inputs, outputs, NULL for absent ones)
    and hands it to :func:`run`, which reads the device and stream once for
    all the launches."""

    launches: tuple = ()  # ((Launch, argument picker), ...): see steps()
    temporaries: tuple = ()  # ((shape, dtype), ...)
    workspace: tuple = ((), 0)  # the temporaries' (offsets, total bytes) in the workspace


def steps(launches, temporaries=()):
    """Steps from ``((Launch, (argument position, ...)), ...)``: each launch
    gets an itemgetter of its arguments' addresses (one C call per launch)."""
    from . import _workspace  # imports CuPy: only the GPU ops build Steps

    temporaries = tuple(temporaries)
    return Steps(
        tuple((launch, operator.itemgetter(*positions)) for launch, positions in launches),
        temporaries,
        _workspace.layout(temporaries),
    )


def run(steps, arguments):
    """Launch ``steps`` (a :class:`Steps`) on the current device and CuPy
    stream with ``arguments``: cupy arrays and raw addresses (NULL for an
    absent array)."""
    if _runtime is None:
        _import_cuda()
    device = _runtime.getDevice()
    stream = _cupy.cuda.get_current_stream().ptr
    addresses = [a if type(a) is int else a.data.ptr for a in arguments]
    if steps.temporaries:
        addresses += _workspace.addresses_on(device, stream, steps.workspace)
    for launch, pick in steps.launches:
        launch.launch_addresses(device, stream, pick(addresses))


def _address(array):
    """Device address of a kernel argument other than a cupy array: a raw
    address (int, e.g. ``NULL``) or an array with a CuPy memory pointer."""
    data = getattr(array, "data", None)
    return data.ptr if hasattr(data, "ptr") else int(array)


# CuPy is imported on the first launch: the references and the CLI import
# this module on machines without it.
_cupy = _driver = _runtime = _ndarray = _workspace = None


def _import_cuda():
    global _cupy, _driver, _runtime, _ndarray, _workspace
    import cupy
    from cupy_backends.cuda.api import driver, runtime

    from . import _workspace as workspace

    _cupy, _driver, _runtime, _ndarray, _workspace = cupy, driver, runtime, cupy.ndarray, workspace
