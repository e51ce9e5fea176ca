"""The open-reservations gauges: governance's unsettled quota reservations per SKU reach the
ops metrics, and go back to zero as the usage stream settles them (real NATS, real
Admission, the real OpsMetrics registry)."""

from __future__ import annotations

from prometheus_client import generate_latest

from control_plane.admission.admit import Ticket
from control_plane.dataplane.reservations import ReservationsReporter
from control_plane.observability.metrics import OpsMetrics
from events.control import LimitsSet
from tests.admission.conftest import World, world  # noqa: F401 (the fixture)


def gauges(metrics: OpsMetrics, sku: str) -> tuple[float, float]:
    text = generate_latest(metrics.registry).decode()

    def value(name: str) -> float:
        line = next(x for x in text.splitlines() if x.startswith(f'{name}{{sku="{sku}"}}'))
        return float(line.rsplit(" ", 1)[1])

    return value("tokenmill_open_reservations"), value("tokenmill_reserved_tokens")


async def test_open_reservations_are_reported_per_sku_until_settled(world: World) -> None:  # noqa: F811
    tenant = await world.tenant()
    key = await world.key(tenant)
    sku = await world.sku("m-open")
    await world.append(LimitsSet(tenant_id=tenant, token_quota=10_000))
    admission = world.replicas[0]
    metrics = OpsMetrics()
    reporter = ReservationsReporter(admission, metrics, world.views[0])

    tickets = [await admission.admit(tenant, key, sku, 10, 90) for _ in range(3)]
    assert all(isinstance(t, Ticket) for t in tickets)
    reporter.report()
    assert gauges(metrics, "m-open") == (3, 300)

    # One finishes with 10 + 40 (its reservation shrinks to that until the usage stream
    # has it), one never ran (released), one is settled by its usage event.
    t0, t1, t2 = (t for t in tickets if isinstance(t, Ticket))
    t0.finish(10, 0, 40)
    t1.release()
    t2.finish(10, 0, 20)
    await world.finished(tenant, key, sku, t2.request_id, 10, 20)
    reporter.report()
    assert gauges(metrics, "m-open") == (1, 50)

    await world.finished(tenant, key, sku, t0.request_id, 10, 40)
    reporter.report()
    assert gauges(metrics, "m-open") == (0, 0)
