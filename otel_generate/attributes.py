"""Every span name, attribute name and fixed attribute value this package emits.

Names under ``gen_ai.*`` follow the OpenTelemetry GenAI semantic conventions
(https://opentelemetry.io/docs/specs/semconv/gen-ai/gen-ai-spans/ and
https://opentelemetry.io/docs/specs/semconv/gen-ai/gen-ai-metrics/). They are defined here
rather than imported from ``opentelemetry.semconv._incubating``, whose constants are private
and move between releases. Names under ``generate.*`` are this package's own.
"""

# --- GenAI semantic conventions: request span -------------------------------------------------
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
GEN_AI_REQUEST_CHOICE_COUNT = "gen_ai.request.choice.count"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_TOKEN_TYPE = "gen_ai.token.type"
ERROR_TYPE = "error.type"

# Fixed values.
OPERATION_TEXT_COMPLETION = "text_completion"
PROVIDER_TRANSFORMERS = "transformers"
FINISH_REASON_STOP = "stop"
FINISH_REASON_LENGTH = "length"
TOKEN_TYPE_INPUT = "input"
TOKEN_TYPE_OUTPUT = "output"

# --- this package: request span ---------------------------------------------------------------
GENERATE_STEPS = "generate.steps"
GENERATE_TIME_TO_FIRST_TOKEN_MS = "generate.time_to_first_token_ms"
GENERATE_TIME_PER_OUTPUT_TOKEN_MS = "generate.time_per_output_token_ms"
GENERATE_BATCH_SIZE = "generate.batch_size"
GENERATE_NUM_BEAMS = "generate.num_beams"
GENERATE_STRATEGY = "generate.strategy"
GENERATE_DEVICE = "generate.device"
GENERATE_SYNCHRONIZED = "generate.synchronized"
#: Number of decode steps that were timed but not emitted as step spans (``max_step_spans`` cap).
GENERATE_STEP_SPANS_DROPPED = "generate.step_spans.dropped"
#: True when some step data is missing or unreliable because of a fault inside the instrumentation.
GENERATE_STEPS_INCOMPLETE = "generate.steps.incomplete"

# Values of ``generate.strategy`` (transformers' decoding methods, see GenerationMixin.generate).
STRATEGY_GREEDY = "greedy"
STRATEGY_SAMPLE = "sample"
STRATEGY_BEAM_SEARCH = "beam_search"
STRATEGY_BEAM_SAMPLE = "beam_sample"
STRATEGY_ASSISTED = "assisted"
# Decoding methods transformers 4.x runs itself and 5.x moved to ``custom_generate`` repositories.
STRATEGY_CONTRASTIVE_SEARCH = "contrastive_search"
STRATEGY_GROUP_BEAM_SEARCH = "group_beam_search"
STRATEGY_CONSTRAINED_BEAM_SEARCH = "constrained_beam_search"
STRATEGY_DOLA = "dola"

# --- this package: step spans -----------------------------------------------------------------
STEP_SPAN_PREFILL = "prefill"
STEP_SPAN_DECODE = "decode"
GENERATE_STEP_INDEX = "generate.step.index"
GENERATE_TOKEN_INDEX = "generate.token.index"
GENERATE_STEP_TOKENS = "generate.step.tokens"
GENERATE_STEP_LATENCY_MS = "generate.step.latency_ms"
GENERATE_STEP_PHASE = "generate.step.phase"
PHASE_PREFILL = STEP_SPAN_PREFILL
PHASE_DECODE = STEP_SPAN_DECODE

# --- GenAI semantic conventions: metrics ------------------------------------------------------
METRIC_TIME_TO_FIRST_TOKEN = "gen_ai.server.time_to_first_token"
METRIC_TIME_PER_OUTPUT_TOKEN = "gen_ai.server.time_per_output_token"
METRIC_REQUEST_DURATION = "gen_ai.server.request.duration"
METRIC_TOKEN_USAGE = "gen_ai.client.token.usage"

# Explicit bucket boundaries from the GenAI metrics page (seconds, or tokens for usage).
BUCKETS_TIME_TO_FIRST_TOKEN_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)
BUCKETS_TIME_PER_OUTPUT_TOKEN_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)
BUCKETS_REQUEST_DURATION_S = tuple(round(0.01 * 2**i, 2) for i in range(14))  # 0.01 .. 81.92
BUCKETS_TOKEN_USAGE = tuple(4**i for i in range(14))  # 1 .. 67108864
