"""The limits in force, in memory, from the control stream's `limits` subjects, for admission
(every field of `events.control.LimitsSet`, per scope). A limit change applies the moment its
event arrives: milliseconds after the append, on every replica. Identity (keys, tenants,
SKUs) and prices come from the governance view (`view.GovernanceView`)."""

from __future__ import annotations

from decimal import ROUND_CEILING, Decimal

import msgspec
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy

from control_plane.admission.position import StreamPosition
from control_plane.admission.view import PricePlan
from events import control
from events.control import LimitsSet, decode_limits
from events.nats_cluster import unsubscribe_within

# A limit scope: (tenant, key or None, SKU or None).
ScopeKey = tuple[str, str | None, str | None]


class LimitsBook:
    def __init__(self, js: JetStreamContext, prefix: str) -> None:
        self.js, self.prefix = js, prefix
        self.policies: dict[ScopeKey, LimitsSet] = {}
        self.position = StreamPosition()
        self._sub: object | None = None

    def apply(self, event: LimitsSet) -> None:
        self.policies[(event.tenant_id, event.key_id, event.sku_id)] = event

    def applicable(self, tenant_id: str, key_id: str, sku_id: str) -> list[LimitsSet]:
        """Every policy a request must pass: tenant-wide, tenant on this SKU, key-wide, key
        on this SKU."""
        scopes: list[ScopeKey] = [
            (tenant_id, None, None),
            (tenant_id, None, sku_id),
            (tenant_id, key_id, None),
            (tenant_id, key_id, sku_id),
        ]
        return [self.policies[s] for s in scopes if s in self.policies]

    def of_key(self, tenant_id: str, key_id: str) -> list[LimitsSet]:
        """The policies a key's holder may see: its tenant's and its own."""
        return [
            p
            for p in self.policies.values()
            if p.tenant_id == tenant_id and p.key_id in (None, key_id)
        ]

    async def start(self) -> None:
        info = await self.js.stream_info(control.control_stream_name(self.prefix))
        self._sub = await self.js.subscribe(
            f"{self.prefix}.ctl.limits.>",
            cb=self._on_message,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL,
        )
        if info.state.last_seq:
            await self._caught_up()

    async def _caught_up(self) -> None:
        """Wait until the last limits event present at start is applied."""
        try:
            last = await self.js.get_last_msg(
                control.control_stream_name(self.prefix), f"{self.prefix}.ctl.limits.>"
            )
        except Exception:  # no limits event yet
            return
        await self.position.wait_for(last.seq or 0, within_s=30.0)

    async def _on_message(self, msg) -> None:  # type: ignore[no-untyped-def]
        try:
            self.apply(decode_limits(msg.data))
        except msgspec.DecodeError:  # another event type on the subject: nothing for us
            pass
        await self.position.advance(msg.metadata.sequence.stream)

    async def stop(self) -> None:
        if self._sub is not None:
            await unsubscribe_within(self._sub)


def cost_micros(plan: PricePlan, prompt: int, cached: int, completion: int) -> int:
    """A request's price in millionths of the plan's currency, rounded up. A price per 1M
    tokens is exactly the price per token in micro-units, so the sum is exact until then."""
    exact = (
        (prompt - cached) * Decimal(plan.input_per_mtok)
        + cached * Decimal(plan.cached_input_per_mtok)
        + completion * Decimal(plan.output_per_mtok)
    )
    return int(exact.to_integral_value(rounding=ROUND_CEILING))
