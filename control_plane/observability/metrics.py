"""Operational metrics: Prometheus exposition with vLLM's names where the meaning matches, our
own `tokenmill_*` series, and a short in-memory history per SKU for the operator's page.

One `OpsMetrics` per app (its own CollectorRegistry, never the process-global one), so two
apps in one process, as in the tests, never mix their numbers.

`model_name` on the vLLM series is the SKU's name, the `model` clients send and `/v1/models`
lists (vLLM's `model_name` is its served model name, the name clients call), on latency,
token and worker-load series alike; `sku` carries the same value. The Hugging Face id behind
a SKU stays in the page's series (`timeseries()[...]["model"]`). Callers:

- the gateway: `observe_request(...)` when a request ends, `refuse_admission(reason, sku)`
  when it turns one away;
- scrape-time readers (`on_scrape`, `on_scrape_async`): the open quota reservations
  (`report_reservations`) and the projection lag, read from the state they live in;
- the worker-presence listener: `update_worker(message)` for every announce / heartbeat / gone;
- the event store: `observe_event_append(...)`.

Everything here is plain Python on the caller's thread, cheap enough for the request path
(a few microseconds per call, about one per inter-token gap).

Size: The Prometheus exposition: every series' name, help and labels in one place.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from control_plane.observability.series import SkuSeries
from tokenmill.settings import ObservabilitySettings
from worker.protocol import Presence, WorkerAnnounce, WorkerGone, WorkerHeartbeat

__all__ = ["PROMETHEUS_TEXT", "ObservabilitySettings", "OpsMetrics", "WorkerView"]

log = logging.getLogger("tokenmill.observability")

# How long a scrape waits for an async reader (Postgres, NATS) before it answers with the last
# figures it has: Prometheus's default scrape timeout is 10 s.
SCRAPE_READ_TIMEOUT_S = 2.0


# The classic text format (0.0.4): every Prometheus and Grafana agent in use reads it.
PROMETHEUS_TEXT = "text/plain; version=0.0.4"

# Bucket bounds (seconds). vLLM's, extended downwards where a fast GPU goes below them.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
E2E_BUCKETS = (
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
)
APPEND_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)


@dataclass
class WorkerView:
    """What the page and the gauges know about one worker."""

    worker_id: str
    sku_id: str
    model: str = ""
    backend: str = ""
    capacity: int | None = None
    running: int = 0
    waiting: int = 0
    kv_pressure: float = 0.0
    heartbeats: int = 0
    last_seen: float = 0.0
    state: str = "live"  # live | lost (no heartbeat for worker_stale_s) | gone (said goodbye)

    def as_dict(self, now: float) -> dict[str, object]:
        return {
            "worker_id": self.worker_id,
            "sku_id": self.sku_id,
            "model": self.model,
            "backend": self.backend,
            "capacity": self.capacity,
            "running": self.running,
            "waiting": self.waiting,
            "kv_pressure": self.kv_pressure,
            "heartbeats": self.heartbeats,
            "last_seen": self.last_seen,
            "seconds_since_seen": max(0.0, now - self.last_seen),
            "state": self.state,
        }


def observe_all(histogram: Histogram, values: Sequence[float]) -> None:
    """`histogram.observe(v)` for each of `values` (a labelled child), with one increment per
    bucket touched: prometheus_client locks once per observation and per bucket, and an
    answer's inter-token gaps are one observation per token, almost all in one or two
    buckets. The plain loop where the client's internals differ."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for value in values:
            histogram.observe(value)
        return
    histogram._raise_if_not_observable()  # type: ignore[attr-defined]
    per_bucket: dict[int, int] = {}
    for value in values:
        if value == value:  # NaN lands in no bucket (as in observe)
            i = bisect.bisect_left(bounds, value)
            per_bucket[i] = per_bucket.get(i, 0) + 1
    for i, n in per_bucket.items():
        buckets[i].inc(n)
    total.inc(sum(values))


class OpsMetrics:
    def __init__(
        self, settings: ObservabilitySettings | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self.settings = settings or ObservabilitySettings()
        self.clock = clock
        self.started_at = clock()
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._series: dict[str, SkuSeries] = {}
        self._models: dict[str, str] = {}  # sku -> model name, as last seen
        self._workers: dict[str, WorkerView] = {}
        self._scrape_hooks: list[Callable[[], None]] = []
        self._async_scrape_hooks: list[Callable[[], Awaitable[None]]] = []
        r = self.registry
        req = ["model_name", "sku"]
        # --- vLLM's names: dashboards built for vLLM read these unchanged. ---
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token in seconds, as the client sees it at the gateway.",
            req,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between consecutive streamed tokens in seconds.",
            req,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency in seconds, admission to last token.",
            req,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens processed.", req, registry=r
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generation tokens produced.", req, registry=r
        )
        # vLLM's prefix-cache counters, in tokens: queries = prompt tokens looked up in the
        # cache, hits = those found there; hits / queries is the hit rate.
        self.prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in prompt tokens.",
            req,
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in prompt tokens served from the cache.",
            req,
            registry=r,
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            [*req, "finished_reason"],
            registry=r,
        )
        engine = ["model_name", "sku", "engine"]  # engine: the worker id, as vLLM labels engines
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage of a worker, 0 to 1.", engine, registry=r
        )
        self.running = Gauge(
            "vllm:num_requests_running", "Requests a worker is running.", engine, registry=r
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting in a worker's queue.", engine, registry=r
        )
        # --- ours ---
        self.tenant_tokens = Counter(
            "tokenmill_tokens",
            "Tokens by tenant, SKU and class (prompt, cached_prompt, completion).",
            ["tenant", "sku", "token_class"],
            registry=r,
        )
        self.unbilled_waste = Counter("tokenmill_unbilled_waste_tokens", "Completion tokens generated but never delivered to the client (not billed).", ["tenant", "sku"], registry=r)  # fmt: skip
        self.tenant_requests = Counter(
            "tokenmill_requests",
            "Finished requests by tenant, SKU and finish reason.",
            ["tenant", "sku", "finish_reason"],
            registry=r,
        )
        self.refused = Counter(
            "tokenmill_admissions_refused",
            "Requests refused before admission, by reason.",
            ["reason", "sku"],
            registry=r,
        )
        self.open_reservations = Gauge(
            "tokenmill_open_reservations",
            "Quota reservations admitted and not yet settled.",
            ["sku"],
            registry=r,
        )
        self.reserved_tokens = Gauge(
            "tokenmill_reserved_tokens",
            "Tokens held by open quota reservations.",
            ["sku"],
            registry=r,
        )
        self.projection_lag = Gauge(
            "tokenmill_projection_lag_messages",
            "Stream messages not yet projected into Postgres.",
            ["projection"],
            registry=r,
        )
        self.projection_lag_s = Gauge(
            "tokenmill_projection_lag_seconds",
            "Age of the oldest message not yet projected.",
            ["projection"],
            registry=r,
        )
        self.dead_letters = Gauge(
            "tokenmill_projection_dead_letters",
            "Unresolved dead letters: events a projection could not apply (see `tokenmill "
            "projections dead-letters list`).",
            ["projection"],
            registry=r,
        )
        self.append_latency = Histogram(
            "tokenmill_event_append_latency_seconds",
            "Time to append an event to JetStream, until acked.",
            ["stream"],
            buckets=APPEND_BUCKETS,
            registry=r,
        )
        self.heartbeats = Counter(
            "tokenmill_worker_heartbeats",
            "Heartbeats received from a worker.",
            ["worker", "sku"],
            registry=r,
        )
        self.last_seen = Gauge(
            "tokenmill_worker_last_seen_timestamp_seconds",
            "When a worker was last heard from (epoch seconds).",
            ["worker", "sku"],
            registry=r,
        )
        self.workers_gauge = Gauge(
            "tokenmill_workers",
            "Workers known to this control plane, by state.",
            ["sku", "state"],
            registry=r,
        )
        self.uptime = Gauge(
            "tokenmill_process_start_time_seconds",
            "When this control plane started (epoch seconds).",
            registry=r,
        )
        self.uptime.set(self.started_at)

    # ------------------------------------------------------------------ requests
    def observe_request(
        self,
        *,
        sku: str,
        model: str,
        tenant: str,
        ttft_s: float | None,
        itl_s: Sequence[float] = (),
        e2e_s: float | None,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int = 0,
        finish_reason: str = "stop",
    ) -> None:
        """One finished request, as the gateway measured it. `itl_s` holds the gaps between
        consecutive streamed tokens (empty for a non-streamed answer). `model` (the SKU's
        model id) is for the page; the series' `model_name` is the SKU name. The token counts
        are the worker's final usage, the same its usage event carries; `cached_tokens` is
        the part of the prompt served from the prefix cache."""
        labels = (sku, sku)
        # Clamped as billing clamps it: a cached count above the prompt is a worker bug.
        hits = min(max(cached_tokens, 0), prompt_tokens)
        if ttft_s is not None:
            self.ttft.labels(*labels).observe(ttft_s)
        if itl_s:
            observe_all(self.itl.labels(*labels), itl_s)
        if e2e_s is not None:
            self.e2e.labels(*labels).observe(e2e_s)
        self.prompt_tokens.labels(*labels).inc(prompt_tokens)
        self.generation_tokens.labels(*labels).inc(completion_tokens)
        self.prefix_cache_queries.labels(*labels).inc(prompt_tokens)
        self.prefix_cache_hits.labels(*labels).inc(hits)  # 0 too: the rate needs both series
        self.request_success.labels(*labels, finish_reason).inc()
        self.tenant_tokens.labels(tenant, sku, "prompt").inc(prompt_tokens)
        if cached_tokens:
            self.tenant_tokens.labels(tenant, sku, "cached_prompt").inc(cached_tokens)
        self.tenant_tokens.labels(tenant, sku, "completion").inc(completion_tokens)
        self.tenant_requests.labels(tenant, sku, finish_reason).inc()
        with self._lock:
            self._models[sku] = model
            self._sku_series(sku).add_request(
                self.clock(),
                ttft_s=ttft_s,
                itl_s=itl_s,
                e2e_s=e2e_s,
                prompt_tokens=prompt_tokens,
                generation_tokens=completion_tokens,
                cached_tokens=hits,
            )

    def refuse_admission(self, reason: str, sku: str = "") -> None:
        """A request turned away before admission: reason such as invalid_api_key,
        key_revoked, tenant_suspended, model_not_found, rate_limited, quota_exceeded,
        no_worker."""
        self.refused.labels(reason, sku).inc()

    def set_open_reservations(self, sku: str, count: int, tokens: int | None = None) -> None:
        self.open_reservations.labels(sku).set(count)
        if tokens is not None:
            self.reserved_tokens.labels(sku).set(tokens)

    def report_reservations(
        self, held: Mapping[str, tuple[int, int]], skus: Iterable[str] = ()
    ) -> None:
        """The reservation gauges as of now: `held` per SKU name (reservations, tokens), and 0
        for every other SKU of `skus`, so an idle SKU reports 0 rather than nothing."""
        self.open_reservations.clear()
        self.reserved_tokens.clear()
        for sku in {*skus, *held}:
            count, tokens = held.get(sku, (0, 0))
            self.set_open_reservations(sku, count, tokens)

    # ------------------------------------------------------------------ scrape-time readers
    def on_scrape(self, read: Callable[[], None]) -> None:
        """Call `read` before every exposition (cheap, in-memory readers only)."""
        self._scrape_hooks.append(read)

    def on_scrape_async(self, read: Callable[[], Awaitable[None]]) -> None:
        """Await `read` before every scrape of /metrics (I/O readers; given
        SCRAPE_READ_TIMEOUT_S, after which the scrape shows the last figures)."""
        self._async_scrape_hooks.append(read)

    async def refresh(self) -> None:
        """Run the async scrape-time readers; a failing or slow one keeps its last figures."""
        for read in self._async_scrape_hooks:
            try:
                await asyncio.wait_for(read(), SCRAPE_READ_TIMEOUT_S)
            except Exception as exc:  # a backend away: readiness reports it
                log.debug("scrape-time reader failed: %r", exc)

    # ------------------------------------------------------------------ event log
    def observe_event_append(self, stream: str, seconds: float) -> None:
        self.append_latency.labels(stream).observe(seconds)

    def set_projection_lag(
        self, projection: str, messages: int, seconds: float | None = None
    ) -> None:
        self.projection_lag.labels(projection).set(messages)
        if seconds is not None:
            self.projection_lag_s.labels(projection).set(seconds)

    # ------------------------------------------------------------------ workers
    def update_worker(self, message: Presence) -> None:
        """Feed every presence message (announce, heartbeat, gone) from the workers."""
        now = self.clock()
        with self._lock:
            worker = self._workers.get(message.worker_id)
            if worker is None or worker.sku_id != message.sku_id:
                if worker is not None:
                    self._drop_load_gauges(worker)
                worker = WorkerView(
                    message.worker_id, message.sku_id, model=self._models.get(message.sku_id, "")
                )
                self._workers[message.worker_id] = worker
            worker.last_seen = now
            if isinstance(message, WorkerAnnounce):
                worker.model, worker.backend, worker.capacity = (
                    message.model,
                    message.backend,
                    message.capacity,
                )
                # The gateway's (the SKU's published model) wins over what a worker calls it.
                self._models.setdefault(message.sku_id, message.model)
                worker.state = "live"
            elif isinstance(message, WorkerHeartbeat):
                worker.running, worker.waiting, worker.kv_pressure = (
                    message.running,
                    message.waiting,
                    message.kv_pressure,
                )
                worker.heartbeats += 1
                worker.state = "live"
                self.heartbeats.labels(worker.worker_id, worker.sku_id).inc()
            elif isinstance(message, WorkerGone):
                worker.state = "gone"
                worker.running = worker.waiting = 0
            self.last_seen.labels(worker.worker_id, worker.sku_id).set(now)
            if worker.state == "live":
                self._set_load_gauges(worker)
            else:
                self._drop_load_gauges(worker)
            self._record_sku_load(worker.sku_id, now)
            self._count_workers()

    def expire_workers(self) -> None:
        """Mark silent workers lost (dropping their load gauges) and forget those silent for
        longer than the chart window. Called before every read."""
        now = self.clock()
        with self._lock:
            changed: set[str] = set()
            for worker in list(self._workers.values()):
                silent = now - worker.last_seen
                if worker.state == "live" and silent > self.settings.worker_stale_s:
                    worker.state = "lost"
                    self._drop_load_gauges(worker)
                    changed.add(worker.sku_id)
                if worker.state != "live" and silent > self.settings.window_s:
                    del self._workers[worker.worker_id]
                    for metric in (self.heartbeats, self.last_seen):
                        _remove(metric, worker.worker_id, worker.sku_id)
            for sku in changed:
                self._record_sku_load(sku, now)
            self._count_workers()

    def _set_load_gauges(self, w: WorkerView) -> None:
        labels = (w.sku_id, w.sku_id, w.worker_id)
        self.kv_usage.labels(*labels).set(w.kv_pressure)
        self.running.labels(*labels).set(w.running)
        self.waiting.labels(*labels).set(w.waiting)

    def _drop_load_gauges(self, w: WorkerView) -> None:
        for metric in (self.kv_usage, self.running, self.waiting):
            _remove(metric, w.sku_id, w.sku_id, w.worker_id)

    def _record_sku_load(self, sku: str, now: float) -> None:
        live = [w for w in self._workers.values() if w.sku_id == sku and w.state == "live"]
        if not live:
            return
        kv = [w.kv_pressure for w in live]
        self._sku_series(sku).set_load(
            now,
            kv_usage=sum(kv) / len(kv),
            kv_usage_max=max(kv),
            running=sum(w.running for w in live),
            waiting=sum(w.waiting for w in live),
        )

    def _count_workers(self) -> None:
        counts: dict[tuple[str, str], int] = {}
        for w in self._workers.values():
            counts[(w.sku_id, w.state)] = counts.get((w.sku_id, w.state), 0) + 1
        self.workers_gauge.clear()
        for (sku, state), n in counts.items():
            self.workers_gauge.labels(sku, state).set(n)

    # ------------------------------------------------------------------ reads
    def exposition(self) -> bytes:
        """The Prometheus text format of everything above."""
        for read in self._scrape_hooks:
            try:
                read()
            except Exception as exc:  # one reader's failure must not blank the scrape
                log.warning("scrape-time reader failed: %r", exc)
        self.expire_workers()
        return generate_latest(self.registry)

    def workers(self) -> list[dict[str, object]]:
        self.expire_workers()
        now = self.clock()
        with self._lock:
            return [
                w.as_dict(now)
                for w in sorted(self._workers.values(), key=lambda w: (w.sku_id, w.worker_id))
            ]

    def timeseries(self, window_s: float | None = None) -> dict[str, object]:
        """Columns per SKU over the last `window_s` (at most the configured window): one
        entry per step, oldest first; `t` holds each step's start (epoch seconds). Each SKU's
        `prefix_cache` sums its prompt tokens (`queries`) and cached ones (`hits`) over the
        window, with `hit_rate` = hits / queries (None without prompt tokens)."""
        self.expire_workers()
        now = self.clock()
        step = self.settings.step_s
        window = min(window_s or self.settings.window_s, self.settings.window_s)
        end = int(now // step)
        start = end - max(1, round(window / step)) + 1
        with self._lock:
            skus: dict[str, dict[str, object]] = {}
            for sku, series in sorted(self._series.items()):
                columns = series.columns(now, start, end)
                skus[sku] = {
                    "model": self._models.get(sku, ""),
                    **columns,
                    "prefix_cache": prefix_cache_summary(columns),
                }
        return {
            "now": now,
            "step_s": step,
            "window_s": window,
            "t": [i * step for i in range(start, end + 1)],
            "skus": skus,
        }

    def _sku_series(self, sku: str) -> SkuSeries:
        series = self._series.get(sku)
        if series is None:
            series = self._series[sku] = SkuSeries(self.settings.step_s, self.settings.window_s)
        return series


def prefix_cache_summary(columns: Mapping[str, Sequence[float | int | None]]) -> dict[str, object]:
    """Prompt tokens looked up and found in the prefix cache over a window's steps."""
    queries = sum(int(v or 0) for v in columns["prefix_cache_queries"])
    hits = sum(int(v or 0) for v in columns["prefix_cache_hits"])
    return {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else None}


def _remove(metric: Gauge | Counter, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass
