"""``otel-generate bench --instructions`` without valgrind or a model: bad inputs exit 2 before valgrind
runs, the error without valgrind, the configurations' order, and the difference method read from callgrind
dumps."""

from __future__ import annotations

import pytest

from otel_generate.bench import instructions
from otel_generate.bench.config import BenchConfig
from tests.helpers.bench import run_cli


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--calls-low", "3", "--calls-high", "3"], "--calls-high must be above --calls-low"),
        (["--calls-low", "-1"], "--calls-low must be 0 or more"),
        (["--configurations", "plain,fast"], "--configurations: unknown 'fast'"),
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


def test_configurations_are_kept_in_order_with_plain_first():
    assert instructions.parse_configurations("unsampled,all-step-spans") == ["plain", "all-step-spans", "unsampled"]
    assert instructions.parse_configurations(None) == list(instructions.CONFIGURATIONS)
    assert instructions.parse_configurations("unsampled,plain-sdk") == ["plain", "plain-sdk", "unsampled"]


def test_difference_method_from_dumps():
    config = BenchConfig(instructions=True, calls_low=2, calls_high=6, new_tokens=4)
    labels = ["plain setup", "plain low", "plain gc after low", "plain high", "plain gc after high", "plain teardown"]
    labels += [label.replace("plain", "unsampled") for label in labels]
    # dumps 1..12 (all threads together); low: 2 calls, high: 6 calls
    dumps = {i + 1: 10_000_000 for i in range(12)}
    dumps[2], dumps[4] = 2 * 1000 + 50, 6 * 1000 + 50  # plain: 1000 per call + 50 once
    dumps[8], dumps[10] = 2 * 1130 + 70, 6 * 1130 + 70  # unsampled: 1130 per call + 70 once
    child = {
        "configurations": ["plain", "unsampled"],
        "runs": {
            name: {"steps": 4, "spans_per_call": 0, "spans_expected_per_call": 0, "outputs_identical": True}
            for name in ("plain", "unsampled")
        },
        "versions": {},
        "model": "m",
        "parameters": 1,
    }
    doc = instructions.result_document(config, child, dumps, labels)
    plain, unsampled = doc["configurations"]
    assert plain["instructions_per_call"] == 1000 and plain["instructions_per_step"] == 250
    assert unsampled["instructions_per_call"] == 1130
    assert unsampled["added_per_call"] == 130 and unsampled["added_percent"] == pytest.approx(13.0)
    assert unsampled["added_per_step"] == 32.5
    assert "added_over_sdk_per_call" not in unsampled  # plain-sdk did not run
    text = instructions.summary_text(doc | {"environment": {"torch_threads": 1}, "exporter": "discard"})
    assert "over plain-sdk" not in text  # no column heading without values under it
    assert "+13.000%" in text


def test_added_over_plain_sdk_when_it_ran():
    config = BenchConfig(instructions=True, calls_low=2, calls_high=6, new_tokens=4)
    names = ["plain", "plain-sdk", "unsampled"]
    parts = ["setup", "low", "gc after low", "high", "gc after high", "teardown"]
    labels = [f"{name} {part}" for name in names for part in parts]
    dumps = {i + 1: 10_000_000 for i in range(len(labels))}
    for block, per_call in enumerate((1000, 1010, 1130)):  # low: 2 calls, high: 6 calls, 50 once each
        dumps[6 * block + 2], dumps[6 * block + 4] = 2 * per_call + 50, 6 * per_call + 50
    child = {
        "configurations": names,
        "runs": {
            name: {"steps": 4, "spans_per_call": 0, "spans_expected_per_call": 0, "outputs_identical": True}
            for name in names
        },
        "versions": {},
        "model": "m",
        "parameters": 1,
    }
    doc = instructions.result_document(config, child, dumps, labels)
    plain, sdk, unsampled = doc["configurations"]
    assert sdk["added_per_call"] == 10 and "added_over_sdk_per_call" not in sdk
    assert unsampled["added_per_call"] == 130
    assert unsampled["added_over_sdk_per_call"] == 120
    assert unsampled["added_over_sdk_percent"] == pytest.approx(100 * 120 / 1010)
    text = instructions.summary_text(doc | {"environment": {"torch_threads": 1}, "exporter": "discard"})
    assert "over plain-sdk" in text and "+11.881%" in text


def _process(name, per_call, sequences, identical=True):
    """What one configuration's process gives: its child result and its six dumps (2 and 6 calls)."""
    parts = ["setup", "low", "gc after low", "high", "gc after high", "teardown"]
    child = {
        "labels": [f"{name} {part}" for part in parts],
        "configurations": [name],
        "runs": {
            name: {
                "steps": 4,
                "spans_per_call": 0,
                "spans_expected_per_call": 0,
                "outputs_identical": identical,
                "sequences": sequences,
            }
        },
        "versions": {"torch": "x"},
        "model": "m",
        "parameters": 1,
    }
    dumps = {number: 10_000_000 for number in range(1, 7)}
    dumps[2], dumps[4] = 2 * per_call + 50, 6 * per_call + 50
    return child, dumps


def test_one_process_per_configuration_merged_in_order():
    config = BenchConfig(instructions=True, calls_low=2, calls_high=6, new_tokens=4)
    processes = [
        _process("plain", 1000, [[1, 2, 3]]),
        _process("plain-sdk", 1010, [[1, 2, 3]]),
        _process("unsampled", 1130, [[1, 2, 3]]),
    ]
    child, dumps, labels = instructions.merge_processes(processes)
    assert child["configurations"] == ["plain", "plain-sdk", "unsampled"]
    assert labels[6:8] == ["plain-sdk setup", "plain-sdk low"] and sorted(dumps) == list(range(1, 19))
    assert dumps[14] == 2 * 1130 + 50  # unsampled's low part, numbered on after the first two processes
    assert "sequences" not in child["runs"]["unsampled"] and child["versions"] == {"torch": "x"}
    doc = instructions.result_document(config, child, dumps, labels)
    plain, sdk, unsampled = doc["configurations"]
    assert plain["instructions_per_call"] == 1000 and sdk["added_per_call"] == 10
    assert unsampled["added_per_call"] == 130 and unsampled["added_over_sdk_per_call"] == 120
    assert all(row["outputs_identical"] for row in doc["configurations"])
    assert doc["method"].startswith("one process per configuration")


def test_outputs_compared_with_plain_across_processes():
    processes = [
        _process("plain", 1000, [[1, 2, 3]]),
        _process("all-step-spans", 1500, [[1, 2, 4]]),  # another output than plain's
        _process("unsampled", 1130, [[1, 2, 3]], identical=False),  # its own calls disagreed
    ]
    child, _, _ = instructions.merge_processes(processes)
    identical = {name: run["outputs_identical"] for name, run in child["runs"].items()}
    assert identical == {"plain": True, "all-step-spans": False, "unsampled": False}


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
    assert run_cli("--instructions", "--configurations", "plain,unsampled", "--output", str(out)) == 2
    err = capsys.readouterr().err
    assert "the process under valgrind for 'plain' failed (exit status 1)" in err and not out.exists()
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
