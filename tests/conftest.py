"""Real servers for the tests: one embedded NATS (JetStream) and one embedded PostgreSQL per
test session, each on a free port under a temporary directory. Never mocked."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from control_plane.embedded import EmbeddedNats, EmbeddedPostgres
from tests.databases import fresh_database


@pytest.fixture(scope="session")
def servers_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="tokenmill-test-"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def nats_server(servers_root: Path) -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(servers_root / "nats").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres_server(servers_root: Path) -> Iterator[EmbeddedPostgres]:
    server = EmbeddedPostgres(servers_root / "pgdata").start()
    yield server
    server.stop()


@pytest.fixture()
def stream_prefix() -> str:
    """A fresh stream-name prefix per test, so tests share one NATS without seeing each other."""
    return "T" + uuid.uuid4().hex[:10].upper()


@pytest.fixture()
def database_url(postgres_server: EmbeddedPostgres) -> Iterator[str]:
    """A fresh database per test on the shared server."""
    with fresh_database(postgres_server, "t_") as url:
        yield url
