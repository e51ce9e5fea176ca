"""Settings, read from the environment once at start-up.

Every field documents its variable; defaults give the embedded single-machine setup.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import overload


@overload
def env(name: str) -> str | None: ...
@overload
def env(name: str, default: str) -> str: ...
def env(name: str, default: str | None = None) -> str | None:
    """The variable's value; unset or empty gives `default`."""
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def env_float(name: str, default: float) -> float:
    """The variable as a number; unset or empty gives `default`."""
    value = env(name)
    return float(value) if value is not None else default


@dataclass(frozen=True)
class Settings:
    # TOKENMILL_DATA_DIR: where the embedded servers, admin token and model cache live.
    data_dir: Path = field(default_factory=lambda: Path(env("TOKENMILL_DATA_DIR", ".tokenmill")))
    # TOKENMILL_NATS_URL: an external NATS (JetStream enabled). Unset: start an embedded one.
    nats_url: str | None = field(default_factory=lambda: env("TOKENMILL_NATS_URL"))
    # TOKENMILL_DATABASE_URL: an external PostgreSQL (postgresql://...). Unset: embedded.
    database_url: str | None = field(default_factory=lambda: env("TOKENMILL_DATABASE_URL"))
    # TOKENMILL_ADMIN_TOKEN: bearer token for /admin/v1. Unset: generated once, kept in data dir.
    admin_token: str | None = field(default_factory=lambda: env("TOKENMILL_ADMIN_TOKEN"))
    # TOKENMILL_HOST / TOKENMILL_PORT: where `tokenmill serve` / `up` listen.
    host: str = field(default_factory=lambda: env("TOKENMILL_HOST", "127.0.0.1"))
    port: int = field(default_factory=lambda: int(env("TOKENMILL_PORT", "8080")))
    # TOKENMILL_STREAM_PREFIX: prefix of stream names, so several installs can share a NATS.
    stream_prefix: str = field(default_factory=lambda: env("TOKENMILL_STREAM_PREFIX", "TM"))
    # TOKENMILL_STREAM_REPLICAS: JetStream replicas for the streams (3 on a production cluster).
    stream_replicas: int = field(default_factory=lambda: int(env("TOKENMILL_STREAM_REPLICAS", "1")))

    def with_overrides(self, **changes: object) -> Settings:
        from dataclasses import replace

        return replace(self, **changes)  # type: ignore[arg-type]
