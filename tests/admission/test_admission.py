"""Admission against the real NATS fixture, two replicas sharing budgets through KV."""

from __future__ import annotations

import asyncio

from control_plane.admission.admit import UNLIMITED, Refusal, Ticket
from tests.admission.conftest import World


async def test_rpm_is_shared_exactly_by_two_replicas(world: World) -> None:
    tenant, key, sku = await world.limited("m-rpm", requests_per_minute=50)
    results = await asyncio.gather(
        *(world.replicas[i % 2].admit(tenant, key, sku, 10, 10) for i in range(120))
    )
    admitted = [r for r in results if isinstance(r, Ticket)]
    refused = [r for r in results if isinstance(r, Refusal)]
    assert len(admitted) == 50
    assert {r.code for r in refused} == {"rate_limit_exceeded"}
    assert refused[0].status == 429 and "retry-after" in refused[0].response_headers()
    assert admitted[0].headers["x-ratelimit-limit-requests"] == "50"
    assert admitted[0].headers["x-ratelimit-reset-requests"] == "30s"
    # No TPM limit: the token headers read unlimited.
    assert admitted[0].headers["x-ratelimit-limit-tokens"] == str(UNLIMITED)
    assert admitted[0].headers["x-ratelimit-reset-tokens"] == "0s"


async def test_a_tenant_without_rate_limits_gets_all_six_headers_unlimited(world: World) -> None:
    tenant = await world.tenant()
    key = await world.key(tenant)
    sku = await world.sku("m-unlimited")
    first, second = [await world.replicas[0].admit(tenant, key, sku, 10, 10) for _ in range(2)]
    assert isinstance(first, Ticket) and isinstance(second, Ticket)
    assert first.headers == {
        f"x-ratelimit-{part}-{name}": value
        for name in ("requests", "tokens")
        for part, value in (
            ("limit", str(UNLIMITED)),
            ("remaining", str(UNLIMITED)),
            ("reset", "0s"),
        )
    }
    first.headers["x-ratelimit-limit-requests"] = "changed"  # each ticket has its own dict
    assert second.headers["x-ratelimit-limit-requests"] == str(UNLIMITED)


async def test_quota_overspends_by_at_most_one_reservation_and_settles(world: World) -> None:
    tenant, key, sku = await world.limited("m-quota", token_quota=1000)
    # each request reserves 10 + 90 = 100: ten fit; the eleventh would overdraw nothing
    results = await asyncio.gather(
        *(world.replicas[i % 2].admit(tenant, key, sku, 10, 90) for i in range(30))
    )
    admitted = [r for r in results if isinstance(r, Ticket)]
    assert len(admitted) == 10
    refused = [r for r in results if isinstance(r, Refusal)]
    assert refused and all(r.code == "insufficient_quota" for r in refused)
    # they finish using 10 + 40 each; the worker's usage events settle them
    for t in admitted:
        t.finish(10, 0, 40)
        await world.finished(tenant, key, sku, t.request_id, 10, 40)
    # 500 of 1000 settled; idle leases go back to the pool
    world.clock.now += 1
    await asyncio.sleep(0.2)
    more = [await world.replicas[i % 2].admit(tenant, key, sku, 10, 150) for i in range(6)]
    ok = [r for r in more if isinstance(r, Ticket)]
    # never more than one reservation (160) past the 500 left; at most one lease chunk
    # (2% of the limit) per replica stranded
    assert 500 - 2 * 20 <= 160 * len(ok) <= 500 + 160
    assert all(r.code == "insufficient_quota" for r in more if isinstance(r, Refusal))
    report = world.replicas[1].usage_report(tenant, key)
    assert report["policies"][0]["total_tokens"] == 500  # type: ignore[index]


async def test_crashed_gateway_reservation_settles_from_usage_stream(world: World) -> None:
    tenant, key, sku = await world.limited("m-crash", token_quota=1000)
    a, b = world.replicas
    ticket = await a.admit(tenant, key, sku, 100, 800)
    assert isinstance(ticket, Ticket)
    assert isinstance(await b.admit(tenant, key, sku, 50, 100), Ticket)
    # replica a "crashes": it never finishes; its request's worker reports 100 + 20 tokens
    await a.stop()
    world.replicas = [b]
    await world.finished(tenant, key, sku, ticket.request_id, 100, 20)
    # a's lease is counted until its heartbeat + reservation ttl, then dropped: never leaked
    world.clock.now += 31
    # b's own reservation (150) and a's settled 120 remain: 730 left
    got = await b.admit(tenant, key, sku, 30, 600)
    assert isinstance(got, Ticket), got
    world.replicas = [a, b]
    await a.start()
