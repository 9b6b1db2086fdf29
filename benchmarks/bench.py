"""The CPU-vs-GPU benchmark suite: timing, memory, FLOP counts and reports (issue 5).

``python benchmarks/run.py [--quick] [--backends numpy,cupy,torch] [--out DIR]`` calls :func:`main`.

Every figure is the median of ``repeats`` calls after ``warmup`` calls, with the interquartile
range and min/max; GPU calls synchronise the device before the clock stops. Per row:

    tokens/s   = tokens / median time                 (tokens = B*T, or B*(S+T) for seq2seq)
    GFLOP/s    = flops / median time / 1e9            (flops from the formulas in FLOPS below)
    % peak     = GFLOP/s / float32 n x n matmul GFLOP/s of the same backend in the same run
    vs torch   = npformer time / PyTorch time on the same device (below 1: npformer is faster)
    peak MB    = the most memory a call adds over what was held before it: on CPU the highest
                 RSS sampled while it runs (or VmHWM if higher) minus RSS before, with free heap
                 pages trimmed first; on GPU the CuPy pool's growth / torch.cuda's peak

Host-side code: it may import numpy; torch and cupy are imported only when their backend is asked for.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import re
import threading
import time
from typing import Any, Callable

import numpy


__all__ = ["summarize", "time_call", "Backend", "make_backends", "run_suite", "write_reports", "main"]


def summarize(times_s: list[float]) -> dict:
    """Median, quartiles, min and max of a list of durations (seconds), in milliseconds."""
    ms = numpy.asarray(times_s, dtype=numpy.float64) * 1e3
    q1, med, q3 = numpy.percentile(ms, [25, 50, 75])
    return {"ms": float(med), "q1_ms": float(q1), "q3_ms": float(q3), "min_ms": float(ms.min()),
            "max_ms": float(ms.max()), "repeats": int(ms.size)}


def time_call(fn: Callable[[], Any], sync: Callable[[], None], warmup: int, repeats: int,
              budget_s: float) -> dict:
    """Warm up, then time ``repeats`` calls (fewer, but at least 3, when one call is slow)."""
    t_first = 0.0
    for _ in range(max(warmup, 1)):
        t0 = time.perf_counter()
        fn()
        sync()
        t_first = time.perf_counter() - t0
    n = max(3, min(repeats, int(budget_s / max(t_first, 1e-9))))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return summarize(times)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


def _glibc():
    import ctypes
    return ctypes.CDLL("libc.so.6")


def host_peak_mb(fn: Callable[[], Any], min_s: float = 0.2) -> float | None:
    """Peak resident memory calls of ``fn`` add (MB), or None where /proc cannot tell.

    A thread samples VmRSS while ``fn`` runs (again and again for ``min_s``, so that a short-lived
    peak is likely to be seen); the kernel's own high-water mark (VmHWM, reset first) is taken too
    where it is higher, since it is updated lazily and can miss peaks on its own."""
    try:
        _glibc().malloc_trim(0)                           # free heap pages leave RSS: reuse shows
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                                  # resets VmHWM to the current RSS
        base = _status_kb("VmRSS")
    except OSError:
        return None
    peak, stop = [base], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _status_kb("VmRSS"))
            time.sleep(2e-4)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    try:
        fn()
        while time.perf_counter() - t0 < min_s:
            fn()
    finally:
        stop.set()
        sampler.join()
    return max(peak[0], _status_kb("VmHWM"), base) / 1024.0 - base / 1024.0


class Backend:
    """One column: ``npformer`` on numpy/cupy, or ``torch`` on cpu/cuda."""

    def __init__(self, name: str, threads: int):
        self.name, self.threads = name, threads
        self.framework = "torch" if name.startswith("torch") else "npformer"
        self.device = "cuda" if name in ("cupy", "torch-cuda") else "cpu"
        self.xp = self.torch = None
        if self.framework == "torch":
            import torch
            torch.set_num_threads(threads)
            # The suite is float32 throughout; a caller (a test session) may have changed torch's
            # default dtype, which would build float64 modules beside float32 inputs.
            torch.set_default_dtype(torch.float32)
            self.torch = torch
        else:
            from npformer.backend import get_backend
            self.xp = get_backend(name)

    def sync(self) -> None:
        if self.name == "cupy":
            self.xp.cuda.get_current_stream().synchronize()
        elif self.name == "torch-cuda":
            self.torch.cuda.synchronize()

    def asarray(self, host: numpy.ndarray):
        if self.torch is not None:
            return self.torch.from_numpy(numpy.ascontiguousarray(host)).to(self.device)
        return self.xp.asarray(host)

    def peak_mb(self, fn: Callable[[], Any], min_s: float = 0.2) -> float | None:
        if self.device == "cpu":
            return host_peak_mb(fn, min_s)
        if self.name == "cupy":
            pool = self.xp.get_default_memory_pool()
            pool.free_all_blocks()
            base = pool.used_bytes()
            fn()
            self.sync()
            return (pool.total_bytes() - base) / 2**20
        t = self.torch
        t.cuda.synchronize()
        t.cuda.reset_peak_memory_stats()
        base = t.cuda.memory_allocated()
        fn()
        t.cuda.synchronize()
        return (t.cuda.max_memory_allocated() - base) / 2**20

    def matmul_gflops(self, n: int, budget_s: float) -> float:
        """Measured float32 n x n matmul rate: the peak each row is compared with."""
        rng = numpy.random.default_rng(0)
        a, b = (self.asarray(rng.standard_normal((n, n), dtype=numpy.float32)) for _ in range(2))
        t = time_call(lambda: a @ b, self.sync, 2, 10, budget_s)
        return 2.0 * n ** 3 / (t["ms"] * 1e-3) / 1e9


def make_backends(names: list[str], threads: int) -> tuple[list[Backend], list[str]]:
    """Backends that can run here, and a note for each one that was asked for and cannot."""
    from npformer.backend import cupy_available
    out, notes = [], []
    try:
        import torch
        has_torch, has_cuda = True, torch.cuda.is_available()
    except ImportError:
        has_torch = has_cuda = False
    for name in names:
        if name == "numpy":
            out.append("numpy")
        elif name == "cupy":
            (out.append if cupy_available() else lambda _: notes.append(
                "cupy: CuPy or a CUDA device is absent; GPU columns unmeasured"))("cupy")
        elif name == "torch":
            if not has_torch:
                notes.append("torch: not importable; no PyTorch columns")
                continue
            if "numpy" in names:
                out.append("torch-cpu")
            if "cupy" in names and has_cuda:
                out.append("torch-cuda")
        else:
            raise ValueError(f"unknown backend {name!r}; expected numpy, cupy or torch")
    return [Backend(n, threads) for n in out], notes


def device_name(backends: list[Backend]) -> str:
    """A file-name slug of the device measured: the GPU's name when one ran, else the CPU's."""
    for b in backends:
        if b.device == "cuda":
            name = (b.xp.cuda.runtime.getDeviceProperties(0)["name"].decode() if b.name == "cupy"
                    else b.torch.cuda.get_device_name(0))
            return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    model = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1] for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    slug = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")
    return f"cpu-{slug}-{len(os.sched_getaffinity(0))}c"


# -- the cases: sizes, FLOP counts, and the same computation built for npformer and for PyTorch ------
FULL = dict(B=8, T=128, d=256, H=8, F=1024, V=512, model_B=8, model_T=128, warmup=2, repeats=10,
            budget_s=3.0, matmul_n=2048, sweep_B=1, sweep_T=(128, 256, 512, 1024, 2048, 4096, 8192),
            sweep_stop_s=3.0, settle_s=0.3, mem_min_s=0.2)
QUICK = dict(B=2, T=64, d=256, H=8, F=1024, V=512, model_B=2, model_T=16, warmup=1, repeats=3,
             budget_s=0.05, matmul_n=512, sweep_B=1, sweep_T=(128, 256), sweep_stop_s=1.0,
             settle_s=0.05, mem_min_s=0.02)
MODELS = {   # L: layers (per stack for seq2seq); F: feed-forward width; dropout 0.1 everywhere
    "gpt-small": dict(kind="gpt", d=256, H=8, L=4, F=1024, V=512),
    "gpt-medium": dict(kind="gpt", d=512, H=8, L=6, F=2048, V=1024),
    "seq2seq-base": dict(kind="seq2seq", d=256, H=8, L=3, F=1024, V=1024),  # base 512/8/6+6/2048, halved
}
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
    "train_step": "matmuls only, fwd+bwd = 3x fwd: gpt 6*N*(L*(4d^2+2dF) + V*d) + 12*L*B*T^2*d; "
                  "seq2seq (S=T) 6*(2*N*L*(6d^2+2dF) + N*V*d) + 36*L*B*T^2*d; "
                  "embeddings, element-wise work and AdamW not counted",
}


def _host(shape, seed=0, dtype=numpy.float32):
    return numpy.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _npformer_pair(b, fwd, bwd, host_inputs, **kw):
    """fwd(*inputs, **kw) returns (y, ..., cache); bwd(dy, cache) with a fixed random dy."""
    xs = [b.asarray(h) for h in host_inputs]
    res = fwd(*xs, **kw)
    y, cache = res[0], res[-1]
    dy = b.asarray(_host(y.shape, 9)) if y.ndim else b.xp.ones((), dtype=y.dtype)
    return {"fwd": lambda: fwd(*xs, **kw), "bwd": lambda: bwd(dy, cache)}


def _torch_pair(b, fn, host_inputs, n_grad, params=()):
    """fn(*inputs) under autograd; bwd = the gradients of the first n_grad inputs and params."""
    torch = b.torch
    xs = [b.asarray(h) for h in host_inputs]
    for x in xs[:n_grad]:
        x.requires_grad_(True)
    wrt = xs[:n_grad] + list(params)
    y = fn(*xs)
    dy = b.asarray(_host(tuple(y.shape), 9)) if y.ndim else torch.ones((), device=y.device)
    return {"fwd": lambda: fn(*xs), "bwd": lambda: torch.autograd.grad(y, wrt, dy, retain_graph=True)}


def _op_case(name, c, shape, flops, np_build, torch_build, B=None, T=None):
    B, T = B or c["B"], T or c["T"]

    def build(b):
        return np_build(b) if b.framework == "npformer" else torch_build(b)
    return {"name": name, "shape": shape, "tokens": B * T, "flops": flops, "build": build}


def _attention_case(name, B, H, T, hs):
    from npformer.ops import attention as A
    qkv = [_host((B, H, T, hs), s) for s in (1, 2, 3)]
    e = B * H * T * T
    case = _op_case(name, None, f"q,k,v ({B}, {H}, {T}, {hs})",
                    {"fwd": 4 * e * hs + 5 * e, "bwd": 8 * e * hs + 4 * e},
                    lambda b: _npformer_pair(b, A.scaled_dot_product_attention_forward,
                                             A.scaled_dot_product_attention_backward, qkv),
                    lambda b: _torch_pair(b, b.torch.nn.functional.scaled_dot_product_attention, qkv, 3),
                    B=B, T=T)
    case["dims"] = (B, H, T, hs)
    return case


def op_cases(c: dict) -> list[dict]:
    from npformer.ops import activations, cross_entropy, feedforward, layernorm, linear, multihead, softmax
    B, T, d, H, F, V = (c[k] for k in "BTdHFV")
    N, E, hs = B * T, B * H * T * T, d // H
    x, w1, b1, w2, b2 = _host((B, T, d), 1), _host((F, d), 2) * 0.05, _host((F,), 3), \
        _host((d, F), 4) * 0.05, _host((d,), 5)
    g, beta, s, h = 1 + 0.1 * _host((d,), 6), _host((d,), 7), _host((B, H, T, T), 8), _host((B, T, F), 10)
    logits, tgt = _host((B, T, V), 11), numpy.random.default_rng(12).integers(0, V, (B, T))
    in_w, in_b, out_w, out_b = _host((3 * d, d), 13) * 0.05, _host((3 * d,), 14), \
        _host((d, d), 15) * 0.05, _host((d,), 16)
    tf = lambda b: b.torch.nn.functional                                     # noqa: E731

    def torch_mha(b):
        m = b.torch.nn.MultiheadAttention(d, H, batch_first=True).to(b.device)
        with b.torch.no_grad():
            for p, v in zip((m.in_proj_weight, m.in_proj_bias, m.out_proj.weight, m.out_proj.bias),
                            (in_w, in_b, out_w, out_b)):
                p.copy_(b.asarray(v))
        return _torch_pair(b, lambda x_: m(x_, x_, x_, need_weights=False)[0], [x], 1, m.parameters())

    def np_mha(b):
        ws = [b.asarray(v) for v in (in_w, in_b, out_w, out_b)]
        xd = b.asarray(x)
        fwd = lambda: multihead.multi_head_attention_forward(xd, xd, xd, H, *ws, need_weights=False)  # noqa
        out, _, cache = fwd()
        dy = b.asarray(_host(out.shape, 9))
        return {"fwd": fwd, "bwd": lambda: multihead.multi_head_attention_backward(dy, cache)}

    return [
        _op_case("linear", c, f"x ({B}, {T}, {d}) -> {F}", {"fwd": 2 * N * d * F, "bwd": 4 * N * d * F},
                 lambda b: _npformer_pair(b, linear.linear_forward, linear.linear_backward, [x, w1, b1]),
                 lambda b: _torch_pair(b, tf(b).linear, [x, w1, b1], 3)),
        _op_case("softmax", c, f"scores ({B}, {H}, {T}, {T})", {"fwd": 5 * E, "bwd": 4 * E},
                 lambda b: _npformer_pair(b, softmax.softmax_forward, softmax.softmax_backward, [s]),
                 lambda b: _torch_pair(b, lambda s_: b.torch.softmax(s_, -1), [s], 1)),
        _op_case("layer_norm", c, f"x ({B}, {T}, {d})", {"fwd": 8 * N * d, "bwd": 12 * N * d},
                 lambda b: _npformer_pair(b, layernorm.layer_norm_forward, layernorm.layer_norm_backward,
                                          [x, g, beta]),
                 lambda b: _torch_pair(b, lambda x_, g_, b_: tf(b).layer_norm(x_, (d,), g_, b_), [x, g, beta], 3)),
        _op_case("gelu", c, f"h ({B}, {T}, {F})", {"fwd": 10 * N * F, "bwd": 15 * N * F},
                 lambda b: _npformer_pair(b, activations.gelu_forward, activations.gelu_backward, [h]),
                 lambda b: _torch_pair(b, tf(b).gelu, [h], 1)),
        _attention_case("attention", B, H, T, hs),
        _op_case("multi_head", c, f"x ({B}, {T}, {d}), {H} heads",
                 {"fwd": 8 * N * d * d + 4 * E * hs + 5 * E, "bwd": 16 * N * d * d + 8 * E * hs + 4 * E},
                 np_mha, torch_mha),
        _op_case("ffn", c, f"x ({B}, {T}, {d}), F={F}, gelu",
                 {"fwd": 4 * N * d * F + 10 * N * F, "bwd": 8 * N * d * F + 15 * N * F},
                 lambda b: _npformer_pair(b, feedforward.feed_forward_forward,
                                          feedforward.feed_forward_backward, [x, w1, b1, w2, b2],
                                          activation="gelu"),
                 lambda b: _torch_pair(b, lambda x_, a, a2, c_, c2: tf(b).linear(tf(b).gelu(tf(b).linear(
                     x_, a, a2)), c_, c2), [x, w1, b1, w2, b2], 5)),
        _op_case("cross_entropy", c, f"logits ({B}, {T}, {V})", {"fwd": 5 * N * V, "bwd": 3 * N * V},
                 lambda b: _npformer_pair(b, cross_entropy.cross_entropy_forward,
                                          cross_entropy.cross_entropy_backward, [logits, tgt]),
                 lambda b: _torch_pair(b, lambda l_, t_: tf(b).cross_entropy(l_.reshape(-1, V), t_.reshape(-1)),
                                       [logits, tgt], 1)),
    ]


def _train_flops(m: dict, B: int, T: int) -> int:
    d, L, F, V = m["d"], m["L"], m["F"], m["V"]
    N = B * T
    if m["kind"] == "gpt":
        return 6 * N * (L * (4 * d * d + 2 * d * F) + V * d) + 12 * L * B * T * T * d
    return 6 * (2 * N * L * (6 * d * d + 2 * d * F) + N * V * d) + 36 * L * B * T * T * d


def _npformer_step(b, m, ids):
    from npformer.models.gpt import GPT, GPTConfig
    from npformer.models.seq2seq import Seq2Seq, Seq2SeqConfig
    from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
    from npformer.training.optim import AdamW
    d, H, L, F, V, T = m["d"], m["H"], m["L"], m["F"], m["V"], ids.shape[1]
    if m["kind"] == "gpt":
        model = GPT(GPTConfig(V, T, L, H, d, F, 0.1, "gelu", norm_first=True, tie_embeddings=True),
                    dtype=numpy.float32, backend=b.name, rng=0)
    else:
        model = Seq2Seq(Seq2SeqConfig(V, V, d, H, L, L, F, 0.1, "relu", norm_first=False, max_len=T),
                        dtype=numpy.float32, backend=b.name, rng=0)
    opt = AdamW(model.parameters(), lr=3e-4)
    src, tgt = b.asarray(ids), b.asarray(ids[:, ::-1].copy())
    one = b.xp.ones((), dtype=b.xp.float32)

    def step():
        model.zero_grad()
        logits = model(src) if m["kind"] == "gpt" else model(src, tgt)   # (B, T, V)
        _, cache = cross_entropy_forward(logits, tgt)
        model.backward(cross_entropy_backward(one, cache))
        opt.step()
    return step


def _torch_step(b, m, ids):
    torch = b.torch
    nn = torch.nn
    d, H, L, F, V, T = m["d"], m["H"], m["L"], m["F"], m["V"], ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=b.device).triu(1)    # True = blocked

    class GPT(nn.Module):                     # pre-norm encoder layers + causal mask + tied head
        def __init__(self):
            super().__init__()
            self.wte, self.wpe, self.drop = nn.Embedding(V, d), nn.Embedding(T, d), nn.Dropout(0.1)
            layer = nn.TransformerEncoderLayer(d, H, F, 0.1, activation="gelu", batch_first=True,
                                               norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, L, enable_nested_tensor=False)
            self.ln_f = nn.LayerNorm(d)

        def forward(self, idx):
            x = self.drop(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))
            return self.ln_f(self.blocks(x, mask=causal, is_causal=True)) @ self.wte.weight.T

    class Seq2Seq(nn.Module):                 # the paper's post-norm model, sinusoidal PE, tied head
        def __init__(self):
            super().__init__()
            self.src_emb, self.tgt_emb = nn.Embedding(V, d, padding_idx=0), nn.Embedding(V, d, padding_idx=0)
            self.tr = nn.Transformer(d, H, L, L, F, 0.1, activation="relu", batch_first=True)
            pos = torch.arange(T)[:, None] * torch.exp(torch.arange(0, d, 2) * (-numpy.log(1e4) / d))
            self.register_buffer("pe", torch.stack([pos.sin(), pos.cos()], -1).reshape(T, d))
            self.drop1, self.drop2 = nn.Dropout(0.1), nn.Dropout(0.1)

        def forward(self, src, tgt):
            sp, tp = src == 0, tgt == 0
            x = self.drop1(self.src_emb(src) * d ** 0.5 + self.pe)
            y = self.drop2(self.tgt_emb(tgt) * d ** 0.5 + self.pe)
            h = self.tr(x, y, tgt_mask=causal, src_key_padding_mask=sp, tgt_key_padding_mask=tp,
                        memory_key_padding_mask=sp, tgt_is_causal=True)
            return h @ self.tgt_emb.weight.T

    torch.manual_seed(0)
    model = (GPT() if m["kind"] == "gpt" else Seq2Seq()).to(b.device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    src, tgt = b.asarray(ids), b.asarray(ids[:, ::-1].copy())

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(src) if m["kind"] == "gpt" else model(src, tgt)
        torch.nn.functional.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1)).backward()
        opt.step()
    return step


def model_cases(c: dict) -> list[dict]:
    B, T = c["model_B"], c["model_T"]
    out = []
    for name, m in MODELS.items():
        ids = numpy.random.default_rng(1).integers(1, m["V"], (B, T))          # no padding tokens
        shape = (f"B={B} T={T} d={m['d']} H={m['H']} L={m['L']}" + ("+" + str(m["L"]) if m["kind"] ==
                 "seq2seq" else "") + f" F={m['F']} V={m['V']}")
        out.append({"name": name, "shape": shape, "tokens": B * T * (2 if m["kind"] == "seq2seq" else 1),
                    "flops": {"step": _train_flops(m, B, T)},
                    "build": lambda b, m=m, ids=ids: {"step": (_npformer_step if b.framework == "npformer"
                                                               else _torch_step)(b, m, ids)}})
    return out


def all_cases(c: dict):
    for case in op_cases(c):
        yield "op", case
    for case in model_cases(c):
        yield "model", case


def sweep_case(c: dict, T: int) -> dict:
    d, H = c["d"], c["H"]
    return _attention_case(f"attention T={T}", c["sweep_B"], H, T, d // H)


def flash_sweep_case(c: dict, T: int) -> dict:
    """The sweep's attention as FlashAttention tiles (npformer.ops.flash_attention): O(T) memory.
    The torch column is the same ``scaled_dot_product_attention`` call as the plain sweep's (PyTorch
    picks its own fused kernel, a flash kernel on CPU and CUDA where it applies)."""
    from npformer.ops import flash_attention as FA
    B, H, hs = c["sweep_B"], c["H"], c["d"] // c["H"]
    qkv = [_host((B, H, T, hs), s) for s in (1, 2, 3)]
    e = B * H * T * T
    case = _op_case(f"flash attention T={T}", None, f"q,k,v ({B}, {H}, {T}, {hs}), 128x128 tiles",
                    {"fwd": 4 * e * hs + 5 * e, "bwd": 10 * e * hs + 6 * e},   # bwd recomputes S = q k^T and P
                    lambda b: _npformer_pair(b, FA.flash_attention_forward, FA.flash_attention_backward, qkv),
                    lambda b: _torch_pair(b, b.torch.nn.functional.scaled_dot_product_attention, qkv, 3), B=B, T=T)
    case["dims"], case["flash"] = (B, H, T, hs), True
    return case


def fits_memory(case: dict, b: Backend) -> bool:
    """Plain attention holds about six (B, H, T, T) float32 arrays at once; keep that under half
    of the memory available now (host MemAvailable, or the device's free memory)."""
    B, H, T, _ = case["dims"]
    if case.get("flash") and b.framework == "npformer":
        return True                                       # a few (B, H, 128, 128) tiles and O(T) arrays
    need = 6 * B * H * T * T * 4
    if b.device == "cpu":
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    elif b.name == "cupy":
        avail = b.xp.cuda.runtime.memGetInfo()[0]
    else:
        avail = b.torch.cuda.mem_get_info()[0]
    return need < avail / 2


def run_suite(backends: list[Backend], quick: bool, log: Callable[[str], None] = print) -> dict:
    """Time every case on every backend, then measure memory; returns the JSON-ready result."""
    cfg = QUICK if quick else FULL
    peaks = {}
    for b in backends:
        _settle(cfg["settle_s"])
        peaks[b.name] = b.matmul_gflops(cfg["matmul_n"], cfg["budget_s"])
        log(f"matmul peak {b.name}: {peaks[b.name]:.1f} GFLOP/s")
    rows: list[dict] = []
    done: list[tuple] = []                                 # (group, case, backend) for the memory pass
    for group, case in all_cases(cfg):
        rows += _measure(group, case, backends, cfg, peaks, done, log)
    for b in backends:                                    # the sweep drops a backend once it is slow
        for t in cfg["sweep_T"]:
            new = _measure("sweep", sweep_case(cfg, t), [b], cfg, peaks, done, log)
            rows += new
            if not new or sum(r["ms"] for r in new) / 1e3 >= cfg["sweep_stop_s"]:
                break
        for t in cfg["sweep_T"]:                           # the same sweep, flash attention
            new = _measure("sweep", flash_sweep_case(cfg, t), [b], cfg, peaks, done, log)
            rows += new
            if not new or sum(r["ms"] for r in new) / 1e3 >= cfg["sweep_stop_s"]:
                break
    _memory_pass(rows, done, cfg, log)
    _ratios(rows)
    return {"meta": _meta(backends, quick, cfg), "matmul_peak_gflops": peaks, "rows": rows}


def _settle(seconds: float) -> None:
    """Let the other library's idle BLAS/OpenMP threads stop spinning before a timing starts
    (OpenBLAS and OpenMP workers busy-wait a while after each call and would steal the cores)."""
    time.sleep(seconds)


def _measure(group, case, backends, cfg, peaks, done, log) -> list[dict]:
    rows = []
    for b in backends:
        if group == "sweep" and not fits_memory(case, b):
            log(f"  {case['name']} {b.name}: skipped (predicted memory over the budget)")
            continue
        calls = case["build"](b)
        _settle(cfg["settle_s"])
        for pas, fn in calls.items():
            t = time_call(fn, b.sync, cfg["warmup"], cfg["repeats"], cfg["budget_s"])
            flops, sec = case["flops"][pas], t["ms"] * 1e-3
            row = {"group": group, "name": case["name"], "pass": pas, "shape": case["shape"],
                   "backend": b.name, "framework": b.framework, "device": b.device, **t,
                   "flops": flops, "tokens": case["tokens"], "tokens_per_s": case["tokens"] / sec,
                   "gflops": flops / sec / 1e9, "peak_share": flops / sec / 1e9 / peaks[b.name],
                   "peak_mb": None}
            rows.append(row)
            log(f"  {case['name']:<18} {pas:<5} {b.name:<10} {t['ms']:9.2f} ms "
                f"[{t['q1_ms']:.2f}, {t['q3_ms']:.2f}]  {row['gflops']:7.1f} GFLOP/s")
        done.append((group, case, b))
        del calls
    return rows


def _memory_pass(rows, done, cfg, log) -> None:
    """More calls per row, after all timings, for its peak memory (see ``peak MB`` above).

    On the host, glibc's mmap threshold is fixed and free heap pages are trimmed before each
    measurement, so that memory freed earlier is not still resident and hiding a call's peak.
    Doing this after the timings leaves the allocator as the timed calls had it."""
    if any(b.device == "cpu" for _, _, b in done):
        try:
            libc = _glibc()
            libc.mallopt(-3, 1 << 16)                     # M_MMAP_THRESHOLD = 64 KiB
            libc.mallopt(-1, 1 << 16)                     # M_TRIM_THRESHOLD = 64 KiB
        except (OSError, AttributeError):
            log("note: glibc mallopt unavailable; host peak memory may read low")
    gc.collect()
    gc.freeze()                                           # what is left is long-lived: skip it from now on
    by = {(r["name"], r["pass"], r["backend"]): r for r in rows}
    for group, case, b in done:
        calls = case["build"](b)
        for pas, fn in calls.items():
            if group == "model":
                fn()                                      # the first step allocates AdamW's moments
            by[(case["name"], pas, b.name)]["peak_mb"] = b.peak_mb(fn, cfg["mem_min_s"])
        del calls
    log("peak memory measured")


def _ratios(rows: list[dict]) -> None:
    """vs_torch = npformer time / torch time of the same case, pass and device (None without torch)."""
    ref = {(r["name"], r["pass"], r["device"]): r["ms"] for r in rows if r["framework"] == "torch"}
    for r in rows:
        t = ref.get((r["name"], r["pass"], r["device"])) if r["framework"] == "npformer" else None
        r["vs_torch"] = r["ms"] / t if t else None


def _meta(backends, quick, cfg) -> dict:
    versions = {"numpy": numpy.__version__, "python": platform.python_version()}
    for b in backends:
        mod = b.torch or b.xp
        versions[mod.__name__] = mod.__version__
    return {"device": device_name(backends), "date": datetime.date.today().isoformat(),
            "mode": "quick" if quick else "full", "threads": backends[0].threads if backends else 0,
            "cpu_count": len(os.sched_getaffinity(0)), "platform": platform.platform(),
            "versions": versions, "backends": [b.name for b in backends],
            "config": {k: v for k, v in cfg.items() if k != "budget_s"}, "flop_counts": FLOPS}


# -- reports -------------------------------------------------------------------------------------
def _f(v, fmt="{:.2f}"):
    return "-" if v is None else fmt.format(v)


def markdown(result: dict) -> str:
    """The summary table (backends as columns), the sweep, and every row in detail."""
    meta, rows, peaks = result["meta"], result["rows"], result["matmul_peak_gflops"]
    names = meta["backends"]
    lines = [f"# npformer benchmarks: {meta['device']}, {meta['date']} ({meta['mode']} mode)", "",
             f"Threads: {meta['threads']} of {meta['cpu_count']} CPUs; versions: "
             + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ".",
             "Float32 matmul peak (GFLOP/s, same run): "
             + ", ".join(f"{k} {v:.1f}" for k, v in peaks.items()) + ".", ""]
    lines += [f"Note: {n}" for n in meta.get("notes", [])] + [""] * bool(meta.get("notes"))
    by = {(r["name"], r["pass"], r["backend"]): r for r in rows}
    keys = list(dict.fromkeys((r["group"], r["name"], r["pass"], r["shape"]) for r in rows))
    ratio_cols = [(n, "torch-cpu" if n == "numpy" else "torch-cuda") for n in ("numpy", "cupy")
                  if n in names and ("torch-cpu" if n == "numpy" else "torch-cuda") in names]
    speed = "numpy" in names and "cupy" in names
    lines += ["## Summary: median ms [IQR] per backend", "",
              "| case | pass | shape | GFLOP | " + " | ".join(f"{n} ms" for n in names)
              + "".join(f" | {a}/{t}" for a, t in ratio_cols) + (" | GPU speed-up" if speed else "") + " |",
              "|" + "---|" * (4 + len(names) + len(ratio_cols) + speed)]
    for group, name, pas, shape in keys:
        if group == "sweep":
            continue
        cells = []
        for n in names:
            r = by.get((name, pas, n))
            cells.append("-" if r is None else f"{r['ms']:.2f} [{r['q1_ms']:.2f}, {r['q3_ms']:.2f}]")
        for a, _ in ratio_cols:
            cells.append(_f(by[(name, pas, a)]["vs_torch"]) + "x" if (name, pas, a) in by else "-")
        if speed:
            cpu, gpu = by.get((name, pas, "numpy")), by.get((name, pas, "cupy"))
            cells.append(f"{cpu['ms'] / gpu['ms']:.1f}x" if cpu and gpu else "-")
        flops = next(r["flops"] for r in rows if r["name"] == name and r["pass"] == pas)
        lines.append(f"| {name} | {pas} | {shape} | {flops / 1e9:.3f} | " + " | ".join(cells) + " |")
    sweep = [r for r in rows if r["group"] == "sweep"]
    if sweep:
        lines += ["", "## Attention sweep: ms (fwd / bwd) and peak MB (fwd / bwd)", "",
                  "| T | " + " | ".join(f"{n} ms | {n} MB" for n in names) + " |",
                  "|" + "---|" * (1 + 2 * len(names))]
        for name in dict.fromkeys(r["name"] for r in sweep):
            cells = []
            for n in names:
                f, b = by.get((name, "fwd", n)), by.get((name, "bwd", n))
                cells += ["-", "-"] if f is None else [
                    f"{f['ms']:.1f} / {b['ms']:.1f}", f"{_f(f['peak_mb'], '{:.0f}')} / {_f(b['peak_mb'], '{:.0f}')}"]
            lines.append(f"| {name.replace('attention T=', '')} | " + " | ".join(cells) + " |")
    lines += ["", "## Every row", "",
              "| case | pass | backend | ms | IQR | min-max | n | tokens/s | GFLOP/s | % peak | vs torch | peak MB |",
              "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| {r['name']} | {r['pass']} | {r['backend']} | {r['ms']:.3f} | {r['q1_ms']:.3f}-"
                     f"{r['q3_ms']:.3f} | {r['min_ms']:.3f}-{r['max_ms']:.3f} | {r['repeats']} | "
                     f"{r['tokens_per_s']:.0f} | {r['gflops']:.1f} | {100 * r['peak_share']:.1f} | "
                     f"{_f(r['vs_torch'])} | {_f(r['peak_mb'], '{:.1f}')} |")
    lines += ["", "FLOP counts used:", ""] + [f"- {k}: {v}" for k, v in meta["flop_counts"].items()]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str, log: Callable[[str], None] = print) -> bool:
    """Speed relative to numpy per case, and the sweep's time and memory against T (log-log)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("note: matplotlib is not installed; no PNG plot written (pip install matplotlib)")
        return False
    rows, names = result["rows"], result["meta"]["backends"]
    by = {(r["name"], r["pass"], r["backend"]): r for r in rows}
    keys = [k for k in dict.fromkeys((r["name"], r["pass"]) for r in rows if r["group"] != "sweep")]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    width = 0.8 / max(len(names), 1)
    for i, n in enumerate(names):
        vals = [by[(k[0], k[1], "numpy")]["ms"] / by[(k[0], k[1], n)]["ms"]
                if (k[0], k[1], n) in by and (k[0], k[1], "numpy") in by else 0 for k in keys]
        axes[0].bar([j + i * width for j in range(len(keys))], vals, width, label=n)
    axes[0].set_xticks([j + 0.4 - width / 2 for j in range(len(keys))])
    axes[0].set_xticklabels([f"{a} {b}" for a, b in keys], rotation=70, fontsize=7)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("speed-up over numpy (x)")
    axes[0].axhline(1, color="gray", lw=0.5)
    sweep = [r for r in rows if r["group"] == "sweep"]
    for n in names:
        for impl in ("attention", "flash attention"):                      # flash: its own line
            pts = sorted((int(r["name"].split("=")[1]), r) for r in sweep if r["backend"] == n
                         and r["pass"] == "fwd" and r["name"].startswith(impl + " T="))
            if pts:
                ts, lab = [t for t, _ in pts], n if impl == "attention" else n + " flash"
                axes[1].plot(ts, [r["ms"] + by[(r["name"], "bwd", n)]["ms"] for _, r in pts], "o-", label=lab)
                axes[2].plot(ts, [max(r["peak_mb"] or 0, 1e-3) for _, r in pts], "o-", label=lab)
    axes[1].set(xscale="log", yscale="log", xlabel="T", ylabel="attention fwd+bwd ms")
    axes[2].set(xscale="log", yscale="log", xlabel="T", ylabel="attention fwd peak MB")
    for ax in axes:
        ax.legend(fontsize=8)
    meta = result["meta"]
    fig.suptitle(f"npformer benchmarks, {meta['device']}, {meta['date']} ({meta['mode']})")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def write_reports(result: dict, out_dir: str, log: Callable[[str], None] = print) -> dict:
    """Markdown, JSON and (with matplotlib) PNG named ``<device>_<date>[_quick]``; returns the paths."""
    meta = result["meta"]
    stem = f"{meta['device']}_{meta['date']}" + ("_quick" if meta["mode"] == "quick" else "")
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, stem + ".json"), "md": os.path.join(out_dir, stem + ".md")}
    with open(paths["json"], "w") as f:
        json.dump(result, f, indent=1)
    with open(paths["md"], "w") as f:
        f.write(markdown(result))
    png = os.path.join(out_dir, stem + ".png")
    if plot(result, png, log):
        paths["png"] = png
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="npformer bench", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats (under a minute on CPU)")
    ap.add_argument("--backends", default="numpy,cupy,torch", help="comma list of numpy, cupy, torch")
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"), help="output folder")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="CPU threads for PyTorch, and numpy's BLAS through threadpoolctl when it "
                         "is installed (default: the CPUs this process may use)")
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error(f"--threads: expected a positive count, got {args.threads}")
    names = [n.strip().lower() for n in args.backends.split(",") if n.strip()]
    try:
        backends, notes = make_backends(names, args.threads)
    except ValueError as exc:
        ap.error(str(exc))
    try:                                                  # numpy's BLAS threads to match torch's
        from threadpoolctl import threadpool_limits
        threadpool_limits(args.threads)
    except ImportError:
        notes.append(f"numpy BLAS threads: library default (threadpoolctl absent); torch threads: "
                     f"{args.threads}")
    for note in notes:
        print("note:", note)
    if not backends:
        ap.error("no backend can run here")
    result = run_suite(backends, args.quick)
    result["meta"]["notes"] = notes
    for kind, path in write_reports(result, args.out).items():
        print(f"wrote {kind}: {path}")
    return 0
