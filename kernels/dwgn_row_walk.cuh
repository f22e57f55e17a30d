// Helpers of the NCHW register row walks (depthwise_nchw_wgrad_regs.cu,
// depthwise_nchw_forward_regs.cu): raw row vectors of 1-16 bytes held in
// registers, their elements as float, predicated loads, the integer
// arithmetic of the unrolled walks, and a window's halo columns (Halo:
// which lane of the group holds each, the shuffles that fetch them).  Inlined by cupy_dwgn._compile like
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

// The halo of a lane's window in the row walks.  A lane owns VS source
// columns, window columns SH .. SH+VS-1 of its window of VS + NH columns;
// halo h (0 .. NH-1) is window column e = h (h < SH, left) or h + VS
// (right), source column d = e - SH relative to its first own column.  It
// is own column se of lane gl + delta (delta = floor(d / VS)), shuffled
// from there when that lane is in the lane's group of group_lanes, else
// loaded by the lane itself (a row or segment edge; zero outside the row).
template <int SH, int VS, int NH>
struct Halo {
  static_assert(NH >= 1 && NH <= 32, "halo bits");
  static constexpr int column(int h) { return h < SH ? h : h + VS; }  // e
  static constexpr int offset(int h) { return column(h) - SH; }       // d

  // The group's lane mask and the halo columns that come from a lane of
  // the group (bit h), passed through an identity shuffle (every lane of
  // the warp calls this) so that ptxas keeps them in two registers: it
  // recomputed them in the walk (about 20 instructions) to save them.
  static __device__ __forceinline__ void lane_constants(int lane, int group, int gl, int group_lanes,
                                                        unsigned& group_mask, unsigned& from_lane) {
    group_mask = (group_lanes == 32 ? 0xffffffffu : ((1u << group_lanes) - 1u)) << ((group * group_lanes) & 31);
    from_lane = 0;
#pragma unroll
    for (int h = 0; h < NH; ++h) {
      const int from = gl + floor_div(offset(h), VS);
      if (from >= 0 && from < group_lanes) from_lane |= 1u << h;
    }
    group_mask = __shfl_sync(0xffffffffu, group_mask, lane);
    from_lane = __shfl_sync(0xffffffffu, from_lane, lane);
  }

  // The halo columns the lane loads itself (bit h): not from a lane of the
  // group and inside [0, width) (ob: the lane's first own source column).
  static __device__ __forceinline__ unsigned direct(unsigned from_lane, int ob, int width) {
    unsigned bits = 0;
#pragma unroll
    for (int h = 0; h < NH; ++h)
      if (!((from_lane >> h) & 1u) && static_cast<unsigned>(ob + offset(h)) < static_cast<unsigned>(width))
        bits |= 1u << h;
    return bits;
  }

  // Fills the halo columns of xw (whose own columns are set) from the
  // group's lanes, or from direct_value[h] where the lane loaded it.  From
  // lane + delta (delta != 0; no lane index to compute): where that lane is
  // outside the group (another group's lane, or this lane's own value past
  // the warp's edge) the value is not used.
  template <int IW>
  static __device__ __forceinline__ void fill(float (&xw)[IW], unsigned from_lane, unsigned group_mask,
                                              const float (&direct_value)[NH]) {
#pragma unroll
    for (int h = 0; h < NH; ++h) {
      const int delta = floor_div(offset(h), VS);
      const int se = offset(h) - delta * VS;  // column within the source lane's own columns
      const bool inside = (from_lane >> h) & 1u;
      const float shuffled = delta < 0 ? __shfl_up_sync(group_mask, xw[SH + se], -delta)
                                       : __shfl_down_sync(group_mask, xw[SH + se], delta);
      xw[column(h)] = inside ? shuffled : direct_value[h];
    }
  }
};

}  // namespace dwgn_walk
