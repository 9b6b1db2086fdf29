"""The README's Python example runs as written, and its two set-up commands are the ones CI uses."""
import contextlib
import io
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _python_blocks(text):
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_python_examples_run():
    """Every python block runs on its own; the tour (the first) prints a passing gradient check."""
    blocks = _python_blocks((ROOT / "README.md").read_text())
    assert blocks, "the README has no python example"
    printed = []
    for code in blocks:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
        printed.append(out.getvalue())
        assert "FAIL" not in printed[-1], printed[-1]
    assert "gradcheck" in printed[0], printed[0]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -e ".[test]" && pytest' in readme
    # CI installs the test extra (with the optional extras the tests exercise), then runs `pytest`
    assert re.search(r'^pip_install -e "\.\[test[,a-z]*\]"$', ci, flags=re.M)
    assert re.search(r"^pytest\s*$", ci, flags=re.M)
    assert "pip install -e . && npformer train" in readme
