// Depthwise 2-D convolution, NCHW: the register sliding-window kernel for
// filters of 3x3, 5x5 and 7x7 at dilation 1 (forward at stride 1 or 2,
// backward-input at stride 1).
//
// Work unit = PB consecutive destination planes x a band of destination rows;
// a step = one unit x one source (backward has M sources per destination
// plane, forward one).  A persistent block walks its steps with two shared
// buffers: while the threads compute step t from one buffer, the source rows
// of step t+1 are copied global -> shared into the other with cp.async, so
// the copy latency is hidden behind the FMAs (units of whole planes take
// each thread's copies from offsets worked out once: FixedCopies).  Each
// thread owns one item of the unit: VW consecutive destination columns x RH
// consecutive rows of one plane.  It streams the (RH-1)*STRIDE + KH source
// rows of its item through registers one row at a time (SPAN values each) and
// FMAs every row into the accumulator rows it feeds; weights live in
// registers.
//
// Stores.  When the destination width is a multiple of VW (and dst 16-byte
// aligned) items store their rows as 16-byte vectors; otherwise the unit's
// outputs, one contiguous range of dst, are written into the buffer the unit
// was computed from (after a barrier) and leave as aligned 16-byte vectors,
// instead of one L2 request per 2- or 4-byte element.
//
// Shared layout.  Image column c of a staged row sits at shared column
// left_halo + c; the host picks left_halo so that the first source value of
// every strip sits LEAD columns after a 16-byte boundary (LEAD = -(KW/2) mod
// VEC, the position it has for "same" padding).  A row of an item is then
// read as NV aligned vector loads (16 bytes, or the smallest aligned piece
// covering the values needed), not SPAN scalar loads: the warp's lanes are 16
// bytes apart, so every shared load costs 4 wavefronts whatever its width.
// With same padding left_halo is a multiple of VEC and staging uses 16-byte
// copies; otherwise the host narrows the staging width to what left_halo,
// the row pitch and the base pointer all allow.
//
//   Forward (BACKWARD = false): dst = y plane p = (n, oc); src = x plane
//     (n, oc / M) = p / M; filter oc; offset = (pad_top, pad_left); plus bias.
//   Backward input (BACKWARD = true, STRIDE = 1): dst = dx plane p = (n, c);
//     the M sources are the grad_out planes p*M + m with filter c*M + m
//     rotated by 180 degrees; offset = KH-1-pad_top, KW-1-pad_left (may be
//     negative when the padding is larger than the filter).
// Source row of destination row r, tap row kh: r*STRIDE - offset_top + kh.
//
// Template parameters: T, KH, KW, STRIDE (1 or 2), BACKWARD, IndexT (int, or
// long long when a tensor has >= 2**31 elements).  The host (module
// cupy_dwgn/_depthwise_nchw_window.py) picks PB, the band, the block size
// (items <= blockDim.x) and a grid of at most the resident blocks.

#include "dwgn_common.cuh"

using dwgn::AccType;
using dwgn::from_acc;
using dwgn::to_acc;

namespace dwgn_window {

// Elements per 16-byte vector.
template <typename T> constexpr int kVec = 16 / static_cast<int>(sizeof(T));

// Destination columns (VW) and rows (RH) per thread.  16 bytes of output per
// row keeps stores 128-bit wide; rows amortize the KH-1 extra source rows
// each item streams, and 4 rows give half types units of as many bytes as
// float32 (a unit's bytes are what a block keeps in flight).  float64 7x7
// keeps fewer rows so its double weights and accumulators stay in registers.
template <typename T> constexpr int kColumns = kVec<T>;
// Half-type 3x3 keeps 2 rows: measured on the H200 (64x144x56 fp16), 4 rows
// cost registers (87 vs 64) and a block per SM and ran 66 us against 53.
template <typename T, int KH> constexpr int kRows =
    (sizeof(T) == 8 && KH > 5) || (sizeof(T) == 2 && KH == 3) ? 2 : 4;

// Blocks per SM the register budget is set for: 2 (<= 128 registers) except
// float64 5x5/7x7, whose weights and accumulators need more, and 4 (<= 64)
// for the 3x3 forward with 32-bit indices of the 2-byte types and of float32
// at stride 1: it ran at 64-80 registers, 4 blocks of 224 threads per SM
// (64x144x56) where registers allowed; the fixed copies raised it to 80-84
// (3 blocks), and NVRTC 13.0 and 13.5 fit it in 64 without spills (the
// backward, and float32 with 64-bit indices, spilled at 64 with NVRTC 13.0).
// Measured on an H200 with 64 registers against the 2-block budget (same
// run): 64x144x56 float16 forward 61.2 -> 47.7 us (with the fixed copies),
// 64x96x112 stride 2 float16 72.4 -> 66.8; float32 at stride 2 went 119.1 ->
// 131.4 in one run (125.5 -> 117.0 with an earlier build), and keeps the
// 2-block budget (shared memory holds it to 4 blocks of 128 threads anyway).
// The 3x3 backward with 32-bit indices has 3 (<= 80): at 95-96 registers a
// 224-thread block (7 warps: 56x56 and 28x28 planes) fits 5 warps in each of
// the SM's 4 register partitions, so 2 blocks, 14 warps; at 80, 3 blocks.
template <typename T, int KH, int STRIDE, bool BACKWARD, typename IndexT>
constexpr int kMinBlocks =
    sizeof(T) == 8 && KH > 3 ? 1
    : KH == 3 && sizeof(IndexT) == 4 && BACKWARD && sizeof(T) <= 4 ? 3
    : (KH == 3 && !BACKWARD && sizeof(IndexT) == 4 && (sizeof(T) == 2 || (sizeof(T) == 4 && STRIDE == 1)) ? 4 : 2);

// Column of a strip's first source value past the aligned read base
// (host: _lead()).
template <typename T, int KW> constexpr int kLead = (kVec<T> - (KW / 2) % kVec<T>) % kVec<T>;


constexpr int cmax(int a, int b) { return a > b ? a : b; }
constexpr int cmin(int a, int b) { return a < b ? a : b; }
// Smallest power-of-two piece (in elements) whose aligned copy covers [lo, hi).
constexpr int piece(int lo, int hi, int c = 1) { return lo / c == (hi - 1) / c ? c : piece(lo, hi, 2 * c); }

// Reads values [LEAD, LEAD + SPAN) past the 16-byte aligned `base` into
// out[0, SPAN) as accumulator values, vector Q of NV at a time.
template <typename T, int LEAD, int SPAN, int Q, int NV>
struct RowReader {
  template <typename Acc>
  static __device__ __forceinline__ void read(const T* base, Acc* out) {
    constexpr int VEC = kVec<T>;
    constexpr int lo = cmax(LEAD, Q * VEC) - Q * VEC;
    constexpr int hi = cmin(LEAD + SPAN, (Q + 1) * VEC) - Q * VEC;
    constexpr int C = piece(lo, hi);
    constexpr int S = lo / C * C;
    using V = typename dwgn::Bits<C * static_cast<int>(sizeof(T))>::type;
    const V v = *reinterpret_cast<const V*>(base + Q * VEC + S);
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int k = lo; k < hi; ++k) out[Q * VEC + k - LEAD] = to_acc(e[k - S]);
    RowReader<T, LEAD, SPAN, Q + 1, NV>::read(base, out);
  }
};
template <typename T, int LEAD, int SPAN, int NV>
struct RowReader<T, LEAD, SPAN, NV, NV> {
  template <typename Acc>
  static __device__ __forceinline__ void read(const T*, Acc*) {}
};

// n / d by dwgn::small_div with __fdividef's reciprocal (within 2 ulp):
// exact for 0 <= n < 4096 and 1 <= d <= 4096 (checked exhaustively in
// float32 with the reciprocal 0, 1 and 2 ulp off either way; here n < 256),
// in 5 instructions against about 20 for an integer division.
__device__ __forceinline__ int small_quotient(int n, int d) {
  return dwgn::small_div(n, __fdividef(1.0f, static_cast<float>(d)));
}

// A thread's item (the same in every unit): destination plane, row group and
// strip within the unit, whether the unit has it, and the aligned shared
// column of its reads (its first source value is LEAD further).  item <
// blockDim.x <= 256; FLOAT_DIV divides with small_quotient.
struct Item {
  int plane, group, strip, offset;
  bool valid;
};
template <int RH, int VW, int STRIDE, bool FLOAT_DIV>
__device__ __forceinline__ Item item_of(int item, int items_per_plane, int strips, int planes_per_unit,
                                        int plane_rows, int staged_width, int read_base) {
  Item it;
  it.plane = FLOAT_DIV ? small_quotient(item, items_per_plane) : item / items_per_plane;
  const int rest = item - it.plane * items_per_plane;
  it.group = FLOAT_DIV ? small_quotient(rest, strips) : rest / strips;
  it.strip = rest - it.group * strips;
  it.valid = item < planes_per_unit * items_per_plane;
  it.offset = (it.plane * plane_rows + it.group * RH * STRIDE) * staged_width + it.strip * VW * STRIDE + read_base;
  return it;
}

// Whether the item is recomputed at every step rather than held in registers
// across the step loop: half types 7x7 backward-input, whose weights (49),
// accumulators (32) and source row (14 floats) fill the 128-register budget;
// NVRTC 13.0 kept the item's shared offset in local memory there (4-8 bytes,
// one local load per step; sm_90, and sm_80 with 64-bit indices).  The
// recomputation (two float-reciprocal divisions, a few multiply-adds) is
// about 20 instructions per step against ~1600 FMAs.
template <typename T, int KH, bool BACKWARD>
constexpr bool kItemPerStep = sizeof(T) == 2 && KH == 7 && BACKWARD;

// threadIdx.x read through asm volatile: the compiler can neither hoist it
// out of a loop nor merge it with another read, so what is computed from it
// is computed where it stands.
__device__ __forceinline__ int thread_x_here() {
  int x;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(x));
  return x;
}

// A unit's plane unit and band (unit = plane_unit * num_bands + band).  Whole
// planes per unit (num_bands == 1, most shapes) skip the division, and the
// other case divides unsigned: a signed division by a runtime value was ~20
// instructions, twice per step (measured: Nsight Compute's executed
// instructions, 64x144x56 float16).
__device__ __forceinline__ void split_unit(int unit, int num_bands, int& plane_unit, int& band) {
  if (num_bands == 1) {
    plane_unit = unit;
    band = 0;
  } else {
    plane_unit = static_cast<int>(static_cast<unsigned>(unit) / static_cast<unsigned>(num_bands));
    band = unit - plane_unit * num_bands;
  }
}

// a % b for a >= 0, b > 0, unsigned (no sign fix-ups).
__device__ __forceinline__ int nonnegative_mod(int a, int b) {
  return static_cast<int>(static_cast<unsigned>(a) % static_cast<unsigned>(b));
}

// Fixed copies (host: fixed_copies = K, 1 <= K <= kMaxFixedCopies): with
// whole planes per unit and row staging by cp.async, staged row `row` of
// every unit comes from the same image row at the same offset from the
// unit's first source plane, so each thread's K copies (i = threadIdx.x +
// k * blockDim.x of the unit's num_rows * row_vectors) are worked out once:
// shared offset (-1: no copy, the row is padding and stays zero, or i is past
// the unit) and source offset from the unit's base.  A step then issues them
// with one compare each, where the general path re-derives row, plane and
// bounds per copy (two reciprocal divisions, ~45 instructions per 16-byte
// copy: a quarter of the kernel's instructions at 64x144x56 float16).
constexpr int kMaxFixedCopies = 4;
// Specializations that never take them: kItemPerStep (registers full: NVRTC
// spilled the copies' offsets) and the float32 stride-2 forward, whose
// planes rarely fit kMaxFixedCopies copies a thread (stride 2 stages twice
// the rows) and whose copies' 8 live registers took it from 80 to 92
// registers (by the register file's per-quarter count, 3 -> 2 blocks of 224
// threads per SM; 64x96x112 forward 119.8 -> 127.5 us between the tables of
// 315d59b and 065f470).  The host passes 0 for them too.
template <typename T, int KH, int STRIDE, bool BACKWARD>
constexpr bool kNoFixedCopies = kItemPerStep<T, KH, BACKWARD> || (sizeof(T) == 4 && STRIDE == 2);
struct FixedCopies {
  int shared[kMaxFixedCopies], source[kMaxFixedCopies];
  // `planes_stride`: source planes between consecutive planes of a unit (M
  // for the backward's M sources per destination plane, else 1).
  __device__ __forceinline__ FixedCopies(int copies, int num_rows, int row_vectors, int elems_per_copy,
                                         int plane_rows, int offset_top, int src_height, int src_width,
                                         int staged_width, int left_halo, int planes_stride) {
    const int total = num_rows * row_vectors;
#pragma unroll
    for (int k = 0; k < kMaxFixedCopies; ++k) {
      const int i = static_cast<int>(threadIdx.x) + k * static_cast<int>(blockDim.x);
      shared[k] = -1;
      source[k] = 0;
      if (k < copies && i < total) {
        const int row = i / row_vectors;
        const int v = i - row * row_vectors;
        const int pb = row / plane_rows;
        const int src_row = row - pb * plane_rows - offset_top;
        if (src_row >= 0 && src_row < src_height) {
          shared[k] = row * staged_width + left_halo + v * elems_per_copy;
          source[k] = (pb * planes_stride * src_height + src_row) * src_width + v * elems_per_copy;
        }
      }
    }
  }
  // Copies into `staged` from `base` (the unit's first source plane); a
  // source offset at or past `limit` lies in a plane past the tensor's last
  // (the last unit's), whose items are idle and never read their rows.
  template <int BYTES, typename T>
  __device__ __forceinline__ void issue(T* staged, const T* base, int limit) const {
#pragma unroll
    for (int k = 0; k < kMaxFixedCopies; ++k) {
      if (shared[k] >= 0 && source[k] < limit) dwgn::cp_async<BYTES>(staged + shared[k], base + source[k]);
    }
  }
};

}  // namespace dwgn_window

template <typename V> __device__ __forceinline__ V zero_value() { return V(0.0f); }
template <> __device__ __forceinline__ uint4 zero_value<uint4>() { return make_uint4(0, 0, 0, 0); }
template <> __device__ __forceinline__ uint2 zero_value<uint2>() { return make_uint2(0, 0); }
template <> __device__ __forceinline__ unsigned int zero_value<unsigned int>() { return 0u; }

template <typename T>
struct StagingArgs {
  const T* src;
  T* staged;
  int source;  // which of the M backward sources (0 forward)
  int first_plane, src_row0, plane_rows, num_rows, num_dst_planes, multiplier;
  int src_height, src_width, staged_width, left_halo;
  float inv_plane_rows;
};

// Global row of staged row `row` of a unit, or nullptr when the row is
// outside the image or past the last plane (staged as zeros).
template <typename T, bool BACKWARD, typename IndexT>
__device__ __forceinline__ const T* staged_source_row(const StagingArgs<T>& a, int row) {
  const int pb = dwgn::small_div(row, a.inv_plane_rows);
  const int src_row = a.src_row0 + row - pb * a.plane_rows;
  const int plane = a.first_plane + pb;
  if (src_row < 0 || src_row >= a.src_height || plane >= a.num_dst_planes) return nullptr;
  // Forward: plane = n*C*M + c*M + m reads x plane n*C + c = plane / M.
  const int src_plane = BACKWARD ? plane * a.multiplier + a.source
                                 : (a.multiplier == 1 ? plane : plane / a.multiplier);
  return a.src + (static_cast<IndexT>(src_plane) * a.src_height + src_row) * a.src_width;
}

// Asynchronous copy (V = 4, 8 or 16 bytes): every thread issues its cp.async
// for the whole unit without waiting (no registers hold the data); rows
// outside the image are zeroed with plain stores.  The caller commits.
template <typename T, int BYTES, bool BACKWARD, typename IndexT>
__device__ __forceinline__ void stage_rows_async(const StagingArgs<T>& a) {
  using V = typename dwgn::Bits<BYTES>::type;
  constexpr int E = BYTES / static_cast<int>(sizeof(T));
  const int row_vectors = a.src_width / E;
  const float inv_row_vectors = __frcp_rn(static_cast<float>(row_vectors));
  const int total = a.num_rows * row_vectors;
  if (a.num_rows == a.plane_rows) {  // block-uniform: a unit of one plane (or one band of it)
    // Copy i = threadIdx.x + k * blockDim.x is vector v of staged row `row`;
    // its source is element (src_row0 + row) * src_width + v * E = src_row0 *
    // src_width + i * E of the plane (rows are src_width = row_vectors * E
    // apart), its shared cell row * staged_width + left_halo + v * E.  The
    // thread divides once and then steps both by blockDim.x copies, where
    // the loop below re-derives row, plane and source row per copy (~45
    // instructions per copy, most of a stride-2 forward's instructions: its
    // units stage 4 source values per output).
    const int plane = a.first_plane;  // < num_dst_planes: the unit exists
    const int src_plane = BACKWARD ? plane * a.multiplier + a.source
                                   : (a.multiplier == 1 ? plane : plane / a.multiplier);
    // Negative when src_row0 < 0 in the first plane: only copies of rows
    // inside the image (offsets >= 0) are formed from it.
    const IndexT plane_offset = static_cast<IndexT>(src_plane) * a.src_height * a.src_width +
                                static_cast<IndexT>(a.src_row0) * a.src_width;
    const int threads = static_cast<int>(blockDim.x);
    const int step_rows = dwgn::small_div(threads, inv_row_vectors);
    const int step_v = threads - step_rows * row_vectors;  // < row_vectors: at most one wrap a step
    int row = dwgn::small_div(static_cast<int>(threadIdx.x), inv_row_vectors);
    int v = static_cast<int>(threadIdx.x) - row * row_vectors;
    T* to = a.staged + row * a.staged_width + a.left_halo + v * E;
    const int to_step = step_rows * a.staged_width + step_v * E;
    const int to_wrap = a.staged_width - row_vectors * E;
    for (int i = threadIdx.x; i < total; i += threads) {
      if (static_cast<unsigned>(a.src_row0 + row) < static_cast<unsigned>(a.src_height))
        dwgn::cp_async<BYTES>(to, a.src + (plane_offset + static_cast<IndexT>(i) * E));
      else
        *reinterpret_cast<V*>(to) = zero_value<V>();
      row += step_rows;
      v += step_v;
      to += to_step;
      if (v >= row_vectors) {
        v -= row_vectors;
        ++row;
        to += to_wrap;
      }
    }
    return;
  }
  for (int i = threadIdx.x; i < total; i += blockDim.x) {
    const int row = dwgn::small_div(i, inv_row_vectors);
    const int v = i - row * row_vectors;
    const T* row_ptr = staged_source_row<T, BACKWARD, IndexT>(a, row);
    T* to = a.staged + row * a.staged_width + a.left_halo + v * E;
    if (row_ptr != nullptr)
      dwgn::cp_async<BYTES>(to, row_ptr + v * E);
    else
      *reinterpret_cast<V*>(to) = zero_value<V>();
  }
}

// Synchronous element-wide copy for 2-byte types whose rows are not 4-byte
// aligned: UNROLL loads in flight per thread, then their stores.
template <typename T, bool BACKWARD, typename IndexT>
__device__ __forceinline__ void stage_rows_sync(const StagingArgs<T>& a) {
  constexpr int UNROLL = 8;
  const float inv_width = __frcp_rn(static_cast<float>(a.src_width));
  const int total = a.num_rows * a.src_width;
  for (int base = threadIdx.x; base < total; base += UNROLL * blockDim.x) {
    T buffer[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int i = base + u * blockDim.x;
      buffer[u] = T(0.0f);
      if (i < total) {
        const int row = dwgn::small_div(i, inv_width);
        const T* row_ptr = staged_source_row<T, BACKWARD, IndexT>(a, row);
        if (row_ptr != nullptr) buffer[u] = row_ptr[i - row * a.src_width];
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int i = base + u * blockDim.x;
      if (i < total) {
        const int row = dwgn::small_div(i, inv_width);
        a.staged[row * a.staged_width + a.left_halo + i - row * a.src_width] = buffer[u];
      }
    }
  }
}

template <typename T, bool BACKWARD, typename IndexT>
__device__ __forceinline__ void stage_rows(const StagingArgs<T>& a, int stage_bytes) {
  switch (stage_bytes) {
    case 16: stage_rows_async<T, 16, BACKWARD, IndexT>(a); break;
    case 8: stage_rows_async<T, 8, BACKWARD, IndexT>(a); break;
    case 4: if (sizeof(T) <= 4) stage_rows_async<T, 4, BACKWARD, IndexT>(a); break;
    default: if (sizeof(T) == 2) stage_rows_sync<T, BACKWARD, IndexT>(a); break;
  }
  dwgn::cp_async_commit();
}

// Flat staging (host: flat_elems > 0; one source per destination plane):
// the unit's source rows (whole planes, or the image rows of one band of one
// plane) are one contiguous range of src, copied as aligned 16-byte cp.async
// vectors into `raw` (shifted by the range's 16-byte phase, like the flat
// output path) instead of row by row with 4- or 8-byte copies and per-copy
// row arithmetic, or element by element where rows are not 4-byte aligned
// (odd widths of 2-byte types: 64x192x75 float16 376 us, 17% of the floor).
// The at most two partial vectors at the ends (misaligned or odd-length
// ranges only) are copied element-wise with plain loads.  The caller commits.
template <typename T>
__device__ __forceinline__ void stage_flat(const T* range, T* raw, int length) {
  constexpr int VEC = dwgn_window::kVec<T>;
  const int shift = static_cast<int>(reinterpret_cast<size_t>(range) % 16) / static_cast<int>(sizeof(T));
  const int vectors = (shift + length + VEC - 1) / VEC;
  for (int v = threadIdx.x; v < vectors; v += blockDim.x) {
    const int lo = v * VEC;
    if (lo >= shift && lo + VEC <= shift + length) {
      dwgn::cp_async<16>(raw + lo, range + (lo - shift));
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e)
        if (lo + e >= shift && lo + e < shift + length) raw[lo + e] = range[lo + e - shift];
    }
  }
}

template <typename T, int KH, int KW, int STRIDE, bool BACKWARD, typename IndexT>
__global__ void __launch_bounds__(256, dwgn_window::kMinBlocks<T, KH, STRIDE, BACKWARD, IndexT>) dwgn_dwconv2d_window(
    const T* __restrict__ src, const T* __restrict__ weight, const T* __restrict__ bias,
    T* __restrict__ dst, int channels, int multiplier, int num_dst_planes, int src_height,
    int src_width, int dst_height, int dst_width, int offset_top, int read_base,
    int planes_per_unit, int band_groups, int num_bands, int staged_rows, int staged_width,
    int left_halo, int stage_bytes, int direct_stores, int flat_elems, int fixed_copies) {
  static_assert(!BACKWARD || STRIDE == 1, "backward-input uses this kernel at stride 1 only");
  using Acc = typename AccType<T>::type;
  constexpr int VEC = dwgn_window::kVec<T>;
  constexpr int VW = dwgn_window::kColumns<T>;
  constexpr int RH = dwgn_window::kRows<T, KH>;
  // Source values one item row reads: VW outputs STRIDE apart plus the filter.
  constexpr int SPAN = (VW - 1) * STRIDE + KW;
  constexpr int ROWS_IN = (RH - 1) * STRIDE + KH;
  constexpr int LEAD = dwgn_window::kLead<T, KW>;
  constexpr int NV = (LEAD + SPAN + VEC - 1) / VEC;  // vectors per item row (host: _row_vectors)
  using Vector = uint4;  // 16 bytes = VEC elements

  extern __shared__ __align__(16) unsigned char shared_raw[];
  const int out_channels = channels * multiplier;
  const int sources = BACKWARD ? multiplier : 1;
  const int strips = (dst_width + VW - 1) / VW;
  const int items_per_plane = band_groups * strips;
  const int band_height = band_groups * RH;
  const int plane_rows = staged_rows;  // staged rows of one plane
  const int num_rows = planes_per_unit * plane_rows;
  const int buffer_elems = num_rows * staged_width;  // multiple of VEC: buffer 1 stays aligned
  const int num_units = (num_dst_planes + planes_per_unit - 1) / planes_per_unit * num_bands;
  T* const buffers = reinterpret_cast<T*>(shared_raw);
  // Flat staging (flat_elems > 0, block-uniform): one padded buffer (the
  // layout the items read, as buffer 0 of row staging) followed by two raw
  // buffers of flat_elems (a multiple of VEC, so they stay 16-byte aligned)
  // that receive the contiguous source range and later hold the unit's
  // outputs for the flat output path.
  const bool flat = flat_elems > 0;
  T* const raw_buffers = buffers + buffer_elems;
  const int src_plane_elems = src_height * src_width;

  const int planes_stride = BACKWARD ? multiplier : 1;
  if (dwgn_window::kNoFixedCopies<T, KH, STRIDE, BACKWARD>) fixed_copies = 0;
  const dwgn_window::FixedCopies fixed(fixed_copies, num_rows, src_width * static_cast<int>(sizeof(T)) / stage_bytes,
                                       stage_bytes / static_cast<int>(sizeof(T)), plane_rows, offset_top,
                                       src_height, src_width, staged_width, left_halo, planes_stride);
  if (flat) {
    // Every padded cell the expansion does not write (halo columns, padding
    // rows, rows past the staged window) stays zero for the whole kernel.
    for (int i = threadIdx.x; i < buffer_elems; i += blockDim.x) buffers[i] = T(0.0f);
  } else if (fixed_copies > 0) {
    // Fixed copies never write the halo columns or the padding rows: zero
    // both buffers whole, once (buffer_elems is a multiple of VEC), before
    // any copy lands in them (the barrier).
    for (int i = threadIdx.x; i < 2 * buffer_elems / VEC; i += blockDim.x)
      reinterpret_cast<uint4*>(buffers)[i] = make_uint4(0, 0, 0, 0);
    __syncthreads();
  } else {
  // The halo columns [0, left_halo) and [left_halo + src_width, staged_width)
  // of every staged row of both buffers are never written by the staging: zero
  // them once (the flat output path zeroes what it overwrote).
  {
    const int halo_width = staged_width - src_width;
    const float inv_halo = __frcp_rn(static_cast<float>(halo_width));
    for (int i = threadIdx.x; i < 2 * num_rows * halo_width; i += blockDim.x) {
      const int row = dwgn::small_div(i, inv_halo);
      const int k = i - row * halo_width;
      buffers[row * staged_width + (k < left_halo ? k : src_width + k)] = T(0.0f);
    }
  }
  }

  // This thread's item (the same in every unit; unused when kItemPerStep).
  const dwgn_window::Item item_once = dwgn_window::item_of<RH, VW, STRIDE, false>(
      threadIdx.x, items_per_plane, strips, planes_per_unit, plane_rows, staged_width, read_base);

  const float inv_plane_rows = __frcp_rn(static_cast<float>(plane_rows));
  // Flat staging's source range of a unit (`length` elements from `start`):
  // whole planes from row 0 (raw_row0 = 0; planes are src_plane_elems apart,
  // so they are one range), or a band's image rows of one plane from its
  // first, raw_row0 (none for a band of padding rows only).
  struct FlatRange {
    IndexT start;
    int length, raw_row0;
  };
  auto flat_range = [&](int first_plane, int band) {
    FlatRange r;
    if (num_bands == 1) {
      r.raw_row0 = 0;
      r.length = min(planes_per_unit, num_dst_planes - first_plane) * src_plane_elems;
    } else {
      const int src_row0 = band * band_height * STRIDE - offset_top;  // image row of staged row 0
      r.raw_row0 = max(src_row0, 0);
      r.length = max(0, min(src_row0 + plane_rows, src_height) - r.raw_row0) * src_width;
    }
    r.start = static_cast<IndexT>(first_plane) * src_plane_elems + static_cast<IndexT>(r.raw_row0) * src_width;
    return r;
  };
  auto stage = [&](int unit, int source, int buffer) {
    int plane_unit, band;
    dwgn_window::split_unit(unit, num_bands, plane_unit, band);
    const int first_plane = plane_unit * planes_per_unit;
    if (flat) {
      // One source per plane (host: multiplier == 1): whole planes
      // first_plane .. first_plane + valid - 1, or the image rows of one
      // band of one plane (num_bands > 1: planes_per_unit == 1); either is
      // one contiguous range of src (FlatRange).
      const FlatRange range = flat_range(first_plane, band);
      stage_flat<T>(src + range.start, raw_buffers + buffer * flat_elems, range.length);
      dwgn::cp_async_commit();
      return;
    }
    if (fixed_copies > 0) {  // num_bands == 1 (host)
      const T* base = src + (static_cast<IndexT>(first_plane) * planes_stride + source) * src_plane_elems;
      const int limit = min(planes_per_unit, num_dst_planes - first_plane) * planes_stride * src_plane_elems;
      T* staged = buffers + buffer * buffer_elems;
      switch (stage_bytes) {
        case 16: fixed.template issue<16>(staged, base, limit); break;
        case 8: fixed.template issue<8>(staged, base, limit); break;
        default: if (sizeof(T) <= 4) fixed.template issue<4>(staged, base, limit); break;
      }
      dwgn::cp_async_commit();
      return;
    }
    const int band_row0 = band * band_height;
    const StagingArgs<T> args{src, buffers + buffer * buffer_elems, source, first_plane,
                              band_row0 * STRIDE - offset_top, plane_rows, num_rows, num_dst_planes,
                              multiplier, src_height, src_width, staged_width, left_halo, inv_plane_rows};
    stage_rows<T, BACKWARD, IndexT>(args, stage_bytes);
  };

  int unit = blockIdx.x;
  int source = 0;
  if (unit < num_units) stage(unit, 0, 0);
  Acc acc[RH][VW];
  for (int step = 0; unit < num_units; ++step) {
    // Step order: the sources of a unit, then the block's next unit.
    int next_unit = unit;
    int next_source = source + 1;
    if (next_source == sources) {
      next_source = 0;
      next_unit = dwgn::grid_stride_next(unit, static_cast<int>(gridDim.x), num_units);
    }
    // Buffer (step + 1) & 1 was last read at step - 1, which ended with a barrier.
    if (!flat) {
      if (next_unit < num_units) stage(next_unit, next_source, (step + 1) & 1);
      else dwgn::cp_async_commit();  // an empty group keeps wait_group<1> counting right
    }

    const dwgn_window::Item item =
        dwgn_window::kItemPerStep<T, KH, BACKWARD>
            ? dwgn_window::item_of<RH, VW, STRIDE, true>(dwgn_window::thread_x_here(), items_per_plane, strips,
                                                         planes_per_unit, plane_rows, staged_width, read_base)
            : item_once;
    int plane_unit, band;
    dwgn_window::split_unit(unit, num_bands, plane_unit, band);
    const int first_plane = plane_unit * planes_per_unit;
    const int band_row0 = band * band_height;
    const int dst_plane = first_plane + item.plane;
    const int dst_row0 = band_row0 + item.group * RH;
    const bool active = item.valid && dst_plane < num_dst_planes && dst_row0 < dst_height;
    const int filter = BACKWARD ? dwgn_window::nonnegative_mod(dst_plane, channels) * multiplier + source
                                : dwgn_window::nonnegative_mod(dst_plane, out_channels);
    // Weights (and the bias) are read before the wait so their latency overlaps it.
    Acc w[KH * KW];
    if (active) {
      const T* w_filter = weight + filter * KH * KW;
#pragma unroll
      for (int t = 0; t < KH * KW; ++t) w[t] = to_acc(w_filter[BACKWARD ? KH * KW - 1 - t : t]);
    }
    if (source == 0) {
      // The forward's bias starts the sums (it is then the first FMA's addend,
      // not an add per output at the store).
      const Acc start = (!BACKWARD && bias != nullptr && active) ? to_acc(bias[filter]) : Acc(0);
#pragma unroll
      for (int j = 0; j < RH; ++j)
#pragma unroll
        for (int o = 0; o < VW; ++o) acc[j][o] = start;
    }
    if (!flat) {
      dwgn::cp_async_wait<1>();  // this thread's copies of this step have landed
      __syncthreads();                  // everyone's have (and the zero rows are visible)
    } else {
      // Three barriers per step.  This one: raw buffer step & 1 has landed
      // (this step's only outstanding group) and is visible; every thread has
      // finished step - 1 (its reads of the padded buffer and its stores from
      // raw buffer (step + 1) & 1, which the next copy reuses).
      dwgn::cp_async_wait<0>();
      __syncthreads();
      // Issued a whole step ahead of its use: the copy overlaps this step.
      if (next_unit < num_units) stage(next_unit, next_source, (step + 1) & 1);
      // Expand the raw range into the padded layout, image columns of every
      // staged row of the unit's valid planes: staged row k of plane pl is
      // image row src_row0 + k, element (pl * src_height + image row -
      // raw_row0) * src_width + c of the range, or zero outside the image
      // (a band's padding rows held image rows of the block's previous band).
      // A row per group of `row_lanes` threads (a power of two <= 32 that
      // covers the narrower rows in one pass), columns row_lanes apart: one
      // division per row, not two per element (the expansion had as many
      // instructions as the unit's arithmetic).
      const FlatRange range = flat_range(first_plane, band);
      const T* const raw = raw_buffers + (step & 1) * flat_elems +
                           static_cast<int>(reinterpret_cast<size_t>(src + range.start) % 16) /
                               static_cast<int>(sizeof(T));
      const int src_row0 = band_row0 * STRIDE - offset_top;
      const int rows_total = min(planes_per_unit, num_dst_planes - first_plane) * plane_rows;
      const int row_lanes = src_width > 16 ? 32 : (src_width > 8 ? 16 : 8);
      const int lane = static_cast<int>(threadIdx.x) & (row_lanes - 1);
      const int row_step = static_cast<int>(blockDim.x) / row_lanes;  // blockDim.x: a multiple of 32 (host)
      for (int row = static_cast<int>(threadIdx.x) / row_lanes; row < rows_total; row += row_step) {
        const int pl = dwgn::small_div(row, inv_plane_rows);  // row = pl * plane_rows + k
        const int image_row = src_row0 + row - pl * plane_rows;
        T* const to = buffers + row * staged_width + left_halo;
        if (static_cast<unsigned>(image_row) < static_cast<unsigned>(src_height)) {
          const T* const from = raw + (pl * src_height + image_row - range.raw_row0) * src_width;
          for (int c = lane; c < src_width; c += row_lanes) to[c] = from[c];
        } else {
          for (int c = lane; c < src_width; c += row_lanes) to[c] = T(0.0f);
        }
      }
      __syncthreads();  // the padded planes are complete
    }

    if (active) {
      const T* item_src = buffers + (flat ? 0 : (step & 1) * buffer_elems) + item.offset;
#pragma unroll
      for (int r = 0; r < ROWS_IN; ++r) {
        Acc row[SPAN];
        dwgn_window::RowReader<T, LEAD, SPAN, 0, NV>::read(item_src + r * staged_width, row);
        // Source row r feeds destination row j through tap row kh = r - j*STRIDE.
#pragma unroll
        for (int j = 0; j < RH; ++j) {
          const int kh = r - j * STRIDE;
          if (kh >= 0 && kh < KH) {
#pragma unroll
            for (int kw = 0; kw < KW; ++kw)
#pragma unroll
              for (int o = 0; o < VW; ++o) acc[j][o] += row[o * STRIDE + kw] * w[kh * KW + kw];
          }
        }
      }
    }
    if (source == sources - 1) {  // block-uniform: the barriers below are safe
      const int col0 = item.strip * VW;
      if (direct_stores) {
        // dst_width % VEC == 0 and dst is 16-byte aligned (host checked):
        // every strip is whole and aligned; streaming store, y is not re-read.
        if (active) {
          T* dst_plane_ptr = dst + static_cast<IndexT>(dst_plane) * dst_height * dst_width;
#pragma unroll
          for (int j = 0; j < RH; ++j) {
            const int r = dst_row0 + j;
            if (r >= dst_height) break;
            Vector packed;
            T* lanes = reinterpret_cast<T*>(&packed);
#pragma unroll
            for (int o = 0; o < VW; ++o) lanes[o] = from_acc<T>(acc[j][o]);
            __stcs(reinterpret_cast<Vector*>(dst_plane_ptr + static_cast<IndexT>(r) * dst_width + col0), packed);
          }
        }
      } else {
        // Rows whose strips are not whole 16-byte vectors: per-item stores
        // would be 2- or 4-byte writes 16 bytes apart across the warp (one L2
        // request per element).  The unit's destination elements are one
        // contiguous range of dst (whole planes, or whole rows of one plane),
        // so the items write them into this step's (now read) buffer in dst
        // order, shifted so that shared and global 16-byte boundaries
        // coincide, and the block stores the range as aligned 16-byte vectors.
        const int valid_planes = min(planes_per_unit, num_dst_planes - first_plane);
        const int unit_rows = min(band_height, dst_height - band_row0);  // = dst_height when ppu > 1
        T* const dst_unit = dst + static_cast<IndexT>(first_plane) * dst_height * dst_width +
                            static_cast<IndexT>(band_row0) * dst_width;
        const int shift = static_cast<int>(reinterpret_cast<size_t>(dst_unit) % 16) / static_cast<int>(sizeof(T));
        const int length = valid_planes * unit_rows * dst_width;  // host: fits a buffer with shift
        // Flat staging: this step's raw buffer (fully read by the expansion,
        // before the last barrier; flat_elems covers shift + length).
        T* const flat_out = flat ? raw_buffers + (step & 1) * flat_elems : buffers + (step & 1) * buffer_elems;
        if (!flat) __syncthreads();  // every item has finished reading this buffer
        if (active) {
          const int item_base = shift + (item.plane * unit_rows + dst_row0 - band_row0) * dst_width + col0;
#pragma unroll
          for (int j = 0; j < RH; ++j) {
            if (dst_row0 + j >= dst_height) break;
#pragma unroll
            for (int o = 0; o < VW; ++o)
              if (col0 + o < dst_width) flat_out[item_base + j * dst_width + o] = from_acc<T>(acc[j][o]);
          }
        }
        __syncthreads();  // the unit's outputs are all in `flat`
        const int vectors = (shift + length + VEC - 1) / VEC;
        for (int v = threadIdx.x; v < vectors; v += blockDim.x) {
          const int lo = v * VEC;
          Vector* const shared_vector = reinterpret_cast<Vector*>(flat_out + lo);
          if (lo >= shift && lo + VEC <= shift + length) {
            __stcs(reinterpret_cast<Vector*>(dst_unit + (lo - shift)), *shared_vector);
          } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e)
              if (lo + e >= shift && lo + e < shift + length) dst_unit[lo + e - shift] = flat_out[lo + e];
          }
          // Row staging rewrites only image columns: restore the zero halo
          // columns this range overwrote (zeroing all of it is simpler and as
          // cheap).  Flat staging rewrites the raw buffer whole.
          if (!flat) *shared_vector = zero_value<Vector>();
        }
      }
    }
    if (!flat) __syncthreads();  // buffer step & 1 is restaged at step + 1 (into (step + 2) & 1)
    unit = next_unit;
    source = next_source;
  }
  dwgn::cp_async_wait<0>();
}
