#!/usr/bin/env python3
"""Bootstrap and run tokenmill from a fresh clone with nothing but Python 3.11+.

    python3 dev.py up [tokenmill up flags]   # embedded NATS + Postgres + API + demo worker
    python3 dev.py test [pytest args]        # ruff, mypy, pytest (slow/GPU tests skipped)

Each command creates `.venv` and installs the project into it on first use; later runs
reuse it (re-installing only when pyproject.toml changed). `--no-venv` right after the
command uses the running interpreter instead, which must have the project's extras.

`test` runs pytest's tiers in order, unit -> integration -> e2e (see tests/conftest.py),
with a header per tier, and stops after the first tier that fails; pytest args select
within the tiers (`python3 dev.py test tests/worker -k decode`).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / "python"
STAMP = VENV / ".tokenmill-installed"
# torch 2.13 is what the test environment pins: a local CPU build is preferred where the
# machine's pip find-links offers one (its "+cpu" local version sorts first).
TORCH_PIN = "torch==2.13.*"


def _run(cmd: list[str], **kw: object) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, **kw)  # type: ignore[call-overload]


def ensure_env(extras: str) -> None:
    """Install the project with `extras` unless the same pyproject already went in with them
    (or with more: `test` installs a superset of what `up` needs)."""
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if STAMP.exists():
        done_digest, _, done_extras = STAMP.read_text().partition(" ")
        if done_digest == digest and set(extras.split(",")) <= set(done_extras.split(",")):
            return
    if not PY.exists():
        _run([sys.executable, "-m", "venv", str(VENV)])
        _run([str(PY), "-m", "pip", "install", "-q", "-U", "pip"])
    _run([str(PY), "-m", "pip", "install", "-q", TORCH_PIN])
    _run([str(PY), "-m", "pip", "install", "-q", "-e", f".[{extras}]"])
    STAMP.write_text(f"{digest} {extras}")


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in {"up", "test"}:
        print(__doc__)
        return 2
    cmd, rest = sys.argv[1], sys.argv[2:]
    use_venv = rest[:1] != ["--no-venv"]
    if not use_venv:
        rest = rest[1:]
    py, bin_dir = (PY, BIN) if use_venv else (Path(sys.executable), Path(sys.executable).parent)
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    if cmd == "up":
        if use_venv:
            ensure_env("worker")
        os.execve(str(bin_dir / "tokenmill"), ["tokenmill", "up", *rest], env)
    if use_venv:
        ensure_env("worker,dev")
    pkgs = ["tokenmill", "control_plane", "events", "worker", "pricing", "tests", "bench"]
    steps = [
        [str(py), "-m", "ruff", "check", *pkgs, "dev.py"],
        [str(py), "-m", "ruff", "format", "--check", *pkgs, "dev.py"],
        [str(py), "-m", "mypy"],
        [str(bin_dir / "lint-imports")],
        # One process for all tiers: each extra one would collect the suite and start the
        # embedded servers again.
        [str(py), "-m", "pytest", "--tiers", "--durations=15", *rest],
    ]
    for step in steps:
        print("+", " ".join(step), flush=True)
        rc = subprocess.run(step, cwd=ROOT, env=env).returncode
        if rc != 0:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
