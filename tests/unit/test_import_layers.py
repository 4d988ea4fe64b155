"""Imports run one way: read every module of ``otel_generate/`` with ``ast`` and fail on
any import that points up the declared layer order. No module of the package is imported here.

The rule covers every import statement, wherever it is: at module level (those define the layers), inside a
function (a lazy import: allowed only downward or within its layer, so the instrumentor's ``_instrument`` may
import the integrations, but nothing may lazily reach up to the instrumentor or the package), and under
``if TYPE_CHECKING``. A package ``__init__`` runs before any of its submodules, so its eager imports are held
to the lowest layer: ``import otel_generate.request`` must not load the instrumentor or an integration.

A new module must be placed in a layer here; a needed exception goes in ``ALLOWED`` with its reason.
"""

from __future__ import annotations

import ast
import fnmatch
import pathlib
from typing import Dict, Iterator, List, NamedTuple, Optional, Tuple

PACKAGE = "otel_generate"
SOURCE = pathlib.Path(__file__).resolve().parents[2] / PACKAGE

#: Lowest first. Module names are relative to ``otel_generate`` ("" is the package ``__init__``); ``*`` matches
#: any part of a dotted name. A module may import from its own layer or any layer below it.
LAYERS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    (
        "names",
        (
            "attributes",
            "_faults",
            "version",
            "package",
            "clock",
            "energy",
            "stats",
            "record",
            "policy",
            "figures",
            "tokens",
        ),
    ),
    (
        "mechanisms",
        (
            "content",
            "options",
            "cancellation",
            "ranks",
            "_patch",
            "background",
            "_lifecycle",
            "_export_loss",
        ),
    ),
    ("request", ("request",)),
    ("derive/emit", ("derive", "emit", "telemetry")),
    ("integrations", ("integrations", "integrations.*")),
    ("instrumentor", ("instrumentor",)),
    ("public API", ("profiler", "_versions")),
    ("package", ("",)),
    ("bench", ("bench", "bench.*")),
    # the command line: `otel-generate` (cli, __main__) dispatches to the bench and to doctor, each imported
    # when its subcommand runs; doctor checks the patch table, so it sits above the instrumentor
    ("command line", ("doctor", "cli", "__main__")),
)

#: Layers the bench may not import even though they sit below it: it measures the public API and the core.
BENCH_FORBIDDEN = ("integrations",)

#: (importer, imported, reason): edges allowed although a rule above forbids them.
ALLOWED: Tuple[Tuple[str, str, str], ...] = ()

#: Import cycles tolerated while they are being removed, each with its reason (none today). The test fails on
#: any other cycle, and on an entry here that no longer exists.
KNOWN_CYCLES: Tuple[Tuple[frozenset, str], ...] = ()


class Edge(NamedTuple):
    importer: str  # relative module name, "" for the package
    imported: str
    path: str
    line: int
    eager: bool  # runs when the importer is imported (not in a function, not under TYPE_CHECKING)


def _modules() -> Dict[str, pathlib.Path]:
    found = {}
    for path in sorted(SOURCE.rglob("*.py")):
        parts = list(path.relative_to(SOURCE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_package(name: str, modules: Dict[str, pathlib.Path]) -> bool:
    return modules[name].name == "__init__.py"


def _relative(absolute: str) -> Optional[str]:
    if absolute == PACKAGE:
        return ""
    if absolute.startswith(PACKAGE + "."):
        return absolute[len(PACKAGE) + 1 :]
    return None


def _join(base: str, name: str) -> str:
    return f"{base}.{name}" if base else name


def _walk(tree: ast.AST) -> Iterator[Tuple[ast.AST, bool]]:
    """Every import node with whether it runs at import time of its module."""

    def visit(node: ast.AST, eager: bool) -> Iterator[Tuple[ast.AST, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, eager
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from visit(child, False)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for statement in child.body:
                    yield from visit(ast.Module(body=[statement], type_ignores=[]), False)
                for statement in child.orelse:
                    yield from visit(ast.Module(body=[statement], type_ignores=[]), eager)
            else:
                yield from visit(child, eager)

    yield from visit(tree, True)


def _edges() -> List[Edge]:
    modules = _modules()
    edges = []
    for name, path in modules.items():
        package = name if _is_package(name, modules) else name.rpartition(".")[0]
        shown = str(path.relative_to(SOURCE.parent))
        for node, eager in _walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [_relative(alias.name) for alias in node.names]
            else:
                if node.level:
                    base = package
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    source = _join(base, node.module or "")
                else:
                    source = _relative(node.module or "")
                if source is None:
                    continue
                for alias in node.names:  # `from otel_generate.x import y`: the submodule y if there is one
                    submodule = _join(source, alias.name)
                    targets.append(submodule if submodule in modules else source)
            for target in targets:
                if target is not None and target != name:
                    edges.append(Edge(name, target, shown, node.lineno, eager))
    return edges


def _layer_of(name: str) -> Optional[int]:
    for index, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            return index
    return None


def _full(name: str) -> str:
    return _join(PACKAGE, name) if name else PACKAGE


def _show(name: str) -> str:
    layer = _layer_of(name)
    return f"{_full(name)} [{LAYERS[layer][0] if layer is not None else '?'}]"


def _allowed(edge: Edge) -> bool:
    return any(fnmatch.fnmatchcase(edge.importer, a) and fnmatch.fnmatchcase(edge.imported, b) for a, b, _ in ALLOWED)


def _report(title: str, lines: List[str]) -> str:
    return f"{title} ({len(lines)}):\n  " + "\n  ".join(lines)


def test_every_module_is_in_a_layer():
    unplaced = [f"{PACKAGE}.{name}" for name in _modules() if _layer_of(name) is None]
    assert not unplaced, _report(
        "modules in no layer: add them to LAYERS in tests/unit/test_import_layers.py", unplaced
    )


def test_no_import_points_up_the_layer_order():
    bench = [index for index, (label, _) in enumerate(LAYERS) if label == "bench"][0]
    forbidden = {index for index, (label, _) in enumerate(LAYERS) if label in BENCH_FORBIDDEN}
    violations = []
    for edge in _edges():
        low, high = _layer_of(edge.imported), _layer_of(edge.importer)
        if low is None or high is None or _allowed(edge):
            continue  # an unplaced module fails test_every_module_is_in_a_layer
        kind = "eager" if edge.eager else "lazy"
        if low > high:
            violations.append(
                f"{edge.path}:{edge.line}: {_show(edge.importer)} imports {_show(edge.imported)} ({kind})"
            )
        elif high == bench and low in forbidden:
            violations.append(
                f"{edge.path}:{edge.line}: the bench imports {_show(edge.imported)}, not the core ({kind})"
            )
    assert not violations, _report(
        "imports pointing up the layer order (or from the bench into an integration)", violations
    )


def test_package_inits_eagerly_import_only_the_lowest_layer():
    """Importing any submodule runs every package ``__init__`` above it first."""
    modules = _modules()
    violations = [
        f"{edge.path}:{edge.line}: {_show(edge.importer)} imports {_show(edge.imported)} at import time"
        for edge in _edges()
        if edge.eager
        and _is_package(edge.importer, modules)
        and _layer_of(edge.imported) not in (0, None)
        and not edge.imported.startswith(_join(edge.importer, ""))  # a package's own submodules are its business
    ]
    assert not violations, _report("package __init__ imports above the lowest layer", violations)


def test_no_import_cycles():
    """Within a layer too: two modules that import each other (even lazily) are one module in two files."""
    graph: Dict[str, set] = {}
    where: Dict[Tuple[str, str], str] = {}
    for edge in _edges():
        graph.setdefault(edge.importer, set()).add(edge.imported)
        where.setdefault((edge.importer, edge.imported), f"{edge.path}:{edge.line}")
    cycles, known = [], {members: reason for members, reason in KNOWN_CYCLES}
    for component in _strongly_connected(graph):
        if len(component) > 1 and known.pop(frozenset(component), None) is None:
            members = sorted(component)
            inner = sorted(
                f"{_full(a)} -> {_full(b)} ({where[(a, b)]})"
                for a in members
                for b in graph.get(a, ())
                if b in component
            )
            cycles.append(f"{', '.join(map(_full, members))}: " + "; ".join(inner))
    assert not cycles, _report("import cycles", cycles)
    gone = [", ".join(sorted(members)) for members in known]
    assert not gone, _report("KNOWN_CYCLES entries that are no longer cycles: delete them", gone)


def _strongly_connected(graph: Dict[str, set]) -> List[set]:
    """Tarjan's algorithm, iterative."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: set = set()
    found: List[set] = []
    counter = 0
    nodes = set(graph) | {b for targets in graph.values() for b in targets}
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                found.append(component)
    return found
