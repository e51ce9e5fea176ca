"""Builders for usage events, ledger rows and price plans in the pricing tests."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from events.usage import RequestFinished
from pricing.invoices import LedgerRow
from pricing.plans import PricePlan

_ids = itertools.count(1)


def at(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]


def plan(
    plan_id: str,
    effective_from: datetime,
    *,
    sku_id: str = "qwen-27b",
    input: str = "0.50",
    cached: str = "0.25",
    output: str = "3.00",
    currency: str = "USD",
) -> PricePlan:
    return PricePlan(
        plan_id=plan_id,
        sku_id=sku_id,
        currency=currency,
        input_per_mtok=Decimal(input),
        cached_input_per_mtok=Decimal(cached),
        output_per_mtok=Decimal(output),
        effective_from=effective_from,
    )


def finished(
    request_id: str,
    at: datetime,
    *,
    tenant_id: str = "acme",
    sku_id: str = "qwen",
    prompt: int = 1000,
    cached: int = 0,
    completion: int = 100,
    finish_reason: str = "stop",
    started: datetime | None = None,
    key_id: str = "key-1",
    worker_id: str = "w1",
    model: str = "qwen3.6-27b",
) -> RequestFinished:
    return RequestFinished(
        request_id=request_id,
        tenant_id=tenant_id,
        key_id=key_id,
        sku_id=sku_id,
        model=model,
        worker_id=worker_id,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
        finish_reason=finish_reason,  # type: ignore[arg-type]
        e2e_ms=1000.0,
        started_at=started or at,
        finished_at=at,
    )


# A ledger row is its RequestFinished event plus where the event sits in the usage stream.
_EVENT_FIELDS = [f for f in LedgerRow.__struct_fields__ if f not in ("stream_seq", "received_at")]


def row(
    finished_at: datetime,
    *,
    seq: int | None = None,
    request_id: str | None = None,
    sku_id: str = "qwen-27b",
    completion: int = 200,
    **usage: Any,
) -> LedgerRow:
    """The ledger's row of `finished`'s event (its other fields as there), at usage-stream
    sequence `seq` (default: a new id, the request id's number too)."""
    n = next(_ids)
    event = finished(
        request_id or f"req-{n}", finished_at, sku_id=sku_id, completion=completion, **usage
    )
    fields = {name: getattr(event, name) for name in _EVENT_FIELDS}
    return LedgerRow(**fields, stream_seq=seq if seq is not None else n)
