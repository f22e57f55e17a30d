"""GPU check of the NCHW window kernel and the direct backward-input kernel
against the float64 reference (outputs NaN-poisoned), then CUDA-event timing
of the issue-7 NCHW cases beside PyTorch.  Development aid for one device run."""
import sys
import numpy
import cupy

sys.path.insert(0, "tests")
from _helpers import DTYPES, TOLERANCE, poisoned, random, relative_error  # noqa: E402
from cupy_dwgn import _depthwise_nchw, _depthwise_nchw_window, _validate, reference  # noqa: E402

rng = numpy.random.default_rng(0)
cases = [
    ((2, 8, 16, 16), 3, 1, 1), ((2, 6, 17, 15), 5, 2, 2), ((1, 5, 13, 11), 7, 1, 3),
    ((2, 3, 6, 7), 3, 1, 4), ((3, 5, 1, 31), 3, 1, 1), ((1, 3, 37, 1), 3, 1, 1),
    ((2, 5, 70, 45), 3, 1, 1), ((1, 3, 33, 34), 7, 1, ((6, 0), (1, 5))), ((2, 2, 9, 40), 3, 1, 5),
    ((1, 7, 300, 300), 3, 1, 1), ((1, 2, 40, 1100), 3, 1, 1), ((1, 3, 130, 129), 7, 2, 3),
    ((2, 30, 7, 7), 3, 1, 1), ((1, 70000, 3, 3), 3, 1, 1), ((2, 4, 23, 24), 5, 2, ((0, 3), (4, 1))),
    ((2, 3, 12, 12), 3, 1, 1, 2), ((2, 2, 15, 14), 7, 2, 3, 3), ((2, 2, 40, 37), 5, 1, 4, 3),
    ((1, 3, 9, 10), 3, 2, 0), ((1, 4, 3, 3), 3, 1, 0), ((4, 16, 112, 112), 3, 2, 1),
]
fail = 0
worst = {}
for dtype in DTYPES:
    for case in cases:
        shape, k, s, p = case[:4]
        m = case[4] if len(case) > 4 else 1
        n, c, h, w = shape
        x = random(rng, shape, dtype)
        wt = random(rng, (c * m, 1, k, k), dtype)
        b = random(rng, (c * m,), dtype)
        g = _validate.conv_geometry(shape, wt.shape, s, p, 1)
        xg, wg, bg = cupy.asarray(x), cupy.asarray(wt), cupy.asarray(b)
        y = poisoned((n, c * m, g.out_height, g.out_width), dtype)
        served = _depthwise_nchw_window.forward(xg, wg, bg, y, g)
        ref = reference.depthwise_conv2d(x, wt, b, stride=s, padding=p)
        errs = {}
        if served:
            errs["fwd"] = relative_error(y, ref)
        dy = random(rng, ref.shape, dtype)
        dx = poisoned(shape, dtype)
        dxref = reference.depthwise_conv2d_backward_input(dy, wt, shape, stride=s, padding=p)
        if _depthwise_nchw_window.backward_input(cupy.asarray(dy), wg, dx, g):
            errs["bwd_in_window"] = relative_error(dx, dxref)
        dx2 = poisoned(shape, dtype)
        _depthwise_nchw.backward_input(cupy.asarray(dy), wg, dx2, g)
        errs["bwd_in_general"] = relative_error(dx2, dxref)
        for key, e in errs.items():
            worst[(str(dtype), key)] = max(worst.get((str(dtype), key), 0), e)
            if not e <= TOLERANCE[dtype]:
                fail += 1
                print("FAIL", dtype, case, key, e)
for key, e in sorted(worst.items()):
    print("worst", key, f"{e:.2e}")
print("failures:", fail)

try:
    import torch
except ImportError:
    torch = None
from harness import time_us  # noqa: E402

torch.backends.cudnn.benchmark = True
bench = [(64, 144, 56, 3, 1), (64, 96, 112, 3, 2), (64, 384, 28, 3, 1), (64, 960, 7, 3, 1),
         (64, 240, 28, 5, 1), (64, 96, 56, 7, 1), (64, 384, 14, 7, 1)]
bw = None
from harness import copy_bandwidth_bytes_per_us  # noqa: E402
bw = copy_bandwidth_bytes_per_us()
print(f"copy {bw/1e6:.2f} TB/s")
for dtype in (numpy.float32, numpy.float16):
    for n, c, h, k, s in bench:
        p = k // 2
        x = cupy.random.standard_normal((n, c, h, h), dtype=cupy.float32).astype(dtype)
        wt = cupy.random.standard_normal((c, 1, k, k), dtype=cupy.float32).astype(dtype)
        g = _validate.conv_geometry(x.shape, wt.shape, s, p, 1)
        y = cupy.empty((n, c, g.out_height, g.out_width), dtype)
        dx = cupy.empty_like(x)
        launch = _depthwise_nchw_window.plan(g, numpy.dtype(dtype), False, "int", True, True)
        t_fwd = time_us(lambda: _depthwise_nchw_window.forward(x, wt, None, y, g))
        t_bwd = time_us(lambda: _depthwise_nchw_window.backward_input(y, wt, dx, g)) if s == 1 else time_us(lambda: _depthwise_nchw.backward_input(y, wt, dx, g))
        tx = torch.as_tensor(x, device="cuda"); tw = torch.as_tensor(wt, device="cuda")
        tcl = tx.contiguous(memory_format=torch.channels_last)
        tf = min(time_us(lambda: torch.nn.functional.conv2d(tx, tw, None, s, p, 1, c)),
                 time_us(lambda: torch.nn.functional.conv2d(tcl, tw, None, s, p, 1, c)))
        ty = torch.as_tensor(y, device="cuda")
        tycl = ty.contiguous(memory_format=torch.channels_last)
        tb = min(time_us(lambda: torch.ops.aten.convolution_backward(ty, tx, tw, None, [s, s], [p, p], [1, 1], False, [0, 0], c, [True, False, False])),
                 time_us(lambda: torch.ops.aten.convolution_backward(tycl, tcl, tw, None, [s, s], [p, p], [1, 1], False, [0, 0], c, [True, False, False])))
        floor = (x.nbytes + y.nbytes) / bw
        print(f"{n}x{c}x{h} {k}x{k} s{s} {numpy.dtype(dtype).name}: fwd {t_fwd:.1f} (torch {tf:.1f}, {floor/t_fwd:.0%} bw) "
              f"bwd_in {t_bwd:.1f} (torch {tb:.1f}, {floor/t_bwd:.0%})  {launch}")
sys.exit(1 if fail else 0)
