# The loopback ports of collector/local.sh's processes, sourced by local.sh and loadtest.sh.
# Each is the default of an environment variable of the same name: set it to move that port.
# They are not the defaults of the compose stack (4317, 4318, 16686, 9090), so a compose stack
# or a test receiver on those ports is left alone.
# shellcheck shell=bash

# single tier (up)
COLLECTOR_GRPC_PORT=${COLLECTOR_GRPC_PORT:-24317}
COLLECTOR_HTTP_PORT=${COLLECTOR_HTTP_PORT:-24318}
COLLECTOR_PROMETHEUS_PORT=${COLLECTOR_PROMETHEUS_PORT:-24464} # the Collector's Prometheus exporter
JAEGER_OTLP_PORT=${JAEGER_OTLP_PORT:-24417}
JAEGER_UI_PORT=${JAEGER_UI_PORT:-26686}
JAEGER_QUERY_GRPC_PORT=${JAEGER_QUERY_GRPC_PORT:-26685}
PROMETHEUS_PORT=${PROMETHEUS_PORT:-29090}
# Arize Phoenix (up --ui phoenix): its web UI and REST API, and its OTLP/gRPC receiver
PHOENIX_UI_PORT=${PHOENIX_UI_PORT:-26006}
PHOENIX_OTLP_GRPC_PORT=${PHOENIX_OTLP_GRPC_PORT:-24517}
# scale tier (up --scale): its own Jaeger, so the two tiers can run side by side
AGENT_GRPC_PORT=${AGENT_GRPC_PORT:-25317}
AGENT_HTTP_PORT=${AGENT_HTTP_PORT:-25318}
AGENT_METRICS_PORT=${AGENT_METRICS_PORT:-25319}       # the agent's own telemetry (/metrics)
GATEWAY_1_PORT=${GATEWAY_1_PORT:-25417}
GATEWAY_1_METRICS_PORT=${GATEWAY_1_METRICS_PORT:-25419} # gateway 1's own telemetry (/metrics)
GATEWAY_2_PORT=${GATEWAY_2_PORT:-25427}
GATEWAY_2_METRICS_PORT=${GATEWAY_2_METRICS_PORT:-25429}
SCALE_JAEGER_OTLP_PORT=${SCALE_JAEGER_OTLP_PORT:-25517}
SCALE_JAEGER_UI_PORT=${SCALE_JAEGER_UI_PORT:-27686}
SCALE_JAEGER_QUERY_GRPC_PORT=${SCALE_JAEGER_QUERY_GRPC_PORT:-27685}

# the variables of each tier, for the free-port check of `up`
SINGLE_PORT_VARS=(COLLECTOR_GRPC_PORT COLLECTOR_HTTP_PORT COLLECTOR_PROMETHEUS_PORT JAEGER_OTLP_PORT
    JAEGER_UI_PORT JAEGER_QUERY_GRPC_PORT PROMETHEUS_PORT)
PHOENIX_PORT_VARS=(PHOENIX_UI_PORT PHOENIX_OTLP_GRPC_PORT)
SCALE_PORT_VARS=(AGENT_GRPC_PORT AGENT_HTTP_PORT AGENT_METRICS_PORT GATEWAY_1_PORT GATEWAY_1_METRICS_PORT
    GATEWAY_2_PORT GATEWAY_2_METRICS_PORT SCALE_JAEGER_OTLP_PORT SCALE_JAEGER_UI_PORT SCALE_JAEGER_QUERY_GRPC_PORT)

# print_ports: every port variable and its value now, for --help
print_ports() {
    local var
    for var in "${SINGLE_PORT_VARS[@]}" "${PHOENIX_PORT_VARS[@]}" "${SCALE_PORT_VARS[@]}"; do
        printf '  %-30s %s\n' "$var" "${!var}"
    done
}
