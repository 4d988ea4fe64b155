"""Producer: ``generate()`` methods other than ``GenerationMixin.generate``.

About 55 transformers model classes define their own ``generate()`` (Whisper, Blip-2, Bark,
MusicGen, SeamlessM4T, ...), and ``custom_generate`` runs a function from a directory or a Hub
repository. Whatever the user called is the request; the ``GenerationMixin.generate`` calls it
makes become inner loops of that one request (:mod:`.generate_loop`).

* Every ``GenerationMixin`` subclass that defines ``generate`` in its own ``__dict__`` gets it
  replaced: the ones that exist when ``instrument()`` runs (a walk of ``__subclasses__()``) and
  the ones created later (lazily imported model modules, ``trust_remote_code`` classes, your own
  subclasses), through a ``GenerationMixin.__init_subclass__`` that this package adds.
* ``GenerationMixin.load_custom_generate`` (transformers 5.x) returns the loaded function
  wrapped the same way, which covers checkpoints that ship ``custom_generate/`` (``from_pretrained``
  then sets ``model.generate`` on the instance, past every class-level hook).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from otel_generate.integrations._routing import compiler_disabled, current_call
from otel_generate.integrations.generate_loop import run_request
from otel_generate.telemetry import Telemetry


def make_outer_generate(original: Callable, telemetry: Telemetry) -> Callable:
    """A model class's own ``generate``: the request, unless it runs inside one of the same model
    (``super().generate()`` chains, a submodule's ``generate()``)."""

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        if not telemetry.active or current_call(self) is not None:
            return original(self, *args, **kwargs)
        return run_request(telemetry, original, self, args, kwargs, loop=False)

    return compiler_disabled(generate)


def make_load_custom_generate(original: Callable, telemetry: Telemetry) -> Callable:
    """``GenerationMixin.load_custom_generate``: the loaded ``generate(model, *args, **kwargs)`` is a request."""

    @functools.wraps(original)
    def load_custom_generate(self, pretrained_model_name_or_path=None, *args, **kwargs):
        function = original(self, pretrained_model_name_or_path, *args, **kwargs)
        if not telemetry.active:
            return function
        return _custom_generate_entry(function, telemetry, pretrained_model_name_or_path)

    return load_custom_generate


def _custom_generate_entry(function: Callable, telemetry: Telemetry, source: Any) -> Callable:
    @functools.wraps(function)
    def custom_generate(*args, **kwargs):
        model = kwargs.get("model", args[0] if args else None)
        if model is None or not telemetry.active or current_call(model) is not None:
            return function(*args, **kwargs)  # called by generate(custom_generate=...): already a request
        call_args = args
        rest = args[1:] if "model" not in kwargs else args
        return run_request(
            telemetry, function, model, rest, kwargs, loop=False, custom_generate=source, call_args=call_args
        )

    return compiler_disabled(custom_generate)
