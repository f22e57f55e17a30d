"""What kernels/depthwise_nhwc_wgrad.cu computes for a launch of
_depthwise_nhwc_wgrad.plan: a NumPy transcription of its index math and
summation order, used by tests/test_compile.py (CPU) and the wider sweep in
the notes.  Per block (blockIdx.x = channel block * groups + tap group,
blockIdx.y = split) and spatial worker, the threads' channels are one
vector (ctl * CT + lane * LC + l covers the block's CTB * CT channels in
order); everything else follows the kernel loop by loop: the unit range and
the worker stride, the unit decode, the column masks, the ring rows with
their slots ((ph*S + kh) % KR, the walk unrolled by P), the zero fill, the
tap-group mask, the reduction red[w][kh][kw][channel] summed over w in
order, the partial stores.  float64 throughout; a ring slot read before it
is written is NaN and poisons the result; every global read asserts that
its (n, row, column, channel) lies inside the array."""

import math

import numpy


def _template(expression):
    args = expression[expression.index("<") + 1 : -1].split(", ")
    itemsize = {"float": 4, "__half": 2, "__nv_bfloat16": 2, "double": 8}[args[0]]
    k, s, lc, kr, tw = (int(v) for v in args[1:6])
    return itemsize, k, s, lc, kr, tw, args[6]


def emulate(launch, grad_out, x):
    """(partial, writes, visits): partial[split][tap][c] (NaN where never
    written), how often each was written, and how often each (grid.x, unit)
    was walked.  ``grad_out``: (N, OH, OW, C), ``x``: (N, H, W, C)."""
    (height, width, channels, out_h, out_w, pad_top, pad_left, x_w_limit, row_strip, row_strips, col_strips, units,
     per_split, ctb, groups) = (int(v) for v in launch.scalars)
    itemsize, k, s, lc, kr, tw, _ = _template(launch.expression)
    ct = 32 // itemsize
    lanes = ct // lc
    iw_cols = (tw - 1) * s + k
    period = kr // math.gcd(kr, s)
    new0 = kr - s if kr > s else 0
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
                    ring = numpy.full((kr, iw_cols, chb), numpy.nan)

                    def load_row(slot, r):
                        ih = ih_first + r
                        row_ok = 0 <= ih < height
                        for e in range(iw_cols):
                            if row_ok and x_cols[e]:
                                assert 0 <= iw0 + e < width
                                ring[slot, e, active] = x64[n, ih, iw0 + e, c]
                                ring[slot, e, ~active] = numpy.nan  # never loaded (inactive threads)
                            else:
                                ring[slot, e] = 0.0

                    for r in range(new0):
                        load_row(r, r)
                    j0 = 0
                    while j0 < oh1 - oh0:
                        for ph in range(period):
                            j = j0 + ph
                            if j >= oh1 - oh0:
                                break
                            for kh in range(new0, kr):
                                load_row((ph * s + kh) % kr, j * s + kh)
                            oh = oh0 + j
                            assert 0 <= oh < out_h
                            g = numpy.zeros((tw, chb))
                            for t in range(tw):
                                if g_cols[t]:
                                    g[t, active] = g64[n, oh, ow0 + t, c]
                            for kh in range(kr):
                                if kh >= rows_here:
                                    break
                                window = ring[(ph * s + kh) % kr][kw_t]  # [kw][t][channel]
                                for t in range(tw):  # the kernel's order: t innermost per (kh, kw)
                                    acc[kh] += g[t] * window[:, t]
                        j0 += period
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
