// Depthwise 2-D convolution, NCHW, on the tensor cores: the forward at
// stride 1 and the backward-input (its stride-1 correlation with the filter
// rotated by 180 degrees) for float16 and bfloat16, 3x3 / 5x5 / 7x7 filters
// at dilation 1, depth multiplier 1, float32 accumulation (mma.sync
// m16n8k16 and m16n8k8).
//
// Why tensor cores: with float32 accumulation every output of a CUDA-core
// kernel costs K*K FMAs plus the conversions of the values it reads, and
// the half-type 5x5 / 7x7 kernels were issue-bound, not memory-bound (H200,
// 64x240x28 5x5 fp16 forward 38 us against an 11 us copy floor, 64x96x56
// 7x7 75 us against 18).  For one channel, filter row kh and a tile of 16
// destination rows x 8 destination columns, the row sums are one matrix
// product with a banded (Toeplitz) matrix of the filter row:
//
//   D[i][n] += sum_k A[i][k] * B[k][n],   A[i][k] = image[row0 + kh + i][col0 + k],
//                                          B[k][n] = w[kh][k - shift - n]  (0 outside [0, K))
//
// with shift = kLeft - offset_left and col0 = 8 * tile: k runs over 24
// image columns (three 8-column chunks: one m16n8k16 for the first two, one
// m16n8k8 for the third), enough for 8 outputs of a filter up to 9 wide.
// B depends on the channel and kh only: a lane builds its fragments once
// per channel (3 words per filter row).  A comes from shared memory by
// ldmatrix; along a strip of kStrip tiles each chunk is loaded once per kh
// and feeds up to three tiles.
//
// The source planes go to shared memory as zero-padded images: image row
// offset_top + r holds source row r at columns kLeft .. kLeft + width - 1
// (kLeft = 8 keeps every row 16-byte aligned, so rows are copied with
// cp.async pieces of 16, 8 or 4 bytes, whichever the row bytes and the
// address allow, and 2-byte loads otherwise); everything else is zero,
// so padding needs no test.  row_stride (halves) is a multiple of 8 with an
// odd number of 16-byte vectors: the 8 rows of an ldmatrix fall in
// different banks.
//
// Non-finite values: a tile's product also multiplies the image values
// next to each output's window by B's zeros, and 0 * inf is NaN, where the
// float64 reference keeps a value that no window holds out of the sums.
// So a strip whose results hold any non-finite value (a warp vote; never on
// finite data that does not overflow) recomputes its outputs one by one
// from the image with the K*K taps of each window (fp32 FMAs, the same
// padding zeros): exactly the outputs whose windows hold an inf or NaN are
// non-finite, as in the reference.
//
// Work: a block of kWarps warps owns planes_per_unit consecutive planes
// (blockIdx.x; the unit's source and destination planes are contiguous in
// NCHW); the (plane, 16-row tile) items are dealt to the warps in a fixed
// order; each warp walks its item's columns in strips.  Outputs gather in a
// shared stage (the unit's destination planes as they lie in dst) and leave
// in 16-byte stores (dwgn::store_unit).  The host
// (cupy_dwgn/_depthwise_nchw_mma.py) sizes the unit and the image.
//
// Template parameters: T (__half or __nv_bfloat16), K (3, 5 or 7), BACKWARD,
// IndexT (int, or long long when a tensor has >= 2**31 elements: only the
// unit's plane offsets use it).

#include "dwgn_common.cuh"

namespace dwgn_dmma {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
// 8-column tiles a warp keeps in flight along a row strip (16 float
// accumulators; chunks loaded per tile: (kStrip + 2) / kStrip).
constexpr int kStrip = 4;
// Image column of source column 0 (host: _depthwise_nchw_mma.LEFT).
constexpr int kLeft = 8;

// D += A * B for one m16n8k16 / m16n8k8 tile, T operands, float32 in place.
template <typename T> struct Mma;
#define DWGN_DMMA(TYPE, PTX_TYPE)                                                                                   \
  template <> struct Mma<TYPE> {                                                                                  \
    static __device__ __forceinline__ void k16(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,  \
                                               unsigned b0, unsigned b1) {                                        \
      asm("mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE ".f32 {%0, %1, %2, %3}, "                 \
          "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"                                                         \
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                                          \
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));                                                  \
    }                                                                                                             \
    static __device__ __forceinline__ void k8(float (&d)[4], unsigned a0, unsigned a1, unsigned b0) {              \
      asm("mma.sync.aligned.m16n8k8.row.col.f32." PTX_TYPE "." PTX_TYPE ".f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "   \
          "{%0, %1, %2, %3};\n"                                                                                    \
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                                          \
          : "r"(a0), "r"(a1), "r"(b0));                                                                             \
    }                                                                                                             \
  };
DWGN_DMMA(__half, "f16")
DWGN_DMMA(__nv_bfloat16, "bf16")
#undef DWGN_DMMA

// Rows 0-7 and 8-15 of one 8-column chunk (lane l < 16 points at row l):
// the A fragment words of rows g and g + 8 for columns 2q, 2q + 1.
__device__ __forceinline__ void load_chunk(unsigned (&frag)[2], const unsigned short* row) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(frag[0]), "=r"(frag[1])
               : "r"(address));
}

// Filter value (kh, tap) of the correlation as raw bits, 0 outside the filter
// (backward-input: the filter rotated by 180 degrees).
template <int K, bool BACKWARD>
__device__ __forceinline__ unsigned tap_bits(const unsigned short* __restrict__ w, int kh, int tap) {
  if (tap < 0 || tap >= K) return 0u;
  return BACKWARD ? w[(K - 1 - kh) * K + (K - 1 - tap)] : w[kh * K + tap];
}

// Copy the unit's source rows into the images (image p row offset_top + r,
// from column kLeft), in piece_bytes pieces: the rows are contiguous in src,
// so piece i of the unit is at from + i * piece_bytes.
__device__ __forceinline__ void copy_rows(unsigned short* images, const unsigned char* from, int rows, int height,
                                          int row_bytes, int piece_bytes, int image_rows, int row_stride,
                                          int offset_top) {
  const int pieces_per_row = row_bytes / piece_bytes;
  const int pieces = rows * pieces_per_row;  // < 2**22: the unit fits shared memory
  const float inv_pieces = __frcp_rn(static_cast<float>(pieces_per_row));
  const float inv_height = __frcp_rn(static_cast<float>(height));
  for (int i = threadIdx.x; i < pieces; i += kThreads) {
    const int row = dwgn::small_div(i, inv_pieces);
    const int within = i - row * pieces_per_row;
    const int plane = dwgn::small_div(row, inv_height);
    const int image_row = plane * image_rows + row - plane * height + offset_top;
    unsigned char* to = reinterpret_cast<unsigned char*>(images + image_row * row_stride + kLeft) + within * piece_bytes;
    const unsigned char* piece = from + static_cast<size_t>(i) * piece_bytes;
    switch (piece_bytes) {  // block-uniform
      case 16: dwgn::cp_async<16>(to, piece); break;
      case 8: dwgn::cp_async<8>(to, piece); break;
      case 4: dwgn::cp_async<4>(to, piece); break;
      default: *reinterpret_cast<unsigned short*>(to) = *reinterpret_cast<const unsigned short*>(piece);
    }
  }
  dwgn::cp_async_commit();
  dwgn::cp_async_wait<0>();
}

}  // namespace dwgn_dmma

template <typename T, int K, bool BACKWARD, typename IndexT>
__global__ void __launch_bounds__(dwgn_dmma::kThreads) dwgn_dwconv2d_mma(
    const T* __restrict__ src, const T* __restrict__ weight, const T* __restrict__ bias, T* __restrict__ dst,
    int channels, int num_planes, int src_height, int src_width, int dst_height, int dst_width, int offset_top,
    int offset_left, int planes_per_unit, int image_rows, int row_stride, int piece_bytes) {
  using namespace dwgn_dmma;
  static_assert(K == 3 || K == 5 || K == 7, "3x3, 5x5 and 7x7 filters");
  extern __shared__ __align__(16) unsigned char shared[];
  unsigned short* const images = reinterpret_cast<unsigned short*>(shared);
  const int image_halves = image_rows * row_stride;  // a multiple of 8
  unsigned char* const stage = shared + static_cast<size_t>(planes_per_unit) * image_halves * 2;

  const int first_plane = blockIdx.x * planes_per_unit;
  const int planes = min(planes_per_unit, num_planes - first_plane);
  const int src_plane = src_height * src_width, dst_plane = dst_height * dst_width;
  T* const unit_dst = dst + static_cast<IndexT>(first_plane) * dst_plane;

  // The images' padding is zero; the rows land over it after the barrier.
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  for (int i = threadIdx.x; i < planes * image_halves / 8; i += kThreads) reinterpret_cast<uint4*>(images)[i] = zero;
  __syncthreads();
  copy_rows(images, reinterpret_cast<const unsigned char*>(src + static_cast<IndexT>(first_plane) * src_plane),
            planes * src_height, src_height, src_width * 2, piece_bytes, image_rows, row_stride, offset_top);
  __syncthreads();  // every piece landed

  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int warp = threadIdx.x >> 5;
  const int row_tiles = (dst_height + 15) >> 4, col_tiles = (dst_width + 7) >> 3;
  const float inv_row_tiles = __frcp_rn(static_cast<float>(row_tiles));
  T* const staged = reinterpret_cast<T*>(stage + dwgn::head_bytes(unit_dst));
  const int shift = kLeft - offset_left;  // host: 0 <= offset_left <= kLeft
  unsigned b01[K][2], b2[K];               // the filter rows' B fragments (k 0-15, k 16-23)
  float bias_value = 0.0f;
  int built = -1;                          // the channel b01 / b2 hold
  for (int item = warp; item < planes * row_tiles; item += kWarps) {
    const int p = dwgn::small_div(item, inv_row_tiles);
    const int row_tile = item - p * row_tiles;
    const int channel = (first_plane + p) % channels;
    if (channel != built) {  // warp-uniform
      built = channel;
      const unsigned short* w = reinterpret_cast<const unsigned short*>(weight) + channel * K * K;
      const int k0 = 2 * q - shift - g;  // tap of B row 2q in column g
#pragma unroll
      for (int kh = 0; kh < K; ++kh) {
        b01[kh][0] = tap_bits<K, BACKWARD>(w, kh, k0) | tap_bits<K, BACKWARD>(w, kh, k0 + 1) << 16;
        b01[kh][1] = tap_bits<K, BACKWARD>(w, kh, k0 + 8) | tap_bits<K, BACKWARD>(w, kh, k0 + 9) << 16;
        b2[kh] = tap_bits<K, BACKWARD>(w, kh, k0 + 16) | tap_bits<K, BACKWARD>(w, kh, k0 + 17) << 16;
      }
      bias_value = (!BACKWARD && bias != nullptr) ? dwgn::to_acc(bias[channel]) : 0.0f;
    }
    const unsigned short* image = images + p * image_halves;
    const int row0 = row_tile * 16;
    // ldmatrix rows: lane l < 16 gives row l of the tile (lanes 16-31 repeat them, unused).
    const unsigned short* lane_row = image + (row0 + (lane & 15)) * row_stride;
    T* const out_plane = staged + p * dst_plane;
    for (int tile0 = 0; tile0 < col_tiles; tile0 += kStrip) {
      const int tiles = min(kStrip, col_tiles - tile0);  // warp-uniform
      float acc[kStrip][4];
#pragma unroll
      for (int t = 0; t < kStrip; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[t][e] = bias_value;
#pragma unroll
      for (int kh = 0; kh < K; ++kh) {
        const unsigned short* chunk_row = lane_row + kh * row_stride + tile0 * 8;
        unsigned frag[kStrip + 2][2];
#pragma unroll
        for (int c = 0; c < kStrip + 2; ++c)
          if (c < tiles + 2) load_chunk(frag[c], chunk_row + 8 * c);
#pragma unroll
        for (int t = 0; t < kStrip; ++t) {
          if (t < tiles) {
            Mma<T>::k16(acc[t], frag[t][0], frag[t][1], frag[t + 1][0], frag[t + 1][1], b01[kh][0], b01[kh][1]);
            Mma<T>::k8(acc[t], frag[t + 2][0], frag[t + 2][1], b2[kh]);
          }
        }
      }
      bool finite = true;
#pragma unroll
      for (int t = 0; t < kStrip; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) finite &= t >= tiles || isfinite(acc[t][e]);
      const bool exact = __all_sync(0xffffffffu, finite);
      // This lane's outputs: rows row0 + g (+ 8), columns 8 * tile + 2q (+ 1).
#pragma unroll
      for (int t = 0; t < kStrip; ++t) {
        if (t >= tiles) break;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int y = row0 + g + (e >> 1) * 8, x = (tile0 + t) * 8 + 2 * q + (e & 1);
          if (y >= dst_height || x >= dst_width) continue;
          float value = acc[t][e];
          if (!exact) {  // warp-uniform: the window's taps one by one (see the header)
            const unsigned short* w = reinterpret_cast<const unsigned short*>(weight) + channel * K * K;
            value = bias_value;
            for (int kh = 0; kh < K; ++kh)
              for (int kw = 0; kw < K; ++kw) {
                const unsigned short bits = image[(y + kh) * row_stride + x + shift + kw];
                const unsigned short tap = BACKWARD ? w[(K - 1 - kh) * K + (K - 1 - kw)] : w[kh * K + kw];
                value = fmaf(dwgn::half_of_word(T(), tap, 0), dwgn::half_of_word(T(), bits, 0), value);
              }
          }
          out_plane[y * dst_width + x] = dwgn::from_acc<T>(value);
        }
      }
    }
  }
  __syncthreads();  // the unit's outputs are staged
  dwgn::store_unit(stage, unit_dst, planes * dst_plane);
}
