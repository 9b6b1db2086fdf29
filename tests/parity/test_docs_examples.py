"""The documentation's PyTorch examples (```py blocks, on docs/pages/interop.md: they need torch and
transformers, so tests/test_docs.py, which runs the ```python blocks everywhere, leaves them to this
file) run as written, and each prints a max difference within the parity tolerance (float32: 1e-5
relative)."""
import contextlib
import io

import pytest

for _mod in ("torch", "transformers", "safetensors"):
    pytest.importorskip(_mod, reason=f"{_mod} not installed: the documentation's interop examples need it")

import transformers  # noqa: E402

from tests.test_docs import PAGES, ROOT, blocks  # noqa: E402

pytestmark = pytest.mark.torch


def test_docs_py_examples_run_and_agree(tmp_path, monkeypatch):
    found = [(page, b) for page in PAGES for b in blocks(page.read_text()) if b.lang == "py"]
    assert [page.name for page, _ in found] == ["interop.md", "interop.md"], "the interop and GPT-2 examples"
    monkeypatch.chdir(tmp_path)                         # the GPT-2 example writes tiny-gpt2/
    transformers.logging.disable_progress_bar()
    for page, block in found:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block.code, f"{page.relative_to(ROOT)} line {block.line}", "exec"), {"__name__": "docs"})
        printed = out.getvalue().split()
        assert len(printed) == 1 and 0 <= float(printed[0]) < 1e-5, printed
    assert (tmp_path / "tiny-gpt2" / "model.safetensors").is_file()
