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
    device_map = _instance_attribute(model, "hf_device_map")
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


#: ``transformers``' ``ModuleUtilsMixin.device`` (5.x), whose value :func:`model_device` reads
#: without its generators: the device of the model's first parameter.
_FIRST_PARAMETER_DEVICE = """
@property
def device(self: "PreTrainedModel") -> torch.device:
    return next(param.device for param in self.parameters())
"""
_device_readers: dict = {}  # model class -> whether model_device may walk its modules itself


def model_device(model: Any) -> Any:
    """``getattr(model, "device", None)``: where the model's ``device`` is transformers' own
    (:data:`_FIRST_PARAMETER_DEVICE`: the first of ``model.parameters()``) and the module methods
    that order the parameters are ``torch.nn.Module``'s, the first parameter is found by walking
    the modules in the order ``named_modules()`` visits them (about a tenth of the cost);
    otherwise, and for a model with no parameter, the attribute itself."""
    cls = type(model)
    walk = _device_readers.get(cls)
    if walk is None:
        walk = _device_readers[cls] = _reads_first_parameter(cls)
    if walk:
        parameter = _first_parameter(model)
        if parameter is not None:
            return parameter.device
    return getattr(model, "device", None)


def _reads_first_parameter(cls: type) -> bool:
    try:
        import inspect

        import torch

        from otel_generate._source import same_code

        module = torch.nn.Module
        device = inspect.getattr_static(cls, "device", None)
        return (
            isinstance(device, property)
            and same_code(device.fget, _FIRST_PARAMETER_DEVICE)
            and all(
                getattr(cls, name) is getattr(module, name)
                for name in ("parameters", "named_parameters", "_named_members", "named_modules")
            )
        )
    except Exception:  # not a torch module, no source, another layout: the attribute itself
        return False


def _first_parameter(model: Any) -> Any:
    """The first of ``model.parameters()``, or ``None`` where that cannot be told without calling
    it (a module on the way overrides ``named_modules``) or there is none."""
    named_modules = _module_named_modules()
    stack = [model]
    seen = set()
    while stack:
        module = stack.pop()
        if module is None or module in seen:  # (a None child; named_modules' memo: a shared module once)
            continue
        seen.add(module)
        if type(module).named_modules is not named_modules:
            return None
        for value in module._parameters.values():
            if value is not None:
                return value
        children = list(module._modules.values())
        children.reverse()
        stack += children
    return None


def _module_named_modules() -> Any:
    global _named_modules
    if _named_modules is None:
        import torch

        _named_modules = torch.nn.Module.named_modules
    return _named_modules


_named_modules: Any = None


def _instance_attribute(model: Any, name: str) -> Any:
    """``getattr(model, name, None)``; for a ``torch.nn.Module`` whose class has no such attribute
    and no ``__getattr__`` of its own, read from the instance's own dictionaries (a failed lookup
    through ``Module.__getattr__`` raises and catches an ``AttributeError``)."""
    state = getattr(model, "__dict__", None)
    cls = type(model)
    if state is not None and "_parameters" in state and "_modules" in state and "_buffers" in state:
        key = (cls, name)
        plain = _plain_attributes.get(key)
        if plain is None:
            plain = _plain_attributes[key] = _is_plain_attribute(cls, name)
        if plain:
            for where in (state, state["_parameters"], state["_buffers"], state["_modules"]):
                if name in where:
                    return where[name]
            return None
    return getattr(model, name, None)


_plain_attributes: dict = {}  # (module class, name) -> whether _instance_attribute may read the dictionaries


def _is_plain_attribute(cls: type, name: str) -> bool:
    try:
        import inspect

        import torch

        return (
            inspect.getattr_static(cls, name, _MISSING) is _MISSING
            and inspect.getattr_static(cls, "__getattr__", None) is torch.nn.Module.__getattr__
            and cls.__getattribute__ is object.__getattribute__
        )
    except Exception:
        return False


_MISSING = object()
