"""The packages' import rules (docs/architecture.md), checked on the source of every module.

Every `import` and `from ... import` is read from the syntax tree, those inside functions too (a
lazy import is still a dependency). Optional parts are reached only through the registries'
import-path strings, which must name modules that exist.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocol", "shardcast", "verification", "node", "contrib", "benchmarks")
ALLOWED: dict[str, set[str]] = {
    "protocol": set(),                                           # the bottom: imports none of the others
    "shardcast": {"protocol"},
    "verification": {"protocol"},                                # never `node`: a validator's checks stand alone
    "node": {"protocol", "shardcast", "verification"},           # never `contrib`: optional parts by registry
    "contrib": {"protocol", "shardcast", "verification", "node"},  # optional parts plug into the node
    "benchmarks": {"protocol", "shardcast", "verification", "node", "contrib"},
}


NODE_LAYERS: dict[str, set[str]] = {
    "model": set(),                                   # the bottom: the one model definition, plain modules
    "fp8": set(),                                     # block-scaled FP8 ops, for serving and training alike
    "distributed": {"model"},                         # a world of ranks: joining, order channel, EP all-to-alls
    "engine": {"model", "fp8", "distributed", "plugins"},  # inference: never rl, never a role
    "envs": {"model", "engine", "plugins"},           # tasks, and the rollout driver that runs them on an engine
    "rl": {"model", "fp8", "distributed", "envs", "recipe"},  # training: never engine, never a role
    "roles": {"model", "fp8", "distributed", "engine", "envs", "rl", "recipe", "replay", "stop_signals", "plugins",
              "heap", "thread_cpu"},
}
"""Inside `node`: which other parts of node each subpackage may import (docs/architecture.md). Model at
the bottom, engine and rl above it (each blind to the other: what both need is in fp8 and distributed),
roles above those; no subpackage imports a command (sim, train_local, join_cli, cli, ...)."""


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import in the module."""
    out = []
    for n in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(n, ast.Import):
            out += [(n.lineno, a.name.split(".")[0]) for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
            out.append((n.lineno, n.module.split(".")[0]))
    return out


def violations(package: str) -> list[str]:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, top in imports_of(path):
            if top in PACKAGES and top != package and top not in ALLOWED[package]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {top}")
    return bad


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_imports_only_what_it_may(package):
    assert violations(package) == []


def node_imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, part of node) of every `node.X` import in the module, `X` a subpackage or a top-level module."""
    out = []
    for n in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
            [n.module] if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module else []
        out += [(n.lineno, name.split(".")[1]) for name in names if name.startswith("node.")]
    return out


@pytest.mark.parametrize("layer", NODE_LAYERS)
def test_each_part_of_node_imports_only_the_layers_it_may(layer):
    bad = [f"{path.relative_to(ROOT)}:{line} imports node.{part}"
           for path in sorted((ROOT / "node" / layer).rglob("*.py"))
           for line, part in node_imports_of(path) if part != layer and part not in NODE_LAYERS[layer]]
    assert bad == []


def test_every_subpackage_of_node_has_its_layer_rule():
    subpackages = {p.parent.name for p in (ROOT / "node").glob("*/*.py")}
    assert subpackages == set(NODE_LAYERS)


def test_the_checker_sees_lazy_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from contrib.vllm import make_engine\n    import node.engine\n")
    assert imports_of(module) == [(2, "contrib"), (3, "node")]
    assert node_imports_of(module) == [(3, "engine")]


def test_every_registry_import_path_names_a_module_that_exists():
    from node.engine.registry import ENGINES
    from node.envs import TASK_FAMILIES

    paths = [e.path for e in ENGINES.values()] + list(TASK_FAMILIES.values())
    assert any(p.startswith("contrib.") for p in paths)  # optional parts are reached this way
    for path in paths:
        module, _, attr = path.partition(":")
        file = ROOT / (module.replace(".", "/") + ".py")
        package = ROOT / module.replace(".", "/") / "__init__.py"
        assert attr and (file.exists() or package.exists()), path
        defined = {n.name for n in ast.walk(ast.parse((file if file.exists() else package).read_text()))
                   if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert attr in defined, f"{path}: {attr} is not defined in {module}"


def test_the_builtin_engine_and_a_task_resolve_through_the_registries():
    from node.engine.engine import Engine
    from node.engine.registry import ENGINES
    from node.plugins import resolve

    assert resolve(ENGINES["builtin"].path) is Engine
    with pytest.raises(ValueError, match="module:attribute"):
        resolve("node.engine.engine")
