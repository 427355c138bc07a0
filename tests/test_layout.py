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


# The packages from the bottom up: each may import only those before it (and the basics).
# orchestration (plan(), verify_plan(): probe, tune, build) sits above the pure planning package.
PACKAGE_ORDER = ("files", "memory", "workload", "distributed", "probing", "gpus", "timing",
                 "planning", "training", "report", "tuning", "orchestration", "integrations", "cli")
BASICS = ("errors", "units", "version", "choices", "precision", "progress", "compiled", "accumulation")
"""Flat modules at autotune/*.py: cross-cutting basics any package may import; they import only
one another (and torch)."""


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "autotune"


def test_every_package_and_flat_module_has_a_place():
    placed = set(PACKAGE_ORDER) | set(BASICS) | {"autotune", "__main__"}
    assert {_package(m) for m in _imports()} <= placed, sorted({_package(m) for m in _imports()} - placed)


def test_packages_import_only_packages_below_them():
    graph, level = _imports(), {name: i for i, name in enumerate(PACKAGE_ORDER)}
    for name in BASICS:
        level[name] = -1
    bad = []
    for module, edges in graph.items():
        source = _package(module)
        if source in ("autotune", "__main__"):
            continue
        for edge in edges:
            target = _package(edge)
            if target == source:
                continue
            if source in BASICS and target not in BASICS or level.get(target, 99) > level[source]:
                bad.append(f"{module} -> {edge}")
    assert not bad, bad


def test_no_package_imports_itself_back():
    graph = _imports()
    packages = {}
    for module, edges in graph.items():
        packages.setdefault(_package(module), set()).update(_package(e) for e in edges)
    for name in packages:
        packages[name].discard(name)
        packages[name] &= set(packages)
    cycles = [c for c in (_cycle_from(packages, p) for p in sorted(packages)) if c]
    assert not cycles, " -> ".join(cycles[0])


def test_planning_is_pure():
    # The policy, the plan file and the exports run without a device: nothing in planning probes,
    # trains or measures.
    graph = _imports()
    for module, edges in graph.items():
        if module.startswith("autotune.planning"):
            bad = sorted(e for e in edges if e.startswith(("autotune.probing.api", "autotune.probing.trial",
                                                           "autotune.memory.cuda", "autotune.memory.cpu",
                                                           "autotune.training", "autotune.tuning")))
            assert not bad, f"{module} imports {bad}"


def test_public_functions_do_not_shadow_subpackages():
    import autotune

    for name in ("probe", "plan", "train"):
        assert callable(getattr(autotune, name))
        assert not (PACKAGE / name).is_dir() and not (PACKAGE / f"{name}.py").exists()
