"""The step-span policy on its own, no model: the slowest fraction kept per model in bounded memory, and
invalid policy options."""

from __future__ import annotations

import pytest

from otel_generate import GenerateInstrumentor
from otel_generate.policy import MAX_MODELS, MIN_SAMPLES, WINDOW, SlowRequests


def test_slowest_fraction_is_kept_per_model_in_bounded_memory():
    tracker = SlowRequests(time_to_first_token_s=100.0, time_per_output_token_s=100.0, fraction=0.1)
    # below MIN_SAMPLES nothing is slow by fraction
    assert [tracker.reason("m", False, 0.001, 0.01) for _ in range(MIN_SAMPLES)] == [None] * MIN_SAMPLES
    # 100 requests of TPOT 0.01..1.00: the slowest tenth of what came before is slow
    reasons = [tracker.reason("m", False, 0.001, (i % 100 + 1) / 100) for i in range(100)]
    assert reasons[-1] == "slowest_fraction" and reasons[0] is None
    assert tracker.reason("other", False, 0.001, 50.0) is None  # another model: its own distribution
    for _ in range(WINDOW * 3):
        tracker.reason("m", False, 0.001, 0.5)
    assert tracker.models()["m"] == 2 * WINDOW  # the two windows are bounded
    for i in range(MAX_MODELS + 10):
        tracker.reason(f"model-{i}", False, 0.001, 0.5)
    assert len(tracker.models()) == MAX_MODELS
    assert tracker.reason("x", True, None, None) == "error"


def test_invalid_policy_options_are_errors():
    instrumentor = GenerateInstrumentor()
    with pytest.raises(ValueError, match="step_spans must be one of all, none, slow"):
        instrumentor.instrument(step_spans="some")
    with pytest.raises(TypeError, match="slow_fraction must be a number"):
        instrumentor.instrument(slow_fraction="0.5")
    with pytest.raises(ValueError, match="slow_fraction must be between 0 and 1"):
        instrumentor.instrument(slow_fraction=2)
    with pytest.raises(ValueError, match="outlier_factor must be >= 1"):
        instrumentor.instrument(outlier_factor=0.5)
    assert not instrumentor.is_instrumented_by_opentelemetry
