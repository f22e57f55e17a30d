"""Reusable device temporaries (weight-gradient partial sums, GroupNorm
statistics), one growing buffer per (device, stream).

A call takes its temporaries from the buffer of the current device and
stream instead of allocating: with every output given (``out=``...), a call
allocates nothing once a first call has sized the buffer, so it can be
captured in a CUDA graph.  Work on one stream runs in order, so successive
calls on that stream may share the bytes; calls on other streams get their
own buffer.  A stream's first buffer may be made while it records a CUDA graph
(torch.cuda.graph captures on a stream of its own): it is then allocated and
zeroed outside the graph.

A buffer that is outgrown stays allocated (kept in ``_RETIRED``): a CUDA
graph captured earlier may still point into it.  With sizes doubling, the
retired buffers hold less than the live one.  :func:`release` frees them all
(call it only when no captured graph is replayed any more).
"""

import functools

import numpy

from . import _launch

try:
    import cupy as _cupy
    from cupy_backends.cuda.api import runtime as _runtime
except ImportError:  # the references import nothing from here, but stay importable
    _cupy = _runtime = None

#: Every temporary starts on this boundary (cudaMalloc's own alignment).
ALIGNMENT = 256

#: Every buffer starts with HEADER bytes, zeroed when it is made and never
#: handed out as a temporary: the grid-barrier word at offset 0, the tickets
#: from offset ALIGNMENT.  Calls on one stream run in order, so one header
#: per stream serves every launch on it.
HEADER = 4096

#: A request for the buffer's grid-barrier word (dwgn::grid_barrier in
#: kernels/dwgn_common.cuh; every barrier flips its top bit and leaves the
#: rest zero).
GRID_BARRIER = "grid barrier"

#: A request for the buffer's TICKETS ticket words (unsigned int, each back
#: at 0 when a launch that uses it ends: the cluster backward's atomicInc
#: modulo its sample count, kernels/group_norm.cu).
TICKETS = "tickets"
TICKET_COUNT = (HEADER - ALIGNMENT) // 4

_BUFFERS = {}  # (device id, stream address) -> cupy uint8 array
_SIDE_STREAMS = {}  # device id -> the stream zeroing buffers made during a capture (_new_while_capturing)
_RETIRED = []

#: Counts the buffer replacements (a grown or released buffer): addresses
#: taken at an older generation may point into a retired or freed buffer
#: (_launch.Steps keeps its temporaries' addresses while it is unchanged).
#: Bumped after the new buffer is in place, so one read before the buffer is
#: never newer than the buffer read.
generation = 0


def addresses(*requests):
    """Device addresses of one temporary per ``(shape, dtype)`` request,
    carved from the current device and stream's buffer (grown if needed).
    The bytes are uninitialized and stay valid until the next call on the
    same stream takes temporaries."""
    return addresses_on(_runtime.getDevice(), _cupy.cuda.get_current_stream().ptr, layout(requests))


def addresses_on(device, stream, workspace_layout):
    """:func:`addresses` for a :func:`layout` of requests on a known device
    and stream (address), which must be the current ones."""
    offsets, total = workspace_layout
    key = (device, stream)
    buffer = _BUFFERS.get(key)
    if buffer is None or buffer.nbytes < total:
        buffer = _grow(key, buffer, total)
    start = buffer.data.ptr
    return [start + offset for offset in offsets]


@functools.lru_cache(maxsize=1024)
def layout(requests):
    """(offset of each request, total bytes), each start ALIGNMENT-aligned,
    after the HEADER bytes (GRID_BARRIER requests get offset 0, TICKETS
    ALIGNMENT)."""
    offsets, total = [], HEADER
    for request in requests:
        if request in (GRID_BARRIER, TICKETS):
            offsets.append(0 if request == GRID_BARRIER else ALIGNMENT)
            continue
        shape, dtype = request
        offsets.append(total)
        count = 1
        for extent in shape:
            count *= extent
        total += -(-count * numpy.dtype(dtype).itemsize // ALIGNMENT) * ALIGNMENT
    return tuple(offsets), total


def _grow(key, buffer, total):
    if buffer is not None:
        _RETIRED.append(buffer)
    size = max(total, 2 * buffer.nbytes if buffer is not None else 0, 64 * 1024)
    if _runtime.streamIsCapturing(key[1]) == _runtime.streamCaptureStatusActive:
        buffer = _new_while_capturing(size)
    else:
        buffer = _cupy.empty(size, dtype=numpy.uint8)
        _clear_grid_barrier(buffer)
    _BUFFERS[key] = buffer
    global generation
    generation += 1
    return buffer


def _new_while_capturing(size):
    """A buffer for a stream that is recording a CUDA graph (a call's first on
    that stream, e.g. under torch.cuda.graph, whose capture stream no eager
    call has used): allocated and its header zeroed now, outside the graph --
    an allocation in the graph would be refused (cudaMalloc during a global
    capture), and a zeroing recorded in it would leave the header unset for
    eager calls on the stream until a replay -- with this thread's capture
    mode relaxed and the zeroing on a stream of its own, waited for."""
    with _launch.relaxed_capture():
        buffer = _cupy.empty(size, dtype=numpy.uint8)
        device = buffer.data.device_id
        side = _SIDE_STREAMS.get(device)
        if side is None:  # kept: a stream destroyed by the collector during a later capture would break it
            side = _SIDE_STREAMS[device] = _cupy.cuda.Stream(non_blocking=True)
        with side:
            _clear_grid_barrier(buffer)
        side.synchronize()
    return buffer


def _clear_grid_barrier(buffer):
    """Zero a new buffer's HEADER (grid-barrier word and tickets), on its
    stream (the current one)."""
    buffer[:HEADER].fill(0)


def release():
    """Free every workspace buffer (the next call allocates afresh)."""
    _BUFFERS.clear()
    _RETIRED.clear()
    global generation
    generation += 1
