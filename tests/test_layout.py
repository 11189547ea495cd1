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
LAYERS = ["config", "families", "sharding", "model", "checkpoint", "perf", "engine", "tts",
          "serve", "cli"]


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
