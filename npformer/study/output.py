"""Where an experiment's files go and how they are written: CSV and JSON always, PNG with matplotlib,
each through a temporary renamed over its path (:mod:`npformer.files`), so a full disk leaves no
half-written file and ends in one error naming it.

Host-only code (files and plots), so plain NumPy is fine here.
"""
from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy

from npformer.errors import WriteError
from npformer.files import os_reason, write_text_atomically, written_atomically

__all__ = ["out_dir", "write_csv", "write_json", "pyplot", "legend_below", "save_figure"]


def out_dir(path: str | os.PathLike) -> Path:
    """``path`` as a directory, created if needed."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise WriteError(f"could not create the output directory {p}: {os_reason(exc)}") from exc
    return p


def _plain(v: Any) -> Any:
    """NumPy scalars and arrays as Python numbers and lists, for JSON."""
    if isinstance(v, numpy.generic):
        return v.item()
    if isinstance(v, numpy.ndarray):
        return v.tolist()
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def write_csv(path: str | os.PathLike, rows: Iterable[Mapping[str, Any]]) -> Path:
    """Rows of equal keys as a CSV with a header line, written whole or not at all; returns the path."""
    rows = [dict(r) for r in rows]
    if not rows:
        raise ValueError(f"no rows to write to {path}")
    text = io.StringIO(newline="")
    w = csv.DictWriter(text, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows({k: _plain(v) for k, v in r.items()} for r in rows)
    return write_text_atomically(path, text.getvalue(), "CSV file")


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """``data`` as indented JSON, written whole or not at all; returns the path."""
    return write_text_atomically(path, json.dumps(_plain(data), indent=2) + "\n", "JSON file")


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a note) when matplotlib is absent."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('note: matplotlib is not installed, so no PNG is written (pip install "npformer[plot]")')
        return None
    return plt


def legend_below(ax, ncol: int = 1, **kwargs):
    """The legend of ``ax`` under its x label, outside the data, so no curve, bar or label runs through
    it whatever the data look like (a figure made with ``layout="constrained"`` makes room for it)."""
    return ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=ncol, fontsize=8, frameon=False,
                     **kwargs)


def save_figure(fig, path: str | os.PathLike) -> Path:
    """``fig`` as a PNG at ``path``, written whole or not at all, then closed; returns the path."""
    with written_atomically(path, "figure") as f:
        fig.savefig(f, format="png", dpi=120, bbox_inches="tight")
    import matplotlib.pyplot as plt
    plt.close(fig)
    return Path(path)
