"""otel_generate.clock: a model's devices read as ``model.device`` and ``hf_device_map`` give them."""

from __future__ import annotations

import pytest
import torch

from otel_generate import clock
from otel_generate.bench.models import build_model


@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
def test_the_device_is_the_models_own(architecture):
    model = build_model(architecture, seed=0)
    assert clock.model_device(model) == model.device == torch.device("cpu")
    assert list(clock.devices_of(model)) == [torch.device("cpu")]
    model.to("meta")
    assert clock.model_device(model) == model.device == torch.device("meta")


def test_a_model_of_another_kind_reads_the_attribute():
    class NoParameters:
        device = "xpu:3"

    assert clock.model_device(NoParameters()) == "xpu:3"
    assert clock.model_device(object()) is None


def test_hf_device_map_gives_every_device_it_names_but_disk():
    model = build_model("gpt2", seed=0)
    model.hf_device_map = {"transformer": 0, "lm_head": "cpu", "x": "disk"}
    assert list(clock.devices_of(model)) == [0, "cpu", torch.device("cpu")]

    class WithItsOwn(torch.nn.Linear):
        hf_device_map = {"": "meta"}

    assert list(clock.devices_of(WithItsOwn(1, 1, device="meta"))) == ["meta"]  # (a Linear has no .device)


def test_device_names_are_str_of_each_device_even_for_equal_keys():
    for device in (1, True, 1.0, 0, False, "cpu", torch.device("cpu"), torch.device("meta")):
        assert clock.device_name(device) == str(device)
