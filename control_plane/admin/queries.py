"""Admin reads, from the Postgres read models (and converters from the governance view's
states, which answer the writes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import asyncpg
import msgspec
from sqlmodel import SQLModel, col, select

from control_plane.admin import schemas as s
from control_plane.admission.view import ApiKey, PricePlan, Sku, Tenant
from control_plane.problems import not_found
from events.projections.tables import ApiKeyRow, PricePlanRow, SkuRow, TenantRow, fetch, fetch_one

_Row = TypeVar("_Row", bound=SQLModel)
_Out = TypeVar("_Out")

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

    async def _one(self, table: type[_Row], where: Any, kind: str, ref: str) -> _Row:
        """The row of `table` where `where` holds; a 404 problem naming `kind` `ref` if none."""
        row = await fetch_one(self.pool, table, select(table).where(where))
        if row is None:
            raise not_found(kind, ref)
        return row

    async def _page(
        self, table: type[_Row], query: Any, limit: int, offset: int, out: Callable[[_Row], _Out]
    ) -> list[_Out]:
        """One page of an ordered `select(table)` query, each row as the API answers it."""
        rows = await fetch(self.pool, table, query.limit(limit).offset(offset))
        return [out(r) for r in rows]

    async def tenants(self, limit: int, offset: int, status: str | None) -> list[s.TenantOut]:
        query = select(TenantRow)
        if status is not None:
            query = query.where(TenantRow.status == status)
        query = query.order_by(col(TenantRow.created_at), col(TenantRow.tenant_id))
        return await self._page(TenantRow, query, limit, offset, _tenant_row)

    async def tenant(self, tenant_id: str) -> s.TenantOut:
        row = await self._one(TenantRow, TenantRow.tenant_id == tenant_id, "tenant", tenant_id)
        return _tenant_row(row)

    async def keys(self, tenant_id: str, limit: int, offset: int) -> list[s.ApiKeyOut]:
        await self.tenant(tenant_id)
        query = select(ApiKeyRow).where(ApiKeyRow.tenant_id == tenant_id)
        query = query.order_by(col(ApiKeyRow.created_at), col(ApiKeyRow.key_id))
        return await self._page(ApiKeyRow, query, limit, offset, _key_row)

    async def skus(self, limit: int, offset: int, status: str | None) -> list[s.SkuOut]:
        query = select(SkuRow)
        if status is not None:
            query = query.where(SkuRow.status == status)
        return await self._page(SkuRow, query.order_by(col(SkuRow.name)), limit, offset, _sku_row)

    async def sku(self, sku_id: str) -> s.SkuOut:
        return _sku_row(await self._one(SkuRow, SkuRow.sku_id == sku_id, "sku", sku_id))

    async def price_plans(self, sku_id: str, limit: int, offset: int) -> list[s.PricePlanOut]:
        await self.sku(sku_id)
        query = select(PricePlanRow).where(PricePlanRow.sku_id == sku_id)
        query = query.order_by(col(PricePlanRow.effective_from), col(PricePlanRow.seq))
        return await self._page(PricePlanRow, query, limit, offset, _plan_row)
