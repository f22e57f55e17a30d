// Channels-last GroupNorm with a fused activation: forward and backward.
//
// x is (N, S, C) in memory (S = the product of the spatial sizes, C fastest);
// the C channels form G groups of D = C / G consecutive channels.  Statistics
// are per (n, g) over S*D elements, biased variance, accumulated in Acc
// (float for float/__half/__nv_bfloat16, double for double).
//
//   z = (x - mean) * rstd * w[c] + b[c]   (w = 1, b = 0 when absent)
//   y = act(z)
//
// Template parameters:
//   T       element type of x, y, grad_out, grad_in
//   W       element type of weight/bias (T, or float for half types)
//   Acc     accumulator type (the finalize kernels are templated on it
//           rather than on T, so that __half and bfloat16 share them)
//   ACT     activation: 0 identity, 1 relu, 2 silu, 3 gelu (erf), 4 gelu_tanh
//   VEC     elements per 16-byte vector access (1: scalar path, used when C
//           is not a multiple of the vector width or a pointer is misaligned)
//   IndexT  int, or long long when a tensor has >= 2**31 elements
//
// Launches (no atomics but the grid barrier's and tickets' counters, no host
// synchronization; the reduction order depends on the shapes, the vector
// path (C a multiple of the 16-byte vector and every pointer 16-byte
// aligned) and the path (cluster, resident, fused or split) only, never on
// the grid, so results are bit-reproducible run to run):
//   forward:  on sm_90, tensors of up to 16 MB on the vector path whose
//             channel sets fit clusters of up to 8 CTAs: fwd_cluster, one
//             launch of thread-block clusters reading x once (at the end of
//             this file); else
//             stats (cooperative: its finalize after a grid barrier) ->
//             fwd_apply: 2 launches, reading x twice (the second time from
//             L2 for tensors that fit it); stats -> fwd_finalize -> fwd_apply
//             on a device without cooperative launches.
//   backward: on sm_90, tensors of up to 16 MB on the vector path whose
//             channel sets fit clusters of up to 4 CTAs: bwd_cluster, one
//             launch reading x and grad_out once (at the end of this file);
//             else bwd_reduce (cooperative, with its finalize) -> bwd_dx, or
//             bwd_reduce -> bwd_finalize -> bwd_dx; reads x and grad_out
//             twice (the floor is 3 passes: read x, grad_out, write grad_in).
//   The one-pass kernels (opt-in, see _group_norm.py) do all three in one;
//   the resident kernels (opt-in; at the end of this file) do it in one
//   launch that reads x (and grad_out) from DRAM once, where they fit on chip.
//
// Numerics: each thread of dwgn_gn_stats keeps a Welford summary (count,
// mean, M2) of its lane, built batch by batch (kRowBatch rows: their own mean
// and M2 in registers, then one Chan merge), beside the plain sum of x in
// double, so the mean is exact.  Lanes are combined by the parallel-axis theorem in
// double; chunks and the channels of a group are combined in one pass
// relative to a shift (gn::finalize_group, where the bound on the
// cancellation is derived).  So neither a large mean
// (x = 1000 + randn in float32) nor an outlier anywhere loses digits to an
// E[x^2] - E[x]^2 cancellation.  The forward applies y = (x - hi) * scale_c
// + offset_c with hi the mean rounded to Acc and the rest folded into
// offset_c, never x * scale + shift, for the same reason.

#include "dwgn_common.cuh"

using dwgn::AccType;
using dwgn::from_acc;
using dwgn::to_acc;

namespace gn {

constexpr int kIdentity = 0;
constexpr int kRelu = 1;
constexpr int kSilu = 2;
constexpr int kGelu = 3;
constexpr int kGeluTanh = 4;

__device__ __forceinline__ float exp_acc(float v) { return expf(v); }
__device__ __forceinline__ double exp_acc(double v) { return exp(v); }
__device__ __forceinline__ float erf_acc(float v) { return erff(v); }
__device__ __forceinline__ double erf_acc(double v) { return erf(v); }
__device__ __forceinline__ float tanh_acc(float v) { return tanhf(v); }
__device__ __forceinline__ double tanh_acc(double v) { return tanh(v); }
__device__ __forceinline__ float rsqrt_acc(float v) { return rsqrtf(v); }
__device__ __forceinline__ double rsqrt_acc(double v) { return rsqrt(v); }

// The logistic function 1 / (1 + exp(-z)).  FAST (half-precision outputs,
// float arithmetic): the hardware exp2 approximation and an approximate
// reciprocal, a relative error near 1e-6, far below the 2**-11 (float16) or
// 2**-8 (bfloat16) steps of the output, for a few instructions instead of
// expf's range reduction and an IEEE division.  exp(-z) = inf (z < -88)
// gives 1 / inf = 0 either way.
template <bool FAST, typename Acc>
__device__ __forceinline__ Acc sigmoid(Acc z) {
  if constexpr (FAST && sizeof(Acc) == 4) {
    return __fdividef(1.0f, 1.0f + __expf(-z));
  } else {
    return Acc(1) / (Acc(1) + exp_acc(-z));
  }
}

// Whether the activations of a T output take the FAST forms (above).
template <typename T>
constexpr bool fast_activation() { return sizeof(T) == 2; }

template <int ACT, bool FAST = false, typename Acc>
__device__ __forceinline__ Acc activation(Acc z) {
  // NaN < 0 is false: a NaN passes through, as in PyTorch's relu (z > 0 ? z : 0 made it 0).
  if (ACT == kRelu) return z < Acc(0) ? Acc(0) : z;
  if (ACT == kSilu) {
    if constexpr (FAST) return z * sigmoid<true>(z);
    return z / (Acc(1) + exp_acc(-z));
  }
  if (ACT == kGelu) return Acc(0.5) * z * (Acc(1) + erf_acc(z * Acc(0.7071067811865476)));
  if (ACT == kGeluTanh) {
    const Acc inner = Acc(0.7978845608028654) * (z + Acc(0.044715) * z * z * z);
    return Acc(0.5) * z * (Acc(1) + tanh_acc(inner));
  }
  return z;
}

// d act(z) / dz.
template <int ACT, bool FAST = false, typename Acc>
__device__ __forceinline__ Acc activation_grad(Acc z) {
  if (ACT == kRelu) return z > Acc(0) ? Acc(1) : Acc(0);
  if (ACT == kSilu) {
    const Acc s = sigmoid<FAST>(z);
    return s * (Acc(1) + z * (Acc(1) - s));
  }
  if (ACT == kGelu) {
    const Acc cdf = Acc(0.5) * (Acc(1) + erf_acc(z * Acc(0.7071067811865476)));
    const Acc pdf = exp_acc(Acc(-0.5) * z * z) * Acc(0.3989422804014327);  // 1/sqrt(2 pi)
    return cdf + z * pdf;
  }
  if (ACT == kGeluTanh) {
    const Acc z2 = z * z;
    const Acc t = tanh_acc(Acc(0.7978845608028654) * (z + Acc(0.044715) * z2 * z));
    return Acc(0.5) * (Acc(1) + t) +
           Acc(0.5) * z * (Acc(1) - t * t) * Acc(0.7978845608028654) *
               (Acc(1) + Acc(3) * Acc(0.044715) * z2);
  }
  return Acc(1);
}

// VEC consecutive elements, one 16-byte (or element-size) access.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
};

// Thread layout of the column reductions: the block covers `cols`
// consecutive columns starting at `first` (min(width, blockDim.x) unless
// given), and `lanes` rows at a time (cols * lanes <= blockDim.x); a thread
// is valid when its lane is whole and its column below `end`.  Extra
// threads idle but still reach every barrier.
struct ColumnLayout {
  int cols, lanes, col, lane, c;
  bool valid;
  __device__ __forceinline__ ColumnLayout(int width, int first, int end)
      : ColumnLayout(first, end, width < static_cast<int>(blockDim.x) ? width : static_cast<int>(blockDim.x), 0) {}
  __device__ __forceinline__ ColumnLayout(int first, int end, int cols_, int) : cols(cols_) {
    lanes = blockDim.x / cols;
    col = threadIdx.x % cols;
    lane = threadIdx.x / cols;
    c = first + col;
    valid = lane < lanes && c < end;
  }
  // The layout of dwgn_gn_stats and dwgn_gn_bwd_reduce: column block z
  // covers columns [z * cols, (z + 1) * cols) of the width (cols <=
  // blockDim.x, chosen by the host: _group_norm._split / _stats_split).
  __device__ static __forceinline__ ColumnLayout channels(int width, int z, int cols) {
    return ColumnLayout(z * cols, width, cols, 0);
  }
};

// The column kernels' work items: (chunk, n, column block) triples, chunk
// fastest, num_chunks * N * ceil(width / cols) of them.  Block b takes items
// b, b + gridDim.x, ...: the host launches one block per item (up to
// 65536 blocks), or (the cooperative launch, which must fit on the device)
// at most the resident blocks.  Which block takes an item never changes what it computes, so the
// results do not depend on the grid.  The two column kernels spell their
// item loop out: a shared loop taking the body as a lambda (tried) cost
// dwgn_gn_stats<__half, *, 8> two registers, over the 128 of 2 blocks per SM
// (and spills when bounded).  count + gridDim.x < 2**31 (the host
// checks it), so int counters never wrap (and cost the reduce kernels,
// which sit at their register bound, no 64-bit pairs).
struct ColumnItems {
  int count, num_chunks, N;
  __device__ __forceinline__ ColumnItems(int num_chunks_, int N_, int width, int cols)
      : num_chunks(num_chunks_), N(N_) {
    count = num_chunks * N * ((width + cols - 1) / cols);
  }
  __device__ __forceinline__ void decode(int item, int& chunk, int& n, int& column_block) const {
    const int rest = item / num_chunks;
    chunk = item - rest * num_chunks;
    column_block = rest / N;
    n = rest - column_block * N;
  }
};

// Sums NUM per-thread values over the `lanes` threads that share a column, in
// a fixed order; the result is valid in the lane-0 thread of each column.
// Every thread of the block must call it.
template <int NUM, typename Acc>
__device__ __forceinline__ void column_sum(Acc (&v)[NUM], const ColumnLayout& L, Acc* scratch) {
#pragma unroll
  for (int i = 0; i < NUM; ++i) scratch[i * blockDim.x + threadIdx.x] = v[i];
  __syncthreads();
  if (L.lane == 0) {
#pragma unroll
    for (int i = 0; i < NUM; ++i) {
      Acc total = Acc(0);
      for (int j = 0; j < L.lanes; ++j) total += scratch[i * blockDim.x + j * L.cols + L.col];
      v[i] = total;
    }
  }
  __syncthreads();  // scratch is reused by the next iteration
}

// 1 / v for the Welford update: the correctly rounded reciprocal, cheaper than
// a division in float.
__device__ __forceinline__ float reciprocal(float v) { return __frcp_rn(v); }
__device__ __forceinline__ double reciprocal(double v) { return 1.0 / v; }

// Rows of [row0, row1) visited by lane `lane` of `lanes` (r = row0 + lane + k * lanes).
__device__ __forceinline__ int lane_rows(int row0, int row1, int lane, int lanes) {
  const int span = row1 - row0 - lane;
  return span > 0 ? (span + lanes - 1) / lanes : 0;
}

// The chunk of rows a column-kernel item reduces (chunk `chunk` of
// num_chunks, rows [row0, row1)), this thread's share of them (lane_count
// rows: row0 + L.lane + k * L.lanes; 0 for an idle thread), and where the
// chunk's two per-channel results go in partial (N, num_chunks, 2, C).
struct ChunkRows {
  int chunk, num_chunks, row0, row1, lane_count;
  __device__ __forceinline__ ChunkRows(int S, int rows_per_chunk, int num_chunks_, int chunk_,
                                       const ColumnLayout& L) {
    chunk = chunk_;
    num_chunks = num_chunks_;
    row0 = chunk * rows_per_chunk;
    row1 = S - row0 > rows_per_chunk ? row0 + rows_per_chunk : S;  // row0 < S; row0 + rows_per_chunk may pass 2**31
    lane_count = L.valid ? lane_rows(row0, row1, L.lane, L.lanes) : 0;
  }
  template <typename P>
  __device__ __forceinline__ P* slot(P* partial, int n, int C, int c) const {
    return partial + (static_cast<long long>(n) * num_chunks + chunk) * 2 * C + c;
  }
};

// Rows a column kernel's thread loads per step.  One load at a time leaves
// far too few bytes in flight to cover the memory latency (Little's law: an
// H200 needs ~25 KB in flight per SM); kRowBatch independent loads per step
// do.
constexpr int kRowBatch = 8;
// Rows per batch of a thread that reads VEC channels per row: 16-byte
// vectors of 8 channels hold 8 values each, so 4 rows keep the registers
// (and still 64 bytes in flight per thread) in bounds.
template <int VEC>
constexpr int row_batch() { return VEC >= 8 ? 4 : kRowBatch; }
// Batches of rows in flight in walk_lane_rows_staged: 2 x 4 rows (statistics)
// or 2 x 2 x 2 (backward reduce) of 16 bytes per thread, 32 KB of shared
// memory per block of 256, which the lane slots reuse after the walk.  With
// the register walk (one batch in flight, none while a thread adds it)
// Nsight Compute read dwgn_gn_stats<half, 8> at 52% of the H200's DRAM peak
// and dwgn_gn_bwd_reduce at 69% (1x512x512x128, 2 blocks of 256 per SM at
// 112-118 registers).  Twice the bytes in flight measured less than
// predicted (H200, same-run A/B: large tensors forward 1.7-3.8% and
// backward 1.8-6.7% faster, SD-size unchanged; a third block per SM gained
// nothing), so bytes in flight are not what bounds these kernels most.
constexpr int kStagedBatches = 2;

// Walks the `count` rows of one lane (k = 0 .. count-1): batch(k) for whole
// batches of BATCH rows, then tail(k, rest) for the rest (< BATCH rows),
// whose loads are also issued together: a chunk of few rows per lane (the
// SD-size tensors) is mostly tail, and one load at a time would cost a
// memory round trip per row.  Row k is passed by number, never as a running
// pointer, so no index can wrap.
template <int BATCH, typename Batch, typename Tail>
__device__ __forceinline__ void walk_lane_rows(int count, Batch batch, Tail tail) {
  int k = 0;
  for (; k + BATCH <= count; k += BATCH) batch(k);
  if (k < count) tail(k, count - k);
}

// walk_lane_rows for rows of NT tensors (row k of tensor t at
// columns[t][k * row_step], 16-byte vectors) copied into shared memory
// kStagedBatches batches ahead with cp.async: batch(k0, v) gets v[t][q] =
// row k0 + q of tensor t for whole batches of RB rows, tail(k0, rest, v) the
// rest (q < rest), in row order as in walk_lane_rows, so sums come out bit
// for bit the same; but a thread keeps kStagedBatches * RB rows in flight
// while it adds a batch, where walk_lane_rows has RB in flight and none
// while it adds.  ring: this thread's first slot; slot j of tensor t is
// ring[(j * NT + t) * slot_stride] (slot_stride = blockDim.x: a warp's
// slots are consecutive 16-byte words, conflict-free), kStagedBatches * RB *
// NT slots per thread.  Every copy has landed when it returns; the caller
// syncs the block before the ring's memory is reused for anything else.
template <int RB, int NT, typename V, typename IndexT, typename Batch, typename Tail>
__device__ __forceinline__ void walk_lane_rows_staged(const V* const (&columns)[NT], IndexT row_step, int count,
                                                      uint4* ring, int slot_stride, Batch batch, Tail tail) {
  static_assert(sizeof(V) == 16, "the ring holds 16-byte vectors");
  constexpr int SLOTS = RB * kStagedBatches;
  static_assert((SLOTS & (SLOTS - 1)) == 0, "row k's slot is k & (SLOTS - 1)");
  auto slot = [&](int k, int t) { return ring + ((k & (SLOTS - 1)) * NT + t) * slot_stride; };
  // Batch k0's rows into their slots, one copy group per batch (committed
  // even when empty, so that wait_group counts batches).
  auto issue = [&](int k0) {
#pragma unroll
    for (int q = 0; q < RB; ++q) {
      if (k0 + q < count) {
#pragma unroll
        for (int t = 0; t < NT; ++t) dwgn::cp_async<16>(slot(k0 + q, t), columns[t] + (k0 + q) * row_step);
      }
    }
    dwgn::cp_async_commit();
  };
  // Row k of tensor t, in registers when this returns: the empty asm takes
  // the loaded words as operands, so the copy issued next into the same
  // slot cannot pass the read (a cp.async write is not ordered after this
  // thread's earlier shared loads otherwise).
  auto take = [&](int k, int t) {
    const uint4 bits = *slot(k, t);
    asm volatile("" ::"r"(bits.x), "r"(bits.y), "r"(bits.z), "r"(bits.w));
    return *reinterpret_cast<const V*>(&bits);
  };
#pragma unroll
  for (int b = 0; b < kStagedBatches; ++b) issue(b * RB);
  int k = 0;
  for (; k + RB <= count; k += RB) {
    dwgn::cp_async_wait<kStagedBatches - 1>();  // batch k has landed
    V v[NT][RB];
#pragma unroll
    for (int q = 0; q < RB; ++q) {
#pragma unroll
      for (int t = 0; t < NT; ++t) v[t][q] = take(k + q, t);
    }
    issue(k + SLOTS);  // into the slots just read
    batch(k, v);
  }
  if (k < count) {
    dwgn::cp_async_wait<kStagedBatches - 1>();
    V v[NT][RB];
#pragma unroll
    for (int q = 0; q < RB; ++q) {
      if (k + q < count) {
#pragma unroll
        for (int t = 0; t < NT; ++t) v[t][q] = take(k + q, t);
      }
    }
    tail(k, count - k, v);
  }
  dwgn::cp_async_wait_all();  // (only empty groups can remain)
}

// One lane's running statistics of VEC channels: the double plain sum of
// each (the mean stays exact), and a Welford mean and M2 in Acc built batch
// by batch: a batch's own mean and M2 (two passes over registers), then one
// Chan merge into the lane summary (one reciprocal per batch, no per-element
// dependency chain).  `seen` (rows merged) stays far below 2**24, so Acc
// holds it exactly.  Shared by dwgn_gn_stats and the one-pass
// forward.
template <typename T, int VEC>
struct LaneWelford {
  using Acc = typename AccType<T>::type;
  double sum[VEC];
  Acc mean[VEC], m2[VEC];
  Acc seen = Acc(0);
  __device__ __forceinline__ LaneWelford() {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      sum[k] = 0.0;
      mean[k] = Acc(0);
      m2[k] = Acc(0);
    }
  }
  template <int RB>
  __device__ __forceinline__ void add_batch(const Vec<T, VEC> (&v)[RB]) {
    const Acc previous = seen;
    seen += Acc(RB);
    const Acc weight_b = Acc(RB) * reciprocal(seen);
    const Acc merge_scale = previous * weight_b;  // Chan: n_a * n_b / (n_a + n_b)
    // 2-byte types: the batch's float sum goes to the double sum once per
    // batch.  It is exact whenever the batch's values span at most 13
    // binades (11-bit significands in float's 24), and otherwise off by at
    // most 2**-24 of the largest, far below the type's 2**-11 step; a
    // float -> double conversion per element (16 per clock per SM on sm_90)
    // cost the statistics kernel more than its loads.  float32 keeps the
    // per-element double sum (its values do not fit float's significand).
    constexpr bool kNarrow = sizeof(T) == 2;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      Acc batch_sum = Acc(0);
      double batch_sum_wide = 0.0;
      Acc values[RB];
#pragma unroll
      for (int r = 0; r < RB; ++r) {
        values[r] = to_acc(v[r].v[k]);
        batch_sum += values[r];
        if (!kNarrow) batch_sum_wide += values[r];
      }
      const Acc batch_mean = batch_sum * Acc(1.0 / RB);  // exact scaling
      Acc batch_m2 = Acc(0);
#pragma unroll
      for (int r = 0; r < RB; ++r) {
        const Acc d = values[r] - batch_mean;
        batch_m2 += d * d;
      }
      sum[k] += kNarrow ? static_cast<double>(batch_sum) : batch_sum_wide;
      const Acc delta = batch_mean - mean[k];
      mean[k] += delta * weight_b;
      m2[k] += batch_m2 + delta * delta * merge_scale;
    }
  }
  // The lane's `count` rows, row k at column[k * row_step], RB rows per
  // batch with all their loads in flight together.
  template <int RB, typename IndexT>
  __device__ __forceinline__ void walk(const Vec<T, VEC>* column, IndexT row_step, int count) {
    walk_lane_rows<RB>(
        count,
        [&](int k0) {
          Vec<T, VEC> v[RB];
#pragma unroll
          for (int r = 0; r < RB; ++r) v[r] = column[(k0 + r) * row_step];
          add_batch<RB>(v);
        },
        [&](int k0, int rest) {
          Vec<T, VEC> v[RB];
#pragma unroll
          for (int r = 0; r < RB; ++r) {
            if (r < rest) v[r] = column[(k0 + r) * row_step];
          }
#pragma unroll
          for (int r = 0; r < RB; ++r) {
            if (r < rest) add(v[r]);
          }
        });
  }
  // walk through walk_lane_rows_staged (the 2-byte types' 16-byte vectors):
  // the same batches in the same order, so the same sums, bit for bit.
  template <int RB, typename IndexT>
  __device__ __forceinline__ void walk_staged(const Vec<T, VEC>* column, IndexT row_step, int count, uint4* ring,
                                              int slot_stride) {
    using V = Vec<T, VEC>;
    const V* const columns[1] = {column};
    walk_lane_rows_staged<RB>(
        columns, row_step, count, ring, slot_stride, [&](int, const V (&v)[1][RB]) { add_batch<RB>(v[0]); },
        [&](int, int rest, const V (&v)[1][RB]) {
#pragma unroll
          for (int r = 0; r < RB; ++r) {
            if (r < rest) add(v[0][r]);
          }
        });
  }
  __device__ __forceinline__ void add(const Vec<T, VEC>& v) {
    seen += Acc(1);
    const Acc inv = reciprocal(seen);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const Acc value = to_acc(v.v[k]);
      sum[k] += value;
      const Acc delta = value - mean[k];
      mean[k] += delta * inv;
      m2[k] += delta * (value - mean[k]);
    }
  }
};

// Per-lane results of a column-kernel block, through shared memory: the
// thread of (lane, col) stores the VEC values of its channels at slots
// lane * span + col * VEC + k (span = VEC * the block's valid columns, so
// the block's channels are slots [0, span) of each lane's row); after a
// barrier one thread per channel combines that channel's lanes, lane 0 to
// lanes - 1 (a fixed order).  Every channel is combined at once: VEC rounds
// of a merge in which only the lane-0 threads work (one column of lanes
// each, serially) cost the vector kernels more than their loads.
template <int VEC, typename A>
__device__ __forceinline__ void store_lane(A* slots, int span, const ColumnLayout& L, const A (&v)[VEC]) {
  if (L.valid) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) slots[L.lane * span + L.col * VEC + k] = v[k];
  }
}

// How lane_rows deals a chunk's rows [row0, row1) to `lanes` lanes: lanes
// j < extra get base + 1 rows, the others base; with the reciprocals the
// lane combine needs, computed once per chunk (a division per lane and
// channel was a long dependent chain in every block's epilogue).
struct LaneSplit {
  int lanes, base, extra;
  double inv_rows, inv_base, inv_base1;
  __device__ __forceinline__ LaneSplit(int row0, int row1, int lanes_) : lanes(lanes_) {
    const int rows = row1 - row0;  // >= 1: a chunk starts below S
    base = rows / lanes;
    extra = rows - base * lanes;
    inv_rows = 1.0 / rows;
    inv_base = base > 0 ? 1.0 / base : 0.0;
    inv_base1 = 1.0 / (base + 1);
  }
};

// One channel's lane summaries (lane j at sums[j * stride], m2s[j * stride],
// covering the rows `split` gives it) combined in double: the plain sum, and
// M2 by the parallel-axis theorem, M2 = sum_j M2_j + (s_j - n_j m)^2 / n_j
// with m = sum / rows (every term >= 0, nothing cancels).
template <typename Acc>
__device__ __forceinline__ void combine_lanes(const double* sums, const Acc* m2s, int stride, const LaneSplit& split,
                                              double& total, double& m2) {
  total = 0.0;
#pragma unroll 4
  for (int j = 0; j < split.lanes; ++j) total += sums[j * stride];
  const double m = total * split.inv_rows;
  m2 = 0.0;
#pragma unroll 4
  for (int j = 0; j < split.lanes; ++j) {
    const bool longer = j < split.extra;
    const int n_j = longer ? split.base + 1 : split.base;
    if (n_j > 0) {
      const double d = sums[j * stride] - n_j * m;  // n_j * (mean_j - m)
      m2 += static_cast<double>(m2s[j * stride]) + d * d * (longer ? split.inv_base1 : split.inv_base);
    }
  }
}

// One channel's lane values (lane j at v[j * stride]) summed in lane order.
template <typename Acc>
__device__ __forceinline__ Acc sum_lanes(const Acc* v, int stride, int lanes) {
  Acc total = Acc(0);
  for (int j = 0; j < lanes; ++j) total += v[j * stride];
  return total;
}

// Item `i` of a group's chunk summaries, D channels times num_chunks chunks
// (channel fastest, so neighbouring threads read neighbouring addresses):
// its offset in one sample's (num_chunks, 2, C) block of partial, and its
// chunk.  2 * C * num_chunks < 2**31: either num_chunks = 1 (C < 2**24,
// _checks), or num_chunks * column blocks <= 256 (_split, _stats_split)
// with at most 512 channels per column block, so this stays inside int.
__device__ __forceinline__ int group_item(int i, int D, int c0, int C, int& chunk) {
  chunk = i / D;
  return chunk * 2 * C + c0 + (i - chunk * D);
}

// Visits i = first, first + stride, ... below count in that order, loading
// U items before adding any of them: the finalize kernels read a few L2-hot
// values per thread and are bound by load latency, and a batch's loads are
// independent, so U round trips overlap.  The order of the additions is the
// plain loop's (deterministic, whoever runs it).
template <int U, typename Load, typename Add>
__device__ __forceinline__ void batched_walk(long long first, long long count, int stride, Load load,
                                             Add add) {
  using Item = decltype(load(0LL));
  for (long long i0 = first; i0 < count; i0 += static_cast<long long>(U) * stride) {
    Item item[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (i0 + u * stride < count) item[u] = load(i0 + u * stride);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (i0 + u * stride < count) add(item[u]);
    }
  }
}
constexpr int kFinalizeBatch = 4;

// Coefficients of VEC consecutive channels in one access.
template <int VEC, typename Acc>
__device__ __forceinline__ Vec<Acc, VEC> load_vec(const Acc* p) {
  return *reinterpret_cast<const Vec<Acc, VEC>*>(p);
}

// Grid-stride walk over the N*S*C/VEC vectors of a channels-last tensor:
// calls body(i, n, c) with the vector index, its sample and its first channel.
// Front to back: walking from the end, to find in L2 what the statistics or
// reduce kernel read last, measured mixed on an H200 (-4% to +5%; 7d010a0)
// and was dropped; so was walking each of that kernel's chunks from its end
// (tiles of 1 to 256 rows: 3-15% slower, even on tensors that fit L2) and
// evict-first loads and stores (forward -4% to +3%, backward 0-2% slower;
// results/group_norm_second_pass_order_h200_2026-12-04.txt).
template <int VEC, typename IndexT, typename Body>
__device__ __forceinline__ void for_each_vector(IndexT num_vectors, int S, int C, Body body) {
  const int cv = C / VEC;
  const IndexT stride = dwgn::global_thread_count<IndexT>();
  for (IndexT i = dwgn::global_thread_index<IndexT>(); i < num_vectors;
       i = dwgn::grid_stride_next(i, stride, num_vectors)) {
    const IndexT row = i / cv;
    body(i, static_cast<int>(row / S), static_cast<int>(i - row * cv) * VEC);
  }
}

// The walk of for_each_vector, U vectors per step: load(i) for each of a
// thread's next U vectors (i, i + stride, ...), then finish(i, n, c, loaded)
// for each in the same order, so the U loads are in flight together (a
// plain grid-stride loop issues the next load only after this vector's
// store, which in place may alias it).  Each vector is still read and
// written by one thread.
template <int VEC, int U, typename IndexT, typename Load, typename Finish>
__device__ __forceinline__ void for_each_vector_batched(IndexT num_vectors, int S, int C, Load load, Finish finish) {
  if constexpr (U == 1) {  // the plain loop: the machine code of the kernels before U (checked by SASS)
    for_each_vector<VEC>(num_vectors, S, C, [&](IndexT i, int n, int c) { finish(i, n, c, load(i)); });
    return;
  }
  using Item = decltype(load(IndexT(0)));
  const int cv = C / VEC;
  const IndexT stride = dwgn::global_thread_count<IndexT>();
  for (IndexT i = dwgn::global_thread_index<IndexT>(); i < num_vectors;) {
    IndexT index[U];
    Item item[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      index[u] = i;
      if (i < num_vectors) item[u] = load(i);
      i = dwgn::grid_stride_next(i, stride, num_vectors);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (index[u] < num_vectors) {
        const IndexT row = index[u] / cv;
        finish(index[u], static_cast<int>(row / S), static_cast<int>(index[u] - row * cv) * VEC, item[u]);
      }
    }
  }
}


// A group's sum of squared deviations from its sums about a shift, d = sum(x - shift) and
// dd = sum((x - shift)^2) over count elements: dd - d^2 / count, clamped at 0 against rounding.
// A NaN (the group holds an inf or a NaN) passes the clamp, so that group's rstd and outputs are
// NaN as in PyTorch; fmax(NaN, 0) gave 0, a finite rstd, and -inf / +inf or relu's 0 outputs.
__device__ __forceinline__ double centered_square_sum(double d, double dd, double count) {
  const double m2 = dd - d * (d / count);
  return m2 < 0.0 ? 0.0 : m2;
}

// The forward finalize of one (n, g): the work of one dwgn_gn_fwd_finalize
// block, shared with the one-pass kernel.  partial holds (sum, M2) in double
// per chunk k of rows [k * rows_per_chunk, min(S, (k + 1) * rows_per_chunk)):
// per channel, (N, num_chunks, 2, C), or with `grouped` per group (the
// statistics kernel summed each group's channels: gn::group_partials),
// (N, num_chunks, 2, G), which reads D times less here.  Every thread of the
// block must call it (blockDim.x a multiple of 32, at most 1024); scratch
// holds 64 doubles (block_sum<2>), broadcast 2.
template <typename Acc, typename W>
__device__ __forceinline__ void finalize_group(
    const double* __restrict__ partial, const W* __restrict__ weight, const W* __restrict__ bias,
    Acc* __restrict__ mean_out, Acc* __restrict__ rstd_out, Acc* __restrict__ ws, int n, int g,
    int S, int C, int G, int num_chunks, int rows_per_chunk, bool grouped, Acc eps, double* scratch,
    double* broadcast) {
  const int D = C / G;
  const int c0 = g * D;
  // A piece: one channel's (grouped: one group's D channels') rows of a chunk.
  const int width = grouped ? G : C;               // partial's row
  const int pieces_per_chunk = grouped ? 1 : D;
  const int first = grouped ? g : c0;
  const int piece_channels = grouped ? D : 1;
  const int items = pieces_per_chunk * num_chunks;
  const double* pn = partial + static_cast<long long>(n) * num_chunks * 2 * width;
  // One pass over the pieces, each taken relative to a shift (the first
  // piece's mean): with e_i = sum_i - rows_i * shift, the group's M2 is
  // sum_i (M2_i + e_i^2 / rows_i) - E^2 / count, E = sum_i e_i.  The
  // subtracted term is count * (mean - shift)^2 <= count / rows_0 times the
  // group's M2 (the first piece alone contributes rows_0 * (shift - mean)^2
  // to it), so at most log10(pieces) digits of the double M2 cancel.
  const double shift = pn[first] / (static_cast<double>(min(S, rows_per_chunk)) * piece_channels);
  // Elements of a full chunk's piece and of the last one, and their
  // reciprocals: no double division (a called subroutine) inside the batched loop.
  const double full_rows = static_cast<double>(rows_per_chunk) * piece_channels;
  const double last_rows = static_cast<double>(S - (num_chunks - 1) * rows_per_chunk) * piece_channels;
  const double inv_full = 1.0 / full_rows, inv_last = 1.0 / last_rows;
  struct Piece {
    double sum, m2, rows, inv_rows;
  };
  double acc[2] = {0.0, 0.0};  // E, sum_i (M2_i + e_i^2 / rows_i)
  batched_walk<kFinalizeBatch>(
      threadIdx.x, items, blockDim.x,
      [&](long long i) {
        int chunk;
        const double* p = pn + group_item(static_cast<int>(i), pieces_per_chunk, first, width, chunk);
        const bool last = chunk == num_chunks - 1;
        return Piece{p[0], p[width], last ? last_rows : full_rows, last ? inv_last : inv_full};
      },
      [&](const Piece& piece) {
        const double e = piece.sum - piece.rows * shift;
        acc[0] += e;
        acc[1] += piece.m2 + e * e * piece.inv_rows;
      });
  dwgn::block_sum<2>(acc, scratch);  // the totals are in thread 0
  if (threadIdx.x == 0) {
    const double count = static_cast<double>(S) * D;
    const double mean = shift + acc[0] / count;
    const double var = centered_square_sum(acc[0], acc[1], count) / count;
    const double rstd = 1.0 / sqrt(var + static_cast<double>(eps));
    mean_out[static_cast<long long>(n) * G + g] = static_cast<Acc>(mean);
    rstd_out[static_cast<long long>(n) * G + g] = static_cast<Acc>(rstd);
    broadcast[0] = mean;
    broadcast[1] = rstd;
  }
  __syncthreads();
  const double mean = broadcast[0];
  const Acc rstd = static_cast<Acc>(broadcast[1]);
  const Acc hi = static_cast<Acc>(mean);
  const double lo = mean - static_cast<double>(hi);  // exact
  Acc* wn = ws + static_cast<long long>(n) * 3 * C;
  for (int j = threadIdx.x; j < D; j += blockDim.x) {
    const int c = c0 + j;
    const Acc scale = weight != nullptr ? rstd * to_acc(weight[c]) : rstd;
    const Acc b = bias != nullptr ? to_acc(bias[c]) : Acc(0);
    wn[c] = hi;
    wn[C + c] = scale;
    wn[2 * C + c] = static_cast<Acc>(static_cast<double>(b) - lo * static_cast<double>(scale));
  }
  __syncthreads();  // broadcast is rewritten by the next group
}

// The statistics kernel's per-group summaries of one chunk: the block's
// channels [c_first, c_first + span) hold whole groups of D channels (the
// host picks the columns per block so: _group_norm._stats_split), and channel j's
// (sum, M2) over the chunk's `rows` rows is at sums[j], m2s[j].  Thread q
// sums group q's D channels in channel order (sum) and adds their M2 by the
// parallel-axis theorem about the group mean m, M2 = sum_j (M2_j + (s_j -
// rows m)^2 / rows), every term >= 0; the group's (sum, M2) go to
// group_out[q], group_out[G + q] (the (2, G) slot of this chunk).  Every
// thread of the block must call it (a barrier orders the channels' stores
// before it; the caller's next barrier protects sums and m2s).
__device__ __forceinline__ void group_partials(const double* sums, const double* m2s, int c_first, int span,
                                               int D, int G, double rows, double* group_out) {
  __syncthreads();  // the channels' summaries are in shared memory
  const double inv_rows = 1.0 / rows;
  for (int q = threadIdx.x; q < span / D; q += blockDim.x) {
    const double* s = sums + q * D;
    const double* m = m2s + q * D;
    double total = 0.0;
#pragma unroll 4
    for (int j = 0; j < D; ++j) total += s[j];
    const double rows_times_mean = total / D;  // rows * the group mean: a channel's sum at the mean
    double m2 = 0.0;
#pragma unroll 4
    for (int j = 0; j < D; ++j) {
      const double e = s[j] - rows_times_mean;
      m2 += m[j] + e * e * inv_rows;
    }
    const int g = c_first / D + q;
    group_out[g] = total;
    group_out[G + g] = m2;
  }
}

// y = act((x - hi) * scale_c + offset_c) for vector i (sample n, first
// channel c), ws (N, 3, C) as finalize_group writes it, `in` the vector of
// x already loaded.  Shared by dwgn_gn_fwd_apply (gn::for_each_vector_batched)
// and, through apply_vector, the one-pass kernel.
template <typename T, int ACT, int VEC, typename IndexT>
__device__ __forceinline__ void apply_loaded(const Vec<T, VEC>& in, const typename AccType<T>::type* __restrict__ ws,
                                             T* y, IndexT i, int n, int C, int c) {
  using Acc = typename AccType<T>::type;
  using V = Vec<T, VEC>;
  const Acc* wn = ws + static_cast<long long>(n) * 3 * C + c;
  // VEC coefficients per load (c and C are multiples of VEC): scalar
  // loads of channels 32 bytes apart cost the L1 8 wavefronts each.
  const auto hi = load_vec<VEC>(wn);
  const auto scale = load_vec<VEC>(wn + C);
  const auto offset = load_vec<VEC>(wn + 2 * C);
  V out;
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    const Acc z = (to_acc(in.v[k]) - hi.v[k]) * scale.v[k] + offset.v[k];
    out.v[k] = from_acc<T>(activation<ACT, fast_activation<T>()>(z));
  }
  reinterpret_cast<V*>(y)[i] = out;
}
template <typename T, int ACT, int VEC, typename IndexT>
__device__ __forceinline__ void apply_vector(const T* x, const typename AccType<T>::type* __restrict__ ws,
                                             T* y, IndexT i, int n, int C, int c) {
  apply_loaded<T, ACT, VEC>(reinterpret_cast<const Vec<T, VEC>*>(x)[i], ws, y, i, n, C, c);
}

}  // namespace gn

// ---------------------------------------------------------------------------
// The column kernels and dwgn_gn_bwd_dx carry no __launch_bounds__(256): with
// it ptxas (CUDA 13, sm_80/sm_90) squeezed dwgn_gn_bwd_reduce to 32 registers
// and dwgn_gn_bwd_dx<bfloat16, silu, 8, long long> (before its U) to 64, and both spilled.

// Forward pass 1: per (n, chunk of rows, c) summaries: the sum of x in
// double (so the mean keeps every digit, even at 1000 + randn in float32)
// and M2 from a Welford update in Acc (no E[x^2] - E[x]^2 cancellation, an
// outlier anywhere included); lanes are combined in double (gn::combine_lanes).
// A thread reads VEC channels per access (16 bytes on the vector path, one
// element on the scalar path, which the host takes for misaligned tensors
// and C not a multiple of the vector): the block's columns are channel
// vectors, so on the vector path C = 320 fp16 is 40 columns x 6 lanes of
// one block (the element path makes it 2 blocks of 160 columns with one
// lane each).  Items (gn::ColumnItems): (chunk, n, column block of `cols`
// of the C / VEC columns); block 256.  partial: (N, num_chunks, 2, C)
// double (sum, M2), or with `grouped` (N, num_chunks, 2, G): each block
// holds whole groups and sums their channels (gn::group_partials).
//
// With finalize != 0 (a cooperative launch: every block resident) the
// kernel also does forward pass 2 after a grid barrier: items (n, g), the
// code of dwgn_gn_fwd_finalize (gn::finalize_group), so the forward takes
// two launches.  partial is written before the barrier and read after it
// (dwgn::grid_barrier fences memory; no SM read it earlier in this kernel,
// so no cached copy can be stale), as in the one-pass kernels.  barrier: the
// workspace's grid-barrier word (_workspace.GRID_BARRIER).  With finalize == 0
// (any launch) mean_out, rstd_out, ws, weight and bias are not touched and
// dwgn_gn_fwd_finalize follows.
template <typename T, typename W, int VEC, typename IndexT>
__global__ void dwgn_gn_stats(const T* __restrict__ x, double* __restrict__ partial,
                              const W* __restrict__ weight, const W* __restrict__ bias,
                              typename AccType<T>::type* __restrict__ mean_out,
                              typename AccType<T>::type* __restrict__ rstd_out,
                              typename AccType<T>::type* __restrict__ ws, unsigned int* __restrict__ barrier,
                              int N, int S, int C, int G, int num_chunks, int rows_per_chunk, int cols,
                              int grouped, typename AccType<T>::type eps, int finalize) {
  using V = gn::Vec<T, VEC>;
  constexpr int RB = gn::row_batch<VEC>();
  using Acc = typename AccType<T>::type;
  // The lanes' summaries (gn::store_lane); after the last item, the
  // finalize's scratch (64 doubles + broadcast 2).  On the 16-byte vector
  // path of the 2-byte types the same memory first holds the rows in flight
  // (LaneWelford::walk_staged: kStagedBatches * RB slots of 16 bytes per
  // thread, a block of at most 256).
  constexpr bool kStaged = sizeof(V) == 16 && VEC == 8;  // float (8 rows a batch) keeps walk: its ring would pass 48 KB
  constexpr int kLaneBytes = 256 * VEC * (sizeof(double) + sizeof(Acc));
  constexpr int kRingBytes = kStaged ? gn::kStagedBatches * RB * 256 * 16 : 0;
  __shared__ __align__(16) unsigned char lane_scratch[kLaneBytes > kRingBytes ? kLaneBytes : kRingBytes];
  double* const lane_sum = reinterpret_cast<double*>(lane_scratch);
  Acc* const lane_m2 = reinterpret_cast<Acc*>(lane_scratch + 256 * VEC * sizeof(double));
  // With grouped: the block's channel summaries of one chunk, at most
  // kMaxSpan channels (64 vector columns of 8, or 256 elements: _stats_split).
  constexpr int kMaxSpan = 512;
  __shared__ double channel_stats[2 * kMaxSpan];  // sums, then M2s
  const int width = C / VEC;  // channel vectors per row
  const gn::ColumnItems items(num_chunks, N, width, cols);
  for (int item = blockIdx.x; item < items.count; item += gridDim.x) {
    int chunk, n, column_block;
    items.decode(item, chunk, n, column_block);
    const gn::ColumnLayout L = gn::ColumnLayout::channels(width, column_block, cols);
    const gn::ChunkRows R(S, rows_per_chunk, num_chunks, chunk, L);
    gn::LaneWelford<T, VEC> lane;
    if (R.lane_count > 0) {
      // This lane's rows: R.row0 + L.lane + k * L.lanes (formed only when the
      // first exists, so the offset stays below N*S*C).
      const V* column = reinterpret_cast<const V*>(x) + (static_cast<IndexT>(n) * S + R.row0 + L.lane) * width + L.c;
      if constexpr (kStaged) {
        lane.template walk_staged<RB>(column, static_cast<IndexT>(L.lanes) * width, R.lane_count,
                                      reinterpret_cast<uint4*>(lane_scratch) + threadIdx.x, blockDim.x);
      } else {
        lane.template walk<RB>(column, static_cast<IndexT>(L.lanes) * width, R.lane_count);
      }
    }
    if constexpr (kStaged) __syncthreads();  // every ring slot read before the lane slots overwrite them
    const int first = column_block * L.cols;  // the block's first column
    const int span = VEC * min(L.cols, width - first);
    gn::store_lane<VEC>(lane_sum, span, L, lane.sum);
    gn::store_lane<VEC>(lane_m2, span, L, lane.m2);
    __syncthreads();
    double* p = grouped ? channel_stats : R.slot(partial, n, C, first * VEC);
    const int stride = grouped ? kMaxSpan : C;
    const gn::LaneSplit split(R.row0, R.row1, L.lanes);
    for (int j = threadIdx.x; j < span; j += blockDim.x) {
      double total, m2;
      gn::combine_lanes(lane_sum + j, lane_m2 + j, span, split, total, m2);
      p[j] = total;
      p[stride + j] = m2;
    }
    if (grouped) {  // block-uniform
      gn::group_partials(channel_stats, channel_stats + kMaxSpan, first * VEC, span, C / G, G, R.row1 - R.row0,
                         R.slot(partial, n, G, 0));
    }
    __syncthreads();  // the slots are rewritten by the next item
  }
  if (finalize == 0) return;  // grid-uniform
  dwgn::grid_barrier(barrier);
  // dwgn_gn_fwd_apply (launched programmatically where _group_norm.py says
  // so) may start placing its blocks while N * G blocks finalize; it waits
  // for this grid before touching memory.
  dwgn::allow_dependent_grid();
  const long long groups = static_cast<long long>(N) * G;
  for (long long item = blockIdx.x; item < groups; item += gridDim.x) {
    const int n = static_cast<int>(item / G);
    gn::finalize_group(static_cast<const double*>(partial), weight, bias, mean_out, rstd_out, ws, n,
                       static_cast<int>(item - static_cast<long long>(n) * G), S, C, G, num_chunks,
                       rows_per_chunk, grouped != 0, eps, lane_sum, lane_sum + 64);
  }
}

// Forward pass 2 on a device without cooperative launches: one block per
// (g, n), gn::finalize_group (in double): mean/rstd (N, G) in Acc and the
// per-(n, c) coefficients ws (N, 3, C): hi = the group mean rounded to Acc,
// scale_c = rstd * w[c] and offset_c = b[c] - (mean - hi) * scale_c, so that
// y = (x - hi) * scale_c + offset_c keeps the digits of the mean that Acc
// cannot hold.
// grid (G, min(N, 65535)); block a multiple of 32, <= 512 (the host sizes
// it to the D * num_chunks pieces: a 32-block grid for N = 1, G = 32 is
// latency-bound, so each block needs many threads).
template <typename Acc, typename W>
__global__ void __launch_bounds__(512) dwgn_gn_fwd_finalize(
    const double* __restrict__ partial, const W* __restrict__ weight, const W* __restrict__ bias,
    Acc* __restrict__ mean_out, Acc* __restrict__ rstd_out, Acc* __restrict__ ws, int N, int S,
    int C, int G, int num_chunks, int rows_per_chunk, int grouped, Acc eps) {
  __shared__ double scratch[64];
  __shared__ double broadcast[2];
  for (int n = blockIdx.y; n < N; n = dwgn::grid_stride_next(n, static_cast<int>(gridDim.y), N)) {
    gn::finalize_group(partial, weight, bias, mean_out, rstd_out, ws, n, blockIdx.x, S, C, G,
                       num_chunks, rows_per_chunk, grouped != 0, eps, scratch, broadcast);
  }
}

// Forward pass 3: y = act((x - mean) * scale_c + b_c), VEC channels
// per thread and access; grid-stride over the N*S*C/VEC vectors.  x and y
// may be the same array (in place: each element is read, then written, by
// one thread), so neither is __restrict__.
// U vectors a thread per step (gn::for_each_vector_batched; the host's rule
// and grid: _group_norm._elementwise_vectors).
template <typename T, int ACT, int VEC, typename IndexT, int U>
__global__ void __launch_bounds__(256) dwgn_gn_fwd_apply(
    const T* x, const typename AccType<T>::type* __restrict__ ws, T* y,
    IndexT num_vectors, int S, int C) {
  dwgn::wait_for_prior_grid();  // ws (and, in place, x) belong to the statistics kernel until it completes
  using V = gn::Vec<T, VEC>;
  gn::for_each_vector_batched<VEC, U>(
      num_vectors, S, C, [&](IndexT i) { return reinterpret_cast<const V*>(x)[i]; },
      [&](IndexT i, int n, int c, const V& in) { gn::apply_loaded<T, ACT, VEC>(in, ws, y, i, n, C, c); });
}

// ---------------------------------------------------------------------------
namespace gn {
// The backward reduce loads two vectors per row (x, grad_out) and keeps six
// per-channel values per vector lane (mean, rstd, scale, bias, two sums):
// few rows per batch keep it within 128 registers (2 blocks of 256 per SM)
// without spills; float64 (twice the registers per value, and its erf/exp)
// takes 1 block per SM and 2 rows.  dwgn_gn_bwd_reduce and the one-pass
// backward both take these bounds.
template <typename T, int VEC>
constexpr int bwd_row_batch() { return sizeof(T) == 8 ? 2 : VEC >= 8 ? 2 : 4; }
template <typename T>
constexpr int bwd_min_blocks() { return sizeof(T) == 8 ? 1 : 2; }

// One lane's backward sums of VEC channels of sample n: A = sum dz and B =
// sum dz * xhat, with xhat = (x - mean) * rstd, z = (x - mean) * (rstd * w)
// + b (the arithmetic of gn::dx_vector, so both see the same act'(z)) and
// dz = grad_out * act'(z).  A vector's channels may lie in different groups
// (D < VEC), so mean and rstd are per channel.  Shared by dwgn_gn_bwd_reduce
// and the one-pass backward.
template <typename T, int ACT, int VEC>
struct BwdLane {
  using Acc = typename AccType<T>::type;
  using V = Vec<T, VEC>;
  Acc a[VEC], b_sum[VEC];
  Acc m[VEC], r[VEC], scale[VEC], b[VEC];
  __device__ __forceinline__ BwdLane() {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      a[k] = Acc(0);
      b_sum[k] = Acc(0);
    }
  }
  // The coefficients of channels c_first .. c_first + VEC - 1 of sample n.
  template <typename W>
  __device__ __forceinline__ void load(const Acc* __restrict__ mean, const Acc* __restrict__ rstd,
                                       const W* __restrict__ weight, const W* __restrict__ bias, int n,
                                       int G, int D, int c_first) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const int c = c_first + k;
      const long long stat = static_cast<long long>(n) * G + c / D;
      m[k] = mean[stat];
      r[k] = rstd[stat];
      scale[k] = weight != nullptr ? r[k] * to_acc(weight[c]) : r[k];
      b[k] = bias != nullptr ? to_acc(bias[c]) : Acc(0);
    }
  }
  __device__ __forceinline__ void add(const V& xv, const V& dyv) {
    V dz = dyv;
    add_keeping_dz(xv, dz);
  }
  // add, leaving dz in dyv (exact where T is Acc: float, double).
  __device__ __forceinline__ void add_keeping_dz(const V& xv, V& dyv) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const Acc centered = to_acc(xv.v[k]) - m[k];
      Acc dz = to_acc(dyv.v[k]);
      if (ACT != kIdentity) dz *= activation_grad<ACT, fast_activation<T>()>(centered * scale[k] + b[k]);
      a[k] += dz;
      b_sum[k] += dz * (centered * r[k]);
      dyv.v[k] = from_acc<T>(dz);
    }
  }
  // The lane's `count` rows, row k at x_column[k * row_step] (and
  // dy_column's), RB rows per batch with all their loads in flight together.
  template <int RB, typename IndexT>
  __device__ __forceinline__ void walk(const V* x_column, const V* dy_column, IndexT row_step, int count) {
    walk_lane_rows<RB>(
        count,
        [&](int k0) {
          V xv[RB], dyv[RB];
#pragma unroll
          for (int q = 0; q < RB; ++q) {
            xv[q] = x_column[(k0 + q) * row_step];
            dyv[q] = dy_column[(k0 + q) * row_step];
          }
#pragma unroll
          for (int q = 0; q < RB; ++q) add(xv[q], dyv[q]);
        },
        [&](int k0, int rest) {
          V xv[RB], dyv[RB];
#pragma unroll
          for (int q = 0; q < RB; ++q) {
            if (q < rest) {
              xv[q] = x_column[(k0 + q) * row_step];
              dyv[q] = dy_column[(k0 + q) * row_step];
            }
          }
#pragma unroll
          for (int q = 0; q < RB; ++q) {
            if (q < rest) add(xv[q], dyv[q]);
          }
        });
  }
  // walk through walk_lane_rows_staged (the 2-byte types' 16-byte vectors):
  // the same rows in the same order, so the same sums, bit for bit.
  template <int RB, typename IndexT>
  __device__ __forceinline__ void walk_staged(const V* x_column, const V* dy_column, IndexT row_step, int count,
                                              uint4* ring, int slot_stride) {
    const V* const columns[2] = {x_column, dy_column};
    walk_lane_rows_staged<RB>(
        columns, row_step, count, ring, slot_stride,
        [&](int, const V (&v)[2][RB]) {
#pragma unroll
          for (int q = 0; q < RB; ++q) add(v[0][q], v[1][q]);
        },
        [&](int, int rest, const V (&v)[2][RB]) {
#pragma unroll
          for (int q = 0; q < RB; ++q) {
            if (q < rest) add(v[0][q], v[1][q]);
          }
        });
  }
};
}  // namespace gn

// Backward pass 2, the work of one (g, y) item.  y < N: for sample n = y,
// with A_c = sum dz and B_c = sum dz*xhat (over the chunks), c1 = sum_c w_c
// A_c / (S D) and c2 = sum_c w_c B_c / (S D), summed by the whole block over
// the D * num_chunks (chunk, channel) pieces; writes ws (N, 5, C): mean,
// scale_c = rstd * w_c, b_c, rstd * c1 and rstd^2 * c2 for every channel of
// the group.  y == N: the weight/bias gradients of the group's channels,
// dw_c = sum B, db_c = sum A over the N * num_chunks rows of partial, one
// column per channel (each written only when its pointer is not null).
// Every thread of the block calls it (blockDim.x a multiple of 32, <= 256);
// scratch holds 2 * 256 Acc (column_sum needs 2 * blockDim.x, block_sum
// 2 * 32), broadcast 2.  Shared by dwgn_gn_bwd_finalize and the one-pass
// backward.
namespace gn {
template <typename Acc, typename W>
__device__ __forceinline__ void bwd_finalize_item(
    const Acc* __restrict__ partial, const Acc* __restrict__ mean, const Acc* __restrict__ rstd,
    const W* __restrict__ weight, const W* __restrict__ bias, Acc* __restrict__ ws,
    W* __restrict__ grad_weight, W* __restrict__ grad_bias, int N, int S, int C, int G,
    int num_chunks, int g, long long y, Acc* scratch, Acc* broadcast) {
  const int D = C / G;
  const int c0 = g * D;
  const int items = D * num_chunks;
  struct Sums {  // one (chunk, channel) piece of partial
    Acc dz, dz_xhat;
  };
  struct WeightedSums {
    Acc w;
    Sums sums;
  };
  if (y == N) {  // block-uniform branch
    if (grad_weight == nullptr && grad_bias == nullptr) return;
    // Rows of partial are (n, chunk) pairs, N * num_chunks <= max(N, 2048) of them.
    const int rows = N * num_chunks;
    for (int j0 = 0; j0 < D; j0 += blockDim.x) {  // the same trip count in every thread
      const ColumnLayout L(D - j0, c0 + j0, c0 + D);
      Acc v[2] = {Acc(0), Acc(0)};
      if (L.valid) {
        batched_walk<kFinalizeBatch>(
            L.lane, rows, L.lanes,
            [&](long long r) {
              const Acc* p = partial + r * 2 * C + L.c;
              return Sums{p[0], p[C]};
            },
            [&](const Sums& piece) {
              v[0] += piece.dz;
              v[1] += piece.dz_xhat;
            });
      }
      column_sum<2>(v, L, scratch);
      if (L.valid && L.lane == 0) {
        if (grad_weight != nullptr) grad_weight[L.c] = from_acc<W>(v[1]);
        if (grad_bias != nullptr) grad_bias[L.c] = from_acc<W>(v[0]);
      }
    }
    return;
  }
  const int n = static_cast<int>(y);
  const Acc* pn = partial + static_cast<long long>(n) * num_chunks * 2 * C;
  Acc v[2] = {Acc(0), Acc(0)};
  batched_walk<kFinalizeBatch>(
      threadIdx.x, items, blockDim.x,
      [&](long long i) {
        int chunk;
        const int offset = group_item(static_cast<int>(i), D, c0, C, chunk);
        const int c = c0 + (static_cast<int>(i) - chunk * D);
        return WeightedSums{weight != nullptr ? to_acc(weight[c]) : Acc(1), {pn[offset], pn[offset + C]}};
      },
      [&](const WeightedSums& piece) {
        v[0] += piece.w * piece.sums.dz;
        v[1] += piece.w * piece.sums.dz_xhat;
      });
  dwgn::block_sum<2>(v, scratch);
  const Acc m = mean[static_cast<long long>(n) * G + g];
  const Acc r = rstd[static_cast<long long>(n) * G + g];
  if (threadIdx.x == 0) {
    const Acc inv_count = Acc(1) / (Acc(S) * Acc(D));
    broadcast[0] = r * v[0] * inv_count;
    broadcast[1] = r * (r * v[1] * inv_count);
  }
  __syncthreads();
  const Acc k1 = broadcast[0];
  const Acc k2 = broadcast[1];
  Acc* wn = ws + static_cast<long long>(n) * 5 * C;
  for (int j = threadIdx.x; j < D; j += blockDim.x) {
    const int c = c0 + j;
    wn[c] = m;
    wn[C + c] = weight != nullptr ? r * to_acc(weight[c]) : r;
    wn[2 * C + c] = bias != nullptr ? to_acc(bias[c]) : Acc(0);
    wn[3 * C + c] = k1;
    wn[4 * C + c] = k2;
  }
  __syncthreads();  // broadcast is rewritten by the next item
}

// x's and grad_out's vector i, loaded together (gn::dx_loaded).
template <typename T, int VEC>
struct XAndGrad {
  Vec<T, VEC> x, grad_out;
};
template <typename T, int VEC, typename IndexT>
__device__ __forceinline__ XAndGrad<T, VEC> load_x_and_grad(const T* x, const T* grad_out, IndexT i) {
  return {reinterpret_cast<const Vec<T, VEC>*>(x)[i], reinterpret_cast<const Vec<T, VEC>*>(grad_out)[i]};
}
// Backward pass 3 for vector i (sample n, first channel c): grad_in =
// scale_c * dz - rstd*c1 - (x - mean) * rstd^2*c2 (xhat * rstd*c2 with xhat =
// (x - mean) * rstd), ws (N, 5, C) as bwd_finalize_item writes it.  Shared
// by dwgn_gn_bwd_dx (vectors loaded ahead: gn::for_each_vector_batched) and,
// through dx_vector, the one-pass backward.
template <typename T, int ACT, int VEC, typename IndexT>
__device__ __forceinline__ void dx_loaded(const XAndGrad<T, VEC>& in, const typename AccType<T>::type* __restrict__ ws,
                                          T* grad_in, IndexT i, int n, int C, int c) {
  using Acc = typename AccType<T>::type;
  using V = Vec<T, VEC>;
  const Acc* wn = ws + static_cast<long long>(n) * 5 * C + c;
  const V& xv = in.x;
  const V& dyv = in.grad_out;
  // VEC coefficients per load, as in dwgn_gn_fwd_apply.
  const auto m = load_vec<VEC>(wn);
  const auto scale = load_vec<VEC>(wn + C);
  const auto b = load_vec<VEC>(wn + 2 * C);  // dead (and dropped) for identity
  const auto k1 = load_vec<VEC>(wn + 3 * C);
  const auto k2 = load_vec<VEC>(wn + 4 * C);
  V out;
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    const Acc centered = to_acc(xv.v[k]) - m.v[k];
    Acc dz = to_acc(dyv.v[k]);
    if (ACT != kIdentity) {
      dz *= activation_grad<ACT, fast_activation<T>()>(centered * scale.v[k] + b.v[k]);
    }
    out.v[k] = from_acc<T>(scale.v[k] * dz - k1.v[k] - centered * k2.v[k]);
  }
  reinterpret_cast<V*>(grad_in)[i] = out;
}
template <typename T, int ACT, int VEC, typename IndexT>
__device__ __forceinline__ void dx_vector(const T* grad_out, const T* x,
                                          const typename AccType<T>::type* __restrict__ ws, T* grad_in,
                                          IndexT i, int n, int C, int c) {
  dx_loaded<T, ACT, VEC>(load_x_and_grad<T, VEC>(x, grad_out, i), ws, grad_in, i, n, C, c);
}
}  // namespace gn

// Backward pass 1: per (n, chunk, c) sums of dz and dz * xhat (gn::BwdLane),
// VEC channels per thread and access.
// Items and thread layout as in dwgn_gn_stats.
// partial: (N, num_chunks, 2, C) Acc.
// Bounds and rows per batch: gn::bwd_row_batch.
// With finalize != 0 (a cooperative launch) the kernel also does backward
// pass 2 after a grid barrier: items (g, y), G * (N + 1) of them, the code
// of dwgn_gn_bwd_finalize (gn::bwd_finalize_item), so the backward takes two
// launches (partial written before the barrier, read after it, as in
// dwgn_gn_stats).  With finalize == 0, ws, grad_weight and grad_bias are not
// touched and dwgn_gn_bwd_finalize follows.
template <typename T, typename W, int ACT, int VEC, typename IndexT>
__global__ void __launch_bounds__(256, gn::bwd_min_blocks<T>()) dwgn_gn_bwd_reduce(
    const T* __restrict__ grad_out, const T* __restrict__ x,
    const typename AccType<T>::type* __restrict__ mean,
    const typename AccType<T>::type* __restrict__ rstd, const W* __restrict__ weight,
    const W* __restrict__ bias, typename AccType<T>::type* __restrict__ partial,
    typename AccType<T>::type* __restrict__ ws, W* __restrict__ grad_weight, W* __restrict__ grad_bias,
    unsigned int* __restrict__ barrier, int N, int S, int C, int G, int num_chunks, int rows_per_chunk, int cols,
    int finalize) {
  using Acc = typename AccType<T>::type;
  using V = gn::Vec<T, VEC>;
  constexpr int RB = gn::bwd_row_batch<T, VEC>();
  // The lanes' sums (gn::store_lane); after the last item, the finalize's
  // scratch (2 * 256 Acc) and broadcast (2).  For the 2-byte types on the
  // 16-byte vector path the same memory first holds the rows in flight
  // (BwdLane::walk_staged; float's 4-row batches would need 64 KB).
  constexpr bool kStaged = sizeof(V) == 16 && VEC == 8;
  constexpr int kLaneA = 256 * (VEC < 2 ? 2 : VEC);
  constexpr int kLaneBytes = (kLaneA + 256 * VEC) * sizeof(Acc);
  constexpr int kRingBytes = kStaged ? gn::kStagedBatches * RB * 2 * 256 * 16 : 0;
  __shared__ __align__(16) unsigned char lane_scratch[kLaneBytes > kRingBytes ? kLaneBytes : kRingBytes];
  Acc* const lane_a = reinterpret_cast<Acc*>(lane_scratch);
  Acc* const lane_b = lane_a + kLaneA;
  const int width = C / VEC;  // channel vectors per row
  const gn::ColumnItems items(num_chunks, N, width, cols);
  for (int item = blockIdx.x; item < items.count; item += gridDim.x) {
    int chunk, n, column_block;
    items.decode(item, chunk, n, column_block);
    const gn::ColumnLayout L = gn::ColumnLayout::channels(width, column_block, cols);
    const gn::ChunkRows R(S, rows_per_chunk, num_chunks, chunk, L);
    gn::BwdLane<T, ACT, VEC> lane;
    if (R.lane_count > 0) {
      lane.load(mean, rstd, weight, bias, n, G, C / G, L.c * VEC);
      // This lane's rows: R.row0 + L.lane + k * L.lanes (in vectors).
      const IndexT first = (static_cast<IndexT>(n) * S + R.row0 + L.lane) * width + L.c;
      if constexpr (kStaged) {
        lane.template walk_staged<RB>(reinterpret_cast<const V*>(x) + first,
                                      reinterpret_cast<const V*>(grad_out) + first,
                                      static_cast<IndexT>(L.lanes) * width, R.lane_count,
                                      reinterpret_cast<uint4*>(lane_scratch) + threadIdx.x, blockDim.x);
      } else {
        lane.template walk<RB>(reinterpret_cast<const V*>(x) + first, reinterpret_cast<const V*>(grad_out) + first,
                               static_cast<IndexT>(L.lanes) * width, R.lane_count);
      }
    }
    if constexpr (kStaged) __syncthreads();  // every ring slot read before the lane slots overwrite them
    const int first = column_block * L.cols;  // the block's first column
    const int span = VEC * min(L.cols, width - first);
    gn::store_lane<VEC>(lane_a, span, L, lane.a);
    gn::store_lane<VEC>(lane_b, span, L, lane.b_sum);
    __syncthreads();
    Acc* p = R.slot(partial, n, C, first * VEC);
    for (int j = threadIdx.x; j < span; j += blockDim.x) {
      p[j] = gn::sum_lanes(lane_a + j, span, L.lanes);
      p[C + j] = gn::sum_lanes(lane_b + j, span, L.lanes);
    }
    __syncthreads();  // the slots are rewritten by the next item
  }
  if (finalize == 0) return;  // grid-uniform
  dwgn::grid_barrier(barrier);
  dwgn::allow_dependent_grid();  // dwgn_gn_bwd_dx may be placed now (as in dwgn_gn_stats)
  const long long finalize_items = static_cast<long long>(G) * (N + 1LL);
  for (long long item = blockIdx.x; item < finalize_items; item += gridDim.x) {
    const long long y = item / G;
    gn::bwd_finalize_item(static_cast<const Acc*>(partial), mean, rstd, weight, bias, ws, grad_weight,
                          grad_bias, N, S, C, G, num_chunks, static_cast<int>(item - y * G), y, lane_a,
                          lane_b);
  }
}

// Backward pass 2: one block per (g, y) item of gn::bwd_finalize_item.
// grid (G, min(N + 1, 65535)); block a multiple of 32, <= 256.
template <typename Acc, typename W>
__global__ void dwgn_gn_bwd_finalize(
    const Acc* __restrict__ partial, const Acc* __restrict__ mean, const Acc* __restrict__ rstd,
    const W* __restrict__ weight, const W* __restrict__ bias, Acc* __restrict__ ws,
    W* __restrict__ grad_weight, W* __restrict__ grad_bias, int N, int S, int C, int G,
    int num_chunks) {
  __shared__ Acc scratch[2 * 256];
  __shared__ Acc broadcast[2];
  // y runs to N inclusive: a long long counter cannot wrap even for N = INT_MAX.
  for (long long y = blockIdx.y; y <= N; y += gridDim.y) {
    gn::bwd_finalize_item(partial, mean, rstd, weight, bias, ws, grad_weight, grad_bias, N, S, C, G,
                          num_chunks, static_cast<int>(blockIdx.x), y, scratch, broadcast);
  }
}

// Backward pass 3 (gn::dx_loaded over every vector), U vectors a thread per
// step as in dwgn_gn_fwd_apply.
template <typename T, int ACT, int VEC, typename IndexT, int U>
__global__ void dwgn_gn_bwd_dx(
    const T* __restrict__ grad_out, const T* __restrict__ x,
    const typename AccType<T>::type* __restrict__ ws, T* __restrict__ grad_in,
    IndexT num_vectors, int S, int C) {
  dwgn::wait_for_prior_grid();  // ws is the reduce kernel's until it completes
  gn::for_each_vector_batched<VEC, U>(
      num_vectors, S, C, [&](IndexT i) { return gn::load_x_and_grad<T, VEC>(x, grad_out, i); },
      [&](IndexT i, int n, int c, const gn::XAndGrad<T, VEC>& in) {
        gn::dx_loaded<T, ACT, VEC>(in, ws, grad_in, i, n, C, c);
      });
}

// ---------------------------------------------------------------------------
// One-pass forward (one cooperative launch): the three forward passes above
// in one persistent kernel, separated by two grid-wide barriers
// (dwgn::grid_barrier; the launch must be cooperative, so every block is
// resident).  Host rule and grid size: _group_norm.py
// (_onepass_plan).
//
//   phase 1  items (n, chunk), N * num_chunks of them, blocks stride over
//            them.  A block covers rows [chunk * rows_per_chunk, ...) of
//            sample n and all C channels: cols = C / VEC threads across a
//            row (one 16-byte vector each), lanes = blockDim.x / cols rows at
//            a time (row0 + lane + k * lanes, as in dwgn_gn_stats).
//            Each thread keeps, per channel of its vector, the double sum of
//            x and a Welford M2 built batch by batch (kRowBatch rows, one
//            Chan merge per batch: the arithmetic of dwgn_gn_stats).
//            The lanes are then combined in shared memory, one thread per
//            channel, lane 0 to lanes - 1 in order, by the parallel-axis
//            theorem: sum = sum_j s_j, M2 = sum_j M2_j + (s_j - n_j m)^2 / n_j
//            with m = sum / rows (every term >= 0).  Writes partial (N,
//            num_chunks, 2, C) double, the layout dwgn_gn_fwd_finalize reads.
//   barrier
//   phase 2  items (n, g), N * G of them: gn::finalize_group (the very code
//            of dwgn_gn_fwd_finalize): mean/rstd and the coefficients ws.
//   barrier
//   phase 3  y = act((x - hi) * scale_c + offset_c) over every vector,
//            grid-stride (gn::apply_vector, the code of dwgn_gn_fwd_apply);
//            x is read again (from L2 for tensors that fit it).
//
// Determinism: the work split (num_chunks, rows_per_chunk, blockDim.x)
// depends on the shape only; the grid size (from the occupancy, so per
// device) only decides which block does which item, never the order of any
// sum.  So the results do not depend on the grid size.
// x and y may be the same array: phase 3 starts after every read of phase 1.
// blockDim.x: a multiple of 32, cols * lanes <= blockDim.x <= 512 and
// lanes * C <= kOnePassSlots (the shared lane summaries).
namespace gn {
constexpr int kOnePassSlots = 2048;
// Largest block of the one-pass kernel (its __launch_bounds__): lanes * C <=
// kOnePassSlots and cols * lanes <= blockDim.x give blockDim.x <= 2048 / VEC.
template <int VEC>
constexpr int onepass_max_block() { return kOnePassSlots / VEC < 512 ? kOnePassSlots / VEC : 512; }
// A one-pass block's threads over rows of C channels: cols = C / VEC
// threads across a row (one VEC-vector each, first channel c_first), lanes
// = blockDim.x / cols rows at a time; threads past cols * lanes idle in
// phase 1 (lane >= lanes) but reach every barrier.
struct OnePassRows {
  int cols, lanes, lane, c_first;
  __device__ __forceinline__ OnePassRows(int C, int vec) {
    cols = C / vec;
    lanes = blockDim.x / cols;
    lane = threadIdx.x / cols;
    c_first = (threadIdx.x % cols) * vec;
  }
};
// Phase 1's two per-channel results of this thread into the shared lane
// slots (lane * C + channel), then a barrier: the block combines the lanes next.
template <int VEC, typename A, typename B>
__device__ __forceinline__ void store_lanes(A* first, B* second, const A (&a)[VEC], const B (&b)[VEC],
                                            const OnePassRows& L, int C) {
  if (L.lane < L.lanes) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      first[L.lane * C + L.c_first + k] = a[k];
      second[L.lane * C + L.c_first + k] = b[k];
    }
  }
  __syncthreads();
}
// Phase-1 item (n, chunk): rows [row0, row1) of sample n, and how many of
// them this thread's lane takes (row0 + lane + k * lanes).
struct OnePassItem {
  int n, row0, row1, count;
  __device__ __forceinline__ OnePassItem(int item, int num_chunks, int rows_per_chunk, int S,
                                         const OnePassRows& L) {
    n = item / num_chunks;
    row0 = (item - n * num_chunks) * rows_per_chunk;
    row1 = S - row0 > rows_per_chunk ? row0 + rows_per_chunk : S;  // row0 < S; row0 + rows_per_chunk may pass 2**31
    count = L.lane < L.lanes ? lane_rows(row0, row1, L.lane, L.lanes) : 0;
  }
};
}

template <typename T, typename W, int ACT, int VEC, typename IndexT>
__global__ void __launch_bounds__(gn::onepass_max_block<VEC>()) dwgn_gn_fwd_onepass(
    const T* x, double* __restrict__ partial, const W* __restrict__ weight,
    const W* __restrict__ bias, typename AccType<T>::type* __restrict__ mean_out,
    typename AccType<T>::type* __restrict__ rstd_out, typename AccType<T>::type* __restrict__ ws,
    T* y, unsigned int* __restrict__ barrier, int N, int S, int C, int G, int num_chunks, int rows_per_chunk,
    typename AccType<T>::type eps) {
  using Acc = typename AccType<T>::type;
  using V = gn::Vec<T, VEC>;
  constexpr int RB = gn::row_batch<VEC>();
  __shared__ double lane_sum[gn::kOnePassSlots];
  __shared__ Acc lane_m2[gn::kOnePassSlots];
  __shared__ double scratch[64];
  __shared__ double broadcast[2];

  // ---- phase 1: per (n, chunk, c) sum and M2.
  const gn::OnePassRows rows_of(C, VEC);
  const int cols = rows_of.cols, lanes = rows_of.lanes, lane = rows_of.lane, c_first = rows_of.c_first;
  for (int item = blockIdx.x; item < N * num_chunks; item += gridDim.x) {  // host: no overflow
    const gn::OnePassItem it(item, num_chunks, rows_per_chunk, S, rows_of);
    const int n = it.n, row0 = it.row0, row1 = it.row1, count = it.count;
    gn::LaneWelford<T, VEC> stats;
    if (count > 0) {
      // This lane's rows (formed only when the first exists).
      const V* column = reinterpret_cast<const V*>(
          x + (static_cast<IndexT>(n) * S + row0 + lane) * C + c_first);
      stats.template walk<RB>(column, static_cast<IndexT>(lanes) * cols, count);  // row step in vectors
    }
    gn::store_lanes<VEC>(lane_sum, lane_m2, stats.sum, stats.m2, rows_of, C);
    double* p = partial + static_cast<long long>(item) * 2 * C;
    const gn::LaneSplit split(row0, row1, lanes);
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      double total, piece_m2;
      gn::combine_lanes(lane_sum + c, lane_m2 + c, C, split, total, piece_m2);
      p[c] = total;
      p[C + c] = piece_m2;
    }
    __syncthreads();  // lane_sum / lane_m2 are rewritten by the next item
  }
  dwgn::grid_barrier(barrier);

  // ---- phase 2: per (n, g) statistics and coefficients.
  const int groups = N * G;  // < 2**31: the host checks it
  for (int item = blockIdx.x; item < groups; item += gridDim.x) {
    const int n = item / G;
    gn::finalize_group(static_cast<const double*>(partial), weight, bias, mean_out, rstd_out, ws,
                       n, item - n * G, S, C, G, num_chunks, rows_per_chunk, false, eps, scratch,
                       broadcast);
  }
  dwgn::grid_barrier(barrier);

  // ---- phase 3: apply.
  const IndexT num_vectors = static_cast<IndexT>(N) * S * cols;
  gn::for_each_vector<VEC>(num_vectors, S, C, [&](IndexT i, int n, int c) {
    gn::apply_vector<T, ACT, VEC>(x, ws, y, i, n, C, c);
  });
}

// ---------------------------------------------------------------------------
// One-pass backward (one cooperative launch): the three backward passes in
// one persistent kernel separated by two grid-wide barriers, as in the
// one-pass forward.  Host rule and grid size: _group_norm.py.
//
//   phase 1  items (n, chunk), N * num_chunks of them: per channel A = sum
//            dz and B = sum dz * xhat over the chunk's rows (dz = grad_out *
//            act'(z), the arithmetic of dwgn_gn_bwd_reduce).  cols = C / VEC
//            threads across a row, lanes = blockDim.x / cols rows at a time
//            (row0 + lane + k * lanes); each thread sums its rows in order,
//            then the lanes are added in shared memory, lane 0 to lanes - 1,
//            one thread per channel.  Writes partial (N, num_chunks, 2, C)
//            Acc, the layout dwgn_gn_bwd_reduce writes.
//   barrier
//   phase 2  items (g, y), G * (N + 1) of them: gn::bwd_finalize_item (the
//            code of dwgn_gn_bwd_finalize): ws and the weight/bias gradients.
//   barrier
//   phase 3  grad_in over every vector, grid-stride (gn::dx_vector, the code
//            of dwgn_gn_bwd_dx); x and grad_out are read again (from L2 for
//            tensors that fit it).
//
// Determinism as in the one-pass forward: the work split depends on the
// shape only, the grid size only on which block takes which item.
// grad_in must not overlap grad_out or x (the host checks it).  partial and
// ws are written in one phase and first read in a later one, after a grid
// barrier (which fences memory), so no SM can hold a stale cached copy when
// the __restrict__ (possibly non-coherent) loads of the next phase read them;
// the one-pass forward relies on the same order.
// blockDim.x: a multiple of 32, cols * lanes <= blockDim.x <= 256 (the
// finalize's scratch) and lanes * C <= kOnePassSlots.
template <typename T, typename W, int ACT, int VEC, typename IndexT>
__global__ void __launch_bounds__(256, gn::bwd_min_blocks<T>()) dwgn_gn_bwd_onepass(
    const T* __restrict__ grad_out, const T* __restrict__ x,
    const typename AccType<T>::type* __restrict__ mean, const typename AccType<T>::type* __restrict__ rstd,
    const W* __restrict__ weight, const W* __restrict__ bias, typename AccType<T>::type* __restrict__ partial,
    typename AccType<T>::type* __restrict__ ws, W* __restrict__ grad_weight, W* __restrict__ grad_bias,
    T* __restrict__ grad_in, unsigned int* __restrict__ barrier, int N, int S, int C, int G, int num_chunks,
    int rows_per_chunk) {
  using Acc = typename AccType<T>::type;
  using V = gn::Vec<T, VEC>;
  constexpr int RB = gn::bwd_row_batch<T, VEC>();
  __shared__ Acc lane_a[gn::kOnePassSlots];
  __shared__ Acc lane_b[gn::kOnePassSlots];
  __shared__ Acc scratch[2 * 256];
  __shared__ Acc broadcast[2];

  // ---- phase 1: per (n, chunk, c) sums of dz and dz * xhat.
  const gn::OnePassRows rows_of(C, VEC);
  const int cols = rows_of.cols, lanes = rows_of.lanes, lane = rows_of.lane, c_first = rows_of.c_first;
  const int D = C / G;
  for (int item = blockIdx.x; item < N * num_chunks; item += gridDim.x) {  // host: no overflow
    const gn::OnePassItem it(item, num_chunks, rows_per_chunk, S, rows_of);
    const int n = it.n, row0 = it.row0, count = it.count;
    gn::BwdLane<T, ACT, VEC> sums;
    if (count > 0) {
      sums.load(mean, rstd, weight, bias, n, G, D, c_first);
      const IndexT first = (static_cast<IndexT>(n) * S + row0 + lane) * C + c_first;
      sums.template walk<RB>(reinterpret_cast<const V*>(x + first), reinterpret_cast<const V*>(grad_out + first),
                             static_cast<IndexT>(lanes) * cols, count);
    }
    gn::store_lanes<VEC>(lane_a, lane_b, sums.a, sums.b_sum, rows_of, C);
    Acc* p = partial + static_cast<long long>(item) * 2 * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      p[c] = gn::sum_lanes(lane_a + c, C, lanes);
      p[C + c] = gn::sum_lanes(lane_b + c, C, lanes);
    }
    __syncthreads();  // lane_a / lane_b are rewritten by the next item
  }
  dwgn::grid_barrier(barrier);

  // ---- phase 2: coefficients (y < N) and weight/bias gradients (y == N).
  const int finalize_items = G * (N + 1);  // < 2**31: the host checks it
  for (int item = blockIdx.x; item < finalize_items; item += gridDim.x) {
    const int y = item / G;
    gn::bwd_finalize_item(static_cast<const Acc*>(partial), mean, rstd, weight, bias, ws, grad_weight,
                          grad_bias, N, S, C, G, num_chunks, item - y * G, y, scratch, broadcast);
  }
  dwgn::grid_barrier(barrier);

  // ---- phase 3: grad_in.
  const IndexT num_vectors = static_cast<IndexT>(N) * S * cols;
  gn::for_each_vector<VEC>(num_vectors, S, C, [&](IndexT i, int n, int c) {
    gn::dx_vector<T, ACT, VEC>(grad_out, x, ws, grad_in, i, n, C, c);
  });
}

// ---------------------------------------------------------------------------
// Resident forward (one cooperative launch, opt-in: _group_norm.py's path
// notes say where it fits on chip and what it measured): x is read from
// DRAM once.  Block b = n * B + j (B = blocks_per_sample) holds rows [j * R,
// min(S, (j + 1) * R)) of sample n (R = rows_per_block), all C channels: a
// contiguous range of x, kept in shared memory from its load to the last
// store of y.  The grid is exactly N * B blocks, every one resident (the
// host checks the occupancy and takes the two-launch path where they do
// not fit; never a smaller grid: each block owns its tile).
//
//   load      the tile, block-strided over its vectors (16-byte cp.async on
//             the vector path; element copies on the scalar path);
//   shift     per group, the tile's mean in Acc: thread sums of its rows
//             (lanes as in the column kernels: cols = C / VEC threads across
//             a row, lanes = blockDim.x / cols rows at a time), then per
//             group over the lanes' shared slots (gn::segment_sums);
//   sums      per group, sum d and sum d^2 with d = x - shift (Acc per
//             thread, double across threads); the tile's (sum, M2) =
//             (count * shift + sum d, sum d^2 - (sum d)^2 / count) to
//             partial (N, B, 2, G) double.  d is centered on the tile's own
//             (rounded) mean, so (sum d)^2 / count is tiny against sum d^2
//             and nothing cancels, even at x = 1000 + randn in float32;
//   barrier   (dwgn::grid_barrier fences memory; partial is read after it
//             through L2, __ldcg, never from a stale L1 line);
//   finalize  every block combines its sample's B tiles for all G groups
//             (gn::segment_sums): the shifted sums of gn::finalize_group
//             about the first tile's mean.  The blocks of a sample run the
//             same additions in the same order, so they agree bit for bit;
//             block j = 0 writes mean_out / rstd_out;
//   apply     y = act((x - hi) * scale_c + offset_c) from the tile, with hi,
//             scale_c and offset_c made as gn::finalize_group makes them
//             (each thread for its VEC channels, once).
//
// Determinism: the split (B, R, blockDim.x) depends on the shape only, and
// every sum has a fixed order, so results are bit-identical run to run.
// x and y may be the same array: every block loads its tile before the
// barrier and stores only its own tile after it.
// Dynamic shared memory (the host sizes it the same way): the tile (R * C
// elements, rounded up to 16 bytes), two slot arrays of lanes * C Acc,
// gn::segment_sums' scratch (2 * blockDim.x doubles), then mean and rstd (G
// doubles each) and the shifts (G Acc).
// blockDim.x: a multiple of 32, C / VEC <= blockDim.x <= 512.
namespace gn {
// Per-segment sums of NUM values, `count` items per segment, for `segments`
// segments (groups, channels), by the whole block: K = max(1, blockDim.x /
// segments) threads per segment each add items k, k + K, ... of theirs
// (load(segment, item, values), kFinalizeBatch loads in flight: the items are
// L2 or shared-memory reads, and a thread's are independent), then one thread
// per segment adds the K partial sums in order (k = 0 .. K-1) and calls
// done(segment, totals).  A fixed order whatever the data, so the blocks
// that reduce the same values agree bit for bit.  scratch holds NUM *
// blockDim.x Sums (used when K > 1).  Every thread of the block must call it
// (it has barriers); the caller orders what load reads before the call and
// what done writes after it.  (A warp per segment with a butterfly, tried
// first, left each warp several segments one after the other: 584 warp
// instructions per group and tile in the resident forward, 44% of its 25 us.)
template <int NUM, typename Sum, typename Load, typename Done>
__device__ __forceinline__ void segment_sums(int segments, int count, Sum* scratch, Load load, Done done) {
  const int K = max(1, static_cast<int>(blockDim.x) / segments);
  // K > 1: segments * K <= blockDim.x, one (segment, k) item per thread at
  // most; K = 1: each thread takes whole segments.
  for (int item = threadIdx.x; item < segments * K; item += blockDim.x) {
    const int seg = item % segments, k = item / segments;
    Sum part[NUM];
#pragma unroll
    for (int q = 0; q < NUM; ++q) part[q] = Sum(0);
    batched_walk<kFinalizeBatch>(
        k, count, K,
        [&](long long i) {
          Vec<Sum, NUM> v;
          load(seg, static_cast<int>(i), v.v);
          return v;
        },
        [&](const Vec<Sum, NUM>& v) {
#pragma unroll
          for (int q = 0; q < NUM; ++q) part[q] += v.v[q];
        });
    if (K == 1) {
      done(seg, part);
    } else {
#pragma unroll
      for (int q = 0; q < NUM; ++q) scratch[q * blockDim.x + item] = part[q];
    }
  }
  __syncthreads();  // K = 1: what done wrote is visible; else the partial sums are in scratch
  if (K == 1) return;  // block-uniform
  if (static_cast<int>(threadIdx.x) < segments) {
    Sum total[NUM];
#pragma unroll
    for (int q = 0; q < NUM; ++q) {
      total[q] = Sum(0);
      for (int j = 0; j < K; ++j) total[q] += scratch[q * blockDim.x + j * segments + threadIdx.x];
    }
    done(static_cast<int>(threadIdx.x), total);
  }
  __syncthreads();  // what done wrote is visible; scratch may be reused
}

// A resident block's place: its tile (sample n, tile j of B, rows [row0,
// row0 + rows)) and its thread's (lane, col) as in the column kernels (cols
// = C / VEC threads across a row, lanes = blockDim.x / cols rows at a
// time: rows lane, lane + lanes, ... of the tile).
struct ResidentTile {
  int cols, lanes, lane, col, c_first, n, j, row0, rows;
  bool active;  // threads past lanes * cols only reach the barriers
  __device__ __forceinline__ ResidentTile(int S, int C, int vec, int blocks_per_sample, int rows_per_block) {
    cols = C / vec;
    lanes = blockDim.x / cols;  // >= 1: the host keeps cols <= blockDim.x
    lane = threadIdx.x / cols;
    col = threadIdx.x - lane * cols;
    c_first = col * vec;
    active = lane < lanes;
    n = blockIdx.x / blocks_per_sample;
    j = blockIdx.x - n * blocks_per_sample;
    row0 = j * rows_per_block;
    rows = min(rows_per_block, S - row0);  // >= 1: the host leaves no block without rows
  }
  // Bytes of one tile of R rows in shared memory (16-byte rounded).
  template <typename T>
  __device__ static __forceinline__ int bytes(int rows_per_block, int C) {
    return (rows_per_block * C * static_cast<int>(sizeof(T)) + 15) & ~15;
  }
};

// Copies `count` consecutive vectors from global to shared memory, the
// block strided over them (16-, 8- or 4-byte cp.async; 2-byte elements one
// by one).  Every copy has landed for its own thread when it returns; the
// caller's barrier makes them visible to the block.
template <typename V>
__device__ __forceinline__ void load_tile(V* tile, const V* source, int count) {
  if constexpr (sizeof(V) >= 4) {
    for (int i = threadIdx.x; i < count; i += blockDim.x) dwgn::cp_async<static_cast<int>(sizeof(V))>(tile + i, source + i);
    dwgn::cp_async_commit();
    dwgn::cp_async_wait_all();
  } else {  // 2-byte elements (the scalar path of the half types)
#pragma unroll 4
    for (int i = threadIdx.x; i < count; i += blockDim.x) tile[i] = source[i];
  }
}

// A tile's thread sums, shared by the resident and cluster forwards: the tile
// holds `rows` rows of `cols` vectors in shared memory; this thread (column
// col, lane `lane` of `lanes`) adds rows lane, lane + lanes, ... of its
// column.  tile_sums: sum x per channel of its vector; centered_sums: sum d
// and sum d^2 with d = x - shift (the shift of each of its channels).
template <typename T, int VEC, typename Acc>
__device__ __forceinline__ void tile_sums(const Vec<T, VEC>* tile, int cols, int col, int lane, int lanes, int rows,
                                          Acc (&sum)[VEC]) {
#pragma unroll
  for (int k = 0; k < VEC; ++k) sum[k] = Acc(0);
  for (int r = lane; r < rows; r += lanes) {
    const Vec<T, VEC> v = tile[r * cols + col];
#pragma unroll
    for (int k = 0; k < VEC; ++k) sum[k] += to_acc(v.v[k]);
  }
}
template <typename T, int VEC, typename Acc>
__device__ __forceinline__ void centered_sums(const Vec<T, VEC>* tile, int cols, int col, int lane, int lanes,
                                              int rows, const Acc (&shift)[VEC], Acc (&sd)[VEC], Acc (&sdd)[VEC]) {
#pragma unroll
  for (int k = 0; k < VEC; ++k) sd[k] = sdd[k] = Acc(0);
  for (int r = lane; r < rows; r += lanes) {
    const Vec<T, VEC> v = tile[r * cols + col];
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const Acc d = to_acc(v.v[k]) - shift[k];
      sd[k] += d;
      sdd[k] += d * d;
    }
  }
}

// The apply from a tile (resident and cluster forwards): channels c_first ..
// c_first + VEC - 1 of x (weight, bias index), whose groups' double mean and
// rstd are group_mean[q], group_rstd[q] with q = (c_local + k) / D; hi,
// scale and offset made as gn::finalize_group makes them (hi the mean
// rounded to Acc, the rest folded into offset).  Rows as in tile_sums;
// row r of the tile goes to dest[r * dest_row_vectors].
template <typename T, int ACT, int VEC, typename W>
__device__ __forceinline__ void apply_tile(const Vec<T, VEC>* tile, int cols, int col, int lane, int lanes, int rows,
                                           const double* group_mean, const double* group_rstd, int c_local,
                                           int c_first, int D, const W* __restrict__ weight,
                                           const W* __restrict__ bias, Vec<T, VEC>* dest, int dest_row_vectors) {
  using Acc = typename AccType<T>::type;
  Acc hi[VEC], scale[VEC], offset[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    const int q = (c_local + k) / D, c = c_first + k;
    const double mean = group_mean[q];
    const Acc rstd = static_cast<Acc>(group_rstd[q]);
    hi[k] = static_cast<Acc>(mean);
    const double lo = mean - static_cast<double>(hi[k]);  // exact
    scale[k] = weight != nullptr ? rstd * to_acc(weight[c]) : rstd;
    const Acc b = bias != nullptr ? to_acc(bias[c]) : Acc(0);
    offset[k] = static_cast<Acc>(static_cast<double>(b) - lo * static_cast<double>(scale[k]));
  }
  for (int r = lane; r < rows; r += lanes) {
    const Vec<T, VEC> v = tile[r * cols + col];
    Vec<T, VEC> out;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const Acc z = (to_acc(v.v[k]) - hi[k]) * scale[k] + offset[k];
      out.v[k] = from_acc<T>(activation<ACT, fast_activation<T>()>(z));
    }
    dest[r * dest_row_vectors] = out;
  }
}
}  // namespace gn

template <typename T, typename W, int ACT, int VEC>
__global__ void __launch_bounds__(512, 1) dwgn_gn_fwd_resident(
    const T* x, double* __restrict__ partial, const W* __restrict__ weight, const W* __restrict__ bias,
    typename AccType<T>::type* __restrict__ mean_out, typename AccType<T>::type* __restrict__ rstd_out, T* y,
    unsigned int* __restrict__ barrier, int S, int C, int G, int blocks_per_sample, int rows_per_block,
    typename AccType<T>::type eps) {
  using Acc = typename AccType<T>::type;
  using V = gn::Vec<T, VEC>;
  extern __shared__ __align__(16) unsigned char resident_shared[];
  const gn::ResidentTile P(S, C, VEC, blocks_per_sample, rows_per_block);
  const int cols = P.cols, lanes = P.lanes, lane = P.lane, col = P.col, c_first = P.c_first;
  const int n = P.n, j = P.j, row0 = P.row0, rows = P.rows;
  const bool active = P.active;
  const int D = C / G;
  V* const tile = reinterpret_cast<V*>(resident_shared);
  Acc* const slots = reinterpret_cast<Acc*>(resident_shared + gn::ResidentTile::bytes<T>(rows_per_block, C));
  const int slot_stride = lanes * C;
  // 8-byte aligned: 2 * slot_stride Acc
  double* const scratch = reinterpret_cast<double*>(slots + 2 * slot_stride);  // gn::segment_sums, 2 * blockDim.x
  double* const group_mean = scratch + 2 * blockDim.x;
  double* const group_rstd = group_mean + G;
  Acc* const shift = reinterpret_cast<Acc*>(group_rstd + G);
  // Item i of group g's lanes * D slots: lane i / D, channel g * D + i % D.
  const float inv_d = 1.0f / static_cast<float>(D);  // small_div: i < lanes * D < 2**22
  auto slot = [&](int g, int i) {
    const int l = dwgn::small_div(i, inv_d);
    return l * C + g * D + (i - l * D);
  };

  // ---- load: rows [row0, row0 + rows) x C, contiguous in x (N * S * C < 2**31: int offsets).
  gn::load_tile(tile, reinterpret_cast<const V*>(x) + (n * S + row0) * cols, rows * cols);
  __syncthreads();  // the tile is read by other threads than the ones that copied it

  // ---- shift: the tile's per-group mean.
  if (active) {
    Acc s[VEC];
    gn::tile_sums(tile, cols, col, lane, lanes, rows, s);
#pragma unroll
    for (int k = 0; k < VEC; ++k) slots[lane * C + c_first + k] = s[k];
  }
  __syncthreads();
  const Acc tile_count = static_cast<Acc>(rows * D);  // exact: rows * D <= R * C < 2**24
  gn::segment_sums<1, double>(
      G, lanes * D, scratch, [&](int g, int i, double* v) { v[0] = slots[slot(g, i)]; },
      [&](int g, const double (&t)[1]) { shift[g] = static_cast<Acc>(t[0]) / tile_count; });

  // ---- sums about the shift: this tile's (sum, M2) per group.
  if (active) {
    Acc sh[VEC], sd[VEC], sdd[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) sh[k] = shift[(c_first + k) / D];
    gn::centered_sums(tile, cols, col, lane, lanes, rows, sh, sd, sdd);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      slots[lane * C + c_first + k] = sd[k];
      slots[slot_stride + lane * C + c_first + k] = sdd[k];
    }
  }
  __syncthreads();
  {
    double* out = partial + (static_cast<long long>(n) * blocks_per_sample + j) * 2 * G;
    const double count = static_cast<double>(rows) * D;
    gn::segment_sums<2, double>(
        G, lanes * D, scratch,
        [&](int g, int i, double* v) {
          const int at = slot(g, i);
          v[0] = slots[at];
          v[1] = slots[slot_stride + at];
        },
        [&](int g, const double (&t)[2]) {
          out[g] = count * static_cast<double>(shift[g]) + t[0];
          out[G + g] = gn::centered_square_sum(t[0], t[1], count);
        });
  }
  dwgn::grid_barrier(barrier);

  // ---- finalize: mean and rstd of every group of sample n, over its B tiles
  // (the shifted sums of gn::finalize_group about the first tile's mean).
  {
    const double* pn = partial + static_cast<long long>(n) * blocks_per_sample * 2 * G;
    const int B = blocks_per_sample;
    const double full_count = static_cast<double>(rows_per_block) * D;  // R <= S: the first tile is full
    const double last_count = static_cast<double>(S - (B - 1) * rows_per_block) * D;
    const double inv_full = 1.0 / full_count, inv_last = 1.0 / last_count;
    const double total_count = static_cast<double>(S) * D;
    gn::segment_sums<2, double>(
        G, B, scratch,
        [&](int g, int b, double* v) {  // v = (e_b, M2_b + e_b^2 / count_b), e_b = sum_b - count_b * shift
          const bool last = b == B - 1;
          const double tile_shift = __ldcg(pn + g) * inv_full;  // the first tile's mean
          const double e = __ldcg(pn + static_cast<long long>(b) * 2 * G + g) - (last ? last_count : full_count) * tile_shift;
          v[0] = e;
          v[1] = __ldcg(pn + static_cast<long long>(b) * 2 * G + G + g) + e * e * (last ? inv_last : inv_full);
        },
        [&](int g, const double (&acc)[2]) {
          const double mean = __ldcg(pn + g) * inv_full + acc[0] / total_count;
          const double var = gn::centered_square_sum(acc[0], acc[1], total_count) / total_count;
          const double rstd = 1.0 / sqrt(var + static_cast<double>(eps));
          group_mean[g] = mean;
          group_rstd[g] = rstd;
          if (j == 0) {
            mean_out[static_cast<long long>(n) * G + g] = static_cast<Acc>(mean);
            rstd_out[static_cast<long long>(n) * G + g] = static_cast<Acc>(rstd);
          }
        });
  }
  if (!active) return;  // no barrier follows (segment_sums ended with one: mean and rstd are visible)

  // ---- apply, from the tile.
  gn::apply_tile<T, ACT>(tile, cols, col, lane, lanes, rows, group_mean, group_rstd, c_first, c_first, D, weight, bias,
                         reinterpret_cast<V*>(y) + (n * S + row0) * cols + col, cols);
}

// ---------------------------------------------------------------------------
// Resident backward (one cooperative launch, opt-in, where x and grad_out
// fit on chip: _group_norm.py): x and grad_out are read from DRAM once.  Tiles and grid as in dwgn_gn_fwd_resident (block b
// = n * B + j holds rows [j * R, ...) of sample n of both tensors).
//
//   load      both tiles (gn::load_tile);
//   sums      per channel, A = sum dz and B = sum dz * xhat over the tile
//             (gn::BwdLane: the arithmetic of dwgn_gn_bwd_reduce), the lanes
//             added in order (gn::segment_sums), and per group sum w_c A_c
//             and sum w_c B_c over its D channels: partial (N * B, 2 * (C +
//             G)) Acc, per tile A (C), B (C), then the two group sums (2 G);
//   barrier
//   weights   dweight_c = sum B, dbias_c = sum A over the N * B tiles: a warp
//             per channel (channels dealt to the grid's warps; which warp
//             takes a channel does not change its sum), lanes strided over
//             the tiles, then a butterfly;
//   coefficients  for sample n, per group: c1 = sum w_c A_c and c2 = sum
//             w_c B_c over the B tiles' group sums (gn::segment_sums), then
//             rstd * c1 / (S D) and rstd^2 * c2 / (S D) (the coefficients of
//             gn::bwd_finalize_item);
//   dx        grad_in = scale_c dz - rstd c1 - (x - mean) rstd^2 c2 from the
//             tiles (the arithmetic of gn::dx_vector).
//
// Determinism as in the resident forward.  grad_in must not overlap x or
// grad_out (the host checks it).  Dynamic shared memory: the x tile and the
// grad_out tile (each R * C elements, 16-byte rounded), two slot arrays of
// lanes * C Acc, gn::segment_sums' scratch (2 * blockDim.x Acc), the tile's
// per-channel sums (2 * C Acc), then the two coefficients (G Acc each).
// blockDim.x: a multiple of 32, C / VEC <= blockDim.x <= 512.
template <typename T, typename W, int ACT, int VEC>
__global__ void __launch_bounds__(512, 1) dwgn_gn_bwd_resident(
    const T* __restrict__ grad_out, const T* __restrict__ x, const typename AccType<T>::type* __restrict__ mean,
    const typename AccType<T>::type* __restrict__ rstd, const W* __restrict__ weight,
    const W* __restrict__ bias, typename AccType<T>::type* __restrict__ partial, W* __restrict__ grad_weight,
    W* __restrict__ grad_bias, T* __restrict__ grad_in, unsigned int* __restrict__ barrier, int S, int C,
    int G, int blocks_per_sample, int rows_per_block) {
  using Acc = typename AccType<T>::type;
  using V = gn::Vec<T, VEC>;
  extern __shared__ __align__(16) unsigned char resident_shared[];
  const gn::ResidentTile P(S, C, VEC, blocks_per_sample, rows_per_block);
  const int cols = P.cols, lanes = P.lanes, lane = P.lane, col = P.col, c_first = P.c_first;
  const int n = P.n, rows = P.rows;
  const int D = C / G;
  const int tile_bytes = gn::ResidentTile::bytes<T>(rows_per_block, C);
  V* const x_tile = reinterpret_cast<V*>(resident_shared);
  V* const dy_tile = reinterpret_cast<V*>(resident_shared + tile_bytes);
  Acc* const slots = reinterpret_cast<Acc*>(resident_shared + 2 * tile_bytes);
  const int slot_stride = lanes * C;
  Acc* const scratch = slots + 2 * slot_stride;  // gn::segment_sums, 2 * blockDim.x
  Acc* const channel_a = scratch + 2 * blockDim.x;  // the tile's per-channel sums
  Acc* const channel_b = channel_a + C;
  Acc* const k1 = channel_b + C;
  Acc* const k2 = k1 + G;
  // partial: per tile, A and B per channel (2 * C), then sum_c w_c A_c and
  // sum_c w_c B_c per group (2 * G).
  const int tile_stride = 2 * (C + G);

  // ---- load both tiles (N * S * C < 2**31: int offsets).
  const int offset = (n * S + P.row0) * cols;
  gn::load_tile(x_tile, reinterpret_cast<const V*>(x) + offset, rows * cols);
  gn::load_tile(dy_tile, reinterpret_cast<const V*>(grad_out) + offset, rows * cols);
  __syncthreads();  // the tiles are read by other threads than the ones that copied them

  // ---- per-channel sums of dz and dz * xhat over the tile, then per group
  // weighted by w_c.
  gn::BwdLane<T, ACT, VEC> sums;
  sums.load(mean, rstd, weight, bias, n, G, D, c_first);
  if (P.active) {
    for (int r = lane; r < rows; r += lanes) sums.add(x_tile[r * cols + col], dy_tile[r * cols + col]);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      slots[lane * C + c_first + k] = sums.a[k];
      slots[slot_stride + lane * C + c_first + k] = sums.b_sum[k];
    }
  }
  __syncthreads();
  Acc* const out = partial + static_cast<long long>(blockIdx.x) * tile_stride;
  gn::segment_sums<2, Acc>(
      C, lanes, scratch,
      [&](int c, int l, Acc* v) {
        v[0] = slots[l * C + c];
        v[1] = slots[slot_stride + l * C + c];
      },
      [&](int c, const Acc (&t)[2]) {
        out[c] = channel_a[c] = t[0];
        out[C + c] = channel_b[c] = t[1];
      });
  gn::segment_sums<2, Acc>(
      G, D, scratch,
      [&](int g, int d, Acc* v) {
        const int c = g * D + d;
        const Acc w = weight != nullptr ? to_acc(weight[c]) : Acc(1);
        v[0] = w * channel_a[c];
        v[1] = w * channel_b[c];
      },
      [&](int g, const Acc (&t)[2]) {
        out[2 * C + g] = t[0];
        out[2 * C + G + g] = t[1];
      });
  dwgn::grid_barrier(barrier);

  // ---- weight and bias gradients: channel c to warp c of the grid's warps.
  const int warp = threadIdx.x >> 5, lane32 = threadIdx.x & 31;
  const int warps = static_cast<int>(blockDim.x >> 5);
  if (grad_weight != nullptr || grad_bias != nullptr) {
    const int tiles = static_cast<int>(gridDim.x);
    for (int c = blockIdx.x * warps + warp; c < C; c += tiles * warps) {
      Acc v[2] = {Acc(0), Acc(0)};
      for (int t = lane32; t < tiles; t += 32) {
        v[0] += __ldcg(partial + static_cast<long long>(t) * tile_stride + c);
        v[1] += __ldcg(partial + static_cast<long long>(t) * tile_stride + C + c);
      }
      v[0] = dwgn::warp_sum(v[0]);
      v[1] = dwgn::warp_sum(v[1]);
      if (lane32 == 0) {
        if (grad_weight != nullptr) grad_weight[c] = from_acc<W>(v[1]);
        if (grad_bias != nullptr) grad_bias[c] = from_acc<W>(v[0]);
      }
    }
  }
  // ---- dx coefficients of sample n's groups, over its B tiles.
  {
    const Acc* pn = partial + static_cast<long long>(n) * blocks_per_sample * tile_stride + 2 * C;
    const Acc inv_count = Acc(1) / (Acc(S) * Acc(D));
    gn::segment_sums<2, Acc>(
        G, blocks_per_sample, scratch,
        [&](int g, int b, Acc* v) {
          v[0] = __ldcg(pn + static_cast<long long>(b) * tile_stride + g);
          v[1] = __ldcg(pn + static_cast<long long>(b) * tile_stride + G + g);
        },
        [&](int g, const Acc (&t)[2]) {
          const Acc r = rstd[static_cast<long long>(n) * G + g];
          k1[g] = r * t[0] * inv_count;
          k2[g] = r * (r * t[1] * inv_count);
        });
  }
  if (!P.active) return;  // no barrier follows (segment_sums ended with one: k1, k2 are visible)

  // ---- grad_in, from the tiles.
  Acc c1[VEC], c2[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    c1[k] = k1[(c_first + k) / D];
    c2[k] = k2[(c_first + k) / D];
  }
  V* dest = reinterpret_cast<V*>(grad_in) + offset + col;
  for (int r = lane; r < rows; r += lanes) {
    const V xv = x_tile[r * cols + col];
    const V dyv = dy_tile[r * cols + col];
    V out;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const Acc centered = to_acc(xv.v[k]) - sums.m[k];
      Acc dz = to_acc(dyv.v[k]);
      if (ACT != gn::kIdentity) {
        dz *= gn::activation_grad<ACT, gn::fast_activation<T>()>(centered * sums.scale[k] + sums.b[k]);
      }
      out.v[k] = from_acc<T>(sums.scale[k] * dz - c1[k] - centered * c2[k]);
    }
    dest[r * cols] = out;
  }
}

// ---------------------------------------------------------------------------
// Cluster forward (one launch, no grid barrier, no workspace; thread-block
// clusters of sm_90: _group_norm.py's path notes say where it is taken and
// what it measured).  A cluster of CL CTAs owns (sample n, channel set k):
// SC = set_channels consecutive channels [k * SC, (k + 1) * SC), whole groups
// (SC a multiple of D) of whole 16-byte vectors.  The CTA of cluster rank r
// holds rows [r * R, min(S, (r + 1) * R)) of the set (R = rows_per_cta; the
// last CTAs may hold none) in shared memory from its load to its stores, so
// x is read from DRAM once and y written once.
//
//   load      the CTA's rows x SC channels, 16-byte cp.async (a row's SC
//             channels are contiguous, rows C apart; cols = SC / VEC threads
//             across a row, lanes = blockDim.x / cols rows at a time);
//   shift     per group, the set's mean: thread sums of its rows (Acc),
//             per group over the lanes' shared slots (gn::set_group_sums,
//             double), then over the cluster's CTAs in rank order through
//             distributed shared memory, rounded to Acc;
//   sums      per group, sum d and sum d^2 with d = x - shift, the same way;
//             mean = shift + sum d / count, var = (sum d^2 - (sum d)^2 /
//             count) / count: d is centered on the group's (rounded) mean,
//             so nothing cancels, even at x = 1000 + randn in float32;
//   apply     y = act((x - hi) * scale_c + offset_c) from the tile
//             (gn::apply_tile); rank 0 writes mean_out / rstd_out.
// Every CTA of a cluster adds the same partial sums in the same order (so
// they agree bit for bit), and the split (SC, CL, R, blockDim.x) depends on
// the shape only: results are bit-identical run to run.  x and y may be the
// same array: a CTA stores only the rows it loaded, after loading them.
// Dynamic shared memory (the host sizes it the same way: _cluster_geometry):
// the tile (R * SC elements, 16-byte rounded), two slot arrays of lanes *
// SC Acc, gn::set_group_sums' parts (2 * max(blockDim.x, SC) doubles), then
// per group of the set (GS = SC / D): the CTA's sum x (GS doubles), its sum d
// and sum d^2 (2 * GS doubles), mean and rstd (2 * GS doubles), the shift
// (GS Acc).
// blockDim.x = lanes * cols, 32 <= blockDim.x <= 128.
//
// Before sm_90 (no clusters; the host never takes this path there, but the
// package compiles every kernel for sm_80 too) the kernel is a trap.
#if __CUDA_ARCH__ >= 900
#define DWGN_CLUSTER_DIMS(size) __cluster_dims__(size, 1, 1)
namespace gn {
// This CTA's rank in its cluster.
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}
// The cluster barrier in two halves: after arrive (release: this thread's
// earlier shared-memory accesses, remote ones included, are ordered before
// it) a thread may work on until wait (acquire), which returns once every
// thread of every CTA of the cluster has arrived.  Not the .aligned forms:
// a warp may reach them diverged.
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire;" ::: "memory"); }
__device__ __forceinline__ void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}
// A CTA's per-group sums of NUM slot arrays in a fixed order, double from the
// slots on: slots[a * stride + l * SC + c] is lane l's sum of channel c of
// the set (SC channels, groups of D); out[a * GS + q] gets group q's total
// over all lanes and channels.  Per channel over the lanes in P = blockDim.x /
// SC parts (part p adds lanes p, p + P, ... in turn; parts holds NUM *
// max(blockDim.x, SC) doubles), then a warp per group: lane j adds its
// group's part sums j, j + 32, ... (item i: part i / D of channel i % D), and
// a butterfly (dwgn::warp_sum).  (gn::segment_sums over lanes * D items per
// group, the first version, ran ~1000 instructions per warp here: its item
// division and batching cost more than the sums.)  Every thread of the block
// calls it; barriers on entry (the slots are written) and exit (out is).
template <int NUM, typename Acc>
__device__ __forceinline__ void set_group_sums(const Acc* slots, int stride, int lanes, int SC, int D, double* parts,
                                               double* out) {
  const int P = max(1, static_cast<int>(blockDim.x) / SC);
  const int span = P * SC;  // <= max(blockDim.x, SC)
  __syncthreads();
  for (int t = threadIdx.x; t < span; t += blockDim.x) {
    const int p = t / SC, c = t - p * SC;
    double s[NUM];
#pragma unroll
    for (int a = 0; a < NUM; ++a) s[a] = 0.0;
    for (int l = p; l < lanes; l += P) {
#pragma unroll
      for (int a = 0; a < NUM; ++a) s[a] += static_cast<double>(slots[a * stride + l * SC + c]);
    }
#pragma unroll
    for (int a = 0; a < NUM; ++a) parts[a * span + t] = s[a];
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // Whole warps only (the shuffles' full mask; blockDim.x >= 32): a last,
  // partial warp sits this stage out (racecheck caught it writing a group's
  // total beside the whole warp that owned the group).
  const int warps = static_cast<int>(blockDim.x) >> 5;
  const float inv_d = 1.0f / static_cast<float>(D);  // small_div: i < P * D <= blockDim.x + SC < 2**22
  for (int q = warp; warp < warps && q < SC / D; q += warps) {
    double s[NUM];
#pragma unroll
    for (int a = 0; a < NUM; ++a) s[a] = 0.0;
    for (int i = lane; i < P * D; i += 32) {
      const int p = dwgn::small_div(i, inv_d);
      const int at = p * SC + q * D + (i - p * D);
#pragma unroll
      for (int a = 0; a < NUM; ++a) s[a] += parts[a * span + at];
    }
#pragma unroll
    for (int a = 0; a < NUM; ++a) {
      s[a] = dwgn::warp_sum(s[a]);
      if (lane == 0) out[a * (SC / D) + q] = s[a];
    }
  }
  __syncthreads();
}
// *p in the shared memory of the cluster's CTA `rank` (p: this CTA's copy).
__device__ __forceinline__ double load_cluster(const double* p, unsigned rank) {
  const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(p));
  unsigned remote;
  double v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("ld.shared::cluster.f64 %0, [%1];" : "=d"(v) : "r"(remote) : "memory");
  return v;
}
__device__ __forceinline__ float load_cluster(const float* p, unsigned rank) {
  const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(p));
  unsigned remote;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}
// total[a] = the sum over the cluster's CL CTAs, in rank order, of what each
// holds at p[a * stride] (p: this CTA's copy), a < NUM; every remote load is
// issued before the first add.
template <int CL, int NUM, typename Acc>
__device__ __forceinline__ void cluster_sums(const Acc* p, int stride, Acc (&total)[NUM]) {
  Acc part[NUM][CL];
#pragma unroll
  for (int r = 0; r < CL; ++r) {
#pragma unroll
    for (int a = 0; a < NUM; ++a) part[a][r] = load_cluster(p + a * stride, r);
  }
#pragma unroll
  for (int a = 0; a < NUM; ++a) {
    total[a] = Acc(0);
#pragma unroll
    for (int r = 0; r < CL; ++r) total[a] += part[a][r];
  }
}
// A cluster CTA's place (the cluster kernels' layout): its cluster owns
// (sample n, channel set `set` of SC = set_channels channels from c0, GS
// groups of D), its rank r holds rows [r * R, r * R + rows) (R =
// rows_per_cta; rows may be 0); its thread's (lane, col): cols = SC / VEC
// threads across a row, lanes = blockDim.x / cols rows at a time.  first:
// the CTA's first element (N * S * C < 2**31, the host's rule: int).
struct ClusterTile {
  int SC, D, GS, cols, lanes, lane, col, c_local, n, set, c0, row0, rows, first;
  unsigned rank;
  bool active;  // threads past lanes * cols only reach the barriers
  __device__ __forceinline__ ClusterTile(int cluster_size, int S, int C, int G, int set_channels, int rows_per_cta,
                                         int vec) {
    SC = set_channels;
    D = C / G;
    GS = SC / D;
    cols = SC / vec;
    lanes = blockDim.x / cols;  // >= 1: the host keeps cols <= blockDim.x
    lane = threadIdx.x / cols;
    col = threadIdx.x - lane * cols;
    c_local = col * vec;
    active = lane < lanes;
    rank = cluster_rank();
    const int sets = C / SC;
    n = blockIdx.x / cluster_size / sets;
    set = blockIdx.x / cluster_size - n * sets;
    c0 = set * SC;
    row0 = static_cast<int>(rank) * rows_per_cta;
    rows = max(0, min(rows_per_cta, S - row0));
    first = (n * S + min(row0, S)) * C + c0;
  }
};
}  // namespace gn
#else
#define DWGN_CLUSTER_DIMS(size)
#endif

template <typename T, typename W, int ACT, int VEC, int CL>
__global__ void DWGN_CLUSTER_DIMS(CL) __launch_bounds__(128) dwgn_gn_fwd_cluster(
    const T* x, const W* __restrict__ weight, const W* __restrict__ bias,
    typename AccType<T>::type* __restrict__ mean_out, typename AccType<T>::type* __restrict__ rstd_out, T* y, int S,
    int C, int G, int set_channels, int rows_per_cta, typename AccType<T>::type eps) {
  using Acc = typename AccType<T>::type;
  using V = gn::Vec<T, VEC>;
#if __CUDA_ARCH__ < 900
  __trap();  // no clusters before sm_90
#else
  extern __shared__ __align__(16) unsigned char cluster_shared[];
  const gn::ClusterTile P(CL, S, C, G, set_channels, rows_per_cta, VEC);
  const int SC = P.SC, D = P.D, GS = P.GS, cols = P.cols, lanes = P.lanes, lane = P.lane, col = P.col;
  const int c_local = P.c_local, n = P.n, c0 = P.c0, rows = P.rows, first = P.first;
  const bool active = P.active;
  const unsigned rank = P.rank;
  V* const tile = reinterpret_cast<V*>(cluster_shared);
  Acc* const slots = reinterpret_cast<Acc*>(cluster_shared + ((rows_per_cta * SC * static_cast<int>(sizeof(T)) + 15) & ~15));
  const int slot_stride = lanes * SC;
  double* const parts = reinterpret_cast<double*>(slots + 2 * slot_stride);  // 8-byte aligned: 2 * slot_stride Acc
  double* const cta_sum = parts + 2 * max(static_cast<int>(blockDim.x), SC);
  double* const cta_centered = cta_sum + GS;  // sum d (GS), then sum d^2 (GS)
  double* const group_mean = cta_centered + 2 * GS;
  double* const group_rstd = group_mean + GS;
  Acc* const shift = reinterpret_cast<Acc*>(group_rstd + GS);
  const int row_vectors = C / VEC;

  // ---- load.
  if (active) {
    const V* source = reinterpret_cast<const V*>(x + first) + col;
    for (int r = lane; r < rows; r += lanes) dwgn::cp_async<16>(tile + r * cols + col, source + r * row_vectors);
  }
  dwgn::cp_async_commit();
  dwgn::cp_async_wait_all();
  __syncthreads();  // the tile is read by other threads than the ones that copied it

  // ---- shift: the set's per-group mean, over the cluster.
  if (active) {
    Acc s[VEC];
    gn::tile_sums(tile, cols, col, lane, lanes, rows, s);
#pragma unroll
    for (int k = 0; k < VEC; ++k) slots[lane * SC + c_local + k] = s[k];
  }
  gn::set_group_sums<1>(slots, slot_stride, lanes, SC, D, parts, cta_sum);
  gn::cluster_sync();  // every CTA's cta_sum is written
  const double count = static_cast<double>(S) * D;
  for (int q = threadIdx.x; q < GS; q += blockDim.x) {
    double total[1];
    gn::cluster_sums<CL>(cta_sum + q, 0, total);
    shift[q] = static_cast<Acc>(total[0] / count);
  }
  __syncthreads();

  // ---- sums about the shift, over the cluster: mean and rstd.
  if (active) {
    Acc sh[VEC], sd[VEC], sdd[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) sh[k] = shift[(c_local + k) / D];
    gn::centered_sums(tile, cols, col, lane, lanes, rows, sh, sd, sdd);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      slots[lane * SC + c_local + k] = sd[k];
      slots[slot_stride + lane * SC + c_local + k] = sdd[k];
    }
  }
  gn::set_group_sums<2>(slots, slot_stride, lanes, SC, D, parts, cta_centered);
  gn::cluster_sync();  // every CTA's cta_centered is written
  for (int q = threadIdx.x; q < GS; q += blockDim.x) {
    double t[2];
    gn::cluster_sums<CL>(cta_centered + q, GS, t);
    const double sd = t[0], sdd = t[1];
    const double mean = static_cast<double>(shift[q]) + sd / count;
    const double var = gn::centered_square_sum(sd, sdd, count) / count;
    const double rstd = 1.0 / sqrt(var + static_cast<double>(eps));
    group_mean[q] = mean;
    group_rstd[q] = rstd;
    if (rank == 0) {
      const int g = n * G + c0 / D + q;
      mean_out[g] = static_cast<Acc>(mean);
      rstd_out[g] = static_cast<Acc>(rstd);
    }
  }
  gn::cluster_arrive();  // this CTA is done reading the others' shared memory
  __syncthreads();       // group_mean, group_rstd

  // ---- apply, from the tile.
  if (active) {
    gn::apply_tile<T, ACT>(tile, cols, col, lane, lanes, rows, group_mean, group_rstd, c_local, c0 + c_local, D,
                           weight, bias, reinterpret_cast<V*>(y + first) + col, row_vectors);
  }
  gn::cluster_wait();  // no CTA leaves while another may still read its partial sums
#endif
}

// ---------------------------------------------------------------------------
// Cluster backward (one launch; sm_90): the forward's clusters (a cluster of
// CL CTAs per (sample n, channel set k), CTA rank r holding rows [r * R,
// min(S, (r + 1) * R)) of the set) with tiles of x and grad_out, so both are
// read from DRAM once:
//
//   load      both tiles, 16-byte cp.async;
//   sums      per channel, A = sum dz and B = sum dz * xhat over the CTA's
//             rows (gn::BwdLane, the arithmetic of dwgn_gn_bwd_reduce): each
//             thread over its rows, then one thread per channel over the
//             lanes in order (cta_chan), then a warp per group adds w_c A_c
//             and w_c B_c over its D channels (cta_group; a butterfly);
//   cluster   per group, the CTAs' group sums in rank order through
//             distributed shared memory: the dx coefficients rstd c1 / (S D)
//             and rstd^2 c2 / (S D) (gn::bwd_finalize_item's); rank 0 adds
//             the CTAs' per-channel sums in rank order and writes them to
//             partial (N, 2, C) Acc for the weight gradients;
//   dx        grad_in = scale_c dz - rstd c1 - (x - mean) rstd^2 c2 from the
//             tiles (gn::dx_vector's arithmetic; dz recomputed for the half
//             types, kept in the grad_out tile for float and double);
//   weights   (when grad_weight or grad_bias is asked) the last cluster of
//             set k to finish, by a ticket (tickets[k], atomicInc modulo N:
//             back to 0 once all N have arrived, ready for the next launch
//             on the stream), adds the N samples' partial sums, its rank-0
//             CTA as a whole (gn::segment_sums: a fixed order):
//             dweight_c = sum B, dbias_c = sum A.
//
// Every sum has an order fixed by the shape (which cluster is last does
// not change the order it adds in), so results are bit-identical run to
// run; no float atomics.  grad_in must not overlap x or grad_out (the host
// checks it).  Dynamic shared memory (_group_norm._cluster_geometry): the x
// and grad_out tiles (R * SC elements each, 16-byte rounded), two slot
// arrays of lanes * SC Acc, cta_chan (2 * SC Acc), cta_group and the
// coefficients (2 * GS Acc each), the ticket's verdict (an int).
// blockDim.x = lanes * cols, 32 <= blockDim.x <= 256.
template <typename T, typename W, int ACT, int VEC, int CL>
__global__ void DWGN_CLUSTER_DIMS(CL) __launch_bounds__(256, 1) dwgn_gn_bwd_cluster(
    const T* __restrict__ grad_out, const T* __restrict__ x, const typename AccType<T>::type* __restrict__ mean,
    const typename AccType<T>::type* __restrict__ rstd, const W* __restrict__ weight, const W* __restrict__ bias,
    typename AccType<T>::type* __restrict__ partial, unsigned int* __restrict__ tickets, W* __restrict__ grad_weight,
    W* __restrict__ grad_bias, T* __restrict__ grad_in, int N, int S, int C, int G, int set_channels,
    int rows_per_cta) {
  using Acc = typename AccType<T>::type;
  using V = gn::Vec<T, VEC>;
#if __CUDA_ARCH__ < 900
  __trap();  // no clusters before sm_90
#else
  extern __shared__ __align__(16) unsigned char cluster_shared[];
  const gn::ClusterTile P(CL, S, C, G, set_channels, rows_per_cta, VEC);
  const int SC = P.SC, D = P.D, GS = P.GS, cols = P.cols, lanes = P.lanes, lane = P.lane, col = P.col;
  const int c_local = P.c_local, n = P.n, set = P.set, c0 = P.c0, rows = P.rows, first = P.first;
  const bool active = P.active;
  const unsigned rank = P.rank;
  const int tile_bytes = (rows_per_cta * SC * static_cast<int>(sizeof(T)) + 15) & ~15;
  V* const x_tile = reinterpret_cast<V*>(cluster_shared);
  V* const dy_tile = reinterpret_cast<V*>(cluster_shared + tile_bytes);
  Acc* const slots = reinterpret_cast<Acc*>(cluster_shared + 2 * tile_bytes);
  const int slot_stride = lanes * SC;
  Acc* const cta_chan = slots + 2 * slot_stride;  // A (SC), then B (SC)
  Acc* const cta_group = cta_chan + 2 * SC;       // sum w A (GS), then sum w B (GS)
  Acc* const coef = cta_group + 2 * GS;           // rstd c1 / (S D) (GS), then rstd^2 c2 / (S D) (GS)
  int* const last = reinterpret_cast<int*>(coef + 2 * GS);
  const int row_vectors = C / VEC;

  // ---- load both tiles.
  if (active) {
    const V* x_source = reinterpret_cast<const V*>(x + first) + col;
    const V* dy_source = reinterpret_cast<const V*>(grad_out + first) + col;
    for (int r = lane; r < rows; r += lanes) {
      dwgn::cp_async<16>(x_tile + r * cols + col, x_source + r * row_vectors);
      dwgn::cp_async<16>(dy_tile + r * cols + col, dy_source + r * row_vectors);
    }
  }
  dwgn::cp_async_commit();
  dwgn::cp_async_wait_all();
  __syncthreads();  // the tiles are read by other threads than the ones that copied them

  // ---- per-channel sums of the CTA's rows, then per group.
  // Where T is Acc (float, double) dz replaces grad_out in its tile, exactly,
  // and the dx pass reads it back instead of evaluating act' again (whose
  // IEEE exp and division dominate these types' time with an activation).
  constexpr bool kKeepDz = sizeof(T) == sizeof(Acc) && ACT != gn::kIdentity;
  gn::BwdLane<T, ACT, VEC> sums;
  if (active) {
    sums.load(mean, rstd, weight, bias, n, G, D, c0 + c_local);
    for (int r = lane; r < rows; r += lanes) {
      if constexpr (kKeepDz) {
        sums.add_keeping_dz(x_tile[r * cols + col], dy_tile[r * cols + col]);
      } else {
        sums.add(x_tile[r * cols + col], dy_tile[r * cols + col]);
      }
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      slots[lane * SC + c_local + k] = sums.a[k];
      slots[slot_stride + lane * SC + c_local + k] = sums.b_sum[k];
    }
  }
  __syncthreads();
  for (int c = threadIdx.x; c < SC; c += blockDim.x) {
    Acc a = Acc(0), b = Acc(0);
    for (int l = 0; l < lanes; ++l) {
      a += slots[l * SC + c];
      b += slots[slot_stride + l * SC + c];
    }
    cta_chan[c] = a;
    cta_chan[SC + c] = b;
  }
  __syncthreads();
  {
    // Whole warps only (the butterfly's full mask; blockDim.x >= 32).
    const int warp = threadIdx.x >> 5, lane32 = threadIdx.x & 31;
    const int warps = static_cast<int>(blockDim.x) >> 5;
    for (int q = warp; warp < warps && q < GS; q += warps) {
      Acc a = Acc(0), b = Acc(0);
      for (int d = lane32; d < D; d += 32) {
        const int c = q * D + d;
        const Acc w = weight != nullptr ? to_acc(weight[c0 + c]) : Acc(1);
        a += w * cta_chan[c];
        b += w * cta_chan[SC + c];
      }
      a = dwgn::warp_sum(a);
      b = dwgn::warp_sum(b);
      if (lane32 == 0) {
        cta_group[q] = a;
        cta_group[GS + q] = b;
      }
    }
  }
  gn::cluster_sync();  // every CTA's cta_chan and cta_group are written

  // ---- over the cluster, in rank order: the dx coefficients; rank 0 the
  // sample's per-channel sums for the weight gradients.
  const Acc inv_count = Acc(1) / (Acc(S) * Acc(D));
  for (int q = threadIdx.x; q < GS; q += blockDim.x) {
    Acc c[2];
    gn::cluster_sums<CL>(cta_group + q, GS, c);
    const Acc rs = rstd[static_cast<long long>(n) * G + c0 / D + q];
    coef[q] = rs * c[0] * inv_count;
    coef[GS + q] = rs * (rs * c[1] * inv_count);
  }
  const bool weights = grad_weight != nullptr || grad_bias != nullptr;
  if (weights && rank == 0) {
    for (int c = threadIdx.x; c < SC; c += blockDim.x) {
      Acc t[2];
      gn::cluster_sums<CL>(cta_chan + c, SC, t);
      partial[static_cast<long long>(n) * 2 * C + c0 + c] = t[0];
      partial[static_cast<long long>(n) * 2 * C + C + c0 + c] = t[1];
    }
  }
  gn::cluster_arrive();  // this CTA is done reading the others' shared memory
  __syncthreads();       // coef

  // ---- dx, from the tiles.
  if (active) {
    Acc c1[VEC], c2[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      c1[k] = coef[(c_local + k) / D];
      c2[k] = coef[GS + (c_local + k) / D];
    }
    V* dest = reinterpret_cast<V*>(grad_in + first) + col;
    for (int r = lane; r < rows; r += lanes) {
      const V xv = x_tile[r * cols + col];
      const V dyv = dy_tile[r * cols + col];
      V out;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const Acc centered = to_acc(xv.v[k]) - sums.m[k];
        Acc dz = to_acc(dyv.v[k]);  // dz itself where kKeepDz
        if (ACT != gn::kIdentity && !kKeepDz) {
          dz *= gn::activation_grad<ACT, gn::fast_activation<T>()>(centered * sums.scale[k] + sums.b[k]);
        }
        out.v[k] = from_acc<T>(sums.scale[k] * dz - c1[k] - centered * c2[k]);
      }
      dest[r * row_vectors] = out;
    }
  }

  // ---- weight gradients of set k: the last of its N clusters adds the
  // samples' partial sums (the ticket pattern of dwgn::grid_barrier: the
  // block's writes ordered before thread 0's fence and atomic).
  if (weights && rank == 0) {  // cluster-uniform
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      const unsigned before = atomicInc(tickets + set, static_cast<unsigned>(N - 1));
      __threadfence();
      *last = before == static_cast<unsigned>(N - 1);
    }
    __syncthreads();
    if (*last) {  // CTA-uniform; the slots are free (scratch: 2 * blockDim.x <= 2 * slot_stride Acc)
      // The whole CTA over the N samples (N may be large: many small
      // samples): blockDim.x / SC threads per channel, then in order.
      gn::segment_sums<2, Acc>(
          SC, N, slots,
          [&](int c, int m, Acc* v) {
            v[0] = __ldcg(partial + static_cast<long long>(m) * 2 * C + c0 + c);
            v[1] = __ldcg(partial + static_cast<long long>(m) * 2 * C + C + c0 + c);
          },
          [&](int c, const Acc (&t)[2]) {
            if (grad_weight != nullptr) grad_weight[c0 + c] = from_acc<W>(t[1]);
            if (grad_bias != nullptr) grad_bias[c0 + c] = from_acc<W>(t[0]);
          });
    }
  }
  gn::cluster_wait();  // no CTA leaves while another may still read its sums
#endif
}

// ---------------------------------------------------------------------------
// Small groups: a warp per (sample n, group g) item (item w = n * G + g),
// for shapes whose groups hold few elements (count = S * D; many samples of
// few rows, (N, C) inputs), where a block or cluster per (sample, set) would
// wait on its barriers for a handful of elements each.  The group's elements
// are read from global memory in each pass (from L1 / L2 after the first);
// element i of the group is row i / D, channel i % D.  Host rule:
// _group_norm._small_serves.  N * S * C < 2**31 (int offsets); count < 2**22
// (gn::small_div).
namespace gn {
struct SmallGroup {
  int item, lane, n, g, D, count, base;  // base: the group's first element (row 0, channel g * D)
  bool valid;                            // warp-uniform: the grid's last warps may hold no item
  __device__ __forceinline__ SmallGroup(int N, int S, int C, int G) {
    item = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    lane = threadIdx.x & 31;
    valid = item < N * G;
    n = item / G;
    g = item - n * G;
    D = C / G;
    count = S * D;
    base = n * S * C + g * D;
  }
  // Offset of element i from base (row i / D, channel i % D).
  __device__ __forceinline__ int at(int i, int C, float inv_d) const {
    const int s = dwgn::small_div(i, inv_d);
    return s * C + (i - s * D);
  }
};
}  // namespace gn

// Forward: the group's mean (pass 1, double across lanes), sums about it
// rounded to Acc (pass 2: the two-pass variance of the cluster forward), y as
// gn::apply_tile forms it (pass 3).  x and y may be the same array (a warp
// writes only its group, after reading it).  blockDim.x a multiple of 32.
template <typename T, typename W, int ACT>
__global__ void __launch_bounds__(256, 1) dwgn_gn_fwd_small(
    const T* x, const W* __restrict__ weight, const W* __restrict__ bias,
    typename AccType<T>::type* __restrict__ mean_out, typename AccType<T>::type* __restrict__ rstd_out, T* y, int N,
    int S, int C, int G, typename AccType<T>::type eps) {
  using Acc = typename AccType<T>::type;
  const gn::SmallGroup P(N, S, C, G);
  if (!P.valid) return;  // whole warps: no shuffle below misses a lane
  const float inv_d = 1.0f / static_cast<float>(P.D);
  const T* xg = x + P.base;
  Acc sum = Acc(0);
  for (int i = P.lane; i < P.count; i += 32) sum += to_acc(xg[P.at(i, C, inv_d)]);
  const double count = static_cast<double>(P.count);
  const Acc shift = static_cast<Acc>(dwgn::warp_sum(static_cast<double>(sum)) / count);
  Acc sd = Acc(0), sdd = Acc(0);
  for (int i = P.lane; i < P.count; i += 32) {
    const Acc d = to_acc(xg[P.at(i, C, inv_d)]) - shift;
    sd += d;
    sdd += d * d;
  }
  const double total_d = dwgn::warp_sum(static_cast<double>(sd));
  const double total_dd = dwgn::warp_sum(static_cast<double>(sdd));
  const double mean = static_cast<double>(shift) + total_d / count;
  const double var = gn::centered_square_sum(total_d, total_dd, count) / count;
  const double rstd = 1.0 / sqrt(var + static_cast<double>(eps));
  if (P.lane == 0) {
    mean_out[P.item] = static_cast<Acc>(mean);
    rstd_out[P.item] = static_cast<Acc>(rstd);
  }
  const Acc hi = static_cast<Acc>(mean), rstd_acc = static_cast<Acc>(rstd);
  const double lo = mean - static_cast<double>(hi);  // exact
  T* yg = y + P.base;
  for (int i = P.lane; i < P.count; i += 32) {
    const int s = dwgn::small_div(i, inv_d);
    const int d = i - s * P.D, e = s * C + d, c = P.g * P.D + d;
    const Acc scale = weight != nullptr ? rstd_acc * to_acc(weight[c]) : rstd_acc;
    const Acc b = bias != nullptr ? to_acc(bias[c]) : Acc(0);
    const Acc offset = static_cast<Acc>(static_cast<double>(b) - lo * static_cast<double>(scale));
    const Acc z = (to_acc(xg[e]) - hi) * scale + offset;
    yg[e] = from_acc<T>(gn::activation<ACT, gn::fast_activation<T>()>(z));
  }
}

// Backward: per channel of the group, A = sum dz and B = sum dz * xhat over
// the S rows (the arithmetic of gn::BwdLane): K = max(1, 32 / D) lanes per
// channel (lane = r * min(D, 32) + d: channel d, rows r, r + K, ...; for D
// >= 32 a lane walks channels d, d + 32, ...), the K row slots added in
// order through shared memory; written to partial (N, 2, C) Acc for the
// weight gradients (dwgn_gn_bwd_weights); the dx coefficients from sum_c w_c
// A_c and sum_c w_c B_c (a butterfly), then dx element by element (dz
// recomputed).  grad_in must not overlap x or grad_out (the host checks
// it).  blockDim.x = 256.
template <typename T, typename W, int ACT>
__global__ void __launch_bounds__(256, 1) dwgn_gn_bwd_small(
    const T* __restrict__ grad_out, const T* __restrict__ x, const typename AccType<T>::type* __restrict__ mean,
    const typename AccType<T>::type* __restrict__ rstd, const W* __restrict__ weight, const W* __restrict__ bias,
    typename AccType<T>::type* __restrict__ partial, T* __restrict__ grad_in, int N, int S, int C, int G) {
  using Acc = typename AccType<T>::type;
  __shared__ Acc row_slots[8][2][32];  // a warp's lanes' channel sums (K > 1)
  const gn::SmallGroup P(N, S, C, G);
  if (!P.valid) return;  // whole warps: no shuffle or __syncwarp below misses a lane
  const int D = P.D, lane = P.lane, c0 = P.g * D;
  const int warp = threadIdx.x >> 5;
  const Acc m = mean[P.item], r = rstd[P.item];
  const T* xg = x + P.base;
  const T* dyg = grad_out + P.base;
  const int width = min(D, 32), K = max(1, 32 / D);
  const int d0 = lane % width, r0 = lane / width;
  Acc wa = Acc(0), wb = Acc(0);  // this lane's share of sum_c w_c A_c, sum_c w_c B_c
  // K > 1: one channel per lane (d0 < D), one trip, so __syncwarp is reached by all.
  for (int d = d0; d < D; d += width) {
    const int c = c0 + d;
    const Acc w = weight != nullptr ? to_acc(weight[c]) : Acc(1);
    const Acc scale = r * w;
    const Acc b = bias != nullptr ? to_acc(bias[c]) : Acc(0);
    Acc a = Acc(0), bsum = Acc(0);
    if (r0 < K) {
      for (int s = r0; s < S; s += K) {
        const int e = s * C + d;
        const Acc centered = to_acc(xg[e]) - m;
        Acc dz = to_acc(dyg[e]);
        if (ACT != gn::kIdentity) dz *= gn::activation_grad<ACT, gn::fast_activation<T>()>(centered * scale + b);
        a += dz;
        bsum += dz * (centered * r);
      }
    }
    if (K > 1) {  // warp-uniform
      row_slots[warp][0][lane] = a;
      row_slots[warp][1][lane] = bsum;
      __syncwarp();
      if (r0 == 0) {
        a = bsum = Acc(0);
        for (int j = 0; j < K; ++j) {
          a += row_slots[warp][0][j * D + d0];
          bsum += row_slots[warp][1][j * D + d0];
        }
      }
      __syncwarp();
    }
    if (r0 == 0) {
      partial[static_cast<long long>(P.n) * 2 * C + c] = a;
      partial[static_cast<long long>(P.n) * 2 * C + C + c] = bsum;
      wa += w * a;
      wb += w * bsum;
    }
  }
  const Acc inv_count = Acc(1) / (Acc(S) * Acc(D));
  const Acc k1 = r * dwgn::warp_sum(wa) * inv_count;
  const Acc k2 = r * (r * dwgn::warp_sum(wb) * inv_count);
  const float inv_d = 1.0f / static_cast<float>(D);
  T* dxg = grad_in + P.base;
  for (int i = lane; i < P.count; i += 32) {
    const int s = dwgn::small_div(i, inv_d);
    const int d = i - s * D, e = s * C + d, c = c0 + d;
    const Acc scale = weight != nullptr ? r * to_acc(weight[c]) : r;
    const Acc centered = to_acc(xg[e]) - m;
    Acc dz = to_acc(dyg[e]);
    if (ACT != gn::kIdentity) {
      const Acc b = bias != nullptr ? to_acc(bias[c]) : Acc(0);
      dz *= gn::activation_grad<ACT, gn::fast_activation<T>()>(centered * scale + b);
    }
    dxg[e] = from_acc<T>(scale * dz - k1 - centered * k2);
  }
}

// The weight gradients from per-sample channel sums: partial (N, 2, C) Acc
// (A = sum dz, B = sum dz * xhat), dweight_c = sum_n B, dbias_c = sum_n A
// (each written when its pointer is not null).  A block of 1024 threads per
// 32 channels: lane = channel (coalesced), warp j adds samples j, j + 32,
// ... (kFinalizeBatch loads in flight), then the 32 warps in order.
template <typename Acc, typename W>
__global__ void __launch_bounds__(1024) dwgn_gn_bwd_weights(const Acc* __restrict__ partial,
                                                            W* __restrict__ grad_weight, W* __restrict__ grad_bias,
                                                            int N, int C) {
  __shared__ Acc warp_sums[2][32][33];
  if (grad_weight == nullptr && grad_bias == nullptr) return;  // grid-uniform
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int c = blockIdx.x * 32 + lane;
  Acc a = Acc(0), b = Acc(0);
  if (c < C) {
    gn::batched_walk<gn::kFinalizeBatch>(
        warp, N, warps,
        [&](long long n) {
          gn::Vec<Acc, 2> v;
          v.v[0] = partial[n * 2 * C + c];
          v.v[1] = partial[n * 2 * C + C + c];
          return v;
        },
        [&](const gn::Vec<Acc, 2>& v) {
          a += v.v[0];
          b += v.v[1];
        });
  }
  warp_sums[0][warp][lane] = a;
  warp_sums[1][warp][lane] = b;
  __syncthreads();
  if (warp == 0 && c < C) {
    a = b = Acc(0);
    for (int j = 0; j < warps; ++j) {
      a += warp_sums[0][j][lane];
      b += warp_sums[1][j][lane];
    }
    if (grad_weight != nullptr) grad_weight[c] = from_acc<W>(b);
    if (grad_bias != nullptr) grad_bias[c] = from_acc<W>(a);
  }
}
