"""Fresh databases on the shared embedded PostgreSQL, so tests do not see each other's rows."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from control_plane.embedded import EmbeddedPostgres, _pg_bin


@contextmanager
def fresh_database(server: EmbeddedPostgres, name_prefix: str) -> Iterator[str]:
    """Create a database named `name_prefix` + a random suffix; yield its URL; drop it after."""
    name = name_prefix + uuid.uuid4().hex[:12]
    psql = [
        str(_pg_bin() / "psql"),
        "-h",
        "127.0.0.1",
        "-p",
        str(server.port),
        "-U",
        "postgres",
        "-d",
        "postgres",
    ]
    subprocess.run([*psql, "-c", f'CREATE DATABASE "{name}"'], check=True, capture_output=True)
    try:
        yield f"postgresql://postgres@127.0.0.1:{server.port}/{name}"
    finally:
        subprocess.run(
            [*psql, "-c", f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'], capture_output=True
        )
