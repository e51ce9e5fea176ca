"""One running stack (app + one fixed-rate worker) per test module: starting them costs
seconds, and each test makes its own tenant and key, so tests do not see each other."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from control_plane.embedded import EmbeddedNats, EmbeddedPostgres
from tests.databases import fresh_database
from tests.dataplane.harness import Stack, running_stack

# Tokens per second of the fixed-rate worker in these tests, per request.
RATE = 200.0


@pytest.fixture(scope="module")
def module_database_url(postgres_server: EmbeddedPostgres) -> Iterator[str]:
    with fresh_database(postgres_server, "dp_") as url:
        yield url


@pytest.fixture(scope="module")
async def stack(
    nats_server: EmbeddedNats, module_database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    prefix = "D" + uuid.uuid4().hex[:10].upper()
    data_dir: Path = tmp_path_factory.mktemp("dataplane")
    async with running_stack(nats_server.url, module_database_url, prefix, data_dir) as s:
        yield s


@pytest.fixture(scope="module")
async def sku(stack: Stack) -> dict[str, object]:
    """A SKU served by one fixed-rate worker process (32-token answers at RATE tokens/s)."""
    sku = await stack.publish_sku("fixed-" + uuid.uuid4().hex[:6])
    stack.start_worker(str(sku["sku_id"]), tokens_per_s=RATE, output_tokens=32)
    await stack.wait_served(str(sku["sku_id"]))
    return sku
