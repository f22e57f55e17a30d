"""Which depthwise kernels give PyTorch's answer when a weight is inf or NaN and
taps fall in the padding (0 * inf is NaN in a zero-padded convolution; a kernel
that skips padded taps leaves those outputs finite).  Per case, layout, dtype,
direction and kernel (the rule's, then each kernel module forced "always", then
every module "never"): outputs whose finiteness differs from the float64
reference and from PyTorch (cuDNN) on the same inputs.  A probe, not a test."""
import sys

import cupy
import numpy

from cupy_dwgn import _dtypes, _validate, depthwise, reference
from cupy_dwgn import (_depthwise_conv_mma, _depthwise_nchw_forward_regs, _depthwise_nchw_rows,
                       _depthwise_nhwc_direct, _depthwise_nhwc_phase, _depthwise_nhwc_ring, _depthwise_nhwc_window)

MODULES = (_depthwise_conv_mma, _depthwise_nchw_forward_regs, _depthwise_nchw_rows, _depthwise_nhwc_direct,
           _depthwise_nhwc_phase, _depthwise_nhwc_ring, _depthwise_nhwc_window)
# (N, C, H, W, K, stride, padding, dilation)
CASES = [(2, 16, 14, 14, 3, 1, 1, 1), (2, 16, 28, 28, 3, 2, 1, 1), (2, 16, 14, 14, 5, 1, 2, 1),
         (2, 16, 14, 14, 7, 1, 3, 1), (2, 16, 7, 7, 3, 1, 1, 1), (2, 8, 20, 20, 13, 1, 6, 1),
         (2, 5, 11, 9, 3, 1, 2, 2), (2, 8, 17, 17, 3, 2, 1, 1)]


def torch_result(x, w, layout, direction, k, stride, padding, dilation, x_shape):
    try:
        import torch
    except ImportError:
        return None
    t = lambda a: torch.from_dlpack(a)
    if layout == "NHWC":
        to = lambda a: t(a).permute(0, 3, 1, 2)
    else:
        to = t
    wt = t(w)
    if direction == "forward":
        y = torch.nn.functional.conv2d(to(x), wt, stride=stride, padding=padding, dilation=dilation, groups=wt.shape[0])
    else:
        nchw = x_shape if layout == "NCHW" else (x_shape[0], x_shape[3], x_shape[1], x_shape[2])
        y = torch.ops.aten.convolution_backward(
            to(x), torch.empty(nchw, device="cuda", dtype=wt.dtype), wt, None, [stride] * 2, [padding] * 2,
            [dilation] * 2, False, [0, 0], wt.shape[0], [True, False, False])[0]
    y = y.permute(0, 2, 3, 1) if layout == "NHWC" else y
    return cupy.asarray(torch.isfinite(y).cpu().numpy())


def main():
    rng = numpy.random.default_rng(0)
    print("case layout dtype direction kernel | differ_from_reference differ_from_torch torch_vs_reference nonfinite_ref")
    for n, c, h, wd, k, stride, padding, dilation in CASES:
        for layout in ("NCHW", "NHWC"):
            for dtype in (numpy.float32, numpy.float16, _dtypes.bfloat16, numpy.float64):
                w = rng.standard_normal((c, 1, k, k)).astype(numpy.float32)
                w[0, 0, 0, 0] = numpy.inf            # a corner tap: in the padding for the top/left outputs
                w[1, 0, k - 1, k // 2] = numpy.nan   # the bottom middle tap
                w[2, 0, k // 2, k - 1] = -numpy.inf  # the right middle tap
                x_shape = (n, c, h, wd) if layout == "NCHW" else (n, h, wd, c)
                g = _validate.conv_geometry(x_shape, (c, 1, k, k), stride, padding, dilation, layout=layout)
                y_shape = (n, c, g.out_height, g.out_width) if layout == "NCHW" else (n, g.out_height, g.out_width, c)
                for direction in ("forward", "backward_input"):
                    src = rng.standard_normal(x_shape if direction == "forward" else y_shape).astype(numpy.float32)
                    src_d = cupy.asarray(src).astype(dtype)
                    w_d = cupy.asarray(w).astype(dtype)
                    conv = dict(stride=stride, padding=padding, dilation=dilation, layout=layout)
                    src64, w64 = src_d.astype(numpy.float64).get(), w_d.astype(numpy.float64).get()
                    if direction == "forward":
                        ref = numpy.isfinite(reference.depthwise_conv2d(src64, w64, None, **conv))
                    else:
                        ref = numpy.isfinite(reference.depthwise_conv2d_backward_input(src64, w64, x_shape, **conv))
                    ref = cupy.asarray(ref)
                    theirs = torch_result(src_d, w_d, layout, direction, k, stride, padding, dilation, x_shape)
                    seen = set()
                    variants = [("rule", {})] + [
                        (m.__name__, {o: "always" if o is m else "never" for o in MODULES}) for m in MODULES] + [
                        ("none", {m: "never" for m in MODULES})]
                    for label, modes in variants:
                        saved = {m: m.MODE for m in modes}
                        for m, v in modes.items():
                            m.MODE = v
                        depthwise._SIGNATURES = {}
                        try:
                            out = cupy.full(ref.shape, numpy.nan, dtype=dtype)
                            build = depthwise._forward_steps if direction == "forward" else depthwise._backward_input_steps
                            steps = build(g, layout, src_d, out)
                            name = "+".join(l.expression.split("<")[0].replace("dwgn_dwconv_", "") for l in steps.launches)
                            if name in seen:
                                continue
                            seen.add(name)
                            if direction == "forward":
                                depthwise.depthwise_conv2d(src_d, w_d, out=out, **conv)
                            else:
                                depthwise.depthwise_conv2d_backward_input(src_d, w_d, x_shape, out=out, **conv)
                            ours = cupy.isfinite(out)
                            d_ref = int((ours != ref).sum())
                            d_torch = -1 if theirs is None else int((ours != theirs).sum())
                            t_ref = -1 if theirs is None else int((theirs != ref).sum())
                            print(f"{n}x{c}x{h}x{wd} k{k} s{stride} p{padding} d{dilation} {layout} {numpy.dtype(dtype).name} "
                                  f"{direction} {name} | {d_ref} {d_torch} {t_ref} {int((~ref).sum())}", flush=True)
                        except Exception as e:  # noqa: BLE001 (a probe: report and go on)
                            print(f"{label}: {type(e).__name__}: {e}", file=sys.stderr)
                        finally:
                            for m, v in saved.items():
                                m.MODE = v
                            depthwise._SIGNATURES = {}


if __name__ == "__main__":
    main()
