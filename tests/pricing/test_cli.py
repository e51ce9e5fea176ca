import csv
import io
import json
from datetime import UTC, datetime
from decimal import Decimal

import pytest

from control_plane.embedded import EmbeddedNats
from pricing.cli import capacity_main, invoices_main
from pricing.invoices import invoice_from_json
from tests.pricing.conftest import BillingRig, finished
from tests.pricing.test_jobs import setup_catalogue


def connection_args(rig: BillingRig, nats_server: EmbeddedNats) -> list[str]:
    return [
        *("--database-url", rig.database_url),
        *("--nats-url", nats_server.url),
        *("--prefix", rig.layout.prefix),
    ]


def test_capacity_cli_reference_and_what_if(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--sku",
        "qwen",
        "--tok-s",
        "387.6",
        "--gpu-hour-cost",
        "2.00",
        "--output-price",
        "3.00",
    ]
    assert capacity_main([*argv, "--busy", "0.70", "--busy", "0.90", "--json"]) == 0
    seventy, ninety = json.loads(capsys.readouterr().out)
    assert seventy["output_tokens_per_period"] == 703_261_440
    assert seventy["gpu_hours_per_million_output"] == "0.7167"
    assert Decimal(ninety["cost_per_million_output"]) < Decimal(seventy["cost_per_million_output"])
    assert capacity_main(argv) == 0
    assert "703.3" in capsys.readouterr().out


async def test_invoices_cli(
    rig: BillingRig, nats_server: EmbeddedNats, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:  # noqa: ANN001
    await setup_catalogue(rig)
    await rig.usage(
        [finished("r1", datetime(2026, 3, 3, tzinfo=UTC), completion=1_000_000, prompt=0)]
    )
    await rig.project()
    base = connection_args(rig, nats_server)

    assert await invoices_main([*base, "show", "--tenant", "acme", "--period", "2026-03"]) == 0
    draft = invoice_from_json(capsys.readouterr().out.strip().encode())
    assert (draft.status, draft.total) == ("draft", Decimal("3.00"))

    assert await invoices_main([*base, "close", "--now", "2026-04-02T00:00:00Z"]) == 0
    assert "finalized inv_acme_202603 3.00 USD" in capsys.readouterr().out
    assert await invoices_main([*base, "list"]) == 0
    assert capsys.readouterr().out.split("\t")[:4] == [
        "inv_acme_202603",
        "acme",
        "2026-03",
        "finalized",
    ]
    out = tmp_path / "inv.csv"
    assert (
        await invoices_main(
            [*base, "--out", str(out), "show", "inv_acme_202603", "--format", "csv"]
        )
        == 0
    )
    assert [r["amount"] for r in csv.DictReader(io.StringIO(out.read_text()))] == ["3.00"]

    argv = [
        *base,
        "showback",
        "--from",
        "2026-03-01",
        "--to",
        "2026-04-01",
        "--granularity",
        "hour",
    ]
    assert await invoices_main(argv) == 0
    (record,) = csv.DictReader(io.StringIO(capsys.readouterr().out))
    assert (record["BilledCost"], record["BillingAccountName"]) == ("3.00", "Acme")
    assert json.loads(record["Tags"]) == {"cost_centre": "CC-1042"}
    assert await invoices_main([*base, "show", "inv_nope"]) == 1


async def test_scheduler_runs_the_jobs(
    rig: BillingRig, nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    from pricing.cli import scheduler_main

    await setup_catalogue(rig)
    await rig.usage([finished("s1", datetime(2026, 3, 3, tzinfo=UTC))])
    await rig.project()
    monkeypatch.setenv("TOKENMILL_BILLING_GRACE_S", "0")
    argv = connection_args(rig, nats_server)
    task = asyncio.create_task(scheduler_main(argv))
    for _ in range(100):
        if await rig.pool.fetchval("SELECT count(*) FROM invoices") and await rig.pool.fetchval(
            "SELECT count(*) FROM billing_reports"
        ):
            break
        await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await rig.pool.fetchval("SELECT invoice_id FROM invoices") == "inv_acme_202603"
    assert (
        await rig.pool.fetchval(
            "SELECT last_seq FROM billing_positions WHERE job = 'usage_rollups'"
        )
        == 1
    )
    assert await rig.pool.fetchval("SELECT ok FROM billing_reports") is True


def test_capacity_cli_projects_the_committed_benchmark_results(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from pathlib import Path

    results = Path(__file__).resolve().parents[2] / "bench" / "results"
    argv = ["--bench", str(results / "2026-11-30-h200-b43d07f-gpu_endpoint.json")]
    argv += [
        "--bench",
        str(results / "2026-11-29-h200-2a49ccd-gpu_suite.json"),
        "--concurrency",
        "8",
    ]
    assert capacity_main([*argv, "--variant", "gateway", "--json"]) == 0
    (gateway,) = json.loads(capsys.readouterr().out)
    assert gateway["sku_id"] == "qwen3.6-27b-fp8"
    assert gateway["source"] == "bench:2026-11-30-h200-b43d07f-gpu_endpoint.json gateway c=8"
    # 708.5739419097932 tok/s x 0.70 busy x 30 days x 86,400 s
    assert gateway["output_tokens_per_period"] == 1_285_636_560
    assert gateway["cost_per_period"] is None and gateway["margin_fraction"] is None
    assert "gpu_hour_cost" in gateway["unknown"]

    assert capacity_main([*argv, "--ttft-p95-max", "0.3", "--gpu-hour-cost", "3.50"]) == 0
    table = capsys.readouterr().out
    assert "qwen3.6-27b-fp8" in table and "engine c=8" in table and "bf16" not in table
    assert "1460.3" in table  # 804.85 tok/s x 0.7 x 30 d, in millions

    with pytest.raises(SystemExit, match="concurrency 8"):
        capacity_main([*argv[:4], "--concurrency", "32"])


async def test_empty_lists_say_so(
    rig: BillingRig, nats_server: EmbeddedNats, capsys: pytest.CaptureFixture[str]
) -> None:
    conn = connection_args(rig, nats_server)
    assert await invoices_main([*conn, "list"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and "no finalized invoices" in captured.err
    assert await invoices_main([*conn, "list", "--tenant", "acme"]) == 0
    assert "no finalized invoices of tenant acme" in capsys.readouterr().err
    assert await invoices_main([*conn, "close", "--now", "2026-05-01T00:00:00Z"]) == 0
    assert "nothing to finalize" in capsys.readouterr().err
    window = ["--from", "2026-01-01T00:00:00Z", "--to", "2026-02-01T00:00:00Z"]
    assert await invoices_main([*conn, "showback", *window]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("BillingAccountId,")  # the header, for tools
    assert "no usage from 2026-01-01" in captured.err
