// Depthwise 2-D convolution, channels-last (NHWC): forward, backward-input,
// backward-weight (CUTLASS DepthwiseDirect2dConv / cuDNN channels_last style).
//
// Shapes: x (N, H, W, C); weight (C*M, 1, KH, KW) in PyTorch layout (staged
// transposed to [tap][channel] in shared memory inside each block, no reorder
// launch); y (N, OH, OW, C*M); output channel oc reads input channel oc / M.
// Padding is passed as the top/left amounts only; bottom/right are implied by
// OH/OW (a tap outside the input reads zero).
//
// Thread mapping shared by every kernel: threadIdx.x walks the channel
// vectors of a channel tile (VEC consecutive channels = one 16-byte vector:
// 4 float, 8 half/bfloat16, 2 double; VEC = 1 is the scalar variant for M > 1,
// C*M not a multiple of VEC or misaligned pointers).  A warp therefore reads
// 32 consecutive 16-byte vectors of one pixel: every tap is the same vector
// shifted by +-C in memory, so loads are coalesced with no transpose.
// threadIdx.y walks "items" (a strip of output pixels); each block owns a
// contiguous range of items (blockIdx.y), so the rows it reads again for the
// next output rows are still in L1/L2.
//
// Template parameters: T element type; KH_, KW_ compile-time filter size
// (3x3, 5x5, 7x7: taps unrolled) or 0, 0 (generic, run-time size); VEC;
// TW output columns per item; RH output rows per item; IndexT int or
// long long (a tensor with >= 2**31 elements).
// Accumulation is in float (double for double): half types never sum in half.

#include "dwgn_common.cuh"

using dwgn::AccType;
using dwgn::from_acc;
using dwgn::to_acc;

// dwnhwc:: Pack, load_vec, load_vec_bits, store_vec, load_shared, load_or_zero, block_range.
#include "dwgn_nhwc_vector.cuh"

// Direct convolution dst = src (*) filter, one launch, used for
//   forward (BACKWARD = false): src = x (N, H, W, C), dst = y (N, OH, OW, C*M),
//     dst channel oc reads src channel oc / M with filter oc, offset = pad;
//   backward-input at stride 1 (BACKWARD = true, VEC path, M = 1 only):
//     src = grad_out, dst = grad_in, filter rotated 180 degrees,
//     offset = dilated span - 1 - pad (the adjoint of a stride-1 correlation).
// dst[n, oh, ow, c] = sum_{kh, kw} src[n, oh*sh - off_t + kh*dh, ow*sw - off_l + kw*dw, c / M] * w[c][kh, kw].
//
// Item = RH output rows x TW output columns of one image; each thread owns
// one channel vector of it.  Specialized sizes stage all KH*KW taps of the
// block's channel tile in shared memory once (the block then loops over its
// items); the generic kernel (RH = 1) stages one filter row (in chunks of
// kw_chunk taps when a row is too wide) per item iteration, so its item loop
// is uniform across the block (barriers inside).
// Unit stride and dilation take a streaming path: each input column of a row
// is loaded once and applied to every (output, tap) pair that reads it
// (specialized: fully unrolled, also reusing input rows across the RH output
// rows; generic: a TW-slot register ring stepped along the taps, tap range
// clipped to the columns inside the image).  Other strides read each tap
// directly, skipping taps that fall in the padding by computing the valid
// tap range per output.
template <typename T, int KH_, int KW_, int VEC, int TW, int RH, bool BACKWARD, typename IndexT>
__global__ void __launch_bounds__(256, 1) dwgn_dwconv_nhwc(
    const T* __restrict__ src, const T* __restrict__ weight, const T* __restrict__ bias,
    T* __restrict__ dst, int batch, int src_h, int src_w, int dst_h, int dst_w,
    int dst_channels, int multiplier, int filter_h_rt, int filter_w_rt, int stride_h,
    int stride_w, int offset_top, int offset_left, int dilation_h, int dilation_w,
    int kw_chunk, IndexT items, IndexT items_per_block) {
  using Acc = typename AccType<T>::type;
  constexpr bool kSpecialized = KH_ > 0;
  static_assert(kSpecialized || RH == 1, "the generic kernel computes one output row per item");
  extern __shared__ __align__(16) unsigned char shared_raw[];
  Acc* w_s = reinterpret_cast<Acc*>(shared_raw);  // [tap][channel of the tile]

  const int filter_h = kSpecialized ? KH_ : filter_h_rt;
  const int filter_w = kSpecialized ? KW_ : filter_w_rt;
  const int taps = filter_h * filter_w;
  const int tile_channels = blockDim.x * VEC;
  const int tile_c0 = blockIdx.x * tile_channels;
  const int c0 = tile_c0 + threadIdx.x * VEC;
  const bool channel_ok = c0 < dst_channels;  // VEC > 1: dst_channels % VEC == 0
  const int src_channels = dst_channels / multiplier;
  const int src_c = c0 / multiplier;
  const int thread = threadIdx.y * blockDim.x + threadIdx.x;
  const int num_threads = blockDim.x * blockDim.y;
  const int strips = (dst_w + TW - 1) / TW;
  const int row_groups = (dst_h + RH - 1) / RH;

  // Weight of loop tap `tap` for channel j of the tile, from PyTorch layout.
  auto filter_weight = [&](int j, int kh, int kw) -> Acc {
    const int c = tile_c0 + j;
    if (c >= dst_channels) return Acc(0);
    const int tap = BACKWARD ? (filter_h - 1 - kh) * filter_w + (filter_w - 1 - kw)
                             : kh * filter_w + kw;
    return to_acc(weight[c * taps + tap]);
  };

  if (kSpecialized) {
    // Consecutive i read consecutive taps of one filter (coalesced reads).
    for (int i = thread; i < taps * tile_channels; i += num_threads) {
      const int j = i / taps;
      const int t = i - j * taps;
      w_s[t * tile_channels + j] = filter_weight(j, t / filter_w, t % filter_w);
    }
    __syncthreads();  // the staged filter is complete
  }
  const bool unit = stride_h == 1 && stride_w == 1 && dilation_h == 1 && dilation_w == 1;
  const bool unit_w = stride_w == 1 && dilation_w == 1;

  Acc bias_v[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    bias_v[v] = (!BACKWARD && bias != nullptr && channel_ok) ? to_acc(bias[c0 + v]) : Acc(0);
  }

  IndexT begin, end;
  dwnhwc::block_range(items, items_per_block, begin, end);
  for (IndexT base = begin; base < end; base += blockDim.y) {
    const IndexT item = base + threadIdx.y;
    const bool active = channel_ok && item < end;
    // item = (n * row_groups + row_group) * strips + strip
    const IndexT row_item = item / strips;
    const int strip = static_cast<int>(item - row_item * strips);
    const IndexT n = row_item / row_groups;
    const int oh0 = static_cast<int>(row_item - n * row_groups) * RH;
    const int ow0 = strip * TW;
    const T* src_img = src + n * src_h * src_w * static_cast<IndexT>(src_channels) + src_c;

    Acc acc[RH][TW][VEC];
#pragma unroll
    for (int j = 0; j < RH; ++j)
#pragma unroll
      for (int t = 0; t < TW; ++t)
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[j][t][v] = bias_v[v];

    if (kSpecialized) {
      if (active && unit) {
        // Input row r (of the RH + KH - 1 the item reads) feeds output row j
        // through filter row kh = r - j; input column e feeds output column
        // t through filter column kw = e - t.  Columns, outputs and filter
        // columns are compile-time; the row loop is not unrolled (a full
        // unroll of 7x7 blows the register budget and the code size).
#pragma unroll 1
        for (int r = 0; r < RH + KH_ - 1; ++r) {
          const int ih = oh0 - offset_top + r;
          if (ih < 0 || ih >= src_h) continue;
          const T* row = src_img + static_cast<IndexT>(ih) * src_w * src_channels;
#pragma unroll
          for (int e = 0; e < TW + KW_ - 1; ++e) {
            const int iw = ow0 - offset_left + e;
            if (iw < 0 || iw >= src_w) continue;
            Acc xv[VEC];
            dwnhwc::load_vec<VEC>(row + static_cast<IndexT>(iw) * src_channels, xv);
#pragma unroll
            for (int j = 0; j < RH; ++j) {
              const int kh = r - j;
              if (kh < 0 || kh >= KH_) continue;
#pragma unroll
              for (int t = 0; t < TW; ++t) {
                const int kw = e - t;
                if (kw < 0 || kw >= KW_) continue;
                const auto w = dwnhwc::load_shared<VEC>(
                    w_s + (kh * KW_ + kw) * tile_channels + threadIdx.x * VEC);
#pragma unroll
                for (int v = 0; v < VEC; ++v) acc[j][t][v] += w.v[v] * xv[v];
              }
            }
          }
        }
      } else if (active) {
        // Strided or dilated: per filter tap, the TW output columns' input
        // values are loaded together (zeros in the padding), then converted
        // and applied (a load and its use in one branch per value kept one
        // load in flight: NHWC stride-2 fp16 at 62% of the copy floor).
#pragma unroll
        for (int j = 0; j < RH; ++j) {
#pragma unroll 1
          for (int kh = 0; kh < KH_; ++kh) {
            const int ih = (oh0 + j) * stride_h - offset_top + kh * dilation_h;
            if (ih < 0 || ih >= src_h) continue;
            const T* row = src_img + static_cast<IndexT>(ih) * src_w * src_channels;
            // One tap's TW loads in flight at a time: unrolling the taps let
            // ptxas hoist every tap's loads (up to 255 registers, spills).
#pragma unroll 1
            for (int kw = 0; kw < KW_; ++kw) {
              dwnhwc::Pack<T, VEC> xp[TW];
#pragma unroll
              for (int t = 0; t < TW; ++t) {
                const int iw = (ow0 + t) * stride_w - offset_left + kw * dilation_w;
                const bool ok = iw >= 0 && iw < src_w;
                xp[t] = dwnhwc::load_pack_or_zero<VEC>(row + static_cast<IndexT>(ok ? iw : 0) * src_channels, ok);
              }
              const auto w = dwnhwc::load_shared<VEC>(w_s + (kh * KW_ + kw) * tile_channels + threadIdx.x * VEC);
#pragma unroll
              for (int t = 0; t < TW; ++t)
#pragma unroll
                for (int v = 0; v < VEC; ++v) acc[j][t][v] += w.v[v] * to_acc(xp[t].v[v]);
            }
          }
        }
      }
    } else {
      for (int kh = 0; kh < filter_h; ++kh) {
        for (int kc = 0; kc < filter_w; kc += kw_chunk) {
          const int chunk = min(kw_chunk, filter_w - kc);
          __syncthreads();  // every thread is done with the previous chunk
          for (int i = thread; i < chunk * tile_channels; i += num_threads) {
            const int j = i / chunk;
            const int u = i - j * chunk;
            w_s[u * tile_channels + j] = filter_weight(j, kh, kc + u);
          }
          __syncthreads();  // the chunk [kc, kc + chunk) of filter row kh is staged
          const int ih = oh0 * stride_h - offset_top + kh * dilation_h;
          if (!active || ih < 0 || ih >= src_h) continue;
          const T* row = src_img + static_cast<IndexT>(ih) * src_w * src_channels;
          if (unit_w) {
            // Taps that put some output column of the strip inside the image:
            // iw = ow0 + t - offset_left + kw in [0, src_w) for some t < TW.
            const int lo = max(kc, offset_left - ow0 - (TW - 1));
            const int hi = min(kc + chunk, src_w + offset_left - ow0);
            const int count = hi - lo;
            if (count <= 0) continue;
            // Ring slot p % TW holds input column base_iw + p; at tap step q
            // output t reads column q + t (slot (q + t) % TW) and column
            // q + TW - 1 is loaded into the slot column q - 1 used to hold.
            const int base_iw = ow0 - offset_left + lo;
            const Acc* w_row = w_s + (lo - kc) * tile_channels + threadIdx.x * VEC;
            Acc ring[TW][VEC];
#pragma unroll
            for (int p = 0; p < TW - 1; ++p) {
              dwnhwc::load_or_zero<VEC, T, Acc, IndexT>(ring[p], row, base_iw + p, src_w, src_channels);
            }
            for (int q0 = 0; q0 < count; q0 += TW) {
#pragma unroll
              for (int u = 0; u < TW; ++u) {
                const int q = q0 + u;
                if (q < count) {
                  dwnhwc::load_or_zero<VEC, T, Acc, IndexT>(ring[(u + TW - 1) % TW], row,
                                                            base_iw + q + TW - 1, src_w, src_channels);
                  const auto w = dwnhwc::load_shared<VEC>(w_row + q * tile_channels);
#pragma unroll
                  for (int t = 0; t < TW; ++t)
#pragma unroll
                    for (int v = 0; v < VEC; ++v) acc[0][t][v] += w.v[v] * ring[(u + t) % TW][v];
                }
              }
            }
          } else {
#pragma unroll
            for (int t = 0; t < TW; ++t) {
              // Valid taps: 0 <= iw0 + kw * dilation_w < src_w.
              const int iw0 = (ow0 + t) * stride_w - offset_left;
              const int kw_lo = max(kc, iw0 < 0 ? (-iw0 + dilation_w - 1) / dilation_w : 0);
              const int kw_hi = min(kc + chunk, iw0 < src_w ? (src_w - 1 - iw0) / dilation_w + 1 : 0);
              for (int kw = kw_lo; kw < kw_hi; ++kw) {
                Acc xv[VEC];
                dwnhwc::load_vec<VEC>(row + static_cast<IndexT>(iw0 + kw * dilation_w) * src_channels, xv);
                const auto w = dwnhwc::load_shared<VEC>(w_s + (kw - kc) * tile_channels + threadIdx.x * VEC);
#pragma unroll
                for (int v = 0; v < VEC; ++v) acc[0][t][v] += w.v[v] * xv[v];
              }
            }
          }
        }
      }
    }

    if (active) {
#pragma unroll
      for (int j = 0; j < RH; ++j) {
        const int oh = oh0 + j;
        if (oh >= dst_h) continue;
        T* dst_row = dst + (n * dst_h + oh) * static_cast<IndexT>(dst_w) * dst_channels + c0;
#pragma unroll
        for (int t = 0; t < TW; ++t) {
          if (ow0 + t < dst_w) {
            dwnhwc::store_vec<VEC>(dst_row + static_cast<IndexT>(ow0 + t) * dst_channels, acc[j][t]);
          }
        }
      }
    }
  }
}


// Shared-memory tiled direct convolution (CUTLASS DepthwiseDirect2dConv /
// cuDNN channels_last design) for specialized filter sizes at dilation 1 and
// stride STRIDE (1 or 2), M = 1, 16-byte channel vectors:
//   forward: src = x, dst = y, offset = pad, flip = 0;
//   stride-1 backward-input: src = grad_out, dst = grad_in, filter rotated
//     180 degrees (flip = 1), offset = KH-1-pad_top, KW-1-pad_left.
// A block owns an output tile of (blockDim.y / tile_ow) * RO rows x tile_ow
// columns of one image and a channel slice of blockDim.x vectors.  It copies
// the input tile + halo ((tile rows - 1) * STRIDE + KH) x ((tile_ow - 1) *
// STRIDE + KW) pixels x slice into shared memory with cp.async (each pixel's
// slice is contiguous in memory: coalesced 16-byte copies, every copy in
// flight at once, no registers held; pixels outside the image are zero-
// filled, which is the padding), and its filter slice as [tap][channel] in
// the accumulator type.  Then each thread computes RO consecutive output rows
// of one column for one channel vector from shared memory: for each filter
// column kw it walks the (RO - 1) * STRIDE + KH input rows once, applying
// each to every output row j that reads it (filter row r - j * STRIDE).
// One tile per block; small register and shared footprints let several
// blocks per SM overlap one block's copies with another's arithmetic.
// Grid (1-D): blockIdx.x = (n * slices + slice) * tiles_h * tiles_w + tile,
// so consecutive blocks are spatial neighbours sharing halo rows in L2.
// Blocks per SM (the register cap, 65536 / (256 * blocks)): 4 for float and
// double with 32-bit indices, which fit 64 registers without a spill (3 took
// 79), else 3 (the half types' 5x5 and 7x7 and the 64-bit index forms spill
// at 64).  H100, float32 NHWC forward, 3 runs each, us, 3 / 4 blocks:
// 64x192x75 5x5 s2 152.5-154.9 / 150.3-153.8, 64x96x112 3x3 s2 and 64x64x112
// within 0.6 (results/depthwise_nhwc_stride2_float32_h100_2026-12-07.txt).
template <typename T, typename IndexT>
constexpr int tiled_min_blocks() { return sizeof(T) >= 4 && sizeof(IndexT) == 4 ? 4 : 3; }
template <typename T, int KH, int KW, int VEC, int STRIDE, int RO, typename IndexT>
__global__ void __launch_bounds__(256, tiled_min_blocks<T, IndexT>()) dwgn_dwconv_nhwc_tiled(
    const T* __restrict__ src, const T* __restrict__ weight, const T* __restrict__ bias,
    T* __restrict__ dst, int src_h, int src_w, int dst_h, int dst_w, int channels,
    int offset_top, int offset_left, int flip, int tile_ow, int tiles_h, int tiles_w, int slices) {
  using Acc = typename AccType<T>::type;
  constexpr int kTaps = KH * KW;
  constexpr int kInRows = (RO - 1) * STRIDE + KH;  // input rows one thread reads
  extern __shared__ __align__(16) unsigned char shared_raw[];
  const int cv = blockDim.x;
  const int slice_channels = cv * VEC;
  const int tile_oh = (blockDim.y / tile_ow) * RO;
  const int in_h = (tile_oh - 1) * STRIDE + KH;
  const int in_w = (tile_ow - 1) * STRIDE + KW;
  // [tap][slice channel] weights, then [input pixel][slice channel] inputs;
  // kTaps * slice_channels * sizeof(Acc) is a multiple of 16 (VEC * sizeof(Acc) >= 16).
  Acc* w_s = reinterpret_cast<Acc*>(shared_raw);
  T* x_s = reinterpret_cast<T*>(shared_raw + kTaps * slice_channels * sizeof(Acc));

  const int spatial = tiles_h * tiles_w;
  const int tile = static_cast<int>(blockIdx.x % spatial);
  const int rest = static_cast<int>(blockIdx.x / spatial);
  const int slice = rest % slices;
  const int n = rest / slices;
  const int oh_base = (tile / tiles_w) * tile_oh;
  const int ow_base = (tile % tiles_w) * tile_ow;
  const int c_base = slice * slice_channels;
  const int c = c_base + threadIdx.x * VEC;
  const bool channel_ok = c < channels;  // channels % VEC == 0

  // Input tile: thread (x, y) copies vector x of pixels y, y + blockDim.y, ...
  const int ih0 = oh_base * STRIDE - offset_top;
  const int iw0 = ow_base * STRIDE - offset_left;
  const T* src_img = src + static_cast<IndexT>(n) * src_h * src_w * channels;
  for (int p = threadIdx.y; p < in_h * in_w; p += blockDim.y) {
    const int r = p / in_w;
    const int ih = ih0 + r;
    const int iw = iw0 + (p - r * in_w);
    const bool inside = channel_ok && ih >= 0 && ih < src_h && iw >= 0 && iw < src_w;
    const T* from = inside ? src_img + (static_cast<IndexT>(ih) * src_w + iw) * channels + c : src;
    dwgn::cp_async<16>(x_s + p * slice_channels + threadIdx.x * VEC, from, inside ? 16 : 0);
  }
  // Filter slice, read while the copies fly; consecutive i read consecutive
  // taps of one filter (coalesced).  Rotating by 180 degrees maps tap t to
  // kTaps - 1 - t.
  const int tid = threadIdx.y * cv + threadIdx.x;
  const int num_threads = cv * blockDim.y;
  for (int i = tid; i < kTaps * slice_channels; i += num_threads) {
    const int j = i / kTaps;
    const int t = i - j * kTaps;
    const int cc = c_base + j;
    w_s[t * slice_channels + j] =
        cc < channels ? to_acc(weight[static_cast<IndexT>(cc) * kTaps + (flip ? kTaps - 1 - t : t)])
                      : Acc(0);
  }
  dwgn::cp_async_wait_all();
  __syncthreads();  // the input tile and the filter slice are in shared memory

  const int col = threadIdx.y % tile_ow;
  const int row0 = (threadIdx.y / tile_ow) * RO;  // first output row of the thread, in the tile
  const int ow = ow_base + col;
  const int oh0 = oh_base + row0;
  if (!channel_ok || ow >= dst_w || oh0 >= dst_h) return;  // no barrier follows

  Acc acc[RO][VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    const Acc b = bias != nullptr ? to_acc(bias[c + v]) : Acc(0);
#pragma unroll
    for (int j = 0; j < RO; ++j) acc[j][v] = b;
  }
  // Input row r of the thread's window is tile row row0 * STRIDE + r; output
  // row j reads it through filter row r - j * STRIDE.
  const T* x_thread = x_s + (row0 * STRIDE * in_w + col * STRIDE) * slice_channels + threadIdx.x * VEC;
  const Acc* w_thread = w_s + threadIdx.x * VEC;
#pragma unroll
  for (int kw = 0; kw < KW; ++kw) {
#pragma unroll
    for (int r = 0; r < kInRows; ++r) {
      Acc xv[VEC];
      dwnhwc::load_vec_bits<VEC>(x_thread + (r * in_w + kw) * slice_channels, xv);
#pragma unroll
      for (int j = 0; j < RO; ++j) {
        const int kh = r - j * STRIDE;
        if (kh < 0 || kh >= KH) continue;
        const auto w = dwnhwc::load_shared<VEC>(w_thread + (kh * KW + kw) * slice_channels);
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[j][v] += w.v[v] * xv[v];
      }
    }
  }
#pragma unroll
  for (int j = 0; j < RO; ++j) {
    if (oh0 + j < dst_h) {
      dwnhwc::store_vec<VEC>(
          dst + ((static_cast<IndexT>(n) * dst_h + oh0 + j) * dst_w + ow) * channels + c, acc[j]);
    }
  }
}

// Backward-input in gather form, any stride, dilation and multiplier (the
// stride-1 vector case goes to dwgn_dwconv_nhwc<..., BACKWARD = true>).
// One item = one grad_in pixel; each thread owns one channel vector of it and
// sums every (output, tap) pair that read it, then writes it (never
// accumulates, so grad_in need not be zeroed).
// Output row oh read input row ih through tap kh iff
// oh * sh = ih + pad_t - kh * dh.  The kh that satisfy it are one residue
// class: they step by tap_step_h = sh / gcd(sh, dh) while oh steps down by
// out_step_h = dh / gcd(sh, dh), so only the first tap needs a remainder test.
// Weights: staged as [tap][m][channel] in shared memory when they fit
// (weights_staged != 0), else read from global memory.
template <typename T, int VEC, typename IndexT>
__global__ void __launch_bounds__(256, 1) dwgn_dwconv_nhwc_bwd_input(
    const T* __restrict__ grad_out, const T* __restrict__ weight, T* __restrict__ grad_in,
    int batch, int height, int width, int channels, int multiplier, int out_h, int out_w,
    int filter_h, int filter_w, int stride_h, int stride_w, int pad_top, int pad_left,
    int dilation_h, int dilation_w, int tap_step_h, int tap_step_w, int out_step_h,
    int out_step_w, int weights_staged, IndexT items, IndexT items_per_block) {
  using Acc = typename AccType<T>::type;
  extern __shared__ __align__(16) unsigned char shared_raw[];
  Acc* w_s = reinterpret_cast<Acc*>(shared_raw);
  const int taps = filter_h * filter_w;
  const int tile_channels = blockDim.x * VEC;
  const int tile_c0 = blockIdx.x * tile_channels;
  const int c0 = tile_c0 + threadIdx.x * VEC;
  const bool channel_ok = c0 < channels;
  const int out_channels = channels * multiplier;
  const int thread = threadIdx.y * blockDim.x + threadIdx.x;
  const int num_threads = blockDim.x * blockDim.y;
  // Index of slot (tap, m) of channel j of the tile in shared memory.
  const int slot_stride = multiplier * tile_channels;

  if (weights_staged) {
    const int per_channel = taps * multiplier;  // filters c*M .. c*M+M-1 are contiguous
    for (int i = thread; i < per_channel * tile_channels; i += num_threads) {
      const int j = i / per_channel;
      const int r = i - j * per_channel;  // = m * taps + tap
      const int m = r / taps;
      const int tap = r - m * taps;
      const int c = tile_c0 + j;
      w_s[tap * slot_stride + m * tile_channels + j] =
          c < channels ? to_acc(weight[static_cast<long long>(c) * per_channel + r]) : Acc(0);
    }
    __syncthreads();  // the staged weights are complete
  }

  IndexT begin, end;
  dwnhwc::block_range(items, items_per_block, begin, end);
  for (IndexT item = begin + threadIdx.y; item < end; item += blockDim.y) {
    if (!channel_ok) break;
    // item = (n * height + ih) * width + iw
    const IndexT row_item = item / width;
    const int iw = static_cast<int>(item - row_item * width);
    const IndexT n = row_item / height;
    const int ih = static_cast<int>(row_item - n * height);
    const T* g_img = grad_out + n * out_h * out_w * static_cast<IndexT>(out_channels) + c0 * multiplier;

    // First tap with a whole output row inside [0, out_h), then the first of
    // those in the residue class (at most tap_step_h tries).
    const int th = ih + pad_top;
    const int tw = iw + pad_left;
    int kh = th - (out_h - 1) * stride_h > 0 ? (th - (out_h - 1) * stride_h + dilation_h - 1) / dilation_h : 0;
    const int kh_end = min(filter_h, th / dilation_h + 1);
    for (int i = 0; i < tap_step_h && kh < kh_end && (th - kh * dilation_h) % stride_h != 0; ++i) ++kh;
    int kw_first = tw - (out_w - 1) * stride_w > 0 ? (tw - (out_w - 1) * stride_w + dilation_w - 1) / dilation_w : 0;
    const int kw_end = min(filter_w, tw / dilation_w + 1);
    for (int i = 0; i < tap_step_w && kw_first < kw_end && (tw - kw_first * dilation_w) % stride_w != 0; ++i) ++kw_first;

    Acc acc[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[v] = Acc(0);
    if (kh < kh_end && (th - kh * dilation_h) % stride_h == 0 && kw_first < kw_end &&
        (tw - kw_first * dilation_w) % stride_w == 0) {
      int oh = (th - kh * dilation_h) / stride_h;
      const int ow_first = (tw - kw_first * dilation_w) / stride_w;
      for (; kh < kh_end; kh += tap_step_h, oh -= out_step_h) {
        const T* g_row = g_img + static_cast<IndexT>(oh) * out_w * out_channels;
        int ow = ow_first;
        for (int kw = kw_first; kw < kw_end; kw += tap_step_w, ow -= out_step_w) {
          const int tap = kh * filter_w + kw;
          const T* g_px = g_row + static_cast<IndexT>(ow) * out_channels;
          for (int m = 0; m < multiplier; ++m) {
            Acc gv[VEC];
            if (VEC == 1) {
              gv[0] = to_acc(g_px[m]);  // channel c0 * M + m
            } else {
              dwnhwc::load_vec<VEC>(g_px, gv);  // M == 1 for vectors
            }
            if (weights_staged) {
              const auto w = dwnhwc::load_shared<VEC>(w_s + tap * slot_stride + m * tile_channels + threadIdx.x * VEC);
#pragma unroll
              for (int v = 0; v < VEC; ++v) acc[v] += w.v[v] * gv[v];
            } else {
#pragma unroll
              for (int v = 0; v < VEC; ++v) {
                acc[v] += to_acc(weight[(static_cast<long long>(c0 + v) * multiplier + m) * taps + tap]) * gv[v];
              }
            }
          }
        }
      }
    }
    dwnhwc::store_vec<VEC>(grad_in + item * channels + c0, acc);
  }
}

// Weight gradient, pass 1 of 2, deterministic (no atomics).
// grid = (channel tiles * tap groups, splits): blockIdx.x = tile * groups +
// group, so the blocks reading the same x/grad_out region run side by side
// and share it through L2.  Block (tile, group, split) sums, over its
// contiguous range of items (output row strips of TW columns), the products
// grad_out * x for the taps of its group, in per-thread registers:
//   specialized sizes: TAPS filter rows (TAPS * KW * VEC accumulators), unit
//     stride/dilation streaming each input column once across the TW outputs;
//   generic: TAPS consecutive taps (TW = 1).
// Then a fixed-order reduction over threadIdx.y writes
// partial[split][tap][channel]; the finalize kernel sums the splits in order.
// Everything depends on the shape only, so results are bit-identical.
template <typename T, int KH_, int KW_, int VEC, int TW, int TAPS, typename IndexT>
__global__ void __launch_bounds__(256, 1) dwgn_dwconv_nhwc_bwd_weight(
    const T* __restrict__ grad_out, const T* __restrict__ x,
    typename AccType<T>::type* __restrict__ partial, int batch, int height, int width,
    int out_channels, int multiplier, int out_h, int out_w, int filter_h_rt, int filter_w_rt,
    int stride_h, int stride_w, int pad_top, int pad_left, int dilation_h, int dilation_w,
    int tap_groups, IndexT items, IndexT items_per_block) {
  dwgn::allow_dependent_grid();  // the finalize (a programmatic launch) may be placed; it waits for this grid
  using Acc = typename AccType<T>::type;
  constexpr bool kSpecialized = KH_ > 0;
  static_assert(kSpecialized || TW == 1, "the generic kernel takes one output per item");
  constexpr int kRowTaps = kSpecialized ? KW_ : 1;  // accumulators per group slot
  extern __shared__ __align__(16) unsigned char shared_raw[];
  Acc* red = reinterpret_cast<Acc*>(shared_raw);  // [threadIdx.y][tile channel]

  const int filter_h = kSpecialized ? KH_ : filter_h_rt;
  const int filter_w = kSpecialized ? KW_ : filter_w_rt;
  const int taps = filter_h * filter_w;
  const int group = blockIdx.x % tap_groups;
  const int tile = blockIdx.x / tap_groups;
  const int tile_channels = blockDim.x * VEC;
  const int c0 = tile * tile_channels + threadIdx.x * VEC;
  const bool channel_ok = c0 < out_channels;
  const int channels = out_channels / multiplier;
  const int x_c = c0 / multiplier;
  const int strips = (out_w + TW - 1) / TW;
  // Specialized: filter rows group*TAPS + s; generic: taps group*TAPS + s.
  const int first = group * TAPS;

  Acc acc[TAPS][kRowTaps][VEC];
#pragma unroll
  for (int s = 0; s < TAPS; ++s)
#pragma unroll
    for (int k = 0; k < kRowTaps; ++k)
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[s][k][v] = Acc(0);

  // Generic: (kh, kw) of each tap of the group, computed once.
  int tap_kh[kSpecialized ? 1 : TAPS], tap_kw[kSpecialized ? 1 : TAPS];
  if (!kSpecialized) {
#pragma unroll
    for (int s = 0; s < TAPS; ++s) {
      const int tap = first + s;
      tap_kh[s] = tap < taps ? tap / filter_w : filter_h;  // filter_h: no such tap
      tap_kw[s] = tap < taps ? tap - tap_kh[s] * filter_w : 0;
    }
  }
  const bool unit_w = stride_w == 1 && dilation_w == 1;

  IndexT begin, end;
  dwnhwc::block_range(items, items_per_block, begin, end);
  for (IndexT item = begin + threadIdx.y; item < end && channel_ok; item += blockDim.y) {
    // item = (n * out_h + oh) * strips + strip
    const IndexT row_item = item / strips;
    const int ow0 = static_cast<int>(item - row_item * strips) * TW;
    const IndexT n = row_item / out_h;
    const int oh = static_cast<int>(row_item - n * out_h);
    const T* g_row = grad_out + row_item * out_w * static_cast<IndexT>(out_channels) + c0;
    const T* x_img = x + n * height * width * static_cast<IndexT>(channels) + x_c;
    Acc gv[TW][VEC];
#pragma unroll
    for (int t = 0; t < TW; ++t) {
      if (ow0 + t < out_w) {
        dwnhwc::load_vec<VEC>(g_row + static_cast<IndexT>(ow0 + t) * out_channels, gv[t]);
      } else {
#pragma unroll
        for (int v = 0; v < VEC; ++v) gv[t][v] = Acc(0);  // past the row: contributes nothing
      }
    }
    if (kSpecialized) {
#pragma unroll
      for (int s = 0; s < TAPS; ++s) {
        const int kh = first + s;
        const int ih = oh * stride_h - pad_top + kh * dilation_h;
        if (kh >= KH_ || ih < 0 || ih >= height) continue;
        const T* row = x_img + static_cast<IndexT>(ih) * width * channels;
        if (unit_w) {
          // Input column e feeds output column t through filter column e - t.
#pragma unroll
          for (int e = 0; e < TW + KW_ - 1; ++e) {
            const int iw = ow0 - pad_left + e;
            if (iw < 0 || iw >= width) continue;
            Acc xv[VEC];
            dwnhwc::load_vec<VEC>(row + static_cast<IndexT>(iw) * channels, xv);
#pragma unroll
            for (int t = 0; t < TW; ++t) {
              const int kw = e - t;
              if (kw < 0 || kw >= KW_) continue;
#pragma unroll
              for (int v = 0; v < VEC; ++v) acc[s][kw][v] += gv[t][v] * xv[v];
            }
          }
        } else {
#pragma unroll
          for (int t = 0; t < TW; ++t) {
            const int iw0 = (ow0 + t) * stride_w - pad_left;
#pragma unroll
            for (int kw = 0; kw < KW_; ++kw) {
              const int iw = iw0 + kw * dilation_w;
              if (iw < 0 || iw >= width) continue;
              Acc xv[VEC];
              dwnhwc::load_vec<VEC>(row + static_cast<IndexT>(iw) * channels, xv);
#pragma unroll
              for (int v = 0; v < VEC; ++v) acc[s][kw][v] += gv[t][v] * xv[v];
            }
          }
        }
      }
    } else {
      const int ih0 = oh * stride_h - pad_top;
      const int iw0 = ow0 * stride_w - pad_left;
#pragma unroll
      for (int s = 0; s < TAPS; ++s) {
        const int ih = ih0 + tap_kh[s] * dilation_h;  // tap_kh = filter_h: may pass, see below
        const int iw = iw0 + tap_kw[s] * dilation_w;
        if (tap_kh[s] >= filter_h || ih < 0 || ih >= height || iw < 0 || iw >= width) continue;
        Acc xv[VEC];
        dwnhwc::load_vec<VEC>(x_img + (static_cast<IndexT>(ih) * width + iw) * channels, xv);
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[s][0][v] += gv[0][v] * xv[v];
      }
    }
  }

  // Fixed-order reduction over threadIdx.y, one tap at a time.
  const int tile_width = blockDim.x * VEC;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  const long long split_base = static_cast<long long>(blockIdx.y) * taps * out_channels;
#pragma unroll
  for (int s = 0; s < TAPS; ++s) {
#pragma unroll
    for (int k = 0; k < kRowTaps; ++k) {
      const int tap = kSpecialized ? (first + s) * KW_ + k : first + s;
      if (tap >= taps) continue;  // uniform across the block
#pragma unroll
      for (int v = 0; v < VEC; ++v) red[threadIdx.y * tile_width + threadIdx.x * VEC + v] = acc[s][k][v];
      __syncthreads();  // every thread's partial sum of this tap is in shared memory
      if (tid < tile_width) {
        const int c = tile * tile_width + tid;
        Acc sum = 0;
        for (int y = 0; y < static_cast<int>(blockDim.y); ++y) sum += red[y * tile_width + tid];
        if (c < out_channels) partial[split_base + static_cast<long long>(tap) * out_channels + c] = sum;
      }
      __syncthreads();  // the sums are read before the next tap overwrites them
    }
  }
}


// Weight gradient, pass 1 of 2, shared-memory tiled (specialized filter sizes,
// dilation 1, stride STRIDE (1 or 2) on both axes, M = 1, 16-byte channel
// vectors).  grid = (slices, splits).  Block (slice, split) owns a channel
// slice of blockDim.x vectors and the contiguous range of spatial tiles
// [split * tiles_per_split, ...) (tile = tile_oh x tile_ow output pixels of
// one image; tile index = (n * tiles_h + th) * tiles_w + tw).  For each tile
// it copies, with 16-byte cp.async, the grad_out tile and the input tile +
// halo ((tile_oh - 1) * STRIDE + KH) x ((tile_ow - 1) * STRIDE + KW) into
// shared memory (pixels outside the image are zero-filled: the padding),
// double-buffered: tile i + 1 is in flight while tile i is summed.
// Thread (x, y): channel vector x, filter row kh = y % KH, tile output row
// r = y / KH (blockDim.y = tile_oh * KH); it accumulates the KW taps of
// filter row kh over the output pixels of row r of every tile, in registers
// (KW x VEC accumulators; only output pixels inside the image are visited).
// At the end the tile_oh threads of each (kh, channel) are summed in row
// order through shared memory, and partial[split][tap][channel] is written.
// Every order depends on the shape only: bit-identical run to run.
template <typename T, int KH, int KW, int VEC, int STRIDE, typename IndexT>
__global__ void __launch_bounds__(256, 2) dwgn_dwconv_nhwc_bwd_weight_tiled(
    const T* __restrict__ grad_out, const T* __restrict__ x,
    typename AccType<T>::type* __restrict__ partial, int height, int width, int channels,
    int out_h, int out_w, int pad_top, int pad_left, int tile_ow, int tiles_h, int tiles_w,
    int num_tiles, int tiles_per_split) {
  dwgn::allow_dependent_grid();  // the finalize (a programmatic launch) may be placed; it waits for this grid
  using Acc = typename AccType<T>::type;
  extern __shared__ __align__(16) unsigned char shared_raw[];
  const int cv = blockDim.x;
  const int slice_channels = cv * VEC;
  const int tile_oh = blockDim.y / KH;
  const int in_h = (tile_oh - 1) * STRIDE + KH;
  const int in_w = (tile_ow - 1) * STRIDE + KW;
  const int x_pixels = in_h * in_w;
  const int g_pixels = tile_oh * tile_ow;
  // Buffer b: [x tile pixel][slice channel] then [grad_out tile pixel][slice channel].
  const int buffer_elems = (x_pixels + g_pixels) * slice_channels;
  T* buffers = reinterpret_cast<T*>(shared_raw);

  const int slice = blockIdx.x;
  const int c_base = slice * slice_channels;
  const int c = c_base + threadIdx.x * VEC;
  const bool channel_ok = c < channels;  // channels % VEC == 0
  const int tile_begin = blockIdx.y * tiles_per_split;
  const int tile_end = min(num_tiles, tile_begin + tiles_per_split);
  const int tiles_img = tiles_h * tiles_w;

  // Issue the copies of tile t into buffer b (thread (x, y) copies vector x of
  // pixels y, y + blockDim.y, ...: each pixel's slice is contiguous).
  auto stage = [&](int t, int b) {
    const int n = t / tiles_img;
    const int rest = t - n * tiles_img;
    const int oh_base = (rest / tiles_w) * tile_oh;
    const int ow_base = (rest % tiles_w) * tile_ow;
    T* x_s = buffers + b * buffer_elems;
    T* g_s = x_s + x_pixels * slice_channels;
    const int ih0 = oh_base * STRIDE - pad_top;
    const int iw0 = ow_base * STRIDE - pad_left;
    const T* x_img = x + static_cast<IndexT>(n) * height * width * channels;
    for (int p = threadIdx.y; p < x_pixels; p += blockDim.y) {
      const int r = p / in_w;
      const int ih = ih0 + r;
      const int iw = iw0 + (p - r * in_w);
      const bool inside = channel_ok && ih >= 0 && ih < height && iw >= 0 && iw < width;
      const T* from = inside ? x_img + (static_cast<IndexT>(ih) * width + iw) * channels + c : x;
      dwgn::cp_async<16>(x_s + p * slice_channels + threadIdx.x * VEC, from, inside ? 16 : 0);
    }
    const T* g_img = grad_out + static_cast<IndexT>(n) * out_h * out_w * channels;
    for (int p = threadIdx.y; p < g_pixels; p += blockDim.y) {
      const int r = p / tile_ow;
      const int oh = oh_base + r;
      const int ow = ow_base + (p - r * tile_ow);
      const bool inside = channel_ok && oh < out_h && ow < out_w;
      const T* from = inside ? g_img + (static_cast<IndexT>(oh) * out_w + ow) * channels + c : grad_out;
      dwgn::cp_async<16>(g_s + p * slice_channels + threadIdx.x * VEC, from, inside ? 16 : 0);
    }
    dwgn::cp_async_commit();
  };

  const int kh = threadIdx.y % KH;
  const int row = threadIdx.y / KH;
  Acc acc[KW][VEC];
#pragma unroll
  for (int k = 0; k < KW; ++k)
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[k][v] = Acc(0);

  if (tile_begin < tile_end) stage(tile_begin, 0);
  for (int t = tile_begin; t < tile_end; ++t) {
    const int b = (t - tile_begin) & 1;
    if (t + 1 < tile_end) {
      stage(t + 1, b ^ 1);  // its buffer was released by the barrier ending tile t - 1
      dwgn::cp_async_wait<1>();  // this thread's copies of tile t have landed
    } else {
      dwgn::cp_async_wait<0>();
    }
    __syncthreads();  // every thread's copies of tile t are visible

    const int rest = t % tiles_img;
    const int oh = (rest / tiles_w) * tile_oh + row;
    const int ow_base = (rest % tiles_w) * tile_ow;
    const int columns = min(tile_ow, out_w - ow_base);
    if (channel_ok && oh < out_h) {
      const T* x_s = buffers + b * buffer_elems;
      const T* g_thread = x_s + (x_pixels + row * tile_ow) * slice_channels + threadIdx.x * VEC;
      const T* x_thread = x_s + (row * STRIDE + kh) * in_w * slice_channels + threadIdx.x * VEC;
      // Two columns in flight hide shared-memory latency; the 7x7 half types
      // (56 float accumulators) have no registers for the second.
#pragma unroll(KW * VEC > 32 ? 1 : 2)
      for (int col = 0; col < columns; ++col) {
        Acc gv[VEC];
        dwnhwc::load_vec<VEC>(g_thread + col * slice_channels, gv);
#pragma unroll
        for (int kw = 0; kw < KW; ++kw) {
          Acc xv[VEC];
          dwnhwc::load_vec<VEC>(x_thread + (col * STRIDE + kw) * slice_channels, xv);
#pragma unroll
          for (int v = 0; v < VEC; ++v) acc[kw][v] += gv[v] * xv[v];
        }
      }
    }
    __syncthreads();  // every thread is done reading buffer b before it is refilled
  }

  // Fixed-order reduction over the tile rows, one filter column at a time,
  // through shared memory (the tile buffers are free after the last barrier).
  Acc* red = reinterpret_cast<Acc*>(shared_raw);  // [threadIdx.y][slice channel]
  const int tid = threadIdx.y * cv + threadIdx.x;
  const long long split_base = static_cast<long long>(blockIdx.y) * KH * KW * channels;
#pragma unroll  // acc[kw] must index registers: compile-time kw
  for (int kw = 0; kw < KW; ++kw) {
#pragma unroll
    for (int v = 0; v < VEC; ++v) red[threadIdx.y * slice_channels + threadIdx.x * VEC + v] = acc[kw][v];
    __syncthreads();  // every thread's sum of filter column kw is in shared memory
    for (int i = tid; i < KH * slice_channels; i += cv * blockDim.y) {
      const int f = i / slice_channels;  // filter row
      const int j = i - f * slice_channels;
      Acc sum = Acc(0);
      for (int r = 0; r < tile_oh; ++r) sum += red[(r * KH + f) * slice_channels + j];
      if (c_base + j < channels) {
        partial[split_base + static_cast<long long>(f * KW + kw) * channels + c_base + j] = sum;
      }
    }
    __syncthreads();  // the sums are read before the next column overwrites them
  }
}

