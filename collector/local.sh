#!/usr/bin/env bash
# The compose stack without Docker: Jaeger, the OpenTelemetry Collector and Prometheus as local
# processes on 127.0.0.1, running this repository's own configurations.
#
#   collector/local.sh up [--fresh] [--ui phoenix]  # Jaeger + collector/otel-collector.yaml + Prometheus
#                                                   #   (+ Arize Phoenix, which the Collector also sends traces to)
#   collector/local.sh up --scale [--fresh]         # Jaeger + collector/agent.yaml + two collector/gateway.yaml
#   collector/local.sh down                         # stops what this clone's `up` started (both tiers) and
#                                                   #   prints each process stopped: name, pid, ports
#   collector/local.sh down --all                   # stops every stack of this user, whichever clone started it
#   collector/local.sh status                       # lists the running stacks of this user: clone, processes, ports
#   collector/local.sh stop [--scale] NAME          # stops one process (jaeger, otel-collector, prometheus,
#   collector/local.sh start [--scale] NAME         #   phoenix; otel-agent, otel-gateway-1, -2), starts it again
#   collector/local.sh --help                       # this text
#
# Options of `up`: --scale the scale-out tier instead of the single one; --fresh empty Jaeger's (and
# Phoenix's) storage first; --ui phoenix also start Arize Phoenix (single tier only) and have the
# Collector export the traces to it too (collector/phoenix.yaml), so they show in a browser at
# PHOENIX_UI. Phoenix is found at $OTEL_GENERATE_PHOENIX_BIN, else `phoenix` on PATH; without it
# `up` says how to install it (pip install arize-phoenix, in a virtual environment of its own).
#
# `up` first checks every prerequisite at once (Go when the binaries are not built yet, Debian's
# prometheus, curl, Phoenix with --ui phoenix, free ports) and names each one missing, before it
# builds or waits on another build; then it builds the binaries once if needed (collector/build.sh:
# Go 1.26 and the Go module proxy; it says how long that takes), starts the processes, waits until
# each answers and prints `NAME=value` lines:
#
#   OTLP_GRPC_ENDPOINT=http://127.0.0.1:24317   the Collector's (with --scale: the agent's) OTLP/gRPC
#   OTLP_HTTP_ENDPOINT=http://127.0.0.1:24318   ... and OTLP/HTTP receiver
#   JAEGER_UI=http://127.0.0.1:26686            Jaeger's UI and query API (/api/traces?service=...)
#   JAEGER_UI_SERVED=placeholder                what that page is: `jaeger-ui` (a built UI) or
#                                               `placeholder` (how to get the UI: on stderr)
#   PROMETHEUS_URL=http://127.0.0.1:29090       Prometheus, scraping the Collector's Prometheus
#                                               exporter (not with --scale: the agent's metrics
#                                               pipeline ends in its debug exporter)
#   PHOENIX_UI=http://127.0.0.1:26006           with --ui phoenix: Phoenix's UI (the traces, in a browser)
#
# Each stack is this clone's own: its state (pid files, logs, Jaeger's and Phoenix's data) is kept
# per clone and per tier, in $OTEL_GENERATE_LOCAL_STATE (default: the build cache's
# local/<clone>-<hash>/ folder), so `down` in one clone leaves another clone's stack running. Two
# stacks at once need different ports: each port is the default of the environment variable of the
# same name (listed below, in collector/ports.sh). The processes are found by the pids this script
# wrote (never by name).
#
# Jaeger stores traces with Badger, on disk, in the tier's state folder (jaeger-data/), kept
# across `down` and `up`; `up --fresh` deletes it first. Spans are kept for
# $OTEL_GENERATE_JAEGER_RETENTION (a Go duration, default 72h), then Badger drops them.
#
# Each configuration runs as written except for its endpoints, set to loopback ports on the
# command line (--set), and the Collectors' own telemetry: off in the single tier
# (service.telemetry.metrics.level=none; its fixed port 8888 would clash between the
# Collectors), on a port of its own for the agent and each gateway (AGENT_METRICS_PORT,
# GATEWAY_n_METRICS_PORT: collector/loadtest.sh reads them). The ports are not the defaults
# (4317, 4318, 16686, 9090, 6006), so a compose stack or a test receiver on those ports is left
# alone.
#
# Environment:
#   OTEL_GENERATE_LOCAL_STATE       the state folder (default: per clone, under the build cache)
#   OTEL_GENERATE_CACHE             the build cache (default ${XDG_CACHE_HOME:-$HOME/.cache}/otel-generate)
#   XDG_CACHE_HOME                  see OTEL_GENERATE_CACHE
#   PROMETHEUS                      the prometheus executable (default: `prometheus` on PATH)
#   OTEL_GENERATE_PHOENIX_BIN       the phoenix executable for --ui phoenix (default: `phoenix` on PATH)
#   OTEL_GENERATE_READY_TIMEOUT_S   how long `up` waits for each process to answer (default 60;
#                                   Phoenix: at least 180)
#   OTEL_GENERATE_JAEGER_RETENTION  how long Jaeger keeps spans (default 72h)
#   OTEL_GENERATE_JAEGER_UI_ASSETS  a built jaeger-ui (packages/jaeger-ui/build) for Jaeger to serve
#   OTEL_GENERATE_BUILD_PROGRESS_S  how often collector/build.sh reports while it builds (its --help)
#   the port variables below, each the default of one loopback port
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=collector/state.sh
. "$HERE/state.sh"
HOST=127.0.0.1
READY_TIMEOUT_S=${OTEL_GENERATE_READY_TIMEOUT_S:-60}
# Phoenix takes longer to answer (its database, its web server): at least 180 s
PHOENIX_READY_TIMEOUT_S=$((READY_TIMEOUT_S > 180 ? READY_TIMEOUT_S : 180))
JAEGER_RETENTION=${OTEL_GENERATE_JAEGER_RETENTION:-72h}
# shellcheck source=collector/ports.sh
. "$HERE/ports.sh"
#: what the page of a Jaeger binary built without UI assets says (cmd/query/app/ui/placeholder)
PLACEHOLDER="This is not the Jaeger UI you are looking for"
USAGE="usage: $0 up [--scale] [--fresh] [--ui phoenix] | down [--all] | status | stop [--scale] NAME | start [--scale] NAME | --help"

usage() { # the header above, then the port variables with the values they have now
    sed -n '2,/^set -euo pipefail/{/^#/{s/^# \{0,1\}//;p}}' "${BASH_SOURCE[0]}"
    echo
    echo "Ports (on 127.0.0.1; the variable of each moves it):"
    print_ports
}

die() {
    echo "local.sh: $*" >&2
    exit 1
}

listening() { (exec 3<>"/dev/tcp/$HOST/$1") 2>/dev/null; }

# alive PIDFILE: the process it names still runs the executable it started (its first argument,
# or its second when the kernel ran it through the interpreter of its #! line, as for phoenix)
alive() {
    local pidfile=$1 pid exe argv=()
    [[ -f $pidfile ]] || return 1
    read -r pid exe <"$pidfile"
    { mapfile -d '' -n 2 argv <"/proc/$pid/cmdline"; } 2>/dev/null || return 1
    [[ ${argv[0]:-} == "$exe" || ${argv[1]:-} == "$exe" ]]
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
            stop_tier "$dir" >&2 # what this `up` already started
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
# during `up`, stop what it started). Waits up to $timeout_s, default READY_TIMEOUT_S.
stop_all_on_failure=true
wait_ready() {
    local name=$1 limit=${timeout_s:-$READY_TIMEOUT_S}
    local deadline=$((SECONDS + limit))
    shift
    until "$@"; do
        if ! alive "$dir/$name.pid"; then
            tail -n 30 "$dir/$name.log" >&2
            $stop_all_on_failure && stop_tier "$dir" >&2
            die "$name exited during start-up (log above, $dir/$name.log)"
        fi
        if ((SECONDS > deadline)); then
            tail -n 30 "$dir/$name.log" >&2
            $stop_all_on_failure && stop_tier "$dir" >&2
            die "$name not ready after $limit s (log above)"
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

ports_of() { # TIER_FOLDER NAME: the ports `up` started NAME on, from NAME.cmd
    (
        cmd_ports=()
        # shellcheck source=/dev/null
        . "$1/$2.cmd" 2>/dev/null
        echo "${cmd_ports[*]}"
    )
}

clone_of() { # TIER_FOLDER: the clone whose `up` started the tier
    cat "$1/clone" 2>/dev/null || echo "(a clone, from before local.sh kept a stack per clone)"
}

has_pidfiles() { compgen -G "$1/*.pid" >/dev/null; }

# stop_tier TIER_FOLDER: stop the processes `up` started there (found by their pid files) and
# print, on stdout, one line per process: what was stopped (name, pid, ports), or that it had exited
stop_tier() {
    local dir=$1 pidfile name pid exe pidfiles=() lines=() where
    where="the $(basename "$dir") tier of $(clone_of "$dir")"
    for pidfile in "$dir"/*.pid; do
        [[ -f $pidfile ]] || continue
        name=$(basename "$pidfile" .pid)
        read -r pid exe <"$pidfile"
        if alive "$pidfile"; then
            lines+=("stopped $name (pid $pid, ports $(ports_of "$dir" "$name")) of $where")
        else
            lines+=("$name (pid $pid) of $where had already exited")
        fi
        pidfiles+=("$pidfile")
    done
    ((${#pidfiles[@]})) || return 0
    stop_pidfiles "${pidfiles[@]}"
    printf '%s\n' "${lines[@]}"
}

tier_running() { # TIER_FOLDER: one of its processes runs
    local pidfile
    for pidfile in "$1"/*.pid; do alive "$pidfile" && return 0; done
    return 1
}

# every state folder of this user: those `up` registered (a link each in REGISTRY; a link to a
# folder that is gone is removed) and the one folder all clones shared before state was per clone
all_states() {
    local link target
    for link in "$REGISTRY"/*; do
        [[ -L $link ]] || continue
        target=$(readlink "$link")
        if [[ -d $target ]]; then echo "$target"; else rm -f "$link"; fi
    done
    if [[ -d $CACHE/local/single || -d $CACHE/local/scale ]]; then echo "$CACHE/local"; fi
}

tier_folders() { # every tier folder of this user, one a line
    local state
    all_states | sort -u | while read -r state; do
        echo "$state/single"
        echo "$state/scale"
    done
}

running_tiers() { # the tier folders of this user with a process running, one a line
    local dir
    tier_folders | while read -r dir; do
        if tier_running "$dir"; then echo "$dir"; fi
    done
}

status() {
    local dir cmd name pidfile pid exe mark tiers
    mapfile -t tiers < <(running_tiers)
    if ((${#tiers[@]} == 0)); then
        echo "no stack of this user is running"
        return
    fi
    for dir in "${tiers[@]}"; do
        mark=
        [[ $(clone_of "$dir") == "$CLONE" ]] && mark=" (this clone)"
        echo "$(clone_of "$dir")$mark: the $(basename "$dir") tier, state $dir"
        for cmd in "$dir"/*.cmd; do
            name=$(basename "$cmd" .cmd)
            pidfile=$dir/$name.pid
            if alive "$pidfile"; then
                read -r pid exe <"$pidfile"
                printf '  %-15s pid %-8s ports %s\n' "$name" "$pid" "$(ports_of "$dir" "$name")"
            else
                printf '  %-15s %-12s ports %s\n' "$name" "not running" "$(ports_of "$dir" "$name")"
            fi
        done
        if [[ -f $dir/endpoints ]]; then sed 's/^/  /' "$dir/endpoints"; fi
    done
}

# say NAME=value: on stdout, and in the tier's endpoints file (for `status`)
say() {
    echo "$1"
    echo "$1" >>"$dir/endpoints"
}

start_jaeger() { # OTLP_PORT UI_PORT QUERY_GRPC_PORT
    mkdir -p "$dir/jaeger-data"
    start jaeger "$1" "$2" "$3" -- \
        JAEGER_OTLP_GRPC=$HOST:$1 JAEGER_QUERY_HTTP=$HOST:$2 JAEGER_QUERY_GRPC=$HOST:$3 \
        JAEGER_UI_ASSETS=${OTEL_GENERATE_JAEGER_UI_ASSETS:-} JAEGER_BADGER_DIR="$dir/jaeger-data" \
        JAEGER_RETENTION="$JAEGER_RETENTION" \
        "$JAEGER" --config="$HERE/jaeger/jaeger.yaml"
}

# say_jaeger_ui URL: JAEGER_UI_SERVED=..., and how to get a UI when it is Jaeger's placeholder
say_jaeger_ui() {
    local page
    page=$(curl -sf --max-time 5 "$1/" || true)
    if [[ $page == *"$PLACEHOLDER"* ]]; then
        say "JAEGER_UI_SERVED=placeholder"
        $phoenix && return 0 # the traces are in Phoenix's UI
        cat >&2 <<EOF
local.sh: $1 serves Jaeger's placeholder page, not the Jaeger UI: the binary built from the Go
  module embeds no UI (it is built from jaeger-ui's JavaScript sources, which no package registry
  serves). The query API works (/api/traces?service=...). The quickest trace UI in a browser:
  collector/local.sh up --ui phoenix (Arize Phoenix: pip install arize-phoenix; docs/backends.md).
  For the Jaeger UI: build jaeger-ui (npm ci && npm run build) and run
  OTEL_GENERATE_JAEGER_UI_ASSETS=<jaeger-ui>/packages/jaeger-ui/build collector/local.sh up; or
  use the compose stack (docker compose up: the image has the UI).
EOF
    else
        say "JAEGER_UI_SERVED=jaeger-ui"
    fi
}

# the Collectors' own telemetry, as --set flags: a Prometheus endpoint on PORT, or none
telemetry_on() {
    echo "--set=service.telemetry.metrics.level=normal"
    echo "--set=service.telemetry.metrics.readers=[{pull: {exporter: {prometheus: {host: '$HOST', port: $1}}}}]"
}

start_phoenix() {
    mkdir -p "$dir/phoenix-data"
    start phoenix "$PHOENIX_UI_PORT" "$PHOENIX_OTLP_GRPC_PORT" -- \
        PHOENIX_WORKING_DIR="$dir/phoenix-data" PHOENIX_HOST=$HOST PHOENIX_PORT="$PHOENIX_UI_PORT" \
        PHOENIX_GRPC_PORT="$PHOENIX_OTLP_GRPC_PORT" PHOENIX_TELEMETRY_ENABLED=false \
        "$PHOENIX_BIN" serve
}

up_single() {
    local phoenix_flags=()
    if $phoenix; then
        start_phoenix # first: it takes the longest to answer
        phoenix_flags=(--config="$HERE/phoenix.yaml"
            --set=exporters.otlp_grpc/phoenix.endpoint=$HOST:$PHOENIX_OTLP_GRPC_PORT)
    fi
    start_jaeger "$JAEGER_OTLP_PORT" "$JAEGER_UI_PORT" "$JAEGER_QUERY_GRPC_PORT"
    start otel-collector "$COLLECTOR_GRPC_PORT" "$COLLECTOR_HTTP_PORT" "$COLLECTOR_PROMETHEUS_PORT" -- \
        "$OTELCOL" --config="$HERE/otel-collector.yaml" "${phoenix_flags[@]}" \
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
    if $phoenix; then
        timeout_s=$PHOENIX_READY_TIMEOUT_S wait_ready phoenix http_ok "http://$HOST:$PHOENIX_UI_PORT/healthz"
        timeout_s=$PHOENIX_READY_TIMEOUT_S wait_ready phoenix listening "$PHOENIX_OTLP_GRPC_PORT"
    fi
    say "OTLP_GRPC_ENDPOINT=http://$HOST:$COLLECTOR_GRPC_PORT"
    say "OTLP_HTTP_ENDPOINT=http://$HOST:$COLLECTOR_HTTP_PORT"
    say "JAEGER_UI=http://$HOST:$JAEGER_UI_PORT"
    say_jaeger_ui "http://$HOST:$JAEGER_UI_PORT"
    say "PROMETHEUS_URL=http://$HOST:$PROMETHEUS_PORT"
    if $phoenix; then
        say "PHOENIX_UI=http://$HOST:$PHOENIX_UI_PORT"
    fi
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
    say "OTLP_GRPC_ENDPOINT=http://$HOST:$AGENT_GRPC_PORT"
    say "OTLP_HTTP_ENDPOINT=http://$HOST:$AGENT_HTTP_PORT"
    say "JAEGER_UI=http://$HOST:$SCALE_JAEGER_UI_PORT"
    say_jaeger_ui "http://$HOST:$SCALE_JAEGER_UI_PORT"
}

# how to install Phoenix, for --ui phoenix without it
PHOENIX_HOW="install Arize Phoenix in a virtual environment of its own (a few minutes):
    python3 -m venv ~/.venvs/phoenix && ~/.venvs/phoenix/bin/pip install arize-phoenix
  then run OTEL_GENERATE_PHOENIX_BIN=~/.venvs/phoenix/bin/phoenix collector/local.sh up --ui phoenix
  (or put that phoenix on PATH)"

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
    if $phoenix; then
        vars+=("${PHOENIX_PORT_VARS[@]}")
        PHOENIX_BIN=${OTEL_GENERATE_PHOENIX_BIN:-$(command -v phoenix || true)}
        if [[ -z $PHOENIX_BIN ]]; then
            problems+=("Arize Phoenix not found (for --ui phoenix): $PHOENIX_HOW")
        elif [[ ! -f $PHOENIX_BIN || ! -x $PHOENIX_BIN ]]; then
            problems+=("OTEL_GENERATE_PHOENIX_BIN=$PHOENIX_BIN is not an executable file: $PHOENIX_HOW")
        else
            PHOENIX_BIN=$(cd "$(dirname "$PHOENIX_BIN")" && pwd)/$(basename "$PHOENIX_BIN")
        fi
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

# --help anywhere: the help, and nothing else
for arg in "$@"; do
    if [[ $arg == -h || $arg == --help ]]; then
        usage
        exit 0
    fi
done

case "${1:-}" in
up)
    shift
    tier=single fresh=false phoenix=false
    while (($#)); do
        case $1 in
        --scale) tier=scale ;;
        --fresh) fresh=true ;;
        --ui | --ui=*)
            if [[ $1 == --ui=* ]]; then ui=${1#--ui=}; else ui=${2:-} && shift; fi
            [[ $ui == phoenix ]] || die "--ui ${ui:-(no value)}: the UI local.sh can start is phoenix (--ui phoenix)"
            phoenix=true
            ;;
        *) die "unknown option $1 ($USAGE)" ;;
        esac
        shift
    done
    if $phoenix && [[ $tier == scale ]]; then
        die "--ui phoenix starts Phoenix next to the single tier's Collector: collector/local.sh up --ui phoenix, without --scale"
    fi
    dir=$STATE/$tier
    mkdir -p "$dir"
    for pidfile in "$dir"/*.pid; do
        [[ -f $pidfile ]] || continue
        alive "$pidfile" && die "the $tier tier of this clone is already up (pid file $pidfile): run collector/local.sh down first"
        rm -f "$pidfile"
    done
    prerequisites "$tier"
    # exit status 3 (from build.sh): Go is missing
    binaries=$("$HERE/build.sh") || exit $?
    OTELCOL=$(sed -n 's/^OTELCOL=//p' <<<"$binaries")
    JAEGER=$(sed -n 's/^JAEGER=//p' <<<"$binaries")
    if $fresh; then
        rm -rf "$dir/jaeger-data" "$dir/phoenix-data"
    fi
    # this state folder, for `status` and `down --all` run in any clone
    mkdir -p "$REGISTRY"
    ln -sfn "$STATE" "$REGISTRY/$(path_key "$STATE")"
    echo "$CLONE" >"$dir/clone"
    rm -f "$dir"/*.cmd "$dir/endpoints"
    if [[ $tier == single ]]; then
        up_single
    else
        up_scale
    fi
    echo "local.sh: the $tier tier of $CLONE is up (state $dir); collector/local.sh down stops it" >&2
    ;;
down)
    shift
    all=false
    for arg in "$@"; do
        case $arg in
        --all) all=true ;;
        *) die "unknown option $arg (usage: $0 down [--all])" ;;
        esac
    done
    if $all; then
        mapfile -t tiers < <(running_tiers)
        echo "down --all: stopping every stack of this user, whichever clone started it (${#tiers[@]} tier(s) running)"
        mapfile -t folders < <(tier_folders)
        for dir in "${folders[@]}"; do stop_tier "$dir"; done
    else
        stopped=false
        for dir in "$STATE"/single "$STATE"/scale; do
            if has_pidfiles "$dir"; then
                stop_tier "$dir"
                stopped=true
            fi
        done
        $stopped || echo "nothing to stop: no stack of this clone ($CLONE) is running"
        mapfile -t others < <(running_tiers)
        if ((${#others[@]})); then
            echo "still running, started by other clones: ${#others[@]} tier(s) (collector/local.sh status lists them; down --all stops them)"
        fi
    fi
    ;;
status)
    (($# == 1)) || die "status takes no option ($USAGE)"
    status
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
        if alive "$dir/$name.pid"; then
            read -r pid _ <"$dir/$name.pid"
            ports=$(ports_of "$dir" "$name")
            stop_pidfiles "$dir/$name.pid"
            echo "stopped $name (pid $pid, ports $ports) of the $tier tier of $CLONE"
        else
            stop_pidfiles "$dir/$name.pid"
            echo "$name of the $tier tier of $CLONE was not running"
        fi
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
        if [[ $name == phoenix ]]; then timeout_s=$PHOENIX_READY_TIMEOUT_S; fi
        launch "$name" "$word" "${cmd_command[@]}"
        for port in "${cmd_ports[@]}"; do wait_ready "$name" listening "$port"; done
    fi
    ;;
*)
    echo "$USAGE" >&2
    exit 2
    ;;
esac
