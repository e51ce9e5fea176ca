"""The event store: JetStream streams for control and usage events, and appends that carry
a message id (dedupe) and the aggregate's expected version (optimistic concurrency)."""

from __future__ import annotations

from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.api import PubAck, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, NotFoundError

from events.control import (
    AnyControlEvent,
    aggregate_of,
    control_stream_name,
    control_subject,
    encode_control,
)
from events.publish import UsagePublisher
from events.usage import (
    UsageEvent,
    usage_stream_name,
)
from events.validation import validate_event

# JetStream's error code for a failed Nats-Expected-Last-Subject-Sequence check.
WRONG_LAST_SEQUENCE = 10071


class ConcurrencyError(Exception):
    """The aggregate changed since the writer read it: its expected version is stale."""

    def __init__(self, aggregate: str, aggregate_id: str, expected: int) -> None:
        super().__init__(f"{aggregate} {aggregate_id} is no longer at version {expected}")
        self.aggregate = aggregate
        self.aggregate_id = aggregate_id
        self.expected = expected


# The streams' descriptions, as NATS shows them.
CONTROL_DESCRIPTION = "tokenmill control events (tenants, keys, SKUs, price plans, limits)"
USAGE_DESCRIPTION = "tokenmill usage events (one per finished request, worker and gateway)"


@dataclass(frozen=True)
class StreamLayout:
    """Stream names and subjects for one install (`prefix` lets installs share a NATS)."""

    prefix: str = "TM"
    replicas: int = 1
    # Retries of a usage publish within this window are dropped by JetStream (Nats-Msg-Id).
    usage_dedupe_window_s: float = 2 * 3600
    control_dedupe_window_s: float = 10 * 60

    @property
    def control_stream(self) -> str:
        return control_stream_name(self.prefix)

    @property
    def usage_stream(self) -> str:
        return usage_stream_name(self.prefix)

    def control_config(self) -> StreamConfig:
        # The control log is kept forever and cannot be edited: it is the audit trail.
        return self._stream_config(
            self.control_stream,
            CONTROL_DESCRIPTION,
            "ctl",
            self.control_dedupe_window_s,
            deny_purge=True,
        )

    def usage_config(self) -> StreamConfig:
        return self._stream_config(
            self.usage_stream, USAGE_DESCRIPTION, "usage", self.usage_dedupe_window_s
        )

    def _stream_config(
        self,
        name: str,
        description: str,
        subject: str,
        dedupe_window_s: float,
        deny_purge: bool = False,
    ) -> StreamConfig:
        # Both logs keep every event (no deletes) on file, replicated, readable directly.
        return StreamConfig(
            name=name,
            description=description,
            subjects=[f"{self.prefix}.{subject}.>"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            num_replicas=self.replicas,
            duplicate_window=dedupe_window_s,
            deny_delete=True,
            deny_purge=deny_purge,
            allow_direct=True,
        )


class EventStore:
    def __init__(self, js: JetStreamContext, layout: StreamLayout) -> None:
        self.js = js
        self.layout = layout

    async def ensure_streams(self) -> None:
        """Create the streams, or bring an existing stream's config up to date."""
        for config in (self.layout.control_config(), self.layout.usage_config()):
            assert config.name is not None
            try:
                await self.js.stream_info(config.name)
            except NotFoundError:
                await self.js.add_stream(config)
            else:
                await self.js.update_stream(config)

    async def append(self, event: AnyControlEvent, expected_version: int | None) -> int:
        """Append a control event; returns its stream sequence (the aggregate's new version).

        `expected_version` is the sequence of the aggregate's last event, 0 for "must not
        exist yet", None for "don't care". A stale one raises ConcurrencyError. A retry of
        the same event (same event_id) within the dedupe window returns the first append's
        sequence instead of appending twice. An event no projection could store raises
        InvalidEvent (events.validation) and is not appended."""
        validate_event(event)
        aggregate, aggregate_id = aggregate_of(event)
        headers = {"Nats-Msg-Id": event.event_id}
        if expected_version is not None:
            headers["Nats-Expected-Last-Subject-Sequence"] = str(expected_version)
        try:
            ack = await self.js.publish(
                control_subject(self.layout.prefix, aggregate, aggregate_id),
                encode_control(event),
                headers=headers,
                stream=self.layout.control_stream,
            )
        except APIError as e:
            if e.err_code == WRONG_LAST_SEQUENCE:
                raise ConcurrencyError(aggregate, aggregate_id, expected_version or 0) from e
            raise
        return int(ack.seq)

    async def publish_usage(self, event: UsageEvent) -> PubAck:
        """One append of a usage event (events.publish.UsagePublisher retries until acked)."""
        return await UsagePublisher(self.js, self.layout.prefix).publish(event)

    async def head(self, stream: str) -> int:
        """The stream's last sequence: what a reader must reach to be caught up."""
        info = await self.js.stream_info(stream)
        return int(info.state.last_seq)
