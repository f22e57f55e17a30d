// Depthwise 2-D convolution, NCHW, forward / backward-input / backward-weight.
//
// Template parameters of every kernel:
//   T          element type: float, double, __half, __nv_bfloat16
//   KH_, KW_   filter size known at compile time (taps fully unrolled), or
//              0, 0 for the generic kernel that reads the size at run time
//   IndexT     int, or long long when a tensor has >= 2**31 elements
//
// Shapes: x (N, C, H, W); weight (C*M, 1, KH, KW); y (N, C*M, OH, OW), with
// M the depth multiplier: output channel oc reads input channel oc / M.
// Padding is passed as the top/left amounts only; the bottom/right amounts
// are implied by OH/OW (any tap outside the input reads zero).
// Accumulation is in float (double for double): half inputs never sum in half.

#include "dwgn_common.cuh"

using dwgn::AccType;
using dwgn::from_acc;
using dwgn::to_acc;

// One thread per output element; grid.y over the N*C*M output planes.
template <typename T, int KH_, int KW_, typename IndexT>
__global__ void __launch_bounds__(256, 4) dwgn_dwconv2d_fwd(
    const T* __restrict__ x, const T* __restrict__ weight, const T* __restrict__ bias,
    T* __restrict__ y, int batch, int channels, int height, int width, int multiplier,
    int out_height, int out_width, int filter_height_rt, int filter_width_rt,
    int stride_h, int stride_w, int pad_top, int pad_left, int dilation_h, int dilation_w) {
  using Acc = typename AccType<T>::type;
  const int filter_height = KH_ > 0 ? KH_ : filter_height_rt;
  const int filter_width = KW_ > 0 ? KW_ : filter_width_rt;
  const int out_channels = channels * multiplier;
  const int out_plane = out_height * out_width;
  DWGN_FOR_EACH_PLANE(plane, batch * out_channels) {
    const int oc = plane % out_channels;
    const int n = plane / out_channels;
    const int ic = oc / multiplier;
    const T* x_plane = x + (static_cast<IndexT>(n) * channels + ic) * height * width;
    const T* w_filter = weight + oc * filter_height * filter_width;
    const Acc bias_value = bias != nullptr ? to_acc(bias[oc]) : Acc(0);
    T* y_plane = y + static_cast<IndexT>(plane) * out_plane;
    DWGN_FOR_EACH_IN_PLANE(r, out_plane) {
      const int oh = r / out_width;
      const int ow = r - oh * out_width;
      const int ih0 = oh * stride_h - pad_top;
      const int iw0 = ow * stride_w - pad_left;
      Acc sum = bias_value;
#pragma unroll
      for (int kh = 0; kh < filter_height; ++kh) {
        const int ih = ih0 + kh * dilation_h;
        if (ih < 0 || ih >= height) continue;
        const T* x_row = x_plane + ih * width;
#pragma unroll
        for (int kw = 0; kw < filter_width; ++kw) {
          const int iw = iw0 + kw * dilation_w;
          if (iw < 0 || iw >= width) continue;
          sum += to_acc(x_row[iw]) * to_acc(w_filter[kh * filter_width + kw]);
        }
      }
      y_plane[r] = from_acc<T>(sum);
    }
  }
}

// Stride-1 convolution through a shared-memory tile: the seed's "Small"
// kernel generalized to images of any size.  A block of 32x8 threads computes
// a 32x32 tile of one destination plane, four rows per thread; the source
// window the tile needs (tile plus dilated halo) is read from global memory
// once, converted to Acc, into dynamic shared memory.  Out-of-image source
// elements read as zero, so padding needs no special case.
//   Forward (BACKWARD = false): dst = y plane (n, oc), src = x plane
//     (n, oc / M), filter oc, offset = (pad_top, pad_left), plus bias.
//   Backward input (BACKWARD = true): with stride 1 the input gradient is the
//     correlation of grad_out with the 180-degree rotated filter: dst = dx
//     plane (n, ic), summed over the M sources grad_out (n, ic*M + m) with
//     filter ic*M + m rotated, offset = dilated span - 1 - pad.
constexpr int kTile = 32;
constexpr int kTileRowsPerPass = 8;

template <typename T, int KH, int KW, bool BACKWARD, typename IndexT>
__global__ void __launch_bounds__(256) dwgn_dwconv2d_tiled(
    const T* __restrict__ src, const T* __restrict__ weight, const T* __restrict__ bias,
    T* __restrict__ dst, int batch, int channels, int multiplier, int src_height,
    int src_width, int dst_height, int dst_width, int offset_top, int offset_left,
    int dilation_h, int dilation_w) {
  using Acc = typename AccType<T>::type;
  constexpr int kRows = kTile / kTileRowsPerPass;
  extern __shared__ __align__(16) unsigned char shared_raw[];
  Acc* tile = reinterpret_cast<Acc*>(shared_raw);
  const int tile_height = kTile + (KH - 1) * dilation_h;
  const int tile_width = kTile + (KW - 1) * dilation_w;
  const int tiles_across = (dst_width + kTile - 1) / kTile;
  const int row0 = static_cast<int>(blockIdx.x) / tiles_across * kTile;
  const int col0 = static_cast<int>(blockIdx.x) % tiles_across * kTile;
  const int thread = threadIdx.y * kTile + threadIdx.x;
  const int out_channels = channels * multiplier;
  const int num_planes = batch * (BACKWARD ? channels : out_channels);
  const int sources = BACKWARD ? multiplier : 1;

  DWGN_FOR_EACH_PLANE(plane, num_planes) {
    Acc acc[kRows];
#pragma unroll
    for (int j = 0; j < kRows; ++j) acc[j] = 0;
    int filter = 0;
    for (int s = 0; s < sources; ++s) {
      int src_plane;
      if (BACKWARD) {
        filter = (plane % channels) * multiplier + s;
        src_plane = (plane / channels) * out_channels + filter;
      } else {
        filter = plane % out_channels;
        src_plane = (plane / out_channels) * channels + filter / multiplier;
      }
      const T* src_p = src + static_cast<IndexT>(src_plane) * src_height * src_width;
      __syncthreads();  // every thread is done reading the previous tile
      for (int i = thread; i < tile_height * tile_width; i += kTile * kTileRowsPerPass) {
        const int r = i / tile_width;
        const int c = i - r * tile_width;
        const int sr = row0 - offset_top + r;
        const int sc = col0 - offset_left + c;
        tile[i] = (sr >= 0 && sr < src_height && sc >= 0 && sc < src_width)
                      ? to_acc(src_p[sr * src_width + sc])
                      : Acc(0);
      }
      Acc w[KH * KW];
      const T* w_filter = weight + filter * KH * KW;
#pragma unroll
      for (int t = 0; t < KH * KW; ++t) w[t] = to_acc(w_filter[BACKWARD ? KH * KW - 1 - t : t]);
      __syncthreads();  // the tile is complete
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const Acc* window = tile + (threadIdx.y + j * kTileRowsPerPass) * tile_width + threadIdx.x;
#pragma unroll
        for (int kh = 0; kh < KH; ++kh) {
#pragma unroll
          for (int kw = 0; kw < KW; ++kw) {
            acc[j] += window[kh * dilation_h * tile_width + kw * dilation_w] * w[kh * KW + kw];
          }
        }
      }
    }
    const Acc bias_value = (!BACKWARD && bias != nullptr) ? to_acc(bias[filter]) : Acc(0);
    T* dst_p = dst + static_cast<IndexT>(plane) * dst_height * dst_width;
    const int c = col0 + threadIdx.x;
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      const int r = row0 + threadIdx.y + j * kTileRowsPerPass;
      if (r < dst_height && c < dst_width) dst_p[r * dst_width + c] = from_acc<T>(acc[j] + bias_value);
    }
  }
}

// One thread per input element; grid.y over the N*C input planes.  Gathers
// every (output, tap) pair that read the element and writes grad_in outright
// (no read-modify-write, so the caller need not zero it).
template <typename T, int KH_, int KW_, typename IndexT>
__global__ void __launch_bounds__(256, 4) dwgn_dwconv2d_bwd_input(
    const T* __restrict__ grad_out, const T* __restrict__ weight, T* __restrict__ grad_in,
    int batch, int channels, int height, int width, int multiplier, int out_height,
    int out_width, int filter_height_rt, int filter_width_rt, int stride_h, int stride_w,
    int pad_top, int pad_left, int dilation_h, int dilation_w) {
  using Acc = typename AccType<T>::type;
  const int filter_height = KH_ > 0 ? KH_ : filter_height_rt;
  const int filter_width = KW_ > 0 ? KW_ : filter_width_rt;
  const int out_plane = out_height * out_width;
  const int in_plane = height * width;
  DWGN_FOR_EACH_PLANE(plane, batch * channels) {
    const int ic = plane % channels;
    // Output planes n*C*M + ic*M + m, m < M, are consecutive: plane*M + m.
    const T* g_planes = grad_out + static_cast<IndexT>(plane) * multiplier * out_plane;
    const T* w_filters = weight + ic * multiplier * filter_height * filter_width;
    T* dx_plane = grad_in + static_cast<IndexT>(plane) * in_plane;
    DWGN_FOR_EACH_IN_PLANE(r, in_plane) {
      const int ih = r / width;
      const int iw = r - ih * width;
      Acc sum = 0;
      for (int m = 0; m < multiplier; ++m) {
        const T* g_plane = g_planes + static_cast<IndexT>(m) * out_plane;
        const T* w_filter = w_filters + m * filter_height * filter_width;
#pragma unroll
        for (int kh = 0; kh < filter_height; ++kh) {
          // Output row oh read input row ih through tap kh iff
          // oh * stride_h - pad_top + kh * dilation_h == ih.
          const int th = ih + pad_top - kh * dilation_h;
          if (th < 0 || th % stride_h != 0) continue;
          const int oh = th / stride_h;
          if (oh >= out_height) continue;
          const T* g_row = g_plane + oh * out_width;
#pragma unroll
          for (int kw = 0; kw < filter_width; ++kw) {
            const int tw = iw + pad_left - kw * dilation_w;
            if (tw < 0 || tw % stride_w != 0) continue;
            const int ow = tw / stride_w;
            if (ow >= out_width) continue;
            sum += to_acc(g_row[ow]) * to_acc(w_filter[kh * filter_width + kw]);
          }
        }
      }
      dx_plane[r] = from_acc<T>(sum);
    }
  }
}

// Stride-2 backward-input by phase decomposition (dilation 1, KH x KW known
// at compile time).  A thread computes grad_in rows 2a, 2a+1 and the 2 * V
// columns 2bV .. 2bV + 2V - 1 (V 2x2 blocks side by side).  Input row
// ih = 2a + p is read by output row oh = (ih + pad_top - kh) / 2 only
// through the taps kh of the parity of ih + pad_top; writing pad_top =
// 2*PT2 + PTP, that is oh = a + PT2 + dr with dr = (p + PTP - kh) / 2 exact.
// Once the parities PTP, PLP of the padding are fixed (one of 4 code paths
// per thread, no branch per tap), every tap of the 4V outputs and the
// grad_out patch they read are compile-time, the patch is loaded once into
// registers (a patch column serves two neighbouring blocks, no `%` per tap)
// and grad_in is written outright, a row's 2V values as one vector where
// aligned.
// Work items are (plane, a, b) in one flat range over all planes, so a
// block's threads stay busy on small planes (a 14x14 plane has 7 x 4 items
// at V = 2; a block per plane left 207 of 256 threads idle at 7 x 7).
namespace dwgn_phase {
constexpr int floor_half(int v) { return v >= 0 ? v / 2 : -((1 - v) / 2); }

template <int PTP, int PLP, int KH, int KW, int V, typename T, typename IndexT>
__device__ __forceinline__ void block_2xv(const T* __restrict__ g_planes, const T* __restrict__ w_filters,
                                          T* __restrict__ dx_plane, int a, int b, int height, int width,
                                          int multiplier, int out_height, int out_width, int pad_top2,
                                          int pad_left2) {
  using Acc = typename AccType<T>::type;
  // Patch rows dr in [DR0, DR1]: the extremes over p in {0, 1}, kh in [0, KH);
  // columns likewise, plus V - 1 for the blocks to the right.
  constexpr int DR0 = floor_half(PTP - (KH - 1));
  constexpr int DR1 = floor_half(1 + PTP);
  constexpr int DC0 = floor_half(PLP - (KW - 1));
  constexpr int DC1 = floor_half(1 + PLP);
  constexpr int PR = DR1 - DR0 + 1;
  constexpr int PC = DC1 - DC0 + 1 + V - 1;
  const int out_plane = out_height * out_width;
  const int oh0 = a + pad_top2 + DR0;
  const int ow0 = b * V + pad_left2 + DC0;
  Acc acc[2][2 * V];
#pragma unroll
  for (int p = 0; p < 2; ++p)
#pragma unroll
    for (int q = 0; q < 2 * V; ++q) acc[p][q] = Acc(0);
  for (int m = 0; m < multiplier; ++m) {
    const T* g_plane = g_planes + static_cast<IndexT>(m) * out_plane;
    const T* w_filter = w_filters + m * KH * KW;
    Acc patch[PR][PC];
#pragma unroll
    for (int i = 0; i < PR; ++i) {
      const int oh = oh0 + i;
      const bool row_ok = oh >= 0 && oh < out_height;
#pragma unroll
      for (int j = 0; j < PC; ++j) {
        const int ow = ow0 + j;
        patch[i][j] = row_ok && ow >= 0 && ow < out_width ? to_acc(g_plane[oh * out_width + ow]) : Acc(0);
      }
    }
#pragma unroll
    for (int p = 0; p < 2; ++p)
#pragma unroll
      for (int kh = 0; kh < KH; ++kh) {
        if (((p + PTP - kh) & 1) != 0) continue;  // compile-time
        const int dr = (p + PTP - kh) / 2;
#pragma unroll
        for (int q = 0; q < 2; ++q)
#pragma unroll
          for (int kw = 0; kw < KW; ++kw) {
            if (((q + PLP - kw) & 1) != 0) continue;
            const int dc = (q + PLP - kw) / 2;
            const Acc w = to_acc(w_filter[kh * KW + kw]);
#pragma unroll
            for (int v = 0; v < V; ++v) acc[p][2 * v + q] += patch[dr - DR0][dc - DC0 + v] * w;
          }
      }
  }
  // Each row's 2V values as one vector store where they lie whole in the row
  // and the address allows (a warp's stores then fill whole sectors; one
  // value a store wrote each sector a quarter at a time), else one by one.
  struct alignas(2 * V * sizeof(T)) Row {
    T e[2 * V];
  };
  const int iw0 = 2 * b * V;
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    const int ih = 2 * a + p;
    if (ih >= height) break;
    T* to = dx_plane + ih * width + iw0;
    if (iw0 + 2 * V <= width && reinterpret_cast<size_t>(to) % sizeof(Row) == 0) {
      Row row;
#pragma unroll
      for (int q = 0; q < 2 * V; ++q) row.e[q] = from_acc<T>(acc[p][q]);
      *reinterpret_cast<Row*>(to) = row;
    } else {
#pragma unroll
      for (int q = 0; q < 2 * V; ++q)
        if (iw0 + q < width) to[q] = from_acc<T>(acc[p][q]);
    }
  }
}

// Blocks per SM the register budget is set for (launch bounds' second
// argument): 3 (85 registers) for float64, where ptxas's own target (64 on
// sm_80, NVRTC 13.0) spilled 8 bytes of the 5x5's loop state; else none.
template <typename T>
constexpr int min_blocks() { return sizeof(T) == 8 ? 3 : 0; }
}  // namespace dwgn_phase

// items = planes * ceil(height / 2) * blocks_across, blocks_across =
// ceil(ceil(width / 2) / V); a 1-D grid steps over them.
template <typename T, int KH, int KW, int V, typename IndexT>
__global__ void __launch_bounds__(256, dwgn_phase::min_blocks<T>()) dwgn_dwconv2d_bwd_input_stride2(
    const T* __restrict__ grad_out, const T* __restrict__ weight, T* __restrict__ grad_in,
    int channels, int height, int width, int multiplier, int out_height, int out_width, int pad_top,
    int pad_left, int blocks_across, int per_plane, IndexT items) {
  const int out_plane = out_height * out_width;
  const int parity = (pad_top & 1) * 2 + (pad_left & 1);
  const IndexT step = static_cast<IndexT>(gridDim.x) * blockDim.x;
  for (IndexT i = static_cast<IndexT>(blockIdx.x) * blockDim.x + threadIdx.x; i < items;
       i = dwgn::grid_stride_next(i, step, items)) {
    const IndexT plane = i / per_plane;
    const int r = static_cast<int>(i - plane * per_plane);
    const int a = r / blocks_across;
    const int b = r - a * blocks_across;
    const int ic = static_cast<int>(plane % channels);
    const T* g_planes = grad_out + plane * multiplier * out_plane;
    const T* w_filters = weight + ic * multiplier * KH * KW;
    T* dx_plane = grad_in + plane * height * width;
    const auto args = [&](auto run) {
      run(g_planes, w_filters, dx_plane, a, b, height, width, multiplier, out_height, out_width, pad_top >> 1,
          pad_left >> 1);
    };
    switch (parity) {
      case 0: args(dwgn_phase::block_2xv<0, 0, KH, KW, V, T, IndexT>); break;
      case 1: args(dwgn_phase::block_2xv<0, 1, KH, KW, V, T, IndexT>); break;
      case 2: args(dwgn_phase::block_2xv<1, 0, KH, KW, V, T, IndexT>); break;
      default: args(dwgn_phase::block_2xv<1, 1, KH, KW, V, T, IndexT>); break;
    }
  }
}

// Weight gradient, pass 1 of 2, deterministic (no atomics).
// grid = (C*M output channels, num_splits, KH*KW / TAPS tap groups);
// block = 256 threads.  Block (oc, s, g) sums grad_out * x over split s of the
// N*OH*OW output positions for the TAPS consecutive taps of group g, held in
// registers (the host picks TAPS: all taps for specialized float sizes, one
// filter row for double 7x7, one tap for the generic kernel).
// The fixed thread-to-position mapping and fixed reduction tree make the sum
// bit-identical from run to run.
template <typename T, int KH_, int KW_, int TAPS, typename IndexT>
__global__ void __launch_bounds__(256) dwgn_dwconv2d_bwd_weight_partial(
    const T* __restrict__ grad_out, const T* __restrict__ x,
    typename AccType<T>::type* __restrict__ partial, int batch, int channels, int height,
    int width, int multiplier, int out_height, int out_width, int filter_height_rt,
    int filter_width_rt, int stride_h, int stride_w, int pad_top, int pad_left,
    int dilation_h, int dilation_w) {
  dwgn::allow_dependent_grid();  // the finalize (a programmatic launch) may be placed; it waits for this grid
  using Acc = typename AccType<T>::type;
  constexpr int kTaps = TAPS;
  static_assert(KH_ == 0 ? TAPS == 1 : (KH_ * KW_) % TAPS == 0, "TAPS must split the filter");
  __shared__ Acc scratch[kTaps * 32];
  const int filter_height = KH_ > 0 ? KH_ : filter_height_rt;
  const int filter_width = KW_ > 0 ? KW_ : filter_width_rt;
  const int filter_taps = filter_height * filter_width;
  const int first_tap = static_cast<int>(blockIdx.z) * kTaps;
  const int oc = blockIdx.x;
  const int ic = oc / multiplier;
  const int split = blockIdx.y;
  const int num_splits = gridDim.y;
  const int out_channels = channels * multiplier;
  const int out_plane = out_height * out_width;
  const IndexT positions = static_cast<IndexT>(batch) * out_plane;
  // Contiguous, nearly equal slices of the positions; depends on the shape only.
  const IndexT begin = positions / num_splits * split + min(static_cast<IndexT>(split), positions % num_splits);
  const IndexT end = begin + positions / num_splits + (split < positions % num_splits ? 1 : 0);

  Acc acc[kTaps];
#pragma unroll
  for (int t = 0; t < kTaps; ++t) acc[t] = 0;

  // Position p = n * out_plane + r; (n, r) advance by blockDim.x per step
  // without a 64-bit division (out_plane may be smaller than blockDim.x).
  IndexT n = (begin + threadIdx.x) / out_plane;
  int r = static_cast<int>(begin + threadIdx.x - n * out_plane);
  for (IndexT p = begin + threadIdx.x; p < end;
       p = dwgn::grid_stride_next(p, static_cast<IndexT>(blockDim.x), end)) {
    const int oh = r / out_width;
    const int ow = r - oh * out_width;
    const Acc g = to_acc(grad_out[(n * out_channels + oc) * out_plane + r]);
    const T* x_plane = x + (n * channels + ic) * height * width;
    const int ih0 = oh * stride_h - pad_top;
    const int iw0 = ow * stride_w - pad_left;
#pragma unroll
    for (int t = 0; t < kTaps; ++t) {
      const int tap = first_tap + t;
      const int kh = tap / filter_width;
      const int kw = tap - kh * filter_width;
      const int ih = ih0 + kh * dilation_h;
      const int iw = iw0 + kw * dilation_w;
      if (ih >= 0 && ih < height && iw >= 0 && iw < width) {
        acc[t] += g * to_acc(x_plane[ih * width + iw]);
      }
    }
    for (r += blockDim.x; r >= out_plane; r -= out_plane) ++n;
  }
  dwgn::block_sum(acc, scratch);
  if (threadIdx.x == 0) {
    Acc* out = partial + (static_cast<IndexT>(oc) * num_splits + split) * filter_taps + first_tap;
#pragma unroll
    for (int t = 0; t < kTaps; ++t) out[t] = acc[t];
  }
}

// Weight gradient, pass 2 of 2, shared by every weight-gradient kernel (NCHW
// and NHWC): grad_weight[oc, tap] = the sum over splits of
// partial[split * split_stride + oc * channel_stride + tap * tap_stride]
// (NCHW partials are [oc][split][tap], NHWC ones [split][tap][oc]).
// A block takes 32 weight elements consecutive in the partials (lane =
// element: [oc][tap] order when taps are contiguous there, NCHW; [tap][oc]
// when channels are, NHWC, so a warp's loads are coalesced: lanes on taps
// read NHWC partials out_channels elements apart, 11-20 us for 1-2 MB on an
// H200); its warp w adds the splits w, w + W, w + 2W, ... (W = warps per
// block) in increasing order, and warp 0 adds the W warp sums in warp order.
// The order depends on the split count and the block size only, so the
// result is bit-identical run to run.  A warp loads kBatch of its splits
// before adding them (in the same order): ptxas kept the plain loop's loads
// one at a time, each waiting out an L2 round trip (NHWC partials have up to
// hundreds of splits: 14 per warp for 64x384x28 half); with at most one
// split per warp a warp loads just that one.  Grid-stride over groups of 32
// elements (the host caps the grid).
template <typename T>
__global__ void __launch_bounds__(256) dwgn_dwconv2d_bwd_weight_finalize(
    const typename AccType<T>::type* __restrict__ partial, T* __restrict__ grad_weight,
    int out_channels, int filter_taps, int num_splits, long long split_stride,
    long long channel_stride, long long tap_stride) {
  using Acc = typename AccType<T>::type;
  __shared__ Acc warp_sums[8][32];  // blockDim.x <= 256 (launch bounds)
  dwgn::wait_for_prior_grid();  // partial is the weight-gradient kernel's until it completes (programmatic launch)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int total = out_channels * filter_taps;
  const bool lanes_on_channels = channel_stride < tap_stride;  // uniform
  const int stride = static_cast<int>(gridDim.x) * 32;
  for (int first = blockIdx.x * 32; first < total; first = dwgn::grid_stride_next(first, stride, total)) {
    const int i = first + lane;
    int oc = 0, tap = 0;
    if (lanes_on_channels) {
      tap = i / out_channels;
      oc = i - tap * out_channels;
    } else {
      oc = i / filter_taps;
      tap = i - oc * filter_taps;
    }
    Acc sum = 0;
    if (i < total) {
      constexpr int kBatch = 8;
      const Acc* p = partial + oc * channel_stride + tap * tap_stride;
      if (num_splits <= warps) {  // uniform: at most one split per warp
        if (warp < num_splits) sum += p[warp * split_stride];
      } else {
#pragma unroll 1
        for (int s = warp; s < num_splits; s += kBatch * warps) {
          Acc values[kBatch];  // splits past the last add 0: the sum is unchanged
#pragma unroll
          for (int b = 0; b < kBatch; ++b)
            values[b] = s + b * warps < num_splits ? p[(s + b * warps) * split_stride] : Acc(0);
#pragma unroll
          for (int b = 0; b < kBatch; ++b) sum += values[b];
        }
      }
    }
    warp_sums[warp][lane] = sum;
    __syncthreads();  // every warp's sums are in shared memory
    if (warp == 0 && i < total) {
      Acc element = warp_sums[0][lane];
      for (int w = 1; w < warps; ++w) element += warp_sums[w][lane];
      grad_weight[oc * filter_taps + tap] = from_acc<T>(element);
    }
    __syncthreads();  // warp_sums is rewritten by the next group
  }
}
