"""Every OpenTelemetry SDK release in the supported range, between the two that CI runs the whole suite on.

CI runs the suite on the floor (1.37.0) and on the newest release. Here, for releases in between that
changed the SDK's metric internals (1.38.0, 1.42.1, 1.44.0), a venv of its own (OpenTelemetry from PyPI,
this package, no torch, no transformers) runs one script, which checks what depends on the SDK:

* ``instrument()`` and the emission of finished requests log nothing (no WARNING, no traceback);
* a DELTA reader collected three times, with two requests before each collection, reads 2 requests
  and 14 inter-token values every time, with the right sums; a cumulative one 2, 4, 6;
* the background emitter is drained by the tracer provider's own ``force_flush``;
* a forked child's DELTA reader reads only its own request, and the parent keeps its own.

Needs the package registry (PyPI), as CI has; the venvs are cached under ``~/.cache/otel-generate``.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CACHE = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "otel-generate" / "sdk-venvs"
RELEASES = ("1.38.0", "1.42.1", "1.44.0")
TIMEOUT_S = 600

SCRIPT = textwrap.dedent(
    r"""
    import io, json, logging, os, sys

    log = io.StringIO()
    logging.basicConfig(stream=log, level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    from opentelemetry.sdk.metrics import Histogram, MeterProvider
    from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from otel_generate import GenerateInstrumentor, attributes as A, emit
    from otel_generate.request import Request

    NS = 1_000_000_000
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    delta = InMemoryMetricReader(preferred_temporality={Histogram: AggregationTemporality.DELTA})
    cumulative = InMemoryMetricReader()
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(  # (no transformers here: its version check is skipped)
        tracer_provider=tracer_provider,
        meter_provider=MeterProvider(metric_readers=[delta, cumulative]),
        skip_dep_check=True,
    )
    telemetry = instrumentor.telemetry


    def request():
        # 8 one-token steps of 1, 2, ..., 8 ms after a 10 ms prefill
        start = 1_000
        ends, at = [], start
        for latency in [10_000_000] + [k * 1_000_000 for k in range(1, 8)]:
            at += latency
            ends.append(at)
        made = Request(model="tiny", start_ns=start, start_wall_ns=1_700_000_000 * NS)
        made.step_ends_ns, made.step_tokens = ends, [1] * 8
        made.end_ns = ends[-1] + 7
        made.input_tokens, made.output_tokens, made.output_tokens_per_sequence = 4, 8, [8]
        made.finish_reasons = ["length"]
        return made


    def run():
        made = request()
        span = emit.start_request_span(telemetry, made.model, start_time=made.start_wall_ns)
        record, deferred = emit.hand_over(telemetry, span, made)
        assert deferred  # the default: the background emitter


    def counts(reader):
        data = reader.get_metrics_data()
        found = {}
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    found[m.name] = [(p.count, round(p.sum, 9)) for p in m.data.data_points]
        return found


    result = {"delta": [], "cumulative": []}
    for _ in range(3):
        run()
        run()
        tracer_provider.force_flush()  # drains the background emitter first
        result["delta"].append(counts(delta))
        result["cumulative"].append(counts(cumulative))
    result["spans"] = len(spans.get_finished_spans())
    run()
    tracer_provider.force_flush()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            run()
            tracer_provider.force_flush()
            os.write(write, json.dumps(counts(delta)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        result["child_delta"] = json.loads(pipe.read())
    os.waitpid(pid, 0)
    result["parent_delta"] = counts(delta)
    instrumentor.uninstrument()
    result["log"] = log.getvalue()
    print(json.dumps(result))
    """
)


def _venv(release: str) -> pathlib.Path:
    """A venv with opentelemetry-sdk ``release`` (and the contrib instrumentation pip pairs with it) and
    this package (no dependencies beyond OpenTelemetry's, wrapt and packaging)."""
    venv = CACHE / release
    python = venv / "bin" / "python"
    marker = venv / "ok"
    if not marker.exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, timeout=TIMEOUT_S)
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run(
            [*pip, f"opentelemetry-api=={release}", f"opentelemetry-sdk=={release}", "opentelemetry-instrumentation"],
            check=True,
            timeout=TIMEOUT_S,
        )
        marker.write_text(release)
    # this checkout, without its dependencies (installed above), every time: the code under test
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps", str(ROOT)],
        check=True,
        timeout=TIMEOUT_S,
        capture_output=True,
    )
    return python


@pytest.mark.slow
@pytest.mark.parametrize("release", RELEASES)
def test_an_sdk_release_in_the_range_is_quiet_and_exact(release, tmp_path):
    python = _venv(release)
    version = subprocess.run(
        [str(python), "-c", "from importlib.metadata import version; print(version('opentelemetry-sdk'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert version == release
    done = subprocess.run([str(python), "-c", SCRIPT], capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["log"] == ""  # no WARNING from instrument(), the emission or the fork
    inter_token_sum = round(sum(k * 1_000_000 for k in range(1, 8)) * 2 / 1e9, 9)
    for collection, (delta, cumulative) in enumerate(zip(result["delta"], result["cumulative"]), 1):
        assert delta["gen_ai.server.request.duration"][0][0] == 2, (release, collection)
        assert delta["generate.inter_token_latency"] == [[14, inter_token_sum]], (release, collection)
        assert cumulative["generate.inter_token_latency"][0][0] == 14 * collection, (release, collection)
        assert cumulative["gen_ai.server.request.duration"][0][0] == 2 * collection, (release, collection)
    assert result["spans"] == 6 * 9  # 6 requests, each a request span and 8 step spans
    # the fork: the child reads its own request only; the parent its own one since the last collection
    assert result["child_delta"]["gen_ai.server.request.duration"][0][0] == 1
    assert result["child_delta"]["generate.inter_token_latency"][0][0] == 7
    assert result["parent_delta"]["gen_ai.server.request.duration"][0][0] == 1
