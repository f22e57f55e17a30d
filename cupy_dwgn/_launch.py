"""Launch helpers shared by the ops: grid sizes, index type, typed scalars."""

import contextlib
import ctypes
import os
import struct
import threading

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


def row_strips(rows, max_rows):
    """``(rows per strip, strips)``: the fewest strips of at most
    ``max_rows`` rows, as even as they can be."""
    strip = -(-rows // -(-rows // max_rows))
    return strip, -(-rows // strip)


#: The register weight gradients take their long row strips (fewer, longer
#: units: fewer rows re-read, fewer blocks to start and reduce) only where
#: the grid those give still holds this many threads; else their short
#: strips, whose units keep more workers busy.  From GPU times (CUDA graph)
#: on an H200, 2026-12-03, 33 (shape, dtype, layout) cases of the NCHW and
#: NHWC kernels at stride 1: long strips lost by 17-56% at grids of at
#: most 49152 threads (fp16 NCHW 32x192x28 3x3 13.4 -> 17.6 us, 8x144x56
#: 11.4 -> 17.8; float32 NHWC 32x384x28 25.7 -> 31.2) and won by 2-15% from
#: 53760 (fp16 NHWC 32x240x28 5x5 26.3 -> 24.5, NCHW 61440: 23.9 -> 20.5;
#: 64x384x28 fp16 NCHW 41.1 -> 38.8), but for float32 NCHW 16x384x28 3x3
#: (49152 threads, long strips 3% faster).  The split, hence the summation
#: order, still depends on the shape only.
LONG_STRIP_MIN_THREADS = 52 * 1024


def walk_units(out_rows, units_per_strip, grid_x, workers, threads, target_blocks, long, short=None):
    """``((rows per strip, strips), units, (splits, units per split) or
    None)`` for a weight gradient whose units are (row strip, ...) ranges
    split by ``unit_splits``: ``long`` = (max rows per strip, min units per
    worker), or ``short`` where the long strips' grid of ``threads``-thread
    blocks would hold fewer than LONG_STRIP_MIN_THREADS threads."""
    def layout(max_rows, min_units):
        strip = row_strips(out_rows, max_rows)
        units = units_per_strip * strip[1]
        return strip, units, unit_splits(units, grid_x, workers, target_blocks, min_units)

    planned = layout(*long)
    split = planned[2]
    if short is not None and split is not None and grid_x * split[0] * threads < LONG_STRIP_MIN_THREADS:
        planned = layout(*short)
    return planned


def unit_splits(units, grid_x, workers, target_blocks, min_units_per_worker):
    """``(splits, units per split)`` for a kernel whose grid.y splits
    ``units`` work units into contiguous ranges taken by ``workers`` workers
    per block: about ``target_blocks`` blocks in all (grid.x = ``grid_x``),
    at least ``min_units_per_worker`` units per worker, at most MAX_GRID_Y
    splits, then balanced so every split is non-empty.  From the shape
    only (never the device), so the summation order the split implies is
    the same on every GPU.  None when a split's unit counters would pass
    int range."""
    splits = max(1, min(-(-target_blocks // grid_x), units // (workers * min_units_per_worker), MAX_GRID_Y))
    per_split = -(-units // splits)
    splits = -(-units // per_split)
    if units >= 2**31 or splits * per_split >= 2**31:  # the kernels' int unit counters
        return None
    return splits, per_split


class _ThreadContext(threading.local):
    ready = False  # whether make_context_current ran on this thread


_THREAD = _ThreadContext()


def make_context_current(device):
    """Make ``device``'s primary CUDA context current on the calling thread
    when none is.  Driver calls (module loads, function attributes, the
    occupancy query, launches on the legacy default stream) act on the
    thread's current context, and a thread whose CUDA runtime was never used
    has none although cudaGetDevice reports device 0: PyTorch's autograd
    worker, which runs every backward, is such a thread (seen: a backward's
    first launch failed with CUDA_ERROR_INVALID_CONTEXT in the occupancy
    query).  cudaSetDevice makes the primary context current (CUDA 12 and
    later); Triton's launcher retains and sets it the same way."""
    if _driver is None:
        _import_cuda()
    if _driver.ctxGetCurrent() == 0:
        _runtime.setDevice(device)
    _THREAD.ready = True


def opt_in_shared(kernel, shared_mem):
    """Let ``kernel`` (a cupy.RawKernel, on the current device) launch with
    ``shared_mem`` bytes of dynamic shared memory.  Past 48 KB of static plus
    dynamic shared memory a kernel must opt in, once per kernel and device;
    the driver's default limit for the dynamic part is 48 KB less the
    kernel's static shared memory (seen: a float64 7x7 weight gradient with
    12.5 KB of static scratch and 43.5 KB dynamic failed to launch,
    CUDA_ERROR_INVALID_VALUE, when only dynamic sizes above 48 KB opted in)."""
    if kernel.max_dynamic_shared_size_bytes < shared_mem:
        kernel.max_dynamic_shared_size_bytes = shared_mem


class Launch:
    """One kernel launch, fully resolved for one call signature: the kernel
    (file + name expression, looked up per device on use), grid, block,
    dynamic shared memory and the scalar arguments that follow the arrays.

    Build it once per signature (cache the builder with functools.lru_cache);
    a :class:`Steps` launches it.  ``launch(x, weight, bias, y)`` also works
    (each array a cupy.ndarray or a raw address, 0 for the null pointer), at
    the cost of building a Steps per call.
    """

    __slots__ = (
        "file", "expression", "grid", "block", "shared_mem", "scalars", "cooperative", "persistent", "whole_grid",
        "cluster", "programmatic", "_kernels", "_scalar_storage",
    )

    def __init__(self, file, expression, grid, block, shared_mem=0, scalars=(), cooperative=False, persistent=False,
                 whole_grid=False, cluster=1, programmatic=False):
        self.file = file
        self.expression = expression
        self.grid = tuple(int(v) for v in grid) + (1,) * (3 - len(grid))
        self.block = tuple(int(v) for v in block) + (1,) * (3 - len(block))
        self.shared_mem = int(shared_mem)
        self.scalars = tuple(scalars)
        for value in self.scalars:  # a Python float would be packed as a double
            if not isinstance(value, numpy.generic):
                raise TypeError(f"{expression}: scalars must be NumPy scalars of the kernel's types, got {value!r}")
        # A cooperative launch (cuLaunchCooperativeKernel: every block
        # resident, so the kernel may use grid.sync()).  ``grid`` is then the
        # most blocks the kernel can use; on a device it launches
        # min(grid.x, the blocks that fit at once there) (grid_on), so the
        # kernel must be correct for any grid.x >= 1.
        self.cooperative = bool(cooperative)
        # A persistent kernel (its blocks walk the work grid-size apart) is
        # launched the same way, with an ordinary launch.
        self.persistent = bool(persistent)
        # A cooperative kernel whose every block owns a piece of the work
        # (the resident GroupNorm kernels) needs its whole grid: grid_on
        # raises rather than trim it (the caller checks it fits first).
        self.whole_grid = bool(whole_grid)
        # CTAs per thread-block cluster, fixed by the kernel's __cluster_dims__
        # (the grid is a multiple of it); past 8, a non-portable size the
        # kernel must be allowed once per device (kernel()).
        self.cluster = int(cluster)
        if self.grid[0] % self.cluster:
            raise ValueError(f"{expression}: grid {self.grid} is not a multiple of the cluster size {self.cluster}")
        # Launched as the secondary of a programmatic dependent launch
        # (cuLaunchKernelEx, CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
        # where the device and PROGRAMMATIC allow it (programmatic_on): its
        # blocks may be placed while the stream's previous kernel finishes
        # (once that one's blocks called dwgn::allow_dependent_grid), so the
        # kernel must call dwgn::wait_for_prior_grid before it touches memory
        # that kernel writes.  Not with a cooperative launch.
        self.programmatic = bool(programmatic)
        if self.programmatic and self.cooperative:
            raise ValueError(f"{expression}: a programmatic launch cannot also be cooperative")
        if (self.cooperative or self.persistent) and self.grid[1:] != (1, 1):
            raise ValueError(f"{expression}: a cooperative or persistent launch takes a 1-D grid, got {self.grid}")
        self._kernels = {}  # device id -> kernel address
        # Built here, not on first use: Launches are shared by several Steps
        # (each with its own lock), whose kernelParams all point into it.
        self._scalar_storage = _scalar_storage(self.scalars)

    def kernel(self, device):
        """The kernel's CUfunction address on ``device`` (the current device;
        compiled or loaded on first use)."""
        address = self._kernels.get(device)
        if address is None:
            make_context_current(device)
            kernel = _compile.get_kernel(self.file, self.expression)
            opt_in_shared(kernel, self.shared_mem)
            if self.cluster > 8:
                if _driver is None:
                    _import_cuda()
                _driver.funcSetAttribute(kernel.kernel.ptr, _NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
            # The memoized RawKernel keeps its module loaded for the life of the process.
            address = self._kernels[device] = kernel.kernel.ptr
        return address

    def grid_on(self, device):
        """The grid launched on ``device`` (the current one): ``grid``, or for
        a cooperative or persistent launch at most the blocks resident at
        once there."""
        if not (self.cooperative or self.persistent):
            return self.grid
        capacity = cooperative_capacity(device, self.kernel(device), self.block, self.shared_mem)
        if self.whole_grid and capacity < self.grid[0]:
            raise RuntimeError(
                f"{self.expression}: {self.grid[0]} blocks cannot all be resident on device {device} "
                f"(at most {capacity}); this launch needs its whole grid"
            )
        return (min(self.grid[0], capacity), 1, 1)

    def scalar_addresses(self):
        """Host addresses of the scalar arguments, each stored once at its
        natural alignment in a buffer this Launch keeps (cuLaunchKernel's
        kernelParams point at them)."""
        return self._scalar_storage[1]

    def __call__(self, *arrays):
        run(Steps(((self, tuple(range(len(arrays)))),)), arrays)

    def __repr__(self):
        return (
            f"Launch({self.expression}, grid={self.grid}, block={self.block}, "
            f"shared_mem={self.shared_mem})"
        )


def _scalar_storage(scalars):
    """(ctypes buffer, address of each scalar): the scalars at their natural
    alignment, as a kernel's parameters are laid out."""
    layout, offset = [], 0
    for value in scalars:
        raw = value.tobytes()
        offset = -(-offset // len(raw)) * len(raw)
        layout.append((offset, raw))
        offset += len(raw)
    buffer = (ctypes.c_ubyte * max(8, offset))()
    base = ctypes.addressof(buffer)
    for start, raw in layout:
        ctypes.memmove(base + start, raw, len(raw))
    return buffer, tuple(base + start for start, _ in layout)


class Steps:
    """One call's work, resolved once per call signature (and pointer
    alignment): its launches, each with the positions of its array arguments
    among the call's addresses, and the temporaries, ``(shape, dtype)`` each,
    whose workspace addresses follow the call's own.

    Per call, :meth:`run` writes every address once into this object's slot
    buffer (one ``struct.pack_into``); each launch's kernelParams array,
    built once, points at its arrays' slots and at its Launch's scalars, so
    a launch is one ``cuLaunchKernel`` with nothing packed per kernel.  A
    CuPy kernel call converts every argument on every call instead (about
    0.3 us per scalar; 8.6 us for 4 arrays + 10 ints against 5.9 for a bare
    launch on an H200).
    """

    __slots__ = (
        "launches", "positions", "temporaries", "workspace", "_slots", "_pack", "_params", "_calls", "_bindings",
        "_bound", "_lock",
    )

    def __init__(self, launches, temporaries=()):
        if _workspace is None:  # only the GPU ops build Steps
            _import_cuda()
        self.launches = tuple(launch for launch, _ in launches)
        self.positions = tuple(tuple(positions) for _, positions in launches)
        self.temporaries = tuple(temporaries)
        self.workspace = _workspace.layout(self.temporaries)  # (offsets, total bytes)
        self._slots = self._pack = self._params = None
        self._calls = {}  # device id -> (driver call, its arguments before the stream, after it) per launch
        # A binding: (device, stream, workspace generation, the temporaries'
        # addresses there, (driver call, its arguments) per launch), kept
        # per (device, stream) in _bindings; _bound is the last one used, so
        # a call on the same device and stream reuses it after three
        # comparisons (replaced as a whole: a thread reads one consistent tuple).
        self._bindings = {}
        self._bound = (None, None, None, (), ())
        self._lock = threading.Lock()

    def _calls_on(self, device, count):
        """The launches' arguments on ``device`` but the stream (the slot
        buffer and the kernelParams arrays are made on the first call:
        ``count`` addresses)."""
        with self._lock:
            if self._slots is None:
                if any(p >= count for positions in self.positions for p in positions):
                    raise ValueError(f"{self!r}: an argument position is past the {count} addresses given")
                slots = (ctypes.c_uint64 * max(1, count))()
                base = ctypes.addressof(slots)
                params = []
                for launch, positions in zip(self.launches, self.positions):
                    pointers = [base + 8 * p for p in positions] + list(launch.scalar_addresses())
                    params.append((ctypes.c_void_p * max(1, len(pointers)))(*pointers))
                self._params = params  # kept: the driver reads them on every launch
                self._pack = struct.Struct(f"{count}{_ADDRESS_FORMAT}").pack_into
                self._slots = slots
            calls = self._calls.get(device)
            if calls is None:
                calls = self._calls[device] = tuple(
                    (
                        _launch_programmatic,
                        (launch.kernel(device), launch.grid_on(device), launch.block, launch.shared_mem),
                        (ctypes.addressof(params),),
                    )
                    if launch.programmatic and programmatic_on(device) else
                    (
                        _driver.launchCooperativeKernel if launch.cooperative else _driver.launchKernel,
                        (launch.kernel(device), *launch.grid_on(device), *launch.block, launch.shared_mem),
                        (ctypes.addressof(params),) if launch.cooperative else (ctypes.addressof(params), 0),
                    )
                    for launch, params in zip(self.launches, self._params)
                )
        return calls

    def _bind(self, device, stream, count):
        """The binding for ``device`` and ``stream`` (both current), made
        the last one used."""
        bound = self._bindings.get((device, stream))
        if bound is None or bound[2] != _workspace.generation:
            # The generation is read before the buffer: a buffer replaced in
            # between leaves an older generation here, so the next call rebinds.
            generation = _workspace.generation
            temporaries = tuple(_workspace.addresses_on(device, stream, self.workspace)) if self.temporaries else ()
            calls = tuple(
                _programmatic_call(stream, *before, *after) if driver_call is _launch_programmatic
                else (driver_call, before + (stream,) + after)
                for driver_call, before, after in self._calls_on(device, count)
            )
            if len(self._bindings) >= _MAX_BINDINGS:  # streams made and dropped in a loop
                self._bindings.clear()
            bound = self._bindings[device, stream] = (device, stream, generation, temporaries, calls)
        self._bound = bound
        return bound

    def run(self, device, addresses):
        """Launch every step on ``device`` (the current device's id) and the
        current CuPy stream with ``addresses``: the call's arguments (ints;
        NULL for an absent array); the temporaries' follow them."""
        if not _THREAD.ready:
            make_context_current(device)
        stream = _cupy.cuda.get_current_stream().ptr
        bound_device, bound_stream, generation, temporaries, calls = self._bound
        if bound_device != device or bound_stream != stream or generation != _workspace.generation:
            _, _, _, temporaries, calls = self._bind(device, stream, len(addresses) + len(self.temporaries))
        # The slots are shared by every caller of these Steps: write and
        # launch as one step (cuLaunchKernel copies the arguments it reads).
        with self._lock:
            self._pack(self._slots, 0, *addresses, *temporaries)
            for driver_call, arguments in calls:
                driver_call(*arguments)

    def __repr__(self):
        return f"Steps({', '.join(map(repr, self.launches))}, temporaries={self.temporaries})"


_MAX_BINDINGS = 64  # (device, stream) bindings kept per Steps

# The slots' struct format: size_t ("N", native only) is the 8-byte unsigned
# type of every 64-bit platform and packs about twice as fast as "Q" (0.15
# against 0.27 us for 9 addresses; both take any int from 0 to 2**64 - 1).
_ADDRESS_FORMAT = "N" if struct.calcsize("N") == 8 else "Q"

_CAPACITY = {}  # (device, kernel address, block, shared) -> resident blocks
_COOPERATIVE = {}  # device -> whether it supports cooperative launches


def cooperative_supported():
    """Whether the current device can launch cooperative kernels (cached)."""
    if _runtime is None:
        _import_cuda()
    device = _runtime.getDevice()
    supported = _COOPERATIVE.get(device)
    if supported is None:
        supported = _COOPERATIVE[device] = bool(
            _runtime.deviceGetAttribute(_runtime.cudaDevAttrCooperativeLaunch, device)
        )
    return supported


# CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED (cuda.h): clusters of
# more than 8 CTAs (16 on an H100 / H200).
_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
_COMPUTE_CAPABILITY_MAJOR = 75  # cudaDevAttrComputeCapabilityMajor
_MAJOR = {}  # device -> compute capability major


def compute_capability_major(device):
    """``device``'s compute capability major (9 on an H100 / H200; cached):
    thread-block clusters need 9 or more."""
    major = _MAJOR.get(device)
    if major is None:
        if _runtime is None:
            _import_cuda()
        major = _MAJOR[device] = int(_runtime.deviceGetAttribute(_COMPUTE_CAPABILITY_MAJOR, device))
    return major


_MAX_SHARED = {}  # device -> the dynamic shared memory a block may opt in to


def max_shared_per_block(device):
    """Bytes of shared memory a block may use on ``device`` when its kernel
    opts in (227 KB on an H200, 163 KB on an A100; cached per device)."""
    limit = _MAX_SHARED.get(device)
    if limit is None:
        if _runtime is None:
            _import_cuda()
        limit = _MAX_SHARED[device] = int(
            _runtime.deviceGetAttribute(_runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, device)
        )
    return limit


def cooperative_capacity(device, kernel, block, shared_mem):
    """How many blocks of ``kernel`` can be resident at once on ``device``
    (the occupancy per SM times the SM count; cached, so the occupancy is
    queried once per kernel, block and device, never per call).  A
    cooperative launch of more blocks fails, so this is the largest grid;
    a persistent launch (Launch.persistent) uses it as one full wave."""
    key = (device, kernel, tuple(block), shared_mem)
    capacity = _CAPACITY.get(key)
    if capacity is None:
        make_context_current(device)
        threads = block[0] * block[1] * block[2]
        per_sm = _driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel, threads, shared_mem)
        sms = _runtime.deviceGetAttribute(_runtime.cudaDevAttrMultiProcessorCount, device)
        capacity = per_sm * sms
        if capacity < 1:
            raise RuntimeError(
                f"kernel cannot be resident on device {device} "
                f"(block {block}, {shared_mem} bytes of dynamic shared memory)"
            )
        _CAPACITY[key] = capacity
    return capacity


# Programmatic dependent launch (sm_90+): cuLaunchKernelEx through ctypes
# (CuPy 14 exposes cuLaunchKernel and cuLaunchCooperativeKernel only), with
# the structures of cuda.h (CUDA 12.0+).
#: Whether ``Launch(programmatic=True)`` launches programmatically where the
#: device allows it (compute capability 9+, a driver with cuLaunchKernelEx).
#: Read when a Steps first binds a device and stream; the environment
#: variable CUPY_DWGN_PROGRAMMATIC_LAUNCH=0 turns it off (benchmarks compare both).
PROGRAMMATIC = os.environ.get("CUPY_DWGN_PROGRAMMATIC_LAUNCH", "1") != "0"
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [
        ("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
        ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
        ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
        ("attributes", ctypes.POINTER(_LaunchAttribute)), ("num_attributes", ctypes.c_uint),
    ]


_launch_kernel_ex = None  # cuLaunchKernelEx, or False where the driver has none
_PROGRAMMATIC_DEVICES = {}  # device -> whether its launches may be programmatic


def _driver_function(name, argtypes):
    """libcuda's entry point ``name`` as a ctypes function returning a
    CUresult, or False where the driver library or the entry point is missing."""
    try:
        function = getattr(ctypes.CDLL("nvcuda.dll" if os.name == "nt" else "libcuda.so.1"), name)
    except (OSError, AttributeError):
        return False
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


def _driver_launch_kernel_ex():
    """libcuda's cuLaunchKernelEx as a ctypes function, or False."""
    global _launch_kernel_ex
    if _launch_kernel_ex is None:
        _launch_kernel_ex = _driver_function(
            "cuLaunchKernelEx", (ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p))
    return _launch_kernel_ex


_CAPTURE_MODE_RELAXED = 2  # CU_STREAM_CAPTURE_MODE_RELAXED
_exchange_capture_mode = None  # cuThreadExchangeStreamCaptureMode (CUDA 10.1+)


@contextlib.contextmanager
def relaxed_capture():
    """This thread's stream-capture mode relaxed for the block (restored
    after): calls that CUDA forbids while a stream captures a graph in the
    default (global) mode -- cudaMalloc, a stream synchronize -- are allowed
    here, as PyTorch's allocator does for its own cudaMalloc during capture.
    For work outside the graph (the workspace: _workspace._grow)."""
    global _exchange_capture_mode
    if _driver is None:
        _import_cuda()
    if _exchange_capture_mode is None:
        _exchange_capture_mode = _driver_function("cuThreadExchangeStreamCaptureMode", (ctypes.POINTER(ctypes.c_int),))
    if not _exchange_capture_mode:
        raise RuntimeError("cupy_dwgn: the CUDA driver has no cuThreadExchangeStreamCaptureMode (CUDA 10.1+ needed)")
    mode = ctypes.c_int(_CAPTURE_MODE_RELAXED)
    status = _exchange_capture_mode(ctypes.byref(mode))  # mode now holds the thread's previous one
    if status:
        raise _driver.CUDADriverError(status)
    try:
        yield
    finally:
        status = _exchange_capture_mode(ctypes.byref(mode))
        if status:
            raise _driver.CUDADriverError(status)


def programmatic_on(device):
    """Whether programmatic launches run as such on ``device`` (the current
    one): PROGRAMMATIC, compute capability 9+ and cuLaunchKernelEx in the
    driver; else they are ordinary launches (cached per device)."""
    on = _PROGRAMMATIC_DEVICES.get(device)
    if on is None:
        on = _PROGRAMMATIC_DEVICES[device] = bool(
            PROGRAMMATIC and compute_capability_major(device) >= 9 and _driver_launch_kernel_ex()
        )
    return on


def _launch_programmatic(config, kernel, params):
    """One cuLaunchKernelEx; raises CUDADriverError as CuPy's launches do."""
    status = _launch_kernel_ex(config, kernel, params, None)
    if status:
        raise _driver.CUDADriverError(status)


def _programmatic_call(stream, kernel, grid, block, shared_mem, params):
    """``(call, arguments)`` of a programmatic launch on ``stream``: its
    CUlaunchConfig names the stream, so a binding (Steps._bind) holds one."""
    attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    config = _LaunchConfig(*grid, *block, shared_mem, stream, ctypes.pointer(attribute), 1)  # holds the attribute
    return _launch_programmatic, (config, kernel, params)


def run(steps, arguments):
    """Launch ``steps`` (a :class:`Steps`) on the current device and CuPy
    stream with ``arguments``: cupy arrays and raw addresses (NULL for an
    absent array).  The ops call :meth:`Steps.run` with the addresses they
    read already."""
    if _runtime is None:
        _import_cuda()
    steps.run(_runtime.getDevice(), [a if type(a) is int else a.data.ptr for a in arguments])


# CuPy is imported on the first launch: the references and the CLI import
# this module on machines without it.
_cupy = _driver = _runtime = _workspace = None


def _import_cuda():
    global _cupy, _driver, _runtime, _workspace
    import cupy
    from cupy_backends.cuda.api import driver, runtime

    from . import _workspace as workspace

    _cupy, _driver, _runtime, _workspace = cupy, driver, runtime, workspace
