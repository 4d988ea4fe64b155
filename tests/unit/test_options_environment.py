"""The package's environment variables without a model: an unparsable value is reported once per process,
parsable ones (padded, empty) give no warning and reach the options ``instrument()`` uses."""

from __future__ import annotations

import logging

import pytest

from tests.helpers.instrumenting import LOGGER, instrumentation, warnings_from_package


def test_unparsable_environment_value_is_reported_once_per_process(
    no_package_env, monkeypatch, caplog, tracer_provider
):
    monkeypatch.setenv("OTEL_GENERATE_MAX_STEP_SPANS", "lots")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(3):  # e.g. three profilers, each turning the instrumentation on and off
            with instrumentation(tracer_provider=tracer_provider):
                pass
    assert len(warnings_from_package(caplog)) == 1


@pytest.mark.parametrize(
    "variable, value, option, parsed",
    [
        ("OTEL_GENERATE_SYNCHRONIZE", " FALSE ", "synchronize", False),
        ("OTEL_GENERATE_SYNCHRONIZE", "", "synchronize", True),
        ("OTEL_GENERATE_MAX_STEP_SPANS", " 7 ", "max_step_spans", 7),
        ("OTEL_GENERATE_MAX_STEP_SPANS", "", "max_step_spans", 1024),
    ],
)
def test_parsable_environment_values_give_no_warning(
    variable, value, option, parsed, no_package_env, captured_telemetry, monkeypatch, caplog, tracer_provider
):
    monkeypatch.setenv(variable, value)
    with caplog.at_level(logging.WARNING, logger=LOGGER), instrumentation(tracer_provider=tracer_provider):
        pass
    assert warnings_from_package(caplog) == []
    assert getattr(captured_telemetry[0], option) == parsed


def test_explain_lists_every_option_but_the_providers_and_names_an_invalid_value(no_package_env, monkeypatch):
    from otel_generate import options

    monkeypatch.setenv("OTEL_GENERATE_MEASURE_ENERGY", "maybe")
    monkeypatch.setenv("OTEL_GENERATE_SLOW_FRACTION", "2")
    monkeypatch.setenv("OTEL_GENERATE_STEP_SPANS", "slow")
    explained = options.explain()
    assert set(explained) == set(options.NAMES) - {"tracer_provider", "meter_provider", "logger_provider"}
    assert explained["measure_energy"] == {
        "value": True,
        "variable": "OTEL_GENERATE_MEASURE_ENERGY",
        "source": "default",
        "ignored": "maybe",
        "problem": "OTEL_GENERATE_MEASURE_ENERGY='maybe' is not true or false; using the default true",
    }
    assert explained["slow_fraction"]["problem"] == (
        "OTEL_GENERATE_SLOW_FRACTION='2' is not a number between 0 and 1; using the default 0.05"
    )
    assert explained["step_spans"] == {"value": "slow", "variable": "OTEL_GENERATE_STEP_SPANS", "source": "environment"}
    assert [name for name, entry in explained.items() if "problem" in entry] == ["slow_fraction", "measure_energy"]


@pytest.mark.parametrize(
    "variable, value, message",
    [
        (
            "OTEL_GENERATE_SYNCHRONIZE",
            "maybe",
            "OTEL_GENERATE_SYNCHRONIZE='maybe' is not true, false, wait or events; using the default true",
        ),
        (
            "OTEL_GENERATE_BACKGROUND_EMISSION",
            "sometimes",
            "OTEL_GENERATE_BACKGROUND_EMISSION='sometimes' is not true or false; using the default true",
        ),
        (
            "OTEL_GENERATE_CAPTURE_STEP_LOGPROBS",
            "2",
            "OTEL_GENERATE_CAPTURE_STEP_LOGPROBS='2' is not true or false; using the default false",
        ),
        (
            "OTEL_GENERATE_STEP_OUTLIER_FACTOR",
            "0.5",
            "OTEL_GENERATE_STEP_OUTLIER_FACTOR='0.5' is not a number >= 1; using the default 3",
        ),
        (
            "OTEL_GENERATE_MAX_STEP_SPANS",
            "lots",
            "OTEL_GENERATE_MAX_STEP_SPANS='lots' is not an int >= 0; using the default 1024",
        ),
    ],
)
def test_the_warning_spells_the_default_as_the_configuration_page_does(
    variable, value, message, no_package_env, monkeypatch, caplog, tracer_provider
):
    monkeypatch.setenv(variable, value)
    with caplog.at_level(logging.WARNING, logger=LOGGER), instrumentation(tracer_provider=tracer_provider):
        pass
    (warning,) = warnings_from_package(caplog)
    assert warning.getMessage() == f"otel_generate: {message}"
