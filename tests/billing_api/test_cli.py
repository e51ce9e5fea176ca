"""`tokenmill invoices` as an operator runs it: a subprocess finding NATS and Postgres through
the environment, next to a running control plane."""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import json
import os
import signal
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest

from pricing.invoices import invoice_from_json
from tests.billing_api.conftest import Billing
from tests.billing_api.test_api import catalogue, september_usage
from tests.pricing.conftest import finished
from tokenmill.cli import RUNTIME_FILE


def environment(b: Billing, data_dir: Path, urls_from_env: bool = True) -> dict[str, str]:
    """The servers' URLs in the environment, or else in the data dir of a running
    `tokenmill up` (its runtime.json)."""
    settings = b.services.settings
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    env |= {"TOKENMILL_STREAM_PREFIX": settings.stream_prefix, "TOKENMILL_DATA_DIR": str(data_dir)}
    urls = {"nats_url": settings.nats_url or "", "database_url": settings.database_url or ""}
    if urls_from_env:
        env |= {
            "TOKENMILL_DATABASE_URL": urls["database_url"],
            "TOKENMILL_NATS_URL": urls["nats_url"],
        }
    else:  # this test process stands in for the running `tokenmill up`
        (data_dir / RUNTIME_FILE).write_text(json.dumps({"pid": os.getpid(), **urls}))
    return env


TOKENMILL = (sys.executable, "-m", "tokenmill.cli")


async def tokenmill(
    b: Billing, data_dir: Path, *argv: str, urls_from_env: bool = True
) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *TOKENMILL, *argv, env=environment(b, data_dir, urls_from_env),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode() + ("" if proc.returncode == 0 else err.decode())


async def test_tokenmill_invoices_reads_what_the_api_finalized(
    billing: Billing, tmp_path: Path
) -> None:
    b = billing
    tenant_id, sku_id, key_id = await catalogue(b)
    await september_usage(b, tenant_id, sku_id, key_id)
    await b.http.get("/invoices", params={"consistent": "true"})
    r = await b.http.post(f"/tenants/{tenant_id}/invoices/2026-09/finalize")
    assert r.status_code == 201, r.text
    final = invoice_from_json(r.content)

    code, out = await tokenmill(b, tmp_path, "invoices", "list", "--tenant", tenant_id)
    assert code == 0, out
    assert out.split() == [final.invoice_id, tenant_id, "2026-09", "finalized", "1.27", "USD"]

    code, out = await tokenmill(b, tmp_path, "invoices", "list", urls_from_env=False)
    assert code == 0 and out.split()[:4] == [final.invoice_id, tenant_id, "2026-09", "finalized"]

    code, out = await tokenmill(b, tmp_path, "invoices", "show", final.invoice_id)
    assert code == 0 and invoice_from_json(out.strip().encode()) == final, out

    code, out = await tokenmill(
        b, tmp_path, "invoices", "show", "--tenant", tenant_id, "--period", "2026-09", "--format", "csv"
    )  # fmt: skip
    assert code == 0, out
    assert sum(Decimal(row["amount"]) for row in csv.DictReader(io.StringIO(out))) == final.total

    code, out = await tokenmill(
        b, tmp_path, "invoices", "showback", "--from", "2026-09-01", "--to", "2026-10-01", "--tenant", tenant_id
    )  # fmt: skip
    assert code == 0, out
    assert (
        sum(Decimal(row["x_InvoicedCost"]) for row in csv.DictReader(io.StringIO(out)))
        == final.total
    )

    code, out = await tokenmill(b, tmp_path, "invoices", "show", "inv_nobody_202609")
    assert code == 1 and "no finalized invoice" in out


async def test_tokenmill_scheduler_runs_the_jobs_and_stops_on_sigterm(
    billing: Billing, tmp_path: Path
) -> None:
    b = billing
    tenant_id, sku_id, key_id = await catalogue(b)
    now = datetime.now(UTC)
    await b.usage(
        finished("now", now, started=now - timedelta(seconds=10), completion=3876, tenant_id=tenant_id, sku_id=sku_id, key_id=key_id)
    )  # fmt: skip
    await b.http.get("/invoices", params={"consistent": "true"})
    proc = await asyncio.create_subprocess_exec(
        *TOKENMILL, "scheduler", env=environment(b, tmp_path), stderr=asyncio.subprocess.PIPE
    )
    try:
        deadline = asyncio.get_running_loop().time() + 30
        while not (await b.http.get("/capacity")).json()["items"]:  # the capacity job ran
            assert proc.returncode is None and asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    assert "is the leader" in err.decode()


def test_commands_that_read_state_refuse_to_start_empty_servers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenmill.cli import main

    for name in ("TOKENMILL_DATABASE_URL", "TOKENMILL_NATS_URL", "TOKENMILL_DATA_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    for argv in (
        ["invoices", "list"],
        ["invoices", "showback", "--from", "2026-01-01", "--to", "2026-02-01"],
        ["reconcile"],
        ["scheduler"],
        ["projections", "rebuild"],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "no tokenmill state" in err and "--data-dir" in err, err
        assert "TOKENMILL_DATABASE_URL" in err
        assert not (tmp_path / ".tokenmill").exists(), argv  # nothing was started or created
    elsewhere = tmp_path / "empty"
    assert main(["--data-dir", str(elsewhere), "invoices", "list"]) == 2
    assert str(elsewhere) in capsys.readouterr().err and not elsewhere.exists()


def _actions(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.Action]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, child in action.choices.items():
                yield f"{path} {name}", argparse.Action([name], name, help=helps.get(name))
                yield from _actions(child, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def test_every_option_and_command_has_help() -> None:
    from pricing.cli import _capacity_parser, _invoices_parser, _scheduler_parser
    from tokenmill.cli import build_parser

    missing = [
        f"{path}: {action.option_strings or action.dest}"
        for parser, path in (
            (build_parser(), "tokenmill"),
            (_invoices_parser(), "tokenmill invoices"),
            (_capacity_parser(), "tokenmill capacity"),
            (_scheduler_parser(), "tokenmill scheduler"),
        )
        for path, action in _actions(parser, path)
        if not action.help
    ]
    assert missing == []
