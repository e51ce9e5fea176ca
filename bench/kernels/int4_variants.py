"""Int4 decode GEMV variants against today's kernel, FP8 and the copy roofline, in one run.

    python3 bench/kernels/int4_variants.py --budget-s 420            # one CUDA GPU, < 7 minutes
    TRITON_INTERPRET=1 python3 bench/kernels/int4_variants.py --smoke   # CPU: tiny shapes, checks only

For each Qwen3.6-27B decode weight shape (bench/int4_kernels.py's SHAPES, group 128, symmetric)
and M in (8, 1, 16, 2, 4) rows (in that order):
- "today": `int4_gemm.int4_gemv` (checkpoint layout, its INT4_DECODE_TILINGS entry);
- "planes-<mode>/...": `int4_gemv.int4_plane_gemv` in each mode (dot, pairs, pairs-xa, halves,
  halves-biased, fma) on the weight repacked by `pack_planes` (plane or pair layout), at its
  default tiling and, for halves, halves-biased and pairs, a few more; the FMA form only up to
  4 rows;
- "fp8/engine" (`fp8_gemm.w8_gemv` with the tiling the engine picks) and "fp8/run15" (the
  H200 sweep's winner), on an e4m3 weight of the same shape;
- "copy": a device copy moving the int4 GEMV's bytes (read + write), through the same timing.
Every variant is checked against `reference.int4_linear` (max and norm relative error; one
over the limit is recorded as wrong and not timed), then timed as CUDA-graph replays over
weight copies larger than L2 (median of `--replays`). One variant's failure is recorded and the
run goes on; shapes that the budget cannot cover are recorded as skipped. The table goes to
stdout, the JSON to bench/results/<date>-<gpu>-<sha>-int4_variants.json and, when $OUT is set,
to $OUT/ under the same name (rewritten after every shape, so a killed run keeps what it
measured).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402

from bench.common import RESULTS, graph_time, result_name  # noqa: E402
from bench.common import copy_bandwidth as common_copy_bandwidth  # noqa: E402
from bench.kernels.int4 import FP8_TILINGS, SHAPES, Budget, err  # noqa: E402
from worker.kernels import reference  # noqa: E402
from worker.kernels.triton import fp8_gemm  # noqa: E402
from worker.kernels.triton import int4_gemm as i4  # noqa: E402
from worker.kernels.triton import int4_gemv as planes  # noqa: E402
from worker.kernels.triton.int4_gemv import PlaneTiling  # noqa: E402

GROUP = 128
ROWS = (8, 1, 16, 2, 4)  # the load point first: what a budget cut loses matters least
L2_SET_BYTES = 192 << 20  # weight copies per graph: several times the 50 MB L2
MAX_REL = 2e-2  # elementwise, against the bf16 reference (norm-wise error is ~4e-3)
SMOKE_SHAPES = [("smoke a", 96, 512), ("smoke b", 64, 384)]


def log(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


def variants(n: int, k: int, m: int, sms: int) -> list[tuple[str, str, PlaneTiling | None]]:
    """(label, mode, tiling) of the plane GEMVs tried at this shape and row count."""
    steps = k // planes.PLANE_BLOCK

    def split(bn: int, blocks: int, per_sm: int) -> int:
        tiles = triton.cdiv(n, bn)
        return max(1, min(triton.cdiv(per_sm * sms, tiles), max(1, steps // blocks // 4)))

    # the fewest instructions per code first (bench/kernels/int4_sass.py): a budget cut drops the rest
    out: list[tuple[str, str, PlaneTiling | None]] = [
        ("planes-halves-biased/default", "halves-biased", None),
        ("planes-halves/default", "halves", None),
    ]
    tilings = (  # (bn, blocks per step, warps, stages, programs per SM)
        (64, 2, 2, 3, 4),  # two blocks (256 k) per step: more loads in flight
        (128, 1, 2, 3, 4),  # 256 codes per thread and step: 2.0 instructions per code
        (64, 1, 1, 3, 8),  # the same per thread on one warp
        (64, 1, 2, 4, 8),
        (128, 1, 4, 3, 8),  # 4 warps: wgmma, the codes from registers
        (32, 2, 2, 4, 4),
    )
    for mode, chosen in (
        ("halves-biased", tilings),
        ("halves", tilings),
        ("pairs", tilings[:2]),
    ):
        for bn, blocks, warps, stages, per_sm in chosen:
            t = PlaneTiling(bn, blocks, split(bn, blocks, per_sm), warps, stages)
            label = f"planes-{mode}/{bn}x{blocks * 128}w{warps}s{stages}"
            out.append((label, mode, t))
    for mode in ("pairs", "dot", "pairs-xa"):
        out.append((f"planes-{mode}/default", mode, None))
    if m <= 4:
        out.append(("planes-fma/default", "fma", None))
        for bn, warps in ((128, 4), (32, 4)):
            t = PlaneTiling(bn, 1, split(bn, 1, 4), warps, 3)
            out.append((f"planes-fma/{bn}x128w{warps}", "fma", t))
    return out


def rel_errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    out, ref = out.double(), ref.double()
    scale = ref.abs().max().clamp_min(1e-30)
    norm = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    return ((out - ref).abs().max() / scale).item(), norm


class Timer:
    """Seconds per call of fn(i), i cycling over `copies` weight copies: CUDA-graph replays on a
    GPU (median of `replays`), wall time under the interpreter (only to exercise the script)."""

    def __init__(self, cuda: bool, replays: int) -> None:
        self.cuda, self.replays = cuda, replays

    def __call__(self, fn: Callable[[int], Any], copies: int) -> float:
        if not self.cuda:
            began = time.perf_counter()
            for i in range(copies):
                fn(i)
            return (time.perf_counter() - began) / copies
        return graph_time(fn, copies, self.replays, median_replay=True)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s (read + written) of a 1 GiB device copy: the roofline every GB/s is compared with."""
    return common_copy_bandwidth() if device.type == "cuda" else float("nan")


def int4_bytes(m: int, n: int, k: int) -> int:
    """What the GEMV must move: the packed weight, its scales, x and out."""
    return n * k // 2 + n * triton.cdiv(k, GROUP) * 2 + 2 * m * k + 2 * m * n


def fp8_bytes(m: int, n: int, k: int) -> int:
    return n * k + 4 * n + 2 * m * k + 2 * m * n


def measure(
    label: str,
    call: Callable[[int, torch.Tensor], torch.Tensor],
    copies: int,
    x: torch.Tensor,
    ref: torch.Tensor | None,
    nbytes: int,
    timer: Timer,
    bandwidth: float,
) -> dict[str, Any]:
    """Check (when ref is given) then time one variant; never raises."""
    row: dict[str, Any] = {"variant": label}
    try:
        if ref is not None:
            out = call(copies - 1, x)
            max_rel, norm_rel = rel_errors(out, ref)
            row.update(max_rel=max_rel, norm_rel=norm_rel, ok=max_rel < MAX_REL)
            if not row["ok"]:
                return row
        outs: list[Any] = [None] * copies

        def timed(i: int) -> None:
            outs[i] = call(i, x)

        t = timer(timed, copies)
        row.update(us=t * 1e6, gb_s=nbytes / t / 1e9, of_copy=nbytes / t / bandwidth)
    except Exception as exc:
        row["error"] = err(exc)
        traceback.print_exc()
    return row


def shape_section(
    name: str, n: int, k: int, device: torch.device, timer: Timer, bandwidth: float,
    budget: Budget, share: float, rows: tuple[int, ...],
) -> dict[str, Any]:  # fmt: skip
    deadline = time.perf_counter() + share
    cuda = device.type == "cuda"
    copies = max(2, triton.cdiv(L2_SET_BYTES, n * k // 2)) if cuda else 1
    g = triton.cdiv(k, GROUP)
    gen = torch.Generator(device=device).manual_seed(n + k)
    codes = [
        torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device, generator=gen)
        for _ in range(copies)
    ]
    scales = [
        (torch.rand(n, g, device=device, generator=gen) * 0.004 + 0.001).half()
        for _ in range(copies)
    ]
    packed = {pairs: [planes.pack_planes(q, pairs) for q in codes] for pairs in (False, True)}
    result: dict[str, Any] = {"n": n, "k": k, "copies": copies, "by_m": {}}
    sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 4
    fp8_w: list[tuple[torch.Tensor, torch.Tensor]] = []
    if cuda:
        fp8_copies = max(2, triton.cdiv(L2_SET_BYTES, n * k))
        fp8_w = [
            (
                (torch.randn(n, k, device=device) * 100).clamp(-448, 448).to(torch.float8_e4m3fn),
                torch.rand(n, device=device) * 1e-4 + 1e-5,
            )
            for _ in range(fp8_copies)
        ]
    copy_src = torch.empty(copies, int4_bytes(1, n, k) // 2, dtype=torch.uint8, device=device)
    copy_dst = torch.empty_like(copy_src)
    for m in rows:
        if time.perf_counter() > deadline or budget.left() < 20:
            result["by_m"][m] = {"skipped": "budget"}
            continue
        x = torch.randn(m, k, device=device, generator=gen).bfloat16()
        ref = reference.int4_linear(x, codes[-1], scales[-1], None, GROUP)
        nbytes = int4_bytes(m, n, k)
        per_m: list[dict[str, Any]] = []

        def add(row: dict[str, Any], per_m: list[dict[str, Any]] = per_m, m: int = m) -> None:
            per_m.append(row)
            shown = row.get("us", row.get("error", row.get("max_rel")))
            log(f"  {name} M={m} {row['variant']}: {shown}")

        add(measure(
            "today", lambda i, x: i4.int4_gemv(x, codes[i], scales[i], None, GROUP),
            copies, x, ref, nbytes, timer, bandwidth,
        ))  # fmt: skip
        for label, mode, tiling in variants(n, k, m, sms):
            if time.perf_counter() > deadline or budget.left() < 15:
                per_m.append({"variant": label, "skipped": "budget"})
                continue

            def plane(i: int, x: torch.Tensor, mode: str = mode, t: Any = tiling) -> torch.Tensor:
                w = packed[mode not in ("dot", "fma")][i]
                return planes.int4_plane_gemv(x, w, scales[i], None, GROUP, None, mode, t)

            add(measure(label, plane, copies, x, ref, nbytes, timer, bandwidth))
        if cuda:
            for label, fp8_tiling in (
                ("fp8/engine", None),
                ("fp8/run15", FP8_TILINGS.get((n, k))),
            ):
                if label == "fp8/run15" and fp8_tiling is None:
                    continue

                def fp8(i: int, x: torch.Tensor, t: Any = fp8_tiling) -> torch.Tensor:
                    w, s = fp8_w[i]
                    return fp8_gemm.w8_gemv(x, w, s, None, t)

                add(measure(
                    label, fp8, len(fp8_w), x, None, fp8_bytes(m, n, k), timer, bandwidth
                ))  # fmt: skip

        def copy(i: int, x: torch.Tensor) -> torch.Tensor:
            return copy_dst[i].copy_(copy_src[i])

        add(measure("copy", copy, copies, x, None, nbytes, timer, bandwidth))
        result["by_m"][m] = add_speedups(per_m)
    return result


def add_speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {r["variant"]: r for r in rows if "us" in r}
    today = by.get("today", {}).get("us")
    fp8 = by.get("fp8/engine", {}).get("us")
    for r in rows:
        if "us" in r:
            r["vs_today"] = today / r["us"] if today else None
            r["vs_fp8"] = fp8 / r["us"] if fp8 else None
    return rows


def print_table(report: dict[str, Any]) -> None:
    head = f"{'variant':34} {'shape':28} {'M':>3} {'us':>9} {'GB/s':>8} {'%copy':>6}"
    print(head + f" {'x today':>8} {'x fp8':>7} {'max rel':>8}")
    for name, shape in report.get("shapes", {}).items():
        for m, rows in shape.get("by_m", {}).items():
            if not isinstance(rows, list):
                print(f"{'-':34} {name:28} {m:>3} {rows}")
                continue
            for r in rows:
                cells = f"{r['variant']:34} {name:28} {m:>3}"
                if "us" in r:
                    cells += f" {r['us']:9.2f} {r['gb_s']:8.1f} {100 * r['of_copy']:6.1f}"
                    vt, vf = r.get("vs_today"), r.get("vs_fp8")
                    cells += f" {vt:8.2f}" if vt else f" {'':8}"
                    cells += f" {vf:7.2f}" if vf else f" {'':7}"
                    if "max_rel" in r:
                        cells += f" {r['max_rel']:8.1e}"
                else:
                    cells += "  " + str(r.get("error") or r.get("skipped") or r)
                print(cells)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-s", type=float, default=420.0)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter)")
    parser.add_argument("--shapes", default="", help="comma-separated shape names (default all)")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/...)")
    args = parser.parse_args(argv)
    budget = Budget(args.budget_s)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        log("no CUDA: run with TRITON_INTERPRET=1 (and --smoke)")
    out = (
        Path(args.out)
        if args.out
        else RESULTS / result_name("int4_variants", None if device.type == "cuda" else "cpu")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "group_size": GROUP,
        "max_rel_limit": MAX_REL,
        "shapes": {},
    }

    # a device runner returns only what is under $OUT: a copy goes there too
    extra = Path(os.environ["OUT"]) / out.name if os.environ.get("OUT") else None

    def write() -> None:
        text = json.dumps(report, indent=2, default=str)
        out.write_text(text)
        if extra is not None:
            extra.parent.mkdir(parents=True, exist_ok=True)
            extra.write_text(text)

    bandwidth = copy_bandwidth(device)
    report["copy_gb_s"] = bandwidth / 1e9
    if not bandwidth == bandwidth:  # nan: no GPU
        bandwidth = 1.0
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    shapes = [s for s in shapes if not args.shapes or s[0] in args.shapes.split(",")]
    rows = tuple(int(r) for r in args.rows.split(","))
    if args.smoke:
        rows = tuple(r for r in rows if r <= 4)
    timer = Timer(device.type == "cuda", args.replays)
    for index, (name, n, k) in enumerate(shapes):
        log(f"== {name} {n} x {k} ({budget.left():.0f} s left)")
        if budget.left() < 25:
            report["shapes"][name] = {"n": n, "k": k, "skipped": "budget"}
            write()
            continue
        # the first shape compiles most kernels: it may take twice a later one's share
        left = len(shapes) - index
        share = (budget.left() - 5) * (2 if index == 0 else 1) / (left + (index == 0))
        began = time.perf_counter()
        try:
            report["shapes"][name] = shape_section(
                name, n, k, device, timer, bandwidth, budget, share, rows
            )
        except Exception as exc:
            traceback.print_exc()
            report["shapes"][name] = {"n": n, "k": k, "error": err(exc)}
        report["shapes"][name]["section_s"] = time.perf_counter() - began
        if device.type == "cuda":
            torch.cuda.empty_cache()
        write()
    report["total_s"] = args.budget_s - budget.left()
    write()
    print_table(report)
    log(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
