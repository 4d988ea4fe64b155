"""The patch table (``otel_generate.instrumentor.PATCHES``) installed on stand-in modules: no transformers, no model.

A module's post-import hook installs exactly its rows that the module defines, with the row's factory, and
``Patches.restore_all()`` (``uninstrument()``) puts back every original object. The real transformers classes are
covered in tests/integration/test_generate_loop.py.
"""

from __future__ import annotations

import importlib.metadata
import logging
import types

from otel_generate import content
from otel_generate._patch import Patches
from otel_generate.instrumentor import (
    CONTINUOUS,
    PATCHES,
    PIPELINES,
    SERVE,
    SERVER,
    _install_module,
    _wanted,
)


def _telemetry(capture=None):
    mode = content.ContentMode.SPAN_ONLY if capture else content.ContentMode.NO_CONTENT
    options = content.ContentOptions(mode=mode) if capture else None
    return types.SimpleNamespace(active=True, content=options, emitter=None)


def _module(name, **attributes):
    module = types.ModuleType(name)
    vars(module).update(attributes)
    return module


def _rows(module):
    return tuple(row for row in PATCHES if row.module == module)


def _class(name, **methods):
    """A stand-in class defining ``methods`` (``None``: a method that does nothing)."""

    def stub(self, *args, **kwargs):
        return None

    return type(name, (), {key: value or stub for key, value in methods.items()})


def test_a_modules_rows_are_installed_with_their_factories_and_restored():
    def submit(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)

    def build_server(*args, **kwargs):
        return "app"

    thread = _class("InferenceThread", submit=submit)  # no async_submit: that row is skipped
    serving = _module(SERVE, InferenceThread=thread)
    server = _module(SERVER, build_server=build_server)
    telemetry, patches = _telemetry(), Patches()

    _install_module(patches, telemetry, SERVE, _rows(SERVE), serving)
    _install_module(patches, telemetry, SERVER, _rows(SERVER), server)

    assert set(patches.installed()) == {(thread, "submit"), (server, "build_server")}
    assert vars(thread)["submit"] is not submit and vars(thread)["submit"].__wrapped__ is submit
    assert server.build_server is not build_server and server.build_server.__wrapped__ is build_server
    assert "async_submit" not in vars(thread)
    assert thread().submit(lambda x: x + 1, 41) == 42  # the replacement calls through
    patches.restore_all()
    assert vars(thread)["submit"] is submit and server.build_server is build_server
    assert patches.installed() == ()


def test_continuous_batching_is_every_hook_point_or_none(caplog):
    def add_request(self, input_ids, request_id=None, max_new_tokens=None, streaming=False, eos_token_id=None):
        return request_id

    def cancel_request(self, request_id):
        return None

    # no _generation_loop_body
    manager = _class("ContinuousBatchingManager", add_request=add_request, cancel_request=cancel_request)
    manager_before = dict(vars(manager))
    module = _module(CONTINUOUS, ContinuousBatchingManager=manager, OutputRouter=_class("OutputRouter"))
    telemetry, patches = _telemetry(), Patches()
    with caplog.at_level(logging.INFO, logger="otel_generate"):
        _install_module(patches, telemetry, CONTINUOUS, _rows(CONTINUOUS), module)
    assert patches.installed() == () and dict(vars(manager)) == manager_before
    assert telemetry.emitter is None  # no background emitter started for it either
    # one WARNING per point it lacks, naming the version and the feature; no traceback
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage().rpartition(": ")[2] for r in warnings] == [
        "`ContinuousBatchingManager._generation_loop_body` not found",
        "`OutputRouter.deliver` not found",
        "`OutputRouter.deliver_batch` not found",
    ]
    version = importlib.metadata.version("transformers")
    for record in warnings:
        assert record.getMessage().startswith(
            f"otel_generate: transformers {version}: continuous batching requests will not be traced: "
        )
        assert record.exc_info is None


def test_rows_with_a_condition_follow_the_options():
    pipeline_rows = _rows(PIPELINES)
    assert [row.when for row in pipeline_rows] == ["content"]
    assert not _wanted(pipeline_rows[0], _telemetry(capture=False))
    assert _wanted(pipeline_rows[0], _telemetry(capture=True))
    (logprobs,) = [row for row in PATCHES if row.when == "logprobs"]
    assert not _wanted(logprobs, _telemetry(capture=True))  # messages on, step log-probabilities off


def test_an_uninstrumented_telemetry_installs_nothing():
    def forward(self):
        return "out"

    pipeline = _class("Pipeline", forward=forward)
    telemetry, patches = _telemetry(capture=True), Patches()
    telemetry.active = False  # uninstrument() ran before the module was imported
    _install_module(patches, telemetry, PIPELINES, _rows(PIPELINES), _module(PIPELINES, Pipeline=pipeline))
    assert patches.installed() == () and vars(pipeline)["forward"] is forward


def test_the_table_fits_one_screen():
    assert len(PATCHES) <= 40
    assert all(row.when in ("always", "content", "logprobs", "emitter") for row in PATCHES)
