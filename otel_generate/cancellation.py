"""A generation stopped because its client went away: finish reason ``cancelled``, not an error.

``transformers serve`` without ``--continuous-batching`` stops the ``generate()`` of a streaming
client that disconnected by raising its private ``_GenerationCancelled`` from the streamer's
``put()`` (``transformers.cli.serving.utils``, 5.x); with ``--continuous-batching`` it calls
``ContinuousBatchingManager.cancel_request`` (:mod:`otel_generate.integrations.continuous_batching`).
Either way the request ends with ``gen_ai.response.finish_reasons = ["cancelled"]``, status UNSET
(no ``error.type``, no exception event: OpenTelemetry's Python SDK does not treat a cancellation
as an error either), and the tokens produced before it are counted.

Which exceptions are a cancellation is decided here and nowhere else (:func:`is_cancellation`):
a class of transformers' (its module under ``transformers``) named in :data:`CANCELLATION_NAMES`,
or, should transformers rename it, any transformers class whose name contains ``Cancel`` —
subclasses included (the whole MRO is read).
"""

from __future__ import annotations

from typing import Any, List, Optional

from otel_generate import attributes as A

#: transformers' private exception for a departed serve client, by class name (5.x:
#: ``transformers.cli.serving.utils._GenerationCancelled``).
CANCELLATION_NAMES = frozenset({"_GenerationCancelled", "GenerationCancelled"})
#: The package whose exceptions are looked at.
TRANSFORMERS = "transformers"


def is_cancellation(exc: Optional[BaseException]) -> bool:
    """Whether ``exc`` means the client went away (see the module's docstring); never raises."""
    if exc is None:
        return False
    try:
        for cls in type(exc).__mro__:
            module = getattr(cls, "__module__", "") or ""
            if module != TRANSFORMERS and not module.startswith(TRANSFORMERS + "."):
                continue
            name = cls.__name__
            if name in CANCELLATION_NAMES or "Cancel" in name:
                return True
    except Exception:
        return False
    return False


def account(request: Any, loops: List[Any]) -> None:
    """Mark a cancelled ``generate()`` request (a :class:`~otel_generate.request.Request` whose
    loops were accounted without a result): no error, one ``cancelled`` finish reason per row,
    and the tokens of the steps recorded before the exception as its output.

    Rows: ``generate.batch_size`` times ``num_return_sequences`` (a streamer, the only way
    transformers serve cancels, allows one row). Output tokens are counted only when some loop
    recorded its steps (a timed request); otherwise they stay unknown (absent).
    """
    request.error = None
    rows = int(request.parameters.get(A.GENERATE_BATCH_SIZE, 1) or 1) * int(
        request.parameters.get(A.GEN_AI_REQUEST_CHOICE_COUNT, 1) or 1
    )
    request.finish_reasons = [A.FINISH_REASON_CANCELLED] * rows
    if request.output_tokens is None and any(getattr(loop, "recorder", None) is not None for loop in loops):
        per_sequence = int(sum(request.step_tokens))
        request.output_tokens_per_sequence = [per_sequence] * rows
        request.output_tokens = per_sequence * rows
