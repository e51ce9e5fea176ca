"""The embedded default demo, run by `tokenmill up`: a SKU serving SmolLM2-135M-Instruct on CPU,
a demo tenant and API key (the same across restarts of one data dir), one worker process with
our torch runtime, and the two lines that point the official openai client at it."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from control_plane.admin.services import hash_key, new_api_key
from control_plane.services import Services
from events.control import ApiKeyIssued, SkuPublished, TenantCreated, sku_id_for

log = logging.getLogger("tokenmill.demo")

DEMO_SKU = "SmolLM2-135M-Instruct"
DEMO_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEMO_TENANT_ID = "ten_demo"
KEY_FILE = "demo-api-key"


def demo_key(data_dir: Path) -> str:
    """The demo key's plaintext, generated once and kept (mode 0600) in the data dir."""
    path = data_dir / KEY_FILE
    if path.exists():
        return path.read_text().strip()
    data_dir.mkdir(parents=True, exist_ok=True)
    plaintext, _ = new_api_key()
    path.touch(mode=0o600)
    path.write_text(plaintext + "\n")
    return plaintext


async def ensure_demo_governance(services: Services) -> tuple[str, str]:
    """Publishes what is missing of the demo SKU, tenant and key; returns (sku_id, key)."""
    view, store = services.view, services.store
    await view.sync()
    sku_id = sku_id_for(DEMO_SKU)
    sku = view.sku(sku_id)
    if sku is None or not sku.active:
        event = SkuPublished(
            sku_id=sku_id, name=DEMO_SKU, model=DEMO_MODEL, runtime="torch_runtime", gpu_type="cpu"
        )
        await view.wait_for(await store.append(event, expected_version=view.version("sku", sku_id)))
    if view.tenant(DEMO_TENANT_ID) is None:
        await view.wait_for(
            await store.append(
                TenantCreated(tenant_id=DEMO_TENANT_ID, name="demo"), expected_version=0
            )
        )
    plaintext = demo_key(Path(services.settings.data_dir))
    key_hash = hash_key(plaintext)
    if view.key_by_hash(key_hash) is None:
        # The id follows the plaintext, so a deleted key file yields a new key, not a clash.
        key_id = "key_demo_" + hashlib.sha256(key_hash.encode()).hexdigest()[:12]
        issued = ApiKeyIssued(
            key_id=key_id,
            tenant_id=DEMO_TENANT_ID,
            key_hash=key_hash,
            prefix=plaintext[:11],
            name="demo",
        )
        await view.wait_for(await store.append(issued, expected_version=0))
    return sku_id, plaintext


WORKER_LOG = "demo-worker.log"
READY_MARK = b" serving SKU "  # the line worker.serve logs once its model is loaded


async def say_when_ready(log_path: Path, offset: int, timeout_s: float = 600.0) -> None:
    """Print one line when the demo worker (whose log starts at `offset`) serves its model, so
    a user who copied the export lines knows when the first answer comes (before: 503)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        with contextlib.suppress(OSError):
            with log_path.open("rb") as f:
                f.seek(offset)
                if READY_MARK in f.read():
                    print(f"Demo worker ready: {DEMO_SKU} answers now.", flush=True)
                    return
        await asyncio.sleep(0.25)


def start_demo_worker(services: Services, sku_id: str, gguf_path: Path) -> subprocess.Popen[bytes]:
    s = services.settings
    assert s.nats_url is not None
    log_file = open(Path(s.data_dir) / WORKER_LOG, "ab")  # noqa: SIM115 (the child owns it)
    return subprocess.Popen(
        [
            sys.executable, "-m", "worker.serve", "--nats-url", s.nats_url, "--prefix", s.stream_prefix,
            "--sku-id", sku_id, "--model", DEMO_SKU, "--backend", "torch_runtime",
            "--config", json.dumps({"model_path": str(gguf_path)}), "--worker-id", "demo-cpu-worker",
        ],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )  # fmt: skip


@contextlib.asynccontextmanager
async def demo_up_hook(services: Services) -> AsyncIterator[None]:
    sku_id, key = await ensure_demo_governance(services)
    worker: subprocess.Popen[bytes] | None = None
    log_path = Path(services.settings.data_dir) / WORKER_LOG
    offset = log_path.stat().st_size if log_path.exists() else 0  # this run's lines only
    try:
        from worker.loading.demo_model import ensure_smollm2

        gguf = await asyncio.to_thread(ensure_smollm2, Path(services.settings.data_dir) / "models")
        worker = start_demo_worker(services, sku_id, Path(gguf))
    except Exception as exc:  # the API is still useful without the demo worker
        log.error("demo worker not started: %s", exc)
    s = services.settings
    print(
        f"\nDemo model {DEMO_SKU} on a CPU worker (a line says when it is loaded; log in "
        f"{log_path}):\n"
        f"  export OPENAI_BASE_URL=http://{s.host}:{s.port}/v1\n"
        f"  export OPENAI_API_KEY={key}\n",
        flush=True,
    )
    ready = asyncio.create_task(say_when_ready(log_path, offset)) if worker else None
    try:
        yield
    finally:
        if ready is not None:
            ready.cancel()
        if worker is not None and worker.poll() is None:
            worker.terminate()
            try:
                await asyncio.to_thread(worker.wait, 30)
            except subprocess.TimeoutExpired:
                worker.kill()
