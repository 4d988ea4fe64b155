"""Inter-token latencies derived from a hand-built ``Request``, no model: per step and per inner call."""

from __future__ import annotations

from otel_generate.derive import inter_token_latencies_ns
from otel_generate.request import InnerCall, Request


def test_inter_token_latency_divides_a_step_by_its_tokens():
    """A step that produced 3 tokens per sequence (assisted decoding) is one gap of a third of its
    latency; a prompt step of a later inner call and a step with no token give none."""
    request = Request(model="m", start_ns=0, start_wall_ns=0)
    request.step_ends_ns = [10, 16, 25, 40, 44, 50]
    request.step_tokens = [1, 1, 3, 1, 0, 2]
    request.calls = [InnerCall(start_ns=0, first_step=0, steps=3), InnerCall(start_ns=25, first_step=3, steps=3)]
    assert list(inter_token_latencies_ns(request)) == [6, 3, 3]
