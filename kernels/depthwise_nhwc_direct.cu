// Depthwise 2-D convolution, channels-last (NHWC): a direct kernel with no
// input staging, for 3x3 and 5x5 filters at stride 1 or 2 (forward; stride-1
// backward-input as the forward correlation with the rotated filter),
// dilation 1, depth multiplier 1, 16-byte channel vectors, float32, float16
// and bfloat16.
//
// Why a kernel of its own: the register-window kernel (depthwise_nhwc_window.cu)
// and the tiled kernel (depthwise_nhwc.cu) stage input tiles in shared
// memory; on 56x56 half-type 3x3 the window kernel issued 26.8M warp
// instructions for 8.1M warp FMAs at 20% occupancy (H200, ncu: 67 us against
// cuDNN's 62 under the profiler), and the tiled kernel at stride 2 68.8M.
// Here a thread reads its inputs straight from global memory (L1 serves the
// halo columns its neighbours in the block also read):
//
// * Thread (x, y) of the block: channel vector x of the block's channel tile
//   (blockIdx.x; VEC channels = 16 bytes, the warp's lanes on consecutive
//   vectors of one pixel, so each load is contiguous), item y.  An item is
//   (image n, output row oh, strip of TW output columns); items are walked
//   grid-stride along blockIdx.y.
// * For each filter row kh the item's IW = (TW - 1) * S + K input vectors of
//   row oh*S - offset_top + kh are loaded raw, all before any is converted
//   (a conversion in the branch of its load makes ptxas wait for each load
//   before issuing the next), zeros in the padding; then converted once and
//   applied to every output column and filter column that reads them.
//   Input rows outside the image are skipped (zero padding adds nothing),
//   or with ALL_ROWS loaded as zeros.
// * The block's filter taps for its channel tile are staged in shared
//   memory once, as float (the backward-input filter rotated), and read per
//   (kh, kw) as accumulator vectors.
// * Outputs leave as 16-byte vectors; columns past dst_w are not stored.
//
// Template parameters: T; K (3, 5); S (1, 2); TW output columns per thread;
// BACKWARD (stride 1: src = grad_out, dst = grad_in, filter rotated,
// offsets K - 1 - pad); ALL_ROWS (every filter row's IW vectors loaded
// before the first is applied, K * IW loads in flight, rows outside the
// image as zeros; else one row's at a time, rows outside skipped); IndexT (int, or long long when a tensor has >= 2**31
// elements: pixel offsets use it).  The host (cupy_dwgn/_depthwise_nhwc_direct.py)
// picks TW and the grid; it requires C % VEC == 0 and both arrays 16-byte
// aligned.

#include "dwgn_common.cuh"
#include "dwgn_nhwc_vector.cuh"

using dwgn::AccType;
using dwgn::from_acc;
using dwgn::to_acc;

template <typename T, int K, int S, int TW, bool BACKWARD, bool ALL_ROWS, typename IndexT>
__global__ void __launch_bounds__(256, 1) dwgn_dwconv_nhwc_direct(
    const T* __restrict__ src, const T* __restrict__ weight, const T* __restrict__ bias, T* __restrict__ dst,
    int src_h, int src_w, int dst_h, int dst_w, int channels, int offset_top, int offset_left, int strips,
    IndexT items) {
  using Acc = typename AccType<T>::type;
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  constexpr int IW = (TW - 1) * S + K;  // input vectors a filter row of an item reads
  extern __shared__ __align__(16) unsigned char shared_raw[];
  Acc* w_s = reinterpret_cast<Acc*>(shared_raw);  // [tap][channel of the tile]

  const int tile_channels = blockDim.x * VEC;
  const int tile_c0 = blockIdx.x * tile_channels;
  const int c = tile_c0 + threadIdx.x * VEC;
  const bool channel_ok = c < channels;  // channels % VEC == 0: whole vectors
  const int threads = blockDim.x * blockDim.y;
  const int thread = threadIdx.y * blockDim.x + threadIdx.x;
  // Consecutive i read consecutive taps of one filter (coalesced reads).
  for (int i = thread; i < K * K * tile_channels; i += threads) {
    const int j = i / (K * K);
    const int tap = i - j * (K * K);
    const int cj = tile_c0 + j;
    w_s[(BACKWARD ? K * K - 1 - tap : tap) * tile_channels + j] =
        cj < channels ? to_acc(weight[cj * (K * K) + tap]) : Acc(0);
  }
  __syncthreads();  // the staged filter is complete
  if (!channel_ok) return;

  Acc bias_v[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) bias_v[v] = (!BACKWARD && bias != nullptr) ? to_acc(bias[c + v]) : Acc(0);
  const Acc* w_thread = w_s + threadIdx.x * VEC;

  const IndexT step = static_cast<IndexT>(gridDim.y) * blockDim.y;
  for (IndexT item = static_cast<IndexT>(blockIdx.y) * blockDim.y + threadIdx.y; item < items; item += step) {
    // item = (n * dst_h + oh) * strips + strip
    const IndexT row_item = item / strips;
    const int strip = static_cast<int>(item - row_item * strips);
    const IndexT n = row_item / dst_h;
    const int oh = static_cast<int>(row_item - n * dst_h);
    const int ow0 = strip * TW;
    const int iw0 = ow0 * S - offset_left;
    const T* src_img = src + n * src_h * static_cast<IndexT>(src_w) * channels + c;

    Acc acc[TW][VEC];
#pragma unroll
    for (int t = 0; t < TW; ++t)
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[t][v] = bias_v[v];

    // The IW input vectors of an input row (zeros outside the image: row_ok false, or columns
    // outside [0, src_w)), then their products with filter row kh's taps, added to every
    // output column that reads them.
    auto load_row = [&](const T* row, bool row_ok, dwnhwc::Pack<T, VEC>(&raw)[IW]) {
#pragma unroll
      for (int e = 0; e < IW; ++e) {
        const int iw = iw0 + e;
        const bool ok = row_ok && iw >= 0 && iw < src_w;
        raw[e] = dwnhwc::load_pack_or_zero<VEC>(row + static_cast<IndexT>(ok ? iw : 0) * channels, ok);
      }
    };
    auto apply_row = [&](int kh, const dwnhwc::Pack<T, VEC>(&raw)[IW]) {
#pragma unroll
      for (int kw = 0; kw < K; ++kw) {
        const auto w = dwnhwc::load_shared<VEC>(w_thread + (kh * K + kw) * tile_channels);
#pragma unroll
        for (int t = 0; t < TW; ++t)
#pragma unroll
          for (int v = 0; v < VEC; ++v) acc[t][v] = fma(w.v[v], to_acc(raw[t * S + kw].v[v]), acc[t][v]);
      }
    };
    if constexpr (ALL_ROWS) {
      dwnhwc::Pack<T, VEC> raw[K][IW];
#pragma unroll
      for (int kh = 0; kh < K; ++kh) {
        const int ih = oh * S - offset_top + kh;
        const bool row_ok = ih >= 0 && ih < src_h;
        load_row(src_img + static_cast<IndexT>(row_ok ? ih : 0) * src_w * channels, row_ok, raw[kh]);
      }
#pragma unroll
      for (int kh = 0; kh < K; ++kh) apply_row(kh, raw[kh]);
    } else {
#pragma unroll 1
      for (int kh = 0; kh < K; ++kh) {
        const int ih = oh * S - offset_top + kh;
        if (ih < 0 || ih >= src_h) continue;  // zero padding
        dwnhwc::Pack<T, VEC> raw[IW];
        load_row(src_img + static_cast<IndexT>(ih) * src_w * channels, true, raw);
        apply_row(kh, raw);
      }
    }

    T* out = dst + (row_item * dst_w + ow0) * static_cast<IndexT>(channels) + c;
#pragma unroll
    for (int t = 0; t < TW; ++t)
      if (ow0 + t < dst_w) dwnhwc::store_vec<VEC>(out + static_cast<IndexT>(t) * channels, acc[t]);
  }
}
