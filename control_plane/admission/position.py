"""How far a replica has read a stream, and a way to wait until it has read further."""

from __future__ import annotations

import asyncio


class StreamPosition:
    def __init__(self) -> None:
        self.seq = 0
        self._advanced = asyncio.Condition()
        self._waiting = 0  # wait_for calls in progress: advance wakes nobody without them

    async def advance(self, seq: int) -> None:
        self.seq = seq
        if self._waiting:  # (once per usage event: the condition's lock only when needed)
            async with self._advanced:
                self._advanced.notify_all()

    async def wait_for(self, seq: int, within_s: float) -> bool:
        """True once the stream has been read up to `seq`; False if that took longer."""
        if self.seq >= seq:
            return True
        self._waiting += 1
        try:
            async with self._advanced:
                try:
                    await asyncio.wait_for(
                        self._advanced.wait_for(lambda: self.seq >= seq), within_s
                    )
                except TimeoutError:
                    return False
            return True
        finally:
            self._waiting -= 1
