"""The load generator and the measurements of ``collector/loadtest.sh`` (run that, not this).

It sends traces shaped like this package's at a fixed span rate into one gateway of the scale
tier (``collector/local.sh up --scale``), or with ``--scale`` into its agent, and measures what the
gateways do with them.

The traces: one real instrumented ``generate()`` call on a tiny random-weight GPT-2 (the spans
this package emits: a request span ``text_completion {model}`` and one step span per decode step,
``prefill`` then ``decode``, instrumentation scope ``otel_generate``) is encoded once as OTLP, as
the SDK's exporter would send it. Every trace sent is a copy with new trace and span ids, its
timestamps moved so that it ends when the export requests are built, just before the run (all of
them are built and serialized first, so that sending costs the generator little on a small
machine). Shares of the traces are an error (a real
``generate()`` that raised at half its steps: the request span has status ERROR) or have a slow
step (one ``decode`` span of 300 ms, above the gateway's 250 ms ``slow-decode-step`` policy); the
rest take the probabilistic policy's chance. Telemetrygen (the contrib module) cannot do this: it
names its spans ``lets-go``/``okey-dokey-N`` under the scope ``telemetrygen``, which the gateway's
filters and step-span policies do not treat as step spans, and gives every span one status.

Export requests carry whole traces, about ``--batch-spans`` spans each (512), gzip-compressed
(as the agent's OTLP exporter sends them; ``--compression none`` to compare), at most
``--in-flight`` at a time (10, the agent's exporter's consumers) over ``--channels`` gRPC
connections (1), paced so that ``rate × elapsed`` spans have been offered at any moment. A
request the receiver refuses is counted and not retried. When the gateway answers too slowly for
the requests in flight, the sender waits and sends less than asked: stderr says how much.

Printed on stdout, one ``NAME=value`` line each (counts in spans):

* ``SENT``: spans offered (in export requests that were answered);
* ``ACCEPTED``: spans the receiver the generator sends to accepted;
* ``REFUSED``: spans refused on the way: the generator's receiver's error answers and rejected
  spans, plus, with ``--scale``, what the gateways' receivers refused to the agent
  (``otelcol_receiver_refused_spans``);
* ``EXPORTED_TO_JAEGER``: spans the gateways' ``otlp_grpc/jaeger`` exporter sent during the run
  (``otelcol_exporter_sent_spans``), counted once every decision has been taken;
* ``IN_JAEGER``: spans of the run's service that Jaeger's query API returns;
* ``GATEWAY_CPU_PERCENT``: the busiest gateway's CPU time over the steady part of the run (from
  ``decision_wait`` after the first span, when it both takes in and decides, to the last span
  sent; the whole sending time when that is under 5 s), in percent of one core, read from
  ``/proc/<pid>/stat``;
* ``GATEWAY_RSS_MB``: the busiest gateway's peak resident memory during the run
  (``/proc/<pid>/status``, sampled every 0.25 s), MiB;
* ``HELD_TRACES_PEAK``: the most traces the busiest gateway held for their decision at once
  (``otelcol_processor_tail_sampling_sampling_traces_on_memory``, read every 0.25 s).

On stderr: what was offered against what was asked, the gateways' memory before the run, and the
check of every trace in Jaeger (each has its request span; a trace with step spans has all of
them). Exit status 1 when a trace in Jaeger is partial or a request span that the gateways
accepted is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Dict, List, Optional

STEP_NAMES = ("prefill", "decode")
PROMPT_TOKENS = 16
MODEL_NAME = "meta-llama/Llama-3.1-8B-Instruct"
SLOW_STEP_S = 0.3
SAMPLE_INTERVAL_S = 0.25
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# =============================================================================================
# The traces
# =============================================================================================


def _record(steps: int, fail_at: Optional[int]):
    """One instrumented generate() on a tiny model: the spans this package emitted (SDK spans)."""
    import torch
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from transformers import StoppingCriteria, StoppingCriteriaList

    from otel_generate import GenerateInstrumentor
    from otel_generate.bench.models import VOCAB_SIZE, build_model

    class FailAtStep(StoppingCriteria):
        def __init__(self, step: int) -> None:
            self.step, self.calls = step, 0

        def __call__(self, input_ids, scores, **kwargs):
            self.calls += 1
            if self.calls == self.step:
                raise RuntimeError("injected failure (collector/loadtest.py)")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "loadtest"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    model = build_model("gpt2", seed=0, max_positions=PROMPT_TOKENS + steps)
    model.config._name_or_path = MODEL_NAME
    ids = torch.randint(1, VOCAB_SIZE - 1, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    if fail_at is not None:
        kwargs["stopping_criteria"] = StoppingCriteriaList([FailAtStep(fail_at)])
    instrumentor = GenerateInstrumentor()
    # no step flagged an outlier: the spans do not depend on how busy the machine was
    instrumentor.instrument(tracer_provider=provider, max_step_spans=steps, outlier_factor=1e9)
    try:
        model.generate(ids, eos_token_id=None, **kwargs)
    except RuntimeError:
        if fail_at is None:
            raise
    finally:
        provider.force_flush()
        instrumentor.uninstrument()
        provider.shutdown()
    return list(exporter.get_finished_spans())


@dataclass
class Template:
    """One trace as OTLP spans (protobuf), with what a copy needs."""

    kind: str
    spans: list  # opentelemetry.proto.trace.v1.trace_pb2.Span
    parent_index: List[Optional[int]]  # index of each span's parent in ``spans``, or None
    end_ns: int  # the trace's last end time
    steps: int = 0
    errors: bool = False


def templates(steps: int) -> Dict[str, Template]:
    """``normal``, ``error`` and ``slow`` traces from real generate() calls."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    def build(kind: str, sdk_spans) -> Template:
        request = encode_spans(sdk_spans)
        (resource_spans,) = request.resource_spans
        spans = [span for scope in resource_spans.scope_spans for span in scope.spans]
        index = {span.span_id: i for i, span in enumerate(spans)}
        parents = [index.get(span.parent_span_id) if span.parent_span_id else None for span in spans]
        step_spans = [s for s in spans if s.name in STEP_NAMES]
        return Template(
            kind=kind,
            spans=spans,
            parent_index=parents,
            end_ns=max(s.end_time_unix_nano for s in spans),
            steps=len(step_spans),
            errors=any(s.status.code == 2 for s in spans),
        )

    normal = build("normal", _record(steps, None))
    error = build("error", _record(steps, max(1, steps // 2)))
    slow = build("slow", _record(steps, None))
    decodes = [s for s in slow.spans if s.name == "decode"]
    if decodes:  # one stalled decode step: the slow-decode-step policy's case
        decodes[len(decodes) // 2].end_time_unix_nano = decodes[len(decodes) // 2].start_time_unix_nano + int(
            SLOW_STEP_S * 1e9
        )
        slow.end_ns = max(s.end_time_unix_nano for s in slow.spans)
    assert not normal.errors and error.errors, "the error template must be the only failed one"
    return {t.kind: t for t in (normal, error, slow)}


def resource_proto(service: str):
    from opentelemetry.exporter.otlp.proto.common._internal import _encode_resource
    from opentelemetry.sdk.resources import Resource

    return _encode_resource(Resource.create({"service.name": service}))


class TraceFactory:
    """Copies of the templates with new ids and timestamps, in the shares asked."""

    def __init__(self, templates: Dict[str, Template], error_share: float, slow_share: float, seed: int) -> None:
        import random

        self.templates = templates
        self.error_share, self.slow_share = error_share, slow_share
        self.random = random.Random(seed)
        self.counts = {kind: 0 for kind in templates}

    def kind(self) -> str:
        draw = self.random.random()
        if draw < self.error_share:
            return "error"
        if draw < self.error_share + self.slow_share:
            return "slow"
        return "normal"

    def add_trace(self, scope_spans, now_ns: int) -> Template:
        """Append one trace's spans to ``scope_spans.spans``; returns its template."""
        template = self.templates[self.kind()]
        self.counts[template.kind] += 1
        shift = now_ns - template.end_ns
        trace_id = os.urandom(16)
        ids = os.urandom(8 * len(template.spans))
        span_ids = [ids[8 * i : 8 * i + 8] for i in range(len(template.spans))]
        out = scope_spans.spans
        for i, source in enumerate(template.spans):
            span = out.add()
            span.CopyFrom(source)
            span.trace_id = trace_id
            span.span_id = span_ids[i]
            parent = template.parent_index[i]
            span.parent_span_id = span_ids[parent] if parent is not None else b""
            span.start_time_unix_nano = source.start_time_unix_nano + shift
            span.end_time_unix_nano = source.end_time_unix_nano + shift
        return template


# =============================================================================================
# The gateways: /proc and their own metrics
# =============================================================================================


def _metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (Prometheus text format)."""
    total = 0.0
    pattern = re.compile(rf"^{re.escape(name)}(?:_total)?(\{{[^}}]*\}})?\s+(\S+)$", re.M)
    for match in pattern.finditer(text):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
    return total


@dataclass
class Gateway:
    name: str
    pid: int
    metrics_url: str
    rss_peak: int = 0
    held_peak: float = 0
    samples: list = field(default_factory=list)  # (time, cpu seconds)

    def cpu_s(self) -> float:
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime

    def rss(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def scrape(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as response:
            return response.read().decode()

    def counters(self) -> Dict[str, float]:
        text = self.scrape()
        return {
            "accepted": _metric(text, "otelcol_receiver_accepted_spans", receiver="otlp"),
            "refused": _metric(text, "otelcol_receiver_refused_spans", receiver="otlp"),
            "exported": _metric(text, "otelcol_exporter_sent_spans", exporter="otlp_grpc/jaeger"),
            "export_failed": _metric(text, "otelcol_exporter_send_failed_spans", exporter="otlp_grpc/jaeger"),
            "held": _metric(text, "otelcol_processor_tail_sampling_sampling_traces_on_memory"),
            "dropped_too_early": _metric(text, "otelcol_processor_tail_sampling_sampling_trace_dropped_too_early"),
        }

    def sample(self) -> None:
        self.samples.append((time.monotonic(), self.cpu_s()))
        self.rss_peak = max(self.rss_peak, self.rss())
        try:
            self.held_peak = max(self.held_peak, self.counters()["held"])
        except (OSError, urllib.error.URLError):
            pass

    def cpu_percent(self, start: float, end: float) -> float:
        def at(t: float) -> float:  # CPU seconds at time t, from the nearest samples
            return min(self.samples, key=lambda s: abs(s[0] - t))[1]

        return 100.0 * (at(end) - at(start)) / max(end - start, 1e-9)


class Sampler(threading.Thread):
    def __init__(self, gateways: List[Gateway]) -> None:
        super().__init__(daemon=True)
        self.gateways, self.halt = gateways, threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            for gateway in self.gateways:
                gateway.sample()
            self.halt.wait(SAMPLE_INTERVAL_S)


# =============================================================================================
# Jaeger
# =============================================================================================


def jaeger_traces(url: str, service: str, start_us: int, limit: int) -> list:
    query = urllib.parse.urlencode(
        {"service": service, "start": start_us, "end": int(time.time() * 1e6) + 60_000_000, "limit": limit}
    )
    try:
        with urllib.request.urlopen(f"{url}/api/traces?{query}", timeout=300) as response:
            return json.load(response)["data"] or []
    except urllib.error.HTTPError as exc:
        if exc.code == 404:  # the service is not there (yet)
            return []
        raise


def traces_sent(batches: list, spans_sent: int) -> int:
    """Traces in the export requests that were sent (the first ones, ``spans_sent`` spans)."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    traces, spans = set(), 0
    for payload, n in batches:
        if spans >= spans_sent:
            break
        request = trace_service_pb2.ExportTraceServiceRequest.FromString(payload)
        traces |= {s.trace_id for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans}
        spans += n
    return len(traces)


def check_traces(traces: list, expected_steps: Dict[str, int]) -> dict:
    """Every trace: one request span; step spans all (of its kind's count) or none."""
    report = {"traces": len(traces), "kept": 0, "partial": [], "no_request_span": []}
    for trace in traces:
        spans = trace["spans"]
        requests = [s for s in spans if s["operationName"].startswith("text_completion ")]
        steps = [s for s in spans if s["operationName"] in STEP_NAMES]
        if len(requests) != 1:
            report["no_request_span"].append(trace["traceID"])
            continue
        tags = {t["key"]: t["value"] for t in requests[0].get("tags", [])}
        total = tags.get("generate.steps")
        if steps:
            report["kept"] += 1
            if len(steps) != total or len({s["spanID"] for s in steps}) != len(steps):
                report["partial"].append((trace["traceID"], len(steps), total))
    return report


# =============================================================================================
# The run
# =============================================================================================


def run(args) -> int:
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    from otel_generate import __version__

    print(f"loadtest: recording the template traces ({args.steps} steps)", file=sys.stderr)
    factory = TraceFactory(templates(args.steps), args.error_share, args.slow_share, args.seed)
    spans_per = {kind: len(t.spans) for kind, t in factory.templates.items()}
    resource = resource_proto(args.service)
    gateways = []
    for spec in args.gateway:
        name, pid, url = spec.split(",")
        gateways.append(Gateway(name, int(pid), url))
    before = {g.name: g.counters() for g in gateways}
    rss_before = {g.name: g.rss() for g in gateways}

    # every export request built before the clock starts, so that sending costs the generator
    # little beside the gateway on a small machine
    batches = []
    total = int(args.rate * args.seconds) + args.batch_spans
    built = 0
    now_ns = time.time_ns()
    while built < total:
        request = trace_service_pb2.ExportTraceServiceRequest()
        resource_spans = request.resource_spans.add()
        resource_spans.resource.CopyFrom(resource)
        scope_spans = resource_spans.scope_spans.add()
        scope_spans.scope.name = "otel_generate"
        scope_spans.scope.version = __version__
        n = 0
        while n < args.batch_spans:
            n += len(factory.add_trace(scope_spans, now_ns).spans)
        batches.append((request.SerializeToString(), n))
        built += n
    print(f"loadtest: {len(batches)} export requests of about {args.batch_spans} spans built", file=sys.stderr)

    compression = grpc.Compression.Gzip if args.compression == "gzip" else grpc.Compression.NoCompression
    exports = []
    for number in range(args.channels):  # connections of their own (a channel option tells them apart)
        channel = grpc.insecure_channel(
            args.target.removeprefix("http://"), compression=compression, options=[("loadtest.channel", number)]
        )
        grpc.channel_ready_future(channel).result(timeout=30)
        exports.append(
            channel.unary_unary(
                "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
                request_serializer=lambda payload: payload,  # already serialized
                response_deserializer=trace_service_pb2.ExportTraceServiceResponse.FromString,
            )
        )

    lock = threading.Lock()
    counts = {"sent": 0, "accepted": 0, "refused": 0, "errors": {}}
    in_flight = threading.Semaphore(args.in_flight)

    def answered(future, n: int) -> None:
        with lock:
            counts["sent"] += n
            try:
                response = future.result()
                rejected = response.partial_success.rejected_spans if response.HasField("partial_success") else 0
                counts["accepted"] += n - rejected
                counts["refused"] += rejected
            except grpc.RpcError as error:
                counts["refused"] += n
                code = error.code().name
                counts["errors"][code] = counts["errors"].get(code, 0) + 1
        in_flight.release()

    sampler = Sampler(gateways)
    for gateway in gateways:
        gateway.sample()
    sampler.start()
    start_wall_us = int(time.time() * 1e6)
    start = time.monotonic()
    own_cpu = time.process_time()
    end = start + args.seconds
    offered = 0
    blocked_s = 0.0
    for number, (payload, n) in enumerate(batches):
        now = time.monotonic()
        if now >= end:
            break
        due = start + offered / args.rate
        if due > now:
            time.sleep(due - now)
            if time.monotonic() >= end:
                break
        waited = time.monotonic()
        in_flight.acquire()
        blocked_s += time.monotonic() - waited
        future = exports[number % len(exports)].future(payload, timeout=args.request_timeout)
        future.add_done_callback(lambda f, n=n: answered(f, n))
        offered += n
    sent_end = time.monotonic()
    own_cpu = time.process_time() - own_cpu
    for _ in range(args.in_flight):  # every request answered
        in_flight.acquire()
    print(
        f"loadtest: offered {offered} spans in {sent_end - start:.1f} s ({offered / (sent_end - start):.0f} spans/s"
        f" for {args.rate:g} asked; {blocked_s:.1f} s waiting on {args.in_flight} requests in flight;"
        f" the generator used {100 * own_cpu / (sent_end - start):.0f} % of a core);"
        f" traces built {factory.counts}; receiver errors {counts['errors'] or 'none'}",
        file=sys.stderr,
    )

    # the steady part: taking in and deciding, from decision_wait after the start
    steady_start = start + args.decision_wait if args.seconds - args.decision_wait >= 5 else start

    # every decision taken (decision_wait after the last span), then the gateways' batches
    def exported_total() -> float:
        return sum(g.counters()["exported"] - before[g.name]["exported"] for g in gateways)

    time.sleep(max(0.0, sent_end + args.decision_wait + 3 - time.monotonic()))
    last, stable_since = exported_total(), time.monotonic()
    deadline = time.monotonic() + args.settle_timeout
    while time.monotonic() - stable_since < 3 and time.monotonic() < deadline:
        time.sleep(0.5)
        value = exported_total()
        if value != last:
            last, stable_since = value, time.monotonic()
    sampler.halt.set()
    sampler.join()
    after = {g.name: g.counters() for g in gateways}
    delta = {
        key: sum(after[g.name][key] - before[g.name][key] for g in gateways)
        for key in ("accepted", "refused", "exported", "export_failed", "dropped_too_early")
    }
    busiest = max(gateways, key=lambda g: after[g.name]["accepted"] - before[g.name]["accepted"])

    # Jaeger: until it holds what the gateways exported (its writes follow the export)
    sent_traces = traces_sent(batches, counts["sent"])
    traces, in_jaeger = [], 0
    deadline = time.monotonic() + args.settle_timeout
    while True:
        traces = jaeger_traces(args.jaeger, args.service, start_wall_us - 60_000_000, sent_traces + 100)
        in_jaeger = sum(len(t["spans"]) for t in traces)
        if in_jaeger >= delta["exported"] or time.monotonic() > deadline:
            break
        time.sleep(1)
    expected_steps = {kind: t.steps for kind, t in factory.templates.items()}
    report = check_traces(traces, expected_steps)

    refused = counts["refused"] + (delta["refused"] if args.scale else 0)
    print(f"SENT={counts['sent']}")
    print(f"ACCEPTED={counts['accepted']}")
    print(f"REFUSED={refused:.0f}")
    print(f"EXPORTED_TO_JAEGER={delta['exported']:.0f}")
    print(f"IN_JAEGER={in_jaeger}")
    print(f"GATEWAY_CPU_PERCENT={busiest.cpu_percent(steady_start, sent_end):.1f}")
    print(f"GATEWAY_RSS_MB={busiest.rss_peak / 2**20:.1f}")
    print(f"HELD_TRACES_PEAK={busiest.held_peak:.0f}")
    sys.stdout.flush()

    request_spans_expected = sent_traces if refused == 0 else None
    held = busiest.held_peak
    per_trace = (busiest.rss_peak - rss_before[busiest.name]) / held if held else float("nan")
    took_in = after[busiest.name]["accepted"] - before[busiest.name]["accepted"]
    rss_from, rss_to = rss_before[busiest.name] / 2**20, busiest.rss_peak / 2**20
    print(
        f"loadtest: {busiest.name} (the busiest) took in {took_in:.0f}"
        f" spans; its RSS went from {rss_from:.1f} to {rss_to:.1f} MiB at a peak of"
        f" {held:.0f} held traces ({per_trace / 1024:.1f} KiB of RSS per held trace of {spans_per['normal']} spans);"
        f" traces sent {sent_traces} ({spans_per} spans each), in Jaeger {report['traces']}, kept whole"
        f" {report['kept'] - len(report['partial'])}, partial {len(report['partial'])}, without their request span"
        f" {len(report['no_request_span'])}; gateway exports failed {delta['export_failed']:.0f},"
        f" traces dropped before their decision {delta['dropped_too_early']:.0f}",
        file=sys.stderr,
    )
    problems = []
    if report["partial"]:
        problems.append(f"partial traces in Jaeger (trace, step spans, of): {report['partial'][:10]}")
    if report["no_request_span"]:
        problems.append(f"traces without one request span: {report['no_request_span'][:10]}")
    if request_spans_expected is not None and report["traces"] != request_spans_expected:
        problems.append(f"{report['traces']} traces in Jaeger for {request_spans_expected} sent and accepted")
    for problem in problems:
        print(f"loadtest: {problem}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "counts": counts,
                    "delta": delta,
                    "traces": factory.counts,
                    "spans_per_trace": spans_per,
                    "rss_before": rss_before,
                    "service": args.service,
                    "offered_rate": offered / (sent_end - start),
                    "report": {k: v if isinstance(v, int) else len(v) for k, v in report.items()},
                },
                f,
                indent=2,
            )
    return 1 if problems else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="OTLP/gRPC endpoint the spans are sent to")
    parser.add_argument("--gateway", action="append", required=True, help="NAME,PID,METRICS_URL of a gateway")
    parser.add_argument("--jaeger", required=True, help="Jaeger's query URL")
    parser.add_argument("--scale", action="store_true", help="the target is the agent")
    parser.add_argument("--rate", type=float, required=True, help="spans per second")
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--error-share", type=float, default=0.01)
    parser.add_argument("--slow-share", type=float, default=0.01)
    parser.add_argument("--batch-spans", type=int, default=512)
    parser.add_argument("--in-flight", type=int, default=10)
    parser.add_argument("--compression", choices=("gzip", "none"), default="gzip")
    parser.add_argument("--channels", type=int, default=1)
    parser.add_argument("--request-timeout", type=float, default=10.0)
    parser.add_argument("--decision-wait", type=float, default=10.0)
    parser.add_argument("--settle-timeout", type=float, default=120.0)
    parser.add_argument("--service", default=f"otel-generate-loadtest-{int(time.time())}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the run's details to this file")
    args = parser.parse_args(argv)
    if args.rate <= 0 or args.seconds <= 0 or args.steps < 2:
        parser.error("--rate and --seconds must be positive, --steps at least 2")
    if not 0 <= args.error_share + args.slow_share <= 1:
        parser.error("--error-share and --slow-share must be shares (their sum at most 1)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
