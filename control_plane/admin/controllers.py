"""Admin API routes under /admin/v1 (bearer admin token). Writes answer from the event they
appended (via the governance view); reads come from the Postgres read models, and with
`?consistent=true` first wait until those have caught up with every write so far."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from litestar import Controller, Response, Router, get, post, put
from litestar.datastructures import ResponseHeader
from litestar.params import Parameter

from control_plane.admin import schemas as s
from control_plane.admin.queries import (
    AdminQueries,
    key_fields,
    key_out,
    plan_out,
    sku_out,
    tenant_out,
)
from control_plane.admin.services import AdminCommands, parse_if_match, sku_ref
from control_plane.auth import admin_guard
from control_plane.problems import PROBLEM_HANDLERS, ProblemError, problem_responses
from control_plane.services import Services
from events.validation import INT64_MAX

Limit = Annotated[int, Parameter(ge=1, le=1000, description="page size")]
# Postgres takes OFFSET as a bigint: a larger one is a 400, not a failed query.
Offset = Annotated[int, Parameter(ge=0, le=INT64_MAX)]
Consistent = Annotated[
    bool, Parameter(description="wait until the read models include every write so far")
]
IfMatch = Annotated[
    str | None, Parameter(header="If-Match", description="expected version (ETag) of the resource")
]


# Documented on the routes that send it: the resource's version, for If-Match.
ETAG = [ResponseHeader(name="ETag", description="version of the resource", documentation_only=True)]


def _with_etag(body: Any, version: int, status: int = 200) -> Response[Any]:
    return Response(body, status_code=status, headers={"ETag": f'"{version}"'})


async def _queries(services: Services, consistent: bool) -> AdminQueries:
    if consistent:
        try:
            await services.wait_read_models()
        except TimeoutError as e:
            raise ProblemError(
                503, "read_models_behind", "the read models did not catch up in time"
            ) from e
    return AdminQueries(services.pool)


class TenantController(Controller):
    path = "/tenants"
    tags = ["tenants"]

    @post("/", summary="Create a tenant", responses=problem_responses(409), response_headers=ETAG)
    async def create_tenant(
        self, services: Services, data: s.TenantCreate
    ) -> Response[s.TenantOut]:
        t = await AdminCommands(services).create_tenant(data)
        return _with_etag(tenant_out(t), t.version, 201)

    @get("/", summary="List tenants", responses=problem_responses())
    async def list_tenants(
        self,
        services: Services,
        limit: Limit = 100,
        offset: Offset = 0,
        status: Literal["active", "suspended"] | None = None,
        consistent: Consistent = False,
    ) -> s.TenantPage:
        q = await _queries(services, consistent)
        return s.TenantPage(
            items=await q.tenants(limit, offset, status), limit=limit, offset=offset
        )

    @get(
        "/{tenant_id:str}",
        summary="Get a tenant",
        responses=problem_responses(404),
        response_headers=ETAG,
    )
    async def get_tenant(
        self, services: Services, tenant_id: str, consistent: Consistent = False
    ) -> Response[s.TenantOut]:
        t = await (await _queries(services, consistent)).tenant(tenant_id)
        return _with_etag(t, t.version)

    @post(
        "/{tenant_id:str}/suspend",
        status_code=200,
        summary="Suspend a tenant (its keys stop working)",
        responses=problem_responses(404, 409),
        response_headers=ETAG,
    )
    async def suspend(
        self,
        services: Services,
        tenant_id: str,
        data: s.TenantSuspend | None = None,
        if_match: IfMatch = None,
    ) -> Response[s.TenantOut]:
        t = await AdminCommands(services).suspend_tenant(tenant_id, data, parse_if_match(if_match))
        return _with_etag(tenant_out(t), t.version)

    @post(
        "/{tenant_id:str}/reactivate",
        status_code=200,
        summary="Reactivate a suspended tenant",
        responses=problem_responses(404, 409),
        response_headers=ETAG,
    )
    async def reactivate(
        self, services: Services, tenant_id: str, if_match: IfMatch = None
    ) -> Response[s.TenantOut]:
        t = await AdminCommands(services).reactivate_tenant(tenant_id, parse_if_match(if_match))
        return _with_etag(tenant_out(t), t.version)

    @put(
        "/{tenant_id:str}/labels",
        summary="Replace a tenant's labels",
        responses=problem_responses(404, 409),
        response_headers=ETAG,
    )
    async def set_labels(
        self, services: Services, tenant_id: str, data: s.TenantLabels, if_match: IfMatch = None
    ) -> Response[s.TenantOut]:
        t = await AdminCommands(services).set_tenant_labels(
            tenant_id, data, parse_if_match(if_match)
        )
        return _with_etag(tenant_out(t), t.version)

    @post(
        "/{tenant_id:str}/keys",
        summary="Issue an API key (the plaintext is returned only here)",
        responses=problem_responses(404, 422),
        response_headers=ETAG,
    )
    async def issue_key(
        self, services: Services, tenant_id: str, data: s.ApiKeyIssue | None = None
    ) -> Response[s.ApiKeyIssued]:
        key, plaintext = await AdminCommands(services).issue_key(tenant_id, data or s.ApiKeyIssue())
        return _with_etag(s.ApiKeyIssued(**key_fields(key), key=plaintext), key.version, 201)

    @get(
        "/{tenant_id:str}/keys",
        summary="List a tenant's API keys",
        responses=problem_responses(404),
    )
    async def list_keys(
        self,
        services: Services,
        tenant_id: str,
        limit: Limit = 100,
        offset: Offset = 0,
        consistent: Consistent = False,
    ) -> s.ApiKeyPage:
        q = await _queries(services, consistent)
        return s.ApiKeyPage(
            items=await q.keys(tenant_id, limit, offset), limit=limit, offset=offset
        )

    @post(
        "/{tenant_id:str}/keys/{key_id:str}/revoke",
        status_code=200,
        summary="Revoke an API key",
        responses=problem_responses(404, 409),
        response_headers=ETAG,
    )
    async def revoke_key(
        self,
        services: Services,
        tenant_id: str,
        key_id: str,
        data: s.ApiKeyRevoke | None = None,
        if_match: IfMatch = None,
    ) -> Response[s.ApiKeyOut]:
        key = await AdminCommands(services).revoke_key(
            tenant_id, key_id, data, parse_if_match(if_match)
        )
        return _with_etag(key_out(key), key.version)


class SkuController(Controller):
    path = "/skus"
    tags = ["skus"]

    @post("/", summary="Publish a SKU", responses=problem_responses(409), response_headers=ETAG)
    async def publish_sku(self, services: Services, data: s.SkuPublish) -> Response[s.SkuOut]:
        sku = await AdminCommands(services).publish_sku(data)
        return _with_etag(sku_out(sku), sku.version, 201)

    @get("/", summary="List SKUs", responses=problem_responses())
    async def list_skus(
        self,
        services: Services,
        limit: Limit = 100,
        offset: Offset = 0,
        status: Literal["published", "retired"] | None = None,
        consistent: Consistent = False,
    ) -> s.SkuPage:
        q = await _queries(services, consistent)
        return s.SkuPage(items=await q.skus(limit, offset, status), limit=limit, offset=offset)

    @get(
        "/{sku:str}",
        summary="Get a SKU (by id or name)",
        responses=problem_responses(404),
        response_headers=ETAG,
    )
    async def get_sku(
        self, services: Services, sku: str, consistent: Consistent = False
    ) -> Response[s.SkuOut]:
        out = await (await _queries(services, consistent)).sku(sku_ref(sku))
        return _with_etag(out, out.version)

    @post(
        "/{sku:str}/retire",
        status_code=200,
        summary="Retire a SKU",
        responses=problem_responses(404, 409),
        response_headers=ETAG,
    )
    async def retire_sku(
        self, services: Services, sku: str, if_match: IfMatch = None
    ) -> Response[s.SkuOut]:
        out = await AdminCommands(services).retire_sku(sku, parse_if_match(if_match))
        return _with_etag(sku_out(out), out.version)

    @post(
        "/{sku:str}/price-plans",
        summary="Set a price plan (history is kept)",
        responses=problem_responses(404, 409),
    )
    async def set_price_plan(
        self, services: Services, sku: str, data: s.PricePlanCreate
    ) -> Response[s.PricePlanOut]:
        plan = await AdminCommands(services).set_price_plan(sku, data)
        return Response(plan_out(plan), status_code=201)

    @get(
        "/{sku:str}/price-plans",
        summary="A SKU's price history, by effective_from",
        responses=problem_responses(404),
    )
    async def price_plans(
        self,
        services: Services,
        sku: str,
        limit: Limit = 100,
        offset: Offset = 0,
        consistent: Consistent = False,
    ) -> s.PricePlanPage:
        q = await _queries(services, consistent)
        return s.PricePlanPage(
            items=await q.price_plans(sku_ref(sku), limit, offset), limit=limit, offset=offset
        )


def admin_router(services: Services) -> Router:
    return Router(
        path="/admin/v1",
        route_handlers=[TenantController, SkuController],
        guards=[admin_guard(services.admin_token)],
        exception_handlers=PROBLEM_HANDLERS,
        security=[{"bearer": []}],
        request_max_body_size=services.settings.max_body_bytes,
    )
