"""The README's Python example runs as written, and its two set-up commands are the ones CI uses."""
import contextlib
import io
import re
from pathlib import Path

from npformer.kernels import numba_cpu

ROOT = Path(__file__).resolve().parents[1]


def _python_blocks(text):
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _run(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    return out.getvalue()


def test_readme_python_examples_run():
    """Every python block runs on its own; the tour (the first) prints a passing gradient check."""
    blocks = _python_blocks((ROOT / "README.md").read_text())
    tour = [b for b in blocks if "npformer.gradcheck(" in b]
    switch = [b for b in blocks if "kernels.disabled()" in b]
    assert len(tour) == 1 and len(switch) == 1, "the README's tour and its fast-path example"
    printed = _run(tour[0])
    assert "gradcheck" in printed and "FAIL" not in printed, printed
    lines = _run(switch[0]).split()
    expected = "numba" if numba_cpu.AVAILABLE else "cpu"
    assert lines[0] == "reference" and lines[1] == expected and float(lines[2]) < 1e-6, lines


def _setup_commands(readme: str) -> list[str]:
    """The commands of the README's set-up section, in order (its one-line bash blocks)."""
    section = readme.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", section, flags=re.S)]


def test_ci_runs_the_readme_set_up_commands_exactly():
    """.ci/run's first stage is the README's two commands as written, in a fresh environment; the
    training command may only gain flags that shorten the run."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = _setup_commands(readme)
    assert commands == ["pip install -e . && npformer train", 'pip install -e ".[test]" && pytest']
    train, test = commands
    lines = [line.strip() for line in ci.splitlines()]
    first = next(i for i, line in enumerate(lines) if line.startswith("python3 -m venv"))
    shortened = re.compile(re.escape(train) + r"( --(steps|warmup|eval-every|log-every) \d+)*")
    at_train = next(i for i, line in enumerate(lines) if shortened.fullmatch(line))
    assert lines.index(test) == at_train + 1 and first < at_train
    assert not any("pip" in line for line in lines[first:at_train]), "something installed before the README's commands"
    assert lines.index("pip install -e \".[test]\" && pytest") < lines.index('pip_install -e ".[test,pretrained,plot,fast,tensorboard]"')


def test_readme_model_use_example_runs(tmp_path, monkeypatch):
    """The 'Using trained models' block: generate, save_pretrained and from_pretrained, as printed."""
    blocks = [b for b in _python_blocks((ROOT / "README.md").read_text()) if "save_pretrained" in b]
    assert len(blocks) == 1, "the README's generate/save_pretrained example"
    monkeypatch.chdir(tmp_path)                     # it writes a model directory
    assert _run(blocks[0]).split() == ["(1,", "13)", "True"]
