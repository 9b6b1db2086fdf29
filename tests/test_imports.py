"""The package's import graph, read from the source (every import statement, at module level or inside a
function): no cycles, the layers read bottom-up, and the reference ops neither import numpy or cupy
nor reach the fast-path layer except through the dispatcher."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "npformer"

# Lower layers never import higher ones. Layers of one rank do not import each other either.
LAYERS = {"errors": 0, "version": 0, "launcher": 0, "backend": 1, "progress": 1, "files": 1, "data": 1, "checks": 2,
          "interop": 2, "dispatch": 3, "ops": 4, "kernels": 5, "nn": 6, "models": 7, "distributed": 7, "training": 8,
          "tools": 8, "study": 9, "pretrained": 9, "bench": 9, "cli": 10, "__main__": 11, "npformer": 11}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str:
    """The npformer module a dotted import name refers to (``from a.b import c``: ``a.b.c`` if it is
    a module, else ``a.b``)."""
    while name not in MODULES:
        name = name.rsplit(".", 1)[0]
    return name


def _imports(path: pathlib.Path) -> set[str]:
    """Every module an import statement in ``path`` names (npformer's resolved, others by top name)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            assert not isinstance(node, ast.ImportFrom), f"{path}: relative import (use absolute ones)"
            continue
        for name in names:
            found.add(_resolve(name) if name.split(".")[0] == "npformer" else name.split(".")[0])
    return found


GRAPH = {m: {t for t in _imports(p) if t in MODULES and t != m} for m, p in MODULES.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_the_graph_is_read_from_every_module():
    assert len(MODULES) > 80 and "npformer.ops.attention" in MODULES and "npformer.kernels.cpu.softmax" in MODULES
    assert "npformer.ops.softmax" in GRAPH["npformer.kernels.cpu.softmax"]


def test_no_import_cycles():
    """Tarjan's strongly connected components: any component of two or more modules is a cycle."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_layers_read_bottom_up():
    assert {_layer(m) for m in MODULES} <= set(LAYERS), "a new top-level module needs a rank in LAYERS"
    upward = [(m, t) for m, targets in GRAPH.items() for t in targets
              if _layer(m) != _layer(t) and LAYERS[_layer(t)] >= LAYERS[_layer(m)]]
    assert not upward, f"imports from a layer into one at its rank or above: {sorted(upward)}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("npformer.ops")))
def test_reference_ops_import_no_array_library_and_no_fast_path(module):
    names = _imports(MODULES[module])
    assert not names & {"numpy", "cupy", "cupyx"}, f"{module} imports {sorted(names & {'numpy', 'cupy', 'cupyx'})}"
    assert not any(n.startswith("npformer.kernels") for n in names), \
        f"{module} reaches the fast paths directly; it may only be dispatched (npformer.dispatch)"


def test_a_cycle_would_be_found():
    """The checker is tested too: a cycle put into the graph is reported."""
    GRAPH["npformer.errors"].add("npformer.cli")
    try:
        with pytest.raises(AssertionError, match="import cycles"):
            test_no_import_cycles()
    finally:
        GRAPH["npformer.errors"].discard("npformer.cli")
