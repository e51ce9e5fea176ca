from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pricing.money import (
    UnknownCurrency,
    allocate,
    exact_cost,
    format_amount,
    line_amount,
    plain,
    round_to_minor,
    to_decimal,
)


def test_rounding_is_half_even_at_the_minor_unit() -> None:
    assert round_to_minor(Decimal("0.125"), "USD") == Decimal("0.12")
    assert round_to_minor(Decimal("0.135"), "USD") == Decimal("0.14")
    assert round_to_minor(Decimal("0.1250001"), "USD") == Decimal("0.13")
    assert round_to_minor(Decimal("2.5"), "JPY") == Decimal("2")
    assert round_to_minor(Decimal("0.0005"), "BHD") == Decimal("0.000")
    assert format_amount(Decimal("3"), "EUR") == "3.00"


def test_line_amount_rounds_once_after_the_exact_product() -> None:
    # 1,234,567 tokens at 0.15/1M = 0.18518505 exactly -> 0.19
    assert exact_cost(1_234_567, Decimal("0.15")) == Decimal("0.18518505")
    assert line_amount(1_234_567, Decimal("0.15"), "USD") == Decimal("0.19")
    # Rounding each request first would give 0.00 per request: the line rounds once.
    assert line_amount(30 * 1000, Decimal("0.15"), "USD") == Decimal("0.00")
    assert line_amount(30 * 100_000, Decimal("0.15"), "USD") == Decimal("0.45")


def test_floats_and_unknown_currencies_are_refused() -> None:
    with pytest.raises(TypeError):
        to_decimal(0.1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        to_decimal("NaN")
    with pytest.raises(UnknownCurrency):
        round_to_minor(Decimal(1), "XXX")


def test_plain_never_prints_exponents() -> None:
    assert plain(Decimal("1E-7")) == "0.0000001"
    assert plain(exact_cost(1, Decimal("0.15"))) == "0.00000015"


@given(
    st.lists(st.integers(min_value=0, max_value=10**9), min_size=1, max_size=40),
    st.sampled_from(["0.15", "0.075", "3.00", "0.6", "12.345678"]),
    st.sampled_from(["USD", "JPY", "BHD"]),
)
def test_allocation_adds_up_exactly_and_stays_within_one_minor_unit(
    quantities: list[int], price: str, code: str
) -> None:
    shares = [exact_cost(q, Decimal(price)) for q in quantities]
    amount = line_amount(sum(quantities), Decimal(price), code)
    parts = allocate(amount, shares, code)
    assert sum(parts) == amount
    unit = Decimal(1).scaleb(-{"USD": 2, "JPY": 0, "BHD": 3}[code])
    assert all(abs(part - share) < unit for part, share in zip(parts, shares, strict=True))
    assert all(part == round_to_minor(part, code) for part in parts)
