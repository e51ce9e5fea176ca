"""Admin reads, from the Postgres read models (and converters from the governance view's
states, which answer the writes)."""

from __future__ import annotations

from typing import Any

import asyncpg
import msgspec
from sqlmodel import col, select

from control_plane.admin import schemas as s
from control_plane.admission.view import ApiKey, PricePlan, Sku, Tenant
from control_plane.problems import not_found
from events.projections.tables import ApiKeyRow, PricePlanRow, SkuRow, TenantRow, fetch, fetch_one

# -- from the view -------------------------------------------------------------------------------


def tenant_out(t: Tenant) -> s.TenantOut:
    return s.TenantOut(**msgspec.structs.asdict(t))


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

# Typed reads: select(...) over the read models' table classes, compiled for asyncpg (no second
# driver, no sync engine). Rows hold the view's fields (prices as numeric), so they convert the
# same way.


def _tenant_row(r: TenantRow) -> s.TenantOut:
    return msgspec.convert(r.model_dump(), s.TenantOut)


def _key_row(r: ApiKeyRow) -> s.ApiKeyOut:
    return key_out(msgspec.convert(r.model_dump(), ApiKey))


def _sku_row(r: SkuRow) -> s.SkuOut:
    return msgspec.convert(r.model_dump(), s.SkuOut)


def _plan_row(r: PricePlanRow) -> s.PricePlanOut:
    prices = {
        "input_per_mtok": str(r.input_per_mtok),
        "cached_input_per_mtok": str(r.cached_input_per_mtok),
        "output_per_mtok": str(r.output_per_mtok),
    }
    return msgspec.convert({**r.model_dump(), **prices}, s.PricePlanOut)


class AdminQueries:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    async def tenants(self, limit: int, offset: int, status: str | None) -> list[s.TenantOut]:
        query = select(TenantRow)
        if status is not None:
            query = query.where(TenantRow.status == status)
        query = query.order_by(col(TenantRow.created_at), col(TenantRow.tenant_id))
        rows = await fetch(self.pool, TenantRow, query.limit(limit).offset(offset))
        return [_tenant_row(r) for r in rows]

    async def tenant(self, tenant_id: str) -> s.TenantOut:
        query = select(TenantRow).where(TenantRow.tenant_id == tenant_id)
        row = await fetch_one(self.pool, TenantRow, query)
        if row is None:
            raise not_found("tenant", tenant_id)
        return _tenant_row(row)

    async def keys(self, tenant_id: str, limit: int, offset: int) -> list[s.ApiKeyOut]:
        await self.tenant(tenant_id)
        query = (
            select(ApiKeyRow)
            .where(ApiKeyRow.tenant_id == tenant_id)
            .order_by(col(ApiKeyRow.created_at), col(ApiKeyRow.key_id))
        )
        rows = await fetch(self.pool, ApiKeyRow, query.limit(limit).offset(offset))
        return [_key_row(r) for r in rows]

    async def skus(self, limit: int, offset: int, status: str | None) -> list[s.SkuOut]:
        query = select(SkuRow)
        if status is not None:
            query = query.where(SkuRow.status == status)
        query = query.order_by(col(SkuRow.name))
        rows = await fetch(self.pool, SkuRow, query.limit(limit).offset(offset))
        return [_sku_row(r) for r in rows]

    async def sku(self, sku_id: str) -> s.SkuOut:
        row = await fetch_one(self.pool, SkuRow, select(SkuRow).where(SkuRow.sku_id == sku_id))
        if row is None:
            raise not_found("sku", sku_id)
        return _sku_row(row)

    async def price_plans(self, sku_id: str, limit: int, offset: int) -> list[s.PricePlanOut]:
        await self.sku(sku_id)
        query = (
            select(PricePlanRow)
            .where(PricePlanRow.sku_id == sku_id)
            .order_by(col(PricePlanRow.effective_from), col(PricePlanRow.seq))
        )
        rows = await fetch(self.pool, PricePlanRow, query.limit(limit).offset(offset))
        return [_plan_row(r) for r in rows]
