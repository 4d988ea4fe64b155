"""Opt-in content capture: the prompt and completion text, and per-step token ids and log-probabilities.

Content is off unless asked for, as the GenAI semantic conventions require (``gen_ai.input.messages``
and ``gen_ai.output.messages`` are Opt-In attributes). Two independent switches:

* **Messages** follow ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT`` (or the
  ``capture_message_content`` keyword of ``instrument()``), read once when ``instrument()`` runs:

  ================================  =====================================================================
  value (case-insensitive)          effect
  ================================  =====================================================================
  unset, empty, ``NO_CONTENT``,     nothing is captured (the default)
  ``false``
  ``SPAN_ONLY``, ``true``           ``gen_ai.input.messages`` / ``gen_ai.output.messages`` on the request
                                    span, as JSON strings
  ``EVENT_ONLY``                    one ``gen_ai.client.inference.operation.details`` event (a log record,
                                    OpenTelemetry logs API) per request, the messages in structured form;
                                    nothing on the span
  ``SPAN_AND_EVENT``                both
  anything else                     one warning on the logger ``otel_generate``; nothing is captured
  ================================  =====================================================================

  The four mode names are those of ``opentelemetry-util-genai`` (``ContentCapturingMode``).
  ``true``/``false`` are the values the GenAI instrumentations accept on their older path
  (``opentelemetry-instrumentation-openai-v2`` without ``OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental``,
  conventions v1.30, where ``true`` puts content into per-message events); ``opentelemetry-util-genai``
  itself rejects them. ``true`` means ``SPAN_ONLY`` here: the request span is where every tracing backend shows
  it, it needs no logs pipeline, and the text is not stored twice.

* **Step tokens** (``capture_step_token_ids`` / ``OTEL_GENERATE_CAPTURE_STEP_TOKEN_IDS`` and
  ``capture_step_logprobs`` / ``OTEL_GENERATE_CAPTURE_STEP_LOGPROBS``, booleans): the token ids
  each step produced (``generate.step.token_ids``) and their natural-log probabilities
  (``generate.step.logprobs``) on the step spans.

Message text needs a tokenizer; see :mod:`otel_generate.integrations.generate_content` for where it
comes from. This module only parses the settings and builds the conventions' message structures
(plain lists and dicts, ``gen-ai-input-messages.json`` / ``gen-ai-output-messages.json`` of
semantic-conventions v1.41); :mod:`otel_generate.emit` turns them into attributes and events.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from otel_generate import attributes as A

#: The GenAI conventions' switch for prompt and completion content.
ENV_CAPTURE_MESSAGE_CONTENT = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
#: This package's switch for ``generate.step.token_ids`` on the step spans.
ENV_CAPTURE_STEP_TOKEN_IDS = "OTEL_GENERATE_CAPTURE_STEP_TOKEN_IDS"
#: This package's switch for ``generate.step.logprobs`` (and the token ids) on the step spans.
ENV_CAPTURE_STEP_LOGPROBS = "OTEL_GENERATE_CAPTURE_STEP_LOGPROBS"


class ContentMode(enum.Enum):
    """Where message content goes; the names of ``opentelemetry-util-genai``'s ``ContentCapturingMode``."""

    NO_CONTENT = 0
    SPAN_ONLY = 1
    EVENT_ONLY = 2
    SPAN_AND_EVENT = 3

    @property
    def on_span(self) -> bool:
        return self in (ContentMode.SPAN_ONLY, ContentMode.SPAN_AND_EVENT)

    @property
    def on_event(self) -> bool:
        return self in (ContentMode.EVENT_ONLY, ContentMode.SPAN_AND_EVENT)


#: The values :func:`parse_mode` accepts, for error messages.
ACCEPTED_MODES = "true, false, " + ", ".join(mode.name for mode in ContentMode)


def parse_mode(value: Any) -> ContentMode:
    """A content mode from a bool, a :class:`ContentMode` (or util-genai's enum), or a string.

    Strings are case-insensitive and stripped: ``true`` is ``SPAN_ONLY``, ``false`` and the
    empty string ``NO_CONTENT``, otherwise a mode name.

    Raises:
        ValueError: for a string that is none of those.
        TypeError: for any other type.
    """
    if isinstance(value, bool):
        return ContentMode.SPAN_ONLY if value else ContentMode.NO_CONTENT
    if isinstance(value, ContentMode):
        return value
    if isinstance(value, enum.Enum) and type(value).__name__ == "ContentCapturingMode":
        value = value.name  # opentelemetry.util.genai.types.ContentCapturingMode, without importing it
    if isinstance(value, str):
        text = value.strip().upper()
        if text in ("", "FALSE"):
            return ContentMode.NO_CONTENT
        if text == "TRUE":
            return ContentMode.SPAN_ONLY
        try:
            return ContentMode[text]
        except KeyError:
            raise ValueError(f"content capture mode must be one of {ACCEPTED_MODES}; got {value!r}") from None
    raise TypeError(
        f"capture_message_content must be a bool or a mode name ({ACCEPTED_MODES}), "
        f"got {type(value).__name__} {value!r}"
    )


@dataclass(frozen=True)
class ContentOptions:
    """What content ``instrument()`` was asked to capture (present only when something is).

    Attributes:
        mode: where message text goes.
        step_token_ids: put ``generate.step.token_ids`` on the step spans.
        step_logprobs: put ``generate.step.logprobs`` on the step spans (greedy and sampling only).
        event_logger: the OpenTelemetry logs-API ``Logger`` events go to (``None`` unless
            ``mode.on_event``).
    """

    mode: ContentMode = ContentMode.NO_CONTENT
    step_token_ids: bool = False
    step_logprobs: bool = False
    event_logger: Any = None

    @property
    def step_content(self) -> bool:
        return self.step_token_ids or self.step_logprobs


def input_messages(prompts: Sequence[str]) -> List[Dict[str, Any]]:
    """``gen_ai.input.messages``: one ``user`` message with one text part per prompt row."""
    return [{"role": A.ROLE_USER, "parts": [{"type": A.PART_TYPE_TEXT, "content": text}]} for text in prompts]


def output_messages(completions: Sequence[str], finish_reasons: Optional[Sequence[str]]) -> List[Dict[str, Any]]:
    """``gen_ai.output.messages``: one ``assistant`` message per returned sequence, with its finish reason.

    ``finish_reasons`` lines up with ``completions``; where it is missing the reason is ``stop``
    (the conventions require one on every output message).
    """
    reasons = list(finish_reasons or ())
    return [
        {
            "role": A.ROLE_ASSISTANT,
            "parts": [{"type": A.PART_TYPE_TEXT, "content": text}],
            "finish_reason": reasons[index] if index < len(reasons) else A.FINISH_REASON_STOP,
        }
        for index, text in enumerate(completions)
    ]
