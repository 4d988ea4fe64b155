"""transformers pipelines: make a pipeline's tokenizer visible to the ``generate()`` it runs.

A ``pipeline("text-generation" | "text2text-generation" | "summarization" | ...)`` call runs
``model.generate()`` from ``Pipeline.forward`` (once per batch), and that ``generate()`` is a
request like any other (:mod:`.generate_loop`): its span is a child of whatever span is current,
so it nests under the span another instrumentation starts around the pipeline call (OpenLLMetry
wraps ``TextGenerationPipeline.__call__``). This module adds no span: it only wraps
``transformers.pipelines.base.Pipeline.forward`` so that, while it runs, a context variable
holds the pipeline's model and tokenizer, from which content capture
(:mod:`.generate_content`) decodes the prompt and the completions.

``forward`` rather than ``__call__``: a pipeline given a generator or a ``Dataset`` returns a
lazy iterator and runs ``forward`` only while the caller iterates, after ``__call__`` returned.

The wrapper is installed only when message content is captured, through a post-import hook: it
never imports ``transformers.pipelines`` itself (about a second of import time), it patches the
module when the application imports it.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any, Callable, Optional

from otel_generate._faults import Fault, log_fault_once
from otel_generate.telemetry import Telemetry

#: ``(model, tokenizer)`` of the pipeline whose ``forward`` is running in this context, or ``None``.
_CURRENT: contextvars.ContextVar[Optional[tuple]] = contextvars.ContextVar("otel_generate_pipeline", default=None)


def tokenizer_for(model: Any) -> Any:
    """The tokenizer of the pipeline running ``model.generate()`` in this context, else ``None``.

    Only for that pipeline's own model: another model's ``generate()`` called meanwhile (an
    assistant model, a model inside a logits processor) gets nothing.
    """
    current = _CURRENT.get()
    if current is not None and current[0] is model:
        return current[1]
    return None


def _tokenizer_of(pipeline: Any) -> Any:
    tokenizer = getattr(pipeline, "tokenizer", None)
    if tokenizer is None:  # multimodal pipelines keep it in their processor
        tokenizer = getattr(getattr(pipeline, "processor", None), "tokenizer", None)
    return tokenizer


def make_forward(original: Callable, telemetry: Telemetry) -> Callable:
    """``Pipeline.forward``: the pipeline's model and tokenizer in a context variable while it runs."""

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if not telemetry.active:
            return original(self, *args, **kwargs)
        try:
            token = _CURRENT.set((getattr(self, "model", None), _tokenizer_of(self)))
        except Exception as fault:  # never break the pipeline
            log_fault_once(Fault.PIPELINE_TOKENIZER_LOOKUP, fault)
            return original(self, *args, **kwargs)
        try:
            return original(self, *args, **kwargs)
        finally:
            _CURRENT.reset(token)

    return forward
