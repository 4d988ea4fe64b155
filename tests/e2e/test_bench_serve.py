"""``otel-generate bench --serve``, one short round of each kind as a smoke test: over HTTP (two
``transformers serve`` processes, plain then instrumented) and in-process (four child processes). No
timing claim: what was sent, generated, streamed, recorded and exported is checked, each from a source
of its own (the load generator's streams, the server's usage counts, the instrumentation's metrics and
spans as the OTLP sink or the SDK's reader received them)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.bench import run_cli

pytestmark = pytest.mark.slow

pytest.importorskip("transformers.cli.serving", reason="this transformers has no OpenAI-compatible serve")
for _module in ("fastapi", "uvicorn", "httpx", "opentelemetry.exporter.otlp.proto.http", "opentelemetry.proto"):
    pytest.importorskip(_module, reason=f"--serve needs {_module} (the [test] extra)")

NEW_TOKENS = 32
CONCURRENCY = 4
SHORT = ["--runs", "1", "--seconds", "2", "--concurrency", str(CONCURRENCY), "--warmup", "1", "--progress"]
DOCUMENT_KEYS = {
    "mode",
    "variant",
    "batching",
    "versions",
    "command",
    "machine",
    "model",
    "device",
    "parameters",
    "concurrency",
    "prompt_tokens",
    "new_tokens_requested",
    "seconds",
    "runs",
    "offered_rates_rps",
    "plain",
    "instrumented",
    "exporter",
    "rounds",
    "levels",
    "load",
    "warnings",
}
LEVEL_FIGURES = ("tokens_per_s", "requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def _continuous_batching_available():
    try:
        from transformers.generation.continuous_batching import continuous_api
    except ImportError:
        return False
    from otel_generate.instrumentor import missing_hooks

    return not missing_hooks(continuous_api)


def check_round(outcome):
    """Every request of the round finished with the tokens it asked for, streamed one by one."""
    figures = outcome["figures"]
    assert figures["requests_completed"] > 0 and figures["tokens_in_window"] > 0
    assert figures["requests_failed"] == figures["requests_unfinished"] == 0, figures["first_error"]
    assert figures["token_count_mismatches"] == figures["streamed_count_mismatches"] == 0
    assert figures["latency_samples"]["itl"] == figures["requests_completed"] * (NEW_TOKENS - 1)
    assert figures["process_cpu"] > 0
    if outcome["side"] == "plain":
        assert outcome["emitter_thread"] is None and figures["emitter_cpu"] is None
        assert outcome["dropped_requests"] is None
    else:
        assert outcome["emitter_thread"] is not None and figures["emitter_cpu"] > 0
        # the instrumentation recorded every request the load generator sent, warmup included
        assert outcome["requests_recorded"] == outcome["requests_total"]
        # the emitter's counter and its warnings agree (none at this load)
        assert outcome["dropped_requests"] == outcome["dropped_requests_logged"] == 0


def check_levels(doc):
    for level in doc["levels"]:
        assert level["pairs"] == 1
        rounds = {r["side"]: r for r in doc["rounds"] if r["label"] == level["label"]}
        for name in LEVEL_FIGURES:
            plain, instrumented = rounds["plain"]["figures"][name], rounds["instrumented"]["figures"][name]
            assert level["plain"][f"median_{name}"] == plain
            assert level["instrumented"][f"median_{name}"] == instrumented
            if plain:
                assert level["ratios"][name] == [pytest.approx(instrumented / plain)]


def test_serve_over_http_one_short_round_of_each_side(tmp_path, capsys):
    out, plot = tmp_path / "serve.json", tmp_path / "serve.png"
    argv = ["--serve", "--continuous-batching", *SHORT, "--rates", "none", "--output", str(out), "--plot", str(plot)]
    assert run_cli(*argv) == 0
    doc = json.loads(out.read_text())
    assert DOCUMENT_KEYS <= set(doc)
    assert (doc["mode"], doc["variant"], doc["batching"]) == ("serve", "http", "continuous")
    assert [(r["side"], r["label"]) for r in doc["rounds"]] == [("plain", "saturation"), ("instrumented", "saturation")]
    for outcome in doc["rounds"]:
        check_round(outcome)
        assert outcome["model_pid"] != outcome["server_pid"]  # transformers 5.25: the model in a process of its own
    plain, instrumented = doc["rounds"]
    assert plain["requests_recorded"] is None  # plain: the model's process recorded no request
    # the instrumented server exported every request's span and its step spans (a prefill, then one per token)
    assert instrumented["spans_received"] >= instrumented["requests_total"] * (1 + NEW_TOKENS)
    assert instrumented["otlp_bytes"]["traces"] > plain["otlp_bytes"]["traces"]
    check_levels(doc)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr()  # the report on stdout; progress and where files went on stderr
    assert "otel-generate bench --serve (HTTP, continuous batching)" in printed.out
    assert "requests dropped by the emitter: 0" in printed.out
    assert "otel-generate bench: pair 1/1, saturation, instrumented: 1/2 rounds [" in printed.err


@pytest.mark.skipif(not _continuous_batching_available(), reason="no instrumentable continuous batching")
def test_serve_in_process_one_short_round_at_saturation_and_at_a_rate(tmp_path):
    out = tmp_path / "serve.json"
    argv = ["--serve", "--in-process", *SHORT, "--rates", "0.5", "--exporter", "otlp-encode", "--output", str(out)]
    assert run_cli(*argv) == 0
    doc = json.loads(out.read_text())
    assert DOCUMENT_KEYS <= set(doc)
    assert (doc["variant"], doc["batching"], doc["exporter"]) == ("in_process", "continuous", "otlp-encode")
    assert [(r["side"], r["label"]) for r in doc["rounds"]] == [
        ("plain", "saturation"),
        ("instrumented", "saturation"),
        ("plain", "rate 0.5x"),
        ("instrumented", "rate 0.5x"),
    ]
    for outcome in doc["rounds"]:
        check_round(outcome)
        if outcome["side"] == "instrumented":
            # each request's span and one step span per token, as the SDK's exporter counted them
            expected = outcome["requests_total"] * (1 + NEW_TOKENS)
            assert outcome["spans_received"] == outcome["spans_expected"] == expected
    saturation = doc["rounds"][0]["figures"]["requests_per_s"]
    assert doc["offered_rates_rps"] == [pytest.approx(0.5 * saturation)]
    # the rate's rounds offered the same arrivals
    assert doc["rounds"][2]["figures"]["requests_sent"] == doc["rounds"][3]["figures"]["requests_sent"] > 0
    check_levels(doc)
