"""One round of ``otel-generate bench --serve --in-process``, in a process of its own.

Run as ``python -m otel_generate.bench.serve_child`` by :mod:`otel_generate.bench.serve`, with the
round's settings as JSON on stdin; it prints the round's result as one JSON line on stdout (its log
goes to stderr). A fresh process per round: the instrumentation cannot be taken out of a process
cleanly once its hooks ran, and each round then starts alike.

The round: the SDK providers (a ``TracerProvider`` with a ``BatchSpanProcessor`` and the
``--exporter``, a ``MeterProvider``; :class:`otel_generate.bench.common.InstrumentedSide`) on both
sides and, on the instrumented side, ``GenerateInstrumentor().instrument()`` with them, before the
model is loaded; the checkpoint loaded on the device; one ``ContinuousBatchingManager`` set up as
``transformers serve --continuous-batching`` sets up its own (the cache of the round's settings,
per-request logits processors, ``warmup()``, ``start()``). Then :class:`ManagerDriver` offers the
load: ``add_request(..., streaming=True)`` from this process's main thread (arrivals) or from the
thread that reads the outputs (closed loop: a new request the moment one finishes), the outputs read
by that one thread with ``get_result``, each new token timed when it is read. After the window and the
drain, the manager stops, the providers are flushed (which drains the background emitter first), and
the instrumentation's own counters are read back from the metric reader: the requests it recorded
(``gen_ai.server.request.duration``'s count) and those its emitter dropped
(``generate.emitter.dropped_requests``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from otel_generate.attributes import METRIC_EMITTER_DROPPED, METRIC_REQUEST_DURATION
from otel_generate.bench.load import DRAIN_TIMEOUT_S, DROP_LINE, WARMUP_TIMEOUT_S, Record, schedule, window_figures
from otel_generate.bench.procstat import find_thread, process_cpu_s, thread_cpu_s


class ManagerDriver:
    """The serving load, offered to a running ``ContinuousBatchingManager`` (see the module docstring)."""

    def __init__(
        self,
        manager: Any,
        prompts: Sequence[Sequence[int]],
        new_tokens: int,
        eos: Optional[int],
        snapshot: Callable[["ManagerDriver"], Dict[str, Optional[float]]],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.manager, self.prompts, self.new_tokens, self.eos = manager, [list(p) for p in prompts], new_tokens, eos
        self.snapshot, self.clock = snapshot, clock
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.live: Dict[str, Record] = {}
        self.records: List[Record] = []
        self.sent = 0
        self.finished = 0
        self.refill = False
        self.warmup_target: Optional[int] = None
        self.measuring = False  # the closed loop's start is a window's, not a warmup's end
        self.started = threading.Event()
        self.marks: Dict[str, Any] = {}
        self.fault: Optional[str] = None
        self.stopping = False
        self.main_tid = threading.get_native_id()
        self.consumer = threading.Thread(target=self._consume, name="bench-outputs", daemon=True)
        self.consumer.start()

    def submit(self) -> None:
        with self.lock:
            number = self.sent
            self.sent += 1
            request_id = f"bench-{number}"
            record = Record(sent=self.clock())
            self.live[request_id] = record
            self.records.append(record)
        self.manager.add_request(
            self.prompts[number % len(self.prompts)],
            request_id=request_id,
            max_new_tokens=self.new_tokens,
            streaming=True,
            eos_token_id=self.eos,
        )

    def _mark(self, edge: str) -> None:
        """The time of a window's ``edge`` and, unless it ends a warmup, the CPU readings."""
        self.marks[edge] = self.clock()
        if self.measuring:
            self.marks[f"cpu_{edge}"] = self.snapshot(self)

    def _consume(self) -> None:
        while not self.stopping:
            output = self.manager.get_result(timeout=0.1)
            if output is None:
                if not self.manager.is_running():
                    self.fault = "the continuous-batching manager stopped"
                    with self.idle:
                        self.idle.notify_all()
                    self.started.set()
                    return
                continue
            now = self.clock()
            refill = False
            with self.lock:
                record = self.live.get(output.request_id)
                if record is None:  # cancelled after the drain
                    continue
                count = len(output.generated_tokens)
                if count > len(record.token_times):
                    record.token_times.extend([now] * (count - len(record.token_times)))
                if output.is_finished():
                    record.finished, record.tokens = now, count
                    if output.error is not None:
                        record.error = str(output.error)[:300]
                    del self.live[output.request_id]
                    self.finished += 1
                    refill = self.refill
                    if self.warmup_target is not None and not self.started.is_set():
                        if self.finished >= self.warmup_target:
                            self._mark("start")
                            self.started.set()
                    self.idle.notify_all()
            if refill:
                self.submit()

    def _drain(self) -> None:
        """Wait for the requests in flight at most :data:`DRAIN_TIMEOUT_S`; cancel the rest (unfinished)."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        with self.idle:
            while self.live and self.fault is None and time.monotonic() < deadline:
                self.idle.wait(max(0.0, deadline - time.monotonic()))
            left = list(self.live)
            self.live.clear()
        for request_id in left:
            self.manager.cancel_request(request_id)

    def _closed(self, concurrency: int, warmup: int, seconds: Optional[float]) -> None:
        """As :meth:`otel_generate.bench.serve_http.HttpDriver._closed`."""
        if warmup == 0 and seconds is None:
            return  # no warmup, no window: nothing to send
        self.marks.clear()
        self.started.clear()
        self.measuring = seconds is not None
        with self.lock:
            self.finished = 0
            self.warmup_target = warmup
            self.refill = True
        if warmup == 0:
            self._mark("start")
            self.started.set()
        for _ in range(concurrency):
            self.submit()
        if not self.started.wait(WARMUP_TIMEOUT_S):
            self.fault = f"{warmup} warmup requests did not finish within {WARMUP_TIMEOUT_S:.0f} s"
        if self.fault is None and seconds is not None:
            time.sleep(max(0.0, self.marks["start"] + seconds - self.clock()))
            self._mark("end")
        with self.lock:
            self.refill = False
            self.warmup_target = None
        self._drain()
        if self.fault is not None:
            raise RuntimeError(self.fault)

    def window(
        self, level: str, concurrency: int, warmup: int, seconds: float, lead_in: float, arrivals: Sequence[float]
    ) -> Tuple[List[Record], float, float, Dict[str, Tuple[Optional[float], Optional[float]]], int]:
        """As :meth:`otel_generate.bench.serve_http.HttpDriver.window`."""
        if level == "saturation":
            self._closed(concurrency, warmup, seconds)
            warmed = sum(1 for r in self.records if r.sent < self.marks["start"])
        else:
            self._closed(concurrency, warmup, None)
            warmed = len(self.records)
            self.marks.clear()
            self.measuring = True
            base = self.clock() + lead_in
            for at, what in schedule(arrivals, seconds):
                delay = base + at - self.clock()
                if delay > 0:
                    time.sleep(delay)
                if what == "send":
                    self.submit()
                else:
                    self._mark(what)
            self._drain()
            if self.fault is not None:
                raise RuntimeError(self.fault)
        marks = self.marks
        cpu = {name: (marks["cpu_start"].get(name), marks["cpu_end"].get(name)) for name in marks["cpu_start"]}
        return list(self.records), marks["start"], marks["end"], cpu, warmed

    def close(self) -> None:
        self.stopping = True
        self.consumer.join(timeout=5)


def metric_totals(data: Any) -> Tuple[Optional[int], Optional[int]]:
    """``(requests dropped by the emitter, requests recorded)`` in the SDK's collected metrics (``None``: none)."""
    if data is None:
        return None, None
    dropped = 0
    recorded = 0
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == METRIC_EMITTER_DROPPED:
                    dropped += sum(int(point.value) for point in metric.data.data_points)
                elif metric.name == METRIC_REQUEST_DURATION:
                    recorded += sum(int(point.count) for point in metric.data.data_points)
    return dropped, recorded


class _DropLines(logging.Handler):
    """Counts the requests the emitter's warnings say it dropped."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.count += sum(int(n) for n in DROP_LINE.findall(record.getMessage()))
        except Exception:  # pragma: no cover - a log line never breaks the round
            pass


def run_round(spec: Dict[str, Any]) -> Dict[str, Any]:
    import torch

    from otel_generate._faults import LOGGER_NAME
    from otel_generate.bench.common import InstrumentedSide
    from otel_generate.bench.config import BenchConfig, torch_dtype
    from otel_generate.bench.models import load_model

    began = time.monotonic()
    torch.set_num_threads(spec["threads"])
    drops = _DropLines()
    logging.getLogger(LOGGER_NAME).addHandler(drops)
    instrumented = bool(spec["instrumented"])
    side = InstrumentedSide(
        BenchConfig(
            exporter=spec["exporter"],
            max_step_spans=spec["max_step_spans"],
            step_spans=spec["step_spans"],
            background_emission=spec["background_emission"],
            sampler=spec["sampler"],
        ),
        time.perf_counter,
        once=instrumented,  # once: instrument() now, kept for the round; otherwise the providers only
    )
    from transformers import ContinuousBatchingConfig

    model, _tokenizer = load_model(spec["model_dir"], dtype=torch_dtype(spec["dtype"]))
    model = model.to(spec["device"])
    cache = ContinuousBatchingConfig(**spec["cache"])
    cache.per_request_processors = True  # as transformers serve sets it
    manager = model.init_continuous_batching(continuous_batching_config=cache)
    if callable(getattr(manager, "warmup", None)):  # transformers serve warms its manager up (5.25)
        manager.warmup()
    manager.start()
    pid = os.getpid()
    emitter: Dict[str, Optional[int]] = {"tid": None}

    def snapshot(driver: ManagerDriver) -> Dict[str, Optional[float]]:
        if instrumented and emitter["tid"] is None:
            emitter["tid"] = find_thread(pid)
        tid = emitter["tid"]
        loaders = [thread_cpu_s(pid, driver.main_tid), thread_cpu_s(pid, driver.consumer.native_id)]
        return {
            "process": process_cpu_s(pid),
            "emitter": thread_cpu_s(pid, tid) if tid is not None else None,
            "server": None,
            "client": None if None in loaders else sum(loaders),
        }

    driver = ManagerDriver(manager, spec["prompts"], spec["new_tokens"], spec["eos"], snapshot)
    startup_s = time.monotonic() - began
    try:
        records, start, end, cpu, warmed = driver.window(
            spec["level"], spec["concurrency"], spec["warmup"], spec["seconds"], spec["lead_in"], spec["arrivals"]
        )
    finally:
        driver.close()
        manager.stop(block=True, timeout=60)
    side.tracer_provider.force_flush()
    side.meter_provider.force_flush()
    reader = side.metric_reader
    data = reader.get_metrics_data() if hasattr(reader, "get_metrics_data") else getattr(reader.exporter, "last", None)
    dropped, recorded = metric_totals(data) if instrumented else (None, None)
    finished = [r.tokens for r in records if r.finished is not None and r.error is None and r.tokens is not None]
    result = {
        "figures": window_figures(records, start, end, spec["new_tokens"], cpu),
        "requests_total": len(records),
        "warmup_requests": warmed,
        "startup_s": startup_s,
        "exit_status": 0,
        "server_pid": None,
        "model_pid": pid,
        "emitter_thread": emitter["tid"],
        "dropped_requests": dropped,
        "dropped_requests_logged": drops.count,
        "requests_recorded": recorded,
        "spans_received": side.exporter.spans,
        "spans_expected": side.spans_expected(finished) if instrumented else 0,
    }
    side.shutdown()
    return result


def main() -> int:
    spec = json.load(sys.stdin)
    result = run_round(spec)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
