"""``otel-generate bench --instructions`` without valgrind or a model: the configurations' order, the
difference method read from callgrind dumps, and the error without valgrind."""

from __future__ import annotations

import pytest

from otel_generate.bench import harness, instructions
from tests.unit.test_bench_cli_and_stats import run_cli


def test_without_valgrind_exits_2_and_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(instructions.shutil, "which", lambda name: None)
    out = tmp_path / "out.json"
    assert run_cli("--instructions", "--output", str(out)) == 2
    err = capsys.readouterr().err
    assert instructions.VALGRIND_MISSING in err and not out.exists()


def test_configurations_are_kept_in_order_with_plain_first():
    assert instructions.parse_configurations("unsampled,all-step-spans") == ["plain", "all-step-spans", "unsampled"]
    assert instructions.parse_configurations(None) == list(instructions.CONFIGURATIONS)


def test_difference_method_from_dumps():
    config = harness.BenchConfig(instructions=True, calls_low=2, calls_high=6, new_tokens=4)
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
