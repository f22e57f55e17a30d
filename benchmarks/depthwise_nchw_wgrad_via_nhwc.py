"""NCHW weight gradient two ways, for the shapes where the NCHW kernels are
slowest (odd widths: the register kernel falls to 1-column vectors): ours on
the NCHW tensors, against NHWC copies (cupy.ascontiguousarray of the
transposes) + our NHWC kernel; also the NHWC kernel alone and the copies
alone (GPU time, harness.time_us), and the largest difference between the
two results relative to the largest value.  A probe for routing NCHW weight
gradients through the NHWC kernel (needs a faster transpose than CuPy's).

    PYTHONPATH=.:benchmarks python3 benchmarks/depthwise_nchw_wgrad_via_nhwc.py
"""
import cupy, numpy
from harness import time_us
import cupy_dwgn as dw
from cupy_dwgn import _dtypes

for n, c, h, k, s, dt in [(64, 576, 19, 3, 1, "float16"), (64, 576, 19, 5, 1, "float16"), (64, 192, 75, 3, 1, "float16"),
                          (64, 40, 150, 3, 1, "float16"), (64, 576, 19, 3, 1, "float32"), (64, 144, 150, 3, 2, "float16"),
                          (64, 384, 14, 7, 1, "float16"), (64, 1392, 10, 5, 1, "float16")]:
    dtype = _dtypes.bfloat16 if dt == "bfloat16" else numpy.dtype(dt)
    x = cupy.random.standard_normal((n, c, h, h), dtype=cupy.float32).astype(dtype)
    oh = (h + 2 * (k // 2) - k) // s + 1
    g = cupy.random.standard_normal((n, c, oh, oh), dtype=cupy.float32).astype(dtype)
    kw = dict(stride=s, padding=k // 2)
    direct = lambda: dw.depthwise_conv2d_backward_weight(g, x, (c, 1, k, k), **kw)
    def via_nhwc():
        xt = cupy.ascontiguousarray(x.transpose(0, 2, 3, 1))
        gt = cupy.ascontiguousarray(g.transpose(0, 2, 3, 1))
        return dw.depthwise_conv2d_backward_weight(gt, xt, (c, 1, k, k), layout="NHWC", **kw)
    xt = cupy.ascontiguousarray(x.transpose(0, 2, 3, 1)); gt = cupy.ascontiguousarray(g.transpose(0, 2, 3, 1))
    nhwc_only = lambda: dw.depthwise_conv2d_backward_weight(gt, xt, (c, 1, k, k), layout="NHWC", **kw)
    transposes = lambda: (cupy.ascontiguousarray(x.transpose(0, 2, 3, 1)), cupy.ascontiguousarray(g.transpose(0, 2, 3, 1)))
    a, b = direct(), via_nhwc()
    err = float(cupy.abs(a.astype(cupy.float32) - b.astype(cupy.float32)).max() / cupy.abs(a.astype(cupy.float32)).max())
    print(f"{n}x{c}x{h} {k}x{k} s{s} {dt}: direct {time_us(direct):7.1f}  via NHWC {time_us(via_nhwc):7.1f}  "
          f"(NHWC kernel {time_us(nhwc_only):6.1f}, cupy transposes {time_us(transposes):6.1f})  rel diff {err:.1e}", flush=True)
