"""The package's layout by process (docs/architecture.md, "Modules"): what the tree says is what is on disk,
the drafter process does not import the worker's or the front end's code, and no two modules import each
other (the drafter client and the metrics used to)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "saguaro_vllm"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PKG.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Every saguaro_vllm module `path` imports, at module level or inside functions; `from pkg import sub`
    counts as importing the submodule only."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in mods]
            found.update(subs)
            if len(subs) < len(node.names):
                found.add(base)
    return {m for m in found if m in mods and m != name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_two_modules_import_each_other():
    assert _cycles(_graph()) == []


def _owned(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    return {n: deps for n, deps in graph.items() if n == package or n.startswith(package + ".")}


def test_drafter_process_imports_neither_worker_nor_front_end():
    banned = ("frontend", "worker", "tools", "projection", "patches", "demo", "plugin")
    graph = _graph()
    for package in ("saguaro_vllm.drafter", "saguaro_vllm.ops", "saguaro_vllm.shared"):
        for name, deps in _owned(graph, package).items():
            bad = sorted(d for d in deps if d.split(".")[1] in banned)
            assert not bad, f"{name} (runs in the drafter process) imports {bad}"


def test_worker_reaches_the_drafter_only_through_shared():
    graph = _graph()
    for name, deps in _owned(graph, "saguaro_vllm.worker").items():
        bad = sorted(d for d in deps if d.split(".")[1] in ("drafter", "ops", "tools", "projection", "demo"))
        assert not bad, f"{name} (runs in vLLM's worker) imports {bad}"


def _tree() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    return re.search(r"## Modules\n.*?```\n(saguaro_vllm/\n.*?)```", text, re.S).group(1)


def test_architecture_tree_matches_the_package():
    tree = _tree()
    rows = {line.split()[0] for line in tree.splitlines()[1:] if re.match(r"  \S", line)}
    on_disk = {p.name + "/" for p in PKG.iterdir() if (p / "__init__.py").exists()}
    on_disk |= {p.name for p in PKG.glob("*.py") if p.name != "__init__.py"}
    assert rows == on_disk
    for package in ("frontend", "worker", "shared", "tools"):
        for module in (PKG / package).glob("*.py"):
            if module.name != "__init__.py":
                assert re.search(rf"\b{module.stem}\b", tree), f"docs/architecture.md's tree omits {package}/{module.name}"
