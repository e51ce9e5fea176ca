"""The operator's page in Debian's chromium against the observability routes alone: sign-in,
live charts from the metrics, and every view degrading to "not available" where the rest of
the admin API is absent."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from control_plane.observability.metrics import ObservabilitySettings, OpsMetrics
from tests.observability.helpers import observe
from tests.observability.test_routes import TOKEN, ops_app
from tests.web.conftest import serve_in_thread
from worker.protocol import WorkerAnnounce, WorkerHeartbeat


@pytest.fixture()
def metrics() -> OpsMetrics:
    return OpsMetrics(ObservabilitySettings(window_s=300, step_s=1, worker_stale_s=30))


@pytest.fixture()
def base_url(metrics: OpsMetrics) -> Iterator[str]:
    with serve_in_thread(ops_app(metrics)) as url:
        yield url


async def sign_in(page: Any, base_url: str, token: str = TOKEN) -> None:
    await page.goto(f"{base_url}/ui/")
    await page.get_by_label("Admin token").fill(token)
    await page.get_by_role("button", name="Sign in").click()


async def test_sign_in_refuses_a_wrong_token_then_accepts_the_right_one(
    page: Any, base_url: str
) -> None:
    await sign_in(page, base_url, "not-the-token")
    await page.get_by_text("That token was refused.").wait_for()
    await sign_in(page, base_url)
    await page.get_by_role("heading", name="Overview").wait_for()
    assert await page.evaluate("sessionStorage.getItem('tokenmill.adminToken')") == TOKEN
    await page.reload()  # the token survives a reload of the tab
    await page.get_by_role("heading", name="Overview").wait_for()
    await page.get_by_role("button", name="Sign out").click()
    await page.get_by_label("Admin token").wait_for()
    assert await page.evaluate("sessionStorage.getItem('tokenmill.adminToken')") is None
    assert page.js_errors == []


async def test_a_request_latency_appears_live_in_the_charts(
    page: Any, base_url: str, metrics: OpsMetrics, artifacts: Path
) -> None:
    metrics.update_worker(
        WorkerAnnounce(
            worker_id="cpu-0", sku_id="demo", model="smollm2-135m", backend="torch", capacity=4
        )
    )
    metrics.update_worker(
        WorkerHeartbeat(
            worker_id="cpu-0", sku_id="demo", running=1, waiting=0, kv_pressure=0.25, ts=time.time()
        )
    )
    await sign_in(page, base_url)
    charts = page.locator("section[data-sku='demo']")
    await charts.wait_for()
    ttft = charts.get_by_role("img", name="Time to first token")
    assert "p50 —" in (await ttft.get_attribute("aria-label"))  # nothing measured yet
    hit_rate = charts.locator("[data-stat='prefix-cache']")
    assert await hit_rate.inner_text() == (
        "Prefix-cache hit rate — (no prompt tokens in the last 15 min)"
    )

    acme = dict(model="smollm2-135m", tenant="acme", ttft_s=0.123)
    observe(metrics, **acme, itl_s=[0.02] * 8, e2e_s=0.4, prompt_tokens=9, completion_tokens=9)
    # a prompt mostly served from the prefix cache
    observe(metrics, **acme, prompt_tokens=1991, cached_tokens=1500, completion_tokens=1)
    chart = await ttft.element_handle()
    # the page polls every 2 s: the new latency shows without a reload, patched into the same
    # chart (a live update does not replace what the operator or a screen reader is on)
    await page.wait_for_function(
        "svg => svg.isConnected && svg.getAttribute('aria-label').includes('p50 123.0 ms')",
        arg=chart,
        timeout=10_000,
    )
    itl = await charts.get_by_role("img", name="Inter-token latency").get_attribute("aria-label")
    assert "p50 20.0 ms" in itl
    kv = await charts.get_by_role("img", name="KV-cache pressure").get_attribute("aria-label")
    assert "mean 25.0 %" in kv
    # 1500 of the 2000 prompt tokens over the window came from the prefix cache
    await hit_rate.filter(has_text="75.0 %").wait_for()
    assert await hit_rate.inner_text() == (
        "Prefix-cache hit rate 75.0 % (1,500 of 2,000 prompt tokens cached, last 15 min)"
    )
    # the chart's latest 1 s step: both requests (75.0 %) or the second alone (75.3 %)
    hits = charts.get_by_role("img", name="Prefix-cache hit rate")
    assert re.search(r"hits 75\.[03] %", await hits.get_attribute("aria-label"))
    await page.get_by_label("Window").select_option(label="5 min")
    await charts.get_by_text("last 5 min").wait_for()
    await page.screenshot(path=str(artifacts / "overview-standalone.png"), full_page=True)

    await page.get_by_role("link", name="Workers").click()
    row = page.get_by_role("row").filter(has_text="cpu-0")
    await row.wait_for()
    assert "live" in await row.inner_text()
    assert page.js_errors == []


async def test_views_without_their_endpoints_say_not_available(
    page: Any, base_url: str, artifacts: Path
) -> None:
    await sign_in(page, base_url)
    for link, heading in [
        ("Tenants & keys", "Tenants"),
        ("SKUs & prices", "SKUs"),
        ("Invoices", "Invoices"),
        ("Usage", "Usage"),
    ]:
        await page.get_by_role("link", name=link, exact=True).click()
        await page.get_by_text(f"{heading}: not available").wait_for()
    await page.get_by_role("link", name="Capacity").click()
    await page.get_by_text("Capacity projection: not available").wait_for()
    # health probes: /healthz and /readyz are not part of this app either
    await page.get_by_text("API not available").wait_for()
    await page.screenshot(path=str(artifacts / "not-available.png"), full_page=True)
    assert page.js_errors == []


async def test_keyboard_reaches_sign_in_and_navigation(page: Any, base_url: str) -> None:
    await page.goto(f"{base_url}/ui/")
    await page.get_by_label("Admin token").wait_for()
    # the token field has the focus from the start: type and press Enter
    assert await page.evaluate("document.activeElement.id") == "admin-token"
    await page.keyboard.type(TOKEN)
    await page.keyboard.press("Enter")
    await page.get_by_role("heading", name="Overview").wait_for()
    await page.get_by_role("link", name="Workers").focus()
    await page.keyboard.press("Enter")
    await page.get_by_role("heading", name="Workers").wait_for()
    assert await page.get_by_role("link", name="Workers").get_attribute("aria-current") == "page"
