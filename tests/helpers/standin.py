"""Stand-in transformers modules for the self-check: a copy of a real module whose class lacks one patch point.

No transformers file is changed: the copy is registered in ``sys.modules`` under the real module's name
before the instrumentation looks at it, so the post-import hook and ``otel-generate doctor`` see a
transformers release without that point, while everything else is the installed transformers.
"""

from __future__ import annotations

import importlib
import types

#: Whisper's module exists in every supported transformers release (4.46 on).
WHISPER = "transformers.models.whisper.generation_whisper"


def module_without(module_name: str, owner: str, attribute: str) -> types.ModuleType:
    """A copy of ``module_name`` whose class ``owner`` is a copy without ``attribute``."""
    real = importlib.import_module(module_name)
    module = types.ModuleType(real.__name__, real.__doc__)
    vars(module).update({key: value for key, value in vars(real).items() if key not in ("__name__", "__doc__")})
    cls = getattr(real, owner)
    body = {key: value for key, value in vars(cls).items() if key not in (attribute, "__dict__", "__weakref__")}
    setattr(module, owner, type(cls.__name__, cls.__bases__, body))
    return module


def whisper_without_need_fallback() -> types.ModuleType:
    """Whisper's generation module as a release without ``WhisperGenerationMixin._need_fallback``."""
    return module_without(WHISPER, "WhisperGenerationMixin", "_need_fallback")
