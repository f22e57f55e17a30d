"""What kernels/depthwise_nchw_wgrad_regs.cu computes for a launch of
_depthwise_nchw_wgrad_regs.plan: a NumPy transcription of its index math,
used by tests/test_compile.py (CPU).  Per block (blockIdx.x = channel,
blockIdx.y = split), warp and lane group, the lanes of the group are a
vector axis; everything else follows the kernel loop by loop: the unit
range and the worker stride, the unit decode (n, row strip, segment), each
lane's ow0 / live / own x column base ob, the own-vector and halo masks
(from_lane / direct), the walk over input rows j with the grad_out ring
(slot ((ph - kh) / S) mod R, ph = j mod P), the halo taken from lane
gl + floor(d / VS) of the group (asserted to be inside it) or loaded
directly, the FMA conditions (live, x row inside the image, 0 <= j - kh <
rows * S), the warp then block reduction and the partial stores.  float64
throughout; a ring slot read before it is written is NaN and poisons the
result; every global read asserts that its (row, column) lies inside the
plane."""

import math

import numpy


def _template(expression):
    args = expression[expression.index("<") + 1 : -1].split(", ")
    itemsize = {"float": 4, "__half": 2, "__nv_bfloat16": 2}[args[0]]
    k, s, vw = (int(v) for v in args[1:4])
    return itemsize, k, s, vw


def emulate(launch, grad_out, x):
    """(partial, writes, visits): partial[split][tap][c] (NaN where never
    written), how often each was written, and how often each (channel,
    unit) was walked.  ``grad_out``: (N, C, OH, OW), ``x``: (N, C, H, W)."""
    (height, width, channels, out_h, out_w, pad_top, pad_left, row_strip, row_strips, segments, group_lanes, units,
     per_split) = (int(v) for v in launch.scalars)
    itemsize, k, s, vw = _template(launch.expression)
    vs = vw * s
    sh = k // 2
    iw_cols = (vw - 1) * s + k
    nh = iw_cols - vs
    slots = -(-k // s)
    period = slots * s
    threads = launch.block[0]
    warps = threads // 32
    groups_per_warp = 32 // group_lanes
    workers = warps * groups_per_warp
    grid_x, splits = launch.grid[0], launch.grid[1]
    batch = x.shape[0]
    assert threads == 128 and launch.shared_mem == 0 and grid_x == channels
    assert 1 <= group_lanes <= 32 and vw * itemsize <= 16
    assert x.shape == (batch, channels, height, width) and grad_out.shape == (batch, channels, out_h, out_w)
    assert out_w % vw == 0 and width % vw == 0 and (pad_left - sh) % vw == 0
    assert units == batch * row_strips * segments and row_strips * row_strip >= out_h > (row_strips - 1) * row_strip
    assert segments * group_lanes * vw >= out_w > (segments - 1) * group_lanes * vw  # dead lanes: last segment
    x64, g64 = x.astype(numpy.float64), grad_out.astype(numpy.float64)
    partial = numpy.full((splits, k * k, channels), numpy.nan)
    writes = numpy.zeros(partial.shape, numpy.int64)
    visits = numpy.zeros((channels, units), numpy.int64)
    gl = numpy.arange(group_lanes)
    halo_e = [h if h < sh else h + vs for h in range(nh)]

    for c in range(channels):
        for split in range(splits):
            begin = split * per_split
            end = min(units, begin + per_split)
            assert begin < end, "empty split"
            red = numpy.zeros((warps, k, k))
            for warp in range(warps):
                warp_acc = numpy.zeros((k, k))
                for group in range(groups_per_warp):
                    worker = warp * groups_per_warp + group
                    acc = numpy.zeros((group_lanes, k, k))
                    for u in range(begin + worker, end, workers):
                        visits[c, u] += 1
                        n, rest = divmod(u, row_strips * segments)
                        rs, seg = divmod(rest, segments)
                        oh0 = rs * row_strip
                        rows = min(row_strip, out_h - oh0)
                        steps = (rows - 1) * s + k
                        ow0 = (seg * group_lanes + gl) * vw
                        live = ow0 < out_w
                        ob = ow0 * s - pad_left + sh
                        ih0 = oh0 * s - pad_top
                        own_ok = [(0 <= ob + v * vw) & (ob + v * vw < width) for v in range(s)]
                        from_lane, direct, src = [], [], []
                        for e in halo_e:
                            d = e - sh
                            lane_src = gl + d // vs  # Python floor division: the kernel's floor_div
                            inside = (lane_src >= 0) & (lane_src < group_lanes)
                            from_lane.append(inside)
                            direct.append(~inside & (ob + d >= 0) & (ob + d < width))
                            src.append(lane_src)
                        ring = numpy.full((slots, group_lanes, vw), numpy.nan)
                        for j in range(steps):
                            ph = j % period
                            ih = ih0 + j
                            row_ok = 0 <= ih < height
                            # Own columns, as loaded (zero where not loaded).
                            own = numpy.zeros((group_lanes, vs))
                            for v in range(s):
                                for lane in gl[own_ok[v]] if row_ok else []:
                                    cols = ob[lane] + v * vw + numpy.arange(vw)
                                    assert 0 <= cols[0] and cols[-1] < width
                                    own[lane, v * vw:(v + 1) * vw] = x64[n, c, ih, cols]
                            window = numpy.full((group_lanes, iw_cols), numpy.nan)
                            window[:, sh:sh + vs] = own
                            for h, e in enumerate(halo_e):
                                d = e - sh
                                se = d - (d // vs) * vs
                                for lane in gl:
                                    if from_lane[h][lane]:
                                        window[lane, e] = own[src[h][lane], se]  # __shfl_sync from that lane
                                    elif direct[h][lane] and row_ok:
                                        col = ob[lane] + d
                                        assert 0 <= col < width
                                        window[lane, e] = x64[n, c, ih, col]
                                    else:
                                        window[lane, e] = 0.0
                            if ph % s == 0:
                                m = j // s
                                ring[(ph // s) % slots] = 0.0
                                if m < rows:
                                    for lane in gl[live]:
                                        assert oh0 + m < out_h and ow0[lane] + vw <= out_w
                                        ring[(ph // s) % slots, lane] = g64[n, c, oh0 + m, ow0[lane]:ow0[lane] + vw]
                            for kh in range(k):
                                if (ph - kh) % s:
                                    continue
                                slot = ((ph - kh) // s) % slots
                                if not (row_ok and j >= kh and j - kh < rows * s):
                                    continue
                                assert (j - kh) // s < rows
                                for kw in range(k):
                                    xs = window[:, kw:kw + (vw - 1) * s + 1:s]  # [lane][t]
                                    products = (ring[slot] * xs).sum(axis=1)
                                    acc[live, kh, kw] += products[live]
                    warp_acc += acc.sum(axis=0)
                red[warp] = warp_acc
            partial[split, :, c] = red.sum(axis=0).reshape(k * k)
            writes[split, :, c] += 1
    return partial, writes, visits


def finalize(partial):
    """grad_weight (C, 1, K, K) from partial[split][tap][c]: splits in order."""
    splits, taps, channels = partial.shape
    k = math.isqrt(taps)
    total = numpy.zeros((taps, channels))
    for split in range(splits):
        total = total + partial[split]
    return total.T.reshape(channels, 1, k, k)
