"""A kernel profile of a training step on the GPU, npformer's beside PyTorch's: the kernels each launches
a step, their GPU time, and the top kernels by time (``benchmarks/gpu_check.sh`` runs it).

    python benchmarks/profile_step.py [--model gpt2-124m,gpt2-124m-fp16] [--batch B] [--seq T] [--compile]
                                      [--out FILE]

The steps are the ones the benchmark suite times (:mod:`npformer.bench.steps`): npformer's zeroes the
gradients, runs the forward, the head and the loss together in chunks of rows, the backward and AdamW over
the flat buffers (mixed precision for the ``-fp16`` and ``-bf16`` models, the forward and backward replayed
from a CUDA graph for the ``-graph`` ones); PyTorch's is ``benchmarks/torch_reference.py``'s, nanoGPT's
structure (one fused QKV linear, ``scaled_dot_product_attention``, fused AdamW; autocast and a GradScaler in
float16), and with ``--compile`` that model under ``torch.compile`` too (compiled before it is profiled).
Each at the model's own B and T (the suite's 8 x 128 where it has none) unless given, the model's dropout
(GPT-2 124M's 0, as nanoGPT pretrains it).

Kernels are counted with PyTorch's profiler, whose CUPTI tracer sees every kernel the process launches,
CuPy's included; copies and fills (``Memcpy``, ``Memset``) are counted apart. Warm-up steps run first (NVRTC
compilation, CuPy's kernel cache and cuBLAS's choices are not profiled). Without PyTorch only npformer's
wall time is reported.
"""
from __future__ import annotations

import argparse
import collections
import gc
import os
import sys
import time

import numpy

DEFAULT_MODELS = "gpt2-124m,gpt2-124m-fp16"
WARMUP = 3
TOP = 25                                   # npformer's kernels listed; PyTorch's: TOP_REFERENCE
TOP_REFERENCE = 10
COPIES = ("Memcpy", "Memset")              # the profiler's names for copies and fills


def _gpu_activities(prof) -> list:
    """(name, microseconds) of each GPU activity the profiler saw."""
    out = []
    for e in prof.events():
        if e.device_type.name == "CUDA":
            out.append((e.name, e.device_time if hasattr(e, "device_time") else e.cuda_time))
    return out


def profile_step(step, sync, device: str = "cuda", warmup: int = WARMUP) -> dict:
    """Run ``step`` ``warmup`` times, time one, then profile one: wall ms, kernels, copies and fills, GPU ms,
    and each kernel's (calls, us) by name (None without PyTorch). On the CPU the profiler traces the CPU's
    ops, and no GPU activity is there to count."""
    for _ in range(warmup):
        step()
    sync()
    t0 = time.perf_counter()
    step()
    sync()
    out = {"wall_ms": (time.perf_counter() - t0) * 1e3, "kernels": None}
    try:
        from torch.profiler import ProfilerActivity, profile as torch_profile
    except ImportError:
        return out
    with torch_profile(activities=[ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU]) as prof:
        step()
        sync()
    by_name = collections.defaultdict(lambda: [0, 0.0])
    copies = 0
    for name, us in _gpu_activities(prof):
        if name.startswith(COPIES):
            copies += 1
            continue
        by_name[name][0] += 1
        by_name[name][1] += us
    out.update(kernels=sum(n for n, _ in by_name.values()), copies=copies,
               gpu_ms=sum(us for _, us in by_name.values()) / 1e3, by_name=dict(by_name))
    return out


def _sides(m, B: int, T: int, compile_: bool, device: str):
    """(label, backend, make_step) for npformer and each PyTorch side that can run on ``device``."""
    from npformer.bench.backends import Backend, reference_backend
    from npformer.bench.steps import _npformer_step
    ids = numpy.random.default_rng(1).integers(1, m.V, (B, T))
    tgt = ids[:, ::-1].copy()
    npf = Backend("cupy" if device == "cuda" else "numpy", 1)
    sides = [("npformer", npf, lambda: _npformer_step(npf, m, ids, tgt))]
    try:
        import benchmarks.torch_reference        # noqa: F401 - registers the PyTorch references
    except ImportError:
        return sides
    for name, label in (("torch", "PyTorch, nanoGPT's structure"), ("torch-compile", "PyTorch, torch.compile")):
        ref = reference_backend(name, device, 1)
        if ref is not None and (name != "torch-compile" or compile_):
            sides.append((label, ref, lambda ref=ref: ref.train_step(m, ids, tgt, m.dropout, m.precision)))
    return sides


def _release(device: str) -> None:
    """Give the GPU memory of the side just profiled back, so the next side starts as alone."""
    gc.collect()
    if device != "cuda":
        return
    import cupy
    cupy.get_default_memory_pool().free_all_blocks()
    try:
        import torch
        torch.cuda.empty_cache()
    except ImportError:
        pass


def profile(model: str, batch: int | None = None, seq: int | None = None, compile_: bool = False,
            device: str = "cuda") -> str:
    """The report of ``model``'s step (a GPT of :data:`npformer.bench.steps.MODELS`) on ``device``; "cpu" runs
    the same steps on NumPy and PyTorch's CPU build, with no kernels to count (how the tests try the steps)."""
    from npformer.backend import get_backend
    from npformer.bench.steps import MODELS, model_batch
    if device == "cuda":
        cp = get_backend("cupy")                     # a clear error where CuPy or a GPU is missing
        where = f"CuPy {cp.__version__} on {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}"
    else:
        where = "the CPU (no kernels to count)"
    m = MODELS[model]
    B, T = model_batch(m)
    B, T = batch or B, seq or T
    sides = _sides(m, B, T, compile_, device)
    precision = {"float32": "float32", "float16": "float16 mixed precision",
                 "bfloat16": "bfloat16 mixed precision"}[m.precision]
    lines = [f"training step, {model} B={B} T={T}, {precision}, dropout {m.dropout:g}"
             + (", npformer's forward and backward from a CUDA graph" if m.graph else "")
             + f"; {where}", "",
             "| side | wall ms | kernels | copies, fills | kernels' GPU ms |", "|---|---|---|---|---|"]
    tops = []
    for label, backend, make in sides:
        step = make()
        r = profile_step(step, backend.sync, device)
        if r["kernels"] is None:
            lines.append(f"| {label} | {r['wall_ms']:.1f} | - | - | - |")
            lines.append("(kernel counts need PyTorch: its profiler's CUPTI tracer counts CuPy's kernels)")
        else:
            lines.append(f"| {label} | {r['wall_ms']:.1f} | {r['kernels']} | {r['copies']} | {r['gpu_ms']:.1f} |")
            if r["kernels"]:
                tops.append((label, r))
        del step
        _release(device)
    for label, r in tops:
        top = TOP if label == "npformer" else TOP_REFERENCE
        lines += ["", f"{label}: the top {top} kernels by GPU time", f"{'calls':>6}  {'ms':>8}  {'%':>5}  kernel"]
        total_us = max(r["gpu_ms"] * 1e3, 1e-9)
        for name, (calls, us) in sorted(r["by_name"].items(), key=lambda kv: -kv[1][1])[:top]:
            lines.append(f"{calls:6d}  {us / 1e3:8.2f}  {100 * us / total_us:5.1f}  {name[:100]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from npformer.bench.steps import MODELS
    ap = argparse.ArgumentParser(prog="profile_step", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODELS,
                    help=f"comma list of the suite's GPT models (default {DEFAULT_MODELS})")
    ap.add_argument("--batch", type=int, default=None, help="B (default: the model's own)")
    ap.add_argument("--seq", type=int, default=None, help="T (default: the model's own)")
    ap.add_argument("--compile", action="store_true", help="also PyTorch's model under torch.compile")
    ap.add_argument("--out", help="also write the report to this file")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: the same steps on NumPy and PyTorch's CPU build, no kernels (a check of the script)")
    args = ap.parse_args(argv)
    models = args.model.split(",")
    gpts = [n for n, m in MODELS.items() if m.kind == "gpt"]
    unknown = [n for n in models if n not in gpts]
    if unknown:
        ap.error(f"--model: expected the suite's GPT models ({', '.join(gpts)}), got {', '.join(unknown)}")
    if (args.batch is not None and args.batch < 1) or (args.seq is not None and args.seq < 1):
        ap.error("--batch and --seq must be >= 1")
    from npformer.errors import BackendUnavailableError
    try:
        report = "\n\n".join(profile(n, args.batch, args.seq, args.compile, args.device) for n in models)
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
