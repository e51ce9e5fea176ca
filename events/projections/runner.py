"""Running a projection: a durable JetStream consumer feeding Postgres in batches.

Postgres, not the consumer, is the authority on progress: each batch's rows and the stream
position are committed in one transaction, and a message at or below the committed position
is skipped. So a projector killed anywhere (mid-batch, after commit but before the ack)
resumes without losing or doubling anything: on start it re-creates its durable consumer at
the committed position + 1. One projector per projection runs at a time (a Postgres advisory
lock); another instance waits as a standby.

An event the projection cannot apply (a failure other than an unreachable backend) never
wedges it: the batch is re-applied one event at a time, and each failing event is recorded
as a dead letter in the transaction that moves the position past it (dead_letters.py)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import asyncpg
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from events.nats_cluster import unsubscribe_within
from events.projections import dead_letters
from events.projections.tables import ProjectionPositionRow, ddl
from events.store import StreamLayout
from events.unavailable import backend_unavailable

log = logging.getLogger(__name__)

POSITIONS_DDL = ddl(ProjectionPositionRow)


class Entry(NamedTuple):
    seq: int  # stream sequence
    data: bytes


class Projection(Protocol):
    """One read model: the tables it owns and how a batch of events changes them."""

    name: str  # position key and durable consumer name
    tables: tuple[str, ...]  # dropped and re-created by a rebuild
    ddl: str  # CREATE TABLE IF NOT EXISTS ... for `tables` (tables.ddl)

    def stream(self, layout: StreamLayout) -> str: ...

    async def apply(self, conn: asyncpg.Connection, batch: Sequence[Entry]) -> None:
        """Write the batch's effects. Runs inside the batch's transaction."""
        ...


class ProjectionLocked(RuntimeError):
    """Another process runs this projection."""


def _stream_seq(reply: str) -> int:
    # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending> (v1), or with
    # <domain>.<account hash> after ACK and a trailing token (v2).
    tokens = reply.split(".")
    return int(tokens[5] if len(tokens) == 9 else tokens[7])


async def ensure_schema(conn: asyncpg.Connection, projections: Sequence[Projection]) -> None:
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext('tokenmill.schema'))")
        await conn.execute(POSITIONS_DDL)
        await conn.execute(dead_letters.DEAD_LETTERS_DDL)
        for p in projections:
            await conn.execute(p.ddl)


async def committed_positions(conn: asyncpg.Connection | asyncpg.Pool) -> dict[str, int]:
    await conn.execute(POSITIONS_DDL)
    rows = await conn.fetch("SELECT projection, last_seq FROM projection_positions")
    return {r["projection"]: int(r["last_seq"]) for r in rows}


class Projector:
    def __init__(
        self,
        nc: NATS,
        database_url: str,
        layout: StreamLayout,
        projection: Projection,
        *,
        batch_size: int = 5000,
        linger_s: float = 0.01,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.database_url = database_url
        self.layout = layout
        self.projection = projection
        self.stream = projection.stream(layout)
        self.batch_size = batch_size
        self.linger_s = linger_s
        self.position = 0  # last committed stream sequence
        self._buf: deque[tuple[int, bytes, str, str]] = deque()  # seq, data, reply, subject
        self._arrived = asyncio.Event()

    async def run(
        self, *, until_seq: int | None = None, reset: bool = False, standby: bool = True
    ) -> None:
        """Project until cancelled, or until the position reaches `until_seq`.

        `reset` drops the projection's tables and replays the stream from the start (a
        rebuild). `standby` waits for the lock if another process holds it; else raise."""
        conn: asyncpg.Connection = await asyncpg.connect(self.database_url)
        sub: Subscription | None = None
        try:
            await self._lock(conn, standby)
            if reset:
                async with conn.transaction():
                    for table in self.projection.tables:
                        await conn.execute(f'DROP TABLE IF EXISTS "{table}" CASCADE')
                    await conn.execute(POSITIONS_DDL)
                    await conn.execute(
                        "DELETE FROM projection_positions WHERE projection = $1",
                        self.projection.name,
                    )
            await ensure_schema(conn, [self.projection])
            self.position = await self._committed(conn)
            sub = await self._subscribe()
            while until_seq is None or self.position < until_seq:
                batch = await self._next_batch()
                if batch:
                    await self._commit(conn, batch)
        finally:
            if sub is not None:
                await unsubscribe_within(sub)
            await conn.close()

    async def wait_caught_up(self, seq: int, within: float = 30.0) -> None:
        """For tests and rebuilds in the same process: wait until position >= seq."""
        deadline = asyncio.get_running_loop().time() + within
        while self.position < seq:
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{self.projection.name} at {self.position}, want {seq}")
            await asyncio.sleep(0.01)

    # -- steps -----------------------------------------------------------------------------

    async def _lock(self, conn: asyncpg.Connection, standby: bool) -> None:
        key = f"tokenmill.projection.{self.stream}.{self.projection.name}"
        waiting = False
        while not await conn.fetchval("SELECT pg_try_advisory_lock(hashtext($1))", key):
            if not standby:
                raise ProjectionLocked(f"projection {self.projection.name} is running elsewhere")
            if not waiting:
                log.info("projection %s runs elsewhere; standing by", self.projection.name)
                waiting = True
            await asyncio.sleep(1.0)

    async def _committed(self, conn: asyncpg.Connection) -> int:
        seq = await conn.fetchval(
            "SELECT last_seq FROM projection_positions WHERE projection = $1", self.projection.name
        )
        return int(seq or 0)

    async def _subscribe(self) -> Subscription:
        """(Re)create the durable push consumer at the committed position + 1. Subscribe to
        its deliver subject first, so no message is pushed to nobody."""
        name = self.projection.name
        deliver = self.nc.new_inbox()
        sub = await self.nc.subscribe(
            deliver, cb=self._on_msg, pending_msgs_limit=-1, pending_bytes_limit=-1
        )
        try:
            await self.js.delete_consumer(self.stream, name)
        except NotFoundError:
            pass
        start = self.position + 1
        await self.js.add_consumer(
            self.stream,
            ConsumerConfig(
                durable_name=name,
                description=f"tokenmill projection {name} -> Postgres",
                deliver_subject=deliver,
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=start,
                ack_policy=AckPolicy.ALL,
                ack_wait=600,
                max_ack_pending=4 * self.batch_size,
            ),
        )
        return sub

    async def _on_msg(self, msg: Msg) -> None:
        if not msg.reply or not msg.reply.startswith("$JS.ACK."):
            return  # a status message (heartbeat), not an event
        self._buf.append((_stream_seq(msg.reply), msg.data, msg.reply, msg.subject))
        self._arrived.set()

    async def _next_batch(self) -> list[tuple[int, bytes, str, str]]:
        if not self._buf:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), 1.0)
            except TimeoutError:
                return []
        if len(self._buf) < self.batch_size and self.linger_s:
            await asyncio.sleep(self.linger_s)  # let a burst fill the batch
        n = min(len(self._buf), self.batch_size)
        return [self._buf.popleft() for _ in range(n)]

    async def _commit(
        self, conn: asyncpg.Connection, batch: list[tuple[int, bytes, str, str]]
    ) -> None:
        recorded = 0
        async with conn.transaction():
            # The row lock orders concurrent writers; the position filter drops redeliveries.
            committed = await conn.fetchval(
                "SELECT last_seq FROM projection_positions WHERE projection = $1 FOR UPDATE",
                self.projection.name,
            )
            committed = int(committed or 0)
            fresh = [
                (Entry(seq, data), subject) for seq, data, _, subject in batch if seq > committed
            ]
            if fresh:
                recorded = await self._apply(conn, fresh)
                await conn.execute(
                    """INSERT INTO projection_positions (projection, stream, last_seq, updated_at)
                       VALUES ($1, $2, $3, now())
                       ON CONFLICT (projection) DO UPDATE
                       SET last_seq = EXCLUDED.last_seq, stream = EXCLUDED.stream, updated_at = now()""",
                    self.projection.name,
                    self.stream,
                    fresh[-1][0].seq,
                )
                committed = fresh[-1][0].seq
        if recorded:
            dead_letters.DEAD_LETTERS.labels(self.projection.name).inc(recorded)
        self.position = committed
        # Ack-all: acknowledges every message up to this one.
        await self.nc.publish(batch[-1][2], b"+ACK")

    async def _apply(self, conn: asyncpg.Connection, fresh: list[tuple[Entry, str]]) -> int:
        """Apply the batch (in a savepoint); if it fails for a reason other than an unreachable
        backend, apply it event by event and dead-letter the ones that fail. Returns how many
        new dead letters it recorded."""
        try:
            async with conn.transaction():
                await self.projection.apply(conn, [entry for entry, _ in fresh])
            return 0
        except Exception as e:
            if backend_unavailable(e):
                raise
        recorded = 0
        for entry, subject in fresh:
            try:
                async with conn.transaction():
                    await self.projection.apply(conn, [entry])
            except Exception as e:
                if backend_unavailable(e):
                    raise
                log.error(
                    "projection %s cannot apply %s seq %d (%s): %r; recorded as a dead letter",
                    self.projection.name,
                    self.stream,
                    entry.seq,
                    subject,
                    e,
                )
                if await dead_letters.record(
                    conn, self.projection.name, self.stream, entry.seq, subject, entry.data, e
                ):
                    recorded += 1
        return recorded
