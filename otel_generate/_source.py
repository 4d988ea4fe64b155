"""Whether an installed transformers function is the code this package knows.

:mod:`otel_generate.clock` reads transformers' ``device`` property, and
:mod:`otel_generate.integrations.step_hook` runs ``StoppingCriteriaList.__call__``'s body in its
own frame, only where the installed code is the code they know: compared here as ``ast.unparse``
writes it, docstrings, comments and layout left out. Nothing of OpenTelemetry is compared: this
package uses only its public API.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any


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
