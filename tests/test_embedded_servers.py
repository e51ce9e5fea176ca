"""The embedded servers are real: JetStream accepts a stream, Postgres runs SQL."""

from __future__ import annotations

import asyncpg
import nats

from control_plane.embedded import EmbeddedNats, EmbeddedPostgres


async def test_jetstream_is_real(nats_server: EmbeddedNats, stream_prefix: str) -> None:
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await js.add_stream(name=f"{stream_prefix}_PING", subjects=[f"{stream_prefix}.ping"])
    ack = await js.publish(f"{stream_prefix}.ping", b"x", headers={"Nats-Msg-Id": "a"})
    dup = await js.publish(f"{stream_prefix}.ping", b"x", headers={"Nats-Msg-Id": "a"})
    assert ack.seq == 1 and dup.duplicate
    await nc.close()


async def test_postgres_is_real(postgres_server: EmbeddedPostgres, database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    assert await conn.fetchval("select 40 + 2") == 42
    await conn.close()
