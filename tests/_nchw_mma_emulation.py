"""What kernels/depthwise_nchw_mma.cu computes for a launch of
_depthwise_nchw_mma.plan: a NumPy transcription of its index math, used by
tests/test_compile.py (CPU).  Per block (blockIdx.x = unit of P planes): the
zero-padded images (every copied row asserted to land inside its plane's
image, the pieces inside the row), the (plane, 16-row tile) items dealt to
the 4 warps (item i to warp i % 4), each walking its columns in strips of
4 tiles: per filter row the 8-column chunks as ldmatrix reads them (lane l
< 16 gives row l; every read asserted inside the image), the lanes' B
fragments from the kernel's tap formula assembled into the 24 x 8 banded
matrix by the PTX layouts of mma.m16n8k16 / m16n8k8 (lane = 4 g + q: b0 =
B[2q..2q+1][g], b1 = B[2q+8..2q+9][g], k8's b0 = B[16+2q..17+2q][g]; every
entry set by exactly one lane), the products with IEEE semantics (0 * inf
is NaN, as on the tensor cores), the strip recomputed tap by tap where a
result is not finite, the outputs through the lanes' D layout (d0/d1 =
D[g][2q..2q+1], d2/d3 = D[g + 8][...]) into the stage (each staged once,
inside the unit's destination planes), then the stage to dst.  float64
sums (the kernel's are float32); outputs never written stay NaN."""

import numpy

WARPS, STRIP, LEFT = 4, 4, 8  # kernel: kWarps, kStrip, kLeft


def _template(expression):
    args = expression[expression.index("<") + 1 : -1].split(", ")
    return int(args[1]), args[2] == "true"


def _lane_b(weights, k, backward, kh, shift):
    """The 24 x 8 matrix B of filter row kh as the 32 lanes' fragments
    (three words each) build it; weights: (K, K) float64."""
    b = numpy.full((24, 8), numpy.nan)
    for lane in range(32):
        g, q = lane // 4, lane % 4
        k0 = 2 * q - shift - g
        for row, tap in ((2 * q, k0), (2 * q + 1, k0 + 1), (2 * q + 8, k0 + 8), (2 * q + 9, k0 + 9),
                         (2 * q + 16, k0 + 16), (2 * q + 17, k0 + 17)):
            assert numpy.isnan(b[row, g]), "a B entry set twice"
            if 0 <= tap < k:
                b[row, g] = weights[k - 1 - kh, k - 1 - tap] if backward else weights[kh, tap]
            else:
                b[row, g] = 0.0
    assert not numpy.isnan(b).any(), "a B entry no lane sets"
    return b


def _products(a, b):
    """a (16 x 24) @ b (24 x 8) with every product formed (0 * inf is NaN)."""
    with numpy.errstate(invalid="ignore", over="ignore"):
        return (a[:, :, None] * b[None, :, :]).sum(axis=1)


def emulate(launch, src, weight, bias=None):
    """dst as the launch writes it (NaN where never written); src (N, C, H, W)
    of the correlation (x, or grad_out for the backward-input), weight (C, 1,
    K, K), bias (C,) or None."""
    (channels, num_planes, src_h, src_w, dst_h, dst_w, offset_top, offset_left, per_unit, image_rows, row_stride,
     piece) = (int(v) for v in launch.scalars)
    k, backward = _template(launch.expression)
    assert launch.block[0] == 32 * WARPS and launch.grid[0] == -(-num_planes // per_unit)
    assert src.shape[0] * src.shape[1] == num_planes and src.shape[2:] == (src_h, src_w)
    assert 0 <= offset_top and 0 <= offset_left <= LEFT
    assert row_stride % 8 == 0 and (row_stride // 8) % 2 == 1, "ldmatrix rows in different banks"
    assert LEFT + src_w <= row_stride and offset_top + src_h <= image_rows
    assert piece in (16, 8, 4, 2) and (2 * src_w) % piece == 0
    image_halves = image_rows * row_stride
    dst_plane = dst_h * dst_w
    # the stage starts 16-byte aligned after the images and holds a range starting up to 14 bytes in
    assert (per_unit * image_halves * 2) % 16 == 0
    assert launch.shared_mem >= per_unit * image_halves * 2 + 14 + per_unit * dst_plane * 2
    values = src.astype(numpy.float64).reshape(num_planes, src_h, src_w)
    weights = weight.astype(numpy.float64).reshape(channels, k, k)
    biases = None if (backward or bias is None) else bias.astype(numpy.float64)
    dst = numpy.full((num_planes, dst_h, dst_w), numpy.nan)
    row_tiles, col_tiles = -(-dst_h // 16), -(-dst_w // 8)
    shift = LEFT - offset_left
    for block in range(launch.grid[0]):
        first = block * per_unit
        planes = min(per_unit, num_planes - first)
        images = numpy.zeros((planes, image_rows, row_stride))
        for p in range(planes):
            images[p, offset_top : offset_top + src_h, LEFT : LEFT + src_w] = values[first + p]
        stage = numpy.full((planes, dst_h, dst_w), numpy.nan)
        written = numpy.zeros(stage.shape, bool)
        for warp in range(WARPS):
            for item in range(warp, planes * row_tiles, WARPS):
                p, row_tile = divmod(item, row_tiles)
                channel = (first + p) % channels
                bs = [_lane_b(weights[channel], k, backward, kh, shift) for kh in range(k)]
                bias_value = 0.0 if biases is None else biases[channel]
                row0 = row_tile * 16
                for tile0 in range(0, col_tiles, STRIP):
                    tiles = min(STRIP, col_tiles - tile0)
                    acc = numpy.full((tiles, 16, 8), bias_value)
                    for kh in range(k):
                        rows = row0 + kh + numpy.arange(16)
                        assert rows[-1] < image_rows, "an ldmatrix row past the image"
                        chunks = []
                        for c in range(tiles + 2):
                            column = (tile0 + c) * 8
                            assert column + 8 <= row_stride, "an ldmatrix row past the image's row"
                            chunks.append(images[p, rows, column : column + 8])
                        for t in range(tiles):
                            acc[t] = acc[t] + _products(numpy.hstack(chunks[t : t + 3]), bs[kh])
                    exact = numpy.isfinite(acc).all()  # else the strip, output by output
                    w = weights[channel][::-1, ::-1] if backward else weights[channel]
                    for t in range(tiles):  # the lanes' D layout
                        for lane in range(32):
                            g, q = lane // 4, lane % 4
                            for e in range(4):
                                i, n = g + (e >> 1) * 8, 2 * q + (e & 1)
                                y, x = row0 + i, (tile0 + t) * 8 + n
                                if y >= dst_h or x >= dst_w:
                                    continue
                                value = acc[t, i, n]
                                if not exact:
                                    window = images[p, y : y + k, x + shift : x + shift + k]
                                    assert window.shape == (k, k), "a recomputed window past the image"
                                    with numpy.errstate(invalid="ignore", over="ignore"):
                                        value = bias_value + (window * w).sum()
                                assert not written[p, y, x], "an output staged twice"
                                written[p, y, x] = True
                                stage[p, y, x] = value
        assert written.all(), "an output of the unit never staged"
        dst[first : first + planes] = stage
    return dst.reshape(src.shape[0], src.shape[1], dst_h, dst_w)
