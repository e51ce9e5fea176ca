"""Prompt tokens served from the prefix cache (`cached_tokens`, OpenAI's
`usage.prompt_tokens_details.cached_tokens`) through the usage stream into the ledger: kept
per request, beside the prompt count they are part of; an event written before the field
existed reads as nothing cached."""

from __future__ import annotations

from datetime import UTC, datetime

import asyncpg
from nats.aio.client import Client as NATS

from events.projections import Projector, all_projections, ensure_schema
from events.projections.usage_ledger import UsageLedgerProjection
from events.store import EventStore
from events.usage import RequestFinished, decode_usage, encode_usage, usage_subject

AT = datetime(2026, 3, 2, 12, tzinfo=UTC)


def finished(request_id: str, prompt: int, cached: int) -> RequestFinished:
    return RequestFinished(
        request_id=request_id,
        tenant_id="acme",
        key_id="key-1",
        sku_id="qwen",
        model="qwen3.6-27b",
        worker_id="w1",
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=7,
        finish_reason="stop",
        e2e_ms=120.0,
        started_at=AT,
        finished_at=AT,
    )


# A worker event as published before `cached_tokens` was part of the schema.
OLDER = (
    b'{"type":"request.finished","schema_version":1,"request_id":"old","tenant_id":"acme",'
    b'"key_id":"key-1","sku_id":"qwen","model":"qwen3.6-27b","worker_id":"w0",'
    b'"prompt_tokens":40,"completion_tokens":3,"finish_reason":"stop","e2e_ms":50.0,'
    b'"started_at":"2026-03-02T11:00:00Z","finished_at":"2026-03-02T11:00:00Z"}'
)


async def test_ledger_keeps_cached_tokens_per_request(
    nc: NATS, store: EventStore, database_url: str
) -> None:
    assert decode_usage(OLDER).cached_tokens == 0  # type: ignore[union-attr]
    conn = await asyncpg.connect(database_url)
    try:
        await ensure_schema(conn, all_projections())
        events = [finished("all", 512, 512), finished("none", 300, 0), finished("some", 900, 256)]
        for event in events:
            await store.publish_usage(event)
        await nc.jetstream().publish(
            usage_subject(store.layout.prefix, "worker", "qwen"),
            OLDER,
            headers={"Nats-Msg-Id": "req:old"},
            stream=store.layout.usage_stream,
        )
        # the same request again beyond the dedupe window, other counts: the first one stays
        await nc.jetstream().publish(
            usage_subject(store.layout.prefix, "worker", "qwen"),
            encode_usage(finished("some", 900, 0)),
            headers={"Nats-Msg-Id": "again:some"},
            stream=store.layout.usage_stream,
        )
        head = await store.head(store.layout.usage_stream)
        projection = UsageLedgerProjection()
        await Projector(nc, database_url, store.layout, projection).run(until_seq=head)
        rows = await conn.fetch(
            "SELECT request_id, prompt_tokens, cached_tokens FROM usage_ledger ORDER BY request_id"
        )
    finally:
        await conn.close()
    assert [tuple(r) for r in rows] == [
        ("all", 512, 512),
        ("none", 300, 0),
        ("old", 40, 0),
        ("some", 900, 256),
    ]
