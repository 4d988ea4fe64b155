"""The set-up hooks read a call's arguments by name as ``Signature.bind`` would, without binding
plain-parameter calls (``otel_generate.integrations.generate_loop._arguments_reader``)."""

from __future__ import annotations

import inspect

import pytest

from otel_generate.integrations.generate_loop import _arguments_reader


def plain(self, generation_config, model_kwargs, generation_mode=None, *, batch_size=1):
    pass


def variadic(self, generation_config, *rest, **extra):
    pass


def positional_only(self, generation_config, /, model_kwargs=None):
    pass


@pytest.mark.parametrize(
    "function, args, kwargs",
    [
        (plain, ("config", {"k": 1}, "sample"), {"batch_size": 2}),  # transformers' positional call
        (plain, (), {"generation_config": "config", "model_kwargs": {}}),  # generate()'s keyword call
        (plain, ("config",), {"model_kwargs": {}}),
        (variadic, ("config", 1, 2), {"z": 3}),
        (positional_only, ("config",), {"model_kwargs": {}}),
    ],
)
def test_the_arguments_by_name_are_those_bind_gives(function, args, kwargs):
    signature = inspect.signature(function)
    signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    expected = dict(signature.bind(*args, **kwargs).arguments)
    assert dict(_arguments_reader(function)(args, kwargs)) == expected
