"""Experiments from the Transformer literature, run by ``npformer study NAME``.

Each experiment is a module with ``DESCRIPTION`` (one line), ``add_arguments(parser)`` and
``run(args) -> int`` (the exit status). It measures something, writes its data as CSV and/or JSON
and, when matplotlib is installed (``pip install "npformer[plot]"``), a PNG into ``args.out``, and
prints a short summary. The data files never need matplotlib.

Modules are imported when the command line is built, so they import only npformer and numpy at
the top and anything heavier (matplotlib) inside the function that needs it.
"""
from __future__ import annotations

# name on the command line -> module
EXPERIMENTS: dict[str, str] = {
    "positional": "npformer.study.positional",
    "xl-memory": "npformer.study.xl_memory",
    "norms": "npformer.study.norms",
    "attention": "npformer.study.attention_maps",
    "gradient-flow": "npformer.study.gradient_flow",
    "layers": "npformer.study.layer_grads",
    "albert": "npformer.study.albert_params",
}

__all__ = ["EXPERIMENTS"]
