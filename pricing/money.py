"""Decimal money: currencies, their minor units, and the one rounding rule billing uses.

Rules (every invoice, export and report follows them, so figures agree to the cent):
- Amounts are `decimal.Decimal`, never floats; a float passed in is refused.
- A line amount is computed at full precision (quantity x unit price / pricing unit) and
  rounded once, half-even ("banker's rounding"), to the currency's minor unit. Totals are
  sums of already-rounded lines, so a total never disagrees with its lines.
- Arithmetic runs in a private decimal context with enough digits that token counts times
  prices are exact; the caller's global decimal context is never consulted or changed.
"""

from __future__ import annotations

import decimal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from decimal import ROUND_DOWN, ROUND_HALF_EVEN, Decimal

# 50 significant digits: a 10^15-token line at a 12-decimal unit price is still exact.
_CONTEXT = decimal.Context(prec=50, rounding=ROUND_HALF_EVEN, traps=[decimal.InvalidOperation])

TOKENS_PER_PRICING_UNIT = 1_000_000  # prices are quoted per 1M tokens


@dataclass(frozen=True)
class Currency:
    code: str
    minor_unit: int  # ISO 4217 exponent: digits after the decimal point (USD 2, JPY 0, BHD 3)

    @property
    def quantum(self) -> Decimal:
        return Decimal(1).scaleb(-self.minor_unit)


# The ISO 4217 exponents of the currencies an operator is likely to bill in.
_CURRENCIES = {
    c.code: c
    for c in (
        Currency("USD", 2),
        Currency("EUR", 2),
        Currency("GBP", 2),
        Currency("CHF", 2),
        Currency("CAD", 2),
        Currency("AUD", 2),
        Currency("SEK", 2),
        Currency("NOK", 2),
        Currency("DKK", 2),
        Currency("PLN", 2),
        Currency("CNY", 2),
        Currency("INR", 2),
        Currency("SGD", 2),
        Currency("BRL", 2),
        Currency("JPY", 0),
        Currency("KRW", 0),
        Currency("BHD", 3),
        Currency("KWD", 3),
    )
}


class UnknownCurrency(ValueError):
    pass


def currency(code: str) -> Currency:
    try:
        return _CURRENCIES[code.upper()]
    except KeyError:
        raise UnknownCurrency(f"unknown currency {code!r}; known: {sorted(_CURRENCIES)}") from None


def to_decimal(value: Decimal | int | str) -> Decimal:
    """A price or amount from an exact input; floats are refused because they are not exact."""
    if isinstance(value, float):
        raise TypeError(f"money must not be a float ({value!r}); pass a str or Decimal")
    result = Decimal(value)
    if not result.is_finite():
        raise ValueError(f"money must be finite, got {value!r}")
    return result


def round_to_minor(amount: Decimal, code: str) -> Decimal:
    """Round half-even to the currency's minor unit (the only rounding billing does)."""
    return amount.quantize(currency(code).quantum, rounding=ROUND_HALF_EVEN, context=_CONTEXT)


def truncate_to_minor(amount: Decimal, code: str) -> Decimal:
    """Round toward zero to the minor unit (used by allocation before distributing remainders)."""
    return amount.quantize(currency(code).quantum, rounding=ROUND_DOWN, context=_CONTEXT)


def exact_cost(tokens: int, price_per_million: Decimal) -> Decimal:
    """Full-precision cost of `tokens` at a price per 1M tokens (exact: no rounding happens)."""
    return _CONTEXT.divide(
        _CONTEXT.multiply(Decimal(tokens), price_per_million), Decimal(TOKENS_PER_PRICING_UNIT)
    )


def line_amount(tokens: int, price_per_million: Decimal, code: str) -> Decimal:
    """A line item's amount: exact cost, rounded once at the line."""
    return round_to_minor(exact_cost(tokens, price_per_million), code)


def exact_sum(values: Iterable[Decimal]) -> Decimal:
    total = Decimal(0)
    for value in values:
        total = _CONTEXT.add(total, value)
    return total


def allocate(amount: Decimal, exact_shares: Sequence[Decimal], code: str) -> list[Decimal]:
    """Split a rounded `amount` over parts whose exact (unrounded) costs are `exact_shares`,
    so that the parts are whole minor units and add up to `amount` exactly.

    Largest-remainder method: each part first gets its share truncated to the minor unit;
    the minor units left over go one each to the parts with the largest truncated-off
    remainders, earlier parts first on a tie (callers pass parts in a canonical order, which
    keeps the result deterministic). With `amount` = round(sum(shares)) every part ends within
    one minor unit of its exact share."""
    quantum = currency(code).quantum
    parts = [truncate_to_minor(share, code) for share in exact_shares]
    leftover_units = int(_CONTEXT.divide(amount - exact_sum(parts), quantum))
    if leftover_units < 0 or leftover_units > len(parts):
        raise ValueError(
            f"cannot allocate {amount} over shares summing to {exact_sum(exact_shares)}"
        )
    by_remainder = sorted(range(len(parts)), key=lambda i: (-(exact_shares[i] - parts[i]), i))
    for i in by_remainder[:leftover_units]:
        parts[i] += quantum
    return parts


def plain(value: Decimal) -> str:
    """A decimal as plain digits (never exponent notation), keeping its scale: 0.10, 0.000150."""
    return format(value, "f")


def format_amount(amount: Decimal, code: str) -> str:
    """An amount at exactly the currency's minor unit, e.g. '12.30' USD, '1230' JPY."""
    return plain(round_to_minor(amount, code))
