"""What kernels/depthwise_nhwc_wgrad.cu computes for a launch of
_depthwise_nhwc_wgrad.plan: a NumPy transcription of its index math and
summation order, used by tests/test_compile.py (CPU) and the wider sweep in
the notes.  Per block (blockIdx.x = channel block * groups + tap group,
blockIdx.y = split) and spatial worker, the threads' channels are one
vector (ctl * CT + lane * LC + l covers the block's CTB * CT channels in
order); everything else follows the kernel loop by loop: the unit range and
the worker stride, the unit decode, the column masks, the row cursors (the
next x row and grad_out row, advanced one row per load whether read or not:
the flat offsets the kernel's pointers hold), the prefetch order (PF: step
j + 1 loaded in step j), the ring rows with their slots ((ph*S + kh) % KR,
the walk unrolled by P, or 2P with PF where P = 3), the zero fill (rows
outside the image, the prefetch past the last row, masked columns), the
tap-group mask, the reduction red[w][kh][kw][channel] summed over w in
order, the partial stores.  float64 throughout; a ring slot read before it
is written is NaN and poisons the result; every global read asserts that
its flat offset is the (n, row, column, channel) element and lies inside
the array.  The kernel's interior walk (no column masks, taken per warp)
reads the same values as the masked one, so only the latter is here."""

import math

import numpy


def _template(expression):
    args = expression[expression.index("<") + 1 : -1].split(", ")
    itemsize = {"float": 4, "__half": 2, "__nv_bfloat16": 2, "double": 8}[args[0]]
    k, s, lc, kr, tw = (int(v) for v in args[1:6])
    return itemsize, k, s, lc, kr, tw, int(args[6])


def emulate(launch, grad_out, x):
    """(partial, writes, visits): partial[split][tap][c] (NaN where never
    written), how often each was written, and how often each (grid.x, unit)
    was walked.  ``grad_out``: (N, OH, OW, C), ``x``: (N, H, W, C)."""
    (height, width, channels, out_h, out_w, pad_top, pad_left, x_w_limit, row_strip, row_strips, col_strips, units,
     per_split, ctb, groups) = (int(v) for v in launch.scalars)
    itemsize, k, s, lc, kr, tw, prefetch = _template(launch.expression)
    ct = 32 // itemsize
    lanes = ct // lc
    iw_cols = (tw - 1) * s + k
    period = kr // math.gcd(kr, s)
    new0 = kr - s if kr > s else 0
    # The walk's unroll: the slot period, doubled where odd and 3 with the prefetch.
    unroll = 2 * period if prefetch and period % 2 and 2 * period <= 6 else period
    grid_x, splits = launch.grid[0], launch.grid[1]
    threads = launch.block[0]
    chb = ctb * ct
    workers = threads // (lanes * ctb)
    batch = x.shape[0]
    assert threads == 256 and workers * lanes * ctb == threads
    assert launch.shared_mem == workers * kr * k * chb * 4
    assert x.shape == (batch, height, width, channels) and grad_out.shape == (batch, out_h, out_w, channels)
    assert units == batch * row_strips * col_strips and row_strips * row_strip >= out_h > (row_strips - 1) * row_strip
    assert col_strips * tw >= out_w > (col_strips - 1) * tw
    assert grid_x == -(-channels // chb) * groups and groups * kr >= k > (groups - 1) * kr
    x64, g64 = x.astype(numpy.float64), grad_out.astype(numpy.float64)
    xf, gf = x64.reshape(-1), g64.reshape(-1)  # flat, as the kernel's pointers see them
    partial = numpy.full((splits, k * k, channels), numpy.nan)
    writes = numpy.zeros(partial.shape, numpy.int64)
    visits = numpy.zeros((grid_x, units), numpy.int64)
    kw_t = numpy.arange(tw)[None, :] * s + numpy.arange(k)[:, None]  # [kw][t] ring column

    for bx in range(grid_x):
        channel_block = bx // groups
        kh0 = (bx - channel_block * groups) * kr
        rows_here = min(kr, k - kh0)
        c_all = channel_block * chb + numpy.arange(chb)
        active = c_all < channels  # whole tiles: a thread's LC channels share it
        c = c_all[active]
        for split in range(splits):
            begin = split * per_split
            end = min(units, begin + per_split)
            assert begin < end, "empty split"
            red = numpy.full((workers, kr, k, chb), numpy.nan)
            for worker in range(workers):
                acc = numpy.zeros((kr, k, chb))
                u = begin + worker
                while active.any() and u < end:
                    visits[bx, u] += 1
                    n, rest = divmod(u, row_strips * col_strips)
                    rs, cs = divmod(rest, col_strips)
                    oh0 = rs * row_strip
                    oh1 = min(oh0 + row_strip, out_h)
                    ow0 = cs * tw
                    iw0 = ow0 * s - pad_left
                    ih_first = oh0 * s - pad_top + kh0
                    x_cols = [0 <= iw0 + e < x_w_limit for e in range(iw_cols)]
                    g_cols = [ow0 + t < out_w for t in range(tw)]
                    rows = oh1 - oh0
                    ring = numpy.full((kr, iw_cols, chb), numpy.nan)
                    # The row cursors: next x row (input row, flat element
                    # offset of its column iw0 less the channel) and next
                    # grad_out row (flat offset); the kernel's pointers.
                    x_cur = [ih_first, ((n * height + ih_first) * width + iw0) * channels]
                    g_cur = [oh0, ((n * out_h + oh0) * out_w + ow0) * channels]

                    def next_x_row(r, live):
                        """Raw values of ring row r from the x cursor (a row
                        outside the image, not live, or a masked column:
                        the zero word)."""
                        ih, off = x_cur
                        assert ih == ih_first + r, "the steps load consecutive rows"
                        ok = live and 0 <= ih < height
                        raw = numpy.zeros((iw_cols, chb))
                        for e in range(iw_cols):
                            if ok and x_cols[e]:  # p + e * step
                                flat = off + e * channels + c
                                assert 0 <= iw0 + e < width and flat.min() >= 0 and flat.max() < xf.size
                                assert (flat == ((n * height + ih) * width + iw0 + e) * channels + c).all()
                                raw[e, active] = xf[flat]
                                raw[e, ~active] = numpy.nan  # never loaded (inactive threads)
                        x_cur[0] += 1
                        x_cur[1] += width * channels
                        return raw

                    def next_g_row(j, live):
                        oh, off = g_cur
                        assert oh == oh0 + j
                        raw = numpy.zeros((tw, chb))
                        for t in range(tw):
                            if live and g_cols[t]:
                                assert oh < out_h
                                flat = off + t * channels + c
                                assert flat.min() >= 0 and flat.max() < gf.size
                                raw[t, active] = gf[flat]
                        g_cur[0] += 1
                        g_cur[1] += out_w * channels
                        return raw

                    def load_step(j):
                        live = j < rows
                        return [next_x_row(j * s + new0 + q, live) for q in range(kr - new0)], next_g_row(j, live)

                    # The interior walk (every column valid) and the edge
                    # walk read the same values; the kernel picks one per
                    # warp, so both are the masked reads here.
                    for r in range(new0):
                        ring[r] = next_x_row(r, True)
                    following = load_step(0) if prefetch else None
                    j0 = 0
                    while j0 < rows:
                        for ph in range(unroll):
                            j = j0 + ph
                            if j >= rows:
                                break
                            if prefetch:
                                (xr, g), following = following, load_step(j + 1)
                            else:
                                xr, g = load_step(j)
                            for q, raw in enumerate(xr):
                                ring[(ph * s + new0 + q) % kr] = raw
                            assert 0 <= oh0 + j < out_h
                            for kh in range(kr):
                                if kh >= rows_here:
                                    break
                                window = ring[(ph * s + kh) % kr][kw_t]  # [kw][t][channel]
                                for t in range(tw):  # the kernel's order: t innermost per (kh, kw)
                                    acc[kh] += g[t] * window[:, t]
                        j0 += unroll
                    u += workers
                red[worker] = acc
            # One thread per (tap, channel) entry sums the workers in order.
            for tap in range(kr * k):
                kh = tap // k
                if kh >= rows_here:
                    continue
                total = numpy.zeros(chb)
                for w in range(workers):
                    total = total + red[w].reshape(kr * k, chb)[tap]
                partial[split, kh0 * k + tap, c] = total[active]
                writes[split, kh0 * k + tap, c] += 1
    return partial, writes, visits


def finalize(partial):
    """grad_weight (C, 1, K, K) from partial[split][tap][c]: splits in order."""
    splits, taps, channels = partial.shape
    k = math.isqrt(taps)
    total = numpy.zeros((taps, channels))
    for split in range(splits):
        total = total + partial[split]
    return total.T.reshape(channels, 1, k, k)
