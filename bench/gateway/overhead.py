"""What the gateway costs, and whether metering is exact under load (issue 3's benchmark).

Topology, every part its own process as in production: nats-server and PostgreSQL (embedded,
unless TOKENMILL_NATS_URL / TOKENMILL_DATABASE_URL are set), `tokenmill serve` (the API with the
/v1 gateway), `tokenmill project` (projectors into the ledger), one fixed-rate worker
(`python -m worker.serve --backend fixed_rate`), and the load generator (bench/gateway/load.py).

1. Overhead: C concurrent streams (default 100) of N-token answers from a worker emitting R
   tokens/s per stream, first directly over NATS (the gateway's own WorkerClient), then
   through the gateway (HTTP SSE), alternating, `--rounds` times each. Gateway-added TTFT =
   TTFT through the gateway - TTFT direct, at p50 and p99; throughput = streamed tokens / wall.
2. Reconciliation: `--recon-requests` (10,000) streamed requests through the gateway at the
   same concurrency, `--cancel-frac` (6%) of them hung up by the client mid-stream; then the
   usage ledger is reconciled against the gateway's deliveries.

    python -m bench.gateway.overhead                      # the full run, a few minutes
    python -m bench.gateway.overhead --recon-requests 1000 --requests 200   # a quick one

Prints a table and writes JSON (`--out`, default
bench/results/<date>-cpu-<sha>-gateway_overhead.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench.common import ROOT, percentile, result_path, write_result

ADMIN_TOKEN = "tmadm_bench_" + uuid.uuid4().hex[:8]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, within: float = 60) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {within}s")


class Bench:
    def __init__(self, a: argparse.Namespace, stack: ExitStack) -> None:
        self.a, self.stack = a, stack
        self.tmp = Path(tempfile.mkdtemp(prefix="tokenmill-gwbench-"))
        self.tmp.chmod(0o755)
        self.prefix = "GB" + uuid.uuid4().hex[:8].upper()
        self.nats_url = os.environ.get("TOKENMILL_NATS_URL") or self._embedded_nats()
        self.database_url = os.environ.get("TOKENMILL_DATABASE_URL") or self._embedded_postgres()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "TOKENMILL_NATS_URL": self.nats_url,
            "TOKENMILL_DATABASE_URL": self.database_url,
            "TOKENMILL_STREAM_PREFIX": self.prefix,
            "TOKENMILL_ADMIN_TOKEN": ADMIN_TOKEN,
            "TOKENMILL_DATA_DIR": str(self.tmp / "data"),
            "TOKENMILL_LOG_LEVEL": "WARNING",
        }

    def _embedded_nats(self) -> str:
        from control_plane.embedded import EmbeddedNats

        server = EmbeddedNats(self.tmp / "nats").start()
        self.stack.callback(server.stop)
        return server.url

    def _embedded_postgres(self) -> str:
        from control_plane.embedded import EmbeddedPostgres

        server = EmbeddedPostgres(self.tmp / "pgdata").start()
        self.stack.callback(server.stop)
        return server.url

    def spawn(self, *args: str, log: str) -> subprocess.Popen[bytes]:
        out = open(self.tmp / log, "ab")  # noqa: SIM115 (the child writes it)
        proc = subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT
        )

        def stop() -> None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()

        self.stack.callback(stop)
        return proc

    def profile_gateway(self, out: Path) -> subprocess.Popen[bytes]:
        """py-spy recording the gateway process (native frames too) until sent SIGINT."""
        py_spy = Path(sys.executable).with_name("py-spy")
        cmd = [str(py_spy) if py_spy.exists() else "py-spy", "record", "--native", "--rate", "250"]
        cmd += ["--format", "speedscope", "-o", str(out), "--pid", str(self.serve.pid)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        time.sleep(1.0)  # attached before the load starts
        return proc

    def admin(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        r = httpx.request(
            method,
            self.url + "/admin/v1" + path,
            json=body,
            headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
        )
        r.raise_for_status()
        return r.json()

    def start(self) -> None:
        serve = ["-m", "tokenmill.cli", "serve", "--port", str(self.port)]
        if self.a.uvloop:  # what `tokenmill serve` would gain from uvloop's event loop
            serve = [
                "-c",
                "import sys, uvloop; uvloop.install(); from tokenmill.cli import main; sys.exit(main())",
                *serve[2:],
            ]
        self.serve = self.spawn(*serve, log="serve.log")
        self.spawn("-m", "tokenmill.cli", "project", log="project.log")
        wait_http(self.url + "/healthz")
        tenant = self.admin("POST", "/tenants", {"name": "bench"})
        self.key = self.admin("POST", f"/tenants/{tenant['tenant_id']}/keys", {})["key"]

    def worker_sku(self, name: str, rate: float, tokens: int) -> dict[str, Any]:
        sku = self.admin(
            "POST",
            "/skus",
            {"name": name, "model": "fixed-rate", "runtime": "fixed_rate", "gpu_type": "cpu"},
        )
        config = json.dumps({"tokens_per_s": rate, "output_tokens": tokens, "capacity": 1024})
        self.spawn(
            "-m", "worker.serve", "--nats-url", self.nats_url, "--prefix", self.prefix, "--sku-id", sku["sku_id"],
            "--model", "fixed-rate", "--backend", "fixed_rate", "--config", config, log=f"worker-{name}.log",
        )  # fmt: skip
        # Served once the gateway sees the worker (a one-token request succeeds).
        deadline = time.monotonic() + 60
        while True:
            r = httpx.post(
                self.url + "/v1/chat/completions",
                json={
                    "model": name,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 1,
                },
                headers={"authorization": f"Bearer {self.key}"},
            )
            if r.status_code == 200:
                return sku
            if time.monotonic() > deadline:
                raise TimeoutError(f"no worker for {name}: {r.text}")
            time.sleep(0.2)

    def load(
        self,
        mode: str,
        sku: dict[str, Any],
        requests: int,
        max_tokens: int,
        cancel_frac: float = 0.0,
        stagger_s: float = 0.0,
        concurrency: int | None = None,
    ) -> dict[str, Any]:
        args = [
            "-m", "bench.gateway.load", "--mode", mode, "--concurrency", str(concurrency or self.a.concurrency),
            "--requests", str(requests), "--max-tokens", str(max_tokens), "--cancel-frac", str(cancel_frac),
            "--url", self.url, "--key", self.key, "--model", sku["name"],
            "--nats-url", self.nats_url, "--prefix", self.prefix, "--sku-id", sku["sku_id"],
            "--stagger-s", str(stagger_s),
        ]  # fmt: skip
        cpu0 = cpu_seconds(self.serve.pid)
        out = subprocess.run(
            [sys.executable, *args], cwd=ROOT, env=self.env, capture_output=True, check=True
        )
        run: dict[str, Any] = json.loads(out.stdout)
        run["gateway_cpu_s"] = cpu_seconds(self.serve.pid) - cpu0
        return run

    async def _reconcile(self, expected: int, since: datetime) -> Any:
        import asyncpg

        from pricing.reconcile import reconcile

        conn = await asyncpg.connect(self.database_url)
        try:
            deadline = time.monotonic() + 120
            while True:  # wait until the projector has written both sides of every request
                ledger = await conn.fetchval(
                    "SELECT count(*) FROM usage_ledger WHERE finished_at >= $1", since
                )
                delivered = await conn.fetchval(
                    "SELECT count(*) FROM gateway_deliveries WHERE finished_at >= $1", since
                )
                if (ledger >= expected and delivered >= expected) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.25)
            return await reconcile(conn, since=since)
        finally:
            await conn.close()

    def reconcile(self, expected: int, since: datetime) -> Any:
        return asyncio.run(self._reconcile(expected, since))


def reconciled(report: Any, mismatches_kept: int = 50) -> dict[str, Any]:
    """A `pricing.reconcile` report as the benchmarks' JSON gives it."""
    return {
        "matched": report.matched,
        "pending": report.pending,
        "match_rate_pct": 100 * report.match_rate,
        "mismatches": [m.__dict__ for m in report.mismatches[:mismatches_kept]],
        "billed_completion_tokens": report.billed_completion_tokens,
        "delivered_completion_tokens": report.delivered_completion_tokens,
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    results = [r for run in runs for r in run["results"]]
    ok = [r for r in results if r["ok"]]
    ttfts = [r["ttft_s"] * 1000 for r in ok if r["ttft_s"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    wall = sum(run["wall_s"] for run in runs)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "first_errors": [r["error"] for r in results if not r["ok"]][:3],
        "ttft_ms_p50": percentile(ttfts, 50),
        "ttft_ms_p90": percentile(ttfts, 90),
        "ttft_ms_p99": percentile(ttfts, 99),
        "ttft_ms_mean": statistics.fmean(ttfts) if ttfts else float("nan"),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall else float("nan"),
        "load_generator_cpu_s": sum(run["cpu_s"] for run in runs),
        # The gateway process's CPU while this mode ran (idle for direct calls).
        "gateway_cpu_s": sum(run["gateway_cpu_s"] for run in runs),
        "gateway_cpu_ms_per_1k_tokens": 1e6 * sum(run["gateway_cpu_s"] for run in runs) / tokens
        if tokens
        else float("nan"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--concurrency", type=int, default=100)
    ap.add_argument(
        "--rate", type=float, default=20.0, help="tokens/s per stream of the overhead worker"
    )
    ap.add_argument("--tokens", type=int, default=32, help="answer length in the overhead runs")
    ap.add_argument(
        "--requests", type=int, default=500, help="requests per overhead round and mode"
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--idle-requests", type=int, default=100, help="requests one at a time")
    ap.add_argument("--recon-requests", type=int, default=10_000)
    ap.add_argument("--recon-tokens", type=int, default=16)
    ap.add_argument("--recon-rate", type=float, default=400.0)
    ap.add_argument("--cancel-frac", type=float, default=0.06)
    ap.add_argument("--uvloop", action="store_true", help="run the gateway on uvloop's event loop")
    ap.add_argument(
        "--profile-gateway",
        type=Path,
        metavar="FILE",
        help="record the gateway process with py-spy (speedscope JSON) during the overhead "
        "rounds; the profiler's own cost shows in that run's numbers",
    )
    ap.add_argument("--out", type=Path, default=result_path("gateway_overhead", gpu="cpu"))
    a = ap.parse_args()

    load_before = os.getloadavg()  # others' work on a shared machine shows in the tails
    with ExitStack() as stack:
        b = Bench(a, stack)
        b.start()
        sku = b.worker_sku("bench-fixed", a.rate, a.tokens)
        # Users start spread over one answer's duration: a steady state of `concurrency` streams.
        stagger = a.tokens / a.rate
        b.load("gateway", sku, a.concurrency, a.tokens)  # warm-up: connections, caches
        b.load("direct", sku, a.concurrency, a.tokens)
        runs: dict[str, list[dict[str, Any]]] = {"direct": [], "gateway": []}
        profiler = b.profile_gateway(a.profile_gateway) if a.profile_gateway else None
        for _ in range(a.rounds):
            for mode in ("direct", "gateway"):
                runs[mode].append(b.load(mode, sku, a.requests, a.tokens, stagger_s=stagger))
                print(f"  {mode}: round done", flush=True)
        if profiler is not None:
            profiler.send_signal(signal.SIGINT)  # py-spy writes its file and exits
            profiler.wait(timeout=60)
            print(f"  gateway profile: {a.profile_gateway}", flush=True)
        direct, gateway = summarize(runs["direct"]), summarize(runs["gateway"])
        # The same, one stream at a time: what the gateway adds by itself, without queueing.
        idle = {
            mode: summarize([b.load(mode, sku, a.idle_requests, a.tokens, concurrency=1)])
            for mode in ("direct", "gateway")
        }

        recon_sku = b.worker_sku("bench-recon", a.recon_rate, a.recon_tokens)
        # Only the reconciliation run's requests (the direct runs are billed by the worker but,
        # by design, never pass the gateway).
        since = datetime.now(UTC)
        t0 = time.perf_counter()
        recon_run = b.load(
            "gateway",
            recon_sku,
            a.recon_requests,
            a.recon_tokens,
            a.cancel_frac,
            a.recon_tokens / a.recon_rate,
        )
        recon_wall = time.perf_counter() - t0
        cancelled = sum(r["cancelled"] for r in recon_run["results"])
        recon_errors = sum(not r["ok"] for r in recon_run["results"])
        report = b.reconcile(a.recon_requests, since)

    overhead = {
        "ttft_added_ms_p50": gateway["ttft_ms_p50"] - direct["ttft_ms_p50"],
        "ttft_added_ms_p99": gateway["ttft_ms_p99"] - direct["ttft_ms_p99"],
        "throughput_cost_pct": 100 * (1 - gateway["tokens_per_s"] / direct["tokens_per_s"]),
        "idle_ttft_added_ms_p50": idle["gateway"]["ttft_ms_p50"] - idle["direct"]["ttft_ms_p50"],
        "idle_ttft_added_ms_p99": idle["gateway"]["ttft_ms_p99"] - idle["direct"]["ttft_ms_p99"],
    }
    recon = {
        "requests": a.recon_requests,
        "client_cancelled": cancelled,
        "cancelled_pct": 100 * cancelled / max(1, a.recon_requests),  # 0: a profiling run
        "errors": recon_errors,
        "wall_s": recon_wall,
        "requests_per_s": a.recon_requests / recon_wall,
        "reconciled_requests": report.requests,
        **reconciled(report),
    }
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "loadavg_1_5_15_before": load_before,
            "loadavg_1_5_15_after": os.getloadavg(),
        },
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "direct": direct,
        "gateway": gateway,
        "idle": idle,
        "overhead": overhead,
        "reconciliation": recon,
    }
    write_result(a.out, result)

    print(
        f"\n{a.concurrency} concurrent streams, {a.tokens} tokens at {a.rate:g} tok/s each, {a.rounds} x {a.requests} requests per mode"
    )
    print(f"{'':24}{'direct (NATS)':>16}{'gateway (HTTP)':>16}{'added':>12}")
    for label, key in (
        ("TTFT p50 (ms)", "ttft_ms_p50"),
        ("TTFT p90 (ms)", "ttft_ms_p90"),
        ("TTFT p99 (ms)", "ttft_ms_p99"),
    ):
        print(
            f"{label:24}{direct[key]:>16.2f}{gateway[key]:>16.2f}{gateway[key] - direct[key]:>12.2f}"
        )
    cost = overhead["throughput_cost_pct"]
    print(
        f"{'throughput (tok/s)':24}{direct['tokens_per_s']:>16.1f}{gateway['tokens_per_s']:>16.1f}{f'{cost:.2f}%':>12}"
    )
    print(f"{'errors':24}{direct['errors']:>16}{gateway['errors']:>16}")
    i_d, i_g = idle["direct"], idle["gateway"]
    for label, key in (
        ("1 stream: TTFT p50", "ttft_ms_p50"),
        ("1 stream: TTFT p99", "ttft_ms_p99"),
    ):
        print(f"{label:24}{i_d[key]:>16.2f}{i_g[key]:>16.2f}{i_g[key] - i_d[key]:>12.2f}")
    gw_cpu = gateway["gateway_cpu_s"] / gateway["wall_s"]
    print(
        f"gateway process CPU: {100 * gw_cpu:.0f}% of one core while relaying "
        f"({gateway['gateway_cpu_ms_per_1k_tokens']:.1f} ms per 1,000 streamed tokens)"
    )
    print(
        f"\nreconciliation: {report.requests} requests ({cancelled} = {recon['cancelled_pct']:.1f}% hung up by the client, "
        f"{recon_errors} errors) at {recon['requests_per_s']:.0f} req/s: match rate {recon['match_rate_pct']:.2f}% "
        f"({len(report.mismatches)} mismatches, {report.pending} pending)"
    )
    print(f"JSON: {a.out}")
    return 0 if not report.mismatches else 1


if __name__ == "__main__":
    raise SystemExit(main())
