"""Price plans: what a SKU costs per 1M tokens of each token class, from a moment on.

A SKU's price history is its plans ordered by `effective_from`; the plan in force at an
instant is the latest one that has started. History only grows: a new price is a new plan
with a later `effective_from`, so invoices already issued stay reproducible."""

from __future__ import annotations

import bisect
import enum
from collections.abc import Iterable, Sequence
from datetime import datetime
from decimal import Decimal

import msgspec

from pricing.money import currency, to_decimal


class TokenClass(enum.StrEnum):
    """How a request's tokens are billed: prompt tokens served from the prefix cache are
    `cached_input`, the rest of the prompt is `input`, generated tokens are `output`."""

    input = "input"
    cached_input = "cached_input"
    output = "output"


TOKEN_CLASSES: tuple[TokenClass, ...] = (
    TokenClass.input,
    TokenClass.cached_input,
    TokenClass.output,
)


def require_utc(at: datetime, what: str) -> datetime:
    if at.tzinfo is None or at.utcoffset() is None:
        raise ValueError(f"{what} must be timezone-aware (UTC), got naive {at.isoformat()}")
    return at


class PricePlan(msgspec.Struct, frozen=True, kw_only=True):
    plan_id: str
    sku_id: str
    currency: str
    input_per_mtok: Decimal
    # None: the plan has no cached-input price, and cached prompt tokens bill at the input
    # price (a cache hit is never cheaper than the plan says, nor free by omission).
    cached_input_per_mtok: Decimal | None = None
    output_per_mtok: Decimal
    effective_from: datetime
    # Control-stream sequence that recorded the plan: lets an invoice use the price history
    # as it was known at its cut, and breaks a tie between two plans with one start (later wins).
    recorded_seq: int = 0

    def __post_init__(self) -> None:
        currency(self.currency)  # refuses an unknown code
        require_utc(self.effective_from, "effective_from")
        for token_class in TOKEN_CLASSES:
            price = to_decimal(self.unit_price(token_class))
            if price < 0:
                raise ValueError(f"plan {self.plan_id}: negative {token_class} price {price}")

    def unit_price(self, token_class: TokenClass) -> Decimal:
        """Price per 1M tokens of the class (cached input without a price of its own: the
        input price)."""
        if token_class is TokenClass.input:
            return self.input_per_mtok
        if token_class is TokenClass.cached_input:
            if self.cached_input_per_mtok is None:
                return self.input_per_mtok
            return self.cached_input_per_mtok
        return self.output_per_mtok


class AmbiguousPriceHistory(ValueError):
    """Two plans of one SKU start at the same instant: which one applies is undefined."""


class PriceBook:
    """Every SKU's price history, indexed for `in_force` lookups (O(log plans))."""

    def __init__(self, plans: Iterable[PricePlan]) -> None:
        self.plans = tuple(plans)
        by_sku: dict[str, list[PricePlan]] = {}
        for plan in self.plans:
            by_sku.setdefault(plan.sku_id, []).append(plan)
        self._history: dict[str, list[PricePlan]] = {}
        self._starts: dict[str, list[datetime]] = {}
        for sku_id, sku_plans in by_sku.items():
            sku_plans.sort(key=lambda p: (p.effective_from, p.recorded_seq))
            kept: list[PricePlan] = []
            for plan in sku_plans:
                if kept and kept[-1].effective_from == plan.effective_from:
                    if kept[-1].recorded_seq == plan.recorded_seq:
                        raise AmbiguousPriceHistory(
                            f"SKU {sku_id}: plans {kept[-1].plan_id} and {plan.plan_id} both start "
                            f"at {plan.effective_from.isoformat()}"
                        )
                    kept.pop()  # re-set for the same instant: the later record replaces it
                kept.append(plan)
            sku_plans = kept
            starts = [p.effective_from for p in sku_plans]
            self._history[sku_id] = sku_plans
            self._starts[sku_id] = starts

    def as_of(self, recorded_seq: int | None) -> PriceBook:
        """The price history as it was known once the control stream reached `recorded_seq`."""
        if recorded_seq is None:
            return self
        return PriceBook(p for p in self.plans if p.recorded_seq <= recorded_seq)

    def history(self, sku_id: str) -> Sequence[PricePlan]:
        return tuple(self._history.get(sku_id, ()))

    def in_force(self, sku_id: str, at: datetime) -> PricePlan | None:
        """The plan of `sku_id` in force at `at`, or None if the SKU had no price yet."""
        starts = self._starts.get(sku_id)
        if not starts:
            return None
        index = bisect.bisect_right(starts, require_utc(at, "at")) - 1
        return self._history[sku_id][index] if index >= 0 else None

    def in_force_until(self, plan: PricePlan) -> datetime | None:
        """When `plan` stops applying (the next plan's start), or None while it is the latest."""
        history = self._history[plan.sku_id]
        index = history.index(plan)
        return history[index + 1].effective_from if index + 1 < len(history) else None


def plan_in_force(plans: Iterable[PricePlan], sku_id: str, at: datetime) -> PricePlan | None:
    """The plan of `sku_id` in force at `at` (for many lookups, build a PriceBook once)."""
    return PriceBook(p for p in plans if p.sku_id == sku_id).in_force(sku_id, at)
