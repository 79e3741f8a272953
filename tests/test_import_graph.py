"""The import graph of kaisoku's modules, read from the source with ``ast``: it has no cycle (imports
inside functions and under ``TYPE_CHECKING`` count), and every import of a kaisoku module inside a
function says why it waits there (an optional dependency, start-up time) in a comment.

An import of ``kaisoku.a.b`` (``import kaisoku.a.b``, ``from kaisoku.a import b``, or a relative form)
is an edge to the deepest kaisoku module that name reaches: ``kaisoku.a.b`` when it is a module,
``kaisoku.a`` when ``b`` is a name defined in it.
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections import deque
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

#: A comment holding one of these words gives an in-function import its reason.
REASON_WORDS = ("optional", "start-up", "startup", "lazy")


@dataclass(frozen=True)
class ImportSite:
    """One ``import`` or ``from ... import`` statement that reaches kaisoku modules."""

    module: str
    """The importing module (``kaisoku.plan.probe``)."""
    path: Path
    line: int
    end_line: int
    targets: tuple[str, ...]
    """The kaisoku modules it reaches (deepest existing module of each imported name)."""
    function: str | None
    """The enclosing function's name, None at module or class level."""


def module_files(src: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the ``kaisoku`` package under ``src``."""
    modules: dict[str, Path] = {}
    for path in sorted((src / "kaisoku").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _deepest(name: str, modules: dict[str, Path]) -> str | None:
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names a statement imports, relative imports resolved against ``module``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        anchor = package[: len(package) - (node.level - 1)]
        base = ".".join([*anchor, *([node.module] if node.module else [])])
    return [f"{base}.{alias.name}" for alias in node.names]


def import_sites(src: Path = SRC) -> list[ImportSite]:
    """Every import statement of the package that reaches a kaisoku module other than its own."""
    modules = module_files(src)
    sites: list[ImportSite] = []
    for module, path in modules.items():
        is_package = path.name == "__init__.py"

        def visit(
            node: ast.AST,
            function: str | None,
            module: str = module,
            path: Path = path,
            is_package: bool = is_package,
        ) -> None:
            for child in ast.iter_child_nodes(node):
                inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    names = _imported_names(child, module, is_package)
                    found = {_deepest(name, modules) for name in names if name.split(".")[0] == "kaisoku"}
                    targets = tuple(sorted(t for t in found if t is not None and t != module))
                    if targets:
                        end = child.end_lineno or child.lineno
                        sites.append(ImportSite(module, path, child.lineno, end, targets, function))
                visit(child, inner)

        visit(ast.parse(path.read_text(), filename=str(path)), None)
    return sites


def import_graph(sites: list[ImportSite]) -> dict[str, dict[str, ImportSite]]:
    """module -> {imported module: the first statement that imports it}."""
    graph: dict[str, dict[str, ImportSite]] = {}
    for site in sites:
        for target in site.targets:
            graph.setdefault(site.module, {}).setdefault(target, site)
    return graph


def strongly_connected(graph: dict[str, dict[str, ImportSite]]) -> list[list[str]]:
    """The components of more than one module (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, list[str]]] = [(root, sorted(graph.get(root, {})))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, pending = work[-1]
            if pending:
                nxt = pending.pop(0)
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph.get(nxt, {}))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def cycle_through(component: list[str], graph: dict[str, dict[str, ImportSite]]) -> list[str]:
    """A shortest cycle from the component's first module back to it, as the modules along it."""
    start, members = component[0], set(component)
    previous: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph.get(node, {})):
            if nxt not in members:
                continue
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(previous[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if nxt not in previous:
                previous[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"no cycle through {start} in {component}")


def describe_cycle(cycle: list[str], graph: dict[str, dict[str, ImportSite]], src: Path = SRC) -> str:
    """``a -> b -> a`` with the statement behind each arrow (file:line, in which function)."""
    steps = []
    for a, b in zip(cycle, cycle[1:]):
        site = graph[a][b]
        where = f"{site.path.relative_to(src)}:{site.line}"
        steps.append(f"{where}" + (f" in {site.function}()" if site.function else ""))
    return " -> ".join(cycle) + "  (" + "; ".join(steps) + ")"


def _comments(path: Path) -> dict[int, str]:
    """Line number -> the comment on that line."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return {tok.start[0]: tok.string for tok in tokens if tok.type == tokenize.COMMENT}


def has_reason(site: ImportSite, lines: list[str], comments: dict[int, str], import_lines: set[int]) -> bool:
    """Whether a comment gives the in-function import its reason: on the statement's own lines, or in
    the comment lines right above it or above the run of import statements it belongs to (blank lines
    between those statements allowed)."""

    def says_why(text: str) -> bool:
        return any(word in text.lower() for word in REASON_WORDS)

    if any(says_why(comments.get(n, "")) for n in range(site.line, site.end_line + 1)):
        return True
    n = site.line - 1
    while n >= 1 and (n in import_lines or not lines[n - 1].strip()):
        n -= 1
    while n >= 1 and lines[n - 1].strip().startswith("#"):
        if says_why(lines[n - 1]):
            return True
        n -= 1
    return False


def unexplained_in_function_imports(sites: list[ImportSite], src: Path = SRC) -> list[str]:
    """``file:line: module imports ... in f()`` for each in-function import of a kaisoku module with no reason."""
    offenders = []
    by_path: dict[Path, list[ImportSite]] = {}
    for site in sites:
        by_path.setdefault(site.path, []).append(site)
    for path, file_sites in sorted(by_path.items()):
        lines = path.read_text().splitlines()
        comments = _comments(path)
        import_lines = {
            n
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for n in range(node.lineno, (node.end_lineno or node.lineno) + 1)
        }
        for site in file_sites:
            if site.function is not None and not has_reason(site, lines, comments, import_lines):
                offenders.append(
                    f"{path.relative_to(src)}:{site.line}: {', '.join(site.targets)} in {site.function}()"
                )
    return offenders


def test_no_import_cycle_between_kaisoku_modules() -> None:
    graph = import_graph(import_sites())
    assert len(graph) > 50  # the walk found the package
    cycles = [describe_cycle(cycle_through(c, graph), graph) for c in strongly_connected(graph)]
    assert not cycles, "import cycles between kaisoku modules (in-function imports count):\n" + "\n".join(
        cycles
    )


def test_in_function_imports_say_why() -> None:
    offenders = unexplained_in_function_imports(import_sites())
    assert not offenders, (
        "in-function imports of kaisoku modules need a comment giving the reason (optional dependency, "
        "start-up time, lazy loading); or move them to the module's top:\n" + "\n".join(offenders)
    )


def test_the_checks_see_relative_function_level_and_typing_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "kaisoku"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .leaf import VALUE\n")
    (pkg / "sub" / "leaf.py").write_text(
        "VALUE = 1\n\ndef later():\n    from kaisoku import top  # a cycle dodged\n    return top\n"
    )
    (pkg / "top.py").write_text(
        "from typing import TYPE_CHECKING\n\nimport kaisoku.sub.leaf.VALUE\n\n"
        "if TYPE_CHECKING:\n    from kaisoku.sub import leaf\n\n"
        "def f():\n    # lazy: only when called\n    import json\n\n    from . import sub\n    return sub\n"
    )
    sites = import_sites(tmp_path)
    graph = import_graph(sites)
    assert graph["kaisoku.sub"] == {"kaisoku.sub.leaf": graph["kaisoku.sub"]["kaisoku.sub.leaf"]}
    assert set(graph["kaisoku.top"]) == {"kaisoku.sub.leaf", "kaisoku.sub"}
    components = strongly_connected(graph)
    assert components == [["kaisoku.sub", "kaisoku.sub.leaf", "kaisoku.top"]]
    cycle = ["kaisoku.sub", "kaisoku.sub.leaf", "kaisoku.top", "kaisoku.sub"]
    assert cycle_through(components[0], graph) == cycle
    assert "kaisoku/top.py:12 in f()" in describe_cycle(cycle, graph, tmp_path)
    # The reason covers the run of imports under it; the dodged cycle's comment gives none.
    assert unexplained_in_function_imports(sites, tmp_path) == [
        "kaisoku/sub/leaf.py:4: kaisoku.top in later()"
    ]


def test_the_library_holds_no_benchmark_and_imports_one_only_for_the_bench_command() -> None:
    """The benchmarks live beside the library (``benchmarks/kaisoku_bench``); ``kaisoku bench`` reaches them
    by an import inside its command, the one place that may."""
    assert not (SRC / "kaisoku" / "bench").exists()
    reaching = set()
    for path in sorted((SRC / "kaisoku").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            if any(name.split(".")[0] == "kaisoku_bench" for name in names):
                inside = [f.name for f in functions if f.lineno <= node.lineno <= (f.end_lineno or f.lineno)]
                reaching.add((path.name, inside[-1] if inside else None))
    assert reaching == {("cli.py", "cmd_bench")}
