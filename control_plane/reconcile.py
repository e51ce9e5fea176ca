"""`tokenmill reconcile`: the usage ledger (what workers billed) against the gateway's
deliveries (what it relayed), request by request.

A request matches when both sides have it with the same prompt tokens, completion tokens and
finish reason. Prints the match rate and every mismatch; exits 1 if there is any.

    tokenmill reconcile --database-url postgresql://...   (or TOKENMILL_DATABASE_URL)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import asyncpg

# Both sides, outer-joined on the request id. A row only one side has is a mismatch, unless
# it finished within the grace period (the other side's event may still be on its way).
QUERY = """
SELECT coalesce(l.request_id, g.request_id) AS request_id,
       coalesce(l.tenant_id, g.tenant_id) AS tenant_id,
       coalesce(l.sku_id, g.sku_id) AS sku_id,
       l.prompt_tokens AS billed_prompt, l.completion_tokens AS billed_completion,
       l.finish_reason AS billed_finish, l.worker_id,
       g.prompt_tokens AS delivered_prompt, g.completion_tokens AS delivered_completion,
       g.finish_reason AS delivered_finish, g.client_disconnected,
       greatest(l.finished_at, g.finished_at) AS finished_at
FROM usage_ledger l FULL OUTER JOIN gateway_deliveries g ON g.request_id = l.request_id
WHERE coalesce(l.finished_at, g.finished_at) >= $1 AND coalesce(l.finished_at, g.finished_at) < $2
"""


@dataclass
class Mismatch:
    request_id: str
    tenant_id: str
    sku_id: str
    problem: str


@dataclass
class Report:
    requests: int = 0
    matched: int = 0
    pending: int = 0  # one side missing, but within the grace period
    billed_completion_tokens: int = 0
    delivered_completion_tokens: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def match_rate(self) -> float:
        checked = self.requests - self.pending
        return 1.0 if checked == 0 else self.matched / checked

    def lines(self) -> list[str]:
        out = [
            f"requests {self.requests}, matched {self.matched}, mismatched {len(self.mismatches)}, "
            f"pending {self.pending}: match rate {self.match_rate * 100:.2f}%",
            f"completion tokens billed {self.billed_completion_tokens}, delivered {self.delivered_completion_tokens}",
        ]
        out += [
            f"MISMATCH {m.request_id} tenant={m.tenant_id} sku={m.sku_id}: {m.problem}"
            for m in self.mismatches
        ]
        return out


def _problem(r: Any) -> str | None:
    if r["billed_completion"] is None:
        return "delivered by the gateway but not in the usage ledger"
    if r["delivered_completion"] is None:
        return f"billed (worker {r['worker_id']}) but no gateway delivery recorded"
    diffs = []
    for what, billed, delivered in (
        ("prompt tokens", r["billed_prompt"], r["delivered_prompt"]),
        ("completion tokens", r["billed_completion"], r["delivered_completion"]),
        ("finish reason", r["billed_finish"], r["delivered_finish"]),
    ):
        if billed != delivered:
            diffs.append(f"{what} billed {billed} vs delivered {delivered}")
    return "; ".join(diffs) or None


async def reconcile(
    conn: asyncpg.Connection | asyncpg.Pool,
    since: datetime | None = None,
    until: datetime | None = None,
    grace: timedelta = timedelta(seconds=10),
) -> Report:
    now = await conn.fetchval("SELECT now()")
    since = since or datetime.fromtimestamp(0, tz=now.tzinfo)
    until = until or now + timedelta(days=1)
    report = Report()
    for r in await conn.fetch(QUERY, since, until):
        report.requests += 1
        report.billed_completion_tokens += r["billed_completion"] or 0
        report.delivered_completion_tokens += r["delivered_completion"] or 0
        problem = _problem(r)
        if problem is None:
            report.matched += 1
        elif (r["billed_completion"] is None or r["delivered_completion"] is None) and r[
            "finished_at"
        ] > now - grace:
            report.pending += 1
        else:
            report.mismatches.append(
                Mismatch(r["request_id"], r["tenant_id"], r["sku_id"], problem)
            )
    report.mismatches.sort(key=lambda m: m.request_id)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tokenmill reconcile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--database-url", default=os.environ.get("TOKENMILL_DATABASE_URL"))
    ap.add_argument(
        "--since", type=datetime.fromisoformat, help="ISO time (with zone); default: all"
    )
    ap.add_argument(
        "--until", type=datetime.fromisoformat, help="ISO time (with zone); default: now"
    )
    ap.add_argument(
        "--grace-s",
        type=float,
        default=10.0,
        help="a one-sided request younger than this is pending",
    )
    a = ap.parse_args(argv)
    if not a.database_url:
        print(
            "tokenmill reconcile: give --database-url or set TOKENMILL_DATABASE_URL",
            file=sys.stderr,
        )
        return 2

    async def run() -> Report:
        conn = await asyncpg.connect(a.database_url)
        try:
            return await reconcile(conn, a.since, a.until, timedelta(seconds=a.grace_s))
        finally:
            await conn.close()

    report = asyncio.run(run())
    print("\n".join(report.lines()))
    return 0 if not report.mismatches else 1


if __name__ == "__main__":
    raise SystemExit(main())
