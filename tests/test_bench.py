"""``otel-generate bench``: timer boundaries, token counts, the JSON document, the plot, errors, --compare.

No timing assertions: the numbers are checked for how they were computed, never for how large they are.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from otel_generate import GenerateInstrumentor, clock
from otel_generate.bench import harness, stats
from otel_generate.bench.cli import main
from otel_generate.bench.models import PAD_TOKEN_ID, build_model
from otel_generate.tokens import count_new_tokens

ROOT = Path(__file__).resolve().parent.parent
FAST = ["--runs", "2", "--warmup", "1", "--new-tokens", "3"]


def run_cli(*argv):
    return main(["bench", *argv])


def no_eos_continuation(batch_size, new_tokens, prompt_tokens=4, seed=0):
    """What the harness's model generates for its seeded prompt with EOS off (computed apart from the harness)."""
    model = build_model("gpt2", seed=seed)
    inputs = harness.make_inputs(model, batch_size, prompt_tokens, seed)
    out = model.generate(
        **inputs, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=PAD_TOKEN_ID
    )
    return out[:, prompt_tokens:].tolist()


def first_index(row, token):
    return row.index(token) if token in row else None


# --- the JSON contract ------------------------------------------------------------------------------

NUMBER = (int, float)


def check_schema(doc):
    """The issue's key list, with types; returns the problems found (empty when valid)."""
    problems = []
    types = {
        "versions": dict, "device": str, "dtype": str, "parameters": int, "prompt_tokens": int,
        "new_tokens_requested": int, "batch_size": int, "warmup": int, "runs": int, "threads": int,
        "samples": list, "median_elapsed_s": NUMBER, "median_tokens_per_s": NUMBER,
        # None only when no run had a second token (TPOT) or a completed step (TTFT)
        "median_time_to_first_token_ms": NUMBER + (type(None),),
        "median_time_per_output_token_ms": NUMBER + (type(None),),
    }
    assert set(types) == set(harness.RESULT_KEYS)
    for key, kind in types.items():
        if key not in doc:
            problems.append(f"missing {key}")
        elif isinstance(doc[key], bool) or not isinstance(doc[key], kind):
            problems.append(f"{key} is {type(doc[key]).__name__}")
    versions = doc.get("versions") if isinstance(doc.get("versions"), dict) else {}
    for key in harness.VERSION_KEYS:
        if not isinstance(versions.get(key), str):
            problems.append(f"versions.{key} missing")
    samples = doc.get("samples") if isinstance(doc.get("samples"), list) else []
    for i, sample in enumerate(samples):
        for key, kind in (("elapsed_s", float), ("new_tokens", int), ("tokens_per_s", float)):
            if not isinstance(sample.get(key), kind) or isinstance(sample.get(key), bool):
                problems.append(f"samples[{i}].{key} is {type(sample.get(key)).__name__}")
    if len(samples) != doc.get("runs"):
        problems.append("one sample per measured run expected")
    return problems


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
    err = capsys.readouterr().err
    assert "tokens/s" in err and "time to first token" in err  # the human-readable summary is on stderr


def test_schema_check_rejects_a_document_missing_a_key():
    doc = {key: 0 for key in harness.RESULT_KEYS}
    assert check_schema(doc)  # wrong types and missing versions are reported
    assert any("missing median_tokens_per_s" in p for p in check_schema({k: v for k, v in doc.items() if k != "median_tokens_per_s"}))


# --- the timer ---------------------------------------------------------------------------------------


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


def test_each_measured_run_is_one_synchronized_generate_between_two_clock_reads(monkeypatch):
    log = []
    now = [0.0]

    def fake_clock():
        log.append("clock")
        now[0] += 0.25
        return now[0]

    monkeypatch.setattr(harness, "synchronizer_for", lambda device: (lambda: log.append("sync")))
    original = harness._Runner.generate

    def generate(self):
        log.append("call")
        return original(self)

    monkeypatch.setattr(harness._Runner, "generate", generate)
    config = harness.BenchConfig(new_tokens=3, warmup=2, runs=3)
    result = harness.run(config, clock=fake_clock)
    # warmup calls are not timed; each measured run: sync, clock, generate, sync, clock
    assert log == ["call"] * 2 + ["sync", "clock", "call", "sync", "clock"] * 3
    assert [s["elapsed_s"] for s in result["samples"]] == [0.25] * 3
    assert [s["tokens_per_s"] for s in result["samples"]] == [3 / 0.25] * 3


# --- invalid input ----------------------------------------------------------------------------------


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
    with pytest.raises(harness.BenchUsageError, match=message):
        harness.BenchConfig(**changes).validate()


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
    with pytest.raises(harness.BenchUsageError, match=message):
        harness.check_lengths(prompt, new, positions)


def test_lengths_that_fit_exactly_are_accepted():
    harness.check_lengths(2048, 1, 2048)
    harness.check_lengths(4, 2045, 2048)  # positions 0..2047 are fed
    harness.check_lengths(10_000, 10, None)  # no position limit known (relative positions)


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


def test_cuda_requested_without_cuda_exits_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out.json"
    assert run_cli("--device", "cuda", "--output", str(out)) == 2
    assert "CUDA was requested but is not available" in capsys.readouterr().err
    assert not out.exists()


def test_auto_device_falls_back_to_cpu_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run_cli("--device", "auto", *FAST, "--runs", "1", "--output", "-") == 0
    assert json.loads(capsys.readouterr().out)["device"] == "cpu"


def test_plot_without_matplotlib_exits_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    plot = tmp_path / "plot.png"
    assert run_cli("--plot", str(plot)) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
    assert not plot.exists()


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
    result = harness.run(harness.BenchConfig(new_tokens=3, warmup=0, runs=2))
    for sample in result["samples"]:
        assert sample["new_tokens"] == 3 and sample["new_tokens_per_sequence"] == [3]
        assert sample["tokens_per_s"] == sample["new_tokens"] / sample["elapsed_s"]


def test_early_eos_reports_the_real_count(capsys):
    new = 8
    row = no_eos_continuation(1, new)[0]
    # a token whose first occurrence is not the first position: generation stops right after it
    index = next(i for i in range(1, new - 1) if row[i] not in row[:i])
    expected = index + 1
    assert run_cli("--new-tokens", str(new), "--warmup", "0", "--runs", "2", "--eos", str(row[index]), "--output", "-") == 0
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
    candidates = [
        (r, t) for r in (0, 1) for t in rows[r][: new - 1] if t not in rows[1 - r] and t != PAD_TOKEN_ID
    ]
    assert candidates, rows
    row, token = candidates[0]
    expected = [new, new]
    expected[row] = first_index(rows[row], token) + 1
    assert rows[1 - row][-1] != PAD_TOKEN_ID  # the full row does not end in what looks like padding
    result = harness.run(harness.BenchConfig(new_tokens=new, warmup=0, runs=2, batch_size=2, eos=str(token)))
    for sample in result["samples"]:
        assert sample["new_tokens_per_sequence"] == expected
        assert sample["new_tokens"] == sum(expected)
        assert sample["tokens_per_s"] == sum(expected) / sample["elapsed_s"]


def test_counting_matches_count_new_tokens_on_the_returned_tensor():
    config = harness.BenchConfig(new_tokens=5, batch_size=2, eos="model")
    runner = harness._Runner(config, "cpu")
    out = runner.generate()
    assert runner.counts(out) == count_new_tokens(out, 4, [runner.model.generation_config.eos_token_id], PAD_TOKEN_ID)


def test_eos_without_id_uses_the_model_eos():
    model = build_model("gpt2")
    assert harness.resolve_eos(harness.BenchConfig(eos="model"), model) == [model.generation_config.eos_token_id]
    assert harness.resolve_eos(harness.BenchConfig(), model) is None
    with pytest.raises(harness.BenchUsageError, match="outside the model's vocabulary"):
        harness.resolve_eos(harness.BenchConfig(eos="100000"), model)


def test_prompt_avoids_special_tokens_and_is_seeded():
    model = build_model("gpt2")
    a = harness.make_inputs(model, 3, 50, seed=1)
    b = harness.make_inputs(model, 3, 50, seed=1)
    assert torch.equal(a["input_ids"], b["input_ids"]) and a["input_ids"].shape == (3, 50)
    assert torch.equal(a["attention_mask"], torch.ones(3, 50, dtype=torch.long))
    specials = set(harness.special_token_ids(model))
    assert specials >= {0, 127} and not (set(a["input_ids"].flatten().tolist()) & specials)


# --- plot ----------------------------------------------------------------------------------------------


def test_plot_writes_a_matplotlib_png_of_every_run(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    calls = []
    original = Axes.plot

    def spy(self, *args, **kwargs):
        calls.append((list(args[0]), list(args[1]), kwargs))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", spy)
    plot, out = tmp_path / "latency.png", tmp_path / "out.json"
    assert run_cli("--new-tokens", "6", "--runs", "2", "--warmup", "0", "--plot", str(plot), "--output", str(out)) == 0
    data = plot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"Matplotlib" in data  # matplotlib's Software text chunk
    samples = json.loads(out.read_text())["samples"]
    lines = [c for c in calls if c[2].get("marker") is None]
    marks = [c for c in calls if c[2].get("marker") == "o"]
    assert [(x, y) for x, y, _ in lines] == [(list(range(6)), s["step_latencies_ms"]) for s in samples]
    assert [(x, y) for x, y, _ in marks] == [([0], [s["step_latencies_ms"][0]]) for s in samples]  # first token marked


# --- --compare ----------------------------------------------------------------------------------------


def test_compare_interleaves_plain_and_instrumented_and_reports_paired_numbers(monkeypatch):
    instrumented_at_call = []
    original = harness._Runner.timed

    def timed(self):
        instrumented_at_call.append(GenerateInstrumentor().is_instrumented_by_opentelemetry)
        return original(self)

    monkeypatch.setattr(harness._Runner, "timed", timed)
    result = harness.run(harness.BenchConfig(new_tokens=4, warmup=1, runs=3, compare=True))
    cmp = result["compare"]
    # measured runs (profiler: instrumented), then compare: warmup pair, then 3 pairs, A B A B
    assert instrumented_at_call[3:] == [False, True] * 4
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
    assert not GenerateInstrumentor().is_instrumented_by_opentelemetry  # left as found


def test_compare_refuses_when_generate_is_already_instrumented(instrumented, tmp_path, capsys):
    out = tmp_path / "out.json"
    assert run_cli("--compare", "--output", str(out)) == 2
    assert "--compare needs generate() uninstrumented" in capsys.readouterr().err
    assert not out.exists()


# --- the command line ----------------------------------------------------------------------------------


def _env():
    env = dict(os.environ)
    env.pop("OTEL_TRACES_EXPORTER", None)
    return env


def test_python_m_otel_generate_bench_writes_json_to_stdout():
    proc = subprocess.run(
        [sys.executable, "-m", "otel_generate", "bench", "--runs", "1", "--warmup", "0", "--output", "-"],
        capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=300,
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
        capture_output=True, text=True, env=_env(), timeout=300,
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
    "model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}


def test_model_config_builds_random_weights_of_that_architecture(tmp_path):
    import transformers

    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    result = harness.run(harness.BenchConfig(model_config=str(tmp_path), new_tokens=3, warmup=0, runs=1))
    data = dict(TINY_LLAMA)
    reference = transformers.LlamaForCausalLM(transformers.AutoConfig.for_model(data.pop("model_type"), **data))
    assert result["model"].startswith("LlamaForCausalLM (random weights")
    assert result["parameters"] == sum(p.numel() for p in reference.parameters())
    assert [s["new_tokens"] for s in result["samples"]] == [3]
    # its 32 positions are enforced
    with pytest.raises(harness.BenchUsageError, match="longer than the model's 32 positions"):
        harness.run(harness.BenchConfig(model_config=str(path), prompt_tokens=40, warmup=0, runs=1))


def test_model_config_that_is_not_a_config_exits_2(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text("{}")
    assert run_cli("--model-config", str(path)) == 2
    assert "not a transformers config.json" in capsys.readouterr().err
