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
    # TOKENMILL_NATS_URL: an external NATS (JetStream enabled): one URL, or several
    # comma-separated (seeds of one cluster; see `nats_servers`). Unset: an embedded one.
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
    # TOKENMILL_V1_MAX_BODY_BYTES: the largest /v1 request body (larger: 413, refused while
    # reading). 8 MiB holds a 262,144-token prompt at 32 JSON bytes a token: text averages 3-4
    # bytes a token, and non-ASCII text sent as \u escapes (6-12 bytes a character) fits too.
    v1_max_body_bytes: int = field(
        default_factory=lambda: int(env("TOKENMILL_V1_MAX_BODY_BYTES", str(8 * 1024 * 1024)))
    )
    # TOKENMILL_MAX_BODY_BYTES: the largest admin API body (larger: a 413 problem before the
    # handler). 1 MiB is ample for any admin write.
    max_body_bytes: int = field(
        default_factory=lambda: int(env("TOKENMILL_MAX_BODY_BYTES", str(1024 * 1024)))
    )
    # TOKENMILL_V1_READ_TIMEOUT_S: a /v1 body must be in this long after its head (408 after);
    # so must any request's head after its first byte. 30 s carries 8 MiB at 280 KB/s.
    v1_read_timeout_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_V1_READ_TIMEOUT_S", 30.0)
    )
    # TOKENMILL_MAX_HEADER_BYTES: the largest request head (request line and headers, any
    # path; larger: 431). 32 KiB is nginx's default (4 x 8 KiB); a tokenmill key is 55 bytes.
    max_header_bytes: int = field(
        default_factory=lambda: int(env("TOKENMILL_MAX_HEADER_BYTES", str(32 * 1024)))
    )

    @property
    def nats_servers(self) -> list[str]:
        """TOKENMILL_NATS_URL as nats-py's `servers=` list (empty when unset)."""
        if not self.nats_url:
            return []
        from control_plane.nats_cluster import nats_servers

        return nats_servers(self.nats_url)

    def with_overrides(self, **changes: object) -> Settings:
        from dataclasses import replace

        return replace(self, **changes)  # type: ignore[arg-type]
