"""Content-capture modes parsed without a model: opentelemetry-util-genai's mode enum, and booleans."""

from __future__ import annotations

from otel_generate import content


def test_util_genai_mode_enum_is_accepted():
    import enum

    class ContentCapturingMode(enum.Enum):  # the shape of opentelemetry.util.genai.types.ContentCapturingMode
        NO_CONTENT = 0
        SPAN_ONLY = 1
        EVENT_ONLY = 2
        SPAN_AND_EVENT = 3

    assert [content.parse_mode(m) for m in ContentCapturingMode] == list(content.ContentMode)
    assert content.parse_mode(True) is content.ContentMode.SPAN_ONLY
    assert content.parse_mode(False) is content.ContentMode.NO_CONTENT
