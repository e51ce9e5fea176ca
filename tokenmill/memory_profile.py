"""An opt-in memory probe: `TOKENMILL_MEMORY_PROFILE=path` starts `tracemalloc` when a
`tokenmill` process starts and, every `TOKENMILL_MEMORY_PROFILE_EVERY_S`, appends to that
file the process's RSS, the traced total and the allocation sites that grew most since the
first snapshot and since the previous one (top `TOKENMILL_MEMORY_PROFILE_TOP`, grouped by
`TOKENMILL_MEMORY_PROFILE_FRAMES` frames of traceback), with glibc's heap counters: allocated
and freed-but-kept (what RSS holds that no live object explains). Off by default: tracing
slows every allocation and takes memory of its own (its snapshots raise the RSS they
report); it is for finding what grows (docs/deploy.md, the soak), not for production. With
`TOKENMILL_MEMORY_PROFILE_FRAMES=0` nothing is traced: only the RSS and heap line, at no
cost.

A daemon thread takes the snapshots, so it works under any event loop and in processes
that have none; a "{pid}" in the path is replaced by the process id (several processes, one
setting).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import time
import tracemalloc
from pathlib import Path

from tokenmill.settings import MemoryProfileSettings

KIB, MIB = 1024, 1024 * 1024  # as the soak's tables count

# What the probe itself allocates, and import machinery, are not the process's growth.
_IGNORED = (tracemalloc.__file__, __file__, "<frozen importlib._bootstrap>", "<unknown>")


def rss_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 elsewhere)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    return 0


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def malloc_stats() -> dict[str, int]:
    """glibc's heap (mallinfo2, glibc 2.33+; empty elsewhere): `malloc_used` is what the
    process's C heap holds allocated (Python's arenas, C extensions), `malloc_free` what it
    has freed but kept (fragmentation: RSS that no live object explains), `malloc_mmap`
    the large blocks mapped apart."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):
        return {}
    fn.restype = _MallInfo2
    info = fn()
    return {
        "malloc_used": info.uordblks,
        "malloc_free": info.fordblks,
        "malloc_mmap": info.hblkhd,
    }


def _short(filename: str) -> str:
    """A frame's file without the interpreter's or the checkout's prefix."""
    for marker in ("/site-packages/", f"/python{sys.version_info[0]}.{sys.version_info[1]}/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename.removeprefix(os.getcwd() + os.sep)


class MemoryProbe:
    """Snapshots every `every_s` seconds (the first one `every_s` after start), each written
    as one block: a header line, then the top sites since the first snapshot and since the
    previous one."""

    def __init__(self, path: Path, every_s: float, top: int, frames: int) -> None:
        self.path = path
        self.every_s = every_s
        self.top = top
        self.frames = max(0, frames)  # 0: no tracing, the header line only
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._first: tracemalloc.Snapshot | None = None
        self._previous: tracemalloc.Snapshot | None = None
        self._started = 0.0
        self.snapshots = 0
        self._traces = False  # whether this probe started tracemalloc (and stops it)

    def start(self) -> MemoryProbe:
        self._traces = bool(self.frames) and not tracemalloc.is_tracing()
        if self._traces:
            tracemalloc.start(self.frames)
        self._started = time.monotonic()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(
                f"# tokenmill memory profile pid {os.getpid()} every {self.every_s:g}s "
                f"top {self.top} frames {self.frames}\n"
            )
        self._thread = threading.Thread(target=self._run, name="memory-profile", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._traces:
            tracemalloc.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            with contextlib.suppress(Exception):  # a probe must never take the process down
                self.snapshot()

    def _take(self) -> tracemalloc.Snapshot:
        snap = tracemalloc.take_snapshot()
        return snap.filter_traces([tracemalloc.Filter(False, name) for name in _IGNORED])

    def snapshot(self) -> None:
        """Take one snapshot and append its block."""
        head = f"== t={time.monotonic() - self._started:.0f}s rss={rss_bytes() / MIB:.1f}MB "
        head += " ".join(f"{k}={v / MIB:.1f}MB" for k, v in malloc_stats().items())
        if not tracemalloc.is_tracing():
            with self.path.open("a") as f:
                f.write(f"{head} snapshot={self.snapshots}\n")
            self.snapshots += 1
            return
        snap = self._take()
        key = "traceback" if self.frames > 1 else "lineno"
        traced, peak = tracemalloc.get_traced_memory()
        lines = [
            f"{head} traced={traced / MIB:.1f}MB peak={peak / MIB:.1f}MB "
            f"tracemalloc={tracemalloc.get_tracemalloc_memory() / MIB:.1f}MB "
            f"snapshot={self.snapshots}"
        ]
        for title, base in (("since first", self._first), ("since previous", self._previous)):
            if base is None:
                continue
            stats = snap.compare_to(base, key)
            lines.append(f"-- {title}")
            for s in stats[: self.top]:
                # innermost frame first: where the memory was allocated, then its callers
                where = " <- ".join(
                    f"{_short(f.filename)}:{f.lineno}" for f in reversed(s.traceback)
                )
                lines.append(
                    f"{s.size_diff / KIB:+10.1f} kB {s.count_diff:+8d} blocks "
                    f"({s.size / KIB:.1f} kB now) {where}"
                )
        with self.path.open("a") as f:
            f.write("\n".join(lines) + "\n")
        if self._first is None:
            self._first = snap
        self._previous = snap
        self.snapshots += 1


def start_from_settings(settings: MemoryProfileSettings | None = None) -> MemoryProbe | None:
    """The probe the settings ask for, started; None when TOKENMILL_MEMORY_PROFILE is unset."""
    settings = settings or MemoryProfileSettings()
    if not settings.path:
        return None
    path = Path(settings.path.replace("{pid}", str(os.getpid())))
    return MemoryProbe(path, settings.every_s, settings.top, settings.frames).start()
