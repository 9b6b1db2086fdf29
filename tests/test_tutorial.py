"""docs/tutorial.md runs as written: its python blocks in order, in one namespace, each block's printed
output compared with the text block shown under it (doctest's rules: ``...`` matches anything,
runs of spaces are equal), and the attention PNG written when matplotlib is present."""
import contextlib
import doctest
import io
import re
from pathlib import Path

import pytest

from tests.helpers import NO_MATPLOTLIB

TUTORIAL = Path(__file__).resolve().parents[1] / "docs" / "tutorial.md"
# a python block, then (optionally, after blank lines only) the text block of what it prints
BLOCK = re.compile(r"```python\n(?P<code>.*?)```(?:\n\s*```text\n(?P<shown>.*?)```)?", re.S)


def blocks(text: str) -> list[tuple[str, str | None]]:
    return [(m["code"], m["shown"]) for m in BLOCK.finditer(text)]


def test_the_block_reader_pairs_outputs_with_their_blocks():
    text = "```python\nprint(1)\n```\n\n```text\n1\n```\nprose\n```python\nx = 2\n```\n```bash\nls\n```\n"
    assert blocks(text) == [("print(1)\n", "1\n"), ("x = 2\n", None)]


def test_tutorial_runs_and_prints_what_it_shows(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                     # the tutorial writes its PNG to the working directory
    found = blocks(TUTORIAL.read_text())
    assert len(found) >= 8 and sum(shown is not None for _, shown in found) >= 7
    namespace = {"__name__": "tutorial"}
    checker = doctest.OutputChecker()
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    for number, (code, shown) in enumerate(found, start=1):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(code, f"docs/tutorial.md block {number}", "exec"), namespace)
        if shown is not None:
            assert checker.check_output(shown, printed.getvalue(), flags), (
                f"block {number} printed\n{printed.getvalue()}\nbut the tutorial shows\n{shown}")
    pytest.importorskip("matplotlib", reason=NO_MATPLOTLIB)
    assert (tmp_path / "tutorial_attention.png").stat().st_size > 1000
