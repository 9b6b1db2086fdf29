"""The README's interop and GPT-2 examples (```py blocks: they need torch and transformers, so
tests/test_readme.py, which runs the ```python blocks everywhere, leaves them to this file) run as
written, and each prints a max difference within the parity tolerance (float32: 1e-5 relative)."""
import contextlib
import io
import re
from pathlib import Path

import pytest

for _mod in ("torch", "transformers", "safetensors"):
    pytest.importorskip(_mod, reason=f"{_mod} not installed: the README's interop examples need it")

import transformers  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"
pytestmark = pytest.mark.torch


def test_readme_py_examples_run_and_agree(tmp_path, monkeypatch):
    blocks = re.findall(r"```py\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 2, "expected the interop and GPT-2 examples"
    monkeypatch.chdir(tmp_path)                         # the GPT-2 example writes tiny-gpt2/
    transformers.logging.disable_progress_bar()
    for code in blocks:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
        printed = out.getvalue().split()
        assert len(printed) == 1 and 0 <= float(printed[0]) < 1e-5, printed
    assert (tmp_path / "tiny-gpt2" / "model.safetensors").is_file()
