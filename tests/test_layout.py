"""The package's dependencies point one way: no import cycle between its subpackages, and the MLR
operator's backends are leaves that import only its contract (and the Triton helpers they share).

Read from the source with ``ast``, lazy imports inside functions included, so a cycle hidden
behind a function-level import counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import structured_attention

ROOT = Path(structured_attention.__file__).parent
PACKAGE = ROOT.name


def _imports(path: Path) -> set[str]:
    """Every ``structured_attention`` module a file imports, as dotted names."""
    package = path.relative_to(ROOT.parent).with_suffix("").parts[:-1]  # the folder, for __init__ too
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names = [module] if node.module or not node.level else [f"{module}.{a.name}" for a in node.names]
            found.update(n for n in names if n.split(".")[0] == PACKAGE)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == PACKAGE)
    return found


def _subpackage_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).parts
        if len(rel) < 2:
            continue  # top-level modules (_checks, _files, __init__) are shared leaves
        for target in _imports(path):
            parts = target.split(".")
            if len(parts) > 1 and parts[1] != rel[0] and (ROOT / parts[1]).is_dir():
                graph.setdefault(rel[0], set()).add(parts[1])
    return graph


def test_no_import_cycle_between_subpackages():
    graph = _subpackage_graph()

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(graph.get(node, ()))
        return False

    cycles = sorted((a, b) for a, targets in graph.items() for b in targets if reaches(b, a))
    assert not cycles, f"import cycles between subpackages: {cycles}"


def test_ops_import_nothing_above_them():
    graph = _subpackage_graph()
    assert graph.get("ops", set()) == set(), graph.get("ops")


def test_mlr_backends_are_leaves_of_the_contract():
    allowed = {f"{PACKAGE}._checks", f"{PACKAGE}._compiler", f"{PACKAGE}.ops.mlr.contract"}
    triton = {f"{PACKAGE}.ops.mlr.triton_common", f"{PACKAGE}.ops.mlr.triton_prefix"}
    backends = {"blocked": set(), "cpu": {f"{PACKAGE}.ops.mlr.cpu_build"}, "cpu_build": set(),
                "triton_general": triton, "triton_prefix": triton, "triton_decode": triton}
    for name, extra in backends.items():
        imported = _imports(ROOT / "ops" / "mlr" / f"{name}.py")
        assert imported <= allowed | extra, f"ops/mlr/{name}.py imports {sorted(imported - allowed - extra)}"
