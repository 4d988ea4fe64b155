"""The request span started without the SDK's ``start_span`` call, where that gives exactly what it gives.

``tracer.start_span(name, attributes=...)`` builds a recording span through keyword calls of
three constructors (``Span``, ``ReadableSpan``, ``BoundedAttributes``) and cleans every attribute
value one by one: about 84,000 instructions of a request more than an unsampled one, nearly all
of it the same work every time. :class:`FastRequestSpans` runs ``start_span``'s own steps in its
own frame, in the same order, with the same calls where a call can do something (the current
span's lookup, ``_is_enabled``, the id generator, the sampler, the tracer's self-observability
metrics, the processors' ``on_start``), and builds the ``Span`` object as its constructors would:

* the span's fields are set as one dictionary, the same keys in the same order with the same
  values as ``Span.__init__`` sets them (checked once against a span built by the constructor
  itself), with a new lock, a new ``BoundedList`` of events and of links (its own constructor),
  and the start time ``Span.start`` sets;
* its ``BoundedAttributes`` is built the same way; where every key is a non-empty ``str`` and
  every value a ``bool``, ``int``, ``float`` or a ``str`` no longer than the span's value limit,
  with room for all of them, the values are stored as they are (what the SDK's cleaning leaves
  them); any other attribute goes through the ``BoundedAttributes`` constructor itself.

It is taken only while the installed SDK runs the code it repeats, checked in two parts (the
function objects read at every request, their code once per set of them, so a patch made later
is seen):

* up to the sampler's decision, and for a span that is not recorded: the tracer is exactly the
  SDK's ``Tracer`` (no ``start_span`` set on the object), and ``Tracer.start_span`` and
  ``SpanContext.__new__`` are the code of opentelemetry-sdk 1.45 (:data:`_START_CODE`); otherwise
  the caller calls ``tracer.start_span`` (nothing done here);
* for a recording span: ``Span.__init__``, ``ReadableSpan.__init__``, ``Span.start``,
  ``BoundedList.__init__``, ``BoundedAttributes.__init__`` and the functions the cleaning runs
  (:data:`_SPAN_CODE`); otherwise the span is built by ``start_span``'s own constructor call and
  ``start()``, with the same arguments.

A parent that is not a ``SpanContext`` raises ``start_span``'s ``TypeError``, a disabled tracer gets
its ``NonRecordingSpan``, and what a sampler, id generator or processor raises goes to the caller,
as from ``start_span``. The
names ``start_span`` and the constructors look up when they run (``get_current_span``,
``NonRecordingSpan``, the SDK module's ``_Span``, ``BoundedAttributes`` and ``BoundedList``,
``threading.Lock``, ``time_ns``, ``DEFAULT_TRACE_STATE``) are looked up here when they are used,
so a replacement made after set-up (gevent's lock) is what the span gets; a replaced
``SpanContext`` or ``TraceFlags`` sends the request to ``start_span``. Not followed: a hook added
to these classes afterwards (``__setattr__``, ``__new__``), or a checked function's ``__code__``
or defaults replaced in place.

The span's end is ``Span.end`` itself: repeating it was measured to save nothing (its cost is
probably the processors' ``on_end``, which any end must call).
"""

from __future__ import annotations

import inspect
import threading
from operator import is_
from typing import Any, Dict, Optional, Tuple

from otel_generate._faults import Fault, log_fault_once
from otel_generate._sdk_code import functions_known

#: sha256 of the code (``ast.unparse``, docstrings left out) of ``Tracer.start_span`` and
#: ``SpanContext.__new__`` (opentelemetry-api), as opentelemetry-sdk 1.45 has them: what
#: :meth:`FastRequestSpans.start` repeats up to the sampler's decision, and for a span it does not record.
_START_CODE = "3d0f5d1edbe1dab97bd5f9c139e5cbe448d1f432dba7260d364ccc38c4e84774"
#: the same, of ``Span.__init__``, ``ReadableSpan.__init__``, ``Span.start``, ``Span._new_events``,
#: ``Span._new_links``, ``BoundedList.__init__``, ``BoundedAttributes.__init__``,
#: ``BoundedAttributes._set_items``, ``._setitem_locked``, ``._raise_if_immutable`` and
#: ``opentelemetry.attributes._clean_attribute_value``: what building a recording span repeats.
_SPAN_CODE = "58413a42aa7b5a26caedf14e964f8c2b0c8835338372b579936481f7d01ea6c7"
_SCALARS = frozenset((bool, int, float))
_TRACE_ID_MAX = 2**128 - 1
_SPAN_ID_MAX = 2**64 - 1


def _start_functions(owners: tuple) -> tuple:
    """The functions :data:`_START_CODE` names, read from ``owners`` now (the classes and module
    ``FastRequestSpans._owners`` holds)."""
    return (owners[0].start_span, owners[6].__new__)


def _span_functions(owners: tuple) -> tuple:
    """The functions :data:`_SPAN_CODE` names, read from ``owners`` now."""
    _, span_type, readable_type, bounded_list, bounded_attributes, attributes_module, _ = owners
    return (
        span_type.__init__,
        readable_type.__init__,
        span_type.start,
        span_type._new_events,
        span_type._new_links,
        bounded_list.__init__,
        bounded_attributes.__init__,
        bounded_attributes._set_items,
        bounded_attributes._setitem_locked,
        bounded_attributes._raise_if_immutable,
        attributes_module._clean_attribute_value,
    )


#: the function objects found to be (or not to be) the code their digest names
#: (:func:`~otel_generate._sdk_code.functions_known`)
_checked: Dict[tuple, Tuple[tuple, bool]] = {}


class FastRequestSpans:
    """Starts request spans for one SDK tracer as ``tracer.start_span`` would (module docstring)."""

    def __init__(self, tracer: Any) -> None:
        import opentelemetry.attributes as attributes_module
        from opentelemetry import trace
        from opentelemetry.sdk import trace as sdk_trace
        from opentelemetry.sdk.util import BoundedList
        from opentelemetry.trace import span as span_module
        from opentelemetry.trace.span import _SPAN_ID_MAX_VALUE, _TRACE_ID_MAX_VALUE

        self._tracer = tracer
        self._module = sdk_trace
        self._span_type = sdk_trace._Span
        self._attributes_type = attributes_module.BoundedAttributes
        self._owners = (
            sdk_trace.Tracer,
            sdk_trace._Span,
            sdk_trace.ReadableSpan,
            BoundedList,
            attributes_module.BoundedAttributes,
            attributes_module,
            trace.SpanContext,
        )
        self._api = trace  # (start_span's names read from it, and from the SDK's module, when it reads them)
        self._span_module = span_module  # (SpanContext.__new__'s DEFAULT_TRACE_STATE, read likewise)
        self._span_context = trace.SpanContext
        self._kind = trace.SpanKind.INTERNAL
        flags = trace.TraceFlags
        self._sampled, self._unsampled = flags(flags.SAMPLED), flags(flags.DEFAULT)
        self._trace_flags = flags
        self._random_flag = getattr(flags, "RANDOM_TRACE_ID", None)
        # (the status every span starts with: the constructor's default, one object)
        self._status = inspect.signature(sdk_trace.ReadableSpan.__init__).parameters["status"].default
        self.broken = False
        self._last: Optional[Tuple[tuple, bool]] = None  # (the functions usable() last read, whether known)
        self._last_span: Optional[Tuple[tuple, bool]] = None  # (the same, for _builds_as_known())
        self._new_span = self._span_type.__new__
        self._new_held = self._attributes_type.__new__
        self._list_type = BoundedList
        self._new_tuple = tuple.__new__
        if (_TRACE_ID_MAX_VALUE, _SPAN_ID_MAX_VALUE) != (_TRACE_ID_MAX, _SPAN_ID_MAX):
            raise TypeError("SpanContext's id ranges are not those expected")
        # the fields the constructors set, in their order, checked against objects they built
        limits = tracer._span_limits
        sample = self._constructed(self._span_type, "", None, None, tracer.resource, {"a": 1}, None, limits)
        built = self._fields("", None, None, sample._attributes, sample._events, sample._links, None, None)
        built["_lock"] = sample._lock
        if list(vars(sample)) != list(built) or any(
            value is not built[name] for name, value in vars(sample).items() if name != "_status"
        ):
            raise TypeError("Span's fields are not those expected")
        if vars(sample)["_status"] is not self._status:
            raise TypeError("Span's status is not the constructor's default")
        held = sample._attributes
        expected = {"_dict": {"a": 1}, "maxlen": held.maxlen, "dropped": 0, "max_value_len": held.max_value_len}
        expected.update(_lock=held._lock, _immutable=False)
        if list(vars(held)) != list(expected) or vars(held) != expected:
            raise TypeError("BoundedAttributes' fields are not those expected")
        for events, maxlen in ((sample._events, limits.max_events), (sample._links, limits.max_links)):
            if list(vars(events)) != ["dropped", "_dq", "_lock"] or events._dq.maxlen != maxlen or events.dropped:
                raise TypeError("BoundedList's fields are not those expected")
        #: Span.__init__'s fields in its order; start() overwrites every one a span has of its own
        self._template = built

    def _constructed(
        self,
        span_type: type,
        name: str,
        context: Any,
        parent: Any,
        resource: Any,
        attributes: Any,
        record_end_metrics: Any,
        limits: Any,
    ) -> Any:
        """A span built by ``span_type``'s constructor with the arguments ``start_span`` passes it
        (the tracer's sampler, processor, scope; kind INTERNAL, no link), not yet started."""
        tracer = self._tracer
        return span_type(
            name=name,
            context=context,
            parent=parent,
            sampler=tracer.sampler,
            resource=resource,
            attributes=attributes,
            span_processor=tracer.span_processor,
            kind=self._kind,
            links=(),
            instrumentation_info=tracer.instrumentation_info,
            record_exception=True,
            set_status_on_exception=True,
            limits=limits,
            instrumentation_scope=tracer._instrumentation_scope,
            record_end_metrics=record_end_metrics,
        )

    def _fields(
        self, name: str, context: Any, parent: Any, attributes: Any, events: Any, links: Any, start: Any, end: Any
    ) -> Dict[str, Any]:
        """``Span.__init__``'s fields (then ``start``'s start time) in the order it sets them, for
        this tracer (checked at set-up against a span its constructor built)."""
        tracer = self._tracer
        return {
            "_name": name,
            "_context": context,
            "_kind": self._kind,
            "_instrumentation_info": tracer.instrumentation_info,
            "_instrumentation_scope": tracer._instrumentation_scope,
            "_parent": parent,
            "_start_time": start,
            "_end_time": None,
            "_attributes": attributes,
            "_events": events,
            "_links": links,
            "_resource": tracer.resource,
            "_status": self._status,
            "_sampler": tracer.sampler,
            "_trace_config": None,
            "_record_exception": True,
            "_set_status_on_exception": True,
            "_span_processor": tracer.span_processor,
            "_limits": tracer._span_limits,
            "_lock": None,
            "_record_end_metrics": end,
        }

    @classmethod
    def for_tracer(cls, tracer: Any) -> Optional["FastRequestSpans"]:
        """A :class:`FastRequestSpans` for ``tracer`` when it is the SDK's own ``Tracer`` running
        the known code, else ``None``."""
        try:
            from opentelemetry.sdk.trace import Tracer
        except ImportError:
            return None
        try:
            if type(tracer) is not Tracer:
                return None
            fast = cls(tracer)
            if not fast.usable():
                return None
            return fast
        except (ImportError, TypeError, AttributeError, IndexError):  # internals that look otherwise
            return None
        except Exception as fault:  # internals that look otherwise: the public path
            log_fault_once(Fault.FAST_REQUEST_SPAN_CHECK, fault)
            return None

    def usable(self) -> bool:
        """Whether :meth:`start` may be taken now: not broken, the tracer's ``start_span`` not
        replaced on the object, and the code it repeats up to the sampler's decision the known code
        (:data:`_START_CODE`; the functions read now, their code once per set of function objects)."""
        tracer, api = self._tracer, self._api
        if self.broken or type(tracer) is not self._owners[0] or "start_span" in tracer.__dict__:
            return False
        if api.SpanContext is not self._span_context or api.TraceFlags is not self._trace_flags:
            return False  # (replaced since set-up: its flags and contexts are not those built here)
        functions = _start_functions(self._owners)
        last = self._last
        if last is not None and all(map(is_, last[0], functions)):
            return last[1]
        known = functions_known(_checked, functions, _START_CODE)
        self._last = (functions, known)
        return known

    def _builds_as_known(self) -> bool:
        """Whether the code that building a recording span repeats is the known code
        (:data:`_SPAN_CODE`), read as :meth:`usable` reads its own."""
        functions = _span_functions(self._owners)
        last = self._last_span
        if last is not None and all(map(is_, last[0], functions)):
            return last[1]
        known = functions_known(_checked, functions, _SPAN_CODE)
        self._last_span = (functions, known)
        return known

    def start(
        self, name: str, attributes: Dict[str, Any], context: Any = None, start_time: Optional[int] = None
    ) -> Any:
        """``tracer.start_span(name, context=context, kind=INTERNAL, attributes=attributes,
        start_time=start_time)``, or ``None`` where the caller must call that itself (nothing done
        then). ``start_time``: nanoseconds since the epoch (``None``: now).

        Raises:
            What ``start_span`` raises, at the same step: a parent that is not a ``SpanContext``
            (``TypeError``), the id generator, the sampler, a span processor's ``on_start``.
        """
        try:
            if not self.usable():
                return None
        except Exception as fault:  # nothing was done: the public path
            self.broken = True
            log_fault_once(Fault.FAST_REQUEST_SPAN, fault)
            return None
        tracer, api, module = self._tracer, self._api, self._module
        # start_span's steps, in its order, each name read when it reads it
        parent = api.get_current_span(context).get_span_context()
        if parent is not None and not isinstance(parent, api.SpanContext):
            raise TypeError("parent_span_context must be a SpanContext or None.")
        if not tracer._is_enabled():
            return api.NonRecordingSpan(context=parent)
        ids = tracer.id_generator
        if parent is None or not parent.is_valid:
            parent = None
            trace_id = ids.generate_trace_id()
        else:
            trace_id = parent.trace_id
        kind = self._kind
        sampling = tracer.sampler.should_sample(context, trace_id, name, kind, attributes, ())
        flags = self._sampled if sampling.decision.is_sampled() else self._unsampled
        if parent is None:
            random_trace_id = ids.is_trace_id_random()
        else:
            random_trace_id = parent.trace_flags.random_trace_id
        if random_trace_id:
            flags = self._trace_flags(flags | self._random_flag)
        span_id = ids.generate_span_id()
        trace_state = sampling.trace_state
        # SpanContext(trace_id, span_id, is_remote=False, trace_flags=flags, trace_state=...): the
        # tuple its __new__ builds (the code checked), without its call
        span_context = self._new_tuple(
            self._span_context,
            (
                trace_id,
                span_id,
                False,
                flags,
                trace_state if trace_state is not None else self._span_module.DEFAULT_TRACE_STATE,
                0 < trace_id <= _TRACE_ID_MAX and 0 < span_id <= _SPAN_ID_MAX,
            ),
        )
        record_end_metrics = tracer._tracer_metrics.start_span(parent, sampling.decision)
        if not sampling.decision.is_recording():
            return api.NonRecordingSpan(context=span_context)
        resource, processor, limits = tracer.resource, tracer.span_processor, tracer._span_limits
        span_type = module._Span
        if (
            span_type is not self._span_type
            or module.BoundedAttributes is not self._attributes_type
            or module.BoundedList is not self._list_type
            or resource is None
            or not self._builds_as_known()
        ):  # start_span's own construction, with the same arguments
            span = self._constructed(
                span_type, name, span_context, parent, resource, sampling.attributes, record_end_metrics, limits
            )
            span.start(start_time=start_time, parent_context=context)
            return span
        # Span.__init__'s fields, in its order; each new object made in its order
        fields = self._template.copy()
        fields["_name"] = name
        fields["_context"] = span_context
        fields["_instrumentation_info"] = tracer.instrumentation_info
        fields["_instrumentation_scope"] = tracer._instrumentation_scope
        fields["_parent"] = parent
        fields["_resource"] = resource
        fields["_sampler"] = tracer.sampler
        fields["_span_processor"] = processor
        fields["_limits"] = limits
        fields["_lock"] = threading.Lock()
        fields["_attributes"] = self._attributes(sampling.attributes, limits)
        fields["_events"] = self._list_type(limits.max_events)  # (Span._new_events)
        fields["_links"] = self._list_type(limits.max_links)  # (Span._new_links: no link)
        fields["_record_end_metrics"] = record_end_metrics
        fields["_start_time"] = start_time if start_time is not None else module.time_ns()  # (Span.start)
        span = self._new_span(span_type)
        span.__dict__ = fields
        processor.on_start(span, parent_context=context)
        return span

    def _attributes(self, attributes: Any, limits: Any) -> Any:
        """``BoundedAttributes(limits.max_span_attributes, attributes, immutable=False,
        max_value_len=limits.max_span_attribute_length)``, as that constructor builds it (its
        cleaning reads ``attributes.items()``: so are they read here, once)."""
        maxlen, limit = limits.max_span_attributes, limits.max_span_attribute_length
        held_type = self._attributes_type
        if attributes and (maxlen is None or 0 < len(attributes) <= maxlen) and (limit is None or limit >= 0):
            items = tuple(attributes.items())
            for key, value in items:
                if type(key) is not str or not key:
                    break
                kind = type(value)
                if kind is str:
                    if limit is not None and len(value) > limit:
                        break
                elif kind not in _SCALARS:
                    break
            else:  # what the cleaning leaves as it is: stored as it is, in order
                held = self._new_held(held_type)
                held.__dict__ = {
                    "_dict": dict(items),
                    "maxlen": maxlen,
                    "dropped": 0,
                    "max_value_len": limit,
                    "_lock": threading.Lock(),
                    "_immutable": False,
                }
                return held
        return held_type(maxlen, attributes, immutable=False, max_value_len=limit)
