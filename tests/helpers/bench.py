"""Helpers the bench's tests share (tests/unit and tests/integration): the command line called in process,
the JSON document's schema check, and numpy's quartiles. Imports neither ``transformers`` nor a model."""

from __future__ import annotations

import numpy

from otel_generate.bench import runner as bench_runner
from otel_generate.bench.cli import main


def run_cli(*argv):
    return main(["bench", *argv])


NUMBER = (int, float)


def check_schema(doc):
    """The issue's key list, with types; returns the problems found (empty when valid)."""
    problems = []
    types = {
        "versions": dict,
        "device": str,
        "dtype": str,
        "parameters": int,
        "prompt_tokens": int,
        "new_tokens_requested": int,
        "batch_size": int,
        "warmup": int,
        "runs": int,
        "threads": int,
        "samples": list,
        "median_elapsed_s": NUMBER,
        "median_tokens_per_s": NUMBER,
        # None only when no run had a second token (TPOT) or a completed step (TTFT)
        "median_time_to_first_token_ms": NUMBER + (type(None),),
        "median_time_per_output_token_ms": NUMBER + (type(None),),
    }
    assert set(types) == set(bench_runner.RESULT_KEYS)
    for key, kind in types.items():
        if key not in doc:
            problems.append(f"missing {key}")
        elif isinstance(doc[key], bool) or not isinstance(doc[key], kind):
            problems.append(f"{key} is {type(doc[key]).__name__}")
    # every median has its interquartile range: [25th, 75th percentile] (None only with the median)
    assert {"iqr_" + k[len("median_") :] for k in types if k.startswith("median_")} == set(bench_runner.IQR_KEYS)
    for key in bench_runner.IQR_KEYS:
        value, median = doc.get(key, "missing"), doc.get("median_" + key[len("iqr_") :])
        if value is None and median is None:
            continue
        if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, NUMBER) for v in value)):
            problems.append(f"{key} is not [q1, q3]")
    versions = doc.get("versions") if isinstance(doc.get("versions"), dict) else {}
    for key in bench_runner.VERSION_KEYS:
        if not isinstance(versions.get(key), str):
            problems.append(f"versions.{key} missing")
    samples = doc.get("samples") if isinstance(doc.get("samples"), list) else []
    for i, sample in enumerate(samples):
        for key, kind in (("elapsed_s", float), ("new_tokens", int), ("tokens_per_s", float)):
            if not isinstance(sample.get(key), kind) or isinstance(sample.get(key), bool):
                problems.append(f"samples[{i}].{key} is {type(sample.get(key)).__name__}")
    if len(samples) != doc.get("runs"):
        problems.append("one sample per measured run expected")
    return problems


def _quartiles(values):
    """[25th, 75th percentile] by numpy (linear interpolation), independent of the bench's own percentile."""
    return [float(v) for v in numpy.percentile(numpy.asarray(values, dtype=float), [25, 75])]
