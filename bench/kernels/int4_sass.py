"""Static cost of the int4 decode GEMVs: each compiled for sm_90 without a GPU, the instructions
of its main loop counted in the SASS (triton's bundled ptxas and cuobjdump).

    python3 bench/kernels/int4_sass.py                 # any machine with triton; ~1 minute on 2 cores

Per kernel and tiling: registers, the loop's instruction count per step and per weight code
(per thread), and the instruction classes that dominate it (unpacking: LOP3/SHF/PRMT/HADD2;
mma; shared-memory reads of the weight: LDS/LDSM). A decode GEMV streams ~16 bytes of weight
per SM and clock at the H200's copy bandwidth, so the instructions per code bound how close to
it a kernel can come; compare with bench/kernels/int4_variants.py's measured times.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from worker.kernels.triton import int4_gemm, int4_gemv  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
COMMON = dict(
    scales="*fp16", mins="*fp16", bias="*fp16", out="*bf16", partial="*fp32", arrivals="*i32",
    M="i32", N="i32", K="i32", k_per_split="i32", splits="i32", stride_xm="i32",
)  # fmt: skip
NOT_DIVISIBLE = ("M", "splits")  # per-step sizes: the launcher does not specialize them


def compile_sass(fn: Any, sig: dict[str, str], consts: dict[str, Any], warps: int,
                 stages: int) -> tuple[str, int]:  # fmt: skip
    names = list(fn.arg_names)
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in sig if k not in NOT_DIVISIBLE}
    src = ASTSource(
        fn=fn, signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts, attrs=attrs
    )
    compiled = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run(
            [str(BIN / "cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True
        ).stdout
        res = subprocess.run(
            [str(BIN / "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True
        ).stdout
    regs = re.findall(r"REG:(\d+)", res)
    return sass, int(regs[0]) if regs else -1


def main_loop(sass: str) -> collections.Counter[str]:
    """Opcode counts of the longest backward-branch body (the K loop)."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    index = {a: i for i, (a, _) in enumerate(ins)}
    best: collections.Counter[str] = collections.Counter()
    for i, (a, text) in enumerate(ins):
        m = re.search(r"BRA .*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in index:
            body = ins[index[int(m.group(1), 16)] : i + 1]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for _, t in body)
            if sum(ops.values()) > sum(best.values()):
                best = ops
    return best


def cases() -> list[tuple[str, Any, dict[str, str], dict[str, Any], int, int, int]]:
    """(label, kernel, signature, constexprs, warps, stages, codes per program and step)."""
    out = []
    old_sig = {"x": "*bf16", "qw": "*u8", **COMMON, "stride_qn": "i32"}
    old_sig.update(stride_sn="i32", stride_om="i32")
    for bn, bk, warps in ((64, 128, 2), (64, 256, 2)):
        consts = dict(
            BM=16, BN=bn, BK=bk, KS=128, GROUP=128, HAS_MINS=False, HAS_BIAS=False, SPLIT=True,
            EVEN_K=True, XMODE=1, DOT=tl.bfloat16, FAST=2, MAGIC=0x4300, MAGIC_F=128.0, PDL=False,
        )  # fmt: skip
        out.append((f"today {bn}x{bk}w{warps}", int4_gemm._int4_gemv_kernel.compiled, old_sig,
                    consts, warps, 3, bn * bk))  # fmt: skip
    for mode, bm, bn, warps in (
        ("dot", 16, 64, 2), ("pairs", 16, 64, 2), ("pairs-xa", 16, 64, 2), ("halves", 16, 64, 2),
        ("halves", 16, 128, 4), ("halves", 16, 128, 2), ("halves-biased", 16, 64, 2),
        ("halves-biased", 16, 128, 2), ("halves-biased", 16, 128, 4),
        ("fma", 1, 64, 2), ("fma", 4, 64, 2),
    ):  # fmt: skip
        halves = mode.startswith("halves")
        biased = mode == "halves-biased"
        sig = {"x": "*bf16", "words": "*i16" if halves else "*i32", **COMMON}
        sig.update(stride_wn="i32", stride_sn="i32", stride_om="i32", stride_xs="i32")
        sig["xsums"] = "*fp32"
        asm = {f"ASM{j}": "" for j in range(4)}
        if halves:
            asm = {
                f"ASM{j}": int4_gemv.half_pair_ptx(4 * j, torch.bfloat16, True, biased)
                for j in range(4)
            }
        consts = dict(
            BM=bm, BN=bn, BLOCKS=1, GROUP=128, WORDS=16, HAS_MINS=False, HAS_BIAS=False,
            SPLIT=True, FMA=mode == "fma", PAIRS=mode not in ("dot", "fma"),
            XA=mode == "pairs-xa", HALVES=halves, BIASED=biased, MAGIC_F=128.0, **asm, DOT=tl.bfloat16, FAST=True, PDL=False,
        )  # fmt: skip
        out.append((f"{mode} M<={bm} {bn}x128w{warps}", int4_gemv._plane_gemv_kernel.compiled,
                    sig, consts, warps, 3, bn * 128))  # fmt: skip
    return out


GROUPS = {
    "unpack": ("LOP3", "SHF", "PRMT", "HADD2.BF16", "IMAD.SHL", "IMAD.MOV", "MOV"),
    "mma": ("HMMA", "HGMMA"),
    "fma": ("FFMA",),
    "smem": ("LDS", "LDSM"),
    "gmem": ("LDG", "LDGSTS"),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.parse_args(argv)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    print(f"triton {triton.__version__}, sm_90")
    head = f"{'kernel':28} {'regs':>4} {'loop':>5} {'/code':>6}"
    print(head + "  " + " ".join(f"{g:>6}" for g in GROUPS))
    for label, fn, sig, consts, warps, stages, codes in cases():
        try:
            sass, regs = compile_sass(fn, sig, consts, warps, stages)
        except Exception as exc:  # one kernel's failure is reported, the others run
            print(f"{label:28} failed: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        ops = main_loop(sass)
        total = sum(ops.values())
        per_code = total / (codes / (32 * warps))
        cells = [sum(n for op, n in ops.items() if op.startswith(g)) for g in GROUPS.values()]
        line = f"{label:28} {regs:4d} {total:5d} {per_code:6.2f}  "
        print(line + " ".join(f"{c:6d}" for c in cells))


if __name__ == "__main__":
    main()
