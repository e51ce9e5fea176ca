"""An app served over real HTTP inside the test's event loop, as `tokenmill serve` serves it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import uvicorn

from control_plane.embedded import free_port


@contextlib.asynccontextmanager
async def serving(app: Any, **config: Any) -> AsyncIterator[tuple[str, uvicorn.Server]]:
    """Serve the ASGI `app` with uvicorn (lifespan on, more uvicorn `config` such as the `http`
    protocol) on a free port; yields its base URL and the server (for tests that look at its
    connections)."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", **config
        )
    )
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]  # leave pytest's signals alone
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()  # raises why it did not start
            raise RuntimeError("uvicorn exited before it started")
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def served(app: Any) -> AsyncIterator[str]:
    """Serve the ASGI `app` as `serving` does; yields only its base URL."""
    async with serving(app) as (base_url, _server):
        yield base_url
