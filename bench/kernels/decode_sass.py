"""The attention decode kernels' main loops as sm_90 SASS, counted without a GPU: FP8 KV's paged
decode and the staged decode's variants (and the staged direct prefill) are compiled ahead of
time for Hopper (triton's own ptxas, cuobjdump), each loop found by its backward branch, and
its instructions counted for one warp: all of them, those a tile of codes only runs (staged),
per 64 tokens (keys, for the prefill) for all warps, by region between the loop's branches, and
by opcode. With the registers, the stack bytes a thread spills to, the shared memory, and the
CTAs an SM holds.

    PYTHONPATH=. python3 -m bench.kernels.decode_sass [--variants default,tree,...] [--sass DIR]

What it is for: a variant's instruction count before a GPU run predicts the run (the staged
decode runs at ~1 instruction a cycle an SM, docs/performance.md "Staged KV"), and a change
that adds instructions to the loop is seen on a 2-core machine. It does not time anything.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import result_path, write_result

SM90_REGISTERS, SM90_SHARED, SM90_MAX_CTAS = 65536, 228 * 1024, 32
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\b(?:\.\S+)?\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))")


@dataclass(frozen=True)
class Variant:
    """A compile of one kernel: the staged decode's constexprs (`staged_attention_decode`'s
    options), FP8 KV's paged decode (`staged=False`), or the staged direct prefill
    (`prefill=True`, `bm` query rows a program)."""

    staged: bool = True
    bn: int = 64
    warps: int = 4
    stages: int = 2
    lookup: str = "prmt_v3"  # "tree", "prmt" or "prmt_v3"
    words: bool = True
    maxnreg: int | None = None
    prefill: bool = False
    bm: int = 64


# the variants bench/engine/staged_kv.py has timed (docs/performance.md holds both counts)
VARIANTS = {
    "fp8_kv": Variant(staged=False),
    "default": Variant(),
    "prmt": Variant(lookup="prmt"),
    "tree": Variant(lookup="tree"),
    "prmt_bytes": Variant(lookup="prmt", words=False),
    "bn32_r168": Variant(bn=32, stages=1, maxnreg=168),
    "w8": Variant(warps=8),
    # the direct prefill at its tiling (`staged_prefill_tiles`) and at the plain prefill's
    "staged_prefill": Variant(prefill=True, bm=64, bn=32, warps=8),
    "staged_prefill_128x64": Variant(prefill=True, bm=128, bn=64, warps=8),
}


def _source(v: Variant) -> Any:
    import triton.language as tl
    from triton.compiler import ASTSource

    q_and_pages = {"q": "*bf16", "k_cache": "*fp8e4nv", "v_cache": "*fp8e4nv"}
    codes = {
        "k_codes": "*u8",
        "k_norms": "*fp16",
        "v_codes": "*u8",
        "v_norms": "*fp16",
        "k_centroids": "*fp32",
        "v_centroids": "*fp32",
    }
    tables = {"context_lens": "*i32", "block_tables": "*i32"}
    outs = {"part_out": "*fp32", "part_lse": "*fp32", "out": "*bf16"}
    strides = {"stride_qb": "i32", "stride_qh": "i32", "stride_bt": "i32"}
    splits = {"num_splits": "i32", "partition": "i32"}
    shape = dict(HQ=24, HKV=4, D=256, BLOCK_SIZE=16, GP=16, BN=v.bn)
    if v.prefill:
        from worker.kernels.triton.turboquant import _staged_prefill_kernel as kernel

        tables = {"cu_seqlens": "*i32", "context_lens": "*i32", "block_tables": "*i32"}
        pointers = {**q_and_pages, **codes, **tables, "positions": "*i64", "out": "*bf16"}
        scalars = {"qk_scale": "fp32", "k_scale": "fp32", "v_scale": "fp32", "num_recent": "i32"}
        scalars |= {"num_seqs": "i32", "stride_qt": "i32", "stride_qh": "i32", "stride_bt": "i32"}
        strides = {k: "i32" for k in ("stride_qt", "stride_qh", "stride_bt")}
        constexprs: dict[str, Any] = dict(
            HQ=24, HKV=4, D=256, BLOCK_SIZE=16, BM=v.bm, BN=v.bn, SEQS=8, K_BITS=4, V_BITS=3,
            DOT=tl.float16, PRMT=v.lookup != "tree", PRMT_V3=v.lookup == "prmt_v3",
            WORDS3=v.words, PDL=True,
        )  # fmt: skip
    elif v.staged:
        from worker.kernels.triton.turboquant import _staged_decode_kernel as kernel

        pointers = {**q_and_pages, **codes, **tables, **outs}
        scalars = {"softmax_scale": "fp32", "k_scale": "fp32", "v_scale": "fp32"}
        scalars |= {"num_recent": "i32", **strides, **splits}
        constexprs = dict(
            **shape, K_BITS=4, V_BITS=3, SINGLE_SPLIT=False, DOT=tl.float16, STAGES=v.stages,
            PRMT=v.lookup != "tree", PRMT_V3=v.lookup == "prmt_v3", WORDS3=v.words, PDL=True,
        )  # fmt: skip
    else:
        from worker.kernels.triton.paged_attention import _decode_partition_kernel as kernel

        pointers = {**q_and_pages, **tables, **outs}
        scalars = {"softmax_scale": "fp32", "v_scale": "fp32", **strides, **splits}
        constexprs = dict(**shape, SINGLE_SPLIT=False, DOT=tl.float16, PDL=True)
    signature = {**pointers, **scalars, **dict.fromkeys(constexprs, "constexpr")}
    names = list(signature)
    # the launcher's specialization: 16-byte aligned pointers, strides multiples of 16
    aligned = [*pointers, *strides]
    return ASTSource(
        fn=kernel.compiled,
        signature=signature,
        constexprs={(names.index(k),): c for k, c in constexprs.items()},
        attrs={(names.index(k),): [["tt.divisibility", 16]] for k in aligned},
    )


def compile_sass(v: Variant) -> tuple[str, dict[str, Any]]:
    """(SASS text, resources) of the variant compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget

    options: dict[str, Any] = {"num_warps": v.warps}
    if not v.staged or v.prefill:
        options["num_stages"] = 2
    if v.maxnreg:
        options["maxnreg"] = v.maxnreg
    compiled = triton.compile(_source(v), target=GPUTarget("cuda", 90, 32), options=options)
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run(
            [str(tools / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True
        ).stdout
        usage = subprocess.run(
            [str(tools / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True
        ).stdout
    registers = int(re.search(r"REG:(\d+)", usage).group(1))  # type: ignore[union-attr]
    # bytes of stack a thread: where ptxas spills what 255 registers do not hold
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))  # type: ignore[union-attr]
    shared = int(compiled.metadata.shared)
    by_registers = SM90_REGISTERS // (registers * 32 * v.warps)
    by_shared = SM90_SHARED // shared if shared else SM90_MAX_CTAS
    resources = {
        "registers": registers,
        "stack_bytes": stack,
        "shared_bytes": shared,
        "ctas_per_sm": min(by_registers, by_shared, SM90_MAX_CTAS),
        "warps_per_sm": min(by_registers, by_shared, SM90_MAX_CTAS) * v.warps,
    }
    return sass, resources


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction) of the first kernel in `sass`."""
    return [(int(m.group(1), 16), m.group(2)) for m in _LINE.finditer(sass)]


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def main_loop(code: list[tuple[int, str]]) -> dict[str, Any]:
    """The loop closed by the last backward branch: its regions between forward branches that
    stay inside it (a region skipped by its branch, e.g. the FP8 pages' dot on a tile of codes
    only, is counted apart), each with its instruction count and top opcodes."""
    back = [
        (a, int(m.group(1), 16))
        for a, t in code
        if (m := _BRANCH.search(t)) and m.group(1) and int(m.group(1), 16) < a
    ]
    if not back:
        raise ValueError("no backward branch: no loop")
    end, start = max(back)
    body = [(a, t) for a, t in code if start <= a <= end]
    skips = []  # (branch address, target): a forward branch within the body
    for a, t in body:
        m = _BRANCH.search(t)
        if m and m.group(1) and a < int(m.group(1), 16) <= end:
            skips.append((a, int(m.group(1), 16)))
    cuts = sorted({start, end + 1, *(a + 16 for a, _ in skips), *(t for _, t in skips)})
    regions = []
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        part = [t for a, t in body if lo <= a < hi]
        counts = collections.Counter(opcode(t) for t in part)
        skipped_by = [hex(a) for a, t in skips if a < lo and t >= hi]
        regions.append(
            {
                "from": hex(lo),
                "instructions": len(part),
                "skippable": bool(skipped_by),
                "top": dict(counts.most_common(8)),
            }
        )
    return {"start": hex(start), "end": hex(end), "regions": regions}


def analyse(name: str, v: Variant) -> dict[str, Any]:
    sass, resources = compile_sass(v)
    loop = main_loop(instructions(sass))
    total = sum(r["instructions"] for r in loop["regions"])
    counts: collections.Counter[str] = collections.Counter()
    for r in loop["regions"]:
        counts.update(r["top"])
    # A tile of codes only (the bulk of a long context) runs every region but those its
    # branches skip for want of FP8 pages: the staged loop's skippable regions come in source
    # order, codes' K, FP8 K, codes' V, FP8 V. FP8 KV's loop has none.
    always = sum(r["instructions"] for r in loop["regions"] if not r["skippable"])
    skippable = [r["instructions"] for r in loop["regions"] if r["skippable"]]
    executed = always + sum(skippable[0::2]) if v.staged else total
    per_tile = 64 / v.bn  # one warp's instructions per 64 tokens (of keys, for a prefill)
    return {
        "variant": vars(v),
        **resources,
        "loop_instructions": total,
        "executed_per_tile": executed,
        # per 64 tokens, all warps: what the SM issues for one tile of one KV head
        "per_64_tokens_all_warps": executed * per_tile * v.warps,
        "loop": loop,
        "sass": sass,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--sass", help="also write each variant's SASS to this folder")
    p.add_argument("--out", help="folder for the JSON (default $OUT, else bench/results)")
    args = p.parse_args(argv)
    report: dict[str, Any] = {"target": "sm_90 (compiled here, not run)", "variants": {}}
    print(
        "variant | registers | stack bytes | CTAs/SM | loop (one warp) | "
        "a tile of codes (one warp) | per 64 tokens, all warps",
        file=sys.stderr,
    )
    for name in args.variants.split(","):
        result = analyse(name, VARIANTS[name])
        sass = result.pop("sass")
        if args.sass:
            Path(args.sass).mkdir(parents=True, exist_ok=True)
            (Path(args.sass) / f"{name}.sass").write_text(sass)
        report["variants"][name] = result
        print(
            f"{name} | {result['registers']} | {result['stack_bytes']} | {result['ctas_per_sm']} | "
            f"{result['loop_instructions']} | {result['executed_per_tile']} | "
            f"{result['per_64_tokens_all_warps']:.0f}",
            file=sys.stderr,
        )
    path = write_result(result_path("decode_sass", args.out, "sm90"), report)
    print(f"wrote {path}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
