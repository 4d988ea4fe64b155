"""Clocks and device synchronization: the one module that decides when time is read.

A clock read on the host while an accelerator still has queued kernels measures when work was
*launched*, not when it finished. Every timing in this package therefore goes through
:func:`synchronizer_for` first: on CUDA, XPU and MPS it returns that backend's own
``synchronize``; on CPU (where eager PyTorch ops have finished when they return) it returns
``None`` and no accelerator function is ever called. The instrumentor's step hook and the
benchmark harness (:func:`timed_call`) both use this module.

``synchronize="events"`` waits for nothing per step: :func:`device_events_for` gives a
:class:`DeviceEvents` whose :meth:`~DeviceEvents.mark` records a CUDA timing event on the device's
stream, and :func:`elapsed_ns` reads two of them once they have completed (device time).

Units: :data:`monotonic_ns` returns integer nanoseconds; :func:`timed_call` returns seconds.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, List, Optional, Tuple, TypeVar

T = TypeVar("T")

Synchronize = Callable[[], None]

#: Monotonic clock used for every step boundary (integer nanoseconds, ``time.perf_counter_ns``).
monotonic_ns: Callable[[], int] = time.perf_counter_ns

#: Wall clock used to place spans on the epoch time line (integer nanoseconds since the epoch).
wall_ns: Callable[[], int] = time.time_ns

NS_PER_MS = 1_000_000
NS_PER_S = 1_000_000_000


def _device_type_and_index(device: Any) -> Tuple[str, Optional[int]]:
    """``"cuda:1"``, ``torch.device("cuda", 1)`` or ``1`` (CUDA ordinal) -> ``("cuda", 1)``."""
    if isinstance(device, int):
        return "cuda", device
    if hasattr(device, "type"):
        return str(device.type), getattr(device, "index", None)
    text = str(device)
    kind, _, index = text.partition(":")
    return kind, (int(index) if index.isdigit() else None)


def synchronizer_for(devices: Any) -> Optional[Synchronize]:
    """Return a function that waits for all queued work on ``devices``, or ``None``.

    Args:
        devices: one device (``torch.device``, ``"cuda:0"``, ``"cpu"``, an int CUDA ordinal) or an
            iterable of them (a model spread over several GPUs by ``device_map``).

    Returns:
        ``None`` when every device is a CPU (or ``meta``) device: nothing to wait for, and no
        accelerator API is touched. Otherwise a zero-argument function calling
        ``torch.cuda.synchronize(device)``, ``torch.xpu.synchronize(device)`` or
        ``torch.mps.synchronize()`` for each distinct accelerator device.

    Raises:
        ValueError: for a device type this package cannot synchronize (for example ``"hpu"``),
            rather than timing it wrongly.
    """
    if isinstance(devices, (str, int)) or hasattr(devices, "type"):
        devices = [devices]
    calls = []
    seen = set()
    for device in devices:
        kind, index = _device_type_and_index(device)
        if kind in ("cpu", "meta") or (kind, index) in seen:
            continue
        seen.add((kind, index))
        import torch  # imported here: the CPU path never needs it

        if kind == "cuda":
            target = torch.device("cuda", index) if index is not None else None
            calls.append(lambda target=target: torch.cuda.synchronize(target))
        elif kind == "xpu":
            target = torch.device("xpu", index) if index is not None else None
            calls.append(lambda target=target: torch.xpu.synchronize(target))
        elif kind == "mps":
            calls.append(torch.mps.synchronize)
        else:
            raise ValueError(f"cannot synchronize device type {kind!r}: expected cpu, cuda, xpu or mps")
    if not calls:
        return None
    if len(calls) == 1:
        return calls[0]

    def synchronize_all() -> None:
        for call in calls:
            call()

    return synchronize_all


class DeviceEvents:
    """CUDA timing events on one device's stream: the step boundaries of ``synchronize="events"``.

    :meth:`mark` records a ``torch.cuda.Event(enable_timing=True)`` on the stream (no host wait)
    and returns it; :func:`elapsed_ns` reads two completed events. Built by
    :func:`device_events_for`, once per request (or per continuous-batching manager).

    Attributes:
        stream: the stream the events are recorded on (the device's current stream when the
            request started, unless another is given).
        new_event: ``torch.cuda.Event`` (a test double replaces it there).
    """

    __slots__ = ("stream", "new_event")

    def __init__(self, stream: Any, new_event: Callable[..., Any]) -> None:
        self.stream = stream
        self.new_event = new_event

    def mark(self, stream: Any = None) -> Any:
        """Record a timing event on :attr:`stream` (or ``stream``) now and return it."""
        event = self.new_event(enable_timing=True)
        event.record(self.stream if stream is None else stream)
        return event

    def step_clock(self, events: List[Any], now: Callable[[], int]) -> Callable[[], int]:
        """A clock for the step hook: each call records an event (appended to ``events``) and
        then reads ``now`` (the host clock read the step keeps): one event record and one list
        append, no wait."""
        new_event, stream, append = self.new_event, self.stream, events.append

        def clock() -> int:
            event = new_event(enable_timing=True)
            event.record(stream)
            append(event)
            return now()

        return clock


#: why :func:`device_events_for` found no events, by devices: ``"cpu"`` (nothing to time on a
#: device), ``"mps"``/``"xpu"``/``"several devices"`` (not one CUDA device), ``"unavailable"``
#: (the CUDA event API failed)
NO_EVENTS_CPU = "cpu"
NO_EVENTS_NOT_ONE_CUDA_DEVICE = "not one CUDA device"
NO_EVENTS_UNAVAILABLE = "unavailable"


def device_events_for(devices: Any) -> Tuple[Optional[DeviceEvents], Optional[str], Optional[BaseException]]:
    """CUDA timing events for a model on ``devices`` (as :func:`synchronizer_for` takes them).

    Returns:
        ``(events, None, None)`` when every accelerator device is one CUDA device: events on that
        device's current stream. Otherwise ``(None, reason, error)``: ``reason`` is one of
        :data:`NO_EVENTS_CPU`, :data:`NO_EVENTS_NOT_ONE_CUDA_DEVICE`, :data:`NO_EVENTS_UNAVAILABLE`
        (then ``error`` is what the CUDA API raised). A CPU model never reaches ``torch``.
    """
    if isinstance(devices, (str, int)) or hasattr(devices, "type"):
        devices = [devices]
    found = set()
    for device in devices:
        kind, index = _device_type_and_index(device)
        if kind in ("cpu", "meta"):
            continue
        found.add((kind, index))
    if not found:
        return None, NO_EVENTS_CPU, None
    kinds = {kind for kind, _ in found}
    indices = {index for _, index in found}
    if kinds != {"cuda"} or len(indices - {None}) > 1:
        return None, NO_EVENTS_NOT_ONE_CUDA_DEVICE, None
    try:
        import torch

        index = next((i for i in indices if i is not None), None)
        target = torch.device("cuda", index) if index is not None else None
        return DeviceEvents(torch.cuda.current_stream(target), torch.cuda.Event), None, None
    except Exception as error:  # no CUDA driver, a build without CUDA: the events are unavailable
        return None, NO_EVENTS_UNAVAILABLE, error


def elapsed_ns(start: Any, end: Any) -> int:
    """Nanoseconds between two completed timing events (``start.elapsed_time(end)`` is in
    milliseconds, resolved to about half a microsecond), rounded to an integer."""
    return round(start.elapsed_time(end) * NS_PER_MS)


def timed_call(
    fn: Callable[[], T],
    synchronize: Optional[Synchronize],
    clock: Callable[[], float] = time.perf_counter,
) -> Tuple[T, float]:
    """Time one call of ``fn`` as completed device work.

    The order is fixed: synchronize, read ``clock``, call ``fn``, synchronize, read ``clock``
    (the pattern of Triton's ``do_bench``, with one synchronization on each side).

    Args:
        fn: the zero-argument call to time, e.g. ``lambda: model.generate(**inputs)``.
        synchronize: from :func:`synchronizer_for`; ``None`` on CPU.
        clock: a clock in seconds (``time.perf_counter`` by default).

    Returns:
        ``(result of fn, elapsed seconds)``.

    Raises:
        ValueError: when the elapsed time is not positive (a clock that did not advance cannot
            give an honest rate).
    """
    if synchronize is not None:
        synchronize()
    start = clock()
    result = fn()
    if synchronize is not None:
        synchronize()
    elapsed = clock() - start
    if not elapsed > 0:
        raise ValueError(f"elapsed time must be positive, got {elapsed!r} s: the clock did not advance")
    return result, elapsed


def devices_of(model: Any) -> Iterable[Any]:
    """The devices a transformers model runs on: every device of ``hf_device_map`` plus ``model.device``."""
    found = []
    device_map = getattr(model, "hf_device_map", None)
    if isinstance(device_map, dict):
        for value in device_map.values():
            if isinstance(value, int):
                found.append(value)
            elif isinstance(value, str) and value not in ("disk",):
                found.append(value)
    device = model_device(model)
    if device is not None:
        found.append(device)
    return found


_device_names: dict = {}


def device_name(device: Any) -> str:
    """``str(device)`` (``"cpu"``, ``"cuda:0"``), remembered per device (``str`` of a
    ``torch.device`` costs more than the dictionary lookup)."""
    key = (type(device), device)  # (True, 1 and 1.0 are equal keys with different names)
    try:
        name = _device_names.get(key)
    except TypeError:  # unhashable
        return str(device)
    if name is None:
        name = str(device)
        if len(_device_names) < 64:
            _device_names[key] = name
    return name


def model_device(model: Any) -> Any:
    """``model.device`` (transformers' property: the device of its first parameter), or ``None``
    where the model has none."""
    return getattr(model, "device", None)
