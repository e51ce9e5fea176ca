from datetime import datetime, timedelta

import pytest
from msgspec.structs import replace

from pricing.plans import AmbiguousPriceHistory, PriceBook, TokenClass, plan_in_force
from tests.pricing.factories import at, plan


def test_plan_in_force_is_the_latest_started_one() -> None:
    march = plan("p-march", at(2026, 3, 1))
    mid = plan("p-mid", at(2026, 3, 15, 12), output="2.40")
    other = plan("p-other", at(2026, 1, 1), sku_id="llama-8b")
    plans = [mid, other, march]
    assert plan_in_force(plans, "qwen-27b", at(2026, 2, 28, 23, 59)) is None
    assert plan_in_force(plans, "qwen-27b", at(2026, 3, 1)) == march
    assert plan_in_force(plans, "qwen-27b", at(2026, 3, 15, 11, 59, 59)) == march
    assert plan_in_force(plans, "qwen-27b", at(2026, 3, 15, 12)) == mid  # starts inclusive
    assert plan_in_force(plans, "llama-8b", at(2026, 3, 15, 12)) == other
    assert plan_in_force(plans, "unknown", at(2026, 3, 15)) is None
    book = PriceBook(plans)
    assert book.in_force_until(march) == at(2026, 3, 15, 12)
    assert book.in_force_until(mid) is None
    assert mid.unit_price(TokenClass.output) == mid.output_per_mtok


def test_other_time_zones_compare_as_instants() -> None:
    from datetime import timezone

    plus2 = timezone(timedelta(hours=2))
    march = plan("p-march", datetime(2026, 3, 1, 2, tzinfo=plus2))  # = 00:00 UTC
    assert plan_in_force([march], "qwen-27b", at(2026, 3, 1)) == march


def test_invalid_histories_and_plans_are_refused() -> None:
    with pytest.raises(AmbiguousPriceHistory):
        PriceBook([plan("a", at(2026, 3, 1)), plan("b", at(2026, 3, 1))])
    with pytest.raises(ValueError):
        plan("naive", datetime(2026, 3, 1))
    with pytest.raises(ValueError):
        plan("negative", at(2026, 3, 1), output="-1")
    with pytest.raises(ValueError):
        plan("bad-currency", at(2026, 3, 1), currency="ZZZ")
    with pytest.raises(ValueError):
        PriceBook([plan("a", at(2026, 3, 1))]).in_force("qwen-27b", datetime(2026, 3, 2))


def test_history_as_of_a_control_sequence_and_re_set_plans() -> None:
    first = plan("p1", at(2026, 3, 1), output="3.00")
    retroactive = replace(
        first, plan_id="p2", output_per_mtok=first.output_per_mtok * 2, recorded_seq=9
    )
    book = PriceBook([first, retroactive])
    assert book.in_force("qwen-27b", at(2026, 3, 5)) == retroactive  # same start, later record wins
    assert book.as_of(8).in_force("qwen-27b", at(2026, 3, 5)) == first
