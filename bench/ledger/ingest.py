"""Usage ingest: RequestFinished events from JetStream into the Postgres ledger.

Publishes N events (plus a few re-sent copies with fresh message ids, as a worker retrying
after the dedupe window would), runs the usage projector over the backlog, and measures
sustained events/s until the ledger has caught up. Then checks that nothing was lost or
doubled: row count and token sums against what was published.

    .venv/bin/python bench/ledger/ingest.py                    # embedded servers, 200,000 events
    .venv/bin/python bench/ledger/ingest.py --events 50000     # quicker
    TOKENMILL_NATS_URL=... TOKENMILL_DATABASE_URL=... .venv/bin/python bench/ledger/ingest.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import shutil
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import nats

from bench.common import result_path, write_result
from control_plane.embedded import EmbeddedNats, EmbeddedPostgres
from events.projections import Projector, UsageLedgerProjection
from events.store import EventStore, StreamLayout
from events.usage import RequestFinished, encode_usage, usage_subject


def make_events(n: int, seed: int = 7) -> list[RequestFinished]:
    rng = random.Random(seed)
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    out = []
    for i in range(n):
        started = t0 + timedelta(milliseconds=i * 3)
        prompt = rng.randint(16, 4096)
        out.append(
            RequestFinished(
                request_id=f"req-{i:08d}",
                tenant_id=f"ten_{i % 37:04d}",
                key_id=f"key_{i % 101:04d}",
                sku_id=f"sku_{i % 3}",
                model="qwen3.6-27b",
                worker_id=f"w{i % 8}",
                prompt_tokens=prompt,
                cached_tokens=rng.randint(0, prompt),
                completion_tokens=rng.randint(1, 1024),
                finish_reason="stop",
                ttft_ms=rng.uniform(20, 900),
                e2e_ms=rng.uniform(100, 20000),
                started_at=started,
                finished_at=started + timedelta(seconds=2),
            )
        )
    return out


async def publish(
    js: nats.js.JetStreamContext, prefix: str, events: list[RequestFinished], resend: int
) -> float:
    """Pipelined async publishes; `resend` events go out a second time under a new message id."""
    t = time.perf_counter()
    for i, e in enumerate(events):
        await js.publish_async(
            usage_subject(prefix, "worker", e.sku_id),
            encode_usage(e),
            headers={"Nats-Msg-Id": f"req:{e.request_id}"},
        )
        if i < resend:
            await js.publish_async(
                usage_subject(prefix, "worker", e.sku_id),
                encode_usage(e),
                headers={"Nats-Msg-Id": f"retry:{e.request_id}"},
            )
    await js.publish_async_completed()
    return time.perf_counter() - t


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, object]:
    servers: list[EmbeddedNats | EmbeddedPostgres] = []
    nats_url = os.environ.get("TOKENMILL_NATS_URL")
    db_url = os.environ.get("TOKENMILL_DATABASE_URL")
    try:
        if not nats_url:
            n = EmbeddedNats(tmp / "nats").start()
            servers.append(n)
            nats_url = n.url
        if not db_url:
            p = EmbeddedPostgres(tmp / "pgdata").start()
            servers.append(p)
            db_url = p.url
        prefix = "BENCH" + str(int(time.time()))
        layout = StreamLayout(prefix=prefix)
        nc = await nats.connect(nats_url)
        js = nc.jetstream(publish_async_max_pending=20000)
        await EventStore(js, layout).ensure_streams()

        events = make_events(args.events)
        resend = int(args.events * args.resend_fraction)
        publish_s = await publish(js, prefix, events, resend)
        head = int((await js.stream_info(layout.usage_stream)).state.last_seq)

        projector = Projector(
            nc, db_url, layout, UsageLedgerProjection(), batch_size=args.batch_size
        )
        t = time.perf_counter()
        await projector.run(until_seq=head)
        ingest_s = time.perf_counter() - t

        conn = await asyncpg.connect(db_url)
        row = await conn.fetchrow(
            """SELECT count(*) AS rows, count(DISTINCT request_id) AS distinct_ids,
                      sum(prompt_tokens) AS prompt, sum(cached_tokens) AS cached,
                      sum(completion_tokens) AS completion FROM usage_ledger"""
        )
        await conn.close()
        await nc.close()
        expected = {
            "rows": len(events),
            "prompt": sum(e.prompt_tokens for e in events),
            "cached": sum(e.cached_tokens for e in events),
            "completion": sum(e.completion_tokens for e in events),
        }
        got = {k: int(row[k]) for k in expected}
        ok = got == expected and int(row["distinct_ids"]) == len(events)
        return {
            "benchmark": "ledger_ingest",
            "events": len(events),
            "resent_copies": resend,
            "stream_messages": head,
            "batch_size": args.batch_size,
            "publish_events_per_s": round(head / publish_s),
            "ingest_seconds": round(ingest_s, 3),
            "ingest_events_per_s": round(head / ingest_s),
            "expected": expected,
            "ledger": got,
            "lost_rows": expected["rows"] - got["rows"],
            "ok": ok,
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "embedded_servers": bool(servers),
            "at": datetime.now(UTC).isoformat(timespec="seconds"),
        }
    finally:
        for s in reversed(servers):
            s.stop()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--batch-size", type=int, default=5000)
    ap.add_argument("--resend-fraction", type=float, default=0.01)
    ap.add_argument("--json", type=Path, default=result_path("ledger_ingest", gpu="cpu"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tokenmill-bench-"))
    tmp.chmod(0o755)  # the embedded postgres runs as its own user
    try:
        result = asyncio.run(run(args, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = [
        ("events published", f"{result['events']:,} (+{result['resent_copies']:,} re-sent copies)"),
        ("publish rate", f"{result['publish_events_per_s']:,} msg/s"),
        ("ingest (backlog -> ledger)", f"{result['ingest_seconds']} s"),
        ("sustained ingest", f"{result['ingest_events_per_s']:,} events/s"),
        (
            "ledger rows / expected",
            f"{result['ledger']['rows']:,} / {result['expected']['rows']:,}",
        ),  # type: ignore[index]
        ("token sums match", str(result["ledger"] == result["expected"])),
        ("verdict", "OK" if result["ok"] else "MISMATCH"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    write_result(args.json, result)
    print(f"wrote {args.json}")
    if not result["ok"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
