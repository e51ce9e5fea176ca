"""Prefix caching on a multi-turn workload, the engine alone: 16 conversations x 6 turns, a
2,048-token system prompt shared by all, 512-token user turns, 128 output tokens; each turn's 16
prompts (system + the conversation so far + the new user turn) run at once. The same workload
with the cache off, then on (one engine each, the same model), reporting per run: TTFT p50 of
turns >= 2, aggregate output tok/s, and for turns >= 2 three fractions of the prompt tokens:
`shared` (what an earlier turn of the conversation already held: system + history),
`reachable` (the part of it a resume can use, `resume_bound`: the previous turn's computed
tokens, i.e. its prompt and answer less the answer's last token, which was sampled and never
fed, rounded down to a KV block, where that sequence left its tail DeltaNet state checkpoint)
and `reported` (usage.cached_tokens). `reported` equals `reachable` unless a checkpoint or KV
block was evicted; `shared` exceeds it by under a block per turn.

    PYTHONPATH=. python3 -m bench.engine.suite --sections prefix_cache --budget-s 300
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

import torch

from bench.common import percentile
from bench.engine.configs import build_model
from bench.engine.load_point import sync
from worker.engine.engine import EngineConfig, LLMEngine
from worker.engine.sequence import SamplingParams

CONVERSATIONS, TURNS, SYSTEM, USER, OUTPUT = 16, 6, 2048, 512, 128
CHECKPOINT_BLOCKS, BLOCK = 32, 16


def workload(vocab: int, seed: int, scale: int = 1) -> tuple[list[int], list[list[list[int]]]]:
    """The system prompt and each conversation's user turns (token ids)."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(SYSTEM // scale)]
    users = [
        [[rng.randrange(vocab) for _ in range(USER // scale)] for _ in range(TURNS)]
        for _ in range(CONVERSATIONS)
    ]
    return system, users


def resume_bound(prompt: int, answer: int, next_prompt: int, spacing: int, block: int) -> int:
    """Tokens a next turn (`next_prompt` tokens, starting with the previous turn's `prompt` +
    `answer`) resumes after: the previous sequence's deepest block boundary within its computed
    tokens (all but the answer's last) that a step ended at, where it left its tail checkpoint:
    any boundary past its prompt (decode steps end at each), else the prompt's own boundary if
    its last chunk ended there, else its last spacing checkpoint (chunks end at each)."""
    deepest = (prompt + answer - 1) // block * block
    if deepest < prompt and deepest % spacing:
        deepest = prompt // spacing * spacing
    return min(deepest, (next_prompt - 1) // block * block)


def run(
    engine: LLMEngine, system: list[int], users: list[list[list[int]]], output: int, ckpt: int
) -> dict[str, Any]:
    params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
    history: list[list[int]] = [[] for _ in users]
    previous: list[tuple[int, int]] = [(0, 0)] * len(users)  # last turn's prompt, answer
    ttft: list[float] = []
    shared = reachable = reported = prompt_total = produced = 0
    sync(engine)
    began = time.perf_counter()
    for turn in range(TURNS):
        prompts = [system + history[c] + users[c][turn] for c in range(len(users))]
        outs = engine.generate(prompts, params)
        for c, out in enumerate(outs):
            produced += out.usage.completion_tokens
            if turn > 0:
                ttft.append(out.metrics.ttft or 0.0)
                shared += len(system) + len(history[c])
                reachable += resume_bound(*previous[c], len(prompts[c]), ckpt * BLOCK, BLOCK)
                reported += out.usage.cached_tokens
                prompt_total += len(prompts[c])
            previous[c] = (len(prompts[c]), len(out.new_token_ids))
            history[c] = history[c] + users[c][turn] + list(out.new_token_ids)
    sync(engine)
    wall = time.perf_counter() - began
    return {
        "wall_s": wall,
        "output_tok_s": produced / wall,
        "ttft_p50_turns_2_on_s": percentile(ttft, 50),
        "ttft_p95_turns_2_on_s": percentile(ttft, 95),
        "shared_fraction": shared / max(prompt_total, 1),
        "reachable_fraction": reachable / max(prompt_total, 1),
        "reported_cached_fraction": reported / max(prompt_total, 1),
    }


def prefix_cache(args: argparse.Namespace, config: Any, budget: float) -> dict[str, Any]:
    began = time.perf_counter()
    _, _, model = build_model(args, config, "fp8" if args.device == "cuda" else "bf16")
    scale = 1 if args.device == "cuda" else 16  # CPU: a plumbing check on short prompts
    system, users = workload(config.vocab_size, args.seed, scale)
    ckpt = max(1, CHECKPOINT_BLOCKS // scale)
    result: dict[str, Any] = {
        "conversations": CONVERSATIONS,
        "turns": TURNS,
        "system_tokens": len(system),
        "user_tokens": len(users[0][0]),
        "output_tokens": OUTPUT // scale,
        "checkpoint_blocks": ckpt,
    }
    for caching in (False, True):
        if time.perf_counter() - began > budget * 0.6 and caching:
            result["cache_on"] = {"skipped": "budget"}
            break
        engine = LLMEngine(
            model,
            None,
            EngineConfig(
                block_size=BLOCK,
                max_num_seqs=CONVERSATIONS,
                max_num_batched_tokens=8192,
                max_model_len=min(16_384, config.max_position_embeddings),
                kv_dtype=torch.float8_e4m3fn if args.device == "cuda" else None,
                device=args.device,
                warm_up=False,
                enable_prefix_caching=caching,
                prefix_checkpoint_blocks=ckpt,
                prefix_checkpoint_slots=4 * CONVERSATIONS,
            ),
        )
        # compiles the shapes first; with the cache on, its own system prompt is different
        engine.generate([[7] * (SYSTEM // scale)], SamplingParams(temperature=0, max_tokens=4))
        point = run(engine, system, users, OUTPUT // scale, ckpt)
        result["cache_on" if caching else "cache_off"] = point
        print(
            f"  cache {'on' if caching else 'off'}: {point['output_tok_s']:.1f} tok/s, "
            f"TTFT p50 turns >= 2 {point['ttft_p50_turns_2_on_s']:.3f} s, cached "
            f"{point['reported_cached_fraction']:.3f} (reachable "
            f"{point['reachable_fraction']:.3f}, shared {point['shared_fraction']:.3f})",
            file=sys.stderr,
        )
        del engine
        if args.device == "cuda":
            torch.cuda.empty_cache()
    off, on = result.get("cache_off", {}), result.get("cache_on", {})
    if "output_tok_s" in off and "output_tok_s" in on:
        result["ttft_ratio_off_over_on"] = (
            off["ttft_p50_turns_2_on_s"] / on["ttft_p50_turns_2_on_s"]
        )
        result["throughput_ratio_on_over_off"] = on["output_tok_s"] / off["output_tok_s"]
    return result
