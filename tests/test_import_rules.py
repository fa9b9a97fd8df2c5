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


def test_the_checker_sees_lazy_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from contrib.vllm import make_engine\n    import node.engine\n")
    assert imports_of(module) == [(2, "contrib"), (3, "node")]


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
