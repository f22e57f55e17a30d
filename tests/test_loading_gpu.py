"""Kernel loading on a GPU: compile errors, per-device modules, the input's device."""

import numpy
import pytest

from cupy_dwgn import _compile, reference
from cupy_dwgn.errors import KernelCompileError

from _helpers import random, relative_error

cupy = pytest.importorskip("cupy")
import cupy_dwgn  # noqa: E402

pytestmark = pytest.mark.gpu


def test_runtime_compile_error_is_a_package_error(broken_kernel):
    with pytest.raises(KernelCompileError) as info:
        _compile.get_kernel(broken_kernel, "k<float>")
    assert info.value.name_expression == "k<float>"
    assert "undefined_name" in info.value.log
    assert cupy.__version__ in str(info.value)


def test_ops_run_on_the_device_of_their_inputs(rng):
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs 2 GPUs")
    x_host = random(rng, (2, 4, 12, 12), numpy.float32)
    w_host = random(rng, (4, 1, 3, 3), numpy.float32)
    h_host = random(rng, (2, 5, 5, 8), numpy.float16, offset=3.0)
    with cupy.cuda.Device(1):
        x, w, h = cupy.asarray(x_host), cupy.asarray(w_host), cupy.asarray(h_host)
    with cupy.cuda.Device(0):  # current device 0, data on device 1
        y = cupy_dwgn.depthwise_conv2d(x, w, padding=1)
        g = cupy_dwgn.group_norm(h, 2, activation="silu")
    assert y.device.id == 1 and g.device.id == 1
    assert relative_error(y, reference.depthwise_conv2d(x_host, w_host, padding=1)) <= 1e-5
    assert relative_error(g, reference.group_norm(h_host, 2, activation="silu")) <= 2e-3
