"""OpenTelemetry's own off switch, and providers set after ``instrument()``, in fresh interpreters.

* ``OTEL_SDK_DISABLED=true`` under ``opentelemetry-instrument``: the SDK's providers hand out no-op
  tracers and meters, so nothing recorded would go anywhere. With the model reported on a CUDA
  device (faked: ``torch.cuda.synchronize`` counted), a 32-token call reads the clock at most twice
  and never waits for the device, and returns what the plain call returns; one INFO line says why.
  A ``TokenLatencyProfiler`` still gets every step, timed (its latencies are the differences of the
  clock reads it caused).
* A meter provider set after ``instrument()``: the first call (no provider: nothing recorded) is
  not timed; the next, once the provider is set, times every step and its metrics reach the reader.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

INSTRUMENT = pathlib.Path(sys.executable).with_name("opentelemetry-instrument")

COUNTING = textwrap.dedent(
    """
    import json, logging, sys
    import torch
    from opentelemetry.instrumentation.utils import suppress_instrumentation
    from otel_generate import clock
    from otel_generate.bench.models import build_model

    reads, synced = [], []
    real_clock = clock.monotonic_ns

    def counting_clock():
        value = real_clock()
        reads.append(value)
        return value

    clock.monotonic_ns = counting_clock
    clock.devices_of = lambda model: ["cuda:0"]  # the model reported on a CUDA device
    torch.cuda.synchronize = lambda device=None: synced.append(str(device))
    model = build_model("gpt2", seed=0)
    ids = torch.randint(1, 100, (1, 4), generator=torch.Generator().manual_seed(0))

    def call():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, eos_token_id=None)
    """
)

DISABLED = COUNTING + textwrap.dedent(
    """
    out = call()
    result = {"reads": len(reads), "synced": len(synced)}
    from otel_generate import TokenLatencyProfiler
    reads.clear()
    with TokenLatencyProfiler() as profiler:
        again = call()
    (record,) = profiler.records
    result["profiler_steps"] = len(record.step_latencies_s)
    result["profiler_reads"] = reads[:]
    result["profiler_latencies_ns"] = [round(s * 1e9) for s in record.step_latencies_s]
    with suppress_instrumentation():
        plain = call()
    result["same"] = bool(torch.equal(out, plain) and torch.equal(again, plain))
    print("RESULT " + json.dumps(result), flush=True)
    """
)

SET_LATER = COUNTING + textwrap.dedent(
    """
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from otel_generate import GenerateInstrumentor, force_flush
    clock.devices_of = lambda model: ["cpu"]
    GenerateInstrumentor().instrument()
    call()
    result = {"before": len(reads)}
    reads.clear()
    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    call()
    result["after"] = len(reads)
    force_flush(10.0)
    counts = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                counts[m.name] = sum(p.count for p in m.data.data_points if hasattr(p, "count"))
    result["counts"] = counts
    print("RESULT " + json.dumps(result), flush=True)
    """
)


def _run(argv, env, tmp_path):
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :]), done


def _env(**extra):
    env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    return env


def test_otel_sdk_disabled_leaves_the_loop_untimed_and_a_profiler_exact(tmp_path):
    script = tmp_path / "app.py"
    script.write_text(DISABLED, encoding="utf-8")
    result, done = _run(
        [str(INSTRUMENT), sys.executable, str(script)],
        _env(
            OTEL_SDK_DISABLED="true",
            OTEL_TRACES_EXPORTER="console",
            OTEL_METRICS_EXPORTER="console",
            OTEL_LOGS_EXPORTER="none",
            OTEL_LOG_LEVEL="info",
            OTEL_PYTHON_LOG_LEVEL="info",
        ),
        tmp_path,
    )
    assert result["same"] is True
    assert result["reads"] <= 2 and result["synced"] == 0
    # the profiler asks for the figures: every step timed, each latency the difference of two clock reads
    assert result["profiler_steps"] == 32
    reads = result["profiler_reads"]
    steps = [later - earlier for earlier, later in zip(reads, reads[1:])][: len(reads) - 2]
    assert result["profiler_latencies_ns"] == steps
    assert "text_completion" not in done.stdout  # nothing went anywhere


def test_a_meter_provider_set_after_instrument_is_timed_for_at_the_next_call(tmp_path):
    script = tmp_path / "app.py"
    script.write_text(SET_LATER, encoding="utf-8")
    result, _ = _run([sys.executable, str(script)], _env(), tmp_path)
    assert result["before"] == 2  # no provider: start and end only
    assert result["after"] == 2 + 32  # every step, for the latency metrics
    assert result["counts"]["gen_ai.server.request.duration"] == 1
    assert result["counts"]["generate.inter_token_latency"] == 31
