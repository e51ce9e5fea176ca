"""A generated tenant-policy suite: each case builds 3 fresh tenants (2 keys each) served by
2 admission replicas sharing NATS, applies one policy change to one tenant or key, probes
every key from both replicas, and asserts that exactly the intended tenant or key is
affected, in the intended way. Cases come from a seeded generator (reproducible by seed).

Default run: 1,000 cases (about 10 s); `-m slow`: 5,000 more with another seed."""

from __future__ import annotations

import random
from dataclasses import dataclass
from decimal import Decimal

import pytest

from control_plane.admission.admit import Refusal, Ticket
from events import control
from events.control import LimitsSet
from tests.admission.conftest import World

KINDS = (
    "revoke",
    "suspend",
    "reactivate",
    "scope",
    "rpm",
    "tpm",
    "quota",
    "output_quota",
    "spend",
    "price_change",
    "streams",
)


@dataclass
class Case:
    seed: int
    kind: str
    tenants: list[str]
    keys: list[list[str]]  # per tenant
    sku_a: str
    sku_b: str
    target_tenant: int
    target_key: int | None  # None: the policy is tenant-wide


def gate(world: World, key_id: str, sku_id: str) -> str | None:
    """The gateway's identity checks, on the backbone's view: the refusal code, or None."""
    view = world.views[0]
    key = view.key(key_id)
    if key is None or not key.active:
        return "invalid_api_key"
    tenant = view.tenant(key.tenant_id)
    if tenant is None or not tenant.active:
        return "tenant_suspended"
    sku = view.sku(sku_id)
    if sku is None or not key.allows(sku.name):
        return "model_not_allowed"
    return None


async def request(
    world: World,
    case: Case,
    key_id: str,
    sku_id: str,
    replica: int,
    prompt: int = 10,
    max_tokens: int = 10,
) -> Ticket | str:
    refused = gate(world, key_id, sku_id)
    if refused:
        return refused
    got = await world.replicas[replica].admit(
        world.keys[key_id], key_id, sku_id, prompt, max_tokens
    )
    return got.code if isinstance(got, Refusal) else got


async def probe_others(world: World, case: Case) -> None:
    """Every key outside the target is untouched: admitted on both replicas."""
    for t, keys in enumerate(case.keys):
        for k, key_id in enumerate(keys):
            if t == case.target_tenant and (case.target_key is None or case.target_key == k):
                continue
            for replica in (0, 1):
                got = await request(world, case, key_id, case.sku_a, replica)
                assert isinstance(got, Ticket), (case, key_id, got)
                got.finish(10, 0, 10)


async def build(world: World, rng: random.Random, seed: int, skus: tuple[str, str]) -> Case:
    kind = rng.choice(KINDS)
    tenants = [await world.tenant() for _ in range(3)]
    keys = [[await world.key(t) for _ in range(2)] for t in tenants]
    tenant_wide = kind in ("suspend", "reactivate", "price_change") or (
        kind not in ("revoke", "scope") and rng.random() < 0.5
    )
    return Case(
        seed,
        kind,
        tenants,
        keys,
        *skus,
        rng.randrange(3),
        None if tenant_wide else rng.randrange(2),
    )


async def run_case(world: World, rng: random.Random, seed: int, skus: tuple[str, str]) -> None:
    case = await build(world, rng, seed, skus)
    tenant = case.tenants[case.target_tenant]
    target_keys = (
        case.keys[case.target_tenant]
        if case.target_key is None
        else [case.keys[case.target_tenant][case.target_key]]
    )
    key_id = case.target_key is not None and target_keys[0] or None
    sku = case.sku_a

    def limits(**fields: object) -> LimitsSet:
        return LimitsSet(tenant_id=tenant, key_id=key_id, **fields)  # type: ignore[arg-type]

    async def burst(n: int, **kw: int) -> list[Ticket | str]:
        """n requests spread over the target's keys and both replicas."""
        return [
            await request(
                world,
                case,
                target_keys[i % len(target_keys)],
                sku,
                (i // len(target_keys)) % 2,
                **kw,
            )
            for i in range(n)
        ]

    match case.kind:
        case "revoke":
            await world.append(control.ApiKeyRevoked(key_id=target_keys[0], tenant_id=tenant))
            for replica in (0, 1):
                assert await request(world, case, target_keys[0], sku, replica) == "invalid_api_key"
        case "suspend" | "reactivate":
            await world.append(control.TenantSuspended(tenant_id=tenant))
            for k in target_keys:
                assert await request(world, case, k, sku, rng.randrange(2)) == "tenant_suspended"
            if case.kind == "reactivate":
                await world.append(control.TenantReactivated(tenant_id=tenant))
                for k in target_keys:
                    assert isinstance(await request(world, case, k, sku, rng.randrange(2)), Ticket)
        case "scope":
            # the target key is re-issued scoped to SKU A only
            scoped = await world.key(tenant, scopes=[world.views[0].sku(case.sku_a).name])  # type: ignore[union-attr]
            await world.append(control.ApiKeyRevoked(key_id=target_keys[0], tenant_id=tenant))
            case.keys[case.target_tenant][case.target_key or 0] = scoped
            assert await request(world, case, scoped, case.sku_b, 0) == "model_not_allowed"
            assert isinstance(await request(world, case, scoped, case.sku_a, 1), Ticket)
        case "rpm":
            n = rng.randint(1, 6)
            await world.append(limits(requests_per_minute=n))
            got = await burst(n + 3)
            assert sum(isinstance(g, Ticket) for g in got) == n, got
            assert all(g == "rate_limit_exceeded" for g in got if not isinstance(g, Ticket))
        case "tpm":
            size = rng.randint(2, 5) * 10  # prompt + max_tokens of each request
            n = rng.randint(1, 5)
            await world.append(limits(tokens_per_minute=size * n + size // 2))
            got = await burst(n + 3, prompt=size // 2, max_tokens=size // 2)
            assert sum(isinstance(g, Ticket) for g in got) == n, got
            assert all(g == "rate_limit_exceeded" for g in got if not isinstance(g, Ticket))
        case "quota" | "output_quota":
            n = rng.randint(1, 5)
            metric = "total_tokens" if case.kind == "quota" else "output_tokens"
            per = 20 if metric == "total_tokens" else 10  # what each request reserves
            await world.append(limits(token_quota=per * n - per // 2, quota_metric=metric))
            got = await burst(n + 3)
            # the n-th request crosses the line (overdraw by less than one reservation)
            assert sum(isinstance(g, Ticket) for g in got) == n, got
            assert all(g == "insufficient_quota" for g in got if not isinstance(g, Ticket))
        case "spend" | "price_change":
            await world.price(case.sku_a, ("1", "0.5", "2"))  # per 1M: 10 in + 10 out = 30 micro
            await world.append(limits(spend_cap="0.000300", spend_currency="USD"))
            if case.kind == "price_change":
                await world.price(case.sku_a, ("10", "5", "20"))  # 300 micro a request
                n = 1
            else:
                n = 10
            got = await burst(n + 2)
            assert sum(isinstance(g, Ticket) for g in got) == n, got
            assert all(g == "insufficient_quota" for g in got if not isinstance(g, Ticket))
            # the price restored for the next cases: SKU A is shared
            await world.price(case.sku_a, ("0", "0", "0"))
            assert (
                Decimal(world.views[0].price_plan_at(case.sku_a, _now(world)).output_per_mtok) == 0
            )  # type: ignore[union-attr]
        case "streams":
            n = rng.randint(1, 4)
            await world.append(limits(max_concurrent_streams=n))
            got = await burst(n + 2)
            open_ = [g for g in got if isinstance(g, Ticket)]
            assert len(open_) == n, got
            assert all(g == "rate_limit_exceeded" for g in got if not isinstance(g, Ticket))
            # a stream ends: one more may open (on the replica that holds the freed slot; the
            # other sees it once the idle lease goes back)
            open_[0].finish(10, 0, 5)
            assert isinstance(await request(world, case, target_keys[0], sku, 0), Ticket)
    await probe_others(world, case)


def _now(world: World):  # type: ignore[no-untyped-def]
    from datetime import UTC, datetime

    return datetime.fromtimestamp(world.clock.now, UTC)


async def run_suite(world: World, cases: int, seed: int) -> int:
    skus = (
        await world.sku("suite-a", ("0", "0", "0")),
        await world.sku("suite-b", ("0", "0", "0")),
    )
    passed = 0
    for i in range(cases):
        rng = random.Random(seed * 100_003 + i)
        await run_case(world, rng, i, skus)
        passed += 1
    return passed


async def test_policy_suite_1000_cases(world: World) -> None:
    assert await run_suite(world, 1000, seed=1) == 1000


@pytest.mark.slow
async def test_policy_suite_5000_cases(world: World) -> None:
    assert await run_suite(world, 5000, seed=2) == 5000
