"""Train a converted model of many small layers as CUDA graphs: the eager step of such a model
is bound by the host's time to issue its kernels (each layer's Python and launch cost), and
torch.cuda.make_graphed_callables replays its forward and backward as two graph launches.

    python examples/torch_cuda_graphs.py

A MobileNet-style stack (depthwise 3x3 + GroupNorm/SiLU + pointwise 1x1, channels_last) is
converted with cupy_dwgn.torch.convert, then trained for a few steps twice from the same
weights on the same data: eagerly, and with its forward and backward captured as CUDA graphs
(the loss and the SGD step stay eager).  The two must agree (the same kernels run on the same
data); the script prints both step times, host time to issue a step and GPU time.

Needs an NVIDIA GPU and PyTorch: CUDA graphs have no CPU counterpart.
"""

import copy
import sys
import time


def torch_on_gpu():
    """torch, or exit with a plain explanation without PyTorch or without a usable GPU."""
    try:
        import torch
    except ImportError:
        sys.exit("Cannot run this example: PyTorch is not installed (pip install torch)")
    import cupy_dwgn

    count, reason = cupy_dwgn.gpu_status()
    if not (count and torch.cuda.is_available()):
        sys.exit(f"Cannot run this example: CUDA graphs need an NVIDIA GPU. {reason}")
    return torch


def small_layer_model(nn, channels=32, blocks=12):
    """Depthwise 3x3 -> GroupNorm + SiLU -> pointwise 1x1, ``blocks`` times, then a classifier."""
    layers = [nn.Conv2d(3, channels, 3, padding=1)]
    for _ in range(blocks):
        layers += [
            nn.Conv2d(channels, channels, 3, padding=1, groups=channels, bias=False),  # depthwise
            nn.GroupNorm(8, channels),
            nn.SiLU(),                                                               # fused into the GroupNorm
            nn.Conv2d(channels, channels, 1),                                        # pointwise: PyTorch's
        ]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10)]
    return nn.Sequential(*layers)


def train(torch, forward, model, batches, targets):
    """SGD steps of ``forward`` (the model itself, or its graphed callable) over the batches;
    returns the losses and the median host time to issue a step and GPU time of a step (ms)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, hosts, gpus = [], [], []
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for x, target in zip(batches, targets):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        start.record()
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(forward(x), target)
        loss.backward()
        optimizer.step()
        stop.record()
        hosts.append((time.perf_counter() - begin) * 1e3)
        stop.synchronize()
        gpus.append(start.elapsed_time(stop))
        losses.append(loss.item())
    return losses, sorted(hosts)[len(hosts) // 2], sorted(gpus)[len(gpus) // 2]


def main():
    torch = torch_on_gpu()
    from torch import nn

    import cupy_dwgn.torch as dwt

    torch.backends.cudnn.benchmark = True
    # cuDNN's deterministic algorithms for the dense convolutions (cupy-dwgn's kernels are bit-for-bit
    # reproducible already), so the two trainings can agree to the last bit.
    torch.backends.cudnn.deterministic = True
    torch.manual_seed(0)
    model = dwt.convert(small_layer_model(nn)).cuda().to(memory_format=torch.channels_last)
    eager_model = copy.deepcopy(model)  # the same weights, trained eagerly

    steps = 20
    gen = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randn(16, 3, 32, 32, device="cuda", generator=gen).to(memory_format=torch.channels_last)
               for _ in range(steps)]
    targets = [torch.randint(0, 10, (16,), device="cuda", generator=gen) for _ in range(steps)]

    # Captures the forward and the backward (after a few warm-up passes on a side stream, which
    # leave the parameters and their gradients untouched); replays them on each new batch.
    graphed = torch.cuda.make_graphed_callables(model, (batches[0].clone(),))

    eager_losses, eager_host, eager_gpu = train(torch, eager_model, eager_model, batches, targets)
    graph_losses, graph_host, graph_gpu = train(torch, graphed, model, batches, targets)

    print("step   loss (eager)   loss (CUDA graphs)")
    for step in (0, 1, steps - 1):
        print(f"{step:4d}   {eager_losses[step]:12.6f}   {graph_losses[step]:18.6f}")
    print(f"eager step:       host {eager_host:6.2f} ms to issue, GPU {eager_gpu:6.2f} ms")
    print(f"CUDA-graph step:  host {graph_host:6.2f} ms to issue, GPU {graph_gpu:6.2f} ms")
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    eager_weights = torch.cat([p.detach().flatten() for p in eager_model.parameters()])
    error = float((weights - eager_weights).norm() / eager_weights.norm())
    print(f"relative error of the graph-trained weights vs the eagerly trained ones after {steps} steps: {error:.2e}")
    if not error <= 1e-5:
        sys.exit("FAILED: training with CUDA graphs does not match eager training")


if __name__ == "__main__":
    main()
