"""The package layout: no import cycles between modules, and imports point one way between stages."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "autotune"


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("autotune",) + path.relative_to(PACKAGE).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _imports() -> dict[str, set[str]]:
    """Module -> autotune modules it imports (``from . import sub`` is an edge to ``sub`` only)."""
    modules = _modules()
    graph = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rsplit(".", 1)[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                subs = [f"{target}.{alias.name}" for alias in node.names]
                named = [s for s in subs if s in modules]
                edges.update(named if named else [target] if target in modules else [])
            elif isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names if alias.name in modules)
        graph[name] = edges - {name}
    return graph


def _cycle_from(graph, start):
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in graph[node]:
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None


def test_no_module_imports_itself_back():
    graph = _imports()
    cycles = [c for c in (_cycle_from(graph, m) for m in sorted(graph)) if c]
    assert not cycles, " -> ".join(cycles[0])


# Stage -> stages it must not import (the arrows point one way: cli on top, memory at the bottom).
LOWER_MUST_NOT_IMPORT = {
    "autotune.memory": ("probing", "planning", "tuning", "training", "gpus", "cli"),
    "autotune.workload": ("memory", "probing", "planning", "tuning", "training", "gpus", "cli"),
    "autotune.probing": ("planning", "tuning", "training", "gpus", "cli"),
    "autotune.planning.types": ("planning.api", "tuning", "training", "gpus", "cli"),
    "autotune.planning.policy": ("planning.api", "probing.api", "probing.trial", "tuning", "training", "cli"),
    "autotune.planning.lr": ("probing", "tuning", "training", "gpus", "cli"),
    "autotune.training": ("tuning", "cli", "planning.api"),
    "autotune.tuning": ("cli", "planning.api"),
}


@pytest.mark.parametrize("lower", sorted(LOWER_MUST_NOT_IMPORT))
def test_imports_point_one_way(lower):
    graph = _imports()
    forbidden = tuple(f"autotune.{stage}" for stage in LOWER_MUST_NOT_IMPORT[lower])
    for module, edges in graph.items():
        if module == lower or module.startswith(lower + "."):
            bad = sorted(e for e in edges if e.startswith(forbidden))
            assert not bad, f"{module} imports {bad}"


def test_public_functions_do_not_shadow_subpackages():
    import autotune

    for name in ("probe", "plan", "train"):
        assert callable(getattr(autotune, name))
        assert not (PACKAGE / name).is_dir() and not (PACKAGE / f"{name}.py").exists()
