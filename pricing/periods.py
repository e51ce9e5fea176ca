"""Billing periods: half-open UTC intervals [start, end), calendar months by default."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import msgspec

from pricing.plans import require_utc


def utc(at: datetime) -> datetime:
    """The same instant in UTC (exports and digests print every instant the same way)."""
    return require_utc(at, "timestamp").astimezone(UTC)


def _month_start(year: int, month: int) -> datetime:
    return datetime(year, month, 1, tzinfo=UTC)


def _add_months(at: datetime, months: int) -> datetime:
    index = at.year * 12 + (at.month - 1) + months
    return _month_start(index // 12, index % 12 + 1)


class BillingPeriod(msgspec.Struct, frozen=True):
    start: datetime
    end: datetime

    def __post_init__(self) -> None:
        if utc(self.start) >= utc(self.end):
            raise ValueError(f"empty billing period {self.start} .. {self.end}")

    @classmethod
    def month(cls, year: int, month: int) -> BillingPeriod:
        start = _month_start(year, month)
        return cls(start, _add_months(start, 1))

    @classmethod
    def containing(cls, at: datetime) -> BillingPeriod:
        """The calendar month (UTC) that contains `at`."""
        at = utc(at)
        return cls.month(at.year, at.month)

    @classmethod
    def parse(cls, label: str) -> BillingPeriod:
        """'2026-03' -> March 2026 (UTC)."""
        if not re.fullmatch(r"\d{4}-\d{2}", label):
            raise ValueError(f"a billing month is YYYY-MM, got {label!r}")
        year, month = label.split("-")
        return cls.month(int(year), int(month))

    @property
    def is_calendar_month(self) -> bool:
        start = utc(self.start)
        return start == _month_start(start.year, start.month) and utc(self.end) == _add_months(
            start, 1
        )

    @property
    def label(self) -> str:
        start = utc(self.start)
        if self.is_calendar_month:
            return f"{start:%Y-%m}"
        return f"{start:%Y-%m-%dT%H:%M}Z..{utc(self.end):%Y-%m-%dT%H:%M}Z"

    def contains(self, at: datetime) -> bool:
        return utc(self.start) <= utc(at) < utc(self.end)

    def following(self) -> BillingPeriod:
        """The next period: the next calendar month, or the next interval of the same length."""
        if self.is_calendar_month:
            return BillingPeriod(utc(self.end), _add_months(utc(self.end), 1))
        return BillingPeriod(utc(self.end), utc(self.end) + (utc(self.end) - utc(self.start)))


def parse_instant(text: str) -> datetime:
    """An ISO 8601 instant ('Z' allowed); one without a zone is taken as UTC."""
    at = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return utc(at) if at.tzinfo else at.replace(tzinfo=UTC)


def last_closable(now: datetime, grace: timedelta) -> BillingPeriod:
    """The latest calendar month whose end is at least `grace` before `now`."""
    open_month = BillingPeriod.containing(utc(now) - grace)
    start = open_month.start
    return BillingPeriod(_add_months(start, -1), start)


def floor_to(at: datetime, granularity: str) -> tuple[datetime, datetime]:
    """The hour or day (UTC) containing `at`, as [start, end)."""
    at = utc(at)
    if granularity == "hour":
        start = at.replace(minute=0, second=0, microsecond=0)
        return start, start + timedelta(hours=1)
    if granularity == "day":
        start = at.replace(hour=0, minute=0, second=0, microsecond=0)
        return start, start + timedelta(days=1)
    raise ValueError(f"granularity must be 'hour' or 'day', got {granularity!r}")
