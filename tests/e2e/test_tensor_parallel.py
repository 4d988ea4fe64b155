"""Tensor-parallel and data-parallel ranks: one user call is one request across a
tensor-parallel group; each data-parallel rank's calls are its own; every span says its rank.

The multi-process cases run ``torchrun --standalone --nproc-per-node 2 tests/helpers/tp_worker.py`` on CPU
(gloo) with a tiny Llama saved by ``save_pretrained``; each rank writes what its own in-memory span
exporter and metric reader hold, and the test sums over the ranks. The in-process cases give a
tiny model a one-dimensional tensor-parallel mesh stand-in, to check the rules without processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import transformers

from otel_generate import attributes as A
from otel_generate import ranks
from otel_generate.bench.models import build_model
from otel_generate.options import ENV_TENSOR_PARALLEL_SPANS
from tests.helpers import prompt, request_spans

WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers", "tp_worker.py")
NEW_TOKENS = 6
HISTOGRAMS = (A.METRIC_REQUEST_DURATION, A.METRIC_CLIENT_OPERATION_DURATION)
needs_tp_plan = pytest.mark.skipif(
    not hasattr(transformers.PreTrainedModel, "_tp_plan"),
    reason="this transformers has no tensor parallelism (tp_plan arrived after 4.46); checked with 5.24",
)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    build_model("llama", seed=0).save_pretrained(str(directory))
    return str(directory)


def run_ranks(tmp_path, model_dir, *flags, env=None):
    """Run the worker on 2 ranks; return their results, ordered by rank."""
    out = tmp_path / "ranks"
    out.mkdir()
    environment = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    environment.update(OMP_NUM_THREADS="1", **(env or {}))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*command, WORKER, str(out), model_dir, *flags],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["rank"] for r in results] == [0, 1] and all(r["world_size"] == 2 for r in results)
    return results


def requests_of(result):
    return [s for s in result["spans"] if s["name"].startswith(A.OPERATION_TEXT_COMPLETION + " ")]


def histogram_counts(results, name):
    return sum(r["metrics"].get(name, 0) for r in results)


@needs_tp_plan
def test_one_call_across_a_tensor_parallel_group_is_one_request(tmp_path, llama_dir):
    results = run_ranks(tmp_path, llama_dir, "--tp")
    # both ranks ran the same call to the same result
    assert results[0]["sequences"] == results[1]["sequences"]
    assert all(r["new_tokens"] == NEW_TOKENS for r in results)
    spans = [span for result in results for span in requests_of(result)]
    assert len(spans) == 1 and requests_of(results[0]) == spans  # rank 0 speaks for the group
    attrs = spans[0]["attributes"]
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == results[0]["new_tokens"] == NEW_TOKENS
    assert attrs[A.GEN_AI_USAGE_INPUT_TOKENS] == results[0]["prompt_tokens"]
    assert attrs[A.GENERATE_TENSOR_PARALLEL_RANK] == 0
    assert attrs[A.GENERATE_TENSOR_PARALLEL_SIZE] == 2
    assert attrs[A.GENERATE_TENSOR_PARALLEL_CALL_INDEX] == 0
    assert attrs[A.GENERATE_DISTRIBUTED_RANK] == 0
    assert attrs[A.GENERATE_DISTRIBUTED_WORLD_SIZE] == 2
    # rank 1 made no span at all (no step spans either) and recorded nothing
    assert results[1]["spans"] == [] and results[1]["metrics"] == {}
    for name in HISTOGRAMS + (A.METRIC_TIME_TO_FIRST_TOKEN, A.METRIC_TIME_PER_OUTPUT_TOKEN):
        assert histogram_counts(results, name) == 1, name


def test_data_parallel_ranks_are_requests_of_their_own(tmp_path, llama_dir):
    results = run_ranks(tmp_path, llama_dir, "--own-prompt")
    for rank, result in enumerate(results):
        (span,) = requests_of(result)
        attrs = span["attributes"]
        assert attrs[A.GENERATE_DISTRIBUTED_RANK] == rank
        assert attrs[A.GENERATE_DISTRIBUTED_WORLD_SIZE] == 2
        assert A.GENERATE_TENSOR_PARALLEL_RANK not in attrs and A.GENERATE_TENSOR_PARALLEL_SIZE not in attrs
        assert attrs[A.GEN_AI_USAGE_INPUT_TOKENS] == result["prompt_tokens"] == 3 + rank
        assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == result["new_tokens"] == NEW_TOKENS
    for name in HISTOGRAMS:
        assert histogram_counts(results, name) == 2, name


@needs_tp_plan
def test_all_ranks_mode_gives_one_span_per_rank_and_one_request_in_the_metrics(tmp_path, llama_dir):
    results = run_ranks(tmp_path, llama_dir, "--tp", env={ENV_TENSOR_PARALLEL_SPANS: "all"})
    spans = [requests_of(result) for result in results]
    assert [len(s) for s in spans] == [1, 1]
    for rank, (span,) in enumerate(spans):
        attrs = span["attributes"]
        assert attrs[A.GENERATE_TENSOR_PARALLEL_RANK] == rank == attrs[A.GENERATE_DISTRIBUTED_RANK]
        assert attrs[A.GENERATE_TENSOR_PARALLEL_SIZE] == 2
        assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == NEW_TOKENS
        # every rank times its own steps: its step spans are its request span's children
        steps = [s for s in results[rank]["spans"] if s["parent_id"] == span["span_id"]]
        assert len(steps) == attrs[A.GENERATE_STEPS] == NEW_TOKENS
    # what ties the two spans of one call together
    assert spans[0][0]["attributes"][A.GENERATE_TENSOR_PARALLEL_CALL_INDEX] == 0
    assert spans[1][0]["attributes"][A.GENERATE_TENSOR_PARALLEL_CALL_INDEX] == 0
    for name in HISTOGRAMS:  # the metrics still count the call once: rank 0 records it
        assert histogram_counts(results, name) == 1, name
    assert results[1]["metrics"] == {}


# --- in process: the rules, with a stand-in mesh --------------------------------------------------


class _Mesh:
    """The part of ``torch.distributed.DeviceMesh`` that :mod:`otel_generate.ranks` reads."""

    ndim = 1
    mesh_dim_names = ("tp",)

    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def size(self):
        return self._size

    def get_local_rank(self):
        return self._rank


def _sharded(rank, size=2):
    model = build_model("gpt2", seed=0)
    model._device_mesh = _Mesh(rank, size)
    return model


def test_a_rank_other_than_0_runs_uninstrumented_by_default(instrumented, span_exporter, metric_reader):
    model = _sharded(1)
    ids, mask = prompt()
    for _ in range(2):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert span_exporter.get_finished_spans() == ()
    assert metric_reader.get_metrics_data() is None or not [
        m for r in metric_reader.get_metrics_data().resource_metrics for s in r.scope_metrics for m in s.metrics
    ]
    # rank 0 of the same group emits, and counts the calls its group made since instrument()
    model0 = _sharded(0)
    for index in range(2):
        out = model0.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        span = request_spans(span_exporter)[-1]
        assert span.attributes[A.GENERATE_TENSOR_PARALLEL_CALL_INDEX] == index
        assert span.attributes[A.GENERATE_TENSOR_PARALLEL_RANK] == 0
        assert span.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == out.shape[-1] - ids.shape[-1]
    assert A.GENERATE_DISTRIBUTED_RANK not in span.attributes  # torch.distributed is not initialized here


def test_all_ranks_mode_records_no_metrics_on_other_ranks(instrument, tracer_provider, span_exporter, metric_reader):
    from opentelemetry.sdk.metrics import MeterProvider

    instrument(
        tracer_provider=tracer_provider,
        meter_provider=MeterProvider(metric_readers=[metric_reader]),
        tensor_parallel_spans="all",
    )
    ids, mask = prompt()
    out = _sharded(1).generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    (span,) = request_spans(span_exporter)
    assert span.attributes[A.GENERATE_TENSOR_PARALLEL_RANK] == 1
    assert span.attributes[A.GENERATE_TENSOR_PARALLEL_SIZE] == 2
    assert span.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == out.shape[-1] - ids.shape[-1]
    data = metric_reader.get_metrics_data()
    counts = [
        point.count
        for r in (data.resource_metrics if data is not None else ())
        for s in r.scope_metrics
        for m in s.metrics
        for point in m.data.data_points
    ]
    assert sum(counts) == 0


def test_placement_outside_a_distributed_run_is_none(gpt2):
    assert ranks.placement(gpt2, "rank0") is None
    assert ranks.tensor_parallel_group(gpt2) is None
    model = build_model("gpt2", seed=0)
    model._device_mesh = _Mesh(0, 1)  # a group of one is no tensor parallelism
    assert ranks.placement(model, "rank0") is None


def test_a_silent_rank_makes_no_request_of_the_generate_calls_inside_its_call(instrumented, span_exporter):
    """A model's own generate() that calls a submodule's (as Blip-2 calls its language model's): on a
    rank other than 0 the inner call is part of the silent call, not a request of its own, and the
    call is counted once."""
    from transformers import GPT2LMHeadModel

    class Wrapping(GPT2LMHeadModel):  # instrumented when defined (docs/contract.md, "Which calls")
        def generate(self, *args, **kwargs):
            return self.inner.generate(*args, **kwargs)

    ids, mask = prompt()
    for rank in (1, 0):
        config = build_model("gpt2", seed=0).config
        model = Wrapping(config).eval()
        model.inner = build_model("gpt2", seed=0)  # a submodule with no mesh of its own
        model._device_mesh = _Mesh(rank, 2)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        spans = request_spans(span_exporter)
        assert len(spans) == (1 if rank == 0 else 0), [s.name for s in spans]
        assert next(ranks._MODELS[model].calls) == 1  # this call was counted once
    (span,) = request_spans(span_exporter)
    assert span.name == "text_completion Wrapping"
    assert span.attributes[A.GENERATE_TENSOR_PARALLEL_RANK] == 0
    assert span.attributes[A.GENERATE_TENSOR_PARALLEL_CALL_INDEX] == 0
    assert span.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == out.shape[-1] - ids.shape[-1]
