"""The gateway's side of a request: dispatch to a worker, relay its chunks, and bill what
reached the client, exactly once, whatever happens to the client or the worker.

Billing follows delivery
------------------------
Each dispatched request leaves three records on the usage stream, in two messages:

- `WorkerGenerated` (`wk:<request_id>`, from the worker): the tokens it generated;
- `RequestFinished` (`req:<request_id>`, from this gateway, published at once): the bill, the
  delivered tokens, with the completion tokens generated but not delivered as
  `unbilled_waste_tokens`. Prompt tokens are billed when anything was delivered (a token, or a
  whole answer); a request answered with an error before any token bills nothing.
- its `delivered` (a `Delivery`, in the same message): the gateway's delivery record, the
  tokens written to the client's connection (a stream's chunks handed to the socket; a whole
  answer's body; 0 for an error answer). One message, so a gateway killed at any moment
  leaves a request with both or neither: never a bill without its delivery record (older
  gateways batched it apart, as GatewayDelivered, and a kill could lose it alone).

Only the gateway bills, once per request id: JetStream's dedupe window
(`StreamLayout.usage_dedupe_window_s`, 2 h) drops retries and the ledger's unique request id
anything later, so the bill is exactly once in any order of arrival. A client that hangs up
makes the gateway send Cancel and drain the worker's chunks until its Finished, so the waste is
exact. A worker that dies mid-stream (its heartbeat stops, or no worker accepts within
`accept_timeout_s`) is billed for what was delivered and reported `worker_lost`. A gateway that
dies before billing leaves the request unbilled (nothing shows it reached the client); its
workers stop generating for it within the gateway lease (see `worker.serve`), and
`tokenmill reconcile` lists it as gateway lost, its generated tokens as waste. Requests
refused before dispatch ran nothing and are not metered.

Size: The gateway's side of one request from dispatch to bill (relay, conclude, report) in one
module, so that the billing rule, what was delivered, reads in one place.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

import msgspec
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from control_plane.dataplane.dispatch import (
    ChunkLost,
    ClientGone,
    Dispatch,
    NoWorker,
    RequestRejected,
    WorkerClient,
    WorkerLost,
    WorkerRegistry,
)
from events.publish import UsagePublisher
from events.usage import (
    Delivery,
    FinishReason,
    RequestFinished,
    UsageEvent,
)
from tokenmill.settings import GatewaySettings
from worker import protocol as p

log = logging.getLogger("tokenmill.gateway")


@dataclass(frozen=True)
class Outcome:
    """How one dispatched request ended, as the gateway saw it."""

    request: p.GenerateRequest
    worker_id: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: FinishReason
    client_disconnected: bool
    ttft_s: float | None
    e2e_s: float
    itl_s: list[float]
    # Delivered to the client (what was billed), and generated but never delivered.
    delivered_completion_tokens: int = 0
    unbilled_waste_tokens: int = 0


# Called once per dispatched request when it ends (metrics, ...).
OutcomeListener = Callable[[Outcome], None]


class Reservation(Protocol):
    """What admission reserved for a request (governance's Ticket): exactly one of these
    ends it."""

    def finish(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> None: ...

    def abandon(self) -> None:
        """Dispatched, outcome unknown here: quotas settle from the usage stream."""

    def release(self) -> None:
        """Never ran: everything goes back."""


class Gateway:
    """Owns the data plane's NATS clients: the worker registry, dispatch, usage publication."""

    def __init__(self, nc: NATS, prefix: str, settings: GatewaySettings | None = None) -> None:
        self.nc, self.prefix = nc, prefix
        self.settings = settings or GatewaySettings()
        self.js: JetStreamContext = nc.jetstream()
        self._usage = UsagePublisher(self.js, prefix)
        self.registry = WorkerRegistry(nc, prefix, self.settings.worker_dead_after_s)
        self.client = WorkerClient(
            nc,
            prefix,
            self.registry,
            self.settings.accept_timeout_s,
            self.settings.silence_timeout_s,
        )
        self._listeners: list[OutcomeListener] = []
        self._background: set[asyncio.Task[object]] = set()
        # Ended requests not yet reported to the outcome listeners (see `_report_ended`).
        self._ended: list[Outcome] = []
        self._reporting: asyncio.Task[None] | None = None
        self._leasing: asyncio.Task[None] | None = None

    @property
    def gateway_id(self) -> str:
        return self.settings.gateway_id

    async def start(self) -> None:
        await self.registry.start()
        await self.client.start()
        self._leasing = asyncio.create_task(self._lease())
        if self.settings.report_every_s > 0:
            self._reporting = asyncio.create_task(self._report_ended())

    async def close(self, within: float = 10.0) -> None:
        """Reports the ended requests still waiting to the listeners and lets in-flight usage
        publications finish (they retry until acked)."""
        if self._reporting is not None:
            self._reporting.cancel()
        self._report_now()
        # The lease holds while in-flight requests drain; a gateway that dies just stops.
        if self._background:
            await asyncio.wait(set(self._background), timeout=within)
        if self._leasing is not None:
            self._leasing.cancel()
        await self.client.close()
        await self.registry.close()

    def on_outcome(self, listener: OutcomeListener) -> None:
        self._listeners.append(listener)

    def serves(self, sku_id: str) -> bool:
        return self.registry.serves(sku_id)

    async def open(
        self, request: p.GenerateRequest, reservation: Reservation | None = None
    ) -> Relay:
        """Dispatches to a worker of the request's SKU. Raises NoWorker when none is live.
        The relay ends `reservation` when the request ends."""
        if not self.serves(request.sku_id):
            raise NoWorker(request.sku_id)
        request = msgspec.structs.replace(request, gateway_id=self.gateway_id)
        return Relay(self, await self.client.dispatch(request), reservation)

    async def _lease(self) -> None:
        """This gateway's lease: while workers hear it, they keep generating for its requests."""
        subject = p.gateway_lease_subject(self.prefix, self.gateway_id)
        while True:
            try:
                await self.nc.publish(subject, b"")
            except Exception:  # reconnecting: the next beat goes out once it is back
                log.debug("lease not published", exc_info=True)
            await asyncio.sleep(self.settings.lease_every_s)

    # -- metering ------------------------------------------------------------------------------

    def _conclude(
        self,
        relay: Relay,
        finish_reason: p.FinishReason,
        client_disconnected: bool,
        *,
        worker_lost: bool,
    ) -> None:
        d = relay.dispatch
        now = time.monotonic()
        reason: FinishReason = "stop" if finish_reason == "tool_calls" else finish_reason
        # Generated: the worker's final count (its Finished, or the last chunk received from a
        # worker that was lost); delivered: what reached the client's connection.
        delivered = min(relay.delivered_completion_tokens, d.completion_tokens)
        billed_any = delivered > 0 or relay.answered
        prompt = d.prompt_tokens if billed_any else 0
        cached = d.cached_tokens if billed_any else 0
        waste = d.completion_tokens - delivered
        outcome = Outcome(
            request=d.request,
            worker_id=d.worker_id,
            prompt_tokens=d.prompt_tokens,
            cached_tokens=d.cached_tokens,
            completion_tokens=d.completion_tokens,
            finish_reason=reason,
            client_disconnected=client_disconnected,
            ttft_s=None if relay.first_token_at is None else relay.first_token_at - relay.started,
            e2e_s=now - relay.started,
            itl_s=relay.itl_s,
            delivered_completion_tokens=delivered,
            unbilled_waste_tokens=waste,
        )
        finished_at = datetime.now(UTC)
        if relay.reservation is not None:
            relay.reservation.finish(prompt, cached, delivered)
        record = Delivery(
            gateway_id=self.gateway_id,
            prompt_tokens=prompt,
            completion_tokens=delivered,
            finish_reason=reason,
            client_disconnected=client_disconnected,
            worker_lost=worker_lost,
        )
        self._publish(self._bill(outcome, prompt, cached, relay.started_at, finished_at, record))
        self._after(outcome)

    def _after(self, outcome: Outcome) -> None:
        # Batching pays off only for an answer whose client goes on to its next request; any
        # other end (a hang-up, an error) has no next request waiting, so it is reported at once.
        quiet = outcome.client_disconnected or outcome.finish_reason in ("cancelled", "error")
        if quiet or self._reporting is None or self._reporting.done():
            self._report([outcome])
        else:
            self._ended.append(outcome)

    async def _report_ended(self) -> None:
        """Ended requests are reported to the outcome listeners (metrics) together every
        `report_every_s`, not each as it ends. A streamed request ends when its client is about
        to send the next one: work done then runs exactly while that next request waits for
        its first token. No record waits here: the bill and its delivery record go out at once,
        in one message (`_conclude`)."""
        while True:
            await asyncio.sleep(self.settings.report_every_s)
            self._report_now()

    def _report_now(self) -> None:
        ended, self._ended = self._ended, []
        self._report(ended)

    def _report(self, ended: list[Outcome]) -> None:
        for outcome in ended:
            for listener in self._listeners:
                try:
                    listener(outcome)
                except Exception:
                    log.exception("outcome listener failed")

    @staticmethod
    def _bill(
        o: Outcome,
        prompt: int,
        cached: int,
        started_at: datetime,
        finished_at: datetime,
        delivered: Delivery,
    ) -> RequestFinished:
        r = o.request
        return RequestFinished(
            request_id=r.request_id,
            tenant_id=r.tenant_id,
            key_id=r.key_id,
            sku_id=r.sku_id,
            model=r.model,
            worker_id=o.worker_id or "",
            prompt_tokens=prompt,
            cached_tokens=cached,
            completion_tokens=o.delivered_completion_tokens,
            finish_reason=o.finish_reason,
            ttft_ms=None if o.ttft_s is None else o.ttft_s * 1000,
            e2e_ms=o.e2e_s * 1000,
            started_at=started_at,
            finished_at=finished_at,
            unbilled_waste_tokens=o.unbilled_waste_tokens,
            delivered=delivered,
        )

    def _publish(self, event: UsageEvent) -> None:
        self._spawn(self._usage.publish_until_acked(event))

    def _spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class Relay:
    """One dispatched request, for the HTTP layer: take `batch()` until it returns [] (or
    raises), answer the client, then call `release()` however that went: the bookkeeping
    (metering, quotas, metrics) happens there, off the token path, and a request that has not
    ended (the client hung up, a chunk was lost) is cancelled on the worker and billed (for
    what was delivered) once the worker confirms."""

    def __init__(
        self, gateway: Gateway, dispatch: Dispatch, reservation: Reservation | None = None
    ) -> None:
        self.gateway, self.dispatch, self.reservation = gateway, dispatch, reservation
        self.started = time.monotonic()
        self.started_at = datetime.now(UTC)
        self.first_token_at: float | None = None
        self.itl_s: list[float] = []
        self._last_token_at = 0.0
        self._concluded = False
        self._chunk_lost = False
        self._worker_lost = False
        # Set by the HTTP layer: the completion tokens written to the client's connection,
        # and whether the whole answer (a body, or a stream's end) was.
        self.delivered_completion_tokens = 0
        self.answered = False

    @property
    def finished(self) -> p.Finished | None:
        return self.dispatch.finished

    async def batch(self) -> list[p.TokenChunk]:
        """The worker's chunks that arrived since the last call, in order; [] once it finished
        (see `finished`). Raises NoWorker, RequestRejected (nothing metered), WorkerLost
        (billed at `release` for what was delivered), ChunkLost or ClientGone (billed once
        `release` has cancelled and drained it)."""
        d = self.dispatch
        try:
            chunks = await d.batch()
        except (NoWorker, RequestRejected):
            self._concluded = True
            if self.reservation is not None:
                self.reservation.release()
            raise
        except WorkerLost:
            # Billed at `release`, once the HTTP layer has said what reached the client.
            self._worker_lost = True
            raise
        if d.gaps:
            self._chunk_lost = True
            raise ChunkLost(f"{d.gaps} chunk(s) of {d.request_id} lost")
        now = 0.0
        for chunk in chunks:
            if chunk.text:
                self._timed(now := now or time.monotonic())
        return chunks

    def _timed(self, now: float) -> None:
        # A token with text reached the client's side of the gateway at `now`.
        if self.first_token_at is None:
            self.first_token_at = now
        else:
            self.itl_s.append(now - self._last_token_at)
        self._last_token_at = now

    def relay_chunks_with(
        self,
        write: Callable[[p.TokenChunk], None] | None,
        ready: Callable[[], bool] = lambda: True,
    ) -> None:
        """From now on, chunks that arrive in order go to `write` right in the NATS read loop
        (timed and counted as `batch()` would) while `ready()`; the rest, and how the request
        ends, still come from `batch()`. None: stop."""
        self.dispatch.relay_chunks_to(None if write is None else _ChunkSink(self, write, ready))

    async def chunks(self) -> AsyncIterator[p.TokenChunk]:
        """`batch()` one chunk at a time."""
        while self.dispatch.finished is None:
            for chunk in await self.batch():
                yield chunk

    def interrupt(self) -> None:
        """The client hung up: whoever waits in `batch()` gets ClientGone."""
        if not self._concluded and not self._worker_lost:
            self.dispatch.interrupt()

    def release(self) -> None:
        """Ends the request's bookkeeping: at once if the worker finished; else cancel it on
        the worker and meter it once the worker confirms, in the background."""
        if self._concluded:
            return
        self._concluded = True
        d = self.dispatch
        if self._worker_lost:
            self.gateway._conclude(self, "error", False, worker_lost=True)
            return
        if d.finished is not None and not self._chunk_lost:
            self.gateway._conclude(self, d.finished.finish_reason, False, worker_lost=False)
            return
        self.gateway._spawn(self._cancel_and_drain(client_disconnected=not self._chunk_lost))

    async def _cancel_and_drain(self, client_disconnected: bool) -> None:
        d = self.dispatch
        if d.finished is None:
            await d.cancel()
        try:
            while d.finished is None:
                try:
                    await d.batch()
                except ClientGone:  # a late interrupt: we are already draining
                    continue
        except (NoWorker, RequestRejected):
            if self.reservation is not None:
                self.reservation.release()
            return
        except WorkerLost:
            self.gateway._conclude(self, "error", client_disconnected, worker_lost=True)
            return
        assert d.finished is not None
        self.gateway._conclude(
            self, d.finished.finish_reason, client_disconnected, worker_lost=False
        )


class _ChunkSink:
    def __init__(
        self, relay: Relay, write: Callable[[p.TokenChunk], None], ready: Callable[[], bool]
    ) -> None:
        self.relay, self.write, self.ready = relay, write, ready

    def take(self, chunk: p.TokenChunk) -> None:
        if chunk.text:
            self.relay._timed(time.monotonic())
        self.write(chunk)


__all__ = [
    "ChunkLost",
    "ClientGone",
    "Gateway",
    "GatewaySettings",
    "NoWorker",
    "Outcome",
    "OutcomeListener",
    "Relay",
    "Reservation",
    "RequestRejected",
    "WorkerLost",
]
