"""Cluster-ready NATS configuration: URL lists, start-up that waits for servers starting after
us (within a bound), and the replica count on every KV bucket."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats
import pytest

from control_plane.admission.budgets import BudgetStore, budget_bucket_configs
from control_plane.embedded import EmbeddedNats, free_port
from events.nats_cluster import connect, ensure_streams, nats_servers
from events.store import EventStore, StreamLayout
from pricing.jobs import BillingSettings, LeaderLock
from tokenmill.settings import AdmissionSettings


@pytest.mark.parametrize(
    ("value", "servers"),
    [
        ("nats://127.0.0.1:4222", ["nats://127.0.0.1:4222"]),
        (
            "nats://nats-0:4222,nats://nats-1:4222, nats://nats-2:4222",
            ["nats://nats-0:4222", "nats://nats-1:4222", "nats://nats-2:4222"],
        ),
        ("tls://a:4222,tls://b:4222,", ["tls://a:4222", "tls://b:4222"]),
        ("nats-0:4222", ["nats-0:4222"]),  # nats-py adds the scheme
    ],
)
def test_nats_url_list(value: str, servers: list[str]) -> None:
    assert nats_servers(value) == servers


@pytest.mark.parametrize("value", ["", " , ,"])
def test_nats_url_list_empty_is_an_error(value: str) -> None:
    with pytest.raises(ValueError, match="TOKENMILL_NATS_URL"):
        nats_servers(value)


@pytest.mark.integration
async def test_connect_waits_for_a_server_that_starts_later(tmp_path: Path) -> None:
    port = free_port()
    dead = free_port()  # a seed that never answers: the client moves on to the others
    server = EmbeddedNats(tmp_path / "nats", port=port)
    loop = asyncio.get_running_loop()
    starting = loop.run_in_executor(None, lambda: (time.sleep(1.5), server.start()))
    began = time.monotonic()
    try:
        nc = await connect(
            f"nats://127.0.0.1:{dead},nats://127.0.0.1:{port}", name="test", within_s=30
        )
        try:
            assert time.monotonic() - began >= 1.0  # it really waited
            assert nc.is_connected
            store = EventStore(nc.jetstream(), StreamLayout(prefix="LATE"))
            await ensure_streams(store)
            assert await store.head(store.layout.usage_stream) == 0
        finally:
            await nc.close()
    finally:
        await starting
        server.stop()


async def test_connect_gives_up_within_its_bound() -> None:
    began = time.monotonic()
    with pytest.raises(ConnectionError, match="within 1s"):
        await connect(f"nats://127.0.0.1:{free_port()}", name="test", within_s=1.0)
    assert time.monotonic() - began < 5


def test_every_bucket_carries_the_replica_count(monkeypatch: pytest.MonkeyPatch) -> None:
    configs = budget_bucket_configs("TM", 3)
    assert {c.bucket for c in configs.values()} == {"TM_GOV_RATE", "TM_GOV_HOLD"}
    assert all(c.replicas == 3 for c in configs.values())
    assert configs["r"].ttl == 300 and configs["h"].ttl is None
    lock = LeaderLock(None, "TM_scheduler", 15.0, replicas=3)  # type: ignore[arg-type]
    assert lock.bucket_config().replicas == 3 and lock.bucket_config().ttl == 15.0
    # the same variable as the streams' sets them
    monkeypatch.setenv("TOKENMILL_STREAM_REPLICAS", "3")
    assert AdmissionSettings().kv_replicas == 3
    assert BillingSettings().kv_replicas == 3
    monkeypatch.delenv("TOKENMILL_STREAM_REPLICAS")
    assert AdmissionSettings().kv_replicas == 1


async def test_replicas_beyond_a_single_server_are_an_explicit_error(
    nats_server: EmbeddedNats, stream_prefix: str
) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        budgets = BudgetStore(js, stream_prefix, "gw", replicas=3)
        with pytest.raises(RuntimeError, match="TOKENMILL_STREAM_REPLICAS=1"):
            await budgets.open()
        store = EventStore(js, StreamLayout(prefix=stream_prefix, replicas=3))
        with pytest.raises(RuntimeError, match="refuses 3 replicas"):
            await ensure_streams(store, within_s=5)
        lock = LeaderLock(js, f"{stream_prefix}_scheduler", 15.0, replicas=3)
        with pytest.raises(RuntimeError, match="TOKENMILL_STREAM_REPLICAS"):
            await lock.renew()
        # replicas=1 creates them, and opening again (another replica) finds the same buckets
        for _ in range(2):
            await BudgetStore(js, stream_prefix, "gw", replicas=1).open()
        info = await js.stream_info(f"KV_{stream_prefix}_GOV_HOLD")
        assert info.config.num_replicas == 1
    finally:
        await nc.close()


def test_settings_give_the_server_list(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenmill.settings import Settings

    monkeypatch.setenv("TOKENMILL_NATS_URL", "nats://a:4222,nats://b:4222")
    assert Settings().nats_servers == ["nats://a:4222", "nats://b:4222"]
    monkeypatch.delenv("TOKENMILL_NATS_URL")
    assert Settings().nats_servers == []
