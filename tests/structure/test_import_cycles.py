"""No module of engine/, studio/ or workers/ imports itself back through others, not even from inside a function.

import-linter (pyproject.toml) checks the layers between packages; a circle inside a layer (kernels.py building
the models whose layers import it, runs -> exports -> deployments -> runs) was held together by imports inside
functions, which Python resolves late and import-linter's layer contracts do not forbid. This test reads every
module's AST, takes every import wherever it stands (top level, function, ``TYPE_CHECKING`` block) and finds
the strongly connected parts of the graph of project-internal imports.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "studio", "workers")

Graph = dict[str, dict[str, int]]  # module -> {imported module: line of the first such import}


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(
    node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]
) -> Iterable[str]:
    """The known modules an import statement loads: ``from pkg import name`` is ``pkg.name`` when that is a
    module, else ``pkg`` itself; a dotted name not known as a module counts as its nearest known parent."""

    def nearest(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    if isinstance(node, ast.Import):
        yield from filter(None, (nearest(alias.name) for alias in node.names))
        return
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join([*base, *([node.module] if node.module else [])])
    else:
        source = node.module or ""
    for alias in node.names:
        full = f"{source}.{alias.name}"
        target = full if full in known else nearest(source)
        if target:
            yield target


def import_graph(root: Path, packages: Iterable[str] = PACKAGES) -> Graph:
    """Every module under ``packages`` with the project modules it imports anywhere in its body."""
    files = {_module_name(root, p): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}
    known = set(files)
    graph: Graph = {}
    for module, path in files.items():
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _imported(node, module, path.name == "__init__.py", known):
                    if target != module:
                        edges[target] = min(edges.get(target, node.lineno), node.lineno)
        graph[module] = edges
    return graph


def circles(graph: Graph) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                part = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    part.append(member)
                    if member == node:
                        break
                if len(part) > 1:
                    found.append(sorted(part))
    return found


def describe(graph: Graph, part: list[str]) -> str:
    """A circle's modules, each with the imports (and their lines) that keep it inside the circle."""
    inside = set(part)
    lines = [f"{len(part)} modules import each other: {', '.join(part)}"]
    for module in part:
        edges = sorted((line, target) for target, line in graph[module].items() if target in inside)
        lines.append(f"  {module}: " + ", ".join(f"line {line} imports {target}" for line, target in edges))
    return "\n".join(lines)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_the_check_finds_a_circle_closed_inside_a_function(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low.py": "def probe():\n    from pkg.high import build\n    return build()\n",
            "pkg/high.py": "from pkg import low\n\n\ndef build():\n    return low\n",
            "pkg/side.py": "from . import low\n",
        },
    )
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg.low"] == {"pkg.high": 2}
    assert graph["pkg.side"] == {"pkg.low": 1}  # a relative import is read as its absolute module
    found = circles(graph)
    assert found == [["pkg.high", "pkg.low"]]
    assert "pkg.low: line 2 imports pkg.high" in describe(graph, found[0])


def test_the_check_follows_a_longer_circle_and_names_of_a_package(tmp_path):
    _write(
        tmp_path,
        {
            "svc/__init__.py": "",
            "svc/runs.py": "from svc.exports import create\n",
            "svc/exports.py": "import svc.deployments\n",
            "svc/deployments.py": "from svc import runs\n",
            "svc/alone.py": "from svc.runs import create\n",
        },
    )
    assert circles(import_graph(tmp_path, ["svc"])) == [["svc.deployments", "svc.exports", "svc.runs"]]


def test_the_project_is_read():
    graph = import_graph(ROOT)
    assert {"engine.models.kernels", "studio.services.runs", "workers.training"} <= set(graph)
    assert sum(len(edges) for edges in graph.values()) > 750  # 852 here: the project's own imports


def test_no_import_circles_in_engine_studio_and_workers():
    graph = import_graph(ROOT)
    found = circles(graph)
    assert not found, "import circles (break each by moving the shared piece down a layer):\n" + "\n".join(
        describe(graph, part) for part in found
    )
