"""Test doubles for a CUDA device on a machine without one: timing events that log every call, and
NVML's energy counter. Imports neither ``torch`` nor ``transformers``; :func:`install_events` and
:func:`install_nvml` patch ``torch.cuda`` and ``sys.modules`` through pytest's ``monkeypatch``.

* :class:`FakeEvents`: ``torch.cuda.Event`` and ``torch.cuda.current_stream``. Each event takes a
  device time when it is recorded: the host clock since the double was made, times
  :attr:`FakeEvents.scale` (0.5: the device needs half the host's interval, so a device time always
  lies inside the host's), in whole half-microseconds as CUDA reports them. Every ``record``,
  ``query``, ``synchronize`` and ``elapsed_time`` call is logged in order with its events and
  thread (:attr:`FakeEvents.calls`); ``torch.cuda.synchronize`` too (``device synchronize``).
* :class:`FakeNVML`: the ``pynvml`` module of ``nvidia-ml-py`` as the package uses it. Read ``k``
  of the energy counter returns the start value plus the first ``k`` increments (known amounts);
  every read is logged with its value and thread.
"""

from __future__ import annotations

import threading
import time
import types
from typing import Any, Callable, List, NamedTuple, Optional, Sequence


class Call(NamedTuple):
    """One logged call: its name, the ids of the events it touched (recording order), its thread."""

    name: str
    events: tuple
    thread: threading.Thread


class FakeStream:
    """A stream object (only its identity matters)."""

    def __init__(self, device: Any) -> None:
        self.device = device


class FakeEvents:
    """``torch.cuda.Event`` / ``current_stream`` / ``synchronize`` of one fake CUDA device.

    Attributes:
        calls: every call, in order (:class:`Call`).
        events: every event made, in order (an event's ``id`` is its index here).
        stream: what ``torch.cuda.current_stream(device)`` returns.
        pending_queries: how many ``query()`` calls answer ``False`` before every event reports
            completion (the device still running the last steps; events complete in order).
    """

    def __init__(self, scale: float = 0.5, pending_queries: int = 0) -> None:
        self.calls: List[Call] = []
        self.events: List[Any] = []
        self.stream = FakeStream("cuda:0")
        self.scale = scale
        self.pending_queries = pending_queries
        self.queries = 0
        self._t0 = time.perf_counter_ns()
        self._lock = threading.Lock()
        fake = self

        class Event:
            def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
                with fake._lock:
                    self.id = len(fake.events)
                    fake.events.append(self)
                self.enable_timing = enable_timing
                self.device_ms: Optional[float] = None
                self.stream: Any = None

            def record(self, stream: Any = None) -> None:
                self.device_ms = fake.device_now_ms()
                self.stream = stream
                fake.log("record", self)

            def query(self) -> bool:
                fake.log("query", self)
                with fake._lock:
                    fake.queries += 1
                    return fake.queries > fake.pending_queries

            def synchronize(self) -> None:
                fake.log("synchronize", self)

            def elapsed_time(self, end: "Event") -> float:
                fake.log("elapsed_time", self, end)
                if not (self.enable_timing and end.enable_timing):
                    raise RuntimeError("both events must be created with enable_timing=True")
                return end.device_ms - self.device_ms

        self.Event = Event

    def device_now_ms(self) -> float:
        """Device time now, milliseconds, in whole half-microseconds."""
        half_us = round((time.perf_counter_ns() - self._t0) * self.scale / 500)
        return half_us * 500 / 1e6

    def log(self, name: str, *events: Any) -> None:
        with self._lock:
            self.calls.append(Call(name, tuple(event.id for event in events), threading.current_thread()))

    def names(self) -> List[str]:
        return [call.name for call in self.calls]

    def expected_ns(self, start: Any, end: Any) -> int:
        """What the instrumentation must report between two events: their elapsed time, nanoseconds."""
        return round((end.device_ms - start.device_ms) * 1e6)


def install_events(monkeypatch: Any, fake: FakeEvents, devices: Sequence[str] = ("cuda:0",)) -> FakeEvents:
    """Make the instrumentation see a model on ``devices`` and time it with ``fake``'s events;
    ``torch.cuda.synchronize`` is logged (``device synchronize``) and does nothing."""
    import torch

    from otel_generate import clock

    monkeypatch.setattr(clock, "devices_of", lambda model: list(devices))
    monkeypatch.setattr(torch.cuda, "Event", fake.Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: fake.stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: fake.calls.append(_device_sync()))
    return fake


def _device_sync() -> Call:
    return Call("device synchronize", (), threading.current_thread())


class NVMLError(Exception):
    """``pynvml.NVMLError``."""


class FakeNVML(types.ModuleType):
    """``pynvml``: ``nvmlInit``, ``nvmlDeviceGetHandleByUUID``, ``nvmlDeviceGetTotalEnergyConsumption``.

    Args:
        increments: ``increments(k)`` is how much the counter advances after read ``k`` (millijoules).
        start_mj: the counter's first value.
        fail_init: ``nvmlInit`` raises.
        fail_read_after: reads after this many raise (``None``: never).
    """

    NVMLError = NVMLError

    def __init__(
        self,
        increments: Callable[[int], int] = lambda k: 1000 + 37 * k,
        start_mj: int = 5_000_000,
        fail_init: bool = False,
        fail_read_after: Optional[int] = None,
    ) -> None:
        super().__init__("pynvml")
        self.increments = increments
        self.value = start_mj
        self.fail_init = fail_init
        self.fail_read_after = fail_read_after
        self.reads: List[tuple] = []  # (value returned, thread)
        self.uuids: List[str] = []
        self._lock = threading.Lock()

    def nvmlInit(self) -> None:  # noqa: N802 (NVML's names)
        if self.fail_init:
            raise NVMLError("Driver Not Loaded")

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:  # noqa: N802
        self.uuids.append(uuid)
        return f"handle:{uuid}"

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: str) -> int:  # noqa: N802
        with self._lock:
            if self.fail_read_after is not None and len(self.reads) >= self.fail_read_after:
                raise NVMLError("Unknown Error")
            value = self.value
            self.value += self.increments(len(self.reads))
            self.reads.append((value, threading.current_thread()))
            return value

    def values(self) -> List[int]:
        return [value for value, _ in self.reads]


def install_nvml(
    monkeypatch: Any, nvml: Optional[FakeNVML], uuid: str = "0e6b1b2c-aaaa-bbbb-cccc-000000000000"
) -> None:
    """``import pynvml`` gives ``nvml`` (``None``: not installed), CUDA device properties carry
    ``uuid``, and the package's NVML state starts afresh (again when the test ends)."""
    import sys

    import torch

    from otel_generate import energy

    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(uuid=uuid))
    # (both restored when the test ends: a later test sees the package's NVML state as it was)
    monkeypatch.setattr(energy, "_nvml", energy._UNTRIED)
    monkeypatch.setattr(energy, "_meters", {})
