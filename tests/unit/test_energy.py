"""What NVML's energy readings can honestly say (otel_generate.energy), and the figures derived from
them (derive), with no NVML and no model: hand-built readings in, exact joules out."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from otel_generate import clock, energy
from otel_generate.derive import derive
from otel_generate.request import Request


def test_request_energy_is_the_difference_when_the_counter_advanced():
    assert energy.request_energy_mj(1_000, 4_500) == 3_500
    assert energy.request_energy_mj(1_000, 1_000) is None  # shorter than the counter's update period
    assert energy.request_energy_mj(None, 4_500) is None and energy.request_energy_mj(1_000, None) is None
    assert energy.request_energy_mj(5_000, 1_000) is None  # a counter that went back: not attributed


def test_step_energies_only_when_the_counter_advanced_within_every_step():
    assert energy.step_energies_mj(100, [150, 230, 231]) == [50, 80, 1]
    assert energy.step_energies_mj(100, [150, 150, 231]) is None  # a step saw no update: coarser than a step
    assert energy.step_energies_mj(100, [150, None]) is None  # a reading failed
    assert energy.step_energies_mj(None, [150]) is None and energy.step_energies_mj(100, []) is None


@given(
    used=st.integers(min_value=1, max_value=10**9),
    computed=st.lists(st.integers(min_value=0, max_value=4096), min_size=1, max_size=64).filter(any),
)
def test_shares_are_proportional_to_tokens_computed_and_add_up_to_the_step(used, computed):
    shares = energy.shares_mj(used, computed)
    assert sum(shares) == pytest.approx(used, rel=1e-9)
    for share, tokens in zip(shares, computed):
        assert share == used * tokens / sum(computed)


def test_shares_need_every_count():
    assert energy.shares_mj(100, [1, None]) is None
    assert energy.shares_mj(100, [0, 0]) is None
    assert energy.shares_mj(None, [1, 2]) is None


def test_no_cuda_device_never_touches_nvml(monkeypatch):
    def no_library():
        raise AssertionError("NVML touched for a CPU model")

    monkeypatch.setattr(energy, "_library", no_library)
    assert energy.meter_for(["cpu"]) is None and energy.meter_for("meta") is None


def test_derived_energy_in_joules_per_token_and_per_step():
    request = Request(model="m", start_ns=0, start_wall_ns=0, end_ns=30, output_tokens=4)
    request.step_ends_ns, request.step_tokens = [10, 20, 30], [1, 1, 1]
    request.energy_mj, request.step_energy_mj = 1_500, [700, 500, 300]
    summary = derive(request, steps=True)
    assert summary.energy_j == 1.5 and summary.energy_per_output_token_j == 1.5 / 4
    assert summary.step_energies_j == [0.7, 0.5, 0.3]
    assert derive(request).step_energies_j is None  # per-step figures only when steps are derived
    request.output_tokens = 0
    assert derive(request).energy_per_output_token_j is None
    request.energy_mj = None
    assert derive(request).energy_j is None


def test_energy_split_into_prefill_and_decode_and_per_total_token():
    request = Request(model="m", start_ns=0, start_wall_ns=0, end_ns=40, input_tokens=6, output_tokens=4)
    request.step_ends_ns, request.step_tokens = [10, 20, 30, 40], [1, 1, 1, 1]
    request.energy_mj, request.step_energy_mj = 2_000, [800, 400, 300, 200]
    summary = derive(request, steps=True)
    assert summary.energy_per_total_token_j == 2.0 / (6 + 4)
    assert (summary.energy_prefill_j, summary.energy_decode_j) == (0.8, 0.4 + 0.3 + 0.2)
    request.prefill_steps = 2  # a prompt prefilled in two chunks: two prefill steps
    summary = derive(request, steps=True)
    assert (summary.energy_prefill_j, summary.energy_decode_j) == (0.8 + 0.4, 0.3 + 0.2)
    request.prefill_steps = 1
    request.step_ends_ns, request.step_tokens, request.step_energy_mj = [10], [1], [800]
    summary = derive(request, steps=True)  # one step, the prefill: no decode step, no decode energy
    assert (summary.energy_prefill_j, summary.energy_decode_j) == (0.8, None)
    request.step_energy_mj = None  # a step whose energy is unknown: no split, the total stays
    summary = derive(request, steps=True)
    assert (summary.energy_prefill_j, summary.energy_decode_j, summary.energy_j) == (None, None, 2.0)
    request.input_tokens = None
    assert derive(request).energy_per_total_token_j is None


def test_device_events_for_says_why_there_are_none():
    assert clock.device_events_for(["cpu"])[:2] == (None, clock.NO_EVENTS_CPU)
    assert clock.device_events_for(["mps"])[:2] == (None, clock.NO_EVENTS_NOT_ONE_CUDA_DEVICE)
    assert clock.device_events_for(["cuda:0", "cuda:1"])[:2] == (None, clock.NO_EVENTS_NOT_ONE_CUDA_DEVICE)


def test_elapsed_ns_rounds_milliseconds_to_nanoseconds():
    class Event:
        def __init__(self, ms):
            self.ms = ms

        def elapsed_time(self, end):
            return end.ms - self.ms

    assert clock.elapsed_ns(Event(0.0), Event(1.2346)) == 1_234_600
    assert clock.elapsed_ns(Event(0.0), Event(0.0004999)) == 500  # (CUDA resolves about half a microsecond)
