"""State of a ``generate()`` producer: one user call (:class:`Call`) and its decoding loops (:class:`Loop`).

A user's ``model.generate(...)`` is one request (a :class:`Call`), whatever class it was called
on: ``GenerationMixin.generate`` itself, a model class's own ``generate()`` (Whisper, Blip-2,
Bark, MusicGen, ...; see :mod:`.overrides`) or a ``custom_generate`` function. Each decoding
loop inside it is a :class:`Loop`: normally exactly one, the ``GenerationMixin.generate`` the
user called; several when a model's ``generate()`` calls the base one per window or per
fallback attempt (Whisper) or per sub-model (Bark).

These classes hold what the hooks (:mod:`.generate_loop`) learn, plus their small lifecycle
(start the span, open and close a loop, let go of tensors). Turning that state into the
request's numbers is :mod:`.accounting`'s.

Other producers attach small objects instead of being called by name:

* :class:`Window` (``Call.window``, ``Loop.window``): Whisper's current 30-second window, whose
  temperature attempts are the call's loops (:mod:`.whisper`);
* :class:`RowSource` (``Loop.paged``): the continuous-batching requests a
  ``generate(..., cache_implementation="paged")`` handed its rows to (:mod:`.continuous_batching`);
* :class:`ContentCapture` (``Call.content``): opt-in content capture (:mod:`.generate_content`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

from opentelemetry import context as otel_context
from opentelemetry import trace

from otel_generate import attributes as A
from otel_generate import clock, emit, energy, figures
from otel_generate._faults import Fault, log_fault_once, note_once
from otel_generate.integrations._routing import (
    ONE_TOKEN_STEPS,
    ROW_ALIGNED,
    CallFrame,
    LoopFrame,
    _is_tensor,
    custom_generate_name,
    loop_strategy,
    model_name,
    response_id,
)
from otel_generate.integrations.streamer import _TimedStreamer
from otel_generate.options import SYNCHRONIZE_EVENTS
from otel_generate.policy import STEP_SPANS_NONE
from otel_generate.request import Request
from otel_generate.telemetry import Telemetry
from otel_generate.tokens import step_tokens

#: Keywords this package adds to ``generate()``; they never reach transformers.
CALLBACK_KWARG = "per_token_latency_callback"
TRACK_KWARG = "track_token_latency"


class Window(Protocol):
    """A group of a call's loops, attached as ``Call.window`` by another producer (Whisper's window)."""

    def on_open(self, loop: "Loop") -> None:
        """A loop of the call opened (not an implicit one): it may join the group (``loop.window``)."""

    def attributes(self, loop: "Loop") -> Tuple[Dict[str, Any], Optional[set]]:
        """The loop's grouping-span attributes, and the positions of its rows whose result was kept
        (``None``: all)."""


class RowSource(Protocol):
    """Where a loop's rows really ran (``Loop.paged``): it fills the loop's numbers itself."""

    def account(self, loop: "Loop") -> None:
        """Fill ``loop``'s steps, tokens, finish reasons and parameters."""


class ContentCapture(Protocol):
    """Opt-in content of the call (``Call.content``), filled once its loops are accounted."""

    def fill(self, call: "Call", loops: List["Loop"], result: Any) -> None:
        """Fill ``call.request``'s content fields; never raises."""


class Call(CallFrame):
    """Producer state of one user call of ``generate()``: the request span, the record, its loops.

    Args:
        telemetry: from ``instrument()``.
        model: the model the user called ``generate()`` on (names the request).
        args, kwargs: the call's arguments (``self``/``model`` excluded); ``kwargs`` is the dict
            passed on to the original, so a streamer in it is replaced by a timing proxy.
        extras: this package's own ``generate()`` keywords, already removed from ``kwargs``.
        custom_generate: the ``custom_generate`` that the call runs (a string or a callable).

    Raises:
        Whatever starting the span or the first clock read raises (a broken span processor): the
        caller then runs ``generate()`` uninstrumented, and the started span is ended marked
        incomplete.
    """

    def __init__(
        self,
        telemetry: Telemetry,
        model: Any,
        args: tuple,
        kwargs: dict,
        extras: dict,
        custom_generate: Any = None,
    ) -> None:
        self.telemetry = telemetry
        self.model = model
        self.args = args
        self.kwargs = kwargs
        self.callback: Optional[Callable[[int, float], None]] = extras.get(CALLBACK_KWARG)
        track = (
            extras[TRACK_KWARG] if TRACK_KWARG in extras else getattr(self.user_generation_config(), TRACK_KWARG, False)
        )
        self.track = bool(track)  # the generate() keyword overrides the GenerationConfig, as for every option
        self.profilers = tuple(telemetry.profilers())
        self.name = model_name(model)
        self.loops: List[Loop] = []
        #: the call is a model's own generate() (or a custom_generate) whose loops are inner calls
        #: (Whisper's windows, Bark's sub-models): set by run_request
        self.outer = False
        self.custom_generate = custom_generate_name(
            custom_generate if custom_generate is not None else kwargs.get("custom_generate")
        )
        self.sync: Optional[Callable[[], None]] = None
        #: ``synchronize="events"`` on one CUDA device: the events of the request's boundaries (its
        #: start, each loop's start and end; the steps' are the recorders')
        self.events: Optional[clock.DeviceEvents] = None
        self.start_event: Any = None
        #: NVML's energy counter of the model's CUDA device(s) (``measure_energy``), its readings at
        #: the request's start and end, and whether each step boundary reads it too (step spans on)
        self.energy: Optional[energy.EnergyMeter] = None
        self.energy_start_mj: Optional[int] = None
        self.energy_end_mj: Optional[int] = None
        self.step_energy = False
        self.streamer: Optional[_TimedStreamer] = None
        self.window: Optional[Window] = None  # the current Whisper window (see .whisper)
        self.content: Optional[ContentCapture] = None  # attached when content is captured
        self._submodules: Optional[set] = None
        self.memory_device: Optional[str] = None

        self.span = emit.start_request_span(telemetry, self.name)
        try:
            # The full record (memory, cache size, streamer timing, ...) only when someone reads it: a
            # recorded span, a profiler, a callback, or track_token_latency.
            self.detailed = self.span.is_recording() or bool(self.profilers) or self.callback is not None or self.track
            # Steps are timed for those, and for the latency metrics, which are recorded for every
            # request, sampled or not, whenever a meter provider collects them. Otherwise generate()
            # runs exactly as uninstrumented.
            self.timed = self.detailed or telemetry.metrics_live()
            mode = telemetry.synchronize
            synchronized = bool(mode)
            device = None
            start_wait = None  # events with energy: one wait before the start reading (none per step)
            if self.timed:
                devices = list(clock.devices_of(model))
                device = clock.device_name(devices[-1]) if devices else None
                # (one CPU device: nothing to wait for, as synchronizer_for would find)
                on_device = not (device == "cpu" and len(devices) == 1)
                if mode == SYNCHRONIZE_EVENTS:
                    self.events = device_events(devices, on_device)
                # (the readings must follow the device's work: none with synchronize=False)
                if on_device and mode and telemetry.options.measure_energy:
                    self.energy = energy.meter_for(devices)
                if mode and on_device:
                    try:
                        if self.events is None:
                            self.sync = clock.synchronizer_for(devices)
                        elif self.energy is not None:
                            start_wait = clock.synchronizer_for(devices)
                    except ValueError as fault:  # a device type with no synchronize we know of
                        synchronized = False
                        log_fault_once(Fault.DEVICE_SYNCHRONIZE, fault)
                if self.energy is not None:
                    policy = telemetry.policy
                    # each step boundary reads the counter where step spans may be built and the
                    # reading follows the device's wait (not in events mode: the host runs ahead)
                    self.step_energy = (
                        self.events is None
                        and self.sync is not None
                        and self.span.is_recording()
                        and policy.name != STEP_SPANS_NONE
                        and policy.max_step_spans > 0
                    )
            self.request = Request(
                model=self.name, start_ns=0, start_wall_ns=0, timed=self.timed, synchronized=synchronized, device=device
            )
            self.request.request_id = response_id()  # a request served by transformers serve (5.25+): its client's id
            self.memory_device = (
                figures.cuda_device(device) if self.detailed and telemetry.options.measure_memory else None
            )
            self.synchronize()
            if start_wait is not None:
                self._wait_once(start_wait)
            self.memory(figures.reset_peak_memory)
            if self.events is not None:
                self.start_event = self.mark()
                if self.start_event is None:  # the events failed: wait per step instead (logged once)
                    self._fall_back_to_waiting(devices)
            self.request.start_ns = clock.monotonic_ns()
            self.request.start_wall_ns = clock.wall_ns()
            if self.energy is not None:
                self.energy_start_mj = self.energy.read()
        except BaseException:
            # The caller runs generate() uninstrumented; the started span says why it has no data.
            if self.span.is_recording():
                self.span.set_attribute(A.GENERATE_STEPS_INCOMPLETE, True)
            self.span.end()
            raise
        streamer = kwargs.get("streamer")
        if streamer is not None:
            self.request.parameters[A.GEN_AI_REQUEST_STREAM] = True
            if self.detailed:
                self.streamer = kwargs["streamer"] = _TimedStreamer(streamer)
        self.context_token = otel_context.attach(trace.set_span_in_context(self.span))

    def user_generation_config(self) -> Any:
        """The ``GenerationConfig`` the user passed (keyword or second positional), else the model's."""
        config = self.kwargs.get("generation_config")
        if config is None and len(self.args) > 1 and not _is_tensor(self.args[1]):
            config = self.args[1]
        if config is None:
            config = getattr(self.model, "generation_config", None)
        return config

    def owns(self, model: Any) -> bool:
        """Whether ``model``'s ``generate()`` is part of this request: the model itself or one of its
        submodules (Blip-2's language model, Bark's sub-models); walked once, when first needed."""
        if model is self.model:
            return True
        if self._submodules is None:
            modules = getattr(self.model, "modules", None)
            try:
                self._submodules = {id(m) for m in modules()} if callable(modules) else set()
            except Exception:
                self._submodules = set()
        return id(model) in self._submodules

    def open_loop(self, model: Any, kwargs: dict, implicit: bool = False, start_ns: Optional[int] = None) -> "Loop":
        """A new decoding loop of this request, started now (or at ``start_ns``)."""
        loop = Loop(self, model, kwargs, implicit, start_ns)
        self.loops.append(loop)
        if self.window is not None and not implicit:
            self.window.on_open(loop)
        return loop

    def implicit_loop(self, model: Any) -> "Loop":
        """The loop of a ``generate()`` that runs the GenerationMixin helpers without
        ``GenerationMixin.generate`` (MusicGen, RAG-token, Dia): opened by the first helper."""
        if self.loops and self.loops[-1].implicit and not self.loops[-1].closed:
            return self.loops[-1]
        return self.open_loop(model, {}, implicit=True)

    def on_fault(self, kind: str, exc: BaseException) -> None:
        if kind == Fault.STEP_HOOK:
            self.request.incomplete = True
        log_fault_once(kind, exc)

    def memory(self, read: Callable[[str], Any]) -> Any:
        """A CUDA memory statistic of the request's device (``None`` off CUDA); a failing one is
        logged once and not read again in this request."""
        if self.memory_device is None:
            return None
        try:
            return read(self.memory_device)
        except Exception as fault:
            self.memory_device = None
            log_fault_once(Fault.MEMORY_STATISTICS, fault)
            return None

    def synchronize(self) -> None:
        """Wait for the device; a failing synchronize is logged once, then no longer used."""
        if self.sync is None:
            return
        try:
            self.sync()
        except Exception as fault:
            self.sync = None
            self.request.synchronized = False
            self.request.incomplete = True
            log_fault_once(Fault.DEVICE_SYNCHRONIZE, fault)

    # --- device events (synchronize="events") and energy ----------------------------------------
    def mark(self) -> Any:
        """Record a CUDA timing event now (``synchronize="events"``), or ``None``: no events, or the
        record failed (logged once; the request's times stay on the host clock)."""
        events = self.events
        if events is None:
            return None
        try:
            return events.mark()
        except Exception as fault:
            self._events_failed(fault)
            return None

    def _events_failed(self, fault: BaseException) -> None:
        log_fault_once(Fault.DEVICE_EVENTS, fault)
        self.events = None
        if self.start_event is not None:  # events were recorded: the steps' host times are launch times
            self.request.synchronized = False
            self.request.incomplete = True

    def _fall_back_to_waiting(self, devices: List[Any]) -> None:
        try:
            self.sync = clock.synchronizer_for(devices)
        except ValueError:
            self.request.synchronized = False
        self.synchronize()

    def _wait_once(self, wait: Callable[[], None]) -> None:
        try:
            wait()
        except Exception as fault:
            log_fault_once(Fault.DEVICE_SYNCHRONIZE, fault)

    def last_event(self) -> Any:
        """The event recorded last in this request (loops run one after the other): the last loop's
        end event, else its last step's, else its start's; the request's start event without loops."""
        for loop in reversed(self.loops):
            if loop.end_event is not None:
                return loop.end_event
            recorder = loop.recorder
            step_events = recorder.events if recorder is not None else None
            if step_events:
                return step_events[-1]
            if loop.start_event is not None:
                return loop.start_event
        return self.start_event

    def wait_for_last_event(self) -> None:
        """``synchronize="events"``: wait for the request's last event, the mode's only wait (besides
        one before the start's energy reading, when energy is read): ``generate()`` returns tensors
        its caller reads, so that work completes anyway."""
        if self.events is None or self.start_event is None:
            return
        last = self.last_event()
        if last is None:
            return
        try:
            last.synchronize()
        except Exception as fault:
            self._events_failed(fault)

    def resolve_device_times(self) -> None:
        """``synchronize="events"``, after :meth:`wait_for_last_event`: every loop's bounds and
        every step's end become device times placed on the request's time line (the request's
        start event at ``request.start_ns``; step ``i`` of a loop ends ``elapsed(event i-1, event
        i)`` after step ``i - 1``, its first step ``elapsed(loop start event, event 0)`` after the
        loop's start), before the steps are accounted. All or nothing: a read that fails leaves
        the host times, the request marked unsynchronized and incomplete (logged once)."""
        base = self.start_event
        if self.events is None or base is None:
            return
        request = self.request
        base_ns = request.start_ns
        resolved = []
        try:
            for loop in self.loops:
                if loop.paged is not None:
                    return  # its steps are continuous batching's, on their own clock
                start_event = loop.start_event
                if start_event is None:
                    raise RuntimeError("a decoding loop has no start event")
                start_ns = base_ns if start_event is base else base_ns + clock.elapsed_ns(base, start_event)
                ends = None
                recorder = loop.recorder
                if recorder is not None and recorder.events is not None:
                    steps = len(recorder.times_ns)
                    if len(recorder.events) < steps:
                        raise RuntimeError(f"{steps} steps timed, {len(recorder.events)} events recorded")
                    ends, previous, end = [], start_event, start_ns
                    for event in recorder.events[:steps]:
                        end += clock.elapsed_ns(previous, event)
                        ends.append(end)
                        previous = event
                end_ns = None if loop.end_event is None else base_ns + clock.elapsed_ns(base, loop.end_event)
                resolved.append((loop, start_ns, ends, end_ns))
        except Exception as fault:
            self._events_failed(fault)
            return
        for loop, start_ns, ends, end_ns in resolved:
            loop.start_ns = start_ns
            if ends is not None:
                loop.recorder.times_ns[:] = ends
            if end_ns is not None:
                loop.end_ns = end_ns
        request.clock = A.CLOCK_DEVICE

    def read_energy_end(self) -> None:
        """The energy counter when the request ends (after the device was waited for)."""
        if self.energy is not None:
            self.energy_end_mj = self.energy.read()

    def attribute_energy(self, loops: List["Loop"]) -> None:
        """``request.energy_mj`` from the start and end readings; ``request.step_energy_mj`` from the
        step readings of a single loop whose steps are exactly the request's, when the counter
        advanced within every step (:mod:`otel_generate.energy`). Neither is guessed."""
        if self.energy is None:
            return
        request = self.request
        if not request.synchronized:  # a wait or an event failed: the readings need not follow the work
            return
        request.energy_mj = energy.request_energy_mj(self.energy_start_mj, self.energy_end_mj)
        if request.energy_mj is None or not self.step_energy or len(loops) != 1:
            return
        recorder = loops[0].recorder
        steps = len(request.step_ends_ns)
        readings = recorder.energies if recorder is not None else None
        if loops[0].paged is None and readings is not None and steps and len(readings) >= steps:
            request.step_energy_mj = energy.step_energies_mj(self.energy_start_mj, readings[:steps])

    def step_clock(self) -> Tuple[Callable[[], int], Optional[List[Any]], Optional[List[Any]]]:
        """The clock a new loop's step recorder reads at each step boundary, with the lists it
        fills besides the times: the step events (``synchronize="events"``: each read records an
        event first) and the energy readings (each read then reads the counter), else ``None``."""
        read = clock.monotonic_ns
        step_events = readings = None
        if self.events is not None:
            step_events = []
            read = self.events.step_clock(step_events, read)
        if self.step_energy and self.energy is not None:
            readings = []
            read = _reading_clock(read, self.energy.read, readings.append)
        return read, step_events, readings

    def release(self) -> None:
        """Let go of the loops: their recorders call back into this call, so the call (prompt
        tensors, the caller's kwargs) is freed when generate() returns, not at a later gc."""
        for loop in self.loops:
            loop.release()
        self.loops = []
        self.window = None  # a Whisper window holds its attempts (loops)


class Loop(LoopFrame):
    """One decoding loop of a request: a ``GenerationMixin.generate`` call, or the implicit loop of
    a model that runs the GenerationMixin helpers itself. Filled by the helper hooks; accounted
    (:func:`.accounting.account_loop`) from its own result tensor when it ends."""

    # (slots: more attributes than an instance dictionary shares its keys for, read on every request)
    __slots__ = (
        "assisted_generator", "cache", "call", "candidates_accepted", "candidates_proposed", "closed",
        "criteria", "end_ns", "finish_reasons", "generation_config", "implicit", "incomplete", "known_strategy",
        "input_tokens", "inputs_tensor", "kv_cache_bytes", "kwargs", "model", "model_input_name",
        "output_tokens", "paged", "parameters", "per_sequence", "prefill_steps", "prompt_length",
        "queue_ns", "recorder", "result", "start_ns", "step_ends_ns", "step_logprobs", "step_requests",
        "step_starts_ns", "step_tokens", "temperature", "uninstrumented", "unobserved", "window",
        "start_event", "end_event",
        "__weakref__",  # (a loop may be referred to weakly, as a dictionary-backed object may)
    )  # fmt: skip

    def __init__(self, call: Call, model: Any, kwargs: dict, implicit: bool, start_ns: Optional[int] = None) -> None:
        self.call = call
        self.model = model
        self.kwargs = kwargs
        self.implicit = implicit
        # (synchronize="events": the loop's start event; the request's own when it starts with the request)
        self.start_event: Any = None
        if getattr(call, "events", None) is not None:
            self.start_event = call.mark() if start_ns is None else call.start_event
        self.end_event: Any = None
        self.start_ns = clock.monotonic_ns() if start_ns is None else start_ns
        self.end_ns: Optional[int] = None
        self.closed = False
        self.generation_config: Any = None
        #: the strategy, once the stopping criteria are built from the final config (read once)
        self.known_strategy: Optional[str] = None
        self.prompt_length: Optional[int] = None
        self.inputs_tensor: Any = None
        self.model_input_name: Any = None
        self.recorder: Any = None
        self.criteria: Any = None
        self.assisted_generator: Optional[str] = None
        self.window: Optional[Window] = None  # the Whisper window this loop is an attempt of
        self.step_logprobs: Any = None  # opt-in content: set by generate_content's logits-processor hook
        self.result: Any = None
        self.cache: Any = None  # the key/value cache object, until the loop returns
        self.kv_cache_bytes: Optional[int] = None
        self.candidates_proposed: Optional[int] = None  # assisted decoding (figures.count_candidates)
        self.candidates_accepted: Optional[int] = None
        #: the continuous-batching requests this loop handed its rows to (``cache_implementation="paged"``),
        #: a :class:`RowSource` (continuous_batching's ``PagedGroup``), or ``None``
        self.paged: Optional[RowSource] = None
        # what accounting fills
        self.step_ends_ns: List[int] = []
        self.step_tokens: List[int] = []
        self.step_starts_ns: Optional[List[int]] = None  # explicit step starts (batch steps), else contiguous
        self.step_requests: Optional[List[int]] = None
        self.prefill_steps = 1
        self.queue_ns: Optional[int] = None
        self.parameters: Dict[str, Any] = {}
        self.input_tokens: Optional[int] = None
        self.output_tokens: Optional[int] = None
        self.per_sequence: List[int] = []
        self.finish_reasons: Optional[List[str]] = None
        self.unobserved: Optional[str] = None
        self.incomplete = False
        self.uninstrumented = False  # uninstrument() ran before this loop's hooks were all reached
        # the temperature of this attempt, read now: Whisper changes the same config for the next one
        config = kwargs.get("generation_config")
        self.temperature: Optional[float] = None
        if config is not None:
            self.temperature = float(config.temperature or 0.0) if getattr(config, "do_sample", False) else 0.0

    @property
    def running(self) -> bool:
        """Its decoding loop has started (the stopping criteria are installed) and not ended."""
        return self.criteria is not None and not self.closed

    def observed(self) -> bool:
        """Whether this loop reached the decoding machinery (a dispatching call, e.g. the outer
        ``generate(custom_generate="dir")``, never does)."""
        return self.generation_config is not None or self.recorder is not None or self.paged is not None

    def release(self) -> None:
        self.recorder = self.criteria = self.result = self.cache = self.paged = None

    def strategy(self) -> Optional[str]:
        """``generate.strategy`` of this loop, once its ``GenerationConfig`` is known."""
        if self.known_strategy is not None:
            return self.known_strategy
        return loop_strategy(self.generation_config, self.kwargs)

    # --- hooks called from inside generate() ------------------------------------------------
    def on_generated_length(
        self, generation_config: Any, input_ids_length: Any, inputs_tensor: Any, model_input_name: Any
    ) -> None:
        """From ``GenerationMixin._prepare_generated_length``: the effective config and prompt width."""
        self.generation_config = generation_config
        if input_ids_length is not None:
            self.prompt_length = int(input_ids_length)
        self.inputs_tensor = inputs_tensor
        self.model_input_name = model_input_name

    def recording_criteria(self, criteria: Any, generation_config: Any) -> Any:
        """``_get_stopping_criteria``'s list, as a :class:`RecordingCriteriaList` feeding this loop."""
        global _step_hook
        if _step_hook is None:  # (it imports transformers: only once a loop runs)
            from otel_generate.integrations import step_hook

            _step_hook = step_hook
        hook = _step_hook
        if self.generation_config is None:
            self.generation_config = generation_config
        strategy = self.known_strategy = self.strategy()  # (the config is final: generate() is decoding next)
        call = self.call
        step_clock, step_events, readings = call.step_clock()
        self.recorder = hook.StepRecorder(
            call.sync,
            step_clock,
            self.start_ns,
            self.prompt_length if self.prompt_length is not None else 0,
            call.on_fault,
            call.callback,
            skip_candidate_calls=call.telemetry.skip_candidate_calls and strategy == A.STRATEGY_ASSISTED,
            # one is_done row per returned sequence (not beam search's flattened candidates), when
            # a row may stop before the others
            keep_done=strategy in ROW_ALIGNED and hook.rows_may_end_apart(criteria),
            token_offset=(  # (the common request has one loop: this one)
                sum(sum(loop.step_tokens or _tokens_so_far(loop)) for loop in call.loops if loop is not self)
                if len(call.loops) > 1
                else 0
            ),
            one_token_steps=self._runs_own_sample_loop(strategy),
            events=step_events,
            energies=readings,
        )
        self.criteria = hook.RecordingCriteriaList(criteria, self.recorder)
        return self.criteria

    def _runs_own_sample_loop(self, strategy: Optional[str]) -> bool:
        """Whether this loop is transformers' own greedy or sampling loop, which appends exactly one
        token per row before each stopping-criteria call: a ``GenerationMixin.generate`` call (not
        an implicit loop, not a ``custom_generate``) of a model whose ``_sample`` is transformers' own."""
        if strategy not in ONE_TOKEN_STEPS or self.prompt_length is None or self.implicit:
            return False
        if self.kwargs.get("custom_generate") is not None or self.call.custom_generate is not None:
            return False
        global _generation_mixin
        if _generation_mixin is None:
            from transformers.generation.utils import GenerationMixin  # (imported: generate() is running)

            _generation_mixin = GenerationMixin
        return getattr(type(self.model), "_sample", None) is _generation_mixin._sample

    def close(self, result: Any = None, read_clock: bool = True) -> None:
        """The loop returned (``result``) or raised; ``read_clock=False`` when it ends with its
        request, whose (synchronized) end time it then takes."""
        self.closed = True
        self.result = result
        self.size_cache(result)
        if read_clock:
            self.call.synchronize()
            self.end_event = self.call.mark()
            self.end_ns = clock.monotonic_ns()

    def size_cache(self, result: Any = None) -> None:
        """``kv_cache_bytes`` from the cache object the loop built (or, with transformers 4.x's legacy
        tuples, the ``past_key_values`` of its output), once; then the cache is let go."""
        if self.cache is None and self.call.detailed:
            self.cache = getattr(result, "past_key_values", None)
        if self.cache is not None:
            try:
                self.kv_cache_bytes = figures.cache_bytes(self.cache)
            except Exception as fault:
                log_fault_once(Fault.KEY_VALUE_CACHE_SIZE, fault)
            self.cache = None


#: :mod:`otel_generate.integrations.step_hook` and transformers' ``GenerationMixin``, imported by
#: the first loop that needs them (not when this module is: it loads before transformers may be)
_step_hook: Any = None
_generation_mixin: Any = None


def device_events(devices: List[Any], on_device: bool) -> Optional[clock.DeviceEvents]:
    """``synchronize="events"``: the request's :class:`~otel_generate.clock.DeviceEvents`, or ``None``
    where the mode falls back to waiting (CPU: nothing changes; MPS, XPU, several devices, no CUDA
    events), said once per reason on the logger ``otel_generate``."""
    if not on_device:
        note_once(
            "events on cpu",
            "otel_generate: synchronize='events' times CUDA devices; a model on the CPU is timed as before "
            "(its work has completed when each step returns)",
        )
        return None
    events, reason, error = clock.device_events_for(devices)
    if events is None:
        detail = f" ({type(error).__name__}: {error})" if error is not None else ""
        note_once(
            f"events {reason}",
            "otel_generate: synchronize='events' needs one CUDA device with timing events (%s%s); steps are timed "
            "as with synchronize='wait'",
            reason,
            detail,
            level=logging.WARNING if reason == clock.NO_EVENTS_UNAVAILABLE else logging.INFO,
        )
    return events


def _reading_clock(
    read: Callable[[], int], read_energy: Callable[[], Optional[int]], append: Callable[[Any], None]
) -> Callable[[], int]:
    """``read``, then one energy reading appended (a step boundary that reads the counter)."""

    def clock_and_energy() -> int:
        now = read()
        append(read_energy())
        return now

    return clock_and_energy


def _tokens_so_far(loop: Loop) -> List[int]:
    """Tokens per step a loop has recorded so far (it may still be running)."""
    recorder = loop.recorder
    if recorder is None:
        return []
    return step_tokens(recorder.step_lengths(), loop.prompt_length if loop.prompt_length is not None else 0)
