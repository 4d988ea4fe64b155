#!/usr/bin/env bash
# The compose stack without Docker: Jaeger, the OpenTelemetry Collector and Prometheus as local
# processes on 127.0.0.1, running this repository's own configurations.
#
#   collector/local.sh up [--fresh]          # Jaeger + collector/otel-collector.yaml + Prometheus
#   collector/local.sh up --scale [--fresh]  # Jaeger + collector/agent.yaml + two collector/gateway.yaml
#   collector/local.sh down                  # stops exactly the processes `up` started (both tiers)
#   collector/local.sh stop [--scale] NAME   # stops one of them (jaeger, otel-collector, prometheus;
#   collector/local.sh start [--scale] NAME  #   otel-agent, otel-gateway-1, -2), starts it again as `up` did
#
# `up` first checks every prerequisite at once (Go when the binaries are not built yet, Debian's
# prometheus, curl, free ports) and names each one missing, before it builds or waits on another
# build; then it builds the binaries once if needed (collector/build.sh: Go 1.26 and the Go
# module proxy), starts the processes, waits until each answers and prints `NAME=value` lines:
#
#   OTLP_GRPC_ENDPOINT=http://127.0.0.1:24317   the Collector's (with --scale: the agent's) OTLP/gRPC
#   OTLP_HTTP_ENDPOINT=http://127.0.0.1:24318   ... and OTLP/HTTP receiver
#   JAEGER_UI=http://127.0.0.1:26686            Jaeger's UI and query API (/api/traces?service=...)
#   JAEGER_UI_SERVED=placeholder                what that page is: `jaeger-ui` (a built UI) or
#                                               `placeholder` (how to get the UI: on stderr)
#   PROMETHEUS_URL=http://127.0.0.1:29090       Prometheus, scraping the Collector's Prometheus
#                                               exporter (not with --scale: the agent's metrics
#                                               pipeline ends in its debug exporter)
#
# Jaeger stores traces with Badger, on disk, in the tier's state folder (jaeger-data/), kept
# across `down` and `up`; `up --fresh` deletes it first. Spans are kept for
# $OTEL_GENERATE_JAEGER_RETENTION (a Go duration, default 72h), then Badger drops them.
#
# Each configuration runs as written except for its endpoints, set to loopback ports on the
# command line (--set), and the Collectors' own telemetry: off in the single tier
# (service.telemetry.metrics.level=none; its fixed port 8888 would clash between the
# Collectors), on a port of its own for the agent and each gateway (AGENT_METRICS_PORT,
# GATEWAY_n_METRICS_PORT: collector/loadtest.sh reads them). The ports (collector/ports.sh) are
# not the defaults (4317, 4318, 16686, 9090), so a compose stack or a test receiver on those
# ports is left alone; each can be changed with the environment variable of the same name. The
# processes are found by the pids this script wrote (never by name), in
# $OTEL_GENERATE_LOCAL_STATE (default: the build cache's local/ folder), with their logs.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=${OTEL_GENERATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/otel-generate}
STATE=${OTEL_GENERATE_LOCAL_STATE:-$CACHE/local}
HOST=127.0.0.1
READY_TIMEOUT_S=${OTEL_GENERATE_READY_TIMEOUT_S:-60}
JAEGER_RETENTION=${OTEL_GENERATE_JAEGER_RETENTION:-72h}
# shellcheck source=collector/ports.sh
. "$HERE/ports.sh"
#: what the page of a Jaeger binary built without UI assets says (cmd/query/app/ui/placeholder)
PLACEHOLDER="This is not the Jaeger UI you are looking for"

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

# start NAME PORT... -- [VAR=value...] COMMAND...: refuse busy ports, start COMMAND (with the
# variables set) in its own session, appending to NAME.log; record "pid executable" in NAME.pid,
# and the ports and the command in NAME.cmd for `local.sh start NAME`
start() {
    local name=$1 ports=() port assignments=()
    shift
    while [[ $1 != -- ]]; do
        ports+=("$1")
        shift
    done
    shift
    while [[ $1 == *=* ]]; do
        assignments+=("$1")
        shift
    done
    for port in "${ports[@]}"; do
        if listening "$port"; then
            stop "$dir" # what this `up` already started
            die "port $HOST:$port (for $name) is in use"
        fi
    done
    {
        declare -p ports | sed 's/^declare -a ports=/cmd_ports=/'
        local cmdline=(env "${assignments[@]}" "$@")
        declare -p cmdline | sed 's/^declare -a cmdline=/cmd_command=/'
    } >"$dir/$name.cmd"
    launch "$name" "$1" env "${assignments[@]}" "$@"
}

# launch NAME EXECUTABLE COMMAND...: COMMAND (which ends up exec'ing EXECUTABLE) in its own
# session, appending to NAME.log; "pid executable" in NAME.pid
launch() {
    local name=$1 exe=$2
    shift 2
    setsid "$@" </dev/null >>"$dir/$name.log" 2>&1 &
    echo "$! $exe" >"$dir/$name.pid"
    # until `env` (and the background shell before it) has become the program (exec), the pid runs bash or env
    local deadline=$((SECONDS + 10))
    until alive "$dir/$name.pid"; do
        [[ -d /proc/$! ]] && ((SECONDS < deadline)) || break
        sleep 0.02
    done
}

# wait_ready NAME CHECK...: until CHECK succeeds; fail with the log if the process exited (and,
# during `up`, stop what it started)
stop_all_on_failure=true
wait_ready() {
    local name=$1 deadline=$((SECONDS + READY_TIMEOUT_S))
    shift
    until "$@"; do
        if ! alive "$dir/$name.pid"; then
            tail -n 30 "$dir/$name.log" >&2
            $stop_all_on_failure && stop "$dir"
            die "$name exited during start-up (log above, $dir/$name.log)"
        fi
        if ((SECONDS > deadline)); then
            tail -n 30 "$dir/$name.log" >&2
            $stop_all_on_failure && stop "$dir"
            die "$name not ready after $READY_TIMEOUT_S s (log above)"
        fi
        sleep 0.2
    done
}

http_ok() { curl -sf -o /dev/null --max-time 2 "$1"; }

stop_pidfiles() { # SIGTERM, then up to 15 s, then SIGKILL; removes the pid files
    local pidfile pid exe deadline
    for pidfile in "$@"; do
        [[ -f $pidfile ]] || continue
        if alive "$pidfile"; then
            read -r pid exe <"$pidfile"
            kill -TERM "$pid" 2>/dev/null || true
        fi
    done
    for pidfile in "$@"; do
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

stop() { # the processes `up` started in the given state folders, found by their pid files
    local pidfile folder pidfiles=()
    for folder in "$@"; do
        for pidfile in "$folder"/*.pid; do
            [[ -f $pidfile ]] && pidfiles+=("$pidfile")
        done
    done
    stop_pidfiles "${pidfiles[@]}"
}

start_jaeger() { # OTLP_PORT UI_PORT QUERY_GRPC_PORT
    mkdir -p "$dir/jaeger-data"
    start jaeger "$1" "$2" "$3" -- \
        JAEGER_OTLP_GRPC=$HOST:$1 JAEGER_QUERY_HTTP=$HOST:$2 JAEGER_QUERY_GRPC=$HOST:$3 \
        JAEGER_UI_ASSETS=${OTEL_GENERATE_JAEGER_UI_ASSETS:-} JAEGER_BADGER_DIR="$dir/jaeger-data" \
        JAEGER_RETENTION="$JAEGER_RETENTION" \
        "$JAEGER" --config="$HERE/jaeger/jaeger.yaml"
}

# say_jaeger_ui URL: JAEGER_UI_SERVED=..., and how to get the UI when it is Jaeger's placeholder
say_jaeger_ui() {
    local page
    page=$(curl -sf --max-time 5 "$1/" || true)
    if [[ $page == *"$PLACEHOLDER"* ]]; then
        echo "JAEGER_UI_SERVED=placeholder"
        cat >&2 <<EOF
local.sh: $1 serves Jaeger's placeholder page, not the Jaeger UI: the binary built from the Go
  module embeds no UI (it is built from jaeger-ui's JavaScript sources, which no package registry
  serves). The query API works (/api/traces?service=...). For the UI: build jaeger-ui (npm ci &&
  npm run build) and run OTEL_GENERATE_JAEGER_UI_ASSETS=<jaeger-ui>/packages/jaeger-ui/build
  collector/local.sh up; or use the compose stack (docker compose up: the image has the UI); or
  see the traces in Phoenix (docs/backends.md).
EOF
    else
        echo "JAEGER_UI_SERVED=jaeger-ui"
    fi
}

# the Collectors' own telemetry, as --set flags: a Prometheus endpoint on PORT, or none
telemetry_on() {
    echo "--set=service.telemetry.metrics.level=normal"
    echo "--set=service.telemetry.metrics.readers=[{pull: {exporter: {prometheus: {host: '$HOST', port: $1}}}}]"
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
    say_jaeger_ui "http://$HOST:$JAEGER_UI_PORT"
    echo "PROMETHEUS_URL=http://$HOST:$PROMETHEUS_PORT"
}

up_scale() {
    start_jaeger "$SCALE_JAEGER_OTLP_PORT" "$SCALE_JAEGER_UI_PORT" "$SCALE_JAEGER_QUERY_GRPC_PORT"
    local n port metrics flags
    for n in 1 2; do
        port=GATEWAY_${n}_PORT
        metrics=GATEWAY_${n}_METRICS_PORT
        mapfile -t flags < <(telemetry_on "${!metrics}")
        start "otel-gateway-$n" "${!port}" "${!metrics}" -- "$OTELCOL" --config="$HERE/gateway.yaml" \
            --set=receivers.otlp.protocols.grpc.endpoint=$HOST:${!port} \
            --set=exporters.otlp_grpc/jaeger.endpoint=$HOST:$SCALE_JAEGER_OTLP_PORT \
            "${flags[@]}"
    done
    # the agent last, once the gateways it sends to listen
    wait_ready otel-gateway-1 listening "$GATEWAY_1_PORT"
    wait_ready otel-gateway-2 listening "$GATEWAY_2_PORT"
    mapfile -t flags < <(telemetry_on "$AGENT_METRICS_PORT")
    start otel-agent "$AGENT_GRPC_PORT" "$AGENT_HTTP_PORT" "$AGENT_METRICS_PORT" -- \
        "$OTELCOL" --config="$HERE/agent.yaml" \
        --set=receivers.otlp.protocols.grpc.endpoint=$HOST:$AGENT_GRPC_PORT \
        --set=receivers.otlp.protocols.http.endpoint=$HOST:$AGENT_HTTP_PORT \
        "--set=exporters.load_balancing.resolver.static.hostnames=[$HOST:$GATEWAY_1_PORT, $HOST:$GATEWAY_2_PORT]" \
        "${flags[@]}"
    wait_ready jaeger http_ok "http://$HOST:$SCALE_JAEGER_UI_PORT/api/services"
    wait_ready jaeger listening "$SCALE_JAEGER_OTLP_PORT"
    wait_ready otel-gateway-1 listening "$GATEWAY_1_METRICS_PORT"
    wait_ready otel-gateway-2 listening "$GATEWAY_2_METRICS_PORT"
    wait_ready otel-agent listening "$AGENT_GRPC_PORT"
    wait_ready otel-agent listening "$AGENT_HTTP_PORT"
    echo "OTLP_GRPC_ENDPOINT=http://$HOST:$AGENT_GRPC_PORT"
    echo "OTLP_HTTP_ENDPOINT=http://$HOST:$AGENT_HTTP_PORT"
    echo "JAEGER_UI=http://$HOST:$SCALE_JAEGER_UI_PORT"
    say_jaeger_ui "http://$HOST:$SCALE_JAEGER_UI_PORT"
}

# prerequisites TIER: every missing one named at once, before anything is built or waited on
prerequisites() {
    local tier=$1 problems=() var vars
    command -v curl >/dev/null || problems+=("curl not found: apt-get install curl")
    if ! "$HERE/build.sh" --built >/dev/null 2>&1; then
        command -v go >/dev/null ||
            problems+=("go not found (needed once, to build the Collector and Jaeger): install Go 1.26 or newer (https://go.dev/dl)")
        command -v flock >/dev/null || problems+=("flock not found (collector/build.sh's lock): apt-get install util-linux")
    fi
    if [[ $tier == single ]]; then
        PROMETHEUS=${PROMETHEUS:-$(command -v prometheus || true)}
        [[ -n $PROMETHEUS && -x $PROMETHEUS ]] ||
            problems+=("prometheus not found: apt-get install prometheus (Debian's package, 2.42), or set PROMETHEUS to its path")
        vars=("${SINGLE_PORT_VARS[@]}")
    else
        vars=("${SCALE_PORT_VARS[@]}")
    fi
    for var in "${vars[@]}"; do
        listening "${!var}" && problems+=("port $HOST:${!var} is in use: free it, or set $var to a free port")
    done
    if ((${#problems[@]})); then
        printf 'local.sh: %s\n' "${problems[@]}" >&2
        exit 1
    fi
}

# tier_of ARGS...: "scale" when --scale is among them, else "single"
tier_of() {
    local arg
    for arg in "$@"; do [[ $arg == --scale ]] && { echo scale; return; }; done
    echo single
}

case "${1:-}" in
up)
    shift
    fresh=false
    for arg in "$@"; do
        case $arg in
        --scale) ;;
        --fresh) fresh=true ;;
        *) die "unknown option $arg (usage: $0 up [--scale] [--fresh])" ;;
        esac
    done
    tier=$(tier_of "$@")
    dir=$STATE/$tier
    mkdir -p "$dir"
    for pidfile in "$dir"/*.pid; do
        [[ -f $pidfile ]] || continue
        alive "$pidfile" && die "the $tier tier is already up (pid file $pidfile): run collector/local.sh down first"
        rm -f "$pidfile"
    done
    prerequisites "$tier"
    # exit status 3 (from build.sh): Go is missing
    binaries=$("$HERE/build.sh") || exit $?
    OTELCOL=$(sed -n 's/^OTELCOL=//p' <<<"$binaries")
    JAEGER=$(sed -n 's/^JAEGER=//p' <<<"$binaries")
    if $fresh; then
        rm -rf "$dir/jaeger-data"
    fi
    if [[ $tier == single ]]; then
        up_single
    else
        up_scale
    fi
    ;;
down)
    stop "$STATE"/*/
    ;;
stop | start)
    command=$1
    shift
    tier=$(tier_of "$@")
    dir=$STATE/$tier
    name=
    for arg in "$@"; do [[ $arg == --scale ]] || name=$arg; done
    [[ -n $name && -f $dir/$name.cmd ]] ||
        die "usage: $0 $command [--scale] NAME, NAME one of: $(cd "$dir" 2>/dev/null && ls -- *.cmd 2>/dev/null | sed 's/\.cmd$//' | tr '\n' ' ')"
    if [[ $command == stop ]]; then
        stop_pidfiles "$dir/$name.pid"
    else
        alive "$dir/$name.pid" && die "$name is running (pid file $dir/$name.pid)"
        stop_all_on_failure=false
        cmd_ports=() cmd_command=()
        # shellcheck source=/dev/null
        . "$dir/$name.cmd"
        for port in "${cmd_ports[@]}"; do
            listening "$port" && die "port $HOST:$port (for $name) is in use"
        done
        # the executable: the first word after env's VAR=value assignments
        for word in "${cmd_command[@]:1}"; do [[ $word == *=* ]] || break; done
        launch "$name" "$word" "${cmd_command[@]}"
        for port in "${cmd_ports[@]}"; do wait_ready "$name" listening "$port"; done
    fi
    ;;
*)
    echo "usage: $0 up [--scale] [--fresh] | down | stop [--scale] NAME | start [--scale] NAME" >&2
    exit 2
    ;;
esac
