"""What kernels/depthwise_nchw_wgrad_regs.cu computes for a launch of
_depthwise_nchw_wgrad_regs.plan: a NumPy transcription of its index math,
used by tests/test_compile.py (CPU).  Per block (blockIdx.x = channel,
blockIdx.y = split), warp and lane group, the lanes of the group are a
vector axis; everything else follows the kernel loop by loop: the unit
range and the worker stride, the unit decode (n, row strip, segment), each
lane's ow0 / live / own x column base ob, the own-vector and halo masks
(from_lane / direct), the row cursors (the flat offsets the kernel's x and
grad_out pointers hold, advanced one row per load whether read or not,
asserted against the element each read should be), the walk in blocks of
PB steps from step -SHIFT with the clean blocks (no tests; the kernel takes
one where every lane of the warp is clean, here where every lane of the
group is, or per ``clean_blocks``) and their loads (the conditions they
do not test asserted to hold), the loads L steps ahead (lookahead) in NB
raw buffers (L for 2-byte types, L + 1 for float; PB = lcm(P, NB) with
L >= 2, else P, float's second buffer copied to the first at a block's
end when P is odd), the grad_out ring (slot ((q - kh) / S) mod R,
q = j mod PB), the halo
taken from lane gl + floor(d / VS) of the group (asserted to be inside it)
or loaded directly, the FMA conditions (live, x row inside the image,
0 <= j - kh < rows * S), the warp then block reduction and the partial
stores.  float64 throughout.  A raw value the kernel leaves unspecified
(a load skipped for a row outside the image or past the walk, or a
grad_out row past the strip or of a dead lane: the kernel keeps the
register's old value, or zero for float) is NaN here, as is a ring slot
read before it is written, so using one poisons the result; a load never
issued in the unit (a column outside [0, W)) leaves the zero the kernel
set at the unit's start."""

import math

import numpy


def _template(expression):
    args = expression[expression.index("<") + 1 : -1].split(", ")
    itemsize = {"float": 4, "__half": 2, "__nv_bfloat16": 2}[args[0]]
    k, s, vw = (int(v) for v in args[1:4])
    return itemsize, k, s, vw


def lookahead(itemsize, k, s, vw):
    """Steps of loads in flight (kernel: dwgn_nchw_regs::lookahead)."""
    if itemsize == 2 and k == 3 and s == 1 and vw == 4:
        return 3
    one = k == 7 or (itemsize == 4 and k == 3 and s == 2) or (itemsize == 4 and k == 5 and vw == 1) or (
        itemsize == 2 and k == 3 and s == 1 and vw in (2, 8))
    return 1 if one else 2


def emulate(launch, grad_out, x, clean_blocks="group"):
    """(partial, writes, visits): partial[split][tap][c] (NaN where never
    written), how often each was written, and how often each (channel,
    unit) was walked.  ``grad_out``: (N, C, OH, OW), ``x``: (N, C, H, W).
    ``clean_blocks``: "group" (a block is clean where every lane of the
    group is), "never", or "alternate" (every other block that could be)."""
    (height, width, channels, out_h, out_w, pad_top, pad_left, row_strip, row_strips, segments, group_lanes, units,
     per_split) = (int(v) for v in launch.scalars)
    itemsize, k, s, vw = _template(launch.expression)
    vs = vw * s
    sh = k // 2
    iw_cols = (vw - 1) * s + k
    nh = iw_cols - vs
    slots = -(-k // s)
    ahead = lookahead(itemsize, k, s, vw)  # L
    buffers = ahead + 1 if itemsize == 4 else ahead  # NB
    period = slots * s  # P: the ring slots repeat
    if ahead > 1:
        period = period // math.gcd(period, buffers) * buffers  # PB: steps per block
    shift = (1 - k) % period  # SHIFT: the walk starts at step -shift
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
    assert clean_blocks in ("group", "never", "alternate")
    xf = x.astype(numpy.float64).reshape(-1)  # flat, as the kernel's pointers see them
    gf = grad_out.astype(numpy.float64).reshape(-1)
    partial = numpy.full((splits, k * k, channels), numpy.nan)
    writes = numpy.zeros(partial.shape, numpy.int64)
    visits = numpy.zeros((channels, units), numpy.int64)
    gl = numpy.arange(group_lanes)
    halo_e = [h if h < sh else h + vs for h in range(nh)]
    # Lane constants: halo h comes from lane gl + floor(d / VS) where that
    # lane is in the group (from_lane).
    from_lane = [((gl + (e - sh) // vs) >= 0) & ((gl + (e - sh) // vs) < group_lanes) for e in halo_e]
    # What the walks did: clean and tested blocks, and a clean block's
    # prefetch finding the next x row outside the image or the next
    # grad_out row past the strip (its last step's).
    blocks_seen = {"clean": 0, "tested": 0, "clean_row_outside": 0, "clean_g_past": 0}

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
                        plane = n * channels + c
                        x_base, g_base = plane * height * width, plane * out_h * out_w
                        own_ok = [(0 <= ob + v * vw) & (ob + v * vw < width) for v in range(s)]
                        direct = [~from_lane[h] & (ob + e - sh >= 0) & (ob + e - sh < width)
                                  for h, e in enumerate(halo_e)]
                        plain = live & numpy.logical_and.reduce(own_ok) & ~numpy.logical_or.reduce(direct)
                        jc0 = numpy.where(plain, max(k - 1, -ih0), steps)
                        jc1 = min(rows * s, height - ih0)
                        # Row cursors: x_at (flat offset of input row ih0 + j,
                        # column ob, for the next step j to load) and g_at
                        # (grad_out row oh0 + j / S, column ow0).
                        cursor = {"x": x_base + ih0 * width + ob, "g": g_base + oh0 * out_w + ow0}
                        xr = numpy.zeros((buffers, s, group_lanes, vw))  # zeroed at the unit's start
                        hr = numpy.zeros((buffers, nh, group_lanes))
                        gr = numpy.full((buffers, group_lanes, vw), numpy.nan)
                        ring = numpy.full((slots, group_lanes, vw), numpy.nan)

                        def load_step(b, j, g_step, clean):
                            """The raw loads of step j into buffer b (the
                            kernel's load_step; clean: a clean block's)."""
                            row_in = 0 <= ih0 + j < height
                            if clean:  # what a clean block does not test holds (j < steps: with L = 1)
                                assert plain.all() and (j < steps or ahead > 1)
                            row_ok = ((clean and ahead == 1) or j < steps) and row_in
                            blocks_seen["clean_row_outside"] += clean and not row_in
                            blocks_seen["clean_g_past"] += clean and g_step and j >= rows * s
                            for v in range(s):
                                ok = row_ok & (True if clean else own_ok[v]) & numpy.ones(group_lanes, bool)
                                cols = ob[:, None] + v * vw + numpy.arange(vw)
                                flat = cursor["x"][:, None] + v * vw + numpy.arange(vw)
                                for lane in gl[ok]:
                                    assert 0 <= ih0 + j < height and 0 <= cols[lane, 0] and cols[lane, -1] < width
                                    assert (flat[lane] == x_base + (ih0 + j) * width + cols[lane]).all()
                                    xr[b, v, lane] = xf[flat[lane]]
                                xr[b, v, ~ok & own_ok[v]] = numpy.nan  # skipped for the row: unspecified
                            if not clean:
                                for h, e in enumerate(halo_e):
                                    ok = row_ok & direct[h]
                                    for lane in gl[ok]:
                                        col = ob[lane] + e - sh
                                        assert 0 <= ih0 + j < height and 0 <= col < width
                                        assert cursor["x"][lane] + e - sh == x_base + (ih0 + j) * width + col
                                        hr[b, h, lane] = xf[cursor["x"][lane] + e - sh]
                                    hr[b, h, ~ok & direct[h]] = numpy.nan
                            cursor["x"] = cursor["x"] + width
                            if g_step:
                                assert j % s == 0
                                ok = (numpy.ones(group_lanes, bool) if clean else live) & (j < rows * s)
                                for lane in gl[ok]:
                                    assert j // s < rows and ow0[lane] + vw <= out_w
                                    flat = cursor["g"][lane] + numpy.arange(vw)
                                    assert (flat == g_base + (oh0 + j // s) * out_w + ow0[lane] + numpy.arange(vw)).all()
                                    gr[b, lane] = gf[flat]
                                gr[b, ~ok] = numpy.nan
                                cursor["g"] = cursor["g"] + out_w

                        for jj in range(ahead):  # step jj: phase shift + jj of its block
                            load_step((shift + jj) % buffers, jj, jj % s == 0, False)
                        jb, block = -shift, 0
                        while jb < steps:
                            clean = bool(((jb >= jc0) & (jb + period <= jc1)).all())
                            if clean_blocks == "never" or (clean_blocks == "alternate" and block % 2):
                                clean = False
                            blocks_seen["clean" if clean else "tested"] += 1
                            for ph in range(period):
                                j = jb + ph
                                if not clean and ph < shift and j < 0:
                                    continue
                                if j >= steps:
                                    break
                                q = ph - shift  # j = q (mod P)
                                assert (j - q) % period == 0
                                cur, nxt = ph % buffers, (ph + ahead) % buffers
                                # Unpack, then step j + L's loads (into buffer
                                # nxt: for 2-byte types the one just unpacked,
                                # for float step j - 1's).
                                own = xr[cur].transpose(1, 0, 2).reshape(group_lanes, vs).copy()
                                direct_value = hr[cur].copy() if not clean else numpy.zeros((nh, group_lanes))
                                if q % s == 0:
                                    ring[(q // s) % slots] = gr[cur]
                                load_step(nxt, j + ahead, (q + ahead) % s == 0, clean)
                                window = numpy.full((group_lanes, iw_cols), numpy.nan)
                                window[:, sh:sh + vs] = own
                                for h, e in enumerate(halo_e):
                                    d = e - sh
                                    delta = d // vs  # Python floor division: the kernel's floor_div
                                    se = d - delta * vs
                                    for lane in gl:
                                        if from_lane[h][lane]:
                                            assert 0 <= lane + delta < group_lanes
                                            window[lane, e] = own[lane + delta, se]  # shuffled from lane + delta
                                        else:
                                            window[lane, e] = direct_value[h][lane]
                                row_in = 0 <= ih0 + j < height
                                for kh in range(k):
                                    if (q - kh) % s:
                                        continue
                                    slot = ((q - kh) // s) % slots
                                    if clean:
                                        assert live.all() and row_in and j >= kh and j - kh < rows * s
                                        lanes = live
                                    elif row_in and j >= kh and j - kh < rows * s:
                                        lanes = live
                                    else:
                                        continue
                                    assert (j - kh) // s < rows
                                    for kw in range(k):
                                        xs = window[:, kw:kw + (vw - 1) * s + 1:s]  # [lane][t]
                                        products = (ring[slot] * xs).sum(axis=1)
                                        acc[lanes, kh, kw] += products[lanes]
                            if period % buffers:  # float, L = 1, odd P: the next block starts with buffer 0
                                xr[0], hr[0], gr[0] = xr[1].copy(), hr[1].copy(), gr[1].copy()
                            jb += period
                            block += 1
                    warp_acc += acc.sum(axis=0)
                red[warp] = warp_acc
            partial[split, :, c] = red.sum(axis=0).reshape(k * k)
            writes[split, :, c] += 1
    emulate.blocks_seen = blocks_seen
    return partial, writes, visits


def finalize(partial):
    """grad_weight (C, 1, K, K) from partial[split][tap][c]: splits in order."""
    splits, taps, channels = partial.shape
    k = math.isqrt(taps)
    total = numpy.zeros((taps, channels))
    for split in range(splits):
        total = total + partial[split]
    return total.T.reshape(channels, 1, k, k)
