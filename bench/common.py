"""What the bench scripts share: result naming and writing, percentiles and medians, GPU timing,
tables, and which commit and GPU a result came from.

Results are named `<date>-<gpu>-<short sha>-<bench>.json` (e.g.
2026-12-01-h200-35cc97c-gpu_suite.json), in bench/results or the folder a run is given ($OUT
on the GPU machine). torch and triton are imported only by the GPU helpers, so the CPU benches
import this module without them.
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import os
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
GIB = 1024**3


# --- which commit, which GPU, what the result is called --------------------------------------


def git_sha() -> str:
    """The short sha of the tree being measured: $TOKENMILL_GIT_SHA where the tree was copied
    without its git folder (the GPU machine), else git's, else 'nosha'."""
    if sha := os.environ.get("TOKENMILL_GIT_SHA"):
        return sha[:7]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=7", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "nosha"
    return out.stdout.strip() or "nosha"


def gpu_name() -> str:
    """The device's name as torch reports it ('NVIDIA H200'), or 'cpu'."""
    try:
        import torch
    except ImportError:
        return "cpu"
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def gpu_tag(name: str | None = None) -> str:
    """The GPU part of a result's name: 'NVIDIA H200' -> 'h200', 'cpu' -> 'cpu'."""
    name = (name or gpu_name()).lower().removeprefix("nvidia").strip()
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "cpu"


def result_name(bench: str, gpu: str | None = None) -> str:
    """`<date>-<gpu>-<short sha>-<bench>.json`, the date in UTC."""
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    return f"{date}-{gpu_tag(gpu)}-{git_sha()}-{bench}.json"


def result_path(bench: str, folder: str | Path | None = None, gpu: str | None = None) -> Path:
    """Where a result goes: `folder`, else $OUT, else bench/results."""
    return Path(folder or os.environ.get("OUT") or RESULTS) / result_name(bench, gpu)


def out_path(bench: str, out: str | Path | None) -> Path:
    """A bench's --out: a JSON file, or a folder for the dated name (none: `result_path`'s)."""
    path = Path(out) if out else result_path(bench)
    return result_path(bench, path) if path.is_dir() else path


def write_result(path: Path, result: Any, indent: int = 2) -> Path:
    """The result as JSON (values JSON lacks, e.g. paths, as strings), folders made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=indent, default=str) + "\n")
    return path


# --- statistics --------------------------------------------------------------------------------


def percentile(values: Iterable[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def median(values: Iterable[float], scale: float = 1.0) -> float | None:
    """The median over repeats (times `scale`, e.g. 1e3 for s -> ms), None when nothing was
    measured."""
    values = list(values)
    return scale * statistics.median(values) if values else None


def err(exc: BaseException) -> str:
    """An exception as a result field records it (a failed case is recorded, the rest run)."""
    return f"{type(exc).__name__}: {exc}"[:400]


# --- tables ------------------------------------------------------------------------------------


def print_table(
    columns: Sequence[str], rows: Iterable[Sequence[Any]], widths: Sequence[int], fmt: str = ".2f"
) -> None:
    """A left-aligned label column, then right-aligned ones, each as wide as `widths` says;
    floats as `fmt`, anything else as str (format a cell beforehand to show it otherwise)."""

    def line(cells: Sequence[Any]) -> str:
        label, *rest = cells  # as many cells as widths
        text = [format(v, fmt) if isinstance(v, float) else str(v) for v in rest]
        return f"{label:{widths[0]}}" + "".join(
            f"{t:>{w}}" for t, w in zip(text, widths[1:], strict=True)
        )

    print(line(columns))
    for row in rows:
        print(line(row))


# --- GPU timing --------------------------------------------------------------------------------


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_gpu() -> None:
    """Drop what the last section left, so the next one has the GPU's memory."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def cuda_time(fn: Callable[[], Any], iters: int, warmup: int = 1) -> float:
    """Mean seconds per call on the GPU (events), after warm-up calls; wall time on the CPU."""
    import torch

    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / 1e3 / iters


def graph_time(
    fn: Callable[[int], Any], copies: int, replays: int = 10, median_replay: bool = False
) -> float:
    """Seconds per call: one CUDA graph of `copies` calls (each on its own weight copy, so the
    set is larger than L2) replayed `replays` times; the mean replay, or the median one."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):
            fn(i)  # compile and allocate outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    if not median_replay:
        return cuda_time(graph.replay, iters=replays, warmup=1) / copies
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3 / copies)
    del graph
    return sorted(times)[len(times) // 2]


def copy_bandwidth(warmup: int = 10, rep: int = 100) -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + written), the roofline's bandwidth."""
    import torch
    import triton

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(
        lambda: dst.copy_(src), warmup=warmup, rep=rep, return_mode="median"
    )
    return 2 * src.numel() / (float(ms) * 1e-3)


def rel_err(out: Any, ref: Any) -> float:
    """Relative L2 error of `out` against the reference, in float64; inf where `out` is not
    finite."""
    import torch

    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return math.inf
    return float(((out - ref).norm() / ref.norm().clamp_min(1e-30)).item())
