"""Appends: message-id dedupe and optimistic concurrency per aggregate, on real JetStream."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from events.control import TenantCreated, TenantLabelsSet, decode_control
from events.store import ConcurrencyError, EventStore
from events.usage import RequestFinished


async def test_expected_version_guards_each_aggregate(store: EventStore) -> None:
    seq = await store.append(TenantCreated(tenant_id="t1", name="a"), expected_version=0)
    # "Must not exist yet" fails the second time.
    with pytest.raises(ConcurrencyError):
        await store.append(TenantCreated(tenant_id="t1", name="b"), expected_version=0)
    # Another aggregate is independent of t1's version.
    await store.append(TenantCreated(tenant_id="t2", name="c"), expected_version=0)
    seq2 = await store.append(
        TenantLabelsSet(tenant_id="t1", labels={"x": "1"}), expected_version=seq
    )
    with pytest.raises(ConcurrencyError) as e:
        await store.append(TenantLabelsSet(tenant_id="t1", labels={"x": "2"}), expected_version=seq)
    assert e.value.aggregate == "tenant" and e.value.aggregate_id == "t1"
    assert await store.head(store.layout.control_stream) == seq2


async def test_concurrent_writers_one_wins(store: EventStore) -> None:
    seq = await store.append(TenantCreated(tenant_id="t1", name="a"), expected_version=0)
    writes = [
        store.append(TenantLabelsSet(tenant_id="t1", labels={"w": str(i)}), expected_version=seq)
        for i in range(5)
    ]
    results = await asyncio.gather(*writes, return_exceptions=True)
    assert sum(isinstance(r, int) for r in results) == 1
    assert sum(isinstance(r, ConcurrencyError) for r in results) == 4


async def test_retried_append_is_deduplicated(store: EventStore) -> None:
    event = TenantCreated(tenant_id="t1", name="a")
    first = await store.append(event, expected_version=None)
    again = await store.append(event, expected_version=None)
    assert first == again and await store.head(store.layout.control_stream) == first
    msg = await store.js.get_msg(store.layout.control_stream, first)
    assert decode_control(msg.data) == event
    assert msg.subject == f"{store.layout.prefix}.ctl.tenant.t1"


async def test_usage_publish_is_deduplicated_by_request_id(store: EventStore) -> None:
    now = datetime.now(UTC)
    event = RequestFinished(
        request_id="r1", tenant_id="t", key_id="k", sku_id="s", model="m", worker_id="w",
        prompt_tokens=3, completion_tokens=4, finish_reason="stop", e2e_ms=1.0, started_at=now, finished_at=now,
    )  # fmt: skip
    a = await store.publish_usage(event)
    b = await store.publish_usage(event)
    assert b.duplicate and a.seq == b.seq
    assert await store.head(store.layout.usage_stream) == 1


async def test_streams_are_idempotent_and_control_is_append_only(store: EventStore) -> None:
    await store.ensure_streams()
    info = await store.js.stream_info(store.layout.control_stream)
    assert info.config.deny_delete and info.config.deny_purge and not info.config.max_age
    usage = await store.js.stream_info(store.layout.usage_stream)
    assert usage.config.duplicate_window == pytest.approx(2 * 3600)
