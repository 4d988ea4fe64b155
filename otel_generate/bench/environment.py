"""What the bench records about where it ran: versions and the machine."""

from __future__ import annotations

import os
import platform
from typing import Any, Dict


def versions() -> Dict[str, str]:
    """Versions of Python, torch, transformers, otel_generate and the OpenTelemetry SDK (if installed)."""
    import torch
    import transformers

    from otel_generate.version import __version__

    found = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "otel_generate": __version__,
    }
    try:
        from importlib.metadata import version

        found["opentelemetry_sdk"] = version("opentelemetry-sdk")
    except Exception:
        pass
    return found


def cpu_model() -> str:
    """The CPU's ``model name`` from ``/proc/cpuinfo``, else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: str) -> Dict[str, Any]:
    """Host facts; the GPU's name only when running on CUDA (the CPU path calls no CUDA function)."""
    info: Dict[str, Any] = {
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "nproc": os.cpu_count(),
    }
    if device == "cuda":
        import torch

        info["gpu"] = torch.cuda.get_device_name(torch.cuda.current_device())
    return info
