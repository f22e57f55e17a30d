// Batched 2-D transpose: dst[b][c][r] = src[b][r][c] for b < batch, r < rows,
// c < cols.  NHWC -> NCHW is rows = H*W, cols = C; NCHW -> NHWC is rows = C,
// cols = H*W.  The channels-last large-filter depthwise path
// (cupy_dwgn/_depthwise_nhwc_large.py) brackets the NCHW large-filter
// kernels with it.
//
// Template parameters: Word, an unsigned integer of the element's size (the
// values are moved, never computed on: one kernel per element size), and
// IndexT (int, or long long when the tensor has >= 2**31 elements).
//
// A block of 32 x 8 threads moves 32 x 32 tiles: each warp reads 32
// consecutive columns of a source row (coalesced), the tile goes through
// shared memory (row pitch 33 words: the transposed reads of a column hit 32
// different banks for 4-byte words), and each warp writes 32 consecutive
// rows of a destination row.  Tiles are numbered (image, tile row, tile
// column) and the blocks walk them grid-size apart, so the grid (at most
// 2**20 blocks) covers any number of tiles.

#include "dwgn_common.cuh"

namespace dwgn_transpose_detail {
constexpr int kTile = 32;
constexpr int kRowsPerPass = 8;  // blockDim.y
}  // namespace dwgn_transpose_detail

template <typename Word, typename IndexT>
__global__ void __launch_bounds__(256) dwgn_transpose(const Word* __restrict__ src, Word* __restrict__ dst,
                                                      int rows, int cols, int tiles_r, int tiles_c,
                                                      long long tiles) {
  using namespace dwgn_transpose_detail;
  __shared__ Word tile[kTile][kTile + 1];
  const long long per_image = static_cast<long long>(tiles_r) * tiles_c;
  for (long long t = blockIdx.x; t < tiles; t += gridDim.x) {
    const long long image = t / per_image;
    const int rest = static_cast<int>(t - image * per_image);
    const int tr = rest / tiles_c;
    const int tc = rest - tr * tiles_c;
    const IndexT base = static_cast<IndexT>(image) * rows * cols;
    const int c = tc * kTile + threadIdx.x;
#pragma unroll
    for (int i = threadIdx.y; i < kTile; i += kRowsPerPass) {
      const int r = tr * kTile + i;
      if (r < rows && c < cols) tile[i][threadIdx.x] = src[base + static_cast<IndexT>(r) * cols + c];
    }
    __syncthreads();  // the tile is complete
    // Destination row = source column, destination column = source row.
    const int r = tr * kTile + threadIdx.x;
#pragma unroll
    for (int i = threadIdx.y; i < kTile; i += kRowsPerPass) {
      const int column = tc * kTile + i;
      if (column < cols && r < rows) dst[base + static_cast<IndexT>(column) * rows + r] = tile[threadIdx.x][i];
    }
    __syncthreads();  // every thread read the tile before the next one overwrites it
  }
}
