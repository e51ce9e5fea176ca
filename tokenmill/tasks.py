"""Ending background asyncio tasks at shutdown."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

# How long one cancel is given before it is repeated.
RECANCEL_S = 1.0


async def cancel_and_wait(task: asyncio.Task[Any] | None, recancel_s: float = RECANCEL_S) -> None:
    """Cancel `task` and return once it has ended, raising what it raised other than the
    cancel. On Python 3.11 `asyncio.wait_for` drops a cancel that lands as its inner awaitable
    completes (fixed in 3.12): a loop around it keeps running, and a plain `cancel(); await
    task` waits for good. So the cancel is repeated until the task ends."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=recancel_s)
    with contextlib.suppress(asyncio.CancelledError):
        task.result()
