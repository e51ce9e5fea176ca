"""Admission cost and accuracy on a real embedded NATS (JetStream KV).

1. One replica at 1,000 requests/s: the latency of admission (key lookup on the governance
   view, every applicable policy — RPM, TPM, token quota, concurrent streams — and the
   reservation), p50/p99; finish is timed with it.
2. Two replicas, each offered 1,000 requests/s from its own connection, against one tenant's
   RPM (and, separately, TPM) limit inside one rate window: admitted vs configured.

    python -m bench.gateway.admission_latency [--seconds 10] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import nats

from bench.common import result_path, write_result
from control_plane.admission.admit import Admission, Ticket
from control_plane.admission.view import GovernanceView
from control_plane.embedded import EmbeddedNats
from events import control
from events.control import LimitsSet
from events.store import EventStore, StreamLayout
from tokenmill.settings import AdmissionSettings


def window_clock() -> Any:
    """Real time, shifted so that a fresh rate window starts now (runs fit in one window)."""
    now = time.time()
    offset = math.ceil(now / 60) * 60 - now + 0.001
    return lambda: time.time() + offset


async def setup_tenant(
    store: EventStore, name: str, sku_id: str, limits: dict[str, Any]
) -> tuple[str, str, str]:
    tenant_id, key_id, plaintext = f"ten_{name}", f"key_{name}", f"tm_{name}_secret"
    key_hash = hashlib.sha256(plaintext.encode()).hexdigest()
    await store.append(control.TenantCreated(tenant_id=tenant_id, name=name), None)
    await store.append(
        control.ApiKeyIssued(key_id=key_id, tenant_id=tenant_id, key_hash=key_hash, prefix="tm_"),
        None,
    )
    seq = await store.append(LimitsSet(tenant_id=tenant_id, **limits), None)
    return tenant_id, key_hash, str(seq)


async def paced(rate: float, seconds: float, fn: Any) -> list[Any]:
    """Call `fn(i)` at `rate` per second for `seconds`, each started on schedule."""
    start = time.perf_counter()
    results = []
    for i in range(int(rate * seconds)):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        results.append(await fn(i))
    return results


async def run(seconds: float) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="tm-bench-adm-"))
    server = EmbeddedNats(root / "nats").start()
    conns = [await nats.connect(server.url) for _ in range(2)]
    layout = StreamLayout(prefix="BENCH")
    store = EventStore(conns[0].jetstream(), layout)
    await store.ensure_streams()
    sku_id = control.sku_id_for("bench")
    await store.append(
        control.SkuPublished(
            sku_id=sku_id, name="bench", model="bench", runtime="t", gpu_type="cpu"
        ),
        None,
    )
    settings = AdmissionSettings(default_max_tokens=256)
    clock = window_clock()
    views = [GovernanceView(nc.jetstream(), layout) for nc in conns]
    replicas = [
        Admission(nc, "BENCH", v, replica_id=f"gw{i}", settings=settings, clock=clock)
        for i, (nc, v) in enumerate(zip(conns, views, strict=True))
    ]
    lat_tenant = await setup_tenant(
        store,
        "lat",
        sku_id,
        dict(
            requests_per_minute=10_000_000,
            tokens_per_minute=10_000_000_000,
            token_quota=10_000_000_000,
            max_concurrent_streams=10_000,
        ),
    )
    rpm_limit, tpm_limit = 20_000, 600_000
    rpm_tenant = await setup_tenant(store, "rpm", sku_id, dict(requests_per_minute=rpm_limit))
    tpm_tenant = await setup_tenant(store, "tpm", sku_id, dict(tokens_per_minute=tpm_limit))
    for v, r in zip(views, replicas, strict=True):
        await v.start()
        await r.start()

    def admit_for(
        replica: Admission, view: GovernanceView, key_hash: str, prompt: int, out: int
    ) -> Any:
        async def one(i: int) -> tuple[float, bool]:
            t = time.perf_counter()
            key = view.key_by_hash(key_hash)
            tenant = view.tenant(key.tenant_id) if key else None
            sku = view.sku_by_name("bench")
            assert key and key.active and tenant and tenant.active and sku and key.allows(sku.name)
            got = await replica.admit(key.tenant_id, key.key_id, sku.sku_id, prompt, out)
            elapsed = time.perf_counter() - t
            if isinstance(got, Ticket):
                got.finish(prompt, 0, out)
            return elapsed, isinstance(got, Ticket)

        return one

    # 1. latency, one replica at 1,000 req/s
    await paced(1000, 1.0, admit_for(replicas[0], views[0], lat_tenant[1], 40, 60))  # warm
    samples = await paced(1000, seconds, admit_for(replicas[0], views[0], lat_tenant[1], 40, 60))
    lat = sorted(s[0] * 1e3 for s in samples)
    latency = {
        "requests": len(lat),
        "admitted": sum(s[1] for s in samples),
        "p50_ms": round(statistics.median(lat), 4),
        "p99_ms": round(lat[int(0.99 * len(lat)) - 1], 4),
        "max_ms": round(lat[-1], 3),
    }

    # 2. accuracy, two replicas at 1,000 req/s each, one rate window
    async def accuracy(
        tenant: tuple[str, str, str], prompt: int, out: int, limit: int, per_request: int
    ) -> dict[str, Any]:
        runs = await asyncio.gather(
            *(
                paced(1000, seconds * 1.5, admit_for(r, v, tenant[1], prompt, out))
                for r, v in zip(replicas, views, strict=True)
            )
        )
        admitted = [sum(ok for _, ok in run) for run in runs]
        enforced = sum(admitted) * per_request
        return {
            "configured": limit,
            "enforced": enforced,
            "offered": sum(len(run) for run in runs) * per_request,
            "admitted_per_replica": admitted,
            "error_pct": round(100 * (enforced - limit) / limit, 3),
        }

    rpm = await accuracy(rpm_tenant, 10, 10, rpm_limit, 1)
    tpm = await accuracy(tpm_tenant, 10, 20, tpm_limit, 30)
    for v, r in zip(views, replicas, strict=True):
        await r.stop()
        await v.stop()
    for nc in conns:
        await nc.close()
    server.stop()
    return {"latency_1_replica_1000rps": latency, "rpm_2_replicas": rpm, "tpm_2_replicas": tpm}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=result_path("admission_latency", gpu="cpu"))
    args = parser.parse_args()
    result = asyncio.run(run(args.seconds))
    lat, rpm, tpm = (
        result["latency_1_replica_1000rps"],
        result["rpm_2_replicas"],
        result["tpm_2_replicas"],
    )
    print("| measure | value |\n|---|---|")
    print(f"| admission p50, 1 replica @ 1,000 req/s | {lat['p50_ms']} ms |")
    print(f"| admission p99 | {lat['p99_ms']} ms |")
    for name, r in (("RPM", rpm), ("TPM", tpm)):
        print(
            f"| {name}, 2 replicas: enforced / configured (offered) | {r['enforced']} / {r['configured']} ({r['offered']}) = {r['error_pct']:+}% |"
        )
    write_result(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
