// Depthwise 2-D convolution, channels-last (NHWC): backward-input at stride 2
// (both axes), phase-decomposed (sub-pixel).  3x3, 5x5 and 7x7 filters,
// dilation 1, depth multiplier 1, channels in 16-byte vectors (VEC = 4
// float32, 8 float16/bfloat16, 2 float64), C % VEC == 0, 16-byte aligned
// grad_out and grad_in.  Every other backward-input call goes to the gather
// kernel of depthwise_nhwc.cu.
//
// The adjoint of y[oh] = sum_kh x[2*oh - pad + kh] w[kh]: with th = ih + pad
// = 2a + i (i = th's parity),
//   grad_in[th] = sum_{m >= 0, kh = i + 2m < K} grad_out[a - m] * w[kh],
// grad_out rows outside [0, OH) contributing zero (likewise the columns, tw
// = iw + pad_left = 2b + j, kw = j + 2n, grad_out column b - n).  So the
// taps reaching a grad_in pixel depend only on its parity (i, j), never on
// a run-time remainder.
//
// Item: one image's pixel block of 2 rows x 2*TW columns in (th, tw)
// coordinates, top-left (2a, 2*b0) (even), i.e. grad_in rows 2a - pad_top +
// {0, 1} and columns 2*b0 - pad_left + [0, 2*TW).  Items are numbered
// (n, row pair a - a_first, column block (b0 - b_first) / TW) with a_first =
// pad_top / 2, b_first = pad_left / 2 (so the first item's block starts at
// grad_in row -1 or 0: an odd pad puts the block's first row/column outside,
// and it is not written).  The thread owning an item and a channel vector
// reads grad_out rows a, a-1, ..., a-R+1 (R = (K+1)/2), each over the TW+R-1
// columns b0-R+1 .. b0+TW-1 (zero outside [0, OW)), into registers one row at
// a time, applies every tap of that row (kh = 2m, 2m+1 below K) to the TW
// pixels of each phase, and writes each of its grad_in pixels inside [0, H) x
// [0, W) exactly once (never accumulates into grad_in; pixels that no
// grad_out row reaches, e.g. the last rows when 2*OH < H + pad - K + 1, are
// written as 0).  Accumulation in float (double for float64) in a fixed
// order: deterministic.
//
// Threads: threadIdx.x walks the block's channel vectors (a warp reads whole
// 16-byte vectors of consecutive channels of a pixel: coalesced), threadIdx.y
// the items of the block's contiguous item range (blockIdx.y; neighbouring
// items share grad_out rows and columns through L1/L2).  blockIdx.x is the
// channel tile.  Weights: the tile's K*K taps staged as [tap][channel] in T
// (not the accumulator type) in shared memory: one 16-byte read per tap and
// vector, converted to float at use (exact), applied to TW pixels.  Why T:
// a tap read serves only TW (2, or 1, for half types) pixels, so float
// weights (two 16-byte reads per half-type vector) would make shared-memory
// bandwidth the limit of the half-type 5x5/7x7 kernels (estimated 28 us of
// weight reads for 64x96x56 7x7 at TW = 1 against an 11 us copy floor), and
// they took the registers that TW = 2 needs.
//
// Template parameters: T, K (3, 5, 7), TW (column pairs per item: host
// cupy_dwgn/_depthwise_nhwc_phase.py, chosen so registers stay at or under
// 128 with no spills), IndexT (int, or long long when a tensor has >= 2**31
// elements: items and element offsets use it).

#include "dwgn_common.cuh"
// dwnhwc:: load_vec_bits, store_vec, load_or_zero, block_range (used here).
#include "dwgn_nhwc_vector.cuh"

template <typename T, int K, int TW, typename IndexT>
__global__ void __launch_bounds__(256, 2) dwgn_dwconv_nhwc_bwd_input_s2(
    const T* __restrict__ grad_out, const T* __restrict__ weight, T* __restrict__ grad_in, int height,
    int width, int channels, int out_h, int out_w, int pad_top, int pad_left, int row_pairs, int col_blocks,
    IndexT items, IndexT items_per_block) {
  using Acc = typename dwgn::AccType<T>::type;
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  constexpr int KK = K * K;
  constexpr int R = (K + 1) / 2;     // grad_out rows an item reads; R - 1 extra columns
  constexpr int IN_C = TW + R - 1;   // grad_out columns an item reads
  extern __shared__ __align__(16) unsigned char shared_raw[];
  T* w_s = reinterpret_cast<T*>(shared_raw);

  const int tile_channels = blockDim.x * VEC;
  const int tile_c0 = blockIdx.x * tile_channels;
  const int c0 = tile_c0 + threadIdx.x * VEC;
  const int thread = threadIdx.y * blockDim.x + threadIdx.x;
  const int num_threads = blockDim.x * blockDim.y;
  // [tap][channel of the tile]; consecutive i read consecutive weights.
  for (int i = thread; i < KK * tile_channels; i += num_threads) {
    const int j = i / KK;
    const int tap = i - j * KK;
    const int c = tile_c0 + j;
    w_s[tap * tile_channels + j] =
        c < channels ? weight[static_cast<long long>(c) * KK + tap] : dwgn::from_acc<T>(Acc(0));
  }
  __syncthreads();  // the only barrier: threads past the channels may leave now
  if (c0 >= channels) return;
  const T* w_thread = w_s + threadIdx.x * VEC;

  const int a_first = pad_top >> 1;
  const int b_first = pad_left >> 1;
  const IndexT per_image = static_cast<IndexT>(row_pairs) * col_blocks;
  IndexT begin, end;
  dwnhwc::block_range(items, items_per_block, begin, end);
  for (IndexT item = begin + threadIdx.y; item < end; item += blockDim.y) {
    const IndexT n = item / per_image;
    const int rest = static_cast<int>(item - n * per_image);
    const int pair = rest / col_blocks;
    const int a = a_first + pair;
    const int b0 = b_first + (rest - pair * col_blocks) * TW;
    const T* g_img = grad_out + n * out_h * out_w * static_cast<IndexT>(channels) + c0;

    Acc acc[2][2 * TW][VEC];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int col = 0; col < 2 * TW; ++col)
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[i][col][v] = Acc(0);

    // One grad_out row at a time (not unrolled: with every row's columns
    // live at once the 7x7 and half-type kernels spill).
#pragma unroll 1
    for (int m = 0; m < R; ++m) {
      const int oh = a - m;
      if (oh < 0 || oh >= out_h) continue;
      const T* g_row = g_img + static_cast<IndexT>(oh) * out_w * channels;
      // Columns b0-R+1 .. b0+TW-1 of grad_out row oh.
      Acc x[IN_C][VEC];
#pragma unroll
      for (int e = 0; e < IN_C; ++e)
        dwnhwc::load_or_zero<VEC, T, Acc, IndexT, true>(x[e], g_row, b0 - (R - 1) + e, out_w, channels);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int kh = i + 2 * m;
        if (kh >= K) continue;
#pragma unroll
        for (int kw = 0; kw < K; ++kw) {
          const int j = kw & 1;
          const int nn = kw >> 1;  // pixel pair b = b0 + t reads column b - nn = x[t - nn + R - 1]
          Acc w[VEC];  // one 16-byte shared load, converted (exact: the weights are T)
          dwnhwc::load_vec_bits<VEC>(w_thread + (kh * K + kw) * tile_channels, w);
#pragma unroll
          for (int t = 0; t < TW; ++t)
#pragma unroll
            for (int v = 0; v < VEC; ++v) acc[i][2 * t + j][v] += w[v] * x[t - nn + R - 1][v];
        }
      }
    }

    T* d_img = grad_in + n * height * width * static_cast<IndexT>(channels) + c0;
    const int iw0 = 2 * b0 - pad_left;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int ih = 2 * a + i - pad_top;
      if (ih < 0 || ih >= height) continue;
      T* d_row = d_img + static_cast<IndexT>(ih) * width * channels;
#pragma unroll
      for (int col = 0; col < 2 * TW; ++col) {
        const int iw = iw0 + col;
        if (iw >= 0 && iw < width) dwnhwc::store_vec<VEC>(d_row + static_cast<IndexT>(iw) * channels, acc[i][col]);
      }
    }
  }
}
