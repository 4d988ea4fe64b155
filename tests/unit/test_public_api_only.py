"""The product talks to the OpenTelemetry API only (the rule of opentelemetry-python-contrib).

No module of ``otel_generate/`` outside ``otel_generate/bench/`` names ``opentelemetry.sdk`` (not even
in a docstring), imports an OpenTelemetry module or name that starts with ``_`` (or lies under an
``_internal`` package), or reads a private name of OpenTelemetry's objects: an attribute that is private
in the installed ``opentelemetry-api``/``-sdk`` sources and that this package does not define itself.

Two exceptions, each one place, named here and in docs/code-layout.md:

* :func:`otel_generate._lifecycle.forget_inherited_metrics`: in a forked child, drops what this
  package's own instruments inherited (open-telemetry/opentelemetry-python#2767; no public call resets
  an instrument). It may read the SDK's storage.
* ``opentelemetry._logs``: the API's logs signal, which OpenTelemetry Python publishes under that
  name (there is no other); only for the opt-in content event.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Iterator, Set, Tuple

import opentelemetry

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "otel_generate"
#: (module path relative to otel_generate/, function name) that may read the SDK's private storage
SDK_STORAGE_READER = ("_lifecycle.py", "forget_inherited_metrics")
#: the API's logs signal (see the module docstring)
LOGS_API = "opentelemetry._logs"


def _product_files() -> Iterator[pathlib.Path]:
    for path in sorted(PACKAGE.rglob("*.py")):
        if "bench" not in path.relative_to(PACKAGE).parts:
            yield path


def _private(dotted: str) -> bool:
    return any(part.startswith("_") or part == "_internal" for part in dotted.split("."))


def _opentelemetry_private_attributes() -> Set[str]:
    """Every ``_name`` (not dunder) that the installed OpenTelemetry sources use as an attribute,
    define as a function, class or module-level name."""
    names: Set[str] = set()
    for root in opentelemetry.__path__:
        for path in pathlib.Path(root).rglob("*.py"):
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError):
                continue
            for node in ast.walk(tree):
                found = None
                if isinstance(node, ast.Attribute):
                    found = node.attr
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    found = node.name
                elif isinstance(node, ast.Name):
                    found = node.id
                if found and found.startswith("_") and not found.startswith("__"):
                    names.add(found)
    return names


def _own_names() -> Set[str]:
    """The ``_names`` this package defines itself (attributes it assigns, functions, classes, globals)."""
    names: Set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for sub in ast.walk(target):
                        if isinstance(sub, ast.Attribute):
                            names.add(sub.attr)
                        elif isinstance(sub, ast.Name):
                            names.add(sub.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    names.add(alias.asname or alias.name.split(".")[0])
    return {name for name in names if name.startswith("_")}


def _functions(tree: ast.AST) -> Iterator[Tuple[str, ast.AST]]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node


def _inside(tree: ast.AST, function: str) -> Set[int]:
    """The ids of the nodes inside ``function`` (any depth)."""
    return {id(sub) for name, node in _functions(tree) if name == function for sub in ast.walk(node)}


def test_no_module_outside_the_bench_names_the_sdk():
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{number}"
        for path in _product_files()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if "opentelemetry.sdk" in line or "opentelemetry_sdk" in line
    ]
    assert not offenders, f"the product names the SDK: {offenders}"


def test_no_module_outside_the_bench_imports_a_private_opentelemetry_module_or_name():
    offenders = []
    for path in _product_files():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            imported = []
            if isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            for dotted in imported:
                if not dotted.startswith("opentelemetry"):
                    continue
                if dotted == LOGS_API or dotted.startswith(LOGS_API + "."):
                    if _private(dotted[len(LOGS_API) :]):
                        offenders.append(f"{path.name}:{node.lineno} {dotted}")
                    continue
                if _private(dotted) or dotted.startswith("opentelemetry.sdk"):
                    offenders.append(f"{path.name}:{node.lineno} {dotted}")
    assert not offenders, f"private OpenTelemetry imports: {offenders}"


def test_no_private_opentelemetry_attribute_is_read_outside_the_one_fork_workaround():
    private = _opentelemetry_private_attributes() - _own_names()
    assert "_measurement_consumer" in private and "_real_instrument" in private  # the scan sees the SDK
    offenders = []
    for path in _product_files():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        allowed = _inside(tree, SDK_STORAGE_READER[1]) if path.name == SDK_STORAGE_READER[0] else set()
        for node in ast.walk(tree):
            if id(node) in allowed:
                continue
            name = None
            if isinstance(node, ast.Attribute):
                name = node.attr
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                name = node.value  # getattr(obj, "_name")
            if name in private:
                offenders.append(f"{path.name}:{node.lineno} {name}")
    assert not offenders, f"private OpenTelemetry names read: {offenders}"


def test_the_fork_workaround_is_one_small_function():
    tree = ast.parse((PACKAGE / SDK_STORAGE_READER[0]).read_text(encoding="utf-8"))
    ((_, node),) = [(name, node) for name, node in _functions(tree) if name == SDK_STORAGE_READER[1]]
    assert node.end_lineno - node.lineno < 80
    layout = (PACKAGE.parent / "docs" / "code-layout.md").read_text(encoding="utf-8")
    assert "forget_inherited_metrics" in layout and "make_draining" in layout
