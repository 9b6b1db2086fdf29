"""The op cases and the attention sweep: sizes, inputs, FLOP counts, and each computation built
for npformer and for a reference framework from the same host arrays (the reference's by op name:
:class:`~npformer.bench.backends.ReferenceBackend`).

A case is a :class:`Case`: its name, group, sizes and FLOPs, and two functions of a backend ``b``:

* ``build(b)``: ``{pass: call}``, the calls that are timed ("fwd", "bwd"; a model's "step");
* ``outputs(b)``: ``{name: host array}``, what the parity check compares (forward output and
  gradients here; a model's loss and gradients in :mod:`npformer.bench.steps`).

npformer's forward returns ``(y, ..., cache)`` and its backward the gradients for a fixed random
upstream gradient, from the cache of one forward made when the case is built.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy

__all__ = ["Case", "FULL", "QUICK", "FLOPS", "host_normal", "upstream_gradient", "op_cases", "sweep_case",
           "flash_sweep_case", "flash_train_cases", "fits_memory"]


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark case. A misspelt field is a TypeError where the case is made, on every machine."""

    name: str
    group: str                          # "op", "model" or "sweep"
    shape: str                          # the sizes, as the report prints them
    tokens: int                         # tokens per call
    flops: dict                         # {pass: FLOPs per call} (cases.FLOPS says how they are counted)
    build: Callable                     # build(b) -> {pass: call}, the calls timed on backend b
    outputs: Callable                   # outputs(b) -> {name: host array}, what parity compares
    precision: str = "float32"
    gpu_only: bool = False              # skipped on the CPU backends
    parity_skipped: str | None = None   # why parity is not checked (the report prints it), or None
    dims: tuple | None = None           # attention: (B, H, T, hs)
    flash: bool = False                 # attention: npformer's flash op (memory linear in T)
    T: int | None = None                # a sweep case's length, its x axis
    kind: str | None = None             # a model case: "gpt" or "seq2seq"
    graph: bool = False                 # a model case whose npformer step is replayed from a CUDA graph
    family: str | None = None           # a name --only selects with others (flash-train)

FULL = dict(B=8, T=128, d=256, H=8, F=1024, V=512, model_B=8, model_T=128, warmup=2, warmup_s=0.25,
            repeats=10, budget_s=3.0, matmul_n=2048, sweep_B=1, sweep_T=(128, 256, 512, 1024, 2048, 4096, 8192),
            sweep_stop_s=3.0, settle_s=0.3, mem_min_s=0.2)
# warm-up: at least warmup calls and warmup_s seconds; quick's 0.2 s is twice the slow start seen from
# PyTorch right after NumPy ran (8 ms calls of a 0.05 ms op for about 0.1 s on the 2-core machine)
QUICK = dict(B=2, T=64, d=256, H=8, F=1024, V=512, model_B=2, model_T=16, warmup=1, warmup_s=0.2,
             repeats=3, budget_s=0.05, matmul_n=512, sweep_B=1, sweep_T=(64, 128), sweep_stop_s=1.0,
             settle_s=0.12, mem_min_s=0.02)
FLOPS = {
    "matmul": "2 flops per multiply-add; N = B*T tokens, E = B*H*T*T attention scores",
    "linear": "fwd 2*N*d*F, bwd 4*N*d*F (dx and dW)",
    "softmax": "fwd 5 per element (max, subtract, exp, sum, divide), bwd 4 per element",
    "layer_norm": "fwd 8 per element, bwd 12 per element",
    "gelu": "fwd 10 per element (erf counted as 5), bwd 15 per element",
    "attention": "fwd 4*E*hs + 5*E (QK^T, PV, softmax), bwd 8*E*hs + 4*E",
    "flash_attention": "fwd as attention, bwd 10*E*hs + 6*E (S = QK^T and P recomputed per tile)",
    "multi_head": "fwd 8*N*d^2 + 4*E*hs + 5*E (QKV and out projections), bwd twice the matmuls + 4*E",
    "ffn": "fwd 4*N*d*F + 10*N*F, bwd 8*N*d*F + 15*N*F",
    "cross_entropy": "fwd 5 per logit, bwd 3 per logit",
    "dropout": "fwd 2 per element (compare, scale), bwd 1 per element; the random draws not counted",
    "flash-train": "FlashAttention's convention: fwd 4*B*H*T^2*D, halved when causal; bwd 2.5x fwd",
    "train_step": "matmuls only, fwd+bwd = 3x fwd: gpt 6*N*(L*(4d^2+2dF) + V*d) + 12*L*B*T^2*d; "
                  "seq2seq (S=T) 6*(2*N*L*(6d^2+2dF) + N*V*d) + 36*L*B*T^2*d; "
                  "embeddings, element-wise work and AdamW not counted",
}


def host_normal(shape, seed: int) -> numpy.ndarray:
    """Standard normal float32 host array; every input of every case is one of these."""
    return numpy.random.default_rng(seed).standard_normal(shape).astype(numpy.float32)


def upstream_gradient(shape) -> numpy.ndarray:
    """The fixed random ``dy`` every backward gets (1 for a scalar loss)."""
    return host_normal(shape, 9) if shape else numpy.ones((), numpy.float32)


def _npformer_calls(module, op: str, host_inputs: list, dtype: str | None = None, **kw) -> Callable:
    """Builder of ``module.<op>_forward`` / ``<op>_backward`` calls (looked up when built), the
    float32 host inputs cast to ``dtype`` on the device when given."""
    def calls(b):
        fwd, bwd = getattr(module, op + "_forward"), getattr(module, op + "_backward")
        xs = [b.asarray(h, dtype) for h in host_inputs]
        res = fwd(*xs, **kw)
        dy = b.asarray(upstream_gradient(res[0].shape), dtype)          # in the inputs' (and output's) dtype
        return {"fwd": lambda: fwd(*xs, **kw), "bwd": lambda: bwd(dy, res[-1])}
    return calls


def _reference_calls(op: str, host_inputs: list, n_grad: int, dtype: str | None = None) -> Callable:
    """Builder of the reference's ``op``, gradients of the first ``n_grad`` inputs."""
    return lambda b: b.op_calls(op, host_inputs, n_grad, dtype)


def _outputs(b, calls: dict, grad_names: tuple) -> dict:
    """Forward output and named gradients on the host (npformer's ``None`` gradients dropped)."""
    y, grads = calls["fwd"](), calls["bwd"]()
    y = y[0] if isinstance(y, tuple) else y
    grads = [g for g in (grads if isinstance(grads, tuple) else (grads,)) if g is not None]
    return {"out": b.to_host(y), **{n: b.to_host(g) for n, g in zip(grad_names, grads, strict=True)}}


def _op_case(name, shape, flops, tokens, grads, npformer_calls, reference_calls, group="op", **fields) -> Case:
    """A Case of npformer's calls beside the reference's; ``fields``: the Case's optional ones."""
    def build(b):
        return npformer_calls(b) if b.framework == "npformer" else reference_calls(b)
    return Case(name, group, shape, tokens, flops, build, lambda b: _outputs(b, build(b), grads), **fields)


def _multi_head_calls(host_x, num_heads: int, weights: list) -> Callable:
    """npformer's self-attention op (one packed QKV projection), the one place that calls it."""
    def calls(b):
        from npformer.ops import multihead
        x, ws = b.asarray(host_x), [b.asarray(w) for w in weights]

        def fwd():
            return multihead.self_attention_forward(x, num_heads, *ws, need_weights=False)
        out, _, cache = fwd()
        dy = b.asarray(upstream_gradient(out.shape))
        return {"fwd": fwd, "bwd": lambda: multihead.self_attention_backward(dy, cache)}
    return calls


def _attention_case(name, B, H, T, hs, flash=False, group="op", dtype="float32") -> Case:
    from npformer.ops import attention, flash_attention
    qkv = [host_normal((B, H, T, hs), s) for s in (1, 2, 3)]          # float32, cast on the device
    e = B * H * T * T
    bwd = 10 * e * hs + 6 * e if flash else 8 * e * hs + 4 * e        # flash recomputes S = q k^T and P
    op = (flash_attention, "flash_attention") if flash else (attention, "scaled_dot_product_attention")
    half = dtype == "float16"               # the GPU's case: SDPA's flash kernel beside npformer's tensor cores
    return _op_case(name, f"q,k,v ({B}, {H}, {T}, {hs})" + (", 128x128 tiles" if flash else ""),
                    {"fwd": 4 * e * hs + 5 * e, "bwd": bwd}, B * T, ("dq", "dk", "dv"),
                    _npformer_calls(*op, qkv, dtype), _reference_calls("attention", qkv, 3, dtype), group,
                    dims=(B, H, T, hs), flash=flash, precision=dtype, T=T if group == "sweep" else None,
                    gpu_only=half, parity_skipped="skipped: float16 (tests/kernels/cuda checks the kernels "
                                                  "against the reference)" if half else None)


DROPOUT_P = 0.1


def _dropout_outputs(x, out, dy, dx) -> dict:
    """What two dropouts with different generators share: the kept fraction (to 2 decimals: 1M
    draws put it within 0.001 of 1 - p), and the scale 1/(1 - p) of every kept element, forward
    and backward."""
    x, out, dy, dx = (numpy.asarray(a, numpy.float64) for a in (x, out, dy, dx))
    kept = out != 0
    return {"kept_fraction": numpy.round(kept.mean(), 2), "scale": (out[kept] / x[kept]).mean(keepdims=True),
            "grad_scale": (dx[kept] / dy[kept]).mean(keepdims=True)}


def _dropout_case(host_x) -> Case:
    """Dropout (p = 0.1) of a (B, T, F) activation; parity compares what does not depend on the generator."""
    def build(b):
        if b.framework != "npformer":
            return b.dropout_calls(host_x, DROPOUT_P)
        from npformer.backend import default_rng
        from npformer.ops import dropout
        x, rng = b.asarray(host_x), default_rng(0, b.name)
        y, cache = dropout.dropout_forward(x, DROPOUT_P, rng=rng)
        dy = b.asarray(upstream_gradient(tuple(y.shape)))
        return {"fwd": lambda: dropout.dropout_forward(x, DROPOUT_P, rng=rng),
                "bwd": lambda: dropout.dropout_backward(dy, cache), "_probe": (x, y, dy)}

    def outputs(b):
        calls = build(b)
        x, y, dy = calls.pop("_probe")
        dx = calls["bwd"]()
        return _dropout_outputs(b.to_host(x), b.to_host(y), b.to_host(dy), b.to_host(dx))

    def timed(b):
        calls = build(b)
        calls.pop("_probe")
        return calls
    n = host_x.size
    return Case("dropout", "op", f"h {host_x.shape}, p={DROPOUT_P}", n // host_x.shape[-1], {"fwd": 2 * n, "bwd": n},
                timed, outputs)


def op_cases(c: dict) -> list[Case]:
    from npformer.ops import activations, cross_entropy, feedforward, layernorm, linear, softmax
    B, T, d, H, F, V = (c[k] for k in "BTdHFV")
    N, E, hs = B * T, B * H * T * T, d // H
    x, w1, b1 = host_normal((B, T, d), 1), host_normal((F, d), 2) * 0.05, host_normal((F,), 3)
    w2, b2 = host_normal((d, F), 4) * 0.05, host_normal((d,), 5)
    g, beta, s, h = 1 + 0.1 * host_normal((d,), 6), host_normal((d,), 7), host_normal((B, H, T, T), 8), \
        host_normal((B, T, F), 10)
    logits, tgt = host_normal((B, T, V), 11), numpy.random.default_rng(12).integers(0, V, (B, T))
    mha = [host_normal((3 * d, d), 13) * 0.05, host_normal((3 * d,), 14), host_normal((d, d), 15) * 0.05,
           host_normal((d,), 16)]
    return [
        _op_case("linear", f"x ({B}, {T}, {d}) -> {F}", {"fwd": 2 * N * d * F, "bwd": 4 * N * d * F}, N,
                 ("dx", "dweight", "dbias"), _npformer_calls(linear, "linear", [x, w1, b1]),
                 _reference_calls("linear", [x, w1, b1], 3)),
        _op_case("softmax", f"scores ({B}, {H}, {T}, {T})", {"fwd": 5 * E, "bwd": 4 * E}, N, ("dx",),
                 _npformer_calls(softmax, "softmax", [s]), _reference_calls("softmax", [s], 1)),
        _op_case("layer_norm", f"x ({B}, {T}, {d})", {"fwd": 8 * N * d, "bwd": 12 * N * d}, N,
                 ("dx", "dweight", "dbias"), _npformer_calls(layernorm, "layer_norm", [x, g, beta]),
                 _reference_calls("layer_norm", [x, g, beta], 3)),
        _op_case("gelu", f"h ({B}, {T}, {F})", {"fwd": 10 * N * F, "bwd": 15 * N * F}, N, ("dx",),
                 _npformer_calls(activations, "gelu", [h]), _reference_calls("gelu", [h], 1)),
        _attention_case("attention", B, H, T, hs),
        _op_case("multi_head", f"x ({B}, {T}, {d}), {H} heads",
                 {"fwd": 8 * N * d * d + 4 * E * hs + 5 * E, "bwd": 16 * N * d * d + 8 * E * hs + 4 * E}, N,
                 ("dx", "din_proj_weight", "din_proj_bias", "dout_proj_weight", "dout_proj_bias"),
                 _multi_head_calls(x, H, mha), lambda b: b.multi_head_calls(x, H, mha)),
        _op_case("ffn", f"x ({B}, {T}, {d}), F={F}, gelu",
                 {"fwd": 4 * N * d * F + 10 * N * F, "bwd": 8 * N * d * F + 15 * N * F}, N,
                 ("dx", "dw1", "db1", "dw2", "db2"),
                 _npformer_calls(feedforward, "feed_forward", [x, w1, b1, w2, b2], activation="gelu"),
                 _reference_calls("ffn", [x, w1, b1, w2, b2], 5)),
        _op_case("cross_entropy", f"logits ({B}, {T}, {V})", {"fwd": 5 * N * V, "bwd": 3 * N * V}, N,
                 ("dlogits",), _npformer_calls(cross_entropy, "cross_entropy", [logits, tgt]),
                 _reference_calls("cross_entropy", [logits, tgt], 1)),
        _dropout_case(h),
    ]


def sweep_case(c: dict, T: int) -> Case:
    """Plain attention at length T (B = sweep_B): memory quadratic in T. A sweep case (and each of its
    rows) carries ``T``, its length, besides its name."""
    return _attention_case(f"attention T={T}", c["sweep_B"], c["H"], T, c["d"] // c["H"], group="sweep")


def flash_sweep_case(c: dict, T: int, dtype: str = "float32") -> Case:
    """The sweep's attention as FlashAttention tiles (npformer.ops.flash_attention): O(T) memory.
    The torch column is the same ``scaled_dot_product_attention`` call as the plain sweep's (PyTorch
    picks its own fused kernel, a flash kernel on CPU and CUDA where it applies). ``dtype="float16"``:
    the GPU's row (tensor cores on both sides), skipped on the CPU backends."""
    suffix = "" if dtype == "float32" else f" {dtype}"
    return _attention_case(f"flash attention T={T}{suffix}", c["sweep_B"], c["H"], T, c["d"] // c["H"], flash=True,
                           group="sweep", dtype=dtype)


# Flash attention at training shapes (B H >= 32, long T, D 64 and 128, causal or not), on the GPU: today's
# sweep runs B 1, where launch time hides the kernels. FLOPs by FlashAttention's convention (the tables
# of Dao 2023): forward 4 B H T^2 D, halved when causal, backward 2.5 times the forward.
FLASH_TRAIN_SHAPES = ((8, 12, 1024, 64, True), (4, 16, 4096, 64, True), (4, 16, 4096, 64, False),
                      (4, 16, 4096, 128, True), (2, 16, 8192, 64, True))
FLASH_TRAIN = "flash-train"             # --only's name for them all


def _on_wgmma(calls: Callable) -> Callable:
    """``calls`` (a builder of npformer's calls) with the Hopper kernels opted in while each runs
    (flash_attention.use_wgmma): the forward and backward on wgmma on a GPU of compute capability 9.0, the
    dense kernels elsewhere."""
    def opted(fn):
        def run():
            from npformer.kernels.cuda.flash_attention import use_wgmma
            use_wgmma(True)
            try:
                return fn()
            finally:
                use_wgmma(False)
        return run

    def built(b):
        made = opted(lambda: calls(b))()
        return {key: opted(fn) for key, fn in made.items()}
    return built


def flash_train_cases(dtypes=("float16", "bfloat16", "float32")) -> list[Case]:
    """The flash cases at :data:`FLASH_TRAIN_SHAPES`, each in each of ``dtypes`` (float32 runs TF32
    under ``--tf32``), beside the reference's ``scaled_dot_product_attention`` (``is_causal`` alike); float16
    also with the Hopper kernels opted in ("wgmma" in the name; bfloat16's are the same kernels but for their
    products). GPU only, parity left to tests/kernels/cuda (its small shapes)."""
    from npformer.ops import flash_attention
    cases = []
    for B, H, T, D, causal in FLASH_TRAIN_SHAPES:
        forward = 4 * B * H * T * T * D / (2 if causal else 1)
        for dtype, wgmma in [(dt, False) for dt in dtypes] + [(dt, True) for dt in dtypes if dt == "float16"]:
            def qkv(shape=(B, H, T, D)):                     # drawn when a case is built (hundreds of MB)
                return [host_normal(shape, s) for s in (1, 2, 3)]             # float32, cast on the device
            name = f"{FLASH_TRAIN} B{B} H{H} T{T} D{D}{' causal' if causal else ''} {dtype}{' wgmma' if wgmma else ''}"
            kw = {"is_causal": True} if causal else {}
            op = "attention_causal" if causal else "attention"

            def ours(b, qkv=qkv, kw=kw, dtype=dtype):
                return _npformer_calls(flash_attention, "flash_attention", qkv(), dtype, **kw)(b)
            cases.append(_op_case(
                name, f"q,k,v ({B}, {H}, {T}, {D})", {"fwd": forward, "bwd": 2.5 * forward}, B * T, ("dq", "dk", "dv"),
                _on_wgmma(ours) if wgmma else ours,
                lambda b, qkv=qkv, op=op, dtype=dtype: _reference_calls(op, qkv(), 3, dtype)(b), family=FLASH_TRAIN,
                precision=dtype,
                gpu_only=True, parity_skipped="skipped: training shapes (tests/kernels/cuda checks the kernels at "
                                              "small ones)"))
    return cases


def fits_memory(case: Case, b) -> bool:
    """Plain attention holds about six (B, H, T, T) float32 arrays at once; keep that under half
    of the memory available now on ``b``'s device."""
    B, H, T, _ = case.dims
    if case.flash and b.framework == "npformer":
        return True                                       # a few (B, H, 128, 128) tiles and O(T) arrays
    return 6 * B * H * T * T * 4 < b.free_bytes() / 2
