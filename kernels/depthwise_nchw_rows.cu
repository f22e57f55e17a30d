// Depthwise 2-D convolution, NCHW, narrow planes (destination rows of at
// most 16 values): one thread per destination row, 3x3, 5x5 and 7x7
// filters, stride 1 (forward and backward-input, the latter as the forward
// correlation with the rotated filter) or stride 2 (forward, rows of at most
// 8 values), dilation 1, depth multiplier 1, float32, float16 and bfloat16.
//
// Why a kernel of its own: on 7x7 planes (N x 960 x 7 x 7, the last stage
// of MobileNet-style nets) the register window kernel spends its time on
// shared-memory staging (ncu, H200, 64x960x7 fp32 3x3 forward: 32 us,
// 9.5M warp instructions, 528 blocks at 38% occupancy, short-scoreboard
// stalls on shared memory) and the whole-plane kernel computes 4 x 4 items
// of which a 7x7 plane uses 49 of 64.  A plane of 7 rows has no reuse worth
// staging: the KH source rows a destination row reads are read by at most
// KH threads, neighbours in the warp, so L1 serves the repeats.
//
// Thread t owns destination row y = t % dst_height of plane t / dst_height
// (N*C planes are contiguous in NCHW, so a warp's rows are one contiguous
// stretch of memory).  For each filter row kh the thread loads the SPAN =
// (W - 1) * S + KW source values its W outputs read, all before any is
// converted (a conversion in the branch of its load makes ptxas wait for
// each load before issuing the next), then accumulates W x KW products in
// float.  Source rows outside the image are skipped (zero padding adds
// nothing); source columns outside it are masked (a per-kernel bit mask:
// every row has the same columns).  Destination columns past dst_width are
// computed from masked zeros and never stored.
//
// Template parameters: T; KH, KW (equal, 3/5/7); S (1, 2); W (8 or 16: the
// widest destination row it serves; S = 2 only with W = 8); BACKWARD;
// IndexT (int, or long long when a tensor has >= 2**31 elements).  The host
// (cupy_dwgn/_depthwise_nchw_rows.py) picks W and the grid.

#include "dwgn_common.cuh"

using dwgn::AccType;
using dwgn::from_acc;
using dwgn::to_acc;

template <typename T, int KH, int KW, int S, int W, bool BACKWARD, typename IndexT>
__global__ void __launch_bounds__(256, 1) dwgn_dwconv2d_rows(
    const T* __restrict__ src, const T* __restrict__ weight, const T* __restrict__ bias, T* __restrict__ dst,
    int channels, int src_height, int src_width, int dst_height, int dst_width, int offset_top, int offset_left,
    IndexT num_rows) {
  using Acc = typename AccType<T>::type;
  constexpr int SPAN = (W - 1) * S + KW;  // source columns a row's W outputs read
  static_assert(SPAN <= 32, "column mask is 32 bits");
  const IndexT t = static_cast<IndexT>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= num_rows) return;
  const IndexT plane = t / dst_height;
  const int y = static_cast<int>(t - plane * dst_height);
  const int channel = static_cast<int>(plane % channels);

  // Source column k - offset_left inside the image: the same for every row.
  unsigned column_ok = 0;
#pragma unroll
  for (int k = 0; k < SPAN; ++k) {
    const int column = k - offset_left;
    column_ok |= (column >= 0 && column < src_width ? 1u : 0u) << k;
  }

  const Acc b = (!BACKWARD && bias != nullptr) ? to_acc(bias[channel]) : Acc(0);
  Acc acc[W];
#pragma unroll
  for (int j = 0; j < W; ++j) acc[j] = b;

  const T* src_plane = src + plane * (static_cast<IndexT>(src_height) * src_width) - offset_left;
  const T* w_channel = weight + channel * (KH * KW);
  const int row0 = y * S - offset_top;
#pragma unroll 1
  for (int kh = 0; kh < KH; ++kh) {
    const int source_row = row0 + kh;
    if (source_row < 0 || source_row >= src_height) continue;  // zero padding
    const T* row = src_plane + source_row * src_width;
    // Backward-input correlates with the filter rotated by 180 degrees.
    const T* w_row = w_channel + (BACKWARD ? (KH - 1 - kh) * KW : kh * KW);
    T raw[SPAN];
#pragma unroll
    for (int k = 0; k < SPAN; ++k) raw[k] = (column_ok >> k) & 1u ? row[k] : from_acc<T>(0.0f);
    Acc w[KW];
#pragma unroll
    for (int kw = 0; kw < KW; ++kw) w[kw] = to_acc(w_row[BACKWARD ? KW - 1 - kw : kw]);
    Acc v[SPAN];
#pragma unroll
    for (int k = 0; k < SPAN; ++k) v[k] = to_acc(raw[k]);
#pragma unroll
    for (int kw = 0; kw < KW; ++kw)
#pragma unroll
      for (int j = 0; j < W; ++j) acc[j] = fma(w[kw], v[j * S + kw], acc[j]);
  }

  T* out = dst + plane * (static_cast<IndexT>(dst_height) * dst_width) + y * dst_width;
#pragma unroll
  for (int j = 0; j < W; ++j)
    if (j < dst_width) out[j] = from_acc<T>(acc[j]);
}
