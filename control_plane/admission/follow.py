"""Following a stream from the last sequence applied, across NATS restarts, node losses and
stream leader elections.

nats-py's ordered consumer re-creates itself only when a heartbeat check fires, and keeps the
first request's start policy: one started by time is re-created with both a start time and a
start sequence, which the server refuses for good (err_code 10094). This follower owns its
consumer instead: an ephemeral push consumer (no acks, flow control, idle heartbeats) that
starts at `position + 1`. A gap in the consumer sequence, a heartbeat that reports messages
this side never saw, or silence past `stall_after_s` ends that consumer; the next one starts
again from the last sequence applied, after a backoff. Only the very first consumer may
start by time, and the sequence it started at becomes the position, so every later one
starts by sequence."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from datetime import datetime

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from control_plane.admission.position import StreamPosition
from events.nats_cluster import unsubscribe_within
from tokenmill.tasks import cancel_and_wait

log = logging.getLogger(__name__)

_STATUS, _DESCRIPTION = "Status", "Description"
_LAST_CONSUMER, _STALLED = "Nats-Last-Consumer", "Nats-Consumer-Stalled"


class StreamFollower:
    """Applies every message of `stream` on `subject` once, in order, to `apply`, advancing
    `position` (the stream sequence applied last) after each. `live` says whether a consumer
    is delivering now."""

    def __init__(
        self,
        nc: NATS,
        stream: str,
        subject: str,
        apply: Callable[[Msg], None],
        position: StreamPosition,
        *,
        name: str = "follower",
        heartbeat_s: float = 1.0,
        start_time: Callable[[], datetime] | None = None,
        backoff_s: tuple[float, float] = (0.1, 5.0),
    ) -> None:
        self.nc, self.js = nc, nc.jetstream()
        self.stream, self.subject, self.apply = stream, subject, apply
        self.position, self.name = position, name
        self.heartbeat_s = heartbeat_s
        # Three heartbeats missed: the consumer is gone (its server restarted or was lost).
        self.stall_after_s = 3 * heartbeat_s
        self.start_time = start_time
        self.backoff_s = backoff_s
        self.restarts = 0  # consumers re-created after the first
        self.last_error: str | None = None
        self._started_by_seq = False  # once the position is known, never by time again
        self._consumer: str | None = None
        self._last_activity = 0.0
        self._broken: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    # -- state -----------------------------------------------------------------------------

    @property
    def live(self) -> bool:
        """A consumer exists and spoke (a message or a heartbeat) within `stall_after_s`."""
        if self._consumer is None or self._broken is None or self._broken.is_set():
            return False
        loop = asyncio.get_running_loop()
        return loop.time() - self._last_activity <= self.stall_after_s

    def status(self) -> dict[str, object]:
        """For health checks and logs."""
        return {
            "live": self.live,
            "seq": self.position.seq,
            "restarts": self.restarts,
            "last_error": self.last_error,
        }

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"follow:{self.name}")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        low, high = self.backoff_s
        delay = low
        first = True
        while True:
            began = loop.time()
            try:
                if not first:
                    self.restarts += 1
                first = False
                await self._follow_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # NATS away, stream leaderless, ...: try again
                self.last_error = f"{type(e).__name__}: {e}"
                log.warning("%s: consumer failed (%s); retrying", self.name, self.last_error)
            # A consumer that worked for a while resets the backoff; repeated failures grow it.
            delay = low if loop.time() - began > 10 * self.stall_after_s else min(high, delay * 2)
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))

    # -- one consumer ----------------------------------------------------------------------

    def _config(self, inbox: str) -> tuple[ConsumerConfig, bool]:
        by_time = self.start_time is not None and not self._started_by_seq
        config = ConsumerConfig(
            deliver_subject=inbox,
            filter_subject=self.subject,
            ack_policy=AckPolicy.NONE,
            max_deliver=1,
            flow_control=True,
            idle_heartbeat=self.heartbeat_s,
            mem_storage=True,
            num_replicas=1,
            # The server drops it soon after this side is gone (no interest).
            inactive_threshold=max(5.0, 2 * self.stall_after_s),
        )
        if by_time:
            assert self.start_time is not None
            config.deliver_policy = DeliverPolicy.BY_START_TIME
            config.opt_start_time = self.start_time()
        else:
            config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = self.position.seq + 1
        return config, by_time

    async def _follow_once(self) -> None:
        loop = asyncio.get_running_loop()
        broken = self._broken = asyncio.Event()
        expected = 1  # the next consumer sequence
        by_time = False

        async def on_msg(msg: Msg) -> None:
            nonlocal expected
            if broken.is_set():
                return
            self._last_activity = loop.time()
            headers = msg.headers
            if headers and headers.get(_STATUS) == "100":
                if msg.reply:  # a flow-control request: answer once we have read up to it
                    await self.nc.publish(msg.reply, b"")
                    return
                stalled = headers.get(_STALLED)
                if stalled:
                    await self.nc.publish(stalled, b"")
                last = headers.get(_LAST_CONSUMER)
                if last is not None and int(last) != expected - 1:
                    log.info("%s: heartbeat reports a message never seen", self.name)
                    broken.set()
                return
            meta = msg.metadata
            if meta.sequence.consumer != expected:
                log.info("%s: consumer sequence gap", self.name)
                broken.set()
                return
            expected += 1
            seq = meta.sequence.stream
            if by_time and expected == 2:
                await self._floor(seq - 1)
            if seq <= self.position.seq:
                return  # applied from an earlier consumer
            # Applying and advancing happen with no await between them: a consumer torn down
            # meanwhile can neither lose nor repeat this message.
            self.apply(msg)
            await self.position.advance(seq)

        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox, cb=on_msg)
        try:
            config, by_time = self._config(inbox)
            info = await self.js.add_consumer(
                self.stream, config, timeout=max(2.0, self.heartbeat_s)
            )
            self._consumer = info.name
            self._last_activity = loop.time()
            delivered = info.delivered
            if by_time and delivered is not None and delivered.consumer_seq == 0:
                # Nothing delivered yet: the start is one past what the info reports.
                await self._floor(delivered.stream_seq)
            self.last_error = None
            log.debug("%s: consumer %s from %s", self.name, info.name, config.deliver_policy)
            while not broken.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(broken.wait(), self.heartbeat_s)
                if loop.time() - self._last_activity > self.stall_after_s:
                    self.last_error = "consumer silent (server restarted or lost?)"
                    log.warning("%s: %s; re-creating it", self.name, self.last_error)
                    broken.set()
        finally:
            broken.set()
            consumer, self._consumer = self._consumer, None
            await unsubscribe_within(sub)
            if consumer is not None and self.nc.is_connected:
                with contextlib.suppress(Exception):
                    await self.js.delete_consumer(self.stream, consumer)

    async def _floor(self, seq: int) -> None:
        """The first consumer started by time just after `seq`: everything before is out of
        scope, so the position moves there and every later consumer starts by sequence."""
        self._started_by_seq = True
        if seq > self.position.seq:
            await self.position.advance(seq)
