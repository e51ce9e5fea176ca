"""Time windows for limits: fixed one-minute windows for RPM/TPM and calendar quota periods
(UTC day or month), all derived from one clock so every replica cuts them alike."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

QuotaPeriod = Literal["day", "month"]

RATE_WINDOW_S = 60.0  # RPM and TPM count over fixed, epoch-aligned minutes


@dataclass(frozen=True)
class Window:
    """A half-open interval [start, end) in epoch seconds with a stable label for KV keys."""

    label: str
    start: float
    end: float

    def reset_in(self, now: float) -> float:
        return max(0.0, self.end - now)


def rate_window(now: float) -> Window:
    index = int(now // RATE_WINDOW_S)
    return Window(f"m{index}", index * RATE_WINDOW_S, (index + 1) * RATE_WINDOW_S)


def quota_window(period: QuotaPeriod, now: float) -> Window:
    # Every instant of a UTC day is in the same day and month windows (POSIX days are exactly
    # 86,400 s), so each day's are built once: the usage ledger asks for both per request.
    return _quota_window_of_day(period, int(now // 86_400))


@functools.lru_cache(maxsize=64)
def _quota_window_of_day(period: QuotaPeriod, day: int) -> Window:
    at = datetime.fromtimestamp(day * 86_400, UTC)
    if period == "day":
        start = datetime(at.year, at.month, at.day, tzinfo=UTC)
        end_ts = start.timestamp() + 86_400
        return Window(f"d{start:%Y%m%d}", start.timestamp(), end_ts)
    start = datetime(at.year, at.month, 1, tzinfo=UTC)
    nxt = datetime(at.year + (at.month == 12), at.month % 12 + 1, 1, tzinfo=UTC)
    return Window(f"mo{start:%Y%m}", start.timestamp(), nxt.timestamp())


def go_duration(seconds: float) -> str:
    """A duration as OpenAI's rate-limit headers write it: `20ms`, `1s`, `6m0s`, `1h2m3s`.
    Whole seconds round up, so a client that waits the stated time is never early."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    total = math.ceil(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"
