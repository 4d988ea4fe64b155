"""``otel-generate bench --serve`` over HTTP: the OTLP sink, a ``transformers serve`` process, and the
load generator that streams requests to it (see :mod:`otel_generate.bench.serve` for the procedure).

* :class:`Sink`: :mod:`otel_generate.bench.sink` in a process of its own, which every server exports to;
* :func:`server_command`, :func:`server_environment`, :class:`Server`: ``opentelemetry-instrument
  transformers serve MODEL`` in a session of its own, plain or instrumented; its model's process found
  among its children;
* :class:`HttpDriver`: asyncio and httpx, one task per streamed ``/v1/completions`` request: a closed
  loop of ``--concurrency`` in flight, or Poisson arrivals.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from otel_generate.bench.config import BenchConfig
from otel_generate.bench.load import DRAIN_TIMEOUT_S, WARMUP_TIMEOUT_S, Level, Record, schedule
from otel_generate.bench.procstat import children, command_line

#: One request's HTTP timeout (a queued request of the one-at-a-time runner waits for those before it), seconds.
REQUEST_TIMEOUT_S = 300.0
#: This package's entry point name in ``opentelemetry_instrumentor``.
OWN_INSTRUMENTATION = "transformers_generate"
#: Pages of a continuous-batching cache (transformers' default page size).
PAGE_TOKENS = 256
#: The load generator closes a connection idle this long (seconds), before the server would (uvicorn: 5 s).
KEEPALIVE_EXPIRY_S = 2.0
#: How long a server may take to start (load its model and answer ``/health``), seconds.
START_TIMEOUT_S = 600.0


def executable(name: str) -> Optional[str]:
    """``name`` next to this interpreter (its virtual environment's ``bin``), else on ``PATH``."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    return shutil.which(name)


def cache_sizes(config: BenchConfig) -> Dict[str, int]:
    """The continuous-batching cache of every round: pages of :data:`PAGE_TOKENS` for four times
    ``--concurrency`` requests (Poisson bursts queue beyond it) plus 4, and at least 256 tokens a step,
    or twice every in-flight prompt at once."""
    pages = 4 * config.concurrency * math.ceil((config.prompt_tokens + config.new_tokens) / PAGE_TOKENS) + 4
    return {"num_blocks": pages, "max_batch_tokens": max(256, 2 * config.concurrency * config.prompt_tokens)}


class Sink:
    """The OTLP/HTTP sink (:mod:`otel_generate.bench.sink`) in a process of its own."""

    def __init__(self, log_path: str) -> None:
        self.log = open(log_path, "w", encoding="utf-8")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "otel_generate.bench.sink"],
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        line = self.process.stdout.readline()
        try:
            self.port = int(json.loads(line)["port"])
        except (ValueError, KeyError, TypeError):
            self.stop()
            raise RuntimeError(f"the OTLP sink did not start: {line!r}") from None
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def stats(self) -> Dict[str, Any]:
        with urllib.request.urlopen(f"{self.endpoint}/stats", timeout=30) as response:
            return json.load(response)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def instrumentations() -> List[str]:
    """The names of every OpenTelemetry instrumentation installed (``opentelemetry_instrumentor`` entry points)."""
    from importlib.metadata import entry_points

    found = entry_points()
    group = (
        found.select(group="opentelemetry_instrumentor")
        if hasattr(found, "select")
        else found.get("opentelemetry_instrumentor", [])
    )
    return sorted({entry.name for entry in group})


def server_environment(config: BenchConfig, side: str, sink: str) -> Dict[str, str]:
    """The environment of a server: this one without its ``OTEL_*`` settings (``OTEL_GENERATE_*`` kept),
    OTLP/HTTP to ``sink``, the ``process`` resource detector, every instrumentation disabled but, on the
    instrumented side, this package's; the instrumentation's options from the bench's; torch's threads."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") or k.startswith("OTEL_GENERATE_")}
    others = [name for name in instrumentations() if name != OWN_INSTRUMENTATION]
    disabled = others + ([OWN_INSTRUMENTATION] if side == "plain" else [])
    env.update(
        OTEL_SERVICE_NAME="otel-generate-bench-serve",
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_METRICS_EXPORTER="otlp",
        OTEL_LOGS_EXPORTER="none",
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_EXPORTER_OTLP_ENDPOINT=sink,
        OTEL_EXPERIMENTAL_RESOURCE_DETECTORS="otel,process",
        OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=",".join(disabled),
        OMP_NUM_THREADS=str(config.threads),
        MKL_NUM_THREADS=str(config.threads),
        PYTHONUNBUFFERED="1",
    )
    if config.max_step_spans is not None:
        env["OTEL_GENERATE_MAX_STEP_SPANS"] = str(config.max_step_spans)
    if config.step_spans is not None:
        env["OTEL_GENERATE_STEP_SPANS"] = config.step_spans
    if config.background_emission is not None:
        env["OTEL_GENERATE_BACKGROUND_EMISSION"] = "true" if config.background_emission else "false"
    if config.sampler == "always_off":
        env["OTEL_TRACES_SAMPLER"] = "always_off"
    return env


def server_command(config: BenchConfig, model_path: str, port: int, device: str) -> List[str]:
    """``opentelemetry-instrument transformers serve MODEL`` on 127.0.0.1:``port`` and ``device`` (``cpu`` or
    ``cuda``), in ``--dtype``; with ``--continuous-batching`` its cache of :func:`cache_sizes`."""
    command = [executable("opentelemetry-instrument") or "opentelemetry-instrument"]
    command += [executable("transformers") or "transformers", "serve", model_path]
    command += ["--host", "127.0.0.1", "--port", str(port), "--device", device, "--dtype", config.dtype]
    command += ["--log-level", "warning"]
    if config.continuous_batching:
        sizes = cache_sizes(config)
        command += ["--continuous-batching", "--cb-num-blocks", str(sizes["num_blocks"])]
        command += ["--cb-max-batch-tokens", str(sizes["max_batch_tokens"])]
    return command


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def log_tail(path: str, limit: int = 3000) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()[-limit:]
    except OSError:
        return ""


class Server:
    """One ``transformers serve`` process (its own session, so that it and its children can be stopped)."""

    def __init__(self, command: List[str], env: Dict[str, str], log_path: str) -> None:
        self.command, self.env, self.log_path = command, env, log_path
        self.process: Optional[subprocess.Popen] = None
        self.base_url = ""

    def start(self, port: int, timeout_s: float = START_TIMEOUT_S) -> float:
        """Start it and wait until ``/health`` answers 200 (the model is loaded); the seconds it took."""
        started = time.monotonic()
        with open(self.log_path, "w", encoding="utf-8") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        self.base_url = f"http://127.0.0.1:{port}"
        while time.monotonic() - started < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the server exited with status {self.process.returncode} while starting: {log_tail(self.log_path)}"
                )
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as response:
                    if response.status == 200:
                        return time.monotonic() - started
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.2)
        raise RuntimeError(f"the server did not answer /health within {timeout_s:.0f} s: {log_tail(self.log_path)}")

    def model_pid(self) -> int:
        """The model's process: from transformers 5.25 a spawned child of the server, before it the server."""
        pid = self.process.pid
        for child in children(pid):
            if any("spawn_main" in part for part in command_line(child)):
                return child
        return pid

    def stop(self, timeout_s: float = 60.0) -> Optional[int]:
        """SIGTERM (the model's process flushes its telemetry on the way out), then SIGKILL to the whole
        session after ``timeout_s``; the exit status."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(process.pid, signal.SIGKILL)  # what is left of its session (the model's process)
        except (ProcessLookupError, PermissionError):
            pass
        if process.poll() is None:
            process.wait()
        return process.returncode


# --------------------------------------------------------------------------------------------
# The HTTP load generator
# --------------------------------------------------------------------------------------------


class HttpDriver:
    """Streams ``/v1/completions`` requests to a server: a closed loop of N in flight, or Poisson arrivals.

    ``bodies``: the JSON bodies the requests cycle through; ``snapshot()``: the CPU readings at the
    window's edges (:func:`otel_generate.bench.load.window_figures`'s ``cpu``).

    A streamed token's time is when the chunk holding it arrived. transformers serve joins the texts of a
    stream that fell behind into one chunk, so a chunk may hold several tokens (their gaps are then 0):
    with ``one_character_tokens`` (the bench's own tokenizer, :func:`otel_generate.bench.models.build_tokenizer`)
    a chunk of N characters is N tokens; otherwise (``--model``'s tokenizer) each chunk counts as one.
    """

    def __init__(
        self,
        base_url: str,
        bodies: Sequence[bytes],
        snapshot: Callable[[], Dict[str, Optional[float]]],
        one_character_tokens: bool,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.base_url, self.bodies, self.snapshot, self.clock = base_url, list(bodies), snapshot, clock
        self.one_character_tokens = one_character_tokens
        self.sent = 0

    def window(
        self,
        level: Level,
        concurrency: int,
        warmup: int,
        seconds: float,
        lead_in: float,
        arrivals: Sequence[float],
    ) -> Tuple[List[Record], float, float, Dict[str, Tuple[Optional[float], Optional[float]]], int]:
        """Warm up and measure one window; ``(records, start, end, cpu, warmup requests)``: every request
        sent, the warmup's first (sent before ``start``, they have no part in the window's figures)."""
        return asyncio.run(self._window(level, concurrency, warmup, seconds, lead_in, arrivals))

    async def _window(self, level, concurrency, warmup, seconds, lead_in, arrivals):
        import httpx

        # idle connections closed before the server's keep-alive (uvicorn: 5 s, as httpx's default) ends them:
        # with equal timeouts a request can go out on a connection the server is closing (a ReadError)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=KEEPALIVE_EXPIRY_S)
        timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0)
        async with httpx.AsyncClient(base_url=self.base_url, limits=limits, timeout=timeout) as client:
            records: List[Record] = []
            marks: Dict[str, Any] = {}
            if level.kind == "saturation":
                await self._closed(client, records, concurrency, warmup, seconds, marks)
                warmed = sum(1 for r in records if r.sent < marks["start"])
            else:
                await self._closed(client, records, concurrency, warmup, None, marks)
                warmed = len(records)
                marks.clear()
                await self._open(client, records, arrivals, lead_in, seconds, marks)
        cpu = {name: (marks["cpu_start"].get(name), marks["cpu_end"].get(name)) for name in marks["cpu_start"]}
        return records, marks["start"], marks["end"], cpu, warmed

    def _mark(self, marks: Dict[str, Any], edge: str, measured: bool = True) -> None:
        """The time of a window's ``edge`` and, when it is ``measured`` (not the end of a warmup), the CPU readings."""
        marks[edge] = self.clock()
        if measured:
            marks[f"cpu_{edge}"] = self.snapshot()

    async def _closed(self, client, records, concurrency, warmup, seconds, marks) -> None:
        """``concurrency`` requests always in flight; the window starts once ``warmup`` have finished and
        lasts ``seconds`` (``None``: stop at the warmup); then the ones in flight are drained."""
        if warmup == 0 and seconds is None:
            return  # no warmup, no window: nothing to send
        started = asyncio.Event()
        state = {"done": 0, "stop": False}
        if warmup == 0:
            self._mark(marks, "start", seconds is not None)
            started.set()

        async def worker() -> None:
            while not state["stop"]:
                record = Record(sent=self.clock())
                records.append(record)
                await self._one(client, record)
                state["done"] += 1
                if record.error is not None:
                    await asyncio.sleep(0.1)  # a failing server: no busy loop
                if not started.is_set() and state["done"] >= warmup:
                    self._mark(marks, "start", seconds is not None)
                    started.set()

        workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
        try:
            await asyncio.wait_for(started.wait(), WARMUP_TIMEOUT_S)
        except asyncio.TimeoutError:
            state["stop"] = True
            await _cancel(workers)
            raise RuntimeError(f"{warmup} warmup requests did not finish within {WARMUP_TIMEOUT_S:.0f} s") from None
        if seconds is not None:
            await asyncio.sleep(max(0.0, marks["start"] + seconds - self.clock()))
            self._mark(marks, "end")
        state["stop"] = True
        await _drain(workers)

    async def _open(self, client, records, arrivals, lead_in, seconds, marks) -> None:
        """Poisson arrivals (times from the window's start, from ``-lead_in``), each request a task of its own."""
        base = self.clock() + lead_in
        tasks = []
        for at, what in schedule(arrivals, seconds):
            delay = base + at - self.clock()
            if delay > 0:
                await asyncio.sleep(delay)
            if what == "send":
                record = Record(sent=self.clock())
                records.append(record)
                tasks.append(asyncio.create_task(self._one(client, record)))
            else:
                self._mark(marks, what)
        await _drain(tasks)

    async def _one(self, client, record: Record) -> None:
        """One streamed request: each chunk with text is a token, the usage chunk says how many were generated."""
        import httpx

        body = self.bodies[self.sent % len(self.bodies)]
        self.sent += 1
        clock = self.clock
        try:
            async with client.stream(
                "POST", "/v1/completions", content=body, headers={"Content-Type": "application/json"}
            ) as response:
                if response.status_code != 200:
                    text = (await response.aread())[:300]
                    record.error = f"HTTP {response.status_code}: {text.decode('utf-8', 'replace')}"
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    now = clock()
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        record.error = f"stream error: {str(chunk['error'])[:300]}"
                        return
                    usage = chunk.get("usage")
                    if usage:
                        record.tokens = usage.get("completion_tokens")
                    for choice in chunk.get("choices") or ():
                        text = choice.get("text")
                        if text:
                            record.token_times.extend([now] * (len(text) if self.one_character_tokens else 1))
            record.finished = clock()
        except (httpx.HTTPError, ValueError) as fault:
            record.error = f"{type(fault).__name__}: {fault or repr(fault.__cause__ or fault.__context__)}"[:300]


async def _cancel(tasks: Sequence["asyncio.Task"]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _drain(tasks: Sequence["asyncio.Task"]) -> None:
    """Wait for ``tasks`` at most :data:`DRAIN_TIMEOUT_S`; cancel the rest (their requests stay unfinished)."""
    if not tasks:
        return
    _done, pending = await asyncio.wait(tasks, timeout=DRAIN_TIMEOUT_S)
    await _cancel(list(pending))


def request_bodies(config: BenchConfig, texts: Sequence[str], eos: Optional[int]) -> List[bytes]:
    """The requests' JSON: greedy, streaming with the usage chunk, ``--new-tokens`` tokens, EOS as
    :func:`eos_override` says (through transformers serve's ``generation_config``)."""
    bodies = []
    for text in texts:
        body: Dict[str, Any] = {
            "prompt": text,
            "max_tokens": config.new_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if eos is not None:
            body["generation_config"] = json.dumps({"eos_token_id": eos})
        bodies.append(json.dumps(body).encode())
    return bodies
