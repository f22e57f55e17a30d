// Depthwise 2-D convolution on the tensor cores, NCHW or channels-last
// (NHWC): the forward at stride 1 or 2 and the backward-input (its stride-1
// correlation with the filter rotated by 180 degrees) for float16 and
// bfloat16, 3x3 / 5x5 / 7x7 filters at dilation 1, depth multiplier 1,
// float32 accumulation (mma.sync m16n8k16 and m16n8k8).
//
// Why tensor cores: with float32 accumulation every output of a CUDA-core
// kernel costs K*K FMAs plus the conversions of the values it reads, and
// the half-type 5x5 / 7x7 kernels were issue-bound, not memory-bound (H200,
// 64x240x28 5x5 fp16 forward 38 us against an 11 us copy floor, 64x96x56
// 7x7 75 us against 18).  For one channel, filter row kh and a tile of 16
// destination rows x 8 destination columns, the row sums are one matrix
// product with a banded (Toeplitz) matrix of the filter row:
//
//   D[i][n] += sum_k A[i][k] * B[k][n],   A[i][k] = image[S * (row0 + i) + kh][col0 + k],
//                                          B[k][n] = w[kh][k - shift - S * n]  (0 outside [0, K))
//
// with S the stride, shift = kLeft - offset_left and col0 = 8 * S * tile.
// At stride 1, k runs over 24 image columns (three 8-column chunks: one
// m16n8k16 for the first two, one m16n8k8 for the third), enough for 8
// outputs of a filter up to 9 wide; at stride 2 over 32 (two m16n8k16),
// enough for 8 outputs 2 apart of a filter up to 11 wide.  B depends on the
// channel and kh only: a lane builds its fragments once per channel (3 or 4
// words per filter row).  A comes from shared memory by ldmatrix (its 16
// rows S apart); along a strip of kStrip tiles each chunk is loaded once per
// kh and feeds up to 3 (stride 2: 2) tiles.
//
// Each channel's source rows go to shared memory as a zero-padded image:
// image row i holds source row S * out_row0 - offset_top + i (out_row0: the
// unit's first destination row) at columns kLeft .. kLeft + width - 1;
// everything else is zero, so padding needs no test.  row_stride (values)
// is a multiple of 8 with an odd number of 16-byte vectors: the 8 rows of an
// ldmatrix fall in different banks.  kLeft = 8 keeps NCHW rows 16-byte
// aligned, so they are copied with cp.async pieces of 16, 8 or 4 bytes
// (whichever the row bytes and the address allow; otherwise the range's
// 4-byte words, loaded a few a thread at once and split into the rows);
// NHWC pixels are 16-byte vectors of the unit's 8 channels, split into the
// 8 images as they are stored.
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
// Work units (the host sizes them, cupy_dwgn/_depthwise_conv_mma.py):
// * NCHW: planes_per_unit consecutive whole planes, or (num_bands > 1) one
//   band of band_rows destination rows of one plane: the unit's source rows
//   and destination rows are each one contiguous range.
// * NHWC: (sample, band of band_rows destination rows, group of 8
//   channels), the groups of a band in consecutive units.
// The grid is persistent (at most the blocks resident at once): block b
// takes units b, b + gridDim.x, ...  With buffers == 2 the next unit's
// source is copied with cp.async while the warps work on this one: NCHW
// rows into a second image buffer; NHWC 16-byte pixels into a raw area,
// split into the one image buffer once landed.  Otherwise (where that does
// not fit) a block zeroes, copies, works and stores one unit after another.
// A block of kWarps warps deals a unit's (channel, 16-row tile) items to its
// warps in a fixed order; each warp walks its item's columns in strips.
// Outputs gather in a shared stage (per channel, the unit's destination
// rows) and leave in 16-byte stores: NCHW as the flat range they are in dst
// (dwgn::store_unit), NHWC as pixels of 8 channels.
//
// Template parameters: T (__half or __nv_bfloat16), K (3, 5 or 7), STRIDE
// (1 or 2; 1 when BACKWARD), BACKWARD, NHWC, IndexT (int, or long long when
// a tensor has >= 2**31 elements: only the unit's offsets use it).

#include "dwgn_common.cuh"

namespace dwgn_dmma {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
// Blocks an SM the register budget is set for (at most 128 registers):
// without it ptxas held some specializations to 64 and spilled (NVRTC 13,
// sm_90: the NHWC and 64-bit-index ones, 16-52 bytes).
constexpr int kMinBlocks = 4;
// 8-column tiles a warp keeps in flight along a row strip (16 float
// accumulators; chunks loaded per tile: (S * kStrip + 2) / kStrip).
constexpr int kStrip = 4;
// Image column of source column 0 (host: _depthwise_conv_mma.LEFT).
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

// NCHW rows whose bytes are not a multiple of 4 (odd widths): the range's
// values by 4-byte words from the word boundary below it (the word holding
// its first value; the last word may hold one value past it: inside the same
// 4-byte-aligned word, so inside the allocation), kBatch words a thread in
// flight before their values are stored (one at a time, each load's latency
// before its store, this copy took 5x the time of the cp.async pieces:
// 64x960x7 3x3 fp16 59 us against 9).
__device__ __forceinline__ void copy_values(unsigned short* images, int image_halves, const unsigned char* from,
                                            int planes, int height, int width, int image_row0, int row_stride) {
  constexpr int kBatch = 4;
  const int values = planes * height * width;  // < 2**22: the unit fits shared memory
  const int head = static_cast<int>(reinterpret_cast<size_t>(from) & 2) >> 1;  // values before the range in its word
  const unsigned* words = reinterpret_cast<const unsigned*>(from - 2 * head);
  const int count = (head + values + 1) >> 1;
  const float inv_width = __frcp_rn(static_cast<float>(width));
  const float inv_height = __frcp_rn(static_cast<float>(height));
  for (int first = threadIdx.x; first < count; first += kBatch * kThreads) {
    unsigned word[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = first + b * kThreads;
      if (i < count) word[b] = words[i];
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = first + b * kThreads;
      if (i >= count) break;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int v = 2 * i + half - head;  // the value's index in the range
        if (v < 0 || v >= values) continue;
        const int row = dwgn::small_div(v, inv_width);
        const int plane = dwgn::small_div(row, inv_height);
        images[plane * image_halves + (row - plane * height + image_row0) * row_stride + kLeft + v - row * width] =
            static_cast<unsigned short>(half ? word[b] >> 16 : word[b] & 0xffffu);
      }
    }
  }
}

// NCHW: copy `height` source rows of each of `planes` planes, one
// contiguous range of src from `from` (whole planes, or one band of one
// plane), into the images (a plane's r-th row at image row image_row0 + r
// of its image, from column kLeft), in piece_bytes pieces: piece i of the
// range is at from + i * piece_bytes (cp.async: the caller commits them);
// 2: copy_values.
__device__ __forceinline__ void copy_rows(unsigned short* images, int image_halves, const unsigned char* from,
                                          int planes, int height, int image_row0, int row_bytes, int piece_bytes,
                                          int row_stride) {
  if (piece_bytes == 2) {  // block-uniform
    copy_values(images, image_halves, from, planes, height, row_bytes / 2, image_row0, row_stride);
    return;
  }
  const int pieces_per_row = row_bytes / piece_bytes;
  const int pieces = planes * height * pieces_per_row;  // < 2**22: the unit fits shared memory
  const float inv_pieces = __frcp_rn(static_cast<float>(pieces_per_row));
  const float inv_height = __frcp_rn(static_cast<float>(height));
  for (int i = threadIdx.x; i < pieces; i += kThreads) {
    const int row = dwgn::small_div(i, inv_pieces);
    const int within = i - row * pieces_per_row;
    const int plane = dwgn::small_div(row, inv_height);
    const int image_row = row - plane * height + image_row0;
    unsigned char* to = reinterpret_cast<unsigned char*>(images + plane * image_halves + image_row * row_stride + kLeft) +
                        within * piece_bytes;
    const unsigned char* piece = from + static_cast<size_t>(i) * piece_bytes;
    switch (piece_bytes) {  // block-uniform
      case 16: dwgn::cp_async<16>(to, piece); break;
      case 8: dwgn::cp_async<8>(to, piece); break;
      default: dwgn::cp_async<4>(to, piece);
    }
  }
}

// NHWC: pixel i of a unit's source rows (row r = i / width at image row
// image_row0 + r, column kLeft + i - r * width), 8 values of the unit's
// channels, split into the 8 images.
__device__ __forceinline__ void put_pixel(unsigned short* images, int image_halves, const uint4& v, int i,
                                          float inv_width, int width, int image_row0, int row_stride) {
  const int r = dwgn::small_div(i, inv_width);
  unsigned short* to = images + (image_row0 + r) * row_stride + kLeft + i - r * width;
  const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int c = 0; c < 8; ++c)
    to[c * image_halves] = static_cast<unsigned short>(c & 1 ? words[c >> 1] >> 16 : words[c >> 1] & 0xffffu);
}

// NHWC, one buffer: the `rows` x `width` pixels from `from` (pixel (r, x)
// at from + (r * width + x) * channels, 8 values of this unit's channels)
// into the 8 images.  Four loads in flight a thread before their values
// are stored.
__device__ __forceinline__ void copy_pixels(unsigned short* images, int image_halves, const uint4* from, int rows,
                                            int width, int channels, int image_row0, int row_stride) {
  constexpr int kBatch = 4;
  const int pixels = rows * width;  // < 2**22: the unit fits shared memory
  const float inv_width = __frcp_rn(static_cast<float>(width));
  const int vectors_per_pixel = channels / 8;
  for (int first = threadIdx.x; first < pixels; first += kBatch * kThreads) {
    uint4 v[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = first + b * kThreads;
      if (i < pixels) v[b] = from[static_cast<size_t>(i) * vectors_per_pixel];
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = first + b * kThreads;
      if (i >= pixels) break;
      put_pixel(images, image_halves, v[b], i, inv_width, width, image_row0, row_stride);
    }
  }
}

// NHWC, pixels copied ahead: the unit's `rows` x `width` pixels from `from`
// into `raw` (pixel i at raw + 16 i) by cp.async (the caller commits them).
__device__ __forceinline__ void issue_pixels(uint4* raw, const uint4* from, int rows, int width, int channels) {
  const int pixels = rows * width;
  const int vectors_per_pixel = channels / 8;
  for (int i = threadIdx.x; i < pixels; i += kThreads)
    dwgn::cp_async<16>(raw + i, from + static_cast<size_t>(i) * vectors_per_pixel);
}

// NHWC, pixels copied ahead: the landed pixels from `raw` into the 8 images.
__device__ __forceinline__ void split_pixels(unsigned short* images, int image_halves, const uint4* raw, int rows,
                                             int width, int image_row0, int row_stride) {
  const int pixels = rows * width;
  const float inv_width = __frcp_rn(static_cast<float>(width));
  for (int i = threadIdx.x; i < pixels; i += kThreads)
    put_pixel(images, image_halves, raw[i], i, inv_width, width, image_row0, row_stride);
}

// NHWC: the unit's staged outputs (8 channel planes of `rows` x `width`, at
// `stage`) to dst as 16-byte pixels (pixel (r, x) at to + (r * width + x) *
// channels).
__device__ __forceinline__ void store_pixels(const unsigned short* stage, uint4* to, int rows, int width,
                                             int channels) {
  const int pixels = rows * width;
  const int vectors_per_pixel = channels / 8;
  for (int i = threadIdx.x; i < pixels; i += kThreads) {
    unsigned words[4];
#pragma unroll
    for (int c = 0; c < 8; c += 2)
      words[c >> 1] = stage[c * pixels + i] | static_cast<unsigned>(stage[(c + 1) * pixels + i]) << 16;
    to[static_cast<size_t>(i) * vectors_per_pixel] = make_uint4(words[0], words[1], words[2], words[3]);
  }
}

// The kernel's scalar arguments (the host's plan).
struct Geometry {
  int channels, num_planes, src_height, src_width, dst_height, dst_width, offset_top, offset_left;
  int planes_per_unit, num_bands, band_rows, image_rows, row_stride, piece_bytes;
};

// Unit `index` of the call (kernel header): its channels (images), its first
// plane (NCHW) or channel (NHWC), its destination rows [out_row0, out_row0 +
// out_rows), and the source rows [src_row0, src_row0 + src_rows) its tiles
// read that lie in the image, from image row image_row0 (`sample`: NHWC
// its sample, NCHW bands its plane; with no source rows image_row0 means
// nothing).
struct Unit {
  int planes, first, out_row0, out_rows, src_row0, src_rows;
  int image_row0;  // the image row of source row src_row0
};

template <int STRIDE, bool NHWC>
__device__ __forceinline__ Unit unit_of(int index, const Geometry& a, int& sample) {
  Unit u;
  int band;
  if (NHWC) {
    const int groups = a.channels / 8;
    const int rest = index / groups;  // (sample, band)
    u.first = (index - rest * groups) * 8;
    sample = rest / a.num_bands;
    band = rest - sample * a.num_bands;
    u.planes = 8;
  } else if (a.num_bands > 1) {
    sample = index / a.num_bands;  // the plane
    band = index - sample * a.num_bands;
    u.first = sample;
    u.planes = 1;
  } else {
    sample = 0;
    band = 0;
    u.first = index * a.planes_per_unit;
    u.planes = min(a.planes_per_unit, a.num_planes - u.first);
  }
  u.out_row0 = band * a.band_rows;
  u.out_rows = min(a.band_rows, a.dst_height - u.out_row0);
  // Image row i holds source row STRIDE * out_row0 - offset_top + i: the
  // rows the unit's tiles read that lie in the image.
  const int first_source = STRIDE * u.out_row0 - a.offset_top;
  // (clamped to the source: a band wholly in the padding below copies nothing
  // and forms no pointer past the tensor)
  u.src_row0 = min(max(first_source, 0), a.src_height);
  u.src_rows = max(0, min(first_source + a.image_rows, a.src_height) - u.src_row0);
  u.image_row0 = u.src_row0 - first_source;
  return u;
}

// NCHW: the unit's destination range (its outputs, one range of dst);
// NHWC: its first output pixel.
template <typename T, bool NHWC, typename IndexT>
__device__ __forceinline__ T* unit_destination(T* dst, const Unit& u, int sample, const Geometry& a) {
  return NHWC ? dst + (static_cast<IndexT>(sample) * a.dst_height + u.out_row0) * a.dst_width * a.channels + u.first
              : dst + static_cast<IndexT>(u.first) * a.dst_height * a.dst_width +
                    static_cast<IndexT>(u.out_row0) * a.dst_width;
}

// NHWC: the unit's first source pixel (the unit's channels of source row
// src_row0, column 0, of its sample) as 16-byte vectors.
template <typename T, typename IndexT>
__device__ __forceinline__ const uint4* unit_pixels(const T* src, const Unit& u, int sample, const Geometry& a) {
  return reinterpret_cast<const uint4*>(src + (static_cast<IndexT>(sample) * a.src_height + u.src_row0) *
                                                  a.src_width * a.channels + u.first);
}

// Issue the unit's source rows into `images` (NCHW: cp.async pieces, not
// committed; NHWC: loads and stores, done on return).
template <typename T, bool NHWC, typename IndexT>
__device__ __forceinline__ void copy_unit(unsigned short* images, const T* src, const Unit& u, int sample,
                                          const Geometry& a) {
  const int image_halves = a.image_rows * a.row_stride;
  if (NHWC) {
    copy_pixels(images, image_halves, unit_pixels<T, IndexT>(src, u, sample, a), u.src_rows, a.src_width,
                a.channels, u.image_row0, a.row_stride);
  } else {
    copy_rows(images, image_halves,
              reinterpret_cast<const unsigned char*>(src + static_cast<IndexT>(u.first) * a.src_height * a.src_width +
                                                     static_cast<IndexT>(u.src_row0) * a.src_width),
              u.planes, u.src_rows, u.image_row0, a.src_width * 2, a.piece_bytes, a.row_stride);
  }
}

// Zero `count` 16-byte vectors from `to`.
__device__ __forceinline__ void zero_vectors(unsigned short* to, int count) {
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  for (int i = threadIdx.x; i < count; i += kThreads) reinterpret_cast<uint4*>(to)[i] = zero;
}

// Two outputs as one word (the lower column in the low half).
template <typename T>
__device__ __forceinline__ unsigned pack_pair(float low, float high) {
  const T l = dwgn::from_acc<T>(low), h = dwgn::from_acc<T>(high);
  return static_cast<unsigned>(reinterpret_cast<const unsigned short&>(l)) |
         static_cast<unsigned>(reinterpret_cast<const unsigned short&>(h)) << 16;
}

// One strip's products: for each filter row kh, the strip's chunks of the
// lane's ldmatrix row (`strip_row`: the strip's first column of the tile's
// row, kh = 0) and each tile's m16n8k16 + m16n8k8 (stride 2: two
// m16n8k16).  FULL: tiles == kStrip, known at compile time.
template <typename T, int K, int STRIDE, bool FULL>
__device__ __forceinline__ void accumulate(float (&acc)[kStrip][4], const unsigned short* strip_row, int row_stride,
                                           int tiles, const unsigned (&b01)[K][2],
                                           const unsigned (&b23)[K][STRIDE == 1 ? 1 : 2]) {
#pragma unroll
  for (int kh = 0; kh < K; ++kh) {
    // Tile t's window: chunks STRIDE * t .. STRIDE * t + kChunks - 1 of the strip.
    const unsigned short* chunk_row = strip_row + kh * row_stride;
    unsigned frag[STRIDE * kStrip + 2][2];
#pragma unroll
    for (int c = 0; c < STRIDE * kStrip + 2; ++c)
      if (FULL || c < STRIDE * tiles + 2) load_chunk(frag[c], chunk_row + 8 * c);
#pragma unroll
    for (int t = 0; t < kStrip; ++t) {
      if (FULL || t < tiles) {
        const int c = STRIDE * t;
        Mma<T>::k16(acc[t], frag[c][0], frag[c][1], frag[c + 1][0], frag[c + 1][1], b01[kh][0], b01[kh][1]);
        if constexpr (STRIDE == 1) {
          Mma<T>::k8(acc[t], frag[c + 2][0], frag[c + 2][1], b23[kh][0]);
        } else {
          Mma<T>::k16(acc[t], frag[c + 2][0], frag[c + 2][1], frag[c + 3][0], frag[c + 3][1], b23[kh][0],
                      b23[kh][1]);
        }
      }
    }
  }
}

// The unit's outputs from its images into the stage (`staged`: where its
// first output goes), a warp per (channel, 16-row tile) item.
template <typename T, int K, int STRIDE, bool BACKWARD, bool NHWC>
__device__ __forceinline__ void compute_unit(const unsigned short* images, T* staged, const Unit& u,
                                             const T* __restrict__ weight, const T* __restrict__ bias,
                                             const Geometry& a) {
  // 8-column chunks a tile's window takes: 24 columns (k16 + k8) at stride 1, 32 (k16 + k16) at stride 2.
  constexpr int kChunks = STRIDE == 1 ? 3 : 4;
  const int image_halves = a.image_rows * a.row_stride;
  const int row_stride = a.row_stride, dst_width = a.dst_width;
  const int stage_plane = u.out_rows * dst_width;
  // Output pairs (columns 2q, 2q + 1) go in one 4-byte store where every pair is 4-byte aligned in the stage.
  const bool pairs = dst_width % 2 == 0 && reinterpret_cast<size_t>(staged) % 4 == 0;
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int warp = threadIdx.x >> 5;
  const int row_tiles = (u.out_rows + 15) >> 4, col_tiles = (dst_width + 7) >> 3;
  const float inv_row_tiles = __frcp_rn(static_cast<float>(row_tiles));
  const int shift = kLeft - a.offset_left;  // host: 0 <= offset_left <= kLeft
  // The filter rows' B fragments: k 0-15 (b01), then k 16-23 (stride 1) or 16-31 (stride 2).
  unsigned b01[K][2], b23[K][kChunks - 2];
  float bias_value = 0.0f;
  int built = -1;                          // the channel b01 / b23 hold
  for (int item = warp; item < u.planes * row_tiles; item += kWarps) {
    const int p = dwgn::small_div(item, inv_row_tiles);
    const int row_tile = item - p * row_tiles;
    const int channel = NHWC ? u.first + p : (u.first + p) % a.channels;
    if (channel != built) {  // warp-uniform
      built = channel;
      const unsigned short* w = reinterpret_cast<const unsigned short*>(weight) + static_cast<size_t>(channel) * K * K;
      const int k0 = 2 * q - shift - STRIDE * g;  // tap of B row 2q in column g
#pragma unroll
      for (int kh = 0; kh < K; ++kh) {
        b01[kh][0] = tap_bits<K, BACKWARD>(w, kh, k0) | tap_bits<K, BACKWARD>(w, kh, k0 + 1) << 16;
        b01[kh][1] = tap_bits<K, BACKWARD>(w, kh, k0 + 8) | tap_bits<K, BACKWARD>(w, kh, k0 + 9) << 16;
#pragma unroll
        for (int j = 0; j < kChunks - 2; ++j)
          b23[kh][j] = tap_bits<K, BACKWARD>(w, kh, k0 + 16 + 8 * j) | tap_bits<K, BACKWARD>(w, kh, k0 + 17 + 8 * j) << 16;
      }
      bias_value = (!BACKWARD && bias != nullptr) ? dwgn::to_acc(bias[channel]) : 0.0f;
    }
    const unsigned short* image = images + p * image_halves;
    const int row0 = row_tile * 16;
    // ldmatrix rows: lane l < 16 gives the image row of the tile's row l (lanes 16-31 repeat them, unused).
    const unsigned short* lane_row = image + STRIDE * (row0 + (lane & 15)) * row_stride;
    T* const out_plane = staged + p * stage_plane;
    for (int tile0 = 0; tile0 < col_tiles; tile0 += kStrip) {
      const int tiles = min(kStrip, col_tiles - tile0);  // warp-uniform
      float acc[kStrip][4];
#pragma unroll
      for (int t = 0; t < kStrip; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[t][e] = bias_value;
      const unsigned short* strip_row = lane_row + STRIDE * tile0 * 8;
      // (a full strip takes no per-chunk or per-tile predicate)
      if (tiles == kStrip)
        accumulate<T, K, STRIDE, true>(acc, strip_row, row_stride, tiles, b01, b23);
      else
        accumulate<T, K, STRIDE, false>(acc, strip_row, row_stride, tiles, b01, b23);
      bool finite = true;
#pragma unroll
      for (int t = 0; t < kStrip; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) finite &= t >= tiles || isfinite(acc[t][e]);
      const bool exact = __all_sync(0xffffffffu, finite);
      // This lane's outputs: rows row0 + g (+ 8), columns 8 * tile + 2q (+ 1).
      if (exact) {  // warp-uniform
#pragma unroll
        for (int t = 0; t < kStrip; ++t) {
          if (t >= tiles) break;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int y = row0 + g + 8 * h, x = (tile0 + t) * 8 + 2 * q;
            if (y >= u.out_rows || x >= dst_width) continue;
            T* const out = out_plane + y * dst_width + x;
            if (pairs) {  // (dst_width even: x + 1 is inside too)
              *reinterpret_cast<unsigned*>(out) = pack_pair<T>(acc[t][2 * h], acc[t][2 * h + 1]);
            } else {
              out[0] = dwgn::from_acc<T>(acc[t][2 * h]);
              if (x + 1 < dst_width) out[1] = dwgn::from_acc<T>(acc[t][2 * h + 1]);
            }
          }
        }
        continue;
      }
      // A non-finite value: each output from its window's taps one by one (see the header).
#pragma unroll
      for (int t = 0; t < kStrip; ++t) {
        if (t >= tiles) break;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int y = row0 + g + (e >> 1) * 8, x = (tile0 + t) * 8 + 2 * q + (e & 1);
          if (y >= u.out_rows || x >= dst_width) continue;
          const unsigned short* w = reinterpret_cast<const unsigned short*>(weight) + static_cast<size_t>(channel) * K * K;
          float value = bias_value;
#pragma unroll 1
          for (int kh = 0; kh < K; ++kh)
#pragma unroll 1
            for (int kw = 0; kw < K; ++kw) {
              const unsigned short bits = image[(STRIDE * y + kh) * row_stride + STRIDE * x + shift + kw];
              const unsigned short tap = BACKWARD ? w[(K - 1 - kh) * K + (K - 1 - kw)] : w[kh * K + kw];
              value = fmaf(dwgn::half_of_word(T(), tap, 0), dwgn::half_of_word(T(), bits, 0), value);
            }
          out_plane[y * dst_width + x] = dwgn::from_acc<T>(value);
        }
      }
    }
  }
}

}  // namespace dwgn_dmma

template <typename T, int K, int STRIDE, bool BACKWARD, bool NHWC, typename IndexT>
__global__ void __launch_bounds__(dwgn_dmma::kThreads, dwgn_dmma::kMinBlocks) dwgn_dwconv2d_mma(
    const T* __restrict__ src, const T* __restrict__ weight, const T* __restrict__ bias, T* __restrict__ dst,
    int channels, int num_planes, int src_height, int src_width, int dst_height, int dst_width, int offset_top,
    int offset_left, int planes_per_unit, int num_bands, int band_rows, int image_rows, int row_stride,
    int piece_bytes, int num_units, int buffers) {
  using namespace dwgn_dmma;
  static_assert(K == 3 || K == 5 || K == 7, "3x3, 5x5 and 7x7 filters");
  static_assert(STRIDE == 1 || (STRIDE == 2 && !BACKWARD), "the backward-input is a stride-1 correlation");
  const Geometry a{channels, num_planes, src_height, src_width, dst_height, dst_width, offset_top,
                   offset_left, planes_per_unit, num_bands, band_rows, image_rows, row_stride, piece_bytes};
  extern __shared__ __align__(16) unsigned char shared[];
  unsigned short* const images = reinterpret_cast<unsigned short*>(shared);
  const int image_halves = image_rows * row_stride;          // a multiple of 8
  const int buffer_halves = planes_per_unit * image_halves;  // one unit's images
  unsigned char* const stage = shared + static_cast<size_t>(buffers) * buffer_halves * 2;
  // A persistent grid (the host caps it at the blocks resident at once):
  // units blockIdx.x, + gridDim.x, ...  The last step is tested before it is
  // taken (unit + gridDim.x may not fit an int).
  int unit = blockIdx.x;
  if (unit >= num_units) return;  // block-uniform
  int sample;
  if (!NHWC && buffers == 2) {  // block-uniform
    // Two image buffers: the next unit's rows are copied (cp.async) into one
    // while the warps work on the other.  The padding is zeroed once; a
    // band's rows outside the image are zeroed before its copies (units of
    // whole planes copy the same rows every time).
    zero_vectors(images, 2 * buffer_halves / 8);
    __syncthreads();
    copy_unit<T, NHWC, IndexT>(images, src, unit_of<STRIDE, NHWC>(unit, a, sample), sample, a);
    dwgn::cp_async_commit();
    for (int b = 0;; b ^= 1) {
      const Unit u = unit_of<STRIDE, NHWC>(unit, a, sample);
      const bool more = num_units - unit > static_cast<int>(gridDim.x);
      if (more) {  // into the other buffer, last read before the previous unit's second barrier
        unsigned short* next_images = images + (b ^ 1) * buffer_halves;
        int next_sample;
        const Unit n = unit_of<STRIDE, NHWC>(unit + gridDim.x, a, next_sample);
        if (num_bands > 1) {  // one image: the rows above and below the band's source rows (all, if none)
          const int top = n.src_rows > 0 ? n.image_row0 : image_rows;
          const int end = n.src_rows > 0 ? n.image_row0 + n.src_rows : image_rows;  // <= image_rows
          zero_vectors(next_images, top * row_stride / 8);
          zero_vectors(next_images + end * row_stride, (image_rows - end) * row_stride / 8);
        }
        copy_unit<T, NHWC, IndexT>(next_images, src, n, next_sample, a);
      }
      dwgn::cp_async_commit();  // (an empty group past the last unit)
      dwgn::cp_async_wait<1>();  // this unit's copies landed (the next unit's may be in flight)
      __syncthreads();
      T* const unit_dst = unit_destination<T, NHWC, IndexT>(dst, u, sample, a);
      compute_unit<T, K, STRIDE, BACKWARD, NHWC>(images + b * buffer_halves,
                                                 reinterpret_cast<T*>(stage + dwgn::head_bytes(unit_dst)), u, weight,
                                                 bias, a);
      __syncthreads();  // the unit's outputs are staged; its images are read
      dwgn::store_unit(stage, unit_dst, u.planes * u.out_rows * dst_width);
      if (!more) break;
      unit += gridDim.x;
    }
    return;
  }
  if (NHWC && buffers == 2) {  // block-uniform
    // Pixels copied ahead: the next unit's pixels land (cp.async) in `raw`
    // while the warps work on this unit's images; once landed they are split
    // into the images (the padding zeroed once, a unit's rows outside its
    // source rows before its split).
    uint4* const raw = reinterpret_cast<uint4*>(shared + buffer_halves * 2);
    unsigned char* const pixel_stage = shared + buffer_halves * 2 + static_cast<size_t>(image_rows) * src_width * 16;
    zero_vectors(images, buffer_halves / 8);
    {
      const Unit first = unit_of<STRIDE, NHWC>(unit, a, sample);
      issue_pixels(raw, unit_pixels<T, IndexT>(src, first, sample, a), first.src_rows, src_width, channels);
      dwgn::cp_async_commit();
    }
    for (;;) {
      const Unit u = unit_of<STRIDE, NHWC>(unit, a, sample);
      const bool more = num_units - unit > static_cast<int>(gridDim.x);
      // (the previous unit's warps finished reading the images before its last barrier)
      const int top = u.src_rows > 0 ? u.image_row0 : image_rows;
      const int end = u.src_rows > 0 ? u.image_row0 + u.src_rows : image_rows;  // <= image_rows
#pragma unroll 1
      for (int c = 0; c < 8; ++c) {
        zero_vectors(images + c * image_halves, top * row_stride / 8);
        zero_vectors(images + c * image_halves + end * row_stride, (image_rows - end) * row_stride / 8);
      }
      dwgn::cp_async_wait<0>();
      __syncthreads();  // this unit's pixels landed
      split_pixels(images, image_halves, raw, u.src_rows, src_width, u.image_row0, row_stride);
      __syncthreads();  // the images are whole; raw is free
      if (more) {
        int next_sample;
        const Unit n = unit_of<STRIDE, NHWC>(unit + gridDim.x, a, next_sample);
        issue_pixels(raw, unit_pixels<T, IndexT>(src, n, next_sample, a), n.src_rows, src_width, channels);
      }
      dwgn::cp_async_commit();
      compute_unit<T, K, STRIDE, BACKWARD, NHWC>(images, reinterpret_cast<T*>(pixel_stage), u, weight, bias, a);
      __syncthreads();  // the unit's outputs are staged
      store_pixels(reinterpret_cast<const unsigned short*>(pixel_stage),
                   reinterpret_cast<uint4*>(unit_destination<T, NHWC, IndexT>(dst, u, sample, a)), u.out_rows,
                   dst_width, channels);
      if (!more) break;
      unit += gridDim.x;
    }
    return;
  }
  for (;;) {  // one buffer: zero, copy, work, store
    const Unit u = unit_of<STRIDE, NHWC>(unit, a, sample);
    // The images' padding is zero; the rows land over it after the barrier
    // (the previous unit's warps finished reading them before its second barrier).
    zero_vectors(images, u.planes * image_halves / 8);
    __syncthreads();
    copy_unit<T, NHWC, IndexT>(images, src, u, sample, a);
    dwgn::cp_async_commit();
    dwgn::cp_async_wait<0>();
    __syncthreads();  // every row landed
    T* const unit_dst = unit_destination<T, NHWC, IndexT>(dst, u, sample, a);
    // NCHW: the range starts at stage + head_bytes(unit_dst) (dwgn::store_unit); NHWC: at stage.
    compute_unit<T, K, STRIDE, BACKWARD, NHWC>(
        images, reinterpret_cast<T*>(stage + (NHWC ? 0 : dwgn::head_bytes(unit_dst))), u, weight, bias, a);
    __syncthreads();  // the unit's outputs are staged
    if (NHWC) {
      store_pixels(reinterpret_cast<const unsigned short*>(stage), reinterpret_cast<uint4*>(unit_dst), u.out_rows,
                   dst_width, channels);
    } else {
      dwgn::store_unit(stage, unit_dst, u.planes * u.out_rows * dst_width);
    }
    if (num_units - unit <= static_cast<int>(gridDim.x)) break;
    unit += gridDim.x;
  }
}
