"""Finished requests fed to OpsMetrics the way the gateway reports them."""

from __future__ import annotations

from typing import Any

from control_plane.observability.metrics import OpsMetrics

# A small answer of the demo SKU; a test names only the fields it is about.
DEMO_REQUEST: dict[str, Any] = dict(
    sku="demo", model="m", tenant="t", ttft_s=0.1, e2e_s=0.2, prompt_tokens=3, completion_tokens=2
)


def observe(metrics: OpsMetrics, **fields: Any) -> None:
    metrics.observe_request(**(DEMO_REQUEST | fields))
