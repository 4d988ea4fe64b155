"""``otel-generate bench`` without a model: the statistics (interquartile ranges, invalid samples), the JSON
schema check, the timed call's clock reads, the shared A/B loop, and the command line's errors (exit status 2,
a message) of the plain, --compare and --continuous-batching modes."""

from __future__ import annotations

import math
import random
import statistics
import sys
from fractions import Fraction

import numpy
import pytest
import torch

from otel_generate import clock
from otel_generate.bench import common, stats, workload
from otel_generate.bench import runner as bench_runner
from otel_generate.bench.cli import main
from otel_generate.bench.config import BenchConfig, BenchUsageError
from tests.helpers.bench import _quartiles, check_schema, run_cli


def test_interquartile_range_of_known_values():
    assert stats.iqr_of([4.0, 1.0, 3.0, 2.0]) == [1.75, 3.25]  # numpy.percentile([1, 2, 3, 4], [25, 75])
    assert stats.iqr_of([7.0]) == [7.0, 7.0]
    assert stats.iqr_of([None, 2.0, None, 4.0]) == [2.5, 3.5]  # missing values are skipped, as for the median
    assert stats.iqr_of([None]) is None and stats.median_of([None]) is None


def _coverage(count, k):
    """P(the k-th smallest to the k-th largest of ``count`` values holds the median), in exact fractions."""
    return 1 - 2 * Fraction(sum(math.comb(count, i) for i in range(k)), 2**count)


def test_the_median_interval_is_the_sign_tests_with_the_largest_rank_that_reaches_95_percent():
    for count in range(1, 61):
        reaching = [k for k in range(1, (count + 1) // 2 + 1) if _coverage(count, k) >= Fraction(95, 100)]
        k = max(reaching) if reaching else 1
        assert stats.median_rank(count) == (k, pytest.approx(float(max(_coverage(count, k), 0)), abs=1e-15)), count
    # fewer than 6 values cannot reach 95 %: the whole range, with the confidence it has
    assert [stats.median_rank(n) for n in (1, 2, 3, 5, 6)] == [(1, 0.0), (1, 0.5), (1, 0.75), (1, 0.9375), (1, 0.96875)]
    # the ranks of the published tables of the sign test's 95 % interval
    assert [stats.median_rank(n)[0] for n in (9, 20, 30, 100)] == [2, 6, 10, 40]
    assert stats.median_interval([5.0, -1.0, 3.0]) == ([-1.0, 5.0], 0.75)
    assert stats.median_interval([float(v) for v in range(20, 0, -1)])[0] == [6.0, 15.0]
    with pytest.raises(ValueError, match="at least one value"):
        stats.median_interval([])


@pytest.mark.parametrize("count", [3, 10, 30])
def test_the_median_interval_holds_the_true_median_as_often_as_it_says(count):
    draw = random.Random(count)
    trials = 4000
    held = 0
    for _ in range(trials):  # a skewed distribution whose median is known: exponential, median ln 2
        low, high = stats.median_interval([draw.expovariate(1.0) for _ in range(count)])[0]
        held += low <= math.log(2) <= high
    assert held / trials == pytest.approx(stats.median_rank(count)[1], abs=0.02)


def _block(plain_s, instrumented_s, steps):
    pairs = common.Pairs(plain_s=plain_s, instrumented_s=instrumented_s, trace_flush_s=[0.0] * len(plain_s))
    pairs.metric_flush_s = [0.0] * len(plain_s)
    ratios, _ = pairs.ratios()
    added, _ = pairs.added_us_per_step([steps] * len(plain_s))
    block = {"paired_ratios": ratios, "added_us_per_step": added}
    stats.with_iqr(block, "paired_ratio", ratios)
    stats.with_iqr(block, "added_us_per_step", added)
    return block


def test_the_conclusion_quotes_the_medians_with_intervals_that_agree_on_whether_zero_is_inside():
    # six pairs, all slower instrumented: resolved; plain times differ, so the pairs' order by ratio is
    # not their order by added time, and each interval takes its own values at the same ranks
    plain = [0.100, 0.200, 0.100, 0.150, 0.120, 0.300]
    block = _block(plain, [0.101, 0.2004, 0.1003, 0.1506, 0.1202, 0.3009], steps=10)
    c = bench_runner.conclusion(block)
    assert c["pairs"] == 6 and c["confidence"] == 0.96875  # 6 values: the whole range
    assert c["added_us_per_step"] == statistics.median(block["added_us_per_step"])
    assert c["added_us_per_step_interval"] == [min(block["added_us_per_step"]), max(block["added_us_per_step"])]
    assert c["ratio"] == statistics.median(block["paired_ratios"])
    assert c["ratio_interval"] == [min(block["paired_ratios"]), max(block["paired_ratios"])]
    assert c["resolved"] is True and c["ratio_interval"][0] > 1
    low, high = c["added_us_per_step_interval"]
    r_low, r_high = c["ratio_interval"]
    assert c["text"] == (
        f"conclusion (steady state, caller-visible, 6 pairs): added {c['added_us_per_step']:.1f} us per decode step "
        f"(96.9 % CI {low:.1f} to {high:.1f} us), ratio {c['ratio']:.4f} (96.9 % CI {r_low:.4f} to {r_high:.4f})"
    )
    # one pair faster instrumented: both intervals now hold the no-cost value
    mixed = bench_runner.conclusion(_block(plain, [0.101, 0.1990, 0.1003, 0.1506, 0.1202, 0.3009], steps=10))
    assert mixed["added_us_per_step_interval"][0] < 0 < mixed["added_us_per_step_interval"][1]
    assert mixed["ratio_interval"][0] < 1 < mixed["ratio_interval"][1]
    assert mixed["resolved"] is False and mixed["text"].endswith("): not resolved on this machine")
    # one pair has no interval, and resolves nothing
    single = bench_runner.conclusion(_block([0.1], [0.2], steps=10))
    assert single["confidence"] == 0.0 and single["resolved"] is False
    assert single["text"] == (
        "conclusion (steady state, caller-visible, 1 pair): added 10000.0 us per decode step, ratio 2.0000 "
        "(one pair: no interval): not resolved on this machine"
    )


def test_schema_check_rejects_a_document_missing_a_key():
    doc = {key: 0 for key in bench_runner.RESULT_KEYS}
    assert check_schema(doc)  # wrong types and missing versions are reported
    assert any(
        "missing median_tokens_per_s" in p
        for p in check_schema({k: v for k, v in doc.items() if k != "median_tokens_per_s"})
    )


def test_timed_call_synchronizes_before_the_first_clock_read_and_after_the_call():
    log = []
    ticks = iter([10.0, 12.5])

    def fake_clock():
        log.append("clock")
        return next(ticks)

    def fn():
        log.append("call")
        return "result"

    result, elapsed = clock.timed_call(fn, lambda: log.append("sync"), clock=fake_clock)
    assert log == ["sync", "clock", "call", "sync", "clock"]
    assert (result, elapsed) == ("result", 2.5)


def test_timed_call_refuses_a_clock_that_did_not_advance():
    with pytest.raises(ValueError, match="positive"):
        clock.timed_call(lambda: None, None, clock=lambda: 5.0)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(runs=0), "--runs must be at least 1"),
        (dict(warmup=-1), "--warmup must be 0 or more"),
        (dict(new_tokens=0), "--new-tokens must be at least 1"),
        (dict(prompt_tokens=0), "--prompt-tokens must be at least 1"),
        (dict(batch_size=0), "--batch-size must be at least 1"),
        (dict(threads=0), "--threads must be at least 1"),
        (dict(model="/nonexistent/checkpoint"), "does not exist"),
        (dict(eos="x"), "--eos takes a non-negative token id"),
    ],
)
def test_invalid_counts_raise(changes, message):
    with pytest.raises(BenchUsageError, match=message):
        BenchConfig(**changes).validate()


@pytest.mark.parametrize(
    "prompt, new, positions, message",
    [
        (3000, 8, 2048, "longer than the model's 2048 positions"),
        (2000, 100, 2048, "need 2099 positions; the model has 2048"),
        (4, 0, 2048, "--new-tokens must be at least 1"),
        (0, 8, 2048, "--prompt-tokens must be at least 1"),
    ],
)
def test_invalid_lengths_raise(prompt, new, positions, message):
    with pytest.raises(BenchUsageError, match=message):
        workload.check_lengths(prompt, new, positions)


def test_lengths_that_fit_exactly_are_accepted():
    workload.check_lengths(2048, 1, 2048)
    workload.check_lengths(4, 2045, 2048)  # positions 0..2047 are fed
    workload.check_lengths(10_000, 10, None)  # no position limit known (relative positions)


@pytest.mark.parametrize(
    "elapsed, counts, message",
    [(0.0, [3], "positive"), (-1.0, [3], "positive"), (1.0, [], "at least one sequence"), (1.0, [2, -1], "negative")],
)
def test_invalid_samples_raise(elapsed, counts, message):
    with pytest.raises(ValueError, match=message):
        stats.make_sample(elapsed, counts)


def test_no_samples_cannot_be_summarized():
    with pytest.raises(ValueError, match="at least one measured run"):
        stats.summarize([])


def test_cuda_requested_without_cuda_exits_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out.json"
    assert run_cli("--device", "cuda", "--output", str(out)) == 2
    assert "CUDA was requested but is not available" in capsys.readouterr().err
    assert not out.exists()


def test_plot_without_matplotlib_exits_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    plot = tmp_path / "plot.png"
    assert run_cli("--plot", str(plot)) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
    assert not plot.exists()


def test_bench_with_an_unknown_option_prints_the_bench_usage(capsys):
    assert main(["bench", "--bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: otel-generate bench ")
    assert "--new-tokens N" in err  # bench's own options, not the top-level COMMAND list
    assert "otel-generate bench: error: unrecognized arguments: --bogus" in err
    assert main(["bench", "--runs", "1", "--bogus", "x"]) == 2
    assert "otel-generate bench: error: unrecognized arguments: --bogus x" in capsys.readouterr().err
    # the top level still answers for itself
    assert main(["nonsense"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: otel-generate ") and "invalid choice" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--exporter", "otlp-encode"], "--exporter applies to the instrumented runs of --compare; add --compare"),
        (["--max-step-spans", "3"], "--max-step-spans applies to the instrumented runs of --compare; add --compare"),
        (["--compare", "--max-step-spans", "-1"], "--max-step-spans must be 0 or more"),
        (["--compare", "--exporter", "zipkin"], "invalid choice"),
        (["--show-per-run"], "--show-per-run shows pairs of --compare; add --compare"),
    ],
)
def test_compare_options_without_compare_or_out_of_range_exit_2(tmp_path, capsys, argv, message):
    out = tmp_path / "out.json"
    assert run_cli(*argv, "--output", str(out)) == 2
    err = capsys.readouterr().err
    assert message in err and "otel-generate bench: error:" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "module, argv, message",
    [
        ("opentelemetry.sdk", ["--compare"], "--compare needs the OpenTelemetry SDK"),
        (
            "opentelemetry.exporter.otlp.proto.common",
            ["--compare", "--exporter", "otlp-encode"],
            "--exporter otlp-encode needs opentelemetry-exporter-otlp-proto-common",
        ),
    ],
)
def test_compare_without_its_packages_exits_2(monkeypatch, tmp_path, capsys, module, argv, message):
    monkeypatch.setitem(sys.modules, module, None)  # import -> ImportError
    out = tmp_path / "out.json"
    assert run_cli(*argv, "--output", str(out)) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_per_token_index_groups_runs_of_different_lengths():
    samples = [
        {"step_latencies_ms": [10.0, 1.0, 2.0], "step_tokens": [1, 1, 1]},
        {"step_latencies_ms": [12.0, 3.0], "step_tokens": [1, 1]},  # stopped early
        {"step_latencies_ms": [11.0, 5.0, 4.0], "step_tokens": [1, 1, 1]},
        {"step_latencies_ms": [], "step_tokens": []},  # a run the instrumentation did not see
    ]
    rows = stats.per_token_index(samples)
    assert [r["token_index"] for r in rows] == [0, 1, 2]
    assert [r["runs"] for r in rows] == [3, 3, 2]
    for row, values in zip(rows, ([10.0, 12.0, 11.0], [1.0, 3.0, 5.0], [2.0, 4.0])):
        assert row["median_ms"] == pytest.approx(float(numpy.median(values)))
        assert [row["q1_ms"], row["q3_ms"]] == pytest.approx(_quartiles(values))
    # a step that appended two tokens (assisted decoding) moves the next step's index by two
    rows = stats.per_token_index([{"step_latencies_ms": [5.0, 1.0, 1.0], "step_tokens": [1, 2, 1]}])
    assert [r["token_index"] for r in rows] == [0, 1, 3]


@pytest.mark.parametrize("name", ["latency.jpg", "latency.jpeg", "latency", "latency.png.txt"])
def test_unsupported_plot_extension_exits_2_and_writes_nothing(tmp_path, capsys, monkeypatch, name):
    ran = []
    monkeypatch.setattr(bench_runner, "measure", lambda *a, **k: ran.append(1))
    plot, out = tmp_path / name, tmp_path / "out.json"
    assert run_cli("--plot", str(plot), "--output", str(out)) == 2
    err = capsys.readouterr().err
    assert "otel-generate bench: error:" in err and "unsupported file extension" in err
    assert ".png, .svg, .pdf" in err
    assert ran == [] and list(tmp_path.iterdir()) == []  # refused before running, nothing written


def test_the_shared_ab_loop_alternates_plain_and_instrumented_and_counts_after_the_warmup():
    """common.interleave, with no model: a stand-in side whose calls take known times and export 3 spans."""

    class Exporter:
        spans, bytes = 0, 0

    class Side:
        exporter, metric_reader, flushes_complete = Exporter(), object(), False
        log = []

        def plain(self, timed):
            self.log.append("A")
            return timed()

        def run(self, timed):
            self.log.append("B")
            self.exporter.spans += 3
            self.exporter.bytes += 100
            return timed(), 0.5, 0.25  # (output, seconds), trace flush, metric flush

    side = Side()
    times = iter([1.0, 2.0, 4.0, 6.0, 2.0, 3.0])  # warmup pair, then two measured pairs
    recorded = []
    pairs = common.interleave(
        side,
        lambda: ("out", next(times)),
        BenchConfig(warmup=1, runs=2),
        lambda a, elapsed, b: recorded.append((a, elapsed, b)),
    )
    assert side.log == ["A", "B"] * 3 and side.flushes_complete is True
    assert pairs.plain_s == [4.0, 2.0] and pairs.instrumented_s == [6.0, 3.0]
    assert pairs.deferred_s == [0.75, 0.75] and recorded == [("out", 4.0, "out"), ("out", 2.0, "out")]
    assert pairs.spans_exported_after == [3, 6] and pairs.spans_exported == 6  # the warmup's 3 left out
    assert pairs.exported_bytes == 200 and pairs.exported_bytes_total == 300
    assert pairs.ratios() == ([6.0 / 4.0, 3.0 / 2.0], [6.75 / 4.0, 3.75 / 2.0])
    assert pairs.added_us_per_step([4, 2]) == ([0.5e6, 0.5e6], [2.75 / 4 * 1e6, 1.75 / 2 * 1e6])
    assert list(pairs.timings()) == [
        "plain_elapsed_s",
        "instrumented_elapsed_s",
        "deferred_trace_flush_s",
        "deferred_metric_flush_s",
        "instrumented_deferred_s",
    ]


def test_compare_refuses_when_generate_is_already_instrumented(instrumented, tmp_path, capsys):
    out = tmp_path / "out.json"
    assert run_cli("--compare", "--output", str(out)) == 2
    assert "--compare needs generate() uninstrumented" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--requests", "4"], "--requests applies to --continuous-batching"),
        (["--continuous-batching", "--requests", "0"], "--requests must be at least 1"),
        (["--continuous-batching", "--batch-size", "2"], "--batch-size does not apply to --continuous-batching"),
        (["--continuous-batching", "--plot", "x.png"], "--plot does not apply to --continuous-batching"),
    ],
)
def test_invalid_continuous_batching_options_exit_2(tmp_path, capsys, argv, message):
    out = tmp_path / "out.json"
    assert run_cli(*argv, "--output", str(out)) == 2
    err = capsys.readouterr().err
    assert message in err and "otel-generate bench: error:" in err
    assert list(tmp_path.iterdir()) == []
