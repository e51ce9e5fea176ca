"""Test tiers, and the real servers the tests share.

Every test belongs to one tier, given by the fixtures it uses (directly or through other
fixtures) unless it is marked with a tier explicitly:

- `unit`: no server; pure functions, models, kernels on CPU.
- `integration`: the real embedded NATS (JetStream) and/or PostgreSQL (`nats_server`,
  `postgres_server`), one of each per test session on a free port. Never mocked.
- `e2e`: the product as it is deployed: a running stack with worker processes (`stack`),
  the browser (`page`, `browser`), or a `tokenmill` server started as a subprocess.

`pytest -m unit` (or `integration`, `e2e`) runs one tier. `--tiers`, which `python3 dev.py
test` passes, runs them in that order with a header per tier and stops after the first tier
that fails, so a failure says which tier it is in.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS

from control_plane.embedded import EmbeddedNats, EmbeddedPostgres
from tests.databases import fresh_database

TIERS = ("unit", "integration", "e2e")
# A test that needs any of these fixtures is in that tier (the first match wins).
TIER_FIXTURES = (
    ("e2e", frozenset({"stack", "page", "browser"})),
    ("integration", frozenset({"nats_server", "postgres_server"})),
)
_TIER = pytest.StashKey[str]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--tiers",
        action="store_true",
        help="run the unit, integration and e2e tiers in that order; stop after a failing tier",
    )


def tier_of(item: pytest.Item) -> str:
    for mark in item.iter_markers():  # the closest explicit tier marker wins
        if mark.name in TIERS:
            return mark.name
    fixtures = set(getattr(item, "fixturenames", ()))  # the closure: fixtures of fixtures too
    for tier, names in TIER_FIXTURES:
        if fixtures & names:
            return tier
    return "unit"


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the markers added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = item.stash[_TIER] = tier_of(item)
        item.add_marker(tier)


class _TierRun:
    """What `--tiers` reports: a header as each tier starts, its counts and time at the end."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.current: str | None = None
        self.outcomes: dict[str, Counter[str]] = {tier: Counter() for tier in TIERS}
        self.seconds: Counter[str] = Counter()
        self.tier_by_nodeid: dict[str, str] = {}

    @pytest.hookimpl(trylast=True)  # after pytest groups items by their parametrized fixtures
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        items.sort(key=lambda item: TIERS.index(item.stash[_TIER]))  # stable: order within
        self.tier_by_nodeid = {item.nodeid: item.stash[_TIER] for item in items}
        self.counts = Counter(self.tier_by_nodeid.values())

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> Generator[None, object, object]:
        tier = item.stash[_TIER]
        if tier != self.current:
            self.current = tier
            reporter = self.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                if reporter._tw.width_of_current_line:  # after -q's dots
                    reporter._tw.line()
                reporter.ensure_newline()
                reporter.write_sep("-", f"{tier} tests ({self.counts[tier]})", bold=True)
                reporter.currentfspath = None  # name the file again under the header
        began = time.monotonic()
        try:
            return (yield)
        finally:
            self.seconds[tier] += time.monotonic() - began
            ends_tier = nextitem is None or nextitem.stash[_TIER] != tier
            failed = self.outcomes[tier]["failed"] + self.outcomes[tier]["error"]
            if ends_tier and failed and nextitem is not None:
                item.session.shouldfail = f"{tier} tests failed; later tiers not run"

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        tier = self.tier_by_nodeid.get(report.nodeid)
        if tier is None:
            return
        if report.failed:
            self.outcomes[tier]["failed" if report.when == "call" else "error"] += 1
        elif report.when == "call" or (report.skipped and report.when == "setup"):
            self.outcomes[tier][report.outcome] += 1

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.config.option.collectonly or not any(self.outcomes.values()):
            return
        terminalreporter.write_sep("=", "tiers")
        for tier in TIERS:
            if not self.counts[tier]:
                continue
            outcomes = self.outcomes[tier]
            ran = ", ".join(f"{n} {what}" for what, n in sorted(outcomes.items()))
            line = (
                f"{tier:<12} {ran} in {self.seconds[tier]:.1f}s" if ran else f"{tier:<12} not run"
            )
            terminalreporter.write_line(line, red=bool(outcomes["failed"] + outcomes["error"]))


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("tiers"):
        config.pluginmanager.register(_TierRun(config), "tokenmill-tiers")


@pytest.fixture(scope="session")
def servers_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="tokenmill-test-"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def nats_server(servers_root: Path) -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(servers_root / "nats").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres_server(servers_root: Path) -> Iterator[EmbeddedPostgres]:
    server = EmbeddedPostgres(servers_root / "pgdata").start()
    yield server
    server.stop()


@pytest.fixture()
async def nc(nats_server: EmbeddedNats) -> AsyncIterator[NATS]:
    """A connection to the session's NATS, per test."""
    conn = await nats.connect(nats_server.url)
    yield conn
    await conn.close()


@pytest.fixture()
def stream_prefix() -> str:
    """A fresh stream-name prefix per test, so tests share one NATS without seeing each other."""
    return "T" + uuid.uuid4().hex[:10].upper()


@pytest.fixture()
def database_url(postgres_server: EmbeddedPostgres) -> Iterator[str]:
    """A fresh database per test on the shared server."""
    with fresh_database(postgres_server, "t_") as url:
        yield url
