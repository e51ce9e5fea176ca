"""Browser fixtures: Debian's chromium driven by Playwright (never a browser Playwright
downloads), screenshots under test-artifacts/, and a helper that serves an ASGI app on a
free port in a background thread."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def ensure_chromium() -> Path:
    """Debian's chromium, installed with apt-get on first use; skips the test only when it
    cannot be installed here (no apt, not root, no package mirror)."""
    if CHROMIUM.exists():
        return CHROMIUM
    if shutil.which("apt-get") is None:
        pytest.skip(
            "browser tests need /usr/bin/chromium and this machine has no apt-get to install it"
        )
    sudo = [] if os.geteuid() == 0 else (["sudo", "-n"] if shutil.which("sudo") else None)
    if sudo is None:
        pytest.skip(
            "browser tests need /usr/bin/chromium: install it with `apt-get install -y chromium` (needs root)"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}

    def apt_get(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*sudo, "apt-get", *args], capture_output=True, text=True, env=env, timeout=timeout
        )

    attempt = apt_get("install", "-y", "chromium", timeout=900)
    if attempt.returncode != 0:  # a stale package list is the usual cause
        apt_get("update", timeout=600)
        attempt = apt_get("install", "-y", "chromium", timeout=900)
    if attempt.returncode != 0 or not CHROMIUM.exists():
        pytest.skip(f"could not install Debian's chromium: {attempt.stderr.strip()[-300:]}")
    return CHROMIUM


@pytest.fixture(scope="session")
async def browser() -> AsyncIterator[Any]:
    executable = ensure_chromium()
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        b = await pw.chromium.launch(
            executable_path=str(executable), args=CHROMIUM_ARGS, headless=True
        )
        yield b
        await b.close()


@pytest.fixture()
async def page(browser: Any) -> AsyncIterator[Any]:
    context = await browser.new_context(
        accept_downloads=True, viewport={"width": 1360, "height": 900}
    )
    page = await context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.js_errors = errors  # the tests assert the page threw nothing
    yield page
    await context.close()


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """Serve an ASGI app with uvicorn on a free port; yields its base URL."""
    import uvicorn

    from control_plane.embedded import free_port

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
