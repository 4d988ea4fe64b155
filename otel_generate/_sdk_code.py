"""Whether the installed OpenTelemetry SDK runs the code a fast path repeats.

:mod:`otel_generate.fast_metrics` and :mod:`otel_generate.fast_spans` repeat the effect of a few
SDK functions without calling them, and only while the installed SDK's functions are the code
they know, and :mod:`otel_generate.clock` reads transformers' ``device`` property only where it
is the code it knows: compared here as ``ast.unparse`` writes it, docstrings, comments and layout
left out.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap
from operator import is_
from types import FunctionType
from typing import Any, Dict, Iterable, Tuple


def code_of(source: str) -> str:
    """The code of ``source`` (one function, indented or not), its docstring left out.

    Raises:
        SyntaxError: ``source`` is not Python.
    """
    tree = ast.parse(textwrap.dedent(source))
    function = tree.body[0]
    body = getattr(function, "body", None)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            del body[0]
    return ast.unparse(tree)


def same_code(function: Any, known: str) -> bool:
    """Whether ``function``'s source is the code ``known``.

    Raises:
        OSError, TypeError: ``function``'s source cannot be read.
    """
    return code_of(inspect.getsource(function)) == code_of(known)


def body_of(source: str) -> str:
    """The code of ``source`` (one function) with its decorators, annotations and docstring left
    out: what it runs, whatever its signature's type hints say.

    Raises:
        SyntaxError: ``source`` is not Python.
    """
    tree = ast.parse(textwrap.dedent(source))
    function = tree.body[0]
    if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        function.decorator_list = []
        function.returns = None
        arguments = function.args
        for argument in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs):
            argument.annotation = None
        for argument in (arguments.vararg, arguments.kwarg):
            if argument is not None:
                argument.annotation = None
    return code_of(ast.unparse(tree))


def same_body(function: Any, known: str) -> bool:
    """Whether ``function`` runs the code ``known`` (:func:`body_of` of both: decorators and
    annotations aside).

    Raises:
        OSError, TypeError: ``function``'s source cannot be read.
    """
    return body_of(inspect.getsource(function)) == body_of(known)


def code_digest(functions: Iterable[Any]) -> str:
    """sha256 (hex) of the functions' code, in order (for code too long to quote).

    Raises:
        OSError, TypeError: a function's source cannot be read.
    """
    text = "\n".join(code_of(inspect.getsource(function)) for function in functions)
    return hashlib.sha256(text.encode()).hexdigest()


def functions_known(cache: Dict[tuple, Tuple[tuple, bool]], functions: tuple, digest: str) -> bool:
    """Whether ``functions`` are plain functions (none a wrapper: a ``functools.wraps`` or ``wrapt``
    wrapper's source reads as the function it wraps) whose :func:`code_digest` is ``digest``.

    Read once per set of function objects, remembered in ``cache`` under their ids with the
    functions themselves: an entry is used only for those very objects (another function may later
    have an address). A function whose source cannot be read is not known; never raises.
    """
    key = (digest, *map(id, functions))
    entry = cache.get(key)
    if entry is not None and all(map(is_, entry[0], functions)):
        return entry[1]
    try:
        known = (
            all(type(function) is FunctionType and not hasattr(function, "__wrapped__") for function in functions)
            and code_digest(functions) == digest
        )
    except Exception:  # no source, another layout: never relied on
        known = False
    if key in cache or len(cache) < 32:
        cache[key] = (functions, known)
    return known
