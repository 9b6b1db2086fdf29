"""``npformer study positional``: the paper's sinusoidal encoding (Vaswani et al. 2017, sec. 3.5).

    PE[pos, 2i] = sin(pos / 10000^(2i/d)),   PE[pos, 2i+1] = cos(pos / 10000^(2i/d))

Two pictures: the table itself (position x dimension), and the dot products PE[p] . PE[q]
between positions, which depend only on p - q (sum_i cos((p - q) w_i)) and fall off with the
distance, so a model can read relative position from them.
"""
from __future__ import annotations

import argparse

import numpy

from npformer.checks import positive_int
from npformer.errors import RangeError
from npformer.nn.embedding import sinusoidal_table
from npformer.study.output import out_dir, pyplot, save_figure, write_csv, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--positions", type=int, default=128, help="number of positions, >= 2 (default 128)")
    p.add_argument("--d-model", type=int, default=128, dest="d_model", help="encoding width, >= 2 (default 128)")


def measure(positions: int, d_model: int) -> dict:
    pe = sinusoidal_table(positions, d_model, dtype="float64", backend="numpy")      # (P, d)
    sim = pe @ pe.T                                                                   # (P, P)
    # the dot product depends only on the offset: compare every row with the first row's profile
    offsets = numpy.arange(positions)
    profile = sim[0]                                                                  # (P,) at offset k
    shift_err = max(float(numpy.abs(sim[p, p:] - profile[:positions - p]).max())
                    for p in range(positions))
    return {"table": pe, "similarity": sim, "offsets": offsets, "profile": profile,
            "max_shift_error": shift_err}


def run(args: argparse.Namespace) -> int:
    for name, value in (("--positions", args.positions), ("--d-model", args.d_model)):
        if positive_int(value, name) < 2:         # a similarity between positions needs two of each
            raise RangeError(f"{name}: expected an int >= 2, got {value}")
    m = measure(args.positions, args.d_model)
    out = out_dir(args.out)
    files = [write_csv(out / "positional_similarity.csv",
                       ({"offset": int(k), "dot_product": float(v)} for k, v in zip(m["offsets"], m["profile"]))),
             write_json(out / "positional.json", {"positions": args.positions, "d_model": args.d_model,
                                                  "max_shift_error": m["max_shift_error"],
                                                  "dot_product_by_offset": m["profile"]})]
    plt = pyplot()
    if plt is not None:
        fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")   # (room for each colour bar label)
        im = a.imshow(m["table"], aspect="auto", cmap="RdBu", vmin=-1, vmax=1)
        a.set(title="sinusoidal encoding PE[pos, i]", xlabel="dimension i", ylabel="position")
        fig.colorbar(im, ax=a, label="PE[pos, i]")
        im = b.imshow(m["similarity"], cmap="viridis")
        b.set(title="PE[p] . PE[q]", xlabel="position q", ylabel="position p")
        fig.colorbar(im, ax=b, label="dot product PE[p] . PE[q]")
        files.append(save_figure(fig, out / "positional.png"))
    near, far = m["profile"][1], m["profile"][-1]
    print(f"positional encoding: {args.positions} positions x {args.d_model} dimensions")
    print(f"  PE[p] . PE[p+k] depends only on k (largest deviation over p: {m['max_shift_error']:.1e})")
    print(f"  offset 0: {m['profile'][0]:.2f} (= d/2), offset 1: {near:.2f}, "
          f"offset {args.positions - 1}: {far:.2f}")
    for f in files:
        print(f"  wrote {f}")
    return 0
