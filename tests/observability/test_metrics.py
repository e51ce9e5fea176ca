"""OpsMetrics: Prometheus exposition (names, labels, values), worker presence and the page's
in-memory series, driven with a controllable clock."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from control_plane.observability.metrics import ObservabilitySettings, OpsMetrics
from control_plane.observability.series import percentile
from tests.observability.helpers import observe
from worker.protocol import WorkerAnnounce, WorkerGone, WorkerHeartbeat


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def samples(metrics: OpsMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of the text exposition, keyed by (name, labels)."""
    text = metrics.exposition().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(metrics: OpsMetrics, name: str, **labels: str) -> float | None:
    return samples(metrics).get((name, frozenset(labels.items())))


@pytest.fixture()
def clock() -> Clock:
    return Clock()


@pytest.fixture()
def metrics(clock: Clock) -> OpsMetrics:
    return OpsMetrics(ObservabilitySettings(window_s=60, step_s=5, worker_stale_s=10), clock=clock)


def test_request_feeds_vllm_histograms_and_counters(metrics: OpsMetrics) -> None:
    metrics.observe_request(
        sku="demo",
        model="smollm2",
        tenant="acme",
        ttft_s=0.03,
        itl_s=[0.01, 0.02, 0.2],
        e2e_s=0.5,
        prompt_tokens=12,
        completion_tokens=4,
        cached_tokens=3,
    )
    lbl = {"model_name": "demo", "sku": "demo"}
    assert value(metrics, "vllm:time_to_first_token_seconds_count", **lbl) == 1
    assert value(metrics, "vllm:time_to_first_token_seconds_sum", **lbl) == pytest.approx(0.03)
    assert value(metrics, "vllm:time_to_first_token_seconds_bucket", **lbl, le="0.04") == 1
    assert value(metrics, "vllm:time_to_first_token_seconds_bucket", **lbl, le="0.02") == 0
    assert value(metrics, "vllm:inter_token_latency_seconds_count", **lbl) == 3
    assert value(metrics, "vllm:inter_token_latency_seconds_bucket", **lbl, le="0.02") == 2
    assert value(metrics, "vllm:e2e_request_latency_seconds_count", **lbl) == 1
    assert value(metrics, "vllm:prompt_tokens_total", **lbl) == 12
    assert value(metrics, "vllm:generation_tokens_total", **lbl) == 4
    assert value(metrics, "vllm:request_success_total", **lbl, finished_reason="stop") == 1
    assert (
        value(metrics, "tokenmill_tokens_total", tenant="acme", sku="demo", token_class="prompt")
        == 12
    )
    assert (
        value(
            metrics,
            "tokenmill_tokens_total",
            tenant="acme",
            sku="demo",
            token_class="cached_prompt",
        )
        == 3
    )
    assert (
        value(
            metrics, "tokenmill_tokens_total", tenant="acme", sku="demo", token_class="completion"
        )
        == 4
    )
    assert (
        value(metrics, "tokenmill_requests_total", tenant="acme", sku="demo", finish_reason="stop")
        == 1
    )


def test_own_series_refusals_reservations_projection_and_appends(metrics: OpsMetrics) -> None:
    metrics.refuse_admission("rate_limited", sku="demo")
    metrics.refuse_admission("rate_limited", sku="demo")
    metrics.refuse_admission("invalid_api_key")
    metrics.set_open_reservations("demo", 7, tokens=900)
    metrics.set_projection_lag("usage_ledger", 42, seconds=1.5)
    metrics.observe_event_append("control", 0.0007)
    assert (
        value(metrics, "tokenmill_admissions_refused_total", reason="rate_limited", sku="demo") == 2
    )
    assert (
        value(metrics, "tokenmill_admissions_refused_total", reason="invalid_api_key", sku="") == 1
    )
    assert value(metrics, "tokenmill_open_reservations", sku="demo") == 7
    assert value(metrics, "tokenmill_reserved_tokens", sku="demo") == 900
    assert value(metrics, "tokenmill_projection_lag_messages", projection="usage_ledger") == 42
    assert value(metrics, "tokenmill_projection_lag_seconds", projection="usage_ledger") == 1.5
    assert (
        value(
            metrics, "tokenmill_event_append_latency_seconds_bucket", stream="control", le="0.001"
        )
        == 1
    )
    assert (
        value(
            metrics, "tokenmill_event_append_latency_seconds_bucket", stream="control", le="0.0005"
        )
        == 0
    )


def test_each_app_has_its_own_registry(clock: Clock) -> None:
    a, b = OpsMetrics(clock=clock), OpsMetrics(clock=clock)
    a.refuse_admission("quota_exceeded", "demo")
    assert value(a, "tokenmill_admissions_refused_total", reason="quota_exceeded", sku="demo") == 1
    assert (
        value(b, "tokenmill_admissions_refused_total", reason="quota_exceeded", sku="demo") is None
    )


def test_worker_presence_sets_vllm_gauges_then_lost_after_silence(
    metrics: OpsMetrics, clock: Clock
) -> None:
    metrics.update_worker(
        WorkerAnnounce(worker_id="w1", sku_id="demo", model="smollm2", backend="torch", capacity=8)
    )
    metrics.update_worker(
        WorkerHeartbeat(
            worker_id="w1", sku_id="demo", running=3, waiting=2, kv_pressure=0.4, ts=clock.now
        )
    )
    eng = {"model_name": "demo", "sku": "demo", "engine": "w1"}
    assert value(metrics, "vllm:num_requests_running", **eng) == 3
    assert value(metrics, "vllm:num_requests_waiting", **eng) == 2
    assert value(metrics, "vllm:kv_cache_usage_perc", **eng) == pytest.approx(0.4)
    assert value(metrics, "tokenmill_worker_heartbeats_total", worker="w1", sku="demo") == 1
    assert (
        value(metrics, "tokenmill_worker_last_seen_timestamp_seconds", worker="w1", sku="demo")
        == clock.now
    )
    assert value(metrics, "tokenmill_workers", sku="demo", state="live") == 1
    [w] = metrics.workers()
    assert (w["state"], w["running"], w["capacity"], w["backend"]) == ("live", 3, 8, "torch")

    clock.now += 11  # past worker_stale_s: its load no longer counts
    assert value(metrics, "vllm:num_requests_running", **eng) is None
    assert value(metrics, "tokenmill_workers", sku="demo", state="lost") == 1
    assert value(metrics, "tokenmill_workers", sku="demo", state="live") is None
    assert metrics.workers()[0]["state"] == "lost"

    clock.now += 1  # it comes back
    metrics.update_worker(
        WorkerHeartbeat(
            worker_id="w1", sku_id="demo", running=1, waiting=0, kv_pressure=0.1, ts=clock.now
        )
    )
    assert value(metrics, "vllm:num_requests_running", **eng) == 1
    assert value(metrics, "tokenmill_worker_heartbeats_total", worker="w1", sku="demo") == 2

    metrics.update_worker(WorkerGone(worker_id="w1", sku_id="demo"))
    assert value(metrics, "vllm:num_requests_running", **eng) is None
    assert metrics.workers()[0]["state"] == "gone"
    clock.now += 61  # beyond the window: forgotten altogether
    assert metrics.workers() == []
    assert (
        value(metrics, "tokenmill_worker_last_seen_timestamp_seconds", worker="w1", sku="demo")
        is None
    )


def test_heartbeat_before_announce_does_not_leave_a_stale_model_label(
    metrics: OpsMetrics, clock: Clock
) -> None:
    metrics.update_worker(
        WorkerHeartbeat(
            worker_id="w1", sku_id="demo", running=1, waiting=0, kv_pressure=0.2, ts=clock.now
        )
    )
    metrics.update_worker(
        WorkerAnnounce(worker_id="w1", sku_id="demo", model="m", backend="torch", capacity=4)
    )
    metrics.update_worker(
        WorkerHeartbeat(
            worker_id="w1", sku_id="demo", running=2, waiting=0, kv_pressure=0.2, ts=clock.now
        )
    )
    running = {k: v for k, v in samples(metrics).items() if k[0] == "vllm:num_requests_running"}
    assert running == {
        (
            "vllm:num_requests_running",
            frozenset({("model_name", "demo"), ("sku", "demo"), ("engine", "w1")}),
        ): 2
    }


def test_timeseries_percentiles_throughput_and_load_per_step(
    metrics: OpsMetrics, clock: Clock
) -> None:
    clock.now = 1_000_000.0  # a step boundary (step 5 s)
    for i in range(100):
        gaps, tokens = [0.01] * 9 + [0.5], dict(prompt_tokens=10, completion_tokens=10)
        observe(metrics, ttft_s=(i + 1) / 1000, itl_s=gaps, e2e_s=1.0 + i / 100, **tokens)
    metrics.update_worker(
        WorkerHeartbeat(worker_id="w1", sku_id="demo", running=4, waiting=1, kv_pressure=0.2, ts=0)
    )
    metrics.update_worker(
        WorkerHeartbeat(worker_id="w2", sku_id="demo", running=2, waiting=0, kv_pressure=0.6, ts=0)
    )
    clock.now += 5  # the next step: the first one closes
    observe(metrics, ttft_s=9.0, e2e_s=9.0, prompt_tokens=1, completion_tokens=1)
    ts = metrics.timeseries()
    assert ts["step_s"] == 5 and len(ts["t"]) == 12  # 60 s window / 5 s
    demo = ts["skus"]["demo"]
    assert demo["model"] == "m"
    first = -2  # the closed step
    assert ts["t"][first] == 1_000_000.0
    assert demo["requests"][first] == 100
    assert demo["ttft_p50"][first] == pytest.approx(0.050)
    assert demo["ttft_p99"][first] == pytest.approx(0.099)
    assert demo["itl_p50"][first] == pytest.approx(0.01)
    assert demo["itl_p90"][first] == pytest.approx(0.01)
    assert demo["itl_p99"][first] == pytest.approx(0.5)
    assert demo["e2e_p90"][first] == pytest.approx(1.89)
    assert demo["generation_tps"][first] == pytest.approx(1000 / 5)
    assert demo["kv_usage"][first] == pytest.approx(0.4)
    assert demo["kv_usage_max"][first] == pytest.approx(0.6)
    assert (demo["running"][first], demo["waiting"][first]) == (6, 1)
    assert demo["requests"][-1] == 1 and demo["ttft_p50"][-1] == 9.0
    # steps with nothing: zero traffic, unknown latency
    assert demo["requests"][0] == 0 and demo["ttft_p50"][0] is None and demo["kv_usage"][0] is None

    clock.now += 60  # the whole window later, the old steps are gone
    later = metrics.timeseries()["skus"]["demo"]
    assert sum(later["requests"]) == 0


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 0.5) is None
    assert percentile([1.0], 0.99) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.75) == 3.0


def test_observing_many_values_at_once_counts_as_observing_each() -> None:
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from control_plane.observability.metrics import observe_all

    buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
    values = [0.0, 0.005, 0.0051, 0.01, 0.049, 0.05, 0.3, 7.5, 1.0, 0.02] * 3
    expositions, sums = [], []
    for many in (False, True):
        registry = CollectorRegistry()
        h = Histogram("gap_seconds", "gaps", ["sku"], buckets=buckets, registry=registry)
        if many:
            observe_all(h.labels("a"), values)
        else:
            for v in values:
                h.labels("a").observe(v)
        lines = generate_latest(registry).splitlines()
        # (the sum may differ in its last bits: 3.12's sum() compensates rounding)
        skip = (b"_created", b"gap_seconds_sum")
        expositions.append(b"\n".join(x for x in lines if not any(k in x for k in skip)))
        sums.append(registry.get_sample_value("gap_seconds_sum", {"sku": "a"}))
    assert expositions[0] == expositions[1]
    assert sums[0] == pytest.approx(sums[1]) == pytest.approx(sum(values))
    assert b'gap_seconds_bucket{le="0.005",sku="a"} 6.0' in expositions[1]


def test_model_name_is_the_served_sku_name_on_every_vllm_series(
    metrics: OpsMetrics, clock: Clock
) -> None:
    # The gateway knows the SKU's Hugging Face id; the demo worker announces the SKU name as
    # its model. One value on every series, the name clients call (as vLLM's served name).
    observe(metrics, model="HuggingFaceTB/SmolLM2-135M-Instruct", itl_s=[0.01])
    metrics.update_worker(
        WorkerAnnounce(
            worker_id="w1", sku_id="demo", model="SmolLM2-135M-Instruct", backend="t", capacity=4
        )
    )
    metrics.update_worker(
        WorkerHeartbeat(
            worker_id="w1", sku_id="demo", running=1, waiting=1, kv_pressure=0.3, ts=clock.now
        )
    )
    names: dict[str, set[str]] = {}
    for (name, labels), _ in samples(metrics).items():
        if name.startswith("vllm:"):
            names.setdefault(name, set()).add(dict(labels)["model_name"])
    assert "vllm:kv_cache_usage_perc" in names and "vllm:generation_tokens_total" in names
    assert names == {name: {"demo"} for name in names}
    # The page still shows the model behind the SKU.
    assert metrics.timeseries()["skus"]["demo"]["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_reservation_gauges_are_read_at_scrape_time_for_every_sku(metrics: OpsMetrics) -> None:
    held: dict[str, tuple[int, int]] = {}
    metrics.on_scrape(lambda: metrics.report_reservations(held, skus=["demo", "other"]))
    assert value(metrics, "tokenmill_open_reservations", sku="demo") == 0
    assert value(metrics, "tokenmill_reserved_tokens", sku="other") == 0
    held["demo"] = (2, 300)
    assert value(metrics, "tokenmill_open_reservations", sku="demo") == 2
    assert value(metrics, "tokenmill_reserved_tokens", sku="demo") == 300
    held.clear()
    assert value(metrics, "tokenmill_open_reservations", sku="demo") == 0


def test_prefix_cache_queries_and_hits_count_prompt_tokens_per_sku(
    metrics: OpsMetrics, clock: Clock
) -> None:
    def request(sku: str, prompt: int, cached: int) -> None:
        observe(metrics, sku=sku, prompt_tokens=prompt, completion_tokens=5, cached_tokens=cached)

    clock.now = 1_000_000.0
    request("qwen", 1000, 0)  # nothing cached: queried, no hit
    clock.now += 20
    request("qwen", 1000, 1000)  # a fully cached prompt
    request("qwen", 500, 125)
    request("llama", 300, 0)
    request("llama", 80, 200)  # more cached than prompt: counted as the whole prompt
    for sku, queries, hits in [("qwen", 2500, 1125), ("llama", 380, 80)]:
        lbl = {"model_name": sku, "sku": sku}
        assert value(metrics, "vllm:prefix_cache_queries_total", **lbl) == queries
        assert value(metrics, "vllm:prefix_cache_hits_total", **lbl) == hits
        assert value(metrics, "vllm:prompt_tokens_total", **lbl) == queries
    text = metrics.exposition().decode()
    assert "# TYPE vllm:prefix_cache_queries_total counter" in text
    assert "# TYPE vllm:prefix_cache_hits_total counter" in text

    # the page's hit rate, per SKU over its window: the uncached request 20 s ago is in the
    # 60 s window and out of a 10 s one
    skus = metrics.timeseries()["skus"]
    assert skus["qwen"]["prefix_cache"] == {"queries": 2500, "hits": 1125, "hit_rate": 0.45}
    assert skus["llama"]["prefix_cache"]["hit_rate"] == pytest.approx(80 / 380)
    recent = metrics.timeseries(10)["skus"]["qwen"]
    assert recent["prefix_cache"] == {"queries": 1500, "hits": 1125, "hit_rate": 0.75}
    assert recent["prefix_cache_hit_rate"][-1] == 0.75
    assert recent["prefix_cache_hit_rate"][0] is None  # a step without prompts: unknown

    clock.now += 60  # the window later: no prompt tokens, no rate (not 0 %)
    assert metrics.timeseries()["skus"]["qwen"]["prefix_cache"] == {
        "queries": 0,
        "hits": 0,
        "hit_rate": None,
    }
    assert value(metrics, "vllm:prefix_cache_hits_total", model_name="qwen", sku="qwen") == 1125
