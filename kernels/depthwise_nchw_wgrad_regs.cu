// Depthwise 2-D convolution, NCHW: weight gradient with the filter taps in
// registers and no shared-memory staging ("register" kernel), square 3x3,
// 5x5 and 7x7 filters, stride S in {1, 2} (both axes), dilation 1, depth
// multiplier 1, any padding, float32, float16 and bfloat16:
//
//   partial[split][tap][c] = sum over this split's (n, oh, ow) of
//       grad_out[n, c, oh, ow] * x[n, c, oh*S - pad_top + kh, ow*S - pad_left + kw]
//
// then the shared finalize kernel (depthwise_conv2d.cu) adds the splits in a
// fixed order: bit-identical results run to run, no atomics.
//
// Why a kernel of its own: dwgn_nchw_wgrad_small (depthwise_nchw_wgrad.cu)
// stages x in shared memory and spends most of its instructions on staging,
// index math and per-item divisions (64x144x56 fp16: 47M warp instructions
// for 8.1M warp FMAs).  Here every x and grad_out value is loaded from
// global memory once per thread, as a vector, and used for every tap:
//
// * Lanes.  A thread owns VW consecutive output columns ow0 .. ow0+VW-1 of one
//   (n, c) plane (VW * sizeof(T) <= 16 bytes; the host picks the widest VW
//   dividing OW, W and pad_left - K/2 that both arrays' alignment allows, so
//   every vector below is aligned and lies wholly inside or outside a row).
//   A lane group = G consecutive lanes covers one row segment of G * VW
//   output columns (G = ceil(OW / VW) split into `segments` equal segments
//   of <= 32 lanes); a warp holds 32 / G groups (idle lanes past them).
//   Lane gl of the group owns ow0 = (segment * G + gl) * VW; a lane with
//   ow0 >= OW (only in a last segment) is "dead": it loads its x columns for
//   its neighbours but multiplies nothing.
// * x columns.  Output column ow0 + t reads input columns
//   (ow0 + t)*S - pad_left + kw, i.e. window column e = t*S + kw of the
//   thread's window of IW = (VW-1)*S + K columns starting at input column
//   ow0*S - pad_left.  The thread loads the VS = VW*S columns starting at
//   ob = ow0*S - pad_left + SH (SH = K/2: window columns SH .. SH+VS-1) as S
//   aligned vectors (ob is a multiple of VW: the host requires
//   (pad_left - SH) % VW == 0).  Window column e = SH + d (halo: d < 0 or
//   d >= VS) is own column d - delta*VS of lane gl + delta, delta =
//   floor(d / VS), fetched by a shuffle (up or down by delta) within the
//   group; when that lane is outside the group (a row or segment edge) the
//   thread loads input column ob + d itself (a scalar load; zero outside
//   [0, W)).
// * Rows.  A work unit is (image n, row strip, segment): output rows
//   oh0 .. oh0+rows-1 (row_strip rows, the last strip shorter).  The group
//   walks the input rows ih = ih0 + j, ih0 = oh0*S - pad_top, j = 0 ..
//   (rows-1)*S + K-1 (every input row a window of the strip reads), loading
//   each once.  Input row j is filter row kh of output row m = (j - kh) / S
//   (relative to oh0) for each kh = j mod S, kh < K with 0 <= j - kh <
//   rows*S.  grad_out row m is loaded at step j = m*S (where its kh = 0
//   pair is) into ring slot m % R, R = ceil(K / S): rows m - R + 1 .. m are
//   the ones any later step still reads (kh <= K-1 < R*S).
// * Loads in flight.  Step j + L's raw loads are issued after step j is
//   unpacked and before its FMAs, L = lookahead(...) steps ahead (2; 1
//   where that spills, as 7x7, whose registers are spent on the taps; 3
//   for 2-byte 3x3 stride 1 VW 4, whose loads are 8 bytes): for
//   2-byte types into the registers just unpacked (L raw buffers), for
//   float into the buffer of step j - 1 (L + 1 buffers: its raw registers
//   are the FMA operands).  Why 2: a thread's loads of one step are 2-3
//   vectors of at most 16 bytes, and with one step in flight an SM had
//   about 10-18 KB of loads outstanding (fp16 64x384x28: 24 warps x 448
//   bytes) where the copy bandwidth needs ~25 KB at ~800 ns of DRAM latency.
//   The walk is unrolled by PB = lcm(R*S, NB) steps (L >= 2), so that every
//   ring slot and raw buffer index is a compile-time constant and no
//   register is copied at a block's end (a copy of a buffer whose load is
//   in flight waits for it: float 3x3 had P = 3 steps and 2 buffers); with
//   L = 1 by R*S steps, float copying a buffer at a block's end when R*S
//   is odd.
// * Addresses: row cursors, the x row of the next step to load at the
//   thread's first own column and the next grad_out row, advanced one row
//   per load (one IMAD.WIDE each); every load of a row is at a constant
//   offset from its cursor.
// * Borders: an x row outside [0, H), x columns outside [0, W), the rows
//   past the walk and grad_out rows past the strip or of dead lanes are
//   never read from memory: a column outside [0, W) keeps the zero its
//   register got at the unit's start, the others are never multiplied (the
//   register keeps a stale value; float: zero).  FMAs are skipped (a
//   group-uniform branch per filter row) for x rows outside the image, for
//   (kh, m) pairs outside the strip and in dead lanes, so no value that
//   the convolution never reads is multiplied.
// * Clean blocks.  The walk goes in blocks of PB steps from step -SHIFT
//   (the steps before 0 skipped) so that a block starts at step K - 1.  A
//   block is clean where all its steps have the x row inside the image and
//   every pair inside the strip (K - 1 <= j < rows*S), in a lane that is
//   live, has all own vectors inside [0, W) and no direct halo column:
//   where every unit of a warp is in a clean block (a vote: warp-uniform)
//   the block runs without the per-filter-row branches, the direct halo
//   loads and the column tests (the row and grad_out-row tests stay: see
//   load_step); else the tested block.  Both are one lambda instantiated
//   twice; they multiply the same pairs in the same order (fp16 7x7 VW 4,
//   NVRTC 13.0: 304 non-FFMA instructions per 1372 FFMA in a clean block,
//   795 in a tested one, 995 before this walk).
// * Every raw load of a step is issued before any of them is unpacked:
//   with the conversion next to each load ptxas waits on every load before
//   issuing the next (measured on the NHWC sibling: 2.7x slower).
// * Splits.  blockIdx.x = channel c, blockIdx.y = split: a contiguous range
//   [split * units_per_split, ...) of the units (n-major, then row strip,
//   then segment); worker (warp, group) w of the block takes units
//   begin + w, begin + w + workers, ...
// * Reduction: each tap's acc is summed over the warp by a fixed butterfly
//   (dwgn::warp_sum; idle and dead lanes hold zero), lane 0 stores it to
//   red[warp][tap]; after one barrier thread `tap` adds the warps in order
//   and writes partial[split][tap][c] (float).  The split count and every
//   order depend on the shape only.
//
// Offsets: a plane's base (n*C + c) * H * W and a unit's first row cursor
// in 64-bit; in-plane offsets in int (the host rejects planes of >= 2**30
// elements).
//
// Template parameters: T; K (3, 5, 7); S (1, 2); VW output columns per
// thread (1, 2, 4, 8 for 2-byte types; 1, 2, 4 for float).  The host is
// cupy_dwgn/_depthwise_nchw_wgrad_regs.py.

#include "dwgn_common.cuh"
#include "dwgn_row_walk.cuh"

namespace dwgn_nchw_regs {

using namespace dwgn_walk;  // gcd, floor_div, pos_mod, element, load_if

constexpr int kThreads = 128;  // block size (host: THREADS)
constexpr int kWarps = kThreads / 32;

// Steps of loads in flight (see the header): 2, but 1 where the second
// step's raw registers spill at the block budget below (NVRTC 13.0 and
// 13.5, sm_90): 7x7 (fp16 VW 4 is at 160 of its 168 registers with 1),
// float 3x3 stride 2 (VW 4: 88 bytes spilled at 80 registers), float 5x5
// VW 1 and 2-byte 3x3 stride 1 VW 2; and 2-byte 3x3 stride 1 VW 8, whose
// 16-byte loads keep enough in flight: with 2 steps at 4 blocks per SM
// (128 registers) fp16 64x144x56 took 57.4 us against 53.5 with 1 (H200).
// 2-byte 3x3 stride 1 VW 4 takes 3: its steps load 8-byte vectors (two
// of them a step, 24 warps an SM at its 80 registers: 2 steps kept only
// ~21 KB in flight), and the third step's 6 raw registers fit the same 80
// (NVRTC 13, no spill; 4 steps spill): fp16 64x384x28 46.8 -> 42.8 us
// (H200, 2026-12-03).
constexpr int lookahead(int bytes, int k, int s, int vw) {
  return bytes == 2 && k == 3 && s == 1 && vw == 4 ? 3
         : k == 7 || (bytes == 4 && k == 3 && s == 2) || (bytes == 4 && k == 5 && vw == 1) ||
                 (bytes == 2 && k == 3 && s == 1 && (vw == 2 || vw == 8))
             ? 1
             : 2;
}

// Blocks per SM the register budget is set for, per element size, K, S
// and VW: the occupancy each specialization reached under the former
// per-K budget (3x3 5 blocks, <= 102 registers; 5x5 4, <= 128; 7x7 3, <=
// 168; NVRTC 13.0, sm_90), so that changes to the walk cannot trade
// occupancy for registers unnoticed (ptxas takes registers up to the
// budget: e.g. fp16 3x3 VW 4 used 76, 6 blocks).  The host's widest VW
// per filter size (MAX_VECTOR) keeps 7x7 within 168 (VW 8 took 192).
constexpr int min_blocks(int bytes, int k, int s, int vw) {
  return k == 3   ? (vw == 1   ? 8
                     : vw == 2 ? (bytes == 2 ? 8 : 7)
                     : vw == 4 ? (bytes == 2 ? (s == 1 ? 6 : 7) : (s == 1 ? 5 : 6))
                               : 5)
         : k == 5 ? (vw == 4 || (bytes == 4 && vw == 2) ? 4 : 5)
                  : (vw == 1 ? 4 : 3);
}

}  // namespace dwgn_nchw_regs

template <typename T, int K, int S, int VW>
__global__ void __launch_bounds__(dwgn_nchw_regs::kThreads,
                                  dwgn_nchw_regs::min_blocks(sizeof(T), K, S, VW))
dwgn_nchw_wgrad_regs(const T* __restrict__ grad_out, const T* __restrict__ x, float* __restrict__ partial,
                     int height, int width, int channels, int out_h, int out_w, int pad_top, int pad_left,
                     int row_strip, int row_strips, int segments, int group_lanes, int units,
                     int units_per_split) {
  dwgn::allow_dependent_grid();  // the finalize (a programmatic launch) may be placed; it waits for this grid
  using namespace dwgn_nchw_regs;
  constexpr int VS = VW * S;            // own x columns per thread
  constexpr int SH = K / 2;             // window column of the first own column
  constexpr int IW = (VW - 1) * S + K;  // window columns
  constexpr int NH = IW - VS;           // halo columns: SH left, NH - SH right
  constexpr int R = (K + S - 1) / S;    // grad_out ring slots
  constexpr int P = R * S;              // steps after which the ring slots repeat
  constexpr int L = lookahead(sizeof(T), K, S, VW);  // steps of loads in flight
  // Raw buffers: for 2-byte types L (step j + L is loaded into the
  // registers of step j just unpacked); for float L + 1 (its unpacked
  // values are the raw registers themselves, still read by step j's FMAs
  // while step j + L loads into step j - 1's buffer).
  constexpr int NB = sizeof(T) == 4 ? L + 1 : L;
  // Walk unroll (steps per block): with L >= 2 a multiple of NB, so that
  // no buffer is copied at a block's end (float 3x3 stride 1: 3 steps, 3
  // buffers); with L = 1, P (float with odd P copies its second buffer to
  // the first at a block's end: unrolling 2P steps instead made float 7x7
  // 64x384x14 54 -> 63 us on an H200).
  constexpr int PB = L == 1 ? P : P / gcd(P, NB) * NB;
  constexpr int SHIFT = pos_mod(1 - K, PB);  // the walk starts at step -SHIFT
  constexpr int KK = K * K;
  using XRaw = typename dwgn::Bits<VW * static_cast<int>(sizeof(T))>::type;  // VW values of a row
  using ERaw = typename dwgn::Bits<static_cast<int>(sizeof(T))>::type;       // one value
  using Halo = dwgn_walk::Halo<SH, VS, NH>;
  __shared__ float red[kWarps][KK];

  const int c = blockIdx.x;
  const int split = blockIdx.y;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int groups_per_warp = 32 / group_lanes;
  const int group = lane / group_lanes;
  const int gl = lane - group * group_lanes;  // lane within the group
  const int worker = warp * groups_per_warp + group;
  const int workers = kWarps * groups_per_warp;
  // The lane constants of the shuffles (dwgn_walk::Halo).
  unsigned group_mask, from_lane;
  Halo::lane_constants(lane, group, gl, group_lanes, group_mask, from_lane);
  const int begin = split * units_per_split;
  const int end = min(units, begin + units_per_split);
  const int per_image = row_strips * segments;

  float acc[K][K];
#pragma unroll
  for (int kh = 0; kh < K; ++kh)
#pragma unroll
    for (int kw = 0; kw < K; ++kw) acc[kh][kw] = 0.0f;

  // Idle lanes (past the warp's groups) walk nothing; a group's lanes walk
  // the same units, so the group mask of the shuffles is converged.
  for (int u = begin + worker; group < groups_per_warp && u < end; u += workers) {
    const int n = u / per_image;
    const int rest = u - n * per_image;
    const int rs = rest / segments;
    const int seg = rest - rs * segments;
    const int oh0 = rs * row_strip;
    const int rows = min(row_strip, out_h - oh0);
    const int steps = (rows - 1) * S + K;
    const int ow0 = (seg * group_lanes + gl) * VW;
    const bool live = ow0 < out_w;  // VW divides OW: all VW columns or none
    const int ob = ow0 * S - pad_left + SH;  // first own x column
    const int ih0 = oh0 * S - pad_top;       // input row of step 0
    const long long plane = static_cast<long long>(n) * channels + c;
    const T* x_plane = x + plane * height * width;
    const T* g_plane = grad_out + plane * out_h * out_w;

    // Own vector v covers columns ob + v*VW .. +VW-1: wholly inside or
    // outside [0, W) (multiples of VW, VW divides W).
    unsigned own_ok = 0;
#pragma unroll
    for (int v = 0; v < S; ++v)
      if (static_cast<unsigned>(ob + v * VW) < static_cast<unsigned>(width)) own_ok |= 1u << v;
    // The halo columns this lane loads itself (dwgn_walk::Halo).
    const unsigned direct = Halo::direct(from_lane, ob, width);

    // Row cursors: x_at is the input row of the next step to load (ih0 + j)
    // at the thread's first own column ob, g_at the next grad_out row (oh0 +
    // j / S) at column ow0; each load advances one row, read or not.  x_at
    // may lie outside x (its offset is formed in 64 bits) and is read only
    // for a row inside the image.
    const T* x_at = x_plane + (static_cast<long long>(ih0) * width + ob);
    const T* g_at = g_plane + (static_cast<long long>(oh0) * out_w + ow0);
    // Raw loads of step j: the x row's own vectors and direct halo values,
    // and (g_step: j % S == 0) grad_out row j / S; the cursors advance.
    // Nothing is read for j >= steps (the prefetch past the walk), for a
    // row outside the image, a column outside [0, W), a grad_out row past
    // the strip or in a dead lane.  A load not issued leaves its register
    // as it was (float: zero): a column outside [0, W) is never loaded in
    // the unit and keeps the zero set at the unit's start; the other values
    // are never multiplied.  In a clean block (below: every lane live, all
    // own vectors inside [0, W), no direct halo) only the row (the image;
    // with L >= 2 also j < steps: L steps past a clean block's last step can
    // lie past the walk, as in 3x3 stride 2) and the grad_out row are
    // tested: the same loads.  The tests
    // stay even where they are known to hold (all but a block's last
    // step): ptxas moved untested loads ahead of the unpacking of the
    // registers they reuse, into other registers, and copied them back at
    // once, waiting for the load (fp16 7x7 VW 4: 12 of a clean block's 14
    // loads read 16-22 instructions after they issue; with the tests all
    // 223-232, a step's FMAs).
    auto load_step = [&](XRaw (&xr)[S], ERaw (&hr)[NH], XRaw& gr, int j, bool g_step, bool clean) {
      const bool row_ok =
          ((clean && L == 1) || j < steps) && static_cast<unsigned>(ih0 + j) < static_cast<unsigned>(height);
#pragma unroll
      for (int v = 0; v < S; ++v) load_if(xr[v], x_at + v * VW, row_ok && (clean || ((own_ok >> v) & 1u)));
      if (!clean) {
#pragma unroll
        for (int h = 0; h < NH; ++h) {
          load_if(hr[h], x_at + Halo::offset(h), row_ok && ((direct >> h) & 1u));
        }
      }
      x_at += width;
      if (g_step) {
        load_if(gr, g_at, (clean || live) && j < rows * S);  // grad_out row j / S < rows
        g_at += out_w;
      }
    };

    float g[R][VW];
    XRaw xr[NB][S], gr[NB];
    ERaw hr[NB][NH];
#pragma unroll
    for (int b = 0; b < NB; ++b) {
#pragma unroll
      for (int v = 0; v < S; ++v) xr[b][v] = XRaw{};
#pragma unroll
      for (int h = 0; h < NH; ++h) hr[b][h] = ERaw{};
      if (sizeof(T) == 2) gr[b] = XRaw{};  // (float: every load_if writes it)
    }
    // Steps 0 .. L - 1 (step j is phase j + SHIFT of its block, buffer
    // (j + SHIFT) % NB: PB is a multiple of NB, or, for float with L = 1
    // and odd P, each block's end copy starts the next at buffer 0).
#pragma unroll
    for (int j = 0; j < L; ++j) {
      const int b = (SHIFT + j) % NB;
      load_step(xr[b], hr[b], gr[b], j, j % S == 0, false);
    }

    // Clean steps: j in [jc0, jc1), where the x row is inside the image
    // (0 <= ih0 + j < H) and every (filter row, output row) pair of the
    // step inside the strip (K - 1 <= j < rows * S), in a lane that is
    // live, has all own vectors inside [0, W) and no direct halo column
    // (else jc0 = steps: none).  The walk goes in blocks of PB steps from
    // step -SHIFT (the first block's steps before 0 are skipped), so that a
    // block starts at step K - 1, a strip's first clean step (but at the
    // image's top edge).
    const bool plain = live && own_ok == (1u << S) - 1 && direct == 0;
    const int jc0 = plain ? max(K - 1, -ih0) : steps;
    const int jc1 = min(rows * S, height - ih0);
    // The block of steps jb .. jb + PB - 1 (step j = jb + ph, ring phase
    // q = ph - SHIFT = j mod PB).  test: steps outside [0, steps) are
    // skipped and each filter row's FMAs are tested (a live lane, the x row
    // inside the image, the pair inside the strip); !test (a clean block):
    // nothing is tested.  Both multiply the same pairs in the same order.
    auto walk_block = [&](int jb, bool test) {
#pragma unroll
      for (int ph = 0; ph < PB; ++ph) {
        const int j = jb + ph;
        if (test && ph < SHIFT && j < 0) continue;
        // The break between steps (never taken in a clean block) keeps
        // ptxas from hoisting later steps' loads into this step's FMAs (as
        // in the NHWC sibling).
        if (j >= steps) break;
        const int q = ph - SHIFT;  // j mod PB (PB is a multiple of P)
        const int cur = ph % NB, ahead = (ph + L) % NB;

        // Unpack this step (own columns, direct halo values, the grad_out
        // row), then load the next step (into the registers just unpacked,
        // or float's other buffer: one step of loads in flight during this
        // step's FMAs), then the shuffled halo.
        float xw[IW];
#pragma unroll
        for (int v = 0; v < S; ++v)
#pragma unroll
          for (int i = 0; i < VW; ++i) xw[SH + v * VW + i] = element<T>(xr[cur][v], i);
        float direct_value[NH];  // zero in a clean block (no direct halo)
#pragma unroll
        for (int h = 0; h < NH; ++h) direct_value[h] = test ? element<T>(hr[cur][h], 0) : 0.0f;
        if (pos_mod(q, S) == 0) {
#pragma unroll
          for (int t = 0; t < VW; ++t) g[pos_mod(floor_div(q, S), R)][t] = element<T>(gr[cur], t);
        }
        load_step(xr[ahead], hr[ahead], gr[ahead], j + L, pos_mod(q + L, S) == 0, !test);
        Halo::fill(xw, from_lane, group_mask, direct_value);

        const bool row_in = static_cast<unsigned>(ih0 + j) < static_cast<unsigned>(height);
#pragma unroll
        for (int kh = 0; kh < K; ++kh) {
          if (pos_mod(q - kh, S) != 0) continue;              // input row j is filter row kh of no output row
          const int slot = pos_mod(floor_div(q - kh, S), R);  // ring slot of output row (j - kh) / S
          if (!test || (live && row_in && j >= kh && j - kh < rows * S)) {  // group-uniform but for dead lanes
#pragma unroll
            for (int kw = 0; kw < K; ++kw)
#pragma unroll
              for (int t = 0; t < VW; ++t) acc[kh][kw] = fmaf(g[slot][t], xw[t * S + kw], acc[kh][kw]);
          }
        }
      }
      if (PB % NB != 0) {  // float, L = 1, odd P: the next block starts with buffer 0
#pragma unroll
        for (int v = 0; v < S; ++v) xr[0][v] = xr[1][v];
#pragma unroll
        for (int h = 0; h < NH; ++h) hr[0][h] = hr[1][h];
        gr[0] = gr[1];
      }
    };
    for (int jb = -SHIFT; jb < steps; jb += PB) {
      // A clean block where every unit of the warp is in one (a vote: the
      // branch is warp-uniform, the block's code runs once per warp).
      // (live is implied by jc0; spelled out, ptxas fits float 3x3 s2 VW 4
      // in its 80 registers without a spill.)
      const bool clean = live && jb >= jc0 && jb + PB <= jc1;
      if (__all_sync(__activemask(), clean)) {
        walk_block(jb, false);
      } else {
        walk_block(jb, true);
      }
    }
  }

  // Fixed-order reduction: a butterfly over the warp, then the warps in order.
#pragma unroll
  for (int kh = 0; kh < K; ++kh)
#pragma unroll
    for (int kw = 0; kw < K; ++kw) {
      const float v = dwgn::warp_sum(acc[kh][kw]);
      if (lane == 0) red[warp][kh * K + kw] = v;
    }
  __syncthreads();  // every warp's sums are in shared memory
  if (threadIdx.x < KK) {
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += red[w][threadIdx.x];
    partial[(static_cast<long long>(split) * KK + threadIdx.x) * channels + c] = sum;
  }
}
