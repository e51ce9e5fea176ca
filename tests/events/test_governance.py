"""The in-memory governance view: replay, then follow the control stream live."""

from __future__ import annotations

from datetime import UTC, datetime

from nats.aio.client import Client as NATS

from control_plane.admission.view import GovernanceView
from events.control import (
    ApiKeyIssued,
    ApiKeyRevoked,
    PricePlanSet,
    SkuPublished,
    TenantCreated,
    TenantSuspended,
    sku_id_for,
)
from events.store import EventStore


def _plan(sku_id: str, price: str, month: int) -> PricePlanSet:
    return PricePlanSet(
        plan_id=f"p{month}", sku_id=sku_id, input_per_mtok=price, cached_input_per_mtok="0", output_per_mtok=price,
        currency="USD", effective_from=datetime(2026, month, 1, tzinfo=UTC),
    )  # fmt: skip


async def test_replays_then_follows_live(nc: NATS, store: EventStore) -> None:
    sku_id = sku_id_for("qwen3.6-27b")
    await store.append(TenantCreated(tenant_id="t1", name="acme"), 0)
    await store.append(
        SkuPublished(
            sku_id=sku_id,
            name="qwen3.6-27b",
            model="Qwen/Qwen3.6-27B",
            runtime="tokenmill",
            gpu_type="H200",
        ),
        0,
    )
    await store.append(_plan(sku_id, "0.5", 6), None)
    await store.append(_plan(sku_id, "0.4", 1), None)

    view = GovernanceView(nc.jetstream(), store.layout)
    await view.start()
    try:
        assert view.seq == 4 and view.tenant("t1").active  # type: ignore[union-attr]
        sku = view.sku_by_name("qwen3.6-27b")
        assert sku is not None and sku.sku_id == sku_id and sku.gpu_type == "H200"
        # Plans are ordered by effective_from, whatever order they were recorded in.
        assert [p.input_per_mtok for p in view.price_plans(sku_id)] == ["0.4", "0.5"]
        assert view.price_plan_at(sku_id, datetime(2026, 3, 1, tzinfo=UTC)).plan_id == "p1"  # type: ignore[union-attr]
        assert view.price_plan_at(sku_id, datetime(2026, 7, 1, tzinfo=UTC)).plan_id == "p6"  # type: ignore[union-attr]
        assert view.price_plan_at(sku_id, datetime(2025, 7, 1, tzinfo=UTC)) is None

        seen: list[int] = []
        view.on_change(lambda _event, seq: seen.append(seq))
        seq = await store.append(
            ApiKeyIssued(key_id="k1", tenant_id="t1", key_hash="h1", prefix="tm_1"), 0
        )
        await view.wait_for(seq, within=5)
        assert view.key_by_hash("h1").active and view.version("key", "k1") == seq  # type: ignore[union-attr]
        seq = await store.append(ApiKeyRevoked(key_id="k1", tenant_id="t1"), seq)
        seq2 = await store.append(
            TenantSuspended(tenant_id="t1", reason="unpaid"), view.version("tenant", "t1")
        )
        await view.wait_for(seq2, within=5)
        assert not view.key_by_hash("h1").active  # type: ignore[union-attr]
        assert (
            view.tenant("t1").status == "suspended"
            and view.tenant("t1").suspended_reason == "unpaid"
        )  # type: ignore[union-attr]
        assert seen == [5, 6, 7]
        assert await view.sync() == 7
    finally:
        await view.stop()


async def test_unknown_event_types_and_fields_do_not_stop_the_view(
    nc: NATS, store: EventStore
) -> None:
    js = nc.jetstream()
    prefix = store.layout.prefix
    # A newer writer: an extra field on a known event, and an event type this build lacks.
    await js.publish(
        f"{prefix}.ctl.tenant.t1",
        b'{"type":"tenant.created","tenant_id":"t1","name":"a","event_id":"e1","occurred_at":"2026-01-01T00:00:00Z","tier":"gold"}',
    )
    await js.publish(
        f"{prefix}.ctl.tenant.t1", b'{"type":"tenant.renamed","tenant_id":"t1","name":"b"}'
    )
    await store.append(TenantSuspended(tenant_id="t1"), None)
    view = GovernanceView(js, store.layout)
    await view.start()
    try:
        assert view.seq == 3
        tenant = view.tenant("t1")
        assert tenant is not None and tenant.name == "a" and tenant.status == "suspended"
    finally:
        await view.stop()
