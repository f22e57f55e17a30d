// Shared device code for every cupy-dwgn kernel: dtype conversion, index
// types, deterministic warp/block reductions.  This header is inlined into
// each .cu source by cupy_dwgn._compile (CuPy keys its disk cache on the
// source text, so an -I include would not invalidate cached cubins).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace dwgn {

// Accumulation type: half types accumulate in float, float64 in double.
template <typename T> struct AccType { using type = float; };
template <> struct AccType<double> { using type = double; };

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }

// Whether T is bfloat16 (for rules that single it out).
template <typename T> constexpr bool kBfloat16 = false;
template <> constexpr bool kBfloat16<__nv_bfloat16> = true;

// Half `high` (0: the low 16 bits, 1: the high 16) of a 32-bit word holding
// two 2-byte values, as float (exact), for kernels that load raw words and
// unpack them late.  bfloat16 is the high half of a float: a shift or a mask,
// one instruction, where __bfloat162float of the high element spends two
// (extract, then shift).  The first argument only picks the type.
__device__ __forceinline__ float half_of_word(__half, unsigned int w, int high) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(high ? w >> 16 : w & 0xffffu)));
}
__device__ __forceinline__ float half_of_word(__nv_bfloat16, unsigned int w, int high) {
  return __uint_as_float(high ? (w & 0xffff0000u) : (w << 16));
}

// The unsigned type of BYTES bytes: raw storage words loaded or copied as one
// instruction (a vector of elements, before any is converted).
template <int BYTES> struct Bits;
template <> struct Bits<2> { using type = unsigned short; };
template <> struct Bits<4> { using type = unsigned int; };
template <> struct Bits<8> { using type = uint2; };
template <> struct Bits<16> { using type = uint4; };

template <typename T> __device__ __forceinline__ T from_acc(float v);
template <> __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <typename T> __device__ __forceinline__ T from_acc(double v);
template <> __device__ __forceinline__ double from_acc<double>(double v) { return v; }

// Flat grid-stride loops over [0, total) in IndexT.
template <typename IndexT>
__device__ __forceinline__ IndexT global_thread_index() {
  return static_cast<IndexT>(blockIdx.x) * blockDim.x + threadIdx.x;
}
template <typename IndexT>
__device__ __forceinline__ IndexT global_thread_count() {
  return static_cast<IndexT>(gridDim.x) * blockDim.x;
}
// Next index of a grid-stride loop.  `i + stride` may not be representable
// when total is close to the largest IndexT, so the step saturates at total.
template <typename IndexT>
__device__ __forceinline__ IndexT grid_stride_next(IndexT i, IndexT stride, IndexT total) {
  return total - i > stride ? i + stride : total;
}

// Plane-wise launch: grid.y walks the planes (one (n, c) image each) and
// grid.x the elements inside a plane.  In-plane indices stay 32-bit (the host
// checks every plane has < 2**30 elements); only the plane's base offset is
// computed in IndexT (long long when a tensor has >= 2**31 elements), so no
// 64-bit division is ever needed.  Both loops step with grid_stride_next, so a
// count close to 2**31 cannot wrap the int counter.
#define DWGN_FOR_EACH_PLANE(plane, num_planes)                      \
  for (int plane = blockIdx.y; plane < (num_planes);                \
       plane = dwgn::grid_stride_next(plane, static_cast<int>(gridDim.y), (num_planes)))
#define DWGN_FOR_EACH_IN_PLANE(r, plane_size)                                  \
  for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < (plane_size);  \
       r = dwgn::grid_stride_next(r, static_cast<int>(gridDim.x * blockDim.x), (plane_size)))

// q = n / d (inv_d = 1/d rounded to nearest) for 0 <= n < 2**22, 1 <= d: (n + 0.5) / d is at least 0.5/d away
// from an integer, more than the float error (about n * 2**-23 / d).
__device__ __forceinline__ int small_div(int n, float inv_d) {
  return __float2int_rz(__fmaf_rn(static_cast<float>(n), inv_d, 0.5f * inv_d));
}

// A barrier across every block of a cooperative launch (all blocks resident:
// cuLaunchCooperativeKernel refuses a grid that does not fit), in place of
// cooperative_groups::this_grid().sync(): <cooperative_groups.h> costs NVRTC
// about 2.4 s per program (a GroupNorm kernel compiled in 2.7 s with it,
// 0.6 s without).  The grid group's own scheme on a word of ours (the
// per-(device, stream) workspace keeps it: _workspace.GRID_BARRIER; zero
// when made): every block adds 1 but block 0, which adds 2**31 - (blocks -
// 1), so the word's top bit flips exactly when the last block arrives and
// its lower bits are back where they were (zero) for the next barrier; each
// block waits for the flip.  (A count reset by the last block plus a
// separate generation word measured ~1 us slower per barrier at 128 blocks:
// one more dependent round trip to L2.)  Memory: every thread's writes
// before the barrier are visible to every thread of the grid after it
// (bar.sync, then thread 0's fence and atomic; its acquire loads and fence).
__device__ __forceinline__ void grid_barrier(unsigned int* barrier) {
  __syncthreads();  // the block's writes are ordered before thread 0's arrival
  if (threadIdx.x == 0) {
    const unsigned int blocks = gridDim.x * gridDim.y * gridDim.z;
    const bool first = blockIdx.x + blockIdx.y + blockIdx.z == 0;
    const unsigned int add = first ? 0x80000000u - (blocks - 1) : 1u;
    __threadfence();
    unsigned int before, now;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(before) : "l"(barrier), "r"(add) : "memory");
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(barrier) : "memory");
    } while (((before ^ now) & 0x80000000u) == 0);
    __threadfence();
  }
  __syncthreads();  // the whole block waits for thread 0
}

// Programmatic dependent launch (sm_90; cupy_dwgn/_launch.py launches a
// kernel so where its Launch is `programmatic`): the next kernel of the
// stream may start once every block of this one has called
// allow_dependent_grid (or exited), and it calls wait_for_prior_grid before
// its first access to memory that this kernel writes (or reads, where the
// next one writes it): that returns once this grid has completed and its
// writes are visible.  The point is the gap between two dependent launches:
// the next grid's blocks are launched and placed while this one finishes.
// Without the launch attribute both are no-ops (the stream order holds as
// ever); below sm_90 they compile to nothing.
__device__ __forceinline__ void allow_dependent_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Butterfly sum over the 32 lanes of a warp; every lane gets the total.
// The order of additions is fixed, so the result is deterministic.
template <typename Acc>
__device__ __forceinline__ Acc warp_sum(Acc v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

// Sums NUM values across the whole block (blockDim.x a multiple of 32, at
// most 1024).  `scratch` holds NUM * 32 accumulators.  The result is valid in
// thread 0 only.  Every thread of the block must call it (it has barriers).
template <int NUM, typename Acc>
__device__ __forceinline__ void block_sum(Acc (&values)[NUM], Acc* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int num_warps = blockDim.x >> 5;
#pragma unroll
  for (int i = 0; i < NUM; ++i) {
    const Acc v = warp_sum(values[i]);
    if (lane == 0) scratch[i * 32 + warp] = v;
  }
  __syncthreads();  // the per-warp partials are visible to warp 0
  if (warp == 0) {
#pragma unroll
    for (int i = 0; i < NUM; ++i) {
      const Acc v = lane < num_warps ? scratch[i * 32 + lane] : Acc(0);
      values[i] = warp_sum(v);
    }
  }
  __syncthreads();  // scratch may be reused by the caller right after
}

// Asynchronous global -> shared copies (sm_80+), shared by the staging loops
// of every kernel.  cp_async<BYTES> copies BYTES (4, 8 or 16) of which the
// first src_bytes come from gmem and the rest are zero-filled (src_bytes 0:
// all zeros, gmem is not read: a padding cell).  16-byte copies bypass L1
// (.cg); smaller ones can only go through it (.ca).
template <int BYTES>
__device__ __forceinline__ void cp_async(void* smem, const void* gmem, int src_bytes = BYTES) {
  static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async copies 4, 8 or 16 bytes");
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (BYTES == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes)
                 : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(s), "l"(gmem), "n"(BYTES),
                 "r"(src_bytes)
                 : "memory");
  }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed copy groups are in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Bytes from the 16-byte boundary at or below p to p.
__device__ __forceinline__ int head_bytes(const void* p) {
  return static_cast<int>(reinterpret_cast<size_t>(p) & 15);
}

// A block's `count` outputs (one contiguous range of dst), gathered in
// shared memory at stage + head_bytes(dst) (stage 16-byte aligned), to dst:
// 16-byte stores between the first and the last 16-byte boundary of the
// range, element stores outside them.  Shared by the NCHW kernels that
// stage a unit's destination planes.
template <typename T>
__device__ __forceinline__ void store_unit(const unsigned char* stage, T* __restrict__ dst, int count) {
  const int head = head_bytes(dst);
  unsigned char* to = reinterpret_cast<unsigned char*>(dst) - head;
  const int end = head + count * static_cast<int>(sizeof(T));
  for (int o = threadIdx.x * 16; o < end; o += blockDim.x * 16) {
    if (o >= head && o + 16 <= end) {
      *reinterpret_cast<uint4*>(to + o) = *reinterpret_cast<const uint4*>(stage + o);
    } else {
      for (int b = max(o, head); b < min(o + 16, end); b += static_cast<int>(sizeof(T)))
        *reinterpret_cast<T*>(to + b) = *reinterpret_cast<const T*>(stage + b);
    }
  }
}

}  // namespace dwgn
