"""Nothing is imported before it is used: instrument() registers post-import hooks; transformers and
torch are imported only by the application, and each patch is installed when its module is imported.

Each case runs in a fresh interpreter (this test process has imported transformers already).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

from tests.helpers import console_spans

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run_python(code: str, timeout: float = 300) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
        cwd=str(ROOT),
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _last_json(stdout: str):
    return json.loads(stdout.strip().splitlines()[-1])


def test_opentelemetry_instrument_imports_neither_transformers_nor_torch():
    instrument = pathlib.Path(sys.executable).with_name("opentelemetry-instrument")
    done = subprocess.run(
        [
            str(instrument),
            "--traces_exporter",
            "console",
            "--metrics_exporter",
            "none",
            "--logs_exporter",
            "none",
            sys.executable,
            "-c",
            "import sys; print('transformers' in sys.modules, 'torch' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        cwd=str(ROOT),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False False"
    # and the instrumentor was loaded and instrumented (not skipped): its hook is registered
    probe = subprocess.run(
        [
            str(instrument),
            "--traces_exporter",
            "none",
            "--metrics_exporter",
            "none",
            "--logs_exporter",
            "none",
            sys.executable,
            "-c",
            "import sys; from otel_generate import GenerateInstrumentor as G; i = G(); "
            "print(i.is_instrumented_by_opentelemetry, i._patches.pending_imports(), "
            "'transformers' in sys.modules, 'torch' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        cwd=str(ROOT),
    )
    assert probe.returncode == 0, probe.stderr
    line = probe.stdout.strip().splitlines()[-1]
    assert line.startswith("True (") and "'transformers.generation.utils'" in line and line.endswith("False False")


def test_import_and_instrument_import_neither_transformers_nor_torch():
    out = _run_python(
        """
        import json, sys
        import otel_generate, otel_generate.package, otel_generate._versions
        from otel_generate import GenerateInstrumentor, TokenLatencyProfiler
        before = ["transformers" in sys.modules, "torch" in sys.modules]
        GenerateInstrumentor().instrument(max_step_spans=0, background_emission=True)
        after = ["transformers" in sys.modules, "torch" in sys.modules]
        GenerateInstrumentor().uninstrument()
        integrations = sorted(name for name in sys.modules if name.startswith("otel_generate.integrations."))
        print(json.dumps([before, after, "transformers" in sys.modules, "torch" in sys.modules, integrations]))
        """
    )
    # uninstrument() has nothing to end in a producer whose module was never imported
    assert _last_json(out) == [[False, False], [False, False], False, False, []]


_GENERATE = """
import inspect, json, pathlib, sys
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

def generate_once():
    import torch
    from otel_generate.bench.models import build_model
    model = build_model("gpt2", seed=0)
    ids = torch.tensor([[5, 6, 7, 8]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, eos_token_id=None,
                         pad_token_id=0, do_sample=False)
    return int(out.shape[-1] - ids.shape[-1])

def ours(function):
    # whether a function in the chain of __wrapped__ is this package's (by its code's file, inside the
    # package's own folder: functools.wraps copies __module__ from the original, and a clone named
    # otel_generate may hold the venv that transformers is installed in)
    import otel_generate
    package = pathlib.Path(otel_generate.__file__).resolve().parent
    seen = function
    for _ in range(16):
        code = getattr(seen, "__code__", None)
        if code is not None and pathlib.Path(code.co_filename).resolve().is_relative_to(package):
            return True
        seen = getattr(seen, "__wrapped__", None)
        if seen is None:
            return False
    return False
"""


def test_instrument_before_import_patches_on_first_import():
    out = _run_python(
        _GENERATE
        + """
from otel_generate import GenerateInstrumentor
exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
GenerateInstrumentor().instrument(tracer_provider=provider)
imported_early = "transformers" in sys.modules or "torch" in sys.modules
new = generate_once()
provider.force_flush()  # the spans are built on the background emitter
spans = exporter.get_finished_spans()
names = sorted(s.name for s in spans)
from transformers.generation.utils import GenerationMixin
patched = ours(GenerationMixin.__dict__["generate"])
GenerateInstrumentor().uninstrument()
print(json.dumps([imported_early, new, names, patched, ours(GenerationMixin.__dict__["generate"])]))
"""
    )
    imported_early, new, names, patched, after = _last_json(out)
    assert imported_early is False
    assert new == 5
    assert names == sorted(["text_completion GPT2LMHeadModel", "prefill"] + ["decode"] * 4)
    assert patched is True and after is False


def test_uninstrument_before_import_cancels_the_hooks_and_instrument_again_works():
    out = _run_python(
        _GENERATE
        + """
from otel_generate import GenerateInstrumentor
exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
instrumentor = GenerateInstrumentor()
instrumentor.instrument(tracer_provider=provider)
instrumentor.uninstrument()
import transformers
from transformers.generation.utils import GenerationMixin
own = GenerationMixin.__dict__["generate"]
untouched = {name: ours(GenerationMixin.__dict__[name]) for name in
             ("generate", "_prepare_generated_length", "_get_stopping_criteria")}
inner = pathlib.PurePath(inspect.unwrap(own).__code__.co_filename).as_posix()
subclass_hook = "__init_subclass__" in GenerationMixin.__dict__
first = generate_once()
spans_uninstrumented = len(exporter.get_finished_spans())
# a later instrument() works: transformers is imported now, so it patches at once
instrumentor.instrument(tracer_provider=provider)
second = generate_once()
provider.force_flush()
spans_instrumented = sorted(s.name for s in exporter.get_finished_spans())
instrumentor.uninstrument()
print(json.dumps([untouched, inner, subclass_hook, first, spans_uninstrumented, second, spans_instrumented,
                  GenerationMixin.__dict__["generate"] is own]))
"""
    )
    untouched, inner, subclass_hook, first, spans_uninstrumented, second, spans_instrumented, restored = _last_json(out)
    assert untouched == {"generate": False, "_prepare_generated_length": False, "_get_stopping_criteria": False}
    assert inner.endswith("transformers/generation/utils.py")
    assert subclass_hook is False
    assert first == 5 and spans_uninstrumented == 0
    assert second == 5
    assert spans_instrumented == sorted(["text_completion GPT2LMHeadModel", "prefill"] + ["decode"] * 4)
    assert restored is True


def test_opentelemetry_instrument_script_importing_transformers_later_gets_its_spans():
    instrument = pathlib.Path(sys.executable).with_name("opentelemetry-instrument")
    script = _GENERATE + "\nprint('generated', generate_once())\n"
    done = subprocess.run(
        [
            str(instrument),
            "--traces_exporter",
            "console",
            "--metrics_exporter",
            "none",
            "--logs_exporter",
            "none",
            sys.executable,
            "-c",
            "import sys; print('early', 'transformers' in sys.modules, 'torch' in sys.modules)\n" + script,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
        cwd=str(ROOT),
    )
    assert done.returncode == 0, done.stderr
    assert "early False False" in done.stdout
    assert "generated 5" in done.stdout

    names = sorted(s["name"] for s in console_spans(done.stdout))
    assert names == sorted(["text_completion GPT2LMHeadModel", "prefill"] + ["decode"] * 4)


def test_importing_the_record_loads_no_integration_nor_transformers():
    out = _run_python(
        """
import json, sys
import otel_generate.request
loaded = sorted(m for m in sys.modules if m.startswith("otel_generate"))
plain = "transformers" in sys.modules or "torch" in sys.modules
from otel_generate import GenerateInstrumentor  # the public names still load on first use
print(json.dumps([loaded, plain, GenerateInstrumentor.__module__,
                  sorted(m for m in sys.modules if m.startswith("otel_generate.integrations"))]))
"""
    )
    loaded, plain, where, integrations = _last_json(out)
    assert "otel_generate.request" in loaded
    assert [m for m in loaded if m.startswith(("otel_generate.integrations", "otel_generate.instrumentor"))] == []
    assert plain is False
    assert where == "otel_generate.instrumentor"
    assert integrations == []  # the instrumentor imports the integrations only inside instrument()
