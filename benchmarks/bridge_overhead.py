"""Host cost of a training call through the PyTorch bridge: forward + backward through autograd
of cupy_dwgn.torch's DepthwiseConv2d / GroupNorm against torch's own nn.Conv2d(groups=C) /
nn.GroupNorm + SiLU, on tiny channels_last tensors (so the GPU finishes long before the host issues
the next call: the time per iteration is the host's), and a cProfile of ours so the slow steps
have names.  What a training step of a small-layer model (MobileNet, EfficientNet) pays per layer
on top of the kernels (results/models_*: a host-bound step shows GPU time above its kernel time).

    PYTHONPATH=.:benchmarks python benchmarks/bridge_overhead.py [--iterations 300] [--profile]
        [--modes float32 bfloat16-autocast]
"""
import argparse
import cProfile
import contextlib
import copy
import io
import pstats
import statistics
import time


def _layers(torch, dwt, device):
    """name -> (torch module, converted module, input shape)."""
    nn = torch.nn
    torch.manual_seed(0)
    conv = nn.Conv2d(32, 32, 3, padding=1, groups=32, bias=False).to(device)
    conv_s2 = nn.Conv2d(32, 32, 3, stride=2, padding=1, groups=32, bias=False).to(device)
    norm = nn.Sequential(nn.GroupNorm(8, 32), nn.SiLU()).to(device)
    return {
        "depthwise 3x3": (conv, dwt.convert(copy.deepcopy(conv)), (2, 32, 8, 8)),
        "depthwise 3x3 stride 2": (conv_s2, dwt.convert(copy.deepcopy(conv_s2)), (2, 32, 8, 8)),
        "group_norm + silu": (norm, dwt.convert(copy.deepcopy(norm)), (2, 32, 8, 8)),
    }


def _iteration(module, x, grad, autocast):
    def run():
        with autocast():
            y = module(x)
        y.backward(grad.to(y.dtype))
    return run


def _time_us(torch, run, iterations):
    """Median over 5 repeats of the time per iteration of ``iterations`` calls, synchronized
    once at the end of each repeat."""
    for _ in range(20):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iterations):
            run()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / iterations * 1e6)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--modes", nargs="+", choices=("float32", "bfloat16-autocast"),
                        default=["float32", "bfloat16-autocast"])
    parser.add_argument("--profile", action="store_true", help="print a cProfile of each of our training calls")
    args = parser.parse_args()

    import torch

    import cupy_dwgn.torch as dwt

    device = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}; host us per forward + backward "
          f"(tiny channels_last tensors, x and parameters requiring grad)")
    for mode in args.modes:
        def autocast():
            if mode == "bfloat16-autocast":
                return torch.autocast("cuda", dtype=torch.bfloat16)
            return contextlib.nullcontext()

        for name, (theirs, ours, shape) in _layers(torch, dwt, device).items():
            x = torch.randn(shape, device=device).to(memory_format=torch.channels_last).requires_grad_(True)
            with torch.no_grad(), autocast():
                out_shape = theirs(x).shape
            grad = torch.randn(out_shape, device=device).to(memory_format=torch.channels_last)
            torch_us = _time_us(torch, _iteration(theirs, x, grad, autocast), args.iterations)
            run = _iteration(ours, x, grad, autocast)
            ours_us = _time_us(torch, run, args.iterations)
            print(f"{mode:18} {name:24} torch {torch_us:7.1f}  ours {ours_us:7.1f}  (+{ours_us - torch_us:.1f})",
                  flush=True)
            if args.profile:
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(args.iterations):
                    run()
                torch.cuda.synchronize()
                profiler.disable()
                text = io.StringIO()
                stats = pstats.Stats(profiler, stream=text)
                stats.sort_stats("tottime").print_stats(22)
                print("\n".join(line for line in text.getvalue().splitlines()[6:] if line.strip()), flush=True)


if __name__ == "__main__":
    main()
