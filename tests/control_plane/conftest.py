"""A running control plane per test: Services on the session's real NATS and a fresh
Postgres database, the app served by uvicorn on a free port, an HTTP client with the admin
token."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from control_plane.app import create_app
from control_plane.embedded import EmbeddedNats, free_port
from control_plane.services import Services
from control_plane.settings import Settings

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
    port = free_port()
    app = create_app(services, run_projectors=True)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]  # leave pytest's signals alone
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=10,
    ) as client:
        yield client
    server.should_exit = True
    await task
