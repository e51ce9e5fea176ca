"""An event a projection cannot apply becomes a dead letter instead of wedging it: on real
JetStream and Postgres, with the bad events appended straight to the stream (as a writer that
skips validation, or an older version, would)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncpg
import pytest
from nats.aio.client import Client as NATS
from prometheus_client import REGISTRY

from events.control import ApiKeyIssued, TenantCreated, control_subject, encode_control
from events.projections import Projector, ReadModelsProjection, all_projections, dead_letters
from events.projections.runner import POSITIONS_DDL
from events.store import EventStore, StreamLayout
from tokenmill.cli import main


def _dead_letter_count() -> float:
    sample = REGISTRY.get_sample_value(
        "tokenmill_projection_dead_letters_total", {"projection": "read_models"}
    )
    return sample or 0.0


async def _append_raw(nc: NATS, layout: StreamLayout, event: TenantCreated) -> tuple[int, str]:
    """Publish without the store's validation; returns (stream seq, subject)."""
    subject = control_subject(layout.prefix, "tenant", event.tenant_id)
    ack = await nc.jetstream().publish(subject, encode_control(event), stream=layout.control_stream)
    return int(ack.seq), subject


async def _project(nc: NATS, database_url: str, layout: StreamLayout, *, reset: bool) -> None:
    head = await EventStore(nc.jetstream(), layout).head(layout.control_stream)
    projector = Projector(nc, database_url, layout, ReadModelsProjection())
    await asyncio.wait_for(projector.run(until_seq=head, reset=reset, standby=False), 30)


async def test_unappliable_events_are_dead_lettered_and_resolvable(
    nc: NATS, store: EventStore, layout: StreamLayout, database_url: str
) -> None:
    before = _dead_letter_count()
    await store.append(TenantCreated(tenant_id="ten_a", name="a"), 0)
    evil = TenantCreated(tenant_id="ten_evil", name="evil\x00name")
    evil_seq, evil_subject = await _append_raw(nc, layout, evil)
    # Valid on its own, but its key hash collides with the first key's (a UNIQUE column).
    await store.append(ApiKeyIssued(key_id="key_1", tenant_id="ten_a", key_hash="h", prefix="p"), 0)
    clash_seq = await store.append(
        ApiKeyIssued(key_id="key_2", tenant_id="ten_a", key_hash="h", prefix="p"), 0
    )
    last = await store.append(TenantCreated(tenant_id="ten_b", name="b"), 0)

    await _project(nc, database_url, layout, reset=False)
    conn = await asyncpg.connect(database_url)
    try:
        assert [
            r["tenant_id"] for r in await conn.fetch("SELECT tenant_id FROM tenants ORDER BY 1")
        ] == ["ten_a", "ten_b"]
        assert (
            await conn.fetchval(
                "SELECT last_seq FROM projection_positions WHERE projection = 'read_models'"
            )
            == last
        )
        letters = await dead_letters.dead_letters(conn)
        assert [(r["stream_seq"], r["stream"], r["projection"]) for r in letters] == [
            (evil_seq, layout.control_stream, "read_models"),
            (clash_seq, layout.control_stream, "read_models"),
        ]
        assert letters[0]["subject"] == evil_subject
        assert bytes(letters[0]["payload"]) == encode_control(evil)
        assert "0x00" in letters[0]["error"] and "UniqueViolation" in letters[1]["error"]
        assert _dead_letter_count() - before == 2
        assert await dead_letters.unresolved_counts(conn) == {"read_models": 2}

        # A rebuild meets them again: it completes, and keeps the first records.
        await _project(nc, database_url, layout, reset=True)
        again = await dead_letters.dead_letters(conn)
        assert [(r["id"], r["first_seen"]) for r in again] == [
            (r["id"], r["first_seen"]) for r in letters
        ]
        assert _dead_letter_count() - before == 2
        assert await conn.fetchval("SELECT count(*) FROM tenants") == 2

        evil_id, clash_id = (r["id"] for r in letters)
        projections = all_projections()
        with pytest.raises(dead_letters.DeadLetterError, match="still fails"):
            await dead_letters.resolve(conn, evil_id, retry=True, projections=projections)
        # Once the cause is gone, a retry applies the event and resolves the letter.
        await conn.execute("DELETE FROM api_keys WHERE key_id = 'key_1'")
        how = await dead_letters.resolve(conn, clash_id, retry=True, projections=projections)
        assert how == "retried"
        assert await conn.fetchval("SELECT key_id FROM api_keys") == "key_2"
        assert await dead_letters.resolve(conn, evil_id) == "skipped"
        assert await dead_letters.unresolved_counts(conn) == {}
        with pytest.raises(dead_letters.DeadLetterError, match="already resolved"):
            await dead_letters.resolve(conn, evil_id)
    finally:
        await conn.close()


def test_dead_letters_command(
    nats_server: object,
    database_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    async def seed() -> int:
        conn = await asyncpg.connect(database_url)
        try:
            await conn.execute(dead_letters.DEAD_LETTERS_DDL)
            await conn.execute(POSITIONS_DDL)
            payload = encode_control(TenantCreated(tenant_id="ten_x", name="x\x00"))
            await dead_letters.record(
                conn,
                "read_models",
                "TM_CONTROL",
                7,
                "TM.ctl.tenant.ten_x",
                payload,
                ValueError("bad"),
            )
            return int(await conn.fetchval("SELECT id FROM projection_dead_letters"))
        finally:
            await conn.close()

    letter = asyncio.run(seed())
    monkeypatch.setenv("TOKENMILL_NATS_URL", nats_server.url)  # type: ignore[attr-defined]
    monkeypatch.setenv("TOKENMILL_DATABASE_URL", database_url)
    base = ["--data-dir", str(tmp_path), "projections", "dead-letters"]
    capsys.readouterr()
    assert main([*base, "list"]) == 0
    out = capsys.readouterr().out
    assert f"{letter}\tread_models\tTM_CONTROL#7\tTM.ctl.tenant.ten_x\t" in out
    assert "unresolved\tValueError: bad" in out
    assert main([*base, "resolve", str(letter), "--retry"]) == 1  # still fails: left as it is
    assert "still fails" in capsys.readouterr().err
    assert main([*base, "resolve", str(letter)]) == 0
    assert capsys.readouterr().out == f"dead letter {letter} resolved (skipped)\n"
    assert main([*base, "list"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "id\tprojection\tevent\tsubject\tfirst_seen\tstatus\terror"
    ]
    assert main([*base, "list", "--all"]) == 0
    assert "resolved (skipped)" in capsys.readouterr().out
    assert main([*base, "resolve", str(letter)]) == 1
