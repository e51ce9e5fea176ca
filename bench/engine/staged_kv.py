"""Staged KV pages (recent pages FP8, aged pages TurboQuant): the memory table, and on a GPU the
decode step, the re-encode throughput and the kernels' agreement with the references at the
Qwen3.6-27B attention shape (24 query / 4 kv heads of 256, 16 full-attention layers).

    python -m bench.engine.staged_kv        # CPU: the memory table only
    python -m bench.engine.staged_kv        # GPU: table + timings + checks; JSON to $OUT

The memory table uses the storage's own accounting (bytes per token of each pool, measured on
allocated one-block pools, worker/models/cache.py StagedAttentionCache) and the page-age mix of
the block manager's policy: per sequence the first `anchor` pages, the last `window` pages and
the page being written stay FP8, the rest are TurboQuant codes; plus the recent pages a step's
prefill chunks hold until they are restaged (worker/engine/block_manager.py staged_pool_blocks).

GPU sections (each guarded: a failure is recorded and the next runs; the JSON is rewritten after
each): check (kernels vs references at real shapes), encode (pages re-encoded per second),
decode (one attention layer's decode at 8 x 32K context: FP8 paged decode vs staged decode with
every page past the window compressed, the default tile / warps / stages and the
DECODE_VARIANTS, each checked against the reference at that shape before it is timed; the
rotations included once; x16 for the step's share).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from bench.common import result_path, write_result
from worker.engine.config import DEFAULT_STEP_TOKENS
from worker.models.cache import StagedAttentionCache
from worker.models.presets import QWEN3_6_27B

GIB = 1 << 30
FP8 = torch.float8_e4m3fn
MILLION = 1_000_000
ENVELOPE_GIB = 86.4
# weights resident on the GPU for the 27B shape as measured (2026-12-01-h200-ad5d6a5-gpu_suite.json;
# W4 with its embedding table in host memory, the W4 default: 2026-12-04-h200-332a051-gpu_suite.json)
WEIGHTS_GIB = {"FP8 weights": 26.25, "W4 weights": 15.28, "W4 weights, table on the host": 12.92}
BLOCK = 16


def attention_shape() -> dict[str, int]:
    c = QWEN3_6_27B
    return dict(
        layers=len([t for t in c.layer_types if t == "full_attention"]),
        hq=c.num_attention_heads,
        hkv=c.num_key_value_heads,
        dim=c.head_dim,
    )


def state_bytes_per_seq(state_bytes: int = 2) -> int:
    """DeltaNet recurrent (bf16, the engine's default) + conv state per sequence, all layers."""
    c = QWEN3_6_27B
    layers = len([t for t in c.layer_types if t != "full_attention"])
    recurrent = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
    conv = c.conv_dim * (c.linear_conv_kernel_dim - 1)
    return layers * (recurrent * state_bytes + conv * 2)


def per_token_bytes(
    k_bits: int, v_bits: int, layer_bits: dict[int, tuple[int, int]] | None = None
) -> tuple[int, int]:
    """(FP8 page bytes, TurboQuant page bytes) per token across the attention layers, those in
    `layer_bits` (model layer index -> K, V bits) at widths of their own."""
    s = attention_shape()
    fp8 = turboquant = 0
    for index, kind in enumerate(QWEN3_6_27B.layer_types):
        if kind == "full_attention":
            bits = (layer_bits or {}).get(index, (k_bits, v_bits))
            probe = StagedAttentionCache.allocate(1, 1, 1, s["hkv"], s["dim"], *bits)
            fp8 += probe.recent_bytes_per_token()
            turboquant += probe.compressed_bytes_per_token()
    return fp8, turboquant


def fp8_fraction(context: int, window: int, anchor: int) -> float:
    """Share of a sequence's tokens in FP8 pages: anchors, window and the page being written."""
    pages = math.ceil(context / BLOCK)
    return min(pages, anchor + window + 1) * BLOCK / max(context, 1)


def memory_table(
    k_bits: int = 4,
    v_bits: int = 3,
    window: int = 8,
    anchor: int = 1,
    context: int = 32_768,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = DEFAULT_STEP_TOKENS,
    layer_bits: dict[int, tuple[int, int]] | None = None,
) -> dict[str, Any]:
    fp8_bpt, tq_bpt = per_token_bytes(k_bits, v_bits, layer_bits)
    f = fp8_fraction(context, window, anchor)
    staged_bpt = f * fp8_bpt + (1 - f) * tq_bpt
    # the recent pages a step's prefill chunks hold until the next restage (fixed, not per seq)
    chunk_pages = math.ceil(max_num_batched_tokens / BLOCK) + max_num_seqs
    headroom = chunk_pages * BLOCK * fp8_bpt
    state = state_bytes_per_seq()
    rows: dict[str, Any] = {
        "config": dict(
            k_bits=k_bits,
            v_bits=v_bits,
            layer_bits=layer_bits or {},
            window_pages=window,
            anchor_pages=anchor,
            block_size=BLOCK,
            context=context,
            fp8_token_share=f,
            **attention_shape(),
        ),
        "bytes_per_token": {"fp8": fp8_bpt, "turboquant": tq_bpt, "staged_mix": staged_bpt},
        "deltanet_state_mib_per_seq": state / (1 << 20),
        "prefill_headroom_gib": headroom / GIB,
        "kv_gib_at_1m_tokens": {
            "fp8": MILLION * fp8_bpt / GIB,
            "staged": MILLION * staged_bpt / GIB,
            "all_turboquant": MILLION * tq_bpt / GIB,
        },
    }
    for name, weights in WEIGHTS_GIB.items():
        per_ctx_fp8 = (context * fp8_bpt + state) / GIB
        per_ctx_staged = (context * staged_bpt + state) / GIB
        left = ENVELOPE_GIB - weights
        rows[name] = {
            "weights_plus_1m_kv_gib": {
                "fp8": weights + MILLION * fp8_bpt / GIB,
                "staged": weights + (MILLION * staged_bpt + headroom) / GIB,
            },
            "resident_32k_contexts": {
                "fp8": int(left // per_ctx_fp8),
                "staged": int((left - headroom / GIB) // per_ctx_staged),
            },
        }
    return rows


def print_memory(table: dict[str, Any]) -> None:
    c = table["config"]
    kv = table["kv_gib_at_1m_tokens"]
    print(
        f"attention KV, {c['layers']} layers x {c['hkv']} kv heads x {c['dim']}, K{c['k_bits']}/"
        f"V{c['v_bits']}, window {c['window_pages']} + anchor {c['anchor_pages']} pages of "
        f"{c['block_size']}: FP8 share {c['fp8_token_share']:.2%} of a {c['context']}-token context"
    )
    b = table["bytes_per_token"]
    print(f"bytes/token: FP8 {b['fp8']}, TurboQuant {b['turboquant']}, mix {b['staged_mix']:.0f}")
    print(f"{'':34} {'FP8 KV':>10} {'staged':>10}")
    print(f"{'attention KV @ 1M live tokens (GiB)':34} {kv['fp8']:>10.2f} {kv['staged']:>10.2f}")
    for name in WEIGHTS_GIB:
        w = table[name]["weights_plus_1m_kv_gib"]
        r = table[name]["resident_32k_contexts"]
        print(f"{name + ' + 1M KV (GiB)':34} {w['fp8']:>10.2f} {w['staged']:>10.2f}")
        print(f"{name + ': 32K contexts in 86.4 GiB':34} {r['fp8']:>10} {r['staged']:>10}")


# ---------------------------------------------------------------- GPU sections


def bench_us(fn: Callable[[], Any], device: str = "cuda") -> float:
    if device != "cuda":  # the CPU plumbing check: one timed call
        began = time.perf_counter()
        fn()
        return (time.perf_counter() - began) * 1e6
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200)) * 1e3


def build_case(
    batch: int, context: int, window: int, anchor: int, k_bits: int, v_bits: int, dev: str
) -> dict[str, Any]:
    """An FP8 paged cache holding every page, and a staged cache over the same rotated
    vectors with every page past each sequence's anchors and window re-encoded (by the Triton
    kernel; its time is the encode measurement)."""
    from worker.kernels.triton.turboquant import turboquant_restage

    s = attention_shape()
    pages = math.ceil(context / BLOCK)
    total = batch * pages
    k = (torch.randn(total, BLOCK, s["hkv"], s["dim"], device=dev) * 0.5).to(FP8)
    v = (torch.randn(total, BLOCK, s["hkv"], s["dim"], device=dev) * 0.5).to(FP8)
    tables = torch.randperm(total, device=dev, dtype=torch.int64).view(batch, pages)
    tables = tables.to(torch.int32)
    # the staged cache's recent pool is the same FP8 pages (the bench needs every page's source);
    # its compressed pool holds the aged pages
    cache = StagedAttentionCache.allocate(
        total, total, BLOCK, s["hkv"], s["dim"], k_bits, v_bits, FP8, dev
    )
    cache.k_cache, cache.v_cache = k, v
    aged = torch.zeros(batch, pages, dtype=torch.bool, device=dev)
    aged[:, anchor : max(anchor, pages - window - 1)] = True
    src = tables[aged].long()
    dst = torch.arange(src.numel(), device=dev)
    staged_tables = tables.clone()
    staged_tables[aged] = (total + dst).to(torch.int32)

    def encode() -> None:
        turboquant_restage(cache, src, dst)

    encode()
    if dev == "cuda":
        torch.cuda.synchronize()
    return dict(
        k=k,
        v=v,
        tables=tables,
        cache=cache,
        staged_tables=staged_tables,
        src=src,
        dst=dst,
        encode=encode,
        ctx=torch.full((batch,), context, dtype=torch.int32, device=dev),
        shape=s,
    )


def section_check(args: argparse.Namespace) -> dict[str, Any]:
    from tests.worker.numerics import rel_err
    from worker.kernels import reference
    from worker.kernels.reference import cu_seqlens_of
    from worker.kernels.triton import turboquant as tk
    from worker.kvcache.turboquant import unpack_codes

    dev = args.device
    out: dict[str, Any] = {}
    context = min(4096, args.context)
    case = build_case(2, context, args.window, args.anchor, args.k_bits, args.v_bits, dev)
    cache, tables, ctx, s = case["cache"], case["staged_tables"], case["ctx"], case["shape"]
    # restage: the kernel's codes against the reference's on a slice of the pages
    ref = StagedAttentionCache(**cache.__dict__)
    n = min(256, case["src"].numel())
    ref.k_codes, ref.v_codes = cache.k_codes.clone(), cache.v_codes.clone()
    ref.k_norms, ref.v_norms = cache.k_norms.clone(), cache.v_norms.clone()
    reference.turboquant_restage(ref, case["src"][:n], case["dst"][:n])
    idx = case["dst"][:n]
    out["restage_code_agreement_k"] = float(
        (
            unpack_codes(cache.k_codes[idx], args.k_bits, s["dim"])
            == unpack_codes(ref.k_codes[idx], args.k_bits, s["dim"])
        )
        .float()
        .mean()
    )
    out["restage_code_agreement_v"] = float(
        (
            unpack_codes(cache.v_codes[idx], args.v_bits, s["dim"])
            == unpack_codes(ref.v_codes[idx], args.v_bits, s["dim"])
        )
        .float()
        .mean()
    )
    out["restage_norm_rel_err"] = rel_err(cache.k_norms[idx], ref.k_norms[idx])
    q = torch.randn(2, s["hq"], s["dim"], device=dev).bfloat16()
    scale = s["dim"] ** -0.5
    want = reference.staged_attention_decode(q, cache, ctx, tables, scale)
    got = tk.staged_attention_decode(q, cache, ctx, tables, scale)
    out["decode_rel_err"] = rel_err(got, want)
    # prefill: a 512-token chunk at the end of each 4K context
    chunk = min(512, context // 4)
    qp = torch.randn(2 * chunk, s["hq"], s["dim"], device=dev).bfloat16()
    cu = cu_seqlens_of([chunk, chunk], dev)
    positions = torch.arange(context - chunk, context, device=dev).repeat(2)
    want_p = reference.staged_attention_prefill(qp, cache, cu, ctx, tables, positions, scale)
    got_p = tk.staged_attention_prefill(qp, cache, cu, ctx, tables, positions, scale)
    out["prefill_rel_err"] = rel_err(got_p, want_p)
    # quality: staged attention against exact FP8 attention over the same vectors
    exact = reference.paged_attention_decode(q, case["k"], case["v"], ctx, case["tables"], scale)
    out["staged_vs_fp8_decode_rel_err"] = rel_err(got, exact)
    out["ok"] = (
        out["decode_rel_err"] < 2e-2
        and out["prefill_rel_err"] < 2e-2
        and min(out["restage_code_agreement_k"], out["restage_code_agreement_v"]) > 0.999
    )
    return out


def section_encode(args: argparse.Namespace) -> dict[str, Any]:
    case = build_case(
        args.batch, args.context, args.window, args.anchor, args.k_bits, args.v_bits, args.device
    )
    pages = case["src"].numel()
    us = bench_us(case["encode"], args.device)
    s = case["shape"]
    read = pages * BLOCK * s["hkv"] * s["dim"] * 2  # FP8 K and V
    return {
        "pages": pages,
        "us_per_layer": us,
        "pages_per_s_per_layer": pages / (us * 1e-6),
        "read_gb_per_s": read / (us * 1e-6) / 1e9,
        "us_per_page_all_layers": us / pages * s["layers"],
    }


# staged decode kernel variants timed beside the default: (tokens per tile, warps, stages,
# 4-bit key lookup, 3-bit code loads, register cap or None, tokens per split or None for the
# default split plan: each row cutting its own context into decode_splits' count, 17 at batch 8
# with 4 KV heads, ~1,984 tokens at 32K). 2048 tokens a split gives 512 programs (2 waves of
# 264 for 132 SMs holding 2 each at 255 registers x 128 threads); a cap of 168 registers fits
# 3 programs of 4 warps an SM, 128 fits 4 (16-token tiles without pipelining: no spills)
# (docs/performance.md, "Current state: staged KV speed on the H200")
DECODE_VARIANTS: list[tuple[int, int, int, str, str, int | None, int | None]] = [
    (64, 4, 2, "prmt", "words", None, None),
    (64, 4, 2, "prmt", "bytes", None, None),  # the default measured at 1,339 us
    (64, 4, 2, "prmt", "bytes", None, 2048),
    (64, 4, 2, "prmt", "words", None, 2048),
    (64, 4, 1, "prmt", "words", None, 2048),
    (64, 4, 2, "tree", "words", None, 2048),
    (64, 8, 2, "prmt", "words", None, 2048),
    (32, 4, 2, "prmt", "words", None, 2048),
    (32, 4, 1, "prmt", "words", 168, None),
    (32, 4, 2, "prmt", "words", 168, 1024),
    (32, 4, 1, "prmt", "words", 168, 1024),
    (64, 4, 2, "prmt_v3", "words", None, None),
    (64, 4, 2, "prmt_v3", "words", None, 2048),
    (64, 8, 2, "prmt_v3", "words", None, 2048),
    (32, 4, 2, "prmt_v3", "words", None, 2048),
    (32, 4, 2, "prmt_v3", "words", 168, 1024),
    (32, 4, 1, "prmt_v3", "words", 168, 1024),
    (16, 4, 1, "prmt", "words", 128, 1024),
    (16, 4, 1, "prmt_v3", "words", 128, 1024),
]


# the CUDA kernel (worker/kernels/cuda/staged_decode.cu) beside them: (compiled variant, splits a
# sequence or None for `splits_for`'s one wave)
CUDA_VARIANTS: list[tuple[int, int | None]] = [
    (0, None), (1, None), (2, None), (3, None), (4, None), (0, 16), (1, 24), (3, 16), (2, 16),
]  # fmt: skip


def variant_name(v: tuple[int, int, int, str, str, int | None, int | None]) -> str:
    bn, warps, stages, lookup, loads, regs, part = v
    return (
        f"staged bn{bn} w{warps} s{stages} {lookup} {loads}"
        + (f" r{regs}" if regs else "")
        + (f" p{part}" if part else "")
    )


def section_decode(args: argparse.Namespace) -> dict[str, Any]:
    from tests.worker.numerics import rel_err
    from worker.kernels import ops, reference
    from worker.kernels.triton import turboquant as tk
    from worker.kernels.triton.paged_attention import paged_attention_decode

    case = build_case(
        args.batch, args.context, args.window, args.anchor, args.k_bits, args.v_bits, args.device
    )
    s, cache = case["shape"], case["cache"]
    q = torch.randn(args.batch, s["hq"], s["dim"], device=args.device).bfloat16()
    scale = s["dim"] ** -0.5
    rot = cache.rotation
    ctx, tables = case["ctx"], case["staged_tables"]

    def fp8() -> None:
        paged_attention_decode(q, case["k"], case["v"], ctx, case["tables"], scale)

    def fp8_p2048() -> None:  # the FP8 kernel at the split size the staged variants try
        paged_attention_decode(q, case["k"], case["v"], ctx, case["tables"], scale, partition=2048)

    def staged_with(
        v: tuple[int, int, int, str, str, int | None, int | None],
    ) -> Callable[[], Any]:
        bn, warps, stages, lookup, loads, regs, part = v
        return lambda: tk.staged_attention_decode(
            q, cache, ctx, tables, scale, part, bn, warps, stages, lookup, loads, regs
        )

    def staged_rotated() -> None:  # the layer's whole cost: rotate q, attend, un-rotate
        q_rot = (q.float() @ rot).to(q.dtype)
        out = ops.staged_attention_decode(q_rot, cache, ctx, tables, scale)  # the default kernel
        (out.float() @ rot.T).to(q.dtype)

    default = (
        tk._TOKENS_PER_STEP,
        tk._NUM_WARPS,
        tk._NUM_STAGES,
        tk._LOOKUP,
        tk._CODE_LOADS,
        None,
        None,
    )
    variants = [default] + [v for v in DECODE_VARIANTS if v != default]
    # every variant checked against the reference at this shape before it is timed
    want = reference.staged_attention_decode(q, cache, ctx, tables, scale)
    result: dict[str, Any] = {"batch": args.batch, "context": args.context, "variants": {}}
    fns: list[tuple[str, Callable[[], Any]]] = [("fp8", fp8), ("fp8_p2048", fp8_p2048)]

    def check(name: str, fn: Callable[[], Any]) -> None:
        """Time `fn` only if it agrees with the reference at this shape."""
        try:
            err = rel_err(fn(), want)
        except Exception as exc:
            result["variants"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            return
        result["variants"][name] = {"rel_err_vs_reference": err, "ok": err < 2e-2}
        if err < 2e-2:
            fns.append((name, fn))

    for v in variants:
        check(variant_name(v), staged_with(v))
    if args.device == "cuda":
        from worker.kernels.cuda import staged_decode as sd

        for variant, splits in CUDA_VARIANTS:
            name = f"staged cuda v{variant} {sd.VARIANTS[variant]}" + (f" x{splits}" if splits else "")  # fmt: skip

            def cuda_fn(variant: int = variant, splits: int | None = splits) -> Any:
                return sd.staged_attention_decode(q, cache, ctx, tables, scale, None, variant, splits)  # fmt: skip

            check(name, cuda_fn)
    fns.append(("staged_with_rotations", staged_rotated))
    for name, fn in fns:
        row = result["variants"].setdefault(name, {}) if name.startswith("staged ") else {}
        try:
            us = bench_us(fn, args.device)
            row.update(us_per_layer=us, ms_per_step_16_layers=us * s["layers"] / 1e3)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
        if not name.startswith("staged "):
            result[name] = row
    result["staged"] = dict(result["variants"][variant_name(default)])
    bytes_fp8 = args.batch * args.context * s["hkv"] * s["dim"] * 2
    fp8_us = result["fp8"].get("us_per_layer")
    if fp8_us:
        result["fp8"]["gb_per_s"] = bytes_fp8 / (fp8_us * 1e-6) / 1e9
        for row in (result["staged"], *result["variants"].values()):
            if "us_per_layer" in row:
                row["vs_fp8"] = row["us_per_layer"] / fp8_us
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--k-bits", type=int, default=4)
    p.add_argument("--v-bits", type=int, default=3)
    p.add_argument("--window", type=int, default=8, help="recent pages kept FP8 per sequence")
    p.add_argument("--anchor", type=int, default=1, help="first pages kept FP8 (sinks)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=32_768)
    p.add_argument("--sections", default="check,encode,decode")
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu: a plumbing check of the GPU sections under the triton interpreter "
        "(with --sections and a small --context; the default on CPU is the table alone)",
    )
    p.add_argument(
        "--out",
        help="folder for <date>-<gpu>-<sha>-staged_kv.json (default $OUT, else bench/results)",
    )
    args = p.parse_args(argv)
    path = result_path("staged_kv", args.out, None if args.device == "cuda" else "cpu")
    report: dict[str, Any] = {"torch": torch.__version__, "sections": {}}
    report["memory"] = memory_table(args.k_bits, args.v_bits, args.window, args.anchor)
    print_memory(report["memory"])
    # the first two attention layers at K4/V4 stand for any two (the random weights rank none)
    two_wide = {3: (4, 4), 7: (4, 4)}
    mix = [("K4/V3", 4, 3, None), ("K4/V3, V4 on 2 of 16 layers", 4, 3, two_wide)]
    mix += [("K3/V3", 3, 3, None), ("K4/V4", 4, 4, None), ("K2/V2", 2, 2, None)]
    report["memory_by_bits"] = {
        name: memory_table(k, v, args.window, args.anchor, layer_bits=layers)[
            "kv_gib_at_1m_tokens"
        ]["staged"]
        for name, k, v, layers in mix
    }
    print(
        "staged KV @ 1M tokens by bits: "
        + ", ".join(f"{k} {v:.2f} GiB" for k, v in report["memory_by_bits"].items())
    )

    def save() -> None:
        write_result(path, report)

    save()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA: memory table only", file=sys.stderr)
        return report
    if args.device == "cpu" and "--sections" not in (argv if argv is not None else sys.argv):
        return report
    report["device_name"] = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    sections = {"check": section_check, "encode": section_encode, "decode": section_decode}
    for name in args.sections.split(","):
        began = time.perf_counter()
        try:
            report["sections"][name] = sections[name](args)
        except Exception as exc:
            report["sections"][name] = {
                "error": f"{type(exc).__name__}: {exc}",
                "trace": traceback.format_exc(limit=6),
            }
        report["sections"][name]["seconds"] = time.perf_counter() - began
        print(f"== {name}: {json.dumps(report['sections'][name], default=str)}", file=sys.stderr)
        if args.device == "cuda":
            torch.cuda.empty_cache()
        save()
    d = report["sections"].get("decode", {})
    if "fp8" in d:
        title = f"decode, one layer, {args.batch} x {args.context}"
        print(f"{title:34} {'us':>10} {'ms/step x16':>12} {'x FP8':>7} {'rel err':>9}")
        rows = [("fp8", d["fp8"]), ("fp8 p2048", d.get("fp8_p2048", {}))]
        rows += list(d.get("variants", {}).items())
        rows.append(("staged_with_rotations", d.get("staged_with_rotations", {})))
        for name, row in rows:
            if "us_per_layer" in row:
                ratio = row["us_per_layer"] / d["fp8"]["us_per_layer"]
                err = row.get("rel_err_vs_reference")
                print(
                    f"{name:34} {row['us_per_layer']:>10.1f} "
                    f"{row['ms_per_step_16_layers']:>12.3f} {ratio:>7.2f} "
                    + (f"{err:>9.2e}" if err is not None else f"{'':>9}")
                )
            else:
                print(f"{name:34} {row.get('error', '?')}")
    return report


if __name__ == "__main__":
    main()
