"""A kernel profile of one npformer training step on the GPU: how many kernels it launches, how much
GPU time they take, and the top kernels by time (``benchmarks/gpu_check.sh`` runs it).

    python benchmarks/profile_step.py [--model gpt-small|gpt-medium|gpt2-124m] [--batch 8] [--seq 1024]
                                      [--out FILE]

The step is the benchmark suite's (forward, cross-entropy, backward, AdamW; the model's sizes and dropout from
``npformer.bench.steps.MODELS``: 0.1, 0 for GPT-2 124M as nanoGPT pretrains it) on CuPy.
Kernels are counted with PyTorch's profiler, whose CUPTI tracer sees every kernel the process
launches, CuPy's included; without PyTorch only the wall time is reported. Warm-up steps run first
(NVRTC compilation and CuPy's kernel cache are not profiled).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import numpy

MODELS = ("gpt-small", "gpt-medium", "gpt2-124m")       # the suite's GPT models this profiles


def _step(cp, m, batch: int, seq: int):
    from npformer.models.gpt import GPT, GPTConfig
    from npformer.nn.flat import flatten_parameters
    from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
    from npformer.training.optim import AdamW
    model = GPT(GPTConfig(m.V, seq, m.L, m.H, m.d, m.F, m.dropout, "gelu_tanh"), dtype="float32",
                backend="cupy", rng=0)
    flatten_parameters(model)                    # as the trainers do: AdamW over whole runs of one buffer
    opt = AdamW(model.parameters(), lr=3e-4)
    ids = cp.asarray(numpy.random.default_rng(1).integers(0, m.V, (batch, seq + 1)))
    x, y = ids[:, :-1], ids[:, 1:]

    def step():
        model.zero_grad()
        loss, cache = cross_entropy_forward(model(x), y)
        model.backward(cross_entropy_backward(cp.ones((), cp.float32), cache))
        opt.step()
    return step


def profile(model: str, batch: int, seq: int, warmup: int = 3) -> str:
    from npformer.backend import get_backend
    cp = get_backend("cupy")                         # a clear error where CuPy or a GPU is missing
    from npformer.bench.steps import MODELS as SPECS
    step = _step(cp, SPECS[model], batch, seq)
    for _ in range(warmup):
        step()
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    step()
    cp.cuda.Device().synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    lines = [f"npformer training step, {model} B={batch} T={seq}, dropout {SPECS[model].dropout:g}, float32, "
             f"CuPy {cp.__version__} on {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}",
             f"wall time {wall_ms:.1f} ms"]
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile as torch_profile
    except ImportError:
        lines.append("kernel count: needs PyTorch (its profiler's CUPTI tracer counts CuPy's kernels)")
        return "\n".join(lines)
    torch.cuda.init()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        cp.cuda.Device().synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    total_us = sum(e.device_time for e in kernels) if kernels and hasattr(kernels[0], "device_time") else \
        sum(e.cuda_time for e in kernels)
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        t = e.device_time if hasattr(e, "device_time") else e.cuda_time
        by_name[e.name][0] += 1
        by_name[e.name][1] += t
    lines.append(f"{len(kernels)} kernels, {total_us / 1e3:.1f} ms of GPU time")
    lines.append(f"{'calls':>6}  {'ms':>8}  {'%':>5}  kernel")
    for name, (calls, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]:
        lines.append(f"{calls:6d}  {us / 1e3:8.2f}  {100 * us / max(total_us, 1e-9):5.1f}  {name[:100]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="profile_step", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2-124m", choices=MODELS)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--out", help="also write the report to this file")
    args = ap.parse_args(argv)
    if args.batch < 1 or args.seq < 1:
        ap.error("--batch and --seq must be >= 1")
    from npformer.errors import BackendUnavailableError
    try:
        report = profile(args.model, args.batch, args.seq)
    except BackendUnavailableError as exc:
        print(f"profile_step: {exc}", file=sys.stderr)
        return 2
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the checkout's npformer
    sys.exit(main())
