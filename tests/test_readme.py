"""The README's Python example runs as written, and its two set-up commands are the ones CI uses."""
import contextlib
import io
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _python_blocks(text):
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _run(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    return out.getvalue()


def test_readme_python_examples_run():
    blocks = _python_blocks((ROOT / "README.md").read_text())
    tour = [b for b in blocks if "npformer.gradcheck(" in b]
    switch = [b for b in blocks if "kernels.disabled()" in b]
    assert len(tour) == 1 and len(switch) == 1, "the README's tour and its fast-path example"
    printed = _run(tour[0])
    assert "gradcheck" in printed and "FAIL" not in printed, printed
    lines = _run(switch[0]).split()
    assert lines[0] == "reference" and lines[1] == "cpu" and float(lines[2]) < 1e-6, lines


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -e ".[test]" && pytest' in readme
    # CI installs the test extra (with the optional extras the tests exercise), then runs `pytest`
    assert re.search(r'^pip_install -e "\.\[test[,a-z]*\]"$', ci, flags=re.M)
    assert re.search(r"^pytest\s*$", ci, flags=re.M)
    assert "pip install -e . && npformer train" in readme
