"""The instrumentor's options, no model: unknown or ill-typed options are errors, the entry point, the
tensor-parallel option and its environment variable."""

from __future__ import annotations

import pytest

from otel_generate import GenerateInstrumentor
from otel_generate.options import (
    ENV_MEASURE_ENERGY,
    ENV_SYNCHRONIZE,
    ENV_TENSOR_PARALLEL_SPANS,
    SYNCHRONIZE_EVENTS,
    resolve,
)


def test_unknown_option_is_a_type_error(tracer_provider):
    with pytest.raises(TypeError, match="synchronise"):
        GenerateInstrumentor().instrument(tracer_provider=tracer_provider, synchronise=False)
    assert not GenerateInstrumentor().is_instrumented_by_opentelemetry
    with pytest.raises(ValueError, match="synchronize must be True, False, 'wait' or 'events', got 'no'"):
        GenerateInstrumentor().instrument(synchronize="no")
    with pytest.raises(TypeError, match="synchronize must be True, False, 'wait' or 'events', got int 1"):
        GenerateInstrumentor().instrument(synchronize=1)
    with pytest.raises(ValueError, match="max_step_spans must be >= 0"):
        GenerateInstrumentor().instrument(max_step_spans=-1)
    assert not GenerateInstrumentor().is_instrumented_by_opentelemetry


def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    found = [
        ep
        for ep in entry_points(group="opentelemetry_instrumentor")
        if ep.value == "otel_generate:GenerateInstrumentor"
    ]
    assert len(found) == 1
    assert found[0].load() is GenerateInstrumentor


def test_the_option_and_its_environment_variable(monkeypatch):
    assert resolve({}).tensor_parallel_spans == "rank0"
    assert resolve({"tensor_parallel_spans": "ALL"}).tensor_parallel_spans == "all"
    monkeypatch.setenv(ENV_TENSOR_PARALLEL_SPANS, "all")
    assert resolve({}).tensor_parallel_spans == "all"
    assert resolve({"tensor_parallel_spans": "rank0"}).tensor_parallel_spans == "rank0"  # the keyword wins
    monkeypatch.setenv(ENV_TENSOR_PARALLEL_SPANS, "every")
    assert resolve({}).tensor_parallel_spans == "rank0"  # unparsable: warned, default
    with pytest.raises(ValueError, match="tensor_parallel_spans must be one of rank0, all"):
        resolve({"tensor_parallel_spans": "every"})
    with pytest.raises(TypeError, match="tensor_parallel_spans must be a string"):
        resolve({"tensor_parallel_spans": 1})


@pytest.mark.parametrize(
    "given, resolved",
    [
        (True, True),
        (False, False),
        ("wait", True),
        ("WAIT", True),
        ("events", SYNCHRONIZE_EVENTS),
        ("Events", "events"),
    ],
)
def test_synchronize_takes_the_three_modes(given, resolved):
    """``True`` and ``"wait"`` are one mode (today's), ``"events"`` the CUDA-event one, ``False`` none."""
    assert resolve({"synchronize": given}).synchronize == resolved


@pytest.mark.parametrize(
    "raw, resolved",
    [("true", True), ("1", True), ("wait", True), ("events", "events"), ("EVENTS", "events"), ("off", False)],
)
def test_synchronize_environment_variable(raw, resolved, monkeypatch):
    monkeypatch.setenv(ENV_SYNCHRONIZE, raw)
    assert resolve({}).synchronize == resolved
    assert resolve({"synchronize": False}).synchronize is False  # the keyword wins


def test_unparsable_synchronize_variable_keeps_the_default(monkeypatch, caplog):
    monkeypatch.setenv(ENV_SYNCHRONIZE, "sometimes")
    assert resolve({}).synchronize is True
    assert "OTEL_GENERATE_SYNCHRONIZE='sometimes' is not true, false, wait or events" in caplog.text


def test_measure_energy_option_and_variable(monkeypatch):
    assert resolve({}).measure_energy is True
    assert resolve({"measure_energy": False}).measure_energy is False
    monkeypatch.setenv(ENV_MEASURE_ENERGY, "false")
    assert resolve({}).measure_energy is False
    with pytest.raises(TypeError, match="measure_energy must be a bool"):
        resolve({"measure_energy": "no"})
