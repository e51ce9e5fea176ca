"""Request and response bodies of the admin API. Requests forbid unknown fields (a typo is a
400, not a silently ignored setting)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

import msgspec

from control_plane.admission.view import PricePlan, Sku

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
Reason = Annotated[str, msgspec.Meta(max_length=500)]
Labels = Annotated[
    dict[
        Annotated[str, msgspec.Meta(min_length=1, max_length=63)],
        Annotated[str, msgspec.Meta(max_length=255)],
    ],
    msgspec.Meta(max_length=64),
]
# SKU names appear as the OpenAI `model` field: letters, digits and . _ - : /
SkuName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")]
Token = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
Price = Annotated[
    str,
    msgspec.Meta(
        pattern=r"^[0-9]{1,12}(\.[0-9]{1,12})?$", description="decimal string, per 1M tokens"
    ),
]
Currency = Annotated[str, msgspec.Meta(pattern=r"^[A-Z]{3}$", description="ISO 4217 code")]
AwareDatetime = Annotated[datetime, msgspec.Meta(tz=True)]


class Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


# -- requests ----------------------------------------------------------------------------------


class TenantCreate(Strict, kw_only=True):
    name: Name
    labels: Labels = {}


class TenantSuspend(Strict, kw_only=True):
    reason: Reason | None = None


class TenantLabels(Strict, kw_only=True):
    labels: Labels


class ApiKeyIssue(Strict, kw_only=True):
    name: Name | None = None
    # SKU names the key may call; empty: all SKUs.
    scopes: list[SkuName] = []


class ApiKeyRevoke(Strict, kw_only=True):
    reason: Reason | None = None


class SkuPublish(Strict, kw_only=True):
    name: SkuName
    model: Token
    runtime: Token
    runtime_config: dict[str, Any] = {}
    gpu_type: Token


class PricePlanCreate(Strict, kw_only=True):
    input_per_mtok: Price
    cached_input_per_mtok: Price
    output_per_mtok: Price
    currency: Currency = "USD"
    # Default: now. A plan may start in the future; history is never rewritten.
    effective_from: AwareDatetime | None = None


# -- responses ---------------------------------------------------------------------------------


class TenantOut(msgspec.Struct, kw_only=True):
    tenant_id: str
    name: str
    status: Literal["active", "suspended"]
    labels: dict[str, str]
    suspended_reason: str | None
    created_at: datetime
    updated_at: datetime
    version: int


class ApiKeyOut(msgspec.Struct, kw_only=True):
    key_id: str
    tenant_id: str
    prefix: str
    name: str | None
    scopes: list[str]
    status: Literal["active", "revoked"]
    created_at: datetime
    revoked_at: datetime | None
    version: int


class ApiKeyIssued(ApiKeyOut, kw_only=True):
    # The plaintext key: shown once, here; only its sha256 is stored.
    key: str


# A SKU as the governance view holds it; the read model has the same fields.
class SkuOut(Sku, frozen=True, kw_only=True):
    retired_at: datetime | None  # always in the answer (null while published)


# A plan as the governance view holds it; the read model has the same fields. (The answers
# have no docstrings: they would become the schemas' descriptions.)
class PricePlanOut(PricePlan, frozen=True, kw_only=True):
    pass


class Page(msgspec.Struct, kw_only=True):
    items: list[Any]
    limit: int
    offset: int


class TenantPage(Page, kw_only=True):
    items: list[TenantOut]


class ApiKeyPage(Page, kw_only=True):
    items: list[ApiKeyOut]


class SkuPage(Page, kw_only=True):
    items: list[SkuOut]


class PricePlanPage(Page, kw_only=True):
    items: list[PricePlanOut]
