"""The production topology as real processes, for chaos tests and the soak benchmark.

Embedded NATS (one node, or a 3-node JetStream cluster with every stream and bucket
replicated 3 times), embedded PostgreSQL, two `tokenmill serve` gateways, a `tokenmill
project` projector and its standby, `tokenmill scheduler` and fixed-rate worker processes,
each its own process that a test can SIGKILL and start again. A load driver streams requests
from three tenants over both gateways, hangs up on some mid-stream and gives every request a
deadline: one that neither finishes nor errors within it is *hung*. The third tenant has a
token quota; `quota_overshoot` says how far its bill went past it.

After a fault, `settle` waits for the three records of every request (worker, gateway,
ledger) and returns the reconciliation (pricing.reconcile), with the requests the clients saw
answered that the ledger lacks (those of a gateway that died before billing them, which
reconciliation lists as gateway lost, apart).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import nats

from control_plane.embedded import EmbeddedPostgres, _wait_port, free_port, nats_server_binary
from events.usage import usage_stream_name
from pricing.reconcile import Report, reconcile

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "tmadm_chaos"
MODEL = "chaos"
RATE = 100.0  # tokens/s of each fixed-rate answer
OUTPUT_TOKENS = 64  # a full answer; max_tokens cuts it


# --- NATS: one node or a cluster ---------------------------------------------------------


@dataclass
class NatsNode:
    """One nats-server with JetStream; with `routes` a member of a cluster named `cluster`."""

    name: str
    store_dir: Path
    port: int = field(default_factory=free_port)
    cluster_port: int = field(default_factory=free_port)
    routes: list[int] = field(default_factory=list)
    cluster: str = ""
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> NatsNode:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        cmd = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js"]
        cmd += ["-sd", str(self.store_dir), "-n", self.name]
        if self.cluster:
            cmd += ["--cluster_name", self.cluster]
            cmd += ["--cluster", f"nats://127.0.0.1:{self.cluster_port}"]
            cmd += ["--routes", ",".join(f"nats://127.0.0.1:{p}" for p in self.routes)]
        log = open(self.store_dir.parent / f"{self.name}.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        _wait_port(self.port, self.proc, f"nats-server {self.name}")
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)
        self.proc = None


def nats_nodes(root: Path, count: int) -> list[NatsNode]:
    """`count` nodes (1: a single server; 3: a cluster routed to one another)."""
    nodes = [NatsNode(f"n{i}", root / f"n{i}") for i in range(count)]
    if count > 1:
        for node in nodes:
            node.cluster = "chaos"
            node.routes = [n.cluster_port for n in nodes if n is not node]
    return nodes


# --- the product's processes ---------------------------------------------------------------


@dataclass
class Proc:
    """A tokenmill process: started, SIGKILLed, started again with the same command."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        out = open(self.log, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            self.cmd, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT
        )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""


@dataclass
class Tenant:
    tenant_id: str
    key: str
    quota: int | None = None


class Topology:
    """The whole install under `root`; `start()` brings it up, `stop()` takes it down."""

    def __init__(
        self,
        root: Path,
        *,
        nats_count: int = 1,
        gateways: int = 2,
        workers: int = 2,
        quota: int = 2500,
        process_env: dict[str, dict[str, str]] | None = None,
    ) -> None:
        self.root = root
        # Extra variables by process name ("gateway0", "scheduler"...; "*": every process),
        # e.g. the memory probe or shorter job intervals for the soak.
        self.process_env = process_env or {}
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.prefix = "X" + uuid.uuid4().hex[:10].upper()
        self.nats = nats_nodes(root / "nats", nats_count)
        self.postgres = EmbeddedPostgres(root / "pgdata")
        self.gateway_ports = [free_port() for _ in range(gateways)]
        self.worker_count = workers
        self.quota = quota
        self.gateways: list[Proc] = []
        self.projectors: list[Proc] = []
        self.scheduler: Proc | None = None
        self.workers: list[Proc] = []
        self.tenants: list[Tenant] = []
        self.sku_id = ""

    # -- addresses and environment -----------------------------------------------------------

    @property
    def nats_url(self) -> str:
        return ",".join(n.url for n in self.nats)

    @property
    def bases(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.gateway_ports]

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
        return env | {
            "TOKENMILL_NATS_URL": self.nats_url,
            "TOKENMILL_DATABASE_URL": self.postgres.url,
            "TOKENMILL_ADMIN_TOKEN": ADMIN,
            "TOKENMILL_STREAM_PREFIX": self.prefix,
            "TOKENMILL_STREAM_REPLICAS": str(len(self.nats)),
            "TOKENMILL_LOG_LEVEL": "WARNING",
            # Fast failure detection: workers beat every 0.1 s, dead after 1 s of silence;
            # a worker stops generating for a gateway silent for 1.5 s.
            "TOKENMILL_GATEWAY_WORKER_DEAD_S": "1",
            "TOKENMILL_WORKER_GATEWAY_SILENT_S": "1.5",
            # Fixed-rate answers have no prefill: a request whose worker sent nothing for 5 s
            # lost its replies (the default, 300 s, outwaits any model's prefill).
            "TOKENMILL_GATEWAY_SILENCE_TIMEOUT_S": "5",
            # glibc's heap as deploy/Dockerfile sets it (docs/deploy.md, the soak).
            "MALLOC_MMAP_THRESHOLD_": "65536",
            "MALLOC_TRIM_THRESHOLD_": "65536",
        }

    def _proc(self, name: str, args: list[str]) -> Proc:
        cmd = [sys.executable, "-m", "tokenmill.cli", *args]
        env = self.env() | self.process_env.get("*", {}) | self.process_env.get(name, {})
        return Proc(name, cmd, env, self.logs / f"{name}.log")

    def gateway(self, i: int) -> Proc:
        port = self.gateway_ports[i]
        data_dir = self.root / f"gw{i}"
        return self._proc(f"gateway{i}", ["serve", "--port", str(port), "--data-dir", str(data_dir)])  # fmt: skip

    def worker(self, i: int) -> Proc:
        config = json.dumps({"tokens_per_s": RATE, "output_tokens": OUTPUT_TOKENS})
        args = ["worker", "--sku-id", self.sku_id, "--model", MODEL, "--backend", "fixed_rate"]
        args += ["--config", config, "--heartbeat-s", "0.1", "--drain-s", "2"]
        return self._proc(f"worker{i}", ["--data-dir", str(self.root / "wk"), *args])

    # -- up and down ---------------------------------------------------------------------------

    def start(self) -> Topology:
        for node in self.nats:
            node.start()
        self.postgres.start()
        self.gateways = [self.gateway(i).start() for i in range(len(self.gateway_ports))]
        for i in range(len(self.gateways)):
            self.wait_ready(i)
        self.projectors = [
            self._proc(f"projector{i}", ["project", "--data-dir", str(self.root / f"pj{i}")]).start()
            for i in range(2)
        ]  # fmt: skip
        self.scheduler = self._proc("scheduler", ["--data-dir", str(self.root / "sch"), "scheduler"])  # fmt: skip
        self.scheduler.start()
        asyncio.run(self._provision())
        self.workers = [self.worker(i).start() for i in range(self.worker_count)]
        asyncio.run(self.wait_serving())
        return self

    def stop(self) -> None:
        procs = [*self.workers, *self.gateways, *self.projectors]
        procs += [self.scheduler] if self.scheduler else []
        for p in procs:
            p.kill(signal.SIGTERM)
        for node in self.nats:
            node.kill(signal.SIGTERM)
        self.postgres.stop()

    def wait_ready(self, i: int, within: float = 90.0) -> None:
        deadline = time.monotonic() + within
        while True:
            gw = self.gateways[i]
            assert gw.alive(), f"gateway{i} exited:\n{gw.tail()}"
            assert time.monotonic() < deadline, f"gateway{i} not ready:\n{gw.tail()}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.bases[i]}/readyz", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)

    def restart_gateway(self, i: int) -> None:
        self.gateways[i].kill()
        self.gateways[i] = self.gateway(i).start()
        self.wait_ready(i)

    async def admin(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        async with httpx.AsyncClient(base_url=self.bases[0] + "/admin/v1", timeout=30) as http:
            r = await http.request(method, path, json=body, headers={"authorization": f"Bearer {ADMIN}"})  # fmt: skip
        assert r.status_code < 300, r.text
        return r.json()

    async def _provision(self) -> None:
        sku = await self.admin("POST", "/skus", {"name": MODEL, "model": MODEL, "runtime": "fixed_rate", "gpu_type": "cpu"})  # fmt: skip
        self.sku_id = sku["sku_id"]
        for i in range(3):
            tenant = await self.admin("POST", "/tenants", {"name": f"tenant{i}"})
            tid = tenant["tenant_id"]
            key = await self.admin("POST", f"/tenants/{tid}/keys", {"scopes": []})
            quota = self.quota if i == 2 else None
            if quota is not None:
                await self.admin("PUT", f"/tenants/{tid}/limits", {"token_quota": quota})
            self.tenants.append(Tenant(tid, key["key"], quota))

    async def wait_serving(self, within: float = 60.0) -> None:
        """Until every gateway answers every tenant and knows the quota."""
        deadline = time.monotonic() + within
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        async with httpx.AsyncClient(timeout=10) as http:
            for base in self.bases:
                for t in self.tenants:
                    auth = {"authorization": f"Bearer {t.key}"}
                    while True:
                        assert time.monotonic() < deadline, f"{base} does not serve {t.tenant_id}"
                        with contextlib.suppress(httpx.HTTPError):
                            if t.quota is not None:
                                usage = (await http.get(f"{base}/v1/usage", headers=auth)).json()
                                known = any(
                                    (p.get("limits") or {}).get("token_quota")
                                    for p in usage.get("policies", [])
                                )
                                if not known:
                                    await asyncio.sleep(0.2)
                                    continue
                            r = await http.post(
                                f"{base}/v1/chat/completions", json=body, headers=auth
                            )
                            if r.status_code == 200:
                                break
                        await asyncio.sleep(0.2)

    def replace_worker(self, i: int) -> None:
        self.workers[i].kill()
        self.workers[i] = self.worker(i).start()

    def rss(self) -> dict[str, int]:
        """Resident memory (bytes) of each product process."""
        procs = [*self.gateways, *self.projectors, *self.workers]
        procs += [self.scheduler] if self.scheduler else []
        return {p.name: rss_bytes(p.pid) for p in procs if p.alive()}

    # -- NATS cluster -----------------------------------------------------------------------

    async def stream_leader(self) -> str:
        """The name of the node leading the usage stream."""
        nc = await nats.connect(self.nats_url.split(","))
        try:
            info = await nc.jetstream().stream_info(usage_stream_name(self.prefix))
            assert info.cluster is not None and info.cluster.leader
            return info.cluster.leader
        finally:
            await nc.close()

    # -- after a fault ---------------------------------------------------------------------------

    async def settle(
        self, since: datetime, answered: list[str], within: float = 60.0, grace_s: float = 5.0
    ) -> Settled:
        """Wait until nothing is pending and the ledger holds every request answered (but those
        of a gateway that died before billing them: not billed, by policy); the last
        reconciliation, the answered requests the ledger lacks and the quota overshoot."""
        conn = await _connect_retrying(self.postgres.url, within)
        try:
            deadline = time.monotonic() + within
            while True:
                report = await reconcile(conn, since=since, grace=timedelta(seconds=grace_s))
                billed = {
                    r["request_id"]
                    for r in await conn.fetch(
                        "SELECT request_id FROM usage_ledger WHERE request_id = ANY($1)", answered
                    )
                }
                lost = {g.request_id for g in report.gateway_lost}
                unbilled = sorted(set(answered) - billed - lost)
                if (report.pending == 0 and not unbilled) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(1.0)
            answered_lost = sorted(set(answered) & lost)
            return Settled(report, unbilled, await self.quota_overshoot(conn), answered_lost)
        finally:
            await conn.close()

    async def quota_overshoot(self, conn: asyncpg.Connection) -> Overshoot:
        (t,) = [t for t in self.tenants if t.quota is not None]
        billed = await conn.fetchval(
            "SELECT coalesce(sum(prompt_tokens + completion_tokens), 0) FROM usage_ledger "
            "WHERE tenant_id = $1",
            t.tenant_id,
        )
        assert t.quota is not None
        return Overshoot(t.quota, int(billed))


@dataclass
class Overshoot:
    """The quota tenant's bill against its quota. Admission lets the one request that crosses
    the line overdraw by less than its reservation (control_plane/admission/budgets.py);
    `beyond_bound` is what goes past that."""

    quota: int
    billed: int

    @property
    def over(self) -> int:
        return max(0, self.billed - self.quota)

    @property
    def beyond_bound(self) -> int:
        return max(0, self.billed - self.quota - MAX_RESERVATION)


@dataclass
class Settled:
    report: Report
    unbilled: list[str]  # answered to a client, not in the ledger, nor gateway lost
    overshoot: Overshoot
    # answered to a client, then its gateway died before billing it (reconciliation: gateway
    # lost; not billed: nothing shows the client got it)
    answered_lost: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        out = [m.problem + f" ({m.request_id})" for m in self.report.mismatches[:10]]
        if self.report.pending:
            out.append(f"{self.report.pending} still pending")
        if self.unbilled:
            out.append(f"{len(self.unbilled)} answered but not billed: {self.unbilled[:5]}")
        if self.report.gateway_lost:
            out.append(
                f"{len(self.report.gateway_lost)} gateway lost "
                f"({len(self.answered_lost)} of them answered)"
            )
        if self.overshoot.beyond_bound:
            out.append(f"quota {self.overshoot.quota} overshot: billed {self.overshoot.billed}")
        return out


async def _connect_retrying(url: str, within: float) -> asyncpg.Connection:
    deadline = time.monotonic() + within
    while True:
        try:
            return await asyncpg.connect(url)
        except (OSError, asyncpg.PostgresError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


def rss_bytes(pid: int) -> int:
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss)
    except ImportError:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0


# --- the load ------------------------------------------------------------------------------------

PROMPT = [{"role": "user", "content": "tell me about the mill"}]
MAX_TOKENS = (8, 48)  # each request's max_tokens, drawn in this range
MAX_RESERVATION = 64 + MAX_TOKENS[1]  # prompt tokens of PROMPT (well under 64) + max_tokens


@dataclass
class Outcome:
    route: str
    tenant: int
    gateway: int
    result: str  # ok | hung_up | refused | failed | hung
    request_id: str = ""
    detail: str = ""


@dataclass
class Load:
    outcomes: list[Outcome] = field(default_factory=list)

    def count(self) -> Counter[str]:
        return Counter(o.result for o in self.outcomes)

    @property
    def answered(self) -> list[str]:
        return [o.request_id for o in self.outcomes if o.result == "ok" and o.request_id]

    @property
    def hung(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.result == "hung"]

    def success_rate(self) -> float:
        """Answered among the requests not refused by quota nor hung up by their client."""
        c = self.count()
        tried = len(self.outcomes) - c["refused"] - c["hung_up"]
        return 1.0 if tried == 0 else c["ok"] / tried

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.result in ("failed", "hung")]


ROUTES = ("chat_stream", "chat", "completions", "responses")


def _request(route: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
    if route in ("chat_stream", "chat"):
        body = {"model": MODEL, "messages": PROMPT, "max_tokens": max_tokens}
        return "/v1/chat/completions", body | ({"stream": True} if route == "chat_stream" else {})
    if route == "completions":
        return "/v1/completions", {"model": MODEL, "prompt": "the mill", "max_tokens": max_tokens}
    return "/v1/responses", {"model": MODEL, "input": "the mill", "max_output_tokens": max_tokens}


async def one_request(
    http: httpx.AsyncClient,
    base: str,
    key: str,
    route: str,
    hang_up_after: int | None,
    rng: random.Random,
) -> tuple[str, str, str]:
    """(result, request id, detail) of one request; a stream with `hang_up_after` is closed
    after that many chunks, as a client hanging up."""
    path, body = _request(route, rng.randint(*MAX_TOKENS))
    auth = {"authorization": f"Bearer {key}"}
    if route != "chat_stream":
        r = await http.post(base + path, json=body, headers=auth)
        rid = r.headers.get("x-request-id", "")
        if r.status_code == 200:
            return "ok", rid, ""
        if r.status_code == 429:
            return "refused", rid, r.text[:200]
        return "failed", rid, f"{r.status_code} {r.text[:200]}"
    async with http.stream("POST", base + path, json=body, headers=auth) as r:
        rid = r.headers.get("x-request-id", "")
        if r.status_code == 429:
            return "refused", rid, (await r.aread()).decode()[:200]
        if r.status_code != 200:
            return "failed", rid, f"{r.status_code} {(await r.aread()).decode()[:200]}"
        chunks = 0
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                return "ok", rid, ""
            if line.startswith("data: {"):
                if '"error"' in line[:40]:
                    return "failed", rid, line[:200]
                chunks += 1
                if chunks == hang_up_after:
                    return "hung_up", rid, ""
        return "failed", rid, "stream ended without [DONE]"


async def drive(
    bases: list[str],
    keys: list[str],
    requests: int | None = None,
    *,
    seconds: float | None = None,
    concurrency: int = 16,
    hang_up: float = 0.08,
    deadline_s: float = 30.0,
    routes: tuple[str, ...] = ("chat_stream",),
    seed: int = 0,
    load: Load | None = None,
    backoff_s: float = 0.5,
) -> Load:
    """`requests` requests (or as many as `seconds` allow, or until both are reached when both
    are given), `concurrency` at a time, spread round-robin over the gateways and tenants;
    `hang_up` of the streams hang up mid-way. A client waits `backoff_s` after a failure, as
    a client that retries would."""
    load = load if load is not None else Load()
    rng = random.Random(seed)
    started = time.monotonic()
    counter = iter(range(10**12))
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)

    async def client(http: httpx.AsyncClient) -> None:
        while True:
            i = next(counter)
            enough = requests is None or i >= requests
            over = seconds is None or time.monotonic() - started > seconds
            if enough and over:
                return
            route = routes[rng.randrange(len(routes))]
            hang = rng.randint(2, 6) if route == "chat_stream" and rng.random() < hang_up else None
            tenant, gw = i % len(keys), (i // len(keys)) % len(bases)
            outcome = Outcome(route, tenant, gw, "hung")
            try:
                result = await asyncio.wait_for(
                    one_request(http, bases[gw], keys[tenant], route, hang, rng), deadline_s
                )
                outcome.result, outcome.request_id, outcome.detail = result
            except TimeoutError:
                outcome.detail = f"no answer nor error within {deadline_s}s"
            except (httpx.HTTPError, OSError) as e:
                outcome.result, outcome.detail = "failed", f"{type(e).__name__}: {e}"[:200]
            load.outcomes.append(outcome)
            if outcome.result in ("failed", "hung"):
                await asyncio.sleep(backoff_s)

    timeout = httpx.Timeout(deadline_s * 2)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return load


def now_utc() -> datetime:
    return datetime.now().astimezone()
