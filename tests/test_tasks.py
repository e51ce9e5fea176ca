"""Ending background tasks: a cancel that the task drops (as Python 3.11's `wait_for` does when
its inner awaitable completes at the same moment) is repeated until the task ends."""

from __future__ import annotations

import asyncio

import pytest

from tokenmill.tasks import cancel_and_wait


async def test_a_dropped_cancel_is_repeated_until_the_task_ends() -> None:
    cancels = 0

    async def drops_the_first_cancel() -> None:
        nonlocal cancels
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancels += 1
                if cancels > 1:
                    raise

    task = asyncio.create_task(drops_the_first_cancel())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task, recancel_s=0.05), 5.0)
    assert task.cancelled() and cancels == 2


async def test_what_the_task_raised_reaches_the_caller() -> None:
    async def fails_on_cancel() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed") from None

    task = asyncio.create_task(fails_on_cancel())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="cleanup failed"):
        await cancel_and_wait(task)


async def test_no_task_and_an_ended_task_are_fine() -> None:
    await cancel_and_wait(None)

    async def done() -> int:
        return 1

    task = asyncio.create_task(done())
    await task
    await cancel_and_wait(task)
