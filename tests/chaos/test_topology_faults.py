"""Each process of the production topology SIGKILLed (or its server restarted) while three
tenants stream through two gateways and some clients hang up: afterwards every request
reconciles exactly (generated = delivered + waste, billed = delivered), every answer is
billed, nothing hung and the quota tenant's bill stays within its quota."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from tests.chaos.topology import Load, Settled, Topology, drive, now_utc

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(240)]

REQUESTS = 300
CONCURRENCY = 12


@pytest.fixture()
def topology(tmp_path: Path) -> Iterator[Topology]:
    top = Topology(tmp_path)
    try:
        yield top.start()
    finally:
        top.stop()


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[Topology]:
    top = Topology(tmp_path, nats_count=3)
    try:
        yield top.start()
    finally:
        top.stop()


def under_fault(
    top: Topology,
    fault: Callable[[], Awaitable[None]],
    *,
    requests: int = REQUESTS,
    after_s: float = 2.0,
    gateways: list[int] | None = None,
) -> tuple[Load, Settled]:
    """Drive the load, inject `fault` `after_s` seconds in, then settle."""
    since = now_utc()
    bases = [top.bases[i] for i in gateways] if gateways else top.bases
    keys = [t.key for t in top.tenants]

    async def run() -> tuple[Load, Settled]:
        load = Load()
        driving = asyncio.create_task(
            drive(bases, keys, requests, concurrency=CONCURRENCY, load=load, routes=ROUTES)
        )
        await asyncio.sleep(after_s)
        assert not driving.done(), "the load finished before the fault"
        await asyncio.get_running_loop().run_in_executor(None, lambda: asyncio.run(fault()))
        await driving
        return load, await top.settle(since, load.answered)

    return asyncio.run(run())


ROUTES = ("chat_stream", "chat_stream", "chat_stream", "chat", "completions")


def assert_exact(load: Load, settled: Settled, *, may_fail: bool = False) -> None:
    count = load.count()
    report = settled.report
    summary = f"{dict(count)}; {report.lines()[:2]}; {settled.problems()}"
    print(summary, f"quota {settled.overshoot}")
    assert not load.hung, f"hung: {load.hung[:3]}; {summary}"
    assert count["hung_up"] >= 0.05 * (len(load.outcomes) - count["refused"]) * 0.5, summary
    assert report.requests >= count["ok"], summary
    assert not report.mismatches and report.pending == 0, summary
    assert report.match_rate == 1.0, summary
    assert not settled.unbilled, summary
    assert settled.overshoot.beyond_bound == 0, summary
    if not may_fail:
        assert not load.failures(), f"{load.failures()[:3]}; {summary}"


async def _noop() -> None:
    return None


def sync(fn: Callable[[], None]) -> Callable[[], Awaitable[None]]:
    async def run() -> None:
        fn()

    return run


def test_worker_sigkill_a_replacement_starts(topology: Topology) -> None:
    def fault() -> None:
        topology.workers[0].kill()
        topology.workers[0] = topology.worker(0).start()

    load, settled = under_fault(topology, sync(fault))
    # Streams on the killed worker end with an error: failures allowed, nothing hung.
    assert_exact(load, settled, may_fail=True)
    assert topology.workers[0].alive()


def test_gateway_sigkill_the_other_serves(topology: Topology) -> None:
    def fault() -> None:
        topology.gateways[0].kill()

    load, settled = under_fault(topology, sync(fault))
    assert_exact(load, settled, may_fail=True)
    # Everything sent to the surviving gateway was answered.
    assert not [o for o in load.failures() if o.gateway == 1], load.failures()[:3]


def test_projector_sigkill_the_standby_catches_up(topology: Topology) -> None:
    def fault() -> None:
        topology.projectors[0].kill()

    load, settled = under_fault(topology, sync(fault))
    assert_exact(load, settled)
    # and a restarted projector joins as the standby
    topology.projectors[0] = topology._proc("projector0", ["project", "--data-dir", str(topology.root / "pj0")]).start()  # fmt: skip
    time.sleep(1)
    assert topology.projectors[0].alive()


def test_scheduler_sigkill_and_restart(topology: Topology) -> None:
    def fault() -> None:
        assert topology.scheduler is not None
        topology.scheduler.kill()
        topology.scheduler.start()

    load, settled = under_fault(topology, sync(fault))
    assert_exact(load, settled)
    assert topology.scheduler is not None and topology.scheduler.alive()


def test_postgres_restart(topology: Topology) -> None:
    def fault() -> None:
        topology.postgres.stop()
        time.sleep(1)
        topology.postgres.start()

    load, settled = under_fault(topology, sync(fault))
    assert_exact(load, settled)


def test_nats_restart(topology: Topology) -> None:
    def fault() -> None:
        (node,) = topology.nats
        node.kill(signal.SIGTERM)
        time.sleep(1)
        node.start()

    load, settled = under_fault(topology, sync(fault))
    assert_exact(load, settled, may_fail=True)


@pytest.mark.parametrize("which", ["leader", "follower"])
def test_nats_cluster_node_loss(cluster: Topology, which: str) -> None:
    async def fault() -> None:
        leader = await cluster.stream_leader()
        node = next(n for n in cluster.nats if (n.name == leader) == (which == "leader"))
        node.kill()
        await asyncio.sleep(3)
        node.start()

    load, settled = under_fault(cluster, fault)
    assert_exact(load, settled, may_fail=True)
