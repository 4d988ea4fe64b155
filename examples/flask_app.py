"""A web request handler that calls ``generate()``: one trace from the HTTP request to each decode step.

Run it under the OpenTelemetry auto-instrumentation, which instruments Flask (with
``opentelemetry-instrumentation-flask`` installed) and ``generate()`` (this package)::

    OTEL_SERVICE_NAME=otel-generate-flask opentelemetry-instrument \
        --traces_exporter console --metrics_exporter none --logs_exporter none \
        python examples/flask_app.py --port 8000

    curl 'http://127.0.0.1:8000/generate?new_tokens=8'

The trace of one request reads::

    GET /generate                       (Flask's HTTP server span, kind SERVER)
    └── text_completion GPT2LMHeadModel
        ├── prefill
        └── decode  (x new_tokens - 1)

The handler answers with JSON: the continuation token ids, the time to first token and the time
per output token in milliseconds (from :class:`otel_generate.TokenLatencyProfiler`), and the
trace id in hex so you can look the trace up in your backend.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any, Optional

import torch
from flask import Flask, jsonify, request
from opentelemetry import trace
from opentelemetry.instrumentation.flask import FlaskInstrumentor

from otel_generate import TokenLatencyProfiler
from otel_generate.bench.models import build_model

#: Upper bound on ``new_tokens`` per request (a demo server should not be asked for 10**9 tokens).
MAX_NEW_TOKENS = 256


def create_app(
    model: Any = None,
    tracer_provider: Optional[trace.TracerProvider] = None,
    instrument_flask: bool = True,
) -> Flask:
    """Build the Flask app around ``model`` (default: a random-weight GPT-2-architecture model).

    With ``instrument_flask`` the app is instrumented with ``FlaskInstrumentor().instrument_app``
    and ``tracer_provider`` (default: the global provider); leave it off under
    ``opentelemetry-instrument``, which instruments Flask itself. ``generate()`` must be
    instrumented separately (``GenerateInstrumentor().instrument()`` or ``opentelemetry-instrument``).
    ``GET /generate?new_tokens=N&prompt_tokens=P&seed=S`` generates greedily from a random prompt
    of ``P`` token ids (default 4) and answers ``{"continuation": [...], "time_to_first_token_ms":
    float, "time_per_output_token_ms": float | null, "trace_id": "32 hex digits"}``. A
    ``new_tokens`` outside 1..256 or a non-integer parameter gets HTTP 400 with the reason.
    """
    model = model if model is not None else build_model("gpt2", seed=0)
    lock = threading.Lock()  # one generate() at a time on the shared model
    app = Flask(__name__)

    @app.get("/generate")
    def generate():
        try:
            new_tokens = int(request.args.get("new_tokens", 8))
            prompt_tokens = int(request.args.get("prompt_tokens", 4))
            seed = int(request.args.get("seed", 0))
        except ValueError as exc:
            return jsonify(error=f"new_tokens, prompt_tokens and seed must be integers: {exc}"), 400
        if not 1 <= new_tokens <= MAX_NEW_TOKENS or prompt_tokens < 1:
            return jsonify(error=f"new_tokens must be in 1..{MAX_NEW_TOKENS} and prompt_tokens >= 1"), 400
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, model.config.vocab_size - 1, (1, prompt_tokens), generator=generator)
        with lock, TokenLatencyProfiler() as profiler:
            output = model.generate(
                input_ids=ids.to(model.device),
                attention_mask=torch.ones_like(ids).to(model.device),
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
            )
        record = profiler.records[-1]
        tpot = record.time_per_output_token_s
        return jsonify(
            continuation=output[0, ids.shape[-1] :].tolist(),
            time_to_first_token_ms=record.time_to_first_token_s * 1e3,
            time_per_output_token_ms=None if tpot is None else tpot * 1e3,
            trace_id=format(trace.get_current_span().get_span_context().trace_id, "032x"),
        )

    if instrument_flask:
        FlaskInstrumentor().instrument_app(app, tracer_provider=tracer_provider)
    return app


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    # `kill` (SIGTERM) exits like Ctrl+C, so the SDK's exit handlers flush the queued spans
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    # opentelemetry-instrument has instrumented Flask and generate() before this module ran
    create_app(instrument_flask=False).run(host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
