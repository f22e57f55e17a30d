"""Tuning sweep of the GroupNorm column kernels' split (_group_norm's
_TARGET_BLOCKS, _MIN_ROWS_PER_CHUNK, _GROUPED_BYTES, _MAX_COLUMNS, ...) and
path: forward and backward GPU time (CUDA graph over rotating input copies,
as benchmarks/group_norm.py measures it) of SD-size and large shapes, SiLU,
G = 32, one column per setting.  The figures behind the constants'
comments come from it.

    PYTHONPATH=.:benchmarks python benchmarks/group_norm_tuning.py [--forward | --shipped | --paths | --cluster | --cluster-backward | --programmatic | --vectors] [NxHxWxC:dtype ...]   # about 30 s on an H200

--paths compares the paths: "auto" (the shipped rule), "cluster" (the
cluster forward wherever it serves the shape), "fused" (the two launches),
"onepass" and "resident" (the opt-in one-launch kernels; resident also at 64
and 32 blocks).  --programmatic compares "auto" and "fused" with and without
the programmatic dependent launch of the second kernel (_launch.PROGRAMMATIC).
--vectors compares the apply / dx kernels' vectors a thread: the shipped rule
(_group_norm._elementwise_vectors), and U = 2 or U = 1 forced.
"""

import sys

import torch

import group_norm as bench
from cupy_dwgn import _group_norm as gn
from cupy_dwgn import _launch
from harness import run_facts

KNOBS = ("_MIN_ROWS_PER_CHUNK", "_MIN_ROWS_PER_HALF_CHUNK", "_MIN_ROWS_PER_LONG_CHUNK", "_TARGET_BLOCKS", "_MAX_COLUMNS", "_GROUPED_BYTES",
         "_GROUPED_TARGET_BLOCKS", "_GROUPED_MIN_ROWS", "_MAX_GROUPED_CHANNELS", "_RESIDENT_BLOCKS", "_CLUSTER_BLOCK",
         "_CLUSTER_TARGET_CTAS", "_CLUSTER_BWD_TARGET_CTAS", "_CLUSTER_BWD_MIN_SET_BYTES", "_CLUSTER_BWD_BLOCK",
         "_CLUSTER_BWD_WIDE_BLOCK")
DEFAULT = {k: getattr(gn, k) for k in KNOBS}  # the shipped values
# (name, knobs changed from the shipped values, path)
SETTINGS = [("shipped", {}, "auto"), ("split", {}, "split"), ("grouped", dict(_GROUPED_BYTES=0), "auto"),
            ("per-channel", dict(_GROUPED_BYTES=2**62), "auto"),
            ("grouped 512", dict(_GROUPED_TARGET_BLOCKS=512), "auto"),
            ("grouped 128", dict(_GROUPED_TARGET_BLOCKS=128), "auto"),
            ("target1024", dict(_TARGET_BLOCKS=1024), "auto"), ("rows64", dict(_MIN_ROWS_PER_CHUNK=64), "auto"),
            ("target256", dict(_TARGET_BLOCKS=256), "auto"), ("cols32", dict(_MAX_COLUMNS=32), "auto"),
            # with the statistics / reduce ring (more rows in flight per thread): shorter chunks, more items
            ("long32", dict(_MIN_ROWS_PER_LONG_CHUNK=32), "auto"), ("half8", dict(_MIN_ROWS_PER_HALF_CHUNK=8), "auto"),
            ("target512", dict(_TARGET_BLOCKS=512), "auto")]
PATHS = [("auto", {}, "auto"), ("cluster", {}, "cluster"), ("fused", {}, "fused"),
         ("cluster 128", dict(_CLUSTER_BLOCK=128), "cluster"), ("cluster 64", dict(_CLUSTER_BLOCK=64), "cluster"),
         ("cluster 128, 512 CTAs", dict(_CLUSTER_BLOCK=128, _CLUSTER_TARGET_CTAS=512), "cluster"),
         ("onepass", {}, "onepass"),
         ("small", {}, "small"),
         # the cluster backward's knobs (the forward columns repeat the cluster forward)
         ("cluster, bwd 256 CTAs", dict(_CLUSTER_BWD_TARGET_CTAS=256), "cluster"),
         ("cluster, bwd 64 CTAs", dict(_CLUSTER_BWD_TARGET_CTAS=64), "cluster"),
         ("cluster, bwd sets of 128 B", dict(_CLUSTER_BWD_MIN_SET_BYTES=128), "cluster"),
         ("cluster, bwd 128 threads", dict(_CLUSTER_BWD_BLOCK=128, _CLUSTER_BWD_WIDE_BLOCK=128), "cluster"),
         ("cluster, bwd 256 threads", dict(_CLUSTER_BWD_BLOCK=256, _CLUSTER_BWD_WIDE_BLOCK=256), "cluster"),
         ("resident", {}, "resident"),
         ("resident 64", dict(_RESIDENT_BLOCKS=64), "resident"), ("resident 32", dict(_RESIDENT_BLOCKS=32), "resident")]
# the apply / dx kernels' vectors a thread: the shipped rule, and U = 2 or 1 forced ("U" stands for
# _group_norm._elementwise_vectors among the knobs)
VECTORS = [("auto", {}, "auto"), ("U=2", dict(U=2), "auto"), ("U=1", dict(U=1), "auto")]
# "PROGRAMMATIC" stands for _launch.PROGRAMMATIC (shipped: on) among the knobs
PROGRAMMATIC = [("auto", {}, "auto"), ("auto, no PDL", dict(PROGRAMMATIC=False), "auto"), ("fused", {}, "fused"),
                ("fused, no PDL", dict(PROGRAMMATIC=False), "fused"), ("auto", {}, "auto")]
CASES = [((2, 64, 64, 320), "float16"), ((2, 64, 64, 320), "float32"), ((2, 32, 32, 640), "float16"), ((2, 32, 32, 640), "float32"),
         ((2, 16, 16, 1280), "float16"), ((8, 8, 8, 1280), "float32"), ((1, 128, 128, 128), "float16"), ((1, 128, 128, 128), "float32"),
         ((8, 128, 128, 320), "float16"), ((1, 512, 512, 128), "float16"), ((4, 64, 64, 2560), "float32"), ((1, 256, 256, 256), "float32")]


SHIPPED_PROGRAMMATIC = _launch.PROGRAMMATIC
SHIPPED_VECTORS = gn._elementwise_vectors


def set_programmatic(on):
    _launch.PROGRAMMATIC = on
    _launch._PROGRAMMATIC_DEVICES.clear()


def clear():
    gn._forward_plan.cache_clear()
    gn._backward_plan.cache_clear()
    gn._SIGNATURES.clear()


def main():
    backward = "--forward" not in sys.argv[1:]  # --forward: forward only (the statistics split's settings)
    # --shipped: the shipped rule alone (an A/B of a kernel change across runs)
    # --cluster: "auto", "cluster", "fused" and the cluster variants of --paths
    # --cluster-backward: "auto", "cluster", "fused" and the cluster backward's variants
    # --small: "auto", "small", "cluster", "fused"; --torch adds PyTorch's best format (GPU time, forward and
    # forward+backward) to each line
    settings = (SETTINGS[:1] if "--shipped" in sys.argv[1:] else PATHS if "--paths" in sys.argv[1:]
                else PROGRAMMATIC if "--programmatic" in sys.argv[1:]
                else VECTORS if "--vectors" in sys.argv[1:]
                else [p for p in PATHS if p[0] in ("auto", "small", "cluster", "fused")] if "--small" in sys.argv[1:]
                else PATHS[:6] if "--cluster" in sys.argv[1:]
                else PATHS[:3] + [p for p in PATHS if p[0].startswith("cluster, bwd")]
                if "--cluster-backward" in sys.argv[1:] else SETTINGS)
    only = [a for a in sys.argv[1:] if "x" in a]  # e.g. 2x64x64x320:float16 (default: every case)
    cases = [(tuple(int(v) for v in a.split(":")[0].split("x")), a.split(":")[1]) for a in only] or CASES
    run_facts(torch)  # prints the device, date and copy bandwidth
    print("case | " + " | ".join(s[0] for s in settings) + "   (forward/backward GPU us, rotating copies, SiLU)", flush=True)
    for shape, dtype in cases:
        sweep(shape, dtype, backward, settings, "--torch" in sys.argv[1:])
    for k, v in DEFAULT.items():
        setattr(gn, k, v)
    set_programmatic(SHIPPED_PROGRAMMATIC)
    gn._elementwise_vectors = SHIPPED_VECTORS
    gn.FORWARD_PATH = gn.BACKWARD_PATH = "auto"
    clear()


def sweep(shape, dtype, backward, settings, with_torch=False):
    case = bench.Case(torch, shape, dtype, "silu")
    cells = []
    for name, knobs, path in settings:
        knobs = dict(knobs)
        set_programmatic(knobs.pop("PROGRAMMATIC", SHIPPED_PROGRAMMATIC))
        u = knobs.pop("U", None)
        gn._elementwise_vectors = SHIPPED_VECTORS if u is None else (lambda *args, u=u: u)
        for k, v in {**DEFAULT, **knobs}.items():
            setattr(gn, k, v)
        gn.FORWARD_PATH = gn.BACKWARD_PATH = path
        clear()
        fwd = bench._graph_us([case.forward_into(i) for i in range(case.copies)])
        bwd = bench._graph_us([case.backward(i, into=True) for i in range(case.copies)]) if backward else 0.0
        cells.append(f"{fwd:6.1f}/{bwd:6.1f}")
    if with_torch:  # PyTorch's faster format: forward / forward+backward
        r = range(case.copies)
        fwd, fwd_bwd = (min(bench._torch_graph_us(torch, [make(i, cl) for i in r]) for cl in (False, True))
                        for make in (case.torch_forward, case.torch_forward_backward))
        cells.append(f"torch {fwd:6.1f}/{fwd_bwd:6.1f} (fwd+bwd)")
    print(f"{'x'.join(map(str, shape))} {dtype} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    sys.exit(main())
