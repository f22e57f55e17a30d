"""Train a small converted model (depthwise convolutions and GroupNorm+SiLU
blocks running on cupy-dwgn's kernels) under PyTorch's
DistributedDataParallel on 2 GPUs (NCCL), then the same global batch on one
GPU, and compare the two loss curves.

The model regresses a fixed random "teacher" network of the same shape
(synthetic data with a learnable target).  Each step draws a global batch
from a seeded generator; with DDP every rank takes its slice of it on its own
GPU (cuda:rank), and DDP averages the gradients, which for equal slices is
the gradient of the global batch's mean loss: what the single-GPU run
computes.  GroupNorm normalizes each sample by itself (no batch statistics),
so the two runs differ only by float32 rounding (TF32 is switched off) and
their losses agree to far better than the 1e-3 relative tolerance checked.

    python examples/ddp_train.py [--gpus 2] [--steps 30] [--batch 32]

The script starts its own processes (torch.multiprocessing.spawn; no torchrun,
MASTER_ADDR=127.0.0.1 and a free port).  With one GPU it still runs: DDP with
one process.  Exits non-zero if either loss does not fall to half its start
or the curves differ by more than the tolerance.  --device cpu runs the same
code with the gloo backend and, by default, torch's own layers (--layers
cupy_dwgn: the bridge's CPU path, the slow float64 NumPy references), to
check the training code on a machine without a GPU.
"""

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile

#: Losses of the DDP run and of the single-GPU run may differ by this much (relative, per step).
LOSS_RTOL = 1e-3
#: The loss must fall below this fraction of its first value (mean of the last 3 steps).
FALL_FACTOR = 0.5

#: A rank that waits this long for the others gives up (instead of NCCL's 10 minutes).
TIMEOUT = datetime.timedelta(seconds=120)

SEED = 0
IMAGE = 32          # input height = width
IN_CHANNELS = 3
WIDTH = 64          # channels inside the model
GROUPS = 8
LR = 0.05
MOMENTUM = 0.9


def need_torch():
    """Return torch, or exit with a plain explanation when it is missing."""
    try:
        import torch
    except ImportError:
        sys.exit("Cannot run this example: PyTorch is not installed (pip install torch)")
    return torch


def gpu_or_exit():
    """Return the number of GPUs, or exit with a plain explanation when none can be used."""
    import cupy_dwgn

    count, reason = cupy_dwgn.gpu_status()
    if not count:
        sys.exit(f"Cannot run this example: {reason}")
    return count


# ---------------------------------------------------------------------------
# Model and data


def build_model(*, seed=SEED, width=WIDTH, groups=GROUPS, blocks=2):
    """A small ConvNeXt-like network on the CPU, float32: a 3x3 stem, ``blocks``
    residual blocks (depthwise 7x7 -> GroupNorm+SiLU -> 1x1 expand -> GroupNorm+SiLU
    -> 1x1 project), then GroupNorm+SiLU and a 1x1 head back to 3 channels.
    Every GroupNorm is followed by its SiLU inside one nn.Sequential, so
    cupy_dwgn.torch.convert fuses them."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(width, width, 7, padding=3, groups=width),  # depthwise
                nn.GroupNorm(groups, width), nn.SiLU(),
                nn.Conv2d(width, 2 * width, 1),
                nn.GroupNorm(groups, 2 * width), nn.SiLU(),
                nn.Conv2d(2 * width, width, 1),
            )

        def forward(self, x):
            return x + self.body(x)

    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(IN_CHANNELS, width, 3, padding=1),
        *[Block() for _ in range(blocks)],
        nn.GroupNorm(groups, width), nn.SiLU(),
        nn.Conv2d(width, IN_CHANNELS, 1),
    )


def prepare(model, device, *, convert=True):
    """``model`` with cupy-dwgn's layers swapped in (``convert``), on ``device``, channels_last
    (cupy-dwgn's GroupNorm kernels are channels-last; its depthwise NHWC kernels take
    channels_last tensors zero-copy)."""
    import torch

    if convert:
        import cupy_dwgn.torch as dwt

        model = dwt.convert(model)
    return model.to(device).to(memory_format=torch.channels_last)


_TEACHER = {}


def teacher():
    """The fixed random network the student learns to imitate (torch's own layers, CPU, eval)."""
    if "net" not in _TEACHER:
        import torch

        net = build_model(seed=SEED + 1000).eval()
        for p in net.parameters():
            p.requires_grad_(False)
        # Scale the output to unit RMS on a fixed batch, so losses start near 1.
        x = torch.randn(64, IN_CHANNELS, IMAGE, IMAGE, generator=torch.Generator().manual_seed(SEED + 2000))
        with torch.no_grad():
            _TEACHER["scale"] = 1.0 / net(x).pow(2).mean().sqrt().item()
        _TEACHER["net"] = net
    return _TEACHER["net"], _TEACHER["scale"]


def global_batch(step, batch):
    """Inputs and targets of step ``step`` (CPU, float32): the same for every rank and every run."""
    import torch

    gen = torch.Generator().manual_seed(SEED * 1_000_003 + step)
    x = torch.randn(batch, IN_CHANNELS, IMAGE, IMAGE, generator=gen)
    net, scale = teacher()
    with torch.no_grad():
        y = net(x) * scale
    return x, y


def train(model, device, steps, batch, *, rank=0, world_size=1, log=None):
    """SGD on the mean squared error to the teacher; returns the loss of the global batch
    at each step (with DDP: the local losses averaged over the ranks)."""
    import torch
    import torch.distributed as dist

    if batch % world_size:
        raise ValueError(f"the global batch ({batch}) must split evenly over {world_size} processes")
    local = batch // world_size
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for step in range(steps):
        x, y = global_batch(step, batch)
        x = x[rank * local:(rank + 1) * local].to(device).contiguous(memory_format=torch.channels_last)
        y = y[rank * local:(rank + 1) * local].to(device).contiguous(memory_format=torch.channels_last)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # DDP all-reduces (averages) the gradients here
        optimizer.step()
        reported = loss.detach().clone()
        if world_size > 1:
            dist.all_reduce(reported)
            reported /= world_size
        losses.append(reported.item())
        if log:
            log(step, losses[-1])
    return losses


# ---------------------------------------------------------------------------
# One process, or several under DistributedDataParallel


def _strict_float32(torch):
    """TF32 off (float32 means float32); returns the previous settings."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    return saved


def train_single(steps=30, batch=32, device="cuda:0", *, convert=None):
    """Train in this process on one device; returns the per-step losses.  Leaves
    torch's TF32 settings and current device as it found them."""
    import contextlib

    import torch

    device = torch.device(device)
    convert = device.type == "cuda" if convert is None else convert
    saved = _strict_float32(torch)
    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            model = prepare(build_model(), device, convert=convert)
            return train(model, device, steps, batch)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _ddp_worker(rank, world_size, port, steps, batch, device_type, convert, result_path):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    _strict_float32(torch)
    if device_type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)  # this rank's arrays (and cupy-dwgn's kernels) live on cuda:rank
        backend = "nccl"
        dist.init_process_group(backend, rank=rank, world_size=world_size, device_id=device, timeout=TIMEOUT)
    else:
        device = torch.device("cpu")
        backend = "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=TIMEOUT)
    try:
        model = prepare(build_model(), device, convert=convert)
        ddp = DistributedDataParallel(model, device_ids=[rank] if device_type == "cuda" else None)
        losses = train(ddp, device, steps, batch, rank=rank, world_size=world_size)
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump({"losses": losses, "backend": backend, "world_size": world_size}, f)
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_ddp(world_size=2, steps=30, batch=32, *, device_type="cuda", convert=None):
    """Train under DistributedDataParallel in ``world_size`` new processes (one per GPU,
    NCCL; or gloo on the CPU); returns the per-step losses of the global batch."""
    import torch.multiprocessing as mp

    convert = device_type == "cuda" if convert is None else convert
    # NVLink SHARP (multicast) buys nothing for this tiny all-reduce; keep it off.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "losses.json")
        mp.spawn(_ddp_worker, args=(world_size, free_port(), steps, batch, device_type, convert, result_path),
                 nprocs=world_size, join=True)
        with open(result_path) as f:
            return json.load(f)["losses"]


# ---------------------------------------------------------------------------
# Checks


def loss_fell(losses, factor=FALL_FACTOR):
    """The mean of the last 3 losses is below ``factor`` times the first loss."""
    tail = losses[-3:]
    return len(losses) >= 2 and sum(tail) / len(tail) < factor * losses[0]


def max_relative_difference(a, b):
    """max over steps of |a - b| / |b|."""
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2, help="processes for the DDP run (default 2, at most the GPUs there)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32, help="global batch (split over the processes)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: gloo instead of NCCL (checks the training code without a GPU)")
    parser.add_argument("--layers", choices=("cupy_dwgn", "torch"),
                        help="cupy_dwgn: the converted model (default on cuda); torch: torch's own layers "
                             "(default on cpu, where the bridge runs the slow float64 NumPy references)")
    args = parser.parse_args(argv)

    torch = need_torch()
    if args.device == "cuda":
        count = gpu_or_exit()
        count = min(count, torch.cuda.device_count())
        if count == 0:
            sys.exit("Cannot run this example: PyTorch sees no CUDA GPU (a CPU-only torch build?): "
                     "pip install torch with CUDA support; `nvidia-smi` shows the driver")
        world_size = max(1, min(args.gpus, count))
        if world_size < args.gpus:
            print(f"note: {count} GPU(s) visible: the DDP run uses {world_size} process(es)")
        import cupy_dwgn

        print(f"cupy-dwgn {cupy_dwgn.__version__}, torch {torch.__version__}, {count} GPU(s): "
              f"{torch.cuda.get_device_name(0)}")
        names = ("DDP", "single-GPU")
    else:
        world_size = max(1, args.gpus)
        print(f"CPU run (gloo), torch {torch.__version__}")
        names = ("DDP", "single-process")
    convert = (args.layers or ("cupy_dwgn" if args.device == "cuda" else "torch")) == "cupy_dwgn"
    if not convert:
        print("layers: torch's own (not converted)")

    model = build_model()
    if convert:
        import cupy_dwgn.torch as dwt

        model = dwt.convert(model)
        depthwise = sum(isinstance(m, dwt.DepthwiseConv2d) for m in model.modules())
        norms = [m for m in model.modules() if isinstance(m, dwt.GroupNorm)]
        fused = sum(m.activation != "identity" for m in norms)
        print(f"converted: {depthwise} depthwise convs, {len(norms)} GroupNorms ({fused} with the SiLU fused)")
    print(f"model: {sum(p.numel() for p in model.parameters())} parameters; global batch {args.batch} x "
          f"{IN_CHANNELS}x{IMAGE}x{IMAGE}, {args.steps} steps of SGD(lr={LR}, momentum={MOMENTUM}), float32, channels_last")
    del model

    print(f"\n{names[0]}: {world_size} process(es) x batch {args.batch // world_size} "
          f"({'NCCL, cuda:0..' + str(world_size - 1) if args.device == 'cuda' else 'gloo, CPU'})", flush=True)
    ddp_losses = train_ddp(world_size, args.steps, args.batch, device_type=args.device, convert=convert)
    print(f"{names[1]}: 1 process x batch {args.batch}", flush=True)
    single_losses = train_single(args.steps, args.batch, "cuda:0" if args.device == "cuda" else "cpu", convert=convert)

    print(f"\n{'step':>4} {names[0] + ' loss':>16} {names[1] + ' loss':>20} {'rel. diff':>10}")
    for step, (a, b) in enumerate(zip(ddp_losses, single_losses)):
        print(f"{step:4d} {a:16.6f} {b:20.6f} {abs(a - b) / abs(b):10.1e}")
    difference = max_relative_difference(ddp_losses, single_losses)
    fell = {name: loss_fell(losses) for name, losses in zip(names, (ddp_losses, single_losses))}
    print(f"\nloss {ddp_losses[0]:.4f} -> {ddp_losses[-1]:.4f} ({names[0]}), "
          f"{single_losses[0]:.4f} -> {single_losses[-1]:.4f} ({names[1]})")
    print(f"max relative error of the {names[0]} loss vs the {names[1]} loss: {difference:.2e} "
          f"(tolerance {LOSS_RTOL:g})")
    failures = [f"{name} loss did not fall below {FALL_FACTOR:g}x its start" for name, ok in fell.items() if not ok]
    if not difference <= LOSS_RTOL:
        failures.append(f"the loss curves differ by {difference:.2e} > {LOSS_RTOL:g}")
    for failure in failures:
        print(f"FAILED: {failure}")
    if not failures:
        print("OK: both losses fell and the curves agree")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
