"""otel_generate._source: a function's code compared without its docstring, comments and layout."""

from __future__ import annotations

from otel_generate._source import code_of, same_code


def reference(self, value):
    """A docstring."""
    if value:  # a comment
        return (value, self)
    return None


def test_docstring_comments_and_layout_do_not_count_a_statement_does():
    assert same_code(
        reference, "def reference(self, value):\n    if value:\n        return (value, self)\n    return None\n"
    )
    assert not same_code(
        reference, "def reference(self, value):\n    if value:\n        return (self, value)\n    return None\n"
    )
    assert code_of("    def f():\n        'doc'\n        return 1\n") == code_of("def f():\n    return 1")


def test_a_body_is_compared_without_decorators_and_annotations_a_parameter_still_counts():
    from otel_generate._source import body_of, same_body

    annotated = "@wraps(x)\ndef f(self, a: int, *rest: str, b: 'T' = 1, **more: float) -> bool:\n    return a\n"
    assert body_of(annotated) == body_of("def f(self, a, *rest, b=1, **more):\n    'doc'\n    return a\n")
    assert body_of(annotated) != body_of("def f(self, a, *rest, b=2, **more):\n    return a\n")
    assert body_of(annotated) != body_of("def f(self, a, *rest, b=1, **more):\n    return b\n")
    assert same_body(
        reference,
        "def reference(self: object, value: int) -> tuple:\n"
        "    if value:\n        return (value, self)\n    return None",
    )
    assert not same_body(reference, "def reference(self, value):\n    return None")
