"""``otel-generate bench --serve``: what the instrumentation costs a server under load.

Two variants, one procedure:

* **HTTP** (``--serve``): ``transformers serve`` with a local model (``--continuous-batching``:
  continuous batching; without it, transformers' one-request-at-a-time ``generate()`` runner) under
  ``opentelemetry-instrument``, driven over HTTP by an open-loop load generator in this process
  (asyncio and httpx: streaming ``/v1/completions`` requests, one task per request);
* **in-process** (``--serve --in-process``): the same load, as ``add_request`` calls and streamed
  outputs, into one ``ContinuousBatchingManager`` in a process of its own, with no HTTP and no API
  server (:mod:`otel_generate.bench.serve_child`): less noise, no server around it.

**Rounds.** Every round is a fresh process (a server, or the in-process child) at one offered load
(:mod:`otel_generate.bench.load`): *saturation*, ``--concurrency`` requests always in flight, or a
Poisson rate. A round warms up (``--warmup`` waves of ``--concurrency`` requests, closed loop), then
measures one window of ``--seconds``: at saturation the closed loop runs on into it; at a rate the
warmup drains, Poisson arrivals start :data:`LEAD_IN_FRACTION` of ``--seconds`` (at least 1 s) before
the window, and every request sent in the window is followed to its end (the drain, at most
:data:`DRAIN_TIMEOUT_S`). The levels are saturation, then ``--rates`` (fractions of saturation are
resolved from the first plain saturation round, and then fixed for every round). For each of
``--runs`` pairs and each level, a plain round, then an instrumented round, with the same arrivals.

**Plain and instrumented** run the same command. HTTP: ``opentelemetry-instrument transformers serve
MODEL ...`` with the SDK's OTLP/HTTP span and metric exporters sending to a local sink
(:mod:`otel_generate.bench.sink`, a process of its own that parses and drops), the ``process``
resource detector on, and every OpenTelemetry instrumentation installed disabled
(``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS``) but, on the instrumented side, this package's
(``transformers_generate``): the only difference is this package. Other instrumentations would add the
same work to both sides (the ASGI instrumentation's a span per streamed chunk) and noise to the
comparison. A FastAPI that traces requests itself (``fastapi.telemetry``, on whenever an SDK is set up)
does so on both sides: a few spans per HTTP request in the API server's process. In-process: the same
SDK providers on both sides (a ``BatchSpanProcessor`` with ``--exporter``, a ``MeterProvider``),
``GenerateInstrumentor().instrument()`` on the instrumented side only.

**Reported** per round and, per level, as the median and interquartile range over the pairs of each
side and of the per-pair ratio instrumented / plain: tokens/s, requests/s, time to first token,
inter-token latency and end-to-end latency (p50 and p99 of the window's requests); the requests the
emitter dropped (HTTP: the ``generate.emitter.dropped_requests`` counter the model's process exports
when it stops, which the sink reads; the warning lines in the server's log are counted too;
in-process: the same counter, read from the SDK's reader); the CPU time of the model's process, of
the emitter's thread (``otel_generate-e`` in ``/proc``, :mod:`otel_generate.bench.procstat`), of the
API server and of the load generator, per second of the window.

Errors: :class:`~otel_generate.bench.config.BenchUsageError` (exit status 2) on invalid input or a
missing tool, before anything runs; ``RuntimeError`` when a server or child fails (its log's tail in
the message).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from otel_generate.bench.config import BenchConfig, BenchUsageError, require_module, resolve_device
from otel_generate.bench.environment import machine, versions
from otel_generate.bench.load import (
    DRAIN_TIMEOUT_S,
    DROP_LINE,
    WARMUP_TIMEOUT_S,
    Level,
    compare_levels,
    parse_rates,
    poisson_arrivals,
    window_figures,
)
from otel_generate.bench.monitor import LoadMonitor
from otel_generate.bench.procstat import find_thread, process_cpu_s, thread_cpu_s
from otel_generate.bench.progress import Progress
from otel_generate.bench.serve_http import (
    OWN_INSTRUMENTATION,
    START_TIMEOUT_S,
    HttpDriver,
    Server,
    Sink,
    cache_sizes,
    executable,
    free_port,
    instrumentations,
    log_tail,
    request_bodies,
    server_command,
    server_environment,
)
from otel_generate.bench.stats import median_iqr_text

#: Arrivals at a rate start this fraction of ``--seconds`` (at least :data:`MIN_LEAD_IN_S`) before the window.
LEAD_IN_FRACTION = 0.1
MIN_LEAD_IN_S = 1.0
#: Distinct prompts the requests cycle through (random letters and digits, seeded).
PROMPTS = 64
#: A median load-generator CPU above this (CPU seconds per second) may have limited the load it offered.
CLIENT_CPU_LIMIT = 0.8
SIDES = ("plain", "instrumented")


# --------------------------------------------------------------------------------------------
# Checks and the plan
# --------------------------------------------------------------------------------------------


def validate(config: BenchConfig, check_tools: bool = True) -> List[Level]:
    """``--serve``'s own checks (after :meth:`BenchConfig.validate`); its levels (``--rates`` parsed).

    ``check_tools``: also look for what a run needs (``--dry-run`` does not): the OpenTelemetry SDK,
    httpx, transformers serve's dependencies, the ``transformers`` and ``opentelemetry-instrument``
    commands, the OTLP/HTTP exporter and opentelemetry-proto (HTTP), ``/proc`` (Linux).

    Raises:
        BenchUsageError: naming the first problem.
    """
    levels = parse_rates(config.rates)
    if not check_tools:
        return levels
    if not os.path.isdir("/proc/self/task"):
        raise BenchUsageError("--serve reads CPU time from /proc: it runs on Linux only")
    require_module(
        "opentelemetry.sdk", "--serve needs the OpenTelemetry SDK: pip install opentelemetry-sdk (the [bench] extra)"
    )
    if config.in_process:
        require_module(
            "transformers.generation.continuous_batching",
            "--serve --in-process needs transformers' continuous batching (transformers 5.17 or newer)",
        )
        return levels
    require_module("httpx", "--serve's load generator needs httpx: pip install httpx (the [bench] extra)")
    for module in ("fastapi", "uvicorn", "transformers.cli.serving"):
        require_module(
            module,
            f"--serve needs transformers serve ({module} is missing): pip install 'transformers[serving]' (the "
            "[serve] extra)",
        )
    require_module(
        "opentelemetry.exporter.otlp.proto.http",
        "--serve's servers export over OTLP/HTTP: pip install opentelemetry-exporter-otlp-proto-http",
    )
    require_module("opentelemetry.proto", "--serve's sink parses OTLP: pip install opentelemetry-proto")
    for name in ("transformers", "opentelemetry-instrument"):
        if executable(name) is None:
            raise BenchUsageError(f"--serve runs the {name!r} command, which was not found beside {sys.executable}")
    return levels


def lead_in_s(config: BenchConfig) -> float:
    return max(MIN_LEAD_IN_S, LEAD_IN_FRACTION * config.seconds)


def plan_text(config: BenchConfig) -> str:
    """``--dry-run``'s line for ``--serve``."""
    levels = validate(config, check_tools=False)
    rounds = 2 * config.runs * len(levels)
    where = "in-process, one process per round" if config.in_process else "HTTP, a fresh server per round"
    return (
        f"--serve ({where}, {batching(config)}): {rounds} rounds: {config.runs} pairs of a plain and an "
        f"instrumented round at each of {len(levels)} offered loads ({', '.join(lv.label for lv in levels)}), "
        f"{config.warmup} warmup waves of {config.concurrency} requests and a {config.seconds:g} s window each"
    )


def batching(config: BenchConfig) -> str:
    return "continuous batching" if config.in_process or config.continuous_batching else "generate() per request"


# --------------------------------------------------------------------------------------------
# The model and the prompts
# --------------------------------------------------------------------------------------------


def prepare_model(config: BenchConfig, directory: str) -> Dict[str, Any]:
    """The checkpoint every round loads: ``--model``'s directory as it is, or random weights written to
    ``directory`` with a tokenizer that decodes every id to text of its own
    (:func:`otel_generate.bench.models.build_tokenizer`): by default a tiny Llama, or ``--model-config``'s
    architecture (built on the CPU in ``--dtype``). Returns ``{"path", "description", "vocab_size",
    "parameters", "max_positions"}``.
    """
    import torch
    import transformers

    from otel_generate.bench.models import build_model, build_tokenizer
    from otel_generate.bench.workload import build_bench_model, check_lengths, max_positions, model_description

    if config.model is not None:
        model_config = transformers.AutoConfig.from_pretrained(config.model, local_files_only=True)
        text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        with torch.device("meta"):
            meta = transformers.AutoModelForCausalLM.from_config(model_config)
        positions = max_positions(meta)
        check_lengths(config.prompt_tokens, config.new_tokens, positions)
        return {
            "path": config.model,
            "description": config.model,
            "vocab_size": int(text.vocab_size),
            "parameters": int(sum(p.numel() for p in meta.parameters())),
            "max_positions": positions,
        }
    if config.model_config is not None:
        model = build_bench_model(config, "cpu")
        description = model_description(config, model)
    else:
        model = build_model("llama", seed=config.seed).to(dtype=getattr(torch, config.dtype))
        description = f"{type(model).__name__} (random weights, seed {config.seed}, built locally: tiny)"
    positions = max_positions(model)
    check_lengths(config.prompt_tokens, config.new_tokens, positions)
    vocab = int(model.get_input_embeddings().num_embeddings)
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bar between the bench's lines
    try:
        model.save_pretrained(directory)
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    build_tokenizer(vocab).save_pretrained(directory)
    return {
        "path": directory,
        "description": description,
        "vocab_size": vocab,
        "parameters": int(sum(p.numel() for p in model.parameters())),
        "max_positions": positions,
    }


def make_prompts(path: str, prompt_tokens: int, seed: int) -> Tuple[List[str], List[List[int]]]:
    """:data:`PROMPTS` random prompts of ``prompt_tokens`` letters and digits (seeded), as text (HTTP) and
    as the checkpoint tokenizer's ids (in-process). With the bench's own tokenizer a letter is a token;
    with ``--model``'s, the count may differ."""
    import transformers

    from otel_generate.bench.models import TOKEN_CHARACTERS

    letters = [c for c in TOKEN_CHARACTERS if c.isalnum()]
    draw = random.Random(seed)
    texts = ["".join(draw.choice(letters) for _ in range(prompt_tokens)) for _ in range(PROMPTS)]
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    ids = [list(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
    return texts, ids


def eos_override(config: BenchConfig, vocab_size: int) -> Optional[int]:
    """The ``eos_token_id`` every request sets: EOS off (the default) is the vocabulary's size, an id no
    token has, so every request generates ``--new-tokens``; ``--eos ID`` that id; ``--eos`` alone none
    (the model's own)."""
    from otel_generate.bench.config import MODEL_EOS

    if config.eos is None:
        return vocab_size
    if config.eos == MODEL_EOS:
        return None
    return int(config.eos)


# --------------------------------------------------------------------------------------------
# Rounds
# --------------------------------------------------------------------------------------------


class Bench:
    """What every round shares: the settings, the model, the prompts, the sink, the work directory."""

    def __init__(self, config: BenchConfig, device: str, workdir: str) -> None:
        self.config, self.device, self.workdir = config, device, workdir
        self.model = prepare_model(config, os.path.join(workdir, "model"))
        self.texts, self.ids = make_prompts(self.model["path"], config.prompt_tokens, config.seed)
        self.eos = eos_override(config, self.model["vocab_size"])
        self.sink: Optional[Sink] = None
        if not config.in_process:
            self.sink = Sink(os.path.join(workdir, "sink.log"))
            self.bodies = request_bodies(config, self.texts, self.eos)
        self.rounds_run = 0

    def close(self) -> None:
        if self.sink is not None:
            self.sink.stop()

    def arrivals(self, level: Level, pair: int, index: int) -> List[float]:
        if level.kind != "rate":
            return []
        seed = self.config.seed * 1_000_003 + pair * 1_000 + index  # the same for both rounds of a pair
        return poisson_arrivals(level.rps, -lead_in_s(self.config), self.config.seconds, seed)

    def round(self, level: Level, side: str, arrivals: Sequence[float]) -> Dict[str, Any]:
        """One round at ``level`` on ``side``: its window's figures and what its process said."""
        self.rounds_run += 1
        if self.config.in_process:
            return self._in_process_round(level, side, arrivals)
        return self._http_round(level, side, arrivals)

    def _http_round(self, level: Level, side: str, arrivals: Sequence[float]) -> Dict[str, Any]:
        config = self.config
        port = free_port()
        log_path = os.path.join(self.workdir, f"server-{self.rounds_run}-{side}.log")
        server = Server(
            server_command(config, self.model["path"], port, self.device),
            server_environment(config, side, self.sink.endpoint),
            log_path,
        )
        before = self.sink.stats()
        try:
            startup_s = server.start(port)
            server_pid = server.process.pid
            model_pid = server.model_pid()
            emitter: Dict[str, Optional[int]] = {"tid": None}

            def snapshot() -> Dict[str, Optional[float]]:
                if side == "instrumented" and emitter["tid"] is None:
                    emitter["tid"] = find_thread(model_pid)
                tid = emitter["tid"]
                return {
                    "process": process_cpu_s(model_pid),
                    "emitter": thread_cpu_s(model_pid, tid) if tid is not None else None,
                    "server": process_cpu_s(server_pid) if model_pid != server_pid else None,
                    "client": time.process_time(),
                }

            driver = HttpDriver(server.base_url, self.bodies, snapshot, one_character_tokens=config.model is None)
            records, start, end, cpu, warmed = driver.window(
                level,
                config.concurrency,
                config.warmup * config.concurrency,
                config.seconds,
                lead_in_s(config),
                arrivals,
            )
        finally:
            status = server.stop()
        after = self.sink.stats()
        log = log_tail(log_path, limit=10**9)
        model_stats = after["processes"].get(str(model_pid))
        spans = after["traces"]["spans"] - before["traces"]["spans"]
        return {
            "side": side,
            "figures": window_figures(records, start, end, config.new_tokens, cpu),
            "requests_total": len(records),
            "warmup_requests": warmed,
            "startup_s": startup_s,
            "exit_status": status,
            "server_pid": server_pid,
            "model_pid": model_pid,
            "emitter_thread": emitter["tid"],
            "dropped_requests": (
                None if side == "plain" else None if model_stats is None else int(model_stats["dropped_requests"])
            ),
            "dropped_requests_logged": sum(int(n) for n in DROP_LINE.findall(log)),
            "requests_recorded": None if model_stats is None else int(model_stats["requests_recorded"]),
            "spans_received": spans,
            "otlp_bytes": {
                name: after[name]["bytes"] - before[name]["bytes"] for name in ("traces", "metrics", "logs")
            },
        }

    def _in_process_round(self, level: Level, side: str, arrivals: Sequence[float]) -> Dict[str, Any]:
        config = self.config
        spec = {
            "model_dir": self.model["path"],
            "device": self.device,
            "dtype": config.dtype,
            "threads": config.threads,
            "prompts": self.ids,
            "new_tokens": config.new_tokens,
            "eos": self.eos,
            "concurrency": config.concurrency,
            "warmup": config.warmup * config.concurrency,
            "seconds": config.seconds,
            "lead_in": lead_in_s(config),
            "level": level.kind,
            "arrivals": list(arrivals),
            "instrumented": side == "instrumented",
            "exporter": config.exporter,
            "max_step_spans": config.max_step_spans,
            "step_spans": config.step_spans,
            "background_emission": config.background_emission,
            "sampler": config.sampler,
            "cache": cache_sizes(config),
        }
        log_path = os.path.join(self.workdir, f"child-{self.rounds_run}-{side}.log")
        env = {**os.environ, "OMP_NUM_THREADS": str(config.threads), "MKL_NUM_THREADS": str(config.threads)}
        with open(log_path, "w", encoding="utf-8") as log:
            try:
                done = subprocess.run(
                    [sys.executable, "-m", "otel_generate.bench.serve_child"],
                    input=json.dumps(spec),
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                    env=env,
                    timeout=START_TIMEOUT_S + WARMUP_TIMEOUT_S + config.seconds + DRAIN_TIMEOUT_S + 60,
                )
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"the in-process round did not finish in time: {log_tail(log_path)}") from None
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"the in-process round failed (exit status {done.returncode}): {log_tail(log_path)}")
        result = json.loads(lines[-1])
        result["side"] = side
        return result


def run(config: BenchConfig, progress: Optional[Progress] = None) -> Dict[str, Any]:
    """Validate, prepare, run every round (see the module docstring); the result document (nothing is
    written here).

    Raises:
        BenchUsageError: invalid input, a missing tool, ``--device cuda`` without CUDA.
        RuntimeError: a server or child that failed.
    """
    config.validate()
    validate(config, check_tools=False)
    device = resolve_device(config.device)  # before the tools: no CUDA says so at once
    levels = validate(config)
    progress = progress if progress is not None else Progress()
    total = 2 * config.runs * len(levels)
    progress.begin(total, "set-up (model, prompts" + ("" if config.in_process else ", OTLP sink") + ")", unit="rounds")
    # the bench's own busy threads: the model's process and, over HTTP, the API server and the load generator
    monitor = LoadMonitor(own_threads=config.threads + (1 if config.in_process else 2), on_busy=progress.say)
    monitor.read("start")
    workdir = tempfile.mkdtemp(prefix="otel-generate-serve-")
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    bench: Optional[Bench] = None
    rounds: List[Dict[str, Any]] = []
    try:
        bench = Bench(config, device, workdir)
        for pair in range(config.runs):
            for index in range(len(levels)):
                for side in SIDES:
                    level = levels[index]
                    progress.phase(f"pair {pair + 1}/{config.runs}, {level.label}, {side}")
                    outcome = bench.round(level, side, bench.arrivals(level, pair, index))
                    outcome.update(pair=pair, level=index, label=level.label, offered_rps=level.rps)
                    rounds.append(outcome)
                    if pair == 0 and index == 0 and side == "plain":
                        levels = _calibrated(levels, outcome["figures"]["requests_per_s"])
                    monitor.read(f"pair {pair + 1} {level.label} {side}")
                    progress.advance()
    finally:
        if bench is not None:
            bench.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return _document(config, device, bench, levels, rounds, monitor, started)


def _calibrated(levels: List[Level], saturation_rps: float) -> List[Level]:
    """The levels with their fractions resolved from the first plain saturation round's requests/s."""
    if any(lv.kind == "rate" and lv.rps is None for lv in levels) and not saturation_rps > 0:
        raise RuntimeError(
            "no request finished in the first plain saturation window: the fractions of --rates cannot be resolved "
            "(give absolute rates, e.g. --rates 5/s, or a longer --seconds)"
        )
    return [lv.resolved(saturation_rps) for lv in levels]


def _document(
    config: BenchConfig,
    device: str,
    bench: "Bench",
    levels: List[Level],
    rounds: List[Dict[str, Any]],
    monitor: LoadMonitor,
    started: str,
) -> Dict[str, Any]:
    compared = compare_levels(rounds, levels)
    others = [name for name in instrumentations() if name != OWN_INSTRUMENTATION]
    if config.in_process:
        plain = (
            "the same child process: SDK TracerProvider + BatchSpanProcessor + the --exporter and MeterProvider "
            "set up, nothing instrumented"
        )
        instrumented = "GenerateInstrumentor().instrument() with those providers"
        exporter = config.exporter
    else:
        plain = (
            "opentelemetry-instrument transformers serve ... with OTEL_PYTHON_DISABLED_INSTRUMENTATIONS="
            + ",".join(others + [OWN_INSTRUMENTATION])
            + ": the SDK and its OTLP/HTTP exporters set up, nothing instrumented"
        )
        instrumented = (
            "the same command with OTEL_PYTHON_DISABLED_INSTRUMENTATIONS="
            + ",".join(others)
            + f": only this package's instrumentation ({OWN_INSTRUMENTATION})"
        )
        exporter = (
            "OTLP/HTTP (the SDK's exporters, a BatchSpanProcessor and a PeriodicExportingMetricReader with their "
            "defaults) to a local sink that parses and drops"
        )
    result: Dict[str, Any] = {
        "mode": "serve",
        "variant": "in_process" if config.in_process else "http",
        "batching": "continuous" if config.in_process or config.continuous_batching else "generate",
        "versions": versions(),
        "date": started,
        "command": list(config.argv),
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("OTEL_GENERATE_")},
        "machine": machine(device),
        "model": bench.model["description"],
        "device": device,
        "dtype": config.dtype,
        "parameters": bench.model["parameters"],
        "concurrency": config.concurrency,
        "prompt_tokens": config.prompt_tokens,
        "new_tokens_requested": config.new_tokens,
        "eos_token_id": bench.eos,
        "eos": "off (eos_token_id set to the vocabulary size, an id no token has)" if config.eos is None else "on",
        "seconds": config.seconds,
        "lead_in_s": lead_in_s(config),
        "drain_timeout_s": DRAIN_TIMEOUT_S,
        "warmup": config.warmup,
        "warmup_requests": config.warmup * config.concurrency,
        "runs": config.runs,
        "threads": config.threads,
        "seed": config.seed,
        "rates": config.rates,
        "offered_rates_rps": [lv.rps for lv in levels if lv.kind == "rate"],
        "rates_from": "the first plain saturation round's requests/s"
        if any(lv.fraction is not None for lv in levels)
        else None,
        "cache": cache_sizes(config) if config.in_process or config.continuous_batching else None,
        "order": "per pair and level: a plain round, then an instrumented round, each a fresh process with the same "
        "arrivals",
        "plain": plain,
        "instrumented": instrumented,
        "exporter": exporter,
        "max_step_spans": config.max_step_spans,
        "step_spans": config.step_spans,
        "sampler": config.sampler,
        "background_emission": config.background_emission,
        "rounds": rounds,
        "levels": compared,
    }
    monitor.read("end")
    result["load"] = monitor.report()
    result["warnings"] = _warnings(config, result)
    return result


def _warnings(config: BenchConfig, result: Dict[str, Any]) -> List[str]:
    warnings = [result["load"]["warning"]] if result["load"]["warning"] else []
    for level in result["levels"]:
        label = level["label"]
        if level["requests_failed"]:
            errors = [r["figures"]["first_error"] for r in result["rounds"] if r["label"] == label]
            first = next((e for e in errors if e), None)
            warnings.append(f"{label}: {level['requests_failed']} request(s) failed (first: {first})")
        if level["requests_unfinished"]:
            warnings.append(
                f"{label}: {level['requests_unfinished']} request(s) had not finished {DRAIN_TIMEOUT_S:.0f} s after "
                "the window and were cancelled"
            )
        if level["token_count_mismatches"] and config.eos is None:
            warnings.append(
                f"{label}: {level['token_count_mismatches']} request(s) did not generate the {config.new_tokens} "
                "tokens asked for"
            )
        if level["streamed_count_mismatches"] and config.model is None:
            warnings.append(
                f"{label}: {level['streamed_count_mismatches']} request(s) streamed another number of tokens than "
                "they generated"
            )
        if level["dropped_requests_total"] is None and level["pairs"]:
            warnings.append(
                f"{label}: the requests dropped by the emitter are unknown for some instrumented rounds (no metrics "
                "came from the model's process)"
            )
        client = level["plain"]["median_client_cpu"]
        if client is not None and client > CLIENT_CPU_LIMIT:
            warnings.append(
                f"{label}: the load generator used {client:.2f} CPU-s/s (median of the plain rounds): it may have "
                "limited the load it offered"
            )
    return warnings


# --------------------------------------------------------------------------------------------
# The summary
# --------------------------------------------------------------------------------------------


def summary_text(result: Dict[str, Any]) -> str:
    """The human-readable summary of a ``--serve`` result (every median with its IQR)."""
    lines = [f"WARNING: {w}" for w in result.get("warnings", [])]
    variant = "in-process" if result["variant"] == "in_process" else "HTTP"
    batching_text = "continuous batching" if result["batching"] == "continuous" else "generate() per request"
    rates = ", ".join(
        f"{lv['label']} = {lv['offered_rps']:.2f} requests/s" for lv in result["levels"] if lv["level"] == "rate"
    )
    lines += [
        f"otel-generate bench --serve ({variant}, {batching_text}): {result['model']}",
        f"  device {result['device']}, {result['dtype']}, {result['threads']} torch thread(s), "
        f"{result['parameters']:,} parameters",
        f"  prompt {result['prompt_tokens']} tokens, {result['new_tokens_requested']} new tokens "
        f"(EOS {'off' if result['eos'].startswith('off') else 'on'}); saturation: {result['concurrency']} requests "
        f"in flight" + (f"; Poisson: {rates}" if rates else ""),
        f"  {result['runs']} pair(s) of rounds per load, each round a fresh process, plain then instrumented; "
        f"{result['seconds']:g} s windows after {result['warmup_requests']} warmup requests",
    ]

    def side(values: Dict[str, Any], name: str, fmt: str) -> str:
        return median_iqr_text(values[f"median_{name}"], values[f"iqr_{name}"], fmt)

    def row(level: Dict[str, Any], title: str, name: str, fmt: str) -> str:
        return (
            f"    {title:<18} plain {side(level['plain'], name, fmt)}; instrumented "
            f"{side(level['instrumented'], name, fmt)}; ratio {side(level['ratios'], name, '.3f')}"
        )

    for level in result["levels"]:
        plain, instr = level["plain"], level["instrumented"]
        dropped = level["dropped_requests"]
        offered = f" ({level['offered_rps']:.2f} requests/s offered)" if level["offered_rps"] else ""
        lines += [
            f"  {level['label']}{offered}, {level['pairs']} pair(s):",
            row(level, "tokens/s", "tokens_per_s", ",.0f"),
            row(level, "requests/s", "requests_per_s", ".2f"),
            row(level, "TTFT p50 (ms)", "ttft_p50_ms", ".2f"),
            row(level, "TTFT p99 (ms)", "ttft_p99_ms", ".2f"),
            row(level, "ITL p50 (ms)", "itl_p50_ms", ".3f"),
            row(level, "ITL p99 (ms)", "itl_p99_ms", ".3f"),
            f"    emitter thread     {side(instr, 'emitter_cpu', '.3f')} CPU-s/s, "
            f"{side(instr, 'emitter_cpu_share', '.1%')} of the model's process "
            f"({side(instr, 'process_cpu', '.2f')} CPU-s/s; plain {side(plain, 'process_cpu', '.2f')})",
            "    requests dropped by the emitter: "
            + ("unknown" if level["dropped_requests_total"] is None else str(level["dropped_requests_total"]))
            + (f" (per round: {', '.join('?' if d is None else str(d) for d in dropped)})" if dropped else ""),
        ]
    return "\n".join(lines)
