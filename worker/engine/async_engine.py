"""AsyncLLMEngine: drive an LLMEngine from asyncio code.

One background thread owns the engine and steps it while there is work; torch releases the GIL
in its kernels, so the event loop stays responsive. Requests and aborts reach the thread through
a queue and are applied between steps; every step's outputs go to per-request asyncio queues,
handed to each event loop in one call per step (one wake-up of the loop, not one per request:
each wake-up is Python run on the loop's thread, which then holds the GIL the engine's thread
needs to launch its next step).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from worker.engine.engine import LLMEngine, RequestOutput
from worker.engine.sequence import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[RequestOutput | BaseException]


@dataclass
class _Abort:
    request_id: str


class _Stop:
    pass


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[_Add | _Abort | _Stop] = queue.SimpleQueue()
        self._streams: dict[str, _Add] = {}  # touched by the engine thread only
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="llm-engine", daemon=True)
            self._thread.start()

    async def close(self) -> None:
        if self._thread is not None:
            self._commands.put(_Stop())
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's deltas until it finishes. Leaving early (the consumer stops
        iterating or is cancelled) aborts the request."""
        self.start()
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._commands.put(_Add(request_id, prompt, params, asyncio.get_running_loop(), outputs))
        finished = False
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    # --- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            busy = self.engine.has_unfinished_requests()
            hold = self.engine.admission_hold_s  # arrivals held for more to come
            try:  # wait for work only when there is nothing to step
                if hold > 0:
                    command = self._commands.get(timeout=hold)
                else:
                    command = self._commands.get(block=not busy)
            except queue.Empty:
                command = None
            while command is not None:
                if isinstance(command, _Stop):
                    self._fail_all(RuntimeError("the engine was shut down"))
                    return
                self._apply(command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if self.engine.has_unfinished_requests():
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # the engine itself broke: tell everyone
                    log.exception("engine step failed")
                    self._fail_all(exc)
                    continue
                self._deliver(outputs)

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            self.engine.abort(command.request_id)
            return
        try:
            self.engine.add_request(command.prompt, command.params, command.request_id)
        except Exception as exc:  # bad request: only its caller hears about it
            command.loop.call_soon_threadsafe(command.outputs.put_nowait, exc)
            return
        self._streams[command.request_id] = command

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs to their streams: one call into each event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(stream.loop, []).append((stream.outputs, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, exc)
        self._streams.clear()
        try:
            self.engine.step()  # nothing is scheduled: only collects the abort outputs
        except Exception:
            log.exception("engine could not drain after a failure")


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue_, out in items:
        queue_.put_nowait(out)
