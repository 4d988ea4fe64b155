# Where collector/local.sh keeps the state of a stack (pid files, logs, Jaeger's and Phoenix's
# data), sourced by local.sh and loadtest.sh. HERE must be this folder.
#
#   CACHE     the build cache: $OTEL_GENERATE_CACHE, default ${XDG_CACHE_HOME:-$HOME/.cache}/otel-generate
#   CLONE     this clone: the folder above collector/, symbolic links resolved
#   STATE     this clone's state folder: $OTEL_GENERATE_LOCAL_STATE, default
#             $CACHE/local/<clone's folder name>-<hash of CLONE>; one folder per tier in it
#             (single/, scale/)
#   REGISTRY  $CACHE/local/stacks: one link per state folder `up` used, how `status` and
#             `down --all` find every stack of the user
# shellcheck shell=bash

CACHE=${OTEL_GENERATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/otel-generate}
CLONE=$(cd "$HERE/.." && pwd -P)
# a short hash of a path: the name of its folder (STATE) or of its link (REGISTRY)
path_key() { printf '%s' "$1" | sha256sum | cut -c1-12; }
STATE=${OTEL_GENERATE_LOCAL_STATE:-$CACHE/local/$(basename "$CLONE")-$(path_key "$CLONE")}
[[ $STATE == /* ]] || STATE=$PWD/$STATE
REGISTRY=$CACHE/local/stacks
