"""What the emitter spends per generated token, counted in instructions, and where (callgrind).

One request of ``--tokens`` one-token steps (a prefill and decode steps, the timestamps made up: no
model, no torch) is emitted the way the background emitter emits it (``otel_generate.emit.finish``
on the calling thread), into the SDK as ``otel-generate bench --instructions`` sets it up: a
``TracerProvider`` with a ``BatchSpanProcessor`` and a discarding exporter, a ``MeterProvider``
with an in-memory reader. The configuration is the default (every step a span, the inter-token
histogram) or ``--step-spans none``.

Run it under callgrind (the script does, unless ``--no-valgrind``): the counting starts after the
imports, the set-up and ``--warmup`` requests (``callgrind_control --instr=on``), then ``--requests``
requests are emitted and the span processor flushed. It prints the instructions per request and per
generated token over every thread, and with ``--top N`` the N functions that cost the most
(inclusive, from ``callgrind_annotate``), which is where the per-token work goes.

    python benchmarks/emitter_profile.py --requests 16                   # the emission, per token
    python benchmarks/emitter_profile.py --requests 16 --floor           # the same public calls alone
    python benchmarks/emitter_profile.py --requests 2000 --call record   # one public call alone

``--top N`` lists the costliest C functions (the interpreter's): where Python code goes, they show
only the interpreter, so the per-token split comes from ``--floor`` and ``--call``.

Environment: ``OPENBLAS_NUM_THREADS``/``OMP_NUM_THREADS`` are set to 1 for the child (idle BLAS
threads spin and add noise); nothing else is read.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile


def request(tokens: int):
    from otel_generate.request import Request

    start = 1_000
    ends, at = [], start
    for index in range(tokens):
        at += 10_000_000 if index == 0 else 1_000_000 + index * 1_000
        ends.append(at)
    made = Request(model="GPT2LMHeadModel", start_ns=start, start_wall_ns=1_700_000_000 * 10**9, timed=True)
    made.step_ends_ns, made.step_tokens = ends, [1] * tokens
    made.end_ns = ends[-1] + 7
    made.input_tokens, made.output_tokens, made.output_tokens_per_sequence = 4, tokens, [tokens]
    made.finish_reasons = ["length"]
    made.parameters = {"gen_ai.request.max_tokens": tokens, "generate.strategy": "greedy"}
    return made


def child(args: argparse.Namespace) -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from otel_generate import GenerateInstrumentor, emit

    class Discard(SpanExporter):
        spans = 0

        def export(self, spans):
            Discard.spans += len(spans)
            return SpanExportResult.SUCCESS

    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(Discard()))
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    options = {"step_spans": args.step_spans} if args.step_spans else {}
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        skip_dep_check=True,
        background_emission=False,
        **options,
    )
    telemetry = instrumentor.telemetry

    def one() -> None:
        made = request(args.tokens)
        span = emit.start_request_span(telemetry, made.model, start_time=made.start_wall_ns)
        emit.finish(telemetry, span, made)

    if args.floor:  # the same public calls, made directly: what the SDK alone costs for this output
        one = floor_calls(telemetry, args)
    if args.call:  # one public call alone, --requests times
        one = single_call(telemetry, args.call)

    for _ in range(args.warmup):
        one()
    tracer_provider.force_flush()
    if args.count:
        subprocess.run(["callgrind_control", "--instr=on", str(os.getpid())], check=True, capture_output=True)
    for _ in range(args.requests):
        one()
    tracer_provider.force_flush()
    if args.count:
        subprocess.run(["callgrind_control", "--instr=off", str(os.getpid())], check=True, capture_output=True)
    print("SPANS", Discard.spans, flush=True)


def floor_calls(telemetry, args: argparse.Namespace):
    """The public OpenTelemetry calls one default request makes, made directly with what
    ``emit.finish`` would pass them (its attributes, times and values), without this package's code
    around them: the request span's attributes and end, every step span, every metric value."""
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind

    from otel_generate import attributes as A
    from otel_generate import emit
    from otel_generate.derive import derive

    made = request(args.tokens)
    span0 = emit.start_request_span(telemetry, made.model, start_time=made.start_wall_ns)
    summary = derive(made, telemetry.policy, steps=True, spans=True, inter_token=True)
    span0.end()
    offset = made.start_wall_ns - made.start_ns
    starts = [s + offset for s in summary.step_starts_ns]
    ends = [e + offset for e in summary.step_ends_ns]
    latencies = summary.step_latencies_s
    request_attributes = {
        **made.parameters,
        A.GEN_AI_USAGE_INPUT_TOKENS: 4,
        A.GEN_AI_USAGE_OUTPUT_TOKENS: args.tokens,
        A.GEN_AI_RESPONSE_FINISH_REASONS: ["length"],
        A.GENERATE_STEPS: args.tokens,
        A.GENERATE_STEP_LATENCIES: latencies,
        A.GENERATE_TIME_TO_FIRST_TOKEN: summary.time_to_first_token_s,
        A.GENERATE_TIME_PER_OUTPUT_TOKEN: summary.time_per_output_token_s,
    }
    base = {
        A.GEN_AI_OPERATION_NAME: "text_completion",
        A.GEN_AI_PROVIDER_NAME: "transformers",
        A.GEN_AI_REQUEST_MODEL: made.model,
    }
    usage_in = dict(base, **{A.GEN_AI_TOKEN_TYPE: "input"})
    usage_out = dict(base, **{A.GEN_AI_TOKEN_TYPE: "output"})
    instruments = telemetry.instruments
    tracer = telemetry.tracer
    steps = args.step_spans != "none"

    def one() -> None:
        span = emit.start_request_span(telemetry, made.model, start_time=made.start_wall_ns)
        span.set_attributes(request_attributes)
        parent = trace.set_span_in_context(span)
        if steps:
            token = 0
            for index in range(args.tokens):
                tracer.start_span(
                    "prefill" if index == 0 else "decode",
                    context=parent,
                    kind=SpanKind.INTERNAL,
                    start_time=starts[index],
                    attributes={
                        A.GENERATE_STEP_INDEX: index,
                        A.GENERATE_TOKEN_INDEX: token,
                        A.GENERATE_STEP_TOKENS: 1,
                        A.GENERATE_STEP_LATENCY: latencies[index],
                    },
                ).end(end_time=ends[index])
                token += 1
        span.end(end_time=ends[-1])
        instruments[A.METRIC_REQUEST_DURATION].record(summary.duration_s, base, context=parent)
        instruments[A.METRIC_CLIENT_OPERATION_DURATION].record(summary.duration_s, base, context=parent)
        instruments[A.METRIC_TIME_TO_FIRST_TOKEN].record(summary.time_to_first_token_s, base, context=parent)
        instruments[A.METRIC_TIME_PER_OUTPUT_TOKEN].record(summary.time_per_output_token_s, base, context=parent)
        instruments[A.METRIC_TOKEN_USAGE].record(4, usage_in, context=parent)
        instruments[A.METRIC_TOKEN_USAGE].record(args.tokens, usage_out, context=parent)
        record = instruments[A.METRIC_INTER_TOKEN_LATENCY].record
        for value in summary.inter_token_latencies_s:
            record(value, base, context=parent)

    return one


#: ``--call``: one public call, as the emitter makes it per generated token, and its parts
CALLS = {
    "step-span": "start_span + end, 4 attributes, explicit parent context and times (a step span)",
    "bare-span": "start_span + end, no attribute",
    "record": "Histogram.record, 3 attributes, a context holding a sampled span (an exemplar offer)",
    "record-no-exemplar": "Histogram.record, 3 attributes, a context without a span (no exemplar offer)",
    "bare-record": "Histogram.record, no attribute, a context without a span",
}


def single_call(telemetry, call: str):
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind

    from otel_generate import attributes as A

    tracer = telemetry.tracer
    histogram = telemetry.instruments[A.METRIC_INTER_TOKEN_LATENCY]
    root = tracer.start_span("root")
    sampled = trace.set_span_in_context(root)
    no_span = trace.set_span_in_context(trace.INVALID_SPAN)
    base = {A.GEN_AI_OPERATION_NAME: "text_completion", A.GEN_AI_PROVIDER_NAME: "transformers"}
    base[A.GEN_AI_REQUEST_MODEL] = "GPT2LMHeadModel"
    counter = [0]

    def one() -> None:
        counter[0] += 1
        i = counter[0]
        if call == "step-span":
            attributes = {
                A.GENERATE_STEP_INDEX: i,
                A.GENERATE_TOKEN_INDEX: i,
                A.GENERATE_STEP_TOKENS: 1,
                A.GENERATE_STEP_LATENCY: 0.001,
            }
            span = tracer.start_span(
                "decode", context=sampled, kind=SpanKind.INTERNAL, start_time=1_000 + i, attributes=attributes
            )
            span.end(end_time=2_000 + i)
        elif call == "bare-span":
            tracer.start_span("decode", context=sampled, kind=SpanKind.INTERNAL, start_time=1_000 + i).end(
                end_time=2_000 + i
            )
        elif call == "record":
            histogram.record(0.001 * (i % 7), base, context=sampled)
        elif call == "record-no-exemplar":
            histogram.record(0.001 * (i % 7), base, context=no_span)
        else:
            histogram.record(0.001 * (i % 7), None, context=no_span)

    return one


def parent(args: argparse.Namespace) -> None:
    if shutil.which("valgrind") is None or shutil.which("callgrind_annotate") is None:
        sys.exit("emitter_profile.py: valgrind's callgrind is not installed (e.g. apt-get install valgrind)")
    folder = tempfile.mkdtemp(prefix="emitter-profile-")
    out = os.path.join(folder, "callgrind.out")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    command = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={out}",
        sys.executable,
        __file__,
        "--child",
        "--count",
        *argv_of(args),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"emitter_profile.py: the child failed:\n{done.stderr[-3000:]}")
    total = 0
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.startswith(("summary:", "totals:")):
                    total = max(total, int(line.split()[1]))
    per_request = total / args.requests
    if args.call:
        result = {"call": args.call, "what": CALLS[args.call], "calls": args.requests, "per_call": round(per_request)}
    else:
        result = {
            "step_spans": args.step_spans or "all",
            "what": "public API calls alone (--floor)" if args.floor else "otel_generate's emission",
            "tokens": args.tokens,
            "requests": args.requests,
            "instructions": total,
            "per_request": round(per_request),
            "per_token": round(per_request / args.tokens),
        }
    print(json.dumps(result))
    if args.top:
        annotated = subprocess.run(
            ["callgrind_annotate", "--inclusive=yes", "--threshold=100", out],
            capture_output=True,
            text=True,
        ).stdout
        rows = [line for line in annotated.splitlines() if re.match(r"^\s*[\d,]+ \(", line)]
        for line in rows[: args.top]:
            print(line[:220])
    shutil.rmtree(folder, ignore_errors=True)


def argv_of(args: argparse.Namespace) -> list:
    argv = ["--tokens", str(args.tokens), "--requests", str(args.requests), "--warmup", str(args.warmup)]
    if args.step_spans:
        argv += ["--step-spans", args.step_spans]
    if args.floor:
        argv.append("--floor")
    if args.call:
        argv += ["--call", args.call]
    return argv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128, help="generated tokens (steps) per request (default 128)")
    parser.add_argument("--requests", type=int, default=16, help="requests counted (default 16)")
    parser.add_argument("--warmup", type=int, default=8, help="requests emitted before counting (default 8)")
    parser.add_argument("--step-spans", choices=["all", "none", "slow"], default=None, help="the step-span policy")
    parser.add_argument(
        "--floor",
        action="store_true",
        help="make the same public OpenTelemetry calls directly instead of emitting: the SDK's own share",
    )
    parser.add_argument(
        "--call",
        choices=sorted(CALLS),
        default=None,
        help="count one public call alone, --requests times: "
        + "; ".join(f"{name}: {what}" for name, what in CALLS.items()),
    )
    parser.add_argument("--top", type=int, default=0, help="print the N most costly functions (inclusive)")
    parser.add_argument("--no-valgrind", action="store_true", help="run the emission once, uncounted")
    parser.add_argument("--child", action="store_true", help="internal: the process the script starts under callgrind")
    parser.add_argument(
        "--count", action="store_true", help="internal: with --child, switch callgrind's counting on and off"
    )
    args = parser.parse_args()
    for name in ("tokens", "requests"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.child or args.no_valgrind:
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
