"""A running tokenmill for data-plane tests: real NATS and Postgres, the real app served by
uvicorn on a free port, tenants/keys/SKUs made through the admin API, and real worker
processes (`python -m worker.serve`)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from control_plane.app import create_app, load_extensions
from control_plane.dataplane.routes import DataPlane
from control_plane.dataplane.server import http_protocol
from control_plane.services import Services
from tests.control_plane.serving import serving
from tokenmill.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
ADMIN_TOKEN = "tmadm_test"
# Fast failure detection in tests: workers beat every 0.1 s and are dead after 1 s of silence.
HEARTBEAT_S = 0.1
DEAD_AFTER_S = 1.0


@dataclass
class Stack:
    base_url: str
    nats_url: str
    prefix: str
    services: Services
    plane: DataPlane
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    server: uvicorn.Server | None = None  # for tests that look at the connections

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    async def admin(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        async with httpx.AsyncClient(base_url=self.base_url + "/admin/v1") as http:
            r = await http.request(
                method, path, json=body, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}
            )
        assert r.status_code < 300, r.text
        return r.json()

    async def publish_sku(self, name: str, model: str = "fixed-rate-test") -> dict[str, Any]:
        return await self.admin(
            "POST",
            "/skus",
            {"name": name, "model": model, "runtime": "fixed_rate", "gpu_type": "cpu"},
        )

    async def tenant_with_key(
        self, scopes: list[str] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        tenant = await self.admin("POST", "/tenants", {"name": "t-" + uuid.uuid4().hex[:6]})
        key = await self.admin(
            "POST", f"/tenants/{tenant['tenant_id']}/keys", {"scopes": scopes or []}
        )
        return tenant, key

    def start_worker(
        self,
        sku_id: str,
        backend: str = "fixed_rate",
        env: dict[str, str] | None = None,
        **config: Any,
    ) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "worker.serve", "--nats-url", self.nats_url, "--prefix", self.prefix,
                "--sku-id", sku_id, "--model", "fixed-rate-test", "--backend", backend,
                "--config", json.dumps(config), "--heartbeat-s", str(HEARTBEAT_S), "--drain-s", "2",
            ],
            cwd=ROOT,
            env={**os.environ, "TOKENMILL_LOG_LEVEL": "WARNING", **(env or {})},
        )  # fmt: skip
        self.workers.append(proc)
        return proc

    async def served_sku(
        self, name_prefix: str, **worker: Any
    ) -> tuple[dict[str, Any], subprocess.Popen[bytes]]:
        """A new SKU (`name_prefix` and a random suffix) once one worker started with `worker`
        serves it; the SKU and the worker's process."""
        sku = await self.publish_sku(name_prefix + uuid.uuid4().hex[:6])
        proc = self.start_worker(sku["sku_id"], **worker)
        await self.wait_served(sku["sku_id"])
        return sku, proc

    async def wait_served(self, sku_id: str, count: int = 1, within: float = 20.0) -> None:
        deadline = time.monotonic() + within
        while len(self.plane.gateway.registry.live_workers(sku_id)) < count:
            assert time.monotonic() < deadline, f"no worker for {sku_id} after {within}s"
            await asyncio.sleep(0.05)

    async def ledger_row(self, request_id: str, within: float = 10.0) -> dict[str, Any]:
        return (await self.ledger_rows([request_id], within))[request_id]

    async def ledger_rows(
        self, request_ids: list[str], within: float = 15.0
    ) -> dict[str, dict[str, Any]]:
        """The usage_ledger rows of these requests, once the projection has written them all."""
        found = await self._rows_of("usage_ledger", request_ids, within)
        missing = set(request_ids) - set(found)
        assert not missing, f"not in the ledger after {within}s: {sorted(missing)[:5]}"
        return found

    async def delivery_rows(
        self, request_ids: list[str], within: float = 15.0
    ) -> dict[str, dict[str, Any]]:
        found = await self._rows_of("gateway_deliveries", request_ids, within)
        assert len(found) == len(set(request_ids)), "gateway deliveries missing"
        return found

    async def _rows_of(
        self, table: str, request_ids: list[str], within: float
    ) -> dict[str, dict[str, Any]]:
        """The table's rows of these requests by request id: all of them, or those there are
        after `within` seconds."""
        deadline = time.monotonic() + within
        while True:
            rows = await self.services.pool.fetch(
                f"SELECT * FROM {table} WHERE request_id = ANY($1)", request_ids
            )
            if len(rows) == len(set(request_ids)) or time.monotonic() > deadline:
                return {r["request_id"]: dict(r) for r in rows}
            await asyncio.sleep(0.05)


def stop_process(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@asynccontextmanager
async def running_stack(
    nats_url: str, database_url: str, prefix: str, data_dir: Path
) -> AsyncIterator[Stack]:
    settings = Settings(
        data_dir=data_dir, nats_url=nats_url, database_url=database_url, stream_prefix=prefix
    )
    services = await Services.connect(settings, admin_token=ADMIN_TOKEN)
    saved = os.environ.get("TOKENMILL_GATEWAY_WORKER_DEAD_S")
    os.environ["TOKENMILL_GATEWAY_WORKER_DEAD_S"] = str(DEAD_AFTER_S)
    try:
        extensions = load_extensions(services)  # the whole app: governance, observability too
    finally:
        if saved is None:
            del os.environ["TOKENMILL_GATEWAY_WORKER_DEAD_S"]
        else:
            os.environ["TOKENMILL_GATEWAY_WORKER_DEAD_S"] = saved
    app = create_app(services, extensions=extensions, run_projectors=True)
    plane = services.extra["dataplane"]
    assert isinstance(plane, DataPlane)
    try:
        # Served as `tokenmill serve` serves it (the fast path as TOKENMILL_FAST_PATH says).
        http = http_protocol(app, plane.completion_handlers())
        async with serving(app, http=http) as (base_url, server):
            stack = Stack(base_url, nats_url, prefix, services, plane, server=server)
            try:
                yield stack
            finally:
                for proc in stack.workers:
                    stop_process(proc)
    finally:
        await services.close()


async def read_then_hang_up(stream: Any, chunks: int | None) -> str:
    """Read `chunks` chunks of a streamed chat or text completion (all of them if None), then
    close it as a client hanging up; the request id."""
    got, request_id = 0, ""
    async for chunk in stream:
        got, request_id = got + 1, chunk.id.removeprefix("chatcmpl-").removeprefix("cmpl-")
        if got == chunks:
            break
    await stream.close()
    return request_id


async def read_killing_the_worker(
    stream: Any, worker: subprocess.Popen[bytes], after: int
) -> tuple[list[str], str, openai.APIError]:
    """Read a streamed chat completion, SIGKILL `worker` once `after` chunks came, and expect
    the stream to end with an error chunk; the texts received, the request id, the error."""
    received: list[str] = []
    request_id = ""
    with pytest.raises(openai.APIError) as e:
        async for chunk in stream:
            request_id = chunk.id.removeprefix("chatcmpl-")
            received.append(chunk.choices[0].delta.content or "")
            if len(received) == after:
                worker.send_signal(signal.SIGKILL)
    return received, request_id, e.value
