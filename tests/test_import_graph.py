"""The package's import graph, read from the source (function-level imports included): no two files import
each other through any loop, and a folder imports only itself and the floors below it (two folders on one floor
never import each other). The README's layout section walks the same floors, top-down in request order."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "ladle"
# Top floor first; a folder may import itself and anything on a floor after its own. Files in the package
# root are the ground; config/ (the engine's arguments) and gguf/ (which imports nothing of ladle's) lie below it.
FLOORS = [("entrypoints", "testing"), ("frontend", "serving"), ("engine",), ("structured_output",), ("executor",), ("startup",),
          ("runner",), ("models",), ("experts",), ("quantization",), ("distributed",), ("attention",), ("kv_cache",), ("kernels",), ("",), ("config",),
          ("gguf",)]  # the GGUF file format, below config: the arguments check a GGUF path, the tokenizer reads one


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


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else ""


def _floor(module: str) -> int:
    folder = _folder(module)
    return next(i for i, floor in enumerate(FLOORS) if folder in floor)


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
            same_folder = _folder(module) == _folder(target)
            if _floor(target) < _floor(module) or (_floor(target) == _floor(module) and not same_folder):
                upward.add((module.removeprefix("ladle.").replace(".", "/") + ".py", target))
    assert not upward, f"arrows up or sideways: {sorted(upward)}"


def test_every_folder_has_a_floor():
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == {f for floor in FLOORS for f in floor} - {""}


def test_the_engine_talks_to_the_runner_through_one_module():
    """The step payload and the sampled-token type are the engine's whole contract with the runner."""
    graph = _graph()
    reached = {t for m, ts in graph.items() if _folder(m) == "engine" for t in ts if _folder(t) == "runner"}
    assert reached == {"ladle.runner.payload"}
