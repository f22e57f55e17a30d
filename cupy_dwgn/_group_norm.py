"""Channels-last GroupNorm with a fused activation, on CuPy arrays: forward and backward.

x is (N, *spatial, C) with 0 to 3 spatial dimensions, C fastest in memory
(NHWC for images; a PyTorch ``channels_last`` tensor seen through DLPack is
one ``transpose(0, 2, 3, 1)`` away).  Statistics are per (sample, group) over
the spatial positions and the C / num_groups channels of the group, with the
biased variance, accumulated in float32 (float64 for float64 inputs).
"""

import functools
import math
import typing

import cupy
import numpy
from cupy import ndarray as _ndarray

from . import _checks, _compile, _dtypes, _interop, _launch, _workspace
from ._launch import i32

KERNEL_FILE = "group_norm.cu"

#: Activations, in the order of their template code in group_norm.cu.
ACTIVATIONS = _checks.ACTIVATIONS
_ACT_CODE = {name: code for code, name in enumerate(ACTIVATIONS)}

#: The keyword arguments of specializations() that cupy_dwgn.precompile forwards.
SELECTION_KEYS = ("dtypes", "activations", "large_index")

_STATS = "dwgn_gn_stats"
_FWD_FINALIZE = "dwgn_gn_fwd_finalize"
_APPLY = "dwgn_gn_fwd_apply"
_BWD_REDUCE = "dwgn_gn_bwd_reduce"
_BWD_FINALIZE = "dwgn_gn_bwd_finalize"
_BWD_DX = "dwgn_gn_bwd_dx"
_ONEPASS = "dwgn_gn_fwd_onepass"
_BWD_ONEPASS = "dwgn_gn_bwd_onepass"
_RESIDENT = "dwgn_gn_fwd_resident"
_BWD_RESIDENT = "dwgn_gn_bwd_resident"
_CLUSTER = "dwgn_gn_fwd_cluster"
_BWD_CLUSTER = "dwgn_gn_bwd_cluster"
_SMALL = "dwgn_gn_fwd_small"
_BWD_SMALL = "dwgn_gn_bwd_small"
_BWD_WEIGHTS = "dwgn_gn_bwd_weights"

# ---------------------------------------------------------------------------
# Path choice (written down here, applied by _path, _small_serves,
# _cluster_geometry and _onepass_geometry):
#
# * small groups, taken by "auto" on every device for groups of at most
#   _SMALL_MAX_GROUP elements (S * D: many samples of few rows, (N, C)
#   inputs): dwgn_gn_fwd_small (ONE launch) and dwgn_gn_bwd_small +
#   dwgn_gn_bwd_weights (two), a warp per (sample, group); measurements at
#   its constants below.
# * the cluster forward, taken by "auto" on a device of compute capability 9
#   (thread-block clusters) with cooperative launches: dwgn_gn_fwd_cluster,
#   ONE launch, no grid barrier, no workspace, x read once into the shared
#   memory of a cluster of CTAs per (sample, set of whole groups); where
#   _cluster_geometry's rule takes it (clusters of at most 8 CTAs, tensors
#   of at most 16 MB, the vector path; measurements at its constants below),
#   else the two launches.  The cluster backward, dwgn_gn_bwd_cluster, the
#   same way (x and grad_out read once; clusters of at most 4 CTAs, tensors
#   of at most 16 MB; its constants below), its weight gradients added by
#   the last cluster of each channel set (a ticket in the workspace header).
# * two launches, taken by "auto" (where the cluster kernels are not) and
#   "fused" on a device that supports cooperative launches:
#   forward  stats (its finalize after a grid barrier) -> fwd_apply;
#   backward bwd_reduce (its finalize after a grid barrier) -> bwd_dx.
#   The column kernel runs cooperatively (every block resident: its grid is
#   a block per item of its larger phase, statistics or finalize, at most
#   65536 and at most the resident blocks, from an occupancy value cached
#   per kernel and device), so its finalize (mean/rstd and the
#   per-channel coefficients; for the backward also dweight/dbias) needs no
#   launch of its own.  Measured on an H200 (2026-11-30, GPU time with
#   rotating copies) it takes the same GPU time as the three launches
#   (2x64x64x320 fp16 SiLU forward/backward 17.1/19.0 us against 17.1/19.3;
#   8x128x128x320 fp16 95.2/144.7 against 98.1/143.1): its finalize phase is
#   no faster than the finalize kernel.  It saves a launch per direction,
#   about 4.5 us of host time each (benchmarks/host_overhead.py).
# * the three launches, "split", and "auto" on a device without cooperative
#   launches: the same column kernel without its finalize, then
#   fwd_finalize / bwd_finalize, then fwd_apply / bwd_dx.
# * "one-pass", only when FORWARD_PATH / BACKWARD_PATH is "onepass":
#   dwgn_gn_fwd_onepass / dwgn_gn_bwd_onepass, ONE cooperative launch each
#   (statistics or reduce, grid barrier, finalize, grid barrier, apply or
#   dx; x (and grad_out) read twice, the second time from L2).  Measured on
#   an H200 (2026-11-30, CUDA-graph GPU time, SD U-Net shapes 2-20 MB, fp16
#   and fp32, identity and SiLU) it was slower than the three launches in
#   every cell (forward 12-27 us against 9-16, backward 16-23 against
#   12-30): the cooperative grid holds only 2-3 blocks per SM (its phase-1
#   registers), so its apply and dx phases run at a fraction of the
#   bandwidth of the standalone kernels, and its finalize phase keeps N * G
#   blocks busy while the rest wait at the barrier.  It stays a tested,
#   opt-in path for that work; it needs
#     - fewer than 2**31 elements (32-bit indices only);
#     - a row of C channels in one block: forward C / VEC <= min(512, 2048 /
#       VEC) vectors (VEC = 16 bytes of elements on the vector path, 1 on
#       the scalar path), backward C / VEC <= 256;
#     - a device that supports cooperative launches;
#   else the three launches run.
#
# * "resident", only when FORWARD_PATH / BACKWARD_PATH is "resident":
#   dwgn_gn_fwd_resident / dwgn_gn_bwd_resident, ONE cooperative launch per
#   direction that reads x (and grad_out) from DRAM once.  Each block keeps
#   a tile of whole rows (all C channels) in shared memory from its load to
#   its stores: tile statistics, one grid barrier, every block combines its
#   sample's tiles (gn::segment_sums), applies (or forms dx) from the tile.
#   Measured on an H200 (2026-12-02, CUDA-graph GPU time, rotating copies,
#   SiLU; benchmarks/group_norm_tuning.py --paths;
#   results/group_norm_resident_h200_2026-12-02.txt) it is slower than the
#   two launches in every SD-size cell but one (2x64x64x320 fp16
#   forward/backward 18.4/19.3 us against 15.4/18.3; 2x16x16x1280 fp16
#   15.7/15.4 against 10.9/11.9; 8x8x8x1280 fp32 forward 10.6 against
#   11.1): one block of 480-512 threads per SM (its tile) runs ~2400
#   instructions per warp at ~13.5 cycles each (Nsight Compute: 23% of the
#   forward's stall samples in combining the tiles' L2 partials, 35% in the
#   tile reductions, 19% in the apply, 13% waiting on the tile's loads), so
#   the phases are latency-bound where the two launches spread the same work
#   over many more warps.  It stays a tested, opt-in path for that work; it
#   needs
#     - a grid of N * B blocks (B = max(1, _RESIDENT_BLOCKS // N) blocks per
#       sample, fewer when S has fewer rows) all resident at once on the
#       device, with tiles (x, and grad_out backward) of at most
#       _RESIDENT_MAX_TILE bytes in all and the shared memory the device
#       allows a block (checked per device, from the occupancy, once per
#       signature: _resident_fits; a grid is never shrunk, each block owns
#       its tile);
#     - a row of C channels in one block (C / VEC <= _RESIDENT_MAX_BLOCK);
#     - fewer than 2**31 elements;
#   else the two launches run ("fused"; "split" without cooperative launches).
#
# Also measured on an H200 and dropped (2026-12-03, the SD-size forward at
# 15.3 us against the 12; results/group_norm_sd_designs_h200_2026-12-03.txt):
# a last-block ("ticket") finalize per sample instead of the grid barrier
# (statistics kernel 9-30 us: one block's chain of L2 round trips); the
# apply kernel finalizing for itself from grouped partials (statistics 6.4-8
# us without its finalize, but 16.1-17.1 us in all at 2x64x64x320 fp16); the
# elementwise kernels by column with each column's coefficients loaded once
# (apply alone up to 19% faster, the op's forward -3% to +6%, backward 1-15%
# slower).
# Where the statistics kernel's time goes past L2 (H100, 2026-12-05;
# benchmarks/group_norm_read_probe.py and Nsight Compute by SASS region,
# results/group_norm_stats_probe_h100_2026-12-05.txt): its row walk reads at
# the rate of a read-only kernel in the same order (64 MB fp16 in 25 us; in
# stripes or grid-stride no faster), and the kernel takes that plus a fixed
# ~9.5 us without its finalize (64 MB and 256 MB alike) and ~14 us with it:
# the lane combine, the barriers' wait for the block or grid's slowest warp,
# the finalize phase (~4 us, as the finalize kernel plus a launch).
FORWARD_PATH = "auto"  # "auto", "small", "cluster", "fused", "split", "onepass" or "resident" (tests and benchmarks force one)
BACKWARD_PATH = "auto"
# Phase-1 work items (n, chunk of rows): about this many in all, each at
# least lanes * row batch rows (every thread gets a whole batch).  Shape only.
_ONEPASS_ITEMS = 512
_ONEPASS_SLOTS = 2048  # gn::kOnePassSlots: lanes * C shared summaries
# More blocks than any GPU holds at once (132 SMs x 32 blocks = 4224 on an
# H200): the cooperative grid is below it, so item counts below
# 2**31 - _ONEPASS_GRID_LIMIT never overflow when stepped by the grid.
_ONEPASS_GRID_LIMIT = 2**16

# The resident kernels' grid: about this many blocks in all (one per SM of
# an H200's 132; B = _RESIDENT_BLOCKS // N per sample), tiles of at most
# _RESIDENT_MAX_TILE bytes (x, or x and grad_out), blocks of at most _RESIDENT_MAX_BLOCK
# threads (the kernel's __launch_bounds__).  64 or 32 blocks in all
# measured mixed against 128 (H200, the --paths run above: within -3.5 to
# +5.6 us per cell).
_RESIDENT_BLOCKS = 128
_RESIDENT_MAX_TILE = 160 * 1024
_RESIDENT_MAX_BLOCK = 512

# The cluster forward (its rule: _cluster_geometry).  Cluster sizes compiled
# (the kernel's __cluster_dims__; 16 is a non-portable size, H100 / H200 only);
# about _CLUSTER_TARGET_CTAS CTAs in all (two per SM of an H200: fewer left
# SMs idle in the prototype, results/group_norm_cluster_prototype_*); tiles
# of at most _CLUSTER_MAX_TILE bytes (two CTAs per SM, and a 16-CTA cluster
# fits a GPC); channel sets of at least _CLUSTER_MIN_SET_BYTES per row;
# blocks of at most _CLUSTER_BLOCK threads (the kernel's __launch_bounds__),
# no more lanes than a CTA has rows but a warp at least.  "auto" takes it
# for clusters of at most _CLUSTER_AUTO_MAX_SIZE CTAs and tensors of at most
# _CLUSTER_AUTO_MAX_BYTES.  Measured on an H200
# (2026-12-04, forward GPU time, CUDA graph over rotating copies, SiLU;
# benchmarks/group_norm_tuning.py --cluster; results/group_norm_cluster_h200_2026-12-04.txt),
# cluster against the two launches, us:
#   - clusters of 1-8 CTAs: 2x32x32x640 fp16 11.3 / 13.9, fp32 12.5 / 13.5;
#     2x16x16x1280 fp16 9.7 / 10.9, fp32 9.4 / 10.7; 8x8x8x1280 fp16 8.7 /
#     11.4, fp32 8.7 / 11.2; 4x32x32x640 fp16 14.3 / 15.8; 2x64x64x640 fp16
#     20.7 / 21.2; but 2x64x64x320 fp32 18.5 / 18.2;
#   - clusters of 16: 2x64x64x320 fp16 15.5 / 15.4, 1x128x128x128 fp16 14.6
#     / 14.5, fp32 16.7 / 16.3, and tensors past L2 far slower (8x128x128x320
#     fp16 119.7 / 84.3, 4x64x64x2560 fp32 225.4 / 138.6: CTAs of large tiles
#     in waves, each loading, reducing and storing in turn);
#   - past L2, even in clusters of 8: 4x64x64x2560 fp16 100.8 / 81.6 (84 MB;
#     benchmarks/group_norm.py, results/group_norm_h200_2026-12-04a.json, a run before this bound);
#   - blocks of 128 threads against 256: 2x32x32x640 fp16 11.3 / 13.2,
#     8x8x8x1280 fp16 8.7 / 10.2, 2x64x64x320 fp16 15.5 / 16.4 (384: 23.6; 64:
#     17.8): the barriers and reductions cost more with more lanes than the
#     rows they share out save.
CLUSTER_SIZES = (1, 2, 4, 8, 16)
_CLUSTER_TARGET_CTAS = 256
_CLUSTER_MAX_TILE = 96 * 1024
_CLUSTER_MIN_SET_BYTES = 32
_CLUSTER_BLOCK = 128
_CLUSTER_AUTO_MAX_SIZE = 8
_CLUSTER_AUTO_MAX_BYTES = 16 * 2**20
# The cluster backward (dwgn_gn_bwd_cluster: tiles of x and grad_out, the
# weight gradients by the last cluster of each set): the same rule with its
# own constants (both tiles within _CLUSTER_MAX_TILE; clusters of at most
# 8 CTAs compiled; blocks of at most _CLUSTER_BWD_BLOCK threads for 2-byte
# types, _CLUSTER_BWD_WIDE_BLOCK for 4- and 8-byte ones, within the
# kernel's __launch_bounds__ of 256) and at most _workspace.TICKET_COUNT
# channel sets; "auto" takes it for clusters of at most
# _CLUSTER_BWD_AUTO_MAX_SIZE CTAs and tensors of at most
# _CLUSTER_BWD_AUTO_MAX_BYTES.  Measured on an H200 (2026-12-04, backward
# GPU time, CUDA graph over rotating copies, SiLU;
# benchmarks/group_norm_tuning.py --cluster-backward;
# results/group_norm_cluster_backward_h200_2026-12-04.txt), cluster against
# the two launches, us:
#   - fp16, 128 threads: 8x8x8x1280 8.8 / 14.2, 2x16x16x1280 9.1 / 11.8,
#     2x32x32x640 13.3 / 15.0, 4x32x32x640 16.4 / 19.3; but 2x64x64x320
#     (clusters of 8) 19.7 / 18.2;
#   - fp32, 256 threads (128: 10.7, 12.5, 20.1, 25.7, 40.5): 8x8x8x1280
#     10.0 / 14.9, 2x16x16x1280 10.8 / 13.5, 2x32x32x640 16.6 / 16.6,
#     4x32x32x640 22.5 / 23.7; but 2x64x64x320 (clusters of 8: 32 clusters
#     of 84 KB CTAs, more than the GPCs place at once) 31.6 / 22.7;
#   - about 256 CTAs in place of 128: fp16 2x32x32x640 12.5, 2x16x16x1280
#     9.6, 4x32x32x640 17.3; sets of at least 128 bytes: mixed (8x8x8x1280
#     fp16 8.6, 4x32x32x640 fp16 19.4).
# Small groups (dwgn_gn_fwd_small / dwgn_gn_bwd_small + dwgn_gn_bwd_weights:
# a warp per (sample, group) item): "auto" takes them, on every device, for
# groups of at most _SMALL_MAX_GROUP elements (S * D) -- many samples of few
# rows, where a block or cluster per (sample, set) mostly waits on its
# barriers.  Measured on an H200 (2026-12-04, forward / backward GPU time,
# SiLU, G = 32 unless named; benchmarks/group_norm_tuning.py --small --torch;
# results/group_norm_small_h200_2026-12-04.txt), small against cluster
# against the two launches, us (group size in brackets):
#   - 4096x1x1x64 G8 fp32 [8] 71.6/110.4 against 191.4/272.1 and
#     747.7/608.1 (PyTorch 85.5 forward, 209.6 forward+backward);
#     512x4x4x320 fp16 [160] 17.1/25.1, 37.8/68.5, 109.1/92.7 (PyTorch 28.6,
#     171.4); 128x8x8x256 fp16 [512] 11.8/14.3, 23.5/31.2, 35.9/34.5;
#     64x4x4x1280 fp32 [640] 10.0/25.2, 17.8/27.5, 26.4/27.3;
#   - but 32x8x8x640 fp16 [1280] 13.4/18.7 against 10.5/12.5 (two launches
#     17.8/18.5), 8x8x8x1280 fp16 [2560] 22.4/23.8 against 8.5/9.2 (11.4/14.1).
_SMALL_MAX_GROUP = 1024
_SMALL_BLOCK = 256  # the kernels' __launch_bounds__ (dwgn_gn_bwd_small's shared slots: 8 warps)
_WEIGHTS_BLOCK = 1024  # dwgn_gn_bwd_weights: 32 channels a block

BWD_CLUSTER_SIZES = (1, 2, 4, 8)
_CLUSTER_BWD_TARGET_CTAS = 128
_CLUSTER_BWD_MIN_SET_BYTES = 32
_CLUSTER_BWD_BLOCK = 128
_CLUSTER_BWD_WIDE_BLOCK = 256
_CLUSTER_BWD_AUTO_MAX_SIZE = 4
_CLUSTER_BWD_AUTO_MAX_BYTES = 16 * 2**20

# Statistics split: at most this many work items (blocks) in the column
# kernels (one wave of the cooperative grid: 2 blocks per SM on an H200's
# 132), fewer where a chunk would sum fewer than _MIN_ROWS_PER_CHUNK rows, or
# _MIN_ROWS_PER_LONG_CHUNK in samples of at least _LONG_SAMPLE_ROWS rows.
# Measured on an H200 (2026-12-01, forward / backward GPU time, SiLU, G = 32;
# benchmarks/group_norm_tuning.py): at most 256 against about 512 (the
# former rule, rounded up) kept every SD-size cell within 0.1 us and made
# 2x1x4093x320 fp16 19.7/22.8 -> 16.1/19.1 us (512 items were two waves),
# the large backwards faster (8x128x128x320 fp16 144.7 -> 139.0,
# 1x256x256x256 fp32 98.8 -> 94.1) and 4x64x64x2560 fp32 142.1/217.0 ->
# 139.7/220.9.  The split depends on the shape and the vector path only
# (never on the device or the grid), so results are bit-identical run to
# run.  Earlier (2026-11-30, per-channel statistics at every size, the same
# method): 512 items against 1024 made the forward
# of every tensor of 33 MB and more faster (8x128x128x320 fp16 105.5 -> 95.0 us, 1x512x512x128 fp16
# 90.2 -> 78.4, 4x64x64x2560 fp32 147.6 -> 142.7) and changed no SD-size
# one; 64-row chunks made samples of 4096+ rows faster (2x64x64x320 fp16
# forward 19.8 -> 17.1, 1x128x128x128 fp16 17.1 -> 14.0, backward likewise)
# and shorter samples slower (2x32x32x640 fp16 12.6 -> 14.5).  256 items
# won on single-wave shapes but lost 10% where the items just overflow one
# wave (4x64x64x2560 fp32: 280 items).
_TARGET_BLOCKS = 256
_MIN_ROWS_PER_CHUNK = 32
# 2-byte dtypes: measured on an H200 (2026-12-01, GPU time forward /
# backward, SiLU; benchmarks/group_norm_tuning.py with the constant set to
# 16): fp16 8x8x8x1280 11.8/15.0 -> 10.7/13.3 us, 2x16x16x1280 11.2/12.9 ->
# 10.4/11.5, 2x32x32x640 12.7/14.5 -> 13.0/14.7, 2x64x64x320 and
# 1x128x128x128 unchanged; float32 lost with 16 (2x32x32x640 13.1/16.1 ->
# 15.9/18.5: its items passed one wave) and 8 lost for both.
_MIN_ROWS_PER_HALF_CHUNK = 16
_MIN_ROWS_PER_LONG_CHUNK = 64
_LONG_SAMPLE_ROWS = 4096
# Column blocks of the vector path: at most this many columns (balanced),
# so a row of wide C gets several lanes and blocks (in one block, C = 1280
# fp16 leaves one lane of 160 threads walking every row of its chunk alone).
# The element-wise path takes up to _COLUMN_BLOCK columns per block.
_MAX_COLUMNS = 64
# The statistics kernel reads 16-byte vectors wherever the vector path
# applies, and sums each group's channels into per-group partial sums
# (gn::group_partials; _stats_split) for tensors of at least
# _GROUPED_BYTES: there about _GROUPED_TARGET_BLOCKS items (at most: one
# wave of the cooperative grid, 2 blocks per SM on an H200's 132) of at
# least _GROUPED_MIN_ROWS rows, so each block walks one long chunk and the
# finalize reads D times fewer partial sums; smaller tensors take the
# per-channel split above.  Measured on an H200 (2026-12-01, forward GPU
# time, rotating copies, SiLU, G = 32; benchmarks/group_norm_tuning.py
# --forward), after the lane combine lost its per-lane divisions:
#   - grouped, 256 items against per-channel, 512: 8x128x128x320 fp16 91.3
#     against 94.6 us, 1x512x512x128 fp16 73.6 against 77.0, 1x256x256x256
#     fp32 64.4 against 67.9 (128 items: 113.4, 84.3; 512: 95.5, 77.0);
#   - on SD-size tensors grouped lost (2x16x16x1280 fp16 12.6 against 11.3,
#     8x8x8x1280 fp32 12.0 against 10.7);
#   - vectors against elements on SD-size tensors: 2x64x64x320 fp16 15.8
#     against 17.0, fp32 17.6 against 19.5, 8x8x8x1280 fp32 10.7 against
#     11.7, 2x32x32x640 fp16 12.7 against 12.4 (the one loss over 0.2 us).
#     Before that change elements won below 16 MB.
# Groups of more than _MAX_GROUPED_CHANNELS channels keep per-channel sums
# (one thread sums a group's channels).  The backward reduce reads vectors at
# every size and keeps per-channel sums (the weight gradient needs them).
_GROUPED_BYTES = 16 * 2**20
_GROUPED_TARGET_BLOCKS = 256
_GROUPED_MIN_ROWS = 32
_MAX_GROUPED_CHANNELS = 64
# Vectors a thread of dwgn_gn_fwd_apply / dwgn_gn_bwd_dx takes per step (the
# kernels' U, their tensor loads issued together; _elementwise_vectors):
# 2 for float16 tensors of at least _ELEMENTWISE_BATCH_BYTES (so also
# wherever they need 64-bit indices), else 1 (with 32-bit indices the
# kernels' machine code before U existed); the grid is a thread per U vectors (at most
# _launch.MAX_BLOCKS blocks: the kernels walk any grid).  Measured
# (forward / backward GPU time, rotating copies, SiLU;
# benchmarks/group_norm_tuning.py --shipped and --vectors;
# results/group_norm_elementwise_ab_2026-12-05.txt), U = 2 against 1:
#   - H200 (2026-12-05, two runs per tree in one call, within 0.2 us of each other):
#     2-byte types past L2 faster, 8x128x128x320 fp16 84.2/133.3 -> 81.0/128.7
#     us, 1x512x512x128 fp16 68.4/106.2 -> 66.6/101.1; float32 mixed,
#     4x64x64x2560 138.3/215.0 -> 136.1/215.7, 1x256x256x256 64.0/93.2 ->
#     62.6/93.8; SD-size tensors slower or unchanged, 2x64x64x320 fp16
#     14.3/17.6 -> 14.7/18.8, fp32 18.6/22.2 -> 18.6/22.8, 1x128x128x128 fp16
#     13.9/15.9 -> 14.4/15.9 (more registers: fp16 apply 32 -> 40, dx 36-56
#     -> 52-68, so fewer blocks an SM); 2x32x32x640, 2x16x16x1280 and
#     8x8x8x1280 within 0.1 us;
#   - H100 (2026-12-05, one run, U = 2 on tensors of 16 MB and more): 8x128x128x320 fp16
#     104.7/170.3 -> 102.3/167.2, 1x512x512x128 fp16 81.7/127.7 ->
#     80.8/123.4; float32 slower, 4x64x64x2560 177.8/282.2 -> 178.0/284.6,
#     1x256x256x256 78.3/120.9 -> 78.7/122.2; so float32 and float64 keep
#     U = 1.  (That run's U = 1 kernels were not yet the code before: dx at
#     56 registers instead of 48 made the SD-size backward 0.4-0.7 us slower;
#     U = 1 now runs the plain loop, machine code identical to it.)
#   - H100 (2026-12-05, next session, --vectors: the shipped rule, U = 2 and U = 1 forced on
#     every 2-byte tensor, one call): bfloat16 slower at every size
#     measured, 8x128x128x320 105.5/170.6 -> 107.4/176.7, 1x1024x1024x128
#     281.2/466.6 -> 285.6/475.7, 1x512x512x128 81.7/126.2 -> 82.8/129.4,
#     8x64x64x640 (42 MB) 59.6/93.5 -> 59.4/100.3 (again 59.2/90.7 ->
#     58.9/98.3): bfloat16 keeps U = 1.  float16 from 21 MB on faster or
#     equal: 4x64x64x640 (21 MB) 32.8/49.4 -> 32.4/49.4, 2x128x128x320 (21
#     MB) 32.1/49.2 -> 32.0/48.8, 1x256x256x256 (34 MB) 46.0/72.2 ->
#     45.1/70.6, 1x384x384x128 (38 MB) 50.3/78.1 -> 49.8/76.1, 4x128x128x320
#     (42 MB) 56.3/87.7 -> 55.2/86.8, 1x1024x1024x128 280.8/477.2 ->
#     282.2/452.8, 8x128x128x320 105.7/163.1 -> 103.1/160.7.
#   - U = 4 (H200): slower than 2 everywhere (8x128x128x320 fp16 83.6/137.1,
#     2x64x64x320 fp16 16.1/19.1);
#   - also dropped (H100, same file): the first vector loaded before the
#     programmatic wait, to overlap the first kernel's finalize (within 0.6
#     us everywhere, 1x512x512x128 fp16 forward 81.8 -> 83.6).
#   The bound: float16 was slower at 4-5 MB (SD-size, H200) and faster from 21 MB
#   (H100; 16-48 MB not measured on an H200): 16 MB, about where the
#   apply and dx stop finding the tensor in L2 after the statistics pass.
#   float32 was slower at 8-10 MB too (1x128x128x128 15.3/19.1 ->
#   15.6/20.1 on the H200).
_ELEMENTWISE_BATCH_BYTES = 16 * 2**20


def _elementwise_variants(dtype, index):
    """The U compiled for ``dtype`` at index width ``index`` (what
    _elementwise_vectors can pick): float16 1 and 2 with 32-bit indices,
    2 with 64-bit ones (they are past the bound); others 1."""
    if numpy.dtype(dtype) != numpy.float16:
        return (1,)
    return (1, 2) if index == "int" else (2,)
_COLUMN_BLOCK = _checks.COLUMN_BLOCK  # block size of the column kernels (their shared scratch is sized for it)


def _vec_width(dtype):
    """Elements per 16-byte access."""
    return 16 // numpy.dtype(dtype).itemsize


weight_dtypes = _checks.weight_dtypes


def _acc_ctype(dtype):
    return _dtypes.ctype(_dtypes.accumulator_dtype(dtype))


def specializations(op=None, dtypes=None, activations=None, large_index=(False, True)):
    """``(file, name expression)`` for each kernel specialization of ``op``
    ("group_norm", "group_norm_backward"; default both).

    dtypes: input dtypes (default: all four; the weight dtypes each accepts are
    included); activations: names from ACTIVATIONS (default: all);
    large_index: which index widths (False: 32-bit, True: 64-bit).
    """
    ops = ("group_norm", "group_norm_backward") if op is None else (op,)
    for o in ops:
        if o not in ("group_norm", "group_norm_backward"):
            raise ValueError(f"op: expected 'group_norm' or 'group_norm_backward', got {o!r}")
    dtypes = tuple(_dtypes.CTYPES) if dtypes is None else tuple(numpy.dtype(d) for d in dtypes)
    activations = ACTIVATIONS if activations is None else tuple(activations)
    for name in activations:
        _check_activation(name)
    large_index = (large_index,) if isinstance(large_index, bool) else tuple(large_index)
    indices = ["long long" if large else "int" for large in large_index]
    name = _compile.name_expression
    specs = []
    for dtype in dtypes:
        t = _dtypes.ctype(dtype)
        acc = _acc_ctype(dtype)
        ws = [_dtypes.ctype(w) for w in weight_dtypes(dtype)]
        vecs = (1, _vec_width(dtype))
        for op_name in ops:
            if op_name == "group_norm":
                specs += [name(_STATS, t, w, v, i) for w in ws for v in vecs for i in indices]
                specs += [name(_FWD_FINALIZE, acc, w) for w in ws]
                specs += [
                    name(_APPLY, t, _ACT_CODE[a], v, i, u)
                    for a in activations for v in vecs for i in indices for u in _elementwise_variants(dtype, i)
                ]
                if "int" in indices:  # the one-pass and resident kernels are 32-bit only
                    specs += [
                        name(_ONEPASS, t, w, _ACT_CODE[a], v, "int")
                        for w in ws for a in activations for v in vecs
                    ]
                    specs += [name(_RESIDENT, t, w, _ACT_CODE[a], v) for w in ws for a in activations for v in vecs]
                    specs += [  # the vector path only
                        name(_CLUSTER, t, w, _ACT_CODE[a], vecs[1], size)
                        for w in ws for a in activations for size in CLUSTER_SIZES
                    ]
                    specs += [name(_SMALL, t, w, _ACT_CODE[a]) for w in ws for a in activations]
            else:
                specs += [
                    name(_BWD_REDUCE, t, w, _ACT_CODE[a], v, i)
                    for w in ws for a in activations for v in vecs for i in indices
                ]
                specs += [name(_BWD_FINALIZE, acc, w) for w in ws]
                specs += [
                    name(_BWD_DX, t, _ACT_CODE[a], v, i, u)
                    for a in activations for v in vecs for i in indices for u in _elementwise_variants(dtype, i)
                ]
                if "int" in indices:  # the one-pass and resident kernels are 32-bit only
                    specs += [
                        name(_BWD_ONEPASS, t, w, _ACT_CODE[a], v, "int")
                        for w in ws for a in activations for v in vecs
                    ]
                    specs += [
                        name(_BWD_RESIDENT, t, w, _ACT_CODE[a], v) for w in ws for a in activations for v in vecs
                    ]
                    specs += [  # the vector path only
                        name(_BWD_CLUSTER, t, w, _ACT_CODE[a], vecs[1], size)
                        for w in ws for a in activations for size in BWD_CLUSTER_SIZES
                    ]
                    specs += [name(_BWD_SMALL, t, w, _ACT_CODE[a]) for w in ws for a in activations]
                    specs += [name(_BWD_WEIGHTS, acc, w) for w in ws]
    return [(KERNEL_FILE, e) for e in dict.fromkeys(specs)]


_affine_dtype = _checks.affine_dtype


class _Plan(typing.NamedTuple):
    """Everything about one call's launches that depends only on its
    signature (shapes, dtypes, activation, eps, vector path) and path: the
    launches and the (shape, dtype) of the two temporaries.  Plans are
    cached, so a repeated call skips this work."""

    first: _launch.Launch  # stats (forward) / reduce (backward), with the finalize on the fused path
    finalize: _launch.Launch  # None on the fused path
    elementwise: _launch.Launch  # apply (forward) / dx (backward)
    temporaries: tuple  # ((shape, dtype) of the partial sums, of the coefficients)
    statistics: tuple = None  # (shape, dtype) of mean and of rstd (forward)
    onepass: _launch.Launch = None  # the one-pass kernel (then first/finalize/elementwise are None)
    resident: _launch.Launch = None  # the resident kernel, forward or backward (likewise)
    cluster: _launch.Launch = None  # the cluster forward or backward (likewise)
    small: _launch.Launch = None  # the small-group forward or backward (likewise; backward: then finalize)


def _vector_width(dtype, channels, aligned):
    """Elements per access: 16 bytes when C is a multiple of it and every
    pointer is 16-byte aligned, else 1 (the scalar path)."""
    vec = _vec_width(dtype)
    return vec if aligned and channels % vec == 0 else 1


def _geometry(batch, rows, channels, dtype, aligned):
    """What both directions derive from a signature: index type, element and
    accumulator types, the vector width and the flat kernels' vector count."""
    size = batch * rows * channels
    index = _launch.index_type(size)
    vec = _vector_width(dtype, channels, aligned)
    return index, _dtypes.ctype(dtype), _dtypes.accumulator_dtype(dtype), vec, _launch.index_scalar(index, size // vec)


def _path(setting, device):
    """The plans' path for a FORWARD_PATH / BACKWARD_PATH setting on
    ``device`` (the current one), where it can launch cooperative kernels (else "split"):
    "onepass", "resident", "cluster" and "small" (forced; the plans fall
    back to "fused" where they do not apply), "auto" on a device with
    thread-block clusters (each direction takes the small-group kernels
    where _small_serves says, else its cluster kernel where
    _cluster_geometry's rule does, else "fused"), "auto, no clusters" on
    one without (small groups, else "fused"), else "fused".  Without
    cooperative launches: "small, split" and "auto, split" (small groups
    as above, else "split"), else "split"."""
    if setting == "split" or not _launch.cooperative_supported():
        return f"{setting}, split" if setting in ("small", "auto") else "split"
    if setting == "small":
        return setting
    if setting in ("auto", "cluster"):
        if _launch.compute_capability_major(device) >= 9:
            return setting
        return "auto, no clusters" if setting == "auto" else "fused"
    return setting if setting in ("onepass", "resident") else "fused"


def _resident_block(cols):
    """Block size of the resident kernels for rows of ``cols`` vectors: the
    multiple of 32 in [64, _RESIDENT_MAX_BLOCK] holding lanes = block //
    cols whole rows with the smallest idle fraction (ties: the larger).
    None when a row does not fit."""
    candidates = [b for b in range(64, _RESIDENT_MAX_BLOCK + 1, 32) if b >= cols]
    if not candidates:
        return None
    return min(candidates, key=lambda b: ((b % cols) / b, -b))


def _resident_geometry(batch, rows, channels, groups, dtype, vec, backward=False):
    """(block, blocks_per_sample, rows_per_block, shared_mem) of the resident
    forward (or backward: tiles of x and grad_out), or None where the shape
    rule above sends it elsewhere (the device check is _resident_fits).
    Depends on the shape only."""
    if batch * rows * channels >= _launch.INT32_LIMIT:
        return None
    cols = channels // vec
    block = _resident_block(cols)
    if block is None:
        return None
    itemsize = numpy.dtype(dtype).itemsize
    per_sample = max(1, _RESIDENT_BLOCKS // batch)
    rows_per_block = -(-rows // per_sample)
    per_sample = -(-rows // rows_per_block)  # no block without rows
    tile = rows_per_block * channels * itemsize
    tiles = 2 if backward else 1
    if tiles * tile > _RESIDENT_MAX_TILE or batch * per_sample > _ONEPASS_GRID_LIMIT:
        return None
    acc = _dtypes.accumulator_dtype(dtype).itemsize
    # The kernels' layout: the tiles (16-byte rounded), two slot arrays of
    # lanes * C Acc, then forward gn::segment_sums' scratch (2 * block
    # doubles), mean and rstd (G doubles each) and the shifts (G Acc);
    # backward the scratch (2 * block Acc), the per-channel sums (2 * C Acc)
    # and the two dx coefficients (G Acc each).
    shared = tiles * (-(-tile // 16) * 16) + 2 * (block // cols) * channels * acc
    if backward:
        shared += (2 * block + 2 * channels + 2 * groups) * acc
    else:
        shared += 2 * block * 8 + groups * (16 + acc)
    return block, per_sample, rows_per_block, shared


def _cluster_geometry(batch, rows, channels, groups, dtype, vec, forced=False, backward=False):
    """(set_channels, cluster, block, rows_per_cta, shared_mem) of the
    cluster forward (or backward: tiles of x and grad_out), or None where it
    does not serve the shape (or, unless ``forced``, where the rule leaves it
    to the two launches).  A cluster owns (sample, set of set_channels
    channels): the fewest whole groups of whole 16-byte vectors dividing C
    whose row has at least _CLUSTER_MIN_SET_BYTES; ``cluster`` CTAs (a power
    of 2 up to 16, backward 8: the least giving _CLUSTER_TARGET_CTAS CTAs in
    all, more where a CTA's tiles would pass _CLUSTER_MAX_TILE) split its
    rows; the rule takes clusters of at most _CLUSTER_AUTO_MAX_SIZE on
    tensors of at most _CLUSTER_AUTO_MAX_BYTES.  The backward's constants
    are the _CLUSTER_BWD_ ones (its block by element size).  Depends on the
    shape only (the device check is _cluster_fits)."""
    itemsize = numpy.dtype(dtype).itemsize
    size = batch * rows * channels
    if vec == 1 or size >= _launch.INT32_LIMIT:
        return None
    tiles, sizes, target, min_set_bytes, auto_max_size, auto_max_bytes, max_block = (
        (2, BWD_CLUSTER_SIZES, _CLUSTER_BWD_TARGET_CTAS, _CLUSTER_BWD_MIN_SET_BYTES, _CLUSTER_BWD_AUTO_MAX_SIZE,
         _CLUSTER_BWD_AUTO_MAX_BYTES, _CLUSTER_BWD_BLOCK if itemsize == 2 else _CLUSTER_BWD_WIDE_BLOCK)
        if backward else (1, CLUSTER_SIZES, _CLUSTER_TARGET_CTAS, _CLUSTER_MIN_SET_BYTES, _CLUSTER_AUTO_MAX_SIZE,
                          _CLUSTER_AUTO_MAX_BYTES, _CLUSTER_BLOCK))
    group_channels = channels // groups
    unit = group_channels * vec // math.gcd(group_channels, vec)  # whole groups of whole vectors
    set_channels = next(
        (k * unit for k in range(1, channels // unit + 1)
         if channels % (k * unit) == 0 and k * unit * itemsize >= min_set_bytes), channels)
    cols = set_channels // vec
    if cols > max_block or (backward and channels // set_channels > _workspace.TICKET_COUNT):
        return None
    clusters = batch * (channels // set_channels)
    for cluster in sizes:  # the least size with enough CTAs (or the largest) whose tiles fit
        rows_per_cta = -(-rows // cluster)
        tile = rows_per_cta * set_channels * itemsize
        enough = clusters * cluster >= target or cluster == sizes[-1]
        if enough and tiles * tile <= _CLUSTER_MAX_TILE:
            break
    else:
        return None
    if clusters * cluster >= _launch.INT32_LIMIT or (not forced and (
            cluster > auto_max_size or size * itemsize > auto_max_bytes)):
        return None
    block = cols * min(max_block // cols, max(rows_per_cta, -(-32 // cols)))
    set_groups = set_channels // group_channels
    acc = _dtypes.accumulator_dtype(dtype).itemsize
    lanes = block // cols
    if backward:
        # dwgn_gn_bwd_cluster's layout: the two tiles (16-byte rounded), two
        # slot arrays of lanes * set_channels Acc, the CTA's per-channel sums
        # (2 * set_channels Acc), per group two sums and two coefficients
        # (4 Acc), the ticket's verdict (an int, 16 bytes kept).
        shared = (2 * (-(-tile // 16) * 16) + (2 * lanes * set_channels + 2 * set_channels + 4 * set_groups) * acc
                  + 16)
    else:
        # dwgn_gn_fwd_cluster's layout: the tile (16-byte rounded), two slot
        # arrays of lanes * set_channels Acc, gn::set_group_sums' parts (2 *
        # max(block, set_channels) doubles), 5 doubles and one Acc per group
        # of the set.
        shared = (-(-tile // 16) * 16 + 2 * lanes * set_channels * acc + 16 * max(block, set_channels)
                  + set_groups * (5 * 8 + acc))
    return set_channels, cluster, block, rows_per_cta, shared


# The _path values on which _small_serves may take the small-group kernels,
# and the path each falls back to where it does not.
_SMALL_PATHS = {"small": "fused", "small, split": "split", "auto": "auto", "auto, no clusters": "fused",
                "auto, split": "split"}


def _small_serves(batch, rows, channels, groups, path):
    """Whether the small-group kernels (a warp per (sample, group)) take the
    shape on ``path``: forced ("small") wherever 32-bit offsets and
    gn::small_div serve, by "auto" for groups of at most _SMALL_MAX_GROUP
    elements.  Depends on the shape only."""
    count = rows * (channels // groups)
    if path not in _SMALL_PATHS or batch * rows * channels >= _launch.INT32_LIMIT:
        return False
    if batch * groups * 32 >= _launch.INT32_LIMIT or count >= 1 << 22:
        return False
    return path.startswith("small") or count <= _SMALL_MAX_GROUP


def _plan_on(device, build, plan_args, aligned, setting):
    """The plan ``build`` (_forward_plan, _backward_plan) makes for the
    path ``setting`` on ``device``: a resident plan whose grid cannot all be
    resident there, or a cluster plan the device cannot launch, gives way
    to the two launches."""
    plan = build(*plan_args, aligned, _path(setting, device))
    if (plan.resident is not None and not _resident_fits(device, plan.resident)) or (
            plan.cluster is not None and not _cluster_fits(device, plan.cluster)):
        plan = build(*plan_args, aligned, "fused")
    return plan


def _cluster_fits(device, launch):
    """Whether ``device`` can launch the cluster ``launch``: its shared
    memory within the per-block limit, and clusters of more than 8 CTAs
    only on compute capability 9 (H100 / H200 allow 16)."""
    return launch.shared_mem <= _launch.max_shared_per_block(device) and (
        launch.cluster <= 8 or _launch.compute_capability_major(device) == 9)


def _resident_fits(device, launch):
    """Whether every block of the resident ``launch`` can be resident at
    once on ``device`` (its shared memory within the device's per-block
    limit, and the occupancy times the SMs at least the grid)."""
    if launch.shared_mem > _launch.max_shared_per_block(device):
        return False
    return _launch.cooperative_capacity(device, launch.kernel(device), launch.block, launch.shared_mem) >= launch.grid[0]


def _onepass_block(cols, vec, max_block=512):
    """Block size of a one-pass kernel for rows of ``cols`` vectors: a
    multiple of 32 in [64, min(max_block, 2048 / vec)] holding lanes = block
    // cols whole rows, with the fewest idle threads (ties: the one nearest
    256).  None when a row does not fit."""
    limit = min(max_block, _ONEPASS_SLOTS // vec)
    candidates = [b for b in range(64, limit + 1, 32) if b >= cols]
    if not candidates:
        return None
    return min(candidates, key=lambda b: (b % cols, abs(b - 256)))


def _onepass_geometry(batch, rows, channels, groups, dtype, vec, path, backward=False):
    """(block, rows_per_chunk, num_chunks, grid) of the one-pass forward (or
    backward, which reads x and grad_out twice and takes blocks of at most
    256 threads), or None when the rule above sends the shape to the
    three-launch path.  grid: the most blocks any phase can use (the launch
    trims it to what is resident on the device; the kernels are correct for
    any grid).  Depends on the shape (and the path setting) only."""
    if path != "onepass":  # "fused" and "split": the column kernels (see above)
        return None
    size = batch * rows * channels
    # The kernels' int item counters step by gridDim.x: every count plus any
    # grid must stay below 2**31.
    if size >= _launch.INT32_LIMIT or groups * (batch + 1) + _ONEPASS_GRID_LIMIT >= _launch.INT32_LIMIT:
        return None
    max_block = 256 if backward else 512
    cols = channels // vec
    block = _onepass_block(cols, vec, max_block)
    if block is None:
        return None
    lanes = block // cols
    itemsize = numpy.dtype(dtype).itemsize
    if backward:  # gn::bwd_row_batch<T, VEC>
        batch_rows = 2 if itemsize == 8 or vec >= 8 else 4
    else:  # gn::row_batch<VEC>
        batch_rows = 4 if vec >= 8 else 8
    per_sample = max(1, -(-_ONEPASS_ITEMS // batch))
    rows_per_chunk = max(lanes * batch_rows, -(-rows // per_sample))
    num_chunks = -(-rows // rows_per_chunk)
    if batch * num_chunks + _ONEPASS_GRID_LIMIT >= _launch.INT32_LIMIT:
        return None
    finalize_items = groups * (batch + 1) if backward else batch * groups
    vector_blocks = -(-(size // vec) // block)
    grid = min(_ONEPASS_GRID_LIMIT, max(batch * num_chunks, finalize_items, vector_blocks))
    return block, rows_per_chunk, num_chunks, grid


@functools.lru_cache(maxsize=1024)
def _forward_plan(batch, rows, channels, groups, dtype, w_dtype, activation, eps, aligned, path="split"):
    name = _compile.name_expression
    index, t, acc_dtype, vec, num_vectors = _geometry(batch, rows, channels, dtype, aligned)
    if _small_serves(batch, rows, channels, groups, path):
        items = batch * groups
        return _Plan(
            None, None, None, (), ((batch, groups), acc_dtype),
            small=_launch.Launch(
                KERNEL_FILE, name(_SMALL, t, _dtypes.ctype(w_dtype), _ACT_CODE[activation]),
                (-(-items * 32 // _SMALL_BLOCK),), (_SMALL_BLOCK,), 0,
                (i32(batch), i32(rows), i32(channels), i32(groups), acc_dtype.type(eps)),
            ),
        )
    path = _SMALL_PATHS.get(path, path)  # where the small-group kernel does not apply
    cluster = None
    if path in ("auto", "cluster"):
        cluster = _cluster_geometry(batch, rows, channels, groups, dtype, vec, forced=path == "cluster")
        path = "fused"  # where the cluster forward does not apply
    if cluster is not None:
        set_channels, size, block, rows_per_cta, shared = cluster
        return _Plan(
            None, None, None, (), ((batch, groups), acc_dtype),
            cluster=_launch.Launch(
                KERNEL_FILE, name(_CLUSTER, t, _dtypes.ctype(w_dtype), _ACT_CODE[activation], vec, size),
                (batch * (channels // set_channels) * size,), (block,), shared,
                (i32(rows), i32(channels), i32(groups), i32(set_channels), i32(rows_per_cta), acc_dtype.type(eps)),
                cluster=size,
            ),
        )
    resident = _resident_geometry(batch, rows, channels, groups, dtype, vec) if path == "resident" else None
    if resident is not None:
        block, per_sample, rows_per_block, shared = resident
        return _Plan(
            None, None, None,
            (((batch, per_sample, 2, groups), numpy.dtype(numpy.float64)),),
            ((batch, groups), acc_dtype),
            resident=_launch.Launch(
                KERNEL_FILE, name(_RESIDENT, t, _dtypes.ctype(w_dtype), _ACT_CODE[activation], vec),
                (batch * per_sample,), (block,), shared,
                (i32(rows), i32(channels), i32(groups), i32(per_sample), i32(rows_per_block), acc_dtype.type(eps)),
                cooperative=True, whole_grid=True,
            ),
        )
    if path == "resident":  # where the resident forward does not apply
        path = "fused"
    onepass = _onepass_geometry(batch, rows, channels, groups, dtype, vec, path)
    if onepass is not None:
        block, rows_per_chunk, num_chunks, wanted = onepass
        return _Plan(
            None, None, None,
            (((batch, num_chunks, 2, channels), numpy.dtype(numpy.float64)), ((batch, 3, channels), acc_dtype)),
            ((batch, groups), acc_dtype),
            _launch.Launch(
                KERNEL_FILE,
                name(_ONEPASS, t, _dtypes.ctype(w_dtype), _ACT_CODE[activation], vec, "int"),
                (wanted,), (block,), 0,
                (i32(batch), i32(rows), i32(channels), i32(groups), i32(num_chunks), i32(rows_per_chunk),
                 acc_dtype.type(eps)),
                cooperative=True,
            ),
        )
    rows_per_chunk, num_chunks, column_blocks, cols, grouped = _stats_split(
        batch, rows, channels // vec, vec, channels // groups,
        batch * rows * channels * numpy.dtype(dtype).itemsize >= _GROUPED_BYTES, numpy.dtype(dtype).itemsize,
    )
    fused = path == "fused"
    eps = acc_dtype.type(eps)
    pieces_per_group = num_chunks if grouped else channels // groups * num_chunks
    return _Plan(
        _column_launch(
            name(_STATS, t, _dtypes.ctype(w_dtype), vec, index), batch * num_chunks * column_blocks,
            batch * groups, fused,
            (i32(batch), i32(rows), i32(channels), i32(groups), i32(num_chunks), i32(rows_per_chunk), i32(cols),
             i32(grouped), eps),
        ),
        None if fused else _launch.Launch(
            KERNEL_FILE, name(_FWD_FINALIZE, _dtypes.ctype(acc_dtype), _dtypes.ctype(w_dtype)),
            (groups, min(batch, _launch.MAX_GRID_Y)), (_group_block(pieces_per_group, 512),), 0,
            (i32(batch), i32(rows), i32(channels), i32(groups), i32(num_chunks), i32(rows_per_chunk), i32(grouped),
             eps),
        ),
        _elementwise_launch(_APPLY, t, _ACT_CODE[activation], vec, index, num_vectors, dtype, rows,
                            channels, fused),
        # Forward summaries are double whatever x is: the sums keep the mean exact.
        (((batch, num_chunks, 2, groups if grouped else channels), numpy.dtype(numpy.float64)),
         ((batch, 3, channels), acc_dtype)),
        ((batch, groups), acc_dtype),
    )


def _elementwise_vectors(num_vectors, vec, dtype):
    """U of dwgn_gn_fwd_apply / dwgn_gn_bwd_dx (the rule above) for
    ``num_vectors`` vectors of ``vec`` elements of ``dtype``."""
    dtype = numpy.dtype(dtype)
    return 2 if dtype == numpy.float16 and int(num_vectors) * vec * dtype.itemsize >= _ELEMENTWISE_BATCH_BYTES else 1


def _elementwise_launch(kernel, t, act, vec, index, num_vectors, dtype, rows, channels, fused):
    """The launch of ``kernel`` (dwgn_gn_fwd_apply or dwgn_gn_bwd_dx) for
    element type ``t``, activation code ``act``, over ``num_vectors`` channel
    vectors: a thread per U of them (_elementwise_vectors); programmatic
    after the fused path's column kernel (its blocks are placed while that
    kernel finalizes)."""
    u = _elementwise_vectors(num_vectors, vec, dtype)
    return _launch.Launch(
        KERNEL_FILE, _compile.name_expression(kernel, t, act, vec, index, u),
        _launch.grid_1d(-(-int(num_vectors) // u)), (_launch.BLOCK,), 0, (num_vectors, i32(rows), i32(channels)),
        programmatic=fused,
    )


def _column_launch(expression, items, finalize_items, fused, scalars):
    """The launch of a column kernel (dwgn_gn_stats, dwgn_gn_bwd_reduce) over
    ``items`` work items (gn::ColumnItems): fused, a cooperative launch doing
    the ``finalize_items`` of the finalize too, with a block per item of the
    larger phase (trimmed to the resident blocks: Launch.grid_on); else one
    block per item.  At most MAX_BLOCKS blocks (blocks then take several)."""
    if items + _launch.MAX_BLOCKS >= _launch.INT32_LIMIT:  # the kernels' int item counters
        raise ValueError(f"group_norm: {items} column-kernel work items; expected fewer than 2**31 - 2**16")
    blocks = max(items, finalize_items) if fused else items
    return _launch.Launch(
        KERNEL_FILE, expression, (min(blocks, _launch.MAX_BLOCKS),), (_COLUMN_BLOCK,), 0, scalars + (i32(fused),),
        cooperative=fused,
    )


# Argument tuples of the launches (positions the Steps refer to; the
# workspace temporaries follow them):
#   forward:  (x, weight or NULL, bias or NULL, y, mean, rstd), then the
#             partial sums (6), coefficients (7), mean / rstd (8, 9) when
#             the caller did not ask for them, and last the grid-barrier
#             word (_workspace.GRID_BARRIER) of the cooperative kernels
#   backward: (grad_out, x, mean, rstd, weight or NULL, bias or NULL, grad_x,
#             grad_weight or NULL, grad_bias or NULL), then the partial sums
#             (9), coefficients (10) and the grid-barrier word (11); the
#             cluster backward: the partial sums (9) and the tickets (10)

def _forward_steps(plan, mean_temporary, rstd_temporary):
    first = 6 + len(plan.temporaries)  # the statistics temporaries follow the plan's
    mean = first if mean_temporary else 4
    rstd = first + mean_temporary if rstd_temporary else 5
    barrier = first + mean_temporary + rstd_temporary
    temporaries = plan.temporaries + (plan.statistics,) * (mean_temporary + rstd_temporary) + (
        _workspace.GRID_BARRIER,)
    if plan.resident is not None:  # (x, partial, weight, bias, mean, rstd, y, barrier)
        return _launch.Steps(((plan.resident, (0, 6, 1, 2, mean, rstd, 3, barrier)),), temporaries)
    if plan.cluster is not None or plan.small is not None:  # (x, weight, bias, mean, rstd, y)
        return _launch.Steps(((plan.cluster or plan.small, (0, 1, 2, mean, rstd, 3)),), temporaries)
    if plan.onepass is not None:  # (x, partial, weight, bias, mean, rstd, coefficients, y, barrier)
        return _launch.Steps(((plan.onepass, (0, 6, 1, 2, mean, rstd, 7, 3, barrier)),), temporaries)
    # (x, partial, weight, bias, mean, rstd, coefficients, barrier)
    statistics = (plan.first, (0, 6, 1, 2, mean, rstd, 7, barrier))
    finalize = () if plan.finalize is None else ((plan.finalize, (6, 1, 2, mean, rstd, 7)),)
    return _launch.Steps((statistics, *finalize, (plan.elementwise, (0, 7, 3))), temporaries)


def _backward_steps(plan):
    if plan.small is not None:  # (grad_out, x, mean, rstd, w, b, partial, grad_x), then (partial, dw, db)
        return _launch.Steps(((plan.small, (0, 1, 2, 3, 4, 5, 9, 6)), (plan.finalize, (9, 7, 8))), plan.temporaries)
    if plan.cluster is not None:  # (grad_out, x, mean, rstd, w, b, partial, tickets, dw, db, grad_x)
        return _launch.Steps(((plan.cluster, (0, 1, 2, 3, 4, 5, 9, 10, 7, 8, 6)),),
                             plan.temporaries + (_workspace.TICKETS,))
    temporaries = plan.temporaries + (_workspace.GRID_BARRIER,)
    if plan.resident is not None:  # (grad_out, x, mean, rstd, w, b, partial, dw, db, grad_x, barrier)
        return _launch.Steps(((plan.resident, (0, 1, 2, 3, 4, 5, 9, 7, 8, 6, 10)),), temporaries)
    if plan.onepass is not None:  # (grad_out, x, mean, rstd, w, b, partial, coefficients, dw, db, grad_x, barrier)
        return _launch.Steps(((plan.onepass, (0, 1, 2, 3, 4, 5, 9, 10, 7, 8, 6, 11)),), temporaries)
    # (grad_out, x, mean, rstd, w, b, partial, coefficients, dw, db, barrier)
    reduce = (plan.first, (0, 1, 2, 3, 4, 5, 9, 10, 7, 8, 11))
    finalize = () if plan.finalize is None else ((plan.finalize, (9, 2, 3, 4, 5, 10, 7, 8)),)
    return _launch.Steps((reduce, *finalize, (plan.elementwise, (0, 1, 10, 6))), temporaries)


class _Entry(typing.NamedTuple):
    """A checked call signature: (N, S, C, num_groups), the plan builder's
    arguments but the alignment, and the resolved Steps per alignment key."""

    shape: tuple
    plan_args: tuple
    steps: dict
    separate: list  # _interop.outputs_separate_memo's slot


@functools.lru_cache(maxsize=1024)
def _backward_plan(batch, rows, channels, groups, dtype, w_dtype, activation, aligned, path="split"):
    name = _compile.name_expression
    index, t, acc_dtype, vec, num_vectors = _geometry(batch, rows, channels, dtype, aligned)
    w_ctype = _dtypes.ctype(w_dtype)
    act = _ACT_CODE[activation]
    if _small_serves(batch, rows, channels, groups, path):
        items = batch * groups
        common = (i32(batch), i32(rows), i32(channels), i32(groups))
        return _Plan(
            None,
            _launch.Launch(  # the weight gradients, from the samples' per-channel sums
                KERNEL_FILE, name(_BWD_WEIGHTS, _dtypes.ctype(acc_dtype), w_ctype), (-(-channels // 32),),
                (_WEIGHTS_BLOCK,), 0, (i32(batch), i32(channels)),
            ),
            None,
            (((batch, 2, channels), acc_dtype),),  # the samples' per-channel sums
            small=_launch.Launch(
                KERNEL_FILE, name(_BWD_SMALL, t, w_ctype, act), (-(-items * 32 // _SMALL_BLOCK),), (_SMALL_BLOCK,),
                0, common,
            ),
        )
    path = _SMALL_PATHS.get(path, path)  # where the small-group kernels do not apply
    cluster = None
    if path in ("auto", "cluster"):
        cluster = _cluster_geometry(batch, rows, channels, groups, dtype, vec, forced=path == "cluster", backward=True)
        path = "fused"  # where the cluster backward does not apply
    if cluster is not None:
        set_channels, size, block, rows_per_cta, shared = cluster
        return _Plan(
            None, None, None,
            (((batch, 2, channels), acc_dtype),),  # the samples' per-channel sums, for the weight gradients
            cluster=_launch.Launch(
                KERNEL_FILE, name(_BWD_CLUSTER, t, w_ctype, act, vec, size),
                (batch * (channels // set_channels) * size,), (block,), shared,
                (i32(batch), i32(rows), i32(channels), i32(groups), i32(set_channels), i32(rows_per_cta)),
                cluster=size,
            ),
        )
    resident = _resident_geometry(batch, rows, channels, groups, dtype, vec, backward=True) if path == "resident" else None
    if resident is not None:
        block, per_sample, rows_per_block, shared = resident
        return _Plan(
            None, None, None,
            (((batch * per_sample, 2 * (channels + groups)), acc_dtype),),
            resident=_launch.Launch(
                KERNEL_FILE, name(_BWD_RESIDENT, t, w_ctype, act, vec), (batch * per_sample,), (block,), shared,
                (i32(rows), i32(channels), i32(groups), i32(per_sample), i32(rows_per_block)),
                cooperative=True, whole_grid=True,
            ),
        )
    if path == "resident":  # where the resident backward does not apply
        path = "fused"
    onepass = _onepass_geometry(batch, rows, channels, groups, dtype, vec, path, backward=True)
    if onepass is not None:
        block, rows_per_chunk, num_chunks, wanted = onepass
        return _Plan(
            None, None, None,
            (((batch, num_chunks, 2, channels), acc_dtype), ((batch, 5, channels), acc_dtype)),
            onepass=_launch.Launch(
                KERNEL_FILE, name(_BWD_ONEPASS, t, w_ctype, act, vec, "int"), (wanted,), (block,), 0,
                (i32(batch), i32(rows), i32(channels), i32(groups), i32(num_chunks), i32(rows_per_chunk)),
                cooperative=True,
            ),
        )
    rows_per_chunk, num_chunks, column_blocks, cols = _split(
        batch, rows, channels // vec, vec > 1, numpy.dtype(dtype).itemsize
    )
    fused = path == "fused"
    common = (i32(batch), i32(rows), i32(channels), i32(groups))
    return _Plan(
        _column_launch(
            name(_BWD_REDUCE, t, w_ctype, act, vec, index), batch * num_chunks * column_blocks,
            groups * (batch + 1), fused, common + (i32(num_chunks), i32(rows_per_chunk), i32(cols)),
        ),
        None if fused else _launch.Launch(
            KERNEL_FILE, name(_BWD_FINALIZE, _dtypes.ctype(acc_dtype), w_ctype),
            (groups, min(batch + 1, _launch.MAX_GRID_Y)), (_group_block(channels // groups * num_chunks, 256),),
            0, common + (i32(num_chunks),),
        ),
        _elementwise_launch(_BWD_DX, t, act, vec, index, num_vectors, dtype, rows, channels, fused),
        (((batch, num_chunks, 2, channels), acc_dtype), ((batch, 5, channels), acc_dtype)),
    )


def _split(batch, rows, width, vectors=True, itemsize=4):
    """(rows_per_chunk, num_chunks, column blocks, columns per block) of the
    column kernels for rows of ``width`` columns (channel vectors, or
    elements when not ``vectors``) of ``itemsize``-byte elements: column
    blocks of at most _MAX_COLUMNS (vectors) or _COLUMN_BLOCK (elements)
    columns, as even as they can be."""
    column_blocks = -(-width // min(width, _MAX_COLUMNS if vectors else _COLUMN_BLOCK))
    cols = -(-width // column_blocks)
    column_blocks = -(-width // cols)
    per_sample = max(1, _TARGET_BLOCKS // (min(batch, _launch.MAX_GRID_Y) * column_blocks))
    if rows >= _LONG_SAMPLE_ROWS:
        min_rows = _MIN_ROWS_PER_LONG_CHUNK
    else:
        min_rows = _MIN_ROWS_PER_HALF_CHUNK if itemsize == 2 else _MIN_ROWS_PER_CHUNK
    rows_per_chunk = max(min_rows, -(-rows // per_sample))
    num_chunks = -(-rows // rows_per_chunk)
    return rows_per_chunk, num_chunks, column_blocks, cols


def _stats_split(batch, rows, width, vec, group_channels, large, itemsize=4):
    """The statistics kernel's split, as :func:`_split` with a fifth item,
    whether its blocks sum each group's channels (the partial sums are then
    per group, and the finalize reads group_channels times less): for
    ``large`` tensors (_GROUPED_BYTES) whose groups have at most
    _MAX_GROUPED_CHANNELS channels, in blocks of whole groups (a multiple of
    group_channels / gcd(group_channels, vec) columns of ``vec`` channels),
    at most _GROUPED_TARGET_BLOCKS items of at least _GROUPED_MIN_ROWS rows."""
    limit = _MAX_COLUMNS if vec > 1 else _COLUMN_BLOCK
    unit = group_channels // math.gcd(group_channels, vec)  # columns holding whole groups
    if not large or unit > limit or group_channels > _MAX_GROUPED_CHANNELS:
        return (*_split(batch, rows, width, vec > 1, itemsize), False)
    column_blocks = -(-width // (limit // unit * unit))
    cols = -(-width // column_blocks // unit) * unit
    column_blocks = -(-width // cols)
    per_sample = max(1, _GROUPED_TARGET_BLOCKS // (min(batch, _launch.MAX_GRID_Y) * column_blocks))
    rows_per_chunk = max(_GROUPED_MIN_ROWS, -(-rows // per_sample))
    return rows_per_chunk, -(-rows // rows_per_chunk), column_blocks, cols, True


def _group_block(pieces, limit):
    """Block size of the finalize kernels, which sum a group's ``pieces``
    (channels x chunks) with the whole block: a multiple of 32 in [32, limit]
    (512 forward, its __launch_bounds__; 256 backward, whose shared scratch
    is sized for it)."""
    return min(limit, max(32, -(-pieces // 32) * 32))


def group_norm(x, num_groups, weight=None, bias=None, *, eps=1e-5, activation="identity", out=None, mean_out=None, rstd_out=None, return_stats=False, stream=None):
    """Channels-last GroupNorm followed by an activation:
    ``y = act((x - mean) * rstd * weight + bias)``.

    Args:
        x: (N, *spatial, C), 0 to 3 spatial dims, C-contiguous; float16,
            float32, float64 or bfloat16.  A cupy.ndarray or any CUDA array
            with ``__dlpack__`` (torch tensor, JAX array): used without a copy,
            results come back as the caller's type.
        num_groups: int dividing C; every group is C // num_groups consecutive
            channels (num_groups == C is InstanceNorm, 1 is LayerNorm over
            (spatial, C)).
        weight, bias: optional (C,) arrays, both of one dtype: x's dtype, or
            float32 for float16/bfloat16 x (mixed precision).  Absent means
            scale 1 / shift 0 (no array is made for them).
        eps: added to the variance, > 0.
        activation: "identity", "relu", "silu", "gelu" (erf form) or
            "gelu_tanh" (tanh approximation), applied after the affine transform.
        out: optional C-contiguous array of x's shape and dtype for y; may be x
            itself (in place), but must not otherwise overlap x, weight or bias.
        mean_out, rstd_out: optional (N, num_groups) arrays of the statistics
            dtype for mean and rstd.  With out, mean_out and rstd_out given the
            call allocates nothing (temporaries come from a per-stream
            workspace), so it can be captured in a CUDA graph.
        return_stats: also return mean and rstd = 1/sqrt(var + eps), each
            (N, num_groups), float32 (float64 for float64 x), for
            :func:`group_norm_backward`.
        stream: launch on this stream (cupy Stream, ``__cuda_stream__``
            object, torch.cuda.Stream); default the current CuPy stream.

    Returns:
        y, or (y, mean, rstd) when return_stats.  Statistics are accumulated in
        float32 (float64 for float64); the variance is biased, as in PyTorch.
        With no spatial positions (S == 0) y is empty and mean/rstd are NaN.

    Example:
        >>> x = cupy.random.randn(2, 64, 64, 320).astype(cupy.float16)   # NHWC
        >>> w = cupy.ones(320, cupy.float32); b = cupy.zeros(320, cupy.float32)
        >>> y, mean, rstd = group_norm(x, 32, w, b, activation="silu", return_stats=True)
        >>> y.shape, mean.shape
        ((2, 64, 64, 320), (2, 32))
    """
    if type(x) is _ndarray:
        result = _interop.on_stream(
            stream, _forward_cached, x, num_groups, weight, bias, eps, activation, out, mean_out, rstd_out,
            return_stats,
        )
        if result is not _MISS:
            return result
    return _interop.call(
        _forward_checked, (x, weight, bias, out, mean_out, rstd_out), stream, num_groups, eps, activation,
        return_stats,
    )


def _forward_cached(x, num_groups, weight, bias, eps, activation, out, mean_out, rstd_out, return_stats):
    """The call through the signature cache, or _MISS."""
    try:
        entry = _SIGNATURES[_forward_key(x, num_groups, weight, bias, eps, activation, out, mean_out, rstd_out)]
    except (KeyError, TypeError):  # a new signature, or an unhashable argument
        return _MISS
    return _interop.on_device(
        x, _forward, x, weight, bias, out, mean_out, rstd_out, return_stats, entry, entry.separate
    )


def _forward_checked(x, weight, bias, out, mean_out, rstd_out, num_groups, eps, activation, return_stats):
    result = _forward_cached(x, num_groups, weight, bias, eps, activation, out, mean_out, rstd_out, return_stats)
    if result is not _MISS:  # e.g. torch tensors, now viewed as cupy arrays
        return result
    shape = check_forward_args(x, num_groups, weight, bias, eps, activation, out, mean_out=mean_out, rstd_out=rstd_out)
    entry = _Entry(shape, (*shape, x.dtype, _affine_dtype(weight, bias, x), activation, eps), {}, [None])
    _interop.remember(
        _SIGNATURES, _forward_key(x, num_groups, weight, bias, eps, activation, out, mean_out, rstd_out), entry
    )
    return _interop.on_device(x, _forward, x, weight, bias, out, mean_out, rstd_out, return_stats, entry, None)


def _forward(device, x, weight, bias, out, mean_out, rstd_out, return_stats, entry, separate):
    """The launches on ``device`` (current).  ``separate``: the entry's
    outputs_separate_memo slot where the given outputs' overlap is still to
    be ruled out (the cached path: _MISS when it is not), None after the
    full checks."""
    null = _launch.NULL
    # Every address is read once: for the overlap memo, the alignment and the launch.
    addresses = (
        x.data.ptr, null if weight is None else weight.data.ptr, null if bias is None else bias.data.ptr,
        null if out is None else out.data.ptr, null if mean_out is None else mean_out.data.ptr,
        null if rstd_out is None else rstd_out.data.ptr,
    )
    if separate is not None and (out is not None or mean_out is not None or rstd_out is not None) and not (
        _interop.outputs_separate_memo(separate, addresses, (out, mean_out, rstd_out), (x, weight, bias), x)
    ):
        return _MISS
    y = cupy.empty(x.shape, dtype=x.dtype) if out is None else out
    if return_stats:  # the statistics: (N, num_groups) of the accumulator dtype
        stats_shape, stats_dtype = entry.shape[::3], _dtypes.accumulator_dtype(x.dtype)
        mean = cupy.empty(stats_shape, stats_dtype) if mean_out is None else mean_out
        rstd = cupy.empty(stats_shape, stats_dtype) if rstd_out is None else rstd_out
    else:  # statistics nobody asked for are workspace temporaries
        mean, rstd = mean_out, rstd_out
    if x.size == 0:
        for stat in (mean, rstd):
            if stat is not None:
                stat.fill(numpy.nan)  # mean of nothing (a no-op when N == 0)
        return (y, mean, rstd) if return_stats else y
    if y is not out or mean is not mean_out or rstd is not rstd_out:  # outputs allocated here
        addresses = addresses[:3] + (
            y.data.ptr, null if mean is None else mean.data.ptr, null if rstd is None else rstd.data.ptr
        )
    # The device is part of the key: whether a resident kernel fits is per device.
    key = ((addresses[0] | addresses[3]) & 15, mean is None, rstd is None, device, FORWARD_PATH)
    steps = entry.steps.get(key)
    if steps is None:
        plan = _plan_on(device, _forward_plan, entry.plan_args, key[0] == 0, FORWARD_PATH)
        steps = entry.steps[key] = _forward_steps(plan, mean is None, rstd is None)
    steps.run(device, addresses)
    return (y, mean, rstd) if return_stats else y


def group_norm_backward(grad_out, x, mean, rstd, num_groups, weight=None, bias=None, *, activation="identity", out=None, grad_weight_out=None, grad_bias_out=None, stream=None):
    """Gradients of :func:`group_norm` with respect to x, weight and bias.

    Args:
        grad_out: (N, *spatial, C), the gradient of y, x's dtype.
        x: the forward input.
        mean, rstd: (N, num_groups) as returned by ``group_norm(...,
            return_stats=True)``: float32 (float64 for float64 x).
        num_groups, weight, bias, activation: as in the forward call (bias
            only matters through the activation's derivative, and for the
            presence of its gradient).
        out: optional array of x's shape and dtype for grad_x.
        grad_weight_out, grad_bias_out: optional (C,) arrays of the weight's
            dtype (only with weight / bias given).  With every output given
            the call allocates nothing (CUDA-graph capturable).
        stream: as in :func:`group_norm`.  Arrays may be cupy or any CUDA
            ``__dlpack__`` array (results come back as the caller's type).

    Returns:
        (grad_x, grad_weight, grad_bias): grad_x of x's shape and dtype;
        grad_weight/grad_bias (C,) in the weight's dtype, or None when weight /
        bias is None.  Deterministic (no atomics).

    Example:
        >>> y, mean, rstd = group_norm(x, 32, w, b, activation="silu", return_stats=True)
        >>> dx, dw, db = group_norm_backward(dy, x, mean, rstd, 32, w, b, activation="silu")
    """
    if type(x) is _ndarray:
        result = _interop.on_stream(
            stream, _backward_cached, grad_out, x, mean, rstd, weight, bias, out, grad_weight_out, grad_bias_out,
            num_groups, activation,
        )
        if result is not _MISS:
            return result
    return _interop.call(
        _backward_checked, (grad_out, x, mean, rstd, weight, bias, out, grad_weight_out, grad_bias_out), stream,
        num_groups, activation,
    )


def _backward_cached(grad_out, x, mean, rstd, weight, bias, out, grad_weight_out, grad_bias_out, num_groups, activation):
    try:
        entry = _SIGNATURES[
            _backward_key(grad_out, x, mean, rstd, num_groups, weight, bias, activation, out, grad_weight_out,
                          grad_bias_out)
        ]
    except (KeyError, TypeError):
        return _MISS
    return _interop.on_device(
        x, _backward, grad_out, x, mean, rstd, weight, bias, out, grad_weight_out, grad_bias_out, entry,
        entry.separate,
    )


def _backward_checked(grad_out, x, mean, rstd, weight, bias, out, grad_weight_out, grad_bias_out, num_groups, activation):
    result = _backward_cached(
        grad_out, x, mean, rstd, weight, bias, out, grad_weight_out, grad_bias_out, num_groups, activation
    )
    if result is not _MISS:
        return result
    shape = check_backward_args(
        grad_out, x, mean, rstd, num_groups, weight, bias, activation, out=out,
        grad_weight_out=grad_weight_out, grad_bias_out=grad_bias_out,
    )
    entry = _Entry(shape, (*shape, x.dtype, _affine_dtype(weight, bias, x), activation), {}, [None])
    _interop.remember(
        _SIGNATURES,
        _backward_key(grad_out, x, mean, rstd, num_groups, weight, bias, activation, out, grad_weight_out,
                      grad_bias_out),
        entry,
    )
    return _interop.on_device(
        x, _backward, grad_out, x, mean, rstd, weight, bias, out, grad_weight_out, grad_bias_out, entry, None
    )


def _backward(device, grad_out, x, mean, rstd, weight, bias, out, grad_weight_out, grad_bias_out, entry, separate):
    """The launches on ``device`` (current); ``separate`` as in :func:`_forward`."""
    null = _launch.NULL
    # Every address is read once: for the overlap memo, the alignment and the launch.
    addresses = (
        grad_out.data.ptr, x.data.ptr, mean.data.ptr, rstd.data.ptr,
        null if weight is None else weight.data.ptr, null if bias is None else bias.data.ptr,
        null if out is None else out.data.ptr, null if grad_weight_out is None else grad_weight_out.data.ptr,
        null if grad_bias_out is None else grad_bias_out.data.ptr,
    )
    if separate is not None and (out is not None or grad_weight_out is not None or grad_bias_out is not None) and not (
        _interop.outputs_separate_memo(
            separate, addresses, (out, grad_weight_out, grad_bias_out), (grad_out, x, mean, rstd, weight, bias)
        )
    ):
        return _MISS
    channels = entry.shape[2]
    w_dtype = entry.plan_args[5]
    grad_in = cupy.empty(x.shape, dtype=x.dtype) if out is None else out
    grad_weight = grad_bias = None
    if weight is not None:
        grad_weight = cupy.empty((channels,), dtype=w_dtype) if grad_weight_out is None else grad_weight_out
    if bias is not None:
        grad_bias = cupy.empty((channels,), dtype=w_dtype) if grad_bias_out is None else grad_bias_out
    if x.size == 0:  # sums over nothing
        for g in (grad_weight, grad_bias):
            if g is not None:
                g.fill(0)
        return grad_in, grad_weight, grad_bias
    if grad_in is not out or grad_weight is not grad_weight_out or grad_bias is not grad_bias_out:  # allocated here
        addresses = addresses[:6] + (
            grad_in.data.ptr, null if grad_weight is None else grad_weight.data.ptr,
            null if grad_bias is None else grad_bias.data.ptr,
        )
    # The device is part of the key: whether a resident kernel fits is per device.
    key = ((addresses[0] | addresses[1] | addresses[6]) & 15, device, BACKWARD_PATH)
    steps = entry.steps.get(key)
    if steps is None:
        steps = entry.steps[key] = _backward_steps(
            _plan_on(device, _backward_plan, entry.plan_args, key[0] == 0, BACKWARD_PATH))
    steps.run(device, addresses)
    return grad_in, grad_weight, grad_bias


# Call-signature cache, as in cupy_dwgn.depthwise: a signature that passed the
# full checks once maps to (N, S, C, num_groups); a repeated call only checks
# that its outputs do not overlap the inputs or each other.
_SIGNATURES = {}
_MISS = _interop.MISS


def _forward_key(x, num_groups, weight, bias, eps, activation, out, mean_out, rstd_out):
    signature = _interop.signature
    return ("fwd", signature(x), num_groups, signature(weight), signature(bias), eps, activation, signature(out),
            signature(mean_out), signature(rstd_out), type(num_groups), type(eps))


def _backward_key(grad_out, x, mean, rstd, num_groups, weight, bias, activation, out, grad_weight_out, grad_bias_out):
    signature = _interop.signature
    return ("bwd", signature(grad_out), signature(x), signature(mean), signature(rstd), num_groups, signature(weight),
            signature(bias), activation, signature(out), signature(grad_weight_out), signature(grad_bias_out),
            type(num_groups))


# ---------------------------------------------------------------------------
# Argument checks: duck-typed over the array class (``kind``) and CuPy-free
# (cupy_dwgn._checks), so cupy_dwgn.host and cupy_dwgn.reference run the very
# same checks on NumPy inputs.

check_forward_args = _checks.check_group_norm_forward
check_backward_args = _checks.check_group_norm_backward
_check_activation = _checks.check_activation
