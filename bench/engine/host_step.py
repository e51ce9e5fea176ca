"""The host time a decode step spends deciding, on any machine (no GPU): staged KV's restage
decision (`BlockManager.restage`, run before every schedule) and the staging of the padded
decode inputs (`DecodeInputs.fill`, every row's block table), at C sequences of L tokens each
(16-token pages, window 8 + anchor 1, every aged-out page already compressed, so a step finds
nothing to move: the steady state of a long decode). With overlapped decode this time hides
behind the GPU's step while it is shorter.

    PYTHONPATH=. python3 -m bench.engine.host_step [--points 8x768,32x32768,64x32768]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.common import median, print_table, result_path, write_result
from worker.engine.block_manager import BlockManager
from worker.engine.config import DEFAULT_STEP_TOKENS
from worker.engine.runner import DecodeInputs
from worker.engine.scheduler import ScheduledBatch, ScheduledSeq
from worker.engine.sequence import SamplingParams, Sequence

BLOCK_SIZE = 16
CHUNK = DEFAULT_STEP_TOKENS  # tokens a prefill step writes


def staged_sequences(rows: int, tokens: int) -> tuple[BlockManager, list[Sequence]]:
    """`rows` sequences of `tokens` tokens prefilled in chunks, restaged after each chunk."""
    pages = -(-tokens // BLOCK_SIZE)
    bm = BlockManager(
        rows * (CHUNK // BLOCK_SIZE + 16), BLOCK_SIZE, num_compressed_blocks=rows * pages
    )
    seqs = [Sequence(i, f"r{i}", list(range(1, tokens + 1)), SamplingParams()) for i in range(rows)]
    step, written = 1, 0
    while written < tokens:
        end = min(tokens, written + CHUNK)
        for s in seqs:
            bm.grow(s, end)
            bm.record_write(s, written, end, step)
        written, step = end, step + 1
        bm.restage(seqs, step)
    for i, s in enumerate(seqs):
        s.state_slot = i
    return bm, seqs


def median_ms(fn: Callable[[], Any], calls: int, repeats: int) -> float:
    """The median over `repeats` of the mean time of `calls` calls, in ms."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return median(times, 1e3) or 0.0


def point(rows: int, tokens: int, repeats: int) -> dict[str, Any]:
    bm, seqs = staged_sequences(rows, tokens)
    step = 10_000
    restage_ms = median_ms(lambda: bm.restage(seqs, step), 20, repeats)
    inputs = DecodeInputs(
        rows,
        -(-tokens // BLOCK_SIZE) + 1,
        BLOCK_SIZE,
        scratch_block=0,
        scratch_slot=rows,
        device=torch.device("cpu"),
    )
    batch = ScheduledBatch(step=step, decodes=[ScheduledSeq(s, tokens - 1, 1, True) for s in seqs])
    fill_ms = median_ms(lambda: inputs.fill(batch, rows), 20, repeats)
    compressed = sum(bm.is_compressed(b) for s in seqs for b in s.block_table)
    return {
        "rows": rows,
        "tokens": tokens,
        "pages": sum(len(s.block_table) for s in seqs),
        "compressed_pages": compressed,
        "restage_ms": restage_ms,
        "fill_ms": fill_ms,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--points", default="8x768,32x32768,64x32768", help="rows x tokens, ...")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", help="results folder (default $OUT, else bench/results)")
    args = p.parse_args(argv)
    points = []
    for spec in args.points.split(","):
        rows, tokens = (int(n) for n in spec.split("x"))
        points.append(point(rows, tokens, args.repeats))
    print_table(
        ("rows x tokens", "pages", "restage ms", "fill ms"),
        [
            (f"{r['rows']} x {r['tokens']}", r["pages"], r["restage_ms"], r["fill_ms"])
            for r in points
        ],
        (16, 10, 12, 10),
        fmt=".3f",
    )
    result = {"repeats": args.repeats, "points": points}
    print("wrote", write_result(result_path("host_step", args.out), result))
    return result


if __name__ == "__main__":
    main()
