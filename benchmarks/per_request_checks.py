"""Microbenchmark of the per-request checks on the ``generate()`` path (none per step):

* ``ranks.placement(model, mode)``: which rank speaks for the call (:mod:`otel_generate.ranks`), in
  a process where ``torch.distributed`` is not initialized and the model is not sharded (the
  common case: a weak-dictionary look-up of the model and ``is_initialized()``);
* ``cancellation.is_cancellation(exc)``: for a call that returned (``None``) and one that raised
  an ordinary exception (a walk of its class's MRO);
* ``clock.devices_of(model)``: the devices a request waits for, read through transformers' public
  ``model.device`` and ``hf_device_map``;
* ``Telemetry.metrics_live()``: whether the meter provider in use aggregates what is recorded (asked
  per request; the answer kept per provider object);
* ``pickle`` of a finished 32-token continuous-batching record (``request.Request``), both ways: what
  handing a request's record to another process would cost (docs/scaling.md);
* the background emitter's check, before a finished request is handed over, that the tracer and
  meter providers in use are those whose flush it wrapped (a provider set after ``instrument()``
  gets wrapped there): with no global provider set (each look-up then reads the environment), and
  with the SDK's providers set globally, as ``opentelemetry-instrument`` does.

    python benchmarks/per_request_checks.py --repeats 5 --calls 200000

Prints nanoseconds per call, the minimum over ``--repeats`` of ``timeit`` runs of ``--calls``.
"""

from __future__ import annotations

import argparse
import pickle
import timeit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200000)
    args = parser.parse_args()

    from otel_generate import cancellation, clock, ranks
    from otel_generate.bench.models import build_model

    model = build_model("gpt2")
    ranks.placement(model, "rank0")  # the model's group is read once
    error = ValueError("not a cancellation")
    cases = {
        "ranks.placement, not distributed": lambda: ranks.placement(model, "rank0"),
        "cancellation.is_cancellation(None)": lambda: cancellation.is_cancellation(None),
        "cancellation.is_cancellation(ValueError)": lambda: cancellation.is_cancellation(error),
        "clock.devices_of (model.device, hf_device_map)": lambda: clock.devices_of(model),
    }
    record = _finished_record(32)
    pickled = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
    print(f"a finished 32-token record pickles to {len(pickled)} bytes")
    cases["pickle.dumps of a 32-token record"] = lambda: pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
    cases["pickle.loads of it"] = lambda: pickle.loads(pickled)
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider

    from otel_generate import GenerateInstrumentor
    from otel_generate.instrumentor import start_emitter

    GenerateInstrumentor().instrument()
    instrumentor = GenerateInstrumentor()
    emitter = start_emitter(instrumentor.patches, instrumentor.telemetry)
    emitter.before_submit()  # the providers of now wrapped once: what follows is the check alone
    cases["providers check, no global provider set"] = emitter.before_submit
    _report(cases, args)
    trace.set_tracer_provider(TracerProvider())
    metrics.set_meter_provider(MeterProvider())
    emitter.before_submit()
    _report(
        {
            "providers check, the SDK's providers set globally": emitter.before_submit,
            "metrics_live, the SDK's meter provider set globally": instrumentor.telemetry.metrics_live,
        },
        args,
    )


def _finished_record(tokens: int):
    """A continuous-batching request's record as the emitter gets it: one-token batch steps of 2 ms
    shared by 16 requests."""
    from otel_generate.request import Request

    record = Request(model="LlamaForCausalLM", start_ns=1_000, start_wall_ns=1_700_000_000 * 10**9, timed=True)
    at, ends = 1_000, []
    for index in range(tokens):
        at += 2_000_000 + index * 1_000
        ends.append(at)
    record.step_ends_ns, record.step_tokens, record.step_requests = ends, [1] * tokens, [16] * tokens
    record.end_ns = ends[-1] + 5
    record.input_tokens, record.output_tokens, record.output_tokens_per_sequence = 8, tokens, [tokens]
    record.finish_reasons = ["length"]
    record.parameters = {"gen_ai.request.max_tokens": tokens, "generate.strategy": "greedy"}
    return record


def _report(cases: dict, args: argparse.Namespace) -> None:
    for name, function in cases.items():
        best = min(timeit.repeat(function, number=args.calls, repeat=args.repeats)) / args.calls
        print(f"{name}: {best * 1e9:.0f} ns per call")


if __name__ == "__main__":
    main()
