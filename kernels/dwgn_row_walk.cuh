// Helpers of the NCHW register row walks (depthwise_nchw_wgrad_regs.cu,
// depthwise_nchw_forward_regs.cu): raw row vectors of 1-16 bytes held in
// registers, their elements as float, predicated loads, and the integer
// arithmetic of the unrolled walks.  Inlined by cupy_dwgn._compile like
// dwgn_common.cuh; include it after that header (it uses dwgn::half_of_word
// and includes nothing itself).
#pragma once

namespace dwgn_walk {

constexpr int gcd(int a, int b) { return b == 0 ? a : gcd(b, a % b); }
constexpr int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }
constexpr int pos_mod(int a, int b) { return ((a % b) + b) % b; }

__device__ __forceinline__ unsigned word(unsigned short r, int) { return r; }
__device__ __forceinline__ unsigned word(unsigned r, int) { return r; }
__device__ __forceinline__ unsigned word(uint2 r, int w) { return w == 0 ? r.x : r.y; }
__device__ __forceinline__ unsigned word(uint4 r, int w) { return w == 0 ? r.x : w == 1 ? r.y : w == 2 ? r.z : r.w; }

// Half h (0: low, 1: high 16 bits) of a word of two 2-byte values, as
// float, exactly: dwgn::half_of_word, except that bfloat16's shift or mask
// is written as inline PTX here because NVVM otherwise sinks it to the FMAs,
// which keeps the raw registers live across the next step's loads (8
// register copies a step in a bfloat16 3x3 VW 8 weight-gradient walk).
__device__ __forceinline__ float from_half_word(__half, unsigned w, int h) { return dwgn::half_of_word(__half(), w, h); }
__device__ __forceinline__ float from_half_word(__nv_bfloat16, unsigned w, int h) {
  unsigned f;
  if (h) {
    asm("and.b32 %0, %1, 0xffff0000;" : "=r"(f) : "r"(w));
  } else {
    asm("shl.b32 %0, %1, 16;" : "=r"(f) : "r"(w));
  }
  return __uint_as_float(f);
}

// Element i (a compile-time constant after unrolling) of a raw vector of T,
// as float (exact).
template <typename T, typename Raw>
__device__ __forceinline__ float element(const Raw& r, int i) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(word(r, i));
  } else {
    return from_half_word(T(), word(r, i / 2), i & 1);
  }
}

// r = the raw value at p when ok (else p is not read): for 2-byte types r
// keeps its value (no instruction), for float it is zeroed (its register
// is the unpacked value itself: keeping it would copy it first).
template <typename Raw, typename T>
__device__ __forceinline__ void load_if(Raw& r, const T* p, bool ok) {
  if constexpr (sizeof(T) == 4) {
    r = ok ? *reinterpret_cast<const Raw*>(p) : Raw{};
  } else if (ok) {
    r = *reinterpret_cast<const Raw*>(p);
  }
}

}  // namespace dwgn_walk
