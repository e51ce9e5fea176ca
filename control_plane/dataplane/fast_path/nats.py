"""The fast path's use of nats-py internals (see the package's docstring for why and for the
versions it is tested with): its protocol parser taking plain reply frames itself, a
subscription's pending queue replaced by a hand-over in the read loop, and `PUB` frames written
to the connection's transport. Each function leaves the connection as nats-py would (stats,
order of writes); `dispatch.WorkerClient` uses them only while `fast_path.enabled()`."""

from __future__ import annotations

import logging
import re
from typing import cast

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.protocol.parser import AWAITING_CONTROL_LINE as _AWAITING_CONTROL_LINE
from nats.protocol.parser import MAX_CONTROL_LINE_SIZE as _MAX_CONTROL_LINE_SIZE
from nats.protocol.parser import Parser

from control_plane.dataplane.dispatch import InlineHandler

log = logging.getLogger("tokenmill.dispatch")


class _Handover:
    """Stands in for a nats-py subscription's pending queue: each message goes to `handler`
    right in the client's read loop, instead of through a queue and the subscription's own
    task (one event-loop hop less per token, and fewer wake-ups under load)."""

    def __init__(self, sub: Subscription, handler: InlineHandler) -> None:
        self.sub, self.handler = sub, handler

    def put_nowait(self, msg: Msg) -> None:
        self.sub._pending_size = 0  # nothing is ever pending here
        try:
            self.handler(msg.subject, msg.data, msg.headers)
        except Exception:  # never into nats-py's read loop
            log.exception("reply handler failed on %s", msg.subject)

    def qsize(self) -> int:
        return 0

    def empty(self) -> bool:
        return True

    def task_done(self) -> None:
        return None

    async def join(self) -> None:
        return None


class _InlineParser(Parser):
    """nats-py's protocol parser, except that a plain MSG frame (no headers) for a
    subscription in `inline` goes to its handler straight from the bytes: no regex, no Msg
    object, no awaits per message. One token is one such frame, so this is the gateway's
    per-token cost of reading NATS. Every other frame (HMSG, PING, INFO, other subscriptions)
    is handed to nats-py's own parse whole, one at a time, so its state never sees a cut."""

    inline: dict[int, InlineHandler]

    async def parse(self, data: bytes = b"") -> None:
        buf = self.buf
        buf.extend(data)
        if self.state != _AWAITING_CONTROL_LINE or not self.inline:
            if buf:
                await super().parse()
            return
        pos = 0
        try:
            while True:
                pos, frame_end = self._take_inline(buf, pos)
                if frame_end is None:
                    return
                self.buf = bytearray(buf[pos:frame_end])  # that frame alone, for nats-py
                await super().parse()
                if self.buf:  # it stopped inside the frame: leave it all the rest
                    self.buf += buf[frame_end:]
                    buf = self.buf
                    pos = 0
                    return
                pos = frame_end
        finally:
            del buf[:pos]
            self.buf = buf

    def _take_inline(self, buf: bytearray, pos: int) -> tuple[int, int | None]:
        """Takes the inline frames from `pos` on; returns where it stopped and, when a whole
        frame for nats-py starts there, where that frame ends (None: wait for more bytes)."""
        size_in, subs, stats = len(buf), self.nc._subs, self.nc.stats
        while pos < size_in:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:  # an over-long line: nats-py's to refuse
                return pos, size_in if size_in - pos > _MAX_CONTROL_LINE_SIZE else None
            is_msg = buf.startswith(b"MSG ", pos)
            if not is_msg and not buf.startswith(b"HMSG ", pos):
                return pos, eol + 2  # PING, PONG, INFO, +OK, -ERR
            args = bytes(buf[pos + (4 if is_msg else 5) : eol]).split()
            if not args or not args[-1].isdigit() or (is_msg and len(args) not in (3, 4)):
                return pos, eol + 2  # malformed: nats-py says so
            end = eol + 2 + int(args[-1]) + 2
            sid = int(args[1]) if is_msg and args[1].isdigit() else None
            handler = None if sid is None else self.inline.get(sid)
            if handler is not None and sid not in subs:  # unsubscribed since
                del self.inline[sid]  # type: ignore[arg-type]
                handler = None
            if end > size_in:
                return pos, None
            if handler is None:
                return pos, end
            payload = bytes(buf[eol + 2 : end - 2])
            pos = end
            stats["in_msgs"] += 1
            stats["in_bytes"] += len(payload)
            try:
                handler(args[0].decode(), payload, None)
            except Exception:  # never into nats-py's read loop
                log.exception("reply handler failed on %s", args[0])
        return pos, None


# What nats-py refuses in a subject (a space or CRLF would break the protocol line).
_UNSAFE_SUBJECT = re.compile(r"\s")


def publish_now(nc: NATS, subject: str, payload: bytes, reply: str = "") -> bool:
    """Writes a publication straight to the socket, in one write, when nothing waits in
    nats-py's buffer (so order holds) and the connection is up; False: nothing was sent, use
    `nc.publish`. nats-py's own publish also hands a future to its flusher task, which then
    wakes for nothing: on the first-token path, work between the request and the worker."""
    transport = getattr(nc, "_transport", None)
    if (
        transport is None
        or getattr(nc, "_pending", True)
        or not nc.is_connected
        or nc.is_draining_pubs
        or len(payload) > nc.max_payload
        or _UNSAFE_SUBJECT.search(subject)
        or _UNSAFE_SUBJECT.search(reply)
    ):
        return False
    transport.write(f"PUB {subject} {reply} {len(payload)}\r\n".encode() + payload + b"\r\n")
    nc.stats["out_msgs"] += 1
    nc.stats["out_bytes"] += len(payload)
    return True


def write_pending_now(nc: NATS) -> None:
    """Writes what nats-py has pending to the socket now, rather than on its flusher task's
    next turn behind everything else the event loop has ready: the request leaves one hop
    earlier on the first-token path. (Order is kept: the flusher finds nothing left.)"""
    pending, transport = getattr(nc, "_pending", None), getattr(nc, "_transport", None)
    if pending and transport is not None and nc.is_connected:
        transport.writelines(pending[:])
        nc._pending = []
        nc._pending_data_size = 0


async def subscribe_inline(nc: NATS, subject: str, handler: InlineHandler) -> Subscription | None:
    """A subscription whose messages `handler` (synchronous, quick) takes in the read loop:
    plain messages straight from the protocol parser, others through the subscription. None:
    this nats-py has no pending queue to replace (subscribe the ordinary way)."""
    sub = await nc.subscribe(subject, pending_bytes_limit=0)
    if not hasattr(sub, "_pending_queue"):
        await sub.unsubscribe()
        return None
    sub._pending_queue = _Handover(sub, handler)  # type: ignore[assignment]
    parser = getattr(nc, "_ps", None)
    if type(parser) is Parser and all(hasattr(parser, a) for a in ("buf", "state", "nc")):
        parser.__class__ = _InlineParser  # keeps its buffer and state
        cast(_InlineParser, parser).inline = {}
    if isinstance(parser, _InlineParser):
        parser.inline[sub._id] = handler
    return sub
