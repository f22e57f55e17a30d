// Depthwise 2-D convolution, channels-last (NHWC), register-window kernel
// ("P2" of the NHWC review): 3x3, 5x5 and 7x7 filters at stride 1, dilation
// 1, depth multiplier 1, forward and stride-1 backward-input (the forward
// correlation with the filter rotated by 180 degrees, offset KH-1-pad, which
// may be negative), float32, float16 and bfloat16.
//
// Why a kernel of its own: the tiled NHWC kernel (depthwise_nhwc.cu) re-reads
// its float weights from shared memory for every tap and serves only RO = 2
// rows with each 16-byte input vector, so its half-type cells are bound by
// shared-memory bandwidth (54-294 bytes of shared traffic per output
// element).  Here the reuse is in registers:
//
// * Lanes.  A pixel's channel tile is 32 bytes: CT = 16 channels for half
//   types (a lane owns one channel pair, __half2 / __nv_bfloat162, converted
//   to float2), 8 for float32 (a lane owns one channel).  Thread t of a block
//   is lane t % 8 of spatial thread s = t / 8; spatial thread s is thread
//   tile (tr, tc) = (s / tile_cols, s % tile_cols) of the block's tile_rows x
//   tile_cols grid.  A warp holds 4 spatial threads.
// * Outputs per thread: RO x TW = 2 x 7 destination pixels of its channel(s).
//   It streams RO+K-1 source rows of TW+K-1 pixels from shared memory (one
//   LDS.32 each), converts each value once, and applies it to every (output,
//   tap) pair that reads it; accumulation in float32 in a fixed order
//   (deterministic, never in half precision).
// * Weights: float registers loaded per channel tile from a [group][tap][CT]
//   float copy in shared memory (the filters of a group of channel tiles,
//   copied once per group); the 7x7 half-type kernel keeps them there and
//   reads one LDS.64 per (source row, output row, tap) (98 float registers
//   would not fit).
// * Tiles and the ring: a work unit is (channel tile, image, tile row, tile
//   column); units are numbered group-major with a group's channel tiles
//   innermost (see advance()) and a persistent block (the grid is at most
//   the blocks resident at once) takes a contiguous, balanced range of them,
//   so it keeps one group (its weights) for all or nearly all of its units.  Each unit's source tile + halo
//   ((tile_rows*RO + K-1) x (tile_cols*TW + K-1) pixels x 32 bytes) is copied
//   with 16-byte cp.async into a three-stage ring, two units ahead: at step k
//   the block waits for unit k, passes one barrier (after which every
//   thread has finished unit k-1), issues the copy of unit k+2 into the
//   buffer unit k-1 used, and computes unit k.  Pixels outside the source
//   (the padding, any amount) are zero-filled by cp.async with src_size 0.
//   The row pitch is padded (host: a multiple of 16 bytes) so the 4 spatial
//   threads of a warp read disjoint 32-byte bank groups.
// * Copies: thread t copies 16-byte half (t & 1) of pixels t/2, t/2 + B/2,
//   ... of the tile (B threads), its (row, column) stepped without division.
//
// Template parameters: T, K (3, 5, 7), IndexT (int, or long long when a
// tensor has >= 2**31 elements: image and pixel offsets use it).  The host
// (cupy_dwgn/_depthwise_nhwc_window.py) picks the tile, pitch and grid; it
// requires C % CT == 0, a 16-byte aligned source and a 4-byte aligned
// destination.

#include "dwgn_common.cuh"

namespace dwgn_nhwc_window {

constexpr int kLanes = 8;         // lanes per pixel (32 bytes of channels)
constexpr int kPixelBytes = 32;   // one pixel's channel tile in shared memory
constexpr int kRows = 2;          // RO: output rows per thread
constexpr int kColumns = 7;       // TW: output columns per thread
constexpr int kStages = 3;        // ring buffers (host: STAGES)

// A lane's values: storage type in memory, float type in registers.
template <typename T> struct Lane;
template <> struct Lane<float> {
  using Store = float;
  using Acc = float;
  static constexpr int kChannels = 1;
  static __device__ __forceinline__ Acc load(Store v) { return v; }
  static __device__ __forceinline__ Store store(Acc v) { return v; }
  static __device__ __forceinline__ Acc fma(Acc w, Acc x, Acc acc) { return fmaf(w, x, acc); }
  static __device__ __forceinline__ Acc from_floats(const float* p) { return p[0]; }
  static __device__ __forceinline__ Acc zero() { return 0.0f; }
};
// Half types: a lane owns a channel pair (one 4-byte word), float2 in registers.
template <typename Pair>
struct PairLane {
  using Store = Pair;
  using Acc = float2;
  static constexpr int kChannels = 2;
  static __device__ __forceinline__ Acc fma(Acc w, Acc x, Acc acc) {
    return make_float2(fmaf(w.x, x.x, acc.x), fmaf(w.y, x.y, acc.y));
  }
  static __device__ __forceinline__ Acc from_floats(const float* p) {
    return *reinterpret_cast<const float2*>(p);
  }
  static __device__ __forceinline__ Acc zero() { return make_float2(0.0f, 0.0f); }
};
template <> struct Lane<__half> : PairLane<__half2> {
  static __device__ __forceinline__ float2 load(__half2 v) { return __half22float2(v); }
  static __device__ __forceinline__ __half2 store(float2 v) { return __float22half2_rn(v); }
};
template <> struct Lane<__nv_bfloat16> : PairLane<__nv_bfloat162> {
  static __device__ __forceinline__ float2 load(__nv_bfloat162 v) { return __bfloat1622float2(v); }
  static __device__ __forceinline__ __nv_bfloat162 store(float2 v) { return __float22bfloat162_rn(v); }
};

// Weights kept in shared memory instead of registers (7x7 half types).
template <typename T, int K> constexpr bool kSharedWeights = sizeof(T) == 2 && K == 7;
// Blocks per SM the register budget is set for.
constexpr int kMinBlocks = 2;

// A work unit: channel tile, image, tile row, tile column; `first` is the
// first channel tile of its group.
struct Unit {
  int ct, first, n, th, tw;
};

struct Args {
  int batch, src_h, src_w, dst_h, dst_w, channels, offset_top, offset_left, flip;
  int tile_rows, tile_cols, tiles_h, tiles_w, pitch, stage_bytes, units, group, channel_tiles;
};

// Unit order: channel tiles in groups of `group` (the last group may be
// smaller); group-major, then image, tile row, tile column, and the group's
// channel tiles innermost.  Why: a unit reads 32 bytes of each pixel, less
// than the 64 bytes DRAM delivers at once; with the channel tiles of a group
// back to back, the other half of each 64 bytes is read from L2 by the next
// unit (with group 1 it was often evicted first: DRAM read up to 2x the
// source, measured).  The weights of a whole group stay in shared memory.
__device__ __forceinline__ void advance(Unit& u, const Args& a) {
  if (++u.ct < min(u.first + a.group, a.channel_tiles)) return;
  u.ct = u.first;
  if (++u.tw == a.tiles_w) {
    u.tw = 0;
    if (++u.th == a.tiles_h) {
      u.th = 0;
      if (++u.n == a.batch) {
        u.n = 0;
        u.first += a.group;
        u.ct = u.first;
      }
    }
  }
}

__device__ __forceinline__ Unit decode(int unit, const Args& a) {
  const int per_image = a.tiles_h * a.tiles_w;
  const int spatial = a.batch * per_image;
  const int group_index = unit / (a.group * spatial);
  Unit u;
  u.first = group_index * a.group;
  const int size = min(a.group, a.channel_tiles - u.first);
  int rest = unit - u.first * spatial;
  const int position = rest / size;
  u.ct = u.first + (rest - position * size);
  rest = position;
  u.n = rest / per_image;
  rest -= u.n * per_image;
  u.th = rest / a.tiles_w;
  u.tw = rest - u.th * a.tiles_w;
  return u;
}

// This thread's 16-byte copies of unit u's source tile into `buf`, then a
// commit.  (row, col) of pixel p = p0 + m * step, stepped without division:
// step = step_r rows + step_c columns (step_c < in_w).
template <typename T, int K, typename IndexT>
__device__ __forceinline__ void copy_tile(const T* __restrict__ src, unsigned char* buf, const Unit& u,
                                          const Args& a, int in_w, int pixels, int p0, int row0, int col0,
                                          int step, int step_r, int step_c, int half) {
  constexpr int CT = kPixelBytes / static_cast<int>(sizeof(T));
  const int ih0 = u.th * a.tile_rows * kRows - a.offset_top;
  const int iw0 = u.tw * a.tile_cols * kColumns - a.offset_left;
  const T* image = src + static_cast<IndexT>(u.n) * a.src_h * a.src_w * a.channels + u.ct * CT +
                   half * (16 / static_cast<int>(sizeof(T)));
  int r = row0, c = col0;
  for (int p = p0; p < pixels; p += step) {
    const int ih = ih0 + r;
    const int iw = iw0 + c;
    const bool inside = static_cast<unsigned>(ih) < static_cast<unsigned>(a.src_h) &&
                        static_cast<unsigned>(iw) < static_cast<unsigned>(a.src_w);
    const T* from = inside ? image + (static_cast<IndexT>(ih) * a.src_w + iw) * a.channels : src;
    dwgn::cp_async<16>(buf + r * a.pitch + c * kPixelBytes + half * 16, from, inside ? 16 : 0);
    r += step_r;
    c += step_c;
    if (c >= in_w) {
      c -= in_w;
      ++r;
    }
  }
  dwgn::cp_async_commit();
}

}  // namespace dwgn_nhwc_window

template <typename T, int K, typename IndexT>
__global__ void __launch_bounds__(256, dwgn_nhwc_window::kMinBlocks) dwgn_dwconv_nhwc_window(
    const T* __restrict__ src, const T* __restrict__ weight, const T* __restrict__ bias, T* __restrict__ dst,
    int batch, int src_h, int src_w, int dst_h, int dst_w, int channels, int offset_top, int offset_left,
    int flip, int tile_rows, int tile_cols, int tiles_h, int tiles_w, int pitch, int stage_bytes, int units,
    int group) {
  using namespace dwgn_nhwc_window;
  using L = Lane<T>;
  using Acc = typename L::Acc;
  using Store = typename L::Store;
  constexpr int CT = kPixelBytes / static_cast<int>(sizeof(T));  // channels per tile
  constexpr int KK = K * K;
  constexpr int RO = kRows;
  constexpr int TW = kColumns;
  constexpr int IN_R = RO + K - 1;
  constexpr int IN_C = TW + K - 1;
  constexpr bool kShared = kSharedWeights<T, K>;
  extern __shared__ __align__(16) unsigned char shared_raw[];
  // [group][tap][CT] float weights (group * KK * CT * 4 bytes, a multiple of 16), then the ring.
  float* w_s = reinterpret_cast<float*>(shared_raw);
  unsigned char* ring = shared_raw + group * KK * CT * sizeof(float);

  const Args a{batch,     src_h,     src_w,   dst_h,   dst_w, channels,    offset_top, offset_left, flip,
               tile_rows, tile_cols, tiles_h, tiles_w, pitch, stage_bytes, units, group, channels / CT};
  const int lane = threadIdx.x & (kLanes - 1);
  const int s = threadIdx.x / kLanes;
  const int tr = s / tile_cols;
  const int tc = s - tr * tile_cols;
  const int in_h = tile_rows * RO + K - 1;
  const int in_w = tile_cols * TW + K - 1;
  const int pixels = in_h * in_w;

  // This block's contiguous range of units (balanced: sizes differ by <= 1).
  const int begin = static_cast<int>(static_cast<long long>(blockIdx.x) * units / gridDim.x);
  const int end = static_cast<int>(static_cast<long long>(blockIdx.x + 1) * units / gridDim.x);
  const int count = end - begin;
  if (count <= 0) return;  // block-uniform: no barrier is skipped by part of a block

  // Copy assignment, fixed for the kernel's life.
  const int half = threadIdx.x & 1;
  const int p0 = threadIdx.x >> 1;
  const int step = blockDim.x >> 1;
  const int row0 = p0 / in_w, col0 = p0 - (p0 / in_w) * in_w;
  const int step_r = step / in_w, step_c = step - (step / in_w) * in_w;

  Unit copy_unit = decode(begin, a);
  Unit unit = copy_unit;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    if (k < count) {
      copy_tile<T, K, IndexT>(src, ring + k * stage_bytes, copy_unit, a, in_w, pixels, p0, row0, col0, step,
                              step_r, step_c, half);
      advance(copy_unit, a);
    } else {
      dwgn::cp_async_commit();  // an empty group keeps the wait count uniform
    }
  }

  // The thread's window in a ring buffer, and its outputs' place in a tile.
  const int window = (tr * RO) * pitch + (tc * TW) * kPixelBytes + lane * 4;
  Acc w_r[kShared ? 1 : K][kShared ? 1 : K];
  Acc b = L::zero();
  int loaded_ct = -1, loaded_first = -1;
  int compute_buf = 0;
  for (int k = 0; k < count; ++k) {
    dwgn::cp_async_wait<1>();  // this thread's copies of unit k have landed
    __syncthreads();           // every thread's have; every thread finished unit k-1
    // The buffer unit k+2 goes to was last read for unit k-1.
    const int copy_buf = compute_buf == 0 ? 2 : compute_buf - 1;
    if (k + 2 < count) {
      copy_tile<T, K, IndexT>(src, ring + copy_buf * stage_bytes, copy_unit, a, in_w, pixels, p0, row0, col0,
                              step, step_r, step_c, half);
      advance(copy_unit, a);
    } else {
      dwgn::cp_async_commit();
    }
    if (unit.first != loaded_first) {  // block-uniform: once per group of channel tiles
      // Filter slice of the group: consecutive i read consecutive weights
      // (its filters are contiguous); filter j goes to [j / CT][tap][j % CT],
      // rotating by 180 degrees maps tap t to KK - 1 - t.  Nobody reads w_s
      // now (barrier above).
      const T* w_group = weight + static_cast<IndexT>(unit.first) * CT * KK;
      const int size = min(group, a.channel_tiles - unit.first);
      for (int i = threadIdx.x; i < size * KK * CT; i += blockDim.x) {
        const int j = i / KK;
        const int t = i - j * KK;
        const int jt = j / CT;
        w_s[(jt * KK + (flip ? KK - 1 - t : t)) * CT + (j - jt * CT)] = dwgn::to_acc(w_group[i]);
      }
      __syncthreads();
      loaded_first = unit.first;
    }
    // This unit's filters: [tap][CT] floats of its channel tile.
    const float* w_lane = w_s + (unit.ct - unit.first) * KK * CT + lane * L::kChannels;
    if (unit.ct != loaded_ct) {  // block-uniform
      if constexpr (!kShared) {
#pragma unroll
        for (int kh = 0; kh < K; ++kh)
#pragma unroll
          for (int kw = 0; kw < K; ++kw) w_r[kh][kw] = L::from_floats(w_lane + (kh * K + kw) * CT);
      }
      if (bias != nullptr) {
        float values[L::kChannels];
#pragma unroll
        for (int v = 0; v < L::kChannels; ++v) values[v] = dwgn::to_acc(bias[unit.ct * CT + lane * L::kChannels + v]);
        b = L::from_floats(values);
      }
      loaded_ct = unit.ct;
    }

    Acc acc[RO][TW];
#pragma unroll
    for (int j = 0; j < RO; ++j)
#pragma unroll
      for (int t = 0; t < TW; ++t) acc[j][t] = b;
    const unsigned char* x_thread = ring + compute_buf * stage_bytes + window;
    // Source row r of the window feeds output rows j = r - kh.
#pragma unroll
    for (int r = 0; r < IN_R; ++r) {
      const unsigned char* x_row = x_thread + r * pitch;
      Acc row[IN_C];
#pragma unroll
      for (int e = 0; e < IN_C; ++e) row[e] = L::load(*reinterpret_cast<const Store*>(x_row + e * kPixelBytes));
#pragma unroll
      for (int j = 0; j < RO; ++j) {
        const int kh = r - j;
        if (kh < 0 || kh >= K) continue;
#pragma unroll
        for (int kw = 0; kw < K; ++kw) {
          Acc w;
          if constexpr (kShared) {
            w = L::from_floats(w_lane + (kh * K + kw) * CT);
          } else {
            w = w_r[kh][kw];
          }
#pragma unroll
          for (int t = 0; t < TW; ++t) acc[j][t] = L::fma(w, row[t + kw], acc[j][t]);
        }
      }
    }

    const int oh0 = unit.th * tile_rows * RO + tr * RO;
    const int ow0 = unit.tw * tile_cols * TW + tc * TW;
    T* out = dst + ((static_cast<IndexT>(unit.n) * dst_h + oh0) * dst_w + ow0) * channels + unit.ct * CT +
             lane * L::kChannels;
#pragma unroll
    for (int j = 0; j < RO; ++j) {
      if (oh0 + j >= dst_h) break;
#pragma unroll
      for (int t = 0; t < TW; ++t) {
        if (ow0 + t < dst_w)
          *reinterpret_cast<Store*>(out + (static_cast<IndexT>(j) * dst_w + t) * channels) = L::store(acc[j][t]);
      }
    }
    advance(unit, a);
    compute_buf = compute_buf == 2 ? 0 : compute_buf + 1;
  }
}
