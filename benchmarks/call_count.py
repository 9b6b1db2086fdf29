"""How much Python a tiny GPT step runs through npformer: calls into npformer's own files in one
forward and one backward (``sys.setprofile``), with the fast paths on and off, and the frames between
``GPT.forward`` and the attention op, each named (what a traceback from the attention op shows).

    python benchmarks/call_count.py

The model is the issue's: 1 layer, d_model 16, 2 heads, a batch of 2 x 8 tokens, float32, NumPy.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

import numpy as np

import npformer
from npformer import kernels
from npformer.models.gpt import GPT, GPTConfig
from npformer.ops.cross_entropy import cross_entropy_backward, cross_entropy_forward

PACKAGE = os.path.dirname(npformer.__file__)
ATTENTION_OPS = ("scaled_dot_product_attention_forward", "flash_attention_forward")


def _model() -> GPT:
    return GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, d_model=16, dim_feedforward=64),
               dtype="float32", backend="numpy", rng=0)


def count_calls(fn) -> Counter:
    """Calls of Python functions defined in npformer's files while ``fn()`` runs, by function."""
    calls: Counter = Counter()

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            calls[f"{os.path.relpath(frame.f_code.co_filename, PACKAGE)}:{frame.f_code.co_name}"] += 1
    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def attention_path(model: GPT, idx) -> list[str]:
    """The frames from GPT.forward (exclusive) down to the attention op (inclusive), outermost first,
    each as ``file:qualified name``."""
    path: list[str] = []

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_name in ATTENTION_OPS and not path:
            f = frame
            while f is not None and not (f.f_code.co_name == "forward" and "gpt.py" in f.f_code.co_filename):
                path.append(f"{os.path.relpath(f.f_code.co_filename, PACKAGE)}:{f.f_code.co_qualname}")
                f = f.f_back
    sys.setprofile(hook)
    try:
        model(idx)
    finally:
        sys.setprofile(None)
    return path[::-1]


def measure() -> dict:
    idx = np.random.default_rng(0).integers(0, 11, (2, 8))
    out = {}
    for label, off in (("fast paths on", False), ("fast paths off", True)):
        model = _model()
        model(idx)                                      # warm: first-call imports and caches out of the count
        with (kernels.disabled() if off else _nothing()):
            state = {}
            fwd = count_calls(lambda: state.update(logits=model(idx)))
            loss, cache = cross_entropy_forward(state["logits"], idx)
            dlogits = cross_entropy_backward(np.ones((), np.float32), cache)
            bwd = count_calls(lambda: model.backward(dlogits))
            out[label] = {"forward": sum(fwd.values()), "backward": sum(bwd.values()),
                          "attention path": attention_path(model, idx), "top": (fwd + bwd).most_common(8)}
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main(argv=None) -> int:
    argparse.ArgumentParser(prog="python benchmarks/call_count.py", description=__doc__.split("\n")[0]).parse_args(argv)
    for label, r in measure().items():
        path = r["attention path"]
        print(f"{label}: {r['forward']} calls forward, {r['backward']} backward; "
              f"attention op {len(path)} frames below GPT.forward:")
        print("    " + " -> ".join(path))
        for name, n in r["top"]:
            print(f"    {n:4d}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
