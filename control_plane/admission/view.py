"""The governance view: tenants, API keys, SKUs and price plans held in memory (and every
aggregate's version, limits included: admission keeps the limits themselves), built
by replaying the control stream and then following it live (an ordered consumer).

The data plane authorizes every request against it, so the hot path never waits on
Postgres. Writers use it too: an aggregate's `version` (the stream sequence of its last
event) is the expected version of the next append."""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any, Literal, TypeVar

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy

from events.control import (
    Aggregate,
    AnyControlEvent,
    ApiKeyIssued,
    ApiKeyRevoked,
    LimitsSet,
    PricePlanSet,
    SkuPublished,
    SkuRetired,
    TenantCreated,
    TenantLabelsSet,
    TenantReactivated,
    TenantSuspended,
    aggregate_of,
    decode_control_or_skip,
)
from events.nats_cluster import unsubscribe_within
from events.store import StreamLayout

log = logging.getLogger(__name__)

_Row = TypeVar("_Row", bound=msgspec.Struct)


def _from_event(row: type[_Row], event: AnyControlEvent, **rest: Any) -> _Row:
    """A view row from the event's fields of the same names, plus `rest` (the view's own
    fields, and copies of the event's mutable ones)."""
    copied = {n: getattr(event, n) for n in row.__struct_fields__ if n in event.__struct_fields__}
    return row(**(copied | rest))


class Tenant(msgspec.Struct, frozen=True, kw_only=True):
    tenant_id: str
    name: str
    status: Literal["active", "suspended"]
    labels: dict[str, str]
    created_at: datetime
    updated_at: datetime
    suspended_reason: str | None = None
    version: int

    @property
    def active(self) -> bool:
        return self.status == "active"


class ApiKey(msgspec.Struct, frozen=True, kw_only=True):
    key_id: str
    tenant_id: str
    key_hash: str
    prefix: str
    name: str | None
    scopes: list[str]
    created_at: datetime
    revoked_at: datetime | None = None
    version: int

    @property
    def active(self) -> bool:
        return self.revoked_at is None

    def allows(self, sku_name: str) -> bool:
        return not self.scopes or sku_name in self.scopes


class Sku(msgspec.Struct, frozen=True, kw_only=True):
    sku_id: str
    name: str
    model: str
    runtime: str
    runtime_config: dict[str, Any]
    gpu_type: str
    status: Literal["published", "retired"]
    published_at: datetime
    retired_at: datetime | None = None
    version: int

    @property
    def active(self) -> bool:
        return self.status == "published"


class PricePlan(msgspec.Struct, frozen=True, kw_only=True):
    plan_id: str
    sku_id: str
    input_per_mtok: str
    cached_input_per_mtok: str
    output_per_mtok: str
    currency: str
    effective_from: datetime
    recorded_at: datetime
    seq: int


Listener = Callable[[AnyControlEvent, int], None]


class GovernanceView:
    def __init__(self, js: JetStreamContext, layout: StreamLayout) -> None:
        self.js = js
        self.layout = layout
        self.seq = 0  # stream sequence of the last applied event
        self._tenants: dict[str, Tenant] = {}
        self._keys: dict[str, ApiKey] = {}
        self._keys_by_hash: dict[str, ApiKey] = {}
        self._skus: dict[str, Sku] = {}
        self._skus_by_name: dict[str, Sku] = {}
        self._plans: dict[str, list[PricePlan]] = {}  # per SKU, ordered by effective_from
        self._versions: dict[tuple[str, str], int] = {}
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._listeners: list[Listener] = []
        self._sub: Subscription | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, within: float = 30.0) -> None:
        """Replay the control stream, return once caught up, then keep following it."""
        self._sub = await self.js.subscribe(
            f"{self.layout.prefix}.ctl.>",
            stream=self.layout.control_stream,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL,
            cb=self._on_msg,
            idle_heartbeat=2.0,
        )
        await self.sync(within)

    async def stop(self) -> None:
        if self._sub is not None:
            await unsubscribe_within(self._sub)
            self._sub = None
        for _, fut in self._waiters:
            fut.cancel()
        self._waiters.clear()

    async def _on_msg(self, msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        if seq <= self.seq:
            return
        event = decode_control_or_skip(msg.data, seq, log, "governance view")
        if event is None:  # not a governance event: skip it, keep following
            self._advance(seq)
            return
        self.apply(event, seq)

    # -- catching up -----------------------------------------------------------------------

    async def wait_for(self, seq: int, within: float = 10.0) -> None:
        """Return once every event up to stream sequence `seq` is applied."""
        if self.seq >= seq:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (seq, fut)
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(fut, within)
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)

    async def sync(self, within: float = 10.0) -> int:
        """Catch up to the control stream's head as of now; returns that sequence."""
        head = int((await self.js.stream_info(self.layout.control_stream)).state.last_seq)
        await self.wait_for(head, within)
        return head

    def on_change(self, listener: Listener) -> None:
        """Call `listener(event, seq)` after each applied event (e.g. to drop a revoked key's
        open streams). Listeners must be quick and must not raise."""
        self._listeners.append(listener)

    def _advance(self, seq: int) -> None:
        self.seq = seq
        if self._waiters:
            for entry in [w for w in self._waiters if w[0] <= seq]:
                self._waiters.remove(entry)
                if not entry[1].done():
                    entry[1].set_result(None)

    # -- reads (the hot path) --------------------------------------------------------------

    def tenant(self, tenant_id: str) -> Tenant | None:
        return self._tenants.get(tenant_id)

    def tenants(self) -> list[Tenant]:
        return list(self._tenants.values())

    def key(self, key_id: str) -> ApiKey | None:
        return self._keys.get(key_id)

    def key_by_hash(self, key_hash: str) -> ApiKey | None:
        return self._keys_by_hash.get(key_hash)

    def keys_of(self, tenant_id: str) -> list[ApiKey]:
        return [k for k in self._keys.values() if k.tenant_id == tenant_id]

    def sku(self, sku_id: str) -> Sku | None:
        return self._skus.get(sku_id)

    def sku_by_name(self, name: str) -> Sku | None:
        return self._skus_by_name.get(name)

    def skus(self) -> list[Sku]:
        return list(self._skus.values())

    def price_plans(self, sku_id: str) -> list[PricePlan]:
        """The SKU's price history, ordered by effective_from."""
        return list(self._plans.get(sku_id, ()))

    def price_plan_at(self, sku_id: str, at: datetime) -> PricePlan | None:
        """The plan in force at `at`: the latest one whose effective_from is not after it."""
        plans = self._plans.get(sku_id, [])
        i = bisect.bisect_right([p.effective_from for p in plans], at)
        return plans[i - 1] if i else None

    def version(self, aggregate: Aggregate, aggregate_id: str) -> int:
        """Sequence of the aggregate's last event; 0 if it has none."""
        return self._versions.get((aggregate, aggregate_id), 0)

    # -- the fold --------------------------------------------------------------------------

    def apply(self, event: AnyControlEvent, seq: int) -> None:
        at = event.occurred_at
        match event:
            case TenantCreated():
                self._tenants[event.tenant_id] = _from_event(
                    Tenant,
                    event,
                    status="active",
                    labels=dict(event.labels),
                    created_at=at,
                    updated_at=at,
                    version=seq,
                )
            case TenantSuspended() | TenantReactivated() | TenantLabelsSet():
                self._update_tenant(event, seq)
            case ApiKeyIssued():
                key = _from_event(
                    ApiKey, event, scopes=list(event.scopes), created_at=at, version=seq
                )
                self._put_key(key)
            case ApiKeyRevoked():
                old = self._keys.get(event.key_id)
                if old is not None:
                    self._put_key(msgspec.structs.replace(old, revoked_at=at, version=seq))
            case SkuPublished():
                prev = self._skus.get(event.sku_id)
                sku = _from_event(
                    Sku,
                    event,
                    runtime_config=dict(event.runtime_config),
                    status="published",
                    published_at=at,
                    version=seq,
                )
                if prev is not None and prev.name != sku.name:
                    self._skus_by_name.pop(prev.name, None)
                self._skus[sku.sku_id] = self._skus_by_name[sku.name] = sku
            case SkuRetired():
                old_sku = self._skus.get(event.sku_id)
                if old_sku is not None:
                    sku = msgspec.structs.replace(
                        old_sku, status="retired", retired_at=at, version=seq
                    )
                    self._skus[sku.sku_id] = self._skus_by_name[sku.name] = sku
            case PricePlanSet():
                plan = _from_event(PricePlan, event, recorded_at=at, seq=seq)
                plans = self._plans.setdefault(event.sku_id, [])
                # Equal effective_from: the later record wins (it sorts after).
                i = bisect.bisect_right([p.effective_from for p in plans], plan.effective_from)
                plans.insert(i, plan)
            case LimitsSet():
                pass  # admission keeps the limits in force (admission.limits); here: version
        self._versions[aggregate_of(event)] = seq
        self._advance(seq)
        for listener in self._listeners:
            try:
                listener(event, seq)
            except Exception:
                log.exception("governance listener failed")

    def _update_tenant(
        self, event: TenantSuspended | TenantReactivated | TenantLabelsSet, seq: int
    ) -> None:
        old = self._tenants.get(event.tenant_id)
        if old is None:
            return
        at = event.occurred_at
        if isinstance(event, TenantSuspended):
            new = msgspec.structs.replace(old, status="suspended", suspended_reason=event.reason)
        elif isinstance(event, TenantReactivated):
            new = msgspec.structs.replace(old, status="active", suspended_reason=None)
        else:
            new = msgspec.structs.replace(old, labels=dict(event.labels))
        self._tenants[event.tenant_id] = msgspec.structs.replace(new, updated_at=at, version=seq)

    def _put_key(self, key: ApiKey) -> None:
        self._keys[key.key_id] = key
        self._keys_by_hash[key.key_hash] = key
