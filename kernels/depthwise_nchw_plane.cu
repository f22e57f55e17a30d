// Depthwise 2-D convolution, NCHW, planes of rows of 10 values and up:
// whole source planes (or bands of their rows) copied into shared memory as
// they are (no padding, no conversion), for 3x3, 5x5 and 7x7 filters at
// dilation 1, depth multiplier 1: the forward at stride 1 or 2, and
// backward-input (stride 1) as the forward correlation with the rotated
// filter.
//
// Why a kernel of its own: at 28x28 and below the register window kernel
// (depthwise_nchw_window.cu) spends more issue slots than bytes on its
// staging (row copies of 2-8 bytes into a padded layout), and its half-type
// cells ran slower than float32 (H200, 2026-12-01: 64x384x28 3x3 fp16
// forward 66.9 us against 48.7 for float32).  A first version of this
// kernel expanded each plane into a zero-padded float layout; ncu counted
// 36M warp instructions for 64x384x28 fp16 3x3 (55 us), two thirds of them
// the expansion's integer index work.  Here a unit's planes are one
// contiguous range of src, copied with 16-byte cp.async, three buffers deep
// (the copy of unit u+1 flies while unit u is computed; the buffer it
// overwrites was last read two units earlier, before the barrier of unit
// u), and each thread reads its window straight from the raw planes: the
// padding is handled by skipping source rows outside the image (they add
// nothing) and masking the columns outside it (per-thread masks, fixed for
// the kernel's life), and each value is converted as it is read
// ((R + KH - 1) x (V + KW - 1) conversions per R x V outputs).
//
// Work unit = P consecutive planes (N*C planes are contiguous in NCHW), or,
// for planes of more than 256 items or whose buffers pass 48 KB (num_bands
// > 1), a band of row_blocks *
// R destination rows of one plane with the source rows its items read (one
// contiguous range too; neighbouring bands re-read KH - STRIDE rows): the
// wide planes of EfficientNet's first stages (75x75, 150x150), whose rows of
// odd or unaligned widths the window kernel stages with shared-memory
// expansion or 4-byte copies.  A persistent block (the grid is at most the
// blocks resident at once) walks units grid-size apart.  Thread t of the block owns item t: plane
// t / items_per_plane of the unit, then row block rb and column block cb of
// that plane: destination rows rb*R .. rb*R+R-1, columns cb*V .. cb*V+V-1
// (outputs past the plane's edge are computed and dropped).  Destination
// row y, tap kh reads source row y * STRIDE - offset_top + kh (forward:
// offset = padding; backward-input: KH-1-pad, may be negative); columns
// likewise.  At stride 2 an item's R x V outputs read (R-1)*2 + KH rows of
// (V-1)*2 + KW values: the small stride-2 planes of EfficientNet and
// MobileNet (38x38 -> 19x19, 19x19 -> 10x10) whose rows the window kernel
// stages 4 bytes at a time.
//
// Load forms: async (src 16-byte aligned: host raw_bytes > 0, each raw
// buffer raw_bytes apart) or, for other pointers, reads straight from global
// memory (no shared memory; a correctness path).  A unit whose first value
// is not 16-byte aligned (odd plane sizes: 13x13 half planes are 338 bytes)
// is copied from the 16-byte boundary below it, and its planes start `head`
// bytes into the buffer; the bytes before the unit belong to the previous
// planes of src (never before src itself, which is aligned).  Units of
// whole planes of a multiple of 16 bytes may instead land plane by plane,
// src_pitch values apart in the buffer (copy_async_pitched: a gap of 16 to
// 112 bytes after each plane, so that the planes' rows fall on other banks).
//
// Store forms: V-value vectors straight to dst when rows are V-aligned
// (vector_stores), else, on the async path with out_stage_bytes > 0, the
// unit's outputs are gathered in a shared buffer and leave as one flat
// range (a unit's destination planes are contiguous too) in 16-byte stores,
// with element stores only before the first and after the last 16-byte
// boundary.  Per-element stores of R x V outputs scattered over a warp's
// rows cost about as much as the whole computation at odd widths (H200,
// 2026-12-02: 64x1136x22 fp16 3x3 forward 126 us against 59 for 20-wide
// planes of the same size).  Otherwise element stores.
//
// Template parameters: T, KH, KW (equal, 3/5/7), STRIDE (1 or 2; 1 when
// BACKWARD), BACKWARD, R (destination rows a thread), PITCHED (whether
// units of whole planes may land src_pitch values apart), IndexT (int, or
// long long when a tensor has >= 2**31 elements: only plane offsets use it).
// The host (cupy_dwgn/_depthwise_nchw_plane.py) picks R, P, the forms and the pitch.

#include "dwgn_common.cuh"

using dwgn::AccType;
using dwgn::from_acc;
using dwgn::to_acc;

namespace dwgn_plane {

// Outputs per thread of the forward kernel: R rows x V columns (R a
// template parameter, the host's choice among these).  float64
// 5x5/7x7 keep 2 rows so their double weights and accumulators stay in
// registers.  2-byte 3x3 at stride 1 (forward and backward-input) takes 8
// (or 6 or 7, below):
// each source row read and converted feeds up to 3 x 4 multiply-adds
// instead of 2.25 on average, and the per-item work (weights, indices,
// masks) is shared by 32 outputs; the kernel was issue-bound at 4 (Nsight
// Compute, 64x192x75 fp16: 51 instructions per output, issue slots 66%
// busy).  H200, 2026-12-04, fp16 forward / backward-input us, 4 rows at 4
// blocks per SM against 8 rows at 3: 64x192x75 158.7 / 157.2 -> 119.1 /
// 118.0, 64x40x150 132.6 / 130.1 -> 102.7 / 101.4, 64x144x56 52.6 / 50.8
// -> 48.0 / 47.0, 64x384x28 35.5 / 34.2 -> 35.0 / 34.5, 64x1392x10 26.4 /
// 25.8 -> 27.2 / 26.6; at stride 2 8 rows lost (64x288x38 32.6 -> 35.8), as
// did 8 rows at 2 blocks (96 registers: 64x192x75 130.5) and 8 columns
// (127 registers, 2 blocks: 160.2).  At stride 2, 2-row items (twice the
// threads in the same buffers) won on banded and small-block units
// (64x144x150 fp16 275.9 -> 246.8, 64x288x38 float32 62.8 -> 56.8) and lost
// elsewhere (64x288x38 fp16 32.4 -> 39.3, 64x192x75 5x5 fp16 133.3 -> 143.4;
// results/depthwise_nchw_plane_stride2_rows_h200_2026-12-04.txt): kept at 4.
// 2-byte 3x3 at stride 1 is also compiled at 6 and 7 rows, the host picking
// (_pick_rows): 8 rows of 16-, 24- and 10-wide planes overhang or fall on
// the same banks (H100, 2026-12-05, fp16 forward us, 6 / 7 / 8 rows:
// 64x1024x16 35.6 / 33.3 / 42.7, 64x448x24 34.3 / 33.1 / 38.0, 64x1392x10
// 24.6 / 26.4 / 27.9; but 64x544x22 43.8 / 42.0 / 39.4;
// results/depthwise_nchw_plane_3x3_rows_h100_2026-12-05.txt).
// 2-byte 5x5 at stride 1 is compiled at 4 and at 7 rows (7 at 2 blocks
// per SM, 110-120 registers), the host picking per plane size
// (_depthwise_nchw_plane.row_choices / _pick_rows): neither won at every
// size (H100, 2026-12-05, fp16 forward us, 4 rows / 7 rows: 64x1024x16 75.1 /
// 61.3, 64x896x17 89.3 / 71.6, 64x176x38 64.8 / 56.1; but 64x1792x12 52.0 /
// 64.6, 64x320x28 49.9 / 57.8; results/depthwise_nchw_plane_5x5_rows_h100_2026-12-05.txt).
// 7x7 at stride 1 (float32 and the half types) is compiled at 4 and 7 rows, the host taking
// the one that computes fewer rows, ties to 7 (14-, 7-, 21- and 28-row planes: H100,
// 2026-12-06, float32 forward 64x384x14 39.8 -> 33.0 us, 64x768x7 23.9 -> 19.4; 127-128
// registers, 2 blocks of 256 threads or 4 of 128 per SM; _depthwise_nchw_plane._pick_rows).
// The weight gradient keeps 4 rows (kWgradRows).
constexpr int kColumns = 4;
template <typename T, int KH> constexpr int kWgradRows = (sizeof(T) == 8 && KH > 3) ? 2 : 4;
// Blocks per SM the register budget is set for (256 threads each): 3x3 at
// 4 (64 registers; the output buffer's pointers took it from 64 to 72, 3
// blocks; 2-byte 3x3 at stride 1, 6-8 rows: 3, 72-80 registers), 5x5 at 3 (80;
// 7 rows: 2), 7x7 at 2.  At stride 2 (source rows of 9 and 11 values; NVRTC 13.0
// spilled 3x3 at 64 and 5x5 at 80 on sm_80) one step fewer: the stride-2
// planes' blocks are small (5 planes of 25 items at 38x38) and shared
// memory holds them to 4 per SM anyway.
template <typename T, int KH, int STRIDE, int R>
constexpr int kMinBlocks =
    sizeof(T) == 8 ? (KH > 3 ? 1 : 2)
                   : (KH == 7 ? 2 : KH == 5 ? (STRIDE == 1 && R == 4 ? 3 : 2) : (R > 4 || STRIDE != 1 ? 3 : 4));
// Raw buffers of a unit each (host: _BUFFERS).
constexpr int kBuffers = 3;

// N values of T as one aligned store.
template <typename T, int N>
struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) Pack {
  T v[N];
};

// row_blocks: R-row blocks of a unit's destination rows (all of a plane's,
// or, with num_bands > 1, one band's).
struct Args {
  int channels, num_planes, src_height, src_width, dst_height, dst_width, offset_top, offset_left;
  int planes_per_unit, num_bands, row_blocks, col_blocks, raw_bytes, vector_stores, out_stage_bytes;
};

// A unit: planes_per_unit whole planes, or (num_bands > 1; the host passes
// at least two bands or none) one band of one plane: destination rows
// [dst_row0, dst_row0 + row_blocks * R) of it and the source rows its items
// read, [src_row0, src_row1) clipped to the image.  Each is one contiguous
// range of src / dst (src_count / dst_count values; a band of padding rows
// only has src_count 0).
struct Unit {
  int first_plane, planes, src_row0, dst_row0, src_count, dst_count;
};
__device__ __forceinline__ Unit planes_of(int first_plane, int planes, const Args& a) {
  Unit u;
  u.first_plane = first_plane;
  u.planes = planes;
  u.src_row0 = u.dst_row0 = 0;
  u.src_count = planes * a.src_height * a.src_width;
  u.dst_count = planes * a.dst_height * a.dst_width;
  return u;
}
template <int R, int STRIDE, int KH>
__device__ __forceinline__ Unit band_of(int plane, int band, const Args& a) {
  Unit u;
  u.first_plane = plane;
  u.planes = 1;
  const int band_rows = a.row_blocks * R;
  u.dst_row0 = band * band_rows;
  const int first = u.dst_row0 * STRIDE - a.offset_top;  // the band's items' first and last source rows
  const int last = (u.dst_row0 + band_rows - 1) * STRIDE - a.offset_top + KH - 1;
  // Clamped to the image: a band of padding rows below it (padding past a
  // band's height) stages nothing from the plane's end, never past it.
  u.src_row0 = min(max(first, 0), a.src_height);
  u.src_count = max(0, min(last + 1, a.src_height) - u.src_row0) * a.src_width;
  u.dst_count = min(band_rows, a.dst_height - u.dst_row0) * a.dst_width;
  return u;
}
// Work unit `index` of the forward kernels: P consecutive planes, or band
// `index % num_bands` of plane `index / num_bands`.
template <int R, int STRIDE, int KH>
__device__ __forceinline__ Unit unit_of(int index, const Args& a) {
  if (a.num_bands == 1)  // grid-uniform
    return planes_of(index * a.planes_per_unit, min(a.planes_per_unit, a.num_planes - index * a.planes_per_unit), a);
  const int plane = static_cast<int>(static_cast<unsigned>(index) / static_cast<unsigned>(a.num_bands));
  return band_of<R, STRIDE, KH>(plane, index - plane * a.num_bands, a);
}

// This thread's item of a unit: plane local_plane of the unit, row block
// row_block of the unit's rows, column block col_block.
struct Place {
  int local_plane, row_block, col_block;
};
__device__ __forceinline__ Place place_of(const Args& a) {
  Place p;
  // threadIdx.x < 2**22: small_div is exact.
  p.local_plane = dwgn::small_div(threadIdx.x, __frcp_rn(static_cast<float>(a.row_blocks * a.col_blocks)));
  const int item = threadIdx.x - p.local_plane * a.row_blocks * a.col_blocks;
  p.row_block = dwgn::small_div(item, __frcp_rn(static_cast<float>(a.col_blocks)));
  p.col_block = item - p.row_block * a.col_blocks;
  return p;
}

// Bit k: source column cb * V * STRIDE - offset_left + k of column block
// cb's window is inside the image (fixed for the kernel's life).
template <int SPAN, int STRIDE>
__device__ __forceinline__ unsigned source_columns(int cb, const Args& a) {
  static_assert(SPAN <= 32, "one bit per window column");
  unsigned column_ok = 0;
#pragma unroll
  for (int k = 0; k < SPAN; ++k) {
    const int column = cb * kColumns * STRIDE - a.offset_left + k;
    column_ok |= (column >= 0 && column < a.src_width ? 1u : 0u) << k;
  }
  return column_ok;
}

// cp.async of a unit's `bytes` source bytes at `src` into `raw`, from the
// 16-byte boundary at or below src: the unit lands at raw + head_bytes(src).
// The last vector may be partial (zero-filled, never read).
// The copies join the thread's current group (copy_async commits it).
// `to(o)`: where the vector at byte o of the range lands (default raw + o).
template <typename To>
__device__ __forceinline__ void copy_range_async(const void* src, int bytes, To to) {
  const int head = dwgn::head_bytes(src);
  const unsigned char* from = static_cast<const unsigned char*>(src) - head;
  const int total = bytes + head;
  const int whole = total & ~15;  // bytes in whole 16-byte vectors
  int o = threadIdx.x * 16;
  for (; o < whole; o += blockDim.x * 16) dwgn::cp_async<16>(to(o), from + o);
  // The last, partial vector: the one thread whose walk stopped on it.
  if (o < total) dwgn::cp_async<16>(to(o), from + o, total - o);
}
__device__ __forceinline__ void copy_range_async(const void* src, unsigned char* raw, int bytes) {
  copy_range_async(src, bytes, [raw](int o) { return raw + o; });
}
__device__ __forceinline__ void copy_async(const void* src, unsigned char* raw, int bytes) {
  copy_range_async(src, raw, bytes);
  dwgn::cp_async_commit();
}
// copy_async (of the PITCHED kernels) of a unit of whole planes of a
// multiple of 16 bytes each (src 16-byte aligned) whose planes land `gap`
// bytes apart (a multiple of 16):
// the vector at byte o of plane p = o / plane_bytes goes to raw + o + p *
// gap (inv_plane_vectors = 1 / (plane_bytes / 16); gap 0: copy_async's
// flat range, whatever inv_plane_vectors).  Why: planes of a power-of-two
// size back to back put every plane's row r on the same shared-memory
// banks, and a warp's items, the same rows of several planes, then read
// one bank many times over (16x16 fp16 5x5 at 4 rows an item: 7-way on
// average by the host's count).  One loop for both; compiled only into the
// PITCHED specializations: its index math per vector cost the 2-byte
// kernels that never pitch up to 7% (H100, 64x1344x14 bf16 3x3 forward 44.7
// -> 47.7 us), and a pitched copy beside the flat one changed their
// compiled window reads.
__device__ __forceinline__ void copy_async_pitched(const void* src, unsigned char* raw, int bytes,
                                                   float inv_plane_vectors, int gap) {
  // (o >> 4) < 48 KB / 16: small_div is exact.
  copy_range_async(src, bytes, [&](int o) { return raw + o + dwgn::small_div(o >> 4, inv_plane_vectors) * gap; });
  dwgn::cp_async_commit();
}

// The SPAN source values of a window row from `values` (shared or global),
// zero in the columns outside the image (column_ok bit k clear).
template <typename T, typename Acc, int SPAN>
__device__ __forceinline__ void read_window_row(const T* values, unsigned column_ok, Acc (&row)[SPAN]) {
#pragma unroll
  for (int k = 0; k < SPAN; ++k) row[k] = (column_ok >> k) & 1u ? to_acc(values[k]) : Acc(0);
}

// __half on the shared path: the SPAN values of a window row from the
// SPAN / 2 + 1 aligned 4-byte words around them (half the loads of one per
// value, each as conflicting as one of those), realigned by a byte permute
// when `values` starts in a word's upper half, columns outside the image
// cleared by `pair_mask` (pair_masks) before conversion.  Reads up to one
// value before the window and three past it, and whole words in the padding:
// shared memory the host guarantees (kPairPad bytes before the buffers and
// after them; the pads' and other planes' values are masked), so no load is
// predicated.  A row's last words reach up to kPairPad bytes past its unit's
// bytes (values masked whatever they are); they reached into the next buffer
// while its cp.async landed, or into the output buffer while other threads
// stored there, and racecheck reported it where a unit ended on its buffer's end (H100,
// 2026-12-06: float16 7x7 4-row items, units of 16 planes of 392 bytes, 4
// hazards; results/depthwise_7x7_rows_h100_2026-12-06.txt): each raw buffer
// now ends in a kPairPad-byte tail (host: _units), so the reads stay in
// their own buffer.
template <int SPAN> constexpr int kPairs = (SPAN + 1) / 2;
constexpr int kPairPad = 32;
template <typename T> constexpr bool kReadsPairs = false;
template <> constexpr bool kReadsPairs<__half> = true;
// Which kernels of such a type read in pairs: all but the 3x3 stride-1
// forward (H200, 2026-12-05: 64x384x28 fp16 forward 35.3 -> 36.5 us and
// 64x1136x22 71.5 -> 74.2 in pairs, where the backward-input of the same
// correlation (no bias) gained at 22, 70.8 -> 67.4, and the stride-2
// forward 32.3 -> 30.0; results/depthwise_nchw_plane_pitch_2026-12-05.txt,
// part 4; H100, one value a load against pairs: 2% faster over 8 widths
// 10-38, 14-wide 3% slower; results/depthwise_nchw_plane_per_value_h100_2026-12-05.txt).
// Host: _depthwise_nchw_plane.reads_pairs.
template <typename T, int KH, int STRIDE, bool BACKWARD>
constexpr bool kPairedReads = kReadsPairs<T> && !(KH == 3 && STRIDE == 1 && !BACKWARD);
// Whether an item reads in pairs, as a type (the kernel's compute lambda takes either).
template <bool B> struct Pairs {
  static constexpr bool value = B;
};
template <int SPAN>
__device__ __forceinline__ void pair_masks(unsigned column_ok, unsigned (&pair_mask)[kPairs<SPAN>]) {
#pragma unroll
  for (int j = 0; j < kPairs<SPAN>; ++j)
    pair_mask[j] = ((column_ok >> (2 * j)) & 1u ? 0x0000ffffu : 0u) | ((column_ok >> (2 * j + 1)) & 1u ? 0xffff0000u : 0u);
}
__device__ __forceinline__ void pair_to_acc(unsigned pair, float& low, float& high) {
  const __half2 h = *reinterpret_cast<const __half2*>(&pair);
  low = __low2float(h);
  high = __high2float(h);
}
template <typename T, int SPAN>
__device__ __forceinline__ void read_window_row_pairs(const T* values, const unsigned (&pair_mask)[kPairs<SPAN>],
                                                      float (&row)[SPAN]) {
  static_assert(kReadsPairs<T>, "pairs of __half values");
  const unsigned odd = (static_cast<unsigned>(reinterpret_cast<size_t>(values)) >> 1) & 1u;
  // The word holding values[0], stepped back through the shared pointer (so the loads stay LDS).
  const unsigned* words = reinterpret_cast<const unsigned*>(values - odd);
  const unsigned selector = odd ? 0x5432u : 0x3210u;  // bytes 2-5 of (word j+1 : word j), or word j
  unsigned w[kPairs<SPAN> + 1];
#pragma unroll
  for (int j = 0; j <= kPairs<SPAN>; ++j) w[j] = words[j];
#pragma unroll
  for (int j = 0; j < kPairs<SPAN>; ++j) {
    float low, high;
    pair_to_acc(__byte_perm(w[j], w[j + 1], selector) & pair_mask[j], low, high);
    row[2 * j] = low;
    if (2 * j + 1 < SPAN) row[2 * j + 1] = high;
  }
}

// One item's R x V outputs of destination plane `plane` from its source
// plane's rows from src_row0 on, `values` (shared or global), stored to
// `out`, the plane's rows from dst_row0 on: in dst, or in the unit's shared
// output buffer (vectors = false).  rb: the item's row block in the plane.
// `column_ok` bit k: source column col0 + k is inside the image.
template <typename T, int KH, int KW, int STRIDE, bool BACKWARD, int R, bool PAIRS>
__device__ __forceinline__ void compute_item(const T* values, int src_row0, int plane, int rb, int cb,
                                             unsigned column_ok, const T* __restrict__ weight,
                                             const T* __restrict__ bias, T* __restrict__ out, int dst_row0,
                                             bool vectors, const Args& a) {
  using Acc = typename AccType<T>::type;
  constexpr int V = kColumns;
  constexpr int SPAN = (V - 1) * STRIDE + KW;
  const int channel = plane % a.channels;
  Acc w[KH][KW];
#pragma unroll
  for (int kh = 0; kh < KH; ++kh)
#pragma unroll
    for (int kw = 0; kw < KW; ++kw)
      // Backward-input correlates with the filter rotated by 180 degrees.
      w[kh][kw] = to_acc(weight[channel * KH * KW + (BACKWARD ? (KH - 1 - kh) * KW + (KW - 1 - kw) : kh * KW + kw)]);
  const Acc b = (!BACKWARD && bias != nullptr) ? to_acc(bias[channel]) : Acc(0);
  Acc acc[R][V];
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int j = 0; j < V; ++j) acc[i][j] = b;

  const int row0 = rb * R * STRIDE - a.offset_top;
  const int col0 = cb * V * STRIDE - a.offset_left;
  unsigned pair_mask[kPairs<SPAN>];
  if constexpr (PAIRS) pair_masks<SPAN>(column_ok, pair_mask);
  // Source row t of the item feeds its output rows i = (t - kh) / STRIDE;
  // rows outside the image are zero padding and add nothing.
#pragma unroll
  for (int t = 0; t < (R - 1) * STRIDE + KH; ++t) {
    const int source_row = row0 + t;
    if (source_row < 0 || source_row >= a.src_height) continue;
    const T* row_values = values + (source_row - src_row0) * a.src_width + col0;
    Acc row[SPAN];
    if constexpr (PAIRS)
      read_window_row_pairs<T, SPAN>(row_values, pair_mask, row);
    else
      read_window_row(row_values, column_ok, row);
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int kh = t - i * STRIDE;
      if (kh < 0 || kh >= KH) continue;
#pragma unroll
      for (int kw = 0; kw < KW; ++kw)
#pragma unroll
        for (int j = 0; j < V; ++j) acc[i][j] = fma(w[kh][kw], row[j * STRIDE + kw], acc[i][j]);
    }
  }

  const int out_col = cb * V;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int y = rb * R + i;
    if (y >= a.dst_height) break;
    T* out_row = out + (y - dst_row0) * a.dst_width + out_col;
    if (vectors) {  // dst_width % V == 0 and rows aligned to the pack
      if (out_col < a.dst_width) {
        Pack<T, V> packed;
#pragma unroll
        for (int j = 0; j < V; ++j) packed.v[j] = from_acc<T>(acc[i][j]);
        *reinterpret_cast<Pack<T, V>*>(out_row) = packed;
      }
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j)
        if (out_col + j < a.dst_width) out_row[j] = from_acc<T>(acc[i][j]);
    }
  }
}

}  // namespace dwgn_plane

template <typename T, int KH, int KW, int STRIDE, bool BACKWARD, int R, bool PITCHED, typename IndexT>
__global__ void __launch_bounds__(256, dwgn_plane::kMinBlocks<T, KH, STRIDE, R>) dwgn_dwconv2d_plane(
    const T* __restrict__ src, const T* __restrict__ weight, const T* __restrict__ bias,
    T* __restrict__ dst, int channels, int num_planes, int src_height, int src_width, int dst_height,
    int dst_width, int offset_top, int offset_left, int planes_per_unit, int num_bands, int row_blocks,
    int col_blocks, int raw_bytes, int vector_stores, int out_stage_bytes, int src_pitch) {
  static_assert(STRIDE == 1 || (STRIDE == 2 && !BACKWARD), "backward-input takes this kernel at stride 1 only");
  using dwgn_plane::kBuffers;
  constexpr int SPAN = (dwgn_plane::kColumns - 1) * STRIDE + KW;
  // __half (but the 3x3 stride-1 forward: kPairedReads) reads the shared planes in 4-byte pairs
  // (read_window_row_pairs), within kPairPad bytes of padding before the buffers and after the last
  // (the host adds both to the shared memory; bfloat16 measured slower in pairs:
  // _depthwise_nchw_plane.PAIR_PAD's comment).
  constexpr bool kPairsOnShared = dwgn_plane::kPairedReads<T, KH, STRIDE, BACKWARD>;
  extern __shared__ __align__(16) unsigned char shared_memory[];
  unsigned char* const raw = shared_memory + (kPairsOnShared ? dwgn_plane::kPairPad : 0);
  const dwgn_plane::Args a{channels,   num_planes, src_height, src_width,     dst_height,   dst_width,
                           offset_top, offset_left, planes_per_unit, num_bands, row_blocks, col_blocks,
                           raw_bytes,  vector_stores, out_stage_bytes};
  const int src_plane = src_height * src_width;
  const int dst_plane = dst_height * dst_width;
  const dwgn_plane::Place place = dwgn_plane::place_of(a);
  const int local_plane = place.local_plane, rb_in_unit = place.row_block, cb = place.col_block;
  const unsigned column_ok = dwgn_plane::source_columns<SPAN, STRIDE>(cb, a);
  const int num_units = (num_planes + planes_per_unit - 1) / planes_per_unit * num_bands;
  // A unit's first source value, and its first destination value.
  auto unit_src = [&](const dwgn_plane::Unit& u) {
    return src + static_cast<IndexT>(u.first_plane) * src_plane + static_cast<IndexT>(u.src_row0) * src_width;
  };
  auto unit_dst = [&](const dwgn_plane::Unit& u) {
    return dst + static_cast<IndexT>(u.first_plane) * dst_plane + static_cast<IndexT>(u.dst_row0) * dst_width;
  };
  // This thread's item of unit u, from the unit's source rows `values` into `out` (dst or the output buffer).
  // pairs: Pairs<true> on the shared path of __half (read_window_row_pairs).
  // The unit's planes are src_pitch values apart in `values` (src: the host passes src_plane on the
  // element path; the buffers: src_plane or more, stage_source).
  auto compute = [&](const dwgn_plane::Unit& u, const T* values, T* out, bool vectors, auto pairs) {
    if (local_plane < u.planes)
      dwgn_plane::compute_item<T, KH, KW, STRIDE, BACKWARD, R, decltype(pairs)::value>(
          values + local_plane * src_pitch, u.src_row0, u.first_plane + local_plane, u.dst_row0 / R + rb_in_unit,
          cb, column_ok, weight, bias, out + local_plane * dst_plane, u.dst_row0, vectors, a);
  };
  constexpr int S = static_cast<int>(sizeof(T));

  if (raw_bytes == 0) {  // element path: read the planes from global memory
    for (int unit = blockIdx.x; unit < num_units; unit += gridDim.x) {
      const dwgn_plane::Unit u = dwgn_plane::unit_of<R, STRIDE, KH>(unit, a);
      compute(u, unit_src(u), unit_dst(u), vector_stores != 0, dwgn_plane::Pairs<false>{});
    }
    return;
  }
  // The unit's output buffer, after the raw ones (raw_bytes is a multiple of 16).
  unsigned char* stage = raw + kBuffers * raw_bytes;
  // A unit's source into buffer `to`: one flat range, or (PITCHED, src_pitch > src_plane: units of whole
  // planes only) its planes src_pitch values apart.
  const int gap = PITCHED ? (src_pitch - src_plane) * S : 0;
  const float inv_plane_vectors = gap ? __frcp_rn(static_cast<float>(src_plane * S / 16)) : 0.0f;
  auto stage_source = [&](const dwgn_plane::Unit& u, unsigned char* to) {
    if constexpr (PITCHED)
      dwgn_plane::copy_async_pitched(unit_src(u), to, u.src_count * S, inv_plane_vectors, gap);
    else
      dwgn_plane::copy_async(unit_src(u), to, u.src_count * S);
  };
  if (blockIdx.x < num_units) stage_source(dwgn_plane::unit_of<R, STRIDE, KH>(blockIdx.x, a), raw);
  for (int unit = blockIdx.x, step = 0; unit < num_units; unit += gridDim.x, ++step) {
    const int next = unit + gridDim.x;
    // Buffer (step + 1) % 3 was last read in step - 2, which every thread
    // finished before the barrier of step - 1.
    if (next < num_units) {
      stage_source(dwgn_plane::unit_of<R, STRIDE, KH>(next, a), raw + ((step + 1) % kBuffers) * raw_bytes);
    } else {
      dwgn::cp_async_commit();  // an empty group keeps the wait count uniform
    }
    dwgn::cp_async_wait<1>();  // this thread's part of the unit has landed
    __syncthreads();           // every thread's part has
    const dwgn_plane::Unit u = dwgn_plane::unit_of<R, STRIDE, KH>(unit, a);
    const T* values = reinterpret_cast<const T*>(raw + (step % kBuffers) * raw_bytes +
                                                 dwgn::head_bytes(unit_src(u)));
    if (out_stage_bytes) {
      compute(u, values, reinterpret_cast<T*>(stage + dwgn::head_bytes(unit_dst(u))), false,
              dwgn_plane::Pairs<kPairsOnShared>{});
      // Every output of the unit is in the buffer; the next write to it
      // follows the next step's barrier, after every thread's stores here.
      __syncthreads();
      dwgn::store_unit(stage, unit_dst(u), u.dst_count);
    } else {
      compute(u, values, unit_dst(u), vector_stores != 0, dwgn_plane::Pairs<kPairsOnShared>{});
    }
  }
}

// ---------------------------------------------------------------------------
// Weight gradient on the same units (3x3, 5x5, 7x7, stride 1 or 2, dilation
// 1, depth multiplier 1; float32, float16, bfloat16):
//
//   partial[split][kh * K + kw][c] = sum over this split's (n, y, x) of
//       grad_out[n][c][y][x] * x[n][c][y * STRIDE - pad_top + kh][x * STRIDE - pad_left + kw]
//
// (float), then the shared finalize adds the splits in split order:
// deterministic, no atomics.  Why: the NCHW weight gradients on rows of odd
// width (EfficientNet's 19, 75, 150) read one 2- or 4-byte column per lane
// (depthwise_nchw_wgrad_regs.cu at VW = 1) or stage rows element by element
// (depthwise_nchw_wgrad.cu), at 12-30% of the copy bandwidth (H200,
// 2026-12-02: 64x192x75 fp16 3x3 351 us, cuDNN 159).  Here a unit's x rows
// and grad_out rows are each one contiguous range copied with 16-byte
// cp.async, three buffers deep as in the forward kernel.
//
// Block (blockIdx.x, blockIdx.y): channels c0 = blockIdx.x * P .. c0 + P - 1
// (P = planes_per_unit consecutive planes of one image are one range), split
// blockIdx.y: the block's units are a contiguous run of the `units` = N *
// num_bands (image, band) pairs, units_per_split each.  Thread t owns the
// same item (local plane, row block, column block) in every unit and keeps
// K x K float sums of its own products; its R x V grad_out values are zero
// past the plane's edge (rows past dst_height, columns past dst_width), so
// an item that overhangs the plane adds nothing for them.  At the end the
// block sums each plane's items in a fixed order (reduce_taps).
//
// Buffer layout (raw_bytes each): x rows at 0, grad_out rows at grad_offset
// (each range copied from the 16-byte boundary below it).
namespace dwgn_plane {

// Blocks per SM the register budget is set for (256 threads): K x K sums,
// R x V grad_out values and a window row per thread; as the forward.
template <int K, int STRIDE>
constexpr int kWgradMinBlocks = K == 7 ? 2 : K == 5 ? (STRIDE == 1 ? 3 : 2) : (STRIDE == 1 ? 4 : 3);

// Adds the item's products to acc: grad_out values of destination rows
// rb * R .. and columns cb * V .. times the source values each tap pairs
// them with.  x_values / grad_values: the unit's staged rows of this plane
// from src_row0 / dst_row0 on.
template <typename T, int K, int STRIDE>
__device__ __forceinline__ void accumulate_item(const T* x_values, int src_row0, const T* grad_values, int dst_row0,
                                                int rb, int cb, unsigned column_ok, float (&acc)[K][K],
                                                const Args& a) {
  constexpr int R = kWgradRows<T, K>;
  constexpr int V = kColumns;
  constexpr int SPAN = (V - 1) * STRIDE + K;
  float grad[R][V];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int y = rb * R + i;
    const T* grad_row = grad_values + (y - dst_row0) * a.dst_width + cb * V;
#pragma unroll
    for (int j = 0; j < V; ++j)
      grad[i][j] = (y < a.dst_height && cb * V + j < a.dst_width) ? to_acc(grad_row[j]) : 0.0f;
  }
  const int row0 = rb * R * STRIDE - a.offset_top;
  const int col0 = cb * V * STRIDE - a.offset_left;
  // Source row t of the item meets output rows i = (t - kh) / STRIDE; rows
  // outside the image are zero padding and add nothing.
#pragma unroll
  for (int t = 0; t < (R - 1) * STRIDE + K; ++t) {
    const int source_row = row0 + t;
    if (source_row < 0 || source_row >= a.src_height) continue;
    float row[SPAN];
    read_window_row(x_values + (source_row - src_row0) * a.src_width + col0, column_ok, row);
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int kh = t - i * STRIDE;
      if (kh < 0 || kh >= K) continue;
#pragma unroll
      for (int kw = 0; kw < K; ++kw)
#pragma unroll
        for (int j = 0; j < V; ++j) acc[kh][kw] = fmaf(grad[i][j], row[j * STRIDE + kw], acc[kh][kw]);
    }
  }
}

// Sums every thread's acc over the items of each of the block's `planes`
// planes (threads p * items .. p * items + items - 1), in a fixed order:
// for each filter row, runs of 16 items, then the runs in order.  Writes
// partial[split][tap][first_channel + p].  scratch: 2 * K * blockDim.x
// floats (the buffers, no longer read); every thread calls it.
template <int K>
__device__ __forceinline__ void reduce_taps(const float (&acc)[K][K], float* scratch, int planes, int items,
                                            int first_channel, int channels, float* __restrict__ partial,
                                            int split) {
  constexpr int kRun = 16;
  const int threads = blockDim.x;
  float* values = scratch;                  // [K][threads]: one filter row's sums per thread
  float* run_sums = scratch + K * threads;  // [planes][K][runs], at most K * threads
  const int runs = (items + kRun - 1) / kRun;
#pragma unroll
  for (int kh = 0; kh < K; ++kh) {
#pragma unroll
    for (int kw = 0; kw < K; ++kw) values[kw * threads + threadIdx.x] = acc[kh][kw];
    __syncthreads();  // the row's sums are in; the previous row's run sums were read before this
    for (int w = threadIdx.x; w < planes * K * runs; w += threads) {
      const int plane_tap = w / runs;
      const int run = w - plane_tap * runs;
      const int p = plane_tap / K;
      const float* v = values + (plane_tap - p * K) * threads + p * items + run * kRun;
      const int count = min(kRun, items - run * kRun);
      float sum = 0.0f;
      for (int e = 0; e < count; ++e) sum += v[e];
      run_sums[w] = sum;
    }
    __syncthreads();  // the run sums are in; `values` is free for the next row
    for (int w = threadIdx.x; w < planes * K; w += threads) {
      const int p = w / K;
      float sum = 0.0f;
      for (int run = 0; run < runs; ++run) sum += run_sums[w * runs + run];
      partial[(static_cast<long long>(split) * K * K + kh * K + (w - p * K)) * channels + first_channel + p] = sum;
    }
  }
}

}  // namespace dwgn_plane

template <typename T, int K, int STRIDE>
__global__ void __launch_bounds__(256, dwgn_plane::kWgradMinBlocks<K, STRIDE>) dwgn_nchw_plane_wgrad(
    const T* __restrict__ grad_out, const T* __restrict__ x, float* __restrict__ partial, int channels,
    int src_height, int src_width, int dst_height, int dst_width, int pad_top, int pad_left, int planes_per_unit,
    int num_bands, int row_blocks, int col_blocks, int raw_bytes, int grad_offset, int units, int units_per_split) {
  dwgn::allow_dependent_grid();  // the finalize (a programmatic launch) may be placed; it waits for this grid
  using dwgn_plane::kBuffers;
  constexpr int R = dwgn_plane::kWgradRows<T, K>;
  constexpr int SPAN = (dwgn_plane::kColumns - 1) * STRIDE + K;
  constexpr int S = static_cast<int>(sizeof(T));
  extern __shared__ __align__(16) unsigned char raw[];
  const dwgn_plane::Args a{channels,  0,        src_height,      src_width, dst_height, dst_width,
                           pad_top,   pad_left, planes_per_unit, num_bands, row_blocks, col_blocks,
                           raw_bytes, 0,        0};
  const int first_channel = blockIdx.x * planes_per_unit;
  const int planes = min(planes_per_unit, channels - first_channel);
  const int src_plane = src_height * src_width;
  const int dst_plane = dst_height * dst_width;
  const dwgn_plane::Place place = dwgn_plane::place_of(a);
  const unsigned column_ok = dwgn_plane::source_columns<SPAN, STRIDE>(place.col_block, a);
  // Unit (image n, band b): band b of image n's planes first_channel ..;
  // the split's units are consecutive, so (n, b) steps instead of dividing.
  auto unit_at = [&](int n, int b) {
    const int plane = n * channels + first_channel;
    return num_bands == 1 ? dwgn_plane::planes_of(plane, planes, a) : dwgn_plane::band_of<R, STRIDE, K>(plane, b, a);
  };
  auto next = [&](int& n, int& b) {
    if (++b == num_bands) b = 0, ++n;
  };
  auto x_at = [&](const dwgn_plane::Unit& u) {
    return x + static_cast<long long>(u.first_plane) * src_plane + static_cast<long long>(u.src_row0) * src_width;
  };
  auto grad_at = [&](const dwgn_plane::Unit& u) {
    return grad_out + static_cast<long long>(u.first_plane) * dst_plane +
           static_cast<long long>(u.dst_row0) * dst_width;
  };
  auto copy = [&](const dwgn_plane::Unit& u, unsigned char* buffer) {
    dwgn_plane::copy_range_async(x_at(u), buffer, u.src_count * S);
    dwgn_plane::copy_async(grad_at(u), buffer + grad_offset, u.dst_count * S);
  };

  float acc[K][K];
#pragma unroll
  for (int kh = 0; kh < K; ++kh)
#pragma unroll
    for (int kw = 0; kw < K; ++kw) acc[kh][kw] = 0.0f;
  // The host gives every split at least one unit.
  const int first_unit = blockIdx.y * units_per_split;
  const int end_unit = min(units, first_unit + units_per_split);
  // (image, band) of the unit computed.
  int n = static_cast<int>(static_cast<unsigned>(first_unit) / static_cast<unsigned>(num_bands));
  int b = first_unit - n * num_bands;
  copy(unit_at(n, b), raw);
  for (int unit = first_unit, step = 0; unit < end_unit; ++unit, ++step) {
    // Buffer (step + 1) % 3 was last read in step - 2, which every thread
    // finished before the barrier of step - 1.
    if (unit + 1 < end_unit) {
      int ahead_n = n, ahead_b = b;
      next(ahead_n, ahead_b);
      copy(unit_at(ahead_n, ahead_b), raw + ((step + 1) % kBuffers) * raw_bytes);
    } else {
      dwgn::cp_async_commit();  // an empty group keeps the wait count uniform
    }
    dwgn::cp_async_wait<1>();  // this thread's part of the unit has landed
    __syncthreads();           // every thread's part has
    const dwgn_plane::Unit u = unit_at(n, b);
    next(n, b);
    if (place.local_plane < planes) {
      const unsigned char* buffer = raw + (step % kBuffers) * raw_bytes;
      dwgn_plane::accumulate_item<T, K, STRIDE>(
          reinterpret_cast<const T*>(buffer + dwgn::head_bytes(x_at(u))) + place.local_plane * src_plane,
          u.src_row0,
          reinterpret_cast<const T*>(buffer + grad_offset + dwgn::head_bytes(grad_at(u))) +
              place.local_plane * dst_plane,
          u.dst_row0, u.dst_row0 / R + place.row_block, place.col_block, column_ok, acc, a);
    }
  }
  dwgn::cp_async_wait_all();
  __syncthreads();  // every thread's last reads of the buffers are done: they become the reduction's scratch
  dwgn_plane::reduce_taps<K>(acc, reinterpret_cast<float*>(raw), planes, row_blocks * col_blocks, first_channel,
                             channels, partial, blockIdx.y);
}
