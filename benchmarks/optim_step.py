"""The optimiser's share of a training step: AdamW's ``step()`` and ``clip_grad_norm`` on the benchmark
suite's GPT shapes, three ways: the per-parameter loop on the reference ops (what the optimiser was
before flat buffers), the per-parameter loop with fast paths, and over flat buffers
(:mod:`npformer.nn.flat`) with fast paths.

    python benchmarks/optim_step.py [--models gpt-small,gpt-medium] [--backend numpy|cupy]
                                    [--repeats 30] [--out FILE.json]

For each model (float32, random gradients of the right shapes, weight decay 0.1) the three
optimisers first take one clipped step from the same state and must agree exactly (the update is
element-wise; the norms, summed in float64 in different orders, to 1e-12); then each is timed
(warm-up, the median of repeats with quartiles). Also counted: calls of the update op
(``adam_update``) and of ``sum_of_squares`` per clipped step; each call is one launch of the
fused kernel on CuPy, and about 14 array operations (``adam_update``) or 3 per 1M-element chunk
(``sum_of_squares``) on the reference ops. No PyTorch.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import numpy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from npformer.bench.harness import settle, time_call  # noqa: E402
from npformer.bench.steps import MODELS  # noqa: E402

BLOCK_SIZE = 128


def _setup(backend: str, m, flat: bool):
    from npformer.backend import to_device
    from npformer.models.gpt import GPT, GPTConfig
    from npformer.training.optim import AdamW
    model = GPT(GPTConfig(m.V, BLOCK_SIZE, m.L, m.H, m.d, m.F, 0.1, "gelu", norm_first=True,
                          tie_embeddings=True), dtype=numpy.float32, backend=backend, rng=0)
    if flat:
        from npformer.nn.flat import flatten_parameters
        flatten_parameters(model)
    rng = numpy.random.default_rng(1)
    for p in model.parameters():                         # the gradients a backward would accumulate
        p.accumulate(to_device(rng.standard_normal(p.shape).astype(numpy.float32), backend))
    return model, AdamW(model.named_parameters(), lr=3e-4, weight_decay=0.1)


def _counted(fn):
    """Run fn() once, counting calls of the update op and of sum_of_squares."""
    from npformer.training import amp, optim
    counts = {"adam_update": 0, "sum_of_squares": 0}
    saved = {(mod, name): getattr(mod, name) for mod in (optim, amp) for name in counts if hasattr(mod, name)}

    def wrap(name, f):
        def counting(*a, **k):
            counts[name] += 1
            return f(*a, **k)
        return counting
    try:
        for (mod, name), f in saved.items():
            setattr(mod, name, wrap(name, f))
        fn()
    finally:
        for (mod, name), f in saved.items():
            setattr(mod, name, f)
    return counts


PATHS = (   # (label, flattened model, fast paths on)
    ("per-parameter, reference ops", False, False),      # the plain loop: what the optimiser was
    ("per-parameter", False, True),
    ("flat", True, True),
)


def run(models: list[str], backend: str, repeats: int) -> list[dict]:
    from npformer import kernels
    from npformer.backend import get_backend, to_numpy
    from npformer.training.optim import clip_grad_norm
    xp = get_backend(backend)
    sync = (lambda: xp.cuda.Device().synchronize()) if backend == "cupy" else (lambda: None)
    rows = []
    for name in models:
        m = MODELS[name]
        setups = [(label, fast, _setup(backend, m, flat)) for label, flat, fast in PATHS]
        with kernels.disabled():
            norm = clip_grad_norm(setups[0][2][0].parameters(), float("inf"))
        max_norm = norm / 2          # the first clip scales by 1/2, later ones by 1 - 1e-6: always a scaling
        counts = {}
        for label, fast, (model, opt) in setups:
            with _paths(kernels, fast):
                other = clip_grad_norm(model.parameters(), float("inf"))
                assert abs(other - norm) <= 1e-12 * norm, f"{name}, {label}: norm {other} against {norm}"
                counts[label] = _counted(lambda: (clip_grad_norm(model.parameters(), max_norm), opt.step()))
        ref = [to_numpy(p.data) for p in setups[0][2][0].parameters()]
        for label, _, (model, _) in setups[1:]:
            for a, b in zip(ref, model.parameters()):
                assert numpy.array_equal(a, to_numpy(b.data)), f"{name}: {label} disagrees with the reference"
        for label, fast, (model, opt) in setups:
            settle(0.2)
            with _paths(kernels, fast):
                t_step = time_call(opt.step, sync, warmup=3, repeats=repeats, budget_s=20.0, warmup_s=0.5)
                t_clip = time_call(lambda: clip_grad_norm(model.parameters(), max_norm), sync, warmup=3,
                                   repeats=repeats, budget_s=20.0, warmup_s=0.5)
            rows.append({"model": name, "backend": backend, "path": label, "parameters": model.num_parameters(),
                         "tensors": len(list(model.parameters())), "step": t_step, "clip": t_clip,
                         "calls_per_step": counts[label]})
    return rows


def _paths(kernels, fast: bool):
    return contextlib.nullcontext() if fast else kernels.disabled()


def table(rows: list[dict]) -> str:
    out = ["| model | params | path | AdamW step ms (q1-q3) | clip ms (q1-q3) | adam_update / sum_of_squares calls "
           "| step speed-up | clip speed-up |", "|---|---|---|---|---|---|---|---|"]
    base = {}
    for r in rows:
        b = base.setdefault((r["model"], r["backend"]), r)          # the first path of each model
        s, c = r["step"], r["clip"]
        out.append(f"| {r['model']} ({r['backend']}) | {r['parameters'] / 1e6:.1f}M in {r['tensors']} | {r['path']} "
                   f"| {s['ms']:.2f} ({s['q1_ms']:.2f}-{s['q3_ms']:.2f}) "
                   f"| {c['ms']:.2f} ({c['q1_ms']:.2f}-{c['q3_ms']:.2f}) "
                   f"| {r['calls_per_step']['adam_update']} / {r['calls_per_step']['sum_of_squares']} "
                   f"| {b['step']['ms'] / s['ms']:.2f}x | {b['clip']['ms'] / c['ms']:.2f}x |")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt-small,gpt-medium")
    ap.add_argument("--backend", default="numpy", choices=["numpy", "cupy"])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    rows = run(args.models.split(","), args.backend, args.repeats)
    print(table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
