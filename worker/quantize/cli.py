"""`tokenmill quantize SRC DST`: an int4 checkpoint from an HF safetensors directory or a GGUF
file (docs/performance.md, "Quantization").

    tokenmill quantize SRC DST [--scheme w4-g128[-sym|-asym]] [--method rtn|gptq]
        [--calibration-tokens N] [--lm-head fp8|int4|bf16] [--[no-]act-order]
        [--device cpu|cuda] [--force]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from worker.models.int4 import Int4Tensors
from worker.quantize.checkpoint import CheckpointError, Source, open_source, write_quantized
from worker.quantize.scheme import INT4, LM_HEAD_MODES, METHODS, Scheme

DEFAULT_CALIBRATION_TOKENS = 65_536
CALIBRATION_SEQ_LEN = 512


def _bar(items: Iterator[str], total: int, desc: str) -> Iterator[str]:
    from tqdm import tqdm

    bar = tqdm(items, total=total, desc=desc, unit="tensor", file=sys.stderr, dynamic_ncols=True)
    for item in bar:
        bar.set_postfix_str(item[-48:], refresh=False)
        yield item


def calibration_sequences(tokenizer_encode: object, tokens: int, seq_len: int) -> list[list[int]]:
    """`tokens` tokens of the calibration text in sequences of `seq_len`."""
    from worker.quantize.perplexity import calibration_text, windows

    assert callable(tokenizer_encode)
    ids = tokenizer_encode(calibration_text())
    seqs = [w for w in windows(ids, seq_len) if len(w) == seq_len][: max(1, tokens // seq_len)]
    if len(seqs) * seq_len < tokens:
        print(
            f"calibration text gives {len(seqs) * seq_len} tokens (asked for {tokens})",
            file=sys.stderr,
        )
    return seqs


def run_gptq(
    source: Source,
    scheme: Scheme,
    tokens: int,
    device: str,
    act_order: bool = True,
    progress: bool = True,
) -> dict[str, Int4Tensors]:
    """GPTQ results for every int4 module of `source` (our module names)."""
    from worker.loading.safetensors import load_hf_model
    from worker.quantize.gptq import gptq_model
    from worker.tokenizer import Tokenizer

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if source.model is not None:  # GGUF: already dequantized
        model = source.model.to(device=device, dtype=dtype)
        tokenizer = Tokenizer.from_gguf(source.path)
    else:
        model = load_hf_model(source.path, device, dtype)
        tokenizer = Tokenizer.from_pretrained(source.path)
    targets = {
        name[: -len(".weight")]
        for name, p in model.named_parameters()
        if scheme.kind(name, tuple(p.shape)) == INT4
    }
    seqs = calibration_sequences(tokenizer.encode, tokens, CALIBRATION_SEQ_LEN)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(targets), desc="gptq", unit="linear", file=sys.stderr)
    results = gptq_model(
        model,
        seqs,
        targets,
        scheme.group_size,
        scheme.symmetric,
        act_order=act_order,
        progress=None if bar is None else (lambda name: bar.update(1)),
    )
    if bar is not None:
        bar.close()
    if source.model is not None:
        source.model = None  # the fake-quantized copy is not the source any more
    return {name: _to_cpu(q) for name, q in results.items()}


def _to_cpu(q: Int4Tensors) -> Int4Tensors:
    mins = None if q.mins is None else q.mins.cpu()
    return Int4Tensors(q.qweight.cpu(), q.scales.cpu(), mins, q.group_size)


def partial_path(dst: Path) -> Path:
    """Where a run builds its output before the final rename (a sibling, so the rename is
    atomic on one filesystem)."""
    return dst.parent / f".{dst.name}.partial"


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    scheme: Scheme,
    method: str = "rtn",
    calibration_tokens: int = DEFAULT_CALIBRATION_TOKENS,
    force: bool = False,
    device: str = "cpu",
    act_order: bool = True,
    progress: bool = True,
    shard_bytes: int | None = None,
) -> Path:
    """Quantize `src` into the directory `dst`; nothing is left at `dst` (nor beside it) unless
    the whole checkpoint was written."""
    dst = Path(dst)
    if method not in METHODS:
        raise CheckpointError(f"unknown method {method!r}; known: {METHODS}")
    if dst.exists() and not force:
        raise CheckpointError(f"{dst} exists (pass --force to replace it)")
    source = open_source(src)  # checks every tensor before anything is written
    work = partial_path(dst)
    shutil.rmtree(work, ignore_errors=True)  # what a killed earlier run left
    work.mkdir(parents=True)
    try:
        computed = None
        if method == "gptq":
            computed = run_gptq(source, scheme, calibration_tokens, device, act_order, progress)
        extra = {} if shard_bytes is None else {"shard_bytes": shard_bytes}
        write_quantized(
            source,
            work,
            scheme,
            method,
            computed,
            device=device,
            progress=(lambda it, n: _bar(it, n, "write")) if progress else None,
            **extra,  # type: ignore[arg-type]
        )
        if dst.exists():
            old = dst.parent / f".{dst.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            dst.rename(old)
            work.rename(dst)
            shutil.rmtree(old)
        else:
            work.rename(dst)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tokenmill quantize",
        description="Write an int4 checkpoint (docs/performance.md, Quantization).",
    )
    parser.add_argument("src", type=Path, help="HF checkpoint directory or .gguf file")
    parser.add_argument("dst", type=Path, help="output directory")
    parser.add_argument("--scheme", default="w4-g128", help="w4-g<group>[-sym|-asym]")
    parser.add_argument("--method", choices=METHODS, default="rtn")
    parser.add_argument(
        "--calibration-tokens",
        type=int,
        default=DEFAULT_CALIBRATION_TOKENS,
        help=f"GPTQ calibration tokens (default {DEFAULT_CALIBRATION_TOKENS})",
    )
    parser.add_argument("--lm-head", choices=LM_HEAD_MODES, default="fp8")
    parser.add_argument(
        "--act-order",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="GPTQ quantizes columns in decreasing Hessian diagonal order (default on)",
    )
    parser.add_argument("--device", default="cpu", help="where to quantize (cpu, cuda)")
    parser.add_argument("--force", action="store_true", help="replace an existing DST")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    try:
        scheme = Scheme.parse(args.scheme, args.lm_head)
    except ValueError as e:
        parser.error(str(e))
    start = time.monotonic()
    try:
        out = quantize_checkpoint(
            args.src,
            args.dst,
            scheme,
            args.method,
            args.calibration_tokens,
            force=args.force,
            device=args.device,
            act_order=args.act_order,
            progress=not args.quiet,
        )
    except CheckpointError as e:
        print(f"tokenmill quantize: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
