"""Billing through the product: the app with the pricing extension (found the way `tokenmill`
finds it), served over real HTTP on the session's NATS and a fresh Postgres database, the
projectors running in the same process."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime

import httpx
import pytest

from control_plane.app import Extension, create_app, load_extensions
from control_plane.services import Services
from events.usage import RequestFinished
from tests.control_plane.conftest import ADMIN_TOKEN, services  # noqa: F401 (a fixture)
from tests.control_plane.serving import served


@dataclass
class Billing:
    http: httpx.AsyncClient
    services: Services
    extension: Extension

    async def usage(self, *events: RequestFinished) -> None:
        for event in events:
            await self.services.store.publish_usage(event)


@pytest.fixture()
async def billing(services: Services) -> AsyncIterator[Billing]:  # noqa: F811
    (extension,) = load_extensions(services, ["pricing"])
    app = create_app(services, extensions=[extension], run_projectors=True)
    async with (
        served(app) as base_url,
        httpx.AsyncClient(
            base_url=f"{base_url}/admin/v1",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=15,
        ) as client,
    ):
        yield Billing(client, services, extension)


def at(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]
