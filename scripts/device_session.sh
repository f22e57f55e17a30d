#!/usr/bin/env bash
# Everything one lent-GPU call should do, with logs under $OUT:
#   device facts, cold-start timing, the GPU test suite (with its compile
#   time), compute-sanitizer memcheck + racecheck on every kernel, benchmarks.
# STEPS selects parts (default: all but candidates, rules, fuzz, models, bridge and ncu): facts cold warm examples cli tests sanitizer fuzz candidates rules dwbench gnbench host models bridge ncu
# (rules: the NHWC direct kernel's settings that rest on H100 runs only, and its float32 3x3 stride-1 contest with
# the ring kernel, timed on this device: float32 3x3 stride 2 TW 2 / 8 with ALL_ROWS (and at 64x96x112, whose
# 56-wide destination the tiled kernel takes, against it), 5x5 stride 1 TW 7 / 8 at 1 and 2
# items a thread, 3x3 stride 1 TW 4 / 8 against the ring; about 2 minutes; after warm).
# (fuzz: scripts/fuzz_gpu.py for FUZZ_SECONDS (default 120), random calls of every op against float64; after warm).
# (bridge: the PyTorch bridge's host cost per training call and real-model steps eager and as CUDA graphs, about 3 minutes).
# (ncu: Nsight Compute on scripts/ncu_workload.py's cases NCU_CASES (default all), the kernels whose names match the
# regex NCU_KERNELS (default dwgn: ours; e.g. "dwgn|depthwise|conv" for cuDNN's too), the summary in ncu_summary.txt;
# it needs hardware counters: seen working on the Firecracker machines, not on gVisor).
# (warm: compile the kernels into CuPy's disk cache with WARM_ARGS (default: the 1412 32-bit-index ones, one process
# a CPU: about 63 s on an H100 host; --large-index adds 611 that only tensors of 2**31+ elements take, 113 s in all),
# several processes at once; after cold, whose point is the cold start.  The tests compile the same set in their own
# pool before the first test (tests/conftest.py), so warm is for the benchmarks and the fuzzer).
# (cli: cupy-dwgn info, selftest and a precompile, as a user runs them).
# (models: the real-model training-step benchmark, about 3 minutes; on 2 GPUs the tests step also runs
# tests/test_multi_gpu.py and examples/ddp_train.py).
# GNBENCH_ARGS go to benchmarks/group_norm.py (e.g. "--dtypes float16 --quick").
# SANITIZER_ARGS pick kernel families (depthwise nchw_window nchw_plane conv_mma nhwc_window nhwc_wgrad nchw_wgrad_regs nchw_plane_wgrad nchw_rows nhwc_direct nhwc_phase group_norm gn_resident gn_cluster gn_small), SANITIZER_TOOLS the tools (memcheck racecheck); DWBENCH_ARGS go to benchmarks/depthwise.py
# (the 144-cell depthwise table, about 70 s on an H200; e.g. "--dtypes float16 --quick").
# PYTEST_ARGS replaces the pytest selection (default "-m gpu"; e.g. "-m 'gpu and not slow'").
# DWGN_COMMIT: the commit the results files record.  Pass it (DWGN_COMMIT=$(git rev-parse --short HEAD))
# when the tree was copied to the GPU machine: a copy's .git can be stale (seen: a run of 7260f39
# recorded 7ed4de2-dirty).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/dwgn_out}; mkdir -p "$OUT"
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/dwgn_cupy_cache}
STEPS=${STEPS:-facts cold warm examples cli tests sanitizer dwbench gnbench host}
status=0
[ -n "${DWGN_COMMIT:-}" ] || echo "note: DWGN_COMMIT is not set; results record this copy's git HEAD, which may be stale" >&2
has() { [[ " $STEPS " == *" $1 "* ]]; }

if has facts; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/device.txt"
  python3 -c "import cupy, numpy, torch; print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__)" | tee -a "$OUT/device.txt"
fi
if has cold; then
  python3 benchmarks/cold_start.py 2>&1 | tee "$OUT/cold_start.txt"
fi
if has warm; then
  python3 scripts/warm_kernel_cache.py ${WARM_ARGS:---jobs $(nproc)} 2>&1 | tail -n 3 | tee "$OUT/warm.txt"
fi
if has examples; then
  for example in examples/*.py; do
    echo "== $example" | tee -a "$OUT/examples.txt"
    python3 "$example" 2>&1 | tee -a "$OUT/examples.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
fi
if has cli; then
  for args in "info" "selftest" "precompile --ops group_norm --dtypes float16 --activations silu"; do
    echo "== python3 -m cupy_dwgn $args" | tee -a "$OUT/cli.txt"
    python3 -m cupy_dwgn $args 2>&1 | tee -a "$OUT/cli.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
fi
# Before the tests: the sanitizer is short and a call cut at its time limit in the tests still has it.
if has sanitizer; then
  for tool in ${SANITIZER_TOOLS:-memcheck racecheck}; do
    compute-sanitizer --tool $tool --error-exitcode 3 python3 scripts/sanitizer_workload.py ${SANITIZER_ARGS:-} 2>&1 \
      | tail -n 30 | tee "$OUT/sanitizer_$tool.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
fi
if has tests; then
  start=$(date +%s)
  # The CPU tests (NVRTC compile check, references, packaging) run in CI.
  eval python3 -m pytest -q -rs --durations=15 -p no:cacheprovider ${PYTEST_ARGS:--m gpu} 2>&1 | tee "$OUT/pytest.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  # The bridges' CPU tests (PyTorch's CPU path, gradcheck, opcheck, torch.compile on the CPU;
  # JAX's): CI runs them too, on torch's and JAX's CPU builds; here on the GPU image's versions.
  if [ -z "${PYTEST_ARGS:-}" ]; then
    python3 -m pytest -q -rs -p no:cacheprovider -m "not gpu" tests/test_torch_bridge.py tests/test_jax.py 2>&1 \
      | tail -n 15 | tee -a "$OUT/pytest.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  fi
  echo "pytest wall time: $(( $(date +%s) - start )) s" | tee -a "$OUT/pytest.txt"
fi
if has fuzz; then
  python3 scripts/fuzz_gpu.py --seconds ${FUZZ_SECONDS:-120} 2>&1 | grep -v "^[0-9]* cases, " | tee "$OUT/fuzz.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if has ncu; then
  # The report (ncu.ncu-rep, for the Nsight Compute GUI), its sections as text, and per kernel the
  # SASS with executed-instruction and stall counts (SourceCounters) as CSV.
  ncu --clock-control none --profile-from-start off -k "regex:${NCU_KERNELS:-dwgn}" --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section SourceCounters -f -o "$OUT/ncu" python3 scripts/ncu_workload.py ${NCU_CASES:-} > "$OUT/ncu_log.txt" 2>&1 \
    || status=1
  ncu -i "$OUT/ncu.ncu-rep" > "$OUT/ncu.txt" 2>&1 || status=1
  ncu -i "$OUT/ncu.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu_sass.csv" 2>&1 || true
  python3 scripts/ncu_workload.py --summarize "$OUT/ncu.txt" | tee "$OUT/ncu_summary.txt"
fi
if has gnbench; then
  python3 benchmarks/group_norm.py --json "$OUT/group_norm.json" --png "$OUT/group_norm.png" ${GNBENCH_ARGS:-} 2>&1 \
    | tee "$OUT/group_norm.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if has models; then
  python3 benchmarks/models.py --json "$OUT/models.json" --png "$OUT/models.png" ${MODELS_ARGS:-} 2>&1 | tee "$OUT/models.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if has bridge; then
  python3 benchmarks/bridge_overhead.py 2>&1 | tee "$OUT/bridge_overhead.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  python3 benchmarks/profile_model.py --timing-only --steps 8 \
    --configs mobilenetv2_100:float32 efficientnet_b3:bfloat16-autocast convnext_nano:bfloat16-autocast 2>&1 \
    | tee "$OUT/profile_model.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  python3 benchmarks/profile_model.py --timing-only --steps 8 --graphed \
    --configs mobilenetv2_100:float32 efficientnet_b3:float32 convnext_nano:float32 2>&1 | tee -a "$OUT/profile_model.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if has host; then
  python3 benchmarks/host_overhead.py --profile --json "$OUT/host_overhead.json" 2>&1 | tee "$OUT/host_overhead.txt"
fi
if has candidates; then
  # Every forward / backward-input kernel that serves each shape, side by side (the view dispatch rules are read
  # from); CANDIDATE_ARGS replaces the default selection (the half-type shapes of the depthwise table and
  # EfficientNet-B3 (stride 1 and 2), where the tensor-core kernel competes).
  python3 benchmarks/depthwise_candidates.py ${CANDIDATE_ARGS:---no-torch --dtypes float16 bfloat16 --mma-variants 1:48 4:48 4:96 2:48:1 --shapes \
    64x144x56x3x1 64x384x28x3x1 64x240x28x5x1 64x96x56x7x1 64x384x14x7x1 64x960x7x3x1 64x24x150x3x1 \
    64x192x75x3x1 64x288x38x5x1 64x576x19x3x1 64x576x19x5x1 64x1392x10x5x1 64x96x112x3x2 64x144x150x3x2 \
    64x192x75x5x2 64x288x38x3x2 64x816x19x5x2} 2>&1 | tee "$OUT/candidates.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if has rules; then
  for args in "64x96x112x3x2 64x144x56x3x2 64x288x38x3x2 64x192x28x3x2 64x576x14x3x2 --columns 2 8 --all-rows" \
              "64x240x28x5x1 64x576x19x5x1 64x288x38x5x1 64x480x14x5x1 --columns 7 8 --items-per-thread 1 2" \
              "64x144x56x3x1 64x192x56x3x1 --columns 4 8"; do
    echo "== benchmarks/depthwise_nhwc_direct.py --dtypes float32 --shapes $args" | tee -a "$OUT/rules.txt"
    python3 benchmarks/depthwise_nhwc_direct.py --dtypes float32 --shapes $args 2>&1 | tee -a "$OUT/rules.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
fi
if has dwbench; then
  python3 benchmarks/depthwise.py --json "$OUT/depthwise.json" --png "$OUT/depthwise.png" ${DWBENCH_ARGS:-} 2>&1 \
    | tee "$OUT/depthwise.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
# The device tool returns at most 8 files: the JSON results stay loose, the
# text logs travel as one archive.
(cd "$OUT" && ls *.txt >/dev/null 2>&1 && tar czf logs.tar.gz *.txt && rm -f *.txt)
exit $status
