"""Pluggable worker backends behind one interface (`base.Backend`):

- `torch_runtime`: our engine, serving a model on CPU or GPU;
- `openai_proxy`: forwards to any external OpenAI-compatible engine (vLLM, ...), metered the same way;
- `fixed_rate`: a load-test fixture that emits tokens at a fixed rate (never a default).
"""

from __future__ import annotations

from typing import Any

from worker.backends.base import Backend, InvalidRequest, Load, Progress, StopMatcher

BACKENDS = ("torch_runtime", "openai_proxy", "fixed_rate")


def make_backend(name: str, config: dict[str, Any]) -> Backend:
    """Builds a backend from its name and keyword config (imported lazily: only the torch
    runtime needs torch)."""
    if name == "fixed_rate":
        from worker.backends.fixed_rate import FixedRateBackend

        return FixedRateBackend(**config)
    if name == "openai_proxy":
        from worker.backends.openai_proxy import OpenAIProxyBackend

        return OpenAIProxyBackend(**config)
    if name == "torch_runtime":
        from worker.backends.torch_runtime import TorchRuntimeBackend

        return TorchRuntimeBackend(**config)
    raise ValueError(f"unknown worker backend {name!r}; one of {', '.join(BACKENDS)}")


__all__ = [
    "BACKENDS",
    "Backend",
    "InvalidRequest",
    "Load",
    "Progress",
    "StopMatcher",
    "make_backend",
]
