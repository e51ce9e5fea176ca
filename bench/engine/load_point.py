"""Drive the engine directly at the load point and report throughput and latency.

The load point (docs/performance.md): 32 requests, 8 in flight, ~512
prompt tokens, up to 256 output tokens; one warm-up round, then 5 timed repeats. Aggregate
output tok/s = completion tokens / wall time of a repeat.

    python -m bench.engine.load_point --preset tiny-qwen3_5 --device cpu            # seconds
    python -m bench.engine.load_point --preset qwen3_6-27b --device cuda --out r.json  # random 27B
    python -m bench.engine.load_point --model-dir /models/Qwen3.6-27B --device cuda
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common import median, percentile
from worker.engine.engine import EngineConfig, LLMEngine
from worker.engine.sequence import SamplingParams

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GIB = 1024**3


@dataclass
class RepeatResult:
    wall_s: float
    completion_tokens: int
    prompt_tokens: int
    output_tok_s: float
    ttft_s: list[float] = field(repr=False)
    e2e_s: list[float] = field(repr=False)
    preemptions: int = 0


def build_model(args: argparse.Namespace) -> tuple[Any, str]:
    device, dtype = args.device, DTYPES[args.dtype]
    if args.model_dir:
        path = Path(args.model_dir)
        if path.suffix == ".gguf":
            from worker.loading.gguf import load_gguf_model

            return load_gguf_model(path, device, dtype), path.name
        from worker.loading.safetensors import load_hf_model

        return load_hf_model(path, device, dtype), path.name
    from worker.models import build_random
    from worker.models.presets import PRESETS

    name = args.preset.replace("_", ".")  # tiny-qwen3_5 -> tiny-qwen3.5
    if name not in PRESETS:
        raise SystemExit(f"unknown preset {args.preset!r}; known: {sorted(PRESETS)}")
    return build_random(PRESETS[name], device, dtype, seed=args.seed), f"{name} (random)"


def run_round(
    engine: LLMEngine,
    prompts: list[list[int]],
    concurrency: int,
    params: SamplingParams,
) -> RepeatResult:
    """Serve all prompts keeping `concurrency` requests in flight; time it."""
    pending = list(prompts)
    in_flight = 0
    ttft: list[float] = []
    e2e: list[float] = []
    completion = prompt_tokens = preemptions = 0
    sync(engine)
    start = time.perf_counter()
    while pending or in_flight:
        while pending and in_flight < concurrency:
            engine.add_request(pending.pop(), params)
            in_flight += 1
        for out in engine.step():
            if not out.finished:
                continue
            in_flight -= 1
            completion += out.usage.completion_tokens
            prompt_tokens += out.usage.prompt_tokens
            preemptions += out.metrics.num_preemptions
            if out.metrics.ttft is not None:
                ttft.append(out.metrics.ttft)
            if out.metrics.e2e is not None:
                e2e.append(out.metrics.e2e)
    sync(engine)
    wall = time.perf_counter() - start
    return RepeatResult(wall, completion, prompt_tokens, completion / wall, ttft, e2e, preemptions)


def sync(engine: LLMEngine) -> None:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize(engine.runner.device)


def random_prompts(n: int, length: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--preset", default="tiny-qwen3_5", help="tiny-qwen3_5 | tiny-llama | qwen3_6-27b"
    )
    p.add_argument(
        "--model-dir", help="HF checkpoint directory or .gguf file (instead of a preset)"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on GPU, fp32 on CPU"
    )
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--warmup-requests", type=int, default=None, help="default: --concurrency")
    p.add_argument("--warmup-max-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument(
        "--kv-blocks", type=int, default=None, help="default: room for every request in flight"
    )
    p.add_argument(
        "--respect-eos", action="store_true", help="stop at EOS (default: always emit max tokens)"
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the JSON report here")
    args = p.parse_args(argv)
    if args.dtype is None:
        args.dtype = "fp32" if args.device == "cpu" else "bf16"
    if args.threads:
        torch.set_num_threads(args.threads)

    load_start = time.perf_counter()
    model, model_name = build_model(args)
    load_s = time.perf_counter() - load_start
    max_model_len = args.prompt_len + args.max_tokens
    blocks_per_seq = -(-max_model_len // args.block_size)
    engine = LLMEngine(
        model,
        None,
        EngineConfig(
            block_size=args.block_size,
            num_kv_blocks=args.kv_blocks or blocks_per_seq * args.concurrency,
            max_num_seqs=args.concurrency,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_model_len,
            device=args.device,
        ),
    )
    vocab = model.config.vocab_size
    rng = random.Random(args.seed)
    params = SamplingParams(
        temperature=0, max_tokens=args.max_tokens, ignore_eos=not args.respect_eos
    )

    warm = args.warmup_requests if args.warmup_requests is not None else args.concurrency
    if warm:
        warm_params = SamplingParams(
            temperature=0, max_tokens=args.warmup_max_tokens, ignore_eos=True
        )
        run_round(
            engine, random_prompts(warm, args.prompt_len, vocab, rng), args.concurrency, warm_params
        )

    repeats = []
    for i in range(args.repeats):
        prompts = random_prompts(args.num_requests, args.prompt_len, vocab, rng)
        r = run_round(engine, prompts, args.concurrency, params)
        repeats.append(r)
        print(
            f"repeat {i + 1}/{args.repeats}: {r.output_tok_s:9.1f} tok/s  wall {r.wall_s:7.2f} s  "
            f"{r.completion_tokens} tokens  preemptions {r.preemptions}",
            file=sys.stderr,
        )

    ttft = [t for r in repeats for t in r.ttft_s]
    e2e = [t for r in repeats for t in r.e2e_s]
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    device_name = (
        torch.cuda.get_device_name(engine.runner.device)
        if engine.runner.device.type == "cuda"
        else platform.processor() or platform.machine()
    )
    report: dict[str, Any] = {
        "model": model_name,
        "device": str(engine.runner.device),
        "device_name": device_name,
        "dtype": args.dtype,
        "load_point": {
            "num_requests": args.num_requests,
            "concurrency": args.concurrency,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "warmup_requests": warm,
        },
        "engine": {
            "block_size": args.block_size,
            "num_kv_blocks": engine.block_manager.num_blocks,
            "max_num_batched_tokens": args.max_num_batched_tokens,
        },
        "output_tok_s": median(r.output_tok_s for r in repeats),
        "output_tok_s_repeats": [r.output_tok_s for r in repeats],
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p95_s": percentile(ttft, 95),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p95_s": percentile(e2e, 95),
        "completion_tokens": sum(r.completion_tokens for r in repeats),
        "preemptions": sum(r.preemptions for r in repeats),
        "weights_gib": weights / GIB,
        "weights_bytes": weights,
        "kv_bytes_per_token": engine.kv_bytes_per_token(),
        "deltanet_state_bytes_per_sequence": engine.state_bytes_per_sequence(),
        "load_s": load_s,
        "repeats": [
            {k: v for k, v in asdict(r).items() if k not in ("ttft_s", "e2e_s")} for r in repeats
        ],
        "torch": torch.__version__,
    }
    print_table(report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return report


def print_table(r: dict[str, Any]) -> None:
    rows = [
        ("model", r["model"]),
        ("device", f"{r['device']} ({r['device_name']}), {r['dtype']}"),
        (
            "load point",
            "{num_requests} req, concurrency {concurrency}, {prompt_len} + {max_tokens} tokens, "
            "{repeats} repeats".format(**r["load_point"]),
        ),
        (
            "output tok/s (median)",
            f"{r['output_tok_s']:.1f}" if r["output_tok_s"] is not None else "-",
        ),
        ("TTFT p50 / p95", f"{r['ttft_p50_s']:.3f} / {r['ttft_p95_s']:.3f} s"),
        ("end-to-end p50 / p95", f"{r['e2e_p50_s']:.3f} / {r['e2e_p95_s']:.3f} s"),
        ("weights", f"{r['weights_gib']:.4g} GiB"),
        ("KV per token", f"{r['kv_bytes_per_token']:,} B"),
        ("DeltaNet state per sequence", f"{r['deltanet_state_bytes_per_sequence']:,} B"),
        ("preemptions", str(r["preemptions"])),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
