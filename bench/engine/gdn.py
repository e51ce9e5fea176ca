"""The gdn section: the DeltaNet recurrence's decode and chunked-prefill launch settings at the
model's shape, timed; the winners go where the kernels read them."""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from bench.common import cuda_time, free_gpu, graph_time


def gdn_sweep(args: argparse.Namespace, config: Any, budget: float) -> dict[str, Any]:
    """The DeltaNet recurrence's launch settings at the model's shape, on a bf16 state pool (the
    engine's default): decode (block_v x warps; a graph over one state pool per DeltaNet layer,
    so the states come from HBM as in the engine) and the 8 x prompt chunked prefill (chunk,
    block_v, warps of its two kernels). Each variant is checked against the op's default; the
    fastest correct one goes into DECODE_LAUNCH / PREFILL_LAUNCH."""
    if args.device != "cuda":
        return {"skipped": "times CUDA kernels"}
    from worker.kernels.triton import delta_rule as dr

    deadline = time.perf_counter() + budget
    c, b, dev = config, args.concurrency, args.device
    hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    layers, scale = len(c.linear_attention_layers), dk**-0.5

    def inputs(tokens: int) -> tuple[torch.Tensor, ...]:
        packed = torch.randn(tokens, 2 * hk * dk + hv * dv, device=dev, dtype=torch.bfloat16)
        q = packed[:, : hk * dk].view(tokens, hk, dk)
        k = packed[:, hk * dk : 2 * hk * dk].view(tokens, hk, dk)
        v = packed[:, 2 * hk * dk :].view(tokens, hv, dv)
        g = -torch.nn.functional.softplus(torch.randn(tokens, hv, device=dev) - 1.0)
        beta = torch.rand(tokens, hv, device=dev, dtype=torch.bfloat16)
        return q, k, v, g, beta

    report: dict[str, Any] = {"decode": {}, "prefill": {}}
    q, k, v, g, beta = inputs(b)
    pools = [(torch.randn(b + 1, hv, dk, dv, device=dev) * 0.05).bfloat16() for _ in range(layers)]
    first = pools[0].clone()  # each variant's check starts from these states (timing moves them)
    slots = torch.randperm(b, device=dev)
    outs: list[Any] = [None] * layers
    default = dict(dr.decode_launch(b))
    best: tuple[float, dict[str, int]] | None = None
    want: Any = None
    # (block_v, warps); the engine's calls pass early_state, as timed here. Several tiles a
    # program (each next state loaded before the last is reduced) lost at 8 and 16 rows by
    # 3-50% (bench/results/2026-12-03-h200-a17741e-gdn16.json), so they are not built.
    for bv, warps in ((32, 2), (64, 4), (64, 2), (64, 8), (128, 4), (32, 4), (16, 2), (128, 8)):
        if time.perf_counter() > deadline:
            break
        launch = {"block_v": bv, "num_warps": warps}
        name = f"bv={bv} w={warps}"
        try:

            def decode(i: int, launch: dict[str, int] = launch) -> None:
                outs[i] = dr.gated_delta_rule_decode(
                    q, k, v, g, beta, pools[i], slots, scale, True, early_state=True, **launch
                )

            t = graph_time(decode, layers)
            pool = first.clone()
            got = dr.gated_delta_rule_decode(q, k, v, g, beta, pool, slots, scale, True, **launch)
            got = torch.cat([got.float().flatten(), pool.float().flatten()])
            want = got if want is None else want
            err = ((got - want).norm() / want.norm()).item()
            report["decode"][name] = {"us": t * 1e6, "rel_err": err}
            if err < 1e-2 and (best is None or t < best[0]):
                best = (t, launch)
        except Exception as exc:
            report["decode"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    chosen = dr.decode_launch(b)  # the batch's own settings: up to WIDE_ROWS, or over
    chosen.update(best[1] if best else default)
    report["decode_chosen"] = {**chosen, "table": "wide" if b > dr.WIDE_ROWS else "narrow"}
    pools.clear()
    free_gpu()

    tokens = b * args.prompt_len
    q, k, v, g, beta = inputs(tokens)
    cu = torch.arange(0, tokens + 1, args.prompt_len, device=dev, dtype=torch.int32)
    state = torch.zeros(b, hv, dk, dv, device=dev, dtype=torch.bfloat16)
    fresh = torch.zeros(b, dtype=torch.bool, device=dev)
    ids = torch.arange(b, device=dev)
    default = dict(dr.PREFILL_LAUNCH)
    best, want = None, None
    variants = [(32, 64, 4, 4), (32, 32, 4, 4), (32, 64, 2, 4), (32, 64, 8, 4), (32, 32, 4, 2)]
    variants += [(32, 128, 4, 8), (64, 64, 4, 4), (64, 64, 8, 8), (16, 64, 2, 4), (32, 32, 2, 2)]
    for chunk, bv, pw, sw in variants:
        if time.perf_counter() > deadline:
            break
        launch = {"chunk_size": chunk, "block_v": bv, "prepare_warps": pw, "scan_warps": sw}
        name = f"BT={chunk} bv={bv} w={pw}/{sw}"
        try:

            def prefill(launch: dict[str, int] = launch) -> Any:
                return dr.gated_delta_rule_prefill(
                    q, k, v, g, beta, cu, state, ids, fresh, scale, True,
                    chunk_size=launch["chunk_size"], block_v=launch["block_v"],
                    prepare_warps=launch["prepare_warps"], scan_warps=launch["scan_warps"],
                )  # fmt: skip

            t = cuda_time(prefill, iters=5, warmup=1)
            got = prefill().float()
            want = got if want is None else want
            err = ((got - want).norm() / want.norm()).item()
            report["prefill"][name] = {"us": t * 1e6, "rel_err": err}
            if err < 2e-2 and (best is None or t < best[0]):
                best = (t, launch)
        except Exception as exc:
            report["prefill"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    dr.PREFILL_LAUNCH.update(best[1] if best else default)
    report["prefill_chosen"] = dict(dr.PREFILL_LAUNCH)
    free_gpu()
    return report
