"""A forked child exports only what it recorded.

The flow of the issue, in a subprocess with the SDK set up in process: 3 requests in the parent,
then a ``torch.utils.data.DataLoader(num_workers=2)`` (fork) for 2 epochs, then
``multiprocessing.get_context("fork").Pool(2, maxtasksperchild=1)`` with 4 generate tasks. Every
process exports to files (one per process) and to an OTLP/gRPC exporter pointed at a closed
loopback port (a collector that is down):

* summed over every process's exports, each ``gen_ai.*`` histogram counts 7 requests (the
  inter-token latency 7 x 7 gaps) and 7 request spans are exported; the parent exports its 3,
  each pool worker its 1, and the DataLoader workers export nothing;
* the 2 epochs take at most 1 s longer instrumented than uninstrumented (before: each DataLoader
  worker spent the exporter's timeout re-sending the parent's requests).

In process: a forked child's copy of this package's histograms is empty, while the parent keeps
its own.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_generate import GenerateInstrumentor
from otel_generate import attributes as A
from otel_generate.integrations import generate_loop
from tests.helpers import prompt

SUBPROCESS_TIMEOUT_S = 420
#: Our exit-flush bound in the pool workers (their OTLP exporter waits on a closed port).
FLUSH_BOUND_S = "2"

FORK_APP = r"""
import json, multiprocessing, os, sys, time

import torch
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, PeriodicExportingMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from otel_generate import GenerateInstrumentor
from otel_generate.bench.models import build_model

MODE, FOLDER, DEAD_PORT = sys.argv[1], sys.argv[2], int(sys.argv[3])
NEVER_MS = 600_000  # nothing is exported before a process exits (or flushes)


class FileSpans(SpanExporter):
    def export(self, spans):
        with open(os.path.join(FOLDER, f"spans-{os.getpid()}.jsonl"), "a") as out:
            for span in spans:
                out.write(json.dumps({"pid": os.getpid(), "name": span.name}) + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass


class FileMetrics(MetricExporter):
    def __init__(self):
        super().__init__(preferred_temporality={}, preferred_aggregation={})

    def export(self, metrics_data, timeout_millis=10_000, **kwargs):
        with open(os.path.join(FOLDER, f"metrics-{os.getpid()}.jsonl"), "a") as out:
            for rm in metrics_data.resource_metrics:
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        points = metric.data.data_points
                        count = sum(p.count for p in points if p.attributes.get("gen_ai.token.type") != "input")
                        out.write(json.dumps({"pid": os.getpid(), "metric": metric.name, "count": count}) + "\n")
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis=10_000):
        return True

    def shutdown(self, timeout_millis=30_000, **kwargs):
        pass


dead = f"127.0.0.1:{DEAD_PORT}"
file_spans = BatchSpanProcessor(FileSpans(), schedule_delay_millis=NEVER_MS)
tracer_provider = TracerProvider()
tracer_provider.add_span_processor(file_spans)
tracer_provider.add_span_processor(
    BatchSpanProcessor(OTLPSpanExporter(endpoint=dead, insecure=True, timeout=10), schedule_delay_millis=NEVER_MS)
)
file_metrics = PeriodicExportingMetricReader(FileMetrics(), export_interval_millis=NEVER_MS)
meter_provider = MeterProvider(
    metric_readers=[
        file_metrics,
        PeriodicExportingMetricReader(
            OTLPMetricExporter(endpoint=dead, insecure=True, timeout=10), export_interval_millis=NEVER_MS
        ),
    ]
)
if MODE == "instrumented":
    GenerateInstrumentor().instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
torch.set_num_threads(1)
model = build_model("gpt2", seed=0)


def generate(seed):
    torch.set_num_threads(1)
    ids = torch.randint(1, 126, (1, 4), generator=torch.Generator().manual_seed(seed))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, eos_token_id=None)
    assert out.shape[-1] == 12
    return os.getpid()


class Items(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        return torch.tensor([index, os.getpid()])


for seed in range(3):
    generate(seed)

loader = torch.utils.data.DataLoader(Items(), batch_size=2, num_workers=2)
loader_pids = set()
started = time.monotonic()
for epoch in range(2):
    for batch in loader:
        loader_pids.update(batch[:, 1].tolist())
epochs_s = time.monotonic() - started

pool_pids = []
if MODE == "instrumented":
    pool = multiprocessing.get_context("fork").Pool(2, maxtasksperchild=1)
    pool_pids = pool.map(generate, range(10, 14), chunksize=1)
    pool.close()
    pool.join()  # the workers exit by themselves and run their exit flush

# the parent exports its own requests to the files once, then leaves without waiting on the dead collector
file_spans.force_flush()
file_metrics.force_flush()
result = {"epochs_s": epochs_s, "loader_pids": sorted(loader_pids), "pool_pids": pool_pids, "pid": os.getpid()}
print("RESULT " + json.dumps(result))
sys.stdout.flush()
os._exit(0)
"""


def _closed_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # closed when the with block ends: connections are refused


def _run(tmp_path, mode, port):
    folder = tmp_path / mode
    folder.mkdir()
    app = tmp_path / "fork_app.py"
    app.write_text(FORK_APP, encoding="utf-8")
    env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", OTEL_EXPORTER_OTLP_TIMEOUT=FLUSH_BOUND_S)
    done = subprocess.run(
        [sys.executable, str(app), mode, str(folder), str(port)],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        env=env,
        cwd=str(tmp_path),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :]), folder


def _lines(folder, kind):
    return [
        json.loads(line) for path in sorted(folder.glob(f"{kind}-*.jsonl")) for line in path.read_text().splitlines()
    ]


def test_forked_children_export_only_what_they_recorded(tmp_path):
    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork start method on this platform")
    port = _closed_port()
    plain, _ = _run(tmp_path, "plain", port)
    result, folder = _run(tmp_path, "instrumented", port)
    loader_pids, pool_pids = set(result["loader_pids"]), result["pool_pids"]
    assert len(loader_pids) == 4  # 2 workers per epoch, new ones each epoch
    assert len(set(pool_pids)) == 4 and not loader_pids & set(pool_pids)  # maxtasksperchild=1

    metrics = _lines(folder, "metrics")
    exporters = {line["pid"] for line in metrics}
    assert not exporters & loader_pids  # the DataLoader workers exported nothing at all
    assert exporters == set(pool_pids) | {result["pid"]}  # the parent and each pool worker
    latency = (
        A.METRIC_REQUEST_DURATION,
        A.METRIC_CLIENT_OPERATION_DURATION,
        A.METRIC_TIME_TO_FIRST_TOKEN,
        A.METRIC_TIME_PER_OUTPUT_TOKEN,
        A.METRIC_TOKEN_USAGE,
    )
    for name in latency:
        by_pid = {}
        for line in metrics:
            if line["metric"] == name:
                by_pid[line["pid"]] = by_pid.get(line["pid"], 0) + line["count"]
        assert sum(by_pid.values()) == 7, (name, by_pid)  # 3 + 4, summed over every process's exports
        assert by_pid == {result["pid"]: 3, **{pid: 1 for pid in pool_pids}}, (name, by_pid)
    gaps = sum(line["count"] for line in metrics if line["metric"] == A.METRIC_INTER_TOKEN_LATENCY)
    assert gaps == 7 * 7

    spans = _lines(folder, "spans")
    requests = [span for span in spans if span["name"].startswith(A.OPERATION_TEXT_COMPLETION + " ")]
    assert len(requests) == 7
    assert not {span["pid"] for span in spans} & loader_pids

    # a collector that is down costs the DataLoader's epochs nothing
    assert result["epochs_s"] <= plain["epochs_s"] + 1.0, (result["epochs_s"], plain["epochs_s"])


# --- in process ----------------------------------------------------------------------------------------


def test_a_forked_child_starts_with_empty_histograms_and_the_parent_keeps_its_own(gpt2):
    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork start method on this platform")
    reader = InMemoryMetricReader()
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(meter_provider=MeterProvider(metric_readers=[reader]))
    try:
        ids, mask = prompt(length=4)
        gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report what it would export, then leave at once
            try:
                from otel_generate import _lifecycle

                data = reader.get_metrics_data()
                names = sorted(
                    m.name
                    for rm in (data.resource_metrics if data else [])
                    for sm in rm.scope_metrics
                    for m in sm.metrics
                )
                os.write(write, json.dumps({"names": names, "recorded": _lifecycle.recorded}).encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            child = json.loads(pipe.read())
        os.waitpid(pid, 0)
    finally:
        instrumentor.uninstrument()
    assert child == {"names": [], "recorded": False}
    data = reader.get_metrics_data()
    counts = {
        m.name: m.data.data_points[0].count
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    }
    assert counts[A.METRIC_REQUEST_DURATION] == 1 and counts[A.METRIC_INTER_TOKEN_LATENCY] == 2


def test_the_fork_reset_leaves_other_instruments_alone():
    from otel_generate import _lifecycle
    from otel_generate.telemetry import create_instruments

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    ours = create_instruments(provider)
    theirs = provider.get_meter("app").create_histogram("app.latency")
    ours[A.METRIC_REQUEST_DURATION].record(0.5, {"a": 1})
    ours[A.METRIC_REQUEST_DURATION].record(0.5, {"a": 2})
    theirs.record(1.0)
    assert _lifecycle.forget_inherited_metrics(ours.values()) == 2
    data = reader.get_metrics_data()
    names = [m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics]
    assert names == ["app.latency"]
    ours[A.METRIC_REQUEST_DURATION].record(0.25)  # recording goes on: a new series
    data = reader.get_metrics_data()
    points = {m.name: m.data.data_points for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert [(p.count, p.sum) for p in points[A.METRIC_REQUEST_DURATION]] == [(1, 0.25)]
    assert _lifecycle.forget_inherited_metrics([object()]) == 0  # not the SDK's: left alone
    provider.shutdown()


def _in_forked_child(work):
    """Run ``work()`` (returning a JSON-able value) in a bare ``os.fork()`` child; its value, or
    ``{"hung": True}`` when the child was still running after 20 s (it is then killed)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            try:
                value = work()
            except BaseException as error:  # said, not mistaken for a hang
                value = {"raised": repr(error)}
            os.write(write, json.dumps(value).encode())
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and os.waitpid(pid, os.WNOHANG) == (0, 0):
        time.sleep(0.01)
    else:
        if time.monotonic() >= deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    return json.loads(text) if text else {"hung": True}


def test_a_forked_child_inherits_no_request_set_up_of_the_parents_other_threads(gpt2, monkeypatch):
    """A parent thread in a request's set-up at the fork does not exist in the child: the child's
    ``uninstrument()`` does not wait for it, and a parent thread holding the set-up lock at the fork
    does not hang the child's ``generate()``."""
    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork start method on this platform")
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(meter_provider=MeterProvider(metric_readers=[InMemoryMetricReader()]))
    telemetry = instrumentor._telemetry
    ids, mask = prompt(length=4)
    entered, release = threading.Event(), threading.Event()
    original = gpt2._prepare_special_tokens

    def waiting(*args, **kwargs):
        entered.set()
        release.wait(30)
        return original(*args, **kwargs)

    def child():
        # torch's intra-op threads do not survive a fork: an earlier test that ran them in this
        # process would leave the child's forward pass waiting on threads that are gone
        import torch

        torch.set_num_threads(1)
        out = gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
        # uninstrument() would wait for no request of another thread (it waits for none here: bound 0)
        alone = generate_loop.wait_for_setups(telemetry, timeout_s=0)
        return {"tokens": out.shape[-1] - 4, "no_other_setup": alone}

    threads = []
    try:
        # 1. another thread is inside a request's set-up at the fork
        monkeypatch.setattr(gpt2, "_prepare_special_tokens", waiting)
        threads.append(
            threading.Thread(
                target=lambda: gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
            )
        )
        threads[-1].start()
        assert entered.wait(30)
        monkeypatch.undo()
        assert len(telemetry.setups) == 1
        in_setup = _in_forked_child(child)
        # 2. another thread holds the set-up lock at the fork
        held = threading.Event()

        def hold():
            with telemetry.setups_changed:
                held.set()
                release.wait(30)

        threads.append(threading.Thread(target=hold))
        threads[-1].start()
        assert held.wait(30)
        lock_held = _in_forked_child(child)
    finally:
        release.set()
        for thread in threads:
            thread.join(30)
        instrumentor.uninstrument()
    assert in_setup == {"tokens": 3, "no_other_setup": True}
    assert lock_held == {"tokens": 3, "no_other_setup": True}  # not {"hung": True}
