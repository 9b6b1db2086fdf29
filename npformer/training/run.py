"""The run directory of ``npformer train`` (nanoGPT's ``out_dir``): what a run leaves behind.

    runs/dates-seq2seq/            the default: runs/TASK-MODEL under the working directory (--out-dir)
        config.json                the effective config, every field of the run's TrainConfig (what
                                   ``npformer train --config FILE`` reads back)
        metrics.jsonl              one JSON object a line, in step order: {"split": "train", ...} every
                                   --log-every steps, {"split": "valid", ...} at each evaluation
        last.npz                   the latest checkpoint (every --checkpoint-every steps and at the end):
                                   ``npformer train --resume`` continues from it
        best.npz                   the checkpoint of the lowest validation loss so far: what
                                   ``npformer translate|generate|eval --checkpoint runs/dates-seq2seq`` read

A training line holds the step, the mean training loss of the steps since the last line (``loss``),
the learning rate of the step, the mean global gradient norm before clipping (``grad_norm``), the
training throughput of those steps (``tokens_per_s``, evaluation time excluded) and the seconds since
the run (or its resumption) started (``time_s``). A validation line holds the step, the trainer's
scalar figures (``loss``, and ``exact_match``, ``bits_per_char``, ``accuracy``, ... by task), ``final``
(true for the evaluation on the whole held-out set at the end; the periodic ones, and the last one under
``--no-final-eval``, read its first ``--eval-limit`` examples or blocks, 300 by default) and ``best``
(true when it wrote best.npz). A step whose gradients are not finite (float16 mixed precision skips
it and halves its loss scale) is counted in the training line's ``skipped``, not in its ``grad_norm``
(``NaN``, JSON's usual extension, when every step of the line was skipped).

``--log-to csv`` writes the same records as ``train.csv`` and ``valid.csv`` too, ``--log-to
tensorboard`` as TensorBoard scalars under ``tensorboard/`` (:data:`SINKS`).

A fixed name per task and model, not a timestamp, so the README's next command can name the run.
A run never replaces another run's files: ``npformer train`` into a directory that holds a run (any
of the files above, :meth:`RunDirectory.files`) is refused before any work
(:func:`npformer.training.resume.check_run_target`) unless it continues that run (``--resume``) or
the user asks to train afresh over it (``--overwrite``, which removes the earlier run's files when
the new run starts, as Hugging Face's ``overwrite_output_dir`` lets a run replace its folder's);
``--out-dir`` keeps runs apart. A resumed run keeps the metrics up to its checkpoint's step and
appends to them.

Every file is written through :mod:`npformer.files`: config.json and the kept metrics replace their
files whole, and a record that cannot be appended (a full disk) is a
:class:`~npformer.errors.WriteError` naming the file, never a traceback; what was written of it is
cut off again (:func:`npformer.files.append_whole`), so the file never ends in half a line.

This module reads and writes files only; it imports no model and no trainer (the command line uses
it to find a run's checkpoint), and matplotlib only inside :func:`plot_metrics`.
"""
from __future__ import annotations

import csv
import io
import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from npformer.errors import MissingExtraError, RangeError, WriteError
from npformer.files import append_whole, os_reason, read_json, read_text, write_text_atomically, written_atomically

__all__ = ["RunDirectory", "CSVSink", "TensorBoardSink", "SINKS", "default_out_dir", "checkpoint_file", "read_metrics",
           "PLOTTED", "plot_metrics", "scalars", "check_not_a_run_file"]

RUNS = "runs"                 # the folder, under the working directory, that holds the runs by default
SPLITS = ("train", "valid")   # the records' "split"


def default_out_dir(task: str, model: str) -> str:
    """The run directory of ``--task task --model model`` when ``--out-dir`` is not given."""
    return f"{RUNS}/{task}-{model}"


class CSVSink:
    """The metrics as ``train.csv`` and ``valid.csv`` in the run directory, a row a record, the columns
    of each split's records (the same for every record of a split in one run)."""

    def __init__(self, path: Path):
        self.files = dict(zip(SPLITS, self.written(path)))

    @staticmethod
    def written(path: Path) -> list[Path]:
        """The files this sink writes in the run directory ``path``."""
        return [path / f"{split}.csv" for split in SPLITS]

    def check_paths(self) -> None:
        for file in self.files.values():
            if file.exists() and not file.is_file():
                raise RangeError(f"{file} is a directory, where --log-to csv writes the run's metrics; move it, "
                                 "or give another --out-dir")

    def start(self, kept: list[dict]) -> None:
        for file in self.files.values():
            file.unlink(missing_ok=True)
        for record in kept:
            self.record(record)

    def record(self, record: dict) -> None:
        file = self.files[record["split"]]
        row = {k: v for k, v in record.items() if k != "split"}
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=list(row), extrasaction="ignore")
        if not file.exists() or file.stat().st_size == 0:     # (0: a first row that could not be written)
            writer.writeheader()
        writer.writerow(row)
        append_whole(file, text.getvalue().encode("utf-8"))


class TensorBoardSink:
    """The metrics as TensorBoard scalars, ``train/loss``, ``valid/exact_match``, ..., in event files
    under ``tensorboard/`` in the run directory (``tensorboard --logdir runs``), written by the
    ``tensorboard`` package (the optional extra; no TensorFlow, no PyTorch)."""

    def __init__(self, path: Path):
        try:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            raise RangeError("--log-to tensorboard needs the tensorboard package: "
                             'pip install "npformer[tensorboard]"') from None
        self.folder, self._event, self._summary, self._writer_type = path / "tensorboard", Event, Summary, EventFileWriter
        self.writer = None

    @staticmethod
    def written(path: Path) -> list[Path]:
        """The event files of earlier runs in the run directory ``path`` (each run adds one)."""
        return sorted((path / "tensorboard").glob("events.out.tfevents.*"))

    def check_paths(self) -> None:
        if self.folder.exists() and not self.folder.is_dir():
            raise RangeError(f"{self.folder} is a file, where --log-to tensorboard writes its event files; move "
                             "it, or give another --out-dir")

    def start(self, kept: list[dict]) -> None:
        self.writer = self._writer_type(str(self.folder))   # a new event file; a resumed run's earlier ones stay

    def record(self, record: dict) -> None:
        values = [self._summary.Value(tag=f"{record['split']}/{k}", simple_value=float(v))
                  for k, v in record.items() if k not in ("split", "step") and isinstance(v, (int, float))]
        self.writer.add_event(self._event(wall_time=time.time(), step=int(record["step"]),
                                          summary=self._summary(value=values)))
        self.writer.flush()                                  # a crash loses nothing written


SINKS = {"csv": CSVSink, "tensorboard": TensorBoardSink}       # --log-to NAME


class RunDirectory:
    """The files of one run (see the module docstring); nothing is written until :meth:`start`.
    ``log_to`` names a second sink of the metrics (:data:`SINKS`: ``csv``, ``tensorboard``)."""

    def __init__(self, path: str | Path, log_to: str | None = None):
        self.path = Path(path)
        self.config = self.path / "config.json"
        self.metrics = self.path / "metrics.jsonl"
        self.last = self.path / "last.npz"
        self.best = self.path / "best.npz"
        self.sinks = [SINKS[log_to](self.path)] if log_to else []

    def files(self) -> list[Path]:
        """The files of a run that are in the directory now, every sink's included: what a new run
        there would replace."""
        ours = [self.config, self.metrics, self.last, self.best, *(f for sink in SINKS.values()
                                                                     for f in sink.written(self.path))]
        return [f for f in ours if f.is_file()]

    def check_paths(self) -> None:
        """Refuse, before the run, a directory where a file of the run goes (``train.csv`` made a
        folder) or a folder where the directory goes: the message names the path."""
        if self.path.exists() and not self.path.is_dir():
            raise RangeError(f"the run directory {self.path} is a file; expected a directory (created if needed)")
        for sink in self.sinks:
            sink.check_paths()
        for f in (self.config, self.metrics, self.last, self.best):
            if f.exists() and not f.is_file():
                raise RangeError(f"{f} is a directory, where the run writes its {f.name}; move it, or give "
                                 "another --out-dir")

    def saved_config(self) -> dict | None:
        """The config.json of the run in the directory (the effective config), None without one."""
        if not self.config.is_file():
            return None
        return read_json(self.config, f"the run's config {self.config}")

    def start(self, config: Any, step: int) -> None:
        """Write ``config`` (a dataclass) as config.json, and keep the metrics of steps up to ``step``
        (none for a new run, those before the checkpoint for a resumed one), in every sink."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise WriteError(f"could not create the run directory {self.path}: {os_reason(exc)}") from exc
        write_text_atomically(self.config, json.dumps(asdict(config), indent=2) + "\n", "config")
        kept = [r for r in read_metrics(self.metrics) if r["step"] <= step] if step and self.metrics.exists() else []
        write_text_atomically(self.metrics, "".join(json.dumps(r) + "\n" for r in kept), "metrics")
        for sink in self.sinks:
            self._writing(sink.start, kept)

    def record(self, record: dict) -> None:
        """Append one line to metrics.jsonl (opened and closed each time: a crash loses nothing written),
        and the record to each sink."""
        self._writing(self._append, record)
        for sink in self.sinks:
            self._writing(sink.record, record)

    def _append(self, record: dict) -> None:
        append_whole(self.metrics, (json.dumps(record) + "\n").encode("utf-8"))

    def _writing(self, write, *args) -> None:
        """``write(*args)``, an ``OSError`` (a full disk) turned into a WriteError naming the run's file."""
        try:
            write(*args)
        except OSError as exc:
            where = f" {exc.filename}" if getattr(exc, "filename", None) else f" in {self.path}"
            raise WriteError(f"could not write the run's metrics{where}: {os_reason(exc)}") from exc


def check_not_a_run_file(path: str | Path, run: RunDirectory | None = None, *, resumed: bool = False) -> None:
    """Refuse a checkpoint path (``--checkpoint``) that names the config.json, metrics.jsonl, best.npz or
    a ``--log-to`` file of ``run`` (the run's own directory: written already or not yet) or of the folder
    it lies in when that holds a run: the checkpoint would replace it, and the run could not be resumed
    or plotted. A last.npz is allowed (the same file written once, or a run's latest checkpoint).
    Paths are compared resolved (``X/./best.npz``, a symbolic link, another spelling of the folder).
    ``resumed``: the run continues from ``path`` (``--resume --checkpoint``), and would write to it."""
    target = Path(path).resolve()
    folder = RunDirectory(Path(path).parent)
    for directory in ([run] if run is not None else []) + ([folder] if folder.files() else []):
        sinks = [f for sink in SINKS.values() for f in sink.written(directory.path)]
        own = next((f for f in (directory.config, directory.metrics, directory.best, *sinks)
                    if f.resolve() == target), None)
        if own is None:
            continue
        where = f"the {own.name} of the run directory {directory.path}"
        if resumed:
            raise RangeError(f"--resume --checkpoint {path}: a resumed run writes its checkpoints to the "
                             f"--checkpoint it continues from, and this is {where}; continue from its last.npz "
                             f"(--resume --out-dir {directory.path}), or from a copy of {own.name} outside it")
        mine = directory is run
        raise RangeError(f"--checkpoint {path} is {where}{', which the run writes itself' if mine else ''}: the "
                         f"checkpoint would replace it; give a file outside {directory.path}"
                         + (" (the run's latest checkpoint is its last.npz already)" if mine else ""))


def checkpoint_file(path: str | Path, which: str = "best") -> Path:
    """The checkpoint ``path`` names: itself when it is not a directory, else the run directory's
    ``best.npz`` (``which="best"``, falling back to ``last.npz`` when no evaluation has written one
    yet) or ``last.npz`` (``which="last"``, what a resumed run continues from)."""
    p = Path(path)
    if not p.is_dir():
        return p
    run = RunDirectory(p)
    for candidate in ((run.best, run.last) if which == "best" else (run.last,)):
        if candidate.is_file():
            return candidate
    wanted = "best.npz or last.npz" if which == "best" else "last.npz"
    raise FileNotFoundError(f"{path} is a directory without {wanted}: expected a checkpoint file or the run "
                            "directory of an npformer train run")


def scalars(result: dict) -> dict[str, float]:
    """The numbers among an evaluation's results (its loss, score, counts), without the texts and lists."""
    return {k: (v if isinstance(v, int) else float(v)) for k, v in result.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


# the fields of each split's records that npformer plot draws: each must be a number (NaN included)
PLOTTED = {"train": ("loss", "lr", "grad_norm"), "valid": ("loss",)}


def read_metrics(path: str | Path, numbers: dict[str, tuple[str, ...]] | None = None) -> list[dict]:
    """The records of a metrics file, or of the metrics.jsonl of the run directory ``path``; each
    must have an integer ``step``, and each record of a split in ``numbers`` (``{"train": ("loss",
    ...)}``, :data:`PLOTTED`) those fields as numbers. A RangeError names the file, the line and the field."""
    p = Path(path)
    if p.is_dir():
        p = RunDirectory(p).metrics
    if not p.is_file():
        raise FileNotFoundError(f"{path}: no metrics file (expected a run directory of npformer train, with "
                                "metrics.jsonl, or such a file)")
    records = []
    what = ("not a metrics file (metrics.jsonl holds one JSON record a line, each with its integer 'step'; "
            "give the run directory or its metrics.jsonl)")
    for number, line in enumerate(read_text(p, f"the metrics file {p}").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RangeError(f"{p}: {what}; line {number} is not a JSON record ({exc.msg})") from None
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            raise RangeError(f"{p}: {what}; line {number} has no integer 'step': {line[:60]!r}")
        for field in (numbers or {}).get(record.get("split"), ()):
            value = record.get(field)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                got = f"has no {field!r}" if field not in record else f"has {field!r} {json.dumps(value)[:40]}"
                raise RangeError(f"{p}: line {number}, a {record['split']} record, {got}; expected a number there, as "
                                 "npformer train writes it")
        records.append(record)
    return records


def plot_metrics(path: str | Path, out: str | Path | None = None) -> Path:
    """Draw a run's training and validation loss, learning rate and gradient norm against the step,
    three panels in one PNG (default: ``metrics.png`` in the run directory); returns its path.
    Needs matplotlib (``pip install "npformer[plot]"``); without it, an ImportError saying so."""
    records = read_metrics(path, numbers=PLOTTED)
    train = [r for r in records if r.get("split") == "train"]
    if not train:
        raise RangeError(f"{path}: the metrics hold no training line yet; nothing to plot")
    try:
        from matplotlib.figure import Figure            # no pyplot: no global state, no display needed
        from matplotlib.ticker import FormatStrFormatter
    except ImportError:
        raise MissingExtraError('npformer plot needs matplotlib: pip install "npformer[plot]"') from None
    valid = [r for r in records if r.get("split") == "valid"]
    steps = [r["step"] for r in train]
    fig = Figure(figsize=(12, 3.6), layout="constrained")
    loss, lr, norm = fig.subplots(1, 3)
    loss.plot(steps, [r["loss"] for r in train], label="training (mean of each --log-every steps)")
    if valid:
        loss.plot([r["step"] for r in valid], [r["loss"] for r in valid], "o-", label="validation")
    loss.set(title="Loss", xlabel="step", ylabel="cross-entropy (nats)")
    loss.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2))     # below the axes: never over a curve
    lr.plot(steps, [r["lr"] for r in train], color="tab:green")
    lr.set(title="Learning rate (warm-up, then cosine)", xlabel="step", ylabel="learning rate")
    lr.yaxis.set_major_formatter(FormatStrFormatter("%.1e"))    # on each tick: no offset text under the title
    finite = [(s, r["grad_norm"]) for s, r in zip(steps, train) if math.isfinite(r["grad_norm"])]
    norm.plot([s for s, _ in finite], [g for _, g in finite], color="tab:red")
    norm.set(title="Gradient norm before clipping", xlabel="step", ylabel="global L2 norm")
    out = Path(out) if out is not None else (Path(path) if Path(path).is_dir() else Path(path).parent) / "metrics.png"
    with written_atomically(out, "plot") as f:                  # whole or not at all
        fig.savefig(f, format=out.suffix[1:] or "png", dpi=110)   # the format its name says, as savefig(out)
    return out
