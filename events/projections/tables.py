"""The Postgres schema of the read models, declared once as SQLModel table classes.

SQLModel is the design's choice for the read models: one declaration gives both the table DDL
(`ddl()`, CREATE TABLE/INDEX IF NOT EXISTS compiled for Postgres and run through the asyncpg
pool, so there is no second driver) and typed queries (`select(...)` over these classes,
compiled for asyncpg and answered as instances of the class by `fetch()`). The tables:

- control read models (read_models.py): tenants, api_keys, skus, price_plans;
- the usage ledger (usage_ledger.py): usage_ledger, gateway_deliveries, worker_generations;
- the projector's bookkeeping (runner.py, dead_letters.py): projection_positions,
  projection_dead_letters;
- billing (pricing/store.py): invoices, usage_rollups, billing_positions, capacity_projections,
  billing_reports.

Where SQLModel is not used: the writes. The ledger's ingest, the hot path, is asyncpg's COPY
of plain tuples into a staging table and one INSERT ... SELECT (usage_ledger.py says why, with
numbers); the control events' upserts and billing's job writes are one hand-written statement
each. Billing's bulk reads of the ledger (pricing/store.py) are hand-written SQL too. Column
order is therefore part of the schema: positional INSERTs follow the field order of these
classes.

`ddl()` creates only the tables it is given (each owner passes its own), not everything in
`SQLModel.metadata`.

A column added to a table after it was first deployed is marked `added` (its `info`): `ddl()`
also emits `ALTER TABLE ... ADD COLUMN IF NOT EXISTS` for it, so an older database catches up.
"""

from __future__ import annotations

import json
from datetime import datetime
from decimal import Decimal
from typing import Any, TypeVar

import asyncpg
from sqlalchemy import (
    ARRAY,
    BigInteger,
    Boolean,
    DateTime,
    Index,
    Integer,
    LargeBinary,
    Numeric,
    PrimaryKeyConstraint,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import DOUBLE_PRECISION, JSONB
from sqlalchemy.dialects.postgresql.asyncpg import PGDialect_asyncpg
from sqlalchemy.schema import CreateColumn, CreateIndex, CreateTable
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler
from sqlmodel import Field, SQLModel

TIMESTAMPTZ = DateTime(timezone=True)
ADDED = {"added": True}  # Column.info of a column added after the table was first deployed


# -- control read models -------------------------------------------------------------------


class TenantRow(SQLModel, table=True):
    __tablename__ = "tenants"

    tenant_id: str = Field(sa_type=Text, primary_key=True)
    name: str = Field(sa_type=Text)
    status: str = Field(sa_type=Text)
    labels: dict[str, str] = Field(
        default_factory=dict, sa_type=JSONB, sa_column_kwargs={"server_default": "{}"}
    )
    suspended_reason: str | None = Field(default=None, sa_type=Text)
    created_at: datetime = Field(sa_type=TIMESTAMPTZ)
    updated_at: datetime = Field(sa_type=TIMESTAMPTZ)
    version: int = Field(sa_type=BigInteger)


class ApiKeyRow(SQLModel, table=True):
    __tablename__ = "api_keys"
    __table_args__ = (Index("api_keys_tenant", "tenant_id"),)

    key_id: str = Field(sa_type=Text, primary_key=True)
    tenant_id: str = Field(sa_type=Text)
    key_hash: str = Field(sa_type=Text, unique=True)
    prefix: str = Field(sa_type=Text)
    name: str | None = Field(default=None, sa_type=Text)
    scopes: list[str] = Field(
        default_factory=list, sa_type=ARRAY(Text), sa_column_kwargs={"server_default": "{}"}
    )
    created_at: datetime = Field(sa_type=TIMESTAMPTZ)
    revoked_at: datetime | None = Field(default=None, sa_type=TIMESTAMPTZ)
    version: int = Field(sa_type=BigInteger)


class SkuRow(SQLModel, table=True):
    __tablename__ = "skus"

    sku_id: str = Field(sa_type=Text, primary_key=True)
    name: str = Field(sa_type=Text, unique=True)
    model: str = Field(sa_type=Text)
    runtime: str = Field(sa_type=Text)
    runtime_config: dict[str, Any] = Field(
        default_factory=dict, sa_type=JSONB, sa_column_kwargs={"server_default": "{}"}
    )
    gpu_type: str = Field(sa_type=Text)
    status: str = Field(sa_type=Text)
    published_at: datetime = Field(sa_type=TIMESTAMPTZ)
    retired_at: datetime | None = Field(default=None, sa_type=TIMESTAMPTZ)
    version: int = Field(sa_type=BigInteger)


class PricePlanRow(SQLModel, table=True):
    __tablename__ = "price_plans"
    __table_args__ = (Index("price_plans_sku", "sku_id", "effective_from", "seq"),)

    plan_id: str = Field(sa_type=Text, primary_key=True)
    sku_id: str = Field(sa_type=Text)
    input_per_mtok: Decimal = Field(sa_type=Numeric)
    cached_input_per_mtok: Decimal = Field(sa_type=Numeric)
    output_per_mtok: Decimal = Field(sa_type=Numeric)
    currency: str = Field(sa_type=Text)
    effective_from: datetime = Field(sa_type=TIMESTAMPTZ)
    recorded_at: datetime = Field(sa_type=TIMESTAMPTZ)
    seq: int = Field(sa_type=BigInteger)  # control-stream sequence of PricePlanSet


# -- the usage ledger ----------------------------------------------------------------------


class UsageLedgerRow(SQLModel, table=True):
    """One row per request (RequestFinished): the bill."""

    __tablename__ = "usage_ledger"
    __table_args__ = (Index("usage_ledger_tenant_time", "tenant_id", "finished_at"),)

    request_id: str = Field(sa_type=Text, primary_key=True)
    tenant_id: str = Field(sa_type=Text)
    key_id: str = Field(sa_type=Text)
    sku_id: str = Field(sa_type=Text)
    model: str = Field(sa_type=Text)
    worker_id: str = Field(sa_type=Text)
    prompt_tokens: int = Field(sa_type=Integer)
    cached_tokens: int = Field(sa_type=Integer)
    completion_tokens: int = Field(sa_type=Integer)
    finish_reason: str = Field(sa_type=Text)
    ttft_ms: float | None = Field(default=None, sa_type=DOUBLE_PRECISION)
    e2e_ms: float = Field(sa_type=DOUBLE_PRECISION)
    started_at: datetime = Field(sa_type=TIMESTAMPTZ)
    finished_at: datetime = Field(sa_type=TIMESTAMPTZ)
    stream_seq: int = Field(sa_type=BigInteger)
    unbilled_waste_tokens: int = Field(
        default=0, sa_type=Integer, sa_column_kwargs={"server_default": text("0"), "info": ADDED}
    )


class GatewayDeliveryRow(SQLModel, table=True):
    """One row per gateway delivery (GatewayDelivered), for reconciliation."""

    __tablename__ = "gateway_deliveries"

    request_id: str = Field(sa_type=Text, primary_key=True)
    tenant_id: str = Field(sa_type=Text)
    key_id: str = Field(sa_type=Text)
    sku_id: str = Field(sa_type=Text)
    gateway_id: str = Field(sa_type=Text)
    prompt_tokens: int = Field(sa_type=Integer)
    completion_tokens: int = Field(sa_type=Integer)
    finish_reason: str = Field(sa_type=Text)
    client_disconnected: bool = Field(sa_type=Boolean)
    finished_at: datetime = Field(sa_type=TIMESTAMPTZ)
    stream_seq: int = Field(sa_type=BigInteger)
    worker_lost: bool = Field(
        default=False,
        sa_type=Boolean,
        sa_column_kwargs={"server_default": text("false"), "info": ADDED},
    )


class WorkerGenerationRow(SQLModel, table=True):
    """One row per worker generation (WorkerGenerated), for reconciliation."""

    __tablename__ = "worker_generations"

    request_id: str = Field(sa_type=Text, primary_key=True)
    tenant_id: str = Field(sa_type=Text)
    sku_id: str = Field(sa_type=Text)
    worker_id: str = Field(sa_type=Text)
    prompt_tokens: int = Field(sa_type=Integer)
    cached_tokens: int = Field(sa_type=Integer)
    completion_tokens: int = Field(sa_type=Integer)
    finish_reason: str = Field(sa_type=Text)
    gateway_lost: bool = Field(sa_type=Boolean)
    finished_at: datetime = Field(sa_type=TIMESTAMPTZ)
    stream_seq: int = Field(sa_type=BigInteger)
    # The gateway that dispatched it ("" from older workers; see pricing.reconcile.metering).
    gateway_id: str = Field(
        default="", sa_type=Text, sa_column_kwargs={"server_default": text("''"), "info": ADDED}
    )


# -- the projector's bookkeeping -----------------------------------------------------------


class ProjectionPositionRow(SQLModel, table=True):
    """How far each projection has committed (its stream sequence)."""

    __tablename__ = "projection_positions"

    projection: str = Field(sa_type=Text, primary_key=True)
    stream: str = Field(sa_type=Text)
    last_seq: int = Field(sa_type=BigInteger)
    updated_at: datetime = Field(
        sa_type=TIMESTAMPTZ, sa_column_kwargs={"server_default": text("now()")}
    )


class DeadLetterRow(SQLModel, table=True):
    """An event a projection could not apply (dead_letters.py)."""

    __tablename__ = "projection_dead_letters"
    __table_args__ = (UniqueConstraint("projection", "stream_seq"),)

    id: int | None = Field(default=None, sa_type=BigInteger, primary_key=True)  # bigserial
    projection: str = Field(sa_type=Text)
    stream: str = Field(sa_type=Text)
    stream_seq: int = Field(sa_type=BigInteger)
    subject: str = Field(sa_type=Text)
    error: str = Field(sa_type=Text)
    payload: bytes = Field(sa_type=LargeBinary)
    first_seen: datetime = Field(
        sa_type=TIMESTAMPTZ, sa_column_kwargs={"server_default": text("now()")}
    )
    resolved_at: datetime | None = Field(default=None, sa_type=TIMESTAMPTZ)
    resolution: str | None = Field(default=None, sa_type=Text)


# -- billing -------------------------------------------------------------------------------


class InvoiceRow(SQLModel, table=True):
    """A finalized invoice (InvoiceFinalized on the control stream)."""

    __tablename__ = "invoices"
    __table_args__ = (Index("invoices_tenant_period", "tenant_id", "period_start"),)

    invoice_id: str = Field(sa_type=Text, primary_key=True)
    tenant_id: str = Field(sa_type=Text)
    period_start: datetime = Field(sa_type=TIMESTAMPTZ)
    period_end: datetime = Field(sa_type=TIMESTAMPTZ)
    currency: str = Field(sa_type=Text)
    cut_seq: int = Field(sa_type=BigInteger)
    total: Decimal = Field(sa_type=Numeric)
    status: str = Field(sa_type=Text)
    finalized_at: datetime | None = Field(default=None, sa_type=TIMESTAMPTZ)
    digest: str = Field(sa_type=Text)
    document: str = Field(sa_type=Text)  # the exact JSON bytes that were finalized
    seq: int = Field(sa_type=BigInteger)  # control-stream sequence of InvoiceFinalized


class UsageRollupRow(SQLModel, table=True):
    """Tokens and requests per hour x tenant x key x SKU x model."""

    __tablename__ = "usage_rollups"
    __table_args__ = (
        PrimaryKeyConstraint("bucket_start", "tenant_id", "key_id", "sku_id", "model"),
    )

    bucket_start: datetime = Field(sa_type=TIMESTAMPTZ)
    tenant_id: str = Field(sa_type=Text)
    key_id: str = Field(sa_type=Text)
    sku_id: str = Field(sa_type=Text)
    model: str = Field(sa_type=Text)
    requests: int = Field(sa_type=BigInteger)
    cancelled: int = Field(sa_type=BigInteger)
    prompt_tokens: int = Field(sa_type=BigInteger)
    cached_tokens: int = Field(sa_type=BigInteger)
    completion_tokens: int = Field(sa_type=BigInteger)


class BillingPositionRow(SQLModel, table=True):
    """How far each incremental billing job got."""

    __tablename__ = "billing_positions"

    job: str = Field(sa_type=Text, primary_key=True)
    last_seq: int = Field(sa_type=BigInteger)
    updated_at: datetime = Field(sa_type=TIMESTAMPTZ)


class CapacityProjectionRow(SQLModel, table=True):
    """The latest capacity projection per SKU."""

    __tablename__ = "capacity_projections"

    sku_id: str = Field(sa_type=Text, primary_key=True)
    computed_at: datetime = Field(sa_type=TIMESTAMPTZ)
    document: dict[str, Any] = Field(sa_type=JSONB)


class BillingReportRow(SQLModel, table=True):
    """A reconciliation report."""

    __tablename__ = "billing_reports"
    __table_args__ = (PrimaryKeyConstraint("kind", "window_end"),)

    kind: str = Field(sa_type=Text)
    window_end: datetime = Field(sa_type=TIMESTAMPTZ)
    window_start: datetime = Field(sa_type=TIMESTAMPTZ)
    generated_at: datetime = Field(sa_type=TIMESTAMPTZ)
    ok: bool = Field(sa_type=Boolean)
    document: dict[str, Any] = Field(sa_type=JSONB)


# -- DDL -----------------------------------------------------------------------------------

# The same dialect compiles the DDL and the queries: asyncpg's, whose "$n" placeholders are
# what asyncpg takes.
_DIALECT = PGDialect_asyncpg()


def table_of(model: type[SQLModel]) -> Table:
    table = model.__table__  # type: ignore[attr-defined]
    assert isinstance(table, Table)
    return table


def table_names(*models: type[SQLModel]) -> tuple[str, ...]:
    return tuple(table_of(m).name for m in models)


def column_names(model: type[SQLModel]) -> tuple[str, ...]:
    return tuple(c.name for c in table_of(model).columns)


def ddl(*models: type[SQLModel]) -> str:
    """CREATE TABLE / CREATE INDEX IF NOT EXISTS for the models' tables (and ADD COLUMN IF NOT
    EXISTS for their added columns): idempotent, one string of statements for asyncpg's
    execute."""
    statements: list[str] = []
    for model in models:
        table = table_of(model)
        statements.append(str(CreateTable(table, if_not_exists=True).compile(dialect=_DIALECT)))
        for index in sorted(table.indexes, key=lambda i: str(i.name)):
            statements.append(str(CreateIndex(index, if_not_exists=True).compile(dialect=_DIALECT)))
        for column in table.columns:
            if column.info.get("added"):
                spec = CreateColumn(column).compile(dialect=_DIALECT)
                statements.append(f'ALTER TABLE "{table.name}" ADD COLUMN IF NOT EXISTS {spec}')
    return "".join(s.strip() + ";\n" for s in statements)


# -- typed queries -------------------------------------------------------------------------

M = TypeVar("M", bound=SQLModel)


def compiled(query: ClauseElement) -> tuple[str, list[Any]]:
    """The query as SQL for asyncpg and its arguments in placeholder order. Binds plain values
    (no expanding IN lists; the admin reads don't need them)."""
    c = query.compile(dialect=_DIALECT)
    assert isinstance(c, SQLCompiler)
    return str(c), [c.params[name] for name in c.positiontup or ()]


def _jsonb_columns(model: type[SQLModel]) -> frozenset[str]:
    return frozenset(c.name for c in table_of(model).columns if isinstance(c.type, JSONB))


async def fetch(
    db: asyncpg.Connection | asyncpg.Pool, model: type[M], query: ClauseElement
) -> list[M]:
    """Run a `select(model)...` and answer validated instances of `model` (asyncpg returns
    jsonb as text: decoded here)."""
    sql, args = compiled(query)
    jsonb = _jsonb_columns(model)
    return [
        model.model_validate(
            {k: json.loads(v) if k in jsonb and isinstance(v, str) else v for k, v in r.items()}
        )
        for r in await db.fetch(sql, *args)
    ]


async def fetch_one(
    db: asyncpg.Connection | asyncpg.Pool, model: type[M], query: ClauseElement
) -> M | None:
    rows = await fetch(db, model, query)
    return rows[0] if rows else None
