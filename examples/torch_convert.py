"""Swap the depthwise convolutions and GroupNorms of a PyTorch model for cupy-dwgn's,
check that the outputs match, and train the converted model for 3 steps next to
the original.

    python examples/torch_convert.py

On a machine with an NVIDIA GPU the model runs on cupy-dwgn's CUDA kernels
(channels_last, so the depthwise convolutions take the NHWC kernels and the
GroupNorms run zero-copy).  Without one it runs on the CPU, where
cupy_dwgn.torch uses the float64 NumPy references (slow; the same code path
the CPU tests use).
"""

import copy
import sys


def torch_and_device():
    """(torch, "cuda" or "cpu"), or exit with a plain explanation without PyTorch."""
    try:
        import torch
    except ImportError:
        sys.exit("Cannot run this example: PyTorch is not installed (pip install torch)")
    import cupy_dwgn

    count, reason = cupy_dwgn.gpu_status()
    if count and torch.cuda.is_available():
        return torch, "cuda"
    print(
        f"No GPU: {reason}\n"
        "Running this example on the CPU instead (cupy_dwgn.torch runs the float64 NumPy references there).",
        file=sys.stderr,
    )
    return torch, "cpu"


def main():
    torch, device = torch_and_device()
    from torch import nn
    from torch.nn import functional as F

    import cupy_dwgn.torch as dwt

    on_gpu = device == "cuda"
    print(f"device: {device} ({'cupy-dwgn CUDA kernels' if on_gpu else 'float64 NumPy references on the CPU'})")
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(16, 16, 3, padding=1, groups=16),           # depthwise 3x3
        nn.GroupNorm(4, 16),
        nn.SiLU(),                                            # fused into the GroupNorm
        nn.Conv2d(16, 32, 1),                                 # pointwise: stays PyTorch's
        nn.Conv2d(32, 64, 5, stride=2, padding=2, groups=32),  # depthwise 5x5, multiplier 2
        nn.GroupNorm(8, 64),
        nn.GELU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    ).to(device).to(memory_format=torch.channels_last)
    converted = dwt.convert(copy.deepcopy(model))
    print(converted)

    size = 32 if on_gpu else 16
    x = torch.randn(8, 16, size, size, device=device).to(memory_format=torch.channels_last)
    target = torch.randint(0, 10, (8,), device=device)
    with torch.no_grad():
        ref, out = model(x), converted(x)
    error = float((out - ref).norm() / ref.norm())
    print(f"relative error of the converted model's output vs PyTorch's: {error:.2e}")

    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, converted)]
    print("step   loss (PyTorch)   loss (cupy-dwgn)")
    for step in range(3):
        losses = []
        for m, opt in zip((model, converted), optimizers):
            opt.zero_grad()
            loss = F.cross_entropy(m(x), target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        print(f"{step:4d}   {losses[0]:14.6f}   {losses[1]:16.6f}")
    loss_error = abs(losses[1] - losses[0]) / abs(losses[0])
    print(f"relative error of the last loss: {loss_error:.2e}")
    if not (error <= 1e-5 and loss_error <= 1e-4):
        sys.exit("FAILED: the converted model does not match PyTorch's")


if __name__ == "__main__":
    main()
