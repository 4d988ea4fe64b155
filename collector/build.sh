#!/usr/bin/env bash
# Build, once, the two binaries that collector/local.sh runs, from their Go modules:
#
#   * the OpenTelemetry Collector: the OpenTelemetry Collector Builder (ocb) v0.161.0 builds the
#     components listed in collector/builder-config.yaml (one Collector release, v0.161.0);
#   * Jaeger v2.12.0: `cmd/jaeger` of the Go module github.com/jaegertracing/jaeger v1.75.0, pinned
#     with its dependencies by collector/jaeger/go.mod and go.sum (a `tool` line: `go install
#     ...@v1.75.0` refuses a module whose go.mod has replace directives).
#
# The binaries go to a git-ignored cache folder, $OTEL_GENERATE_CACHE (default
# ${XDG_CACHE_HOME:-$HOME/.cache}/otel-generate), in a folder named after a hash of the files
# and versions that define them: a second run with the same manifest and go.sum builds nothing, and a change to
# either builds anew next to the old one. Prints `OTELCOL=path` and `JAEGER=path`.
#
# A build from nothing takes minutes: on a 2-core machine the Collector took 320 s and Jaeger 465 s
# (BENCHMARKS.md, "Building and starting the real backends"). Before it starts, it says on stderr
# what it will build and how long that took there; while Go compiles, a line with the time so far
# every $OTEL_GENERATE_BUILD_PROGRESS_S seconds (default 20); at the end, where the binaries are.
#
# Needs Go 1.26 (`go version`) and the Go module proxy. Exit status 3 when `go` is missing.
# While another build.sh holds the build lock (two processes asking at once), it says so on
# stderr and waits for it.
#
#   collector/build.sh            # build what is missing, print the two paths
#   collector/build.sh --built    # build nothing: print the paths and exit 0 when both are built,
#                                 # else exit 4 (how local.sh knows whether it needs Go)
#   collector/build.sh --help     # this text
#
# Environment:
#   OTEL_GENERATE_CACHE             the cache folder (default ${XDG_CACHE_HOME:-$HOME/.cache}/otel-generate)
#   XDG_CACHE_HOME                  see OTEL_GENERATE_CACHE
#   OTEL_GENERATE_BUILD_PROGRESS_S  seconds between two progress lines while Go builds (default 20)
#   and Go's own (GOPROXY, GOFLAGS, GOCACHE, GOMODCACHE, ...), which `go` reads
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=${OTEL_GENERATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/otel-generate}
OCB_VERSION=v0.161.0
JAEGER_MODULE_VERSION=v1.75.0 # the module's v1 tag of the release whose v2 tag is:
JAEGER_VERSION=v2.12.0        # what `jaeger version` reports (the compose image jaegertracing/jaeger:2.12.0)
PROGRESS_S=${OTEL_GENERATE_BUILD_PROGRESS_S:-20}
# wall times of a build from nothing on a 2-core machine: BENCHMARKS.md, "Building and starting the
# real backends"
COLLECTOR_BUILD_S=320
JAEGER_BUILD_S=465
REFERENCE="a 2-core machine"

log() { echo "build.sh: $*" >&2; }

case ${1:-} in
-h | --help)
    sed -n '2,/^set -euo pipefail/{/^#/{s/^# \{0,1\}//;p}}' "${BASH_SOURCE[0]}"
    exit 0
    ;;
--built | "") ;;
*)
    log "unknown option $1 (usage: $0 [--built | --help])"
    exit 2
    ;;
esac
if [[ ! $PROGRESS_S =~ ^[1-9][0-9]*$ ]]; then
    log "OTEL_GENERATE_BUILD_PROGRESS_S=$PROGRESS_S: a whole number of seconds, 1 or more"
    exit 2
fi

# with_progress WHAT EXPECTED_S START COMMAND...: COMMAND in the background; every PROGRESS_S
# seconds while it runs, a line with the time since START (the $SECONDS WHAT began); COMMAND's status
with_progress() {
    local what=$1 expected=$2 since=$3 pid next status=0
    shift 3
    # in a process group of its own (job control on for this one start), so that a Ctrl-C or a
    # kill of build.sh can stop Go and every compiler it started
    set -m
    "$@" &
    pid=$!
    set +m
    trap 'kill -TERM -- "-$pid" 2>/dev/null; exit 130' INT TERM
    next=$((SECONDS + PROGRESS_S))
    while kill -0 "$pid" 2>/dev/null; do
        if ((SECONDS >= next)); then
            log "$what: $((SECONDS - since)) s so far (it took $expected s on $REFERENCE)"
            next=$((SECONDS + PROGRESS_S))
        fi
        sleep 0.5
    done
    wait "$pid" || status=$?
    trap - INT TERM
    return "$status"
}

# the folder name: a hash of the files and versions that define a binary
key() { { cat "$@"; echo "$OCB_VERSION $JAEGER_VERSION"; } | sha256sum | cut -c1-16; }

otelcol_dir=$CACHE/otelcol-$(key "$HERE/builder-config.yaml")
jaeger_dir=$CACHE/jaeger-$(key "$HERE/jaeger/go.mod" "$HERE/jaeger/go.sum")
otelcol=$otelcol_dir/otelcol-otel-generate
jaeger=$jaeger_dir/jaeger

if [[ ${1:-} == --built ]]; then
    [[ -x $otelcol && -x $jaeger ]] || exit 4
    echo "OTELCOL=$otelcol"
    echo "JAEGER=$jaeger"
    exit 0
fi

built=false
if [[ ! -x $otelcol || ! -x $jaeger ]]; then
    if ! command -v go >/dev/null; then
        log "go not found: install Go 1.26 or newer (https://go.dev/dl) to build the Collector and Jaeger"
        exit 3
    fi
    mkdir -p "$CACHE"
    # one build at a time (two test processes may ask together); the second finds the binaries
    exec 9>"$CACHE/build.lock"
    if ! flock -n 9; then
        log "waiting for another collector/build.sh to finish (it holds $CACHE/build.lock)"
        flock 9
        log "the other build finished"
    fi
fi

# what is still missing (another build may have made it), and how long it took on the reference machine
names=()
times=()
total=0
if [[ ! -x $otelcol ]]; then
    names+=("the Collector")
    times+=("$COLLECTOR_BUILD_S s")
    total=$((total + COLLECTOR_BUILD_S))
fi
if [[ ! -x $jaeger ]]; then
    names+=("Jaeger")
    times+=("$JAEGER_BUILD_S s")
    total=$((total + JAEGER_BUILD_S))
fi
joined() { local IFS=,; sed 's/,/ and /' <<<"$*"; } # "a and b"
if ((${#names[@]})); then
    built=true
    in_all=
    ((${#names[@]} > 1)) && in_all=", $total s in all"
    log "building $(joined "${names[@]}") from their Go modules, once. On $REFERENCE (BENCHMARKS.md) that took $(joined "${times[@]}")$in_all; this machine has $(nproc) cores. A line every $PROGRESS_S s while it builds."
fi

build_collector() { # the builder's output (it runs go) goes to its log, shown if it fails
    "$builder" --config="$work/manifest.yaml" --ldflags="-s -w" >"$work/build.log" 2>&1
}

build_jaeger() {
    cd "$HERE/jaeger" && go build -mod=readonly -trimpath \
        -ldflags="-s -w -X github.com/jaegertracing/jaeger/internal/version.latestVersion=$JAEGER_VERSION" \
        -o "$jaeger.tmp" github.com/jaegertracing/jaeger/cmd/jaeger
}

if [[ ! -x $otelcol ]]; then
    start=$SECONDS
    builder=$CACHE/ocb-$OCB_VERSION/builder
    if [[ ! -x $builder ]]; then
        log "installing the OpenTelemetry Collector Builder $OCB_VERSION"
        with_progress "the Collector (installing its builder)" "$COLLECTOR_BUILD_S" "$start" \
            env GOBIN="$(dirname "$builder")" go install -trimpath "go.opentelemetry.io/collector/cmd/builder@$OCB_VERSION"
    fi
    log "building the Collector from collector/builder-config.yaml into $otelcol_dir"
    work=$otelcol_dir.tmp
    rm -rf "$work"
    mkdir -p "$work"
    # the manifest with its output_path pointing into the cache
    sed "s#^\(  output_path:\).*#\1 $work#" "$HERE/builder-config.yaml" >"$work/manifest.yaml"
    with_progress "the Collector" "$COLLECTOR_BUILD_S" "$start" build_collector ||
        { cat "$work/build.log" >&2; exit 1; }
    "$work/otelcol-otel-generate" components >"$work/components.txt"
    rm -rf "$otelcol_dir"
    mv "$work" "$otelcol_dir"
    log "Collector built in $((SECONDS - start)) s"
fi

if [[ ! -x $jaeger ]]; then
    start=$SECONDS
    log "building Jaeger $JAEGER_VERSION (module $JAEGER_MODULE_VERSION) into $jaeger_dir"
    mkdir -p "$jaeger_dir"
    with_progress "Jaeger" "$JAEGER_BUILD_S" "$start" build_jaeger
    mv "$jaeger.tmp" "$jaeger"
    log "Jaeger built in $((SECONDS - start)) s"
fi

if $built; then
    log "the binaries are cached in $CACHE: $otelcol and $jaeger (the next run finds them and builds nothing)"
fi
echo "OTELCOL=$otelcol"
echo "JAEGER=$jaeger"
