"""A server run on its own thread and event loop, for callers that are synchronous (a schema
fuzzer's generated tests cannot share the test's loop)."""

from __future__ import annotations

import asyncio
import threading
from typing import Self


class ThreadedServer:
    """Subclasses implement `serve`: set up, call `started()`, then `await until_stopped()`.
    `with server:` returns once it started (or raises what stopped it)."""

    start_timeout_s = 60.0

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._started = False
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=type(self).__name__, daemon=True)

    async def serve(self) -> None:
        raise NotImplementedError

    def started(self) -> None:
        self._started = True
        self._ready.set()

    async def until_stopped(self) -> None:
        assert self._stop is not None
        await self._stop.wait()

    def __enter__(self) -> Self:
        self._thread.start()
        self._ready.wait(self.start_timeout_s)
        if self._error is not None or not self._started:
            raise RuntimeError(f"{type(self).__name__} did not start") from self._error
        return self

    def __exit__(self, *_: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as e:
            self._error = e
            self._ready.set()

    async def _run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        await self.serve()
