"""``npformer study albert``: where BERT's parameters are, and what ALBERT's two reductions remove
(Lan et al. 2019, sections 3.1-3.2 and Table 4).

For each shape, BERT and ALBERT with each cross-layer sharing mode (none, all, attention, ffn), with
the factorised embedding (tables V x E, then an E x H mapping) and without it (tables V x H). The
counts come from the closed form (:func:`npformer.models.albert.parameter_count`) split by part, and
every model small enough (``--build-limit``) is also built and its ``num_parameters()`` compared
with the formula (a mismatch is an error). The MLM head is left out, as in the paper's counts.

Two lessons stand out: at BERT-base size the V x H table is a fifth of the model and E = 128 takes
it down to a sixth of itself; sharing all layers divides the encoder by L. At the size of the
character models trained here (V of about 64) the table is small and sharing is what counts.
"""
from __future__ import annotations

import argparse

from npformer.checks import real
from npformer.models.albert import SHARE_MODES, ALBERT, ALBERTConfig, parameter_count
from npformer.models.bert import BERT
from npformer.study.output import legend_below, out_dir, pyplot, save_figure, write_csv, write_json

# name -> (vocabulary V, hidden H, layers L, heads, feed-forward F, positions P, embedding E)
SHAPES = {
    "char": (64, 128, 2, 4, 256, 64, 32),          # npformer train --model albert --embedding-size 32
    "small": (8000, 256, 4, 4, 1024, 512, 64),
    "base": (30000, 768, 12, 12, 3072, 512, 128),  # BERT-base / ALBERT-base
    "large": (30000, 1024, 24, 16, 4096, 512, 128),
}
PARTS = ("tables", "mapping", "attention", "ffn", "norms", "pooler")
PART_NAMES = {"tables": "embedding tables", "mapping": "E -> H mapping", "attention": "attention",
              "ffn": "feed-forward", "norms": "layer norms", "pooler": "pooler"}     # in the plot


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", nargs="+", default=["char", "base"], choices=sorted(SHAPES),
                   help="which shapes to count (default: char base); " + "; ".join(
                       f"{k}: V={v[0]} H={v[1]} L={v[2]} F={v[4]} E={v[6]}" for k, v in SHAPES.items()))
    p.add_argument("--build-limit", type=float, default=2e8, dest="build_limit", metavar="N",
                   help="also build every model with at most N parameters and check its count against "
                        "the closed form (default 2e8; 0: closed form only)")


def configs(shape: str) -> list[tuple[str, object]]:
    """(label, config) for BERT and the eight ALBERT variants of ``shape``."""
    v, h, n, heads, f, p, e = SHAPES[shape]
    base = ALBERTConfig(vocab_size=v, embedding_size=None, hidden_size=h, num_hidden_layers=n,
                        num_attention_heads=heads, intermediate_size=f, max_position_embeddings=p)
    out = [("BERT", base.as_bert())]
    for emb in (None, e):
        for share in SHARE_MODES:
            cfg = ALBERTConfig(**{**base.to_dict(), "embedding_size": emb, "share": share})
            out.append((f"ALBERT E={emb or 'H'} share={share}", cfg))
    return out


def _built_count(config, dtype="float16") -> int:
    """Parameters of the model actually built (float16: counting only, half the memory)."""
    model = (ALBERT if isinstance(config, ALBERTConfig) else BERT)(config, dtype=dtype, rng=0)
    return model.num_parameters()


def measure(shapes: list[str], build_limit: float) -> list[dict]:
    rows = []
    for shape in shapes:
        bert_total = None
        for label, cfg in configs(shape):
            counts = parameter_count(cfg)
            bert_total = bert_total or counts["total"]
            built = _built_count(cfg) if counts["total"] <= build_limit else None
            if built is not None and built != counts["total"]:
                raise RuntimeError(f"{shape} {label}: the built model has {built:,} parameters but the "
                                   f"closed form gives {counts['total']:,}")
            albert = isinstance(cfg, ALBERTConfig)
            v, h, n, _, f, _, e = SHAPES[shape]
            rows.append({"shape": shape, "model": label, "vocab": v, "hidden": h, "layers": n, "ff": f,
                         "embedding": cfg.embedding_dim if albert else h,
                         "factorised": bool(albert and cfg.factorised),
                         "share": cfg.share if albert else "none",
                         **{k: counts[k] for k in PARTS}, "total": counts["total"],
                         "built": "" if built is None else built,
                         "fraction_of_bert": counts["total"] / bert_total})
    return rows


def run(args: argparse.Namespace) -> int:
    real(args.build_limit, "--build-limit", 0)
    rows = measure(list(dict.fromkeys(args.shapes)), args.build_limit)
    out = out_dir(args.out)
    files = [write_csv(out / "albert_params.csv", rows),
             write_json(out / "albert_params.json", {"shapes": {k: dict(zip(
                 ("vocab", "hidden", "layers", "heads", "ff", "positions", "embedding"), SHAPES[k]))
                 for k in dict.fromkeys(args.shapes)}, "parts": list(PARTS), "rows": rows})]
    plt = pyplot()
    if plt is not None:
        files.append(_plot(plt, rows, out / "albert_params.png"))
    for shape in dict.fromkeys(args.shapes):
        v, h, n, heads, f, p, e = SHAPES[shape]
        mine = [r for r in rows if r["shape"] == shape]
        scale, unit = (1e6, "M") if mine[0]["total"] >= 1e6 else (1e3, "k")
        print(f"{shape}: V={v} H={h} L={n} heads={heads} F={f} P={p} E={e} (parameters in {unit})")
        print(f"  {'model':28} " + " ".join(f"{k:>9}" for k in (*PARTS, "total")) + "   of BERT  built")
        for r in mine:
            check = "not built" if r["built"] == "" else "= closed form"
            print(f"  {r['model']:28} " + " ".join(f"{r[k] / scale:>9.2f}" for k in (*PARTS, "total"))
                  + f"  {r['fraction_of_bert']:>7.1%}  {check}")
    for f in files:
        print(f"  wrote {f}")
    return 0


def _plot(plt, rows, path):
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(6.5 * len(shapes), 5.2), squeeze=False, layout="constrained")
    colours = dict(zip(PARTS, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:gray")))
    for ax, shape in zip(axes[0], shapes):
        mine = [r for r in rows if r["shape"] == shape][::-1]            # BERT at the top
        scale = 1e6 if mine[-1]["total"] >= 1e6 else 1e3
        left = [0.0] * len(mine)
        for part in PARTS:
            widths = [r[part] / scale for r in mine]
            ax.barh(range(len(mine)), widths, left=left, color=colours[part], label=PART_NAMES[part])
            left = [a + b for a, b in zip(left, widths)]
        for i, r in enumerate(mine):
            ax.text(left[i], i, f" {r['total'] / scale:,.1f}", va="center", fontsize=8)
        ax.set_yticks(range(len(mine)), [r["model"] for r in mine], fontsize=8)
        ax.set_xlabel(f"parameters ({'millions' if scale == 1e6 else 'thousands'})")
        v, h, n, _, f, _, e = SHAPES[shape]
        ax.set_title(f"{shape}: V={v}, H={h}, L={n}, E={e}")
        ax.set_xlim(0, max(left) * 1.18)
    legend_below(axes[0][0], ncol=3)
    fig.suptitle("BERT against ALBERT: factorised embedding and cross-layer sharing")
    return save_figure(fig, path)
