"""`tokenmill up` as an operator runs it: a subprocess on embedded servers under a data dir."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from control_plane.embedded import free_port

TOKENMILL = [sys.executable, "-m", "tokenmill.cli"]


@contextlib.contextmanager
def tokenmill_up(data_dir: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Start `tokenmill up`, wait for /readyz, and on exit stop it with SIGTERM."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    proc = subprocess.Popen(
        [*TOKENMILL, "up", "--data-dir", str(data_dir), "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "tokenmill up exited early"
            assert time.monotonic() < deadline, "tokenmill up did not become ready"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        yield base, proc
    except BaseException:
        proc.kill()
        out = proc.communicate()[0].decode()
        print(out[-5000:])
        raise
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=90)


@pytest.mark.e2e
def test_up_serves_stops_cleanly_and_keeps_state(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    data = tmp_path / "tm"
    with tokenmill_up(data) as (base, proc):
        token = (data / "admin-token").read_text().strip()
        auth = {"Authorization": f"Bearer {token}"}
        r = httpx.post(f"{base}/admin/v1/tenants", json={"name": "kept"}, headers=auth)
        assert r.status_code == 201, r.text
        tenant_id = r.json()["tenant_id"]
    out = proc.communicate()[0].decode()
    assert proc.returncode == 0, out
    assert base in out and token in out
    # Nothing of ours is left: the embedded servers stopped with it.
    assert not (data / "runtime.json").exists()
    assert not (data / "pgdata" / "postmaster.pid").exists()

    with tokenmill_up(data) as (base, proc):
        r = httpx.get(
            f"{base}/admin/v1/tenants/{tenant_id}", params={"consistent": "true"}, headers=auth
        )
        assert r.status_code == 200 and r.json()["name"] == "kept"
    assert proc.wait() == 0
