"""Why does dwgn_gn_stats take its read floor plus 9-15 us on tensors past L2?
Read-only probes of its access pattern, next to the statistics kernel itself.

The statistics kernel (kernels/group_norm.cu, dwgn_gn_stats) gives each of
about 256 blocks one contiguous chunk of rows (1x512x512x128 fp16: 1024 rows
of 256 bytes, chunks 256 KB apart), two blocks per SM (118 registers).  The
elementwise kernels sweep the tensor front to back with a grid-stride loop and
reach 84-108% of their floor.  These probes read a channels-last tensor (16-byte
vectors, rows of W vectors, lanes = 256 / W rows at a time per block, DEPTH
loads in flight per thread) in three orders, with occupancy pinned at two
blocks per SM by dynamic shared memory (as the statistics kernel) or not:

* ``chunks B``: block b reads rows [b * R, (b + 1) * R), R = rows / B (the
  statistics kernel's order; B = 256 puts chunk starts a power of two apart,
  263 does not: DRAM channel camping would show there);
* ``stripes B``: block b reads row groups b, b + B, b + 2B, ... (a group =
  ``lanes`` rows): every block sweeps the tensor front to back together;
* ``grid-stride``: the elementwise kernels' order (one vector per thread per
  step; the shipped kernels take two on float16 tensors of 16 MB and more),
  occupancy free.

and the library's forward with the statistics split's item count changed
(_GROUPED_TARGET_BLOCKS 256, 263, 264; "split" path, whose first launch is
the statistics kernel alone, and the shipped "fused" one, timed per kernel by
the profiler).  Findings: results/group_norm_stats_probe_h100_2026-12-05.txt.

    PYTHONPATH=.:benchmarks python benchmarks/group_norm_read_probe.py   # under 2 minutes on an H100
"""

import cupy
import torch

import cupy_dwgn
from cupy_dwgn import _group_norm as gn
from group_norm_tuning import clear
from harness import kernel_profile, rotating, run_facts, time_us

SOURCE = r"""
template <int DEPTH>
__device__ __forceinline__ void read_rows(const uint4* __restrict__ x, long long row0, long long rows,
                                          long long step, int width, unsigned int* __restrict__ out) {
  // This thread reads column (threadIdx.x % width) of rows row0 + lane,
  // row0 + lane + step, ... below rows, DEPTH loads in flight.
  const int lanes = blockDim.x / width, lane = threadIdx.x / width, col = threadIdx.x % width;
  unsigned int acc = 0;
  if (lane < lanes) {
    long long r = row0 + lane;
    for (; r + (DEPTH - 1) * step < rows; r += DEPTH * step) {
      uint4 v[DEPTH];
#pragma unroll
      for (int d = 0; d < DEPTH; ++d) v[d] = x[(r + d * step) * width + col];
#pragma unroll
      for (int d = 0; d < DEPTH; ++d) acc ^= v[d].x ^ v[d].y ^ v[d].z ^ v[d].w;
    }
    for (; r < rows; r += step) {
      const uint4 v = x[r * width + col];
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
  }
  if (acc == 0x12345678u) out[blockIdx.x * blockDim.x + threadIdx.x] = acc;  // keeps the loads
}

// Block b: rows [b * per_block, (b + 1) * per_block), lanes at a time.
template <int DEPTH>
__global__ void probe_chunks(const uint4* x, long long rows, long long per_block, int width, unsigned int* out) {
  extern __shared__ unsigned char occupancy_pin[];
  const long long row0 = blockIdx.x * per_block;
  const long long end = row0 + per_block < rows ? row0 + per_block : rows;
  read_rows<DEPTH>(x, row0, end, blockDim.x / width, width, out);
}

// Block b: row groups (lanes rows each) b, b + gridDim.x, ...
template <int DEPTH>
__global__ void probe_stripes(const uint4* x, long long rows, long long, int width, unsigned int* out) {
  extern __shared__ unsigned char occupancy_pin[];
  const long long lanes = blockDim.x / width;
  read_rows<DEPTH>(x, blockIdx.x * lanes, rows, lanes * gridDim.x, width, out);
}

__global__ void probe_grid_stride(const uint4* __restrict__ x, long long n, unsigned int* __restrict__ out) {
  unsigned int acc = 0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const uint4 v = x[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}
"""
NAMES = [f"probe_{kind}<{depth}>" for kind in ("chunks", "stripes") for depth in (4, 8)] + ["probe_grid_stride"]
BLOCK = 256
PIN_BYTES = 100 * 1024  # two blocks per SM (228 KB of shared memory an SM), as the statistics kernel's registers
CASES = [(1, 512, 512, 128), (1, 1024, 1024, 128), (8, 128, 128, 320)]
L2_BYTES = 60 * 2**20


def main():
    _, facts = run_facts(torch)
    bandwidth = facts["copy_bandwidth_TBps"] * 1e6  # bytes per us, read + write
    module = cupy.RawModule(code=SOURCE, options=("-std=c++17",), name_expressions=NAMES)
    kernels = {name: module.get_function(name) for name in NAMES}
    for name in NAMES[:4]:
        kernels[name].max_dynamic_shared_size_bytes = PIN_BYTES
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    out = cupy.zeros(1 << 22, cupy.uint32)
    for shape in CASES:
        n, h, w, c = shape
        nbytes = n * h * w * c * 2
        copies = max(2, -(-2 * L2_BYTES // nbytes))
        xs = [cupy.random.default_rng(k).standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
              for k in range(copies)]
        width, rows = c * 2 // 16, n * h * w
        read_floor = nbytes / bandwidth  # the bytes read, moved at the copy's rate (which counts read + write)
        print(f"\n{n}x{h}x{w}x{c} fp16 ({nbytes / 2**20:.0f} MB): read floor {read_floor:.1f} us "
              f"at the copy rate; rows of {width} vectors", flush=True)

        def probe(name, blocks, per_block, pin):
            kernel = kernels[name]
            calls = [lambda x=x: kernel((blocks,), (BLOCK,), (x, cupy.int64(rows), cupy.int64(per_block),
                                                               cupy.int32(width), out), shared_mem=pin)
                     for x in xs]
            us = time_us(rotating(calls))
            print(f"  {name:22s} blocks {blocks:5d} pin {'yes' if pin else 'no ':3s} {us:7.1f} us "
                  f"({100 * read_floor / us:3.0f}% of the read floor)", flush=True)

        for blocks in (256, 263, 264, 512):
            per_block = -(-rows // blocks)
            for depth in (4, 8):
                probe(f"probe_chunks<{depth}>", blocks, per_block, PIN_BYTES if blocks <= 2 * sms else 0)
        for blocks in (256, 264, 4 * sms, 8 * sms):
            for depth in (4, 8):
                probe(f"probe_stripes<{depth}>", blocks, 0, PIN_BYTES if blocks <= 2 * sms else 0)
        grid = kernels["probe_grid_stride"]
        vectors = nbytes // 16
        for blocks in (2 * sms, 8 * sms, 32 * sms):
            calls = [lambda x=x: grid((blocks,), (BLOCK,), (x, cupy.int64(vectors), out)) for x in xs]
            us = time_us(rotating(calls))
            print(f"  {'probe_grid_stride':22s} blocks {blocks:5d} pin no  {us:7.1f} us "
                  f"({100 * read_floor / us:3.0f}% of the read floor)", flush=True)
        # The statistics kernel alone ("split": its finalize is a launch of its own) at three item counts.
        shipped = gn._GROUPED_TARGET_BLOCKS
        for target in (256, 263, 264):
            gn._GROUPED_TARGET_BLOCKS = target
            gn.FORWARD_PATH = "split"
            clear()
            calls = [lambda x=x: cupy_dwgn.group_norm(x, 32) for x in xs]
            split = kernel_profile(torch, rotating(calls))
            gn.FORWARD_PATH = "auto"
            clear()
            fused = kernel_profile(torch, rotating(calls))
            print(f"  library, {target} items: split stats {split['void dwgn_gn_stats'][0]:.1f} us, finalize "
                  f"{split['void dwgn_gn_fwd_finalize'][0]:.1f}, apply {split['void dwgn_gn_fwd_apply'][0]:.1f}; "
                  f"fused stats {fused['void dwgn_gn_stats'][0]:.1f}, apply {fused['void dwgn_gn_fwd_apply'][0]:.1f}; "
                  f"forward GPU time {time_us(rotating(calls)):.1f} us", flush=True)
        gn._GROUPED_TARGET_BLOCKS = shipped
        clear()
        del xs


if __name__ == "__main__":
    main()
