// Depthwise 2-D convolution, NCHW: forward (stride 1 or 2) and stride-1
// backward-input with the filter in registers and no shared-memory staging
// ("register row walk"), square 3x3, 5x5 and 7x7 filters, dilation 1, depth
// multiplier 1, any padding, float32, float16 and bfloat16:
//
//   dst[p, oh, ow] = bias[c] + sum_{kh, kw} w[c, kh, kw] *
//                    src[p, oh*S - pad_top + kh, ow*S - pad_left + kw]
//
// for each plane p = n * C + c.  Forward: src = x, dst = y, w = the filter.
// Backward-input (BACKWARD, S = 1): src = grad_out, dst = grad_in, w = the
// filter rotated by 180 degrees, pad = K - 1 - the convolution's padding
// (the host passes it; it may be negative), no bias.
//
// Why a kernel of its own: the shared-memory window kernel
// (depthwise_nchw_window.cu) stages every source row through shared memory
// and its buffers hold it to 4 blocks of 128 threads per SM, which kept the
// stride-2 float32 forward at 74% of the DRAM peak (Nsight Compute, H200,
// 64x96x112) where PyTorch's channels-last kernel reaches 96%.  Here every
// source value is loaded from global memory once per thread, as a vector,
// and used for every tap; the walk is that of the register weight gradient
// (depthwise_nchw_wgrad_regs.cu, whose header explains the lanes, the halo
// shuffles, the row cursors and the raw buffers), with output rows in
// place of its taps:
//
// * Lanes.  A thread owns VW consecutive destination columns ow0 .. ow0+VW-1
//   of a plane (VW * sizeof(T) <= 16 bytes).  It loads the VS = VW*S
//   source columns starting at ob = ow0*S - pad_left + K/2 as NV aligned
//   vectors of XV = min(VS, 16 bytes) columns (the host picks the widest VW
//   with VW dividing OW and XV dividing W and pad_left - K/2, that both
//   arrays' alignments allow: each vector lies wholly inside or outside
//   the row, and a wholly outside one is never loaded and stays zero).  The
//   K - S halo columns of its window come from the neighbour lanes of its
//   group by shuffles, or, at a row or segment edge, from a scalar load of
//   its own (zero outside [0, W)): dwgn_walk::Halo.
// * Rows.  A work unit is (plane, row strip, segment): destination rows
//   oh0 .. oh0+rows-1.  The group walks the source rows ih0 + j, ih0 =
//   oh0*S - pad_top, j = 0 .. (rows-1)*S + K-1, loading each once.  Source
//   row j is filter row kh of destination row m = (j - kh) / S for each kh
//   = j mod S, kh < K with 0 <= j - kh < rows*S: it adds its K taps to
//   row m's accumulators, ring slot m % R (R = ceil(K / S) rows are open at
//   a time), and with kh = K - 1 row m is complete: it is stored as one
//   vector and its slot restarts at the bias.  A source row outside the
//   image is not loaded and adds nothing (zero padding); the stores follow
//   the steps, so every destination row of the strip is written once.
// * Loads in flight: step j + L's raw loads are issued after step j is
//   unpacked and before its FMAs (L = lookahead(), NB raw buffers; the
//   walk is unrolled by PB = lcm(R*S, NB) steps so that every ring slot
//   and buffer index is a compile-time constant).
// * Units: blockIdx.x * workers + worker, then every gridDim.x * workers-th
//   (worker = (warp, group)); the host sizes the grid to cover the units
//   once (a second pass only past 2**31 - 1 blocks).
//
// Offsets: a plane's base p * H * W in 64-bit, in-plane offsets in int
// (the host rejects planes of >= 2**30 elements).
//
// Template parameters: T; K (3, 5, 7); S (1, 2); VW destination columns per
// thread (1, 2, 4, 8 for 2-byte types; 1, 2, 4 for float); BACKWARD.  The
// host is cupy_dwgn/_depthwise_nchw_forward_regs.py.

#include "dwgn_common.cuh"
#include "dwgn_row_walk.cuh"

namespace dwgn_nchw_fwd_regs {

using namespace dwgn_walk;  // gcd, floor_div, pos_mod, element, load_if

constexpr int kThreads = 128;  // block size (host: THREADS)
constexpr int kWarps = kThreads / 32;

// Steps of loads in flight: 3 for 3x3, 2 for 5x5, 1 for 7x7 (whose
// registers go to its 49 taps and 7 open rows).  Measured on an H200
// (2026-12-03, 64x96x112 3x3 stride 2, strips of 7 / 14 rows): float32 3
// steps 94.7-96.9 us, 2 steps 99.4, 1 step 103.2; float16 3 steps 56.6, 2
// steps 57.5-61.3, 1 step 69.1; the stride-1 2-byte 56-wide forward and
// backward-input (64x144x56) 44.2 / 43.8 with 3 steps, 47.2 / 46.9 with 2,
// 55.6 / 55.2 with 1.
constexpr int lookahead(int, int k, int, int) { return k == 3 ? 3 : k == 5 ? 2 : 1; }

// Blocks per SM the register budget is set for (NVRTC 13.0, sm_90, no
// spills): 3x3 5 (<= 102 registers; the 2-byte stride-2 walk of 8 columns,
// whose 3 steps of two 16-byte vectors need 116, 4), 5x5 4 (<= 128), 7x7 3
// (<= 168).  float32 3x3 stride 2 at 4 or 5 blocks: 94.7 / 96.9 us (the
// same within noise); 2-byte stride-2 VW 8 at 5 blocks spilled.
constexpr int min_blocks(int bytes, int k, int s, int vw) {
  return k == 3 ? (bytes == 2 && s == 2 && vw == 8 ? 4 : 5) : k == 5 ? 4 : 3;
}

// VW floats rounded to T and stored as one vector at p.
template <typename T, int VW>
__device__ __forceinline__ void store_row(T* p, const float (&v)[VW]) {
  struct alignas(VW * sizeof(T)) Row {
    T e[VW];
  } row;
#pragma unroll
  for (int i = 0; i < VW; ++i) row.e[i] = dwgn::from_acc<T>(v[i]);
  *reinterpret_cast<Row*>(p) = row;
}

}  // namespace dwgn_nchw_fwd_regs

template <typename T, int K, int S, int VW, bool BACKWARD>
__global__ void __launch_bounds__(dwgn_nchw_fwd_regs::kThreads,
                                  dwgn_nchw_fwd_regs::min_blocks(sizeof(T), K, S, VW))
dwgn_nchw_forward_regs(const T* __restrict__ src, const T* __restrict__ weight, const T* __restrict__ bias,
                       T* __restrict__ dst, int height, int width, int channels, int out_h, int out_w, int pad_top,
                       int pad_left, int row_strip, int row_strips, int segments, int group_lanes, long long units) {
  using namespace dwgn_nchw_fwd_regs;
  static_assert(!BACKWARD || S == 1, "backward-input at stride 1 only");
  constexpr int VS = VW * S;            // own source columns per thread
  // loaded as NV vectors of XV columns (at most 16 bytes each)
  constexpr int XV = VS * static_cast<int>(sizeof(T)) <= 16 ? VS : 16 / static_cast<int>(sizeof(T));
  constexpr int NV = VS / XV;
  constexpr int SH = K / 2;             // window column of the first own column
  constexpr int IW = (VW - 1) * S + K;  // window columns
  constexpr int NH = IW - VS;           // halo columns: SH left, NH - SH right
  constexpr int R = (K + S - 1) / S;    // open destination rows
  constexpr int P = R * S;              // steps after which the ring slots repeat
  constexpr int L = lookahead(sizeof(T), K, S, VW);
  // Raw buffers: L for 2-byte types (step j + L loads into the registers
  // step j just unpacked), L + 1 for float (its raw registers are the FMA
  // operands of step j while step j + L loads).
  constexpr int NB = sizeof(T) == 4 ? L + 1 : L;
  constexpr int PB = P / gcd(P, NB) * NB;
  using XRaw = typename dwgn::Bits<XV * static_cast<int>(sizeof(T))>::type;
  using ERaw = typename dwgn::Bits<static_cast<int>(sizeof(T))>::type;
  using Halo = dwgn_walk::Halo<SH, VS, NH>;

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int groups_per_warp = 32 / group_lanes;
  const int group = lane / group_lanes;
  const int gl = lane - group * group_lanes;
  const int workers = kWarps * groups_per_warp;
  unsigned group_mask, from_lane;  // the lane constants of the shuffles (dwgn_walk::Halo)
  Halo::lane_constants(lane, group, gl, group_lanes, group_mask, from_lane);
  const int per_plane = row_strips * segments;

  for (long long u = static_cast<long long>(blockIdx.x) * workers + warp * groups_per_warp + group;
       group < groups_per_warp && u < units; u += static_cast<long long>(gridDim.x) * workers) {
    const long long plane = u / per_plane;
    const int rest = static_cast<int>(u - plane * per_plane);
    const int rs = rest / segments;
    const int seg = rest - rs * segments;
    const int c = static_cast<int>(plane % channels);
    const int oh0 = rs * row_strip;
    const int rows = min(row_strip, out_h - oh0);
    const int steps = (rows - 1) * S + K;
    const int ow0 = (seg * group_lanes + gl) * VW;
    const bool live = ow0 < out_w;  // VW divides OW: all VW columns or none
    const int ob = ow0 * S - pad_left + SH;
    const int ih0 = oh0 * S - pad_top;

    float w[K][K];
#pragma unroll
    for (int kh = 0; kh < K; ++kh)
#pragma unroll
      for (int kw = 0; kw < K; ++kw)
        w[kh][kw] = dwgn::to_acc(weight[c * K * K + (BACKWARD ? K * K - 1 - (kh * K + kw) : kh * K + kw)]);
    const float start = BACKWARD || bias == nullptr ? 0.0f : dwgn::to_acc(bias[c]);

    unsigned own_ok = 0;
#pragma unroll
    for (int v = 0; v < NV; ++v)
      if (static_cast<unsigned>(ob + v * XV) < static_cast<unsigned>(width)) own_ok |= 1u << v;
    const unsigned direct = Halo::direct(from_lane, ob, width);  // halo columns loaded by this lane

    // Cursors: the source row of the next step to load at column ob, and
    // the next destination row to store at column ow0.
    const T* x_at = src + (plane * height * width + static_cast<long long>(ih0) * width + ob);
    T* y_at = dst + (plane * out_h * out_w + static_cast<long long>(oh0) * out_w + ow0);
    auto load_step = [&](XRaw (&xr)[NV], ERaw (&hr)[NH], int j) {
      const bool row_ok = j < steps && static_cast<unsigned>(ih0 + j) < static_cast<unsigned>(height);
#pragma unroll
      for (int v = 0; v < NV; ++v) load_if(xr[v], x_at + v * XV, row_ok && ((own_ok >> v) & 1u));
#pragma unroll
      for (int h = 0; h < NH; ++h) load_if(hr[h], x_at + Halo::offset(h), row_ok && ((direct >> h) & 1u));
      x_at += width;
    };

    float acc[R][VW];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int t = 0; t < VW; ++t) acc[r][t] = start;
    XRaw xr[NB][NV];
    ERaw hr[NB][NH];
#pragma unroll
    for (int b = 0; b < NB; ++b) {
#pragma unroll
      for (int v = 0; v < NV; ++v) xr[b][v] = XRaw{};
#pragma unroll
      for (int h = 0; h < NH; ++h) hr[b][h] = ERaw{};
    }
#pragma unroll
    for (int j = 0; j < L; ++j) load_step(xr[j % NB], hr[j % NB], j);

    for (int jb = 0; jb < steps; jb += PB) {
#pragma unroll
      for (int q = 0; q < PB; ++q) {
        const int j = jb + q;
        if (j >= steps) break;
        const int cur = q % NB, ahead = (q + L) % NB;
        float xw[IW];
#pragma unroll
        for (int v = 0; v < NV; ++v)
#pragma unroll
          for (int i = 0; i < XV; ++i) xw[SH + v * XV + i] = element<T>(xr[cur][v], i);
        float direct_value[NH];
#pragma unroll
        for (int h = 0; h < NH; ++h) direct_value[h] = element<T>(hr[cur][h], 0);
        load_step(xr[ahead], hr[ahead], j + L);
        Halo::fill(xw, from_lane, group_mask, direct_value);
        const bool row_in = static_cast<unsigned>(ih0 + j) < static_cast<unsigned>(height);
#pragma unroll
        for (int kh = 0; kh < K; ++kh) {
          if (pos_mod(q - kh, S) != 0) continue;              // source row j is filter row kh of no row
          const int slot = pos_mod(floor_div(q - kh, S), R);  // ring slot of destination row (j - kh) / S
          const bool pair = j >= kh && j - kh < rows * S;
          if (pair && row_in) {
#pragma unroll
            for (int kw = 0; kw < K; ++kw)
#pragma unroll
              for (int t = 0; t < VW; ++t) acc[slot][t] = fmaf(w[kh][kw], xw[t * S + kw], acc[slot][t]);
          }
          if (kh == K - 1 && pair) {  // destination row (j - kh) / S is complete
            if (live) store_row<T, VW>(y_at, acc[slot]);
            y_at += out_w;
#pragma unroll
            for (int t = 0; t < VW; ++t) acc[slot][t] = start;
          }
        }
      }
    }
  }
}
