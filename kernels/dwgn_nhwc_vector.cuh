// Channel-vector helpers of the NHWC kernels (depthwise_nhwc.cu,
// depthwise_nhwc_phase.cu): 16-byte (VEC-element) loads and stores
// converted to/from the accumulator type, shared-memory accumulator vectors,
// zero-padded column loads, and a block's contiguous item range.
// Inlined by cupy_dwgn._compile like dwgn_common.cuh; include it after that
// header (it uses dwgn::to_acc / dwgn::from_acc and includes nothing itself).
#pragma once

namespace dwnhwc {

// VEC elements loaded/stored as one 16-byte (or smaller, for VEC = 1) access.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// VEC accumulators read from shared memory as 16-byte accesses.
template <typename Acc, int VEC>
struct alignas(sizeof(Acc) * VEC > 16 ? 16 : sizeof(Acc) * VEC) AccVec {
  Acc v[VEC];
};

template <int VEC, typename T, typename Acc>
__device__ __forceinline__ void load_vec(const T* p, Acc (&a)[VEC]) {
  const Pack<T, VEC> pk = *reinterpret_cast<const Pack<T, VEC>*>(p);
#pragma unroll
  for (int v = 0; v < VEC; ++v) a[v] = dwgn::to_acc(pk.v[v]);
}

// load_vec, with bfloat16 widened by bit operations (dwgn::half_of_word: one
// instruction per element where the conversion spends two on the high one,
// extract then shift, and a register to hold it).  The tiled conv and the
// phase kernel use it: NVRTC 13.0 left 8 bytes in local memory in their
// bfloat16 7x7 stride-2 (64-bit indices, sm_90) and 5x5 (64-bit indices,
// sm_80) specializations, which sit at their register caps (80 and 128).  Elsewhere load_vec stays: there the
// change moved ptxas's register counts both ways, across occupancy steps.
template <int VEC, typename T, typename Acc>
__device__ __forceinline__ void load_vec_bits(const T* p, Acc (&a)[VEC]) {
  load_vec<VEC>(p, a);
}

template <int VEC>
__device__ __forceinline__ void load_vec_bits(const __nv_bfloat16* p, float (&a)[VEC]) {
  if constexpr (VEC % 2 == 0) {
    const Pack<unsigned int, VEC / 2> pk = *reinterpret_cast<const Pack<unsigned int, VEC / 2>*>(p);
#pragma unroll
    for (int v = 0; v < VEC / 2; ++v) {
      a[2 * v] = dwgn::half_of_word(__nv_bfloat16(), pk.v[v], 0);
      a[2 * v + 1] = dwgn::half_of_word(__nv_bfloat16(), pk.v[v], 1);
    }
  } else {
    load_vec<VEC>(p, a);
  }
}

template <int VEC, typename T, typename Acc>
__device__ __forceinline__ void store_vec(T* p, const Acc (&a)[VEC]) {
  Pack<T, VEC> pk;
#pragma unroll
  for (int v = 0; v < VEC; ++v) pk.v[v] = dwgn::from_acc<T>(a[v]);
  *reinterpret_cast<Pack<T, VEC>*>(p) = pk;
}

template <int VEC, typename Acc>
__device__ __forceinline__ AccVec<Acc, VEC> load_shared(const Acc* p) {
  return *reinterpret_cast<const AccVec<Acc, VEC>*>(p);
}

// The VEC values at p as stored, or zero bits (+0.0 in every type) when !ok;
// p is read only when ok.  Loading a batch of these before converting any
// keeps the batch's loads in flight together (a load whose conversion sits
// in the same branch is waited on before the next load issues).
template <int VEC, typename T>
__device__ __forceinline__ Pack<T, VEC> load_pack_or_zero(const T* p, bool ok) {
  Pack<T, VEC> pk;
  if (ok) {
    pk = *reinterpret_cast<const Pack<T, VEC>*>(p);
  } else {
#pragma unroll
    for (int v = 0; v < VEC; ++v) pk.v[v] = dwgn::from_acc<T>(typename dwgn::AccType<T>::type(0));
  }
  return pk;
}

// Column iw of an input row, or zeros outside [0, width) (padding); BITS:
// loaded with load_vec_bits.
template <int VEC, typename T, typename Acc, typename IndexT, bool BITS = false>
__device__ __forceinline__ void load_or_zero(Acc (&a)[VEC], const T* row, int iw, int width,
                                             int channels) {
  if (iw >= 0 && iw < width) {
    if constexpr (BITS) {
      load_vec_bits<VEC>(row + static_cast<IndexT>(iw) * channels, a);
    } else {
      load_vec<VEC>(row + static_cast<IndexT>(iw) * channels, a);
    }
  } else {
#pragma unroll
    for (int v = 0; v < VEC; ++v) a[v] = Acc(0);
  }
}

// This block's contiguous range [begin, end) of `items`; blocks of equal
// share (the last may be short or empty).
template <typename IndexT>
__device__ __forceinline__ void block_range(IndexT items, IndexT per_block, IndexT& begin,
                                            IndexT& end) {
  begin = static_cast<IndexT>(blockIdx.y) * per_block;
  end = items - begin > per_block ? begin + per_block : items;
}

}  // namespace dwnhwc
