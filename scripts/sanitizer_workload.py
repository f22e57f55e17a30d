"""A small run of every kernel family on awkward shapes, for compute-sanitizer
(memcheck: out-of-bounds and misaligned accesses; racecheck: shared memory)."""

import cupy

import cupy_dwgn

rng = cupy.random.default_rng(0)


def _nhwc(a):
    return cupy.ascontiguousarray(a.transpose(0, 2, 3, 1))


def depthwise():
    # Shapes chosen to reach every kernel family: register window (3x3/5x5/7x7,
    # stride 1 and 2, asymmetric and oversized padding, small planes packed per
    # block), large filter (>= 9x9), direct / tiled fallbacks (dilation,
    # non-square), both weight-gradient paths, and NHWC with vector and scalar
    # channel access (C multiple of 8, odd C, multiplier 2, misaligned view).
    for dtype in (cupy.float32, cupy.float16):
        for x_shape, w_shape, conv in [
            ((2, 3, 13, 11), (6, 1, 3, 3), dict(padding=1)),
            ((1, 2, 9, 17), (2, 1, 5, 3), dict(stride=(2, 1), padding=((2, 3), (0, 1)), dilation=(1, 2))),
            ((2, 2, 15, 15), (2, 1, 7, 7), dict(padding=3)),
            ((1, 2, 20, 20), (2, 1, 11, 9), dict(padding="same")),
            ((2, 16, 17, 24), (16, 1, 3, 3), dict(stride=2, padding=1)),
            # the stride-2 phase backward-input: another padding parity, 5x5, M = 2, odd width
            ((2, 5, 14, 13), (10, 1, 5, 5), dict(stride=2, padding=(2, 1))),
            ((1, 8, 12, 16), (8, 1, 5, 5), dict(padding=((4, 0), (1, 6)))),
            ((4, 24, 7, 7), (24, 1, 3, 3), dict(padding=1)),
            ((2, 8, 16, 16), (8, 1, 13, 13), dict(padding=6)),
            ((1, 4, 9, 9), (4, 1, 31, 31), dict(padding=15)),
            # the whole-plane kernel with cp.async staging (units 16-byte aligned)
            ((8, 64, 14, 14), (64, 1, 3, 3), dict(padding=1)),
            ((4, 96, 28, 28), (96, 1, 5, 5), dict(padding=((1, 3), (2, 0)))),
            # NCHW weight gradient with blocks of two stages, the second short
            ((11, 1056, 9, 9), (1056, 1, 7, 7), dict(padding=3)),
        ]:
            x = rng.standard_normal(x_shape, dtype=cupy.float32).astype(dtype)
            w = rng.standard_normal(w_shape, dtype=cupy.float32).astype(dtype)
            for layout, xl in (("NCHW", x), ("NHWC", _nhwc(x))):
                y = cupy_dwgn.depthwise_conv2d(xl, w, layout=layout, **conv)
                cupy_dwgn.depthwise_conv2d_backward_input(y, w, xl.shape, layout=layout, **conv)
                cupy_dwgn.depthwise_conv2d_backward_weight(y, xl, w.shape, layout=layout, **conv)
            # misaligned views (data pointer not 16-byte aligned): NHWC, and
            # NCHW (the plane kernel's element path)
            cupy_dwgn.depthwise_conv2d(_misaligned(_nhwc(x)), w, layout="NHWC", **conv)
            y = cupy_dwgn.depthwise_conv2d(x, w, **conv)
            cupy_dwgn.depthwise_conv2d(_misaligned(x), w, **conv)
            cupy_dwgn.depthwise_conv2d_backward_input(_misaligned(y), w, x.shape, **conv)
    # float64 NCHW weight gradient: double-buffered cp.async staging, blocks of
    # 2-3 stages (the last one short), stride 1 and 2
    for x_shape, k, stride in (((11, 1056, 9, 9), 7, 1), ((5, 1056, 40, 40), 5, 2)):
        x = rng.standard_normal(x_shape, dtype=cupy.float64)
        y = cupy_dwgn.depthwise_conv2d(x, rng.standard_normal((x_shape[1], 1, k, k)), stride=stride, padding=k // 2)
        cupy_dwgn.depthwise_conv2d_backward_weight(y, x, (x_shape[1], 1, k, k), stride=stride, padding=k // 2)


def nhwc_window():
    # The NHWC register-window kernel for every stride-1 3x3/5x5/7x7 NHWC call
    # (MODE "always", the call-signature cache cleared; float32 3x3 included,
    # which the rule leaves to the tiled kernels): odd sizes, per-side and
    # oversized padding (negative backward offsets), several channel tiles
    # and spatial tiles, a 4-byte offset destination, and channel-tile groups
    # of 1, 2 and 4 (launched directly).
    from cupy_dwgn import _depthwise_nhwc_direct, _depthwise_nhwc_ring, _depthwise_nhwc_window, _validate, depthwise as dw

    # The ring and direct kernels, ahead of the window kernel in the dispatch, are off.
    _depthwise_nhwc_window.MODE, _depthwise_nhwc_direct.MODE, dw._SIGNATURES = "always", "never", {}
    _depthwise_nhwc_ring.MODE = "never"
    try:
        for dtype in (cupy.float32, cupy.float16):
            for x_shape, k, padding in [
                ((2, 13, 11, 32), 3, 1), ((1, 9, 10, 16), 5, ((0, 4), (3, 1))), ((2, 7, 7, 16), 7, 3),
                ((1, 5, 9, 16), 7, 8), ((3, 40, 30, 48), 3, 1), ((2, 70, 40, 32), 5, ((2, 1), (0, 3))),
            ]:
                x = rng.standard_normal(x_shape, dtype=cupy.float32).astype(dtype)
                w = rng.standard_normal((x_shape[3], 1, k, k), dtype=cupy.float32).astype(dtype)
                b = rng.standard_normal((x_shape[3],), dtype=cupy.float32).astype(dtype)
                y = cupy_dwgn.depthwise_conv2d(x, w, b, padding=padding, layout="NHWC")
                cupy_dwgn.depthwise_conv2d_backward_input(y, w, x.shape, padding=padding, layout="NHWC")
                offset = cupy.empty(y.size + 4 // y.itemsize, dtype)[4 // y.itemsize:].reshape(y.shape)
                cupy_dwgn.depthwise_conv2d(x, w, b, padding=padding, layout="NHWC", out=offset)
                g = _validate.conv_geometry(x.shape, w.shape, 1, padding, 1, layout="NHWC")
                for group in (2, 4):
                    _depthwise_nhwc_window.plan(g, x.dtype, False, "int", 16, 16, group)(x, w, b, y)
    finally:
        _depthwise_nhwc_window.MODE, _depthwise_nhwc_direct.MODE, dw._SIGNATURES = "rule", "rule", {}
        _depthwise_nhwc_ring.MODE = "rule"


def nhwc_wgrad():
    # The NHWC register-tap weight gradient for every 3x3/5x5/7x7 NHWC call at
    # stride 1 and 2 (MODE "always", the call-signature cache cleared): odd
    # sizes, per-side and oversized padding, a 1-row plane, 7x7's two tap
    # groups, several channel blocks, an x view 4 bytes off 16, and channel
    # tiles per block forced to 1, 2 and 4 (an idle tile in the last block;
    # launched directly).
    from cupy_dwgn import _depthwise_nhwc_wgrad, _depthwise_wgrad_mma, _dtypes, _validate, depthwise as dw

    # The tensor-core weight gradient comes first where it serves: off.
    _depthwise_nhwc_wgrad.MODE, _depthwise_wgrad_mma.MODE, dw._SIGNATURES = "always", "never", {}
    try:
        for dtype in (cupy.float32, cupy.float16, _dtypes.bfloat16):
            for x_shape, k, stride, padding in [
                ((2, 13, 11, 48), 3, 1, 1), ((1, 9, 10, 16), 5, 1, ((0, 4), (3, 1))), ((2, 7, 7, 16), 7, 1, 3),
                ((1, 5, 9, 16), 7, 1, ((8, 2), (0, 8))), ((2, 1, 12, 16), 3, 1, (1, 0)), ((2, 13, 11, 48), 3, 2, 1),
                ((1, 17, 16, 16), 5, 2, ((4, 0), (1, 2))), ((1, 15, 15, 32), 7, 2, 3), ((3, 40, 30, 64), 3, 1, 1),
            ]:
                c = x_shape[3]
                g = _validate.conv_geometry(x_shape, (c, 1, k, k), stride, padding, 1, layout="NHWC")
                x = rng.standard_normal(x_shape, dtype=cupy.float32).astype(dtype)
                dy = rng.standard_normal((g.batch, g.out_height, g.out_width, c), dtype=cupy.float32).astype(dtype)
                conv = dict(stride=stride, padding=padding, layout="NHWC")
                cupy_dwgn.depthwise_conv2d_backward_weight(dy, x, (c, 1, k, k), **conv)
                offset = cupy.empty(x.size + 4 // x.itemsize, dtype)[4 // x.itemsize:].reshape(x.shape)
                offset[...] = x
                cupy_dwgn.depthwise_conv2d_backward_weight(dy, offset, (c, 1, k, k), **conv)
                for ctb in (1, 2, 4):
                    lc = _depthwise_nhwc_wgrad.config(k, stride, x.dtype)[0]
                    if _depthwise_nhwc_wgrad.channel_tile(x.dtype) // lc * ctb > 32:
                        continue
                    (partial, finalize), (shape, acc) = _depthwise_nhwc_wgrad.plan(g, x.dtype, "int", 16, 16, ctb)
                    sums = cupy.empty(shape, acc)
                    partial(dy, x, sums)
                    finalize(sums, cupy.empty((c, 1, k, k), dtype))
    finally:
        _depthwise_nhwc_wgrad.MODE, _depthwise_wgrad_mma.MODE, dw._SIGNATURES = "rule", "rule", {}


def _nchw_weight_gradient(x_shape, k, stride, padding, dtype, x_offsets):
    # One NCHW weight gradient on random x and grad_out, with x at each of
    # x_offsets bytes past a 16-byte boundary (a view into a larger buffer).
    c = x_shape[1]
    conv = dict(stride=stride, padding=padding)
    x = rng.standard_normal(x_shape, dtype=cupy.float32).astype(dtype)
    y_shape = cupy_dwgn.depthwise_conv2d(x, cupy.zeros((c, 1, k, k), dtype), **conv).shape
    dy = rng.standard_normal(y_shape, dtype=cupy.float32).astype(dtype)
    for offset in x_offsets:
        shifted = cupy.empty(x.size + offset // x.itemsize, dtype)[offset // x.itemsize:].reshape(x.shape)
        shifted[...] = x
        cupy_dwgn.depthwise_conv2d_backward_weight(dy, shifted, (c, 1, k, k), **conv)


def nchw_wgrad_regs():
    # The NCHW register weight gradient for every 3x3/5x5/7x7 NCHW call at
    # stride 1 and 2 (MODE "always", the call-signature cache cleared): odd
    # widths (VW = 1), per-side and oversized padding, a 1-row plane, rows
    # wider than a warp (segments, dead lanes), an x view 4 bytes off 16.
    from cupy_dwgn import (_depthwise_nchw_plane_wgrad, _depthwise_nchw_wgrad_regs, _depthwise_wgrad_mma, _dtypes,
                           depthwise as dw)

    # The tensor-core and whole-plane weight gradients come first where they serve: off.
    _depthwise_nchw_wgrad_regs.MODE, _depthwise_nchw_plane_wgrad.MODE, dw._SIGNATURES = "always", "never", {}
    _depthwise_wgrad_mma.MODE = "never"
    try:
        for dtype in (cupy.float32, cupy.float16, _dtypes.bfloat16):
            for x_shape, k, stride, padding in [
                ((2, 3, 13, 11), 3, 1, 1), ((1, 2, 9, 10), 5, 1, ((0, 4), (3, 1))), ((2, 2, 7, 7), 7, 1, 3),
                ((1, 2, 5, 9), 7, 1, ((8, 2), (0, 8))), ((2, 2, 1, 12), 3, 1, (1, 0)), ((2, 3, 13, 11), 3, 2, 1),
                ((1, 2, 17, 16), 5, 2, ((4, 0), (1, 2))), ((1, 2, 15, 15), 7, 2, 3), ((3, 8, 40, 32), 3, 1, 1),
                ((1, 2, 6, 272), 3, 1, 1), ((2, 4, 28, 28), 7, 1, 3), ((1, 3, 40, 12), 3, 1, 1),
                ((1, 2, 36, 20), 5, 1, 2),
            ]:
                _nchw_weight_gradient(x_shape, k, stride, padding, dtype, x_offsets=(0, 4))
    finally:
        _depthwise_nchw_wgrad_regs.MODE, _depthwise_nchw_plane_wgrad.MODE, dw._SIGNATURES = "rule", "rule", {}
        _depthwise_wgrad_mma.MODE = "rule"


def nchw_plane_wgrad():
    # The NCHW whole-plane weight gradient for every 3x3/5x5/7x7 NCHW call
    # at stride 1 and 2 (MODE "always", the call-signature cache cleared):
    # units of several planes with a short last group, odd widths, per-side
    # and oversized padding, stride 2 on odd and even sources, bands (75x75,
    # 150x150 s2, padding rows past a band), several units per split.
    from cupy_dwgn import _depthwise_nchw_plane_wgrad, _depthwise_wgrad_mma, _dtypes, depthwise as dw

    # The tensor-core weight gradient comes first where it serves: off.
    _depthwise_nchw_plane_wgrad.MODE, _depthwise_wgrad_mma.MODE, dw._SIGNATURES = "always", "never", {}
    try:
        for dtype in (cupy.float32, cupy.float16, _dtypes.bfloat16):
            for x_shape, k, stride, padding in [
                ((2, 7, 13, 11), 3, 1, 1), ((1, 5, 9, 10), 5, 1, ((0, 4), (3, 1))), ((3, 3, 7, 7), 7, 1, 3),
                ((1, 2, 5, 9), 7, 1, ((8, 2), (0, 8))), ((3, 50, 6, 5), 3, 1, 1), ((2, 5, 4, 7), 3, 2, 0),
                ((2, 3, 19, 19), 5, 2, 2), ((1, 2, 15, 15), 7, 2, 3), ((3, 40, 19, 19), 3, 1, 1),
                ((2, 2, 75, 75), 3, 1, 1), ((2, 2, 75, 75), 5, 2, 2), ((1, 1, 150, 150), 3, 2, 1),
                ((2, 1, 60, 70), 7, 1, 8), ((1, 2, 20, 70), 3, 1, ((0, 60), (1, 1))), ((9, 3, 7, 7), 3, 1, 1),
            ]:
                _nchw_weight_gradient(x_shape, k, stride, padding, dtype, x_offsets=(0,))
    finally:
        _depthwise_nchw_plane_wgrad.MODE, _depthwise_wgrad_mma.MODE, dw._SIGNATURES = "rule", "rule", {}


def wgrad_mma():
    # The tensor-core weight gradient for every half-type 3x3/5x5/7x7 stride-1
    # call it serves, NCHW and NHWC (MODE "always", the call-signature cache
    # cleared): per-side padding and padding past the filter (border rows),
    # 1-row and 3-column planes, 2 and 3 chunks, a 4-channel last group
    # (NCHW), several splits, NCHW x 4 bytes off 16 (4-byte pieces), rings of
    # 2 to 8 buffers each refilled.
    import numpy

    from cupy_dwgn import _depthwise_wgrad_mma, _dtypes, _validate, depthwise as dw

    _depthwise_wgrad_mma.MODE, dw._SIGNATURES = "always", {}
    try:
        for dtype in (cupy.float16, _dtypes.bfloat16):
            for x_shape, k, padding in [
                ((3, 16, 14, 14), 7, 3), ((2, 24, 28, 28), 5, 2), ((1, 16, 9, 10), 5, ((0, 4), (3, 1))),
                ((1, 8, 5, 8), 7, ((6, 2), (0, 9))), ((2, 16, 28, 3), 7, ((2, 3), (3, 2))), ((2, 16, 1, 12), 3, (1, 0)),
                ((2, 8, 8, 40), 5, 2), ((3, 20, 30, 34), 3, 0), ((24, 64, 14, 14), 7, 3), ((9, 32, 28, 28), 3, 1),
            ]:
                _nchw_weight_gradient(x_shape, k, 1, padding, dtype, x_offsets=(0, 4))
                if x_shape[1] % 8 == 0:
                    n, c, h, w = x_shape
                    x = rng.standard_normal((n, h, w, c), dtype=cupy.float32).astype(dtype)
                    y = cupy_dwgn.depthwise_conv2d(x, cupy.zeros((c, 1, k, k), dtype), padding=padding, layout="NHWC")
                    dy = rng.standard_normal(y.shape, dtype=cupy.float32).astype(dtype)
                    cupy_dwgn.depthwise_conv2d_backward_weight(dy, x, (c, 1, k, k), padding=padding, layout="NHWC")
            # One split of 20 images: every buffer of 2- to 8-deep rings refilled (launched directly).
            for layout in ("NCHW", "NHWC"):
                x_shape = (20, 16, 14, 14) if layout == "NCHW" else (20, 14, 14, 16)
                g = _validate.conv_geometry(x_shape, (16, 1, 7, 7), 1, 3, 1, layout=layout)
                x = rng.standard_normal(x_shape, dtype=cupy.float32).astype(dtype)
                for stages in (2, 3, 5, 8):
                    (partial, finalize), (shape, acc) = _depthwise_wgrad_mma.plan(
                        g, numpy.dtype(dtype), layout, "int", 16, 16, 1, stages)
                    sums = cupy.empty(shape, acc)
                    partial(x, x, sums)  # grad_out has x's shape here (7x7, padding 3)
                    finalize(sums, cupy.empty((16, 1, 7, 7), dtype))
    finally:
        _depthwise_wgrad_mma.MODE, dw._SIGNATURES = "rule", {}


def _nchw_direct_calls(module, cases):
    # Every NCHW forward and (stride 1) backward-input call of `cases` ((x
    # shape, filter size, stride, padding)) with `module`'s kernel forced
    # (MODE "always", the call-signature cache cleared), aligned and from a
    # misaligned view, in the three dtypes the direct-style kernels serve.
    from cupy_dwgn import _dtypes, depthwise as dw

    module.MODE, dw._SIGNATURES = "always", {}
    try:
        for dtype in (cupy.float32, cupy.float16, _dtypes.bfloat16):
            for x_shape, k, stride, padding in cases:
                c = x_shape[1]
                conv = dict(stride=stride, padding=padding)
                x = rng.standard_normal(x_shape, dtype=cupy.float32).astype(dtype)
                w = rng.standard_normal((c, 1, k, k), dtype=cupy.float32).astype(dtype)
                b = rng.standard_normal((c,), dtype=cupy.float32).astype(dtype)
                y = cupy_dwgn.depthwise_conv2d(x, w, b, **conv)
                cupy_dwgn.depthwise_conv2d(_misaligned(x), w, **conv)
                if stride == 1:
                    cupy_dwgn.depthwise_conv2d_backward_input(y, w, x_shape, **conv)
                    cupy_dwgn.depthwise_conv2d_backward_input(_misaligned(y), w, x_shape, **conv)
    finally:
        module.MODE, dw._SIGNATURES = "rule", {}


def nchw_rows():
    # The NCHW row kernel: both row widths, stride 2, padding past the
    # filter, per-side padding, a 1x1 image, a partial last block.
    from cupy_dwgn import _depthwise_nchw_rows

    _nchw_direct_calls(_depthwise_nchw_rows, [
        ((3, 37, 7, 7), 3, 1, 1), ((2, 9, 14, 14), 7, 1, 3), ((1, 6, 5, 3), 7, 1, 8),
        ((2, 5, 11, 13), 5, 1, ((0, 4), (3, 1))), ((4, 7, 1, 1), 3, 1, 1), ((2, 21, 14, 14), 3, 2, 1),
        ((1, 6, 13, 16), 7, 2, 3), ((2, 13, 16, 16), 5, 1, 2),
    ])


def nchw_forward_regs():
    # The NCHW register row walk: 56-wide rows of 8 2-byte values, stride-2
    # rows of two 16-byte vectors, strips cut by the bottom, rows wider than
    # a warp (segments), odd widths, padding past the filter, per-side
    # padding, 1-row planes.
    from cupy_dwgn import _depthwise_nchw_forward_regs

    _nchw_direct_calls(_depthwise_nchw_forward_regs, [
        ((2, 3, 56, 56), 3, 1, 1), ((1, 3, 40, 12), 3, 1, 1), ((2, 3, 13, 11), 3, 1, 1),
        ((1, 2, 36, 20), 5, 1, 2), ((1, 1, 5, 9), 7, 1, ((8, 2), (0, 8))), ((2, 1, 1, 12), 3, 1, (1, 0)),
        ((1, 1, 6, 272), 3, 1, 1), ((1, 2, 112, 112), 3, 2, 1), ((1, 2, 56, 56), 5, 2, 2),
        ((2, 3, 13, 14), 3, 2, 1), ((1, 2, 15, 14), 7, 2, 3), ((1, 1, 4, 520), 3, 2, 1),
    ])


def _nhwc_call(dtype, x_shape, k, stride, padding):
    # One NHWC forward (with bias) on random data and, at stride 1, its
    # backward-input; returns (x, weight, bias, y).
    c = x_shape[3]
    conv = dict(stride=stride, padding=padding, layout="NHWC")
    x = rng.standard_normal(x_shape, dtype=cupy.float32).astype(dtype)
    w = rng.standard_normal((c, 1, k, k), dtype=cupy.float32).astype(dtype)
    b = rng.standard_normal((c,), dtype=cupy.float32).astype(dtype)
    y = cupy_dwgn.depthwise_conv2d(x, w, b, **conv)
    if stride == 1:
        cupy_dwgn.depthwise_conv2d_backward_input(y, w, x_shape, **conv)
    return x, w, b, y


def _nhwc_calls(dtypes, cases):
    # _nhwc_call for each of `cases` ((x shape, filter size, stride, padding)) in each dtype.
    for dtype in dtypes:
        for x_shape, k, stride, padding in cases:
            _nhwc_call(dtype, x_shape, k, stride, padding)


def conv_mma():
    # The tensor-core forward (stride 1 and 2) / backward-input (float32
    # keeps the others), NCHW: row copies in 16-, 8- and 4-byte pieces and 2-byte loads
    # (misaligned views, odd widths), planes of several strips and row tiles,
    # bands of rows (150 and 112 wide), 8 planes a unit, padding past the
    # filter's half, per-side padding, a valid correlation, 1-row planes;
    # NHWC: whole planes and bands of 8-channel groups; an inf in each layout
    # (its strips recomputed output by output).
    from cupy_dwgn import _depthwise_conv_mma, _dtypes, depthwise as dw

    cases = [
        ((2, 5, 56, 56), 7, 1, 3), ((1, 3, 112, 112), 3, 1, 1), ((4, 70, 14, 14), 3, 1, 1), ((2, 9, 19, 19), 5, 1, 2),
        ((2, 5, 29, 31), 5, 1, ((0, 4), (3, 1))), ((1, 3, 40, 24), 7, 1, "valid"), ((2, 5, 1, 31), 3, 1, 1),
        ((1, 6, 17, 9), 7, 1, 8), ((1, 2, 150, 150), 5, 1, 2), ((2, 8, 38, 38), 3, 2, 1), ((1, 3, 75, 75), 5, 2, 2),
        ((1, 2, 150, 150), 3, 2, 1), ((1, 3, 9, 9), 5, 2, 4),
    ]
    _nchw_direct_calls(_depthwise_conv_mma, cases)
    _depthwise_conv_mma.MODE, dw._SIGNATURES = "always", {}
    try:
        _nhwc_calls((cupy.float16, _dtypes.bfloat16), [
            ((2, 28, 28, 16), 5, 1, 2), ((1, 56, 56, 8), 7, 1, 3), ((1, 150, 150, 8), 5, 1, 2), ((2, 13, 11, 24), 3, 1, 1),
            ((1, 17, 9, 8), 7, 1, 8), ((2, 38, 38, 16), 3, 2, 1), ((1, 75, 75, 8), 5, 2, 2),
        ])
        for layout, shape in (("NCHW", (2, 5, 14, 18)), ("NHWC", (2, 14, 18, 8))):
            x = rng.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
            x[(1, 2, 6, 7) if layout == "NCHW" else (1, 6, 7, 2)] = cupy.inf
            c = shape[1] if layout == "NCHW" else shape[3]
            w = rng.standard_normal((c, 1, 5, 5), dtype=cupy.float32).astype(cupy.float16)
            cupy_dwgn.depthwise_conv2d(x, w, padding=2, layout=layout)
    finally:
        _depthwise_conv_mma.MODE, dw._SIGNATURES = "rule", {}


def nhwc_direct():
    # The NHWC direct kernel for every 3x3/5x5 NHWC forward (stride 1 and 2)
    # and stride-1 backward-input call it serves (MODE "always", the
    # call-signature cache cleared): strips cut by the right edge, padding
    # past the filter, per-side padding, uneven channel tiles, a 1x1 image,
    # float32 5x5's two TW (7 and 8) and its 2-item grid, float32 3x3 stride
    # 2 (ALL_ROWS) on a 2-item grid.
    from cupy_dwgn import _depthwise_nhwc_direct, _depthwise_nhwc_ring, _dtypes, depthwise as dw

    _depthwise_nhwc_direct.MODE, _depthwise_nhwc_ring.MODE, dw._SIGNATURES = "always", "never", {}
    try:
        _nhwc_calls((cupy.float32, cupy.float16, _dtypes.bfloat16), [
            ((2, 13, 11, 32), 3, 1, 1), ((1, 9, 10, 16), 5, 1, ((0, 4), (3, 1))), ((1, 5, 3, 8), 3, 1, 4),
            ((3, 1, 1, 24), 3, 1, 1), ((2, 7, 7, 296), 5, 1, 2), ((2, 15, 13, 40), 3, 2, 1),
            ((1, 17, 16, 16), 5, 2, ((4, 0), (1, 2))), ((2, 6, 19, 24), 5, 1, 2), ((2, 5, 23, 16), 5, 1, 2),
            ((20, 28, 28, 128), 5, 1, 2),  # float32: TW 7, 2 items a thread
            ((24, 28, 28, 128), 3, 2, 1),  # float32 stride 2: TW 2 with ALL_ROWS, 2 items a thread
        ])
    finally:
        _depthwise_nhwc_direct.MODE, _depthwise_nhwc_ring.MODE, dw._SIGNATURES = "rule", "rule", {}


def nhwc_ring():
    # The NHWC row-ring kernel for every 3x3 NHWC forward (stride 1 and 2),
    # stride-1 backward-input and 5x5 stride-2 forward call it serves (MODE
    # "always", the call-signature cache cleared), with bulk copies (the ops'
    # path), then launched with the block's cp.async pieces on 3 blocks:
    # strips cut by the right edge, padding past the filter, per-side
    # padding, a 1x1 image, 74 and 250 vectors, a 256-thread 5x5 block of
    # 2-column strips, each thread taking several; rows whose K slots pass
    # MAX_SHARED run under the device's limit, as the ops plan them.
    import numpy

    from cupy_dwgn import _depthwise_nhwc_ring, _dtypes, _launch, _validate, depthwise as dw

    _depthwise_nhwc_ring.MODE, dw._SIGNATURES = "always", {}
    try:
        for dtype in (cupy.float32, cupy.float16, _dtypes.bfloat16):
            for case in [
                ((2, 13, 11, 32), 1, 1), ((1, 9, 10, 16), 1, ((0, 2), (2, 1))), ((1, 5, 3, 8), 1, 4),
                ((3, 1, 1, 24), 1, 1), ((2, 7, 7, 296), 1, 1), ((2, 15, 13, 40), 2, 1),
                ((1, 17, 16, 16), 2, ((2, 0), (1, 2))), ((4, 28, 28, 96), 1, 1),
                ((1, 9, 150, 144), 2, 1), ((2, 6, 77, 216), 1, 1),
                ((2, 15, 13, 40), 2, 2, 5), ((2, 10, 9, 16), 2, ((4, 1), (0, 3)), 5), ((2, 3, 4, 8), 2, 6, 5),
                ((2, 9, 6, 1000), 2, 2, 5), ((1, 21, 21, 816), 2, 2, 5), ((2, 7, 20, 24), 2, 2, 5),
                ((2, 10, 10, 1024), 1, 1), ((2, 11, 10, 512), 2, ((1, 2), (3, 0)), 5),
            ]:
                x_shape, stride, padding = case[:3]
                k = case[3] if len(case) > 3 else 3
                c = x_shape[3]
                x, w, b, y = _nhwc_call(dtype, x_shape, k, stride, padding)
                g = _validate.conv_geometry(x_shape, (c, 1, k, k), stride, padding, 1, layout="NHWC")
                launch = _depthwise_nhwc_ring.plan_on_device(g, numpy.dtype(dtype), False, "int", 16, 16, None, False)
                if launch is None:  # past even the device's limit (the ops took another kernel)
                    continue
                _launch.Launch(launch.file, launch.expression, (3,), launch.block, launch.shared_mem, launch.scalars,
                               persistent=True)(x, w, b, cupy.empty_like(y))
    finally:
        _depthwise_nhwc_ring.MODE, dw._SIGNATURES = "rule", {}


def nhwc_phase():
    # The NHWC stride-2 backward-input kernel for every stride-2 3x3/5x5/7x7
    # NHWC call it serves (MODE "always", the call-signature cache cleared),
    # all four dtypes: odd and tiny planes, every padding class (odd, even,
    # per-side, oversized, unread last rows), several channel tiles with an
    # empty last slot; and the gather fallback for a misaligned grad_out.
    from cupy_dwgn import _depthwise_nhwc_phase, depthwise as dw

    _depthwise_nhwc_phase.MODE, dw._SIGNATURES = "always", {}
    try:
        for dtype in (cupy.float32, cupy.float16, cupy.float64):
            for x_shape, k, padding in [
                ((2, 13, 11, 32), 3, 1), ((1, 9, 10, 16), 5, ((0, 4), (3, 1))), ((2, 7, 7, 16), 7, 3),
                ((1, 1, 1, 8), 3, 1), ((1, 10, 10, 8), 3, 0), ((1, 15, 17, 40), 7, 6),
                ((1, 29, 31, 264), 5, 2), ((2, 12, 9, 16), 5, 1),
            ]:
                c = x_shape[3]
                w = rng.standard_normal((c, 1, k, k), dtype=cupy.float32).astype(dtype)
                x = cupy.zeros(x_shape, dtype)
                y = cupy_dwgn.depthwise_conv2d(x, w, stride=2, padding=padding, layout="NHWC")
                dy = rng.standard_normal(y.shape, dtype=cupy.float32).astype(dtype)
                cupy_dwgn.depthwise_conv2d_backward_input(dy, w, x_shape, stride=2, padding=padding, layout="NHWC")
                cupy_dwgn.depthwise_conv2d_backward_input(_misaligned(dy), w, x_shape, stride=2, padding=padding,
                                                          layout="NHWC")
    finally:
        _depthwise_nhwc_phase.MODE, dw._SIGNATURES = "rule", {}


def nchw_window():
    # The NCHW register-window kernel launched directly (its plan, as the ops
    # build it): the fixed copies (whole planes per unit, copy offsets worked
    # out once, padding rows zeroed once) for one plane and several per unit
    # with a partial last one, the backward's 2 sources per plane, padding
    # rows at the top and bottom, 5x5; banded planes (row staging; flat
    # staging of bands at odd widths of 2-byte types) and stride-2 forwards.
    from cupy_dwgn import _depthwise_nchw_window, _dtypes, _validate, depthwise as dw

    for dtype in (cupy.float32, cupy.float16, _dtypes.bfloat16):
        for x_shape, multiplier, k, padding in [
            ((1, 6, 56, 56), 1, 3, 1), ((1, 5, 32, 32), 1, 3, 1), ((2, 3, 40, 40), 2, 3, 1),
            ((1, 3, 48, 48), 1, 3, ((2, 3), (1, 1))), ((1, 4, 56, 56), 1, 5, 2), ((1, 2, 112, 112), 1, 3, 1),
            ((2, 3, 75, 75), 1, 3, 1), ((1, 2, 101, 91), 1, 5, ((0, 6), (2, 2))),  # bands, flat in 2-byte types
        ]:
            w_shape = (x_shape[1] * multiplier, 1, k, k)
            g = _validate.conv_geometry(x_shape, w_shape, 1, padding, 1)
            y_shape = (g.batch, w_shape[0], g.out_height, g.out_width)
            w = rng.standard_normal(w_shape, dtype=cupy.float32).astype(dtype)
            b = rng.standard_normal(w_shape[:1], dtype=cupy.float32).astype(dtype)
            for backward, src_shape, dst_shape in ((False, x_shape, y_shape), (True, y_shape, x_shape)):
                if not backward and multiplier > 1:
                    continue
                src = rng.standard_normal(src_shape, dtype=cupy.float32).astype(dtype)
                dst = cupy.empty(dst_shape, dtype)
                launch = _depthwise_nchw_window.plan(g, cupy.dtype(dtype), backward, "int", dw._alignment(src),
                                                     dw._alignment(dst) == 16)
                launch(src, w, 0 if backward else b, dst)
        # Stride-2 forwards: units of one plane staged row by row (the stepped loop).
        for x_shape, k, padding in [((1, 3, 112, 112), 3, 1), ((1, 2, 57, 40), 5, 2), ((1, 3, 97, 97), 3, "valid"),
                                    ((1, 3, 151, 151), 3, 1)]:
            w_shape = (x_shape[1], 1, k, k)
            g = _validate.conv_geometry(x_shape, w_shape, 2, padding, 1)
            src = rng.standard_normal(x_shape, dtype=cupy.float32).astype(dtype)
            w = rng.standard_normal(w_shape, dtype=cupy.float32).astype(dtype)
            dst = cupy.empty((g.batch, w_shape[0], g.out_height, g.out_width), dtype)
            launch = _depthwise_nchw_window.plan(g, cupy.dtype(dtype), False, "int", dw._alignment(src),
                                                 dw._alignment(dst) == 16)
            launch(src, w, 0, dst)


def nchw_plane():
    # The NCHW whole-plane kernel launched directly (its plan, as the ops
    # build it): units starting between 16-byte boundaries (odd plane sizes,
    # copied from the boundary below), outputs through the shared output
    # buffer into an aligned and a misaligned destination, vector stores,
    # a partial last unit, the element path (misaligned source); the
    # stride-2 forward (odd and even planes, 5x5 and 7x7); bands of one
    # plane (planes of more than 256 items, float32 planes too large for
    # the buffers).  2-byte 5x5 at stride 1 at each of its rows a thread (4
    # and 7, forced), bands of 7-row items too.  float16 reads the shared
    # planes in 4-byte pairs into the pads around the buffers: the most left
    # padding they serve, the stride-2 7x7 overhang past odd rows.  Units
    # of several planes of a multiple of 16 bytes staged a gap apart (the
    # PITCHED 2-byte 5x5 kernels: the rule's gap, the smallest and the
    # largest forced), a partial last unit.
    from cupy_dwgn import _depthwise_nchw_plane, _dtypes, _validate, depthwise as dw

    for dtype in (cupy.float32, cupy.float16, _dtypes.bfloat16):
        for x_shape, k, padding, stride in [
                ((3, 7, 13, 11), 3, 1, 1), ((4, 70, 21, 21), 3, 1, 1), ((2, 33, 14, 14), 5, 2, 1),
                ((2, 5, 29, 31), 5, ((0, 4), (3, 1)), 1), ((2, 24, 15, 15), 7, 3, 1), ((4, 40, 28, 28), 3, 1, 1),
                ((4, 40, 38, 38), 3, 1, 2), ((3, 50, 19, 19), 5, 2, 2), ((2, 6, 27, 28), 7, 3, 2),
                ((2, 3, 75, 75), 3, 1, 1), ((2, 4, 60, 61), 3, 1, 1), ((1, 3, 70, 66), 7, 8, 1),
                ((1, 3, 150, 150), 3, 1, 2), ((1, 2, 20, 70), 3, ((0, 60), (1, 1)), 1),
                ((1, 3, 4, 90), 3, ((0, 100), (1, 1)), 1), ((2, 6, 17, 19), 5, 2, 1),
                ((1, 2, 150, 100), 5, ((1, 4), (2, 2)), 1), ((1, 3, 9, 40), 5, ((2, 2), (15, 1)), 1),
                ((2, 3, 27, 29), 7, 3, 2), ((3, 203, 16, 16), 5, 2, 1), ((5, 121, 8, 8), 5, ((0, 4), (3, 1)), 1),
                # 7x7 planes (one 7-row item a column block); persistent blocks walking two units
                ((4, 9, 7, 7), 7, 3, 1), ((33, 131, 14, 14), 7, 3, 1)]:
            gaps = _depthwise_nchw_plane._PITCH_GAPS
            # P >= 3 (_MIN_UNITS); at these plane counts the rule's pick (None) stages flat, the forced gaps not
            pitch_gaps = (None, gaps[0], gaps[-1]) if x_shape[0] * x_shape[1] > 528 else (None,)
            w_shape = (x_shape[1], 1, k, k)
            g = _validate.conv_geometry(x_shape, w_shape, stride, padding, 1)
            y_shape = (g.batch, x_shape[1], g.out_height, g.out_width)
            w = rng.standard_normal(w_shape, dtype=cupy.float32).astype(dtype)
            b = rng.standard_normal(w_shape[:1], dtype=cupy.float32).astype(dtype)
            directions = ((False, x_shape, y_shape), (True, y_shape, x_shape)) if stride == 1 else ((False, x_shape, y_shape),)
            for backward, src_shape, dst_shape in directions:
                src = rng.standard_normal(src_shape, dtype=cupy.float32).astype(dtype)
                for src_view, dst in ((src, cupy.empty(dst_shape, dtype)),
                                      (src, _misaligned(cupy.empty(dst_shape, dtype))),
                                      (_misaligned(src), cupy.empty(dst_shape, dtype))):
                    for item_rows in _depthwise_nchw_plane.row_choices(cupy.dtype(dtype).itemsize, k, stride):
                        pitched = _depthwise_nchw_plane.pitch_capable(cupy.dtype(dtype).itemsize, k, stride, item_rows)
                        for gap in pitch_gaps if pitched else (None,):
                            launch = _depthwise_nchw_plane.plan(g, cupy.dtype(dtype), backward, "int",
                                                                dw._alignment(src_view), dw._alignment(dst), item_rows,
                                                                gap)
                            launch(src_view, w, 0 if backward else b, dst)


def _misaligned(a):
    """A C-contiguous copy of ``a`` one element past its allocation's start."""
    base = cupy.empty(a.size + 1, a.dtype)
    view = base[1:].reshape(a.shape)
    view[...] = a
    return view


def group_norm(paths=None):
    # Every path: "cluster" (what "auto" takes on an sm_90 GPU where the
    # vector path applies and a set's rows fit the cluster's shared memory),
    # "small" (a warp per (sample, group): what "auto" takes for small
    # groups), "resident" (opt-in; these cases all fit on chip),
    # "fused" (the column kernels with their finalize after a grid barrier),
    # "split" (three launches), "onepass";
    # per-channel partial sums (what these small tensors take) and per-group
    # ones (forced; the cases' groups have 2-8 channels, and 131 channels in
    # ((2, 393), 3), which stays per channel); the apply / dx kernels at the
    # vectors a thread the rule gives these small tensors (1) and, for the
    # float16 cases, at 2 (forced; the rule's pick from 16 MB).  Each case
    # also runs on a misaligned view (element loads).
    from cupy_dwgn import _group_norm

    shipped_grouped_bytes = _group_norm._GROUPED_BYTES
    shipped_vectors = _group_norm._elementwise_vectors
    two_vectors = lambda num_vectors, vec, dtype: 2 if cupy.dtype(dtype) == cupy.float16 else 1  # noqa: E731 (what is compiled)
    for path, grouped_bytes, vectors in [
            ("cluster", shipped_grouped_bytes, shipped_vectors), ("small", shipped_grouped_bytes, shipped_vectors),
            ("resident", shipped_grouped_bytes, shipped_vectors),
            ("fused", shipped_grouped_bytes, shipped_vectors), ("fused", 0, shipped_vectors),
            ("fused", shipped_grouped_bytes, two_vectors),
            ("split", shipped_grouped_bytes, shipped_vectors), ("split", 0, shipped_vectors),
            ("split", shipped_grouped_bytes, two_vectors), ("onepass", shipped_grouped_bytes, shipped_vectors)]:
        if paths is not None and path not in paths:
            continue
        _group_norm.FORWARD_PATH = _group_norm.BACKWARD_PATH = path
        _group_norm._GROUPED_BYTES = grouped_bytes
        _group_norm._elementwise_vectors = vectors
        _group_norm._forward_plan.cache_clear()
        _group_norm._backward_plan.cache_clear()
        _group_norm._SIGNATURES.clear()
        group_norm_cases()
    _group_norm.FORWARD_PATH = _group_norm.BACKWARD_PATH = "auto"
    _group_norm._GROUPED_BYTES = shipped_grouped_bytes
    _group_norm._elementwise_vectors = shipped_vectors
    _group_norm._forward_plan.cache_clear()
    _group_norm._backward_plan.cache_clear()
    _group_norm._SIGNATURES.clear()


def gn_resident():
    # The resident forward alone (and the fused backward after it).
    group_norm(paths=("resident",))


def gn_cluster():
    # The cluster forward and backward alone.
    group_norm(paths=("cluster",))


def gn_small():
    # The small-group kernels alone (forward, backward and the weight gradients' reduce).
    group_norm(paths=("small",))


def group_norm_cases():
    for dtype in (cupy.float32, cupy.float16):
        for shape, groups in [((2, 7, 9, 136), 17), ((1, 97, 12), 4), ((3, 5, 5, 5, 64), 32), ((2, 393), 3),
                              ((1, 131075, 24), 3),  # whole row batches plus remainders per lane
                              ((2, 16, 16, 640), 32), ((8, 4, 4, 1280), 32)]:  # clusters of 8 (fp32: 4) and 1
            x = (3 + rng.standard_normal(shape, dtype=cupy.float32)).astype(dtype)
            c = shape[-1]
            w = rng.standard_normal(c, dtype=cupy.float32)
            b = rng.standard_normal(c, dtype=cupy.float32)
            for activation in ("identity", "silu"):
                y, mean, rstd = cupy_dwgn.group_norm(x, groups, w, b, activation=activation, return_stats=True)
                cupy_dwgn.group_norm_backward(y, x, mean, rstd, groups, w, b, activation=activation)
            # an unaligned view (data pointer not 16-byte aligned)
            base = cupy.empty(x.size + 1, dtype)
            view = base[1:].reshape(shape)
            view[...] = x
            cupy_dwgn.group_norm(view, groups)


if __name__ == "__main__":
    import sys

    families = sys.argv[1:] or ["depthwise", "nchw_window", "nchw_plane", "conv_mma", "nhwc_window", "nhwc_wgrad", "nchw_wgrad_regs", "nchw_plane_wgrad", "nchw_rows", "nchw_forward_regs",
                                "nhwc_direct", "nhwc_ring", "nhwc_phase", "wgrad_mma", "group_norm"]
    for family in families:
        {"depthwise": depthwise, "nchw_window": nchw_window, "nchw_plane": nchw_plane, "nhwc_window": nhwc_window, "nhwc_wgrad": nhwc_wgrad,
         "nchw_wgrad_regs": nchw_wgrad_regs, "nchw_plane_wgrad": nchw_plane_wgrad, "nchw_rows": nchw_rows, "nchw_forward_regs": nchw_forward_regs,
         "conv_mma": conv_mma,
         "nhwc_direct": nhwc_direct,
         "nhwc_ring": nhwc_ring, "nhwc_phase": nhwc_phase, "wgrad_mma": wgrad_mma,
         "group_norm": group_norm, "gn_resident": gn_resident, "gn_cluster": gn_cluster,
         "gn_small": gn_small}[family]()
    cupy.cuda.Device().synchronize()
    print("sanitizer workload done")
