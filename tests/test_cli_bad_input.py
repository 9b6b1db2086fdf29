"""Bad invocations of every sub-command, run in-process: each ends with one line on stderr,
``npformer COMMAND: error: ...`` naming the flag, and exit status 2 (a usage error) or 1 (a training
run that diverged, or the machine out of memory: valid settings, a failed run; see npformer.cli).
None ends in a traceback, none is accepted silently, and none trains a model (the checks run before
the work; the few rows that get as far as building a trainer use tiny sizes).

A summary of the rows by outcome is written at the end of the module's run.

Not here: a --checkpoint that is a directory or cannot be written (tests/training/test_checkpoint.py),
and npformer bench's own options beyond their one line and exit status (the suite, npformer.bench,
checks them). After the table: the runs, checkpoints and exports a refused command
names are left byte for byte as they were, and outputs that fail midway leave nothing half-written.
"""
import collections
import contextlib
import errno
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from npformer import cli
from npformer.cli import main
from npformer.training.run import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--task", "copy", "--n-train", "200", "--steps", "6", "--warmup", "1", "--d-model", "16", "--heads", "2",
        "--layers", "1", "--ff", "32", "--batch-size", "8", "--eval-every", "0", "--log-every", "3"]
LM = ["--task", "charlm", "--steps", "4", "--warmup", "1", "--d-model", "16", "--heads", "2", "--layers", "1",
      "--ff", "32", "--batch-size", "4", "--block-size", "16", "--eval-every", "0", "--log-every", "2"]
XL = ["--task", "recall", "--steps", "3", "--warmup", "0", "--d-model", "16", "--heads", "2", "--layers", "1",
      "--ff", "16", "--batch-size", "4", "--block-size", "4", "--n-train", "16", "--eval-every", "0"]
USAGE, DIVERGED = 2, 1
COMMANDS = ("train", "eval", "plot", "translate", "generate", "fill-mask", "export", "embed", "gradcheck", "study",
            "bench")

OUTCOMES: collections.Counter = collections.Counter()

# a damaged tokenizer.json in an export -> what the error says of it
DAMAGED_JSON = {"empty": "not valid JSON (Expecting value, line 1 column 1)", "truncated": "not valid JSON",
                "not-json": "not valid JSON (Expecting property name enclosed in double quotes",
                "binary": "not UTF-8 text (byte 0xbf at offset 0)", "array": "expected a JSON object, got an array"}


def row(argv, names, code=USAGE, base=()):
    """A table row: ``base`` + ``argv`` must end with ``code`` and one error line containing ``names``."""
    return pytest.param(argv[:1] + list(base) + argv[1:], names, code,
                        id=" ".join([argv[0], *(["<tiny>"] if base else []), *argv[1:]])[:90])


def train(*argv, names, code=USAGE):
    return row(["train", *argv], names, code, base=TINY)


def lm(*argv, names):
    return row(["train", *argv], names, base=LM)


def xl(*argv, names):
    return row(["train", *argv], names, base=XL)


CASES = [
    # -- train: each numeric flag at 0 / -1 / nan / inf / huge where meaningful ---------------------
    *(train("--steps", v, names="--steps") for v in ("0", "-1", "1.5", "x")),
    *(train("--batch-size", v, names="--batch-size") for v in ("0", "-1", "1000000", "nan")),
    *(train("--lr", v, names="--lr") for v in ("0", "-1", "nan", "inf", "-inf", "abc")),
    train("--lr", "1e6", names="diverged at step", code=DIVERGED),
    *(train("--warmup", v, names="--warmup") for v in ("-1", "6", "1000")),
    *(train("--min-lr", v, names="--min-lr") for v in ("-1", "nan", "inf", "1")),
    *(train("--weight-decay", v, names="--weight-decay") for v in ("-1", "nan", "inf")),
    *(train("--clip", v, names="--clip") for v in ("0", "-1", "nan", "-inf")),
    *(train("--d-model", v, names="--d-model") for v in ("0", "-1", "15", "2.5")),
    *(train("--heads", v, names="--heads") for v in ("0", "-1", "3")),
    *(train("--layers", v, names="--layers") for v in ("0", "-1")),
    *(train("--ff", v, names="--ff") for v in ("0", "-1")),
    *(train("--dropout", v, names="--dropout") for v in ("-0.1", "1", "1.5", "nan", "inf")),
    train("--eval-every", "-1", names="--eval-every"),
    *(train("--log-every", v, names="--log-every") for v in ("0", "-1")),
    train("--checkpoint-every", "-1", "--checkpoint", "{dir}/c.npz", names="--checkpoint-every"),
    train("--seed", "-1", names="--seed"),
    *(train("--n-train", v, names="--n-train") for v in ("0", "-1", "3")),
    *(train("--n-valid", v, names="--n-valid") for v in ("0", "-1")),
    *(train("--label-smoothing", v, names="--label-smoothing") for v in ("-0.1", "1", "1.5", "nan")),
    # -- train: choices and flags that conflict ----------------------------------------------------
    train("--precision", "float8", names="--precision"),
    train("--precision", "float16", "--dtype", "float64", names="--dtype"),
    train("--dtype", "float16", names="--dtype"),
    train("--backend", "torch", names="--backend"),
    train("--model", "gpt5", names="--model"),
    train("--activation", "tanh", names="--activation"),
    row(["train", "--task", "poems"], "--task"),
    train("--text", "{file}", names="--text"),                              # not an option of seq2seq
    train("--mem-len", "4", names="--mem-len"),
    train("--share", "all", names="--share"),
    train("--model", "transformer-xl", names="'recall'"),
    train("--model", "gpt", "--n-valid", "10", names="--n-train"),
    row(["train", "--model", "seq2seq", "--task", "charlm", "--steps", "2"], "seq2seq task"),
    row(["train", "--model", "gpt", "--task", "dates", "--steps", "2"], "--task charlm"),
    lm("--model", "bert", "--norm-first", names="--norm-first"),
    lm("--model", "gpt1", "--norm-first", names="--model gpt1"),
    xl("--model", "transformer-xl", "--norm-first", names="--norm-first"),
    # -- train: the character models' and Transformer-XL's own flags ----------------------------------
    *(lm("--block-size", v, names="--block-size" if v != "100000000" else "block_size") for v in ("0", "-1", "100000000")),
    lm("--batch-size", "100000000", names="--batch-size"),
    lm("--text", "{dir}/missing.txt", names="--text {dir}/missing.txt: no such file"),
    lm("--text", "{empty}", names="--text {empty} is empty"),
    lm("--text", "{short}", names="block_size"),
    lm("--text", "{dir}", names="--text {dir}: is a directory; expected a file"),
    lm("--text", "/proc/self/mem", names="--text /proc/self/mem: cannot be read: Input/output error (EIO)"),
    lm("--model", "albert", "--embedding-size", "-1", names="--embedding-size"),
    lm("--model", "albert", "--share", "some", names="--share"),
    xl("--mem-len", "-1", names="--mem-len"),
    xl("--n-train", "2", names="--batch-size"),
    xl("--block-size", "0", names="--block-size"),
    # -- train --resume: the checkpoint's settings hold --------------------------------------------
    row(["train", "--resume"], "--resume: no checkpoint to continue"),
    row(["train", "--resume", "--out-dir", "{dir}"], "--resume: no checkpoint to continue"),
    row(["train", "--resume", "--checkpoint", "{dir}"], "without last.npz"),
    row(["train", "--resume", "--checkpoint", "{dir}/missing.npz"], "missing.npz"),
    row(["train", "--resume", "--checkpoint", "{s2s}", "--model", "gpt"], "--model gpt conflicts"),
    row(["train", "--resume", "--checkpoint", "{s2s}", "--task", "dates"], "--task dates conflicts"),
    row(["train", "--resume", "--checkpoint", "{s2s}", "--d-model", "32"], "--d-model 32 conflicts"),
    row(["train", "--resume", "--checkpoint", "{s2s}", "--lr", "0.1"], "--lr 0.1 conflicts"),
    row(["train", "--resume", "--checkpoint", "{s2s}", "--post-norm"], "--post-norm conflicts"),
    row(["train", "--resume", "--checkpoint", "{s2s}", "--share", "all"], "--share does not apply"),
    row(["train", "--resume", "--checkpoint", "{gpt}", "--heads", "4"], "--heads 4 conflicts"),
    row(["train", "--resume", "--checkpoint", "{gpt}", "--steps", "0"], "--steps"),
    row(["train", "--resume", "--checkpoint", "{s2s}", "--steps", "3"], "--steps 3: the run saved in"),
    # -- train: the run directory and --config FILE -----------------------------------------------
    train("--out-dir", "{file}", names="afile.txt"),                       # a file, not a directory
    train("--out-dir", "{file}/run", names="afile.txt"),
    train("--config", "{dir}/missing.json", names="--config"),
    train("--config", "{file}", names="not valid JSON"),
    train("--config", "{bad_key}", names="'nheads' is not an option"),
    train("--config", "{bad_value}", names="bad_value.json: lr: expected a real number"),
    train("--config", "{bad_toml}", names="not valid TOML"),
    train("--config", "{binary}", names="--config {binary}: not UTF-8 text (byte 0xbf at offset 0)"),
    lm("--text", "{binary}", names="--text {binary}: not UTF-8 text (byte 0xbf at offset 0)"),
    # -- where a run writes: another run's files are never replaced (--resume continues, --overwrite
    #    replaces); an empty path is an error before any step ---------------------------------------
    train("--out-dir", "{run}", names="--out-dir {run} holds a run (config.json, metrics.jsonl, last.npz, best.npz), "
          "which a new run would replace; continue it with --resume, train afresh over it with --overwrite"),
    row(["train", "--config", "{run}/config.json", "--steps", "4"],
        "the run directory {run} (out_dir in --config {run}/config.json) holds a run"),
    train("--out-dir", "", names="--out-dir: expected a path, got an empty string"),
    train("--checkpoint", "", names="--checkpoint: expected a path, got an empty string"),
    lm("--text", "", names="--text: expected a path, got an empty string"),
    train("--checkpoint", "{s2s}", names="--checkpoint {s2s} exists: a checkpoint this run would replace"),
    row(["train", "--resume", "--checkpoint", "{run}", "--out-dir", "{run_gpt}"],
        "--out-dir {run_gpt} holds another run (config.json, metrics.jsonl, last.npz, best.npz) than the one "
        "--resume continues from {run}/last.npz: --model 'gpt' there, 'seq2seq' here"),
    train("--log-to", "csv", "--out-dir", "{csv_run}", names="{csv_run}/train.csv is a directory, where --log-to csv "
          "writes the run's metrics"),
    # -- export: where it writes, checked before the checkpoint is read ------------------------------
    row(["export", "--checkpoint", "{run_gpt}", "--to", "{run_gpt}"],
        "--to {run_gpt} is the run directory of an npformer train run (metrics.jsonl, last.npz, best.npz)"),
    row(["export", "--checkpoint", "{gpt}", "--to", "{file}/x"], "--to {file}/x is under {file}, a file"),
    row(["export", "--checkpoint", "{gpt}", "--to", "{file}"], "--to {file} is a file"),
    row(["export", "--checkpoint", "{gpt}", "--to", ""], "--to: expected a directory, got an empty path"),
    row(["export", "--checkpoint", "{gpt}", "--to", "{export}"], "--to {export} holds a model (config.json, "
        "model.safetensors, tokenizer.json, tokenizer_config.json), which the export would replace; give --overwrite"),
    # -- eval, plot ---------------------------------------------------------------------------------
    row(["eval", "--checkpoint", "{dir}/missing.npz"], "missing.npz"),
    row(["eval", "--checkpoint", "{file}"], "not an npformer checkpoint"),
    row(["eval", "--checkpoint", "{dir}"], "without best.npz or last.npz"),
    row(["eval"], "--checkpoint"),
    row(["plot", "{dir}"], "no metrics file"),
    row(["plot", "{file}"], "line 1"),
    row(["plot", "{binary}"], "the metrics file {binary}: not UTF-8 text"),
    row(["plot"], "RUN_DIR"),
    # -- generate ---------------------------------------------------------------------------------
    *(row(["generate", "--checkpoint", "{gpt}", "--tokens", v], "--tokens") for v in ("-1", "x")),
    *(row(["generate", "--checkpoint", "{gpt}", "--temperature", v], "--temperature")
      for v in ("nan", "inf", "-inf", "-1")),
    *(row(["generate", "--checkpoint", "{gpt}", "--top-p", v], "--top-p") for v in ("1.5", "0", "-0.1", "nan", "inf")),
    row(["generate", "--checkpoint", "{gpt}", "--temperature", "0", "--top-p", "1.5"], "--top-p"),
    *(row(["generate", "--checkpoint", "{gpt}", "--top-k", v], "--top-k") for v in ("0", "-1")),
    row(["generate", "--checkpoint", "{gpt}", "--seed", "-1"], "--seed"),
    row(["generate", "--checkpoint", "{gpt}", "--dtype", "float64"], "--dtype"),
    row(["generate", "--checkpoint", "{dir}/missing.npz"], "missing.npz"),
    row(["generate", "--checkpoint", "{file}"], "not an npformer checkpoint"),
    row(["generate", "--checkpoint", "{s2s}"], "needs a GPT checkpoint"),
    row(["generate", "--model", "{dir}"], "is missing config.json, model.safetensors, tokenizer.json"),
    row(["generate", "--model", "{dir}/missing"], "does not exist"),
    # an export whose tokenizer.json is damaged: named before the tokenizers package is needed
    *(row([command, "--model", "{export_%s_%s}" % (kind, damage), *text], "tokenizer.json: " + names)
      for command, kind, text in (("generate", "gpt", []), ("fill-mask", "bert", ["a[MASK]"]))
      for damage, names in DAMAGED_JSON.items()),
    row(["generate", "--prompt", "x"], "--checkpoint"),                    # neither source
    row(["generate", "--checkpoint", "{gpt}", "--model", "{dir}"], "--model"),
    # -- translate --------------------------------------------------------------------------------
    row(["translate", "--checkpoint", "{dir}/missing.npz", "x"], "missing.npz"),
    row(["translate", "--checkpoint", "{gpt}", "x"], "needs a Seq2Seq checkpoint"),
    row(["translate", "--checkpoint", "{file}", "x"], "not an npformer checkpoint"),
    row(["translate", "--checkpoint", "{s2s}", ""], "empty source"),
    row(["translate", "--checkpoint", "{s2s}", "a" * 500], "max_len"),
    row(["translate", "--checkpoint", "{s2s}"], "text"),
    row(["translate", "x"], "--checkpoint"),
    # -- embed ------------------------------------------------------------------------------------
    row(["embed", "--model", "{dir}", "x"], "{dir}"),
    row(["embed", "--model", "{dir}/missing", "x"], "missing"),
    row(["embed", "--dtype", "float16", "x"], "--dtype"),
    row(["embed"], "text"),
    # -- gradcheck --------------------------------------------------------------------------------
    row(["gradcheck", "--only", "no_such_op"], "--only"),
    *(row(["gradcheck", "--seed", v, "--only", "relu"], "--seed") for v in ("-1", "x")),
    row(["gradcheck", "--backend", "torch"], "--backend"),
    # -- study ------------------------------------------------------------------------------------
    row(["study", "positional", "--out", "{file}"], "--out"),
    row(["study", "positional", "--out", "{file}/sub"], "--out"),
    *(row(["study", "positional", flag, v, "--out", "{dir}"], flag)
      for flag, v in (("--positions", "1"), ("--positions", "0"), ("--d-model", "-1"), ("--positions", "x"))),
    *(row(["study", "albert", "--build-limit", v, "--out", "{dir}"], "--build-limit") for v in ("nan", "-1", "inf")),
    row(["study", "albert", "--shapes", "huge", "--out", "{dir}"], "--shapes"),
    *(row(["study", "gradient-flow", flag, v, "--out", "{dir}"], flag)
      for flag, v in (("--lr", "inf"), ("--lr", "nan"), ("--lr", "0"), ("--steps", "-1"), ("--seq-len", "0"),
                      ("--batch-size", "0"), ("--seed", "-1"))),
    *(row(["study", "layers", flag, v, "--out", "{dir}"], flag)
      for flag, v in (("--lr", "inf"), ("--heads", "3"), ("--layers", "0"), ("--steps", "0"), ("--seed", "-1"))),
    *(row(["study", "norms", flag, v, "--out", "{dir}"], flag)
      for flag, v in (("--lr", "inf"), ("--dropout", "1"), ("--min-len", "0"), ("--min-len", "20"),
                      ("--max-len", "-1"), ("--batch-size", "1"), ("--norms", "group"), ("--probes", "64"),
                      ("--heads", "3"), ("--extra-pad", "-1"), ("--seed", "-1"))),
    *(row(["study", "xl-memory", flag, v, "--out", "{dir}"], flag)
      for flag, v in (("--lr", "inf"), ("--mem-len", "0"), ("--segment", "0"), ("--eval-mem", "a"),
                      ("--eval-mem", "-1"), ("--seed", "-1"))),
    row(["study", "xl-memory", "--heads", "3", "--out", "{dir}"], "--heads 3"),
    row(["study", "xl-memory", "--n-train", "1", "--steps", "2", "--out", "{dir}"], "--batch-size"),
    *(row(["study", "attention", flag, v, "--out", "{dir}"], flag)
      for flag, v in (("--heads", "3"), ("--layers", "0"), ("--block-size", "-1"), ("--seed", "-1"))),
    row(["study", "attention", "--checkpoint", "{dir}/missing.npz", "--out", "{dir}"], "missing.npz"),
    row(["study", "attention", "--input", "", "--out", "{dir}"], "input"),
    row(["study", "attention", "--task", "charlm", "--block-size", "2", "--d-model", "8", "--heads", "2",
         "--out", "{dir}"], "block_size=2"),
    row(["study", "nope"], "NAME"),
    row(["study"], "NAME"),
    # -- an unknown option: named by its sub-command, with the closest one it has ------------------
    row(["train", "--lrr", "1e-3"], "unrecognized arguments: --lrr 1e-3; did you mean --lr?"),
    row(["train", "--eval_evry", "5"], "did you mean --eval-every?"),
    # nanoGPT's settings npformer has no counterpart of: what to use instead, never a far suggestion
    row(["train", "--eval-iters", "20"], "npformer train has no such setting: a validation reads --eval-limit"),
    row(["train", "--lr-decay-iters", "50"], "the cosine reaches --min-lr at the last step, --steps"),
    row(["train", "--gradient-accumulation-steps", "4"], "raise --batch-size"),
    row(["train", "--init-from", "resume"], "npformer train --resume --checkpoint RUN_DIR"),
    row(["train", "--compile=True"], "npformer compiles nothing"),
    row(["train", "--frobnicate", "1"], "unrecognized arguments: --frobnicate 1; not a setting of npformer train"),
    row(["train", "--bias=maybe"], "argument --bias: expected True or False"),
    row(["train", "--final-eval", "no"], "argument --final-eval: expected True or False"),
    row(["train", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    row(["eval", "--checkpoint", "{s2s}", "--jsn"], "did you mean --json?"),
    row(["generate", "--checkpoint", "{gpt}", "--temprature", "1"], "did you mean --temperature?"),
    row(["study", "positional", "--outt", "{dir}"], "did you mean --out?"),
    row(["gradcheck", "--zzz"], "unrecognized arguments: --zzz"),
    # -- the command itself -----------------------------------------------------------------------
    row(["fly"], "COMMAND"),
]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """Tiny checkpoints (a Seq2Seq, a GPT, a BERT) and their run directories, exports of the GPT and the
    BERT and copies with a damaged tokenizer.json, and files to point flags at."""
    d = tmp_path_factory.mktemp("bad_input")
    s2s, gpt, bert = str(d / "s2s.npz"), str(d / "gpt.npz"), str(d / "bert.npz")
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["train", *TINY, "--checkpoint", s2s, "--out-dir", str(d / "run-s2s")]) == 0
        assert main(["train", *LM, "--checkpoint", gpt, "--out-dir", str(d / "run-gpt")]) == 0
        assert main(["train", *LM, "--model", "bert", "--checkpoint", bert, "--out-dir", str(d / "run-bert")]) == 0
        for kind in ("gpt", "bert"):
            assert main(["export", "--checkpoint", str(d / f"{kind}.npz"), "--to", str(d / f"export-{kind}")]) == 0
    exports = {}
    for kind in ("gpt", "bert"):
        good = (d / f"export-{kind}" / "tokenizer.json").read_bytes()
        damaged = {"empty": b"", "truncated": good[:len(good) // 2], "not-json": b"{version: 1}",
                   "binary": b"\xbf\x00\xff", "array": b"[]"}
        assert set(damaged) == set(DAMAGED_JSON)
        for damage, content in damaged.items():
            copy = d / f"export-{kind}-{damage}"
            shutil.copytree(d / f"export-{kind}", copy)
            (copy / "tokenizer.json").write_bytes(content)
            exports[f"export_{kind}_{damage}"] = str(copy)
    (d / "afile.txt").write_text("x")
    (d / "empty.txt").write_text("")
    (d / "short.txt").write_text("abc")
    (d / "bad_key.json").write_text('{"nheads": 4}')
    (d / "bad_value.json").write_text('{"lr": "fast"}')
    (d / "bad.toml").write_text("steps = = 3")
    (d / "bin.json").write_bytes(b"\xbf\x00\xff not text")
    (d / "csv-run" / "train.csv").mkdir(parents=True)          # a folder where --log-to csv writes a file
    return {"dir": str(d), "s2s": s2s, "gpt": gpt, "bert": bert, "file": str(d / "afile.txt"),
            "empty": str(d / "empty.txt"), "short": str(d / "short.txt"), "bad_key": str(d / "bad_key.json"),
            "bad_value": str(d / "bad_value.json"), "bad_toml": str(d / "bad.toml"), "binary": str(d / "bin.json"),
            "run": str(d / "run-s2s"), "run_gpt": str(d / "run-gpt"), "csv_run": str(d / "csv-run"),
            "export": str(d / "export-gpt"), "export_gpt": str(d / "export-gpt"), "export_bert": str(d / "export-bert"),
            **exports}


@pytest.fixture(scope="module", autouse=True)
def summary(request):
    """After the module: the rows by what actually happened, on the terminal."""
    yield
    if OUTCOMES:
        line = "npformer bad-input cases by outcome: " + ", ".join(f"{k}: {v}" for k, v in sorted(OUTCOMES.items()))
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            print("\n" + line)


def _run(argv: list[str]) -> tuple[object, str, str]:
    """(exit status or the exception that escaped, stdout, stderr) of ``main(argv)``."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:                        # argparse
            code = exc.code
        except Exception as exc:                         # a traceback on the command line
            code = exc
    return code, out.getvalue(), err.getvalue()


def _outcome(code, err: str) -> str:
    if isinstance(code, BaseException):
        return "traceback"
    if code == 0:
        return "accepted silently (exit 0)"
    if len(_error_lines(err)) != 1:
        return f"exit {code}, {len(_error_lines(err))} lines on stderr"
    return {USAGE: "clear usage error (exit 2)", DIVERGED: "diverged run, one line (exit 1)"}.get(code, f"exit {code}")


def _error_lines(err: str) -> list[str]:
    """The lines of standard error but the first when it says which checkpoint of a run directory the
    command uses (``npformer export: using run/best.npz``), which it says before anything else."""
    lines = err.splitlines()
    return lines[1:] if lines and re.match(r"npformer [\w-]+: using \S+\.npz", lines[0]) else lines


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("argv,names,code", CASES)
def test_a_bad_invocation_is_one_line_naming_the_flag(paths, argv, names, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)          # an empty working directory: no runs/ of other tests to resume
    argv = [a.format(**paths) for a in argv]
    names = names.format(**paths)
    got, _, err = _run(argv)
    OUTCOMES[_outcome(got, err)] += 1
    if isinstance(got, BaseException):
        raise AssertionError(f"npformer {' '.join(argv)} ended in a traceback") from got
    command = "npformer" + (f" {argv[0]}" if argv[0] in COMMANDS else "")
    if argv[0] == "study" and len(argv) > 1 and argv[1] in cli.EXPERIMENTS:
        command += f" {argv[1]}"                          # npformer study NAME: error: ...
    assert got == code, (got, err)
    lines = _error_lines(err)
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{command}: error: "), lines[0]
    assert names in lines[0], lines[0]


def test_precision_bfloat16_without_ml_dtypes_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    """Refused before the run directory is made (ml_dtypes' import made to fail)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)
    got, _, err = _run(["train", *TINY, "--precision", "bfloat16"])
    assert got == USAGE and len(err.splitlines()) == 1, err
    assert err.startswith("npformer train: error: --precision bfloat16: bfloat16 needs the ml_dtypes package"), err
    assert 'pip install "npformer[bfloat16]"; or use --precision float16' in err
    assert not (tmp_path / "runs").exists()


def test_a_text_that_cannot_be_read_is_one_line_naming_the_flag_before_the_run(tmp_path, monkeypatch):
    """--text of a file that exists but cannot be read (no permission; /proc/self/mem's EIO is in the
    table) ended in a traceback: it is read as --config is, through npformer.files.read_text."""
    path = tmp_path / "locked.txt"
    path.write_text("a text to train on. " * 40)
    real = Path.read_bytes

    def no_permission(self):
        if self == path:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real(self)
    monkeypatch.setattr(Path, "read_bytes", no_permission)
    got, out, err = _run(["train", *LM, "--text", str(path), "--out-dir", str(tmp_path / "run")])
    assert got == USAGE and out == ""
    assert err == f"npformer train: error: --text {path}: cannot be read: Permission denied (EACCES)\n"
    assert not (tmp_path / "run").exists()


def test_the_table_covers_every_subcommand():
    commands = {p.values[0][0] for p in CASES}
    assert commands >= {"train", "generate", "translate", "embed", "gradcheck", "study"}
    studied = {p.values[0][1] for p in CASES if p.values[0][0] == "study" and len(p.values[0]) > 1}
    assert studied >= set(cli.EXPERIMENTS)


def test_bench_options_end_in_a_one_line_usage_error(capsys):
    """npformer bench hands its options to the suite (npformer.bench), which parses them on the command
    line's Parser: one line, as every other usage error (it printed argparse's usage block first), the
    closest option named; the status is 2 and nothing escapes."""
    for argv, said in [(["bench", "--threads", "0"], "--threads: expected a positive count, got 0"),
                       (["bench", "--paths", "turbo"], "--paths: expected a comma list of fast, numpy, reference"),
                       (["bench", "--nope"], "unrecognized arguments: --nope"),
                       (["bench", "--skip-parrity"],
                        "unrecognized arguments: --skip-parrity; did you mean --skip-parity?"),
                       (["bench", "--threads", "x"], "argument --threads: invalid int value: 'x'")]:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"npformer bench: error: {said}") and line.endswith("(see npformer bench --help)")


# -- what must still work ----------------------------------------------------------------------------

@pytest.mark.parametrize("alias, canonical", [
    (["--learning-rate", "0.002"], ["--lr", "0.002"]), (["--learning_rate", "0.002"], ["--lr", "0.002"]),
    (["--max-steps", "7"], ["--steps", "7"]), (["--max_iters", "7"], ["--steps", "7"]),
    (["--n-layer", "3"], ["--layers", "3"]), (["--n_head", "4"], ["--heads", "4"]),
    (["--n-embd", "32"], ["--d-model", "32"]), (["--batch_size", "5"], ["--batch-size", "5"]),
    (["--output-dir", "somewhere"], ["--out-dir", "somewhere"]), (["--output_dir", "x"], ["--out-dir", "x"]),
    (["--no_bias"], ["--no-bias"]), (["--eval_every", "3"], ["--eval-every", "3"]),
    (["--eval-interval", "4"], ["--eval-every", "4"]), (["--log_interval", "2"], ["--log-every", "2"]),
    (["--warmup-iters", "5"], ["--warmup", "5"]), (["--device", "cpu"], ["--backend", "numpy"]),
    (["--device=cuda"], ["--backend", "cupy"]), (["--device", "cuda:0"], ["--backend", "cupy"])])
def test_other_tools_names_of_train_flags_are_hidden_synonyms(alias, canonical):
    """nanoGPT's, Hugging Face's and PyTorch examples' names parse as npformer's own flags (the same
    value in the same field) and stay out of --help."""
    parser = cli.build_parser()
    assert vars(parser.parse_args(["train", *alias])) == vars(parser.parse_args(["train", *canonical]))
    assert alias[0] not in parser.commands["train"].format_help()


@pytest.mark.parametrize("given, same", [
    (["--bias=False"], ["--no-bias"]), (["--bias", "False"], ["--no-bias"]), (["--bias=True"], ["--bias"]),
    (["--bias", "true"], ["--bias"]), (["--final_eval=False"], ["--no-final-eval"]),
    (["--tf32", "False", "--steps", "3"], ["--no-tf32", "--steps", "3"])])
def test_an_on_off_flag_takes_true_or_false_as_nanogpt_s_configurator_does(given, same):
    """--bias=False and --bias False (nanoGPT's spelling) set what they say, as --no-bias does; the
    value is optional (--bias alone is True), so the flag still reads as a switch in --help."""
    parser = cli.build_parser()
    assert vars(parser.parse_args(["train", *given])) == vars(parser.parse_args(["train", *same]))
    assert "--bias [True|False]" in parser.commands["train"].format_help()


def _ok(argv, paths=None):
    argv = [a.format(**paths) for a in argv] if paths else argv
    code, out, err = _run(argv)
    assert code == 0 and err == "", (code, err)
    return out


def test_a_short_run_without_warmup_trains(paths, tmp_path, monkeypatch):
    """--steps 50 alone used to fail on the default warm-up of 100; a run of 100 steps or fewer now
    warms up for steps // 10."""
    monkeypatch.chdir(tmp_path)                   # its own default run directory
    i = TINY.index("--warmup")
    out = _ok(["train", *TINY[:i], *TINY[i + 2:], "--steps", "50", "--log-every", "50"])
    assert "final validation" in out
    from npformer.training.config import make_config
    assert make_config({"steps": 50}).warmup == 5 and make_config({"steps": 700}).warmup == 100


def test_good_training_flags_still_run(paths, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                   # its own default run directory
    ckpt = paths["dir"] + "/good.npz"
    _ok(["train", *TINY, "--clip", "inf", "--checkpoint-every", "0", "--checkpoint", ckpt, "--dropout", "0",
         "--label-smoothing", "0", "--eval-every", "0", "--seed", "0"])
    out = _ok(["train", "--resume", "--checkpoint", ckpt, "--steps", "8", "--log-every", "4", "--task", "copy",
               "--d-model", "16", "--model", "seq2seq", "--clip", "inf"])     # the checkpoint's own values agree
    assert "resumed from" in out


def test_good_sampling_flags_still_run(paths):
    assert _ok(["generate", "--checkpoint", "{gpt}", "--tokens", "0"], paths) == "The \n"   # the prompt alone
    assert _ok(["generate", "--checkpoint", "{gpt}", "--tokens", "3", "--temperature", "0", "--top-p", "1",
                "--top-k", "1"], paths).startswith("The ")
    assert _ok(["translate", "--checkpoint", "{s2s}", "abc"], paths).startswith("abc\t")


def test_good_study_flags_still_run(paths, tmp_path):
    out = _ok(["study", "positional", "--positions", "8", "--d-model", "4", "--out", str(tmp_path / "new" / "dir")])
    assert "wrote" in out and (tmp_path / "new" / "dir" / "positional.json").is_file()


# -- what is not a usage error -----------------------------------------------------------------------

@pytest.mark.parametrize("message,line", [
    ("Unable to allocate 71.5 GiB for an array with shape (100000200, 96)",
     "npformer train: error: out of memory (Unable to allocate 71.5 GiB for an array with shape (100000200, 96)); "
     "try smaller sizes"),
    ("", "npformer train: error: out of memory; try smaller sizes")])
def test_out_of_memory_is_one_line_and_exit_1(monkeypatch, message, line):
    def too_big(options):
        raise MemoryError(message)
    monkeypatch.setattr(cli, "make_config", too_big)
    code, _, err = _run(["train", "--steps", "2"])
    assert code == 1 and err.splitlines() == [line]


def test_a_floating_point_error_outside_the_loop_is_not_reported_as_a_divergence(monkeypatch):
    def broken(options):
        raise FloatingPointError("a bug, not a diverged run")
    monkeypatch.setattr(cli, "make_config", broken)
    with pytest.raises(FloatingPointError, match="a bug"):
        main(["train", "--steps", "2"])


def test_a_diverged_run_is_one_line_from_the_shell():
    """NumPy's overflow warnings are silenced while the loop checks the loss: one line, exit 1."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "npformer", "train", *TINY, "--lr", "1e6"], capture_output=True,
                          text=True, timeout=120, env=env)          # in the tests' working directory
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("npformer train: error: the run diverged at step "), lines
    assert "a lower --lr (this run: 1e+06)" in lines[0] and "--clip" in lines[0]


# -- what a refused command leaves as it was -----------------------------------------------------------

def _tree(root: str) -> dict[str, bytes]:
    """Every file under ``root`` (hidden temporaries included) by relative path, with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


@pytest.mark.parametrize("argv", [
    ["train", *TINY, "--out-dir", "{run}"],                                # a newcomer's test run over a trained one
    ["train", *TINY, "--steps", "1", "--warmup", "0", "--out-dir", "{run}"],
    ["train", "--config", "{run}/config.json", "--steps", "4"],           # the saved config names the run itself
    ["train", *TINY, "--checkpoint", "{s2s}"],
    ["train", "--resume", "--checkpoint", "{run}", "--out-dir", "{run_gpt}"],
    ["export", "--checkpoint", "{run_gpt}", "--to", "{run_gpt}"],
    ["export", "--checkpoint", "{gpt}", "--to", "{export}"]], ids=lambda a: " ".join(a[:1] + a[-2:]))
def test_a_refused_command_leaves_every_run_checkpoint_and_export_as_it_was(paths, argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = _tree(paths["dir"])
    code, out, err = _run([a.format(**paths) for a in argv])
    assert code == USAGE and len(_error_lines(err)) == 1 and out == "", (code, err)
    assert _tree(paths["dir"]) == before


def _copy_run(paths, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(paths["run"], run)
    return run


def test_overwrite_trains_afresh_over_another_run_and_says_what_it_removed(paths, tmp_path):
    run = _copy_run(paths, tmp_path)
    (run / "notes.txt").write_text("mine")                                   # not a file of the run: kept
    out = _ok(["train", *TINY, "--lr", "0.01", "--out-dir", str(run), "--overwrite"])
    removed = ", ".join(str(run / n) for n in ("config.json", "metrics.jsonl", "last.npz", "best.npz"))
    assert out.startswith(f"--overwrite: removed the earlier run's {removed}\n")
    assert json.loads((run / "config.json").read_text())["lr"] == 0.01
    assert [r["step"] for r in read_metrics(run) if r["split"] == "train"] == [3, 6]   # the new run's alone
    assert (run / "notes.txt").read_text() == "mine"
    out = _ok(["train", *TINY, "--out-dir", str(run), "--overwrite_output_dir"])   # Hugging Face's name too
    assert out.startswith("--overwrite: removed")


def test_overwrite_removes_nothing_when_the_new_runs_checkpoint_cannot_be_written(paths, tmp_path, monkeypatch):
    """--overwrite with a --checkpoint the new run could not write (a directory, a path under a file, a
    place no file can be created in, a folder that cannot be made): refused before the earlier run's
    files are removed, which used to be lost with the new run failing at its first save."""
    run = _copy_run(paths, tmp_path)
    before = _tree(str(run))
    (tmp_path / "adir").mkdir()
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != locked and real(p, mode, **kw))
    bad = {str(tmp_path / "adir"): "is a directory", paths["file"] + "/c.npz": "which is a file",
           str(locked / "new" / "c.npz"): f"its directory cannot be created in '{locked}'"}
    if os.path.isdir("/proc/self"):
        bad["/proc/npformer-test.npz"] = "creating a file in '/proc' failed"     # not even root can
    for checkpoint, message in bad.items():
        code, out, err = _run(["train", *TINY, "--out-dir", str(run), "--overwrite", "--checkpoint", checkpoint])
        assert code == USAGE and out == "" and len(err.splitlines()) == 1, (checkpoint, code, err)
        assert err.startswith("npformer train: error: ") and checkpoint in err and message in err, err
        assert _tree(str(run)) == before, checkpoint
    assert list(locked.iterdir()) == []


@pytest.mark.parametrize("name", ["config.json", "metrics.jsonl", "best.npz", "train.csv"])
def test_a_checkpoint_naming_a_file_of_the_run_directory_is_refused(paths, tmp_path, monkeypatch, name):
    """--checkpoint RUN/metrics.jsonl (config.json, best.npz, a --log-to file), however spelled, would be
    replaced by the checkpoint, after which the run could not be resumed or plotted: refused before any
    work, whether the run is new, trains afresh with --overwrite or is resumed from that very file."""
    monkeypatch.chdir(tmp_path)
    run = _copy_run(paths, tmp_path)
    (run / "link").symlink_to(run)
    before = _tree(str(run))
    for out_dir, extra in (("new", []), ("run", ["--overwrite"]), (str(run), ["--overwrite"])):
        shown = Path(out_dir).name if out_dir == str(run) else out_dir
        spellings = [f"{shown}/{name}", f"./{shown}/./{name}", str(tmp_path / shown / ".." / shown / name)]
        if shown == "run":
            spellings.append(str(run / "link" / name))                   # a symbolic link to the run directory
        for checkpoint in spellings:
            code, out, err = _run(["train", *TINY, "--out-dir", out_dir, *extra, "--checkpoint", checkpoint])
            assert code == USAGE and out == "" and len(err.splitlines()) == 1, (out_dir, checkpoint, err)
            assert err.startswith(f"npformer train: error: --checkpoint {checkpoint} is the {name} of the run "
                                  f"directory {out_dir}, which the run writes itself"), err
            assert "give a file outside" in err
            assert _tree(str(run)) == before and not (tmp_path / "new").exists()
    if name == "best.npz":                            # resumed from best.npz, the run would write over it
        for where in (["--out-dir", "run"], []):     # [] : the out_dir the copy's checkpoint names, paths["run"]
            code, _, err = _run(["train", "--resume", "--checkpoint", "run/best.npz", "--steps", "9", *where])
            assert code == USAGE, err
            assert err.startswith("npformer train: error: --resume --checkpoint run/best.npz: a resumed run writes "
                                  "its checkpoints to the --checkpoint it continues from, and this is the best.npz of "
                                  "the run directory run;"), err
            assert "continue from its last.npz (--resume --out-dir run)" in err and _tree(str(run)) == before


def test_a_checkpoint_naming_the_runs_own_last_npz_is_written_once(tmp_path, monkeypatch):
    """--checkpoint RUN/last.npz, spelled another way, is the file the run writes anyway: allowed,
    written once at each save."""
    from npformer.training.loop import Trainer
    monkeypatch.chdir(tmp_path)
    saved, save = [], Trainer.save
    monkeypatch.setattr(Trainer, "save", lambda self, path: saved.append(str(path)) or save(self, path))
    _ok(["train", *TINY, "--out-dir", "run", "--checkpoint", str(tmp_path / "run" / "." / "last.npz")])
    assert saved == ["run/last.npz", "run/best.npz", "run/last.npz"]     # the end; the final validation's best


def test_resume_continues_its_own_run_and_a_copy_of_it_without_overwrite(tmp_path):
    run = tmp_path / "run"
    _ok(["train", *TINY, "--out-dir", str(run)])
    same = tmp_path / "copy"             # a copy of the same run (the same config): resuming into it continues it
    shutil.copytree(run, same)
    out = _ok(["train", "--resume", "--checkpoint", str(run), "--steps", "9"])
    assert out.startswith(f"resumed from {run / 'last.npz'} at step 6\n") and "--overwrite" not in out
    assert "resumed from" in _ok(["train", "--resume", "--checkpoint", str(run), "--out-dir", str(same),
                                  "--steps", "12"])
    assert [r["step"] for r in read_metrics(same) if r["split"] == "train"] == [3, 6, 12]    # its own, then ours


def test_an_export_replaces_an_earlier_one_only_with_overwrite(paths, tmp_path):
    to = tmp_path / "export"
    shutil.copytree(paths["export"], to)
    (to / "README.md").write_text("my notes")
    _ok(["export", "--checkpoint", paths["bert"], "--to", str(to), "--overwrite"])
    assert json.loads((to / "config.json").read_text())["model_type"] == "bert"
    assert (to / "README.md").read_text() == "my notes" and not [p for p in to.iterdir() if p.name.startswith(".")]


def _full_disk(monkeypatch, when=lambda path: True):
    """Every flush of a file to the disk fails as a full disk does (``when(path)`` chooses which)."""
    real = os.fsync

    def fsync(fd):
        if when(os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else ""):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)
    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("earlier", [False, True])
def test_an_export_onto_a_full_disk_leaves_nothing_half_written(paths, tmp_path, monkeypatch, earlier):
    to = tmp_path / "export"
    if earlier:
        shutil.copytree(paths["export_bert"], to)
    before = _tree(str(tmp_path))
    _full_disk(monkeypatch, when=lambda path: path.endswith("model.safetensors"))
    code, out, err = _run(["export", "--checkpoint", paths["gpt"], "--to", str(to), "--overwrite"])
    monkeypatch.undo()
    kept = f"the files in '{to}' are as they were" if earlier else "nothing was written"
    assert code == USAGE and err == f"npformer export: error: could not write export '{to}': the disk is full " \
                                    f"(No space left on device); {kept}\n"
    assert _tree(str(tmp_path)) == before and to.exists() == earlier      # no temporary, no partial file


def test_an_unwritable_output_directory_is_refused_before_the_work(paths, tmp_path, monkeypatch):
    """A read-only directory (or file system): found by os.access before any work, root or not."""
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != locked and real(p, mode, **kw))
    for argv, flag in ((["export", "--checkpoint", paths["gpt"], "--to", str(locked / "x")], "--to"),
                       (["train", *TINY, "--out-dir", str(locked / "run")], "--out-dir"),
                       (["study", "positional", "--out", str(locked)], "--out")):
        code, _, err = _run(argv)
        assert code == USAGE and f"{flag} {locked}" in err and f"cannot write in {locked}" in err, err
    assert list(locked.iterdir()) == []


def test_a_metrics_file_that_cannot_be_written_is_one_line(paths, tmp_path, monkeypatch):
    from npformer.training.run import RunDirectory

    def full(self, record):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(RunDirectory, "_append", full)
    code, _, err = _run(["train", *TINY, "--out-dir", str(tmp_path / "run")])
    assert code == USAGE and err == (f"npformer train: error: could not write the run's metrics in {tmp_path / 'run'}: "
                                     "the disk is full (No space left on device)\n")


def test_a_full_disk_under_last_npz_still_writes_the_checkpoint_on_another_disk(paths, tmp_path, monkeypatch):
    """The run directory's disk is full when the trained weights are saved: --checkpoint, on another disk,
    is written all the same (each path is tried), and the one error names both: the file that failed and
    the one written. Its weights are the run's own: those of the same run written without the failure."""
    run, other = tmp_path / "run", tmp_path / "other" / "c.npz"
    _full_disk(monkeypatch, when=lambda path: path.startswith(str(run / ".last.npz.")))
    code, _, err = _run(["train", *TINY, "--out-dir", str(run), "--checkpoint", str(other)])
    monkeypatch.undo()
    assert code == USAGE and err == (f"npformer train: error: could not write checkpoint '{run / 'last.npz'}': the "
                                     "disk is full (No space left on device); no checkpoint was written; the weights "
                                     f"of step 6 were written to '{other}'\n")
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "metrics.jsonl"]      # nothing half-written
    from npformer.training.checkpoint import load_checkpoint
    got, expected = load_checkpoint(other), load_checkpoint(paths["s2s"])                # the same TINY run
    assert got.meta["step"] == 6 and got.model.keys() == expected.model.keys()
    assert all(np.array_equal(got.model[k], expected.model[k]) for k in got.model)


def test_bench_checks_its_output_folder_before_measuring(paths, capsys, monkeypatch):
    from npformer.bench import suite

    monkeypatch.setattr(suite, "run_suite", lambda *a, **k: pytest.fail("measured before --out was checked"))
    for out in (paths["file"], paths["file"] + "/sub"):
        with pytest.raises(SystemExit) as exc:
            main(["bench", "--quick", "--only", "gelu", "--backends", "numpy", "--out", out])
        assert exc.value.code == USAGE
        assert capsys.readouterr().err.splitlines()[-1].startswith(f"npformer bench: error: --out {out} ")


def test_bench_results_that_cannot_be_written_are_printed_not_lost(paths, tmp_path, monkeypatch):
    from npformer.bench import suite

    result = {"meta": {"device": "cpu-test", "date": "2026-11-28", "mode": "quick", "notes": []}, "rows": []}
    monkeypatch.setattr(suite, "run_suite", lambda *a, **k: result)
    monkeypatch.setattr(suite, "markdown", lambda r: "| the measured table |")
    _full_disk(monkeypatch)
    code, out, err = _run(["bench", "--quick", "--only", "gelu", "--backends", "numpy", "--out", str(tmp_path / "b")])
    monkeypatch.undo()
    assert code == USAGE and "| the measured table |" in out
    assert err.startswith(f"npformer bench: error: could not write report '{tmp_path / 'b'}/cpu-test_2026-11-28_quick")
    assert "the disk is full" in err and list((tmp_path / "b").iterdir()) == []


# -- exports read back: checked against their model ------------------------------------------------------

@pytest.fixture
def tokenizers():
    return pytest.importorskip("tokenizers", reason="tokenizers not installed (the pretrained extra)")


@pytest.mark.parametrize("kind, command", [("gpt", ["generate"]), ("bert", ["fill-mask", "a[MASK]"])])
def test_an_export_with_another_tokenizer_or_none_at_all_is_refused(paths, tmp_path, tokenizers, kind, command):
    other = "bert" if kind == "gpt" else "gpt"
    sizes = {k: len(json.loads((Path(paths[f"export_{k}"]) / "tokenizer.json").read_text())["model"]["vocab"])
             + (k == "bert") for k in ("gpt", "bert")}                     # BERT's [MASK] is an added token
    cases = {"another export's": ((Path(paths[f"export_{other}"]) / "tokenizer.json").read_text(),
                                  f"a vocabulary of {sizes[other]} tokens, but the model in {tmp_path / 'm'} has "
                                  f"{sizes[kind]} (vocab_size in its config.json): a tokenizer of another model?"),
             "no tokenizer": ("{}", "not a tokenizer the tokenizers package can read"),
             "half a tokenizer": ('{"version": "1.0"}', "not a tokenizer the tokenizers package can read")}
    for name, (content, message) in cases.items():
        model = tmp_path / "m"
        shutil.rmtree(model, ignore_errors=True)
        shutil.copytree(paths[f"export_{kind}"], model)
        (model / "tokenizer.json").write_text(content)
        code, _, err = _run([command[0], "--model", str(model), *command[1:]])
        assert code == USAGE, (name, err)
        assert err.startswith(f"npformer {command[0]}: error: {model / 'tokenizer.json'}: "), (name, err)
        assert message in err and len(err.splitlines()) == 1, (name, err)


def test_an_export_refuses_characters_outside_its_vocabulary_as_its_checkpoint_does(paths, tokenizers):
    code, out, err = _run(["generate", "--model", paths["export"], "--prompt", "ZZZ~", "--tokens", "5"])
    assert code == USAGE and out == ""
    assert err == ("npformer generate: error: the prompt 'ZZZ~': 'Z', '~' are not in the model's vocabulary (its "
                   "tokenizer reads them as '<unk>')\n")
    code, _, err = _run(["generate", "--checkpoint", paths["gpt"], "--prompt", "ZZZ~"])      # the same model
    assert code == USAGE and "the characters 'Z~' are not in the model's vocabulary" in err
    code, _, err = _run(["fill-mask", "--model", paths["export_bert"], "Z[MASK]"])
    assert code == USAGE and "text 'Z[MASK]': 'Z' is not in the model's vocabulary" in err
    assert _ok(["generate", "--model", paths["export"], "--prompt", "The ", "--tokens", "3"]).startswith("The ")


# -- accepted, with a note or a better default ------------------------------------------------------------

def test_more_threads_than_cpus_are_capped_with_a_note(paths, tmp_path):
    from npformer.kernels.cpu.threads import usable_cpus, within_cpus
    cpus = usable_cpus()
    assert within_cpus(cpus, "--threads") == (cpus, None)
    out = _ok(["train", *TINY, "--threads", "100000", "--out-dir", str(tmp_path / "run")])
    assert out.startswith(f"note: --threads 100000 is more than the {cpus} CPUs this process may use; using {cpus}\n")
    assert f" threads={cpus} " in out
    assert json.loads((tmp_path / "run" / "config.json").read_text())["threads"] == cpus


def test_generate_without_a_prompt_starts_from_the_text_when_the_default_is_not_in_it(paths, tmp_path):
    text = tmp_path / "lower.txt"
    text.write_text("abc def, ghi jkl. " * 80)                          # no 'T': "The " cannot be read
    ckpt = str(tmp_path / "lower.npz")
    _ok(["train", *LM, "--text", str(text), "--checkpoint", ckpt, "--out-dir", str(tmp_path / "run")])
    assert _ok(["generate", "--checkpoint", ckpt, "--tokens", "0"]) == "abc \n"     # the text's first characters
    assert _ok(["generate", "--checkpoint", ckpt, "--tokens", "5"]).startswith("abc ")
    assert _ok(["generate", "--checkpoint", paths["gpt"], "--tokens", "0"]) == "The \n"
