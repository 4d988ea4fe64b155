"""Tracing ``transformers serve``: a local model to serve, and a client that sends concurrent requests.

Nothing is downloaded: ``model`` writes a tiny random-weight Llama and a character-level tokenizer
(one token per printable ASCII character, built locally) to a directory that ``transformers
serve`` loads like any checkpoint. Then, in one shell::

    python examples/serve_demo.py model /tmp/tiny-serve
    OTEL_SERVICE_NAME=tiny-serve opentelemetry-instrument \\
        --traces_exporter console --metrics_exporter none --logs_exporter none \\
        transformers serve /tmp/tiny-serve --host 127.0.0.1 --port 8000 --device cpu \\
        --continuous-batching --cb-num-blocks 16 --cb-max-batch-tokens 64

(drop the three ``--c...`` options to serve without continuous batching), and in another::

    OTEL_SERVICE_NAME=tiny-client opentelemetry-instrument \\
        --traces_exporter console --metrics_exporter none --logs_exporter none \\
        python examples/serve_demo.py client http://127.0.0.1:8000 --requests 2

The client sends the ``/v1/completions`` requests at the same time, each inside a CLIENT span of its
own (``POST /v1/completions``, a trace of its own) whose W3C ``traceparent`` it sends, as an
instrumented HTTP client does, and prints each trace id with the response's token usage. The server
prints, per request, its HTTP server span (``POST /v1/completions``, a child of the client's span),
and under it the ``text_completion`` request span and its ``prefill``/``decode`` step spans: each
request in the trace its client started. (Without an OpenTelemetry SDK, as plain ``python``, the
client's spans are not recorded and no ``traceparent`` is sent: each request starts its own trace at
the server.) The ``openai`` client, with OpenTelemetry's OpenAI instrumentation, is shown in
docs/serving.md.

(Under ``opentelemetry-instrument`` the server needs ``opentelemetry-instrumentation-fastapi``
for the ``POST`` spans; ``pip install -e ".[test]"`` has it.)
"""

from __future__ import annotations

import argparse
import json
import string
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Dict, List, Optional, Sequence

#: Token ids 0..3 are <pad>, <s>, </s>, <unk>; then the 95 printable ASCII characters.
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
EOS_TOKEN_ID = 2


def build_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` with one token per printable ASCII character (no merges), built locally."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    characters = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
    vocab = {token: index for index, token in enumerate(list(SPECIAL_TOKENS) + characters)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return tokenizer


def build_model_dir(path: str, seed: int = 0) -> str:
    """Write a tiny random-weight ``LlamaForCausalLM`` (vocabulary 128, EOS id 2) and its tokenizer to ``path``."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=1, eos_token_id=EOS_TOKEN_ID, pad_token_id=0, do_sample=False
    )
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def complete(
    base_url: str, prompt: str, max_tokens: int, headers: Optional[Dict[str, str]] = None, timeout_s: float = 120.0
) -> Dict[str, Any]:
    """``POST {base_url}/v1/completions`` (greedy); the JSON answer."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.load(response)


def wait_for_server(base_url: str, timeout_s: float = 120.0) -> None:
    """Wait until the server answers ``GET {base_url}/v1/models`` (it takes seconds to start).

    Raises:
        TimeoutError: it did not answer within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{base_url}/v1/models", timeout=5):
                return
        except (OSError, urllib.error.URLError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no server answered at {base_url} within {timeout_s:.0f} s") from None
            time.sleep(0.5)


def send_concurrent(base_url: str, prompts: Sequence[str], max_tokens: int, tracer: Any = None) -> List[Dict[str, Any]]:
    """Send one completion request per prompt, all at once, each inside a CLIENT span of its own trace.

    Each request's ``POST /v1/completions`` CLIENT span is started with ``tracer`` (default: the
    OpenTelemetry API's global one, which records nothing until an SDK is configured, e.g. by
    ``opentelemetry-instrument``) and its context is sent as W3C ``traceparent``/``tracestate``
    headers (the global propagator's, W3C Trace Context by default).

    Returns, in prompt order, ``{"prompt", "trace_id", "parent_span_id"`` (hex: the client span's
    trace and span ids, zeros when not recorded) ``, "response"}``. Raises the first request's error, if any.
    """
    from opentelemetry import propagate, trace

    tracer = tracer or trace.get_tracer("serve_demo")
    results: List[Dict[str, Any]] = [{"prompt": prompt} for prompt in prompts]
    errors: List[BaseException] = []

    def one(result: Dict[str, Any]) -> None:
        try:
            with tracer.start_as_current_span(
                "POST /v1/completions",
                kind=trace.SpanKind.CLIENT,
                attributes={"http.request.method": "POST", "url.full": f"{base_url}/v1/completions"},
            ) as span:
                headers: Dict[str, str] = {}
                propagate.inject(headers)  # the client span's context, as an instrumented HTTP client sends it
                context = span.get_span_context()
                result["trace_id"], result["parent_span_id"] = f"{context.trace_id:032x}", f"{context.span_id:016x}"
                result["response"] = complete(base_url, result["prompt"], max_tokens, headers)
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(result,)) for result in results]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    model = commands.add_parser("model", help="write the tiny model and tokenizer to a directory")
    model.add_argument("path")
    client = commands.add_parser("client", help="send concurrent /v1/completions requests")
    client.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    client.add_argument("--requests", type=int, default=2, help="how many, all at once (default 2)")
    client.add_argument("--max-tokens", type=int, default=8, help="max_tokens of each (default 8)")
    args = parser.parse_args(argv)
    if args.command == "model":
        print(f"wrote {build_model_dir(args.path)}")
        return 0
    if args.requests < 1:
        parser.error("--requests must be at least 1")
    prompts = [f"request {index}: hello" for index in range(args.requests)]
    wait_for_server(args.url.rstrip("/"))
    for result in send_concurrent(args.url.rstrip("/"), prompts, args.max_tokens):
        usage = result["response"]["usage"]
        print(
            f"trace_id={result['trace_id']} prompt_tokens={usage['prompt_tokens']} "
            f"completion_tokens={usage['completion_tokens']} text={result['response']['choices'][0]['text']!r}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
