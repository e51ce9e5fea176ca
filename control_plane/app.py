"""The Litestar app factory.

`create_app(services, extensions=...)` mounts the admin API, health and OpenAPI; everything
else (the `/v1` data plane, metrics, the operator's page) plugs in as an `Extension`: route
handlers, plugins, and async context managers that run while the app serves (`lifespan`) or
only under `tokenmill up` (`up_hooks`: demo data, a CPU worker). Shared resources live on
the explicit `Services` object, handed to every extension and injected into handlers as
`services`."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from litestar import Litestar
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import Components, SecurityScheme
from litestar.plugins import PluginProtocol
from litestar.types import ControllerRouterHandler

from control_plane.admin.controllers import admin_router
from control_plane.health import healthz, readyz
from control_plane.problems import PROBLEM_HANDLERS
from control_plane.services import Services
from tokenmill.modules import installed_modules
from tokenmill.settings import Settings

log = logging.getLogger("tokenmill")

ServicesHook = Callable[[Services], AbstractAsyncContextManager[None]]

# Modules that may contribute an Extension: each may define
# `tokenmill_extension(services: Services) -> Extension | None`.
EXTENSION_MODULES = (
    "control_plane.dataplane",
    "control_plane.admission",
    "control_plane.observability",
    "pricing",
)


@dataclass
class Extension:
    name: str
    route_handlers: Sequence[ControllerRouterHandler] = ()
    plugins: Sequence[PluginProtocol] = ()
    # Entered (in order) when the app starts, exited when it stops: background tasks,
    # subscriptions. Each gets the Services.
    lifespan: Sequence[ServicesHook] = ()
    # Entered by `tokenmill up` only, after the app is serving: demo SKU/tenant/key, a CPU
    # worker. Exited before the servers stop.
    up_hooks: Sequence[ServicesHook] = ()
    # Objects this extension shares with the others (e.g. "metrics"): merged into
    # `services.extra` as the extensions load, in EXTENSION_MODULES order.
    extra: dict[str, Any] = field(default_factory=dict)


def load_extensions(
    services: Services, modules: Sequence[str] = EXTENSION_MODULES
) -> list[Extension]:
    """The extensions the installed modules offer (a module without the hook offers none)."""
    found = []
    for module in installed_modules(modules):
        factory = getattr(module, "tokenmill_extension", None)
        ext = factory(services) if factory is not None else None
        if ext is not None:
            services.extra.update(ext.extra)
            found.append(ext)
    return found


def create_app(
    services: Services,
    *,
    extensions: Sequence[Extension] = (),
    run_projectors: bool = False,
    debug: bool = False,
) -> Litestar:
    """The app over already-connected `services` (the caller connects and closes them).
    `run_projectors` also runs the projections in this process (as `tokenmill up` does)."""

    @asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            if run_projectors:
                await stack.enter_async_context(services.running_projectors())
            for ext in extensions:
                for hook in ext.lifespan:
                    await stack.enter_async_context(hook(services))
            yield

    return Litestar(
        route_handlers=[
            healthz,
            readyz,
            admin_router(services),
            *[h for ext in extensions for h in ext.route_handlers],
        ],
        plugins=[p for ext in extensions for p in ext.plugins],
        dependencies={"services": Provide(lambda: services, sync_to_thread=False)},
        exception_handlers=PROBLEM_HANDLERS,
        lifespan=[lifespan],
        # /v1 routes that reach the app (a trailing slash, say) keep the /v1 limit; the admin
        # router sets its own (TOKENMILL_MAX_BODY_BYTES)
        request_max_body_size=services.settings.v1_max_body_bytes,
        openapi_config=OpenAPIConfig(
            title="tokenmill",
            version="0.1.0",
            description="Governed, metered, OpenAI-compatible serving of GPU language models.",
            path="/schema",
            components=Components(
                security_schemes={"bearer": SecurityScheme(type="http", scheme="bearer")},
            ),
        ),
        debug=debug,
    )


__all__ = ["Extension", "Services", "Settings", "create_app", "load_extensions"]
