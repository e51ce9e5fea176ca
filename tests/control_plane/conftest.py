"""A running control plane per test: Services on the session's real NATS and a fresh
Postgres database, the app served by uvicorn on a free port, an HTTP client with the admin
token."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from control_plane.app import create_app
from control_plane.embedded import EmbeddedNats
from control_plane.services import Services
from tests.control_plane.serving import served
from tokenmill.settings import Settings

ADMIN_TOKEN = "test-admin-token"


@pytest.fixture()
async def services(
    nats_server: EmbeddedNats, database_url: str, stream_prefix: str, tmp_path: Path
) -> AsyncIterator[Services]:
    settings = Settings(
        data_dir=tmp_path,
        nats_url=nats_server.url,
        database_url=database_url,
        admin_token=ADMIN_TOKEN,
        stream_prefix=stream_prefix,
    )
    svc = await Services.connect(settings, ADMIN_TOKEN)
    yield svc
    await svc.close()


@pytest.fixture()
async def api(services: Services) -> AsyncIterator[httpx.AsyncClient]:
    """The admin API over real HTTP, projectors running in the same process."""
    async with (
        served(create_app(services, run_projectors=True)) as base_url,
        httpx.AsyncClient(
            base_url=base_url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10
        ) as client,
    ):
        yield client
