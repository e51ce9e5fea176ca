"""Calling workers over NATS: the registry of live workers, and the client that dispatches a
request to one worker of a SKU and relays its replies.

Used by the gateway, and by the benchmark to call workers directly (no HTTP, no metering).

Size: The worker registry, the router and the worker client: all three read the workers'
announced state.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import types
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from control_plane.dataplane import fast_path
from events.nats_cluster import unsubscribe_within
from tokenmill.settings import RoutingSettings
from worker import protocol as p
from worker import request_bodies

log = logging.getLogger("tokenmill.dispatch")


class NoWorker(Exception):
    """No live worker serves the SKU (nothing ran, nothing is metered)."""


class BodyStoreUnavailable(Exception):
    """A request too large for one message could not be put into the object store that
    carries it (JetStream unavailable): nothing ran, nothing is metered."""


class WorkerLost(Exception):
    """The worker holding the request stopped heartbeating (or never accepted it)."""


class ChunkLost(Exception):
    """A token chunk never arrived (core NATS is at most once): the text has a hole."""


class ClientGone(Exception):
    """The HTTP client hung up (the relay was interrupted)."""


class RequestRejected(Exception):
    def __init__(self, rejected: p.Rejected) -> None:
        super().__init__(rejected.message)
        self.rejected = rejected


@dataclass
class WorkerInfo:
    worker_id: str
    sku_id: str
    last_seen: float  # monotonic
    model: str = ""
    backend: str = ""
    capacity: int = 0
    max_context: int | None = None
    running: int = 0
    waiting: int = 0
    kv_pressure: float = 0.0
    direct: bool = False  # it listens on its own subject (so it can be routed to)
    # This gateway's requests in flight on it, now and when its last heartbeat came: the
    # difference is what the heartbeat cannot show yet (see `WorkerRegistry.score`).
    local: int = 0
    local_at_beat: int = 0
    # NATS found no subscriber on its own subject (it died or is draining): not routed to
    # before this (monotonic).
    unreachable_until: float = 0.0


Score = tuple[int, float]  # (queue depth, KV pressure): lower is less loaded


class WorkerRegistry:
    """Live workers, from their announcements and heartbeats. A worker is dead `dead_after_s`
    after its last heartbeat, or at once when it says it is gone."""

    def __init__(self, nc: NATS, prefix: str, dead_after_s: float = 3.0) -> None:
        self.nc, self.prefix, self.dead_after_s = nc, prefix, dead_after_s
        self.workers: dict[str, WorkerInfo] = {}
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(p.presence_wildcard(self.prefix), cb=self._on_presence)
        await self.nc.publish(p.discover_subject(self.prefix), b"")
        await self.nc.flush()

    async def close(self) -> None:
        if self._sub is not None:
            await unsubscribe_within(self._sub)

    async def _on_presence(self, msg: Msg) -> None:
        try:
            m = p.decode_presence(msg.data)
        except Exception:  # a discover ping, or a newer message kind: not for us
            return
        now = time.monotonic()
        if isinstance(m, p.WorkerGone):
            self.workers.pop(m.worker_id, None)
            return
        info = self.workers.get(m.worker_id)
        if info is None:
            info = self.workers[m.worker_id] = WorkerInfo(m.worker_id, m.sku_id, now)
        info.last_seen = now
        if isinstance(m, p.WorkerAnnounce):
            info.model, info.backend, info.capacity, info.max_context = (
                m.model,
                m.backend,
                m.capacity,
                m.max_context,
            )
            info.direct, info.unreachable_until = m.direct, 0.0
        else:
            info.running, info.waiting, info.kv_pressure = m.running, m.waiting, m.kv_pressure
            info.local_at_beat = info.local

    def alive(self, worker_id: str) -> bool:
        info = self.workers.get(worker_id)
        return info is not None and time.monotonic() - info.last_seen < self.dead_after_s

    def serves(self, sku_id: str) -> bool:
        """Whether a live worker serves `sku_id` (`live_workers` without building the list)."""
        now = time.monotonic()
        for w in self.workers.values():
            if w.sku_id == sku_id and now - w.last_seen < self.dead_after_s:
                return True
        return False

    def live_workers(self, sku_id: str) -> list[WorkerInfo]:
        now = time.monotonic()
        return [
            w
            for w in self.workers.values()
            if w.sku_id == sku_id and now - w.last_seen < self.dead_after_s
        ]

    def routable(self, sku_id: str) -> list[WorkerInfo]:
        """The live workers of `sku_id` a request can be sent to by id."""
        now = time.monotonic()
        return [
            w
            for w in self.workers.values()
            if w.sku_id == sku_id
            and w.direct
            and now - w.last_seen < self.dead_after_s
            and now >= w.unreachable_until
        ]

    @staticmethod
    def score(w: WorkerInfo) -> Score:
        """(queue depth, KV pressure), compared in that order: a queued request waits for a
        whole sequence to end, while KV pressure only predicts that. The last heartbeat's
        figures, corrected by this gateway's requests sent to or finished on the worker since
        (so a burst between two heartbeats does not all land on one worker): past `capacity`
        in flight, the surplus queues; each request is taken to hold the KV share that the
        running ones hold on average (1 / capacity when none runs)."""
        delta = w.local - w.local_at_beat
        queue = max(0, w.waiting + min(delta, 0))
        if w.capacity > 0:
            queue = max(queue, w.running + w.waiting + delta - w.capacity)
        per_request = w.kv_pressure / w.running if w.running else 1 / max(w.capacity, 1)
        return queue, max(0.0, w.kv_pressure + delta * per_request)


class Router:
    """Picks the worker of a request among the live workers of its SKU: the one that last
    served the request's prompt prefix (its KV cache may hold it) unless it is overloaded,
    else the least loaded by `WorkerRegistry.score`, equals taken in turn."""

    def __init__(self, registry: WorkerRegistry, settings: RoutingSettings | None = None) -> None:
        self.registry = registry
        self.settings = settings or RoutingSettings()
        self._affinity: OrderedDict[bytes, str] = OrderedDict()
        self._turn = 0

    def prefix_key(self, request: p.GenerateRequest) -> bytes | None:
        """A hash of the prompt's stable prefix, salted with the tenant: for a chat, the
        leading system messages and the first user message (what every later turn of the
        conversation starts with); for a completion, the prompt. Text, not tokens: the same text
        renders to the same tokens on every worker of a SKU. None: no prompt."""
        if request.messages is not None:
            parts = []
            for m in request.messages:
                if m.role not in ("system", "user"):
                    break
                parts.append(f"\x1e{m.role}\x1f{m.content}")
                if m.role == "user":
                    break
            text = "".join(parts)
        else:
            text = request.prompt or ""
        if not text:
            return None
        salt = "" if self.settings.affinity_cross_tenant else request.tenant_id
        data = f"{salt}\x00{text[: self.settings.affinity_prefix_chars]}".encode()
        return hashlib.blake2b(data, digest_size=16).digest()

    def pick(self, sku_id: str, key: bytes | None) -> WorkerInfo | None:
        """None: no worker to route to by id (send to the SKU's queue group)."""
        candidates = self.registry.routable(sku_id)
        if not candidates:
            return None
        scored = [(self.registry.score(w), w) for w in candidates]
        best = min(sc for sc, _ in scored)
        held = None if key is None else self._affinity.get(key)
        if held is not None:
            s = self.settings
            for (queue, kv), w in scored:
                if w.worker_id == held:
                    if (
                        queue <= best[0] + s.affinity_queue_margin
                        and kv <= best[1] + s.affinity_kv_margin
                    ):
                        return w
                    break
        ties = [w for sc, w in scored if sc == best]
        self._turn += 1
        return ties[self._turn % len(ties)]

    def served(self, key: bytes, worker_id: str) -> None:
        """`worker_id` took a request with this prefix: the next one goes there too."""
        self._affinity[key] = worker_id
        self._affinity.move_to_end(key)
        while len(self._affinity) > self.settings.affinity_entries:
            self._affinity.popitem(last=False)


class _NoResponders:
    pass


class _Lost:
    pass


class _Interrupted:
    pass


_Item = p.Reply | _NoResponders | _Lost | _Interrupted


class ChunkSink(Protocol):
    def ready(self) -> bool:
        """Whether a chunk can be taken now (else it is queued for `batch()`)."""

    def take(self, chunk: p.TokenChunk) -> None: ...


@dataclass(eq=False)
class Dispatch:
    """One request in flight on a worker: what it has relayed so far, in order."""

    request: p.GenerateRequest
    client: WorkerClient
    # What went out: the request, or its stub when it did not fit one message (the object
    # store holds the rest, worker/request_bodies.py); a reroute sends the same again.
    sent: p.GenerateRequest
    sent_at: float = field(default_factory=time.monotonic)
    heard_at: float = field(default_factory=time.monotonic)  # the worker's last reply
    worker_id: str | None = None
    routed_to: str | None = None  # the worker it was sent to by id (None: the queue group)
    affinity_key: bytes | None = None  # its prompt prefix's hash (`Router.prefix_key`)
    counted_on: str | None = None  # the worker whose `local` count holds it
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    next_seq: int = 0
    gaps: int = 0  # chunks that never arrived
    finished: p.Finished | None = None
    # Replies not yet taken by `batch()`, and the future it waits on when there are none (a
    # deque and a bare future: cheaper per token than an asyncio.Queue).
    _items: deque[_Item] = field(default_factory=deque)
    _waiter: asyncio.Future[None] | None = None
    # Takes in-order token chunks in the read loop instead of the queue (see `relay_chunks_to`).
    _chunk_sink: ChunkSink | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def relay_chunks_to(self, sink: ChunkSink | None) -> None:
        """From now on, a token chunk that arrives in order, with nothing queued before it,
        is counted and handed to `sink` right in the NATS read loop while `sink.ready()`,
        instead of being queued for `batch()`: no wake-up of the consumer per token. Anything
        else (Finished, failures, a chunk out of order or while the sink is not ready) is
        queued as before, so `batch()` still sees every failure and every gap. None: stop."""
        self._chunk_sink = sink

    def _put(self, item: _Item) -> None:
        sink = self._chunk_sink
        if (
            sink is not None
            and type(item) is p.TokenChunk
            and item.seq == self.next_seq
            and not self._items
            and sink.ready()
        ):
            self.next_seq = item.seq + 1
            self._count(item)
            try:
                sink.take(item)
            except Exception:  # counted all the same: metering follows what the worker sent
                log.exception("chunk sink failed on %s", self.request_id)
            return
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def batch(self) -> list[p.TokenChunk]:
        """The token chunks that arrived since the last call, waiting for at least one; []
        once the worker's Finished is in (then in `finished`). Counts lost chunks in `gaps`.
        Raises NoWorker, WorkerLost, RequestRejected or ClientGone, after handing over the
        chunks that came before. May be called again after ClientGone: it goes on."""
        out: list[p.TokenChunk] = []
        while self.finished is None:
            while self._items:
                item = self._items.popleft()
                if isinstance(item, p.TokenChunk):
                    self.gaps += item.seq - self.next_seq
                    self.next_seq = item.seq + 1
                    self._count(item)
                    out.append(item)
                elif isinstance(item, p.Accepted):  # `_on_reply` takes these itself
                    self.worker_id = item.worker_id
                elif isinstance(item, p.Finished):
                    self.gaps += item.seq - self.next_seq
                    self._count(item)
                    self.finished = item
                    self.client._forget(self)
                    return out
                elif out:  # a failure: first hand over what came before it
                    self._items.appendleft(item)
                    return out
                elif isinstance(item, p.Rejected):
                    self.client._forget(self)
                    raise RequestRejected(item)
                elif isinstance(item, _NoResponders):
                    self.client._forget(self)
                    raise NoWorker(self.request.sku_id)
                elif isinstance(item, _Interrupted):
                    raise ClientGone()
                else:
                    raise WorkerLost(self.worker_id or "(no worker accepted it)")
            if out:
                return out
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return out

    async def chunks(self) -> AsyncIterator[p.TokenChunk]:
        """`batch()` one chunk at a time, until the worker's Finished."""
        while self.finished is None:
            for chunk in await self.batch():
                yield chunk

    def _count(self, m: p.TokenChunk | p.Finished) -> None:
        self.prompt_tokens, self.cached_tokens = m.prompt_tokens, m.cached_tokens
        self.completion_tokens = m.completion_tokens

    def interrupt(self) -> None:
        """Wakes the consumer of `batch()` with ClientGone (the client hung up)."""
        self._put(_Interrupted())

    async def cancel(self) -> None:
        """Tells the worker to stop; it still answers with Finished (finish reason cancelled)."""
        cancel = p.Cancel(request_id=self.request_id)
        with contextlib.suppress(Exception):
            await self.client.nc.publish(
                p.cancel_subject(self.client.prefix, self.request.sku_id), p.encode(cancel)
            )


# Takes one message of a subscription in the read loop: (subject, payload, headers or None).
InlineHandler = Callable[[str, bytes, "dict[str, str] | None"], None]


def _fast_nats() -> types.ModuleType:
    # Imported only with the fast path on: an untested nats-py need not even import it.
    from control_plane.dataplane.fast_path import nats

    return nats


async def subscribe_replies(
    nc: NATS, subject: str, handler: InlineHandler, fast: bool | None = None
) -> Subscription:
    """A subscription whose messages `handler` (synchronous, quick) takes: in nats-py's read
    loop on the fast path (`fast_path.nats.subscribe_inline`), else from a callback
    subscription. `fast`: None reads the switch (`fast_path.enabled()`)."""
    if fast is None:
        fast = fast_path.enabled()
    if fast and (sub := await _fast_nats().subscribe_inline(nc, subject, handler)) is not None:
        return sub

    async def cb(msg: Msg) -> None:
        handler(msg.subject, msg.data, msg.headers)

    return await nc.subscribe(subject, cb=cb, pending_msgs_limit=1_000_000)


class WorkerClient:
    """Dispatches requests to a SKU's queue group; all replies come to one wildcard inbox
    subscription and are routed by their token."""

    def __init__(
        self,
        nc: NATS,
        prefix: str,
        registry: WorkerRegistry,
        accept_timeout_s: float = 5.0,
        silence_timeout_s: float = 300.0,
        router: Router | None = None,
        fast: bool | None = None,
    ) -> None:
        self.nc, self.prefix, self.registry = nc, prefix, registry
        # nats-py's internals on the token path (`fast_path.nats`); None reads the switch.
        self.fast = fast_path.enabled() if fast is None else fast
        self._fast_nats = _fast_nats() if self.fast else None
        self.router = router or Router(registry)
        self.accept_timeout_s = accept_timeout_s
        # A live worker silent this long on one request lost its replies (say, our NATS
        # connection dropped and came back): fail it rather than wait forever.
        self.silence_timeout_s = silence_timeout_s
        self._inbox = nc.new_inbox()
        self._bodies = request_bodies.RequestBodies(nc, prefix)
        self._in_flight: dict[str, Dispatch] = {}
        self._sub: Subscription | None = None
        self._reaper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._sub = await subscribe_replies(self.nc, f"{self._inbox}.*", self._on_reply, self.fast)
        self._reaper = asyncio.create_task(self._reap())

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        if self._sub is not None:
            await unsubscribe_within(self._sub)

    def in_flight(self) -> int:
        return len(self._in_flight)

    async def dispatch(self, request: p.GenerateRequest) -> Dispatch:
        """`request.reply_to` is filled in here."""
        request = msgspec.structs.replace(request, reply_to=f"{self._inbox}.{request.request_id}")
        d = Dispatch(request, self, request)
        data = p.encode(request)
        if not request_bodies.fits(self.nc, data):  # before it is in flight: nothing to undo
            try:
                d.sent = await self._bodies.put(request, data)
            except Exception as exc:
                raise BodyStoreUnavailable(f"{type(exc).__name__}: {exc}") from exc
            data = p.encode(d.sent)
        self._in_flight[request.request_id] = d
        d.affinity_key = self.router.prefix_key(request)
        target = self.router.pick(request.sku_id, d.affinity_key)
        if target is None:
            subject = p.work_subject(self.prefix, request.sku_id)
        else:
            subject = p.direct_work_subject(self.prefix, request.sku_id, target.worker_id)
            d.routed_to = d.counted_on = target.worker_id
            target.local += 1
        fast_nats = self._fast_nats
        if fast_nats is None or not fast_nats.publish_now(self.nc, subject, data, request.reply_to):
            await self.nc.publish(subject, data, reply=request.reply_to)
            if fast_nats is not None:
                fast_nats.write_pending_now(self.nc)
        return d

    def _forget(self, d: Dispatch) -> None:
        if self._in_flight.get(d.request_id) is d:
            del self._in_flight[d.request_id]
            self._uncount(d)

    def _uncount(self, d: Dispatch) -> None:
        info = None if d.counted_on is None else self.registry.workers.get(d.counted_on)
        if info is not None and info.local > 0:
            info.local -= 1
        d.counted_on = None

    def _reroute(self, d: Dispatch) -> None:
        """Nobody listens on the subject of the worker it was routed to (killed, or draining,
        before its heartbeat stops): off to the SKU's queue group instead, where NATS picks a
        worker that is there (or answers 503 when none is: NoWorker)."""
        assert d.routed_to is not None
        info = self.registry.workers.get(d.routed_to)
        if info is not None:
            info.unreachable_until = time.monotonic() + self.registry.dead_after_s
        self._uncount(d)
        d.routed_to = None
        req = d.sent
        subject, data = p.work_subject(self.prefix, req.sku_id), p.encode(req)
        fast_nats = self._fast_nats
        if fast_nats is None or not fast_nats.publish_now(self.nc, subject, data, req.reply_to):
            task = asyncio.ensure_future(self.nc.publish(subject, data, reply=req.reply_to))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def _on_reply(self, subject: str, data: bytes, headers: dict[str, str] | None) -> None:
        d = self._in_flight.get(subject[len(self._inbox) + 1 :])
        if d is None:
            return
        if not data and headers and headers.get("Status") == "503":
            if d.routed_to is not None and d.worker_id is None:
                self._reroute(d)
            else:
                d._put(_NoResponders())
            return
        try:
            reply = p.decode_reply(data)
        except msgspec.DecodeError:
            return
        d.heard_at = time.monotonic()
        if isinstance(reply, p.Accepted):
            # The reaper watches this worker from now on; nothing for the consumer to do, so
            # it is not woken (the first token follows at once on a quick worker).
            d.worker_id = reply.worker_id
            if d.counted_on is None and (info := self.registry.workers.get(d.worker_id)):
                info.local += 1
                d.counted_on = d.worker_id
            if d.affinity_key is not None:
                self.router.served(d.affinity_key, d.worker_id)
            return
        d._put(reply)

    async def _reap(self) -> None:
        """Fails the requests whose worker died, or that no worker accepted in time."""
        period = min(0.2, self.registry.dead_after_s / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for d in list(self._in_flight.values()):
                if d.finished is not None:
                    continue
                if d.worker_id is None:
                    lost = now - d.sent_at > self.accept_timeout_s
                else:
                    lost = (
                        not self.registry.alive(d.worker_id)
                        or now - d.heard_at > self.silence_timeout_s
                    )
                if lost:
                    self._forget(d)
                    d._put(_Lost())
