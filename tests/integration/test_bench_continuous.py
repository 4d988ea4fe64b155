"""``otel-generate bench --continuous-batching``: waves of requests on one persistent manager, plain
and instrumented interleaved, throughput and added cost per batch step. No timing claim:
the arithmetic, the order of the runs, the span count and the outputs are checked."""

from __future__ import annotations

import json
import statistics
import threading

import pytest

from otel_generate import GenerateInstrumentor
from otel_generate.bench import continuous
from otel_generate.bench.config import BenchConfig
from tests.helpers.bench import run_cli


def _continuous_batching_available():
    try:
        from transformers.generation.continuous_batching import continuous_api
    except ImportError:
        return False
    from otel_generate.instrumentor import missing_hooks

    return not missing_hooks(continuous_api)


needs_cb = pytest.mark.skipif(
    not _continuous_batching_available(), reason="this transformers has no instrumentable continuous batching"
)


def _scheduler_threads():
    return [t for t in threading.enumerate() if "_run_generation_loop" in t.name and t.is_alive()]


@needs_cb
def test_waves_interleave_plain_and_instrumented_and_report_paired_numbers(monkeypatch):
    instrumented_at_wave = []
    original = continuous._Waves.wave

    def wave(self):
        instrumented_at_wave.append(GenerateInstrumentor().is_instrumented_by_opentelemetry)
        return original(self)

    monkeypatch.setattr(continuous._Waves, "wave", wave)
    config = BenchConfig(continuous_batching=True, requests=2, new_tokens=3, warmup=1, runs=2)
    result = continuous.run(config)
    cmp = result["compare"]
    assert result["mode"] == "continuous_batching" and result["requests"] == 2
    assert instrumented_at_wave == [False, True] * 3  # 1 warmup pair, then 2 pairs, A B A B
    # 2 prompts of 4 tokens fit one batch step: one prefill step, then one step per further token
    assert cmp["plain_batch_steps"] == cmp["instrumented_batch_steps"] == [3, 3]
    assert cmp["tokens"] == [6, 6]
    assert cmp["paired_ratios"] == [b / a for a, b in zip(cmp["plain_elapsed_s"], cmp["instrumented_elapsed_s"])]
    assert cmp["median_paired_ratio"] == statistics.median(cmp["paired_ratios"])
    assert cmp["added_us_per_batch_step"] == [
        (b - a) / 3 * 1e6 for a, b in zip(cmp["plain_elapsed_s"], cmp["instrumented_elapsed_s"])
    ]
    assert cmp["added_us_per_batch_step_with_deferred"] == [
        (b + d - a) / 3 * 1e6
        for a, b, d in zip(cmp["plain_elapsed_s"], cmp["instrumented_elapsed_s"], cmp["instrumented_deferred_s"])
    ]
    assert cmp["plain_tokens_per_s"] == [6 / a for a in cmp["plain_elapsed_s"]]
    assert cmp["iqr_paired_ratio"][0] <= cmp["median_paired_ratio"] <= cmp["iqr_paired_ratio"][1]
    # every instrumented run exported each request's span and its 3 step spans
    assert cmp["spans_exported"] == cmp["spans_expected"] == 2 * 2 * (1 + 3)
    assert cmp["outputs_identical"] is True
    assert not GenerateInstrumentor().is_instrumented_by_opentelemetry  # left as found
    assert _scheduler_threads() == []  # the manager was stopped


@needs_cb
def test_max_step_spans_zero_keeps_request_spans_only(capsys, tmp_path):
    out = tmp_path / "cb.json"
    assert (
        run_cli(
            "--continuous-batching",
            "--requests",
            "2",
            "--new-tokens",
            "2",
            "--runs",
            "1",
            "--warmup",
            "0",
            "--max-step-spans",
            "0",
            "--output",
            str(out),
            "--progress",
        )
        == 0
    )
    doc = json.loads(out.read_text())
    assert doc["compare"]["spans_exported"] == doc["compare"]["spans_expected"] == 2
    captured = capsys.readouterr()
    assert "otel-generate bench --continuous-batching" in captured.out  # the report, on stdout
    # --progress, on stderr: one run is one wave, a pair two
    assert "otel-generate bench: set-up (torch, transformers, the model): 0/2 runs [" in captured.err
    assert "otel-generate bench: continuous batching, pairs: 2/2 runs [" in captured.err
    assert "added per batch step: caller-visible" in captured.out and "(IQR " in captured.out


@needs_cb
def test_step_span_policy_none_is_passed_through(tmp_path):
    out = tmp_path / "cb.json"
    assert (
        run_cli(
            "--continuous-batching",
            "--requests",
            "2",
            "--new-tokens",
            "2",
            "--runs",
            "1",
            "--warmup",
            "0",
            "--step-spans",
            "none",
            "--output",
            str(out),
        )
        == 0
    )
    cmp = json.loads(out.read_text())["compare"]
    assert cmp["step_spans"] == "none" and cmp["spans_exported"] == cmp["spans_expected"] == 2


@pytest.mark.skipif(_continuous_batching_available(), reason="this transformers has continuous batching")
def test_without_continuous_batching_the_bench_says_so(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert run_cli("--continuous-batching", "--runs", "1", "--output", str(out)) == 2
    assert "needs transformers' continuous batching" in capsys.readouterr().err
    assert not out.exists()
