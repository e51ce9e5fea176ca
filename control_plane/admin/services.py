"""Admin commands: check against the governance view (caught up to the stream head), append
one event with the aggregate's version as the expected last subject sequence, and answer from
the view once it has applied the event. A concurrent writer to the same aggregate makes the
append fail: a 409, never a silent overwrite."""

from __future__ import annotations

import hashlib
import secrets
from datetime import UTC, datetime
from decimal import Decimal

import msgspec

from control_plane.admin import schemas as s
from control_plane.admission.view import ApiKey, PricePlan, Sku, Tenant
from control_plane.problems import ProblemError, not_found
from control_plane.services import Services
from events.control import (
    Aggregate,
    AnyControlEvent,
    ApiKeyIssued,
    ApiKeyRevoked,
    PricePlanSet,
    SkuPublished,
    SkuRetired,
    TenantCreated,
    TenantLabelsSet,
    TenantReactivated,
    TenantSuspended,
    new_id,
    sku_id_for,
    tenant_id_for,
)
from events.store import ConcurrencyError

KEY_PREFIX = "tm_"


def hash_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


def new_api_key() -> tuple[str, str]:
    """(plaintext, visible prefix): `tm_<8 hex>_<secret>`; the prefix is `tm_<8 hex>`."""
    prefix = KEY_PREFIX + secrets.token_hex(4)
    return f"{prefix}_{secrets.token_urlsafe(32)}", prefix


def parse_if_match(value: str | None) -> int | None:
    """An `If-Match` header carries the version (ETag) the client read: `"12"`, `W/"12"`, `12`."""
    if value is None:
        return None
    raw = value.strip().removeprefix("W/").strip('"')
    if not raw.isdigit():
        raise ProblemError(
            400, "invalid_if_match", f"If-Match must be a version number, got {value!r}"
        )
    return int(raw)


def check_version(current: int, expected: int | None, what: str) -> None:
    """409 `version_mismatch` unless the client's `If-Match` version (if any) is `current`;
    `what` names the aggregate with its verb ("tenant t1 is", "limits of t1 are")."""
    if expected is not None and expected != current:
        raise ProblemError(
            409,
            "version_mismatch",
            f"{what} at version {current}, not {expected}",
            current_version=current,
        )


def sku_ref(ref: str) -> str:
    """A SKU is addressed by id or by name (ids derive from names)."""
    return ref if ref.startswith("sku_") else sku_id_for(ref)


class AdminCommands:
    def __init__(self, services: Services) -> None:
        self.view = services.view
        self.store = services.store

    async def _append(
        self, event: AnyControlEvent, aggregate: Aggregate, aggregate_id: str, if_match: int | None
    ) -> None:
        current = self.view.version(aggregate, aggregate_id)
        check_version(current, if_match, f"{aggregate} {aggregate_id} is")
        try:
            seq = await self.store.append(event, expected_version=current)
        except ConcurrencyError as e:
            raise ProblemError(
                409,
                "concurrent_write",
                f"{aggregate} {aggregate_id} changed meanwhile; re-read and retry",
            ) from e
        await self.view.wait_for(seq)

    # -- tenants ---------------------------------------------------------------------------

    async def create_tenant(self, body: s.TenantCreate) -> Tenant:
        await self.view.sync()
        # Older tenants have random ids: only the view knows their names.
        same = next((t for t in self.view.tenants() if t.name == body.name), None)
        tenant_id = same.tenant_id if same is not None else tenant_id_for(body.name)
        exists = ProblemError(
            409, "tenant_exists", f"a tenant named {body.name!r} exists", tenant_id=tenant_id
        )
        if same is not None or self.view.tenant(tenant_id) is not None:
            raise exists
        event = TenantCreated(tenant_id=tenant_id, name=body.name, labels=body.labels)
        try:
            seq = await self.store.append(event, expected_version=0)
        except ConcurrencyError as e:  # created meanwhile, under the same derived id
            raise exists from e
        await self.view.wait_for(seq)
        return self._tenant(tenant_id)

    async def suspend_tenant(
        self, tenant_id: str, body: s.TenantSuspend | None, if_match: int | None
    ) -> Tenant:
        await self.view.sync()
        if self._tenant(tenant_id).status == "suspended":
            raise ProblemError(409, "tenant_suspended", f"tenant {tenant_id} is already suspended")
        event = TenantSuspended(tenant_id=tenant_id, reason=body.reason if body else None)
        await self._append(event, "tenant", tenant_id, if_match)
        return self._tenant(tenant_id)

    async def reactivate_tenant(self, tenant_id: str, if_match: int | None) -> Tenant:
        await self.view.sync()
        if self._tenant(tenant_id).status == "active":
            raise ProblemError(409, "tenant_active", f"tenant {tenant_id} is not suspended")
        await self._append(TenantReactivated(tenant_id=tenant_id), "tenant", tenant_id, if_match)
        return self._tenant(tenant_id)

    async def set_tenant_labels(
        self, tenant_id: str, body: s.TenantLabels, if_match: int | None
    ) -> Tenant:
        await self.view.sync()
        self._tenant(tenant_id)
        await self._append(
            TenantLabelsSet(tenant_id=tenant_id, labels=body.labels), "tenant", tenant_id, if_match
        )
        return self._tenant(tenant_id)

    def _tenant(self, tenant_id: str) -> Tenant:
        tenant = self.view.tenant(tenant_id)
        if tenant is None:
            raise not_found("tenant", tenant_id)
        return tenant

    # -- API keys --------------------------------------------------------------------------

    async def issue_key(self, tenant_id: str, body: s.ApiKeyIssue) -> tuple[ApiKey, str]:
        await self.view.sync()
        self._tenant(tenant_id)
        unknown = [name for name in body.scopes if self.view.sku_by_name(name) is None]
        if unknown:
            raise ProblemError(
                422, "unknown_sku", f"scopes name unknown SKUs: {', '.join(unknown)}"
            )
        plaintext, prefix = new_api_key()
        key_id = new_id("key")
        event = ApiKeyIssued(
            key_id=key_id,
            tenant_id=tenant_id,
            key_hash=hash_key(plaintext),
            prefix=prefix,
            name=body.name,
            scopes=sorted(set(body.scopes)),
        )
        await self._append(event, "key", key_id, None)
        return self._key(tenant_id, key_id), plaintext

    async def revoke_key(
        self, tenant_id: str, key_id: str, body: s.ApiKeyRevoke | None, if_match: int | None
    ) -> ApiKey:
        await self.view.sync()
        if self._key(tenant_id, key_id).revoked_at is not None:
            raise ProblemError(409, "key_revoked", f"key {key_id} is already revoked")
        event = ApiKeyRevoked(
            key_id=key_id, tenant_id=tenant_id, reason=body.reason if body else None
        )
        await self._append(event, "key", key_id, if_match)
        return self._key(tenant_id, key_id)

    def _key(self, tenant_id: str, key_id: str) -> ApiKey:
        key = self.view.key(key_id)
        if key is None or key.tenant_id != tenant_id:
            raise not_found("api_key", key_id)
        return key

    # -- SKUs and price plans --------------------------------------------------------------

    async def publish_sku(self, body: s.SkuPublish) -> Sku:
        await self.view.sync()
        sku_id = sku_id_for(body.name)
        existing = self.view.sku(sku_id)
        if existing is not None and existing.active:
            raise ProblemError(
                409, "sku_exists", f"SKU {body.name!r} is already published", sku_id=sku_id
            )
        event = SkuPublished(sku_id=sku_id, **msgspec.structs.asdict(body))
        await self._append(event, "sku", sku_id, None)
        return self._sku(sku_id)

    async def retire_sku(self, ref: str, if_match: int | None) -> Sku:
        await self.view.sync()
        sku_id = sku_ref(ref)
        if not self._sku(sku_id).active:
            raise ProblemError(409, "sku_retired", f"SKU {ref} is already retired")
        await self._append(SkuRetired(sku_id=sku_id), "sku", sku_id, if_match)
        return self._sku(sku_id)

    async def set_price_plan(self, ref: str, body: s.PricePlanCreate) -> PricePlan:
        await self.view.sync()
        sku_id = sku_ref(ref)
        self._sku(sku_id)
        plan_id = new_id("plan")
        event = PricePlanSet(
            plan_id=plan_id,
            sku_id=sku_id,
            input_per_mtok=str(Decimal(body.input_per_mtok)),
            cached_input_per_mtok=str(Decimal(body.cached_input_per_mtok)),
            output_per_mtok=str(Decimal(body.output_per_mtok)),
            currency=body.currency,
            effective_from=(body.effective_from or datetime.now(UTC)).astimezone(UTC),
        )
        await self._append(event, "price", sku_id, None)
        return next(p for p in self.view.price_plans(sku_id) if p.plan_id == plan_id)

    def _sku(self, sku_id: str) -> Sku:
        sku = self.view.sku(sku_id)
        if sku is None:
            raise not_found("sku", sku_id)
        return sku
