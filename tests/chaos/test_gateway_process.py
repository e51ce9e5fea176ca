"""`tokenmill serve` processes, stopped and killed around requests: the bill carries its
delivery record and waits for no batch; a SIGKILL mid-stream leaves the worker to notice the
silent gateway, stop within the bound and record the waste, with nothing billed. Read straight from
the usage stream (the projectors ran in the dead process)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

from control_plane.embedded import EmbeddedNats, EmbeddedPostgres, free_port
from events.usage import GatewayDelivered, RequestFinished, WorkerGenerated, decode_usage
from tests.databases import fresh_database
from tests.dataplane.harness import ROOT, stop_process

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(180)]

ADMIN = "tmadm_chaos"
SILENT_S = 1.5
RATE = 50.0


class Install:
    def __init__(self, nats_url: str, database_url: str, data_dir: Path) -> None:
        self.prefix = "C" + uuid.uuid4().hex[:10].upper()
        self.nats_url = nats_url
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
        self.env |= {
            "TOKENMILL_NATS_URL": nats_url,
            "TOKENMILL_DATABASE_URL": database_url,
            "TOKENMILL_ADMIN_TOKEN": ADMIN,
            "TOKENMILL_STREAM_PREFIX": self.prefix,
            # Completed answers reach the outcome listeners in batches this far apart: the bill
            # and its delivery record must not wait for them.
            "TOKENMILL_GATEWAY_REPORT_EVERY_S": "30",
            "TOKENMILL_GATEWAY_WORKER_DEAD_S": "1",
        }
        self.data_dir = data_dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def serve(self) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(self.port)]
        cmd += ["--data-dir", str(self.data_dir)]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env)
        self.procs.append(proc)
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "did not start"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base}/readyz", timeout=2).status_code == 200:
                    return proc
            time.sleep(0.2)

    def admin(self, path: str, body: dict[str, Any]) -> Any:
        r = httpx.post(
            f"{self.base}/admin/v1{path}", json=body, headers={"authorization": f"Bearer {ADMIN}"}
        )
        assert r.status_code < 300, r.text
        return r.json()

    def worker(self, sku_id: str) -> None:
        cmd = [
            sys.executable, "-m", "worker.serve", "--nats-url", self.nats_url, "--prefix", self.prefix,
            "--sku-id", sku_id, "--model", "m", "--backend", "fixed_rate", "--heartbeat-s", "0.1",
            "--config", json.dumps({"tokens_per_s": RATE, "output_tokens": 2000}),
        ]  # fmt: skip
        env = {**os.environ, "TOKENMILL_WORKER_GATEWAY_SILENT_S": str(SILENT_S)}
        self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env))


@pytest.fixture()
def install(
    nats_server: EmbeddedNats, postgres_server: EmbeddedPostgres, tmp_path: Path
) -> Iterator[Install]:
    with fresh_database(postgres_server, "chaos_") as url:
        inst = Install(nats_server.url, url, tmp_path)
        try:
            yield inst
        finally:
            for proc in reversed(inst.procs):
                stop_process(proc)


async def usage_events(install: Install, within: float, until: Any) -> list[Any]:
    """The install's usage events, read until `until(events)` holds or `within` passes."""
    nc = await nats.connect(install.nats_url)
    try:
        sub = await nc.jetstream().subscribe(f"{install.prefix}.usage.>", ordered_consumer=True)
        events: list[Any] = []
        deadline = time.monotonic() + within
        while not until(events) and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError, nats.errors.TimeoutError):
                events.append(decode_usage((await sub.next_msg(timeout=0.5)).data))
        return events
    finally:
        await nc.close()


def test_the_bill_carries_its_delivery_and_sigkill_stops_the_workers_generation(
    install: Install,
) -> None:
    gateway = install.serve()
    sku = install.admin("/skus", {"name": "chaos", "model": "m", "runtime": "fixed_rate", "gpu_type": "cpu"})  # fmt: skip
    tenant = install.admin("/tenants", {"name": "chaos"})
    key = install.admin(f"/tenants/{tenant['tenant_id']}/keys", {"scopes": []})["key"]
    auth = {"authorization": f"Bearer {key}"}
    install.worker(sku["sku_id"])
    body = {"model": "chaos", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    deadline = time.monotonic() + 30
    while (r := httpx.post(f"{install.base}/v1/chat/completions", json=body, headers=auth)).status_code != 200:  # fmt: skip
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)
    done = r.headers["x-request-id"]
    # Stopped right after: the bill, its delivery record in it, is out (or goes out on the way
    # down), with no delivery record apart.
    gateway.send_signal(signal.SIGTERM)
    gateway.wait(timeout=15)
    events = asyncio.run(
        usage_events(
            install, 10, lambda ev: any(isinstance(e, RequestFinished) and e.request_id == done for e in ev)
        )
    )  # fmt: skip
    (bill,) = [e for e in events if isinstance(e, RequestFinished) and e.request_id == done]
    assert bill.delivered is not None and bill.delivered.completion_tokens == bill.completion_tokens == 3  # fmt: skip
    # and no delivery record apart from it
    assert not [e for e in events if isinstance(e, GatewayDelivered)]

    # A new gateway; killed mid-stream.
    gateway = install.serve()
    stream_body = {**body, "max_tokens": 2000, "stream": True}
    received, request_id = 0, ""
    with httpx.stream(
        "POST", f"{install.base}/v1/chat/completions", json=stream_body, headers=auth, timeout=30
    ) as r:
        assert r.status_code == 200, r.read()
        request_id = r.headers["x-request-id"]
        for line in r.iter_lines():
            if line.startswith("data: {"):
                received += 1
                if received == 10:
                    gateway.send_signal(signal.SIGKILL)
                    killed_at = time.monotonic()
                    break
    gateway.wait(timeout=10)

    def stopped(ev: list[Any]) -> bool:
        return any(isinstance(e, WorkerGenerated) and e.request_id == request_id for e in ev)

    events = asyncio.run(usage_events(install, SILENT_S + 10, stopped))
    took = time.monotonic() - killed_at
    (generated,) = [e for e in events if isinstance(e, WorkerGenerated) and e.request_id == request_id]  # fmt: skip
    assert generated.gateway_lost and generated.finish_reason == "cancelled"
    assert took < SILENT_S + 5
    assert received <= generated.completion_tokens < received + (SILENT_S + 3) * RATE
    # Nothing billed: the gateway that could show a delivery died.
    assert not [e for e in events if isinstance(e, RequestFinished) and e.request_id == request_id]
