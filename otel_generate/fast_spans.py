"""A faster way to build step spans, taken only where it gives exactly what the public API gives.

A step span built through the public API (``tracer.start_span(...).end(...)``) costs the SDK
about 17 µs of Python even with few attributes: the span object, its lock, the attribute
container, the processors' start and end hooks. A step span is known in full when it is built
(its times, its attributes, its parent): :class:`FastStepSpans` builds it directly as the
``ReadableSpan`` that ``Span.end()`` would hand to the span processor, and calls the processor's
``on_end`` with it, in about a third of the time. The ``ReadableSpan`` is a copy of one built by
its own constructor at set-up, with the span's own fields set; its ``SpanContext`` is the tuple
that ``SpanContext.__new__`` builds; the processors' ``on_end`` are called as the SDK's
multi-processor calls them (for a ``BatchSpanProcessor`` whose ``on_end`` is exactly the code
this module knows, what that ``on_end`` calls for a sampled span: its batch processor's
``emit``). :meth:`FastStepSpans.emit_many` builds a request's step spans in one call.

That uses SDK internals, so it is taken only when the result is the same as the public path's
(:meth:`FastStepSpans.for_tracer`, checked once per ``instrument()``):

* the tracer is the SDK's own ``Tracer``, enabled, without the SDK's self-observability metrics;
* every span processor is exactly the SDK's ``BatchSpanProcessor`` or ``SimpleSpanProcessor``,
  whose ``on_start`` and ``_on_ending`` do nothing (any other processor may do something there:
  the public path is used), under the SDK's ``SynchronousMultiSpanProcessor``; those hooks, and
  the multi-processor's, are checked against their code, and for a replacement set on the object,
  at every request (a hook patched after ``instrument()`` sends the step spans to the public path);
* the span limits admit the step span's attributes (all numbers, at most
  :data:`MAX_FAST_ATTRIBUTES`): nothing would be dropped or truncated;
* the sampler decides each span as ``start_span`` would: its own ``should_sample`` is called
  with the same arguments, and its attributes and trace state are used; for the SDK's own
  samplers (``ParentBased``, ``ALWAYS_ON``/``ALWAYS_OFF``, ``TraceIdRatioBased``), whose
  decision for a child depends only on its parent and its trace id, the decision is taken once
  per parent and reused for its siblings.

A span id is drawn for every step span, one the sampler drops too, as ``start_span`` draws it.
Anything else, and any step span with non-numeric attributes (opt-in token ids), goes through
the public API. The processors are checked again whenever the provider's list of processors
changes (a processor added after ``instrument()``). A fault in building a span turns the fast
path off for good (logged once); an exception a processor raises is the processor's, and goes
to the caller as the public path's would.
"""

from __future__ import annotations

import time
from itertools import compress, repeat
from operator import is_
from types import FunctionType
from typing import Any, Dict, List, Optional, Sequence, Tuple

from otel_generate._faults import Fault, log_fault_once
from otel_generate._sdk_code import functions_known, same_body, same_code

#: Step spans with at most this many attributes, all numbers or bools, may take the fast path.
MAX_FAST_ATTRIBUTES = 8
_TRACE_ID_MAX = 2**128 - 1
_SPAN_ID_MAX = 2**64 - 1
_DEFAULT_TRACE_STATE: Any = None  # set from the API on first use (opentelemetry.trace.DEFAULT_TRACE_STATE)


class FastStepSpans:
    """Builds step spans as SDK ``ReadableSpan`` objects for one SDK tracer (see the module docstring)."""

    def __init__(self, tracer: Any) -> None:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.trace import SpanKind, TraceFlags
        from opentelemetry.trace.span import _SPAN_ID_MAX_VALUE, _TRACE_ID_MAX_VALUE, DEFAULT_TRACE_STATE

        global _DEFAULT_TRACE_STATE
        _DEFAULT_TRACE_STATE = DEFAULT_TRACE_STATE
        if (_TRACE_ID_MAX_VALUE, _SPAN_ID_MAX_VALUE) != (_TRACE_ID_MAX, _SPAN_ID_MAX):
            raise TypeError("SpanContext's id ranges are not those expected")
        flags = TraceFlags(TraceFlags.SAMPLED)
        public = trace.SpanContext(1, 2, is_remote=False, trace_flags=flags, trace_state=DEFAULT_TRACE_STATE)
        if tuple(public) != (1, 2, False, flags, DEFAULT_TRACE_STATE, True):
            raise TypeError("SpanContext's fields are not those expected")

        self._tracer = tracer
        self._readable = ReadableSpan
        self._span_context = trace.SpanContext
        self._trace_flags = TraceFlags
        self._kind = SpanKind.INTERNAL
        self._sampled = TraceFlags(TraceFlags.SAMPLED)
        self._unsampled = TraceFlags(TraceFlags.DEFAULT)
        self._random_flag = getattr(TraceFlags, "RANDOM_TRACE_ID", None)
        self._sampler = tracer.sampler
        self._resource = tracer.resource
        self._processor = tracer.span_processor
        self._checked = tracer.span_processor._span_processors  # the processors found eligible
        self._info = getattr(tracer, "instrumentation_info", None)
        self._scope = getattr(tracer, "_instrumentation_scope", None)
        self._per_parent = _decides_per_parent(self._sampler)
        self._decided: Dict[int, Any] = {}  # id(parent SpanContext) -> decision (per-parent samplers)
        # ReadableSpan.__init__'s result for this tracer, built once by the constructor itself: each
        # step span is a copy of its __dict__ with the span's own fields set (the same keys and values
        # the constructor would set, without its call)
        sample = ReadableSpan(
            name="",
            context=None,
            parent=None,
            resource=self._resource,
            attributes=None,
            kind=self._kind,
            instrumentation_info=self._info,
            start_time=0,
            end_time=0,
            instrumentation_scope=self._scope,
        )
        self._template = dict(vars(sample))
        self._own = ("_name", "_context", "_parent", "_attributes", "_start_time", "_end_time")
        if not set(self._own) <= set(self._template):
            raise TypeError("ReadableSpan's fields are not those expected")
        self._new_readable = ReadableSpan.__new__
        self._new_tuple = tuple.__new__
        self.broken = False

    def usable(self) -> bool:
        """Whether the fast path may be taken now: not broken, and the provider's processors are
        still those checked (``add_span_processor`` replaces the tuple: then they are checked again)."""
        if self.broken:
            return False
        current = self._processor._span_processors
        if current is not self._checked:
            if not _eligible_processors(self._processor):
                return False
            self._checked = current
        return True

    @classmethod
    def for_tracer(cls, tracer: Any) -> Optional["FastStepSpans"]:
        """A :class:`FastStepSpans` for ``tracer`` when it is equivalent to the public path, else ``None``."""
        try:
            from opentelemetry.sdk.trace import Tracer
        except ImportError:
            return None
        try:
            if type(tracer) is not Tracer:
                return None
            if callable(getattr(tracer, "_is_enabled", None)) and not tracer._is_enabled():
                return None
            metrics = getattr(tracer, "_tracer_metrics", None)
            if metrics is not None and type(metrics).__name__ != "NoOpTracerMetrics":
                return None
            if not _eligible_processors(tracer.span_processor):
                return None
            limits = getattr(tracer, "_span_limits", None)
            if limits is None:
                return None
            for name in ("max_span_attributes", "max_attributes"):
                value = getattr(limits, name, None)
                if value is not None and value < MAX_FAST_ATTRIBUTES:
                    return None
            return cls(tracer)
        except (ImportError, TypeError):  # an SDK whose internals look otherwise: the public path
            return None
        except Exception as fault:  # an SDK whose internals look otherwise: the public path
            log_fault_once(Fault.FAST_STEP_SPANS_CHECK, fault)
            return None

    def _flags(self, parent: Any, sampling: Any) -> tuple:
        """``(recording, trace flags)`` of a child span with this sampling result, as ``start_span`` sets them."""
        decision = sampling.decision
        flags = self._sampled if decision.is_sampled() else self._unsampled
        if self._random_flag is not None and getattr(parent.trace_flags, "random_trace_id", False):
            flags = self._trace_flags(flags | self._random_flag)
        return decision.is_recording(), flags

    def _decide(self, parent_context: Any, parent: Any, name: str, attributes: Dict[str, Any]) -> tuple:
        if len(self._decided) > 64:
            self._decided.clear()
        trace_id = parent.trace_id
        sampling = self._sampler.should_sample(parent_context, trace_id, name, self._kind, attributes, ())
        recording, flags = self._flags(parent, sampling)
        decided = (parent, sampling, recording, flags, trace_id, sampling.trace_state)
        self._decided[id(parent)] = decided
        return decided

    def emit_many(
        self,
        contexts: Sequence[Any],
        parents: Sequence[Any],
        names: Sequence[str],
        starts: Sequence[int],
        ends: Sequence[int],
        attributes: Sequence[Dict[str, Any]],
        begin: int = 0,
        eligible: Optional[Sequence[bool]] = None,
        yield_every: int = 0,
    ) -> int:
        """Ended step spans ``begin``, ``begin + 1``, ... in order, until one must take the public
        path; returns that one's index (``len(names)`` when none must).

        Step ``i`` is named ``names[i]``, a child of ``parents[i]`` (a ``SpanContext``) in
        ``contexts[i]`` (a ``Context`` holding the parent span), from ``starts[i]`` to ``ends[i]``
        (nanoseconds since the epoch), with ``attributes[i]``; ``eligible[i]`` false (opt-in
        attributes that are not numbers) sends it to the public path. A fault in building a span
        turns this path off for good (logged once) and returns that span's index. An exception a
        processor's ``on_end`` raises is logged once (``Fault.STEP_SPAN_EXPORT``, as the caller
        logs the public path's) and the next span goes on. On a background thread
        (``yield_every``), the interpreter lock is yielded after every that many spans, counted
        by index as the caller counts them.
        """
        count = len(names)
        if self.broken:
            return begin
        try:
            # what ending a sampled span, and a recording one that is not, calls (read once a call)
            calls = _end_calls(self._processor, self._checked)
            if calls is None:  # a hook the fast path does not call is not the known code now
                return begin
            ends_sampled, ends_unsampled = calls
            tracer = self._tracer
            if callable(getattr(tracer, "_is_enabled", None)) and not tracer._is_enabled():
                return begin  # (disabled since instrument(): start_span's own answer)
            new_span_id = tracer.id_generator.generate_span_id  # (the generator in place now)
            resource = self._tracer.resource
            if resource is not self._resource:  # (the provider's resource changed: a forked child's)
                self._resource = self._template["_resource"] = resource
        except Exception as fault:
            self.broken = True
            log_fault_once(Fault.FAST_STEP_SPANS, fault)
            return begin
        on_ends: Sequence[Any] = ()
        new_tuple, span_context = self._new_tuple, self._span_context
        new_readable, readable, template = self._new_readable, self._readable, self._template
        per_parent = self._per_parent
        last_parent: Any = None
        recording = valid_trace = False
        flags = trace_id = trace_state = span_attributes = None
        for index in range(begin, count):
            if eligible is not None and not eligible[index]:
                return index
            parent = parents[index]
            try:
                if per_parent:
                    span_attributes = attributes[index]  # these samplers hand the attributes through unchanged
                    if parent is not last_parent:
                        # the decision, and all that follows from it, once per parent: (parent,
                        # sampling, recording, flags, trace id, trace state), found by the parent itself
                        decided = self._decided.get(id(parent))
                        if decided is None or decided[0] is not parent:
                            decided = self._decide(contexts[index], parent, names[index], span_attributes)
                        _, _, recording, flags, trace_id, trace_state = decided
                        if trace_state is None:
                            trace_state = _DEFAULT_TRACE_STATE
                        valid_trace = 0 < trace_id <= _TRACE_ID_MAX
                        on_ends = ends_sampled if flags.sampled else ends_unsampled
                        last_parent = parent
                else:
                    trace_id = parent.trace_id
                    sampling = self._sampler.should_sample(
                        contexts[index], trace_id, names[index], self._kind, attributes[index], ()
                    )
                    span_attributes = sampling.attributes
                    recording, flags = self._flags(parent, sampling)
                    trace_state = sampling.trace_state if sampling.trace_state is not None else _DEFAULT_TRACE_STATE
                    valid_trace = 0 < trace_id <= _TRACE_ID_MAX
                    on_ends = ends_sampled if flags.sampled else ends_unsampled
                span_id = new_span_id()  # (start_span draws one for a span that is not recording too)
                if recording:  # (a non-recording span: nothing reaches the processors)
                    # SpanContext(trace_id, span_id, False, flags, trace_state) without its __new__'s
                    # call: the same tuple (the trace id is the parent's, the span id the generator's)
                    context = new_tuple(
                        span_context,
                        (trace_id, span_id, False, flags, trace_state, valid_trace and 0 < span_id <= _SPAN_ID_MAX),
                    )
                    span = new_readable(readable)
                    fields = template.copy()
                    fields["_name"] = names[index]
                    fields["_context"] = context
                    fields["_parent"] = parent
                    fields["_attributes"] = span_attributes
                    fields["_start_time"] = starts[index]
                    fields["_end_time"] = ends[index]
                    span.__dict__ = fields
            except Exception as fault:
                self.broken = True
                log_fault_once(Fault.FAST_STEP_SPANS, fault)
                return index
            if recording:
                try:
                    for on_end in on_ends:  # SynchronousMultiSpanProcessor.on_end, without its call
                        on_end(span)  # (a BatchSpanProcessor's: what its on_end calls, _end_calls)
                except Exception as fault:  # a span processor raised: the other steps still go
                    log_fault_once(Fault.STEP_SPAN_EXPORT, fault)
            if yield_every and index % yield_every == yield_every - 1:
                time.sleep(0)  # a background emitter lets the producer run
        return count


def _eligible_processors(processor: Any) -> bool:
    """The SDK's multi-processor holding only the SDK's batch and simple processors, whose
    ``on_start`` and ``_on_ending`` do nothing (:func:`_hooks_known`)."""
    from opentelemetry.sdk.trace import SynchronousMultiSpanProcessor
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    if type(processor) is not SynchronousMultiSpanProcessor or not _hooks_known(processor, _MULTI_HOOKS):
        return False
    return all(
        type(p) in (BatchSpanProcessor, SimpleSpanProcessor) and _hooks_known(p, _NO_HOOKS)
        for p in processor._span_processors
    )


#: The hooks of the SDK's ``SynchronousMultiSpanProcessor`` (opentelemetry-sdk 1.45) that a span's
#: start and end run: each calls its processors' hook in order. The fast path calls the processors'
#: ``on_end`` itself (:func:`_end_calls`) and their ``on_start`` and ``_on_ending`` not at all.
_MULTI_HOOKS = {
    "on_start": """
def on_start(self, span, parent_context=None):
    for sp in self._span_processors:
        sp.on_start(span, parent_context=parent_context)
""",
    "_on_ending": """
def _on_ending(self, span):
    for sp in self._span_processors:
        sp._on_ending(span)
""",
    "on_end": """
def on_end(self, span):
    for sp in self._span_processors:
        sp.on_end(span)
""",
}
#: ``on_start`` and ``_on_ending`` of the SDK's batch and simple processors: they do nothing.
_NO_HOOKS = {
    "on_start": "def on_start(self, span, parent_context=None):\n    pass\n",
    "_on_ending": "def _on_ending(self, span):\n    pass\n",
}


def _plain_function_known(
    cache: Dict[Any, Tuple[Any, bool]], key: Any, function: Any, check: Any, known_code: str
) -> bool:
    """``check(function, known_code)`` (:func:`~otel_generate._sdk_code.same_code` or ``same_body``)
    for a plain Python function that wraps nothing (not a wrapper: a ``functools.wraps`` or
    ``wrapt`` wrapper's source reads as the function it wraps), remembered in ``cache`` under
    ``key`` with the function itself: an entry is used only for that very object (a ``wrapt``
    wrapper compares and hashes equal to the function it wraps, and another function may later
    have its address). A ``check`` that raises (no source, another layout) is False."""
    if type(function) is not FunctionType:
        return False
    entry = cache.get(key)
    if entry is not None and entry[0] is function:
        return entry[1]
    try:
        known = not hasattr(function, "__wrapped__") and bool(check(function, known_code))
    except Exception:  # no source, another layout: never relied on
        known = False
    if key in cache or len(cache) < 32:  # (an entry's key taken over by a new function: replaced)
        cache[key] = (function, known)
    return known


#: hook functions checked against :data:`_MULTI_HOOKS` or :data:`_NO_HOOKS`:
#: (id, name) -> (the function, whether it is the known code)
_checked_hooks: Dict[Tuple[int, str], Tuple[Any, bool]] = {}


def _hooks_known(processor: Any, hooks: Dict[str, str]) -> bool:
    """Whether each of ``hooks`` (name -> the code it runs) is, on ``processor``, a plain function
    of its class (not a wrapper, not set on the object itself) that runs that code (decorators and
    annotations aside; a hook the class does not have is never called either). Read once per
    function object (:func:`_plain_function_known`): a patch of the class is checked when it is made."""
    own = getattr(processor, "__dict__", None) or {}
    for name, source in hooks.items():
        if name in own:  # (set on the object itself: it is what a span's start or end calls)
            return False
        function = getattr(type(processor), name, None)
        if function is None:
            continue
        if not _plain_function_known(_checked_hooks, (id(function), name), function, same_body, source):
            return False
    return True


#: ``BatchSpanProcessor.on_end`` (as in opentelemetry-sdk 1.45): for a sampled span it calls its
#: batch processor's ``emit``, for any other nothing; compared with the installed code before
#: :func:`_end_calls` relies on it.
_BATCH_ON_END = """
def on_end(self, span: ReadableSpan) -> None:
    if not (span.context and span.context.trace_flags.sampled):
        return
    self._batch_processor.emit(span)
"""
#: ``BatchSpanProcessor.on_end`` function objects checked: id -> (the function, whether it is the known code)
_checked_on_ends: Dict[Any, Tuple[Any, bool]] = {}


def _batch_on_end_known(processor_type: type) -> bool:
    """Whether ``processor_type.on_end`` is a plain function (not a wrapper, whose source would
    read as the function's) that runs exactly :data:`_BATCH_ON_END`; read once per function
    object, so a patch of it is checked when it is made."""
    function = getattr(processor_type, "on_end", None)
    return _plain_function_known(_checked_on_ends, id(function), function, same_code, _BATCH_ON_END)


def _end_calls(multi: Any, processors: Sequence[Any]) -> Optional[Tuple[Tuple[Any, ...], Tuple[Any, ...]]]:
    """``(for a sampled span, for a recording span that is not sampled)``: what the
    multi-processor ``multi``'s ``on_end`` calls, one call per processor of ``processors`` (its
    processors), in order; ``None`` where a hook the fast path repeats or leaves out is no longer
    the known code (:func:`_hooks_known`: patched since ``instrument()``). A
    ``BatchSpanProcessor`` whose ``on_end`` is :data:`_BATCH_ON_END` (a step span's context is a
    non-empty tuple), not replaced on the object itself, gives its batch processor's ``emit`` for a
    sampled span and nothing for another; every other processor its ``on_end`` for both."""
    if not _hooks_known(multi, _MULTI_HOOKS):
        return None
    sampled: List[Any] = []
    unsampled: List[Any] = []
    for processor in processors:
        if not _hooks_known(processor, _NO_HOOKS):
            return None
        batch = getattr(processor, "_batch_processor", None)
        own = getattr(processor, "__dict__", None)
        # (an on_end set on the processor object itself is what the multi-processor calls)
        if batch is not None and (own is None or "on_end" not in own) and _batch_on_end_known(type(processor)):
            sampled.append(batch.emit)
        else:
            sampled.append(processor.on_end)
            unsampled.append(processor.on_end)
    return tuple(sampled), tuple(unsampled)


def _decides_per_parent(sampler: Any) -> bool:
    """Whether ``sampler`` is one of the SDK's own, whose decision for a child span depends only on
    its parent span and its trace id (and which passes the attributes through unchanged)."""
    from opentelemetry.sdk.trace import sampling

    if type(sampler).__module__ != sampling.__name__:
        return False
    if isinstance(sampler, (sampling.StaticSampler, sampling.TraceIdRatioBased)):
        return True
    if isinstance(sampler, sampling.ParentBased):
        delegates = (
            "_root",
            "_remote_parent_sampled",
            "_remote_parent_not_sampled",
            "_local_parent_sampled",
            "_local_parent_not_sampled",
        )
        return all(_decides_per_parent(getattr(sampler, name, None)) for name in delegates)
    return False


def fast_eligible(attributes: Dict[str, Any]) -> bool:
    """Whether a step span's attributes may take the fast path: few, and all numbers or bools."""
    return len(attributes) <= MAX_FAST_ATTRIBUTES and all(
        isinstance(value, (int, float, bool)) for value in attributes.values()
    )


#: sha256 of the code (``ast.unparse``, docstrings left out) of the SDK functions a span's
#: ``set_attributes`` runs, as opentelemetry-sdk 1.45 has them: ``Span.set_attributes``,
#: ``BoundedAttributes._set_items``, ``._setitem_locked``, ``._raise_if_immutable`` and
#: ``opentelemetry.attributes._clean_attribute_value``. :func:`set_request_attributes` repeats their
#: effect only while the installed SDK's code is this.
_SET_ATTRIBUTES_CODE = "8227d5eb6db752ed25d920470903028aa7275fda003023caa7a9aa3344504373"
_SCALAR_TYPES = (bool, int, float)
_ELEMENT_TYPES = frozenset((*_SCALAR_TYPES, str))  # what a list or tuple value may hold
_SEQUENCE_TYPES = frozenset((list, tuple))
_VALUE_TYPES = _ELEMENT_TYPES | _SEQUENCE_TYPES  # what a value may be
_KEY_TYPES = frozenset((str,))
#: the functions a span's ``set_attributes`` runs (:func:`_attribute_functions`) found to be the known
#: code (:func:`~otel_generate._sdk_code.functions_known`'s cache)
_checked_attribute_functions: Dict[tuple, Tuple[tuple, bool]] = {}


#: the SDK's ``Span`` class, ``BoundedAttributes`` class and ``opentelemetry.attributes`` module,
#: imported on first use (not when this module is)
_attribute_owners: Any = None


def _attribute_functions(span_type: type, attributes_type: type, attributes_module: Any) -> tuple:
    """The functions ``set_attributes`` runs on a ``span_type`` span holding ``attributes_type``
    (``attributes_module``: ``opentelemetry.attributes``), as :data:`_SET_ATTRIBUTES_CODE` lists them."""
    return (
        span_type.set_attributes,
        attributes_type._set_items,
        attributes_type._setitem_locked,
        attributes_type._raise_if_immutable,
        attributes_module._clean_attribute_value,
    )


#: the last answer of :func:`_sets_attributes_as_expected`: ``(span type, attributes type, the
#: functions read, the answer)``
_last_attribute_check: Tuple[Any, Any, tuple, bool] = (None, None, (), False)


def _sets_attributes_as_expected(span_type: type, attributes_type: type) -> bool:
    """Whether ``set_attributes`` on a ``span_type`` span holding ``attributes_type`` runs the code
    :data:`_SET_ATTRIBUTES_CODE` names: plain functions, none a wrapper (read at every call; their
    code once per set of function objects, so a patch of any of them is checked when it is made).
    The last answer is given again, without the look-up, while the types and the functions read
    are the same objects (every request of a process, until something is patched)."""
    global _attribute_owners, _last_attribute_check
    last_span, last_attributes, last_functions, last_known = _last_attribute_check
    if span_type is last_span and attributes_type is last_attributes and last_span is not None:
        try:
            functions = _attribute_functions(span_type, attributes_type, _attribute_owners[2])
        except Exception:  # another layout: never relied on
            return False
        if all(map(is_, last_functions, functions)):
            return last_known
    try:
        if _attribute_owners is None:
            import opentelemetry.attributes as attributes_module
            from opentelemetry.sdk.trace import Span

            _attribute_owners = (Span, attributes_module.BoundedAttributes, attributes_module)
        span_class, attributes_class, attributes_module = _attribute_owners
        if not issubclass(span_type, span_class) or attributes_type is not attributes_class:
            return False
        functions = _attribute_functions(span_type, attributes_type, attributes_module)
    except Exception:  # another layout: never relied on
        return False
    known = functions_known(_checked_attribute_functions, functions, _SET_ATTRIBUTES_CODE)
    _last_attribute_check = (span_type, attributes_type, functions, known)
    return known


def set_request_attributes(span: Any, attributes: Dict[str, Any]) -> bool:
    """``span.set_attributes(attributes)`` for the request span's own attributes, without the
    SDK's per-value cleaning where cleaning changes nothing but lists into tuples: every key a
    non-empty ``str``, every value a ``bool``, ``int``, ``float`` or ``str`` (no longer than the
    span's value limit), or a list or tuple of those; room for all of them under the span's
    attribute limit; the span not ended. Then the same keys, values and order result, under the
    same locks. Returns False, having changed nothing, where the caller must call
    ``set_attributes`` itself (any other span, value or SDK).

    The types of the keys and values are checked in C (a request span has about 30 attributes);
    only the list and tuple values, and the strings when the span limits their length, are looked
    at one by one."""
    held = getattr(span, "_attributes", None)
    if not _sets_attributes_as_expected(type(span), type(held)) or "set_attributes" in vars(span):
        return False  # (one set on the span object itself is what the caller's set_attributes calls)
    limit = held.max_value_len
    values = attributes.values()
    kinds = set(map(type, values))
    if not kinds <= _VALUE_TYPES or not set(map(type, attributes)) <= _KEY_TYPES or "" in attributes:
        return False
    if (
        str in kinds
        and limit is not None
        and max(map(len, compress(values, map(is_, map(type, values), repeat(str))))) > limit
    ):
        return False
    cleaned = attributes
    if list in kinds or tuple in kinds:
        cleaned = dict(attributes)
        # (the keys of the list and tuple values, found in C: a request span has about two)
        for key in list(compress(attributes, map(_SEQUENCE_TYPES.__contains__, map(type, values)))):
            value = attributes[key]
            elements = set(map(type, value))  # (iterated in C: a request's 128 step latencies are floats)
            if not elements <= _ELEMENT_TYPES:
                return False
            if str in elements and limit is not None:
                if any(len(element) > limit for element in value if type(element) is str):
                    return False
            cleaned[key] = tuple(value)
    with span._lock:
        if span._end_time is not None or held._immutable:
            return False
        room = held.maxlen
        if room is not None and len(held._dict) + len(cleaned) > room:
            return False
        with held._lock:
            stored = held._dict
            if stored.keys().isdisjoint(cleaned):
                stored.update(cleaned)  # (new keys: appended in order, as one by one)
            else:
                for key, value in cleaned.items():
                    if key in stored:
                        del stored[key]  # (a key set again moves to the end)
                    stored[key] = value
    return True
