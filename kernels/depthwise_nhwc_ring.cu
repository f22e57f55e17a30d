// Depthwise 2-D convolution, channels-last (NHWC): the row-ring kernel, for
// 3x3 filters at stride 1 or 2 (forward; stride-1 backward-input as the
// forward correlation with the rotated filter) and 5x5 forward at stride 2,
// dilation 1, depth multiplier 1, float32, float16 and bfloat16, on rows
// whose channels fit one block.
//
// Why a kernel of its own: in NHWC a whole input row (W pixels x C channels)
// is one contiguous run of memory.  The window kernel (depthwise_nhwc_window.cu)
// stages tiles with one 16-byte cp.async per thread per pixel half, and on
// 56x56 half-type 3x3 a fifth of its instructions and of its stall samples
// were that copy loop, another fifth the barrier after each tile's wait (ncu,
// benchmarks/results/ncu_nhwc_window_h200_2026-12-02.txt); the direct kernels
// re-read each input row K times through L1.  Here each input row is copied
// once, whole, into a ring of shared-memory rows by one bulk copy (sm_90:
// cp.async.bulk, completing on the slot's mbarrier; older GPUs: every thread
// copies 16-byte pieces with cp.async and arrives on the mbarrier when they
// land), several rows ahead of the rows being computed, so the threads spend
// their issue slots on the FMAs.
//
// * A block walks a contiguous range of output rows of the flattened (image,
//   output row) sequence, 1/gridDim.x of them (persistent grid: as many
//   blocks as fit at once).  Its input stream is, per image it touches, the
//   input rows its output rows read, in order; entry q of the stream goes to
//   ring slot q % ring, whose mbarrier completes one phase per entry.  Rows
//   in the vertical padding take an entry whose barrier arrives with no copy;
//   the compute skips them.
// * Thread t: channel vector cv = t % (C / 4) (4 channels: 16 bytes of
//   float32, 8 of a half type), column group t / (C / 4); for each output
//   row it computes strips of TW output columns, strip = column group +
//   k * column groups.  Its K x K x 4 taps (and bias) stay in registers for the
//   whole kernel.  Inputs are read from the ring as 4-channel vectors; the
//   slot's padding columns (left of column 0 and right of the last) are
//   zeroed once and never written by the copies.
// * After each output row the block syncs once (every thread is done with
//   the entries only that row needed), then refills the freed slots.
//
// Template parameters: T; K (3, 5); S (1, 2); TW output columns per strip;
// BACKWARD (stride 1: src = grad_out, dst = grad_in, filter rotated, offsets
// K - 1 - pad); IndexT (int, or long long when a tensor has >= 2**31
// elements: global offsets use it).  Scalar bulk: 1 copies by cp.async.bulk
// where the GPU has it (sm_90+), 0 by the block's cp.async pieces everywhere
// (the tests run both on an sm_90 GPU).  The host (cupy_dwgn/_depthwise_nhwc_ring.py)
// picks the ring, the column groups and the grid; it requires C * sizeof(T)
// % 16 == 0, 16-byte aligned arrays, C / 4 <= 512 (5x5: 256) and rows under 1 MB.

#include "dwgn_common.cuh"
#include "dwgn_nhwc_vector.cuh"

namespace dwgn_nhwc_ring {

__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void barrier_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void barrier_arrive(unsigned long long* bar) {
  asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.shared.b64 state, [%0];\n}" ::"r"(shared_address(bar))
               : "memory");
}

// Spin until the barrier's phase of the given parity has completed.
__device__ __forceinline__ void barrier_wait(unsigned long long* bar, unsigned parity) {
  const unsigned address = shared_address(bar);
  unsigned done;
  do {
#if __CUDA_ARCH__ >= 900
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(address), "r"(parity) : "memory");
#else
    asm volatile("{\n .reg .pred p;\n mbarrier.test_wait.parity.shared.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(address), "r"(parity) : "memory");
#endif
  } while (!done);
}

// One thread: copy `bytes` (a multiple of 16, < 2**20) from global memory to
// shared memory as one bulk copy that completes the barrier's current phase
// (whose arrival count is 1).  sm_90 and later.
__device__ __forceinline__ void bulk_copy(void* dst_shared, const void* src, unsigned bytes, unsigned long long* bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   shared_address(dst_shared)),
               "l"(src), "r"(bytes), "r"(shared_address(bar))
               : "memory");
#else
  __trap();
#endif
}

// Every thread of the block: its 16-byte pieces of the same copy by cp.async,
// then an arrival (counted in the barrier's blockDim.x) that lands when they have.
__device__ __forceinline__ void block_copy(void* dst_shared, const void* src, unsigned bytes, unsigned long long* bar) {
  const unsigned dst = shared_address(dst_shared);
  const char* from = static_cast<const char*>(src);
  for (unsigned offset = threadIdx.x * 16u; offset < bytes; offset += blockDim.x * 16u)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + offset), "l"(from + offset) : "memory");
  asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];" ::"r"(shared_address(bar)) : "memory");
}

// The input stream of a block: per image its output rows touch (a segment),
// the input rows those outputs read, (rows - 1) * S + K of them.
template <int K, int S>
struct Segment {
  int n, first_oh, rows;
  __device__ __forceinline__ Segment(int row, int row_end, int dst_h)
      : n(row / dst_h), first_oh(row - n * dst_h), rows(min(dst_h - first_oh, row_end - row)) {}
  __device__ __forceinline__ int length() const { return (rows - 1) * S + K; }
  __device__ __forceinline__ void next(int& row, int row_end, int dst_h) {
    row += rows;
    ++n;
    first_oh = 0;
    rows = min(dst_h, row_end - row);
  }
};

}  // namespace dwgn_nhwc_ring

// 5x5: 25 x 4 taps in registers (158-182 in all), so at most 256 threads
// (under 512 the 128-register cap spilled them).
template <typename T, int K, int S, int TW, bool BACKWARD, typename IndexT>
__global__ void __launch_bounds__(K == 3 ? 512 : 256) dwgn_dwconv_nhwc_ring(
    const T* __restrict__ src, const T* __restrict__ weight, const T* __restrict__ bias, T* __restrict__ dst,
    int src_h, int src_w, int dst_h, int dst_w, int channels, int offset_top, int offset_left, int lead,
    int slot_pixels, int ring, int total_rows, int bulk) {
  using namespace dwgn_nhwc_ring;
  using dwgn::to_acc;
  constexpr int VEC = 4;
  constexpr int IW = (TW - 1) * S + K;  // slot columns a strip reads per filter row
  extern __shared__ __align__(16) unsigned char shared_raw[];
  unsigned long long* bars = reinterpret_cast<unsigned long long*>(shared_raw);
  T* slots = reinterpret_cast<T*>(shared_raw + (ring * 8 + 15) / 16 * 16);
  const int slot_elements = slot_pixels * channels;
  const int row_elements = src_w * channels;
  const int lead_elements = lead * channels;
  const unsigned row_bytes = static_cast<unsigned>(row_elements) * sizeof(T);
#if __CUDA_ARCH__ >= 900
  const bool use_bulk = bulk != 0;
#else
  const bool use_bulk = false;  // no bulk copies before sm_90
#endif

  const int vectors = channels / VEC;
  const int cv = threadIdx.x % vectors;
  const int column_group = threadIdx.x / vectors;
  const int column_groups = blockDim.x / vectors;
  const int c = cv * VEC;
  const int strips = (dst_w + TW - 1) / TW;
  const int row_begin = static_cast<int>(static_cast<long long>(blockIdx.x) * total_rows / gridDim.x);
  const int row_end = static_cast<int>(static_cast<long long>(blockIdx.x + 1) * total_rows / gridDim.x);

  // Zero every slot's padding columns (16-byte pieces: C * sizeof(T) % 16 == 0).
  {
    const int pad_pieces = (slot_elements - row_elements) * static_cast<int>(sizeof(T)) / 16;
    const int lead_pieces = lead_elements * static_cast<int>(sizeof(T)) / 16;
    for (int i = threadIdx.x; i < ring * pad_pieces; i += blockDim.x) {
      const int slot = i / pad_pieces;
      const int piece = i - slot * pad_pieces;
      uint4* base = reinterpret_cast<uint4*>(slots + slot * slot_elements);
      base[piece < lead_pieces ? piece : piece + static_cast<int>(row_bytes / 16)] = make_uint4(0, 0, 0, 0);
    }
  }
  if (threadIdx.x == 0)
    for (int slot = 0; slot < ring; ++slot) barrier_init(bars + slot, use_bulk ? 1u : blockDim.x);
#if __CUDA_ARCH__ >= 900
  // The barriers' initialization and the zeroed columns, visible to the bulk copies (the async proxy).
  asm volatile("fence.mbarrier_init.release.cluster;\n fence.proxy.async.shared::cta;" ::: "memory");
#endif
  __syncthreads();

  float w[K * K][VEC];
  float bias_v[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
#pragma unroll
    for (int tap = 0; tap < K * K; ++tap)
      w[BACKWARD ? K * K - 1 - tap : tap][v] = to_acc(weight[(c + v) * (K * K) + tap]);
    bias_v[v] = (!BACKWARD && bias != nullptr) ? to_acc(bias[c + v]) : 0.0f;
  }

  // Producer: issues stream entries [issued, limit); every thread walks the
  // same cursor (only thread 0 copies in bulk mode).
  int produce_row = row_begin;
  Segment<K, S> produce(row_begin, row_end, dst_h);
  int produce_local = 0, issued = 0;
  auto issue_until = [&](int limit) {
    while (issued < limit && produce_row < row_end) {
      const int ih = produce.first_oh * S - offset_top + produce_local;
      const int slot = issued % ring;
      unsigned long long* bar = bars + slot;
      if (ih >= 0 && ih < src_h) {
        const T* row = src + (static_cast<IndexT>(produce.n) * src_h + ih) * static_cast<IndexT>(row_elements);
        T* to = slots + slot * slot_elements + lead_elements;
        if (!use_bulk)
          block_copy(to, row, row_bytes, bar);
        else if (threadIdx.x == 0)
          bulk_copy(to, row, row_bytes, bar);
      } else if (!use_bulk || threadIdx.x == 0) {
        barrier_arrive(bar);
      }
      ++issued;
      if (++produce_local == produce.length()) {
        produce.next(produce_row, row_end, dst_h);
        produce_local = 0;
      }
    }
  };
  issue_until(ring);

  int consume_row = row_begin;
  Segment<K, S> consume(row_begin, row_end, dst_h);
  int segment_q0 = 0;  // stream index of the consumed segment's first entry
  for (int row = row_begin; row < row_end; ++row) {
    const int r = row - consume_row;  // output row within the segment
    const int oh = consume.first_oh + r;
    const int q_first = segment_q0 + r * S;
#pragma unroll
    for (int kh = 0; kh < K; ++kh) {
      const int q = q_first + kh;
      barrier_wait(bars + q % ring, static_cast<unsigned>(q / ring) & 1u);
    }
    T* out_row = dst + static_cast<IndexT>(row) * dst_w * channels + c;
    for (int strip = column_group; strip < strips; strip += column_groups) {
      const int ow0 = strip * TW;
      float acc[TW][VEC];
#pragma unroll
      for (int t = 0; t < TW; ++t)
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[t][v] = bias_v[v];
#pragma unroll
      for (int kh = 0; kh < K; ++kh) {
        const int ih = oh * S - offset_top + kh;
        if (ih < 0 || ih >= src_h) continue;  // zero padding adds nothing
        const T* in = slots + ((q_first + kh) % ring) * slot_elements + (ow0 * S - offset_left + lead) * channels + c;
        dwnhwc::Pack<T, VEC> raw[IW];
#pragma unroll
        for (int e = 0; e < IW; ++e) raw[e] = *reinterpret_cast<const dwnhwc::Pack<T, VEC>*>(in + e * channels);
#pragma unroll
        for (int e = 0; e < IW; ++e) {
          float x[VEC];
#pragma unroll
          for (int v = 0; v < VEC; ++v) x[v] = to_acc(raw[e].v[v]);
#pragma unroll
          for (int kw = 0; kw < K; ++kw) {
            // column e feeds output t where e = t * S + kw
            if ((e - kw) % S != 0) continue;
            const int t = (e - kw) / S;
            if (t < 0 || t >= TW) continue;
#pragma unroll
            for (int v = 0; v < VEC; ++v) acc[t][v] = fma(w[kh * K + kw][v], x[v], acc[t][v]);
          }
        }
      }
#pragma unroll
      for (int t = 0; t < TW; ++t)
        if (ow0 + t < dst_w) dwnhwc::store_vec<VEC>(out_row + static_cast<IndexT>(ow0 + t) * channels, acc[t]);
    }
    __syncthreads();  // every thread is done with the entries below the next row's first
    int keep;  // oldest stream entry still needed
    if (oh + 1 < consume.first_oh + consume.rows) {
      keep = q_first + S;
    } else {
      segment_q0 += consume.length();
      consume.next(consume_row, row_end, dst_h);
      keep = segment_q0;
    }
    issue_until(keep + ring);
  }
}
