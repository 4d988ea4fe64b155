"""Every span name, attribute name and fixed attribute value this package emits.

Names under ``gen_ai.*`` follow the OpenTelemetry GenAI semantic conventions as released in
semantic-conventions v1.41 (the last release before they moved to
https://github.com/open-telemetry/semantic-conventions-genai; pages gen-ai-spans.md,
gen-ai-metrics.md and gen-ai-events.md), declared by :data:`SCHEMA_URL` on the tracer, the
meter and the event logger. They are defined here rather than imported from
``opentelemetry.semconv._incubating``, whose constants are private and move between releases.
Names under ``generate.*`` are this package's own. Durations are seconds, with no unit in the name.
"""

#: The semantic-conventions version these names follow.
SCHEMA_URL = "https://opentelemetry.io/schemas/1.41.0"

# --- GenAI semantic conventions: request span -------------------------------------------------
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
GEN_AI_REQUEST_CHOICE_COUNT = "gen_ai.request.choice.count"
GEN_AI_REQUEST_STOP_SEQUENCES = "gen_ai.request.stop_sequences"
GEN_AI_REQUEST_STREAM = "gen_ai.request.stream"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
#: The request's id (continuous batching's ``request_id``).
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
#: Seconds from the start of the request to the first hand-over of generated tokens to a streaming
#: consumer: the streamer's first ``put`` of generated tokens (``generate()``), or the first delivered
#: output with tokens of a streaming continuous-batching request.
GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_TOKEN_TYPE = "gen_ai.token.type"
ERROR_TYPE = "error.type"
#: Opt-in content (:mod:`otel_generate.content`): the prompt rows and the returned sequences, as the
#: conventions' JSON structures (gen-ai-input-messages.json / gen-ai-output-messages.json); a JSON
#: string on the span, structured on the event.
GEN_AI_INPUT_MESSAGES = "gen_ai.input.messages"
GEN_AI_OUTPUT_MESSAGES = "gen_ai.output.messages"
#: The opt-in event (a log record) that carries a request's attributes and messages.
EVENT_INFERENCE_OPERATION_DETAILS = "gen_ai.client.inference.operation.details"

# Fixed values.
OPERATION_TEXT_COMPLETION = "text_completion"
PROVIDER_TRANSFORMERS = "transformers"
FINISH_REASON_STOP = "stop"
FINISH_REASON_LENGTH = "length"
#: A generation stopped because its client went away (``transformers serve`` without continuous
#: batching raises its private cancellation inside ``generate()``; with it, ``cancel_request``).
#: Not an error: the status stays UNSET and the tokens produced before it are counted.
FINISH_REASON_CANCELLED = "cancelled"
TOKEN_TYPE_INPUT = "input"
TOKEN_TYPE_OUTPUT = "output"
ROLE_USER = "user"
ROLE_ASSISTANT = "assistant"
PART_TYPE_TEXT = "text"

# --- this package: request span ---------------------------------------------------------------
GENERATE_STEPS = "generate.steps"
#: Seconds from the start of the request to the end of the step that produced the first token.
GENERATE_TIME_TO_FIRST_TOKEN = "generate.time_to_first_token"
#: Seconds after the first token divided by the tokens produced after it (per sequence).
GENERATE_TIME_PER_OUTPUT_TOKEN = "generate.time_per_output_token"
GENERATE_BATCH_SIZE = "generate.batch_size"
GENERATE_NUM_BEAMS = "generate.num_beams"
GENERATE_STRATEGY = "generate.strategy"
#: Seconds from the request's submission to the first batch step that included it (continuous batching).
GENERATE_TIME_IN_QUEUE = "generate.time_in_queue"
#: Seconds spent inside the streamer's ``put`` and ``end`` calls (part of the step latencies).
GENERATE_STREAMER_DURATION = "generate.streamer.duration"
GENERATE_DEVICE = "generate.device"
#: True when the step times are those of completed device work: each clock read waited for the device
#: (``synchronize=True``, the default), or the times are CUDA-event device times (``synchronize="events"``),
#: or the model runs on the CPU; False with ``synchronize=False`` (launch times) or a failed wait.
GENERATE_SYNCHRONIZED = "generate.synchronized"
#: Which clock the step times, time to first token and time per output token were read from: present,
#: with the value ``device``, only when they are CUDA-event device times (``synchronize="events"``); absent
#: means the host clock (every other request).
GENERATE_CLOCK = "generate.clock"
CLOCK_DEVICE = "device"
#: Joules the request used: NVML's total-energy counter of its device(s), read at its start and end
#: (continuous batching: the sum of its shares of the batch steps it took part in). Where NVML is available.
GENERATE_ENERGY = "generate.energy"
#: ``generate.energy`` divided by ``gen_ai.usage.output_tokens`` (joules).
GENERATE_ENERGY_PER_OUTPUT_TOKEN = "generate.energy.per_output_token"
#: ``generate.energy`` divided by all the request's tokens, ``gen_ai.usage.input_tokens`` plus
#: ``gen_ai.usage.output_tokens`` (joules).
GENERATE_ENERGY_PER_TOTAL_TOKEN = "generate.energy.per_total_token"
#: Joules of the prefill step(s) and of the decode steps: the sums of their ``generate.step.energy``,
#: only where every step's energy is known.
GENERATE_ENERGY_PREFILL = "generate.energy.prefill"
GENERATE_ENERGY_DECODE = "generate.energy.decode"
#: Number of decode steps that were timed but not emitted as step spans (``max_step_spans`` cap,
#: or the step-span policy).
GENERATE_STEP_SPANS_DROPPED = "generate.step_spans.dropped"
#: The step-span policy that applied (``all``, ``none``, ``slow``) and whether this request's steps were emitted.
GENERATE_STEP_SPANS_POLICY = "generate.step_spans.policy"
GENERATE_STEP_SPANS_EMITTED = "generate.step_spans.emitted"
#: Why the ``slow`` policy emitted them: ``error``, ``time_to_first_token``, ``time_per_output_token``,
#: ``slowest_fraction``.
GENERATE_STEP_SPANS_REASON = "generate.step_spans.reason"
#: Every step's latency in seconds, in order (capped like ``max_step_spans``).
GENERATE_STEP_LATENCIES = "generate.step.latencies"
#: Decode steps slower than ``outlier_factor`` times the request's median decode step.
GENERATE_STEP_OUTLIERS = "generate.step.outliers"
#: Bytes: the peak of ``torch.cuda.max_memory_allocated`` during the request (CUDA only).
GENERATE_MEMORY_PEAK_ALLOCATED = "generate.memory.peak_allocated"
#: Bytes held by the key/value cache's tensors when the request ended.
GENERATE_KV_CACHE_SIZE = "generate.kv_cache.size"
#: Assisted decoding: candidate tokens proposed, accepted by the model, and accepted / proposed.
GENERATE_ASSISTED_PROPOSED = "generate.assisted.candidates.proposed"
GENERATE_ASSISTED_ACCEPTED = "generate.assisted.candidates.accepted"
GENERATE_ASSISTED_ACCEPTANCE_RATE = "generate.assisted.acceptance_rate"
#: True when some step data is missing or unreliable because of a fault inside the instrumentation.
GENERATE_STEPS_INCOMPLETE = "generate.steps.incomplete"
#: Why no step was timed although the request generated: a loop the instrumentation cannot see into.
GENERATE_STEPS_UNOBSERVED = "generate.steps.unobserved"
#: True when ``uninstrument()`` (or the last self-instrumenting ``TokenLatencyProfiler`` closing) ran
#: while the request was in flight and before its loop's hooks were reached: the loop ran, its steps were
#: not timed (token counts are read off the tensors). A request whose set-up had passed is unaffected, except a
#: model's own generate() with inner calls (Whisper's windows): those started afterwards run unseen.
GENERATE_STEPS_UNINSTRUMENTED = "generate.steps.uninstrumented"
UNOBSERVED_CUSTOM_GENERATE = "custom_generate"  # a custom_generate loop that never calls the stopping criteria
UNOBSERVED_MODEL_LOOP = "model_loop"  # a model's own generate() that runs no GenerationMixin loop
#: Output tokens of inner calls whose result was not kept (Whisper fallback), included in gen_ai.usage.output_tokens.
GENERATE_USAGE_DISCARDED_OUTPUT_TOKENS = "generate.usage.discarded_output_tokens"
#: The custom_generate that ran: the repository or directory given, or the callable's qualified name.
GENERATE_CUSTOM_GENERATE = "generate.custom_generate"
#: The candidate generator of assisted decoding (transformers' class name, e.g. ``MTPCandidateGenerator``).
GENERATE_ASSISTED_GENERATOR = "generate.assisted.generator"

# Values of ``generate.strategy`` (transformers' decoding methods, see GenerationMixin.generate).
STRATEGY_GREEDY = "greedy"
STRATEGY_SAMPLE = "sample"
STRATEGY_BEAM_SEARCH = "beam_search"
STRATEGY_BEAM_SAMPLE = "beam_sample"
STRATEGY_ASSISTED = "assisted"
#: A ``custom_generate`` callable, directory or repository (see ``generate.custom_generate``).
STRATEGY_CUSTOM_GENERATE = "custom_generate"
# Decoding methods transformers 4.x runs itself and 5.x moved to ``custom_generate`` repositories.
STRATEGY_CONTRASTIVE_SEARCH = "contrastive_search"
STRATEGY_GROUP_BEAM_SEARCH = "group_beam_search"
STRATEGY_CONSTRAINED_BEAM_SEARCH = "constrained_beam_search"
STRATEGY_DOLA = "dola"

# --- this package: ranks of a distributed run (request span) -----------------------------------------
#: The process's rank inside the model's tensor-parallel group (``tp_plan``), and the group's size.
GENERATE_TENSOR_PARALLEL_RANK = "generate.tensor_parallel.rank"
GENERATE_TENSOR_PARALLEL_SIZE = "generate.tensor_parallel.size"
#: The 0-based ordinal of this ``generate()`` call among the calls made on this tensor-parallel model
#: in this process while the instrumentation was on (suppressed ones included): the ranks of a group
#: run the same calls in the same order (their collectives must match), so the spans of one user call
#: carry the same value on every rank.
GENERATE_TENSOR_PARALLEL_CALL_INDEX = "generate.tensor_parallel.call_index"
#: ``torch.distributed.get_rank()`` and ``get_world_size()``, when ``torch.distributed`` is initialized.
GENERATE_DISTRIBUTED_RANK = "generate.distributed.rank"
GENERATE_DISTRIBUTED_WORLD_SIZE = "generate.distributed.world_size"

# --- this package: inner-call spans ---------------------------------------------------------------
#: One span per inner ``generate()`` call when a request ran several (Whisper windows and
#: fallback attempts, Bark's sub-models): children of the request span, parents of their steps.
SPAN_INNER_GENERATE = "inner_generate"
GENERATE_CALL_INDEX = "generate.call.index"
GENERATE_CALL_MODEL = "generate.call.model"
GENERATE_CALL_STEPS = "generate.call.steps"
#: Tokens this inner call generated (all its rows); not a gen_ai.usage.* name, so nothing is counted twice.
GENERATE_CALL_OUTPUT_TOKENS = "generate.call.output_tokens"
GENERATE_WINDOW_INDEX = "generate.window.index"
#: Seconds of audio where the window starts (Whisper's ``seek``; the earliest row's).
GENERATE_WINDOW_START = "generate.window.start"
GENERATE_ATTEMPT_INDEX = "generate.attempt.index"
GENERATE_ATTEMPT_TEMPERATURE = "generate.attempt.temperature"
#: Whether the attempt's result was kept (for at least one row).
GENERATE_ATTEMPT_KEPT = "generate.attempt.kept"
GENERATE_ATTEMPT_ROWS = "generate.attempt.rows"
GENERATE_ATTEMPT_KEPT_ROWS = "generate.attempt.kept_rows"

# --- this package: step spans -----------------------------------------------------------------
STEP_SPAN_PREFILL = "prefill"
STEP_SPAN_DECODE = "decode"
GENERATE_STEP_INDEX = "generate.step.index"
GENERATE_TOKEN_INDEX = "generate.token.index"
GENERATE_STEP_TOKENS = "generate.step.tokens"
#: The step's duration, seconds.
GENERATE_STEP_LATENCY = "generate.step.latency"
#: True on a decode step slower than ``outlier_factor`` times the request's median decode step (absent otherwise).
GENERATE_STEP_OUTLIER = "generate.step.outlier"
#: How many requests shared the batch step (continuous batching).
GENERATE_STEP_REQUESTS = "generate.step.requests"
#: Joules the step used (NVML's counter read at its two boundaries; continuous batching: this request's
#: share of the batch step, in proportion to the tokens it computed in it). Only where the counter advanced
#: within every step of the request.
GENERATE_STEP_ENERGY = "generate.step.energy"
#: Opt-in (:mod:`otel_generate.content`): the token ids this step appended, row-major (every
#: returned sequence's ``generate.step.tokens`` ids in turn), as the returned tensor holds them.
GENERATE_STEP_TOKEN_IDS = "generate.step.token_ids"
#: Opt-in: the natural-log probability of each of those tokens under the processed distribution
#: the token was chosen from (after logits processors and warpers); same layout.
GENERATE_STEP_LOGPROBS = "generate.step.logprobs"
PHASE_PREFILL = STEP_SPAN_PREFILL
PHASE_DECODE = STEP_SPAN_DECODE

# --- GenAI semantic conventions: metrics ------------------------------------------------------
METRIC_TIME_TO_FIRST_TOKEN = "gen_ai.server.time_to_first_token"
METRIC_TIME_PER_OUTPUT_TOKEN = "gen_ai.server.time_per_output_token"
METRIC_REQUEST_DURATION = "gen_ai.server.request.duration"
METRIC_CLIENT_OPERATION_DURATION = "gen_ai.client.operation.duration"
METRIC_TOKEN_USAGE = "gen_ai.client.token.usage"
#: This package's own (the GenAI conventions define no inter-token latency metric yet; a proposal is
#: semantic-conventions-genai#232): one observation per decode step, the step's latency divided by the
#: tokens it produced per sequence, seconds.
METRIC_INTER_TOKEN_LATENCY = "generate.inter_token_latency"
#: This package's own health: a counter of finished requests whose telemetry the background emitter
#: dropped because its queue was full (attribute ``gen_ai.operation.name``).
METRIC_EMITTER_DROPPED = "generate.emitter.dropped_requests"
#: This package's own: one observation per successful request with energy and output tokens, its joules
#: divided by its output tokens.
METRIC_ENERGY_PER_OUTPUT_TOKEN = "generate.energy_per_output_token"

# Explicit bucket boundaries from the GenAI metrics page (seconds, or tokens for usage).
BUCKETS_TIME_TO_FIRST_TOKEN_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)
BUCKETS_TIME_PER_OUTPUT_TOKEN_S = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
BUCKETS_REQUEST_DURATION_S = tuple(round(0.01 * 2**i, 2) for i in range(14))  # 0.01 .. 81.92
BUCKETS_OPERATION_DURATION_S = BUCKETS_REQUEST_DURATION_S  # the same boundaries on the metrics page
BUCKETS_TOKEN_USAGE = tuple(4**i for i in range(14))  # 1 .. 67108864
#: Per-token gaps: 1 ms to 2.5 s, fine where decode steps usually fall (a few ms to a few hundred ms on a
#: GPU; SGLang's inter-token-latency boundaries, with 1 ms added below them).
BUCKETS_INTER_TOKEN_LATENCY_S = (
    0.001,
    0.002,
    0.004,
    0.006,
    0.008,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.035,
    0.04,
    0.06,
    0.08,
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1.0,
    2.5,
)
#: Joules per output token: 1 mJ (large batches) to 100 J (a large model at batch 1), about 2.5x apart.
BUCKETS_ENERGY_PER_OUTPUT_TOKEN_J = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    25.0,
    50.0,
    100.0,
)
