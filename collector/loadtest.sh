#!/usr/bin/env bash
# Load the scale tier's gateways with traces shaped like this package's and measure them.
#
#   collector/local.sh up --scale                                # first (once)
#   collector/loadtest.sh --rate SPANS_PER_S --seconds S         # into one gateway (otel-gateway-1)
#   collector/loadtest.sh --scale --rate SPANS_PER_S --seconds S # into the agent, spread over both
#
# Options after those (defaults in brackets): --steps N [256] step spans per trace, plus its
# request span; --error-share F [0.01] and --slow-share F [0.01] of the traces fail or have one
# 300 ms decode step; --service NAME [otel-generate-loadtest-<time>] the spans' service.name;
# --json FILE the run's details; --in-flight N [10], --channels N [1], --compression gzip|none,
# --batch-spans N [512], --seed N: how it sends. The generator and what each figure means:
# collector/loadtest.py. Measured figures and how to size from them: docs/scaling.md.
#
# Prints, on stdout, exactly these lines (spans, percent of one core, MiB, traces):
#
#   SENT=...  ACCEPTED=...  REFUSED=...  EXPORTED_TO_JAEGER=...  IN_JAEGER=...
#   GATEWAY_CPU_PERCENT=...  GATEWAY_RSS_MB=...  HELD_TRACES_PEAK=...
#
# (one per line), and on stderr what it did. It waits decision_wait (collector/gateway.yaml)
# after the last span, so that every trace is decided, before it reads Jaeger. Exit status 1 when
# a trace in Jaeger is partial or the tier is not up; 2 for bad arguments.
#
# The generator is Python: run it where this package and its test extra are installed (the
# repository's virtual environment), or name that interpreter in $PYTHON.
#
# It finds the scale tier that this clone's `collector/local.sh up --scale` started, by its pid
# files in the clone's state folder, and its ports by the variables local.sh used.
#
# Environment:
#   PYTHON                     the interpreter that runs collector/loadtest.py (default python3)
#   OTEL_GENERATE_LOCAL_STATE  local.sh's state folder, when local.sh was given one
#   OTEL_GENERATE_CACHE        the build cache, under which that folder is by default
#                              (default ${XDG_CACHE_HOME:-$HOME/.cache}/otel-generate)
#   XDG_CACHE_HOME             see OTEL_GENERATE_CACHE
#   the port variables below (collector/ports.sh), as local.sh was given them; the scale tier's
#   are the ones it uses
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=collector/state.sh
. "$HERE/state.sh"
HOST=127.0.0.1
PYTHON=${PYTHON:-python3}
# shellcheck source=collector/ports.sh
. "$HERE/ports.sh"

USAGE="usage: $0 [--scale] --rate SPANS_PER_S --seconds S [--steps N] [--error-share F] [--slow-share F] [--service NAME] [--json FILE] [--seed N] [--batch-spans N] [--in-flight N] [--channels N] [--compression gzip|none] | --help"
usage() {
    echo "$USAGE" >&2
    exit 2
}

show_help() { # the header above, then the port variables
    sed -n '2,/^set -euo pipefail/{/^#/{s/^# \{0,1\}//;p}}' "${BASH_SOURCE[0]}"
    echo
    echo "Ports (on 127.0.0.1):"
    print_ports
    exit 0
}
for arg in "$@"; do
    if [[ $arg == -h || $arg == --help ]]; then show_help; fi
done

scale=false
rate=
seconds=
passed=()
while (($#)); do
    case $1 in
    --scale) scale=true ;;
    --rate) rate=${2:-} && shift ;;
    --seconds) seconds=${2:-} && shift ;;
    --steps | --error-share | --slow-share | --service | --json | --seed | --batch-spans | --in-flight | --compression | --channels)
        [[ $# -ge 2 ]] || usage
        passed+=("$1" "$2") && shift
        ;;
    *) echo "loadtest.sh: unknown argument $1" >&2 && usage ;;
    esac
    shift
done
[[ -n $rate && -n $seconds ]] || usage

dir=$STATE/scale
pid_of() { # NAME: the pid of a running process of the scale tier, or fail
    local pid exe
    [[ -f $dir/$1.pid ]] || return 1
    read -r pid exe <"$dir/$1.pid"
    [[ $( (tr '\0' '\n' <"/proc/$pid/cmdline" | head -n 1) 2>/dev/null) == "$exe" ]] || return 1
    echo "$pid"
}
gateways=()
for n in 1 2; do
    metrics=GATEWAY_${n}_METRICS_PORT
    pid=$(pid_of "otel-gateway-$n") || {
        echo "loadtest.sh: the scale tier is not up (otel-gateway-$n): run collector/local.sh up --scale first" >&2
        exit 1
    }
    gateways+=(--gateway "otel-gateway-$n,$pid,http://$HOST:${!metrics}/metrics")
done
if $scale; then
    pid_of otel-agent >/dev/null || { echo "loadtest.sh: the agent is not running: collector/local.sh up --scale" >&2 && exit 1; }
    target=$HOST:$AGENT_GRPC_PORT
    passed+=(--scale)
else
    target=$HOST:$GATEWAY_1_PORT
fi
decision_wait=$(sed -n 's/^ *decision_wait: *\([0-9]*\)s.*/\1/p' "$HERE/gateway.yaml")

exec "$PYTHON" "$HERE/loadtest.py" --target "$target" "${gateways[@]}" \
    --jaeger "http://$HOST:$SCALE_JAEGER_UI_PORT" --decision-wait "$decision_wait" \
    --rate "$rate" --seconds "$seconds" "${passed[@]}"
