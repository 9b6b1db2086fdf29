"""Resuming a run: which checkpoint ``npformer train --resume`` continues, the config it continues
with (the checkpoint's own, with the few options a resumed run may change), and where a run may
write without replacing another run's files.

    source, given = resume_source(options)        # options: the flags and --config file given
    config = resumed_config(source, given)        # then make_trainer(config).load(source)
    others = check_run_target(config, "--out-dir runs/x", resumed_from=source, overwrite=False)

A resumed run is the same run: any option outside :data:`RESUMABLE` given with another value than the
checkpoint's is an error naming the flag and both values, never silently ignored. Two runs with the
same config outside :data:`RESUMABLE` are the same run (the batches and dropout masks are functions
of the seed and the step), which is how :func:`check_run_target` tells the run a resumed run
continues from another one.
"""
from __future__ import annotations

from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

from npformer.errors import RangeError
from npformer.training.config import DEFAULT_TASK, FIELDS, config_from_dict, default_model, flag
from npformer.training.run import RunDirectory, check_not_a_run_file, checkpoint_file, default_out_dir

__all__ = ["RESUMABLE", "resume_source", "resumed_config", "check_run_target"]

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


def _fixed(config: dict) -> dict:
    """A run's config without the options a resumed run may change: what makes it the run it is."""
    return {k: v for k, v in config.items() if k not in RESUMABLE}


def _saved_config(run: RunDirectory) -> dict | None:
    """The config of the run in ``run``: its config.json, else the one its checkpoints keep."""
    from npformer.training.checkpoint import load_checkpoint

    saved = run.saved_config()
    for path in (run.last, run.best):
        if saved is None and path.is_file():
            saved = load_checkpoint(path).meta["train_config"]
    return saved


def _differences(saved: dict, config: dict) -> str:
    """The first options (in --help's order) in which two runs' configs differ, for a message."""
    keys = [*FIELDS, *sorted(set(saved) - set(FIELDS))]
    fixed = {**_fixed(saved), **_fixed(config)}
    names = [k for k in keys if k in fixed and saved.get(k) != config.get(k)]
    shown = [f"{flag(n) if n in FIELDS else n} {saved.get(n)!r} there, {config.get(n)!r} here" for n in names[:3]]
    return ", ".join(shown) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def check_run_target(config, where: str, *, resumed_from: str | Path | None = None,
                     overwrite: bool = False) -> list[Path]:
    """Check, before any work, that the run ``config`` writes no other run's files: its run directory
    (``config.out_dir``, which ``where`` names as the user gave it, e.g. ``"--out-dir runs/x"``) and its
    ``--checkpoint`` file. A new run refuses a directory holding any file of a run
    (:meth:`RunDirectory.files`) and an existing checkpoint file; a run resumed from ``resumed_from``
    refuses them when they belong to another run (another config outside :data:`RESUMABLE`). With
    ``overwrite`` (``npformer train --overwrite``) they are returned instead: the files the run
    removes when it starts. A path where a folder stands for a file, or the reverse, is refused
    either way, as is a ``--checkpoint`` that names a run directory's config, metrics or best.npz
    (:func:`~npformer.training.run.check_not_a_run_file`) or cannot be written (a directory, a path
    under a file, a read-only place): all before anything is removed."""
    from npformer.training.checkpoint import check_checkpoint_path

    run = RunDirectory(config.out_dir, config.log_to)
    run.check_paths()
    source = Path(resumed_from).resolve() if resumed_from is not None else None
    if config.checkpoint is not None:
        check_not_a_run_file(config.checkpoint, run, resumed=Path(config.checkpoint).resolve() == source)
        check_checkpoint_path(config.checkpoint, create=False)
    mine = asdict(config)
    others: list[Path] = []
    present = run.files()
    if present and not (source is not None and source.parent == run.path.resolve()):
        saved = _saved_config(run) if source is not None else None
        if saved is None or _fixed(saved) != _fixed(mine):
            if not overwrite:
                names = ", ".join(f.relative_to(run.path).as_posix() for f in present)
                if source is None:
                    raise RangeError(f"{where} holds a run ({names}), which a new run would replace; continue it "
                                     "with --resume, train afresh over it with --overwrite (its files are removed), "
                                     "or give another --out-dir")
                why = f": {_differences(saved, mine)}" if saved is not None else ""
                raise RangeError(f"{where} holds another run ({names}) than the one --resume continues from "
                                 f"{resumed_from}{why}; give another --out-dir, or --overwrite to replace it")
            others += present
    if config.checkpoint is not None:
        path = Path(config.checkpoint)
        target = path.resolve()                  # (new/../c.npz names c.npz before new/ is made)
        if target.is_file() and target != source and target not in [p.resolve() for p in others]:
            from npformer.training.checkpoint import load_checkpoint
            same = source is not None and _fixed(load_checkpoint(target).meta["train_config"]) == _fixed(mine)
            if not same and not overwrite:
                raise RangeError(f"--checkpoint {path} exists: a checkpoint this run would replace; give another "
                                 f"path, continue its run with --resume --checkpoint {path}, or --overwrite to "
                                 "replace it")
            if not same:
                others.append(path)
    return others
