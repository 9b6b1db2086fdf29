"""Resuming a run: which checkpoint ``npformer train --resume`` continues, and the config it continues
with (the checkpoint's own, with the few options a resumed run may change).

    source, given = resume_source(options)        # options: the flags and --config file given
    config = resumed_config(source, given)        # then make_trainer(config).load(source)

A resumed run is the same run: any option outside :data:`RESUMABLE` given with another value than the
checkpoint's is an error naming the flag and both values, never silently ignored.
"""
from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from npformer.errors import RangeError
from npformer.training.config import DEFAULT_TASK, FIELDS, config_from_dict, default_model, flag
from npformer.training.run import RunDirectory, checkpoint_file, default_out_dir

__all__ = ["RESUMABLE", "resume_source", "resumed_config"]

# the options a resumed run may change; every other one continues as the checkpoint says, and giving
# it with another value than the checkpoint's is an error
RESUMABLE = ("steps", "out_dir", "checkpoint", "backend", "threads", "eval_every", "log_every", "checkpoint_every")


def _shown(name: str, value: Any) -> str:
    """How the flag of field ``name`` set to ``value`` reads on the command line."""
    if value is None:
        return f"no {flag(name)} (the default)"
    if isinstance(value, bool):
        return flag(name) if value else FIELDS[name].metadata["off"][0]
    return f"{flag(name)} {value}"


def resume_source(given: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """The checkpoint ``--resume`` continues from, and the options with a run directory given as
    ``--checkpoint`` moved to ``--out-dir``: ``--checkpoint PATH`` (a checkpoint, or a run directory's
    last.npz), else the last.npz of ``--out-dir``, else of the default run directory of the
    ``--task``/``--model`` given (``npformer train --resume`` alone continues runs/dates-seq2seq)."""
    if "checkpoint" in given:
        if not Path(given["checkpoint"]).is_dir():
            return Path(given["checkpoint"]), given
        given = dict(given)
        run = given.pop("checkpoint")
        given.setdefault("out_dir", run)
        return checkpoint_file(run, "last"), given
    task = given.get("task", DEFAULT_TASK)
    model = given.get("model") or default_model(task)
    out_dir = given.get("out_dir") or default_out_dir(task, model)
    last = RunDirectory(out_dir).last
    if not last.is_file():
        where = "--out-dir" if "out_dir" in given else f"the run directory of --task {task} --model {model}"
        raise FileNotFoundError(f"--resume: no checkpoint to continue, {last} ({where}) does not exist; give "
                                "--checkpoint PATH or --out-dir DIR of the run")
    return last, given


def resumed_config(path: str | Path, given: dict[str, Any]):
    """The config of the run saved in ``path``, with the options a resumed run may change (RESUMABLE)
    taken from ``given``. Any other option given must agree with the checkpoint: a resumed run is
    the same run, so a different model, task or size is an error naming the flag, the checkpoint's
    value and the one given, never silently ignored."""
    from npformer.training.checkpoint import load_checkpoint

    meta = load_checkpoint(path).meta
    saved = config_from_dict(meta["train_config"], meta.get("kind"))
    own = {f.name for f in fields(saved)}
    keep = "; a resumed run keeps its settings (only " + ", ".join(flag(n) for n in RESUMABLE) + " may change)"
    for name, value in given.items():
        if name in RESUMABLE:
            continue
        if name not in own:
            raise RangeError(f"{flag(name)} does not apply to the --model {saved.model} run saved in {path}{keep}")
        if getattr(saved, name) != value:
            raise RangeError(f"{_shown(name, value)} conflicts with the run saved in {path}, which has "
                             f"{_shown(name, getattr(saved, name))}{keep}")
    if "steps" in given and given["steps"] <= int(meta["step"]):
        raise RangeError(f"--steps {given['steps']}: the run saved in {path} is at step {meta['step']} already; give "
                         f"--steps above it to train on")
    return replace(saved, **{k: v for k, v in given.items() if k in RESUMABLE})
