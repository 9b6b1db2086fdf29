"""Experiments from the Transformer literature, run by ``npformer study NAME``.

Each experiment is a module with ``add_arguments(parser)`` and ``run(args) -> int`` (the exit status),
listed in :data:`EXPERIMENTS` with its one-line description. It measures something, writes its data
as CSV and/or JSON and, when matplotlib is installed (``pip install "npformer[plot]"``), a PNG into
``args.out``, and prints a short summary. The data files never need matplotlib.

The command line lists the experiments from :data:`EXPERIMENTS` alone and imports an experiment's
module only when that experiment is chosen (``npformer study NAME ...``, its ``--help`` included), so
this package's ``__init__`` imports nothing, and a module imports anything heavier than npformer and
numpy (matplotlib) inside the function that needs it.
"""
from __future__ import annotations

from typing import NamedTuple


class Experiment(NamedTuple):
    module: str          # the module with add_arguments and run, imported when the experiment is chosen
    description: str     # one line, for the help


# name on the command line -> experiment
EXPERIMENTS: dict[str, Experiment] = {
    "positional": Experiment(
        "npformer.study.positional",
        "the sinusoidal positional encoding as a heatmap, and the similarity between positions"),
    "xl-memory": Experiment(
        "npformer.study.xl_memory",
        "Transformer-XL with and without memory on a task whose dependencies are longer than a segment: "
        "validation loss, and evaluation with a longer memory than training"),
    "norms": Experiment(
        "npformer.study.norms",
        "BatchNorm (batch and running statistics) beside LayerNorm in one Transformer: padded "
        "variable-length batches, neighbours, batch size 1 at inference"),
    "attention": Experiment(
        "npformer.study.attention_maps",
        "heatmaps of every head's attention weights for an input of your choice, from a trained checkpoint "
        "or a fresh model, with token labels"),
    "gradient-flow": Experiment(
        "npformer.study.gradient_flow",
        "RNN and LSTM (hand-written BPTT) beside a Transformer encoder: the norm of d(loss at the last "
        "step)/d(input at step t) against t, at initialisation and after training"),
    "layers": Experiment(
        "npformer.study.layer_grads",
        "per-layer gradient norms during training: post-norm vs pre-norm, with and without residual "
        "connections"),
    "albert": Experiment(
        "npformer.study.albert_params",
        "parameter counts of BERT against ALBERT (factorised embedding, each sharing mode) as a table "
        "and a plot"),
}

__all__ = ["EXPERIMENTS", "Experiment"]
