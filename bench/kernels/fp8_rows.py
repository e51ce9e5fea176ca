"""FP8 decode GEMMs at the batches of concurrency 17-64 (M = 32 and 64 rows): `scaled_mm`
(per-token e4m3 activations + cuBLAS, the engine's path from 17 rows) against `w8_gemv`
tilings, W8A8 (x quantized to e4m3 per K step, fp8 x fp8 dots: no widening of the weight) and
W8A16, at every Qwen3.6-27B decode shape, on one GPU. W8A8 rounds x per 128-wide K block inside
each program, or once per token before the launch (`x_per_token`, the per-token rounding that
scaled_mm does).

    python -m bench.kernels.fp8_rows --budget-s 90 [--write-tuning]

Each candidate is checked against the dequantized reference and timed as CUDA-graph replays over
weight copies larger than L2 (median of 10 replays). A tiling that beats scaled_mm by 3% at a
(shape, rows) goes into `WIDE_DECODE_TILINGS` (`--write-tuning`: the GPU's tuning file, table
`fp8_wide_decode_tilings`); the others keep scaled_mm. Prints the table; writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

import torch

from bench.common import copy_bandwidth, err, graph_time, out_path, rel_err, write_result
from bench.engine.gemv import decode_shapes, incumbent_first, keep_or_replace
from worker.kernels.triton import fp8_gemm as fp8k
from worker.kernels.triton.fp8_gemm import DecodeTiling, wave_splits
from worker.models.fp8 import quantize_weight
from worker.models.presets import QWEN3_6_27B

ROWS = (32, 64)
WIN = 0.97  # a GEMV tiling must beat scaled_mm by 3% to replace it


def candidates(n: int, k: int) -> list[DecodeTiling]:
    """W8A8 tilings, with x rounded per K step in each program or once per token before the
    launch (`x_per_token`), each at one split, at the split that best fills whole waves and at
    twice that; two W8A16 ones for comparison. (At 32 rows every winner was 128 channels x 8
    warps, 920536c-fp8_rows.json; 64-channel tiles stay as a check.)"""
    out: set[DecodeTiling] = set()
    shapes = [
        (128, bk, warps, stages) for bk in (128, 256) for warps in (4, 8) for stages in (3, 4)
    ]
    shapes += [(64, 128, 4, 3), (64, 128, 8, 3)]
    for per_token in (True, False):
        for bn, bk, warps, stages in shapes:
            base = DecodeTiling(bn, bk, 1, warps, stages, act_fp8=True, x_per_token=per_token)
            wave = wave_splits(n, k, base)
            # and two waves' worth, for the shapes with few column tiles (down: 40 of 128)
            for splits in {1, wave, min(2 * wave, max(1, k // bk // 4))}:
                out.add(dataclasses.replace(base, splits=splits))
    for bn, warps in ((32, 2), (64, 4)):  # W8A16 (the weight widened to fp16) for comparison
        base = DecodeTiling(bn, 256, 1, warps, 4)
        out.add(DecodeTiling(bn, 256, wave_splits(n, k, base), warps, 4))
    return sorted(out, key=_order)


def _order(t: DecodeTiling) -> tuple[Any, ...]:
    return (not t.act_fp8, not t.x_per_token, t.bn, t.bk, t.num_warps, t.num_stages, t.splits)


def shape_rows(n: int, k: int, m: int, qs: list[Any], bandwidth: float, deadline: float) -> dict[str, Any]:  # fmt: skip
    copies = len(qs)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x, (qs[0][0].float() * qs[0][1][:, None]).bfloat16()).float()
    outs: list[Any] = [None] * copies
    row: dict[str, Any] = {"floor_us": n * k / bandwidth * 1e6, "candidates": []}

    def timed(fn: Any) -> tuple[float, float]:
        t = graph_time(fn, copies, median_replay=True)
        return t * 1e6, rel_err(outs[0].float(), ref)

    def mm(i: int) -> None:
        outs[i] = fp8k.scaled_mm(x, qs[i][0], qs[i][1])

    us, e = timed(mm)
    row["scaled_mm"] = {"us": us, "rel_err": e, "of_copy": row["floor_us"] / us}
    incumbent = fp8k.WIDE_DECODE_TILINGS.get((n, k, m))
    times: dict[DecodeTiling, float] = {}
    for tiling in incumbent_first(incumbent, candidates(n, k)):
        if time.perf_counter() > deadline:
            row["candidates"].append({"tiling": repr(tiling), "skipped": "budget"})
            continue
        entry: dict[str, Any] = {"tiling": repr(tiling)}
        try:

            def gemv(i: int, tiling: DecodeTiling = tiling) -> None:
                outs[i] = fp8k.w8_gemv(x, qs[i][0], qs[i][1], None, tiling)

            us, e = timed(gemv)
            entry.update({"us": us, "rel_err": e, "of_copy": row["floor_us"] / us})
            if e < 4e-2:  # W8A8: e4m3 rounding of x
                times[tiling] = us
        except Exception as exc:
            entry["error"] = err(exc)
        row["candidates"].append(entry)
    # the tiling in use keeps its place unless a candidate beats it by KEEP_MARGIN
    chosen = keep_or_replace(times, incumbent)
    best = None if chosen is None else (times[chosen], chosen)
    if best is not None:
        row["best"] = {"tiling": repr(best[1]), "us": best[0], "of_copy": row["floor_us"] / best[0]}
        if best[0] < WIN * row["scaled_mm"]["us"]:
            fp8k.WIDE_DECODE_TILINGS[(n, k, m)] = best[1]
            row["chosen"] = "w8_gemv"
        else:  # a tiling the file had that lost to scaled_mm goes too
            fp8k.WIDE_DECODE_TILINGS.pop((n, k, m), None)
            row["chosen"] = "scaled_mm"
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="JSON file or folder (default $OUT / results)")
    parser.add_argument("--budget-s", type=float, default=90.0)
    parser.add_argument("--write-tuning", action="store_true")
    args = parser.parse_args(argv)
    out = out_path("fp8_rows", args.out)
    start = time.perf_counter()
    bandwidth = copy_bandwidth()
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "copy_gb_s": bandwidth / 1e9}
    report["shapes"] = {}
    shapes = decode_shapes(QWEN3_6_27B)
    for index, (name, (n, k)) in enumerate(shapes.items()):
        copies = max(2, -(-(192 << 20) // (n * k)))
        qs = [quantize_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(copies)]  # fmt: skip
        report["shapes"][name] = {}
        for m in ROWS:
            left = args.budget_s - (time.perf_counter() - start)
            deadline = time.perf_counter() + left / (2 * (len(shapes) - index))
            try:
                report["shapes"][name][m] = shape_rows(n, k, m, qs, bandwidth, deadline)
            except Exception as exc:
                report["shapes"][name][m] = {"error": err(exc)}
            r = report["shapes"][name][m]
            print(f"  {name} M={m}: scaled_mm {r.get('scaled_mm', {}).get('us', float('nan')):.1f} us, "
                  f"best {r.get('best', {}).get('us', float('nan')):.1f} {r.get('best', {}).get('tiling')}",
                  file=sys.stderr, flush=True)  # fmt: skip
        del qs
        torch.cuda.empty_cache()
        write_result(out, report)
    report["wide_decode_tilings"] = {
        f"{n}x{k}x{m}": repr(t) for (n, k, m), t in sorted(fp8k.WIDE_DECODE_TILINGS.items())
    }
    if args.write_tuning:
        from worker.kernels import tuning

        path = tuning.path_for(torch.cuda.get_device_name())
        data = tuning.read(path) if path.exists() else tuning.snapshot(torch.cuda.get_device_name())
        data["fp8_wide_decode_tilings"] = {
            f"{n}x{k}x{m}": dataclasses.asdict(t)
            for (n, k, m), t in sorted(fp8k.WIDE_DECODE_TILINGS.items())
        }
        tuning.write(path, data)
        report["tuning_file"] = str(path)
    write_result(out, report)
    print(
        f"\n{'shape':<28} {'M':>3} {'floor us':>8} {'scaled_mm':>9} {'best gemv':>9}  chosen / tiling"
    )
    for name, per_m in report["shapes"].items():
        for m, r in per_m.items():
            if "scaled_mm" not in r:
                print(f"{name:<28} {m:>3} {r}")
                continue
            b = r.get("best", {})
            print(f"{name:<28} {m:>3} {r['floor_us']:>8.1f} {r['scaled_mm']['us']:>9.1f} "
                  f"{b.get('us', float('nan')):>9.1f}  {r.get('chosen', '-')} {b.get('tiling', '')}")  # fmt: skip
    return report


if __name__ == "__main__":
    main()
