"""HTTP for limits: admin endpoints that set and read limits (problem details on errors),
and the tenant-facing `GET /v1/usage` (OpenAI error objects on errors).

Admin (bearer admin token), under /admin/v1:
    PUT /tenants/{tenant_id}/limits                 body: LimitsBody -> the tenant's policy
    GET /tenants/{tenant_id}/limits                 every policy of the tenant (and its keys)
    PUT /tenants/{tenant_id}/keys/{key_id}/limits   body: LimitsBody -> one key's policy
A PUT replaces the whole policy of its scope (tenant or key, optionally one SKU); fields left
out are unlimited. `If-Match: "<version>"` makes it conditional (409 when stale).

Tenant (bearer API key): GET /v1/usage -> usage this period and what is left, for the caller's
own tenant and key only; the key decides the tenant, so no other tenant's data is reachable.
"""

from __future__ import annotations

import hashlib
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, Literal

import msgspec
from litestar import Request, Response, Router, get, put

from control_plane.admin.controllers import ETAG, IfMatch
from control_plane.admin.services import check_version, parse_if_match
from control_plane.admission.admit import Admission
from control_plane.auth import admin_guard
from control_plane.dataplane import errors
from control_plane.problems import PROBLEM_HANDLERS, ProblemError, not_found, problem_responses
from control_plane.services import Services
from events.control import LimitsSet, QuotaMetric
from events.store import ConcurrencyError
from events.validation import INT64_MAX

# Stored in bigint columns and counted in int64: larger is a 400 naming the field.
Count = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]


class LimitsBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    sku_id: str | None = None
    requests_per_minute: Count | None = None
    tokens_per_minute: Count | None = None
    token_quota: Count | None = None
    quota_metric: QuotaMetric = "total_tokens"
    quota_period: Literal["day", "month"] = "month"
    spend_cap: str | None = None  # decimal string in spend_currency
    spend_currency: str | None = None
    max_concurrent_streams: Count | None = None


def policy_out(p: LimitsSet) -> dict[str, Any]:
    out = msgspec.structs.asdict(p)
    out["occurred_at"] = p.occurred_at.isoformat()
    return out


def limits_write(path: str, summary: str) -> put:
    """A limits write as the API documents it: 200 with the new version as ETag; 404 for an
    unknown tenant or key, 409 for a stale If-Match."""
    return put(
        path,
        status_code=200,
        summary=summary,
        responses=problem_responses(404, 409),
        response_headers=ETAG,
    )


def governance_admin_router(services: Services, admission: Admission) -> Router:
    async def write(
        tenant_id: str, key_id: str | None, body: LimitsBody, if_match: str | None
    ) -> Response[dict[str, Any]]:
        expected = parse_if_match(if_match)
        if services.view.tenant(tenant_id) is None:
            raise not_found("tenant", tenant_id)
        if key_id is not None:
            key = services.view.key(key_id)
            if key is None or key.tenant_id != tenant_id:
                raise not_found("api_key", key_id)
        if body.spend_cap is not None:
            try:
                cap = Decimal(body.spend_cap)
                if not cap.is_finite() or cap < 0 or not body.spend_currency:
                    raise InvalidOperation
            except InvalidOperation as e:
                raise ProblemError(
                    400,
                    "invalid_spend_cap",
                    "spend_cap must be a non-negative decimal string with spend_currency",
                ) from e
        current = services.view.version("limits", tenant_id)
        check_version(current, expected, f"limits of {tenant_id} are")
        event = LimitsSet(tenant_id=tenant_id, key_id=key_id, **msgspec.structs.asdict(body))
        try:
            seq = await services.store.append(event, expected_version=current)
        except ConcurrencyError as e:
            raise ProblemError(
                409, "concurrent_write", "limits changed meanwhile; re-read and retry"
            ) from e
        # read-your-writes: the limits admission enforces, and the version the GET reports
        await admission.limits.position.wait_for(seq, within_s=5.0)
        await services.view.wait_for(seq)
        return Response({"version": seq, "policy": policy_out(event)}, headers={"ETag": f'"{seq}"'})

    @limits_write("/tenants/{tenant_id:str}/limits", "Set a tenant's limits")
    async def put_tenant_limits(
        tenant_id: str, data: LimitsBody, if_match: IfMatch = None
    ) -> Response[dict[str, Any]]:
        return await write(tenant_id, None, data, if_match)

    @limits_write("/tenants/{tenant_id:str}/keys/{key_id:str}/limits", "Set a key's limits")
    async def put_key_limits(
        tenant_id: str, key_id: str, data: LimitsBody, if_match: IfMatch = None
    ) -> Response[dict[str, Any]]:
        return await write(tenant_id, key_id, data, if_match)

    @get(
        "/tenants/{tenant_id:str}/limits",
        summary="A tenant's limits (tenant-wide and per key)",
        responses=problem_responses(404),
        response_headers=ETAG,
    )
    async def get_limits(tenant_id: str) -> Response[dict[str, Any]]:
        if services.view.tenant(tenant_id) is None:
            raise not_found("tenant", tenant_id)
        policies = [p for p in admission.limits.policies.values() if p.tenant_id == tenant_id]
        version = services.view.version("limits", tenant_id)
        body = {
            "tenant_id": tenant_id,
            "version": version,
            "policies": [policy_out(p) for p in policies],
        }
        return Response(body, headers={"ETag": f'"{version}"'})

    return Router(
        path="/admin/v1",
        route_handlers=[put_tenant_limits, put_key_limits, get_limits],
        guards=[admin_guard(services.admin_token)],
        exception_handlers=PROBLEM_HANDLERS,
        security=[{"bearer": []}],
        tags=["limits"],
    )


def _openai_401() -> Response[dict[str, Any]]:
    body = {
        "error": {
            "message": "Incorrect or revoked API key.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    return Response(body, status_code=401)


def usage_router(services: Services, admission: Admission) -> Router:
    @get("/usage", summary="The caller's own usage and remaining quota (bearer API key)")
    async def my_usage(request: Request[Any, Any, Any]) -> Response[dict[str, Any]]:
        scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return _openai_401()
        # keys are stored as the sha256 hex digest of the plaintext (as the gateway hashes)
        key = services.view.key_by_hash(hashlib.sha256(token.strip().encode()).hexdigest())
        if key is None or not key.active:
            return _openai_401()
        tenant = services.view.tenant(key.tenant_id)
        if tenant is None or not tenant.active:  # as the completion routes refuse it
            return Response(msgspec.to_builtins(errors.tenant_suspended().body), status_code=403)
        return Response(admission.usage_report(key.tenant_id, key.key_id))

    return Router(path="/v1", route_handlers=[my_usage])
