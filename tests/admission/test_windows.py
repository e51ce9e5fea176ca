"""Quota windows (built once per UTC day) and the stream position replicas wait on."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from control_plane.admission.position import StreamPosition
from control_plane.admission.windows import quota_window


def ts(*args: int) -> float:
    return datetime(*args, tzinfo=UTC).timestamp()  # type: ignore[misc]


@pytest.mark.parametrize(
    "instant, day, month",
    [
        (ts(2026, 11, 30, 23, 59, 59), "d20261130", "mo202611"),
        (ts(2026, 12, 1), "d20261201", "mo202612"),
        (ts(2026, 12, 31, 23, 59, 59) + 0.999, "d20261231", "mo202612"),
        (ts(2027, 1, 1), "d20270101", "mo202701"),
        (ts(2028, 2, 29, 12), "d20280229", "mo202802"),
    ],
)
def test_quota_windows_cut_at_utc_midnight_and_month_start(
    instant: float, day: str, month: str
) -> None:
    d, m = quota_window("day", instant), quota_window("month", instant)
    assert (d.label, m.label) == (day, month)
    at = datetime.fromtimestamp(instant, UTC)
    start = datetime(at.year, at.month, at.day, tzinfo=UTC)
    assert (d.start, d.end) == (start.timestamp(), (start + timedelta(days=1)).timestamp())
    assert d.start <= instant < d.end and m.start <= instant < m.end
    first = datetime(at.year, at.month, 1, tzinfo=UTC)
    assert (
        m.start == first.timestamp()
        and m.end == (first + timedelta(days=32)).replace(day=1).timestamp()
    )
    assert quota_window("day", d.end) != d  # the next instant is the next day
    assert quota_window("day", d.start) == d


async def test_a_stream_position_wakes_its_waiters_and_times_out_without_them() -> None:
    position = StreamPosition()
    await position.advance(3)  # nobody waits: nothing to wake
    assert await position.wait_for(2, within_s=0.01)
    waiter = asyncio.create_task(position.wait_for(10, within_s=5.0))
    await asyncio.sleep(0.01)
    await position.advance(9)
    await asyncio.sleep(0.01)
    assert not waiter.done()
    await position.advance(10)
    assert await asyncio.wait_for(waiter, 1.0)
    assert not await position.wait_for(11, within_s=0.05)
    assert position._waiting == 0
