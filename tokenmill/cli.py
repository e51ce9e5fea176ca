"""The `tokenmill` command.

    tokenmill up [--data-dir .tokenmill] [--port 8080] [--host 127.0.0.1]
        embedded NATS + Postgres (unless TOKENMILL_NATS_URL / TOKENMILL_DATABASE_URL are set),
        streams and schema, projectors and the API in one process; Ctrl-C / SIGTERM stops it
    tokenmill serve      the API only (stateless; run several behind a load balancer)
    tokenmill project    the projectors only (one active per projection, others stand by)
    tokenmill projections rebuild [--only NAME]
        drop the read models and replay them from the streams (stop the projectors first)
    tokenmill projections dead-letters list [--all] [--json] | resolve ID [--retry]
        events a projection could not apply; resolve marks one done (--retry re-applies it)
    tokenmill invoices list|show|close|showback|rollups|report ...   billing (--help for more)
    tokenmill scheduler  the billing jobs only (one active across replicas; `up` runs them too)
    tokenmill capacity ...   capacity projection what-ifs (needs no servers; --help for more)

Every command finds NATS and Postgres the same way: the environment variables; else the
servers of a `tokenmill up` running on the same data dir; else it starts the embedded
servers itself, for as long as it runs. Commands that read state (invoices, scheduler,
reconcile, projections) start them only over a data dir that holds state: with none there
they stop and say what to pass (--data-dir, or the servers' URLs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import uvicorn

from control_plane.app import create_app, load_extensions
from control_plane.auth import resolve_admin_token
from control_plane.dataplane.server import http_protocol
from control_plane.embedded import EmbeddedNats, EmbeddedPostgres
from control_plane.services import Services
from events.projections import ProjectionLocked, Projector, all_projections, dead_letters
from pricing.cli import capacity_main, invoices_main, scheduler_main
from tokenmill.memory_profile import start_from_settings as start_memory_profile
from tokenmill.settings import Settings

log = logging.getLogger("tokenmill")

RUNTIME_FILE = "runtime.json"  # the servers of a running `tokenmill up`, for other commands


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def backends(settings: Settings) -> Iterator[Settings]:
    """`settings` with both server URLs set, starting embedded servers if needed."""
    if settings.nats_url and settings.database_url:
        yield settings
        return
    runtime = settings.data_dir / RUNTIME_FILE
    if runtime.exists():
        info = json.loads(runtime.read_text())
        if info.get("pid") != os.getpid() and _pid_alive(int(info.get("pid", 0))):
            yield settings.with_overrides(
                nats_url=settings.nats_url or info["nats_url"],
                database_url=settings.database_url or info["database_url"],
            )
            return
    started: list[EmbeddedNats | EmbeddedPostgres] = []
    try:
        nats_url, database_url = settings.nats_url, settings.database_url
        if not nats_url:
            n = EmbeddedNats(settings.data_dir / "nats").start()
            started.append(n)
            nats_url = n.url
        if not database_url:
            p = EmbeddedPostgres(settings.data_dir / "pgdata").start()
            started.append(p)
            database_url = p.url
        runtime.write_text(
            json.dumps({"pid": os.getpid(), "nats_url": nats_url, "database_url": database_url})
        )
        yield settings.with_overrides(nats_url=nats_url, database_url=database_url)
    finally:
        with contextlib.suppress(FileNotFoundError):
            if json.loads(runtime.read_text()).get("pid") == os.getpid():
                runtime.unlink()
        for server in reversed(started):
            server.stop()


class _Stop:
    """SIGINT/SIGTERM end the command gracefully (uvicorn re-raises the signal it caught
    after shutting down; this handler absorbs it, so cleanup still runs)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.server: uvicorn.Server | None = None

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, *_: object) -> None:
        if self.server is not None:
            self.server.should_exit = True
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().call_soon_threadsafe(self.event.set)


async def _serve(settings: Settings, admin_token: str, *, projectors: bool, up: bool) -> None:
    stop = _Stop()
    stop.install()
    services = await Services.connect(settings, admin_token)
    try:
        extensions = load_extensions(services)
        app = create_app(services, extensions=extensions, run_projectors=projectors)
        plane = services.extra.get("dataplane")
        config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level="warning",
            lifespan="on",
            # Input limits; on the fast path the /v1 completion routes skip Litestar's routing.
            http=http_protocol(app, plane.completion_handlers()) if plane is not None else "auto",
        )
        server = stop.server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve())
        while not server.started and not serving.done() and not stop.event.is_set():  # noqa: ASYNC110 (uvicorn offers a flag only)
            await asyncio.sleep(0.02)
        if serving.done():
            serving.result()
            raise SystemExit(f"the API did not start on {settings.host}:{settings.port}")
        url = f"http://{settings.host}:{settings.port}"
        print(
            f"tokenmill {'is up' if up else 'serves'} at {url}  (OpenAPI: {url}/schema/openapi.json)",
            flush=True,
        )
        if up:
            print(f"  admin token: {admin_token}", flush=True)
            print(f"  data dir:    {settings.data_dir.resolve()}", flush=True)
        async with AsyncExitStack() as stack:
            if up:
                for ext in extensions:
                    for hook in ext.up_hooks:
                        await stack.enter_async_context(hook(services))
            await serving
    finally:
        await services.close()


async def _project(settings: Settings) -> None:
    stop = _Stop()
    stop.install()
    services = await Services.connect(settings, admin_token="")
    try:
        async with services.running_projectors():
            print(
                "tokenmill projectors running: " + ", ".join(p.name for p in all_projections()),
                flush=True,
            )
            await stop.event.wait()
    finally:
        await services.close()


async def _rebuild(settings: Settings, only: str | None) -> None:
    services = await Services.connect(settings, admin_token="")
    try:
        for projection in all_projections():
            if only and projection.name != only:
                continue
            stream = projection.stream(services.layout)
            head = await services.store.head(stream)
            projector = Projector(services.nc, services.database_url, services.layout, projection)
            await projector.run(until_seq=head, reset=True, standby=False)
            print(f"rebuilt {projection.name}: replayed {stream} up to seq {head}", flush=True)
    finally:
        await services.close()


# Commands that read what a running or stopped `tokenmill up` recorded: over a data dir with no
# state, starting empty embedded servers would only answer "nothing" (and litter the cwd).
STATE_COMMANDS = frozenset({"invoices", "scheduler", "reconcile", "projections"})


def _missing_state(settings: Settings) -> str | None:
    """Why `backends` would have to start empty servers for a command that reads state, or
    None when it finds them (URLs, a running `tokenmill up`, or an existing data dir)."""
    if settings.nats_url and settings.database_url:
        return None
    runtime = settings.data_dir / RUNTIME_FILE
    if runtime.exists():
        with contextlib.suppress(ValueError, OSError):
            if _pid_alive(int(json.loads(runtime.read_text()).get("pid", 0))):
                return None
    missing = [
        what
        for what, url, path in (
            ("PostgreSQL", settings.database_url, settings.data_dir / "pgdata" / "PG_VERSION"),
            ("NATS", settings.nats_url, settings.data_dir / "nats"),
        )
        if not url and not path.exists()
    ]
    if not missing:
        return None
    return (
        f"no tokenmill state in {settings.data_dir.resolve()} (no {' or '.join(missing)} data, "
        "no running `tokenmill up`); pass --data-dir DIR of a `tokenmill up`, or set "
        "TOKENMILL_DATABASE_URL and TOKENMILL_NATS_URL to the running instance's servers"
    )


# Billing's commands parse their own arguments (pricing.cli); they get the servers' URLs.
BILLING_COMMANDS = {
    "invoices": "invoices, showback CSV, rollups and the reconciliation report",
    "scheduler": "run the billing jobs (one active instance across replicas)",
    "capacity": "capacity projections: GPU-hours per 1M tokens, tokens per month, margin",
}


# The data plane's commands parse their own arguments (pricing.reconcile, worker.serve).
DATAPLANE_COMMANDS = {
    "reconcile": "compare the usage ledger with the gateway's deliveries, request by request",
    "worker": "serve one SKU from a worker backend (torch_runtime, openai_proxy, fixed_rate); "
    "--gpu N: on GPU N alone (one worker process per GPU)",
}


def _dataplane(command: str, argv: list[str], settings: Settings) -> int:
    if command == "reconcile":
        from pricing.reconcile import main as reconcile_main

        return reconcile_main(["--database-url", str(settings.database_url), *argv])
    from worker.serve import main as worker_main

    return worker_main(
        ["--nats-url", str(settings.nats_url), "--prefix", settings.stream_prefix, *argv]
    )


async def _scheduler(argv: list[str]) -> int:
    stop = _Stop()
    stop.install()
    return await scheduler_main(argv, stop.event)


def _billing(command: str, argv: list[str], settings: Settings) -> int:
    if command == "capacity":
        return capacity_main(argv)
    if "-h" not in argv and "--help" not in argv:
        assert settings.database_url and settings.nats_url
        argv = [
            *("--database-url", settings.database_url, "--nats-url", settings.nats_url),
            *("--prefix", settings.stream_prefix),
            *argv,
        ]
    if command == "scheduler":
        return asyncio.run(_scheduler(argv))
    return asyncio.run(invoices_main(argv))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenmill", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        help="state of the embedded servers, admin token (default ./.tokenmill)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, summary in (
        ("up", "embedded servers (unless configured), projectors, the API, the billing jobs"),
        ("serve", "the API only (stateless; run several behind a load balancer)"),
    ):
        p = sub.add_parser(name, help=summary)
        p.add_argument("--data-dir", type=Path, dest="sub_data_dir", help=argparse.SUPPRESS)
        p.add_argument("--port", type=int, help="port to listen on (TOKENMILL_PORT, 8080)")
        p.add_argument("--host", help="address to listen on (TOKENMILL_HOST, 127.0.0.1)")
    p = sub.add_parser("project", help="the projectors only (one active per projection)")
    p.add_argument("--data-dir", type=Path, dest="sub_data_dir", help=argparse.SUPPRESS)
    projections = sub.add_parser(
        "projections", help="read-model maintenance: rebuild, dead letters"
    ).add_subparsers(dest="action", required=True)
    p = projections.add_parser("rebuild", help="drop the read models and replay the streams")
    p.add_argument("--data-dir", type=Path, dest="sub_data_dir", help=argparse.SUPPRESS)
    p.add_argument(
        "--only",
        choices=[x.name for x in all_projections()],
        help="rebuild only this projection",
    )
    p = projections.add_parser("dead-letters", help="events a projection could not apply")
    p.add_argument("--data-dir", type=Path, dest="sub_data_dir", help=argparse.SUPPRESS)
    dead_letters.add_arguments(p)
    sub.add_parser("quantize", help="write an int4 checkpoint (no servers)", add_help=False)
    for name, summary in {**BILLING_COMMANDS, **DATAPLANE_COMMANDS}.items():
        p = sub.add_parser(name, help=summary, add_help=False)
        p.add_argument("--data-dir", type=Path, dest="sub_data_dir", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, billing_argv = parser.parse_known_args(argv)
    if args.command == "quantize":  # parses its own arguments; needs no servers
        from worker.quantize.cli import main as quantize_main

        return quantize_main(billing_argv)
    if billing_argv and args.command not in BILLING_COMMANDS | DATAPLANE_COMMANDS:
        parser.error(f"unrecognized arguments: {' '.join(billing_argv)}")

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    start_memory_profile()  # TOKENMILL_MEMORY_PROFILE: off unless set
    settings = Settings()
    data_dir = getattr(args, "sub_data_dir", None) or args.data_dir
    if data_dir:
        settings = settings.with_overrides(data_dir=data_dir)
    if getattr(args, "port", None):
        settings = settings.with_overrides(port=args.port)
    if getattr(args, "host", None):
        settings = settings.with_overrides(host=args.host)
    if args.command in DATAPLANE_COMMANDS and {"-h", "--help"} & set(billing_argv):
        return _dataplane(args.command, billing_argv, settings)  # no servers needed
    if args.command == "capacity" or {"-h", "--help"} & set(billing_argv):
        return _billing(args.command, billing_argv, settings)  # no servers needed
    if args.command in STATE_COMMANDS and (why := _missing_state(settings)):
        print(f"tokenmill {args.command}: {why}", file=sys.stderr)
        return 2
    settings.data_dir.mkdir(parents=True, exist_ok=True)

    with backends(settings) as settings:
        if args.command in BILLING_COMMANDS:
            return _billing(args.command, billing_argv, settings)
        if args.command in DATAPLANE_COMMANDS:
            return _dataplane(args.command, billing_argv, settings)
        if args.command in ("up", "serve"):
            token, generated = resolve_admin_token(settings)
            if generated and args.command == "serve":
                print(
                    f"generated admin token (kept in {settings.data_dir / 'admin-token'}): {token}",
                    flush=True,
                )
            asyncio.run(
                _serve(settings, token, projectors=args.command == "up", up=args.command == "up")
            )
        elif args.command == "project":
            asyncio.run(_project(settings))
        elif args.action == "dead-letters":
            return dead_letters.command(str(settings.database_url), args)
        else:
            try:
                asyncio.run(_rebuild(settings, args.only))
            except ProjectionLocked as e:
                print(
                    f"tokenmill: {e}; stop the running projectors (tokenmill up / project) first",
                    file=sys.stderr,
                )
                return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
