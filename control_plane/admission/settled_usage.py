"""Settled usage, read from the usage stream by every replica: the worker's RequestFinished
events summed per (tenant or key, SKU or all, quota period). Every replica that has applied
the same prefix of the stream holds the same sums, so settled usage needs no shared counter,
survives any gateway crash, and is exactly what billing will charge."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from control_plane.admission.follow import StreamFollower
from control_plane.admission.limits import cost_micros
from control_plane.admission.position import StreamPosition
from control_plane.admission.view import GovernanceView
from control_plane.admission.windows import quota_window
from events.usage import RequestFinished, decode_usage, usage_stream_name

# (scope id: tenant or key, SKU id or None for all SKUs, quota window label)
UsageKey = tuple[str, str | None, str]


@dataclass
class Usage:
    requests: int = 0
    total_tokens: int = 0
    output_tokens: int = 0
    spend_micros: dict[str, int] = field(default_factory=dict)  # per currency


def usage_keys(event: RequestFinished) -> list[UsageKey]:
    at = event.started_at.timestamp()
    labels = (quota_window("day", at).label, quota_window("month", at).label)
    return [
        (scope, sku, label)
        for scope in (event.tenant_id, event.key_id)
        for sku in (None, event.sku_id)
        for label in labels
    ]


class SettledUsage:
    """Follows the usage stream (all of it, so its position is the stream's) from the start
    of the previous month (quota periods are at most a month) and keeps the sums;
    `on_settled` is told of each new request. The follower re-creates its consumer from the
    last sequence applied whenever NATS restarts, loses a node or moves the stream's leader;
    `live` says whether it is following now (for /readyz)."""

    def __init__(
        self,
        nc: NATS,
        prefix: str,
        view: GovernanceView,
        on_settled: Callable[[RequestFinished], None] | None = None,
        *,
        heartbeat_s: float = 1.0,
    ) -> None:
        self.js, self.prefix, self.view, self.on_settled = nc.jetstream(), prefix, view, on_settled
        self.usage: dict[UsageKey, Usage] = {}
        self.position = StreamPosition()
        self.follower = StreamFollower(
            nc,
            usage_stream_name(prefix),
            f"{prefix}.usage.>",
            self._on_message,
            self.position,
            name="usage ledger",
            heartbeat_s=heartbeat_s,
            start_time=_previous_month_start,
        )

    @property
    def live(self) -> bool:
        """Whether usage reaches this replica now. While False, settled sums are stale (they
        catch up once it is live again, from where they stopped)."""
        return self.follower.live

    def get(self, scope_id: str, sku_id: str | None, window_label: str) -> Usage:
        return self.usage.get((scope_id, sku_id, window_label)) or Usage()

    def apply(self, event: RequestFinished) -> None:
        price = self.view.price_plan_at(event.sku_id, event.started_at)
        cost = (
            cost_micros(price, event.prompt_tokens, event.cached_tokens, event.completion_tokens)
            if price
            else 0
        )
        for key in usage_keys(event):
            usage = self.usage.setdefault(key, Usage())
            usage.requests += 1
            usage.total_tokens += event.prompt_tokens + event.completion_tokens
            usage.output_tokens += event.completion_tokens
            if price:
                usage.spend_micros[price.currency] = (
                    usage.spend_micros.get(price.currency, 0) + cost
                )

    async def start(self, within_s: float = 60.0) -> None:
        """Start following; return once the usage present now is applied."""
        info = await self.js.stream_info(usage_stream_name(self.prefix))
        self.follower.start()
        if info.state.last_seq:
            await self.position.wait_for(info.state.last_seq, within_s=within_s)

    def _on_message(self, msg: Msg) -> None:
        event = decode_usage(msg.data)
        if isinstance(event, RequestFinished):
            # Applying and telling admission happen without an await between them, so no
            # admission ever sees the usage both settled and still reserved, or neither.
            self.apply(event)
            if self.on_settled:
                self.on_settled(event)

    async def stop(self) -> None:
        await self.follower.stop()


def _previous_month_start() -> datetime:
    now = datetime.now(UTC)
    return datetime(now.year - (now.month == 1), (now.month - 2) % 12 + 1, 1, tzinfo=UTC)
