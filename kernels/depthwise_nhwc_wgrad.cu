// Depthwise 2-D convolution, channels-last (NHWC): weight gradient with the
// filter taps in registers ("register-tap" kernel), 3x3, 5x5 and 7x7 filters,
// stride 1 or 2 (both axes), dilation 1, depth multiplier 1, float32, float16
// and bfloat16:
//
//   partial[split][tap][c] = sum over this split's (n, oh, ow) of
//       grad_out[n, oh, ow, c] * x[n, oh*S - pad_top + kh, ow*S - pad_left + kw, c]
//
// then the shared finalize kernel (depthwise_conv2d.cu) adds the splits in a
// fixed order: bit-identical results run to run, no atomics.
//
// Why a kernel of its own: the tiled weight gradient (depthwise_nhwc.cu)
// stages x and grad_out in shared memory and re-reads KW+1 16-byte vectors
// per output pixel and filter row, so it is bound by shared-memory traffic.
// Here every value is read from global memory (L1/L2) into registers once
// per thread strip and used for every tap that needs it:
//
// * Lanes.  A thread owns LC consecutive channels (LC = 2 for a half-type
//   pair, one 4-byte load; else 1).  L = 32 / (LC * sizeof(T)) lanes cover a
//   32-byte channel tile (CT = 32 / sizeof(T) channels: one sector per
//   pixel).  Thread t of the block is lane t % L of channel tile
//   (t / L) % CTB of the block's CTB tiles, spatial worker w = t / (L * CTB)
//   of W = blockDim.x / (L * CTB).
// * Taps.  A thread accumulates KR filter rows (kh0 .. kh0+KR-1, kh0 = tap
//   group * KR, rows past K masked: the last group of 7x7 with KR = 4) x K
//   columns x LC channels in float registers, acc[KR][K][LC].
// * Work unit: (image n, row strip, column strip): RS output rows (host) x TW
//   output columns (template).  A thread walks its unit's output rows; the KR
//   input rows the current output row's taps read are a register ring
//   ring[KR][IW][LC], IW = (TW-1)*S + K columns: input row r (relative to the
//   strip, ih = oh0*S - pad_top + kh0 + r) lives in slot r % KR.  Output row
//   j of the strip reads rows j*S .. j*S + KR-1; rows j*S + max(0, KR-S) ..
//   j*S + KR-1 are new (the others were loaded for row j-1; the first
//   KR-S rows are loaded before the walk).  The walk is unrolled by
//   P = KR / gcd(KR, S) rows so every slot index is a compile-time constant.
//   grad_out's TW values of the row are loaded once per row.  With PF = 1
//   the next row's raw values (its new x rows and grad_out) are loaded
//   before this row's FMAs, so one row of loads is always in flight.
// * Borders: an input value outside the image (padding), or in a column no
//   output reads (>= x_w_limit: past the last output's window), and a
//   grad_out value in a column >= out_w load as zero (no product with a
//   non-finite value that the convolution never reads); rows past out_h are
//   never walked.  No other bounds checks in the walk.  The rows of a tap
//   group past K are never multiplied (the FMAs of filter rows >= K - kh0
//   are skipped, block-uniform).
// * Addresses: a row is loaded from a running row pointer as p + e * step,
//   one IMAD.WIDE per value.  A row outside the image reads a zero word in
//   global memory with step 0 (three selects per row).  A unit whose IW
//   input columns are all in [0, x_w_limit) and TW grad_out columns all
//   < out_w is interior; where every unit of a warp is (a vote), the warp
//   walks without column masks, else with a mask per value (its load
//   pointed at the zero word).  Both walks are one lambda, instantiated
//   twice; they load the same values.
// * Splits.  blockIdx.x = channel block * groups + tap group; blockIdx.y = the
//   split: a contiguous range [split * units_per_split, ...) of the units
//   (n-major, then row strip, then column strip), worker w taking units
//   begin + w, begin + w + W, ...  (neighbouring workers: neighbouring column
//   strips, their halos shared through L1).
// * Reduction: each thread stores acc to shared memory red[w][kh][kw][CTB*CT];
//   after one barrier, entry (tap, channel) is summed over w = 0 .. W-1 in
//   order by one thread and written to partial[split][tap][c] (float).  The
//   split count and every order depend on the shape only.
//
// Template parameters: T; K (3, 5, 7); S (1, 2); LC (1, 2); KR filter rows
// per thread; TW output columns per thread; PF (0, 1: prefetch); IndexT (int, or long long when a
// tensor has >= 2**31 elements: image and row offsets use it; a strip's
// first x row pointer is formed in 64 bits either way).  The
// host (cupy_dwgn/_depthwise_nhwc_wgrad.py) picks the configuration and the
// split; it requires C % CT == 0 and both arrays aligned to LC * sizeof(T).

#include "dwgn_common.cuh"

namespace dwgn_nhwc_wgrad {

constexpr int kTileBytes = 32;  // a channel tile: 32 bytes of one pixel
constexpr int kThreads = 256;   // block size (host: THREADS)
// Blocks per SM the register budget is set for: 2 (<= 128 registers; two
// 256-thread blocks, 16 warps per SM), but 3 (<= 80, 24 warps) for float32
// 3x3 stride 1 with 32-bit indexing, the one configuration that fits 80
// without spilling (NVRTC 13.0 and 13.5: 96 -> 80 registers; its 64-bit
// sibling spilled 44 bytes, every other configuration 8-1342).
template <typename T, int K, int S, typename IndexT>
constexpr int min_blocks() {
  return sizeof(T) == 4 && K == 3 && S == 1 && sizeof(IndexT) == 4 ? 3 : 2;
}

// A thread's LC channels of one pixel as one load ("raw": the storage
// type, loaded before any of it is unpacked to float).
template <typename T, int LC> struct Load;
template <typename T> struct Load<T, 1> {
  using Raw = T;
  static __device__ __forceinline__ Raw zero() { return dwgn::from_acc<T>(0.0f); }
  static __device__ __forceinline__ void unpack(Raw r, float (&v)[1]) { v[0] = dwgn::to_acc(r); }
};
template <> struct Load<__half, 2> {
  using Raw = __half2;
  static __device__ __forceinline__ Raw zero() { return __float2half2_rn(0.0f); }
  static __device__ __forceinline__ void unpack(Raw r, float (&v)[2]) {
    const float2 f = __half22float2(r);
    v[0] = f.x;
    v[1] = f.y;
  }
};
template <> struct Load<__nv_bfloat16, 2> {
  using Raw = __nv_bfloat162;
  static __device__ __forceinline__ Raw zero() { return __float2bfloat162_rn(0.0f); }
  static __device__ __forceinline__ void unpack(Raw r, float (&v)[2]) {
    const float2 f = __bfloat1622float2(r);
    v[0] = f.x;
    v[1] = f.y;
  }
};

// A raw word of zeros in global memory.  The loads of a row outside the
// image (and of the prefetch past a strip's last row) read it with address
// step 0, so zeroing a row costs three selects per row, not a test per
// value; the edge walk also points masked columns at it.  Never written.
__device__ unsigned int zero_word = 0;

template <typename T>
__device__ __forceinline__ const T* zero_row() {
  return reinterpret_cast<const T*>(&zero_word);
}

constexpr int gcd(int a, int b) { return b == 0 ? a : gcd(b, a % b); }

}  // namespace dwgn_nhwc_wgrad

template <typename T, int K, int S, int LC, int KR, int TW, int PF, typename IndexT>
__global__ void __launch_bounds__(dwgn_nhwc_wgrad::kThreads, (dwgn_nhwc_wgrad::min_blocks<T, K, S, IndexT>())) dwgn_dwconv_nhwc_wgrad(
    const T* __restrict__ grad_out, const T* __restrict__ x, float* __restrict__ partial, int height, int width,
    int channels, int out_h, int out_w, int pad_top, int pad_left, int x_w_limit, int row_strip,
    int row_strips, int col_strips, int units, int units_per_split, int tiles_per_block, int groups) {
  dwgn::allow_dependent_grid();  // the finalize (a programmatic launch) may be placed; it waits for this grid
  using namespace dwgn_nhwc_wgrad;
  constexpr int CT = kTileBytes / static_cast<int>(sizeof(T));  // channels per tile
  constexpr int L = CT / LC;                                     // lanes per tile
  constexpr int IW = (TW - 1) * S + K;                           // ring columns
  constexpr int P = KR / gcd(KR, S);                             // walk unroll: slot period
  constexpr int NEW0 = KR > S ? KR - S : 0;                      // first new ring row per step
  constexpr int NEW = KR - NEW0;                                 // new ring rows per step
  static_assert(IW <= 32, "column mask is 32 bits");
  static_assert(KR >= S, "the steps load consecutive input rows");
  extern __shared__ __align__(16) float red[];  // [W][KR][K][CTB * CT]

  const int chb = tiles_per_block * CT;  // channels per block
  const int lane = threadIdx.x % L;
  const int ctl = (threadIdx.x / L) % tiles_per_block;
  const int worker = threadIdx.x / (L * tiles_per_block);
  const int workers = blockDim.x / (L * tiles_per_block);
  const int channel_block = blockIdx.x / groups;
  const int kh0 = (blockIdx.x - channel_block * groups) * KR;
  const int rows_here = min(KR, K - kh0);  // filter rows of this tap group
  const int ch = ctl * CT + lane * LC;     // channel within the block
  const int c = channel_block * chb + ch;
  const bool active = c < channels;        // channels % CT == 0: whole tiles
  const int split = blockIdx.y;
  const int begin = split * units_per_split;
  const int end = min(units, begin + units_per_split);

  float acc[KR][K][LC];
#pragma unroll
  for (int kh = 0; kh < KR; ++kh)
#pragma unroll
    for (int kw = 0; kw < K; ++kw)
#pragma unroll
      for (int l = 0; l < LC; ++l) acc[kh][kw][l] = 0.0f;

  const int per_image = row_strips * col_strips;
  const IndexT x_pitch = static_cast<IndexT>(width) * channels;  // elements per row
  const IndexT g_pitch = static_cast<IndexT>(out_w) * channels;
  for (int u = begin + worker; active && u < end; u += workers) {
    const int n = u / per_image;
    const int rest = u - n * per_image;
    const int rs = rest / col_strips;
    const int cs = rest - rs * col_strips;
    const int oh0 = rs * row_strip;
    const int oh1 = min(oh0 + row_strip, out_h);
    const int ow0 = cs * TW;
    const int iw0 = ow0 * S - pad_left;
    const int ih_first = oh0 * S - pad_top + kh0;  // input row of ring row 0
    unsigned x_cols = 0, g_cols = 0;
#pragma unroll
    for (int e = 0; e < IW; ++e)
      if (iw0 + e >= 0 && iw0 + e < x_w_limit) x_cols |= 1u << e;
#pragma unroll
    for (int t = 0; t < TW; ++t)
      if (ow0 + t < out_w) g_cols |= 1u << t;
    const int rows = oh1 - oh0;
    using Raw = typename Load<T, LC>::Raw;

    // Row cursors: the next x row to load (input row ih at column iw0; the
    // pointer may lie outside x and is read only while 0 <= ih < height)
    // and the next grad_out row (output row oh0, oh0 + 1, ... at column ow0).
    // (64-bit: ih_first may lie past the last image's last row.)
    int ih = ih_first;
    const T* x_row = x + ((static_cast<long long>(n) * height + ih_first) * width + iw0) * channels + c;
    const T* g_row = grad_out + ((static_cast<IndexT>(n) * out_h + oh0) * out_w + ow0) * channels + c;
    // Raw loads of the next x row / grad_out row.  A row's raw loads are all
    // issued before any is unpacked: with load and unpack in one branch per
    // value, ptxas waited on each half-type load before issuing the next
    // (measured: 64x144x56 fp16 178 us, 20% issue active, 15 long-scoreboard
    // stall cycles per instruction; 2.7x slower).  A row outside the image,
    // and the prefetch past the strip's last row (!live), read the zero word
    // with step 0.  Bit e of col_mask clear masks a column by pointing its load at the zero
    // word (the edge walk: a bit test and a 64-bit select per value; a
    // predicated load into a zeroed word saved 0-15% of the edge walk's
    // instructions, with predicates spilled to registers, and spilled one
    // specialization); the interior walk passes constant all-ones masks.
    auto next_x_row = [&](Raw (&raw)[IW], bool live, unsigned col_mask) {
      const bool ok = live && static_cast<unsigned>(ih) < static_cast<unsigned>(height);
      const T* p = ok ? x_row : zero_row<T>();
      const int step = ok ? channels : 0;
#pragma unroll
      for (int e = 0; e < IW; ++e)
        raw[e] = *reinterpret_cast<const Raw*>((col_mask >> e) & 1u ? p + e * step : zero_row<T>());
      ++ih;
      x_row += x_pitch;
    };
    auto next_g_row = [&](Raw (&raw)[TW], bool live, unsigned col_mask) {
      const T* p = live ? g_row : zero_row<T>();
      const int step = live ? channels : 0;
#pragma unroll
      for (int t = 0; t < TW; ++t)
        raw[t] = *reinterpret_cast<const Raw*>((col_mask >> t) & 1u ? p + t * step : zero_row<T>());
      g_row += g_pitch;
    };

    // The walk of the unit's rows, for column masks x_ok / g_ok.
    auto walk = [&](unsigned x_ok, unsigned g_ok) {
      float ring[KR][IW][LC];
      // Ring row r = input row ih_first + r.  Not masked by the tap group's
      // row count: a row loaded as filter row KR-1 is read as rows KR-1-S,
      // ... by the next output rows.
      {
        Raw first[NEW0 > 0 ? NEW0 : 1][IW];
#pragma unroll
        for (int r = 0; r < NEW0; ++r) next_x_row(first[r], true, x_ok);
#pragma unroll
        for (int r = 0; r < NEW0; ++r)
#pragma unroll
          for (int e = 0; e < IW; ++e) Load<T, LC>::unpack(first[r][e], ring[r][e]);
      }
      // Raw loads of the step of output row j (its NEW rows of x and its TW
      // grad_out values); nothing is read for j >= rows (the prefetch past
      // the last row).
      auto load_step = [&](Raw (&xr)[NEW][IW], Raw (&gr)[TW], int j) {
        const bool live = j < rows;
#pragma unroll
        for (int q = 0; q < NEW; ++q) next_x_row(xr[q], live, x_ok);
        next_g_row(gr, live, g_ok);
      };

      // PF: the next step's raw values are loaded before this step's FMAs
      // (one step of loads always in flight, IW * NEW + TW more registers).
      // With an even unroll U the two buffers alternate (compile-time
      // indices); with an odd one the next step's values are copied into
      // buffer 0 after the FMAs.  An odd slot period P is unrolled twice
      // where that fits (3 -> 6: ptxas no longer moves the 10-16 raw
      // registers every P steps; 5 -> 10 spilled).
      constexpr int U = PF && P % 2 && 2 * P <= 6 ? 2 * P : P;
      constexpr bool alternate = U % 2 == 0;
      Raw xb[PF ? 2 : 1][NEW][IW], gb[PF ? 2 : 1][TW];
      if (PF) load_step(xb[0], gb[0], 0);
      // The break between rows keeps ptxas from hoisting the next row's loads
      // into this row's FMAs: a branch-free walk of whole P-row groups did
      // that and spilled in 26 of the 36 specializations at 128 registers.
      for (int j0 = 0; j0 < rows; j0 += U) {
#pragma unroll
        for (int ph = 0; ph < U; ++ph) {
          const int j = j0 + ph;
          if (j >= rows) break;
          const int cur = PF && alternate ? ph % 2 : 0;
          if (PF) {
            load_step(xb[alternate ? cur ^ 1 : 1], gb[alternate ? cur ^ 1 : 1], j + 1);
          } else {
            load_step(xb[0], gb[0], j);
          }
#pragma unroll
          for (int q = 0; q < NEW; ++q)
#pragma unroll
            for (int e = 0; e < IW; ++e) Load<T, LC>::unpack(xb[cur][q][e], ring[(ph * S + NEW0 + q) % KR][e]);
          float g[TW][LC];
#pragma unroll
          for (int t = 0; t < TW; ++t) Load<T, LC>::unpack(gb[cur][t], g[t]);
#pragma unroll
          for (int kh = 0; kh < KR; ++kh) {
            // Block-uniform: only the last group of a K not divisible by
            // KR has fewer rows (K % KR), so only rows >= K % KR test it.
            if (K % KR != 0 && kh >= K % KR && kh >= rows_here) break;
#pragma unroll
            for (int kw = 0; kw < K; ++kw)
#pragma unroll
              for (int t = 0; t < TW; ++t)
#pragma unroll
                for (int l = 0; l < LC; ++l)
                  acc[kh][kw][l] = fmaf(g[t][l], ring[(ph * S + kh) % KR][t * S + kw][l], acc[kh][kw][l]);
          }
          if (PF && !alternate) {
#pragma unroll
            for (int q = 0; q < NEW; ++q)
#pragma unroll
              for (int e = 0; e < IW; ++e) xb[0][q][e] = xb[1][q][e];
#pragma unroll
            for (int t = 0; t < TW; ++t) gb[0][t] = gb[1][t];
          }
        }
      }
    };
    // Interior unit (thread-uniform): every column valid, no masks.  A warp
    // holds 32 / (L * CTB) workers, each on its own unit (neighbouring
    // column strips): the interior walk only where all of the warp's units
    // are interior, else the edge walk for all (both walks give the same
    // values), so that a warp never runs both walks one after the other.
    const bool interior = x_cols == (1u << IW) - 1 && g_cols == (1u << TW) - 1;
    // The masks are lambda arguments, not generic-lambda functors: NVRTC
    // 13.0 (the GPU image's, and CI's) crashes compiling generic lambdas
    // here; the inlined walk folds the interior call's constant masks.
    if (__all_sync(__activemask(), interior)) {
      walk((1u << IW) - 1, (1u << TW) - 1);
    } else {
      walk(x_cols, g_cols);
    }
  }

  // Fixed-order block reduction over the workers.
  constexpr int KRK = KR * K;
#pragma unroll
  for (int kh = 0; kh < KR; ++kh)
#pragma unroll
    for (int kw = 0; kw < K; ++kw)
#pragma unroll
      for (int l = 0; l < LC; ++l) red[((worker * KR + kh) * K + kw) * chb + ch + l] = acc[kh][kw][l];
  __syncthreads();
  const long long split_base = static_cast<long long>(split) * K * K * channels;
  for (int i = threadIdx.x; i < KRK * chb; i += blockDim.x) {
    const int tap = i / chb;  // within the group: kh * K + kw
    const int cb = i - tap * chb;
    const int kh = tap / K;
    const int cg = channel_block * chb + cb;
    if (kh >= rows_here || cg >= channels) continue;
    float sum = 0.0f;
    for (int w = 0; w < workers; ++w) sum += red[(w * KRK + tap) * chb + cb];
    partial[split_base + static_cast<long long>(kh0 * K + tap) * channels + cg] = sum;
  }
}
