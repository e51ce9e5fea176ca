"""Control events: the governed state of the factory (tenants, API keys, SKUs, price plans,
limits) as an append-only log on the control stream, one subject per aggregate.

Every event is a msgspec tagged Struct with a `schema_version`. Evolve only by adding fields
with defaults (old messages then decode unchanged); a breaking change is a new tag."""

from __future__ import annotations

import logging
import secrets
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Literal, get_args

import msgspec

# The aggregates of the control stream; each is a subject token: {prefix}.ctl.<aggregate>.<id>
Aggregate = Literal["tenant", "key", "sku", "price", "limits"]


class ControlEvent(msgspec.Struct, kw_only=True, frozen=True):
    """Fields every control event carries. `event_id` doubles as the JetStream message id."""

    schema_version: int = 1
    event_id: str = msgspec.field(default_factory=lambda: new_id("evt"))
    occurred_at: datetime = msgspec.field(default_factory=lambda: datetime.now(UTC))
    actor: str = "admin"


# -- tenants ---------------------------------------------------------------------------------


class TenantCreated(ControlEvent, tag="tenant.created", kw_only=True, frozen=True):
    tenant_id: str
    name: str
    labels: dict[str, str] = {}


class TenantSuspended(ControlEvent, tag="tenant.suspended", kw_only=True, frozen=True):
    tenant_id: str
    reason: str | None = None


class TenantReactivated(ControlEvent, tag="tenant.reactivated", kw_only=True, frozen=True):
    tenant_id: str


class TenantLabelsSet(ControlEvent, tag="tenant.labels_set", kw_only=True, frozen=True):
    tenant_id: str
    labels: dict[str, str]


# -- API keys --------------------------------------------------------------------------------


class ApiKeyIssued(ControlEvent, tag="api_key.issued", kw_only=True, frozen=True):
    """Only the sha256 of the plaintext key is ever stored; `prefix` identifies it to humans."""

    key_id: str
    tenant_id: str
    key_hash: str
    prefix: str
    name: str | None = None
    # SKU names the key may call; empty means every SKU.
    scopes: list[str] = []


class ApiKeyRevoked(ControlEvent, tag="api_key.revoked", kw_only=True, frozen=True):
    key_id: str
    tenant_id: str
    reason: str | None = None


# -- SKUs ------------------------------------------------------------------------------------


class SkuPublished(ControlEvent, tag="sku.published", kw_only=True, frozen=True):
    """A named, priced offering: a model served by a worker runtime on a GPU type.
    Publishing a retired SKU's name again republishes it (a new version of the aggregate)."""

    sku_id: str
    name: str
    model: str
    runtime: str
    runtime_config: dict[str, Any] = {}
    gpu_type: str


class SkuRetired(ControlEvent, tag="sku.retired", kw_only=True, frozen=True):
    sku_id: str


# -- price plans (one aggregate per SKU; the log is the history) ------------------------------


class PricePlanSet(ControlEvent, tag="price_plan.set", kw_only=True, frozen=True):
    """Prices per 1M tokens as decimal strings (never floats), from `effective_from` on."""

    plan_id: str
    sku_id: str
    input_per_mtok: str
    cached_input_per_mtok: str
    output_per_mtok: str
    currency: str
    effective_from: datetime


# -- limits (one aggregate per tenant) --------------------------------------------------------

QuotaMetric = Literal["total_tokens", "output_tokens"]


class LimitsSet(ControlEvent, tag="limits.set", kw_only=True, frozen=True):
    """Every limit of one scope — (tenant, optional key, optional SKU) — so the latest event of
    a scope is its whole policy. Appended on `{prefix}.ctl.limits.<tenant_id>` (one aggregate
    per tenant, so conflicting edits of a tenant's limits give a 409). `None` means unlimited."""

    tenant_id: str
    sku_id: str | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    token_quota: int | None = None
    quota_period: Literal["day", "month"] = "month"
    # The key this policy narrows to (a key of `tenant_id`); None: the whole tenant.
    key_id: str | None = None
    # What `token_quota` counts: prompt + completion tokens, or completion tokens only.
    quota_metric: QuotaMetric = "total_tokens"
    # Spend cap per quota period, a decimal string in `spend_currency` (the price plans').
    spend_cap: str | None = None
    spend_currency: str | None = None
    # Streams (in-flight requests) open at once.
    max_concurrent_streams: int | None = None

    @property
    def scope_id(self) -> str:
        """The id limits are counted against: the key's when narrowed to a key."""
        return self.key_id or self.tenant_id


AnyControlEvent = (
    TenantCreated
    | TenantSuspended
    | TenantReactivated
    | TenantLabelsSet
    | ApiKeyIssued
    | ApiKeyRevoked
    | SkuPublished
    | SkuRetired
    | PricePlanSet
    | LimitsSet
)


def aggregate_of(event: AnyControlEvent) -> tuple[Aggregate, str]:
    """The aggregate an event belongs to: its subject and its concurrency boundary."""
    match event:
        case TenantCreated() | TenantSuspended() | TenantReactivated() | TenantLabelsSet():
            return "tenant", event.tenant_id
        case ApiKeyIssued() | ApiKeyRevoked():
            return "key", event.key_id
        case SkuPublished() | SkuRetired():
            return "sku", event.sku_id
        case PricePlanSet():
            return "price", event.sku_id
        case LimitsSet():
            return "limits", event.tenant_id
    raise TypeError(f"not a control event: {event!r}")


def control_stream_name(prefix: str) -> str:
    return f"{prefix}_CONTROL"


def control_subject(prefix: str, aggregate: Aggregate, aggregate_id: str) -> str:
    return f"{prefix}.ctl.{aggregate}.{aggregate_id}"


# Bound methods: one encoder and one decoder of the union for the process (the decoder also
# serves decode_control_or_skip).
_decoder = msgspec.json.Decoder(AnyControlEvent)
encode_control: Callable[[AnyControlEvent], bytes] = msgspec.json.Encoder().encode
decode_control: Callable[[bytes], AnyControlEvent] = _decoder.decode


class _Tagged(msgspec.Struct):
    type: str  # msgspec's tag field


_tag_decoder = msgspec.json.Decoder(_Tagged)
_CONTROL_TAGS = frozenset(t.__struct_config__.tag for t in get_args(AnyControlEvent))


def decode_control_or_skip(
    data: bytes, seq: int, log: logging.Logger, reader: str, *, strict: bool = False
) -> AnyControlEvent | None:
    """The event, or None for one to skip. Other parts of the product keep their own event
    types on the control stream (billing's `invoice.finalized`): those are skipped quietly.
    A message of no type, or a malformed one of a known type, is skipped with a warning, or
    with `strict` raises msgspec.DecodeError (a projection then records it as a dead letter)."""
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError:
        try:
            tag: str | None = _tag_decoder.decode(data).type
        except msgspec.DecodeError:
            tag = None
        if tag is not None and tag not in _CONTROL_TAGS:
            log.debug("%s: skipping %s event at seq %d (not a governance event)", reader, tag, seq)
            return None
        if strict:
            raise
        log.warning("%s: skipping undecodable control event at seq %d", reader, seq)
        return None


def new_id(kind: str) -> str:
    """`<kind>_<26 hex>`: sortable by time (uuid7-like), safe as a NATS subject token."""
    ms = int(datetime.now(UTC).timestamp() * 1000)
    return f"{kind}_{ms:012x}{secrets.token_hex(7)}"


def tenant_id_for(name: str) -> str:
    """Tenant ids derive from the name (as SKU ids do), so two creates of one name meet on one
    subject and the second fails its expected version: names stay unique without a race.
    Tenants created before this keep their random `new_id("ten")` ids."""
    return "ten_" + uuid.uuid5(uuid.NAMESPACE_URL, "tokenmill:tenant:" + name).hex[:26]


def sku_id_for(name: str) -> str:
    """SKU ids derive from the name, so two publishes of one name meet on one subject and
    optimistic concurrency, not a race on a uniqueness check, decides."""
    return "sku_" + uuid.uuid5(uuid.NAMESPACE_URL, "tokenmill:sku:" + name).hex[:16]


_limits_decoder = msgspec.json.Decoder(LimitsSet)


def decode_limits(data: bytes) -> LimitsSet:
    """Decode a `limits.set` event (raises msgspec.DecodeError for any other type)."""
    return _limits_decoder.decode(data)
