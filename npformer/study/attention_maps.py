"""``npformer study attention``: every head's attention weights for one input, as heatmaps with the
tokens on both axes, from a checkpoint of ``npformer train`` or from a freshly initialised model.

    Seq2Seq (dates, numbers, copy, reverse):  encoder self-attention  (source x source),
        decoder self-attention (target x target, causal) and cross-attention (target x source),
        per layer and head; the decoder reads ``<bos>`` + the target (``--target``, default the
        model's own greedy output), as in training (teacher forcing).
    GPT (charlm; gpt, gpt1, gpt2): causal self-attention (text x text) per layer and head.
    BERT, ALBERT (charlm, masked): self-attention over the whole text (text x text) per layer and
        head (ALBERT's shared layer once per use); ``[MASK]`` in the input is the mask token.

The layers call ``MultiheadAttention`` with ``need_weights=False`` (the weights are not needed for
the output). :func:`record_attention` asks each attention module for them, per head, for the
duration of a ``with`` block, by wrapping that module's ``forward``: an instance attribute, which
``module(x)`` (``Module.__call__``: ``self.forward(x)``) finds before the class's, deleted on exit;
nothing in ``npformer.nn`` knows of it. In eval mode there is no dropout, so every row of a
weight matrix sums to 1 over the keys the query may see, and a row whose keys are all masked is 0.

Per head it reports the entropy of each query's distribution (bits; log2 of the number of visible
keys for a uniform one) and the key each query attends to most.
"""
from __future__ import annotations

import argparse
import math
from contextlib import contextmanager
from pathlib import Path

import numpy

from npformer.backend import get_backend, to_device, to_numpy
from npformer.checks import non_negative_int, positive_int
from npformer.data.corpus import CharLMData, load_corpus
from npformer.data.tasks import TASKS, get_task
from npformer.data.vocab import BOS_ID, EOS_ID, SPECIALS, CharVocab
from npformer.errors import RangeError, ShapeError
from npformer.models.decoding import eval_mode, greedy_decode
from npformer.models.gpt import GPT, GPTConfig
from npformer.models.seq2seq import Seq2Seq, Seq2SeqConfig
from npformer.nn.attention import MultiheadAttention
from npformer.study.output import out_dir, pyplot, save_figure, write_csv, write_json
from npformer.training.trained_models import MASK_TOKEN, encode_masked, load_trained

SEQ2SEQ_TASKS = tuple(TASKS)            # every built-in seq2seq task (npformer.data.tasks)
DEFAULT_INPUTS = {"dates": "3rd of March 1997", "numbers": "twenty thousand and seventeen",
                  "copy": "abcdefghij", "reverse": "abcdefghij", "charlm": "The river ran"}
DEFAULT_TARGETS = {"dates": "1997-03-03", "numbers": "20017", "copy": "abcdefghij", "reverse": "jihgfedcba"}
GROUPS = {  # (kind, module attribute) -> (file/label key, what the axes hold)
    ("encoder", "self_attn"): ("encoder_self", "encoder self-attention"),
    ("decoder", "self_attn"): ("decoder_self", "decoder self-attention (causal)"),
    ("decoder", "multihead_attn"): ("decoder_cross", "decoder cross-attention"),
    ("gpt", "self_attn"): ("self", "self-attention (causal)"),
}
# checkpoint kinds -> how their attention is read: "seq2seq", "gpt" (causal) or "encoder" (bidirectional)
READS = {"seq2seq": "seq2seq", "gpt": "gpt", "gpt1": "gpt", "gpt2": "gpt", "bert": "encoder", "albert": "encoder"}


# -- recording -----------------------------------------------------------------------------------
@contextmanager
def record_attention(model):
    """Yields a list that fills with ``(module name, weights (B, H, Tq, Tk) host array)``, one per
    attention call, in call order. The wrapped modules compute the weights whatever their caller
    asked for, and hand them back only to a caller that asked (``need_weights=True``)."""
    records: list = []
    wrapped = []
    for name, mod in model.named_modules():
        if not isinstance(mod, MultiheadAttention) or any(m is mod for m in wrapped):   # ALBERT: one module, L names
            continue

        def forward(*args, _mod=mod, _name=name, **kwargs):
            wanted = kwargs.get("need_weights", True)
            average = kwargs.get("average_attn_weights", True)
            kwargs.update(need_weights=True, average_attn_weights=False)
            out, weights = type(_mod).forward(_mod, *args, **kwargs)              # (B, H, Tq, Tk)
            records.append((_name, to_numpy(weights)))
            if not wanted:
                return out, None
            return out, (weights.mean(axis=1) if average else weights)
        mod.forward = forward            # an instance attribute: Module.__call__ finds it before the class's
        wrapped.append(mod)
    try:
        yield records
    finally:
        for mod in wrapped:
            del mod.forward


# -- models and inputs ---------------------------------------------------------------------------
def _label(vocab: CharVocab, i: int) -> str:
    if i < len(SPECIALS):
        return SPECIALS[i]
    if i >= len(vocab):
        return MASK_TOKEN
    ch = vocab.symbols[i - len(SPECIALS)]
    return {" ": "␣", "\n": "\\n", "\t": "\\t"}.get(ch, ch)


def _encode(vocab: CharVocab, text: str, what: str) -> list[int]:
    if not isinstance(text, str) or not text:
        raise ValueError(f"{what}: expected a non-empty string, got {text!r}")
    return vocab.encode(vocab.check_text(text, what))


def load_model(checkpoint: str | None, task: str, args: argparse.Namespace):
    """``(kind, model, vocabularies, task name)``; kind "seq2seq", "gpt" or "encoder" (:data:`READS`).
    ``vocabularies`` is (src, tgt) for seq2seq and (vocab,) for the others."""
    backend = args.backend or "numpy"
    get_backend(backend)
    if checkpoint is not None:
        trained = load_trained(checkpoint, backend=backend, kinds=tuple(READS),
                               need="attention maps need a checkpoint of " + ", ".join(READS)
                                    + " from 'npformer train'")
        return READS[trained.kind], trained.model, trained.vocabs, trained.meta.get("train_config", {}).get("task", "")
    if task == "charlm":
        vocab = CharLMData(load_corpus(), block_size=args.block_size).vocab
        cfg = GPTConfig(vocab_size=len(vocab), block_size=args.block_size, n_layer=args.layers, n_head=args.heads,
                        d_model=args.d_model, dim_feedforward=args.ff, dropout=0.0)
        return "gpt", GPT(cfg, backend=backend, rng=args.seed), (vocab,), task
    if task not in SEQ2SEQ_TASKS:
        raise ValueError(f"--task: expected one of {[*SEQ2SEQ_TASKS, 'charlm']}, got {task!r}")
    t = get_task(task, n_train=1, n_valid=1)
    cfg = Seq2SeqConfig(src_vocab_size=len(t.src_vocab), tgt_vocab_size=len(t.tgt_vocab), d_model=args.d_model,
                        nhead=args.heads, num_encoder_layers=args.layers, num_decoder_layers=args.layers,
                        dim_feedforward=args.ff, dropout=0.0, max_len=args.block_size)
    return "seq2seq", Seq2Seq(cfg, backend=backend, rng=args.seed), (t.src_vocab, t.tgt_vocab), task


def attention_maps(kind: str, model, vocabs: tuple, text: str, target: str | None = None) -> dict:
    """Runs the model on ``text`` (and the decoder on ``<bos>`` + ``target``) and returns the tokens
    and, per attention module, its weights (H, Tq, Tk) with the query and key labels."""
    backend = model.backend
    if kind == "gpt":
        (vocab,) = vocabs
        ids = _encode(vocab, text, "input")
        if len(ids) > model.config.block_size:
            raise ValueError(f"input: {len(ids)} characters, but the model's context is block_size="
                             f"{model.config.block_size}")
        tokens = [_label(vocab, i) for i in ids]
        with eval_mode(model), record_attention(model) as rec:
            model(to_device(numpy.asarray([ids]), backend))
        result = {"kind": kind, "input": text, "tokens": tokens}
    elif kind == "encoder":
        (vocab,) = vocabs
        mask_id = len(vocab)                      # npformer train's [MASK]: one id after the characters
        if not isinstance(text, str) or not text:
            raise ValueError(f"input: expected a non-empty string, got {text!r}")
        ids = encode_masked(vocab, text, mask_id) if MASK_TOKEN in text else _encode(vocab, text, "input")
        if len(ids) > model.config.max_position_embeddings:
            raise ValueError(f"input: {len(ids)} characters, but the model reads at most "
                             f"max_position_embeddings={model.config.max_position_embeddings}")
        tokens = [_label(vocab, i) for i in ids]
        with eval_mode(model), record_attention(model) as rec:
            model(to_device(numpy.asarray([ids]), backend))
        result = {"kind": kind, "input": text, "tokens": tokens}
    else:
        src_vocab, tgt_vocab = vocabs
        src_ids = _encode(src_vocab, text, "input")
        limit = model.config.max_len
        if len(src_ids) > limit:
            raise ValueError(f"input: {len(src_ids)} characters, but the model's max_len is {limit}")
        src = to_device(numpy.asarray([src_ids]), backend)
        if target is None:        # the model's own output, without special tokens
            if limit < 2:         # <bos> fills the decoder's positions: greedy_decode's max_len would be 0
                raise RangeError(f"the model's max_len is {limit}, which leaves the decoder no position after "
                                 "<bos> to write its output in: give --target TEXT, or a model with max_len >= 2 "
                                 "(--block-size 2 or more for a fresh one)")
            out = greedy_decode(model, src, bos_id=BOS_ID, eos_id=EOS_ID, max_len=min(limit - 1, 48))[0]
            target = "".join(tgt_vocab.symbols[i - len(SPECIALS)] for i in out if i >= len(SPECIALS))
        tgt_ids = _encode(tgt_vocab, target, "target") if target else []
        tgt_in = [BOS_ID] + tgt_ids
        if len(tgt_in) > limit:
            raise ValueError(f"target: {len(tgt_in)} tokens with <bos>, but the model's max_len is {limit}")
        src_tokens = [_label(src_vocab, i) for i in src_ids]
        tgt_tokens = [_label(tgt_vocab, i) for i in tgt_in]
        with eval_mode(model), record_attention(model) as rec:
            model(src, to_device(numpy.asarray([tgt_in]), backend))
        result = {"kind": kind, "input": text, "target": target, "source_tokens": src_tokens,
                  "target_tokens": tgt_tokens}
    maps, calls = [], {}
    for name, w in rec:
        attr = name.split(".")[-1]
        stack = kind if kind in ("gpt", "encoder") else ("encoder" if ".encoder." in f".{name}." else "decoder")
        if (stack, attr) not in GROUPS:
            raise ValueError(f"unexpected attention module {name!r}")
        key, label = GROUPS[(stack, attr)]
        layer = calls[key] = calls.get(key, -1) + 1     # layers run in order; a shared layer once per use
        if kind in ("gpt", "encoder"):
            q = k = result["tokens"]
        elif stack == "encoder":
            q = k = src_tokens
        else:
            q, k = tgt_tokens, (tgt_tokens if attr == "self_attn" else src_tokens)
        maps.append({"module": name, "group": key, "label": label, "layer": layer,
                     "queries": q, "keys": k, "weights": w[0]})                       # (H, Tq, Tk)
    if not maps:
        raise RuntimeError("no attention weights were recorded: the model's layers did not call their "
                           "MultiheadAttention modules")
    result["maps"] = maps
    return result


# -- summaries -----------------------------------------------------------------------------------
def head_summaries(maps: list[dict]) -> list[dict]:
    """One row per (module, head, query): entropy in bits, the visible keys, the most attended key."""
    rows = []
    for m in maps:
        w = m["weights"]                                                          # (H, Tq, Tk)
        for h in range(w.shape[0]):
            for qi in range(w.shape[1]):
                row = w[h, qi]
                if row.sum() == 0:                                                # every key masked
                    continue
                nz = row[row > 0]
                top = int(row.argmax())
                rows.append({"group": m["group"], "layer": m["layer"], "head": h, "query": qi,
                             "query_token": m["queries"][qi], "top_key": top, "top_key_token": m["keys"][top],
                             "top_weight": float(row[top]), "entropy_bits": float(-(nz * numpy.log2(nz)).sum()),
                             "uniform_bits": math.log2(int((row > 0).sum()))})
    return rows


def _print_summary(result: dict, rows: list[dict], show: int = 32) -> None:
    by_head: dict = {}
    for r in rows:
        by_head.setdefault((r["group"], r["layer"], r["head"]), []).append(r)
    labels = {m["group"]: m["label"] for m in result["maps"]}
    order = [key for key, _ in GROUPS.values()]
    current = None
    for (group, layer, head), rs in sorted(by_head.items(), key=lambda kv: (order.index(kv[0][0]), *kv[0][1:])):
        if group != current:
            print(f"\n{labels[group]}: mean entropy in bits (of a uniform row over the visible keys), then "
                  "query→its most attended key")
            current = group
        ent = numpy.mean([r["entropy_bits"] for r in rs])
        uni = numpy.mean([r["uniform_bits"] for r in rs])
        tops = " ".join(f"{r['query_token']}→{r['top_key_token']}" for r in rs[:show])
        more = f" … (+{len(rs) - show} queries: attention_summary.csv)" if len(rs) > show else ""
        print(f"  layer {layer} head {head}: {ent:.2f} bits ({uni:.2f})  {tops}{more}")


def _plot(plt, maps: list[dict], group: str, label: str, path: Path, title: str):
    ms = [m for m in maps if m["group"] == group]
    layers = sorted({m["layer"] for m in ms})
    heads = ms[0]["weights"].shape[0]
    tq, tk = ms[0]["weights"].shape[1:]
    cell = max(2.2, 0.2 * max(tq, tk))
    fig, axes = plt.subplots(len(layers), heads, figsize=(cell * heads + 1, cell * len(layers) + 0.8),
                             squeeze=False)
    top = max(float(m["weights"].max()) for m in ms)       # one colour scale for every panel
    for m in ms:
        row = layers.index(m["layer"])
        for h in range(heads):
            ax = axes[row][h]
            im = ax.imshow(m["weights"][h], cmap="viridis", vmin=0, vmax=top, aspect="auto")
            ax.set_xticks(range(tk), m["keys"], fontsize=7, rotation=90)
            ax.set_yticks(range(tq), m["queries"], fontsize=7)
            ax.set_title(f"layer {m['layer']} head {h}", fontsize=9)
    fig.suptitle(f"{label}: {title}", fontsize=10)
    fig.supxlabel("key", fontsize=9)
    fig.supylabel("query", fontsize=9)
    fig.tight_layout()
    fig.colorbar(im, ax=axes, shrink=0.6, fraction=0.02, pad=0.02, label="attention weight")
    return save_figure(fig, path)


# -- the command ---------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", metavar="PATH", help="a checkpoint from 'npformer train' (seq2seq, gpt, "
                   "gpt1, gpt2, bert or albert); without it, a freshly initialised model for --task")
    p.add_argument("--input", metavar="TEXT", help="the text to attend over (default: an example for the task)")
    p.add_argument("--target", metavar="TEXT", help="seq2seq: the decoder's text (default: the model's "
                   "greedy output for --input; for a fresh model and the default input, the right answer)")
    p.add_argument("--task", default="dates", choices=[*SEQ2SEQ_TASKS, "charlm"],
                   help="fresh model only: a Seq2Seq for a task, or a GPT for charlm (default dates)")
    p.add_argument("--d-model", type=int, default=128, dest="d_model", help="fresh model width (default 128)")
    p.add_argument("--heads", type=int, default=4, help="fresh model heads (default 4)")
    p.add_argument("--layers", type=int, default=2, help="fresh model layers (default 2)")
    p.add_argument("--ff", type=int, default=256, help="fresh model feed-forward width (default 256)")
    p.add_argument("--block-size", type=int, default=64, dest="block_size",
                   help="fresh model's longest input (default 64)")
    p.add_argument("--seed", type=int, default=0, help="fresh model initialisation (default 0)")
    p.add_argument("--backend", choices=["numpy", "cupy"])


def run(args: argparse.Namespace) -> int:
    for name in ("d_model", "heads", "layers", "ff", "block_size"):
        positive_int(getattr(args, name), "--" + name.replace("_", "-"))
    non_negative_int(args.seed, "--seed")
    if args.checkpoint is None and args.d_model % args.heads:
        raise ShapeError(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
    kind, model, vocabs, task = load_model(args.checkpoint, args.task, args)
    text = args.input if args.input is not None else DEFAULT_INPUTS.get(task)
    if text is None:
        raise ValueError(f"no default input for a model trained on {task!r}: give --input TEXT")
    if kind != "seq2seq" and args.target is not None:
        raise ValueError(f"--target is for Seq2Seq models; a {'GPT' if kind == 'gpt' else 'BERT or ALBERT'} "
                         "attends over --input only")
    target = args.target
    if target is None and kind == "seq2seq" and args.checkpoint is None and args.input is None:
        target = DEFAULT_TARGETS[task]           # an untrained model's own output is noise
    result = attention_maps(kind, model, vocabs, text, target)
    if kind == "seq2seq" and not result["target"]:
        print("note: the model's greedy output holds no symbols, so the decoder reads <bos> alone; "
              "give --target TEXT to see it attend over a target")
    rows = head_summaries(result["maps"])
    source = f"checkpoint {args.checkpoint}" if args.checkpoint else f"a fresh model (seed {args.seed})"
    out = out_dir(args.out)
    meta = {k: v for k, v in result.items() if k != "maps"}
    files = [write_json(out / "attention.json", {
                 **meta, "model": kind, "checkpoint": args.checkpoint, "task": task,
                 "maps": [{**{k: v for k, v in m.items() if k != "weights"},
                           "weights": m["weights"].astype(numpy.float64).round(6)} for m in result["maps"]]}),
             write_csv(out / "attention_summary.csv", rows)]
    print(f"attention of {source} ({kind}, task {task or '?'}) on {text!r}"
          + (f" -> {result['target']!r}" if kind == "seq2seq" else ""))
    _print_summary(result, rows)
    plt = pyplot()
    if plt is not None:
        title = repr(text) + (f" -> {result['target']!r}" if kind == "seq2seq" else "")
        seen = []
        for m in result["maps"]:
            if m["group"] not in seen:
                seen.append(m["group"])
                files.append(_plot(plt, result["maps"], m["group"], m["label"],
                                   out / f"attention_{m['group']}.png", title))
    for f in files:
        print(f"  wrote {f}")
    return 0
