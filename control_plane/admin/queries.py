"""Admin reads, from the Postgres read models (and converters from the governance view's
states, which answer the writes)."""

from __future__ import annotations

import json
from typing import Any

import asyncpg
import msgspec

from control_plane.admin import schemas as s
from control_plane.admission.view import ApiKey, PricePlan, Sku, Tenant
from control_plane.problems import not_found

# -- from the view -------------------------------------------------------------------------------


def tenant_out(t: Tenant) -> s.TenantOut:
    return s.TenantOut(
        tenant_id=t.tenant_id,
        name=t.name,
        status=t.status,
        labels=t.labels,
        suspended_reason=t.suspended_reason,
        created_at=t.created_at,
        updated_at=t.updated_at,
        version=t.version,
    )


def key_fields(k: ApiKey) -> dict[str, Any]:
    return {
        "key_id": k.key_id,
        "tenant_id": k.tenant_id,
        "prefix": k.prefix,
        "name": k.name,
        "scopes": k.scopes,
        "status": "active" if k.revoked_at is None else "revoked",
        "created_at": k.created_at,
        "revoked_at": k.revoked_at,
        "version": k.version,
    }


def key_out(k: ApiKey) -> s.ApiKeyOut:
    return s.ApiKeyOut(**key_fields(k))


def sku_out(k: Sku) -> s.SkuOut:
    return msgspec.convert(msgspec.structs.asdict(k), s.SkuOut)


def plan_out(p: PricePlan) -> s.PricePlanOut:
    return msgspec.convert(msgspec.structs.asdict(p), s.PricePlanOut)


# -- from Postgres -------------------------------------------------------------------------------


# Rows hold the view's fields (jsonb as text, prices as numeric), so they convert the same way.


def _tenant_row(r: asyncpg.Record) -> s.TenantOut:
    return msgspec.convert({**r, "labels": json.loads(r["labels"])}, s.TenantOut)


def _key_row(r: asyncpg.Record) -> s.ApiKeyOut:
    return key_out(msgspec.convert(dict(r), ApiKey))


def _sku_row(r: asyncpg.Record) -> s.SkuOut:
    return msgspec.convert({**r, "runtime_config": json.loads(r["runtime_config"])}, s.SkuOut)


def _plan_row(r: asyncpg.Record) -> s.PricePlanOut:
    prices = ("input_per_mtok", "cached_input_per_mtok", "output_per_mtok")
    return msgspec.convert({**r, **{k: str(r[k]) for k in prices}}, s.PricePlanOut)


class AdminQueries:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    async def tenants(self, limit: int, offset: int, status: str | None) -> list[s.TenantOut]:
        rows = await self.pool.fetch(
            """SELECT * FROM tenants WHERE ($1::text IS NULL OR status = $1)
               ORDER BY created_at, tenant_id LIMIT $2 OFFSET $3""",
            status,
            limit,
            offset,
        )
        return [_tenant_row(r) for r in rows]

    async def tenant(self, tenant_id: str) -> s.TenantOut:
        row = await self.pool.fetchrow("SELECT * FROM tenants WHERE tenant_id = $1", tenant_id)
        if row is None:
            raise not_found("tenant", tenant_id)
        return _tenant_row(row)

    async def keys(self, tenant_id: str, limit: int, offset: int) -> list[s.ApiKeyOut]:
        await self.tenant(tenant_id)
        rows = await self.pool.fetch(
            "SELECT * FROM api_keys WHERE tenant_id = $1 ORDER BY created_at, key_id LIMIT $2 OFFSET $3",
            tenant_id,
            limit,
            offset,
        )
        return [_key_row(r) for r in rows]

    async def skus(self, limit: int, offset: int, status: str | None) -> list[s.SkuOut]:
        rows = await self.pool.fetch(
            """SELECT * FROM skus WHERE ($1::text IS NULL OR status = $1)
               ORDER BY name LIMIT $2 OFFSET $3""",
            status,
            limit,
            offset,
        )
        return [_sku_row(r) for r in rows]

    async def sku(self, sku_id: str) -> s.SkuOut:
        row = await self.pool.fetchrow("SELECT * FROM skus WHERE sku_id = $1", sku_id)
        if row is None:
            raise not_found("sku", sku_id)
        return _sku_row(row)

    async def price_plans(self, sku_id: str, limit: int, offset: int) -> list[s.PricePlanOut]:
        await self.sku(sku_id)
        rows = await self.pool.fetch(
            """SELECT * FROM price_plans WHERE sku_id = $1
               ORDER BY effective_from, seq LIMIT $2 OFFSET $3""",
            sku_id,
            limit,
            offset,
        )
        return [_plan_row(r) for r in rows]
