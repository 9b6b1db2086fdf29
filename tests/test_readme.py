"""The README: its Python examples run as written, its two set-up commands are the ones CI uses, it
stays short and answers a new user's first questions, and its links lead somewhere. (The rest of the
documentation is tested by test_docs.py.)"""
import contextlib
import io
import re
import unicodedata
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
    """The README holds two python blocks, each run here on its own: the op example prints a passing
    gradient check (it runs first), the model example is tested below."""
    blocks = _python_blocks((ROOT / "README.md").read_text())
    tour = [b for b in blocks if "npformer.gradcheck(" in b]
    assert len(blocks) == 2 and len(tour) == 1 and blocks[0] == tour[0], "the op example, then the model's"
    printed = _run(tour[0])
    assert "gradcheck" in printed and "FAIL" not in printed, printed
    assert len(tour[0].strip().splitlines()) <= 20, "the README's API example stays short"


def test_readme_is_short_and_answers_the_first_questions():
    """At most 250 lines (the reference is docs/pages), and it says how to train on your own text,
    where the metrics are and how to export a model, each in its own words."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for needed in ("npformer train --task charlm --text", "metrics.jsonl", "npformer export --checkpoint",
                   "--checkpoint", "run directory"):
        assert needed in readme, needed


def test_readme_lists_every_extra():
    """The install table names each extra of setup.cfg as the command that installs it."""
    import configparser
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    readme = (ROOT / "README.md").read_text()
    for extra in cfg["options.extras_require"]:
        assert f'| `pip install -e ".[{extra}]"` |' in readme, extra


def _slug(heading: str) -> str:
    """The anchor of a heading, as GitHub and MkDocs's toc both make it for the headings used here."""
    text = unicodedata.normalize("NFKD", heading.replace("`", "")).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def _anchors(path: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)}


def test_readme_links_lead_to_files_and_headings():
    """Every relative link of the README names a file of the checkout and, with #anchor, one of its
    headings (the README is not built by MkDocs, so nothing else checks them)."""
    readme = ROOT / "README.md"
    targets = re.findall(r"\]\(([^)\s]+)\)", readme.read_text())
    local = [t for t in targets if "://" not in t]
    assert any(t.startswith("docs/pages/") for t in local)
    for target in local:
        name, _, anchor = target.partition("#")
        path = (ROOT / name) if name else readme
        assert path.exists(), target
        if anchor:
            assert anchor in _anchors(path), f"{target}: no heading with that anchor"


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
