"""``otel-generate bench --instructions`` without valgrind or a model: bad inputs exit 2 before valgrind
runs, the error without valgrind, the configurations' order, and the paired counts read from callgrind
dumps."""

from __future__ import annotations

import re

import pytest

from otel_generate.bench import instructions
from otel_generate.bench.config import BenchConfig
from tests.helpers.bench import run_cli


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--pairs", "0"], "--pairs must be at least 1"),
        (["--configurations", "unsampled,fast"], "--configurations: unknown 'fast'"),
        (["--new-tokens", "0"], "--new-tokens must be at least 1"),
        (["--compare"], "--instructions is a mode of its own"),
        (["--step-spans", "none"], "--step-spans does not apply to --instructions"),
        (["--device", "cuda"], "CPU only"),
        (["--plot", "x.png"], "--plot does not apply to --instructions"),
    ],
)
def test_bad_inputs_exit_2_before_valgrind_runs(monkeypatch, tmp_path, capsys, argv, message):
    ran = []
    monkeypatch.setattr(instructions.subprocess, "run", lambda *a, **k: ran.append(a))
    out = tmp_path / "out.json"
    assert run_cli("--instructions", *argv, "--output", str(out)) == 2
    err = capsys.readouterr().err
    assert "otel-generate bench: error:" in err and message in err
    assert ran == [] and not out.exists()


def test_without_valgrind_exits_2_and_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(instructions.shutil, "which", lambda name: None)
    out = tmp_path / "out.json"
    assert run_cli("--instructions", "--output", str(out)) == 2
    err = capsys.readouterr().err
    assert instructions.VALGRIND_MISSING in err and not out.exists()


def test_configurations_are_kept_in_their_table_order():
    assert instructions.parse_configurations("unsampled,all-step-spans") == ["all-step-spans", "unsampled"]
    assert instructions.parse_configurations(None) == list(instructions.CONFIGURATIONS)
    assert "plain" not in instructions.CONFIGURATIONS  # every configuration is paired with plain calls


def _process(name, plain, instrumented, view="all", identical=True, steps=4):
    """What one configuration's process gives: its child result and its dumps, ``plain`` and
    ``instrumented`` the counts of its pairs' calls (every other dump: set-up, between, teardown)."""
    labels, dumps = [f"{name} setup"], {1: 10_000_000}
    for pair, (p, i) in enumerate(zip(plain, instrumented)):
        for kind, count in (("plain", p), ("instrumented", i), ("between", 5_000_000)):
            labels.append(f"{name} {kind} {pair}")
            dumps[len(labels)] = count
    labels.append(f"{name} teardown")
    dumps[len(labels)] = 10_000_000
    child = {
        "labels": labels,
        "configurations": [name],
        "runs": {
            name: {"steps": steps, "spans_per_call": 1, "spans_expected_per_call": 1, "outputs_identical": identical}
        },
        "versions": {"torch": "x"},
        "model": "m",
        "parameters": 1,
    }
    return instructions.configuration_counts(child, dumps)


def test_paired_counts_give_the_added_work_per_call_for_each_thread_view():
    config = BenchConfig(instructions=True, pairs=3, new_tokens=4)
    counts = {
        ("unsampled", "all"): _process("unsampled", [1000, 1010, 990], [1130, 1160, 1120]),
        ("unsampled", "caller"): _process("unsampled", [900, 905, 895], [910, 905, 915]),
    }
    assert counts[("unsampled", "all")]["plain"] == [1000, 1010, 990]
    doc = instructions.result_document(config, counts)
    (row,) = doc["configurations"]
    assert row["plain_per_call"] == 1000 and row["instructions_per_call"] == pytest.approx(3410 / 3)
    assert row["added_per_call"] == pytest.approx(410 / 3)  # 130, 150, 130
    assert (row["added_min_per_call"], row["added_median_per_call"], row["added_max_per_call"]) == (130, 130, 150)
    assert row["added_percent"] == pytest.approx(100 * (410 / 3) / 1000)
    assert row["added_per_step"] == pytest.approx(410 / 3 / 4)
    assert row["caller_plain_per_call"] == 900 and row["caller_added_per_call"] == pytest.approx(10)
    assert (row["caller_added_min_per_call"], row["caller_added_max_per_call"]) == (0, 20)
    assert row["outputs_identical"] is True and doc["pairs"] == 3
    assert doc["method"].startswith("per configuration, two processes")
    text = instructions.summary_text(doc | {"environment": {"torch_threads": 1}})
    assert "the caller's thread" in text and "all threads" in text and "+13.667%" in text and "+1.111%" in text


def test_outputs_must_match_plain_in_both_processes():
    config = BenchConfig(instructions=True, pairs=1, new_tokens=4)
    counts = {
        ("all-step-spans", "all"): _process("all-step-spans", [1000], [1500]),
        ("all-step-spans", "caller"): _process("all-step-spans", [900], [950], identical=False),
    }
    (row,) = instructions.result_document(config, counts)["configurations"]
    assert row["outputs_identical"] is False
    assert "some instrumented outputs differ" in instructions.summary_text(
        instructions.result_document(config, counts) | {"environment": {"torch_threads": 1}}
    )


def test_a_failed_process_names_its_configuration_and_exits_2(monkeypatch, tmp_path, capsys):
    started = []

    class FailingProcess:
        def __init__(self, command, env, stdout):
            started.append(command[-1])  # the spec's path: <workdir>/cNNa/spec.json or cNNc (all threads, caller)

        def wait(self):
            return 1

        def terminate(self):
            pass

    monkeypatch.setattr(instructions.shutil, "which", lambda name: "/usr/bin/valgrind")
    monkeypatch.setattr(instructions.subprocess, "Popen", FailingProcess)
    out = tmp_path / "out.json"
    assert run_cli("--instructions", "--configurations", "all-step-spans,unsampled", "--output", str(out)) == 2
    err = capsys.readouterr().err
    # (every process fails; whichever is seen first is named)
    assert re.search(r"the process under valgrind for '(all-step-spans|unsampled)' failed \(exit status 1\)", err)
    assert not out.exists()
    # folders of one length for every configuration: the child's arguments move no allocation
    # (two workers: either process may start first, and the other may not start at all)
    assert {len(path) for path in started} == {len(started[0])}
    assert any(path.endswith(("c00a/spec.json", "c00c/spec.json")) for path in started)


def test_stopped_children_start_no_other_process(monkeypatch):
    monkeypatch.setattr(instructions.subprocess, "Popen", lambda *a, **k: pytest.fail("a process was started"))
    children = instructions._Children()
    children.stop()
    assert children.run(["valgrind"], {}) == -1


def test_span_processor_exports_at_flush_not_on_the_sdk_timer():
    """The processor under valgrind exports at a flush (or a full batch), never after the SDK's 5 s timer."""
    import time

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    processor = instructions.span_processor(exporter)
    assert isinstance(processor, BatchSpanProcessor)
    provider = TracerProvider()
    provider.add_span_processor(processor)
    try:
        provider.get_tracer("test").start_span("request").end()
        time.sleep(5.5)  # past the SDK's default schedule_delay_millis (5000)
        assert exporter.get_finished_spans() == ()
        assert provider.force_flush()
        assert [span.name for span in exporter.get_finished_spans()] == ["request"]
    finally:
        provider.shutdown()
