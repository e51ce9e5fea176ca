"""A bounded soak of the production topology: two `tokenmill serve` gateways behind one address
(a round-robin TCP proxy here), the projector and its standby, the scheduler, fixed-rate
workers, embedded NATS and Postgres, all separate processes (tests/chaos/topology.py). Three
tenants send mixed routes (streamed and whole chat completions, completions, responses) with
some clients hanging up mid-stream; the third tenant has a token quota.

Reports the success rate (answered among the requests neither refused by quota nor hung up by
their client), the hung requests (no answer nor error within the deadline), the three-way
reconciliation, the quota tenant's bill against its quota and each process's RSS slope after
the warm-up and over the run's last half (least squares over samples, in MB per 10 minutes).
Prints a table, writes JSON (with every RSS sample).

    python -m bench.gateway.soak --minutes 30

To see what grows: `--memory-profile DIR` has the chosen processes write their allocation
diffs there (TOKENMILL_MEMORY_PROFILE, tokenmill/memory_profile.py), and `--env
PROC:VAR=VALUE` gives a process any other variable, such as a shorter job interval:

    python -m bench.gateway.soak --minutes 8 --memory-profile /tmp/mem \
        --memory-profile-processes scheduler,gateway0 \
        --env scheduler:TOKENMILL_BILLING_CAPACITY_INTERVAL_S=60
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import print_table, result_path, write_result
from tests.chaos.topology import Load, Topology, drive, now_utc

MB = 1024 * 1024
# Streams twice as often as each other route: with --hang-up 0.15, 6% of all requests hang up.
ROUTES = ("chat_stream", "chat_stream", "chat", "completions", "responses")


async def round_robin_proxy(targets: list[int]) -> tuple[asyncio.Server, int]:
    """A TCP proxy on a free port sending each new connection to the next target port."""
    turn = itertools.cycle(targets)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", next(turn))
        except OSError:
            client_w.close()
            return
        await asyncio.gather(pipe(client_r, up_w), pipe(up_r, client_w))

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def slope_mb_per_10min(samples: list[tuple[float, int]]) -> float | None:
    """Least-squares slope of (seconds, bytes) samples, in MB per 10 minutes."""
    if len(samples) < 3:
        return None
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mr = sum(r for _, r in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var == 0:
        return None
    cov = sum((t - mt) * (r - mr) for t, r in samples)
    return cov / var * 600 / MB


async def soak(top: Topology, args: argparse.Namespace) -> dict[str, Any]:
    server, port = await round_robin_proxy(top.gateway_ports)
    base = f"http://127.0.0.1:{port}"
    routes: tuple[str, ...] = ROUTES
    key = top.tenants[0].key
    async with httpx.AsyncClient(timeout=10) as http:  # /v1/responses where it answers
        r = await http.post(
            f"{base}/v1/responses",
            json={"model": "chaos", "input": "hi", "max_output_tokens": 4},
            headers={"authorization": f"Bearer {key}"},
        )
    if r.status_code != 200:
        routes = tuple(x for x in routes if x != "responses")
    since = now_utc()
    started = time.monotonic()
    seconds = args.minutes * 60
    warmup = args.warmup_minutes * 60 if args.warmup_minutes is not None else min(300, seconds / 3)
    rss: dict[str, list[tuple[float, int]]] = {}

    async def sample() -> None:
        while time.monotonic() - started < seconds:
            t = time.monotonic() - started
            for name, value in top.rss().items():
                rss.setdefault(name, []).append((t, value))
            await asyncio.sleep(args.sample_s)

    load = Load()
    sampler = asyncio.create_task(sample())
    await drive(
        [base],
        [t.key for t in top.tenants],
        seconds=seconds,
        concurrency=args.concurrency,
        hang_up=args.hang_up,
        deadline_s=args.deadline_s,
        routes=routes,
        load=load,
    )
    await sampler
    server.close()
    settled = await top.settle(since, load.answered, within=90)
    elapsed = time.monotonic() - started
    report = settled.report
    processes = {
        name: {
            "rss_mb_first": samples[0][1] / MB,
            "rss_mb_last": samples[-1][1] / MB,
            "slope_mb_per_10min": slope_mb_per_10min([s for s in samples if s[0] >= warmup]),
            # The last half alone: a bounded high-water mark still filling after the warm-up
            # shows here as a slope falling towards 0, a leak as one that does not.
            "slope_last_half": slope_mb_per_10min([s for s in samples if s[0] >= seconds / 2]),
            "rss_mb": [[round(t), round(r / MB, 2)] for t, r in samples],
        }
        for name, samples in sorted(rss.items())
    }
    count = load.count()
    return {
        "minutes": args.minutes,
        "warmup_s": warmup,
        "elapsed_s": elapsed,
        "routes": list(routes),
        "concurrency": args.concurrency,
        "requests": len(load.outcomes),
        "outcomes": dict(count),
        "requests_per_s": len(load.outcomes) / elapsed,
        "success_rate": load.success_rate(),
        "hang_up_share": count["hung_up"] / max(1, len(load.outcomes)),
        "hung": len(load.hung),
        "failures": [vars(o) for o in load.failures()[:20]],
        "reconciliation": {
            "requests": report.requests,
            "matched": report.matched,
            "mismatched": len(report.mismatches),
            "pending": report.pending,
            "match_rate": report.match_rate,
            "generated": report.generated_completion_tokens,
            "delivered": report.delivered_completion_tokens,
            "waste": report.unbilled_waste_tokens,
            "billed": report.billed_completion_tokens,
            "mismatches": [vars(m) for m in report.mismatches[:20]],
            "answered_not_billed": settled.unbilled[:20],
        },
        "quota": {
            "quota": settled.overshoot.quota,
            "billed": settled.overshoot.billed,
            "over": settled.overshoot.over,
            "beyond_bound": settled.overshoot.beyond_bound,
        },
        "processes": processes,
    }


def process_env(args: argparse.Namespace) -> dict[str, dict[str, str]]:
    """Extra variables by process name from --env and --memory-profile."""
    out: dict[str, dict[str, str]] = {}
    for item in args.env:
        proc, sep, assignment = item.partition(":")
        var, eq, value = assignment.partition("=")
        if not sep or not eq or not var:
            raise SystemExit(f"--env {item!r}: expected PROC:VAR=VALUE")
        out.setdefault("*" if proc == "all" else proc, {})[var] = value
    if args.memory_profile:
        folder = Path(args.memory_profile).resolve()
        names = args.memory_profile_processes.split(",")
        for name in PROCESSES if names == ["all"] else names:
            out.setdefault(name, {})
            out[name]["TOKENMILL_MEMORY_PROFILE"] = str(folder / f"{name}.txt")
            out[name]["TOKENMILL_MEMORY_PROFILE_EVERY_S"] = str(args.memory_profile_every_s)
    return out


PROCESSES = ("gateway0", "gateway1", "projector0", "projector1", "scheduler", "worker0", "worker1")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--warmup-minutes", type=float, help="default: a third, at most 5")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--hang-up", type=float, default=0.15, help="share of streams hung up")
    ap.add_argument("--deadline-s", type=float, default=30.0, help="a request's deadline")
    ap.add_argument("--quota", type=int, default=200_000, help="the third tenant's token quota")
    ap.add_argument("--sample-s", type=float, default=10.0, help="RSS sampling period")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", help="results folder (default $OUT, else bench/results)")
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="PROC:VAR=VALUE",
        help="a variable for one process (gateway0, scheduler, ...; all: every one); repeatable",
    )
    ap.add_argument("--memory-profile", metavar="DIR", help="allocation diffs, one file a process")
    ap.add_argument(
        "--memory-profile-processes",
        default="all",
        help="comma-separated process names to profile (default all)",
    )
    ap.add_argument("--memory-profile-every-s", type=float, default=60.0)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tokenmill-soak-") as tmp:
        top = Topology(
            Path(tmp), workers=args.workers, quota=args.quota, process_env=process_env(args)
        )
        try:
            top.start()
            result = asyncio.run(soak(top, args))
            result["process_env"] = top.process_env
        finally:
            top.stop()
    rec, quota = result["reconciliation"], result["quota"]
    print(
        f"{result['requests']} requests in {result['elapsed_s']:.0f}s "
        f"({result['requests_per_s']:.1f}/s), outcomes {result['outcomes']}"
    )
    print(
        f"success {result['success_rate'] * 100:.3f}%, hung {result['hung']}, hang-ups "
        f"{result['hang_up_share'] * 100:.1f}%; reconciliation {rec['match_rate'] * 100:.2f}% "
        f"({rec['matched']}/{rec['requests']}, {rec['mismatched']} mismatched, "
        f"{rec['pending']} pending, {len(rec['answered_not_billed'])} answered not billed); "
        f"generated {rec['generated']} = delivered {rec['delivered']} + waste {rec['waste']}, "
        f"billed {rec['billed']}; quota {quota['quota']} billed {quota['billed']} "
        f"(over {quota['over']}, beyond the one-request bound {quota['beyond_bound']})"
    )
    rows = [
        (
            name,
            p["rss_mb_first"],
            p["rss_mb_last"],
            "-" if p["slope_mb_per_10min"] is None else f"{p['slope_mb_per_10min']:.2f}",
            "-" if p["slope_last_half"] is None else f"{p['slope_last_half']:.2f}",
        )
        for name, p in result["processes"].items()
    ]
    print_table(
        ("process", "RSS MB start", "RSS MB end", "MB/10 min", "last half"),
        rows,
        (12, 14, 12, 11, 11),
    )
    path = write_result(result_path("gateway_soak", args.out, gpu="cpu"), result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
