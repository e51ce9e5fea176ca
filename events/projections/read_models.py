"""Read models of the control stream: tenants, api_keys, skus, price_plans (declared in
tables.py).

Every column comes from an event (no now()), so a rebuild yields identical tables. Limits
(LimitsSet) have no read model here: admission folds them from the stream itself."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from decimal import Decimal

import asyncpg

from events.control import (
    ApiKeyIssued,
    ApiKeyRevoked,
    PricePlanSet,
    SkuPublished,
    SkuRetired,
    TenantCreated,
    TenantLabelsSet,
    TenantReactivated,
    TenantSuspended,
    control_stream_name,
    decode_control_or_skip,
)
from events.projections.runner import Entry
from events.projections.tables import (
    ApiKeyRow,
    PricePlanRow,
    SkuRow,
    TenantRow,
    ddl,
    table_names,
)
from events.store import StreamLayout

log = logging.getLogger(__name__)

TABLES = (TenantRow, ApiKeyRow, SkuRow, PricePlanRow)


class ReadModelsProjection:
    name = "read_models"
    tables = table_names(*TABLES)
    # tenant_limits was a read model of LimitsSet that nothing read: an older database drops it.
    ddl = ddl(*TABLES) + "DROP TABLE IF EXISTS tenant_limits;\n"

    def stream(self, layout: StreamLayout) -> str:
        return control_stream_name(layout.prefix)

    async def apply(self, conn: asyncpg.Connection, batch: Sequence[Entry]) -> None:
        # Control events are few: one statement each keeps the fold obvious.
        for seq, data in batch:
            event = decode_control_or_skip(data, seq, log, "read_models", strict=True)
            if event is not None:
                await self._apply_one(conn, event, seq)

    async def _apply_one(self, conn: asyncpg.Connection, event: object, seq: int) -> None:
        match event:
            case TenantCreated():
                await conn.execute(
                    """INSERT INTO tenants VALUES ($1, $2, 'active', $3::jsonb, NULL, $4, $4, $5)
                       ON CONFLICT (tenant_id) DO NOTHING""",
                    event.tenant_id,
                    event.name,
                    json.dumps(event.labels, sort_keys=True),
                    event.occurred_at,
                    seq,
                )
            case TenantSuspended():
                await _update_tenant(
                    conn, event, seq, "status = 'suspended', suspended_reason = $4", event.reason
                )
            case TenantReactivated():
                await _update_tenant(conn, event, seq, "status = 'active', suspended_reason = NULL")
            case TenantLabelsSet():
                await _update_tenant(
                    conn, event, seq, "labels = $4::jsonb", json.dumps(event.labels, sort_keys=True)
                )
            case ApiKeyIssued():
                await conn.execute(
                    """INSERT INTO api_keys VALUES ($1, $2, $3, $4, $5, $6, $7, NULL, $8)
                       ON CONFLICT (key_id) DO NOTHING""",
                    event.key_id,
                    event.tenant_id,
                    event.key_hash,
                    event.prefix,
                    event.name,
                    list(event.scopes),
                    event.occurred_at,
                    seq,
                )
            case ApiKeyRevoked():
                await conn.execute(
                    "UPDATE api_keys SET revoked_at = $2, version = $3 WHERE key_id = $1",
                    event.key_id,
                    event.occurred_at,
                    seq,
                )
            case SkuPublished():
                await conn.execute(
                    """INSERT INTO skus VALUES ($1, $2, $3, $4, $5::jsonb, $6, 'published', $7, NULL, $8)
                       ON CONFLICT (sku_id) DO UPDATE SET name = EXCLUDED.name, model = EXCLUDED.model,
                         runtime = EXCLUDED.runtime, runtime_config = EXCLUDED.runtime_config,
                         gpu_type = EXCLUDED.gpu_type, status = 'published',
                         published_at = EXCLUDED.published_at, retired_at = NULL,
                         version = EXCLUDED.version""",
                    event.sku_id,
                    event.name,
                    event.model,
                    event.runtime,
                    json.dumps(event.runtime_config, sort_keys=True),
                    event.gpu_type,
                    event.occurred_at,
                    seq,
                )
            case SkuRetired():
                await conn.execute(
                    "UPDATE skus SET status = 'retired', retired_at = $2, version = $3 WHERE sku_id = $1",
                    event.sku_id,
                    event.occurred_at,
                    seq,
                )
            case PricePlanSet():
                await conn.execute(
                    """INSERT INTO price_plans VALUES ($1, $2, $3::numeric, $4::numeric, $5::numeric, $6, $7, $8, $9)
                       ON CONFLICT (plan_id) DO NOTHING""",
                    event.plan_id,
                    event.sku_id,
                    Decimal(event.input_per_mtok),
                    Decimal(event.cached_input_per_mtok),
                    Decimal(event.output_per_mtok),
                    event.currency,
                    event.effective_from,
                    event.occurred_at,
                    seq,
                )


async def _update_tenant(
    conn: asyncpg.Connection,
    event: TenantSuspended | TenantReactivated | TenantLabelsSet,
    seq: int,
    assignments: str,
    *values: object,
) -> None:
    """Set `assignments` (parameters from $4 on: `values`) on the event's tenant, with the
    time and version of the change."""
    await conn.execute(
        f"UPDATE tenants SET {assignments}, updated_at = $2, version = $3 WHERE tenant_id = $1",
        event.tenant_id,
        event.occurred_at,
        seq,
        *values,
    )
