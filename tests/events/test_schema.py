"""The read models' schema as created from the SQLModel declarations (events/projections/
tables.py), checked against the catalog of a real Postgres: every table, column (order, type,
nullability, default) and index, as the hand-written DDL had them."""

from __future__ import annotations

import asyncpg
from sqlmodel import select

from events.projections import all_projections, ensure_schema
from events.projections.tables import TenantRow, compiled, fetch, fetch_one
from events.projections.usage_ledger import UsageLedgerProjection
from pricing.store import BillingStore

_COLUMNS = """
SELECT c.relname AS table, a.attname AS name, format_type(a.atttypid, a.atttypmod) AS type,
       a.attnotnull AS not_null, pg_get_expr(d.adbin, d.adrelid) AS dflt
FROM pg_attribute a
JOIN pg_class c ON c.oid = a.attrelid
JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = 'public'
LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
WHERE c.relkind = 'r' AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY c.relname, a.attnum"""
_INDEXES = "SELECT indexdef FROM pg_indexes WHERE schemaname = 'public' ORDER BY indexname"

EXPECTED_COLUMNS = {
    "api_keys": [
        "key_id text NOT NULL",
        "tenant_id text NOT NULL",
        "key_hash text NOT NULL",
        "prefix text NOT NULL",
        "name text",
        "scopes text[] NOT NULL DEFAULT '{}'::text[]",
        "created_at timestamp with time zone NOT NULL",
        "revoked_at timestamp with time zone",
        "version bigint NOT NULL",
    ],
    "billing_positions": [
        "job text NOT NULL",
        "last_seq bigint NOT NULL",
        "updated_at timestamp with time zone NOT NULL",
    ],
    "billing_reports": [
        "kind text NOT NULL",
        "window_end timestamp with time zone NOT NULL",
        "window_start timestamp with time zone NOT NULL",
        "generated_at timestamp with time zone NOT NULL",
        "ok boolean NOT NULL",
        "document jsonb NOT NULL",
    ],
    "capacity_projections": [
        "sku_id text NOT NULL",
        "computed_at timestamp with time zone NOT NULL",
        "document jsonb NOT NULL",
    ],
    "gateway_deliveries": [
        "request_id text NOT NULL",
        "tenant_id text NOT NULL",
        "key_id text NOT NULL",
        "sku_id text NOT NULL",
        "gateway_id text NOT NULL",
        "prompt_tokens integer NOT NULL",
        "completion_tokens integer NOT NULL",
        "finish_reason text NOT NULL",
        "client_disconnected boolean NOT NULL",
        "finished_at timestamp with time zone NOT NULL",
        "stream_seq bigint NOT NULL",
        "worker_lost boolean NOT NULL DEFAULT false",
    ],
    "invoices": [
        "invoice_id text NOT NULL",
        "tenant_id text NOT NULL",
        "period_start timestamp with time zone NOT NULL",
        "period_end timestamp with time zone NOT NULL",
        "currency text NOT NULL",
        "cut_seq bigint NOT NULL",
        "total numeric NOT NULL",
        "status text NOT NULL",
        "finalized_at timestamp with time zone",
        "digest text NOT NULL",
        "document text NOT NULL",
        "seq bigint NOT NULL",
    ],
    "price_plans": [
        "plan_id text NOT NULL",
        "sku_id text NOT NULL",
        "input_per_mtok numeric NOT NULL",
        "cached_input_per_mtok numeric NOT NULL",
        "output_per_mtok numeric NOT NULL",
        "currency text NOT NULL",
        "effective_from timestamp with time zone NOT NULL",
        "recorded_at timestamp with time zone NOT NULL",
        "seq bigint NOT NULL",
    ],
    "projection_dead_letters": [
        "id bigint NOT NULL DEFAULT nextval('projection_dead_letters_id_seq'::regclass)",
        "projection text NOT NULL",
        "stream text NOT NULL",
        "stream_seq bigint NOT NULL",
        "subject text NOT NULL",
        "error text NOT NULL",
        "payload bytea NOT NULL",
        "first_seen timestamp with time zone NOT NULL DEFAULT now()",
        "resolved_at timestamp with time zone",
        "resolution text",
    ],
    "projection_positions": [
        "projection text NOT NULL",
        "stream text NOT NULL",
        "last_seq bigint NOT NULL",
        "updated_at timestamp with time zone NOT NULL DEFAULT now()",
    ],
    "skus": [
        "sku_id text NOT NULL",
        "name text NOT NULL",
        "model text NOT NULL",
        "runtime text NOT NULL",
        "runtime_config jsonb NOT NULL DEFAULT '{}'::jsonb",
        "gpu_type text NOT NULL",
        "status text NOT NULL",
        "published_at timestamp with time zone NOT NULL",
        "retired_at timestamp with time zone",
        "version bigint NOT NULL",
    ],
    "tenants": [
        "tenant_id text NOT NULL",
        "name text NOT NULL",
        "status text NOT NULL",
        "labels jsonb NOT NULL DEFAULT '{}'::jsonb",
        "suspended_reason text",
        "created_at timestamp with time zone NOT NULL",
        "updated_at timestamp with time zone NOT NULL",
        "version bigint NOT NULL",
    ],
    "usage_ledger": [
        "request_id text NOT NULL",
        "tenant_id text NOT NULL",
        "key_id text NOT NULL",
        "sku_id text NOT NULL",
        "model text NOT NULL",
        "worker_id text NOT NULL",
        "prompt_tokens integer NOT NULL",
        "cached_tokens integer NOT NULL",
        "completion_tokens integer NOT NULL",
        "finish_reason text NOT NULL",
        "ttft_ms double precision",
        "e2e_ms double precision NOT NULL",
        "started_at timestamp with time zone NOT NULL",
        "finished_at timestamp with time zone NOT NULL",
        "stream_seq bigint NOT NULL",
        "unbilled_waste_tokens integer NOT NULL DEFAULT 0",
    ],
    "usage_rollups": [
        "bucket_start timestamp with time zone NOT NULL",
        "tenant_id text NOT NULL",
        "key_id text NOT NULL",
        "sku_id text NOT NULL",
        "model text NOT NULL",
        "requests bigint NOT NULL",
        "cancelled bigint NOT NULL",
        "prompt_tokens bigint NOT NULL",
        "cached_tokens bigint NOT NULL",
        "completion_tokens bigint NOT NULL",
    ],
    "worker_generations": [
        "request_id text NOT NULL",
        "tenant_id text NOT NULL",
        "sku_id text NOT NULL",
        "worker_id text NOT NULL",
        "prompt_tokens integer NOT NULL",
        "cached_tokens integer NOT NULL",
        "completion_tokens integer NOT NULL",
        "finish_reason text NOT NULL",
        "gateway_lost boolean NOT NULL",
        "finished_at timestamp with time zone NOT NULL",
        "stream_seq bigint NOT NULL",
        "gateway_id text NOT NULL DEFAULT ''::text",
    ],
}
EXPECTED_INDEXES = [
    "UNIQUE INDEX api_keys_key_hash_key ON api_keys (key_hash)",
    "UNIQUE INDEX api_keys_pkey ON api_keys (key_id)",
    "INDEX api_keys_tenant ON api_keys (tenant_id)",
    "UNIQUE INDEX billing_positions_pkey ON billing_positions (job)",
    "UNIQUE INDEX billing_reports_pkey ON billing_reports (kind, window_end)",
    "UNIQUE INDEX capacity_projections_pkey ON capacity_projections (sku_id)",
    "UNIQUE INDEX gateway_deliveries_pkey ON gateway_deliveries (request_id)",
    "UNIQUE INDEX invoices_pkey ON invoices (invoice_id)",
    "INDEX invoices_tenant_period ON invoices (tenant_id, period_start)",
    "UNIQUE INDEX price_plans_pkey ON price_plans (plan_id)",
    "INDEX price_plans_sku ON price_plans (sku_id, effective_from, seq)",
    "UNIQUE INDEX projection_dead_letters_pkey ON projection_dead_letters (id)",
    "UNIQUE INDEX projection_dead_letters_projection_stream_seq_key ON projection_dead_letters (projection, stream_seq)",
    "UNIQUE INDEX projection_positions_pkey ON projection_positions (projection)",
    "UNIQUE INDEX skus_name_key ON skus (name)",
    "UNIQUE INDEX skus_pkey ON skus (sku_id)",
    "UNIQUE INDEX tenants_pkey ON tenants (tenant_id)",
    "UNIQUE INDEX usage_ledger_pkey ON usage_ledger (request_id)",
    "INDEX usage_ledger_tenant_time ON usage_ledger (tenant_id, finished_at)",
    "UNIQUE INDEX usage_rollups_pkey ON usage_rollups (bucket_start, tenant_id, key_id, sku_id, model)",
    "UNIQUE INDEX worker_generations_pkey ON worker_generations (request_id)",
]


async def _schema(conn: asyncpg.Connection) -> tuple[dict[str, list[str]], list[str]]:
    columns: dict[str, list[str]] = {}
    for r in await conn.fetch(_COLUMNS):
        parts = [r["name"], r["type"], "NOT NULL" if r["not_null"] else "", ""]
        if r["dflt"] is not None:
            parts[3] = f"DEFAULT {r['dflt']}"
        columns.setdefault(r["table"], []).append(" ".join(p for p in parts if p))
    indexes = [
        r["indexdef"].replace("public.", "").replace("CREATE ", "").replace(" USING btree", "")
        for r in await conn.fetch(_INDEXES)
    ]
    return columns, indexes


async def _create_everything(database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        await ensure_schema(conn, all_projections())
    finally:
        await conn.close()
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=1)
    try:
        await BillingStore(pool).ensure_schema()
    finally:
        await pool.close()


async def test_created_schema_has_the_tables_columns_and_indexes(database_url: str) -> None:
    await _create_everything(database_url)
    await _create_everything(database_url)  # idempotent
    conn = await asyncpg.connect(database_url)
    try:
        columns, indexes = await _schema(conn)
    finally:
        await conn.close()
    assert columns == EXPECTED_COLUMNS
    assert indexes == EXPECTED_INDEXES


# The columns added to the usage tables after they were first deployed.
ADDED_COLUMNS = {
    "usage_ledger": ("unbilled_waste_tokens",),
    "gateway_deliveries": ("worker_lost",),
    "worker_generations": ("gateway_id",),
}


async def test_an_older_database_catches_up(database_url: str) -> None:
    """Tables created before a column was added get it; the retired tenant_limits goes."""
    conn = await asyncpg.connect(database_url)
    try:
        old = {
            name: [c for c in cols if c.split()[0] not in ADDED_COLUMNS.get(name, ())]
            for name, cols in EXPECTED_COLUMNS.items()
            if name in UsageLedgerProjection.tables
        }
        for name, cols in old.items():
            await conn.execute(f"CREATE TABLE {name} ({', '.join(cols)}, PRIMARY KEY (request_id))")
        await conn.execute(
            "CREATE TABLE tenant_limits (tenant_id text, sku_id text, PRIMARY KEY (tenant_id, sku_id))"
        )
        await conn.execute(
            "INSERT INTO gateway_deliveries VALUES ('r', 't', 'k', 's', 'g', 1, 1, 'stop', false, now(), 1)"
        )
    finally:
        await conn.close()
    await _create_everything(database_url)
    conn = await asyncpg.connect(database_url)
    try:
        columns, indexes = await _schema(conn)
        assert await conn.fetchval("SELECT worker_lost FROM gateway_deliveries") is False
    finally:
        await conn.close()
    assert columns == EXPECTED_COLUMNS
    assert indexes == EXPECTED_INDEXES


async def test_typed_reads(database_url: str) -> None:
    """select(...) over a table class answers validated instances (jsonb decoded)."""
    await _create_everything(database_url)
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(
            """INSERT INTO tenants VALUES ('t1', 'acme', 'active', '{"team": "ml"}', NULL, now(), now(), 3),
                                          ('t2', 'globex', 'suspended', '{}', 'unpaid', now(), now(), 4)"""
        )
        query = select(TenantRow).where(TenantRow.status == "active")
        assert compiled(query)[1] == ["active"]
        rows = await fetch(conn, TenantRow, query)
        assert [(r.tenant_id, r.labels, r.version) for r in rows] == [("t1", {"team": "ml"}, 3)]
        assert (
            await fetch_one(conn, TenantRow, select(TenantRow).where(TenantRow.name == "x")) is None
        )
    finally:
        await conn.close()
