"""What a wheel of npformer holds: every folder of the package (``packages = find:`` skips a folder
without ``__init__.py``, and the installed CLI then fails with ModuleNotFoundError), its data files, the
licence, one version, and GPU extras that install binary CuPy wheels. ``.ci/run`` builds the wheel and
runs the CLI from a non-editable install; these are the fast checks of the same things."""
import configparser
import fnmatch
import importlib
import re
from pathlib import Path

import pytest

import npformer

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "npformer"
CFG = configparser.ConfigParser()
CFG.read(ROOT / "setup.cfg")


def _python_folders() -> list[str]:
    """Every folder under npformer/ holding .py files, as a dotted package name."""
    return sorted({".".join(p.parent.relative_to(ROOT).parts) for p in PACKAGE.rglob("*.py")
                   if "__pycache__" not in p.parts})


def test_every_folder_with_python_files_is_a_package():
    folders = _python_folders()
    assert {"npformer", "npformer.models", "npformer.training", "npformer.kernels.cpu"} <= set(folders)
    missing = [f for f in folders if not (ROOT / f.replace(".", "/") / "__init__.py").is_file()]
    assert not missing, f"folders without __init__.py, left out of the wheel by 'packages = find:': {missing}"


def test_setuptools_finds_every_package_folder():
    setuptools = pytest.importorskip("setuptools", reason="setuptools builds the wheel; the folders' "
                                                          "__init__.py files are checked without it above")
    include = [s.strip() for s in CFG["options.packages.find"]["include"].split(",")]
    assert CFG["options"]["packages"].strip() == "find:" and include == ["npformer", "npformer.*"]
    found = set(setuptools.find_packages(str(ROOT), include=include))
    assert found == set(_python_folders())


def test_every_package_imports_and_the_models_are_exported():
    for name in _python_folders():
        if not name.startswith("npformer.kernels.cuda"):        # imports CuPy only when a kernel runs
            importlib.import_module(name)
    from npformer.models import (ALBERT, BERT, GPT, ALBERTConfig, BERTConfig, GPTConfig, NormEncoder,   # noqa: F401
                                 NormEncoderConfig, Seq2Seq, Seq2SeqConfig, TransformerXL, TransformerXLConfig)
    import npformer.models as models
    assert all(getattr(models, name).__module__.startswith("npformer.models.") for name in models.__all__)


def test_every_data_file_is_declared_package_data():
    data = [p for p in PACKAGE.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")
            and "__pycache__" not in p.parts]
    # setuptools splits a value on commas and newlines (not spaces) and matches each part as a glob
    declared = {(pkg.strip(), pattern.strip()) for pkg, patterns in CFG["options.package_data"].items()
                for pattern in re.split(r"[,\n]", patterns) if pattern.strip()}
    for path in data:
        pkg = ".".join(path.parent.relative_to(ROOT).parts)
        assert any(p == pkg and fnmatch.fnmatchcase(path.name, pattern) for p, pattern in declared), \
            f"{path.relative_to(ROOT)} is not in [options.package_data]"


def test_one_version_and_a_licence_file():
    assert CFG["metadata"]["version"].strip() == "attr: npformer.version.__version__"
    assert re.fullmatch(r"\d+\.\d+\.\d+", npformer.__version__)
    assert CFG["metadata"]["license"].strip() == "MIT"
    assert CFG["metadata"]["license_files"].strip() == "LICENSE"
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "Copyright (c) 2026 the npformer authors" in text


def test_gpu_extras_install_binary_cupy_wheels():
    extras = {name: value.split() for name, value in CFG["options.extras_require"].items()}
    assert extras["gpu-cuda12"] == ["cupy-cuda12x>=13"] and extras["gpu-cuda13"] == ["cupy-cuda13x>=13"]
    assert not any(re.match(r"cupy\b(?!-cuda)", req) for reqs in extras.values() for req in reqs), \
        "the plain 'cupy' package builds from source"
    readme = (ROOT / "README.md").read_text()
    assert '".[gpu-cuda12]"' in readme and '".[gpu-cuda13]"' in readme and "nvidia-smi" in readme
    assert ".[gpu]" not in readme


def test_bfloat16_is_an_optional_extra():
    """ml_dtypes (bfloat16) is installed by npformer[bfloat16] and the test extra, never by npformer itself:
    the message of a bfloat16 asked for without it names the extra (npformer.backend.BFLOAT16_EXTRA)."""
    from npformer.backend import BFLOAT16_EXTRA
    extras = {name: value.split() for name, value in CFG["options.extras_require"].items()}
    assert extras["bfloat16"] == ["ml_dtypes>=0.5"] and "ml_dtypes>=0.5" in extras["test"]
    assert "ml_dtypes" not in CFG["options"]["install_requires"]
    assert BFLOAT16_EXTRA == 'pip install "npformer[bfloat16]"'


def test_metadata_a_package_index_shows():
    """Classifiers a user filters an index by (licence, Python versions, typed), the type-hint marker
    file (PEP 561) shipped, and tomli where the standard library has no tomllib (--config FILE.toml)."""
    classifiers = CFG["metadata"]["classifiers"].split("\n")
    assert "License :: OSI Approved :: MIT License" in classifiers and "Typing :: Typed" in classifiers
    low = CFG["options"]["python_requires"].strip()
    assert low == ">=3.10" and "Programming Language :: Python :: 3.10" in classifiers
    assert (PACKAGE / "py.typed").is_file()
    requires = [r.strip() for r in CFG["options"]["install_requires"].split("\n") if r.strip()]
    assert 'tomli>=1.1; python_version < "3.11"' in requires
