"""``otel-generate bench``: timer boundaries, token counts, the JSON document, the plot, errors, --compare.

No timing assertions: the numbers are checked for how they were computed, never for how large they are.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import torch

from otel_generate import GenerateInstrumentor
from otel_generate import attributes as A
from otel_generate.bench import common, exporters, monitor, workload
from otel_generate.bench import runner as bench_runner
from otel_generate.bench.config import BenchConfig, BenchUsageError
from otel_generate.bench.models import PAD_TOKEN_ID, build_model
from otel_generate.tokens import count_new_tokens
from tests.helpers.bench import _quartiles, check_schema, run_cli

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--runs", "2", "--warmup", "1", "--new-tokens", "3"]


def no_eos_continuation(batch_size, new_tokens, prompt_tokens=4, seed=0):
    """What the harness's model generates for its seeded prompt with EOS off (computed apart from the harness)."""
    model = build_model("gpt2", seed=seed)
    inputs = workload.make_inputs(model, batch_size, prompt_tokens, seed)
    out = model.generate(
        **inputs, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=PAD_TOKEN_ID
    )
    return out[:, prompt_tokens:].tolist()


def first_index(row, token):
    return row.index(token) if token in row else None


# --- the JSON contract ------------------------------------------------------------------------------


def test_json_has_every_key_of_the_issue_with_its_type(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert run_cli(*FAST, "--output", str(path)) == 0
    doc = json.loads(path.read_text())
    assert check_schema(doc) == []
    samples = doc["samples"]
    assert doc["median_time_to_first_token_ms"] is not None and doc["median_time_per_output_token_ms"] is not None
    # the summaries are the medians of the kept samples
    assert doc["median_elapsed_s"] == statistics.median(s["elapsed_s"] for s in samples)
    assert doc["median_tokens_per_s"] == statistics.median(s["tokens_per_s"] for s in samples)
    assert doc["median_time_to_first_token_ms"] == statistics.median(s["time_to_first_token_ms"] for s in samples)
    assert doc["median_time_per_output_token_ms"] == statistics.median(s["time_per_output_token_ms"] for s in samples)
    # TTFT / TPOT are the instrumentation's step latencies
    for s in samples:
        assert len(s["step_latencies_ms"]) == 3 and s["step_tokens"] == [1, 1, 1]
        assert s["time_to_first_token_ms"] == s["step_latencies_ms"][0]
        assert s["time_per_output_token_ms"] == pytest.approx(sum(s["step_latencies_ms"][1:]) / 2)
    model = build_model("gpt2", seed=0)
    assert doc["parameters"] == sum(p.numel() for p in model.parameters())
    assert (doc["device"], doc["dtype"], doc["threads"], doc["warmup"], doc["runs"]) == ("cpu", "float32", 1, 1, 2)
    assert (doc["prompt_tokens"], doc["new_tokens_requested"], doc["batch_size"]) == (4, 3, 1)
    out = capsys.readouterr().out
    assert "tokens/s" in out and "time to first token" in out  # the report is on stdout


def test_every_median_has_its_interquartile_range_in_the_json_and_the_summary(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert run_cli("--runs", "5", "--warmup", "0", "--new-tokens", "3", "--compare", "--output", str(path)) == 0
    doc = json.loads(path.read_text())
    samples = doc["samples"]
    for name in ("elapsed_s", "tokens_per_s", "time_to_first_token_ms", "time_per_output_token_ms"):
        values = [s[name] for s in samples]
        assert doc[f"median_{name}"] == statistics.median(values)
        assert doc[f"iqr_{name}"] == pytest.approx(_quartiles(values), rel=1e-12)
    cmp = doc["compare"]
    for name, values in (
        ("paired_ratio", cmp["paired_ratios"]),
        ("paired_ratio_with_deferred", cmp["paired_ratios_with_deferred"]),
        ("added_us_per_step", cmp["added_us_per_step"]),
        ("added_us_per_step_with_deferred", cmp["added_us_per_step_with_deferred"]),
        ("plain_elapsed_s", cmp["plain_elapsed_s"]),
        ("instrumented_elapsed_s", cmp["instrumented_elapsed_s"]),
        ("instrumented_deferred_s", cmp["instrumented_deferred_s"]),
        ("plain_tokens_per_s", cmp["plain_tokens_per_s"]),
    ):
        assert len(values) == 5
        assert cmp[f"median_{name}"] == statistics.median(values)
        assert cmp[f"iqr_{name}"] == pytest.approx(_quartiles(values), rel=1e-12)
    # the report prints the same interquartile ranges next to the medians (of the steady-state pairs)
    out = capsys.readouterr().out
    q1, q3 = doc["iqr_elapsed_s"]
    assert f"median {doc['median_elapsed_s'] * 1e3:.3f} ms (IQR {q1 * 1e3:.3f} to {q3 * 1e3:.3f} ms)" in out
    q1, q3 = doc["iqr_tokens_per_s"]
    assert f"median {doc['median_tokens_per_s']:.1f} (IQR {q1:.1f} to {q3:.1f})" in out
    q1, q3 = doc["iqr_time_to_first_token_ms"]
    assert f"{doc['median_time_to_first_token_ms']:.3f} ms (IQR {q1:.3f} to {q3:.3f} ms)" in out
    q1, q3 = doc["iqr_time_per_output_token_ms"]
    assert f"{doc['median_time_per_output_token_ms']:.3f} ms (IQR {q1:.3f} to {q3:.3f} ms)" in out
    once = cmp["instrument_once"]
    for name in ("paired_ratio", "paired_ratio_with_deferred"):
        q1, q3 = once[f"iqr_{name}"]
        assert f"{once[f'median_{name}']:.4f} (IQR {q1:.4f} to {q3:.4f})" in out
    for line in out.splitlines():
        if " median " in line:
            assert "IQR" in line, line


# --- the timer ---------------------------------------------------------------------------------------


def test_each_measured_run_is_one_synchronized_generate_between_two_clock_reads(monkeypatch):
    log = []
    now = [0.0]

    def fake_clock():
        log.append("clock")
        now[0] += 0.25
        return now[0]

    monkeypatch.setattr(workload, "synchronizer_for", lambda device: lambda: log.append("sync"))
    original = workload.Runner.generate

    def generate(self):
        log.append("call")
        return original(self)

    monkeypatch.setattr(workload.Runner, "generate", generate)
    config = BenchConfig(new_tokens=3, warmup=2, runs=3)
    result = bench_runner.run(config, clock=fake_clock)
    # warmup calls are not timed; each measured run: sync, clock, generate, sync, clock
    assert log == ["call"] * 2 + ["sync", "clock", "call", "sync", "clock"] * 3
    assert [s["elapsed_s"] for s in result["samples"]] == [0.25] * 3
    assert [s["tokens_per_s"] for s in result["samples"]] == [3 / 0.25] * 3


# --- invalid input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--runs", "0"], "--runs must be at least 1"),
        (["--warmup", "-1"], "--warmup must be 0 or more"),
        (["--new-tokens", "0"], "--new-tokens must be at least 1"),
        (["--prompt-tokens", "5000"], "longer than the model's 2048 positions"),
        (["--model", "/nonexistent/checkpoint"], "does not exist"),
        (["--device", "tpu"], "invalid choice"),
        (["--runs", "many"], "invalid int value"),
    ],
)
def test_cli_invalid_input_exits_2_with_a_message_and_writes_nothing(tmp_path, capsys, argv, message):
    out, plot = tmp_path / "out.json", tmp_path / "plot.png"
    plot_args = ["--plot", str(plot)] if importlib.util.find_spec("matplotlib") else []
    assert run_cli(*argv, "--output", str(out), *plot_args) == 2
    err = capsys.readouterr().err
    assert message in err and "otel-generate bench: error:" in err
    assert not out.exists() and not plot.exists()
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind either


def test_auto_device_falls_back_to_cpu_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run_cli("--device", "auto", *FAST, "--runs", "1", "--output", "-") == 0
    assert json.loads(capsys.readouterr().out)["device"] == "cpu"


# --- the load average ---------------------------------------------------------------------------------


def _fake_load(monkeypatch, load, cores=2, age=600.0):
    readings = []

    def getloadavg():
        readings.append(load)
        return load

    monkeypatch.setattr(os, "getloadavg", getloadavg)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setattr(monitor, "process_age_s", lambda: age)
    return readings


def test_a_busy_machine_is_warned_about_and_every_reading_is_recorded(monkeypatch, tmp_path, capsys):
    calls = _fake_load(monkeypatch, (6.0, 5.0, 4.0))
    out = tmp_path / "out.json"
    assert run_cli(*FAST, "--output", str(out)) == 0
    doc = json.loads(out.read_text())
    load = doc["load"]
    # before the model, after the warmup, after each of the 2 runs, at the end
    assert [r["at"] for r in load["readings"]] == ["start", "after warmup", "run 1", "run 2", "end"]
    assert len(calls) == 5
    assert all((r["load_1m"], r["load_5m"], r["load_15m"]) == (6.0, 5.0, 4.0) for r in load["readings"])
    assert (load["cores"], load["own_threads"], load["limit_per_core"]) == (2, 1, 0.5)
    for r in load["readings"]:  # the bench's own thread, counted in as the 1-minute average takes it up
        assert r["own_estimate"] == pytest.approx(1 - math.exp(-r["bench_age_s"] / 60))
        assert r["other_per_core"] == pytest.approx((6.0 - r["own_estimate"]) / 2)
    assert load["max_other_per_core"] == max(r["other_per_core"] for r in load["readings"]) > 2.4
    assert load["busy"] is True
    assert doc["warnings"] == [load["warning"]] and "the machine was busy" in load["warning"]
    captured = capsys.readouterr()
    err = captured.err
    # the report on stdout counts the warnings; they are printed on stderr
    assert "WARNING" not in captured.out and "1 warning(s), on stderr and in the JSON's warnings" in captured.out
    # said at once, at the first reading (before the model was built), and again with the report
    assert err.startswith("WARNING: the machine is busy: 1-minute load average 6.00 at start on 2 core(s)")
    assert "\nWARNING: the machine was busy: 1-minute load average 6.00" in err


def test_a_quiet_machine_gets_no_warning(monkeypatch, tmp_path, capsys):
    _fake_load(monkeypatch, (0.4, 0.3, 0.2))
    assert run_cli(*FAST, "--output", "-") == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["load"]["busy"] is False and doc["load"]["warning"] is None and doc["warnings"] == []
    assert "WARNING" not in captured.err


def test_the_bench_own_threads_do_not_make_the_machine_busy(monkeypatch, capsys):
    # 1.9 on 2 cores is 0.95 per core, but the bench's own busy thread accounts for about 1 of it
    _fake_load(monkeypatch, (1.9, 1.0, 0.5), cores=2, age=600.0)
    assert run_cli(*FAST, "--output", "-") == 0
    load = json.loads(capsys.readouterr().out)["load"]
    assert load["busy"] is False and load["max_other_per_core"] == pytest.approx(0.45, abs=1e-3)
    # with 2 torch threads of its own, 2.9 on 2 cores is still not busy; 4.0 is
    _fake_load(monkeypatch, (2.9, 1.0, 0.5), cores=2, age=600.0)
    assert run_cli(*FAST, "--threads", "2", "--output", "-") == 0
    assert json.loads(capsys.readouterr().out)["load"]["busy"] is False
    _fake_load(monkeypatch, (4.0, 1.0, 0.5), cores=2, age=600.0)
    assert run_cli(*FAST, "--threads", "2", "--output", "-") == 0
    assert json.loads(capsys.readouterr().out)["load"]["busy"] is True


def test_without_getloadavg_there_is_no_verdict(monkeypatch, capsys):
    monkeypatch.delattr(os, "getloadavg")
    assert run_cli(*FAST, "--output", "-") == 0
    load = json.loads(capsys.readouterr().out)["load"]
    assert load["readings"] == [] and load["busy"] is None and load["warning"] is None


# --- CPU never touches CUDA ---------------------------------------------------------------------------


def test_cpu_run_never_calls_a_cuda_function(monkeypatch, tmp_path):
    def forbidden(*args, **kwargs):
        raise AssertionError("a CUDA function was called on the CPU path")

    for name in ("synchronize", "is_available", "current_device", "get_device_name", "device_count", "Event"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    out = tmp_path / "out.json"
    assert run_cli("--device", "cpu", *FAST, "--compare", "--output", str(out)) == 0
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and [s["new_tokens"] for s in doc["samples"]] == [3, 3]
    assert doc["compare"]["steps"] == [3, 3]


# --- token counts -------------------------------------------------------------------------------------


def test_three_new_tokens_are_counted_and_the_rate_is_tokens_over_elapsed():
    result = bench_runner.run(BenchConfig(new_tokens=3, warmup=0, runs=2))
    for sample in result["samples"]:
        assert sample["new_tokens"] == 3 and sample["new_tokens_per_sequence"] == [3]
        assert sample["tokens_per_s"] == sample["new_tokens"] / sample["elapsed_s"]


def test_early_eos_reports_the_real_count(capsys):
    new = 8
    row = no_eos_continuation(1, new)[0]
    # a token whose first occurrence is not the first position: generation stops right after it
    index = next(i for i in range(1, new - 1) if row[i] not in row[:i])
    expected = index + 1
    assert (
        run_cli("--new-tokens", str(new), "--warmup", "0", "--runs", "2", "--eos", str(row[index]), "--output", "-")
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert expected < new
    assert result["eos_token_id"] == [row[index]]
    for sample in result["samples"]:
        assert sample["new_tokens"] == expected and sample["new_tokens_per_sequence"] == [expected]
        assert sample["tokens_per_s"] == expected / sample["elapsed_s"]
        assert len(sample["step_latencies_ms"]) == expected  # the instrumentation saw the same stop


def test_batch_of_two_with_one_row_ending_early_counts_each_row():
    new = 12
    rows = no_eos_continuation(2, new)
    # a token produced by exactly one row: that row stops after it, the other runs to the end
    candidates = [(r, t) for r in (0, 1) for t in rows[r][: new - 1] if t not in rows[1 - r] and t != PAD_TOKEN_ID]
    assert candidates, rows
    row, token = candidates[0]
    expected = [new, new]
    expected[row] = first_index(rows[row], token) + 1
    assert rows[1 - row][-1] != PAD_TOKEN_ID  # the full row does not end in what looks like padding
    result = bench_runner.run(BenchConfig(new_tokens=new, warmup=0, runs=2, batch_size=2, eos=str(token)))
    for sample in result["samples"]:
        assert sample["new_tokens_per_sequence"] == expected
        assert sample["new_tokens"] == sum(expected)
        assert sample["tokens_per_s"] == sum(expected) / sample["elapsed_s"]


def test_counting_matches_count_new_tokens_on_the_returned_tensor():
    config = BenchConfig(new_tokens=5, batch_size=2, eos="model")
    runner = workload.Runner(config, "cpu")
    out = runner.generate()
    assert runner.counts(out) == count_new_tokens(out, 4, [runner.model.generation_config.eos_token_id], PAD_TOKEN_ID)


def test_eos_without_id_uses_the_model_eos():
    model = build_model("gpt2")
    assert workload.resolve_eos(BenchConfig(eos="model"), model) == [model.generation_config.eos_token_id]
    assert workload.resolve_eos(BenchConfig(), model) is None
    with pytest.raises(BenchUsageError, match="outside the model's vocabulary"):
        workload.resolve_eos(BenchConfig(eos="100000"), model)


def test_prompt_avoids_special_tokens_and_is_seeded():
    model = build_model("gpt2")
    a = workload.make_inputs(model, 3, 50, seed=1)
    b = workload.make_inputs(model, 3, 50, seed=1)
    assert torch.equal(a["input_ids"], b["input_ids"]) and a["input_ids"].shape == (3, 50)
    assert torch.equal(a["attention_mask"], torch.ones(3, 50, dtype=torch.long))
    specials = set(workload.special_token_ids(model))
    assert specials >= {0, 127} and not (set(a["input_ids"].flatten().tolist()) & specials)


# --- plot ----------------------------------------------------------------------------------------------


def test_plot_draws_the_median_and_interquartile_band_per_token_index_with_prefill_marked(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    calls = {"plot": [], "fill_between": [], "errorbar": []}
    for name in calls:
        original = getattr(Axes, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):
            calls[_name].append((args, kwargs))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(Axes, name, spy)
    plot, out = tmp_path / "latency.png", tmp_path / "out.json"
    assert run_cli("--new-tokens", "6", "--runs", "3", "--warmup", "0", "--plot", str(plot), "--output", str(out)) == 0
    data = plot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"Matplotlib" in data  # matplotlib's Software text chunk
    samples = json.loads(out.read_text())["samples"]
    per_index = numpy.array([s["step_latencies_ms"] for s in samples])  # runs x token index
    assert per_index.shape == (3, 6)
    # one median line (not one line per run)
    assert len(calls["plot"]) == 1
    (xs, ys), _ = calls["plot"][0]
    assert list(xs) == list(range(6))
    assert list(ys) == pytest.approx(list(numpy.median(per_index, axis=0)))
    # the interquartile band
    assert len(calls["fill_between"]) == 1
    (xs, low, high), _ = calls["fill_between"][0]
    assert list(xs) == list(range(6))
    assert list(low) == pytest.approx([_quartiles(per_index[:, i])[0] for i in range(6)])
    assert list(high) == pytest.approx([_quartiles(per_index[:, i])[1] for i in range(6)])
    # the prefill step (token 0) marked with its median and interquartile range
    assert len(calls["errorbar"]) == 1
    (x, y), kwargs = calls["errorbar"][0]
    first = per_index[:, 0]
    q1, q3 = _quartiles(first)
    assert list(x) == [0] and list(y) == pytest.approx([numpy.median(first)])
    median = numpy.median(first)
    assert [kwargs["yerr"][0][0], kwargs["yerr"][1][0]] == pytest.approx([median - q1, q3 - median])
    assert "prefill" in kwargs["label"]


@pytest.mark.parametrize("extension, magic", [("svg", b"<svg"), ("pdf", b"%PDF-"), ("PNG", b"\x89PNG")])
def test_plot_is_written_in_the_format_its_extension_names(tmp_path, extension, magic):
    pytest.importorskip("matplotlib")
    plot = tmp_path / f"latency.{extension}"
    assert run_cli("--new-tokens", "3", "--runs", "2", "--warmup", "0", "--plot", str(plot)) == 0
    data = plot.read_bytes()
    assert magic in data[:400]
    assert list(tmp_path.iterdir()) == [plot]  # no temporary file left behind


# --- --compare ----------------------------------------------------------------------------------------


def test_compare_interleaves_plain_and_instrumented_and_reports_paired_numbers(monkeypatch):
    instrumented_at_call = []
    original = workload.Runner.timed

    def timed(self):
        instrumented_at_call.append(GenerateInstrumentor().is_instrumented_by_opentelemetry)
        return original(self)

    monkeypatch.setattr(workload.Runner, "timed", timed)
    result = bench_runner.run(BenchConfig(new_tokens=4, warmup=1, runs=3, compare=True))
    cmp = result["compare"]
    # measured runs (profiler: instrumented), then compare: warmup pair, then 3 pairs, A B A B; then the
    # same with the instrumentor set up once and kept (its plain runs under suppress_instrumentation())
    assert instrumented_at_call[3:11] == [False, True] * 4
    assert instrumented_at_call[11:] == [True, True] * 4
    assert cmp["pairs"] == 3 and cmp["steps"] == [4, 4, 4]
    assert cmp["paired_ratios"] == [b / a for a, b in zip(cmp["plain_elapsed_s"], cmp["instrumented_elapsed_s"])]
    assert cmp["median_paired_ratio"] == statistics.median(cmp["paired_ratios"])
    assert cmp["added_us_per_step"] == [
        (b - a) / 4 * 1e6 for a, b in zip(cmp["plain_elapsed_s"], cmp["instrumented_elapsed_s"])
    ]
    assert cmp["median_added_us_per_step"] == statistics.median(cmp["added_us_per_step"])
    # the instrumented runs really exported a request span and 4 step spans each
    assert cmp["spans_exported"] == cmp["spans_expected"] == 3 * (1 + 4)
    assert cmp["outputs_identical"] is True
    once = cmp["instrument_once"]
    assert once["pairs"] == 3 and once["steps"] == [4, 4, 4] and "once" in once["instrument"]
    assert once["spans_exported"] == once["spans_expected"] == 3 * (1 + 4)
    assert once["outputs_identical"] is True
    assert once["paired_ratios"] == [b / a for a, b in zip(once["plain_elapsed_s"], once["instrumented_elapsed_s"])]
    assert not GenerateInstrumentor().is_instrumented_by_opentelemetry  # left as found


def test_compare_instrument_once_instruments_once_and_its_plain_runs_record_nothing(monkeypatch):
    calls = {"instrument": 0, "uninstrument": 0}
    original_instrument, original_uninstrument = GenerateInstrumentor.instrument, GenerateInstrumentor.uninstrument

    def instrument(self, **kwargs):
        calls["instrument"] += 1
        return original_instrument(self, **kwargs)

    def uninstrument(self, **kwargs):
        calls["uninstrument"] += 1
        return original_uninstrument(self, **kwargs)

    monkeypatch.setattr(GenerateInstrumentor, "instrument", instrument)
    monkeypatch.setattr(GenerateInstrumentor, "uninstrument", uninstrument)
    runner = workload.Runner(BenchConfig(new_tokens=3, warmup=1, runs=2), "cpu")
    side = common.InstrumentedSide(runner.config, runner.clock, once=True)
    assert calls == {"instrument": 1, "uninstrument": 0}
    once = bench_runner._compare_pairs(runner, side, None, "pair")  # 1 warmup pair, 2 pairs; shuts the side down
    assert calls == {"instrument": 1, "uninstrument": 1}  # kept for every instrumented run, removed at the end
    # the plain runs under suppress_instrumentation() exported nothing: only the instrumented runs' spans
    assert once["spans_exported_after_each_flush"] == [4, 8]
    assert once["spans_exported"] == once["spans_expected"] == 2 * (1 + 3)


def test_headline_and_compare_say_which_runs_they_describe(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert run_cli(*FAST, "--compare", "--output", str(out)) == 0
    doc = json.loads(out.read_text())
    assert "profiled runs" in doc["measured_runs"] and "per-step hook" in doc["measured_runs"]
    assert "separate from the measured (profiled) runs" in doc["compare"]["runs"]
    out = capsys.readouterr().out
    assert "measured runs (2, profiled: per-step hook on" in out
    assert "(steady state): 2 pairs of runs of their own (not the measured runs above)" in out
    # the plain side's throughput is reported from the plain runs themselves
    cmp = doc["compare"]
    assert cmp["plain_tokens_per_s"] == [3 / a for a in cmp["plain_elapsed_s"]]


CONCLUSION = re.compile(
    r"conclusion \(steady state, caller-visible, (?P<pairs>\d+) pairs\): "
    r"added (?P<added>-?\d+\.\d) us per decode step \((?P<confidence>[\d.]+) % CI (?P<low>-?\d+\.\d) to "
    r"(?P<high>-?\d+\.\d) us\), ratio (?P<ratio>\d+\.\d{4}) \((?P=confidence) % CI (?P<r_low>\d+\.\d{4}) to "
    r"(?P<r_high>\d+\.\d{4})\)(?P<unresolved>: not resolved on this machine)?"
)


def test_compare_report_on_stdout_ends_with_the_conclusion_the_json_holds(tmp_path):
    """``otel-generate bench --compare --runs 3 --new-tokens 32 2>/dev/null``, with ``--output`` for the JSON
    to check it against: the report is on stdout, and its last line is the conclusion."""
    script = shutil.which("otel-generate", path=str(Path(sys.executable).parent))
    assert script is not None, "the otel-generate console script is not installed (pip install -e .)"
    command = f"{shlex.quote(script)} bench --compare --runs 3 --new-tokens 32 --output result.json 2>/dev/null"
    proc = subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=300
    )
    assert proc.returncode == 0 and proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("otel-generate bench: ") and "tokens/s" in proc.stdout
    assert not any(line.startswith(("WARNING", "  JSON written")) for line in lines)  # those go to stderr
    assert sum(line.startswith("conclusion") for line in lines) == 1
    shown = CONCLUSION.fullmatch(lines[-1])
    assert shown, lines[-1]
    once = json.loads((tmp_path / "result.json").read_text())["compare"]["instrument_once"]
    conclusion = json.loads((tmp_path / "result.json").read_text())["compare"]["conclusion"]
    assert conclusion["text"] == lines[-1]
    # three pairs: the interval is the smallest to the largest pair, which holds the median with
    # probability 1 - 2 / 2**3, whatever the distribution
    added, ratios = once["added_us_per_step"], once["paired_ratios"]
    assert len(added) == len(ratios) == conclusion["pairs"] == int(shown["pairs"]) == 3
    assert conclusion["confidence"] == 0.75 and shown["confidence"] == "75"
    assert conclusion["added_us_per_step"] == statistics.median(added)
    assert conclusion["added_us_per_step_interval"] == [min(added), max(added)]
    assert conclusion["ratio"] == statistics.median(ratios)
    assert conclusion["ratio_interval"] == [min(ratios), max(ratios)]
    assert shown["added"] == f"{statistics.median(added):.1f}"
    assert (shown["low"], shown["high"]) == (f"{min(added):.1f}", f"{max(added):.1f}")
    assert shown["ratio"] == f"{statistics.median(ratios):.4f}"
    assert (shown["r_low"], shown["r_high"]) == (f"{min(ratios):.4f}", f"{max(ratios):.4f}")
    holds_zero = min(added) <= 0 <= max(added)
    assert conclusion["resolved"] is not holds_zero and (shown["unresolved"] is not None) is holds_zero
    assert (min(ratios) <= 1 <= max(ratios)) is holds_zero


def test_the_report_shows_the_steady_state_and_the_per_run_pairs_only_when_asked(tmp_path, capsys):
    per_run, steady = "instrument() before and uninstrument() after each instrumented run", "(steady state)"
    assert run_cli(*FAST, "--compare", "--output", str(tmp_path / "a.json")) == 0
    default = capsys.readouterr().out.splitlines()
    assert any(steady in line for line in default) and not any(per_run in line for line in default)
    assert run_cli(*FAST, "--compare", "--show-per-run", "--output", str(tmp_path / "b.json")) == 0
    both = capsys.readouterr().out.splitlines()
    first, second = (next(i for i, line in enumerate(both) if text in line) for text in (per_run, steady))
    assert first < second  # the steady state last, above its conclusion
    doc = json.loads((tmp_path / "b.json").read_text())
    for lines in (default, both):
        assert lines[-1].startswith("conclusion (steady state, caller-visible, 2 pairs): ")
        # each pair against its own plain run: the instrumented runs' own median is not shown beside it
        assert not any(line.strip().startswith("instrumented") for line in lines)
    assert both[-1] == doc["compare"]["conclusion"]["text"]


def test_compare_finishes_deferred_work_after_each_instrumented_call_and_charges_it(monkeypatch):
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider

    log = []
    original_timed = workload.Runner.timed
    original_trace_flush, original_meter_flush = TracerProvider.force_flush, MeterProvider.force_flush

    def timed(self):
        log.append("instrumented" if GenerateInstrumentor().is_instrumented_by_opentelemetry else "plain")
        return original_timed(self)

    def trace_flush(self, *a, **k):
        log.append("trace flush")
        return original_trace_flush(self, *a, **k)

    def meter_flush(self, *a, **k):
        log.append("meter flush")
        return original_meter_flush(self, *a, **k)

    monkeypatch.setattr(workload.Runner, "timed", timed)
    monkeypatch.setattr(TracerProvider, "force_flush", trace_flush)
    monkeypatch.setattr(MeterProvider, "force_flush", meter_flush)
    now = [0.0]

    def fake_clock():  # every read advances 0.25 s: each timed call and each flush "takes" 0.25 s
        now[0] += 0.25
        return now[0]

    result = bench_runner.run(BenchConfig(new_tokens=4, warmup=1, runs=3, compare=True), clock=fake_clock)
    cmp = result["compare"]
    # after the 3 measured (profiled) runs: 1 warmup pair and 3 pairs; the flushes come right after
    # each instrumented call, before the next plain call's timer starts
    pair = ["plain", "instrumented", "trace flush", "meter flush"]
    assert log[3:19] == pair * 4
    # then the instrumentor set up once: the plain runs go through its wrappers, suppressed
    assert log[19:] == ["instrumented", "instrumented", "trace flush", "meter flush"] * 4
    assert cmp["plain_elapsed_s"] == cmp["instrumented_elapsed_s"] == [0.25] * 3
    assert cmp["deferred_trace_flush_s"] == cmp["deferred_metric_flush_s"] == [0.25] * 3
    assert cmp["instrumented_deferred_s"] == [0.5] * 3
    assert cmp["paired_ratios"] == [1.0] * 3  # caller-visible
    assert cmp["paired_ratios_with_deferred"] == [3.0] * 3  # (0.25 + 0.5) / 0.25
    assert cmp["median_paired_ratio_with_deferred"] == 3.0 and cmp["iqr_paired_ratio_with_deferred"] == [3.0, 3.0]
    assert cmp["added_us_per_step_with_deferred"] == [0.5 / 4 * 1e6] * 3
    assert cmp["median_instrumented_deferred_s"] == 0.5 and cmp["flushes_complete"] is True


def test_compare_each_flush_exports_its_own_run_before_the_next_one():
    result = bench_runner.run(BenchConfig(new_tokens=4, warmup=1, runs=3, compare=True))
    cmp = result["compare"]
    # the flush after each instrumented call exported that call's request span and 4 step spans
    assert cmp["spans_exported_after_each_flush"] == [5, 10, 15]
    assert cmp["instrument_once"]["spans_exported_after_each_flush"] == [5, 10, 15]
    assert cmp["paired_ratios_with_deferred"] == [
        (b + t + m) / a
        for a, b, t, m in zip(
            cmp["plain_elapsed_s"],
            cmp["instrumented_elapsed_s"],
            cmp["deferred_trace_flush_s"],
            cmp["deferred_metric_flush_s"],
        )
    ]
    assert all(d >= 0 for d in cmp["instrumented_deferred_s"])
    assert cmp["exporter"] == "discard" and cmp["exported_bytes"] is None and cmp["exported_metric_bytes"] is None


def test_otlp_encode_exporter_really_encodes_every_span_as_otlp_protobuf(monkeypatch, capsys):
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    span_payloads, metric_payloads = [], []
    encode_spans, encode_metrics = exporters.encode_spans_request, exporters.encode_metrics_request

    def spy_spans(spans):
        message = encode_spans(spans)
        span_payloads.append(message.SerializeToString())
        return message

    def spy_metrics(data):
        message = encode_metrics(data)
        metric_payloads.append(message.SerializeToString())
        return message

    monkeypatch.setattr(exporters, "encode_spans_request", spy_spans)
    monkeypatch.setattr(exporters, "encode_metrics_request", spy_metrics)
    argv = ["--new-tokens", "3", "--runs", "2", "--warmup", "0", "--compare", "--exporter", "otlp-encode"]
    assert run_cli(*argv, "--output", "-") == 0
    captured = capsys.readouterr()
    cmp = json.loads(captured.out)["compare"]
    assert cmp["exporter"] == "otlp-encode"
    # the bytes counted are the bytes of real OTLP requests, holding every exported span; the second half
    # of the payloads are those of the instrument-once runs, which follow
    once = cmp["instrument_once"]
    half, metric_half = len(span_payloads) // 2, len(metric_payloads) // 2
    assert once["exported_bytes"] == sum(len(p) for p in span_payloads[half:]) > 0
    assert once["exported_metric_bytes"] == sum(len(p) for p in metric_payloads[metric_half:]) > 0
    span_payloads, metric_payloads = span_payloads[:half], metric_payloads[:metric_half]
    assert span_payloads and cmp["exported_bytes"] == sum(len(p) for p in span_payloads) > 0
    decoded = [ExportTraceServiceRequest.FromString(p) for p in span_payloads]
    names = [
        span.name for request in decoded for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans
    ]
    assert len(names) == cmp["spans_exported"] == cmp["spans_expected"] == 2 * (1 + 3)
    requests = [n for n in names if n.startswith(A.OPERATION_TEXT_COMPLETION + " ")]
    assert len(requests) == 2  # one request span per instrumented call
    assert sorted(n for n in names if n not in requests) == [A.STEP_SPAN_DECODE] * 4 + [A.STEP_SPAN_PREFILL] * 2
    # and the metrics, once per instrumented call
    assert len(metric_payloads) == 2 and cmp["exported_metric_bytes"] == sum(len(p) for p in metric_payloads) > 0
    metric_names = {
        m.name
        for request in map(ExportMetricsServiceRequest.FromString, metric_payloads)
        for rm in request.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    }
    assert {A.METRIC_REQUEST_DURATION, A.METRIC_TIME_TO_FIRST_TOKEN, A.METRIC_TOKEN_USAGE} <= metric_names
    # --output - puts the JSON on stdout, so the report is on stderr; it shows the steady-state pairs
    assert f"{once['exported_bytes']:,} OTLP bytes encoded and discarded" in captured.err


def test_max_step_spans_is_passed_to_the_instrumented_runs(capsys):
    assert (
        run_cli(
            "--new-tokens", "4", "--runs", "2", "--warmup", "0", "--compare", "--max-step-spans", "1", "--output", "-"
        )
        == 0
    )
    cmp = json.loads(capsys.readouterr().out)["compare"]
    assert cmp["max_step_spans"] == 1 and "max_step_spans=1" in cmp["instrumented"]
    assert cmp["spans_exported"] == cmp["spans_expected"] == 2 * (1 + 1)  # the request span and one step span
    assert (
        run_cli(
            "--new-tokens", "4", "--runs", "1", "--warmup", "0", "--compare", "--max-step-spans", "0", "--output", "-"
        )
        == 0
    )
    cmp = json.loads(capsys.readouterr().out)["compare"]
    assert cmp["spans_exported"] == cmp["spans_expected"] == 1


def test_step_spans_and_background_emission_are_passed_to_the_instrumented_runs(capsys):
    assert (
        run_cli(
            "--new-tokens", "4", "--runs", "2", "--warmup", "0", "--compare", "--step-spans", "none", "--output", "-"
        )
        == 0
    )
    cmp = json.loads(capsys.readouterr().out)["compare"]
    assert cmp["step_spans"] == "none" and "step_spans='none'" in cmp["instrumented"]
    assert cmp["spans_exported"] == cmp["spans_expected"] == 2  # request spans only
    assert (
        run_cli(
            "--new-tokens", "4", "--runs", "2", "--warmup", "0", "--compare", "--background-emission", "--output", "-"
        )
        == 0
    )
    cmp = json.loads(capsys.readouterr().out)["compare"]
    assert "background_emission=True" in cmp["instrumented"]
    # the flush after each call waited for the worker: every span arrived, and was charged to its call
    assert cmp["spans_exported"] == cmp["spans_expected"] == 2 * (1 + 4)
    assert cmp["spans_exported_after_each_flush"] == [5, 10]
    assert run_cli("--step-spans", "none") == 2  # without --compare
    assert "--step-spans applies to the instrumented runs of --compare" in capsys.readouterr().err


def test_sampler_always_off_times_unsampled_requests(capsys):
    """--sampler always_off: every instrumented request unsampled, no span exported, its
    metrics still recorded (exported_metric_bytes: the OTLP metric requests hold the latency histograms)."""
    argv = ["--new-tokens", "4", "--runs", "2", "--warmup", "0", "--compare", "--sampler", "always_off"]
    assert run_cli(*argv, "--exporter", "otlp-encode", "--output", "-") == 0
    cmp = json.loads(capsys.readouterr().out)["compare"]
    assert cmp["sampler"] == "always_off" and "sampler=ALWAYS_OFF" in cmp["instrumented"]
    assert cmp["spans_exported"] == cmp["spans_expected"] == 0
    assert cmp["exported_bytes"] == 0 and cmp["exported_metric_bytes"] > 0
    assert cmp["outputs_identical"] is True
    assert run_cli("--sampler", "always_off") == 2  # without --compare
    assert "--sampler applies to the instrumented runs of --compare" in capsys.readouterr().err


# --- the command line ----------------------------------------------------------------------------------


def _env():
    env = dict(os.environ)
    env.pop("OTEL_TRACES_EXPORTER", None)
    return env


def test_python_m_otel_generate_bench_writes_json_to_stdout():
    proc = subprocess.run(
        [sys.executable, "-m", "otel_generate", "bench", "--runs", "1", "--warmup", "0", "--output", "-"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert check_schema(doc) == []
    assert doc["samples"][0]["new_tokens"] == 8  # the default --new-tokens, EOS off
    assert "otel-generate bench:" in proc.stderr and "tokens/s" in proc.stderr


def test_console_script_runs_and_exits_2_on_bad_input():
    script = shutil.which("otel-generate", path=str(Path(sys.executable).parent))
    assert script is not None, "the otel-generate console script is not installed (pip install -e .)"
    proc = subprocess.run(
        [script, "bench", "--runs", "1", "--warmup", "0", "--new-tokens", "2", "--output", "-"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert [s["new_tokens"] for s in json.loads(proc.stdout)["samples"]] == [2]
    bad = subprocess.run([script, "bench", "--runs", "0"], capture_output=True, text=True, env=_env(), timeout=300)
    assert bad.returncode == 2 and "--runs must be at least 1" in bad.stderr and bad.stdout == ""


def test_the_instrumentation_core_never_imports_the_bench():
    code = """
import pkgutil, sys, importlib
import otel_generate
core = sorted(m.name for m in pkgutil.iter_modules(otel_generate.__path__, "otel_generate.")
              if m.name not in ("otel_generate.bench", "otel_generate.__main__"))
for name in core:
    importlib.import_module(name)
import torch, transformers
from otel_generate import GenerateInstrumentor, TokenLatencyProfiler
config = transformers.GPT2Config(vocab_size=16, n_positions=16, n_embd=8, n_layer=1, n_head=1)
model = transformers.GPT2LMHeadModel(config).eval()
with TokenLatencyProfiler() as profiler:  # the core at work: instrument, generate, record, uninstrument
    model.generate(torch.tensor([[1, 2]]), attention_mask=torch.ones(1, 2, dtype=torch.long),
                   max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
assert len(profiler.records) == 1 and profiler.records[0].output_tokens == 2
bench = sorted(m for m in sys.modules if m == "otel_generate.bench" or m.startswith("otel_generate.bench."))
print(len(core), bench)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    count, loaded = proc.stdout.split(maxsplit=1)
    assert int(count) >= 10  # every core module was imported
    assert loaded.strip() == "[]"


# --- the step-hook microbenchmark -----------------------------------------------------------------------


def test_step_hook_microbenchmark_times_every_call_and_reports_paired_differences(tmp_path):
    spec = importlib.util.spec_from_file_location("step_hook", ROOT / "benchmarks" / "step_hook.py")
    step_hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step_hook)
    out = tmp_path / "hook.json"
    assert step_hook.main(["--repeats", "3", "--calls", "20", "--output", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["variants"]) == {"eos_off", "eos_on"}
    for name, variant in doc["variants"].items():
        assert variant["recorded_calls"] == 3 * 20  # the recorder really ran once per call
        assert variant["paired_difference_us"] == [b - a for a, b in zip(variant["without_us"], variant["with_us"])]
        assert variant["hook_us"] == statistics.median(variant["paired_difference_us"])
        assert doc["hook_us"][name] == variant["hook_us"]
        assert all(math.isfinite(v) and v > 0 for v in variant["with_us"] + variant["without_us"])
    assert doc["input_ids_shape"] == [1, 132]
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        step_hook.run(repeats=0)


# --- --model-config --------------------------------------------------------------------------------------


TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def test_model_config_builds_random_weights_of_that_architecture(tmp_path):
    import transformers

    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    result = bench_runner.run(BenchConfig(model_config=str(tmp_path), new_tokens=3, warmup=0, runs=1))
    data = dict(TINY_LLAMA)
    reference = transformers.LlamaForCausalLM(transformers.AutoConfig.for_model(data.pop("model_type"), **data))
    assert result["model"].startswith("LlamaForCausalLM (random weights")
    assert result["parameters"] == sum(p.numel() for p in reference.parameters())
    assert [s["new_tokens"] for s in result["samples"]] == [3]
    # its 32 positions are enforced
    with pytest.raises(BenchUsageError, match="longer than the model's 32 positions"):
        bench_runner.run(BenchConfig(model_config=str(path), prompt_tokens=40, warmup=0, runs=1))


def test_model_config_that_is_not_a_config_exits_2(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text("{}")
    assert run_cli("--model-config", str(path)) == 2
    assert "not a transformers config.json" in capsys.readouterr().err
