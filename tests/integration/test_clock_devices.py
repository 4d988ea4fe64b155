"""otel_generate.clock: a model's devices read as ``model.device`` and ``hf_device_map`` give them."""

from __future__ import annotations

import pytest
import torch
import transformers

from otel_generate import clock
from otel_generate.bench.models import build_model

_TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])


@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
def test_the_device_is_the_models_own_and_found_by_the_walk(architecture):
    model = build_model(architecture, seed=0)
    if _TRANSFORMERS_MAJOR >= 5:  # its device is the first parameter's: the walk is taken, not the attribute
        assert clock._reads_first_parameter(type(model))
    assert clock._first_parameter(model) is next(model.parameters())
    assert clock.model_device(model) == model.device == torch.device("cpu")
    model.to("meta")
    assert clock.model_device(model) == model.device == torch.device("meta")


def test_the_first_parameter_is_the_first_one_in_parameters_order_whatever_the_tree():
    class Tree(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.empty = torch.nn.Sequential(torch.nn.Identity(), torch.nn.ReLU())
            self.shared = torch.nn.Linear(2, 2)
            self.inner = torch.nn.Sequential(torch.nn.Identity(), self.shared)  # the same module twice
            self.register_parameter("none_first", None)
            self.late = torch.nn.Parameter(torch.zeros(1, device="meta"))

    tree = Tree()
    assert clock._first_parameter(tree) is next(tree.parameters())  # the module's own parameter first
    del tree.late
    assert clock._first_parameter(tree) is next(tree.parameters()) is tree.shared.weight
    tree.shared.weight = None  # a None parameter is skipped, as parameters() does
    assert clock._first_parameter(tree) is next(tree.parameters()) is tree.shared.bias


def test_a_module_that_orders_its_modules_otherwise_is_not_walked():
    class Reordered(torch.nn.Sequential):
        def named_modules(self, *args, **kwargs):
            return reversed(list(super().named_modules(*args, **kwargs)))

    outer = torch.nn.Sequential(Reordered(torch.nn.Linear(1, 1), torch.nn.Linear(2, 2, device="meta")))
    assert clock._first_parameter(outer) is None  # cannot be told without calling it


def test_a_model_without_parameters_or_of_another_kind_reads_the_attribute():
    class NoParameters:
        device = "xpu:3"

    assert clock.model_device(NoParameters()) == "xpu:3"
    assert clock.model_device(object()) is None
    model = build_model("gpt2", seed=0)
    for module in model.modules():
        for name in list(module._parameters):
            module._parameters[name] = None
    assert clock._first_parameter(model) is None
    try:  # transformers' own property, read as is (what it does without parameters depends on its version)
        expected, raised = model.device, None
    except Exception as error:
        expected, raised = None, type(error)
    if raised is not None:
        with pytest.raises(raised):
            clock.model_device(model)
    else:
        assert clock.model_device(model) == expected


def test_hf_device_map_is_read_as_getattr_reads_it():
    model = build_model("gpt2", seed=0)
    assert clock._instance_attribute(model, "hf_device_map") is getattr(model, "hf_device_map", None) is None
    model.hf_device_map = {"transformer": 0, "lm_head": "cpu", "x": "disk"}
    assert clock._instance_attribute(model, "hf_device_map") is model.hf_device_map
    assert list(clock.devices_of(model)) == [0, "cpu", torch.device("cpu")]
    model.register_buffer("buffered", torch.ones(1))
    assert clock._instance_attribute(model, "buffered") is model.buffered
    assert clock._instance_attribute(model, "transformer") is model.transformer
    assert clock._instance_attribute(model, "config") is model.config  # a property of the class: getattr

    class WithItsOwn(torch.nn.Linear):
        hf_device_map = {"": "meta"}

    assert clock._instance_attribute(WithItsOwn(1, 1), "hf_device_map") == {"": "meta"}


def test_device_names_are_str_of_each_device_even_for_equal_keys():
    for device in (1, True, 1.0, 0, False, "cpu", torch.device("cpu"), torch.device("meta")):
        assert clock.device_name(device) == str(device)
