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
# Needs Go 1.26 (`go version`) and the Go module proxy. Exit status 3 when `go` is missing.
# While another build.sh holds the build lock (two processes asking at once), it says so on
# stderr and waits for it.
#
#   collector/build.sh            # build what is missing, print the two paths
#   collector/build.sh --built    # build nothing: print the paths and exit 0 when both are built,
#                                 # else exit 4 (how local.sh knows whether it needs Go)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=${OTEL_GENERATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/otel-generate}
OCB_VERSION=v0.161.0
JAEGER_MODULE_VERSION=v1.75.0 # the module's v1 tag of the release whose v2 tag is:
JAEGER_VERSION=v2.12.0        # what `jaeger version` reports (the compose image jaegertracing/jaeger:2.12.0)

log() { echo "build.sh: $*" >&2; }

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

if [[ ! -x $otelcol ]]; then
    start=$SECONDS
    builder=$CACHE/ocb-$OCB_VERSION/builder
    if [[ ! -x $builder ]]; then
        log "installing the OpenTelemetry Collector Builder $OCB_VERSION"
        GOBIN=$(dirname "$builder") go install -trimpath "go.opentelemetry.io/collector/cmd/builder@$OCB_VERSION"
    fi
    log "building the Collector from collector/builder-config.yaml into $otelcol_dir"
    work=$otelcol_dir.tmp
    rm -rf "$work"
    mkdir -p "$work"
    # the manifest with its output_path pointing into the cache
    sed "s#^\(  output_path:\).*#\1 $work#" "$HERE/builder-config.yaml" >"$work/manifest.yaml"
    "$builder" --config="$work/manifest.yaml" --ldflags="-s -w" >"$work/build.log" 2>&1 ||
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
    (cd "$HERE/jaeger" && go build -mod=readonly -trimpath \
        -ldflags="-s -w -X github.com/jaegertracing/jaeger/internal/version.latestVersion=$JAEGER_VERSION" \
        -o "$jaeger.tmp" github.com/jaegertracing/jaeger/cmd/jaeger)
    mv "$jaeger.tmp" "$jaeger"
    log "Jaeger built in $((SECONDS - start)) s"
fi

echo "OTELCOL=$otelcol"
echo "JAEGER=$jaeger"
