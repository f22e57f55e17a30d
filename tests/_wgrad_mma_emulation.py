"""What kernels/depthwise_wgrad_mma.cu computes for a launch of
_depthwise_wgrad_mma.plan: a NumPy transcription of its index math, used by
tests/test_compile.py (CPU).  Per block (blockIdx.x = channel group,
blockIdx.y = split) the raw copies of every image (NCHW: the group's planes
as one flat range in pieces of ``piece`` bytes; NHWC: one 8-channel vector
per pixel, each read asserted to lie inside the array) through the ring of
``stages`` raw buffers (_Ring: a buffer refilled only after its image was
worked on, read only after its copies landed), then the (chunk,
input row) units dealt to the 8 warps (unit u to warp u % 8), each running
all 8 channels with the lanes' fragments assembled into A (16x16) and B
(16x8) by the PTX layout of mma.m16n8k16 (lane = 4 g + t: a0 =
A[g][2t..2t+1], a2 = A[g][2t+8..2t+9], b0 = B[2t..2t+1][g], b1 =
B[2t+8..2t+9][g], d0/d1 = D[g][2t..2t+1]) from the raw buffer's offsets
(zero where the kernel's load predicates are off), the border rows' fresh
product added where the lane's row is real, the warps' sums added in warp
order, the filter rows made NaN by a non-finite grad_out value in the
A rows of the first and last input row's tiles (rows below / above it meet
padding rows), the partial stores.  float64 sums (the kernel's are float32);
partial entries never written stay NaN."""

import numpy


def _template(expression):
    args = expression[expression.index("<") + 1 : -1].split(", ")
    return int(args[1]), args[2] == "true"


def emulate(launch, grad_out, x):
    """partial[split][tap][c] (NaN where never written).  ``grad_out`` and
    ``x`` in the launch's layout (NCHW: (N, C, OH, OW) / (N, C, H, W); NHWC:
    (N, OH, OW, C) / (N, H, W, C))."""
    (height, width, channels, out_h, out_w, pad_top, pad_left, images, per_split, chunks, piece,
     stages) = (int(v) for v in launch.scalars)
    k, nhwc = _template(launch.expression)
    warps = 8
    assert launch.block[0] == 32 * warps
    grid_x, splits = launch.grid[0], launch.grid[1]
    assert grid_x == -(-channels // warps) and splits * per_split >= images > (splits - 1) * per_split
    assert chunks * 16 >= out_w > (chunks - 1) * 16
    assert nhwc or out_w % 2 == 0
    x_plane, dy_plane = height * width, out_h * out_w
    assert 2 <= stages <= 8
    assert launch.shared_mem == max(stages * warps * (x_plane + dy_plane) * 2, warps * warps * 32 * 8)
    xf, gf = x.astype(numpy.float64).reshape(-1), grad_out.astype(numpy.float64).reshape(-1)
    partial = numpy.full((splits, k * k, channels), numpy.nan)
    r_begin, r_end = max(pad_top, 0), min(height + pad_top, out_h + k - 1)
    rows = max(0, r_end - r_begin)
    lanes = numpy.arange(32)
    g, t = lanes // 4, lanes % 4
    for bx in range(grid_x):
        c0 = bx * warps
        group = min(warps, channels - c0)
        for split in range(splits):
            acc = numpy.zeros((warps, warps, 32, 2))  # [warp][channel][lane][d0, d1]
            poisoned = [0] * warps  # per channel: filter rows made NaN through padding rows
            n_begin, n_end = split * per_split, min(images, (split + 1) * per_split)
            ring = _Ring(stages, n_begin)
            for s in range(stages - 1):  # the prologue: one commit each, empty past the split
                ring.commit([ring.issue(n_begin + s, None)] if n_begin + s < n_end else [])
            for n in range(n_begin, n_end):
                ring.wait(stages - 2)  # then the barrier
                ring.commit([ring.issue(n + stages - 1, n)] if n + stages - 1 < n_end else [])
                ring.read(n)
                raw_x, raw_dy = _stage(xf, gf, n, c0, group, channels, x_plane, dy_plane, piece, nhwc)
                for unit in range(rows * chunks):
                    chunk, r = divmod(unit, rows)
                    _products(acc[unit % warps], poisoned, raw_x, raw_dy, chunk, r_begin + r, k, height, width, out_h,
                              out_w, pad_top, pad_left, group, nhwc, g, t)
            for c in range(group):
                total = acc[0, c].copy()
                for w in range(1, warps):
                    total += acc[w, c]
                for lane in range(32):
                    for e in range(2):
                        j = 2 * t[lane] + e
                        if g[lane] < k and j < k:
                            nan = (poisoned[c] >> g[lane]) & 1
                            partial[split, g[lane] * k + j, c0 + c] = numpy.nan if nan else total[lane, e]
    return partial


class _Ring:
    """The raw buffers' bookkeeping, as the kernel orders it: image m's
    copies go to buffer (m - n_begin) % stages, one cp.async group per
    commit; wait(k) completes every group but the newest k
    (cp.async.wait_group k).  Asserts that a buffer is refilled only after
    its image was worked on, and read only when its own image's copies have
    landed."""

    def __init__(self, stages, n_begin):
        self.stages, self.n_begin = stages, n_begin
        self.holds = [None] * stages  # image in each buffer
        self.landed = [False] * stages
        self.groups = []

    def issue(self, image, current):
        slot = (image - self.n_begin) % self.stages
        held = self.holds[slot]
        assert held is None or (current is not None and held < current), (image, held, current)
        self.holds[slot], self.landed[slot] = image, False
        return slot

    def commit(self, slots):
        self.groups.append(slots)

    def wait(self, pending):
        while len(self.groups) > max(pending, 0):
            for slot in self.groups.pop(0):
                self.landed[slot] = True

    def read(self, image):
        slot = (image - self.n_begin) % self.stages
        assert self.holds[slot] == image and self.landed[slot], (image, self.holds[slot], self.landed[slot])


def _stage(xf, gf, n, c0, group, channels, x_plane, dy_plane, piece, nhwc):
    """The raw buffer's x and grad_out parts for image n, read piece by piece
    at the kernel's flat offsets."""
    warps = 8
    raw_x, raw_dy = numpy.full(warps * x_plane, numpy.nan), numpy.full(warps * dy_plane, numpy.nan)
    for raw, flat, plane in ((raw_x, xf, x_plane), (raw_dy, gf, dy_plane)):
        if nhwc:
            for p in range(plane):
                start = (n * plane + p) * channels + c0
                assert start + warps <= flat.size
                raw[p * warps : (p + 1) * warps] = flat[start : start + warps]
        else:
            start = (n * channels + c0) * plane
            values = group * plane
            step = piece // 2
            assert values % step == 0 and start % step == 0 and start + values <= flat.size
            for offset in range(0, values, step):
                raw[offset : offset + step] = flat[start + offset : start + offset + step]
    return raw_x, raw_dy


def _products(acc, poisoned, raw_x, raw_dy, chunk, r, k, height, width, out_h, out_w, pad_top, pad_left, group, nhwc,
              g, t):
    """One unit (chunk, input row r) of one warp: every channel's product;
    in the first and last input row's tiles, the filter rows below (top) or
    above (bottom) an A row with a non-finite value are flagged in
    ``poisoned[channel]``."""
    x_plane, dy_plane = height * width, out_h * out_w
    h = r - pad_top
    interior = k - 1 <= r < out_h
    for c in range(group):
        a = numpy.zeros((16, 16))
        b = numpy.zeros((16, 8))
        row_ok = (g < k) & (r - g >= 0) & (r - g < out_h)
        for lane in range(32):
            gl, k0 = g[lane], chunk * 16 + 2 * t[lane]
            for d in (0, 1, 8, 9):
                kk = k0 + d
                if row_ok[lane] and kk < out_w:
                    p = (r - gl) * out_w + kk
                    a[gl, kk - 16 * chunk] = raw_dy[p * 8 + c if nhwc else c * dy_plane + p]
                w = kk + gl - pad_left
                if kk < out_w and 0 <= w < width:
                    p = h * width + w
                    b[kk - 16 * chunk, gl] = raw_x[p * 8 + c if nhwc else c * x_plane + p]
        for row in range(k):
            if not numpy.isfinite(a[row]).all():
                if h == 0:
                    poisoned[c] |= (1 << row) - 1
                if h == height - 1:
                    poisoned[c] |= ((1 << k) - 1) & ~((2 << row) - 1)
        with numpy.errstate(invalid="ignore", over="ignore"):
            d = a @ b
        d = numpy.stack([d[g, 2 * t], d[g, 2 * t + 1]], axis=1)  # [lane][d0, d1]
        acc[c] += d if interior else numpy.where(row_ok[:, None], d, 0.0)
