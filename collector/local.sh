#!/usr/bin/env bash
# The compose stack without Docker: Jaeger, the OpenTelemetry Collector and Prometheus as local
# processes on 127.0.0.1, running this repository's own configurations.
#
#   collector/local.sh up           # Jaeger + collector/otel-collector.yaml + Prometheus
#   collector/local.sh up --scale   # Jaeger + collector/agent.yaml + two collector/gateway.yaml
#   collector/local.sh down         # stops exactly the processes `up` started (both tiers)
#
# `up` builds the binaries once if needed (collector/build.sh: Go 1.26 and the Go module proxy),
# starts the processes, waits until each answers and prints `NAME=value` lines:
#
#   OTLP_GRPC_ENDPOINT=http://127.0.0.1:24317   the Collector's (with --scale: the agent's) OTLP/gRPC
#   OTLP_HTTP_ENDPOINT=http://127.0.0.1:24318   ... and OTLP/HTTP receiver
#   JAEGER_UI=http://127.0.0.1:26686            Jaeger's UI and query API (/api/traces?service=...)
#   PROMETHEUS_URL=http://127.0.0.1:29090       Prometheus, scraping the Collector's Prometheus
#                                               exporter (not with --scale: the agent's metrics
#                                               pipeline ends in its debug exporter)
#
# Each configuration runs as written except for its endpoints, set to loopback ports on the
# command line (--set), and the Collectors' own telemetry server, turned off
# (service.telemetry.metrics.level=none): its fixed port 8888 would clash between the Collectors.
# The ports are not the defaults (4317, 4318, 16686, 9090), so a compose stack or a test receiver
# on those ports is left alone; each can be changed with the environment variable of the same
# name below. The processes are found by the pids this script wrote (never by name), in
# $OTEL_GENERATE_LOCAL_STATE (default: the build cache's local/ folder), with their logs.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=${OTEL_GENERATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/otel-generate}
STATE=${OTEL_GENERATE_LOCAL_STATE:-$CACHE/local}
HOST=127.0.0.1
READY_TIMEOUT_S=${OTEL_GENERATE_READY_TIMEOUT_S:-60}

# single tier (up)
COLLECTOR_GRPC_PORT=${COLLECTOR_GRPC_PORT:-24317}
COLLECTOR_HTTP_PORT=${COLLECTOR_HTTP_PORT:-24318}
COLLECTOR_PROMETHEUS_PORT=${COLLECTOR_PROMETHEUS_PORT:-24464} # the Collector's Prometheus exporter
JAEGER_OTLP_PORT=${JAEGER_OTLP_PORT:-24417}
JAEGER_UI_PORT=${JAEGER_UI_PORT:-26686}
JAEGER_QUERY_GRPC_PORT=${JAEGER_QUERY_GRPC_PORT:-26685}
PROMETHEUS_PORT=${PROMETHEUS_PORT:-29090}
# scale tier (up --scale): its own Jaeger, so the two tiers can run side by side
AGENT_GRPC_PORT=${AGENT_GRPC_PORT:-25317}
AGENT_HTTP_PORT=${AGENT_HTTP_PORT:-25318}
GATEWAY_1_PORT=${GATEWAY_1_PORT:-25417}
GATEWAY_2_PORT=${GATEWAY_2_PORT:-25427}
SCALE_JAEGER_OTLP_PORT=${SCALE_JAEGER_OTLP_PORT:-25517}
SCALE_JAEGER_UI_PORT=${SCALE_JAEGER_UI_PORT:-27686}
SCALE_JAEGER_QUERY_GRPC_PORT=${SCALE_JAEGER_QUERY_GRPC_PORT:-27685}

die() {
    echo "local.sh: $*" >&2
    exit 1
}

listening() { (exec 3<>"/dev/tcp/$HOST/$1") 2>/dev/null; }

alive() { # pid file: the process it names still runs the binary it started
    local pidfile=$1 pid exe
    [[ -f $pidfile ]] || return 1
    read -r pid exe <"$pidfile"
    [[ $( (tr '\0' '\n' <"/proc/$pid/cmdline" | head -n 1) 2>/dev/null) == "$exe" ]]
}

# start NAME PORT... -- COMMAND...: refuse busy ports, start in its own session with its log,
# record "pid executable" in NAME.pid
start() {
    local name=$1 ports=() port
    shift
    while [[ $1 != -- ]]; do
        ports+=("$1")
        shift
    done
    shift
    for port in "${ports[@]}"; do
        if listening "$port"; then
            stop "$dir" # what this `up` already started
            die "port $HOST:$port (for $name) is in use; set its variable in collector/local.sh to another port"
        fi
    done
    setsid "$@" </dev/null >"$dir/$name.log" 2>&1 &
    echo "$! $1" >"$dir/$name.pid"
    # until the background shell has become the program (exec), the pid runs bash
    local deadline=$((SECONDS + 10))
    until alive "$dir/$name.pid"; do
        [[ -d /proc/$! ]] && ((SECONDS < deadline)) || break
        sleep 0.02
    done
}

# wait_ready NAME CHECK...: until CHECK succeeds; fail with the log if the process exited
wait_ready() {
    local name=$1 deadline=$((SECONDS + READY_TIMEOUT_S))
    shift
    until "$@"; do
        if ! alive "$dir/$name.pid"; then
            tail -n 30 "$dir/$name.log" >&2
            stop "$dir"
            die "$name exited during start-up (log above, $dir/$name.log)"
        fi
        if ((SECONDS > deadline)); then
            tail -n 30 "$dir/$name.log" >&2
            stop "$dir"
            die "$name not ready after $READY_TIMEOUT_S s (log above)"
        fi
        sleep 0.2
    done
}

http_ok() { curl -sf -o /dev/null --max-time 2 "$1"; }

stop() { # the processes `up` started in the given state folders, found by their pid files
    local pidfile pid exe deadline folder pidfiles=()
    for folder in "$@"; do
        for pidfile in "$folder"/*.pid; do
            [[ -f $pidfile ]] && pidfiles+=("$pidfile")
        done
    done
    for pidfile in "${pidfiles[@]}"; do
        [[ -f $pidfile ]] || continue
        if alive "$pidfile"; then
            read -r pid exe <"$pidfile"
            kill -TERM "$pid" 2>/dev/null || true
        fi
    done
    for pidfile in "${pidfiles[@]}"; do
        deadline=$((SECONDS + 15))
        while alive "$pidfile" && ((SECONDS < deadline)); do sleep 0.1; done
        if alive "$pidfile"; then
            read -r pid exe <"$pidfile"
            kill -KILL "$pid" 2>/dev/null || true
            sleep 0.2
        fi
        rm -f "$pidfile"
    done
}

start_jaeger() { # OTLP_PORT UI_PORT QUERY_GRPC_PORT
    JAEGER_OTLP_GRPC=$HOST:$1 JAEGER_QUERY_HTTP=$HOST:$2 JAEGER_QUERY_GRPC=$HOST:$3 \
        JAEGER_UI_ASSETS=${OTEL_GENERATE_JAEGER_UI_ASSETS:-} \
        start jaeger "$1" "$2" "$3" -- "$JAEGER" --config="$HERE/jaeger/jaeger.yaml"
}

up_single() {
    start_jaeger "$JAEGER_OTLP_PORT" "$JAEGER_UI_PORT" "$JAEGER_QUERY_GRPC_PORT"
    start otel-collector "$COLLECTOR_GRPC_PORT" "$COLLECTOR_HTTP_PORT" "$COLLECTOR_PROMETHEUS_PORT" -- \
        "$OTELCOL" --config="$HERE/otel-collector.yaml" \
        --set=receivers.otlp.protocols.grpc.endpoint=$HOST:$COLLECTOR_GRPC_PORT \
        --set=receivers.otlp.protocols.http.endpoint=$HOST:$COLLECTOR_HTTP_PORT \
        --set=exporters.otlp_grpc/jaeger.endpoint=$HOST:$JAEGER_OTLP_PORT \
        --set=exporters.prometheus.endpoint=$HOST:$COLLECTOR_PROMETHEUS_PORT \
        --set=service.telemetry.metrics.level=none
    # Prometheus: the repository's scrape configuration and rules, the target on loopback
    sed -e "s#otel-collector:8889#$HOST:$COLLECTOR_PROMETHEUS_PORT#" \
        -e "s#/etc/prometheus/rules.yml#$HERE/prometheus/rules.yml#" \
        "$HERE/prometheus/prometheus.yml" >"$dir/prometheus.yml"
    rm -rf "$dir/prometheus-data"
    start prometheus "$PROMETHEUS_PORT" -- \
        "$PROMETHEUS" --config.file="$dir/prometheus.yml" --storage.tsdb.path="$dir/prometheus-data" \
        --web.listen-address=$HOST:$PROMETHEUS_PORT
    wait_ready jaeger http_ok "http://$HOST:$JAEGER_UI_PORT/api/services"
    wait_ready jaeger listening "$JAEGER_OTLP_PORT"
    wait_ready otel-collector listening "$COLLECTOR_GRPC_PORT"
    wait_ready otel-collector listening "$COLLECTOR_HTTP_PORT"
    wait_ready otel-collector listening "$COLLECTOR_PROMETHEUS_PORT"
    wait_ready prometheus http_ok "http://$HOST:$PROMETHEUS_PORT/-/ready"
    echo "OTLP_GRPC_ENDPOINT=http://$HOST:$COLLECTOR_GRPC_PORT"
    echo "OTLP_HTTP_ENDPOINT=http://$HOST:$COLLECTOR_HTTP_PORT"
    echo "JAEGER_UI=http://$HOST:$JAEGER_UI_PORT"
    echo "PROMETHEUS_URL=http://$HOST:$PROMETHEUS_PORT"
}

up_scale() {
    start_jaeger "$SCALE_JAEGER_OTLP_PORT" "$SCALE_JAEGER_UI_PORT" "$SCALE_JAEGER_QUERY_GRPC_PORT"
    local n port
    for n in 1 2; do
        port=GATEWAY_${n}_PORT
        start "otel-gateway-$n" "${!port}" -- "$OTELCOL" --config="$HERE/gateway.yaml" \
            --set=receivers.otlp.protocols.grpc.endpoint=$HOST:${!port} \
            --set=exporters.otlp_grpc/jaeger.endpoint=$HOST:$SCALE_JAEGER_OTLP_PORT \
            --set=service.telemetry.metrics.level=none
    done
    # the agent last, once the gateways it sends to listen
    wait_ready otel-gateway-1 listening "$GATEWAY_1_PORT"
    wait_ready otel-gateway-2 listening "$GATEWAY_2_PORT"
    start otel-agent "$AGENT_GRPC_PORT" "$AGENT_HTTP_PORT" -- "$OTELCOL" --config="$HERE/agent.yaml" \
        --set=receivers.otlp.protocols.grpc.endpoint=$HOST:$AGENT_GRPC_PORT \
        --set=receivers.otlp.protocols.http.endpoint=$HOST:$AGENT_HTTP_PORT \
        "--set=exporters.load_balancing.resolver.static.hostnames=[$HOST:$GATEWAY_1_PORT, $HOST:$GATEWAY_2_PORT]" \
        --set=service.telemetry.metrics.level=none
    wait_ready jaeger http_ok "http://$HOST:$SCALE_JAEGER_UI_PORT/api/services"
    wait_ready jaeger listening "$SCALE_JAEGER_OTLP_PORT"
    wait_ready otel-agent listening "$AGENT_GRPC_PORT"
    wait_ready otel-agent listening "$AGENT_HTTP_PORT"
    echo "OTLP_GRPC_ENDPOINT=http://$HOST:$AGENT_GRPC_PORT"
    echo "OTLP_HTTP_ENDPOINT=http://$HOST:$AGENT_HTTP_PORT"
    echo "JAEGER_UI=http://$HOST:$SCALE_JAEGER_UI_PORT"
}

case "${1:-}" in
up)
    tier=single
    [[ ${2:-} == --scale ]] && tier=scale
    dir=$STATE/$tier
    mkdir -p "$dir"
    for pidfile in "$dir"/*.pid; do
        [[ -f $pidfile ]] || continue
        alive "$pidfile" && die "the $tier tier is already up (pid file $pidfile): run collector/local.sh down first"
        rm -f "$pidfile"
    done
    # exit status 3 (from build.sh): Go is missing
    binaries=$("$HERE/build.sh") || exit $?
    OTELCOL=$(sed -n 's/^OTELCOL=//p' <<<"$binaries")
    JAEGER=$(sed -n 's/^JAEGER=//p' <<<"$binaries")
    if [[ $tier == single ]]; then
        PROMETHEUS=${PROMETHEUS:-$(command -v prometheus)} ||
            die "prometheus not found: apt-get install prometheus (Debian 2.42), or set PROMETHEUS to its path"
        up_single
    else
        up_scale
    fi
    ;;
down)
    stop "$STATE"/*/
    ;;
*)
    echo "usage: $0 up [--scale] | down" >&2
    exit 2
    ;;
esac
