"""The Prometheus SLO rules (collector/prometheus/rules.yml), checked and unit-tested by promtool.

* ``promtool check rules`` accepts the file.
* ``promtool test rules collector/prometheus/rules_test.yml`` passes: series that cross a
  threshold fire their alert (after its ``for``), one that stays under does not.
* The unit tests are not vacuous: with a threshold moved past the test's series, the same
  unit tests fail.
* The rules cover p99 time to first token, p99 time per output token, the error ratio and output
  tokens per second, over the metric names the Collector's Prometheus exporter gives this
  package's histograms.

``promtool`` comes with Debian's ``prometheus`` package; without it these skip (or, with
``OTEL_GENERATE_REQUIRE_BACKENDS=1`` / ``CI=true``, fail).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from otel_generate import attributes as A
from tests.helpers.local_stack import require_executable

PROMETHEUS_DIR = Path(__file__).resolve().parents[2] / "collector" / "prometheus"
RULES = PROMETHEUS_DIR / "rules.yml"
RULES_TEST = PROMETHEUS_DIR / "rules_test.yml"


@pytest.fixture(scope="module")
def promtool():
    return require_executable("promtool", "apt-get install prometheus (Debian's package ships promtool)")


def _prometheus_name(otel_name: str, unit: str) -> str:
    """The Collector Prometheus exporter's name for an OTel histogram (dots → underscores, unit suffix)."""
    suffix = {"s": "_seconds", "{token}": ""}[unit]
    return otel_name.replace(".", "_") + suffix


def test_promtool_check_rules(promtool):
    result = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_fire_and_stay_silent(promtool):
    result = subprocess.run(
        [promtool, "test", "rules", RULES_TEST.name], capture_output=True, text=True, timeout=60, cwd=PROMETHEUS_DIR
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    tests = yaml.safe_load(RULES_TEST.read_text())["tests"]
    alert_cases = [case for test in tests for case in test["alert_rule_test"]]
    assert any(case["exp_alerts"] for case in alert_cases), "a case where an alert fires"
    assert any(not case["exp_alerts"] for case in alert_cases), "a case where an alert does not fire"


def test_promtool_unit_tests_fail_when_a_threshold_moves(promtool, tmp_path):
    rules = RULES.read_text()
    moved = rules.replace(":p99_5m > 1\n", ":p99_5m > 3\n", 1)  # 2.485 s no longer crosses it
    assert moved != rules
    (tmp_path / "rules.yml").write_text(moved)
    shutil.copy(RULES_TEST, tmp_path / "rules_test.yml")
    result = subprocess.run(
        [promtool, "test", "rules", "rules_test.yml"], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert result.returncode != 0, result.stdout
    assert "GenAITimeToFirstTokenP99High" in result.stdout + result.stderr


def test_rules_cover_the_slos_over_the_exported_metric_names():
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    text = " ".join(rule["expr"] for rule in rules)
    for otel_name, unit in (
        (A.METRIC_TIME_TO_FIRST_TOKEN, "s"),
        (A.METRIC_TIME_PER_OUTPUT_TOKEN, "s"),
        (A.METRIC_REQUEST_DURATION, "s"),
        (A.METRIC_TOKEN_USAGE, "{token}"),
        (A.METRIC_INTER_TOKEN_LATENCY, "s"),
    ):
        assert _prometheus_name(otel_name, unit) in text, otel_name
    alerts = {rule["alert"] for rule in rules if "alert" in rule}
    assert alerts == {
        "GenAITimeToFirstTokenP99High",
        "GenAITimePerOutputTokenP99High",
        "GenAIInterTokenLatencyP99High",
        "GenAIRequestErrorRatioHigh",
        "GenAIOutputTokensPerSecondLow",
    }
    assert "histogram_quantile(0.99" in text
    assert 'gen_ai_token_type="output"' in text
