"""Usage by tenant and SKU from the usage ledger, for the operator's page: token counts only
(what it cost is the pricing module's showback export)."""

from __future__ import annotations

import csv
import io
from datetime import UTC, date, datetime, time, timedelta
from typing import Any, Protocol

USAGE_SQL = """
SELECT tenant_id, sku_id,
       count(*) AS requests,
       coalesce(sum(prompt_tokens), 0) AS prompt_tokens,
       coalesce(sum(cached_tokens), 0) AS cached_tokens,
       coalesce(sum(completion_tokens), 0) AS completion_tokens,
       min(finished_at) AS first_at,
       max(finished_at) AS last_at
FROM usage_ledger
WHERE finished_at >= $1 AND finished_at < $2
GROUP BY tenant_id, sku_id
ORDER BY tenant_id, sku_id
"""

CSV_COLUMNS = (
    "tenant_id",
    "tenant_name",
    "sku_id",
    "sku_name",
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "first_at",
    "last_at",
)


class Names(Protocol):
    """The governance view, for display names."""

    def tenant(self, tenant_id: str) -> Any: ...
    def sku(self, sku_id: str) -> Any: ...


def period(start: date | None, end: date | None) -> tuple[datetime, datetime]:
    """[start, end] as whole UTC days; open ends reach the beginning / the end of time."""
    lo = datetime.combine(start, time.min, UTC) if start else datetime(1970, 1, 1, tzinfo=UTC)
    hi = (
        datetime.combine(end + timedelta(days=1), time.min, UTC)
        if end
        else datetime(9999, 1, 1, tzinfo=UTC)
    )
    return lo, hi


async def usage_by_tenant(
    pool: Any, names: Names, start: date | None, end: date | None
) -> list[dict[str, Any]]:
    lo, hi = period(start, end)
    rows = await pool.fetch(USAGE_SQL, lo, hi)
    out = []
    for r in rows:
        tenant, sku = names.tenant(r["tenant_id"]), names.sku(r["sku_id"])
        out.append(
            {
                "tenant_id": r["tenant_id"],
                "tenant_name": tenant.name if tenant is not None else None,
                "sku_id": r["sku_id"],
                "sku_name": sku.name if sku is not None else None,
                "requests": r["requests"],
                "prompt_tokens": r["prompt_tokens"],
                "cached_tokens": r["cached_tokens"],
                "completion_tokens": r["completion_tokens"],
                "first_at": r["first_at"].isoformat(),
                "last_at": r["last_at"].isoformat(),
            }
        )
    return out


def usage_csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()
