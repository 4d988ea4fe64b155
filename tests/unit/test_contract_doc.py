"""docs/contract.md says what the product emits: every metric and attribute name it gives is one that
``otel_generate/attributes.py`` defines and the product's code uses (metrics: the instruments
``telemetry.create_instruments`` really creates, with the unit and kind the table gives), every metric and
emitted attribute the package defines is in it, and the counts its prose gives match its tables."""

from __future__ import annotations

import ast
import pathlib
import re
from typing import Dict, List, Set

import pytest

from otel_generate import attributes as A

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONTRACT = (ROOT / "docs" / "contract.md").read_text()
PACKAGE = ROOT / "otel_generate"

#: names a backtick in the contract may hold that are names the product emits
_EMITTED_NAME = re.compile(r"^(gen_ai|generate|error)\.[a-z_.]+$")
#: constants of attributes.py that are not attribute or metric names (values, the schema, span names)
_NOT_NAMES = re.compile(
    r"^(SCHEMA_URL|BUCKETS_.*|OPERATION_.*|PROVIDER_.*|FINISH_REASON_.*|TOKEN_TYPE_.*|ROLE_.*|"
    r"PART_TYPE_.*|STRATEGY_.*|UNOBSERVED_.*|STEP_SPAN_.*|PHASE_.*|SPAN_.*|EVENT_.*)$"
)
_NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9}


def _sections(text: str) -> Dict[str, str]:
    """``{heading: body}`` of the ``##`` sections."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def _table_rows(section: str) -> List[List[str]]:
    """The cells of each body row of the markdown tables in ``section``."""
    rows = []
    for line in section.splitlines():
        if line.startswith("|") and not re.match(r"^\|[-| :]+\|$", line):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return [row for row in rows if row and row[0] not in ("attribute", "metric", "value")]


def _first_name(cell: str) -> str:
    found = re.match(r"^`([^`]+)`", cell)
    assert found, f"a table row that does not start with a backticked name: {cell!r}"
    return found.group(1)


SECTIONS = _sections(CONTRACT)
METRIC_ROWS = _table_rows(SECTIONS["Metrics"])
METRICS = [_first_name(row[0]) for row in METRIC_ROWS]
ATTRIBUTE_TABLES = ("Request span", "Inner-call spans", "Step spans")
ATTRIBUTES = {name: [_first_name(row[0]) for row in _table_rows(SECTIONS[name])] for name in ATTRIBUTE_TABLES}


def _defined() -> Dict[str, str]:
    """``{constant: value}`` of the names attributes.py defines."""
    return {k: v for k, v in vars(A).items() if k.isupper() and isinstance(v, str) and not _NOT_NAMES.match(k)}


def _constants_used_by_the_product() -> Set[str]:
    """Constants of attributes.py that a module of the product (outside attributes.py and the bench) names."""
    used: Set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        if path.name == "attributes.py" or "bench" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.isupper():
                used.add(node.attr)
            elif isinstance(node, ast.alias) and node.name.isupper():
                used.add(node.name)
    return used


def test_the_tables_were_read():
    assert "gen_ai.server.time_to_first_token" in METRICS and len(METRICS) >= 6
    assert "gen_ai.request.model" in ATTRIBUTES["Request span"]
    assert "generate.window.index" in ATTRIBUTES["Inner-call spans"]
    assert "generate.step.latency" in ATTRIBUTES["Step spans"]


def test_every_name_in_the_contract_is_defined_in_attributes_py_and_used_by_the_product():
    defined = _defined()
    by_value = {v: k for k, v in defined.items()}
    used = _constants_used_by_the_product()
    named = set(re.findall(r"`([^`\s]+)`", CONTRACT))
    emitted = sorted(name for name in named if _EMITTED_NAME.match(name))
    assert "gen_ai.token.type" in emitted and "error.type" in emitted
    undefined = [name for name in emitted if name not in by_value]
    assert not undefined, f"docs/contract.md names these, attributes.py defines none of them: {undefined}"
    unused = [name for name in emitted if by_value[name] not in used]
    assert not unused, f"docs/contract.md names these, no module of the product uses their constant: {unused}"


def test_every_metric_and_emitted_attribute_the_package_defines_is_in_the_contract():
    defined = _defined()
    used = _constants_used_by_the_product()
    metrics = {v for k, v in defined.items() if k.startswith("METRIC_")}
    assert metrics == set(METRICS), "the Metrics table and attributes.py's METRIC_* differ"
    tabled = {name for names in ATTRIBUTES.values() for name in names} | metrics
    named = set(re.findall(r"`([^`\s]+)`", CONTRACT))
    missing = sorted(
        v for k, v in defined.items() if k in used and _EMITTED_NAME.match(v) and v not in tabled and v not in named
    )
    assert not missing, f"emitted names docs/contract.md does not give: {missing}"


def test_the_metrics_table_is_what_create_instruments_creates():
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from otel_generate import telemetry

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    instruments = telemetry.create_instruments(provider)
    assert sorted(instruments) == sorted(METRICS)
    for row in METRIC_ROWS:
        name, kind, unit = _first_name(row[0]), row[1], row[2].strip("`")
        instrument = instruments[name]
        assert type(instrument).__name__.lower().endswith(kind), (name, type(instrument).__name__, kind)
        assert instrument.unit == unit, name
    provider.shutdown()


def test_the_counts_in_the_prose_match_the_tables():
    intro = CONTRACT.split("\n## ", 1)[0]
    histograms = sum(1 for row in METRIC_ROWS if row[1] == "histogram")
    counters = sum(1 for row in METRIC_ROWS if row[1] == "counter")
    said = re.search(r"\b(\w+) histograms; and (\w+) counter\b.*?\b(\w+) metrics in all", intro, re.S)
    assert said, "the introduction no longer says how many histograms, counters and metrics there are"
    assert [_NUMBERS[w] for w in said.groups()] == [histograms, counters, len(METRIC_ROWS)]
    metrics = " ".join(SECTIONS["Metrics"].split())  # sentences run over line ends
    said = re.search(r"Attributes of the (\w+) histograms", metrics)
    assert said and _NUMBERS[said.group(1)] == histograms
    # "The two durations ... time to first token, time per output token and the inter-token latency ... these three"
    durations = [name for name in METRICS if name.endswith(".duration")]
    assert re.search(r"The two durations and token usage are recorded for every request", metrics)
    assert len(durations) == 2
    latencies = ["time_to_first_token", "time_per_output_token", "inter_token_latency"]
    assert all(any(name.endswith(part) for name in METRICS) for part in latencies)
    assert "these three are missing" in metrics


@pytest.mark.parametrize("word", sorted(_NUMBERS))
def test_no_other_count_of_metrics_in_the_prose(word):
    """A sentence that counts metrics, histograms or counters is one of those checked above."""
    prose = re.sub(r"^\|.*$", "", CONTRACT, flags=re.M)
    for found in re.finditer(rf"\b{word} (metrics|histograms|counters?)\b", prose, re.I):
        context = prose[max(0, found.start() - 80) : found.end() + 40]
        assert "in all" in context or "Attributes of the" in context or "histograms; and" in context, (
            f"a count the test does not check: {context!r}"
        )
