"""The documentation site (docs/pages, built from docs/mkdocs.yml) runs as written and builds.

How a page's code blocks are tested, by the fence's language:

* ``python``: run here, in order, in one namespace per page, in a fresh working directory; a
  ``text`` block right after one (only blank lines between) is what it prints, compared by doctest's
  rules (``...`` matches anything, runs of spaces are equal). The tutorial is one such page.
* ``python`` right under a ``<!-- runs under LAUNCHER: tests/FILE.py -->`` line: the block needs a
  launcher this process cannot be (``mpirun -n 2``), so that test file runs it; here we check that
  the file exists and reads the page.
* ``py``: needs PyTorch (and transformers), so ``tests/parity/test_docs_examples.py`` runs it where
  they are installed.
* ``console``: transcripts of real runs (``$`` commands and what they printed, shortened with
  ``...``). They are not executed: they take minutes and their speeds depend on the machine. The
  commands themselves are tested by ``tests/test_cli*.py``, and ``.ci/run`` runs the README's
  set-up commands exactly as written.

The build (``mkdocs build --strict``) fails on any warning, among them a link to a missing page,
image or anchor, so building checks every internal link. External links are checked for their form
only (https with a host): CI has no network beyond the package registries, and a fetch would make
the suite depend on other people's servers."""
import contextlib
import doctest
import importlib.util
import io
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted((DOCS / "pages").rglob("*.md"))
LANGUAGES = {"python", "py", "text", "console", "bash"}
RUNNER = re.compile(r"<!-- runs under [^:]+: (?P<test>tests/\S+\.py) -->")
FENCE = re.compile(r"```(?P<lang>\S*)")


class Block(NamedTuple):
    lang: str
    code: str
    line: int                 # the opening fence's line, from 1
    runner: str | None        # the test file of a <!-- runs under ...: tests/X.py --> line above it
    shown: str | None         # a python block's printed output: the text block right after it


def blocks(text: str) -> list[Block]:
    """Every fenced block of a markdown text; a fence must start its line."""
    lines = text.split("\n")
    found, i = [], 0              # (lang, code, first line index, last line index, runner)
    while i < len(lines):
        opening = FENCE.fullmatch(lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j] == "```"), None)
        assert end is not None, f"line {i + 1}: the block opened here is not closed"
        marker = RUNNER.fullmatch(lines[i - 1]) if i else None
        found.append((opening["lang"], "".join(line + "\n" for line in lines[i + 1:end]), i, end,
                      marker and marker["test"]))
        i = end + 1
    out = []
    for n, (lang, code, first, last, runner) in enumerate(found):
        shown = None
        if lang == "python" and n + 1 < len(found):
            lang2, code2, first2, _, _ = found[n + 1]
            if lang2 == "text" and not any(line.strip() for line in lines[last + 1:first2]):
                shown = code2
        out.append(Block(lang, code, first + 1, runner, shown))
    return out


def runnable(page: Path) -> list[Block]:
    """The blocks of ``page`` this file runs: python, not left to another test."""
    return [b for b in blocks(page.read_text()) if b.lang == "python" and b.runner is None]


def test_the_block_reader_pairs_outputs_and_finds_markers():
    text = ("```python\nprint(1)\n```\n\n```text\n1\n```\nprose\n```python\nx = 2\n```\n```console\n$ ls\n```\n"
            "<!-- runs under mpirun -n 2: tests/distributed/test_cli_mpi.py -->\n```python\ny = 3\n```\n")
    found = blocks(text)
    assert [(b.lang, b.code, b.shown) for b in found] == [
        ("python", "print(1)\n", "1\n"), ("text", "1\n", None), ("python", "x = 2\n", None),
        ("console", "$ ls\n", None), ("python", "y = 3\n", None)]
    assert [b.runner for b in found] == [None] * 4 + ["tests/distributed/test_cli_mpi.py"]
    assert [b.line for b in found] == [1, 5, 9, 12, 16]


def test_every_block_says_what_it_is():
    """A fence names one of the languages the docstring above explains, so no block goes untested
    by mistake (an unnamed fence, a ```python3)."""
    for path in [ROOT / "README.md", *PAGES]:
        for block in blocks(path.read_text()):
            assert block.lang in LANGUAGES, f"{path.relative_to(ROOT)} line {block.line}: ```{block.lang}"
        assert not re.search(r"^[ \t]+```", path.read_text(), flags=re.M), f"{path}: an indented fence"


@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p)], ids=lambda p: p.name)
def test_page_runs_and_prints_what_it_shows(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                     # pages write files (run directories, models, PNGs)
    found = runnable(page)
    if page.name == "tutorial.md":                  # the tutorial is a walk of many steps, each shown
        assert len(found) >= 8 and sum(b.shown is not None for b in found) >= 7
    namespace = {"__name__": "docs"}
    checker = doctest.OutputChecker()
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    for block in found:
        printed = io.StringIO()
        where = f"docs/pages/{page.relative_to(DOCS / 'pages')} line {block.line}"
        with contextlib.redirect_stdout(printed):
            exec(compile(block.code, where, "exec"), namespace)
        if block.shown is not None:
            assert checker.check_output(block.shown, printed.getvalue(), flags), (
                f"{where} printed\n{printed.getvalue()}\nbut the page shows\n{block.shown}")
    if page.name == "tutorial.md" and importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "tutorial_attention.png").stat().st_size > 1000     # its last block draws


def test_blocks_run_elsewhere_are_run_by_the_test_they_name():
    elsewhere = [(page, b) for page in PAGES for b in blocks(page.read_text()) if b.runner]
    assert elsewhere, "the data-parallel loop runs under mpirun"
    for page, block in elsewhere:
        test = ROOT / block.runner
        assert test.is_file() and page.name in test.read_text(), f"{block.runner} does not read {page.name}"
    torch_blocks = [page for page in PAGES for b in blocks(page.read_text()) if b.lang == "py"]
    assert torch_blocks and "```py" in (ROOT / "tests/parity/test_docs_examples.py").read_text()


def _links(text: str) -> list[str]:
    """The targets of markdown links and images, and of <https://...> autolinks."""
    return re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r"<(https?://[^>]+)>", text)


def test_external_links_are_https_with_a_host():
    for path in [ROOT / "README.md", *PAGES]:
        for target in _links(path.read_text()):
            parts = urlsplit(target)
            if parts.scheme or target.startswith("//"):
                assert parts.scheme == "https" and parts.netloc, f"{path.relative_to(ROOT)}: {target}"


def test_every_page_is_in_the_nav_and_mkdocs_yml_is_strict():
    config = (DOCS / "mkdocs.yml").read_text()
    assert "\nstrict: true\n" in config and "\ndocs_dir: pages\n" in config
    for name in ("omitted_files", "not_found", "anchors", "unrecognized_links"):
        assert re.search(rf"\n\s+{name}: warn\n", config), name
    for page in PAGES:
        assert str(page.relative_to(DOCS / "pages")) in config, f"{page.name} is not in mkdocs.yml's nav"


def test_the_site_builds_without_a_warning(tmp_path):
    """``mkdocs build --strict``, as .ci/run does: a broken link or anchor, a page left out of the
    nav or a docstring mkdocstrings cannot render fails it."""
    for module in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason=f'{module} not installed: the docs extra builds the site '
                                           '(pip install -e ".[docs]")')
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(DOCS / "mkdocs.yml"),
                          "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "WARNING" not in run.stderr + run.stdout, run.stderr[-4000:]
    assert (tmp_path / "site" / "api" / "ops" / "index.html").is_file()


def test_ci_builds_the_site_strictly_from_the_docs_extra():
    """.ci/run installs the docs extra and builds the site with --strict, outside the checkout."""
    import configparser
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    docs = cfg["options.extras_require"]["docs"].split()
    assert any(r.startswith("mkdocs>=") for r in docs) and any(r.startswith("mkdocstrings[python]") for r in docs)
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    build = lines.index('mkdocs build --strict -f docs/mkdocs.yml -d "$work/site"')
    assert lines.index('pip_install -e ".[docs]"') < build < lines.index("pytest", build)
