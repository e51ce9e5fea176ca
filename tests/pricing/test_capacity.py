import json
from dataclasses import replace
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest

from pricing.capacity import (
    CapacityInputs,
    Throughput,
    project,
    throughput_from_bench,
    throughput_from_ledger,
)
from pricing.invoices import LedgerRow
from tests.pricing.factories import at, plan

REFERENCE = Throughput(sku_id="qwen3.6-27b-w4", output_tokens_per_second=Decimal("387.6"))


def test_reference_table() -> None:
    p = project(REFERENCE, CapacityInputs(gpu_hour_cost=Decimal("2.00")))
    assert p.output_tokens_per_period == 703_261_440  # 387.6 x 0.70 x 30 x 86,400 (~703M)
    assert round(p.gpu_hours_per_million_output, 3) == Decimal("0.717")
    assert p.cost_per_period == Decimal("1440.00")  # 2.00 x 720 h
    assert p.cost_per_million_output == Decimal("2.0476")  # 1440 / 703.26144
    assert p.revenue_per_million_output is None and p.margin_per_period is None


def test_margin_and_what_ifs() -> None:
    inputs = CapacityInputs(gpu_hour_cost=Decimal("2.00")).priced_by(
        plan("p", at(2026, 1, 1), input="0.50", cached="0.10", output="3.00")
    )
    base = project(REFERENCE, inputs)
    assert base.revenue_per_million_output == Decimal("3.0000")
    assert base.revenue_per_period == Decimal("2109.78")  # 703.26144 x 3.00
    assert base.margin_per_period == Decimal("669.78")
    assert base.margin_fraction == Decimal("0.3175")
    assert base.breakeven_busy_fraction == Decimal("0.4778")  # 1440 / (1004.6592 x 3)
    # At the break-even busy fraction the margin is ~zero.
    at_breakeven = project(REFERENCE, replace(inputs, busy_fraction=base.breakeven_busy_fraction))
    assert abs(at_breakeven.margin_per_period or 0) < Decimal("1.00")
    # The input that comes with the output earns too: 2 input tokens per output, half cached.
    mixed = project(
        REFERENCE,
        replace(
            inputs, input_tokens_per_output_token=Decimal(2), cached_share_of_input=Decimal("0.5")
        ),
    )
    assert mixed.revenue_per_million_output == Decimal("3.6000")  # 3 + 1 x 0.50 + 1 x 0.10
    # A busier GPU lowers the cost per 1M tokens; GPU-hours per 1M (while busy) do not change.
    busy = project(REFERENCE, replace(inputs, busy_fraction=Decimal("0.95")))
    assert busy.cost_per_million_output < base.cost_per_million_output
    assert busy.gpu_hours_per_million_output == base.gpu_hours_per_million_output
    two_gpus = project(replace(REFERENCE, gpus=2), inputs)
    assert two_gpus.gpu_hours_per_million_output == Decimal("1.4333")
    with pytest.raises(ValueError):
        CapacityInputs(gpu_hour_cost=Decimal(2), busy_fraction=Decimal("1.5"))


def test_throughput_from_a_benchmark_results_file(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    path.write_text(
        json.dumps(
            {
                "sku_id": "qwen",
                "summary": {"output_tok_s": 387.6},
                "prompt_tokens": 512,
                "max_tokens": 256,
            }
        )
    )
    measured = throughput_from_bench(path)
    assert measured.output_tokens_per_second == Decimal("387.6")
    assert measured.input_tokens_per_output_token == Decimal(2)
    assert measured.source == "bench:results.json"
    with pytest.raises(ValueError):
        throughput_from_bench({"sku_id": "x", "latency": 1})


def test_throughput_from_the_ledger_counts_concurrent_requests_once() -> None:
    t0 = at(2026, 3, 1)

    def request(start_s: float, end_s: float, completion: int, worker: str = "w1") -> LedgerRow:
        return LedgerRow(
            request_id=f"r{start_s}-{worker}",
            tenant_id="t",
            key_id="k",
            sku_id="s",
            model="m",
            worker_id=worker,
            prompt_tokens=2 * completion,
            completion_tokens=completion,
            finish_reason="stop",
            started_at=t0 + timedelta(seconds=start_s),
            finished_at=t0 + timedelta(seconds=end_s),
            stream_seq=1,
        )

    rows = [
        request(0, 10, 1000),
        request(5, 20, 1000),
        request(100, 110, 1000),
        request(0, 4, 400, "w2"),
    ]
    w1, w2 = throughput_from_ledger(rows, "s")
    assert w1.source == "ledger:w1" and w1.output_tokens_per_second == Decimal(
        100
    )  # 3000 / 30 s busy
    assert w1.input_tokens_per_output_token == Decimal(2)
    assert w2.output_tokens_per_second == Decimal(100)


def test_a_missing_gpu_cost_is_unknown_not_free() -> None:
    from pricing.jobs import BillingSettings, capacity_inputs

    priced = plan("p", at(2026, 1, 1), input="0.50", cached="0.10", output="3.00")
    inputs = capacity_inputs(BillingSettings(gpu_hour_costs={}), "H200", priced)
    assert inputs.gpu_hour_cost is None
    p = project(REFERENCE, inputs)
    assert p.output_tokens_per_period == 703_261_440  # what the GPU produces is still known
    assert p.revenue_per_period == Decimal("2109.78")
    for unknown in (
        p.cost_per_period,
        p.cost_per_million_output,
        p.margin_per_million_output,
        p.margin_per_period,
        p.margin_fraction,
        p.breakeven_busy_fraction,
    ):
        assert unknown is None
    assert set(p.unknown) == {"gpu_hour_cost"}
    assert p.unknown["gpu_hour_cost"].startswith("no GPU-hour cost for gpu_type H200")
    doc = p.as_dict()
    assert doc["margin_fraction"] is None and "gpu_hour_cost" in doc["unknown"]
    # A cost of 0 given on purpose is a cost, not an unknown.
    free = project(REFERENCE, replace(inputs, gpu_hour_cost=Decimal(0)))
    assert free.margin_fraction == Decimal(1) and free.unknown == {}


RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def test_the_committed_benchmark_results_are_read() -> None:
    from pricing.capacity import bench_points

    endpoint = {
        (p.sku_id, p.variant): p
        for p in bench_points(RESULTS / "2026-11-30-h200-b43d07f-gpu_endpoint.json")
    }
    assert set(endpoint) == {("qwen3.6-27b-fp8", "gateway"), ("qwen3.6-27b-fp8", "direct")}
    gateway = endpoint[("qwen3.6-27b-fp8", "gateway")]
    assert gateway.output_tokens_per_second == Decimal("708.5739419097932")
    assert (gateway.concurrency, gateway.prompt_tokens, gateway.output_tokens) == (8, 512, 256)
    assert gateway.ttft_p95_s == Decimal("0.5081623159000017")
    assert gateway.throughput().input_tokens_per_output_token == Decimal(2)

    suite = {p.sku_id: p for p in bench_points(RESULTS / "2026-11-29-h200-2a49ccd-gpu_suite.json")}
    assert set(suite) == {"qwen3.6-27b-fp8", "qwen3.6-27b-bf16", "qwen3.6-27b-hf"}
    assert suite["qwen3.6-27b-fp8"].output_tokens_per_second == Decimal("804.8499334240253")
    assert suite["qwen3.6-27b-bf16"].concurrency == 8
    assert {p.variant for p in suite.values()} == {"engine"}

    for path in sorted(RESULTS.glob("*-gpu_*.json")):  # every committed GPU result
        assert bench_points(path), path


def test_points_are_chosen_by_concurrency_and_slo() -> None:
    from pricing.capacity import NoPointMeetsTheChoice, bench_points, choose_points

    points = [
        *bench_points(RESULTS / "2026-11-30-h200-b43d07f-gpu_endpoint.json"),
        *bench_points(RESULTS / "2026-11-29-h200-2a49ccd-gpu_suite.json"),
        *bench_points(RESULTS / "2026-11-29-h200-f4e60f3-gpu_suite_run14.json"),
    ]
    at8 = choose_points(points, concurrency=8)
    assert len(at8) == 5  # fp8 gateway, fp8 direct, and the engine's fp8, bf16, hf
    engine_fp8 = next(p for p in at8 if p.variant == "engine" and p.sku_id.endswith("-fp8"))
    assert engine_fp8.output_tokens_per_second == Decimal("804.8499334240253")  # the best run
    # ttft p95 <= 0.3 s: only the engine's fp8 (0.24 s; bf16 0.35 s, the gateway 0.51 s).
    fast = choose_points(points, concurrency=8, ttft_p95_max_s=Decimal("0.3"))
    assert {(p.sku_id, p.variant) for p in fast} == {("qwen3.6-27b-fp8", "engine")}
    with pytest.raises(NoPointMeetsTheChoice, match="at concurrency 8"):
        choose_points(points, concurrency=16)


def test_a_concurrency_sweep_gives_a_point_per_concurrency() -> None:
    from pricing.capacity import bench_points, choose_points

    doc = json.loads((RESULTS / "2026-11-30-h200-b43d07f-gpu_endpoint.json").read_text())
    fast = {"output_tokens_per_s": 300.5, "ttft_s_p95": 0.1, "e2e_s_p95": 1.0}
    slow = {"output_tokens_per_s": 1100.0, "ttft_s_p95": 1.9, "e2e_s_p95": 6.0}
    doc["sweep"] = [
        {"concurrency": 2, "gateway": fast, "direct": fast},
        {"concurrency": 32, "gateway": slow, "direct": slow},
    ]
    points = bench_points(doc)
    assert sorted({p.concurrency for p in points}) == [2, 8, 32]
    (at32,) = choose_points(points, concurrency=32, variants=["gateway"])
    assert at32.output_tokens_per_second == Decimal("1100.0")
    # Within a 1 s TTFT p95 the best measured is the load point at 8 (0.51 s), not 32.
    (slo,) = choose_points(points, ttft_p95_max_s=Decimal(1), variants=["gateway"])
    assert (slo.concurrency, slo.output_tokens_per_second) == (8, Decimal("708.5739419097932"))


def test_the_engine_sweep_gives_a_point_per_measured_concurrency() -> None:
    from pricing.capacity import bench_points, choose_points

    points = bench_points(RESULTS / "2026-12-01-h200-920536c-engine_sweep.json")
    assert {(p.sku_id, p.concurrency) for p in points} == {
        ("qwen3.6-27b-fp8", 32),
        ("qwen3.6-27b-fp8", 64),
    }
    (at32,) = choose_points(points, concurrency=32)
    assert at32.variant == "engine" and round(at32.output_tokens_per_second) == 1870
    assert at32.prompt_tokens == 512 and at32.output_tokens == 256
