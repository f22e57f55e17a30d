"""Real models: timm mobilenetv2_100, convnext_nano, efficientnet_b3 and resnet50_gn, and a
diffusion U-Net block of our own, each as PyTorch runs it and converted with
cupy_dwgn.torch.convert, in float32 and bfloat16: accuracy against a float64
copy of the same model, and the time of a training step.

Models (timm.create_model(name, pretrained=False): random weights, no network):

    mobilenetv2_100  17 depthwise 3x3 convs (BatchNorm: nothing to fuse)
    convnext_nano    14 depthwise 7x7 convs (LayerNorm2d: stays torch's)
    efficientnet_b3  26 depthwise 3x3 / 5x5 convs (stride 1 and 2) at 300x300: planes 150, 75,
                     38, 19 and 10 wide, none a multiple of 8 above 64 (the NCHW window kernel's
                     unaligned rows), the depthwise widths of EfficientNet-B2..B7
    resnet50_gn      53 GroupNorm(32) (ReLU is a separate attribute, not fused)
    unet_block       ours: two diffusion-U-Net ResBlocks at 320 channels,
                     GroupNorm(32)+SiLU -> conv3x3 -> GroupNorm(32)+SiLU -> conv3x3, + skip;
                     the first with dense 3x3 convs, the second with depthwise 3x3 + 1x1
                     (nn.Sequential pieces, so convert() fuses every SiLU into its GroupNorm)

Precision modes (--modes):

    float32            model and data in float32
    bfloat16-autocast  (default) float32 weights, forward under torch.autocast("cuda", bfloat16);
                       torch runs its convolutions in bfloat16 and its GroupNorm in float32 (float32
                       out); the bridge casts depthwise inputs to bfloat16 like torch, but its
                       GroupNorm keeps the input's dtype (bfloat16 after a bfloat16 conv)
    bfloat16-cast      model and data cast to bfloat16 (weights too; SGD on bfloat16 weights)

Variants per (model, mode): torch's own layers in contiguous NCHW and in channels_last, and the
converted model (cupy_dwgn.torch.convert of a deep copy: same weights) in both memory formats
(our GroupNorm kernels are channels-last; on contiguous NCHW tensors the bridge falls back to
torch's GroupNorm).  The baseline is torch in its faster memory format; ours is reported in its
faster format too (every variant's time is in the JSON).

(a) Accuracy (batch 8 at 224x224 for timm, 300x300 for efficientnet_b3, 4 for the U-Net block):
    the float64 copy of the model (same weights; in bfloat16-cast mode the weights and input, in
    both bfloat16 modes the cotangent, are first rounded to bfloat16, so the reference sees the
    very same numbers) runs forward and backward on the same input and the same random output
    cotangent (one backward of sum(out * cotangent)); for each variant we report the relative
    error norm ||v - v64|| / ||v64|| of the output, of the input gradient dL/dx, and of all
    parameter gradients concatenated into one vector.  TF32 is off for this part
    (torch.backends.cudnn / cuda.matmul .allow_tf32 = False), so float32 means float32 arithmetic
    in every layer. Target: ours within 2x of torch's own error, each of the three, compared in
    the same memory format (so only the swapped layers differ), in both formats ("error_ok").
    Gradient errors carry the ReLU/ReLU6 masks that flip between float32 and float64 (randomly
    initialized mobilenetv2 shows ~5e-3 in float32 for torch itself): noisy, but the same for
    both.
(b) Training-step time: forward + loss (cross entropy against random labels for timm, MSE against
    a random target for the U-Net block) + backward + SGD(momentum 0.9) step +
    zero_grad(set_to_none), batch 64 at 224x224 for timm (300x300 for efficientnet_b3) and
    8x320x64x64 for the U-Net block, torch's default TF32 settings and cudnn.benchmark = True;
    each step bracketed by its own pair of CUDA events (so host-bound gaps count), after warm-up
    steps, median of the steps.  The four variants' models are built and warmed up first, then
    timed in up to ROUNDS rounds (one step per variant each, at the default 20 steps), the
    variants in turn (a different one first each round): the host's speed drifts by up to 2x over
    a run (results/models_host_fastpath_h100_2026-12-06.txt), and host-bound steps would carry that
    drift into whichever variant ran during it.  Rounds of 5 steps (4 rounds) still let a slow
    stretch of 1-3 s fall on one or two variants (results/models_h100_2026-12-06c.json: convnext_nano
    bfloat16 ours 19.1-20.6 ms a step in the first round, 27-42 in the next two, torch's steady).

    PYTHONPATH=.:benchmarks python benchmarks/models.py --json OUT.json --png OUT.png
        [--models convnext_nano unet_block] [--modes float32 bfloat16-cast] [--quick]

--quick: the U-Net block only (no timm needed), float32 and bfloat16-autocast, fewer steps (a
smoke run, not for the record).  Without --json the result goes to
benchmarks/results/models_<gpu>_<date>.json (--json - writes none); the JSON is rewritten after
each (model, mode), so a run cut short keeps what it measured.  A variant that raises gets null
times/errors and an "error" string; the run goes on.  --cpu-dry-run runs the same code on the
CPU at tiny sizes (perf_counter instead of CUDA events; the bridge's CPU path, its float64 NumPy
references; the bridge handles CUDA autocast only, so ours fails in bfloat16-autocast there) to
check the script without a GPU; its numbers mean nothing.
"""

import argparse
import contextlib
import copy
import datetime
import math
import platform
import statistics
import sys
import time
import traceback

#: name -> (source, training batch, input shape without the batch, accuracy batch)
MODELS = {
    "mobilenetv2_100": ("timm", 64, (3, 224, 224), 8),
    "convnext_nano": ("timm", 64, (3, 224, 224), 8),
    "efficientnet_b3": ("timm", 64, (3, 300, 300), 8),
    "resnet50_gn": ("timm", 64, (3, 224, 224), 8),
    "unet_block": ("ours", 8, (320, 64, 64), 4),
}
MODES = ("float32", "bfloat16-autocast", "bfloat16-cast")
DEFAULT_MODES = ("float32", "bfloat16-autocast")
FORMATS = ("NCHW", "channels_last")
#: Timed steps are taken in at most this many rounds over the variants (interleaved; see (b)
#: above): one step a variant a round at the default --steps.
ROUNDS = 20
#: Target: the converted model's error within this factor of torch's own.
ERROR_FACTOR = 2.0
ERROR_KINDS = ("out", "dx", "dparam")

METHOD = {
    "accuracy": "batch 8 (timm, 224x224; efficientnet_b3 300x300) / 4 (unet_block); one forward + backward "
                "with a fixed random output cotangent; float64 copy of the same model as reference (bfloat16-cast: weights and input "
                "rounded to bfloat16 first); TF32 off",
    "step_time": "forward + loss + backward + SGD step + zero_grad, batch 64x3x224x224 (timm; "
                 "efficientnet_b3 64x3x300x300) / 8x320x64x64 (unet_block); each step between its own CUDA events; warm-up steps, then the variants' steps interleaved "
                 "(one step a variant in turn, the first rotating), median",
    "baseline": "torch's own layers in its faster memory format (NCHW or channels_last); ours: the converted "
                "model in its faster memory format",
}



# ---------------------------------------------------------------------------
# Models


def _unet_modules(torch):
    nn = torch.nn

    def conv3x3(channels, depthwise):
        if depthwise:  # depthwise 3x3 then pointwise 1x1 (a separable conv)
            return nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, groups=channels),
                                 nn.Conv2d(channels, channels, 1))
        return nn.Conv2d(channels, channels, 3, padding=1)

    class ResBlock(nn.Module):
        """A diffusion U-Net ResBlock without the time embedding:
        x + conv(silu(gn(conv(silu(gn(x)))))), every GroupNorm + SiLU adjacent in an
        nn.Sequential (what convert() fuses)."""

        def __init__(self, channels, groups=32, depthwise=False):
            super().__init__()
            self.in_layers = nn.Sequential(nn.GroupNorm(groups, channels), nn.SiLU(), conv3x3(channels, depthwise))
            self.out_layers = nn.Sequential(nn.GroupNorm(groups, channels), nn.SiLU(), conv3x3(channels, depthwise))

        def forward(self, x):
            return x + self.out_layers(self.in_layers(x))

    return ResBlock


def build_model(torch, name, *, channels=None):
    """The float32 model ``name`` on the CPU, in training mode, seeded (same weights every run)."""
    torch.manual_seed(0)
    source = MODELS[name][0]
    if source == "timm":
        import timm

        model = timm.create_model(name, pretrained=False, drop_rate=0.0, drop_path_rate=0.0)
    else:
        ResBlock = _unet_modules(torch)
        c = channels or MODELS[name][2][0]
        model = torch.nn.Sequential(ResBlock(c), ResBlock(c, depthwise=True))
    return model.train()


def count_layers(torch, model):
    """Depthwise convs and GroupNorms of a torch model (what convert() should swap)."""
    nn = torch.nn
    depthwise = sum(isinstance(m, nn.Conv2d) and m.groups == m.in_channels > 1 for m in model.modules())
    groupnorm = sum(isinstance(m, nn.GroupNorm) for m in model.modules())
    return {"depthwise": depthwise, "group_norm": groupnorm}


def count_converted(dwt, model):
    """Our modules in a converted model, and how many GroupNorms carry a fused activation."""
    dw = [m for m in model.modules() if isinstance(m, dwt.DepthwiseConv2d)]
    gn = [m for m in model.modules() if isinstance(m, dwt.GroupNorm)]
    fused = sum(getattr(m, "activation", "identity") not in (None, "identity") for m in gn)
    return {"depthwise": len(dw), "group_norm": len(gn), "fused_activations": fused}


# ---------------------------------------------------------------------------
# Precision modes and memory formats


def mode_dtype(torch, mode):
    return torch.float32 if mode == "float32" else torch.bfloat16


def autocast_context(torch, mode, device):
    if mode == "bfloat16-autocast":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def place(torch, model, mode, memory_format, device):
    """``model`` moved to ``device`` in the mode's parameter dtype and the memory format."""
    dtype = torch.bfloat16 if mode == "bfloat16-cast" else torch.float32
    fmt = torch.channels_last if memory_format == "channels_last" else torch.contiguous_format
    return model.to(device=device, dtype=dtype).to(memory_format=fmt)


def as_format(torch, tensor, memory_format):
    fmt = torch.channels_last if memory_format == "channels_last" else torch.contiguous_format
    return tensor.contiguous(memory_format=fmt)


def round_to_bfloat16_(torch, model):
    """Round every parameter and floating buffer to bfloat16 in place (kept float32), so the
    float64 reference of the bfloat16-cast mode has exactly the weights the model runs with."""
    with torch.no_grad():
        for t in list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]:
            t.copy_(t.to(torch.bfloat16).to(t.dtype))


@contextlib.contextmanager
def strict_float32(torch):
    """TF32 off for convolutions and matmuls (restored afterwards)."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


# ---------------------------------------------------------------------------
# (a) accuracy


def output_shape(torch, base, shape, device):
    """The output shape of one sample (an eval-mode copy: BatchNorm takes batch 1)."""
    probe = copy.deepcopy(base).eval().to(device)
    with torch.no_grad():
        out_shape = tuple(probe(torch.zeros((1,) + tuple(shape), device=device)).shape[1:])
    del probe
    return out_shape


def forward_backward(torch, model, x, cotangent, mode, memory_format, device):
    """Output, input gradient and {name: parameter gradient} of one forward + backward
    with ``cotangent`` as the output's gradient, all detached, in float64."""
    model.zero_grad(set_to_none=True)
    xi = as_format(torch, x, memory_format).detach().requires_grad_(True)
    with autocast_context(torch, mode, device):
        out = model(xi)
    out.backward(cotangent.to(out.dtype))
    grads = {n: p.grad.detach().double() for n, p in model.named_parameters() if p.grad is not None}
    result = out.detach().double(), xi.grad.detach().double(), grads
    model.zero_grad(set_to_none=True)
    return result


def relative_error(torch, got, ref):
    """||got - ref|| / ||ref|| (NaN when got has a NaN)."""
    return ((got - ref).norm() / ref.norm()).item()


def param_grad_error(torch, grads, ref_grads):
    """Relative error norm of all parameter gradients as one vector (matched by name; a
    gradient missing on one side counts as zeros)."""
    names = set(grads) | set(ref_grads)
    num = den = 0.0
    for n in names:
        ref = ref_grads.get(n)
        got = grads.get(n)
        if ref is None:
            ref = torch.zeros_like(got)
        if got is None:
            got = torch.zeros_like(ref)
        if got.shape != ref.shape:
            return float("nan")
        num += (got - ref).double().pow(2).sum().item()
        den += ref.double().pow(2).sum().item()
    return math.sqrt(num / den) if den else float("nan")


def accuracy(torch, dwt, base, name, mode, device, log):
    """{variant: {"out", "dx", "dparam": relative error} or {"error": text}}, variant in
    torch_NCHW, torch_channels_last, ours_NCHW, ours_channels_last; and the converted counts."""
    _, _, shape, batch = MODELS[name]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((batch,) + tuple(shape), generator=gen)
    if mode == "bfloat16-cast":
        x = x.to(torch.bfloat16).float()
    out_shape = output_shape(torch, base, shape, device)
    cotangent = torch.randn((batch,) + tuple(out_shape), generator=gen)
    if mode != "float32":  # a bfloat16 output takes it rounded: give the reference the same numbers
        cotangent = cotangent.to(torch.bfloat16).float()
    x, cotangent = x.to(device), cotangent.to(device)

    t0 = time.perf_counter()
    try:
        ref_model = copy.deepcopy(base).to(device=device, dtype=torch.float64)
        ref = forward_backward(torch, ref_model, x.double(), cotangent.double(), "float64", "NCHW", device)
        del ref_model
    except Exception as error:
        text = f"float64 reference: {type(error).__name__}: {error}"
        log(f"    {text}")
        return {f"{i}_{f}": {"error": text} for i in ("torch", "ours") for f in FORMATS}, None
    log(f"    float64 reference {time.perf_counter() - t0:.1f} s")

    errors, counts = {}, None
    dtype = mode_dtype(torch, mode) if mode == "bfloat16-cast" else torch.float32
    for impl in ("torch", "ours"):
        for memory_format in FORMATS:
            variant = f"{impl}_{memory_format}"
            try:
                model = copy.deepcopy(base)
                if impl == "ours":
                    model = dwt.convert(model)
                    counts = count_converted(dwt, model)
                model = place(torch, model, mode, memory_format, device)
                out, dx, grads = forward_backward(torch, model, x.to(dtype), cotangent.to(dtype), mode,
                                                  memory_format, device)
                errors[variant] = {
                    "out": relative_error(torch, out, ref[0]),
                    "dx": relative_error(torch, dx, ref[1]),
                    "dparam": param_grad_error(torch, grads, ref[2]),
                }
                del out, dx, grads
            except Exception as error:
                errors[variant] = {"error": f"{type(error).__name__}: {error}"}
                log(f"    {variant} accuracy FAILED: {errors[variant]['error']}")
                if log.traceback:
                    traceback.print_exc()
            model = None
            log(f"    {variant:20} " + _error_text(errors[variant]))
    return errors, counts


def _error_text(err):
    if "error" in err:
        return "error " + err["error"][:100]
    return "  ".join(f"{k} {err[k]:.2e}" for k in ERROR_KINDS)


# ---------------------------------------------------------------------------
# (b) training-step time


class Timer:
    """Per-step time in microseconds: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, torch, device):
        self.torch, self.cuda = torch, device.type == "cuda"

    def run(self, step, steps):
        torch = self.torch
        if not self.cuda:
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                step()
                times.append((time.perf_counter() - t0) * 1e6)
            return times
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        torch.cuda.synchronize()
        for start, stop in events:
            start.record()
            step()
            stop.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(stop) * 1e3 for start, stop in events]


def make_step(torch, model, name, mode, memory_format, device, batch, out_shape, graphed=False):
    """One training step of ``model`` as a function of no arguments: forward + loss + backward +
    SGD(momentum 0.9) step + zero_grad on a fixed random batch.  ``graphed``: the model's forward
    and backward as CUDA graphs (torch.cuda.make_graphed_callables; not under autocast), the loss
    and the optimizer eager."""
    shape = MODELS[name][2]
    gen = torch.Generator().manual_seed(2)
    dtype = torch.bfloat16 if mode == "bfloat16-cast" else torch.float32
    x = as_format(torch, torch.randn((batch,) + tuple(shape), generator=gen).to(device=device, dtype=dtype), memory_format)
    if graphed:
        if mode == "bfloat16-autocast":
            raise ValueError("graphed: the model runs outside autocast; take float32 or bfloat16-cast")
        model = torch.cuda.make_graphed_callables(model, (x,))
    if MODELS[name][0] == "timm":
        target = torch.randint(0, out_shape[0], (batch,), generator=gen).to(device)

        def loss_fn(out):
            return torch.nn.functional.cross_entropy(out.float(), target)
    else:
        target = as_format(torch, torch.randn((batch,) + tuple(out_shape), generator=gen).to(device), memory_format)

        def loss_fn(out):
            return torch.nn.functional.mse_loss(out.float(), target)

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with autocast_context(torch, mode, device):
            out = model(x)
        loss = loss_fn(out)
        loss.backward()
        optimizer.step()

    return step


def interleaved_step_times(timer, steps_by_variant, steps, rounds, on_error):
    """Every step's time (us) per variant: ``steps`` timed steps each, taken in ``rounds`` rounds
    over the variants in turn, the first variant of each round rotating, so a slow stretch of the
    host falls on every variant alike.  A variant that raises is reported to ``on_error(variant,
    error)`` and left out of later rounds."""
    variants = list(steps_by_variant)
    times = {variant: [] for variant in variants}
    per_round = [steps // rounds + (r < steps % rounds) for r in range(rounds)]
    for r, count in enumerate(per_round):
        order = variants[r % len(variants):] + variants[:r % len(variants)] if variants else []
        for variant in order:
            if variant not in steps_by_variant or not count:
                continue
            try:
                times[variant] += timer.run(steps_by_variant[variant], count)
            except Exception as error:
                del steps_by_variant[variant]
                on_error(variant, error)
    return {variant: t for variant, t in times.items() if variant in steps_by_variant}


# ---------------------------------------------------------------------------
# One (model, mode)


def run_config(torch, dwt, base, name, mode, device, args, log):
    _, batch, shape, acc_batch = MODELS[name]
    if args.cpu_dry_run:
        batch = 2
    row = {
        "op": name, "case": f"train step, batch {batch}x{'x'.join(map(str, shape))}",
        "dtype": "float32" if mode == "float32" else "bfloat16",
        "precision": {"float32": "float32", "bfloat16-autocast": "autocast", "bfloat16-cast": "cast"}[mode],
        "mode": mode, "direction": "train_step", "timing": "eager",
        "batch": batch, "input_shape": list(shape), "accuracy_batch": acc_batch,
        "torch_layers": count_layers(torch, base),
    }
    log(f"  accuracy vs float64 (batch {acc_batch}, TF32 off)")
    with strict_float32(torch):
        errors, counts = accuracy(torch, dwt, base, name, mode, device, log)
    row["errors_by_variant"] = errors
    row["converted_layers"] = counts

    out_shape = output_shape(torch, base, shape, device)
    rounds = min(ROUNDS, args.steps)
    log(f"  training step, batch {batch}: {args.warmup} warm-up + {args.steps} timed steps per variant, "
        f"the variants interleaved in {rounds} rounds")
    times = {variant: None for variant in (f"{impl}_{f}" for impl in ("torch", "ours") for f in FORMATS)}
    timer = Timer(torch, device)

    def failed(variant, error):
        row.setdefault("variant_errors", {})[variant] = f"{type(error).__name__}: {error}"
        log(f"    {variant:20} FAILED: {type(error).__name__}: {error}")
        if args.traceback:
            traceback.print_exc()

    steps_by_variant = {}
    for variant in times:
        impl, memory_format = variant.split("_", 1)
        try:
            model = copy.deepcopy(base)
            if impl == "ours":
                model = dwt.convert(model)
            model = place(torch, model, mode, memory_format, device)
            step = make_step(torch, model, name, mode, memory_format, device, batch, out_shape)
            timer.run(step, args.warmup)
            steps_by_variant[variant] = step
        except Exception as error:
            failed(variant, error)
        model = step = None  # a failed variant's memory goes back (e.g. out of memory)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    t0 = time.perf_counter()
    for variant, all_times in interleaved_step_times(timer, steps_by_variant, args.steps, rounds, failed).items():
        times[variant] = statistics.median(all_times)
        row.setdefault("step_times_us", {})[variant] = all_times
        log(f"    {variant:20} {times[variant] / 1e3:8.2f} ms/step  (min {min(all_times) / 1e3:.2f}, "
            f"max {max(all_times) / 1e3:.2f})")
    log(f"    (timed steps of all variants: {time.perf_counter() - t0:.1f} s)")
    steps_by_variant.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    row.update({
        "torch_nchw_us": times.get("torch_NCHW"), "torch_channels_last_us": times.get("torch_channels_last"),
        "ours_nchw_us": times.get("ours_NCHW"), "ours_channels_last_us": times.get("ours_channels_last"),
    })
    for impl in ("torch", "ours"):
        timed = {f: times[f"{impl}_{f}"] for f in FORMATS if times.get(f"{impl}_{f}") is not None}
        best = min(timed, key=timed.get) if timed else None
        row[f"{impl}_us"] = timed.get(best)
        row[f"{impl}_format"] = best
    row["layout"] = row["ours_format"]
    row["speedup"] = row["torch_us"] / row["ours_us"] if row["torch_us"] and row["ours_us"] else None
    # Accuracy is compared format by format (torch's layers and the converted model in the same
    # memory format, so only the swapped layers differ): error_ok when, in both formats, each of
    # out / dx / dparam of ours is within ERROR_FACTOR of torch's.  The row's error fields are
    # those of the format the converted model was faster in (channels_last when untimed).
    ok_by_format = {}
    for memory_format in FORMATS:
        ours, theirs = errors.get(f"ours_{memory_format}", {}), errors.get(f"torch_{memory_format}", {})
        ok_by_format[memory_format] = all(
            ours.get(k) is not None and theirs.get(k) is not None and ours[k] <= ERROR_FACTOR * theirs[k]
            for k in ERROR_KINDS)  # False for NaN or a failed variant
    shown = row["ours_format"] or "channels_last"
    row["error_format"] = shown
    for kind in ERROR_KINDS:
        ours, theirs = errors.get(f"ours_{shown}", {}).get(kind), errors.get(f"torch_{shown}", {}).get(kind)
        row[f"{kind}_err_ours"], row[f"{kind}_err_torch"] = ours, theirs
        row[f"{kind}_err_ratio"] = ours / theirs if ours is not None and theirs else None
    row["error_ok_by_format"] = ok_by_format
    row["error_ok"] = all(ok_by_format.values())
    return row


# ---------------------------------------------------------------------------
# Output


def _ms(us, width=7):
    return f"{'-':>{width}}" if us is None else f"{us / 1e3:{width}.2f}"


def _e(value, width=8):
    return f"{'-':>{width}}" if value is None else f"{value:{width}.1e}"


def row_line(r):
    speed = "-" if r.get("speedup") is None else f"x{r['speedup']:.2f} {'faster' if r['speedup'] > 1 else 'SLOWER'}"
    errs = "  ".join(f"{k} {_e(r.get(f'{k}_err_torch'), 7)}/{_e(r.get(f'{k}_err_ours'), 7)}" for k in ERROR_KINDS)
    return (f"{r['op']:16} {r['mode']:18} torch {_ms(r['torch_us'])} ms ({r['torch_format']}), ours "
            f"{_ms(r['ours_us'])} ms ({r['ours_format']}) {speed} | err torch/ours ({r['error_format']}) {errs} "
            f"{'ok' if r['error_ok'] else 'ERROR > 2x torch'}")


def final_table(rows):
    print()
    print("step time in ms (median; t = torch, o = converted, CL = channels_last); errors: relative "
          "error norm vs the float64 model, torch / ours, both in the converted model's faster format;\n"
          "within 2x: ours <= 2 x torch for out, dx and dparam in both memory formats")
    print(f"{'model':16} {'mode':18} {'t NCHW':>7} {'t CL':>7} {'o NCHW':>7} {'o CL':>7} {'speedup':>7} "
          f"{'out t':>8} {'out o':>8} {'dx t':>8} {'dx o':>8} {'dp t':>8} {'dp o':>8}  within 2x")
    for r in rows:
        speed = "-" if r.get("speedup") is None else f"{r['speedup']:.2f}"
        print(f"{r['op']:16} {r['mode']:18} {_ms(r['torch_nchw_us'])} {_ms(r['torch_channels_last_us'])} "
              f"{_ms(r['ours_nchw_us'])} {_ms(r['ours_channels_last_us'])} {speed:>7} "
              + " ".join(f"{_e(r.get(f'{k}_err_torch'))} {_e(r.get(f'{k}_err_ours'))}" for k in ERROR_KINDS)
              + f"  {'yes' if r['error_ok'] else 'NO'}")
    timed = [r for r in rows if r.get("speedup")]
    if timed:
        geo = math.exp(sum(math.log(r["speedup"]) for r in timed) / len(timed))
        won = sum(r["speedup"] > 1 for r in timed)
        print(f"\nconverted model faster than torch's faster memory format in {won} of {len(timed)}; "
              f"geometric mean speedup {geo:.2f}x")
    print(f"accuracy within {ERROR_FACTOR:g}x of torch's own error (out, dx, dparam; both formats): "
          f"{sum(r['error_ok'] for r in rows)} of {len(rows)}")


def dry_run_facts(torch):
    return {"device": f"CPU dry run ({platform.processor() or platform.machine()})",
            "date": datetime.date.today().isoformat(), "cupy": None, "torch": torch.__version__,
            "cudnn": None, "copy_bandwidth_TBps": None}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), help="default: all")
    parser.add_argument("--modes", nargs="+", choices=MODES, help=f"default: {' '.join(DEFAULT_MODES)}")
    parser.add_argument("--json", help="results file (default benchmarks/results/models_<gpu>_<date>.json; - for none)")
    parser.add_argument("--png", help="also plot the results here (plot_models.py)")
    parser.add_argument("--steps", type=int, help="timed steps per variant (default 20; --quick 8)")
    parser.add_argument("--warmup", type=int, help="warm-up steps per variant (default 5; --quick 3)")
    parser.add_argument("--quick", action="store_true", help="the U-Net block only, fewer steps (a smoke run)")
    parser.add_argument("--traceback", action="store_true", help="print the traceback of each failing variant")
    parser.add_argument("--cpu-dry-run", action="store_true", help="check the code path on the CPU (tiny sizes)")
    args = parser.parse_args(argv)
    models = args.models or (["unet_block"] if args.quick else list(MODELS))
    modes = args.modes or list(DEFAULT_MODES)
    args.steps = args.steps or (8 if args.quick or args.cpu_dry_run else 20)
    args.warmup = args.warmup or (3 if args.quick or args.cpu_dry_run else 5)
    if args.cpu_dry_run:
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)

    import torch

    try:
        import cupy_dwgn.torch as dwt
    except ImportError as error:
        raise SystemExit(f"cupy_dwgn.torch is not importable: {error}")

    start = time.perf_counter()

    def log(text):
        print(f"[{time.perf_counter() - start:6.1f} s] {text}", flush=True)

    log.traceback = args.traceback

    if args.cpu_dry_run:
        device = torch.device("cpu")
        facts = dry_run_facts(torch)
        for name in MODELS:  # tiny sizes: the code path, not the numbers
            source, _, shape, _ = MODELS[name]
            MODELS[name] = (source, 2, (shape[0], 64, 64) if source == "timm" else (64, 8, 8), 2)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU visible to PyTorch (use --cpu-dry-run to check the code path)")
        from harness import run_facts

        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        _, facts = run_facts(torch)
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()  # the copy-bandwidth buffers (4 GiB)
    torch.backends.cudnn.benchmark = True
    settings = {
        "cudnn.benchmark": True,
        "timing: cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "timing: cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "accuracy: tf32": False,
        "optimizer": "SGD(lr=1e-3, momentum=0.9), zero_grad(set_to_none=True)",
        "loss": "cross_entropy vs random labels (timm); mse vs random target (unet_block)",
        "steps": args.steps, "warmup": args.warmup,
    }

    from harness import plot_safely, results_document, results_path, write_json

    results = results_document(
        facts, [], commit=None, quick=args.quick, cpu_dry_run=args.cpu_dry_run, torch_settings=settings,
        timm=_timm_version(), method=METHOD,
        error_metric="||v - v64|| / ||v64|| against a float64 copy of the model (same weights, input, cotangent)",
        error_target=f"ours <= {ERROR_FACTOR:g} x torch, for out, dx and dparam",
    )
    json_path = results_path(args.json, "models", facts)

    total = len(models) * len(modes)
    done = 0
    for name in models:
        log(f"building {name}")
        try:
            base = build_model(torch, name)
        except Exception as error:
            log(f"{name}: cannot build ({type(error).__name__}: {error}); skipped")
            for mode in modes:
                results["rows"].append({"op": name, "mode": mode, "error": f"{type(error).__name__}: {error}"})
            continue
        for mode in modes:
            done += 1
            log(f"[{done}/{total}] {name} {mode}")
            base_mode = base
            if mode == "bfloat16-cast":
                base_mode = copy.deepcopy(base)
                round_to_bfloat16_(torch, base_mode)
            row = run_config(torch, dwt, base_mode, name, mode, device, args, log)
            results["rows"].append(row)
            log(row_line(row))
            write_json(json_path, results)
        del base
        if device.type == "cuda":
            torch.cuda.empty_cache()
    rows = [r for r in results["rows"] if "speedup" in r]
    final_table(rows)
    print(f"wall time {time.perf_counter() - start:.0f} s" + (f"; results in {json_path}" if json_path else ""))
    if args.png:
        plot_safely("plot_models", results, args.png)
    return 0


def _timm_version():
    try:
        import timm

        return timm.__version__
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
