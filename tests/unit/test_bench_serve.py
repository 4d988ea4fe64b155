"""``otel-generate bench --serve`` without a model: the offered loads, a window's figures and the paired
comparison (checked against numpy), the /proc readers, the OTLP sink (real protobuf requests over HTTP),
the HTTP load generator against a local stand-in server that streams server-sent events, the in-process
driver against a stand-in manager, and the command line's errors. No timing claim: counts, order and
arithmetic."""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy
import pytest
import torch

from otel_generate.bench import load, procstat, sink
from otel_generate.bench.cli import main
from otel_generate.bench.load import Level, Record
from tests.helpers.bench import run_cli

# --------------------------------------------------------------------------------------------
# Offered loads
# --------------------------------------------------------------------------------------------


def test_rates_are_fractions_of_saturation_absolute_rates_or_none():
    assert load.parse_rates("0.5, 0.7") == [Level("saturation"), Level("rate", 0.5), Level("rate", 0.7)]
    assert load.parse_rates("20/s,0.25") == [Level("saturation"), Level("rate", None, 20.0), Level("rate", 0.25)]
    assert load.parse_rates("none") == [Level("saturation")]
    resolved = [lv.resolved(40.0) for lv in load.parse_rates("0.5,3/s")]
    assert [lv.rps for lv in resolved] == [None, 20.0, 3.0]
    assert [lv.label for lv in resolved] == ["saturation", "rate 0.5x", "rate 3/s"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("fast", "'fast' is not a fraction"),
        ("0", "must be above 0"),
        ("-2/s", "must be above 0"),
        ("2.5", "above 2 times the saturation throughput"),
        ("0.5,0.5", "given twice"),
        ("nan", "must be above 0"),
    ],
)
def test_bad_rates_are_refused(text, message):
    with pytest.raises(ValueError, match=message):
        load.parse_rates(text)


def test_poisson_arrivals_repeat_with_their_seed_and_keep_to_their_window():
    first = load.poisson_arrivals(50.0, -1.0, 100.0, seed=7)
    assert first == load.poisson_arrivals(50.0, -1.0, 100.0, seed=7)
    assert first != load.poisson_arrivals(50.0, -1.0, 100.0, seed=8)
    assert first == sorted(first) and -1.0 < first[0] and first[-1] < 100.0
    # exponential gaps of mean 1/50 s: 5,050 expected over 101 s, within 5 standard deviations (sqrt(5050) = 71)
    assert abs(len(first) - 5050) < 5 * 71
    gaps = numpy.diff(first)
    assert abs(gaps.mean() - 0.02) < 0.002


def test_the_open_loop_schedule_marks_the_window_between_its_arrivals():
    events = load.schedule([-0.5, 0.0, 1.0, 2.5], 2.0)
    assert events == [(-0.5, "send"), (0.0, "start"), (0.0, "send"), (1.0, "send"), (2.0, "end"), (2.5, "send")]


# --------------------------------------------------------------------------------------------
# A window's figures and the paired comparison
# --------------------------------------------------------------------------------------------


def _records():
    return [
        Record(sent=9.0, token_times=[9.5, 10.2, 10.4], finished=10.4, tokens=3),  # sent before the window
        Record(sent=10.0, token_times=[10.1, 10.3, 10.6], finished=10.6, tokens=3),
        Record(sent=10.5, token_times=[10.9, 10.9, 11.5], finished=11.5, tokens=3),  # two tokens in one chunk
        Record(sent=11.0, token_times=[11.2, 11.9], finished=12.5, tokens=2),  # its last token after the window
        Record(sent=11.5, error="HTTP 500: boom"),
        Record(sent=11.8, token_times=[11.95]),  # unfinished by the end of the drain
        Record(sent=12.0, token_times=[12.1, 12.2, 12.3], finished=12.3, tokens=3),  # after the window
    ]


def test_window_figures_count_inside_the_window_and_follow_the_requests_sent_in_it():
    cpu = {"process": (100.0, 101.5), "emitter": (4.0, 4.3), "server": (1.0, None), "client": None}
    figures = load.window_figures(_records(), 10.0, 12.0, requested_tokens=3, cpu=cpu)
    assert figures["duration_s"] == 2.0
    assert figures["requests_sent"] == 5
    assert figures["requests_completed"] == 3
    assert figures["requests_failed"] == 1 and figures["first_error"] == "HTTP 500: boom"
    assert figures["requests_unfinished"] == 1
    assert figures["token_count_mismatches"] == 1  # the one that generated 2 of 3
    assert figures["streamed_count_mismatches"] == 0
    # tokens received in [10, 12): 2 of the first request, 3, 3, 2 and 1 of the others
    assert figures["tokens_in_window"] == 2 + 3 + 3 + 2 + 1
    assert figures["tokens_per_s"] == 11 / 2.0
    assert figures["requests_completed_in_window"] == 3  # finished at 10.4, 10.6, 11.5
    ttft = [0.1, 0.4, 0.2, 0.15]
    itl = [0.2, 0.3, 0.0, 0.6, 0.7]
    e2e = [0.6, 1.0, 1.5]
    for name, values in (("ttft", ttft), ("itl", itl), ("e2e", e2e)):
        for q in (50, 99):
            assert figures[f"{name}_p{q}_ms"] == pytest.approx(numpy.percentile(values, q) * 1e3)
    assert figures["latency_samples"] == {"ttft": 4, "itl": 5, "e2e": 3}
    assert figures["process_cpu"] == pytest.approx(0.75)
    assert figures["emitter_cpu"] == pytest.approx(0.15)
    assert figures["emitter_cpu_share"] == pytest.approx(0.2)
    assert figures["server_cpu"] is None and figures["client_cpu"] is None


def test_an_empty_window_is_refused_and_a_quiet_one_has_no_latencies():
    with pytest.raises(ValueError, match="more than 0 s"):
        load.window_figures([], 5.0, 5.0, 3)
    quiet = load.window_figures([], 5.0, 6.0, 3)
    assert quiet["tokens_per_s"] == 0 and quiet["ttft_p99_ms"] is None and quiet["emitter_cpu_share"] is None


def _round(pair, level, side, tokens_per_s, itl_p99, dropped=None):
    figures = load.window_figures([], 0.0, 1.0, 3)
    figures.update(tokens_per_s=tokens_per_s, itl_p99_ms=itl_p99)
    return {"pair": pair, "level": level, "side": side, "figures": figures, "dropped_requests": dropped}


def test_levels_pair_the_rounds_and_give_each_side_and_the_ratio_with_its_spread():
    levels = [Level("saturation"), Level("rate", 0.5, 10.0)]
    rounds = [
        _round(0, 0, "plain", 100.0, 10.0),
        _round(0, 0, "instrumented", 80.0, 12.0, dropped=0),
        _round(1, 0, "plain", 120.0, 20.0),
        _round(1, 0, "instrumented", 90.0, 30.0, dropped=2),
        _round(2, 0, "plain", 110.0, 10.0),
        _round(2, 0, "instrumented", 99.0, 11.0, dropped=0),
        _round(0, 1, "plain", 50.0, 5.0),  # its instrumented round is missing: no pair
    ]
    saturation, rate = load.compare_levels(rounds, levels)
    assert saturation["pairs"] == 3 and rate["pairs"] == 0
    assert saturation["plain"]["tokens_per_s"] == [100.0, 120.0, 110.0]
    ratios = [0.8, 0.75, 0.9]
    assert saturation["ratios"]["tokens_per_s"] == pytest.approx(ratios)
    assert saturation["ratios"]["median_tokens_per_s"] == pytest.approx(statistics.median(ratios))
    assert saturation["ratios"]["iqr_tokens_per_s"] == pytest.approx(numpy.percentile(ratios, [25, 75]).tolist())
    assert saturation["ratios"]["itl_p99_ms"] == pytest.approx([1.2, 1.5, 1.1])
    assert saturation["ratios"]["ttft_p50_ms"] == [None, None, None]  # no latencies in these windows
    assert saturation["dropped_requests"] == [0, 2, 0] and saturation["dropped_requests_total"] == 2
    assert rate["offered_rps"] == 10.0 and rate["label"] == "rate 0.5x"


# --------------------------------------------------------------------------------------------
# /proc
# --------------------------------------------------------------------------------------------


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux's /proc")
def test_proc_readers_find_the_emitter_thread_by_name_and_read_cpu_time():
    from otel_generate.background import BackgroundEmitter

    pid = os.getpid()
    before = procstat.process_cpu_s(pid)
    mine = procstat.thread_cpu_s(pid, threading.get_native_id())
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:  # 50 ms of CPU on this thread
        pass
    assert procstat.process_cpu_s(pid) > before and procstat.thread_cpu_s(pid, threading.get_native_id()) > mine
    emitter = BackgroundEmitter()
    native = []
    assert emitter.submit(lambda: native.append(threading.get_native_id()))
    assert emitter.drain(5.0)
    # (emitters of earlier tests may still be alive in this process)
    assert native[0] in procstat.find_threads(pid) and procstat.EMITTER_COMM == "otel_generate-e"
    assert threading.get_native_id() not in procstat.find_threads(pid)
    emitter.stop(5.0)
    assert procstat.process_cpu_s(2**22 + 12345) is None and procstat.find_thread(2**22 + 12345) is None
    child = __import__("subprocess").Popen(["sleep", "5"])
    try:
        assert child.pid in procstat.children(pid) and procstat.command_line(child.pid) == ["sleep", "5"]
    finally:
        child.kill()
        child.wait()


# --------------------------------------------------------------------------------------------
# The OTLP sink
# --------------------------------------------------------------------------------------------


def _trace_request(spans):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    for index in range(spans):
        scope.spans.add(name=f"span {index}", trace_id=bytes(16), span_id=bytes(8))
    return request.SerializeToString()


def _metrics_request(pid, dropped, recorded):
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    from otel_generate.attributes import METRIC_EMITTER_DROPPED, METRIC_REQUEST_DURATION

    request = ExportMetricsServiceRequest()
    resource = request.resource_metrics.add()
    resource.resource.attributes.add(key="process.pid").value.int_value = pid
    scope = resource.scope_metrics.add()
    counter = scope.metrics.add(name=METRIC_EMITTER_DROPPED)
    counter.sum.is_monotonic = True
    counter.sum.data_points.add(as_int=dropped).attributes.add(key="gen_ai.operation.name").value.string_value = "x"
    histogram = scope.metrics.add(name=METRIC_REQUEST_DURATION)
    histogram.histogram.data_points.add(count=recorded)
    scope.metrics.add(name="something.else").sum.data_points.add(as_int=99)
    return request.SerializeToString()


def _post(url, body):
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/x-protobuf"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status


def test_the_sink_counts_spans_and_keeps_each_process_cumulative_counters():
    server, _counts = sink.make_server()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        traces = [_trace_request(3), _trace_request(4)]
        for body in traces:
            assert _post(f"{base}/v1/traces", body) == 200
        # cumulative: the later export of a stream holds its total; two processes apart
        for body in (_metrics_request(41, 2, 10), _metrics_request(41, 5, 17), _metrics_request(42, 0, 3)):
            assert _post(f"{base}/v1/metrics", body) == 200
        with pytest.raises(urllib.error.HTTPError) as refused:
            _post(f"{base}/v1/traces", b"\xff\xff not protobuf")
        assert refused.value.code == 400
        with pytest.raises(urllib.error.HTTPError) as unknown:
            _post(f"{base}/v1/profiles", b"")
        assert unknown.value.code == 404
        with urllib.request.urlopen(f"{base}/stats", timeout=10) as response:
            stats = json.load(response)
    finally:
        server.shutdown()
        server.server_close()
    assert stats["traces"] == {"requests": 2, "bytes": sum(len(b) for b in traces), "spans": 7}
    assert stats["metrics"]["requests"] == 3
    assert stats["processes"] == {
        "41": {"dropped_requests": 5, "requests_recorded": 17},
        "42": {"dropped_requests": 0, "requests_recorded": 3},
    }


# --------------------------------------------------------------------------------------------
# The HTTP load generator, against a stand-in server
# --------------------------------------------------------------------------------------------


class _Streaming(BaseHTTPRequestHandler):
    """Streams ``max_tokens`` one-character tokens as server-sent events, two to a chunk after the first
    (as transformers serve joins a stream that fell behind), then the finish and the usage chunks."""

    protocol_version = "HTTP/1.0"  # the body ends when the connection closes
    bodies: list = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        tokens = body["max_tokens"]
        texts = ["a"] + ["bc"] * ((tokens - 1) // 2) + (["d"] if (tokens - 1) % 2 else [])

        def send(chunk):
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()

        for text in texts:
            send({"choices": [{"index": 0, "text": text}]})
            time.sleep(0.002)
        send({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        send({"choices": [], "usage": {"completion_tokens": tokens, "prompt_tokens": 8}})
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


@pytest.fixture
def streaming_server():
    pytest.importorskip("httpx")
    _Streaming.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Streaming)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _driver(base_url, one_character_tokens=True):
    from otel_generate.bench.serve_http import HttpDriver

    snapshots = []

    def snapshot():
        snapshots.append(1)
        return {"process": float(len(snapshots)), "emitter": None, "server": None, "client": None}

    bodies = [json.dumps({"prompt": p, "max_tokens": 5, "stream": True}).encode() for p in ("ab", "cd")]
    return HttpDriver(base_url, bodies, snapshot, one_character_tokens=one_character_tokens), snapshots


def test_the_closed_loop_keeps_its_requests_in_flight_and_counts_every_token(streaming_server):
    driver, snapshots = _driver(streaming_server)
    records, start, end, cpu, warmed = driver.window(Level("saturation"), 3, 6, 0.3, 0.0, [])
    assert start < end and len(snapshots) == 2 and cpu["process"] == (1.0, 2.0)
    assert warmed == sum(1 for r in records if r.sent < start) >= 6
    assert len(records) > warmed  # some were sent in the window
    assert all(r.error is None and r.finished is not None for r in records)  # every one drained
    assert all(r.tokens == 5 and len(r.token_times) == 5 for r in records)
    # two tokens to a chunk: they arrived together
    assert all(r.token_times[1] == r.token_times[2] and r.token_times[3] == r.token_times[4] for r in records)
    prompts = [b["prompt"] for b in _Streaming.bodies]  # the bodies in turn (received in any order)
    assert len(prompts) == len(records) and prompts.count("ab") == (len(records) + 1) // 2
    figures = load.window_figures(records, start, end, 5, cpu)
    assert figures["token_count_mismatches"] == figures["streamed_count_mismatches"] == 0


def test_the_open_loop_sends_each_arrival_once_and_marks_the_window_between_them(streaming_server):
    driver, snapshots = _driver(streaming_server, one_character_tokens=False)
    arrivals = [-0.1, 0.05, 0.1, 0.15]
    records, start, end, cpu, warmed = driver.window(Level("rate", None, 10.0), 2, 2, 0.2, 0.15, arrivals)
    assert len(records) == warmed + len(arrivals) and warmed >= 2
    measured = records[warmed:]
    assert [start <= r.sent < end for r in measured] == [False, True, True, True]
    assert all(r.sent < start for r in records[:warmed])
    assert len(snapshots) == 2
    # without the bench's tokenizer a chunk counts as one token: 3 chunks of text for 5 tokens
    assert all(r.tokens == 5 and len(r.token_times) == 3 for r in measured)


def test_a_failing_server_gives_failed_requests_not_a_hang(streaming_server):
    from otel_generate.bench.serve_http import HttpDriver

    bodies = [b"not json"]  # the stand-in server cannot parse it: the connection drops
    driver = HttpDriver(streaming_server, bodies, lambda: {}, one_character_tokens=True)
    records, start, end, _cpu, _warmed = driver.window(Level("saturation"), 2, 2, 0.2, 0.0, [])
    assert records and all(r.error is not None and r.finished is None for r in records)
    assert load.window_figures(records, start, end, 5)["requests_failed"] == sum(
        1 for r in records if start <= r.sent < end
    )


# --------------------------------------------------------------------------------------------
# The in-process driver, against a stand-in manager
# --------------------------------------------------------------------------------------------


class _Output:
    def __init__(self, request_id, tokens, finished):
        self.request_id, self.generated_tokens, self._finished, self.error = request_id, tokens, finished, None

    def is_finished(self):
        return self._finished


class _Manager:
    """Adds one token per step (1 ms) to every request it holds, streaming each step's output."""

    def __init__(self):
        import queue

        self.outputs = queue.Queue()
        self.active = {}
        self.added = []
        self.cancelled = []
        self.lock = threading.Lock()
        self.running = True
        threading.Thread(target=self._steps, daemon=True).start()

    def add_request(self, input_ids, request_id, max_new_tokens, streaming, eos_token_id):
        self.added.append((list(input_ids), request_id, max_new_tokens, streaming, eos_token_id))
        with self.lock:
            self.active[request_id] = (max_new_tokens, [])

    def _steps(self):
        while self.running:
            with self.lock:
                for request_id, (limit, tokens) in list(self.active.items()):
                    tokens.append(len(tokens))
                    finished = len(tokens) == limit
                    if finished:
                        del self.active[request_id]
                    self.outputs.put(_Output(request_id, list(tokens), finished))
            time.sleep(0.001)

    def get_result(self, timeout=None):
        import queue

        try:
            return self.outputs.get(timeout=timeout)
        except queue.Empty:
            return None

    def is_running(self):
        return self.running

    def cancel_request(self, request_id):
        self.cancelled.append(request_id)


@pytest.mark.parametrize("level", ["saturation", "rate"])
def test_the_in_process_driver_offers_the_same_load_to_a_manager(level):
    from otel_generate.bench.serve_child import ManagerDriver

    manager = _Manager()
    edges = []
    driver = ManagerDriver(
        manager, [[1, 2], [3, 4, 5]], new_tokens=4, eos=128, snapshot=lambda d: edges.append(1) or {"process": 1.0}
    )
    try:
        arrivals = [-0.05, 0.02, 0.04] if level == "rate" else []
        records, start, end, cpu, warmed = driver.window(level, 3, 3, 0.1, 0.05, arrivals)
    finally:
        driver.close()
        manager.running = False
    assert start < end and len(edges) == 2 and cpu == {"process": (1.0, 1.0)}
    assert all(r.finished is not None and r.tokens == 4 and len(r.token_times) == 4 for r in records)
    assert len(manager.added) == len(records) and not manager.cancelled
    assert {a[2:] for a in manager.added} == {(4, True, 128)}  # max_new_tokens, streaming, EOS off
    prompts = [a[0] for a in manager.added]  # the prompts in turn
    assert prompts.count([1, 2]) == (len(prompts) + 1) // 2 and prompts.count([3, 4, 5]) == len(prompts) // 2
    if level == "rate":
        assert len(records) == warmed + 3
        assert [start <= r.sent < end for r in records[warmed:]] == [False, True, True]


# --------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--in-process"], "--in-process applies to --serve; add --serve"),
        (["--concurrency", "4"], "--concurrency applies to --serve; add --serve"),
        (["--seconds", "3"], "--seconds applies to --serve; add --serve"),
        (["--rates", "0.5"], "--rates applies to --serve; add --serve"),
        (["--serve", "--concurrency", "0"], "--concurrency must be at least 1"),
        (["--serve", "--seconds", "0"], "--seconds must be above 0"),
        (["--serve", "--rates", "fast"], "--rates: 'fast' is not a fraction"),
        (["--serve", "--rates", "0.5,0.5"], "is given twice"),
        (["--serve", "--compare"], "--serve is a mode of its own; drop --compare"),
        (["--serve", "--instructions"], "--serve is a mode of its own; drop --instructions"),
        (["--serve", "--batch-size", "2"], "--batch-size does not apply to --serve"),
        (["--serve", "--requests", "4"], "--requests applies to --continuous-batching's waves"),
        (["--serve", "--exporter", "otlp-encode"], "--exporter applies to --serve --in-process"),
        (["--serve", "--runs", "0"], "--runs must be at least 1"),
        (["--serve", "--plot", "serve.jpg"], "unsupported file extension"),
    ],
)
def test_invalid_serve_options_exit_2_and_write_nothing(tmp_path, capsys, argv, message):
    out = tmp_path / "out.json"
    assert run_cli(*argv, "--output", str(out)) == 2
    err = capsys.readouterr().err
    assert message in err and "otel-generate bench: error:" in err
    assert list(tmp_path.iterdir()) == []


def test_serve_without_cuda_exits_2_before_anything_is_built(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out.json"
    config = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "configs", "llama-20m.json")
    argv = ["--serve", "--continuous-batching", "--device", "cuda", "--model-config", config, "--dtype", "bfloat16"]
    assert run_cli(*argv, "--output", str(out)) == 2
    assert "CUDA was requested but is not available" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_the_dry_run_says_how_many_rounds_and_servers(capsys):
    assert main(["bench", "--serve", "--continuous-batching", "--runs", "3", "--rates", "0.5,20/s", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--serve (HTTP, a fresh server per round, continuous batching): 18 rounds" in out
    assert "(saturation, rate 0.5x, rate 20/s)" in out and "prompt 8 x batch 1, 32 new tokens" in out
    assert main(["bench", "--serve", "--in-process", "--rates", "none", "--dry-run"]) == 0
    assert "--serve (in-process, one process per round, continuous batching): 10 rounds" in capsys.readouterr().out


def test_without_warmup_a_rate_round_sends_only_its_arrivals(streaming_server):
    from otel_generate.bench.serve_child import ManagerDriver

    driver, _snapshots = _driver(streaming_server)
    records, start, end, _cpu, warmed = driver.window(Level("rate", None, 10.0), 3, 0, 0.1, 0.05, [-0.01, 0.02])
    assert warmed == 0 and len(records) == 2 and [start <= r.sent < end for r in records] == [False, True]
    manager = _Manager()
    in_process = ManagerDriver(manager, [[1]], new_tokens=2, eos=None, snapshot=lambda d: {})
    try:
        records, start, end, _cpu, warmed = in_process.window("rate", 3, 0, 0.1, 0.05, [0.02])
    finally:
        in_process.close()
        manager.running = False
    assert warmed == 0 and len(records) == len(manager.added) == 1 and manager.added[0][4] is None
