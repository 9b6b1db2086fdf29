"""What a mixed-precision GPT step keeps in memory, counted on the CPU: the arrays held from the forward
for the backward, by op and dtype, and the training state per parameter, npformer beside PyTorch.

    python benchmarks/saved_memory.py [--model gpt2-124m] [--precision float16|bfloat16] [--seq 128]
                                      [--dropout 0.1] [--no-torch]

A GPU step's peak is its training state (weights, gradients, optimiser moments) plus what the forward
keeps for the backward; both can be counted without a GPU, since they are what the model and the
optimiser allocate, not how fast. Issue 43 asks for the float16 step's peak at or below PyTorch's (on
an H200, 2026-11-28: 7948 MB against 6762), and for float32 not kept where float16 serves.

* Kept for the backward, npformer: the model of ``--model``'s widths with two layers, rounded to
  ``--precision`` by ``MixedPrecision``, runs its forward (``GPT.hidden``: the trainers take the head
  and the loss together in chunks, holding no (B, T, V) logits) on one sequence of ``--seq`` tokens,
  with the reference ops (``npformer.kernels.disabled()``) and flash attention (what a GPU runs: its
  cache is O(T)), the caches then taken as the CUDA fast paths keep them (the same arrays, as their
  docstrings say, but for the dropouts of the GELU feed-forward block and of each layer's two residual
  sums, whose fused kernels keep the mask's seed, two float64 draws, where the reference keeps the mask
  as booleans: ``_as_the_gpu_keeps``). Every array in every module's cache is counted once (views
  count their whole base array; the weights not at all).
* PyTorch: the benchmark suite's nanoGPT-structured model (``benchmarks/torch_reference.GPT``) with the
  same widths, layers and dropouts under ``torch.autocast("cpu", dtype)``, its saved tensors recorded
  by ``torch.autograd.graph.saved_tensors_hooks`` (each storage once; the float32 weights not, their
  16-bit copies made by autocast yes). SDPA's own dropout is off on both sides: with it PyTorch's CPU
  SDPA falls back to the math path and keeps the (T, T) weights, which no GPU flash kernel does
  (npformer's flash dropout keeps nothing either: a hash of the element's index).
* Everything kept scales with B T (flash attention's cache too), so the per-layer figures are scaled
  from ``--seq`` tokens to the model's B T; the logits of PyTorch's head (B, T, V) are shown apart.
* Training state in bytes per parameter, from the arrays after one optimiser step: npformer's flat
  buffers (16-bit weights and gradients, float32 masters, AdamW's two moments; until 2026-11-29 also
  a float32 copy of the gradients, 4 bytes a parameter) against PyTorch's (float32 weights and
  gradients, AdamW's moments), and both in MB at the model's parameter count.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

import numpy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from npformer import kernels                                          # noqa: E402
from npformer.bench.steps import MODELS                               # noqa: E402

MB = 1e6
LAYERS = 2              # built: layer 0 gives the per-layer figures


def _owner(a):
    """The array that owns ``a``'s memory (``a`` itself, or the base of a view)."""
    while isinstance(a.base, numpy.ndarray):
        a = a.base
    return a


def _arrays(obj, path: str):
    """(path, array) for every NumPy array inside a cache (tuples, named tuples, lists, dicts)."""
    if isinstance(obj, numpy.ndarray):
        yield path, obj
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        for name, value in zip(obj._fields, obj):
            yield from _arrays(value, f"{path}.{name}")
    elif isinstance(obj, (tuple, list)):
        for i, value in enumerate(obj):
            yield from _arrays(value, f"{path}.{i}")
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _arrays(value, f"{path}.{key}")


def _where(name: str) -> str:
    """'layers.0.self_attn' -> 'layer', anything else ('ln_f', 'wte') -> 'outside the layers'."""
    return "layer" if name.startswith("layers.0") else "outside" if not name.startswith("layers.") else "other layers"


def _as_the_gpu_keeps(cache, residual_dropout: bool, p: float):
    """``cache`` as the CUDA fast paths keep it: a GELU feed-forward block's dropout (fused with bias
    and GELU) and a layer's residual dropouts (fused with the sum and the layer norm) keep their mask as
    its seed (``DropoutCache.of_seed``: npformer/kernels/cuda/activations.py, residual.py), where the
    reference ops run here keep it as booleans; every other cache is the reference's."""
    from npformer.ops.dropout import DropoutCache
    from npformer.ops.feedforward import FeedForwardCache

    def seeded(drop):
        return drop if not drop.dropped else DropoutCache(None, drop.scale, drop.x_shape, drop.x_dtype,
                                                          numpy.zeros(2), p)
    if isinstance(cache, FeedForwardCache):
        return cache._replace(drop=seeded(cache.drop))
    if residual_dropout and isinstance(cache, DropoutCache):
        return seeded(cache)
    return cache


def npformer_kept(m, precision: str, T: int, dropout: float) -> Counter:
    """{(where, what, dtype): bytes} kept by npformer's forward for the backward at one sequence of T."""
    from npformer.models.gpt import GPT, GPTConfig
    from npformer.nn.attention import MultiheadAttention
    from npformer.nn.dropout import Dropout
    from npformer.nn.transformer import TransformerDecoderLayer, TransformerEncoderLayer
    from npformer.training.amp import MixedPrecision
    model = GPT(GPTConfig(m.V, T, LAYERS, m.H, m.d, m.F, dropout, "gelu", norm_first=True, tie_embeddings=True),
                dtype=numpy.float32, backend="numpy", rng=0)
    for module in model.modules():
        if isinstance(module, MultiheadAttention):
            module.attention = "flash"                  # what a GPU runs (auto picks flash on CuPy)
    MixedPrecision(model, precision)
    weights = {id(_owner(p.data)) for p in model.parameters()}
    idx = numpy.random.default_rng(0).integers(0, m.V, (1, T))
    with kernels.disabled():
        model.hidden(idx)
    kept, seen = Counter(), set(weights)
    layer_types = (TransformerEncoderLayer, TransformerDecoderLayer)
    layers = [layer for layer in model.modules() if isinstance(layer, layer_types)]
    residual = {id(d) for layer in layers for d in vars(layer).values() if isinstance(d, Dropout)}   # fused_layers.py's
    for name, module in model.named_modules():
        for cache in module._saved:
            cache = _as_the_gpu_keeps(cache, id(module) in residual, dropout)
            for path, a in _arrays(cache, ""):
                owner = _owner(a)
                if id(owner) in seen or owner.nbytes == 0:
                    continue
                seen.add(id(owner))
                what = f"{name.split('.')[-1] if name else 'model'}{path}"
                kept[_where(name), what, str(a.dtype)] += owner.nbytes
    model.clear_saved()
    return kept


def torch_kept(m, precision: str, T: int, dropout: float) -> Counter:
    """{(where, what, dtype): bytes} of the tensors PyTorch's autograd saves, forward and loss, at one
    sequence of T (the head's logits under 'head')."""
    import torch
    from benchmarks.torch_reference import GPT as TorchGPT
    torch.manual_seed(0)
    model = TorchGPT(m.d, m.H, LAYERS, m.F, m.V, T, dropout).train()
    for layer in model.layers:
        layer.self_attn.p = 0.0                         # see the module docstring
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    current, kept, seen = ["model"], Counter(), set(params)
    for name, module in model.named_modules():
        module.register_forward_pre_hook(lambda mod, args, name=name: current.append(name or "model"))
        module.register_forward_hook(lambda mod, args, out: current.pop() and None)   # None: keep the output

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            name = current[-1]
            shape = ", ".join("T" if n == T else str(n) for n in t.shape)   # the same key at T and 2 T
            kept[_where(name), f"{name.split('.')[-1]} ({shape})", str(t.dtype).replace("torch.", "")] \
                += storage.nbytes()
        return t

    idx = torch.randint(0, m.V, (1, T), generator=torch.Generator().manual_seed(0))
    dtype = getattr(torch, precision)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=dtype):
        logits = model(idx)
        current.append("head")                          # the loss's own saves (float32 log-probabilities)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, m.V), idx.reshape(-1))
    loss.backward()
    return kept


def training_state(m, precision: str) -> dict:
    """Bytes per parameter of each library's training state after one AdamW step (a one-layer model
    of the widths; the ratios do not depend on the size)."""
    from npformer.models.gpt import GPT, GPTConfig
    from npformer.nn.flat import flat_parameters, flatten_parameters
    from npformer.training.amp import MixedPrecision
    from npformer.training.optim import AdamW
    T = 8
    model = GPT(GPTConfig(m.V, T, 1, m.H, m.d, m.F, 0.0, "gelu", norm_first=True, tie_embeddings=True),
                dtype=numpy.float32, backend="numpy", rng=0)
    flatten_parameters(model)
    amp = MixedPrecision(model, precision)
    opt = AdamW(amp.named_parameters(), lr=3e-4)
    idx = numpy.random.default_rng(0).integers(0, m.V, (1, T))
    model.backward_hidden(model.head.cross_entropy(model.hidden(idx), idx, dloss=amp.scaled_dloss()).dx)
    state, model_grads = Counter(), [b.grad for b in flat_parameters(model).buffers]
    for buffer in flat_parameters(model).buffers:
        state["model weights", str(buffer.data.dtype)] += buffer.data.nbytes
        state["model gradients", str(buffer.grad.dtype)] += buffer.grad.nbytes
    amp.step(opt)
    for buffer in amp._flat.buffers:
        state["float32 masters", str(buffer.data.dtype)] += buffer.data.nbytes
        if not any(buffer.grad is g for g in model_grads):       # (since 2026-11-29 they are the model's)
            state["masters' gradients", str(buffer.grad.dtype)] += buffer.grad.nbytes
    for run in opt._flat.buffers.values():
        for name, array in run[2].items():
            state[f"AdamW {name}", str(array.dtype)] += array.nbytes
    n = sum(p.size for p in amp.parameters())
    return {key: value / n for key, value in state.items()}


def parameter_count(m) -> int:
    """The parameters of the model of ``m``'s widths and layers (tied head), from one- and two-layer
    models: P(L) = P(1) + (L - 1) (P(2) - P(1))."""
    from npformer.models.gpt import GPT, GPTConfig
    counts = [sum(p.size for p in GPT(GPTConfig(m.V, m.T, layers, m.H, m.d, m.F, 0.0, "gelu", norm_first=True,
                                                tie_embeddings=True), dtype=numpy.float32, backend="numpy",
                                      rng=0).parameters())
              for layers in (1, 2)]
    return counts[0] + (m.L - 1) * (counts[1] - counts[0])


def _table(rows: list, header: tuple) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def split_by_tokens(count, m, precision: str, T: int, dropout: float) -> tuple[Counter, Counter]:
    """(per token, fixed) bytes of ``count`` (npformer_kept or torch_kept), from one sequence of T and
    one of 2 T: what grows with the tokens (activations) and what does not (PyTorch's 16-bit copies of
    the weights, which autocast keeps for the backward)."""
    one, two = count(m, precision, T, dropout), count(m, precision, 2 * T, dropout)
    per_token, fixed = Counter(), Counter()
    for key in set(one) | set(two):
        grows = two[key] - one[key]
        if grows:
            per_token[key] = grows / T
        if 2 * one[key] - two[key]:
            fixed[key] = 2 * one[key] - two[key]
    return per_token, fixed


def report(m, precision: str, T: int, dropout: float, with_torch: bool) -> str:
    tokens = m.B * m.T
    sides = {"npformer": split_by_tokens(npformer_kept, m, precision, T, dropout)}
    if with_torch:
        sides["PyTorch"] = split_by_tokens(torch_kept, m, precision, T, dropout)
    out = [(f"{m.kind} d={m.d} H={m.H} F={m.F} V={m.V}, {precision} mixed precision, dropout {dropout}; "
            f"counted at B=1 T={T} and T={2 * T}, the part that grows with the tokens scaled to "
            f"B={m.B} T={m.T} ({tokens} tokens)"), ""]
    totals = {}
    for side, (per_token, fixed) in sides.items():
        rows, per_dtype = [], Counter()
        for (where, what, dtype), n in sorted(per_token.items()):
            if where == "layer":
                rows.append((what, dtype, f"{n * tokens / MB:.1f}"))
                per_dtype[dtype] += n * tokens
        layer = sum(per_dtype.values())
        outside = Counter()
        for (where, what, dtype), n in per_token.items():
            if where == "outside":
                outside["head and loss" if what.startswith("head") else "embeddings and final norm"] += n * tokens
        weights = sum(n for (where, _, _), n in fixed.items() if where == "layer")
        out += [f"### {side}: kept for the backward, one layer, growing with the tokens (MB at {tokens} tokens)", "",
                _table(rows, ("array", "dtype", "MB")), "",
                f"one layer: {layer / MB:.1f} MB ("
                + ", ".join(f"{d} {v / MB:.1f}" for d, v in sorted(per_dtype.items()))
                + f"); {m.L} layers: {m.L * layer / MB:.0f} MB. Outside the layers: "
                + ", ".join(f"{k} {v / MB:.0f} MB" for k, v in sorted(outside.items()))
                + f". Kept whatever the tokens (16-bit copies of the weights): {weights / MB:.1f} MB a layer", ""]
        totals[side] = m.L * (layer + weights) + sum(outside.values())
    state = training_state(m, precision)
    total = sum(state.values())
    n_params = parameter_count(m)
    out += ["### npformer: training state, bytes per parameter", "",
            _table([(k, d, f"{v:.2f}") for (k, d), v in state.items()], ("array", "dtype", "bytes / parameter")),
            "", (f"in all {total:.2f} bytes a parameter; PyTorch's autocast with AdamW keeps float32 weights, "
                 "float32 gradients and two float32 moments: 16 bytes a parameter (its 16-bit copies of the weights "
                 "are counted above, among what it keeps for the backward)"), "",
            "### In all, kept for the backward: " + "; ".join(f"{side} {v / MB:.0f} MB" for side, v in totals.items()),
            "",
            f"### Training state at {n_params / 1e6:.1f}M parameters: npformer {total * n_params / MB:.0f} MB, "
            f"PyTorch {16 * n_params / MB:.0f} MB", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-124m", choices=[k for k, v in MODELS.items() if v.kind == "gpt"])
    ap.add_argument("--precision", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--seq", type=int, default=128, help="tokens of the counted sequence (default 128)")
    ap.add_argument("--dropout", type=float, default=None, help="dropout (default: the model's)")
    ap.add_argument("--no-torch", action="store_true", help="npformer alone (PyTorch is optional)")
    args = ap.parse_args(argv)
    m = MODELS[args.model]
    if m.B is None:
        m = type(m)(**{**m.__dict__, "B": 8, "T": 128})
    with_torch = not args.no_torch
    if with_torch:
        try:
            import torch  # noqa: F401
        except ImportError:
            print("PyTorch is not installed: npformer alone (--no-torch)", file=sys.stderr)
            with_torch = False
    print(report(m, args.precision, args.seq, m.dropout if args.dropout is None else args.dropout, with_torch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
