// Depthwise 2-D convolution, NCHW: deterministic weight gradient.
//
//   grad_weight[oc, kh, kw] = sum over n, oh, ow of
//       grad_out[n, oc, oh, ow] * x[n, oc / M, oh*S - pad_top + kh, ow*S - pad_left + kw]
//
// Two partial kernels, each followed (when a channel's sum is split over
// several blocks) by dwgn_dwconv2d_bwd_weight_finalize (depthwise_conv2d.cu), which adds the splits in split
// order:
//   dwgn_nchw_wgrad_small<T, K, S, R>  square K in {3, 5, 7}, stride S in {1, 2}
//       (both axes), dilation 1, R output rows per work item (2 or 4).
//       Register accumulators for all K*K taps.
//   dwgn_nchw_wgrad_large<T>        any KH x KW at stride 1, dilation 1, when
//       a padded plane fits in shared memory (e.g. 31x31 on 16x16 images).
// Every other geometry is left to dwgn_dwconv2d_bwd_weight_partial
// (depthwise_conv2d.cu); the host (cupy_dwgn/_depthwise_nchw_wgrad.py) decides.
//
// Determinism: no atomics.  Which thread sums which products, and the order
// of every reduction, depend on the shape only (the host picks the tiling and
// split count from the shape alone), so results are bit-identical run to run.
//
// Index widths: only plane base offsets can exceed 2**31; they are computed
// in 64-bit (once per staged plane or per output row), everything inside a
// plane is 32-bit (the caller checks planes have < 2**30 elements).  So these
// kernels need no IndexT parameter.

#include "dwgn_common.cuh"

using dwgn::AccType;
using dwgn::from_acc;
using dwgn::to_acc;

// Elements of T in one 16-byte vector.
template <typename T>
struct Vec16 {
  static constexpr int kCount = 16 / static_cast<int>(sizeof(T));
};

// 32-bit word w (a constant after unrolling) of the 16-byte vectors `raw`.
template <int N>
__device__ __forceinline__ unsigned int word_of(const uint4 (&raw)[N], int w) {
  const uint4& v = raw[w / 4];
  switch (w % 4) {
    case 0: return v.x;
    case 1: return v.y;
    case 2: return v.z;
    default: return v.w;
  }
}
// Unpack<T>::get<J>(raw): element J of the T values packed in `raw`, as Acc.
// Bit extraction instead of a pointer cast keeps the words in registers (a
// cast through a local array cost a stack frame for __half 3x3).
template <typename T> struct Unpack {  // the 2-byte types
  template <int J, int N>
  static __device__ __forceinline__ float get(const uint4 (&raw)[N]) {
    return dwgn::half_of_word(T(), word_of(raw, J / 2), J % 2);
  }
};

template <> struct Unpack<float> {
  template <int J, int N>
  static __device__ __forceinline__ float get(const uint4 (&raw)[N]) {
    return __uint_as_float(word_of(raw, J));
  }
};
template <> struct Unpack<double> {
  template <int J, int N>
  static __device__ __forceinline__ double get(const uint4 (&raw)[N]) {
    return __hiloint2double(static_cast<int>(word_of(raw, 2 * J + 1)),
                            static_cast<int>(word_of(raw, 2 * J)));
  }
};
// out[J] = element J of `raw` for J = 0 .. COUNT-1 (compile-time recursion,
// so every index is a constant).
template <int J, int COUNT>
struct UnrollUnpack {
  template <typename T, typename Acc, int N>
  static __device__ __forceinline__ void run(const uint4 (&raw)[N], Acc* out) {
    if constexpr (J < COUNT) {
      out[J] = Unpack<T>::template get<J>(raw);
      UnrollUnpack<J + 1, COUNT>::template run<T>(raw, out);
    }
  }
};

// ---------------------------------------------------------------------------
// Small filters.
//
// Block (oc, split) sums the taps of output channel oc over a contiguous range
// of "units" (unit u = image n = u / num_bands, band u % num_bands of
// band_rows output rows).  It walks its units a stage at a time: a stage is up
// to units_per_stage units whose input windows are staged together in shared
// memory as T, zero-padded, so the compute loop has no bounds checks:
//   staged row i of a unit  <->  input row  oh0*S - pad_top + i
//   staged col j            <->  input col  j - pad_left
// so output column ow reads staged columns ow*S + kw, and a thread's window
// for VW consecutive outputs ow0 = VW*cg starts at the 16-byte aligned column
// ow0*S.
//
// Work item (unit p, row group rg, column group cg): a thread takes the VW
// output columns [VW*cg, VW*cg + VW) of the R output rows
// oh0 + R*rg + h, h < R (dy held in registers), and walks the (R - 1)*S + K
// staged input rows those rows read, each window loaded once (NV 16-byte
// shared loads) and used by every row that reads it: staged row R*rg*S + i
// feeds row h with tap kh = i - h*S.  Items go to threads round-robin.
//
// Staged cells that no valid output reads (beyond the band's last row, or
// right of the last output's window) are zero, so the padding items of a
// partial row group / column group multiply zero by zero.
// Two blocks of 256 per SM (<= 128 registers), except float64 7x7 whose 49
// double accumulators need about 172 registers.
template <typename T, int K>
constexpr int small_min_blocks() {
  return sizeof(typename AccType<T>::type) == 8 && K == 7 ? 1 : 2;
}

// Staging copies kStageSlots rows per thread per batch: all the batch's
// global loads are issued before any shared store, so kStageSlots loads are in
// flight per thread instead of one (the staging was latency bound).
constexpr int kStageSlots = 8;
// Row-table entry of a staged row that is all zeros (outside the image or
// past the rows its unit's outputs read).
constexpr long long kZeroRow = -0x7fffffffffffffffLL - 1;

// Output rows per work item: R, a template parameter (2 or 4; the host's
// _item_rows picks it).  ncu on an H200 (2026-12-01, 64x144x56 3x3 float32,
// R = 2): 63.4M warp instructions for 8.1M warp FMAs, half the issue slots
// used; the per-item work outside the FMAs (the item's index decode with its
// divisions, its grad_out loads, the (R - 1)*S + K staged rows it reads) is
// paid once per R rows.

// The R grad_out rows of work item `item` of the stage starting at unit0
// (zero for a row past the band or a column past the image), and where the
// item's staged window starts (element offset in the staging buffer).
template <typename T, int K, int S, int R>
__device__ __forceinline__ int load_item_dy(
    const T* __restrict__ grad_out, typename AccType<T>::type (&dy)[R][Vec16<T>::kCount], int item,
    int unit0, int oc, int out_channels, int out_height, int out_width, int band_rows,
    int num_bands, int groups, int col_groups, int unit_elems, int staged_width, bool dy_vector) {
  using Acc = typename AccType<T>::type;
  constexpr int VW = Vec16<T>::kCount;
  const int cg = item % col_groups;
  const int rest = item / col_groups;
  const int rg = rest % groups;
  const int p = rest / groups;
  const int u = unit0 + p;
  const int n = u / num_bands;
  const int oh0 = (u - n * num_bands) * band_rows;
  const int rows_in_band = min(band_rows, out_height - oh0);
  const int ow0 = cg * VW;
#pragma unroll
  for (int h = 0; h < R; ++h) {
    const int r = R * rg + h;
    const T* dy_row = grad_out +
        ((static_cast<long long>(n) * out_channels + oc) * out_height + oh0 + min(r, rows_in_band - 1)) * out_width + ow0;
    if (r < rows_in_band && dy_vector) {
      const uint4 raw[1] = {__ldg(reinterpret_cast<const uint4*>(dy_row))};
      UnrollUnpack<0, VW>::template run<T>(raw, dy[h]);
    } else {
#pragma unroll
      for (int v = 0; v < VW; ++v) {
        dy[h][v] = (r < rows_in_band && ow0 + v < out_width) ? to_acc(dy_row[v]) : Acc(0);
      }
    }
  }
  return p * unit_elems + R * rg * S * staged_width + ow0 * S;
}

template <typename T, int K, int S, int R>
__global__ void __launch_bounds__(256, small_min_blocks<T, K>()) dwgn_nchw_wgrad_small(
    const T* __restrict__ grad_out, const T* __restrict__ x,
    typename AccType<T>::type* __restrict__ partial, T* __restrict__ grad_weight,
    int channels, int height, int width, int multiplier, int out_height, int out_width,
    int pad_top, int pad_left, int band_rows, int num_bands, int num_units,
    int units_per_stage, int col_groups, int staged_width, int lanes_log2) {
  dwgn::allow_dependent_grid();  // the finalize (a programmatic launch) may be placed; it waits for this grid
  using Acc = typename AccType<T>::type;
  constexpr int VW = Vec16<T>::kCount;          // output columns per thread
  constexpr int kWindow = (VW - 1) * S + K;     // input columns they read
  constexpr int NV = (kWindow + VW - 1) / VW;   // 16-byte loads per window
  constexpr int kItemRows = (R - 1) * S + K;    // input rows they read
  __shared__ Acc scratch[K * K * 32];
  extern __shared__ __align__(16) unsigned char shared_raw[];

  const int oc = blockIdx.x;
  const int ic = oc / multiplier;
  const int out_channels = channels * multiplier;
  const int split = blockIdx.y;
  const int num_splits = gridDim.y;

  // Rows staged per unit: a whole number of row groups (the last group of a
  // band of band_rows % R != 0 reads rows past the band; they are staged as
  // zeros).
  const int groups = (band_rows + R - 1) / R;
  const int staged_rows = (R * groups - 1) * S + K;
  const int unit_elems = staged_rows * staged_width;
  const int cols_valid = (out_width - 1) * S + K;  // staged columns valid outputs read
  // A stage's shared region: its staged units, then the row table (x offset
  // of staged column 0 of each staged row, input column -pad_left, or
  // kZeroRow).  unit_elems * sizeof(T) is a multiple of 16 (staged_width is
  // a multiple of VW); the host rounds the region up to 16 bytes.
  const int region_bytes = (units_per_stage * (unit_elems * static_cast<int>(sizeof(T)) + staged_rows * 8) + 15) / 16 * 16;
  auto staged_of = [&](int b) { return reinterpret_cast<T*>(shared_raw + b * region_bytes); };
  auto table_of = [&](int b) { return reinterpret_cast<long long*>(staged_of(b) + units_per_stage * unit_elems); };
  // 16-byte grad_out loads need every output row 16-byte aligned.
  const bool dy_vector = out_width % VW == 0 && (reinterpret_cast<size_t>(grad_out) & 15) == 0;
  const long long plane_stride = static_cast<long long>(height) * width;

  // This split's stages: contiguous, nearly equal shares (shape-only).
  const int num_stages = (num_units + units_per_stage - 1) / units_per_stage;
  const int stage_begin = num_stages / num_splits * split + min(split, num_stages % num_splits);
  const int stage_end = stage_begin + num_stages / num_splits + (split < num_stages % num_splits ? 1 : 0);

  // Row table of stage `stage` into `table`.
  auto build_table = [&](int stage, long long* table) {
    const int unit0 = stage * units_per_stage;
    const int total_rows = min(units_per_stage, num_units - unit0) * staged_rows;
    for (int row = threadIdx.x; row < total_rows; row += blockDim.x) {
      const int p = row / staged_rows;
      const int i = row - p * staged_rows;
      const int u = unit0 + p;
      const int n = u / num_bands;
      const int oh0 = (u - n * num_bands) * band_rows;
      const int rows_valid = (min(band_rows, out_height - oh0) - 1) * S + K;
      const int ih = oh0 * S - pad_top + i;
      const bool row_in = i < rows_valid && ih >= 0 && ih < height;
      table[row] = row_in ? (static_cast<long long>(n) * channels + ic) * plane_stride +
                                static_cast<long long>(ih) * width - pad_left
                          : kZeroRow;
    }
  };

  Acc acc[K * K];
#pragma unroll
  for (int t = 0; t < K * K; ++t) acc[t] = Acc(0);

  // float64 stages with cp.async, double-buffered: stage s + 1's copies are
  // in flight while stage s is summed (every element is naturally aligned for
  // a copy of its own size, whatever pad_left is).  Measured on an H200
  // (2026-12-01, weight gradient, N = 64): float64 64x96x112 3x3 s2 618 ->
  // 430 us, 64x144x56 3x3 291 -> 260, 64x96x56 7x7 625 -> 578; float32 lost
  // with it (64x144x56 3x3 126 -> 137, 64x384x28 80 -> 94: a 4-byte cp.async
  // per element), so float32 and the 2-byte types (cp.async copies at least
  // 4 aligned bytes, and pad_left makes an input row's pairs straddle staged
  // pairs) copy through registers into one buffer.
  constexpr bool kAsync = sizeof(T) == 8;
  constexpr int kCopyBytes = 8;  // issue_copies: kAsync only
  auto issue_copies = [&](int stage, T* staged, const long long* table) {
    const int unit0 = stage * units_per_stage;
    const int cells = min(units_per_stage, num_units - unit0) * staged_rows * staged_width;
    for (int cell = threadIdx.x; cell < cells; cell += blockDim.x) {
      const int row = cell / staged_width;
      const int j = cell - row * staged_width;
      const long long off = table[row];
      const bool inside = off != kZeroRow && j < cols_valid && j >= pad_left && j - pad_left < width;
      dwgn::cp_async<kCopyBytes>(staged + cell, inside ? x + off + j : x, inside ? kCopyBytes : 0);
    }
    dwgn::cp_async_commit();
  };
  if constexpr (kAsync) {
    if (stage_begin < stage_end) {
      build_table(stage_begin, table_of(0));
      __syncthreads();  // the table is complete
      issue_copies(stage_begin, staged_of(0), table_of(0));
    }
  }

  for (int stage = stage_begin; stage < stage_end; ++stage) {
    const int unit0 = stage * units_per_stage;
    const int units = min(units_per_stage, num_units - unit0);
    const int total_rows = units * staged_rows;
    const int items = units * groups * col_groups;
    const int b = kAsync ? (stage - stage_begin) & 1 : 0;
    const T* staged = staged_of(b);

    // grad_out of this thread's first item, loaded now so its latency hides
    // behind the staging.
    Acc dy[R][VW];
    int s_offset = 0;
    if (static_cast<int>(threadIdx.x) < items) {
      s_offset = load_item_dy<T, K, S, R>(grad_out, dy, threadIdx.x, unit0, oc, out_channels, out_height,
                                       out_width, band_rows, num_bands, groups, col_groups, unit_elems,
                                       staged_width, dy_vector);
    }

    if constexpr (kAsync) {
      if (stage + 1 < stage_end) {
        build_table(stage + 1, table_of(b ^ 1));
        // The table is complete, and every thread is done summing stage - 1,
        // whose buffer the next copies overwrite.
        __syncthreads();
        issue_copies(stage + 1, staged_of(b ^ 1), table_of(b ^ 1));
        dwgn::cp_async_wait<1>();  // this thread's copies of this stage have landed
      } else {
        dwgn::cp_async_wait<0>();
      }
      __syncthreads();  // every thread's copies of this stage are visible
    } else {
      // Row table (its previous contents were last read before the previous
      // stage's post-copy barrier, so no barrier is needed before writing it).
      long long* row_table = table_of(0);
      build_table(stage, row_table);
      __syncthreads();  // the table is written and every thread is done reading the previous stage

      // Staging lanes: groups of 2**lanes_log2 threads copy one staged row
      // (columns col, col + lanes, ...); rows_per_pass groups work side by
      // side (threads beyond the last whole group idle while staging).
      const int lanes = 1 << lanes_log2;
      const int rows_per_pass = blockDim.x >> lanes_log2;
      const int stage_sub = threadIdx.x >> lanes_log2;
      const int stage_col = threadIdx.x & (lanes - 1);
      T* staging = staged_of(0);
      if (stage_sub < rows_per_pass) {
        for (int j = stage_col; j - stage_col < staged_width; j += lanes) {
          const bool col_in = j < cols_valid && j >= pad_left && j - pad_left < width;
          for (int row0 = stage_sub; row0 < total_rows; row0 += rows_per_pass * kStageSlots) {
            T v[kStageSlots];
#pragma unroll
            for (int s = 0; s < kStageSlots; ++s) {
              const int row = row0 + s * rows_per_pass;
              const long long off = row < total_rows ? row_table[row] : kZeroRow;
              v[s] = (col_in && off != kZeroRow) ? x[off + j] : from_acc<T>(Acc(0));
            }
            if (j < staged_width) {
#pragma unroll
              for (int s = 0; s < kStageSlots; ++s) {
                const int row = row0 + s * rows_per_pass;
                if (row < total_rows) staging[row * staged_width + j] = v[s];
              }
            }
          }
        }
      }
      __syncthreads();  // the stage is complete
    }

    for (int item = threadIdx.x; item < items; item += blockDim.x) {
      if (item != static_cast<int>(threadIdx.x)) {
        s_offset = load_item_dy<T, K, S, R>(grad_out, dy, item, unit0, oc, out_channels, out_height,
                                         out_width, band_rows, num_bands, groups, col_groups, unit_elems,
                                         staged_width, dy_vector);
      }
      const T* s_base = staged + s_offset;
#pragma unroll
      for (int i = 0; i < kItemRows; ++i) {
        uint4 raw[NV];
        const uint4* s_vec = reinterpret_cast<const uint4*>(s_base + i * staged_width);
#pragma unroll
        for (int q = 0; q < NV; ++q) raw[q] = s_vec[q];
        Acc win[kWindow];
        UnrollUnpack<0, kWindow>::template run<T>(raw, win);
#pragma unroll
        for (int h = 0; h < R; ++h) {
          const int kh = i - h * S;  // compile-time after unrolling
          if (kh < 0 || kh >= K) continue;
#pragma unroll
          for (int kw = 0; kw < K; ++kw) {
#pragma unroll
            for (int v = 0; v < VW; ++v) acc[kh * K + kw] += dy[h][v] * win[v * S + kw];
          }
        }
      }
    }
    // No barrier here: the next stage's first barrier (after its row table)
    // orders these reads before its copies or staging writes.
  }

  // Fixed-order block tree (warp butterflies, then warp 0 over the warps).
  dwgn::block_sum(acc, scratch);
  if (threadIdx.x == 0) {
    if (num_splits == 1) {
#pragma unroll
      for (int t = 0; t < K * K; ++t) grad_weight[oc * K * K + t] = from_acc<T>(acc[t]);
    } else {
      Acc* out = partial + (static_cast<long long>(oc) * num_splits + split) * (K * K);
#pragma unroll
      for (int t = 0; t < K * K; ++t) out[t] = acc[t];
    }
  }
}

// ---------------------------------------------------------------------------
// Large filters, stride 1, dilation 1 (e.g. 31x31 on 16x16 images).
//
//   dw[kh][kw] = sum over n, oh, ow of dy[n][oh][ow] * xpad[n][oh + kh][ow + kw]
//
// Block (oc, split) loops over its images n in order.  Per image it stages the
// padded input plane and the grad_out plane as Acc in shared memory:
//   staged row r <-> input row r - pad_top, staged col c <-> input col c - pad_left,
// rows_staged = OH - 1 + KHp, cols_staged = OW - 1 + KWp (KHp, KWp: the filter
// rounded up to the tap tiling, so padding taps read inside the buffer).
// Warp w owns the tap tile (kh0 .. kh0 + kRows - 1) x (kw0 .. kw0 + 31), lane
// = kw - kw0; each thread owns kRows taps of one column and keeps their sums
// in registers for the whole block, so no cross-thread reduction is needed.
// It walks ow, and slides down oh with a kRows-row register window of x (one
// shared load of x and one broadcast load of dy per output).  Output rows and
// columns whose window misses the image for every tap of the warp's tile are
// skipped (with 16x16 images and pad 15 most of them).
constexpr int kLargeRows = 4;  // kh rows per thread

template <typename T>
__global__ void __launch_bounds__(512) dwgn_nchw_wgrad_large(
    const T* __restrict__ grad_out, const T* __restrict__ x,
    typename AccType<T>::type* __restrict__ partial, T* __restrict__ grad_weight,
    int batch, int channels, int height, int width, int multiplier, int out_height,
    int out_width, int filter_height, int filter_width, int pad_top, int pad_left) {
  dwgn::allow_dependent_grid();  // the finalize (a programmatic launch) may be placed; it waits for this grid
  using Acc = typename AccType<T>::type;
  constexpr int kRows = kLargeRows;
  extern __shared__ __align__(16) unsigned char shared_raw[];
  const int kw_tiles = (filter_width + 31) / 32;
  const int kh_tiles = (filter_height + kRows - 1) / kRows;
  const int rows_staged = out_height - 1 + kh_tiles * kRows;
  const int cols_staged = out_width - 1 + kw_tiles * 32;
  Acc* xs = reinterpret_cast<Acc*>(shared_raw);
  Acc* dys = xs + rows_staged * cols_staged;

  const int oc = blockIdx.x;
  const int ic = oc / multiplier;
  const int out_channels = channels * multiplier;
  const int split = blockIdx.y;
  const int num_splits = gridDim.y;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  // The host launches exactly kh_tiles * kw_tiles warps.
  const int kw0 = (warp % kw_tiles) * 32;
  const int kh0 = (warp / kw_tiles) * kRows;
  const int kw = kw0 + lane;

  // Output rows where some tap row of this warp meets an input row:
  // 0 <= oh + kh - pad_top < height for some kh in [kh0, kh0 + kRows).
  const int oh_begin = max(0, pad_top - kh0 - kRows + 1);
  const int oh_end = min(out_height, pad_top - kh0 + height);  // exclusive
  // Likewise for columns over the warp's 32 kw.
  const int ow_begin = max(0, pad_left - kw0 - 31);
  const int ow_end = min(out_width, pad_left - kw0 + width);

  const int n_begin = batch / num_splits * split + min(split, batch % num_splits);
  const int n_end = n_begin + batch / num_splits + (split < batch % num_splits ? 1 : 0);

  Acc acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = Acc(0);

  for (int n = n_begin; n < n_end; ++n) {
    __syncthreads();  // every thread is done reading the previous image
    const T* x_plane = x + (static_cast<long long>(n) * channels + ic) * height * width;
    for (int i = threadIdx.x; i < rows_staged * cols_staged; i += blockDim.x) {
      const int r = i / cols_staged;
      const int ih = r - pad_top;
      const int iw = i - r * cols_staged - pad_left;
      xs[i] = (ih >= 0 && ih < height && iw >= 0 && iw < width) ? to_acc(x_plane[ih * width + iw]) : Acc(0);
    }
    const T* dy_plane = grad_out + (static_cast<long long>(n) * out_channels + oc) * out_height * out_width;
    for (int i = threadIdx.x; i < out_height * out_width; i += blockDim.x) dys[i] = to_acc(dy_plane[i]);
    __syncthreads();  // both planes are staged

    for (int ow = ow_begin; ow < ow_end; ++ow) {
      const Acc* x_col = xs + (oh_begin + kh0) * cols_staged + ow + kw;
      Acc win[kRows];
#pragma unroll
      for (int r = 0; r < kRows - 1; ++r) win[r + 1] = x_col[r * cols_staged];
      for (int oh = oh_begin; oh < oh_end; ++oh) {
#pragma unroll
        for (int r = 0; r < kRows - 1; ++r) win[r] = win[r + 1];
        win[kRows - 1] = x_col[(oh - oh_begin + kRows - 1) * cols_staged];
        const Acc d = dys[oh * out_width + ow];
#pragma unroll
        for (int r = 0; r < kRows; ++r) acc[r] += d * win[r];
      }
    }
  }

  if (kw < filter_width) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int kh = kh0 + r;
      if (kh >= filter_height) break;
      const int tap = kh * filter_width + kw;
      if (num_splits == 1) {
        grad_weight[static_cast<long long>(oc) * filter_height * filter_width + tap] = from_acc<T>(acc[r]);
      } else {
        partial[(static_cast<long long>(oc) * num_splits + split) * filter_height * filter_width + tap] = acc[r];
      }
    }
  }
}

