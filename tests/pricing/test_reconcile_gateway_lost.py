"""Reconciliation when a gateway dies, on the real servers (JetStream, the real projector,
Postgres): a bill carries its delivery record, so no bill is ever stored without it; a
request its gateway never reported is *gateway lost* (not billed, its tokens waste) when that
gateway is known gone, and a mismatch when the gateway went on reporting later requests."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from events.usage import Delivery, RequestFinished, WorkerGenerated
from pricing.reconcile import main, reconcile
from tests.pricing.conftest import BillingRig

DEAD, LIVE = "gw-dead-1a2b", "gw-live-3c4d"
T0 = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=5)  # past any grace period


def bill(rid: str, at: datetime, completion: int, *, gateway: str | None) -> RequestFinished:
    """The bill as the gateway publishes it: its delivery record inside (none with
    `gateway=None`: an older gateway's bill, whose delivery report went apart)."""
    delivered = None
    if gateway is not None:
        delivered = Delivery(
            gateway_id=gateway,
            prompt_tokens=7,
            completion_tokens=completion,
            finish_reason="stop",
        )
    return RequestFinished(
        request_id=rid, tenant_id="acme", key_id="k1", sku_id="qwen", model="m", worker_id="w1",
        prompt_tokens=7, completion_tokens=completion, finish_reason="stop", e2e_ms=100.0,
        started_at=at - timedelta(seconds=1), finished_at=at, delivered=delivered,
    )  # fmt: skip


def generated(
    rid: str, at: datetime, completion: int, *, gateway: str, lease_stopped: bool = False
) -> WorkerGenerated:
    return WorkerGenerated(
        request_id=rid, tenant_id="acme", key_id="k1", sku_id="qwen", model="m", worker_id="w1",
        prompt_tokens=7, completion_tokens=completion,
        finish_reason="cancelled" if lease_stopped else "stop", gateway_lost=lease_stopped,
        gateway_id=gateway, e2e_ms=100.0, started_at=at - timedelta(seconds=1), finished_at=at,
    )  # fmt: skip


async def test_a_dead_gateways_unreported_requests_are_gateway_lost_not_mismatches(
    rig: BillingRig, capsys: pytest.CaptureFixture[str]
) -> None:
    s = timedelta(seconds=1)
    await rig.usage(
        [
            # Billed by the gateway that is about to die: bill and delivery in one message.
            bill("a-billed", T0, 10, gateway=DEAD),
            generated("a-billed", T0, 10, gateway=DEAD),
            # Its last streams: one it was still relaying when it died (the worker stopped on
            # the silent lease), one the worker finished just before it died unbilled.
            generated("b-streaming", T0 + 3 * s, 25, gateway=DEAD, lease_stopped=True),
            generated("c-finished", T0 + s, 12, gateway=DEAD),
            # A live gateway that went on billing later requests but never this one: a lost
            # bill, whatever the reason, is a mismatch.
            generated("d-forgotten", T0 + 2 * s, 5, gateway=LIVE),
            bill("e-later", T0 + 60 * s, 9, gateway=LIVE),
            generated("e-later", T0 + 60 * s, 9, gateway=LIVE),
            # An older gateway's bill whose batched delivery report a kill lost: what carrying
            # the delivery in the bill rules out.
            bill("f-no-delivery", T0 + 4 * s, 3, gateway=None),
            generated("f-no-delivery", T0 + 4 * s, 3, gateway=DEAD),
        ]  # type: ignore[list-item]
    )
    await rig.project()

    # One message, two rows: every bill of this version has its delivery row.
    deliveries = {
        r["request_id"]: r
        for r in await rig.pool.fetch("SELECT * FROM gateway_deliveries ORDER BY request_id")
    }
    assert sorted(deliveries) == ["a-billed", "e-later"]
    assert (deliveries["a-billed"]["gateway_id"], deliveries["a-billed"]["completion_tokens"]) == (DEAD, 10)  # fmt: skip
    assert (
        await rig.pool.fetchval(
            "SELECT gateway_id FROM worker_generations WHERE request_id = 'c-finished'"
        )
        == DEAD
    )

    report = await reconcile(rig.pool, since=T0 - s)
    assert report.requests == 6
    assert report.matched == 2 and report.pending == 0
    assert [
        (g.request_id, g.gateway_id, g.generated_completion_tokens, g.lease_stopped)
        for g in report.gateway_lost
    ] == [  # fmt: skip
        ("b-streaming", DEAD, 25, True),
        ("c-finished", DEAD, 12, False),
    ]
    problems = {m.request_id: m.problem for m in report.mismatches}
    assert sorted(problems) == ["d-forgotten", "f-no-delivery"]
    assert "reported later requests" in problems["d-forgotten"]
    assert problems["f-no-delivery"] == "billed but no gateway delivery recorded"
    # Not billed, counted as waste: generated = delivered + waste still holds.
    assert report.billed_completion_tokens == 10 + 9 + 3
    assert report.delivered_completion_tokens == 10 + 9
    assert report.gateway_lost_tokens == 25 + 12
    assert report.generated_completion_tokens == 10 + 25 + 12 + 5 + 9 + 3
    assert (
        report.generated_completion_tokens
        == report.delivered_completion_tokens + report.unbilled_waste_tokens
    )
    assert report.match_rate == 2 / 4  # the gateway-lost ones are not checked against anything

    # The command lists them apart; only the mismatches fail it.
    code = await asyncio.to_thread(
        main, ["--database-url", rig.database_url, "--since", (T0 - s).isoformat()]
    )
    out = capsys.readouterr().out
    assert code == 1
    assert "gateway lost 2: match rate 50.00%" in out
    assert f"GATEWAY LOST b-streaming tenant=acme sku=qwen gateway={DEAD}" in out
    assert "(37 of it gateway lost)" in out
    assert "MISMATCH d-forgotten" in out and "MISMATCH c-finished" not in out


async def test_with_only_a_dead_gateways_requests_the_command_passes(
    rig: BillingRig, capsys: pytest.CaptureFixture[str]
) -> None:
    s = timedelta(seconds=1)
    await rig.usage(
        [
            bill("a-billed", T0, 10, gateway=DEAD),
            generated("a-billed", T0, 10, gateway=DEAD),
            generated("b-streaming", T0 + 3 * s, 25, gateway=DEAD, lease_stopped=True),
            # the gateway's last report came within the grace period after it: still gone
            bill("g-raced", T0 + 5 * s, 4, gateway=DEAD),
            generated("g-raced", T0 + 5 * s, 4, gateway=DEAD),
            generated("c-finished", T0 + 4 * s, 12, gateway=DEAD),
        ]  # type: ignore[list-item]
    )
    await rig.project()
    code = await asyncio.to_thread(
        main, ["--database-url", rig.database_url, "--since", (T0 - s).isoformat()]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "matched 2, mismatched 0, pending 0, gateway lost 2: match rate 100.00%" in out
    # The same one a second before its gateway's last report: the gateway was alive after it
    # by more than a grace period of 0 s, so it is a mismatch then.
    report = await reconcile(rig.pool, since=T0 - s, grace=timedelta(0))
    assert [m.request_id for m in report.mismatches] == ["c-finished"]
