"""``_lifecycle.forget_inherited_metrics``: the one function that reads the SDK's storage, on its own.

In a forked child it drops what this package's instruments inherited (open-telemetry/opentelemetry-python#2767),
exactly, for cumulative and DELTA readers; where the storage is not what it expects, it logs once and writes
nothing. CI runs this file on the floor SDK and the newest one.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
from opentelemetry.sdk.metrics import Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader

from otel_generate import GenerateInstrumentor, _lifecycle
from otel_generate import attributes as A


def _counts(reader):
    data = reader.get_metrics_data()
    return {
        m.name: sorted((p.count, p.sum) for p in m.data.data_points)
        for rm in (data.resource_metrics if data else ())
        for sm in rm.scope_metrics
        for m in sm.metrics
    }


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_a_forked_child_reads_only_its_own_values_and_the_parent_keeps_its_own():
    cumulative = InMemoryMetricReader()
    delta = InMemoryMetricReader(preferred_temporality={Histogram: AggregationTemporality.DELTA})
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(meter_provider=MeterProvider(metric_readers=[cumulative, delta]))
    try:
        duration = instrumentor.telemetry.instruments[A.METRIC_REQUEST_DURATION]
        duration.record(0.5, {"model": "a"})
        duration.record(0.25, {"model": "a"})
        assert _counts(delta)[A.METRIC_REQUEST_DURATION] == [(2, 0.75)]  # a DELTA collection before the fork
        duration.record(1.0, {"model": "a"})  # the parent's, not collected yet
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its own one value, in both readers
            try:
                duration.record(2.0, {"model": "a"})
                result = {"cumulative": _counts(cumulative), "delta": _counts(delta)}
                duration.record(4.0, {"model": "a"})
                result["delta again"] = _counts(delta)
                os.write(write, json.dumps(result).encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            child = json.loads(pipe.read())
        os.waitpid(pid, 0)
        assert child["cumulative"][A.METRIC_REQUEST_DURATION] == [[1, 2.0]]
        assert child["delta"][A.METRIC_REQUEST_DURATION] == [[1, 2.0]]
        assert child["delta again"][A.METRIC_REQUEST_DURATION] == [[1, 4.0]]
        # the parent: every value of its own, none of the child's
        assert _counts(cumulative)[A.METRIC_REQUEST_DURATION] == [(3, 1.75)]
        assert _counts(delta)[A.METRIC_REQUEST_DURATION] == [(1, 1.0)]
    finally:
        instrumentor.uninstrument()


class _Odd:
    """An SDK-like instrument whose storage is laid out otherwise."""

    def __init__(self, storages):
        self._measurement_consumer = type("Consumer", (), {"_reader_storages": storages})()


def test_a_storage_laid_out_otherwise_is_left_alone_and_said_once(caplog, monkeypatch):
    monkeypatch.setattr(_lifecycle, "_warned", set())
    matches = ["not a match"]  # would be written to, were it not checked
    storage = type("Storage", (), {"_instrument_view_instrument_matches": matches})()
    odd = [_Odd({"reader": storage}), _Odd(["not a dict"])]
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    ours = provider.get_meter("otel_generate").create_histogram("ours")
    ours.record(1.0)
    with caplog.at_level(logging.WARNING, logger="otel_generate"):
        assert _lifecycle.forget_inherited_metrics([*odd, ours]) == 1  # the real one is still dropped
        assert _lifecycle.forget_inherited_metrics(odd) == 0
    assert matches == ["not a match"]
    warnings = [r.getMessage() for r in caplog.records if r.name == "otel_generate"]
    assert len(warnings) == 1 and "could not drop the metrics it inherited" in warnings[0]
    assert _counts(reader) == {}


def test_instruments_without_sdk_storage_have_nothing_to_drop(caplog):
    from opentelemetry.metrics import NoOpHistogram, get_meter_provider

    with caplog.at_level(logging.WARNING, logger="otel_generate"):
        proxy = get_meter_provider().get_meter("never-set").create_histogram("h")  # the API's stand-in, or no-op
        assert _lifecycle.forget_inherited_metrics([NoOpHistogram("h"), proxy, object()]) == 0
    assert not [r for r in caplog.records if r.name == "otel_generate"]
