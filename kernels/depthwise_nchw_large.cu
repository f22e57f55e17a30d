// Depthwise 2-D convolution, NCHW, large filters (9x9 .. 31x31 and beyond),
// stride 1, dilation 1: forward and backward-input.
//
// Both directions are one stride-1 correlation of a source plane with a
// filter (see depthwise_conv2d.cu, dwgn_dwconv2d_tiled):
//   forward:        dst = y (n, oc), src = x (n, oc / M), filter oc,
//                   offset = (pad_top, pad_left), plus bias;
//   backward-input: dst = dx (n, c), summed over the M sources
//                   grad_out (n, c*M + m) with filter c*M + m rotated by 180
//                   degrees, offset = filter size - 1 - pad (may be < 0).
// dst(r, c) = sum over kh, kw of src(r - off_top + kh, c - off_left + kw) * w(kh, kw),
// a source element outside the source plane reading zero.
//
// Block: NB destination planes that share one filter (consecutive batch
// items n of one channel) times one band of BAND_ROWS destination rows.  The
// source rows the band reads (clipped to the image: no zero rows are ever
// stored) of the NB planes are staged in shared memory as Acc, with a few
// zero columns left and right; the filter is staged once per block (rotated
// for backward) with VH-1 zero rows above and below.
//
// Thread: one item = VH consecutive rows x VW consecutive columns of one
// destination plane, accumulated in registers.  It loops only over the
// source rows that lie inside the image for its rows (no per-tap test), and
// over the filter columns kw for which at least one of its VW outputs reads
// inside the image.  Along kw the VW+3 source values of the row are a
// sliding register window: per group of 4 taps it loads 4 new source values
// and, per output row, 4 weights with one 16-byte shared load (a broadcast
// when the warp's rows agree), and does VH*VW*4 FMAs.
//
// Items are numbered plane-fastest, then row group, then column strip, so
// item L = p + NB * g (plane slot p, row group g) within a strip.  Staged
// source rows and result rows are stored in groups of kVH rows; the plane
// pitch is congruent to an odd c and the row-group pitch to NB * c modulo 32
// banks, so the address a lane reads or writes is L * c + const (mod 32):
// the 32 lanes of a warp (within one strip) hit 32 different banks, or the
// same word (broadcast) where their rows coincide at the image border.
// Weights: lanes whose rows agree read the same 16 bytes (broadcast).
//
// Results go through shared memory so that the global stores are coalesced
// rows of the destination plane (a thread's own VW outputs are 32 bytes
// apart from its neighbours').
//
// Staging walks the flat (plane, row, column) index of the block with a
// fixed stride without a division per element (Walk3) and keeps kBatch
// global loads in flight per thread: the blocks of a single wave otherwise
// wait for one load latency per element.

#include "dwgn_common.cuh"

using dwgn::AccType;
using dwgn::from_acc;
using dwgn::to_acc;

namespace dwgn_large {

// Outputs per thread: VH rows x VW columns.
constexpr int kVW = 8;
constexpr int kVH = 2;
// Filter columns per step of the sliding window (one 16-byte weight load for float).
constexpr int kStep = 4;
constexpr int kMaxThreads = 512;

// Four consecutive weights from 16-byte-aligned shared memory.
__device__ __forceinline__ void load4(const float* p, float (&w)[kStep]) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  w[0] = v.x;
  w[1] = v.y;
  w[2] = v.z;
  w[3] = v.w;
}
__device__ __forceinline__ void load4(const double* p, double (&w)[kStep]) {
  const double2 a = *reinterpret_cast<const double2*>(p);
  const double2 b = *reinterpret_cast<const double2*>(p + 2);
  w[0] = a.x;
  w[1] = a.y;
  w[2] = b.x;
  w[3] = b.y;
}

// Global loads in flight per thread while staging.
constexpr int kBatch = 4;

// e = (a * rows + r) * cols + c for e = first, first + step, ... without a
// division per step (rows, cols >= 1; the caller stops at its total).
struct Walk3 {
  int a, r, c;
  int da, dr, dc;
  int rows, cols;
  __device__ __forceinline__ Walk3(int first, int step, int rows_, int cols_) : rows(rows_), cols(cols_) {
    int q = first / cols;
    c = first - q * cols;
    a = q / rows;
    r = q - a * rows;
    q = step / cols;
    dc = step - q * cols;
    da = q / rows;
    dr = q - da * rows;
  }
  __device__ __forceinline__ void advance() {
    c += dc;
    int carry = 0;
    if (c >= cols) {
      c -= cols;
      carry = 1;
    }
    r += dr + carry;  // < 2 * rows
    a += da;
    if (r >= rows) {
      r -= rows;
      a += 1;
    }
  }
};

}  // namespace dwgn_large

// Scalars (all computed by cupy_dwgn/_depthwise_nchw_large.py, which sizes
// the dynamic shared memory from the same numbers):
//   planes_per_block   NB, destination planes per block (batch items n)
//   band_rows          destination rows per block, a multiple of kVH
//   batch_groups       ceil(batch / NB); blockIdx.x = filter * batch_groups + group
//   halo_left          zero columns stored left of source column 0
//   src_pitch          shared pitch between the kVH rows of a staged row group
//   src_group_pitch    shared pitch between staged row groups (NB * c mod 32)
//   src_plane_pitch    shared pitch between staged planes (c mod 32)
//   filter_pitch       shared row pitch of the filter, a multiple of kStep
//   out_row_pitch      shared pitch between the kVH rows of a result row group
//   out_group_pitch    shared pitch between result row groups (NB * c' mod 32)
//   out_plane_pitch    shared pitch between result planes (c' mod 32)
// Shared layout: filter [(KH + 2*(kVH-1)) * filter_pitch], then the staged
// source planes, which the result tile overwrites after the last product.
// Staged source row r (image row src_row0 + r) of plane slot p starts at
// p * src_plane_pitch + (r / kVH) * src_group_pitch + (r % kVH) * src_pitch;
// result row r (destination row row0 + r) likewise with the out_ pitches.
template <typename T, bool BACKWARD, typename IndexT>
__global__ void __launch_bounds__(dwgn_large::kMaxThreads) dwgn_dwconv2d_large(
    const T* __restrict__ src, const T* __restrict__ weight, const T* __restrict__ bias,
    T* __restrict__ dst, int batch, int channels, int multiplier, int src_height,
    int src_width, int dst_height, int dst_width, int filter_height, int filter_width,
    int offset_top, int offset_left, int planes_per_block, int band_rows, int batch_groups,
    int halo_left, int src_pitch, int src_group_pitch, int src_plane_pitch, int filter_pitch,
    int out_row_pitch, int out_group_pitch, int out_plane_pitch) {
  using Acc = typename AccType<T>::type;
  using namespace dwgn_large;
  extern __shared__ __align__(16) unsigned char shared_raw[];
  Acc* filter_smem = reinterpret_cast<Acc*>(shared_raw);
  const int filter_rows = filter_height + 2 * (kVH - 1);
  Acc* planes_smem = filter_smem + filter_rows * filter_pitch;

  const int filter_index = static_cast<int>(blockIdx.x) / batch_groups;  // oc (fwd) or c (bwd)
  const int n0 = (static_cast<int>(blockIdx.x) - filter_index * batch_groups) * planes_per_block;
  const int plane_count = min(planes_per_block, batch - n0);  // planes of this block (>= 1)
  const int row0 = static_cast<int>(blockIdx.y) * band_rows;  // first destination row
  const int out_channels = channels * multiplier;
  const int strips = (dst_width + kVW - 1) / kVW;
  const int row_groups = band_rows / kVH;

  // Source rows of the band: every row some destination row of
  // [row0, row0 + band_rows) reads, clipped to the image.
  const int src_row0 = min(max(row0 - offset_top, 0), src_height);
  const int src_row1 = min(max(row0 + band_rows - 1 - offset_top + filter_height, 0), src_height);
  const int src_rows = max(src_row1 - src_row0, 0);

  // This thread's item.
  const int item = threadIdx.x;
  const int plane_slot = item % planes_per_block;
  const int item_rest = item / planes_per_block;
  const int row_group = item_rest % row_groups;
  const int strip = item_rest / row_groups;
  const bool active = strip < strips && plane_slot < plane_count;
  const int out_row = row0 + row_group * kVH;  // first of the thread's kVH rows
  const int out_col = strip * kVW;             // first of its kVW columns

  // Source rows inside the image for at least one of the thread's rows: no
  // tap outside them is visited (rows of the union that one output row does
  // not read meet its zero filter rows).
  int ih_begin = max(out_row - offset_top, src_row0);
  int ih_end = min(out_row + kVH - 1 - offset_top + filter_height, src_row1);
  // Filter columns for which one of the kVW outputs reads inside the image:
  // out_col + j + kw - offset_left in [0, src_width) for some j < kVW.  The
  // start is rounded down to a multiple of kStep (aligned weight loads); the
  // extra columns read the zero columns left of the image (halo_left >=
  // min(offset_left, kVW + kStep - 2) covers them).
  const int kw_lo = max(0, offset_left - out_col - (kVW - 1));
  const int kw_end = min(filter_width, src_width + offset_left - out_col);
  const int kw_begin = kw_lo & ~(kStep - 1);
  if (kw_end <= kw_lo) ih_end = ih_begin;  // no column inside the image
  const int kw_chunks = (kw_end - kw_begin) / kStep;
  const int kw_singles = (kw_end - kw_begin) - kw_chunks * kStep;

  Acc acc[kVH][kVW];
#pragma unroll
  for (int i = 0; i < kVH; ++i)
#pragma unroll
    for (int j = 0; j < kVW; ++j) acc[i][j] = 0;

  const int sources = BACKWARD ? multiplier : 1;
  for (int s = 0; s < sources; ++s) {
    const int filter = BACKWARD ? filter_index * multiplier + s : filter_index;
    __syncthreads();  // every thread is done reading the previous source and filter
    {
      // Filter: row kh is stored at row kh + kVH - 1; zero rows and columns around it.
      const T* w_filter = weight + filter * filter_height * filter_width;
      const int total = filter_rows * filter_pitch;
      for (int e0 = threadIdx.x; e0 < total; e0 += kBatch * blockDim.x) {
        Acc v[kBatch];
#pragma unroll
        for (int k = 0; k < kBatch; ++k) {
          const int e = e0 + k * static_cast<int>(blockDim.x);
          const int r = e / filter_pitch;
          const int kw = e - r * filter_pitch;
          const int kh = r - (kVH - 1);
          v[k] = 0;
          if (e < total && kh >= 0 && kh < filter_height && kw < filter_width) {
            v[k] = to_acc(BACKWARD ? w_filter[(filter_height - 1 - kh) * filter_width + (filter_width - 1 - kw)]
                                   : w_filter[kh * filter_width + kw]);
          }
        }
#pragma unroll
        for (int k = 0; k < kBatch; ++k) {
          const int e = e0 + k * static_cast<int>(blockDim.x);
          if (e < total) filter_smem[e] = v[k];
        }
      }
    }
    // Source planes: staged row r is image row src_row0 + r; stored column
    // halo_left + col holds image column col, zero outside [0, src_width).
    // Consecutive plane slots are consecutive batch items.
    const int total = plane_count * src_rows * src_pitch;
    if (total > 0) {
      const int first_plane = BACKWARD ? n0 * out_channels + filter : n0 * channels + filter / multiplier;
      const IndexT plane_stride = static_cast<IndexT>(BACKWARD ? out_channels : channels) * src_height * src_width;
      const T* src0 = src + (static_cast<IndexT>(first_plane) * src_height + src_row0) * src_width;
      // Two walks over the same elements: one loads kBatch of them, the other
      // then stores them (recomputing the shared offsets keeps registers free).
      Walk3 load_at(threadIdx.x, blockDim.x, src_rows, src_pitch);  // a = plane slot, r = row, c = column
      Walk3 store_at = load_at;
      for (int e0 = threadIdx.x; e0 < total; e0 += kBatch * blockDim.x) {
        Acc v[kBatch];
#pragma unroll
        for (int k = 0; k < kBatch; ++k) {
          const int col = load_at.c - halo_left;
          v[k] = 0;
          if (e0 + k * static_cast<int>(blockDim.x) < total && col >= 0 && col < src_width) {
            v[k] = to_acc(src0[load_at.a * plane_stride + static_cast<IndexT>(load_at.r * src_width + col)]);
          }
          load_at.advance();
        }
#pragma unroll
        for (int k = 0; k < kBatch; ++k) {
          if (e0 + k * static_cast<int>(blockDim.x) < total) {
            planes_smem[store_at.a * src_plane_pitch + (store_at.r / kVH) * src_group_pitch +
                        (store_at.r % kVH) * src_pitch + store_at.c] = v[k];
          }
          store_at.advance();
        }
      }
    }
    __syncthreads();  // filter and source planes are complete

    if (active) {
      const Acc* plane_s = planes_smem + plane_slot * src_plane_pitch + halo_left + out_col - offset_left;
      for (int ih = ih_begin; ih < ih_end; ++ih) {
        // s_row[kw + j] = src(ih, out_col + j + kw - offset_left)
        const unsigned staged_row = static_cast<unsigned>(ih - src_row0);
        const Acc* s_row = plane_s + (staged_row / kVH) * src_group_pitch + (staged_row % kVH) * src_pitch;
        // Output row out_row + i uses filter row ih - out_row - i + offset_top,
        // stored kVH - 1 rows further down.
        const Acc* w_row = filter_smem + (ih - out_row + offset_top + kVH - 1) * filter_pitch;
        int kw = kw_begin;
        Acc window[kVW + kStep - 1];
#pragma unroll
        for (int j = 0; j < kVW - 1; ++j) window[j] = s_row[kw + j];
        // Not unrolled: unrolling by 3 removes the window copies but needs ~95
        // registers (2 instead of 4 blocks of 256 threads per SM).
#pragma unroll 1
        for (int chunk = 0; chunk < kw_chunks; ++chunk, kw += kStep) {
#pragma unroll
          for (int q = 0; q < kStep; ++q) window[kVW - 1 + q] = s_row[kw + kVW - 1 + q];
#pragma unroll
          for (int i = 0; i < kVH; ++i) {
            Acc w[kStep];
            dwgn_large::load4(w_row - i * filter_pitch + kw, w);
#pragma unroll
            for (int q = 0; q < kStep; ++q)
#pragma unroll
              for (int j = 0; j < kVW; ++j) acc[i][j] += window[j + q] * w[q];
          }
#pragma unroll
          for (int j = 0; j < kVW - 1; ++j) window[j] = window[j + kStep];
        }
        for (int single = 0; single < kw_singles; ++single, ++kw) {
          window[kVW - 1] = s_row[kw + kVW - 1];
#pragma unroll
          for (int i = 0; i < kVH; ++i) {
            const Acc w = w_row[kw - i * filter_pitch];
#pragma unroll
            for (int j = 0; j < kVW; ++j) acc[i][j] += window[j] * w;
          }
#pragma unroll
          for (int j = 0; j < kVW - 1; ++j) window[j] = window[j + 1];
        }
      }
    }
  }

  // Results: registers -> shared tile -> coalesced rows of each destination plane.
  __syncthreads();  // every thread is done reading the staged source planes
  if (active) {
    Acc* tile = planes_smem + plane_slot * out_plane_pitch + row_group * out_group_pitch + out_col;
#pragma unroll
    for (int i = 0; i < kVH; ++i)
#pragma unroll
      for (int j = 0; j < kVW; ++j) tile[i * out_row_pitch + j] = acc[i][j];
  }
  __syncthreads();  // the result tile is complete
  const int band_height = min(band_rows, dst_height - row0);  // >= 1
  const int total = plane_count * band_height * dst_width;
  const Acc bias_value = (!BACKWARD && bias != nullptr) ? to_acc(bias[filter_index]) : Acc(0);
  const int first_plane = BACKWARD ? n0 * channels + filter_index : n0 * out_channels + filter_index;
  const IndexT plane_stride = static_cast<IndexT>(BACKWARD ? channels : out_channels) * dst_height * dst_width;
  T* dst0 = dst + (static_cast<IndexT>(first_plane) * dst_height + row0) * dst_width;
  Walk3 at(threadIdx.x, blockDim.x, band_height, dst_width);  // a = plane slot, r = row, c = column
  for (int e = threadIdx.x; e < total; e += blockDim.x, at.advance()) {
    const Acc value = planes_smem[at.a * out_plane_pitch + (at.r / kVH) * out_group_pitch +
                                  (at.r % kVH) * out_row_pitch + at.c];
    dst0[at.a * plane_stride + static_cast<IndexT>(at.r * dst_width + at.c)] = from_acc<T>(value + bias_value);
  }
}
