"""Every launch's kernelParams match its kernel's parameters, and every launch
the ops choose for any valid call is a shipped kernel in a configuration a GPU
accepts, checked without a GPU.

The ops hand each kernel its arrays by position in the call's argument tuple
and its scalars from the Launch (cupy_dwgn._launch.Steps).  A wrong position
or scalar type would only show on a GPU, as wrong results or a crash.  Here
NVRTC names each instantiated kernel (its lowered, mangled name), c++filt
spells out its parameter list, and a stand-in driver receives the launches of
real Steps built by the ops' own kernel-choice code; every kernelParams entry
is read back from host memory and compared with the address or scalar the
parameter must get: parameter count, pointer or value, each pointer's element
type against its array's dtype, each scalar's type, alignment and value.  Two
arrays of one dtype given to each other's parameters are not caught here (the
GPU suite catches those).  Device queries the plans make (SM count, shared
memory, a kernel's registers) get H200 values.
"""

import contextlib
import ctypes
import itertools
import shutil
import struct
import subprocess
import types

import numpy
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

cupy = pytest.importorskip("cupy")

from cupy.cuda import memory  # noqa: E402

from cupy_dwgn import _compile, _dtypes, _group_norm, _launch, _validate, _workspace, depthwise  # noqa: E402
from cupy_dwgn import (  # noqa: E402
    _depthwise_conv_mma, _depthwise_nchw_large, _depthwise_nchw_window, _depthwise_nhwc_direct, _depthwise_nhwc_phase, _depthwise_nhwc_ring, _depthwise_nhwc_window,
    _depthwise_wgrad_mma,
)
from _helpers import SM90_SHARED_OPT_IN, h200_device_facts  # noqa: E402

DTYPES = [numpy.dtype(numpy.float32), numpy.dtype(numpy.float16), _dtypes.bfloat16, numpy.dtype(numpy.float64)]
#: (N, C, H, W, multiplier, KH, KW, stride, padding, dilation): every kernel family.
CONVOLUTIONS = [
    (2, 16, 32, 32, 1, 3, 3, 1, 1, 1), (2, 16, 32, 32, 1, 3, 3, 2, 1, 1), (2, 16, 32, 32, 1, 5, 5, 1, 2, 1),
    (2, 16, 32, 32, 1, 7, 7, 2, 3, 1), (2, 16, 32, 32, 2, 3, 3, 1, 1, 1), (2, 16, 32, 32, 1, 4, 4, 1, 1, 1),
    (2, 16, 32, 32, 1, 3, 3, 1, 2, 2), (2, 16, 32, 32, 1, 3, 3, 3, 1, 1), (2, 16, 64, 64, 1, 11, 11, 1, 5, 1),
    (2, 16, 64, 64, 1, 1, 31, 1, 0, 1), (2, 17, 9, 9, 3, 2, 3, 1, 0, 1), (8, 1024, 7, 7, 1, 7, 7, 1, 3, 1),
    (2, 5, 20, 20, 2, 9, 9, 1, 4, 1), (1, 4, 20, 20, 1, 31, 31, 1, 15, 1),
    # float32 5x5 stride 1 on rows 15-38 wide with fewer channels than a vector (the direct
    # kernel's rule sized a grid of no channel tile: ZeroDivisionError on the GPU suite's
    # "tiled 5x5 dilation 2 M=3"), and 64 images, where the direct kernel takes 2 items a thread
    (2, 2, 40, 37, 3, 5, 5, 1, 4, 2), (2, 2, 28, 28, 1, 5, 5, 1, 2, 1), (64, 8, 28, 28, 1, 5, 5, 1, 2, 1),
]
#: (N, S, C, num_groups) for GroupNorm.
NORMS = [(2, 64, 320, 32), (2, 16, 12, 6), (4, 100, 7, 7), (1, 3, 24, 3), (8, 1024, 640, 32)]
SCALAR_CODES = {"int": "i", "long long": "q", "float": "f", "double": "d"}
POINTEES = {"float": numpy.dtype(numpy.float32), "double": numpy.dtype(numpy.float64),
            "__half": numpy.dtype(numpy.float16), "__nv_bfloat16": _dtypes.bfloat16}
# The layout transposes move raw words of the element's size.
WORD_POINTEES = {"unsigned short": 2, "unsigned int": 4, "unsigned long long": 8}


def _array(shape, dtype, offset=0):
    """A cupy array over a made-up address (no GPU needed to make one)."""
    dtype = numpy.dtype(dtype)
    nbytes = max(1, int(numpy.prod(shape)) * dtype.itemsize)
    pointer = memory.MemoryPointer(memory.UnownedMemory(0x7F00_0000_0000 + offset, nbytes, None, device_id=0), 0)
    return cupy.ndarray(shape, dtype, memptr=pointer)


def _steps_of_every_path(monkeypatch):
    """(dtype of each call argument, Steps) for every kernel-choice path the
    ops take (None: the NULL a backward passes in the forward kernels' bias slot)."""
    h200_device_facts(monkeypatch)
    steps = []
    for n, c, h, w, m, kh, kw, s, p, d in CONVOLUTIONS:
        g = _validate.conv_geometry((n, c, h, w), (c * m, 1, kh, kw), s, p, d)
        for dtype in DTYPES:
            for layout in ("NCHW", "NHWC"):
                x = _array((g.batch * g.channels * g.height * g.width,), dtype)
                y = _array((g.batch * g.channels * g.multiplier * g.out_height * g.out_width,), dtype)
                for misaligned in (0, 2, 8):
                    x_off = _array(x.shape, dtype, misaligned)
                    steps.append(((dtype,) * 4, depthwise._forward_steps(g, layout, x_off, y)))
                    steps.append(((dtype, dtype, None, dtype), depthwise._backward_input_steps(g, layout, y, x_off)))
                    steps.append(((dtype, dtype, None, dtype), depthwise._backward_weight_steps(g, layout, y, x_off)))
                    # The tensor-core weight gradient wherever it serves the call.
                    monkeypatch.setattr(_depthwise_wgrad_mma, "MODE", "always")
                    steps.append(((dtype, dtype, None, dtype), depthwise._backward_weight_steps(g, layout, y, x_off)))
                    monkeypatch.setattr(_depthwise_wgrad_mma, "MODE", "rule")
                    # The tensor-core forward / backward-input wherever it serves the call.
                    monkeypatch.setattr(_depthwise_conv_mma, "MODE", "always")
                    steps.append(((dtype,) * 4, depthwise._forward_steps(g, layout, x_off, y)))
                    steps.append(((dtype, dtype, None, dtype), depthwise._backward_input_steps(g, layout, y, x_off)))
                    monkeypatch.setattr(_depthwise_conv_mma, "MODE", "rule")
                    if layout == "NHWC":  # the ring, register-window and direct kernels wherever they serve the call
                        kernels = (_depthwise_nhwc_ring, _depthwise_nhwc_window, _depthwise_nhwc_direct)
                        for module in kernels:
                            for each in kernels:
                                monkeypatch.setattr(each, "MODE", "always" if each is module else "never")
                            steps.append(((dtype,) * 4, depthwise._forward_steps(g, layout, x_off, y)))
                            steps.append(((dtype, dtype, None, dtype),
                                          depthwise._backward_input_steps(g, layout, y, x_off)))
                        for each in kernels:
                            monkeypatch.setattr(each, "MODE", "rule")
    for n, s, c, groups in NORMS:
        for dtype in DTYPES:
            acc = _dtypes.accumulator_dtype(dtype)
            for w_dtype in map(numpy.dtype, _group_norm.weight_dtypes(dtype)):
                forward_arguments = (dtype, w_dtype, w_dtype, dtype, acc, acc)
                backward_arguments = (dtype, dtype, acc, acc, w_dtype, w_dtype, dtype, w_dtype, w_dtype)
                for aligned, path in itertools.product((True, False),
                                                       ("split", "fused", "onepass", "resident", "cluster", "small")):
                    plan = _group_norm._forward_plan(n, s, c, groups, dtype, w_dtype, "silu", 1e-5, aligned, path)
                    for mean_temporary in (False, True):
                        for rstd_temporary in (False, True):
                            steps.append((forward_arguments,
                                          _group_norm._forward_steps(plan, mean_temporary, rstd_temporary)))
                    backward = _group_norm._backward_plan(n, s, c, groups, dtype, w_dtype, "gelu", aligned, path)
                    steps.append((backward_arguments, _group_norm._backward_steps(backward)))
    return steps


def _signatures(launches):
    """{(file, expression): [parameter type, ...]} from NVRTC's lowered names, demangled."""
    by_file = {}
    for launch in launches:
        by_file.setdefault(launch.file, set()).add(launch.expression)
    lowered = {}
    for filename, expressions in by_file.items():
        for expression, report in _compile.nvrtc_compile(filename, sorted(expressions), 80).items():
            lowered[filename, expression] = report["lowered"]
    names = sorted(set(lowered.values()))
    demangled = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                               check=True).stdout.splitlines()
    spelled = dict(zip(names, demangled))
    return {key: _parameters(spelled[name]) for key, name in lowered.items()}


def _parameters(signature):
    """The parameter types of a demangled function signature ``name<...>(a, b, ...)``."""
    inner = signature[signature.rindex("(", 0, signature.rindex(")")) + 1 : signature.rindex(")")]
    parameters, depth, current = [], 0, ""
    for char in inner:
        depth += char in "<(" and 1 or (char in ">)" and -1 or 0)
        if char == "," and depth == 0:
            parameters.append(current.strip())
            current = ""
        else:
            current += char
    return parameters + ([current.strip()] if current.strip() else [])


def _scalar_type(parameter):
    """'int', 'long long', 'float' or 'double' for a by-value parameter (the
    accumulator type is written dwgn::AccType<T>::type)."""
    if "AccType<double>" in parameter:
        return "double"
    if "AccType<" in parameter:
        return "float"
    return parameter


@pytest.mark.skipif(shutil.which("c++filt") is None, reason="c++filt (binutils) is not installed")
def test_every_launch_passes_its_kernel_the_right_arguments(monkeypatch):
    all_steps = _steps_of_every_path(monkeypatch)
    signatures = _signatures({launch for _, steps in all_steps for launch in steps.launches})

    received = []
    driver = types.SimpleNamespace(
        launchKernel=lambda kernel, *dims_stream_params_extra: received.append((kernel, dims_stream_params_extra[8])),
        launchCooperativeKernel=lambda kernel, *dims_stream_params: received.append((kernel, dims_stream_params[8])),
        occupancyMaxActiveBlocksPerMultiprocessor=lambda kernel, threads, shared: 2,
        ctxGetCurrent=lambda: 0xC0,  # a context is current
    )
    runtime = types.SimpleNamespace(getDevice=lambda: 0, deviceGetAttribute=lambda attribute, device: 132,
                                    cudaDevAttrMultiProcessorCount=16)
    stream = types.SimpleNamespace(ptr=0)
    temporary_base = 0x6000_0000_0000
    workspace = types.SimpleNamespace(
        addresses_on=lambda device, stream_, layout: [temporary_base + offset for offset in layout[0]], generation=0
    )
    programmatic = []  # (kernel, the CUlaunchConfig's fields) of each programmatic launch

    def launch_kernel_ex(config, kernel, params, extra):
        attribute = config.attributes[0]
        programmatic.append((kernel, (config.grid_x, config.grid_y, config.grid_z), (config.block_x, config.block_y,
                             config.block_z), config.shared_mem, config.stream or 0, config.num_attributes,
                             attribute.id, attribute.value, extra))
        received.append((kernel, params))
        return 0

    monkeypatch.setattr(_launch, "_driver", driver)
    monkeypatch.setattr(_launch, "_runtime", runtime)
    monkeypatch.setattr(_launch, "_THREAD", _launch._ThreadContext())
    monkeypatch.setattr(_launch, "_cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(get_current_stream=lambda: stream)))
    monkeypatch.setattr(_launch, "_workspace", workspace)
    monkeypatch.setattr(_launch.Launch, "kernel", lambda self, device: id(self))
    # Programmatic launches (the device answers compute capability 132 >= 9) go to a stand-in cuLaunchKernelEx.
    monkeypatch.setattr(_launch, "PROGRAMMATIC", True)
    monkeypatch.setattr(_launch, "_MAJOR", {})
    monkeypatch.setattr(_launch, "_PROGRAMMATIC_DEVICES", {})
    monkeypatch.setattr(_launch, "_launch_kernel_ex", launch_kernel_ex)

    checked = 0
    _depthwise_nchw_window.plan.cache_clear()
    _depthwise_nchw_large._plan.cache_clear()
    for argument_dtypes, steps in all_steps:
        arguments = tuple(0x5000_0000_0000 + 0x100 * k for k in range(len(argument_dtypes)))
        expected_addresses = arguments + tuple(temporary_base + offset for offset in steps.workspace[0])
        # The grid-barrier word and the tickets (_workspace.GRID_BARRIER, TICKETS) are unsigned ints.
        dtypes = argument_dtypes + tuple(
            numpy.dtype(numpy.uint32) if temporary in (_workspace.GRID_BARRIER, _workspace.TICKETS)
            else numpy.dtype(temporary[1])
            for temporary in steps.temporaries)
        received.clear()
        programmatic.clear()
        _launch.run(steps, arguments)
        assert len(received) == len(steps.launches)
        # Each programmatic launch: its grid, block and shared memory, the stream, and the one attribute
        # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (6) = 1.
        assert programmatic == [
            (id(launch), launch.grid_on(0), launch.block, launch.shared_mem, stream.ptr, 1, 6, 1, None)
            for launch in steps.launches if launch.programmatic]
        for (kernel, params), launch, positions in zip(received, steps.launches, steps.positions):
            assert kernel == id(launch)
            parameters = signatures[launch.file, launch.expression]
            assert len(parameters) == len(positions) + len(launch.scalars), (launch, parameters)
            entries = (ctypes.c_void_p * len(parameters)).from_address(params)
            for index, parameter in enumerate(parameters):
                if index < len(positions):
                    assert parameter.endswith("*"), (launch, index, parameter)
                    # The array's element type is the pointee (a wrong position
                    # between arrays of different dtypes shows here).
                    pointee = _scalar_type(parameter.replace("const", "").rstrip("*").strip())
                    argument_dtype = dtypes[positions[index]]
                    if argument_dtype is not None and pointee in WORD_POINTEES:
                        assert WORD_POINTEES[pointee] == argument_dtype.itemsize, (launch, index, parameter)
                    elif argument_dtype is not None:
                        assert POINTEES[pointee] == argument_dtype, (launch, index, parameter, argument_dtype)
                    got = ctypes.c_uint64.from_address(entries[index]).value
                    assert got == expected_addresses[positions[index]], (launch, index, parameter)
                else:
                    scalar = launch.scalars[index - len(positions)]
                    code = SCALAR_CODES[_scalar_type(parameter)]
                    size = struct.calcsize(code)
                    assert scalar.dtype.itemsize == size and scalar.dtype.kind == ("f" if code in "fd" else "i"), (
                        launch, index, parameter, scalar.dtype)
                    assert entries[index] % size == 0, (launch, index, "misaligned scalar")
                    assert struct.unpack(code, ctypes.string_at(entries[index], size))[0] == scalar.item()
                checked += 1
    assert checked > 10000
    assert any(launch.cooperative for _, steps in all_steps for launch in steps.launches)  # fused and one-pass kernels
    assert any(launch.programmatic for _, steps in all_steps for launch in steps.launches)  # fused GroupNorm
    assert any(launch.file == _depthwise_nhwc_window.KERNEL_FILE for _, steps in all_steps for launch in steps.launches)
    # Stride-2 NHWC backward-input (the rule takes the phase kernel there).
    assert any(launch.file == _depthwise_nhwc_phase.KERNEL_FILE for _, steps in all_steps for launch in steps.launches)
    _launch._CAPACITY.clear()  # stand-in occupancies


def test_steps_rebind_on_a_new_device_stream_or_workspace_buffer(monkeypatch):
    """Steps.run keeps its driver calls and temporaries' addresses per device
    and stream: another stream gets its own workspace buffer, another device
    its own kernel, and a grown or released buffer (a new workspace
    generation) is read again, never its old addresses."""
    from cupy_dwgn import _workspace

    _launch._import_cuda()  # before the stand-ins replace what it sets
    received = []  # (kernel, stream, the slot values the launch reads)

    def launch_kernel(kernel, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        entries = (ctypes.c_void_p * 2).from_address(params)
        received.append((kernel, stream, tuple(ctypes.c_uint64.from_address(e).value for e in entries)))

    streams = {"now": types.SimpleNamespace(ptr=0)}
    monkeypatch.setattr(_launch, "_driver", types.SimpleNamespace(launchKernel=launch_kernel, ctxGetCurrent=lambda: 0xC0))
    monkeypatch.setattr(_launch, "_THREAD", _launch._ThreadContext())
    monkeypatch.setattr(_launch, "_cupy", types.SimpleNamespace(
        cuda=types.SimpleNamespace(get_current_stream=lambda: streams["now"])))
    monkeypatch.setattr(_launch.Launch, "kernel", lambda self, device: 1000 + device)
    next_buffer = iter(range(0x6000_0000_0000, 0x7000_0000_0000, 0x1000_0000))
    monkeypatch.setattr(_workspace, "_cupy", types.SimpleNamespace(
        empty=lambda size, dtype: _array((size,), numpy.uint8, next(next_buffer) - 0x7F00_0000_0000)))
    monkeypatch.setattr(_workspace, "_runtime", types.SimpleNamespace(  # no stream is capturing a graph
        streamIsCapturing=lambda stream: 0, streamCaptureStatusActive=1))
    monkeypatch.setattr(_workspace, "_BUFFERS", {})
    monkeypatch.setattr(_workspace, "_RETIRED", [])
    cleared = []  # buffers whose grid-barrier word was zeroed
    monkeypatch.setattr(_workspace, "_clear_grid_barrier", lambda buffer: cleared.append(buffer.data.ptr))

    small = _launch.Steps(((_launch.Launch("f.cu", "k", (1,), (32,)), (0, 1)),), (((256,), numpy.float32),))
    large = _launch.Steps(((_launch.Launch("f.cu", "k", (1,), (32,)), (0, 1)),), (((2**20,), numpy.float32),))

    def temporary_of(steps, device, stream):
        streams["now"] = types.SimpleNamespace(ptr=stream)
        received.clear()
        steps.run(device, (0xA000,))
        ((kernel, launched_on, (argument, temporary)),) = received
        assert (kernel, launched_on, argument) == (1000 + device, stream, 0xA000)
        return temporary

    def buffer(device, stream):
        """Where a buffer's first temporary starts: after its header (grid-barrier word, tickets)."""
        return _workspace._BUFFERS[device, stream].data.ptr + _workspace.HEADER

    lookups = []  # workspace lookups: one per (re)binding, none when a binding is reused
    addresses_on = _workspace.addresses_on
    monkeypatch.setattr(_workspace, "addresses_on", lambda *args: lookups.append(args) or addresses_on(*args))

    assert temporary_of(small, 0, 0) == buffer(0, 0)
    # That first call made the buffer (a new generation after its binding
    # read the generation), so the next call rebinds once; then it is reused.
    assert temporary_of(small, 0, 0) == buffer(0, 0) and len(lookups) == 2
    assert temporary_of(small, 0, 0) == buffer(0, 0) and len(lookups) == 2  # the binding reused
    assert temporary_of(small, 0, 7) == buffer(0, 7) != buffer(0, 0)
    assert temporary_of(small, 0, 0) == buffer(0, 0) and len(lookups) == 4  # stream 7's buffer: one rebind here
    assert temporary_of(small, 0, 0) == buffer(0, 0) and len(lookups) == 4  # stream 0's binding kept
    assert temporary_of(small, 1, 7) == buffer(1, 7) != buffer(0, 7)
    first = buffer(0, 0)
    assert temporary_of(large, 0, 0) == buffer(0, 0) != first  # grew the buffer of device 0, stream 0
    assert temporary_of(small, 0, 0) == buffer(0, 0)
    assert temporary_of(small, 0, 7) == buffer(0, 7)
    _workspace.release()
    assert temporary_of(small, 0, 7) == buffer(0, 7)
    assert temporary_of(small, 0, 0) == buffer(0, 0)
    # Every buffer made had its grid-barrier word zeroed, once.
    made = [b.data.ptr for b in _workspace._BUFFERS.values()]
    assert set(made) <= set(cleared) and len(cleared) == len(set(cleared)) == 6


def test_a_thread_with_no_current_context_gets_its_devices_primary_context(monkeypatch):
    # The driver's current context is per thread; a thread that never used
    # the CUDA runtime has none (PyTorch's autograd worker).  Steps.run makes
    # the device's primary context current (cudaSetDevice) once per thread,
    # before any driver call, and only where none is current.
    import threading

    contexts = threading.local()  # this fake driver's current context, per thread
    events = []

    def set_device(device):
        events.append(("setDevice", device))
        contexts.current = 0xC0 + device

    def launch_kernel(kernel, *dims_stream_params_extra):
        events.append(("launch", getattr(contexts, "current", 0)))

    monkeypatch.setattr(_launch, "_driver", types.SimpleNamespace(
        launchKernel=launch_kernel, ctxGetCurrent=lambda: getattr(contexts, "current", 0)))
    monkeypatch.setattr(_launch, "_runtime", types.SimpleNamespace(setDevice=set_device))
    monkeypatch.setattr(_launch, "_cupy", types.SimpleNamespace(
        cuda=types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(ptr=0))))
    monkeypatch.setattr(_launch, "_THREAD", _launch._ThreadContext())
    monkeypatch.setattr(_launch.Launch, "kernel", lambda self, device: 1000 + device)
    steps = _launch.Steps(((_launch.Launch("f.cu", "k", (1,), (32,)), (0,)),), ())

    def in_a_new_thread(function):
        thread = threading.Thread(target=function)
        thread.start()
        thread.join()

    in_a_new_thread(lambda: [steps.run(1, (0xA000,)) for _ in range(3)])
    assert events == [("setDevice", 1)] + [("launch", 0xC1)] * 3
    events.clear()

    def with_a_context_current():
        contexts.current = 0xE0  # e.g. the thread used the runtime before
        steps.run(0, (0xA000,))

    in_a_new_thread(with_a_context_current)
    assert events == [("launch", 0xE0)]


def test_workspace_layout_keeps_the_grid_barrier_word_apart():
    # The header's bytes (the first HEADER of a buffer, zeroed when it is
    # made) are never handed out as a temporary: a GRID_BARRIER request gets
    # offset 0, TICKETS ALIGNMENT (TICKET_COUNT words up to the header's
    # end), every other request starts after the header.
    from cupy_dwgn import _workspace

    f32, f64 = numpy.dtype(numpy.float32), numpy.dtype(numpy.float64)
    header, align = _workspace.HEADER, _workspace.ALIGNMENT
    offsets, total = _workspace.layout((((10,), f32), _workspace.GRID_BARRIER, ((3,), f64), _workspace.TICKETS))
    assert offsets == (header, 0, header + align, align) and total == header + 2 * align
    assert align + 4 * _workspace.TICKET_COUNT == header
    offsets, total = _workspace.layout((((1000,), f64),))
    assert offsets == (header,) and total == header + 8192


# Any valid call the ops accept must reach a launch that a GPU accepts: a
# shipped specialization (the set CI compiles), a grid and block within the
# hardware's limits, dynamic shared memory within sm_90's opt-in maximum.
# The ops' kernel choice runs for drawn geometries (any filter, stride,
# padding, dilation and multiplier, widths with and without vectors, rows of
# 1 to 300, tensors past 2**31 elements) in both layouts, every dtype and
# several alignments, with the device queries the plans make answered as an
# H200 would.  A plan that oversteps a limit would only show on a GPU, as a
# launch failure on the first call with that shape.
MAX_GRID_X, MAX_GRID_YZ, MAX_BLOCK_THREADS, MAX_BLOCK_Z = 2**31 - 1, 65535, 1024, 64


def _assert_launchable(launch):
    """Asserts that ``launch`` is a shipped kernel in a configuration a GPU takes."""
    assert (launch.file, launch.expression) in _SHIPPED, launch
    x, y, z = launch.grid
    assert 1 <= x <= MAX_GRID_X and 1 <= y <= MAX_GRID_YZ and 1 <= z <= MAX_GRID_YZ, launch
    threads = launch.block[0] * launch.block[1] * launch.block[2]
    assert min(launch.block) >= 1 and threads <= MAX_BLOCK_THREADS and launch.block[2] <= MAX_BLOCK_Z, launch
    assert 0 <= launch.shared_mem <= SM90_SHARED_OPT_IN, launch
    assert launch.cluster <= 16 and x % launch.cluster == 0, launch


_SHIPPED = set(_compile.specializations(large_index=(False, True)))
_EXTENTS = st.one_of(st.integers(1, 40), st.sampled_from([7, 14, 16, 28, 56, 75, 112, 150, 255, 300]))


@st.composite
def _convolutions(draw):
    """(x shape as NCHW, weight shape, stride, padding, dilation) of a call the ops accept."""
    kh = draw(st.one_of(st.sampled_from([1, 3, 5, 7]), st.integers(1, 31)))
    kw = draw(st.one_of(st.just(kh), st.integers(1, 31)))
    stride = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    dilation = draw(st.sampled_from([(1, 1), (1, 1), (2, 2), (1, 3)]))
    padding = draw(st.one_of(
        st.just((kh // 2 * dilation[0], kw // 2 * dilation[1])),
        st.tuples(st.tuples(st.integers(0, kh + 1), st.integers(0, kh + 1)),
                  st.tuples(st.integers(0, kw + 1), st.integers(0, kw + 1)))))
    batch = draw(st.one_of(st.integers(1, 4), st.sampled_from([16, 64, 70000])))
    channels = draw(st.one_of(st.integers(1, 40), st.sampled_from([96, 144, 384, 960, 1392, 2048])))
    multiplier = draw(st.sampled_from([1, 1, 1, 2, 3]))
    return ((batch, channels, draw(_EXTENTS), draw(_EXTENTS)), (channels * multiplier, 1, kh, kw), stride, padding,
            dilation)


@settings(max_examples=300, deadline=None)
@given(_convolutions(), st.sampled_from(DTYPES), st.sampled_from(["NCHW", "NHWC"]), st.sampled_from([0, 1, 2, 4]))
# The NHWC ring kernel's rows past its default shared memory, planned under the device's opt-in limit.
@example(((1, 32, 7, 300), (32, 1, 3, 3), (1, 1), (1, 1), (1, 1)), DTYPES[0], "NHWC", 0)
@example(((2, 2, 40, 37), (6, 1, 5, 5), (1, 1), (4, 4), (2, 2)), DTYPES[0], "NHWC", 0)
def test_any_valid_convolution_reaches_launchable_kernels(convolution, dtype, layout, misaligned_elements):
    x_shape, w_shape, stride, padding, dilation = convolution
    if layout == "NHWC":
        x_shape = (x_shape[0], x_shape[2], x_shape[3], x_shape[1])
    try:
        g = _validate.conv_geometry(x_shape, w_shape, stride, padding, dilation, layout=layout)
    except ValueError:  # an empty output, a filter larger than the padded input
        assume(False)
    x = _array((g.batch * g.channels * g.height * g.width,), dtype, misaligned_elements * dtype.itemsize)
    y = _array((g.batch * g.channels * g.multiplier * g.out_height * g.out_width,), dtype)
    with _h200_device_queries():
        launches = (depthwise._forward_steps(g, layout, x, y).launches
                    + depthwise._backward_input_steps(g, layout, y, x).launches
                    + depthwise._backward_weight_steps(g, layout, y, x).launches)
    for launch in launches:
        _assert_launchable(launch)


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.integers(1, 8), st.sampled_from([32, 70000])),
       st.one_of(st.integers(1, 300), st.sampled_from([64 * 64, 127 * 127, 512 * 512])),
       st.integers(1, 96), st.sampled_from([1, 2, 3, 4, 8, 16, 20, 32]), st.sampled_from(DTYPES),
       st.sampled_from(["identity", "silu", "gelu"]), st.booleans(), st.sampled_from(["auto", "split", "fused"]))
def test_any_valid_group_norm_reaches_launchable_kernels(batch, rows, group_size, groups, dtype, activation,
                                                         aligned, path):
    channels = group_size * groups
    w_dtype = numpy.dtype(_group_norm.weight_dtypes(dtype)[-1])
    with _h200_device_queries():
        forward = _group_norm._forward_plan(batch, rows, channels, groups, dtype, w_dtype, activation, 1e-5,
                                            aligned, path)
        backward = _group_norm._backward_plan(batch, rows, channels, groups, dtype, w_dtype, activation, aligned,
                                              path)
        launches = (list(_group_norm._forward_steps(forward, True, True).launches)
                    + list(_group_norm._backward_steps(backward).launches))
    for launch in launches:
        _assert_launchable(launch)


@contextlib.contextmanager
def _h200_device_queries():
    """_helpers.h200_device_facts for a block; the plans built meanwhile
    are dropped after.  (MonkeyPatch.context, not the fixture: hypothesis
    runs every drawn case inside one test call.)"""
    with pytest.MonkeyPatch.context() as patch:
        h200_device_facts(patch)
        try:
            yield
        finally:
            _depthwise_nchw_large._plan.cache_clear()
