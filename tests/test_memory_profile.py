"""The opt-in memory probe (tokenmill/memory_profile.py): off unless asked, names the line
whose allocations grew, and is wired into every `tokenmill` process's start."""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

from tokenmill.memory_profile import MemoryProbe, start_from_settings
from tokenmill.settings import MemoryProfileSettings

KEPT: list[bytes] = []


def grow(n: int) -> None:
    KEPT.extend(bytes(1000) + str(i).encode() for i in range(n))  # the line that grows


def test_off_unless_a_path_is_set() -> None:
    assert start_from_settings(MemoryProfileSettings(path=None)) is None
    assert not tracemalloc.is_tracing()


def test_names_the_line_that_grew_and_stops_tracing(tmp_path: Path) -> None:
    path = tmp_path / "{pid}.txt"
    settings = MemoryProfileSettings(path=str(path), every_s=3600, top=5, frames=1)
    probe = start_from_settings(settings)
    assert probe is not None and tracemalloc.is_tracing()
    try:
        probe.snapshot()
        grow(2000)
        probe.snapshot()
    finally:
        probe.stop()
        KEPT.clear()
    assert not tracemalloc.is_tracing()
    text = (tmp_path / f"{os.getpid()}.txt").read_text()
    first_block = text.split("-- since first\n")[1].split("-- since previous")[0]
    top = first_block.splitlines()[0]
    line = grow.__code__.co_firstlineno + 1
    assert f"test_memory_profile.py:{line}" in top, text
    assert float(top.split()[0]) > 1900  # KiB: 2,000 blocks of 1,000 bytes and more
    assert "rss=" in text and "traced=" in text


def test_frames_zero_traces_nothing(tmp_path: Path) -> None:
    probe = MemoryProbe(tmp_path / "m.txt", every_s=3600, top=5, frames=0).start()
    probe.snapshot()
    probe.stop()
    assert not tracemalloc.is_tracing()
    (header, line) = (tmp_path / "m.txt").read_text().splitlines()
    assert line.startswith("== t=") and "rss=" in line and "since" not in line


def test_every_tokenmill_process_starts_it(tmp_path: Path) -> None:
    """The command starts the probe before it dispatches (here a command needing no servers)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    env["TOKENMILL_MEMORY_PROFILE"] = str(tmp_path / "p-{pid}.txt")
    out = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "capacity", "--help"],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    (written,) = tmp_path.glob("p-*.txt")
    assert written.read_text().startswith("# tokenmill memory profile pid ")
