"""No import circles between the modules of ``mstar/``: every import counts,
at module level, inside functions and under ``TYPE_CHECKING`` alike."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mstar"


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each ``mstar`` module and the ``mstar`` modules it imports (a name
    imported from a package counts as its submodule where one exists)."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_mstar_has_no_import_circles():
    assert cycles(import_graph()) == []


def test_the_walk_finds_a_circle_and_relative_imports():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    real = import_graph()
    assert "mstar.engine.resources.kv.plan" in real["mstar.engine.resources.kv.manager"]


# The rooms, lowest first: a module imports its own room's and lower rooms' modules only.
# The plan layer is the floor everyone reads; the command line, demo and benchmarks sit on top.
ROOMS = (
    "mstar.engine.resources",
    "mstar.cpu",
    "mstar.models",
    "mstar.engine",
    "mstar.serve",
    "mstar",
)


def room(module: str) -> int:
    """The rank of ``module``'s room in ``ROOMS`` (the first, longest, prefix that matches)."""
    return next(i for i, r in enumerate(ROOMS) if module == r or module.startswith(f"{r}."))


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every import from a lower room into a higher one."""
    return sorted((a, b) for a, targets in graph.items() for b in targets if room(b) > room(a))


def test_no_module_imports_from_a_room_above_it():
    assert upward(import_graph()) == []


def test_the_rooms_check_sees_an_upward_import():
    assert (
        room("mstar.engine.resources.kv.plan") < room("mstar.cpu.quant") < room("mstar.models.hf")
    )
    assert room("mstar.models.hf") < room("mstar.engine.engine") < room("mstar.serve.app")
    assert room("mstar.serve.app") < room("mstar.cli")
    graph = {"mstar.cpu.quant": {"mstar.models.loader"}, "mstar.models.hf": {"mstar.cpu.build"}}
    assert upward(graph) == [("mstar.cpu.quant", "mstar.models.loader")]
    real = import_graph()
    assert "mstar.models.hf" in real["mstar.engine.engine"]  # the walk sees the real arrows


def test_the_engine_top_level_holds_the_serving_loop_and_the_cpp_one_folder():
    top = sorted(p.name for p in (PACKAGE / "engine").iterdir() if p.is_file())
    assert len(top) <= 15, top
    sources = {p.parent for p in PACKAGE.rglob("*") if p.suffix in {".cpp", ".h"}}
    assert sources == {PACKAGE / "cpu" / "csrc"}
