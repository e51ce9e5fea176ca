"""Appending usage events: the one publisher the worker and the gateway share.

A usage event is appended until JetStream acks it: its message id (`dedupe_id`) makes a
retried append of an event already stored a duplicate ack rather than a second record, so
retrying forever (no stream yet, NATS reconnecting, a timeout) never double-counts a token.
"""

from __future__ import annotations

import asyncio
import logging

from nats.js import JetStreamContext
from nats.js.api import PubAck

from events.usage import UsageEvent, dedupe_id, encode_usage, subject_of

log = logging.getLogger("tokenmill.usage")


class UsagePublisher:
    def __init__(
        self,
        js: JetStreamContext,
        prefix: str,
        *,
        timeout_s: float = 5.0,
        first_delay_s: float = 0.05,
        max_delay_s: float = 2.0,
    ) -> None:
        self.js = js
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s

    async def publish(self, event: UsageEvent) -> PubAck:
        """One append; raises what JetStream raises."""
        return await self.js.publish(
            subject_of(self.prefix, event),
            encode_usage(event),
            headers={"Nats-Msg-Id": dedupe_id(event)},
            timeout=self.timeout_s,
        )

    async def publish_until_acked(self, event: UsageEvent) -> PubAck:
        """Append, retrying with exponential backoff until acked (a duplicate ack: an earlier
        try was stored)."""
        delay = self.first_delay_s
        while True:
            try:
                return await self.publish(event)
            except Exception as exc:  # no stream yet, NATS reconnecting, timeout: keep trying
                log.warning("usage event %s not acked (%s); retrying", dedupe_id(event), exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_delay_s)
