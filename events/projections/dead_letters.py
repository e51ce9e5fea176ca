"""Dead letters: events a projection could not apply. The projector records one in the same
transaction that moves its position past it, so one bad event never wedges a read model and
is never lost; `/readyz` reports not ready while any is unresolved, and the operator lists
and resolves them (`tokenmill projections dead-letters list | resolve ID [--retry]`).

A row is keyed by (projection, stream sequence): a rebuild that meets the event again keeps
the first record, resolved or not."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import asyncpg
from prometheus_client import Counter

from events.projections.tables import DeadLetterRow, ddl

if TYPE_CHECKING:
    from events.projections.runner import Projection

log = logging.getLogger(__name__)

DEAD_LETTERS_DDL = ddl(DeadLetterRow)

# Process-wide (the projectors of one process share it); on prometheus_client's default
# registry, so a scrape of that registry shows it.
DEAD_LETTERS = Counter(
    "tokenmill_projection_dead_letters",
    "Events a projection could not apply, recorded as dead letters (see /readyz).",
    ["projection"],
)


async def record(
    conn: asyncpg.Connection,
    projection: str,
    stream: str,
    seq: int,
    subject: str,
    payload: bytes,
    error: BaseException,
) -> bool:
    """Record a dead letter (inside the caller's transaction); False if already recorded."""
    new_id = await conn.fetchval(
        """INSERT INTO projection_dead_letters (projection, stream, stream_seq, subject, error, payload)
           VALUES ($1, $2, $3, $4, $5, $6)
           ON CONFLICT (projection, stream_seq) DO NOTHING RETURNING id""",
        projection,
        stream,
        seq,
        subject,
        f"{type(error).__name__}: {error}",
        payload,
    )
    return new_id is not None


async def unresolved_counts(conn: asyncpg.Connection | asyncpg.Pool) -> dict[str, int]:
    await conn.execute(DEAD_LETTERS_DDL)
    rows = await conn.fetch(
        """SELECT projection, count(*) AS n FROM projection_dead_letters
           WHERE resolved_at IS NULL GROUP BY projection"""
    )
    return {r["projection"]: int(r["n"]) for r in rows}


async def dead_letters(
    conn: asyncpg.Connection | asyncpg.Pool, *, include_resolved: bool = False
) -> list[dict[str, Any]]:
    await conn.execute(DEAD_LETTERS_DDL)
    rows = await conn.fetch(
        """SELECT * FROM projection_dead_letters
           WHERE $1 OR resolved_at IS NULL ORDER BY id""",
        include_resolved,
    )
    return [dict(r) for r in rows]


class DeadLetterError(Exception):
    """The dead letter does not exist, is already resolved, or still fails to apply."""


async def resolve(
    conn: asyncpg.Connection,
    letter_id: int,
    *,
    retry: bool = False,
    projections: Sequence[Projection] = (),
) -> str:
    """Mark a dead letter resolved; with `retry`, first re-apply its event to its projection
    (in one transaction with the mark; if it fails again, nothing changes). Returns how it was
    resolved: "retried" or "skipped"."""
    async with conn.transaction():
        row = await conn.fetchrow(
            "SELECT * FROM projection_dead_letters WHERE id = $1 FOR UPDATE", letter_id
        )
        if row is None:
            raise DeadLetterError(f"no dead letter {letter_id}")
        if row["resolved_at"] is not None:
            raise DeadLetterError(f"dead letter {letter_id} is already resolved")
        resolution = "skipped"
        if retry:
            from events.projections.runner import Entry

            projection = next((p for p in projections if p.name == row["projection"]), None)
            if projection is None:
                raise DeadLetterError(f"unknown projection {row['projection']!r}")
            # Orders the re-apply with the running projector's commits (it takes this row
            # lock per batch).
            await conn.execute(
                "SELECT 1 FROM projection_positions WHERE projection = $1 FOR UPDATE",
                projection.name,
            )
            try:
                async with conn.transaction():
                    await projection.apply(conn, [Entry(row["stream_seq"], bytes(row["payload"]))])
            except Exception as e:
                raise DeadLetterError(
                    f"dead letter {letter_id} still fails: {type(e).__name__}: {e}"
                ) from e
            resolution = "retried"
        await conn.execute(
            """UPDATE projection_dead_letters SET resolved_at = now(), resolution = $2
               WHERE id = $1""",
            letter_id,
            resolution,
        )
    return resolution


# -- the operator's command: tokenmill projections dead-letters ... -------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="dead_letters_action", required=True)
    p = actions.add_parser("list", help="unresolved dead letters (--all: resolved ones too)")
    p.add_argument("--all", action="store_true", dest="include_resolved", help="resolved ones too")
    p.add_argument("--json", action="store_true", help="one JSON object per line, with payload")
    p = actions.add_parser("resolve", help="mark a dead letter resolved")
    p.add_argument("id", type=int, help="the dead letter's id (from list)")
    p.add_argument(
        "--retry",
        action="store_true",
        help="re-apply its event first (resolved only if it applies)",
    )


def _line(r: dict[str, Any]) -> str:
    status = f"resolved ({r['resolution']})" if r["resolved_at"] else "unresolved"
    first_seen: datetime = r["first_seen"]
    return (
        f"{r['id']}\t{r['projection']}\t{r['stream']}#{r['stream_seq']}\t{r['subject']}\t"
        f"{first_seen.isoformat(timespec='seconds')}\t{status}\t{r['error']}"
    )


async def _command(database_url: str, args: argparse.Namespace) -> int:
    from events.projections import all_projections

    conn: asyncpg.Connection = await asyncpg.connect(database_url)
    try:
        if args.dead_letters_action == "list":
            rows = await dead_letters(conn, include_resolved=args.include_resolved)
            if args.json:
                for r in rows:
                    payload = bytes(r["payload"]).decode("utf-8", "backslashreplace")
                    print(json.dumps({**r, "payload": payload}, default=str), flush=True)
            else:
                print("id\tprojection\tevent\tsubject\tfirst_seen\tstatus\terror", flush=True)
                for r in rows:
                    print(_line(r), flush=True)
            return 0
        try:
            await conn.execute(DEAD_LETTERS_DDL)
            how = await resolve(conn, args.id, retry=args.retry, projections=all_projections())
        except DeadLetterError as e:
            print(f"tokenmill: {e}", file=sys.stderr, flush=True)
            return 1
        print(f"dead letter {args.id} resolved ({how})", flush=True)
        return 0
    finally:
        await conn.close()


def command(database_url: str, args: argparse.Namespace) -> int:
    return asyncio.run(_command(database_url, args))
