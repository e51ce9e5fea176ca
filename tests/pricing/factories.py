"""Builders for ledger rows and price plans in the pricing tests."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime
from decimal import Decimal

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


def row(
    finished_at: datetime,
    *,
    seq: int | None = None,
    tenant_id: str = "acme",
    key_id: str = "key-1",
    sku_id: str = "qwen-27b",
    model: str = "qwen3.6-27b",
    prompt: int = 1000,
    cached: int = 0,
    completion: int = 200,
    finish_reason: str = "stop",
    request_id: str | None = None,
) -> LedgerRow:
    n = next(_ids)
    return LedgerRow(
        request_id=request_id or f"req-{n}",
        tenant_id=tenant_id,
        key_id=key_id,
        sku_id=sku_id,
        model=model,
        worker_id="w1",
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
        finish_reason=finish_reason,
        started_at=finished_at,
        finished_at=finished_at,
        stream_seq=seq if seq is not None else n,
    )
