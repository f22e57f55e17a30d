"""Arrays and streams from other libraries: DLPack in, the caller's type out.

Every public GPU op runs its cupy.ndarray fast path directly; any other
argument comes here.  A GPU array with ``__dlpack__`` (a torch tensor, a JAX
array, ...) is viewed as a cupy.ndarray without a copy by
``cupy.from_dlpack``, which orders the current stream after the producer's
(the DLPack protocol's ``stream`` argument); the results go back through the
caller's own ``from_dlpack`` (torch, or the array API namespace of the
array, e.g. jax.numpy), which orders the consumer's stream after ours.  An
``out=`` argument given as a foreign array is written in place and returned
as the very object the caller passed.
"""

import contextlib
import warnings

#: DLPack device types whose memory a CUDA kernel can address.
_CUDA_DEVICE_TYPES = (2, 13)  # kDLCUDA, kDLCUDAManaged

_STREAMS = {}  # (device, stream address) -> cupy stream object

#: Returned by an op's signature-cache path when the call needs the full checks.
MISS = object()

try:
    import cupy as _cupy
    from cupy_backends.cuda.api import runtime as _runtime

    _CUPY_STREAMS = (_cupy.cuda.Stream, _cupy.cuda.ExternalStream)
    _ndarray = _cupy.ndarray
except ImportError:
    _CUPY_STREAMS = ()
    _ndarray = _runtime = None

# ---------------------------------------------------------------------------
# The ops' call-signature caches: a signature (op, each array's shape, dtype,
# contiguity and device, the other arguments) that passed the full checks
# once maps to what the checks computed, so a repeated call skips them.

#: A key part that never matches: a foreign array always takes the checked path.
UNCACHED = object()
MAX_SIGNATURES = 4096

if _ndarray is not None and hasattr(_ndarray, "_c_contiguous"):

    def signature(array):
        """What the checks of one array argument depend on (None for None)."""
        if array is None:
            return None
        if type(array) is not _ndarray:
            return UNCACHED
        # _c_contiguous: the flag CuPy keeps (a.flags builds an object per call).
        return array.shape, array.dtype, array._c_contiguous, array.data.device_id

else:

    def signature(array):
        """What the checks of one array argument depend on (None for None)."""
        if array is None:
            return None
        if type(array) is not _ndarray:
            return UNCACHED
        return array.shape, array.dtype, array.flags.c_contiguous, array.data.device_id


def remember(cache, key, value):
    """cache[key] = value, bounded; an unhashable key (a list argument) is not kept."""
    try:
        if len(cache) >= MAX_SIGNATURES:
            cache.clear()
        cache[key] = value
    except TypeError:
        pass

def outputs_separate_memo(memo, addresses, outputs, inputs, in_place_ok=None):
    """:func:`outputs_separate`, remembered for the last ``addresses`` it
    passed (the call's: every input's and given output's, in a fixed order,
    NULL for None; the caller reads them once for this and its launch):
    ``memo`` is a one-item list kept with one call signature, whose sizes
    are fixed, so the same addresses give the same answer (a loop that
    reuses its output buffers checks them once)."""
    if memo[0] == addresses:
        return True
    if not outputs_separate(outputs, inputs, in_place_ok):
        return False
    memo[0] = addresses
    return True


def outputs_separate(outputs, inputs, in_place_ok=None):
    """No given output overlaps an input or another output (the first output
    may be exactly ``in_place_ok``); False sends the call to the checked
    path, which raises the error."""
    given = [a for a in outputs if a is not None]
    if not given:
        return True
    spans = [(a.data.ptr, a.data.ptr + a.nbytes) for a in given]
    for a in inputs:
        if a is not None and a.nbytes:
            start, end = a.data.ptr, a.data.ptr + a.nbytes
            for index, (o_start, o_end) in enumerate(spans):
                if o_start < end and start < o_end and not (
                    index == 0 and outputs[0] is not None and a is in_place_ok and (start, end) == (o_start, o_end)
                ):
                    return False
    for i in range(len(spans)):
        for j in range(i):
            if spans[i][0] < spans[j][1] and spans[j][0] < spans[i][1]:
                return False
    return True


def on_device(array, function, *args):
    """``function(device, *args)`` with array's device current (entered only
    when it is not); ``device``: its id, for the launch."""
    device = array.data.device_id
    if device == _runtime.getDevice():
        return function(device, *args)
    with array.device:
        return function(device, *args)


def on_stream(stream, function, *args):
    """``function(*args)`` (an op's signature-cache path) with ``stream``
    current when it is a CuPy stream object; MISS for any other stream
    (converted by the checked path)."""
    if stream is None:
        return function(*args)
    if type(stream) in _CUPY_STREAMS:
        with stream:
            return function(*args)
    return MISS


def as_stream(stream):
    """A CuPy stream object for ``stream``: a cupy.cuda.Stream (or
    ExternalStream), an object with ``__cuda_stream__`` (CUDA stream
    protocol, e.g. torch.cuda.Stream in recent PyTorch), an object with a
    ``cuda_stream`` address (torch.cuda.Stream), or a raw address (int)."""
    import cupy

    if isinstance(stream, (cupy.cuda.Stream, cupy.cuda.ExternalStream)):
        return stream
    device = cupy.cuda.runtime.getDevice()
    if hasattr(stream, "__cuda_stream__"):
        address = stream.__cuda_stream__()[1]
    elif isinstance(getattr(stream, "cuda_stream", None), int):
        address = stream.cuda_stream
        device = getattr(getattr(stream, "device", None), "index", None) or device
    elif type(stream) is int:
        address = stream
    else:
        raise TypeError(
            "stream: expected a cupy.cuda.Stream, an object with __cuda_stream__ or a "
            f"cuda_stream address (torch.cuda.Stream), or an int address, got {type(stream).__name__}"
        )
    key = (device, address)
    cached = _STREAMS.get(key)
    if cached is None:
        cached = _STREAMS[key] = external_stream(cupy, address, device)
    return cached


def external_stream(cupy, address, device):
    """A CuPy stream object for the raw stream handle ``address`` of ``device``
    (``cupy``: the module, passed so the torch bridge's tests can stand in).

    cupy.cuda.ExternalStream is deprecated in CuPy 14 for
    Stream.from_external, which takes an object with __cuda_stream__ but
    leaves the device unknown (-1); we hold a raw handle and know its device,
    which lets CuPy check that the stream is used there, so ExternalStream is
    kept while it exists, without its warning reaching the user."""
    external = getattr(cupy.cuda, "ExternalStream", None)
    if external is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return external(address, device)

    class _Handle:  # pragma: no cover - a CuPy without ExternalStream
        def __cuda_stream__(self):
            return (0, address)

    return cupy.cuda.Stream.from_external(_Handle())  # pragma: no cover


def _foreign_gpu_array(value):
    """value is not a cupy array but a GPU array with __dlpack__."""
    if not hasattr(value, "__dlpack__") or not hasattr(value, "__dlpack_device__"):
        return False
    try:
        return value.__dlpack_device__()[0] in _CUDA_DEVICE_TYPES
    except Exception:  # a producer that cannot say: leave it to the type check
        return False


def call(function, arrays, stream, *args):
    """``function(*cupy_arrays, *args)`` on ``stream`` (None: the current
    CuPy stream), with foreign GPU arrays in ``arrays`` viewed as cupy arrays
    and the results returned as the type of the first foreign array."""
    import cupy

    context = contextlib.nullcontext() if stream is None else as_stream(stream)
    with context:
        like = None
        converted = []
        for value in arrays:
            if value is not None and type(value) is not cupy.ndarray and _foreign_gpu_array(value):
                like = value if like is None else like
                value = cupy.from_dlpack(value)
            converted.append(value)
        result = function(*converted, *args)
        if like is None:
            return result
        back = _converter(like)
        originals = {id(c): a for a, c in zip(arrays, converted) if c is not a}
        return _map(result, lambda r: originals[id(r)] if id(r) in originals else back(r))


def _map(result, convert):
    if isinstance(result, tuple):
        return tuple(None if r is None else convert(r) for r in result)
    return convert(result)


def _converter(like):
    """cupy array -> an array of ``like``'s library, zero-copy."""
    if type(like).__module__.split(".")[0] == "torch":
        import torch

        return torch.from_dlpack
    namespace = getattr(like, "__array_namespace__", None)
    if namespace is not None:
        return namespace().from_dlpack
    return lambda array: array
