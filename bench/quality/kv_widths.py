"""Staged KV codes at the same bytes, two ways: the norm each vector stores, and code widths per
layer. SmolLM2-135M-Instruct's post-RoPE queries, keys and values (captured as
`bench.quality.key_codes` does, the staged cache's layout kept: anchor page, window of 8 pages
and the page being written exact), coded by the reference codec's rotation and codebooks.

- norm rule: the codec stores |x| (TurboQuant-MSE: the decoded vector is centroids x |x|, its
  norm shrunk by the codebook); "norm-preserving" stores |x| / |c| (c: the centroid vector), so
  the decoded vector has x's norm. Encode-only: the decode kernels read a norm either way.
- per-layer widths: K4 everywhere, V3 except on the n layers where, on the calibration text,
  V4 lowers the attention output error the most (a static per-model choice; evaluated on the
  held-out text). Bytes per token grow by n / layers x a V4 page's extra bytes.

Metrics (means over layers and query heads, the last `--queries` positions): KL of the causal
softmax, and the attention output's relative error (what `key_codes` calls out_rel).

    python -m bench.quality.kv_widths    # ~2 min on 2 cores; bench/results/<date>-cpu-<sha>-kv_widths.json
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from bench.common import result_path, write_result
from bench.quality.key_codes import (
    MODEL,
    Captured,
    capture,
    capture_arguments,
    coded_mask,
    first_tokens,
    layer_metrics,
    study_config,
)
from worker.kvcache import turboquant as tq


def coded(x: torch.Tensor, bits: int, norm_preserving: bool) -> torch.Tensor:
    """x [H, T, d] through the codec's rotation and codebook, decoded (fp32)."""
    y = tq.rotate(x)
    norms = y.norm(dim=-1, keepdim=True)
    centroids, bounds = tq.codebook(x.shape[-1], bits, x.device)
    c = centroids[torch.bucketize(y / norms.clamp_min(1e-30), bounds)]
    if norm_preserving:
        norms = norms / c.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    return tq.unrotate(c * norms.half().float())


def per_layer(
    cap: Captured,
    k_bits: list[int],
    v_bits: list[int],
    norm_preserving: bool,
    queries: int,
    window_pages: int,
    scale: float,
) -> list[dict[str, float]]:
    mask = coded_mask(cap.k[0].shape[1], queries, window_pages)
    return [
        layer_metrics(
            q, k, v, coded(k, kb, norm_preserving), coded(v, vb, norm_preserving), mask, scale
        )
        for q, k, v, kb, vb in zip(cap.q, cap.k, cap.v, k_bits, v_bits, strict=True)
    ]


def mean(rows: list[dict[str, float]], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def variants(
    held: Captured, calib: Captured, queries: int, window_pages: int, scale: float, dim: int
) -> tuple[list[dict[str, Any]], list[int]]:
    layers = len(held.k)
    args = (queries, window_pages, scale)
    # which layers gain most from V4, on the calibration text
    v3 = per_layer(calib, [4] * layers, [3] * layers, False, *args)
    v4 = per_layer(calib, [4] * layers, [4] * layers, False, *args)
    order = sorted(range(layers), key=lambda i: v4[i]["out_rel"] - v3[i]["out_rel"])

    def pair_bytes(kb: int, vb: int) -> int:
        return tq.bytes_per_vector(dim, kb) + tq.bytes_per_vector(dim, vb)

    specs: list[tuple[str, list[int], list[int], bool]] = [
        ("K4/V3 (default)", [4] * layers, [3] * layers, False),
        ("K4/V3, norm-preserving", [4] * layers, [3] * layers, True),
        ("K4/V4", [4] * layers, [4] * layers, False),
    ]
    for n in (2, 4, 7):
        wide = set(order[:n])
        vb = [4 if i in wide else 3 for i in range(layers)]
        specs.append((f"K4/V3, V4 on {n} layers", [4] * layers, vb, False))
        specs.append((f"K4/V3, V4 on {n} layers, norm-preserving", [4] * layers, vb, True))
    base = pair_bytes(4, 3)
    rows = []
    for name, kb, vb, np_ in specs:
        r = per_layer(held, kb, vb, np_, *args)
        size = sum(pair_bytes(k, v) for k, v in zip(kb, vb, strict=True)) / layers
        rows.append(
            {
                "codes": name,
                "bytes_vs_k4v3": size / base,
                "kl": mean(r, "kl"),
                "out_rel": mean(r, "out_rel"),
                "worst_layer_out_rel": max(x["out_rel"] for x in r),
            }
        )
    return rows, order


def table(rows: list[dict[str, Any]]) -> str:
    ref = rows[0]
    lines = [
        "| codes | bytes vs K4/V3 | KL | out rel err | vs K4/V3 | worst layer |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['codes']} | {r['bytes_vs_k4v3']:.3f} | {r['kl']:.3e} | {r['out_rel']:.5f} "
            f"| {100 * (r['out_rel'] / ref['out_rel'] - 1):+.1f}% | {r['worst_layer_out_rel']:.4f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    capture_arguments(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from bench.quality.passkey import load_smollm2
    from worker.quantize.perplexity import calibration_text, held_out_text

    began = time.perf_counter()
    model, tokenizer = load_smollm2("cpu", torch.float32, args.gguf)
    held = capture(model, first_tokens(tokenizer, held_out_text(), args.tokens))
    calib = capture(model, first_tokens(tokenizer, calibration_text(), args.tokens))
    scale = model.model.layers[0].self_attn.scale
    rows, order = variants(held, calib, args.queries, args.window_pages, scale, held.k[0].shape[-1])
    result = {
        "model": MODEL,
        "config": {
            **study_config(args),
            "text": "held_out_text(); layers chosen on calibration_text()",
        },
        "v4_gain_order": order,
        "rows": rows,
        "total_s": time.perf_counter() - began,
    }
    print(table(rows))
    write_result(args.out or result_path("kv_widths", gpu="cpu"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
