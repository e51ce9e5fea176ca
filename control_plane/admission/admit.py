"""Admission: who may send this request now, and what it reserves.

The gateway calls, per /v1 request, after its own key lookup (admission.keys.Authorizer):

    decision = await admission.admit(tenant_id, key_id, sku_id, prompt_tokens, max_tokens,
                                     request_id)
    if isinstance(decision, Refusal):   # 429: decision.body(), decision.response_headers()
    ... dispatch with max_tokens=decision.max_tokens; add decision.headers to the response ...
    decision.finish(prompt_tokens, cached_tokens, completion_tokens)   # usage known
    decision.abandon()   # dispatched, outcome unknown (client gone, worker died)
    decision.release()   # never dispatched (no worker, error before dispatch)

A request reserves, against every policy that applies to it (tenant, tenant x SKU, key,
key x SKU): one request of RPM, prompt + max_tokens of TPM and of a token quota (or
max_tokens for an output-token quota, or their price for a spend cap), and one stream slot.
`finish` settles rate windows to the actual count at once; quota reservations settle when
the request's RequestFinished arrives on the usage stream (the worker publishes it even when
the gateway is gone) or expire after `reservation_ttl_s` — never leaked.

Size: Admission's API and the reservation bookkeeping of every policy scope: the scopes share
one reserve/settle path.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Literal

from nats.aio.client import Client as NATS

from control_plane.admission.budgets import BudgetSpec, BudgetStore, Clock, SharedBudget
from control_plane.admission.limits import LimitsBook, cost_micros
from control_plane.admission.settled_usage import SettledUsage
from control_plane.admission.view import GovernanceView
from control_plane.admission.windows import Window, go_duration, quota_window, rate_window
from events.control import LimitsSet
from events.usage import RequestFinished
from tokenmill.settings import AdmissionSettings
from tokenmill.tasks import cancel_and_wait

log = logging.getLogger(__name__)
BudgetKind = Literal["streams", "rpm", "tpm", "quota"]
# Rate-limit headers report this where no limit applies (clients parse the headers as ints).
UNLIMITED = 2_147_483_647


@dataclass
class Hold:
    """Units of one budget a request holds."""

    kind: BudgetKind
    budget: SharedBudget
    units: int
    window: Window | None
    metric: str = ""  # for quotas: total_tokens, output_tokens or spend
    policy: LimitsSet | None = None
    # how far past a quota this request may go as the one that crosses the line (None: any)
    may_overdraw: int | None = None


@dataclass
class Refusal:
    """An OpenAI error for the gateway to return as is."""

    status: int
    type: str
    code: str
    message: str
    retry_after_s: float | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {"message": self.message, "type": self.type, "param": None, "code": self.code}
        }

    def response_headers(self) -> dict[str, str]:
        headers = dict(self.headers)
        if self.retry_after_s is not None:
            headers["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
        return headers


@dataclass
class Ticket:
    """An admitted request. Exactly one of finish / abandon / release ends it."""

    admission: Admission
    request_id: str
    tenant_id: str
    key_id: str
    sku_id: str
    prompt_tokens: int
    max_tokens: int  # what was reserved; dispatch with this cap
    holds: list[Hold]
    headers: dict[str, str]
    done: bool = False

    def finish(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> None:
        if self.done:
            return
        self.done = True
        actual_total = prompt_tokens + completion_tokens
        for hold in self.holds:
            if hold.kind == "streams":
                hold.budget.give_back(hold.units)
            elif hold.kind == "tpm":
                hold.budget.give_back(max(0, hold.units - actual_total))
        self.admission._settle_quota(self, (prompt_tokens, cached_tokens, completion_tokens))

    def abandon(self) -> None:
        """Dispatched, but the outcome is unknown here: the stream slot frees now; the rate
        window keeps what was reserved; quotas wait for the usage stream."""
        if self.done:
            return
        self.done = True
        for hold in self.holds:
            if hold.kind == "streams":
                hold.budget.give_back(hold.units)

    def release(self) -> None:
        """Never dispatched: every unit goes back."""
        if self.done:
            return
        self.done = True
        for hold in self.holds:
            if hold.kind != "quota":
                hold.budget.give_back(hold.units)
        self.admission._settle_quota(self, None)


@dataclass
class _AwaitingUsage:
    holds: list[Hold]
    expires_at: float
    sku_id: str = ""


class Admission:
    def __init__(
        self,
        nc: NATS,
        prefix: str,
        view: GovernanceView,
        *,
        replica_id: str | None = None,
        settings: AdmissionSettings | None = None,
        clock: Clock = time.time,
    ) -> None:
        self.settings = settings or AdmissionSettings()
        self.replica_id = replica_id or "gw-" + uuid.uuid4().hex[:12]
        self.clock = clock
        self.view = view  # the backbone's: prices (its owner starts and stops it)
        js = nc.jetstream()
        self.limits = LimitsBook(js, prefix)
        self.ledger = SettledUsage(
            nc,
            prefix,
            self.view,
            on_settled=self._on_settled,
            heartbeat_s=self.settings.follower_heartbeat_s,
        )
        self.budgets = BudgetStore(
            js,
            prefix,
            self.replica_id,
            clock=clock,
            lease_fraction=self.settings.lease_fraction,
            idle_return_s=self.settings.idle_return_s,
            usage_seq=lambda: self.ledger.position.seq,
            wait_usage=self.ledger.position.wait_for,
            replicas=self.settings.kv_replicas,
        )
        # quota reservations waiting for their request on the usage stream
        self._awaiting: dict[str, _AwaitingUsage] = {}
        self._sync_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.budgets.open()
        await self.limits.start()
        await self.ledger.start()
        self._sync_task = asyncio.create_task(self._sync_loop())

    async def stop(self) -> None:
        await cancel_and_wait(self._sync_task)
        await self.budgets.close()
        await self.limits.stop()
        await self.ledger.stop()

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sync_interval_s)
            try:
                self._expire_reservations()
                await self.budgets.sync_all()
            except asyncio.CancelledError:
                raise
            except Exception:  # NATS briefly away: the next round retries
                log.warning("governance sync failed", exc_info=True)

    # -- admission ----------------------------------------------------------------------

    async def admit(
        self,
        tenant_id: str,
        key_id: str,
        sku_id: str,
        prompt_tokens: int,
        max_tokens: int | None = None,
        request_id: str | None = None,
        choices: int = 1,
    ) -> Ticket | Refusal:
        """Reserve what the request may use against every policy that applies, or refuse
        (429) naming the first that cannot take it. No I/O unless a lease runs short.
        `choices` (OpenAI `n`) sequences each may write `max_tokens`: all are reserved, and
        the ticket's `max_tokens` is their total."""
        cap = max_tokens if max_tokens is not None else self.settings.default_max_tokens
        cap *= max(1, choices)
        ticket = Ticket(
            self,
            request_id or uuid.uuid4().hex,
            tenant_id,
            key_id,
            sku_id,
            prompt_tokens,
            cap,
            [],
            {},
        )
        holds = self._holds(ticket)
        if choices > 1:  # n choices cross a quota's line by at most one choice's reservation
            for hold in holds:
                if hold.kind == "quota":
                    hold.may_overdraw = hold.units // choices
        taken = [h for h in holds if h.budget.try_take(h.units)]
        if len(taken) < len(holds):  # some lease ran short: take one by one, leasing as needed
            for hold in taken:
                hold.budget.give_back(hold.units)
            taken = []
            for hold in holds:
                if not await hold.budget.take(hold.units, hold.may_overdraw):
                    for got in taken:
                        got.budget.give_back(got.units)
                    return self._refusal(hold, holds)
                taken.append(hold)
        ticket.holds = holds
        ticket.headers = rate_limit_headers(holds, self.clock())
        quota_holds = [h for h in holds if h.kind == "quota"]
        if quota_holds:
            self._awaiting[ticket.request_id] = _AwaitingUsage(
                quota_holds, self.clock() + self.settings.reservation_ttl_s, sku_id
            )
        return ticket

    def open_reservations(self) -> dict[str, tuple[int, int]]:
        """Per SKU id: quota reservations not yet settled from the usage stream, and the
        tokens they hold (per request, its largest token hold: several policies reserve the
        same tokens)."""
        out: dict[str, tuple[int, int]] = {}
        for waiting in self._awaiting.values():
            count, tokens = out.get(waiting.sku_id, (0, 0))
            held = max((h.units for h in waiting.holds if h.metric != "spend"), default=0)
            out[waiting.sku_id] = (count + 1, tokens + held)
        return out

    def _holds(self, ticket: Ticket) -> list[Hold]:
        now = self.clock()
        holds: list[Hold] = []
        for policy in self.limits.applicable(ticket.tenant_id, ticket.key_id, ticket.sku_id):
            holds.extend(self._policy_holds(policy, ticket, now))
        return holds

    def _policy_holds(self, policy: LimitsSet, ticket: Ticket, now: float) -> list[Hold]:
        scope, sku = policy.scope_id, policy.sku_id or "all"
        base = f"{scope}.{sku}"
        holds: list[Hold] = []
        s = self.settings
        zero: Callable[[], int] = lambda: 0  # noqa: E731 - rate windows and slots settle nothing
        if policy.max_concurrent_streams is not None:
            spec = BudgetSpec(
                f"c.{base}", policy.max_concurrent_streams, False, s.stream_slot_ttl_s
            )
            holds.append(Hold("streams", self.budgets.budget(spec, zero), 1, None))
        window = rate_window(now)
        for kind, limit, units in (
            ("rpm", policy.requests_per_minute, 1),
            ("tpm", policy.tokens_per_minute, ticket.prompt_tokens + ticket.max_tokens),
        ):
            if limit is not None:
                spec = BudgetSpec(
                    f"r.{base}.{kind}.{window.label}", limit, False, 120.0, window.end
                )
                holds.append(Hold(kind, self.budgets.budget(spec, zero), units, window))  # type: ignore[arg-type]
        period = quota_window(policy.quota_period, now)
        quotas: list[tuple[str, int]] = []
        if policy.token_quota is not None:
            quotas.append((policy.quota_metric, policy.token_quota))
        if policy.spend_cap is not None:
            quotas.append(("spend", int(Decimal(policy.spend_cap) * 1_000_000)))
        for metric, limit in quotas:
            spec = BudgetSpec(
                f"q.{base}.{metric}.{period.label}", limit, True, s.reservation_ttl_s, period.end
            )
            settled = self._settled_fn(scope, policy.sku_id, period.label, metric, policy)
            units = self._units(
                metric, policy, ticket.sku_id, (ticket.prompt_tokens, 0, ticket.max_tokens)
            )
            budget = self.budgets.budget(spec, settled)
            holds.append(Hold("quota", budget, units, period, metric, policy))
        return holds

    def _settled_fn(
        self, scope: str, sku_id: str | None, label: str, metric: str, policy: LimitsSet
    ) -> Callable[[], int]:
        ledger = self.ledger

        def settled() -> int:
            usage = ledger.get(scope, sku_id, label)
            if metric == "total_tokens":
                return usage.total_tokens
            if metric == "output_tokens":
                return usage.output_tokens
            return usage.spend_micros.get(spend_currency(policy), 0)

        return settled

    def _units(
        self, metric: str, policy: LimitsSet, sku_id: str, tokens: tuple[int, int, int]
    ) -> int:
        """A request's units of a quota metric; `tokens` is (prompt, cached, completion)."""
        prompt, cached, completion = tokens
        if metric == "total_tokens":
            return prompt + completion
        if metric == "output_tokens":
            return completion
        price = self.view.price_plan_at(sku_id, datetime.fromtimestamp(self.clock(), UTC))
        if price is None or price.currency != spend_currency(policy):
            return 0  # no price in the cap's currency: this SKU does not count against it
        return cost_micros(price, prompt, cached, completion)

    def _settle_quota(self, ticket: Ticket, tokens: tuple[int, int, int] | None) -> None:
        """Finish: each quota reservation shrinks to the actual units, held until the usage
        stream shows the request. Release (`tokens` None: nothing ran): all goes back."""
        waiting = self._awaiting.get(ticket.request_id)
        if waiting is None:
            return  # already settled from the usage stream
        if tokens is None:
            self._drop_awaiting(ticket.request_id)
            return
        for hold in waiting.holds:
            assert hold.policy is not None
            used = min(hold.units, self._units(hold.metric, hold.policy, ticket.sku_id, tokens))
            hold.budget.give_back(hold.units - used)
            hold.units = used

    def _on_settled(self, event: RequestFinished) -> None:
        """The usage stream has the request: its actual usage is in the settled sums now, so
        it leaves this replica's lease, and the rest of the reservation goes back to it."""
        waiting = self._awaiting.pop(event.request_id, None)
        if waiting is None:
            return
        tokens = (event.prompt_tokens, event.cached_tokens, event.completion_tokens)
        for hold in waiting.holds:
            assert hold.policy is not None
            used = min(hold.units, self._units(hold.metric, hold.policy, event.sku_id, tokens))
            hold.budget.settle_out(used)
            hold.budget.give_back(hold.units - used)

    def _expire_reservations(self) -> None:
        if not self.ledger.live:
            # The usage stream is unreadable: a reservation's request may have finished
            # unseen. Dropping it now would free usage the settled sums lack.
            return
        now = self.clock()
        for request_id, waiting in list(self._awaiting.items()):
            if waiting.expires_at <= now:
                self._drop_awaiting(request_id)

    def _drop_awaiting(self, request_id: str) -> None:
        waiting = self._awaiting.pop(request_id, None)
        if waiting:
            for hold in waiting.holds:
                hold.budget.give_back(hold.units)

    def _refusal(self, failed: Hold, holds: list[Hold]) -> Refusal:
        now = self.clock()
        headers = rate_limit_headers(holds, now)
        reset = failed.window.reset_in(now) if failed.window else 1.0
        if failed.kind == "quota":
            return Refusal(
                429,
                "insufficient_quota",
                "insufficient_quota",
                "You exceeded your current quota for this period.",
                reset,
                headers,
            )
        what = {
            "streams": "concurrent streams",
            "rpm": "requests per minute",
            "tpm": "tokens per minute",
        }
        limit = failed.budget.limit
        return Refusal(
            429,
            "requests" if failed.kind != "tpm" else "tokens",
            "rate_limit_exceeded",
            f"Rate limit reached for {what[failed.kind]}: limit {limit}, requested {failed.units}.",
            reset,
            headers,
        )

    # -- the tenant's own view -----------------------------------------------------------

    def usage_report(self, tenant_id: str, key_id: str) -> dict[str, object]:
        """Usage and what is left, for the policies that apply to this key (its tenant's and
        its own); never another tenant's."""
        now = self.clock()
        policies = self.limits.of_key(tenant_id, key_id)
        out: list[dict[str, object]] = []
        for p in policies:
            period = quota_window(p.quota_period, now)
            usage = self.ledger.get(p.scope_id, p.sku_id, period.label)
            entry: dict[str, object] = {
                "scope": "key" if p.key_id else "tenant",
                "sku_id": p.sku_id,
                "period": p.quota_period,
                "period_start": datetime.fromtimestamp(period.start, UTC).isoformat(),
                "period_end": datetime.fromtimestamp(period.end, UTC).isoformat(),
                "requests": usage.requests,
                "total_tokens": usage.total_tokens,
                "output_tokens": usage.output_tokens,
                "spend": {c: str(Decimal(m) / 1_000_000) for c, m in usage.spend_micros.items()},
                "limits": {
                    "requests_per_minute": p.requests_per_minute,
                    "tokens_per_minute": p.tokens_per_minute,
                    "token_quota": p.token_quota,
                    "quota_metric": p.quota_metric,
                    "spend_cap": p.spend_cap,
                    "max_concurrent_streams": p.max_concurrent_streams,
                },
            }
            if p.token_quota is not None:
                used = (
                    usage.total_tokens if p.quota_metric == "total_tokens" else usage.output_tokens
                )
                entry["remaining_tokens"] = max(0, p.token_quota - used)
            if p.spend_cap is not None:
                spent = Decimal(usage.spend_micros.get(spend_currency(p), 0)) / 1_000_000
                entry["remaining_spend"] = str(max(Decimal(0), Decimal(p.spend_cap) - spent))
            out.append(entry)
        return {"tenant_id": tenant_id, "key_id": key_id, "policies": out}


def spend_currency(policy: LimitsSet) -> str:
    return policy.spend_currency or "USD"


def rate_limit_headers(holds: list[Hold], now: float) -> dict[str, str]:
    """The six `x-ratelimit-*` headers, from the tightest RPM and TPM budget (largest share
    used); where no such limit applies, limit and remaining read UNLIMITED."""
    if not any(h.kind == "rpm" or h.kind == "tpm" for h in holds):
        return dict(_NO_RATE_LIMIT_HEADERS)
    headers: dict[str, str] = {}
    for kind, name in (("rpm", "requests"), ("tpm", "tokens")):
        candidates = [h for h in holds if h.kind == kind]
        if candidates:
            tightest = min(candidates, key=lambda h: h.budget.remaining() / max(1, h.budget.limit))
            limit, remaining = tightest.budget.limit, tightest.budget.remaining()
            reset = tightest.window.reset_in(now) if tightest.window else 0.0
        else:
            limit, remaining, reset = UNLIMITED, UNLIMITED, 0.0
        headers[f"x-ratelimit-limit-{name}"] = str(limit)
        headers[f"x-ratelimit-remaining-{name}"] = str(remaining)
        headers[f"x-ratelimit-reset-{name}"] = go_duration(reset)
    return headers


# What `rate_limit_headers` says when no RPM or TPM limit applies (the common case, built once).
_NO_RATE_LIMIT_HEADERS = {
    f"x-ratelimit-{part}-{name}": value
    for name in ("requests", "tokens")
    for part, value in (("limit", str(UNLIMITED)), ("remaining", str(UNLIMITED)), ("reset", "0s"))
}
