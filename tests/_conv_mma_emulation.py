"""What kernels/depthwise_conv_mma.cu computes for a launch of
_depthwise_conv_mma.plan: a NumPy transcription of its index math, used by
tests/test_compile.py (CPU).  A persistent grid of ``resident`` blocks,
each walking units grid-size apart (NCHW: P whole planes or one band of one
plane; NHWC: sample, band, group of 8 channels) with its own image buffers:
one zeroed before every unit, or (NCHW) two zeroed once, the next unit's
rows copied into one while the other is worked on, a band's rows outside
its source rows zeroed before its copies (stale rows of an earlier unit
would change the results).  The source rows a unit copies are asserted to
be every row its outputs read that lies in the image, each landing inside
its image (NCHW units of several planes copy whole planes, one range of
src).  The (channel, 16-row tile) items are dealt to the 4 warps (item i to
warp i % 4), each walking its columns in strips of 4 tiles: per filter row
the 8-column chunks as ldmatrix reads them (lane l < 16 gives the image row
of tile row l, rows S apart; every read asserted inside the image), the
lanes' B fragments from the kernel's tap formula assembled into the banded
matrix (24 x 8; stride 2: 32 x 8) by the PTX layouts of mma.m16n8k16 /
m16n8k8 (lane = 4 g + q: b0 = B[2q..2q+1][g], b1 = B[2q+8..2q+9][g], then
k8's b0 = B[16+2q..17+2q][g], or at stride 2 the second k16's b0 / b1;
every entry set by exactly one lane), the products with IEEE semantics
(0 * inf is NaN, as on the tensor cores), the strip recomputed tap by tap
where a result is not finite, the outputs through the lanes' D layout
(d0/d1 = D[g][2q..2q+1], d2/d3 = D[g + 8][...]) into the stage (each
output of the call staged exactly once, by the unit that owns its row),
then to dst.  float64 sums (the kernel's are float32)."""

import numpy

WARPS, STRIP, LEFT, NHWC_CHANNELS = 4, 4, 8, 8  # kernel: kWarps, kStrip, kLeft; an NHWC unit's channels


def _template(expression):
    args = expression[expression.index("<") + 1 : -1].split(", ")
    return int(args[1]), int(args[2]), args[3] == "true", args[4] == "true"


def _lane_b(weights, k, stride, backward, kh, shift):
    """The 24 x 8 (stride 2: 32 x 8) matrix B of filter row kh as the 32
    lanes' fragments (three or four words each) build it; weights: (K, K)
    float64."""
    chunks = 3 if stride == 1 else 4
    b = numpy.full((8 * chunks, 8), numpy.nan)
    for lane in range(32):
        g, q = lane // 4, lane % 4
        k0 = 2 * q - shift - stride * g
        for row, tap in [(2 * q + 8 * j + e, k0 + 8 * j + e) for j in range(chunks) for e in (0, 1)]:
            assert numpy.isnan(b[row, g]), "a B entry set twice"
            if 0 <= tap < k:
                b[row, g] = weights[k - 1 - kh, k - 1 - tap] if backward else weights[kh, tap]
            else:
                b[row, g] = 0.0
    assert not numpy.isnan(b).any(), "a B entry no lane sets"
    return b


def _products(a, b):
    """a (16 x k) @ b (k x 8) with every product formed (0 * inf is NaN)."""
    with numpy.errstate(invalid="ignore", over="ignore"):
        return (a[:, :, None] * b[None, :, :]).sum(axis=1)


def _units(num_units, batch, channels, dst_h, num_bands, band_rows, per_unit, nhwc):
    """(channel plane indices, out_row0, out_rows) of every unit."""
    units = []
    for index in range(num_units):
        if nhwc:
            groups = channels // NHWC_CHANNELS
            rest, group = divmod(index, groups)
            sample, band = divmod(rest, num_bands)
            assert sample < batch
            planes = [sample * channels + group * NHWC_CHANNELS + c for c in range(NHWC_CHANNELS)]
        elif num_bands > 1:
            plane, band = divmod(index, num_bands)
            planes = [plane]
        else:
            band = 0
            planes = list(range(index * per_unit, min((index + 1) * per_unit, batch * channels)))
        out_row0 = band * band_rows
        units.append((planes, out_row0, min(band_rows, dst_h - out_row0)))
    return units


def emulate(launch, src, weight, bias=None, resident=None):
    """dst as the launch writes it, in the launch's layout; src the
    correlation's source (x, or grad_out for the backward-input) in that
    layout, weight (C, 1, K, K), bias (C,) or None.  ``resident``: the blocks
    the persistent grid has on the device (default: one a unit), each
    walking its units with its own image buffers."""
    (channels, num_planes, src_h, src_w, dst_h, dst_w, offset_top, offset_left, per_unit, num_bands, band_rows,
     image_rows, row_stride, piece, num_units, buffers) = (int(v) for v in launch.scalars)
    k, stride, backward, nhwc = _template(launch.expression)
    chunks = 3 if stride == 1 else 4
    assert stride == 1 or not backward
    assert launch.block[0] == 32 * WARPS and launch.persistent and launch.grid[0] == num_units
    assert buffers in (1, 2)
    batch = src.shape[0]
    values = (src.transpose(0, 3, 1, 2) if nhwc else src).astype(numpy.float64)
    assert values.shape == (batch, channels, src_h, src_w) and num_planes == (batch if nhwc else batch * channels)
    values = values.reshape(batch * channels, src_h, src_w)
    assert 0 <= offset_top and 0 <= offset_left <= LEFT
    assert row_stride % 8 == 0 and (row_stride // 8) % 2 == 1, "ldmatrix rows in different banks"
    assert LEFT + src_w <= row_stride
    assert nhwc or (piece in (16, 8, 4, 2) and (2 * src_w) % piece == 0)
    assert band_rows % 16 == 0 or num_bands == 1
    assert num_bands * band_rows >= dst_h > (num_bands - 1) * band_rows
    unit_planes = NHWC_CHANNELS if nhwc else per_unit
    assert not (nhwc and per_unit != NHWC_CHANNELS) and (num_bands == 1 or nhwc or per_unit == 1)
    image_halves = image_rows * row_stride
    assert image_rows >= stride * (16 * -(-min(band_rows, dst_h) // 16) - 1) + k, "a tile's rows past the image"
    # the stage starts 16-byte aligned after the buffers (NCHW: its range up to 14 bytes in)
    stage_bytes = unit_planes * min(band_rows, dst_h) * dst_w * 2 + (0 if nhwc else 14)
    assert (unit_planes * image_halves * 2) % 16 == 0
    if nhwc:  # one image buffer, and with pixels copied ahead their raw 16-byte vectors (at most image_rows rows)
        assert launch.shared_mem >= unit_planes * image_halves * 2 + (image_rows * src_w * 16 if buffers == 2 else 0) + stage_bytes
    else:
        assert launch.shared_mem >= buffers * unit_planes * image_halves * 2 + stage_bytes
    weights = weight.astype(numpy.float64).reshape(channels, k, k)
    biases = None if (backward or bias is None) else bias.astype(numpy.float64)
    dst = numpy.full((batch * channels, dst_h, dst_w), numpy.nan)
    written = numpy.zeros(dst.shape, bool)
    col_tiles = -(-dst_w // 8)
    shift = LEFT - offset_left
    units = _units(num_units, batch, channels, dst_h, num_bands, band_rows, per_unit, nhwc)

    def load(index, images, zero_all):
        """The unit's copies into ``images`` (the kernel's zeroing first)."""
        planes, out_row0, out_rows = units[index]
        first_source = stride * out_row0 - offset_top
        src_row0 = min(max(first_source, 0), src_h)
        src_rows = max(0, min(first_source + image_rows, src_h) - src_row0)
        image_row0 = src_row0 - first_source
        if len(planes) > 1 and not nhwc:
            assert (src_row0, src_rows) == (0, src_h), "a unit of several planes copies whole planes"
        # every source row the unit's outputs read, where it lies in the image, is copied
        needed = [r for r in range(first_source, first_source + stride * (out_rows - 1) + k) if 0 <= r < src_h]
        assert all(src_row0 <= r < src_row0 + src_rows for r in needed)
        if zero_all:
            images[:] = 0.0
        elif num_bands > 1 or nhwc:  # rows above and below the unit's source rows (all, if none)
            top = image_row0 if src_rows > 0 else image_rows
            end = image_row0 + src_rows if src_rows > 0 else image_rows
            assert 0 <= top <= end <= image_rows
            images[:, :top] = 0.0
            images[:, end:] = 0.0
        for p, plane in enumerate(planes):
            assert src_rows == 0 or 0 <= image_row0 and image_row0 + src_rows <= image_rows
            images[p, image_row0 : image_row0 + src_rows, LEFT : LEFT + src_w] = values[plane, src_row0 : src_row0 + src_rows]

    blocks = min(num_units, resident or num_units)
    for block in range(blocks):
        mine = list(range(block, num_units, blocks))
        if buffers == 2 and nhwc:  # one buffer zeroed once; each unit's pixels split into it once landed
            images = numpy.zeros((unit_planes, image_rows, row_stride))
            for index in mine:
                load(index, images, False)
                _work(units[index], images, weights, biases, k, stride, backward, shift, channels, dst_w,
                      image_rows, row_stride, col_tiles, chunks, dst, written)
        elif buffers == 2:  # zeroed once; unit i + 1 copied into the other buffer while unit i is worked on
            ring = [numpy.zeros((unit_planes, image_rows, row_stride)) for _ in range(2)]
            load(mine[0], ring[0], False)
            for i, index in enumerate(mine):
                if i + 1 < len(mine):
                    load(mine[i + 1], ring[(i + 1) % 2], False)
                _work(units[index], ring[i % 2], weights, biases, k, stride, backward, shift, channels, dst_w,
                      image_rows, row_stride, col_tiles, chunks, dst, written)
        else:
            images = numpy.full((unit_planes, image_rows, row_stride), numpy.nan)  # stale until zeroed
            for index in mine:
                load(index, images, True)
                _work(units[index], images, weights, biases, k, stride, backward, shift, channels, dst_w,
                      image_rows, row_stride, col_tiles, chunks, dst, written)
    assert written.all(), "an output never staged"
    dst = dst.reshape(batch, channels, dst_h, dst_w)
    return numpy.ascontiguousarray(dst.transpose(0, 2, 3, 1)) if nhwc else dst


def _work(unit, images, weights, biases, k, stride, backward, shift, channels, dst_w, image_rows, row_stride,
          col_tiles, chunks, dst, written):
    """One unit's items, dealt to the warps, from ``images`` into dst."""
    planes, out_row0, out_rows = unit
    row_tiles = -(-out_rows // 16)
    for warp in range(WARPS):
        for item in range(warp, len(planes) * row_tiles, WARPS):
            p, row_tile = divmod(item, row_tiles)
            channel = planes[p] % channels
            bs = [_lane_b(weights[channel], k, stride, backward, kh, shift) for kh in range(k)]
            bias_value = 0.0 if biases is None else biases[channel]
            w = weights[channel][::-1, ::-1] if backward else weights[channel]
            row0 = row_tile * 16
            for tile0 in range(0, col_tiles, STRIP):
                tiles = min(STRIP, col_tiles - tile0)
                acc = numpy.full((tiles, 16, 8), bias_value)
                for kh in range(k):
                    rows = stride * (row0 + numpy.arange(16)) + kh
                    assert rows[-1] < image_rows, "an ldmatrix row past the image"
                    loaded = []
                    for c in range(stride * tiles + 2):
                        column = (stride * tile0 + c) * 8
                        assert column + 8 <= row_stride, "an ldmatrix row past the image's row"
                        loaded.append(images[p, rows, column : column + 8])
                    for t in range(tiles):
                        window = numpy.hstack(loaded[stride * t : stride * t + chunks])
                        acc[t] = acc[t] + _products(window, bs[kh])
                exact = numpy.isfinite(acc).all()  # else the strip, output by output
                for t in range(tiles):  # the lanes' D layout
                    for lane in range(32):
                        g, q = lane // 4, lane % 4
                        for e in range(4):
                            i, n = g + (e >> 1) * 8, 2 * q + (e & 1)
                            y, x = row0 + i, (tile0 + t) * 8 + n
                            if y >= out_rows or x >= dst_w:
                                continue
                            value = acc[t, i, n]
                            if not exact:
                                window = images[p, stride * y : stride * y + k,
                                                stride * x + shift : stride * x + shift + k]
                                assert window.shape == (k, k), "a recomputed window past the image"
                                with numpy.errstate(invalid="ignore", over="ignore"):
                                    value = bias_value + (window * w).sum()
                            assert not written[planes[p], out_row0 + y, x], "an output staged twice"
                            written[planes[p], out_row0 + y, x] = True
                            dst[planes[p], out_row0 + y, x] = value
