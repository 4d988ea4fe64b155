"""The GenAI histograms in the real Prometheus, through the real Collector (``collector/local.sh up``).

``examples/app.py`` runs :data:`REQUESTS` times under ``opentelemetry-instrument``, exporting
traces and metrics over OTLP to the Collector; its Prometheus exporter is scraped by Debian's
Prometheus 2.42, which also loads the SLO rules of ``collector/prometheus/rules.yml``. PromQL
then gives back what the apps printed:

* the request count equals the requests made;
* ``histogram_quantile(0.99, ...)`` over the time-to-first-token buckets returns the value that
  Prometheus' interpolation gives for the time-to-first-token values the apps printed, in the
  package's bucket boundaries.

Skips (or, with ``OTEL_GENERATE_REQUIRE_BACKENDS=1`` / ``CI=true``, fails) without Go or prometheus.
"""

from __future__ import annotations

import math

import pytest

from otel_generate import attributes as A
from tests.e2e.test_otlp_export import printed, run_app
from tests.helpers.local_stack import get_json, local_stack, wait_for
from tests.helpers.otlp_receiver import GRPC

pytestmark = pytest.mark.slow

REQUESTS = 3
SERVICE = "otel-generate-e2e-metrics"
#: scrape interval 5 s, Collector batch 1 s: a minute is far more than needed
SCRAPE_TIMEOUT_S = 60
TTFT = "gen_ai_server_time_to_first_token_seconds"
REQUEST_COUNT = "gen_ai_server_request_duration_seconds_count"


@pytest.fixture(scope="module")
def stack():
    with local_stack() as endpoints:
        yield endpoints


def _query(stack: dict, promql: str) -> list:
    answer = get_json(f"{stack['PROMETHEUS_URL']}/api/v1/query", {"query": promql})
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def _prometheus_quantile(q: float, values: list, bounds: tuple) -> float:
    """Prometheus' ``histogram_quantile`` over the cumulative buckets of ``values`` (its linear
    interpolation inside the bucket holding rank ``q * count``; the first bucket starts at 0)."""
    edges = list(bounds) + [math.inf]
    cumulative = [sum(1 for v in values if v <= edge) for edge in edges]
    rank = q * cumulative[-1]
    for i, count in enumerate(cumulative):
        if count >= rank:
            lower = 0.0 if i == 0 else edges[i - 1]
            below = 0 if i == 0 else cumulative[i - 1]
            if math.isinf(edges[i]):
                return edges[i - 1]
            return lower + (edges[i] - lower) * (rank - below) / (count - below)
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def made(stack):
    """Run the app REQUESTS times; the time to first token (s) each printed."""
    ttfts = []
    for _ in range(REQUESTS):
        proc = run_app(
            {
                "OTEL_SERVICE_NAME": SERVICE,
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_METRICS_EXPORTER": "otlp",
                "OTEL_LOGS_EXPORTER": "none",
                "OTEL_EXPORTER_OTLP_PROTOCOL": GRPC,
                "OTEL_EXPORTER_OTLP_ENDPOINT": stack["OTLP_GRPC_ENDPOINT"],
            }
        )
        assert proc.returncode == 0, proc.stderr
        assert "Failed to export" not in proc.stderr, proc.stderr
        ttfts.append(printed(proc.stdout)["ttft_ms"] / 1e3)
    return ttfts


def test_request_count_in_prometheus_equals_the_requests_made(stack, made):
    def count():
        result = _query(stack, f'sum({REQUEST_COUNT}{{exported_job="{SERVICE}"}})')
        return result and float(result[0]["value"][1]) == REQUESTS and result

    assert wait_for(count, SCRAPE_TIMEOUT_S, 1.0), _query(stack, f"{REQUEST_COUNT}")
    # a series per process (its service.instance.id is the `exported_instance` label), each of one request
    # without an error
    series = _query(stack, f'{REQUEST_COUNT}{{exported_job="{SERVICE}"}}')
    assert len({s["metric"]["exported_instance"] for s in series}) == len(series) == REQUESTS
    for one in series:
        assert float(one["value"][1]) == 1
        assert one["metric"]["gen_ai_operation_name"] == A.OPERATION_TEXT_COMPLETION
        assert "error_type" not in one["metric"]
    # the time-to-first-token histogram counted every request too
    (ttft_count,) = _query(stack, f'sum({TTFT}_count{{exported_job="{SERVICE}"}})')
    assert float(ttft_count["value"][1]) == REQUESTS


def test_p99_time_to_first_token_from_histogram_quantile(stack, made):
    promql = f'histogram_quantile(0.99, sum by (le) ({TTFT}_bucket{{exported_job="{SERVICE}"}}))'

    def p99():
        count = _query(stack, f'sum({TTFT}_count{{exported_job="{SERVICE}"}})')
        return count and float(count[0]["value"][1]) == REQUESTS and _query(stack, promql)

    result = wait_for(p99, SCRAPE_TIMEOUT_S, 1.0)
    assert result, f"no answer to {promql}"
    (sample,) = result
    value = float(sample["value"][1])
    expected = _prometheus_quantile(0.99, made, A.BUCKETS_TIME_TO_FIRST_TOKEN_S)
    assert value == pytest.approx(expected, rel=1e-9), (made, value)


def test_prometheus_loaded_the_slo_rules(stack):
    groups = get_json(f"{stack['PROMETHEUS_URL']}/api/v1/rules")["data"]["groups"]
    rules = {rule["name"]: rule for group in groups for rule in group["rules"]}
    assert {
        "gen_ai_request_model:gen_ai_server_time_to_first_token_seconds:p99_5m",
        "gen_ai_request_model:gen_ai_server_time_per_output_token_seconds:p99_5m",
        "gen_ai_request_model:gen_ai_server_request_errors:ratio_rate5m",
        "gen_ai_request_model:gen_ai_output_tokens:rate5m",
        "GenAITimeToFirstTokenP99High",
        "GenAITimePerOutputTokenP99High",
        "GenAIRequestErrorRatioHigh",
        "GenAIOutputTokensPerSecondLow",
    } <= set(rules)
    assert all(rule["health"] != "err" for rule in rules.values()), rules
