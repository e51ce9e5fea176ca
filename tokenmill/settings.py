"""Settings: every env-backed dataclass of tokenmill, read from the environment once at start-up.

Each field documents its variable in place; defaults give the embedded single-machine setup
(`tokenmill up`). One module for all of them so that an operator finds every variable in one
place and every part reads variables the same way (`env`, `env_float`, `env_int`,
`env_bool`). It imports nothing of tokenmill: the worker reads it without the control plane.

- `Settings`: the control plane's process (servers, ports, stream names, request limits).
- `AdmissionSettings`: quotas, rate limits and shared budgets.
- `GatewaySettings`, `RoutingSettings`: dispatch to workers.
- `ObservabilitySettings`: /metrics and the operator's page.
- `BillingSettings`: invoices, capacity and reconciliation jobs.
- `WorkerSettings`: a worker process (`tokenmill worker`, `python -m worker.serve`).
- `MemoryProfileSettings`: the opt-in allocation probe of any `tokenmill` process.

The engine's own knobs (TOKENMILL_ENGINE_*) are fields of `worker.engine.EngineConfig`,
documented there beside what they tune, and read with the helpers here.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any, overload


@overload
def env(name: str) -> str | None: ...
@overload
def env(name: str, default: str) -> str: ...
def env(name: str, default: str | None = None) -> str | None:
    """The variable's value; unset or empty gives `default`."""
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def env_float(name: str, default: float) -> float:
    """The variable as a number; unset or empty gives `default`."""
    value = env(name)
    return float(value) if value is not None else default


def env_int(name: str, default: int) -> int:
    """The variable as an integer (a float spelling such as "1e5" is accepted)."""
    value = env(name)
    return int(float(value)) if value is not None else default


def env_bool(name: str, default: bool = False) -> bool:
    """The variable as a switch: 1/true/yes/on or 0/false/no/off; unset or empty: `default`."""
    value = (env(name) or "").strip().lower()
    if not value:
        return default
    return value in ("1", "true", "yes", "on")


def nats_servers(url: str) -> list[str]:
    """`TOKENMILL_NATS_URL` as nats-py's `servers=`: one URL, or several comma-separated
    (seeds of one cluster; the client learns the rest from the server)."""
    servers = [part.strip() for part in url.split(",") if part.strip()]
    if not servers:
        raise ValueError("TOKENMILL_NATS_URL holds no URL")
    return servers


def gpu_hour_costs(spec: str) -> dict[str, Decimal]:
    """TOKENMILL_GPU_HOUR_COSTS ("H200=3.50,L40S=1.10") as a gpu_type -> cost mapping."""
    pairs = (item.split("=", 1) for item in spec.split(",") if "=" in item)
    return {gpu.strip(): Decimal(cost.strip()) for gpu, cost in pairs}


@dataclass(frozen=True)
class Settings:
    # TOKENMILL_DATA_DIR: where the embedded servers, admin token and model cache live.
    data_dir: Path = field(default_factory=lambda: Path(env("TOKENMILL_DATA_DIR", ".tokenmill")))
    # TOKENMILL_NATS_URL: an external NATS (JetStream enabled): one URL, or several
    # comma-separated (seeds of one cluster; see `nats_servers`). Unset: an embedded one.
    nats_url: str | None = field(default_factory=lambda: env("TOKENMILL_NATS_URL"))
    # TOKENMILL_DATABASE_URL: an external PostgreSQL (postgresql://...). Unset: embedded.
    database_url: str | None = field(default_factory=lambda: env("TOKENMILL_DATABASE_URL"))
    # TOKENMILL_ADMIN_TOKEN: bearer token for /admin/v1. Unset: generated once, kept in data dir.
    admin_token: str | None = field(default_factory=lambda: env("TOKENMILL_ADMIN_TOKEN"))
    # TOKENMILL_HOST / TOKENMILL_PORT: where `tokenmill serve` / `up` listen.
    host: str = field(default_factory=lambda: env("TOKENMILL_HOST", "127.0.0.1"))
    port: int = field(default_factory=lambda: int(env("TOKENMILL_PORT", "8080")))
    # TOKENMILL_STREAM_PREFIX: prefix of stream names, so several installs can share a NATS.
    stream_prefix: str = field(default_factory=lambda: env("TOKENMILL_STREAM_PREFIX", "TM"))
    # TOKENMILL_STREAM_REPLICAS: JetStream replicas for the streams (3 on a production cluster).
    stream_replicas: int = field(default_factory=lambda: int(env("TOKENMILL_STREAM_REPLICAS", "1")))
    # TOKENMILL_V1_MAX_BODY_BYTES: the largest /v1 request body (larger: 413, refused while
    # reading). 8 MiB holds a 262,144-token prompt at 32 JSON bytes a token: text averages 3-4
    # bytes a token, and non-ASCII text sent as \u escapes (6-12 bytes a character) fits too.
    v1_max_body_bytes: int = field(
        default_factory=lambda: int(env("TOKENMILL_V1_MAX_BODY_BYTES", str(8 * 1024 * 1024)))
    )
    # TOKENMILL_MAX_BODY_BYTES: the largest admin API body (larger: a 413 problem before the
    # handler). 1 MiB is ample for any admin write.
    max_body_bytes: int = field(
        default_factory=lambda: int(env("TOKENMILL_MAX_BODY_BYTES", str(1024 * 1024)))
    )
    # TOKENMILL_V1_READ_TIMEOUT_S: a /v1 body must be in this long after its head (408 after);
    # so must any request's head after its first byte. 30 s carries 8 MiB at 280 KB/s.
    v1_read_timeout_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_V1_READ_TIMEOUT_S", 30.0)
    )
    # TOKENMILL_MAX_HEADER_BYTES: the largest request head (request line and headers, any
    # path; larger: 431). 32 KiB is nginx's default (4 x 8 KiB); a tokenmill key is 55 bytes.
    max_header_bytes: int = field(
        default_factory=lambda: int(env("TOKENMILL_MAX_HEADER_BYTES", str(32 * 1024)))
    )
    # TOKENMILL_FAST_PATH: "0" serves /v1 on uvicorn's and nats-py's public APIs only; on (the
    # default) the data plane takes control_plane/dataplane/fast_path (where the installed
    # versions are the ones it was tested with).
    fast_path: bool = field(default_factory=lambda: env_bool("TOKENMILL_FAST_PATH", True))
    # TOKENMILL_WEB_DIR: the operator's page's files; unset: the checkout's web/, else the
    # packaged copy.
    web_dir: str | None = field(default_factory=lambda: env("TOKENMILL_WEB_DIR"))

    @property
    def nats_servers(self) -> list[str]:
        """TOKENMILL_NATS_URL as nats-py's `servers=` list (empty when unset)."""
        return nats_servers(self.nats_url) if self.nats_url else []

    def with_overrides(self, **changes: object) -> Settings:
        from dataclasses import replace

        return replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class AdmissionSettings:
    # TOKENMILL_GOV_DEFAULT_MAX_TOKENS: what a request without max_tokens reserves (and is
    # capped to): its completion can never outgrow what admission reserved.
    default_max_tokens: int = field(
        default_factory=lambda: int(env_float("TOKENMILL_GOV_DEFAULT_MAX_TOKENS", 4096))
    )
    # TOKENMILL_GOV_RESERVATION_TTL_S: the longest a request may run. A quota reservation whose
    # request never shows up in the usage stream is dropped after this; so is what a crashed
    # replica held.
    reservation_ttl_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_GOV_RESERVATION_TTL_S", 600.0)
    )
    # TOKENMILL_GOV_STREAM_TTL_S: a crashed replica's concurrent-stream slots free after this.
    stream_slot_ttl_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_GOV_STREAM_TTL_S", 30.0)
    )
    # TOKENMILL_GOV_SYNC_INTERVAL_S: how often a replica hands back idle leased budget and
    # refreshes its heartbeat in the shared counters.
    sync_interval_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_GOV_SYNC_INTERVAL_S", 0.25)
    )
    # TOKENMILL_GOV_IDLE_RETURN_S: leased budget unused this long goes back to the pool.
    idle_return_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_GOV_IDLE_RETURN_S", 1.0)
    )
    # TOKENMILL_GOV_LEASE_FRACTION: the largest lease, as a fraction of the limit. Smaller
    # leases strand less budget on an idle replica; larger ones hit NATS less often.
    lease_fraction: float = field(
        default_factory=lambda: env_float("TOKENMILL_GOV_LEASE_FRACTION", 0.02)
    )
    # TOKENMILL_GOV_FOLLOWER_HEARTBEAT_S: the usage follower's idle heartbeat. Three missed
    # (a NATS restart, a lost node) and it re-creates its consumer from the last sequence read.
    follower_heartbeat_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_GOV_FOLLOWER_HEARTBEAT_S", 1.0)
    )
    # TOKENMILL_STREAM_REPLICAS: replicas of the shared-budget KV buckets, as for the streams.
    kv_replicas: int = field(default_factory=lambda: int(env("TOKENMILL_STREAM_REPLICAS", "1")))


@dataclass(frozen=True)
class WorkerSettings:
    # TOKENMILL_NATS_URL: the NATS server (JetStream enabled) shared with the control plane.
    nats_url: str = field(
        default_factory=lambda: env("TOKENMILL_NATS_URL", "nats://127.0.0.1:4222")
    )
    # TOKENMILL_STREAM_PREFIX: the install's subject and stream prefix.
    stream_prefix: str = field(default_factory=lambda: env("TOKENMILL_STREAM_PREFIX", "TM"))
    # TOKENMILL_WORKER_SKU: the SKU id this worker serves.
    sku_id: str = field(default_factory=lambda: env("TOKENMILL_WORKER_SKU", ""))
    # TOKENMILL_WORKER_MODEL: the model name written into usage events.
    model: str = field(default_factory=lambda: env("TOKENMILL_WORKER_MODEL", ""))
    # TOKENMILL_WORKER_BACKEND: torch_runtime | openai_proxy | fixed_rate.
    backend: str = field(default_factory=lambda: env("TOKENMILL_WORKER_BACKEND", "torch_runtime"))
    # TOKENMILL_WORKER_CONFIG: the backend's keyword config as JSON.
    backend_config: dict[str, Any] = field(
        default_factory=lambda: json.loads(env("TOKENMILL_WORKER_CONFIG", "{}"))
    )
    # TOKENMILL_WORKER_ID: stable id in usage events and presence; default host-pid-random.
    worker_id: str = field(
        default_factory=lambda: env(
            "TOKENMILL_WORKER_ID", f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        )
    )
    # TOKENMILL_WORKER_HEARTBEAT_S: heartbeat period; gateways call a worker dead after a few missed.
    heartbeat_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_WORKER_HEARTBEAT_S", 0.5)
    )
    # TOKENMILL_WORKER_GATEWAY_SILENT_S: a request whose gateway's lease is silent this long is
    # stopped (the gateway died: nobody would receive the tokens).
    gateway_silent_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_WORKER_GATEWAY_SILENT_S", 3.0)
    )
    # TOKENMILL_WORKER_DRAIN_S: on SIGTERM, how long in-flight requests may run before cancel.
    drain_s: float = field(default_factory=lambda: env_float("TOKENMILL_WORKER_DRAIN_S", 10.0))


@dataclass(frozen=True)
class GatewaySettings:
    # TOKENMILL_GATEWAY_WORKER_DEAD_S: a worker silent this long (no heartbeat) is dead, and
    # its in-flight requests end with an error (billed for what was delivered).
    worker_dead_after_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_GATEWAY_WORKER_DEAD_S", 3.0)
    )
    # TOKENMILL_GATEWAY_ACCEPT_TIMEOUT_S: a request no worker accepted by then is failed.
    accept_timeout_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_GATEWAY_ACCEPT_TIMEOUT_S", 5.0)
    )
    # TOKENMILL_GATEWAY_SILENCE_TIMEOUT_S: a request whose live worker sent nothing for this
    # long is failed (its replies were lost); longer than any prefill.
    silence_timeout_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_GATEWAY_SILENCE_TIMEOUT_S", 300.0)
    )
    # TOKENMILL_GATEWAY_REPORT_EVERY_S: ended requests are reported to the outcome listeners
    # (metrics) together this often (see `Gateway._report_ended`); 0: each at once. The bill
    # and its delivery record are not batched.
    report_every_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_GATEWAY_REPORT_EVERY_S", 0.05)
    )
    # TOKENMILL_GATEWAY_LEASE_EVERY_S: how often this gateway publishes its lease; workers stop
    # the requests of a gateway silent for TOKENMILL_WORKER_GATEWAY_SILENT_S (3 s).
    lease_every_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_GATEWAY_LEASE_EVERY_S", 0.5)
    )
    # TOKENMILL_GATEWAY_RESERVATIONS_EVERY_S: how often the open-reservations gauges refresh.
    reservations_every_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_GATEWAY_RESERVATIONS_EVERY_S", 1.0)
    )
    # TOKENMILL_GATEWAY_ID: this replica's id in its delivery records and its requests; default
    # host-pid-random. Give each process its own: reconciliation reads a gateway id that
    # reports again later as a gateway still alive (pricing.reconcile.metering).
    gateway_id: str = field(
        default_factory=lambda: (
            os.environ.get("TOKENMILL_GATEWAY_ID")
            or f"gw-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        )
    )


@dataclass(frozen=True)
class RoutingSettings:
    # TOKENMILL_GATEWAY_AFFINITY_ENTRIES: prefix hashes remembered (LRU), each with the worker
    # that last served it; ~100 bytes each.
    affinity_entries: int = field(
        default_factory=lambda: int(env_float("TOKENMILL_GATEWAY_AFFINITY_ENTRIES", 100_000))
    )
    # TOKENMILL_GATEWAY_AFFINITY_PREFIX_CHARS: characters of the prompt's prefix hashed (the
    # gateway has no tokenizer): ~512 tokens, a few KV blocks' worth.
    affinity_prefix_chars: int = field(
        default_factory=lambda: int(env_float("TOKENMILL_GATEWAY_AFFINITY_PREFIX_CHARS", 2048))
    )
    # TOKENMILL_GATEWAY_AFFINITY_QUEUE_MARGIN / _KV_MARGIN: how much more loaded than the least
    # loaded worker the prefix's worker may be and still get the request.
    affinity_queue_margin: int = field(
        default_factory=lambda: int(env_float("TOKENMILL_GATEWAY_AFFINITY_QUEUE_MARGIN", 1))
    )
    affinity_kv_margin: float = field(
        default_factory=lambda: env_float("TOKENMILL_GATEWAY_AFFINITY_KV_MARGIN", 0.2)
    )
    # TOKENMILL_GATEWAY_AFFINITY_CROSS_TENANT: one tenant's prefix hash matches another's. Off:
    # a tenant that could steer its requests onto the worker holding another tenant's prompt
    # could tell from the first-token time whether that prompt is cached (a timing side
    # channel on other tenants' prompts).
    affinity_cross_tenant: bool = field(
        default_factory=lambda: env_bool("TOKENMILL_GATEWAY_AFFINITY_CROSS_TENANT")
    )


@dataclass(frozen=True)
class ObservabilitySettings:
    # TOKENMILL_OPS_WINDOW_S: how much history the page's charts keep in memory (seconds).
    window_s: float = field(default_factory=lambda: env_float("TOKENMILL_OPS_WINDOW_S", 900.0))
    # TOKENMILL_OPS_STEP_S: one chart point per this many seconds.
    step_s: float = field(default_factory=lambda: env_float("TOKENMILL_OPS_STEP_S", 5.0))
    # TOKENMILL_WORKER_STALE_S: a worker silent this long is reported lost and its load dropped.
    worker_stale_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_WORKER_STALE_S", 10.0)
    )
    # TOKENMILL_METRICS_TOKEN: when set, /metrics answers only `Authorization: Bearer <it>`
    # (401 otherwise): the exposition names tenant ids with their token counts. Unset: open.
    metrics_token: str | None = field(default_factory=lambda: env("TOKENMILL_METRICS_TOKEN"))


@dataclass(frozen=True)
class BillingSettings:
    # TOKENMILL_BILLING_GRACE_S: a month closes this long after it ends; usage that reaches the
    # ledger later is an adjustment on the next invoice. Default 6 hours.
    grace_s: float = field(default_factory=lambda: env_float("TOKENMILL_BILLING_GRACE_S", 21600.0))
    # TOKENMILL_BILLING_CURRENCY: invoice currency of a tenant none of whose usage is priced.
    default_currency: str = field(default_factory=lambda: env("TOKENMILL_BILLING_CURRENCY", "USD"))
    # TOKENMILL_GPU_HOUR_COSTS: cost of one GPU-hour per SKU gpu_type, "H200=3.50,L40S=1.10".
    gpu_hour_costs: dict[str, Decimal] = field(
        default_factory=lambda: gpu_hour_costs(env("TOKENMILL_GPU_HOUR_COSTS", ""))
    )
    # TOKENMILL_CAPACITY_BUSY_FRACTION: share of the month a GPU is assumed busy.
    busy_fraction: Decimal = field(
        default_factory=lambda: Decimal(env("TOKENMILL_CAPACITY_BUSY_FRACTION", "0.70"))
    )
    # TOKENMILL_CAPACITY_WINDOW_S: how much recent ledger measures a SKU's throughput.
    capacity_window_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_CAPACITY_WINDOW_S", 86400.0)
    )
    # TOKENMILL_RECONCILE_WINDOW_S: how far back each reconciliation report looks.
    reconcile_window_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_RECONCILE_WINDOW_S", 86400.0)
    )
    # TOKENMILL_SCHEDULER_LOCK_TTL_S: the leader key's TTL; renewed every third of it.
    lock_ttl_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_SCHEDULER_LOCK_TTL_S", 15.0)
    )
    # TOKENMILL_BILLING_{CLOSE,ROLLUP,CAPACITY,RECONCILE}_INTERVAL_S: how often each job runs.
    close_interval_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_BILLING_CLOSE_INTERVAL_S", 300.0)
    )
    rollup_interval_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_BILLING_ROLLUP_INTERVAL_S", 60.0)
    )
    capacity_interval_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_BILLING_CAPACITY_INTERVAL_S", 900.0)
    )
    reconcile_interval_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_BILLING_RECONCILE_INTERVAL_S", 3600.0)
    )
    # TOKENMILL_STREAM_REPLICAS: replicas of the leader lock's KV bucket, as for the streams.
    kv_replicas: int = field(default_factory=lambda: int(env("TOKENMILL_STREAM_REPLICAS", "1")))

    @property
    def grace(self) -> timedelta:
        return timedelta(seconds=self.grace_s)


@dataclass(frozen=True)
class MemoryProfileSettings:
    """The opt-in memory probe (tokenmill/memory_profile.py), for finding what grows in a
    long-running process; off unless TOKENMILL_MEMORY_PROFILE is set."""

    # TOKENMILL_MEMORY_PROFILE: a file; set, the process traces its allocations (tracemalloc,
    # slower) and appends its RSS and the allocation sites that grew most there. "{pid}" in
    # it is replaced by the process id. Unset (the default): no tracing.
    path: str | None = field(default_factory=lambda: env("TOKENMILL_MEMORY_PROFILE"))
    # TOKENMILL_MEMORY_PROFILE_EVERY_S: seconds between snapshots (the first after one period).
    every_s: float = field(
        default_factory=lambda: env_float("TOKENMILL_MEMORY_PROFILE_EVERY_S", 60.0)
    )
    # TOKENMILL_MEMORY_PROFILE_TOP: allocation sites written per comparison.
    top: int = field(default_factory=lambda: env_int("TOKENMILL_MEMORY_PROFILE_TOP", 15))
    # TOKENMILL_MEMORY_PROFILE_FRAMES: frames of traceback kept per allocation (1: the line
    # only; more tells apart who called a shared helper, at more cost). 0: no tracing, only
    # the RSS and C heap line each period (no cost to measure, as the soak's RSS is).
    frames: int = field(default_factory=lambda: env_int("TOKENMILL_MEMORY_PROFILE_FRAMES", 1))
