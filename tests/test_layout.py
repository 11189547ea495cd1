"""The package reads as the data flow: each layer imports only the layers before it, and nothing
in `jaxinfer/` or `tests/` loads a script (scripts are tools that import the package, never the
other way round)."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# jaxinfer's layers, in data-flow order (`jaxinfer/__init__.py`): a module may import its own
# layer and the ones before it. pallas_kernels imports only jax.
LAYERS = ["config", "families", "sharding", "model", "checkpoint", "perf", "engine", "proof",
          "train", "tts", "serve", "cli"]


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "jaxinfer" or len(parts) == 1:
        return None
    return LAYERS.index(parts[1])


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, at any depth (function-level ones too)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                    if node.module == "jaxinfer"]
    return out


MODULES = sorted((ROOT / "jaxinfer").rglob("*.py"))


def test_every_module_belongs_to_a_layer():
    for path in MODULES:
        rel = path.relative_to(ROOT).with_suffix("")
        if rel.name != "__init__" or len(rel.parts) > 2:
            assert _layer(".".join(rel.parts)) is not None, rel


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_a_later_layer(path):
    rel = path.relative_to(ROOT).with_suffix("")
    if len(rel.parts) == 2 and rel.name == "__init__":
        return  # the package's lazy public API (jaxinfer/__init__.py) names every layer
    own = _layer(".".join(rel.parts))
    for line, module in _imports(path):
        if module.split(".")[0] == "scripts":
            pytest.fail(f"{rel}:{line} imports the script {module}")
        layer = _layer(module)
        if layer is not None and layer > own:
            pytest.fail(f"{rel}:{line} ({LAYERS[own]}) imports {module} ({LAYERS[layer]})")
    assert "pallas_kernels" not in str(rel)


def test_pallas_kernels_import_only_jax():
    for path in sorted((ROOT / "pallas_kernels").rglob("*.py")):
        for line, module in _imports(path):
            assert module.split(".")[0] not in ("jaxinfer", "scripts", "tests"), (path, line)


def test_tests_load_no_script():
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for line, module in _imports(path):
            assert module.split(".")[0] != "scripts", (path, line)
        for node in ast.walk(ast.parse(path.read_text())):  # importlib's load-a-file route
            assert not (isinstance(node, ast.Attribute)
                        and node.attr == "spec_from_file_location"), (path, node.lineno)


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def _import_graph() -> dict[str, set[str]]:
    """module -> the jaxinfer / pallas_kernels modules it imports, at any depth (function-level and
    `TYPE_CHECKING` imports too: a circle a lazy import hides is still a circle in the design).
    `from pkg import name` counts as importing `pkg.name` when that is a module, else `pkg`."""
    paths = sorted((ROOT / "jaxinfer").rglob("*.py")) + sorted(
        (ROOT / "pallas_kernels").rglob("*.py"))
    known = {_module_name(p) for p in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        name, edges = _module_name(path), set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                edges |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known
                          else node.module for a in node.names}
        graph[name] = {m for m in edges if m in known and m != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                out.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


# The only import circles allowed, each to be broken by passing what the helper module needs as
# arguments (or moving the shared types down a level); remove an entry when its circle is gone.
KNOWN_CIRCLES: set[frozenset[str]] = set()


def test_no_import_circle():
    circles = set(_circles(_import_graph()))
    new = [sorted(c) for c in circles - KNOWN_CIRCLES]
    assert not new, f"import circles: {new}"
    gone = [sorted(c) for c in KNOWN_CIRCLES - circles]
    assert not gone, f"these circles are broken: remove them from KNOWN_CIRCLES: {gone}"


def test_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(graph) == [frozenset({"a", "b", "c"})]
