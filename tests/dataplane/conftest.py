"""One running stack (app + one fixed-rate worker) per test module: starting them costs
seconds, and each test makes its own tenant and key, so tests do not see each other.

Every test that uses a stack (or the `fast_path` fixture) runs twice: on the data-plane fast
path and on the public APIs of uvicorn and nats-py only (`TOKENMILL_FAST_PATH=0`), with the same
assertions: the contract tests (OpenAI API shapes, streaming, metering, hostile input). A test
of the fast path's own mechanics, or one outside those (routing, backends, CLIs), is marked
`fast_path_only` and runs with the default only."""

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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "fast_path_only: runs with the default (the fast path on) only: a test of the fast"
        " path's own mechanics, or one outside the contract tests run both ways",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "fast_path" in metafunc.fixturenames:
        only = metafunc.definition.get_closest_marker("fast_path_only") is not None
        modes = [True] if only else [True, False]
        ids = ["fast" if on else "public" for on in modes]
        metafunc.parametrize("fast_path", modes, ids=ids, indirect=True, scope="module")


@pytest.fixture(scope="module")
def fast_path(request: pytest.FixtureRequest) -> Iterator[bool]:
    """TOKENMILL_FAST_PATH for what is built while it lasts (servers, worker clients). On
    unless parametrized (a suite outside this directory that uses these fixtures)."""
    on: bool = getattr(request, "param", True)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TOKENMILL_FAST_PATH", "1" if on else "0")
        yield on


@pytest.fixture(scope="module")
def module_database_url(fast_path: bool, postgres_server: EmbeddedPostgres) -> Iterator[str]:
    # One per stack: a stack's projectors resume from the positions they find in it.
    with fresh_database(postgres_server, "dp_") as url:
        yield url


@pytest.fixture(scope="module")
def stack_env() -> dict[str, str]:
    """Environment settings of the module's stack (a module overrides this to change them)."""
    return {}


@pytest.fixture(scope="module")
async def stack(
    fast_path: bool,
    nats_server: EmbeddedNats,
    module_database_url: str,
    tmp_path_factory: pytest.TempPathFactory,
    stack_env: dict[str, str],
) -> AsyncIterator[Stack]:
    with pytest.MonkeyPatch.context() as env:
        for name, value in stack_env.items():
            env.setenv(name, value)
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
