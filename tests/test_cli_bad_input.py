"""Bad invocations of every sub-command, run in-process: each ends with one line on stderr,
``npformer COMMAND: error: ...`` naming the flag, and exit status 2 (a usage error) or 1 (a training
run that diverged, or the machine out of memory: valid settings, a failed run; see npformer.cli).
None ends in a traceback, none is accepted silently, and none trains a model (the checks run before
the work; the few rows that get as far as building a trainer use tiny sizes).

A summary of the rows by outcome is written at the end of the module's run.

Not here: a --checkpoint that is a directory or cannot be written (the checkpoint path checks live in
npformer/training/checkpoint.py and loop.py, another branch's work), and npformer bench's own options
beyond its exit status (the suite, npformer.bench, parses them with argparse's usual usage block).
"""
import collections
import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from npformer import cli
from npformer.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--task", "copy", "--n-train", "200", "--steps", "6", "--warmup", "1", "--d-model", "16", "--heads", "2",
        "--layers", "1", "--ff", "32", "--batch-size", "8", "--eval-every", "0", "--log-every", "3"]
LM = ["--task", "charlm", "--steps", "4", "--warmup", "1", "--d-model", "16", "--heads", "2", "--layers", "1",
      "--ff", "32", "--batch-size", "4", "--block-size", "16", "--eval-every", "0", "--log-every", "2"]
XL = ["--task", "recall", "--steps", "3", "--warmup", "0", "--d-model", "16", "--heads", "2", "--layers", "1",
      "--ff", "16", "--batch-size", "4", "--block-size", "4", "--n-train", "16", "--eval-every", "0"]
USAGE, DIVERGED = 2, 1
COMMANDS = ("train", "eval", "plot", "translate", "generate", "embed", "gradcheck", "study", "bench")

OUTCOMES: collections.Counter = collections.Counter()


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
    train("--precision", "bfloat16", names="--precision bfloat16"),        # NumPy has no bfloat16
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
    lm("--text", "{dir}/missing.txt", names="missing.txt"),
    lm("--text", "{empty}", names="empty.txt"),
    lm("--text", "{short}", names="block_size"),
    lm("--text", "{dir}", names="is not a file"),
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
    # -- eval, plot ---------------------------------------------------------------------------------
    row(["eval", "--checkpoint", "{dir}/missing.npz"], "missing.npz"),
    row(["eval", "--checkpoint", "{file}"], "not an npformer checkpoint"),
    row(["eval", "--checkpoint", "{dir}"], "without best.npz or last.npz"),
    row(["eval"], "--checkpoint"),
    row(["plot", "{dir}"], "no metrics file"),
    row(["plot", "{file}"], "line 1"),
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
    row(["generate", "--model", "{dir}"], "tokenizer.json"),
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
    row(["eval", "--checkpoint", "{s2s}", "--jsn"], "did you mean --json?"),
    row(["generate", "--checkpoint", "{gpt}", "--temprature", "1"], "did you mean --temperature?"),
    row(["study", "positional", "--outt", "{dir}"], "did you mean --out?"),
    row(["gradcheck", "--zzz"], "unrecognized arguments: --zzz"),
    # -- the command itself -----------------------------------------------------------------------
    row(["fly"], "COMMAND"),
]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """Tiny checkpoints (a Seq2Seq, a GPT) and files to point flags at."""
    d = tmp_path_factory.mktemp("bad_input")
    s2s, gpt = str(d / "s2s.npz"), str(d / "gpt.npz")
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["train", *TINY, "--checkpoint", s2s, "--out-dir", str(d / "run-s2s")]) == 0
        assert main(["train", *LM, "--checkpoint", gpt, "--out-dir", str(d / "run-gpt")]) == 0
    (d / "afile.txt").write_text("x")
    (d / "empty.txt").write_text("")
    (d / "short.txt").write_text("abc")
    (d / "bad_key.json").write_text('{"nheads": 4}')
    (d / "bad_value.json").write_text('{"lr": "fast"}')
    (d / "bad.toml").write_text("steps = = 3")
    return {"dir": str(d), "s2s": s2s, "gpt": gpt, "file": str(d / "afile.txt"), "empty": str(d / "empty.txt"),
            "short": str(d / "short.txt"), "bad_key": str(d / "bad_key.json"), "bad_value": str(d / "bad_value.json"),
            "bad_toml": str(d / "bad.toml")}


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
    if len(err.splitlines()) != 1:
        return f"exit {code}, {len(err.splitlines())} lines on stderr"
    return {USAGE: "clear usage error (exit 2)", DIVERGED: "diverged run, one line (exit 1)"}.get(code, f"exit {code}")


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
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{command}: error: "), lines[0]
    assert names in lines[0], lines[0]


def test_the_table_covers_every_subcommand():
    commands = {p.values[0][0] for p in CASES}
    assert commands >= {"train", "generate", "translate", "embed", "gradcheck", "study"}
    studied = {p.values[0][1] for p in CASES if p.values[0][0] == "study" and len(p.values[0]) > 1}
    assert studied >= set(cli.EXPERIMENTS)


def test_bench_options_end_in_a_usage_error_not_a_traceback(capsys):
    """npformer bench hands its options to the suite (npformer.bench), whose parser prints argparse's
    usage block before its error line; the status is 2 and nothing escapes."""
    for argv in (["bench", "--threads", "0"], ["bench", "--paths", "turbo"], ["bench", "--nope"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1].startswith("npformer bench: error: ")


# -- what must still work ----------------------------------------------------------------------------

@pytest.mark.parametrize("alias, canonical", [
    (["--learning-rate", "0.002"], ["--lr", "0.002"]), (["--learning_rate", "0.002"], ["--lr", "0.002"]),
    (["--max-steps", "7"], ["--steps", "7"]), (["--max_iters", "7"], ["--steps", "7"]),
    (["--n-layer", "3"], ["--layers", "3"]), (["--n_head", "4"], ["--heads", "4"]),
    (["--n-embd", "32"], ["--d-model", "32"]), (["--batch_size", "5"], ["--batch-size", "5"]),
    (["--output-dir", "somewhere"], ["--out-dir", "somewhere"]), (["--output_dir", "x"], ["--out-dir", "x"]),
    (["--no_bias"], ["--no-bias"]), (["--eval_every", "3"], ["--eval-every", "3"])])
def test_other_tools_names_of_train_flags_are_hidden_synonyms(alias, canonical):
    """nanoGPT's, Hugging Face's and PyTorch examples' names parse as npformer's own flags (the same
    value in the same field) and stay out of --help."""
    parser = cli.build_parser()
    assert vars(parser.parse_args(["train", *alias])) == vars(parser.parse_args(["train", *canonical]))
    assert alias[0] not in parser.commands["train"].format_help()


def _ok(argv, paths=None):
    argv = [a.format(**paths) for a in argv] if paths else argv
    code, out, err = _run(argv)
    assert code == 0 and err == "", (code, err)
    return out


def test_a_short_run_without_warmup_trains(paths):
    """--steps 50 alone used to fail on the default warm-up of 100; a run of 100 steps or fewer now
    warms up for steps // 10."""
    i = TINY.index("--warmup")
    out = _ok(["train", *TINY[:i], *TINY[i + 2:], "--steps", "50", "--log-every", "50"])
    assert "final validation" in out
    from npformer.training.config import make_config
    assert make_config({"steps": 50}).warmup == 5 and make_config({"steps": 700}).warmup == 100


def test_good_training_flags_still_run(paths):
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
