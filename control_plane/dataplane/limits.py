"""What the gateway accepts of a request before doing any work for it (docs/dataplane.md,
"Input limits"); the values come from `Settings` (environment)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.settings import Settings


@dataclass(frozen=True)
class InputLimits:
    max_body_bytes: int = 8 * 1024 * 1024
    read_timeout_s: float = 30.0
    max_header_bytes: int = 32 * 1024

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> InputLimits:
        s = settings or Settings()
        return cls(s.v1_max_body_bytes, s.v1_read_timeout_s, s.max_header_bytes)
