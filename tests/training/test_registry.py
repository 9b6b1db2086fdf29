"""The layout of npformer.training: every model name has a trainer, imported directly, and the
modules import bottom-up (config, loop, the task trainers, the registry) without a cycle."""
import ast
from pathlib import Path

from npformer.training.config import CONFIGS, DEFAULT_MODELS
from npformer.training.loop import Trainer
from npformer.training.registry import TRAINERS

TRAINING = Path(__file__).resolve().parents[2] / "npformer" / "training"
TASK_TRAINERS = {"seq2seq_trainer", "lm_trainer", "mlm_trainer", "xl_trainer"}


def _tree(name: str) -> ast.Module:
    return ast.parse((TRAINING / f"{name}.py").read_text(), filename=f"{name}.py")


def _training_imports(name: str) -> set[str]:
    """The npformer.training modules that module ``name`` imports, at any depth of its code."""
    found = set()
    for node in ast.walk(_tree(name)):
        if isinstance(node, ast.ImportFrom) and node.module == "npformer.training":
            found |= {alias.name for alias in node.names if (TRAINING / f"{alias.name}.py").is_file()}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("npformer.training."):
            found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("npformer.training.")}
    return found


def _uses_string_imports(name: str) -> list[str]:
    """Calls that import a module named by a string: importlib.import_module, __import__."""
    hits = []
    for node in ast.walk(_tree(name)):
        if isinstance(node, ast.Import) and any(a.name == "importlib" for a in node.names):
            hits.append(f"line {node.lineno}: import importlib")
        elif isinstance(node, ast.ImportFrom) and node.module == "importlib":
            hits.append(f"line {node.lineno}: from importlib import ...")
        elif isinstance(node, ast.Call):
            fn = node.func
            called = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if called in ("import_module", "__import__"):
                hits.append(f"line {node.lineno}: {called}(...)")
    return hits


def test_every_model_name_maps_to_its_trainer_class():
    assert list(TRAINERS) == list(CONFIGS)                     # the same names, in the same order
    for name, trainer in TRAINERS.items():
        assert isinstance(trainer, type) and issubclass(trainer, Trainer), name
        assert trainer.kind == name                             # the checkpoint kind is the model name
    assert set(DEFAULT_MODELS.values()) <= set(TRAINERS)
    assert set(DEFAULT_MODELS) >= {"dates", "numbers", "copy", "reverse", "charlm", "recall"}


def test_the_registry_imports_every_trainer_directly():
    assert _uses_string_imports("registry") == []
    imported = {alias.name: node.module for node in ast.walk(_tree("registry"))
                if isinstance(node, ast.ImportFrom) for alias in node.names}
    for trainer in TRAINERS.values():
        assert imported.get(trainer.__name__) == trainer.__module__, trainer


def test_no_module_of_training_imports_by_string():
    for path in sorted(TRAINING.glob("*.py")):
        assert _uses_string_imports(path.stem) == [], path.name


def test_training_modules_import_bottom_up_without_a_cycle():
    names = [p.stem for p in sorted(TRAINING.glob("*.py")) if p.stem != "__init__"]
    graph = {name: _training_imports(name) for name in names}
    assert graph["config"] == set()                                     # imports no other training module
    assert not graph["loop"] & (TASK_TRAINERS | {"registry"})
    assert "config" in graph["loop"]
    for trainer in TASK_TRAINERS:
        assert "loop" in graph[trainer], trainer
        assert not graph[trainer] & (TASK_TRAINERS | {"registry"}), (trainer, graph[trainer])
    assert graph["registry"] >= TASK_TRAINERS | {"config", "loop"}
    assert not any("registry" in imports for imports in graph.values())  # nothing is above it

    done, active = set(), []

    def visit(name):                                                    # depth-first; a cycle raises
        assert name not in active, "import cycle: " + " -> ".join(active[active.index(name):] + [name])
        if name in done:
            return
        active.append(name)
        for dep in sorted(graph[name]):
            visit(dep)
        active.pop()
        done.add(name)

    for name in names:
        visit(name)
