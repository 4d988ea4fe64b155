"""Instructions of the emitter's per-request pieces, replayed on a hand-built request, no model.

    python benchmarks/callgrind_emit_replay.py CONFIG PIECE [N] [--time]

Builds ``N`` (default 20) finished 128-step requests by hand (one token a step, steps back to
back, the first 20 ms, the others 3 to 4 ms apart, drawn with a fixed seed; 8 input and 128
output tokens), on an SDK ``TracerProvider`` with a ``BatchSpanProcessor`` (a queue of 65,536) and a
discarding exporter and an SDK ``MeterProvider`` with an ``InMemoryMetricReader`` (three requests are
emitted first, so that every histogram's aggregations exist), and counts one piece of the
emitter for all of them, printing the instructions per request. No torch or transformers is
imported: a run takes seconds under valgrind, so a change to the emitter can be counted at once.

CONFIG: ``unsampled`` (``ParentBased(ALWAYS_OFF)``), ``step-spans-off`` (``ALWAYS_ON``,
``max_step_spans=0``) or ``sampled`` (``ALWAYS_ON``, every step a span).

PIECE:

- ``finish``: :func:`otel_generate.emit.finish` (the request span started before, uncounted);
- ``metrics``: ``emit._record_metrics`` (the request's histograms), its summary derived before;
- ``derive``: :func:`otel_generate.derive.derive` as ``finish`` asks for it in this configuration;
- ``steps``: ``emit._emit_steps`` (the 128 step spans; ``sampled`` only).

How: the counted work runs inside ``operator.call`` (``--collect-atstart=no
--toggle-collect=_operator_call``), the main thread's count alone (``--separate-threads=yes``:
the span processor's thread is not counted), ``PYTHONHASHSEED=0``. The same piece counted in
``callgrind_own_code.py``'s workload differs (that request's own numbers, another memory layout):
this script is for comparing two versions of the emitter's code, not for the own-code total.
Needs valgrind on Linux.

``--time``: no valgrind; the same requests, each piece timed with ``time.perf_counter_ns`` in this
process, and the median printed in microseconds (time, unlike instructions, moves with whatever
else the machine runs).
"""

from __future__ import annotations

import operator
import os
import random
import sys
import time

import callgrind_toggled  # noqa: E402  (benchmarks/, the script's own folder)

CONFIGS = ("unsampled", "step-spans-off", "sampled")
PIECES = ("finish", "metrics", "derive", "steps")
STEPS = 128


def prepare(config: str, piece: str, n: int) -> tuple:
    """``(one, items, tracer_provider)``: ``one(item)`` runs ``piece`` for one of the ``n`` prepared
    requests in ``items``."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased

    from otel_generate import emit
    from otel_generate.derive import derive
    from otel_generate.options import Options
    from otel_generate.request import Request
    from otel_generate.telemetry import Telemetry

    class Discard(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    tracer_provider = TracerProvider(sampler=ParentBased(ALWAYS_OFF) if config == "unsampled" else ALWAYS_ON)
    # (a queue long enough for every step span of N requests: none is dropped)
    tracer_provider.add_span_processor(BatchSpanProcessor(Discard(), max_queue_size=1 << 16))
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    options = Options(
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        max_step_spans=0 if config == "step-spans-off" else 4096,
    )
    telemetry = Telemetry.from_options(options)
    draw = random.Random(1)

    def request() -> Request:
        start = time.monotonic_ns()
        ends = [start + 20_000_000]
        for _ in range(STEPS - 1):
            ends.append(ends[-1] + draw.randint(3_000_000, 4_000_000))
        made = Request(
            model="gpt2",
            start_ns=start,
            start_wall_ns=time.time_ns(),
            device="cpu",
            step_ends_ns=ends,
            step_tokens=[1] * STEPS,
            step_starts_ns=[start] + ends[:-1],
            end_ns=ends[-1] + 100_000,
            input_tokens=8,
            output_tokens=STEPS,
            output_tokens_per_sequence=[STEPS],
            finish_reasons=["length"],
        )
        made.parameters.update({"gen_ai.request.max_tokens": STEPS, "gen_ai.request.temperature": 1.0})
        return made

    for _ in range(3):  # every histogram's aggregations exist from here on
        emit.finish(telemetry, emit.start_request_span(telemetry, "gpt2"), request())
    recording = config != "unsampled"
    items = []
    for _ in range(n):
        span, made = emit.start_request_span(telemetry, "gpt2"), request()
        summary = derive(made, telemetry.policy, steps=recording, spans=recording, inter_token=True)
        items.append((span, made, summary))
    if piece == "steps" and items[0][2].step_spans != STEPS:
        raise SystemExit("steps: the configuration emits no step spans (use sampled)")
    fast = telemetry.fast_histograms

    def one(item: tuple) -> None:
        span, made, summary = item
        if piece == "finish":
            emit.finish(telemetry, span, made)
        elif piece == "metrics":
            emit._record_metrics(telemetry.instruments, span, made, summary, fast)
        elif piece == "derive":
            derive(made, telemetry.policy, steps=recording, spans=recording, inter_token=True)
        else:
            emit._emit_steps(telemetry, span, made, summary)

    return one, items, tracer_provider


def child(config: str, piece: str, n: int) -> None:
    one, items, tracer_provider = prepare(config, piece, n)
    operator.call(lambda: [one(item) for item in items])
    tracer_provider.shutdown()


def timed(config: str, piece: str, n: int) -> float:
    """The median of ``piece``'s time over ``n`` requests, microseconds."""
    import statistics

    one, items, tracer_provider = prepare(config, piece, n)
    times = []
    for item in items:
        start = time.perf_counter_ns()
        one(item)
        times.append(time.perf_counter_ns() - start)
    tracer_provider.shutdown()
    return statistics.median(times) / 1000


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return 0
    args = [arg for arg in sys.argv[1:] if arg != "--time"]
    time_it = len(args) < len(sys.argv) - 1
    if (
        not 2 <= len(args) <= 3
        or args[0] not in CONFIGS
        or args[1] not in PIECES
        or (len(args) == 3 and not args[2].isdigit())
    ):
        print(f"usage: {sys.argv[0]} {{{','.join(CONFIGS)}}} {{{','.join(PIECES)}}} [N] [--time]", file=sys.stderr)
        return 2
    n = int(args[2]) if len(args) == 3 else 20
    if n < 1:
        print("N must be at least 1", file=sys.stderr)
        return 2
    if time_it:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        median_us = timed(args[0], args[1], n)
        print(f"{args[0]}, {args[1]}: {median_us:,.1f} µs per request, median ({n} requests)")
        return 0
    env = dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [os.path.dirname(os.path.dirname(__file__)), env.get("PYTHONPATH")])
    )
    # (--separate-threads: the span processor's thread is counted apart, and it never enters operator.call)
    total = sum(
        callgrind_toggled.operator_call_totals(__file__, (args[0], args[1], str(n)), ("--separate-threads=yes",), env)
    )
    print(f"{args[0]}, {args[1]}: {total / n:,.0f} instructions per request ({n} requests)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
