"""The package's import graph, read from the source (function-level imports included): no two files import
each other through any loop, and a folder imports only folders on the floors below it. The arrows that still
run up are listed by name: they are the executor seam's work (issue 32), and a new one fails this test."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "ladle"
# Top floor first; a folder may import itself and anything after it. Files in the package root are the ground.
FLOORS = ["entrypoints", "engine", "models", "distributed", "worker", "attention", "kv_cache", "kernels", ""]
# (importing file, imported module): the engine process's tensor-parallel group still reaches up into startup.
KNOWN_UPWARD = {
    ("distributed/worker.py", "ladle.engine.allocator"),
    ("distributed/worker.py", "ladle.engine.setup"),
    ("distributed/workers.py", "ladle.engine.step_executor"),
}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The ladle modules a file imports (from-imports of a package resolve to its submodule when one exists)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("ladle")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ladle") and not node.level:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if (ROOT.parent / sub.replace(".", "/")).with_suffix(".py").exists() else node.module)
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in ROOT.rglob("*.py")}
    return {m: {i for i in _imports(p) if i in files and i != m} for m, p in files.items()}


def _floor(module: str) -> int:
    parts = module.split(".")
    folder = parts[1] if len(parts) > 2 else ""
    return FLOORS.index(folder)


def test_no_file_imports_itself_through_a_loop():
    graph = _graph()
    index, low, stack, on_stack, loops = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                loops.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not loops, f"import circles: {loops}"


def test_folders_import_only_the_floors_below():
    upward = set()
    for module, imported in _graph().items():
        for target in imported:
            if _floor(target) < _floor(module):
                upward.add((module.removeprefix("ladle.").replace(".", "/") + ".py", target))
    assert upward == KNOWN_UPWARD, f"new arrows up: {upward - KNOWN_UPWARD}; gone: {KNOWN_UPWARD - upward}"
