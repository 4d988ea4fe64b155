"""The instrumentor's options, no model: unknown or ill-typed options are errors, the entry point, the
tensor-parallel option and its environment variable."""

from __future__ import annotations

import pytest

from otel_generate import GenerateInstrumentor
from otel_generate.options import ENV_TENSOR_PARALLEL_SPANS, resolve


def test_unknown_option_is_a_type_error(tracer_provider):
    with pytest.raises(TypeError, match="synchronise"):
        GenerateInstrumentor().instrument(tracer_provider=tracer_provider, synchronise=False)
    assert not GenerateInstrumentor().is_instrumented_by_opentelemetry
    with pytest.raises(TypeError, match="synchronize must be a bool"):
        GenerateInstrumentor().instrument(synchronize="no")
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
