"""A served request's trace context, carried with the request to the model's process.

``transformers serve`` 5.25 and newer runs the model in a process of its own: an API server puts
each request on a ``multiprocessing`` queue as a tuple (``(method, request id, *args, stream)``),
and the model's process takes it off and runs it. OpenTelemetry's context does not cross a queue,
so :mod:`.serve` carries it **with the request**, the way an HTTP client carries it in headers: the
W3C ``traceparent`` and ``tracestate`` of the span current where the request was submitted (the
API server's ``POST`` span), and the id the client receives for the request.

They ride on the request's last argument (its generation settings, a ``dict``; or the arguments
of a submitted function, a ``tuple``), as an instance of a subclass of that type
(:class:`CarryingDict`, :class:`CarryingTuple`) with one more attribute, :data:`ATTRIBUTE`. Pickled
across the queue and read back in the model's process, it is still the ``dict`` or ``tuple`` it was
for transformers' code, whether or not that process is instrumented: an uninstrumented model's
process runs the request exactly as it would have, and only loses its trace.

This module is what the model's process imports to unpickle such a request: it imports no more of
this package than the package itself, and only OpenTelemetry's API besides.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from opentelemetry import context as otel_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

#: The attribute of a carried argument: ``{"traceparent": ..., "tracestate": ..., "response_id": ...}``.
ATTRIBUTE = "otel_generate_carrier"
#: The key of the client's response id in a carrier (the W3C keys are the propagator's).
RESPONSE_ID = "response_id"
#: W3C Trace Context only, whatever ``OTEL_PROPAGATORS`` says: both ends are this package.
_W3C = TraceContextTextMapPropagator()


class CarryingDict(dict):
    """A request's ``dict`` argument with its carrier (:data:`ATTRIBUTE`)."""


class CarryingTuple(tuple):
    """A request's ``tuple`` argument with its carrier (:data:`ATTRIBUTE`)."""


def current_carrier(response_id: Optional[str] = None, context: Any = None) -> Dict[str, str]:
    """The W3C trace context of ``context`` (default: the current one), and ``response_id`` when
    given; empty when there is neither a valid span context nor a response id."""
    carrier: Dict[str, str] = {}
    _W3C.inject(carrier, context=context)
    if response_id:
        carrier[RESPONSE_ID] = response_id
    return carrier


def carrying(argument: Any, carrier: Dict[str, str]) -> Any:
    """``argument`` (a ``dict`` or ``tuple``) as a :class:`CarryingDict` or :class:`CarryingTuple`
    holding ``carrier``; any other value (or an empty carrier) unchanged."""
    if not carrier:
        return argument
    if isinstance(argument, dict):
        carried: Any = CarryingDict(argument)
    elif isinstance(argument, tuple):
        carried = CarryingTuple(argument)
    else:
        return argument
    setattr(carried, ATTRIBUTE, dict(carrier))
    return carried


def carrier_of(message: Any) -> Optional[Dict[str, str]]:
    """The carrier of a queued request (any of its parts carrying one), else ``None``."""
    if not isinstance(message, (tuple, list)):
        return None
    for part in message:
        carrier = getattr(part, ATTRIBUTE, None) if isinstance(part, (CarryingDict, CarryingTuple)) else None
        if isinstance(carrier, dict):
            return carrier
    return None


def context_of(carrier: Dict[str, str], response_id_key: Any) -> Any:
    """The OpenTelemetry context a carrier describes: its remote parent span, and the response id
    under ``response_id_key`` when it has one."""
    context = _W3C.extract(carrier, context=otel_context.Context())
    response_id = carrier.get(RESPONSE_ID)
    if isinstance(response_id, str) and response_id:
        context = otel_context.set_value(response_id_key, response_id, context)
    return context
