"""The CPU-side benchmark tools: benchmarks/ab_table.py reads the cell lines
benchmarks/depthwise.py prints (made here by its own cell_line) and puts
several runs side by side; benchmarks/depthwise_candidates.py names the
kernel the ops take only where its candidate is the ops' launch."""

import pathlib
import sys

import numpy
import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

ab_table = pytest.importorskip("ab_table")


def _line(case, dtype, layout, direction, ours, nchw, cl, index=1):
    depthwise = pytest.importorskip("depthwise")  # imports cupy (no GPU needed)
    best = min(nchw, cl)
    row = {"case": case, "dtype": dtype, "layout": layout, "direction": direction, "ours_us": ours,
           "torch_nchw_us": nchw, "torch_channels_last_us": cl, "floor_us": 27.3, "torch_best_us": best,
           "torch_best_format": "channels_last" if cl <= nchw else "NCHW", "ratio_vs_torch_best": best / ours,
           "fraction_of_floor": 27.3 / ours, "rel_error": 2.1e-4, "rel_error_ok": True}
    return f"[{index}/48] " + depthwise.cell_line(row)


def test_parse_reads_the_benchmarks_own_cell_lines():
    lines = [_line("64x144x56 3x3 s1", "float16", "NHWC", "forward", 67.6, 95.2, 49.1),
             "copy bandwidth 4.23 TB/s", _line("64x144x56 3x3 s1", "float16", "NHWC", "forward", 68.0, 95.0, 50.0, 2),
             _line("16x512x16 31x31 s1", "bfloat16", "NCHW", "backward_weight", 254.7, 3021.2, 3100.0, 3)]
    cells = ab_table.parse(lines)
    assert cells == {("64x144x56 3x3 s1", "float16", "NHWC", "forward"): ([67.6, 68.0], [49.1, 50.0]),
                     ("16x512x16 31x31 s1", "bfloat16", "NCHW", "backward_weight"): ([254.7], [3021.2])}


def test_table_marks_changes_and_gives_the_geometric_mean():
    a = {("c1", "float16", "NHWC", "forward"): ([60.0, 62.0], [50.0]), ("c2", "float32", "NCHW", "forward"): ([10.0], [9.0]),
         ("c3", "float32", "NCHW", "forward"): ([5.0], [4.0])}
    b = {("c1", "float16", "NHWC", "forward"): ([45.5], [49.0]), ("c2", "float32", "NCHW", "forward"): ([10.2], [9.0])}
    lines = ab_table.table([a, b], ["main", "new"])
    rows = {line.split("  ")[0].strip(): line for line in lines}
    assert rows["c1 float16 NHWC forward"].rstrip().endswith("*")  # 61 -> 45.5 (the median of 60 and 62 first)
    assert "61.0" in rows["c1 float16 NHWC forward"] and "45.5" in rows["c1 float16 NHWC forward"]
    assert not rows["c2 float32 NCHW forward"].rstrip().endswith("*")  # 2%: under the threshold
    geomean = next(line for line in lines if line.startswith("geomean"))
    assert geomean.split()[-1] == f"{((45.5 / 61.0) * (10.2 / 10.0)) ** 0.5:.3f}"
    assert any("1 cells not in every file" in line for line in lines)


def test_main_refuses_a_file_without_cell_lines(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("nothing here\n")
    with pytest.raises(SystemExit):
        ab_table.main([str(empty)])
    assert "no cell lines" in capsys.readouterr().err


def test_conv_shape_parses_the_shapes_option():
    harness = pytest.importorskip("harness")  # imports cupy (no GPU needed)
    import argparse

    assert harness.conv_shape("64x144x75x3x1") == (64, 144, 75, 3, 1)
    for bad in ("64x144x75x3", "64x144x75x3x0", "64xCx75x3x1", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="NxCxHxKxSTRIDE"):
            harness.conv_shape(bad)
    depthwise = pytest.importorskip("depthwise")
    assert depthwise.case_name(*harness.conv_shape("64x96x150x3x2")) == "64x96x150 3x3 s2"


def test_models_interleaves_the_variants_in_rounds():
    # benchmarks/models.py times each variant's steps in rounds over the variants, the first one
    # rotating, so a slow stretch of the host falls on all alike; a variant that raises drops out.
    models = pytest.importorskip("models")

    class CountingTimer:  # models.Timer's interface: run(step, count) -> count step times
        def __init__(self):
            self.calls = []

        def run(self, step, count):
            self.calls.append((step(), count))
            return [float(len(self.calls))] * count

    def failing():
        raise RuntimeError("out of memory")

    timer, errors = CountingTimer(), []
    steps = {"a": lambda: "a", "b": lambda: "b", "c": lambda: "c"}
    times = models.interleaved_step_times(timer, steps, 10, 4, lambda variant, error: errors.append(variant))
    assert [variant for variant, _ in timer.calls] == list("abc" "bca" "cab" "abc")
    assert [count for _, count in timer.calls] == [3] * 3 + [3] * 3 + [2] * 3 + [2] * 3
    assert {variant: len(t) for variant, t in times.items()} == {"a": 10, "b": 10, "c": 10}
    assert errors == []

    timer, steps = CountingTimer(), {"a": lambda: "a", "b": failing, "c": lambda: "c"}
    times = models.interleaved_step_times(timer, steps, 4, 2, lambda variant, error: errors.append(variant))
    assert errors == ["b"] and set(times) == {"a", "c"} and "b" not in steps
    assert all(len(t) == 4 for t in times.values())


#: The depthwise table's cases but 31x31 (the large-filter kernels are no candidates) and layers that reach
#: the other kernels (NCHW rows and walk at stride 2, the ring on wide half rows, the window at 5x5).
CANDIDATE_SHAPES = ["64x144x56x3x1", "64x96x112x3x2", "64x384x28x3x1", "64x960x7x3x1", "64x240x28x5x1", "64x96x56x7x1",
                    "64x384x14x7x1", "64x576x14x3x2", "64x192x75x5x2", "64x32x112x3x1", "64x1392x10x3x1",
                    "64x672x14x5x1"]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_candidates_time_the_ops_own_launch(layout, monkeypatch):
    # benchmarks/depthwise_candidates.py labels the kernel the ops take: that candidate must be the
    # ops' launch in every setting (grid, block, shared memory, scalars), or its time is not the ops'
    # time (before 2026-12-07 the NHWC window candidate ran channel group 1 where the ops run 2 or 4).
    # Planned as on an H200, without a GPU.
    candidates = pytest.importorskip("depthwise_candidates")  # imports cupy (no GPU needed)
    harness = pytest.importorskip("harness")
    from _helpers import dispatch_stand_in, h200_device_facts

    from cupy_dwgn import _depthwise_nchw_large, _launch, _validate, depthwise
    from cupy_dwgn._dtypes import bfloat16

    h200_device_facts(monkeypatch)
    labelled = set()
    for n, c, hw, k, stride in map(harness.conv_shape, CANDIDATE_SHAPES):
        shape = (n, c, hw, hw) if layout == "NCHW" else (n, hw, hw, c)
        g = _validate.conv_geometry(shape, (c, 1, k, k), stride, k // 2, 1, layout=layout)
        for dtype in (numpy.dtype(numpy.float16), bfloat16, numpy.dtype(numpy.float32)):
            array = dispatch_stand_in(n * c * hw * hw, dtype)
            index = _launch.index_type(array.size, array.size)
            for backward in (False, True) if stride == 1 else (False,):
                build = depthwise._backward_input_steps if backward else depthwise._forward_steps
                (taken,) = build(g, layout, array, array).launches
                plans = {name: plan(g, dtype, backward, index) for name, plan in candidates.CANDIDATES[layout].items()}
                name = candidates.taken_candidate(plans, taken)
                assert name is not None, (layout, g, dtype.name, backward, taken.expression)
                labelled.add(name)
    _depthwise_nchw_large._plan.cache_clear()
    # The shapes reach most of the layout's kernels, so a candidate planned otherwise than the ops fails here.
    assert len(labelled) >= 4, labelled


def _fuzz_gpu():
    sys.path.insert(0, str(BENCHMARKS.parent / "scripts"))
    import fuzz_gpu

    return fuzz_gpu


def test_fuzz_draws_valid_depthwise_calls_and_knows_their_geometry():
    # scripts/fuzz_gpu.py pads the float64 oracle's input itself: its padding and output size must be the
    # library's for every padding form, or a correct kernel would be reported wrong.
    from cupy_dwgn import _validate

    fuzz = _fuzz_gpu()
    rng = numpy.random.default_rng(0)
    forms, filters, kinds = set(), set(), set()
    for _ in range(3000):
        case = fuzz.draw_depthwise(rng)
        kinds.add(case["array"])
        batch, channels, height, width = case["x_shape"]
        shape = (batch, height, width, channels) if case["layout"] == "NHWC" else (batch, channels, height, width)
        padding = fuzz.padding_argument(case)
        g = _validate.conv_geometry(shape, (channels * case["multiplier"], 1, *case["filter"]),
                                    tuple(case["stride"]), padding, tuple(case["dilation"]), layout=case["layout"])
        (top, bottom), (left, right) = fuzz._pads(case)
        assert (g.pad_top, g.pad_bottom, g.pad_left, g.pad_right) == (top, bottom, left, right), case
        assert (g.out_height, g.out_width) == fuzz._output_size(case), case
        forms.add(type(padding).__name__ if not isinstance(padding, str) else padding)
        filters.add(case["filter"][0])
    assert forms == {"int", "tuple", "same", "valid"} and {1, 3, 31} <= filters
    assert kinds == _fuzz_array_kinds(fuzz, fuzz.DEPTHWISE_ARRAYS)


def _fuzz_array_kinds(fuzz, weights):
    """The array kinds the fuzzer should draw: all of them, the JAX ones only where JAX is installed."""
    return {kind for kind in weights if fuzz.HAVE_JAX or not kind.startswith("jax")}


def test_fuzz_draws_valid_group_norm_calls():
    from cupy_dwgn import _checks

    fuzz = _fuzz_gpu()
    rng = numpy.random.default_rng(1)
    ranks, kinds = set(), set()
    for _ in range(3000):
        case = fuzz.draw_group_norm(rng)
        kinds.add(case["array"])
        shape = case["shape"]
        assert shape[-1] % case["num_groups"] == 0 and numpy.prod(shape) <= fuzz.MAX_ELEMENTS, case
        assert case["activation"] in _checks.ACTIVATIONS and case["dtype"] in fuzz.TOLERANCE
        ranks.add(len(shape) - 2)
    assert ranks == {0, 1, 2, 3}
    assert kinds == _fuzz_array_kinds(fuzz, fuzz.GROUP_NORM_ARRAYS)
