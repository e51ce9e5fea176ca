"""The decode GEMV kernel (`fp8_gemm._gemv_kernel`) compiled ahead of time for sm_90, no GPU needed.

The CPU suite runs the kernel under triton's interpreter, which does not type-check: a kernel
that the interpreter runs correctly can still fail to compile on the GPU (a loop-carried local
that reused the pointer argument `x_scale`'s name compiled only on CPU). So every constexpr
variant that `w8_gemv` launches on a Hopper GPU is compiled here with the arguments' types as
the launcher specializes them: the code paths (W8A16, W8A8 per K step, W8A8 with x quantized per
token, split K, bias, ragged K, PDL off, 16-bit weights) at their default and preset tilings, and
every GEMV tiling of the shipped H200 tuning file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("triton")

import triton  # noqa: E402

from worker.kernels import tuning  # noqa: E402
from worker.kernels.triton.fp8_gemm import (  # noqa: E402
    BF16_DECODE_TILINGS,
    DecodeTiling,
    default_tiling,
)

ROOT = Path(__file__).resolve().parents[2]

# Compiles each variant of argv[1] (a JSON list) for sm_90; prints one line per variant and
# exits 1 naming the ones that failed, with their errors on stderr. In a fresh interpreter: the
# test process may have imported triton in interpreter mode, whose functions cannot compile.
_COMPILE_FOR_HOPPER = """
import json, sys, time, traceback
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from worker.kernels.triton.fp8_gemm import _gemv_kernel

failed = []
for v in json.loads(sys.argv[1]):
    fp8, split, per_token = v["fp8"], v["split"], v["x_per_token"]
    weight = "*fp8e4nv" if fp8 else "*bf16"
    # what w8_gemv passes: unused pointer arguments are `out` or the weight
    pointers = {"x": "*fp8e4nv" if per_token else "*bf16",
                "x_scale": "*fp32" if per_token else "*bf16",
                "w": weight, "scale": "*fp32" if fp8 else weight,
                "bias": "*bf16" if v["bias"] else weight, "out": "*bf16",
                "partial": "*fp32" if split else "*bf16", "arrivals": "*i32" if split else "*bf16"}
    sizes = ["M", "N", "K", "k_per_split", "splits", "stride_xm", "stride_wn", "stride_om"]
    constexprs = dict(BM=v["bm"], BN=v["bn"], BK=v["bk"], SPLIT=split, HAS_SCALE=fp8,
                      HAS_BIAS=v["bias"], EVEN_K=v["even_k"],
                      DOT=tl.float16 if fp8 else tl.bfloat16, ACT_FP8=v["act_fp8"],
                      X_PER_TOKEN=per_token, FP8_DOT=True, PDL=v["pdl"])
    signature = {**pointers, **dict.fromkeys(sizes, "i32"),
                 **dict.fromkeys(constexprs, "constexpr")}
    names = list(signature)
    # the launcher's specialization: 16-byte aligned pointers, sizes and strides that are
    # multiples of 16 (M and splits are never specialized); a ragged K leaves K and the input
    # row strides unaligned
    aligned = [*pointers, "N", "k_per_split", "stride_om"]
    if v["even_k"]:
        aligned += ["K", "stride_xm", "stride_wn"]
    source = ASTSource(
        fn=_gemv_kernel.compiled,
        signature=signature,
        constexprs={(names.index(k),): c for k, c in constexprs.items()},
        attrs={(names.index(k),): [["tt.divisibility", 16]] for k in aligned},
    )
    began = time.monotonic()
    try:
        triton.compile(source, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": v["warps"], "num_stages": v["stages"]})
    except Exception:
        failed.append(v["label"])
        print(f"--- {v['label']} failed:", traceback.format_exc()[-4000:], file=sys.stderr)
        continue
    print(f"{v['label']}: {time.monotonic() - began:.1f}s", flush=True)
if failed:
    print("failed to compile:", *failed, sep="\\n  ", file=sys.stderr)
    sys.exit(1)
"""


def launch_variant(
    label: str,
    tiling: DecodeTiling,
    rows: int,
    k: int,
    fp8: bool = True,
    bias: bool = False,
    pdl: bool = True,
) -> dict[str, Any] | None:
    """The constexprs and launch options `w8_gemv` gives `_gemv_kernel` on a GPU for `rows` rows
    of K = `k` (None where it launches another kernel: two-pass or stream-K)."""
    bm = 16 if rows <= 16 else triton.next_power_of_2(rows)
    if bm == 16 and (tiling.two_pass or (tiling.stream_k and k % tiling.bk == 0)):
        return None
    k_per_split = triton.cdiv(triton.cdiv(k, tiling.splits), tiling.bk) * tiling.bk
    act_fp8 = fp8 and tiling.act_fp8
    return {
        "label": label,
        "fp8": fp8,
        "bm": bm,
        "bn": tiling.bn,
        "bk": tiling.bk,
        "split": triton.cdiv(k, k_per_split) > 1,
        "even_k": k % tiling.bk == 0,
        "act_fp8": act_fp8,
        "x_per_token": act_fp8 and tiling.x_per_token,
        "bias": bias,
        "pdl": pdl,
        "warps": tiling.num_warps,
        "stages": tiling.num_stages,
    }


def code_path_variants() -> list[dict[str, Any] | None]:
    """One or more variants of each path through the kernel, at Qwen3.6-27B decode shapes."""
    w8a8_per_token = DecodeTiling(128, 128, 3, 8, 4, act_fp8=True, x_per_token=True)
    return [
        launch_variant("w8a16 (default q|k|v)", default_tiling(14336, 5120), 1, 5120),
        launch_variant("w8a16 split K (default MLP down)", default_tiling(5120, 17408), 1, 17408),
        launch_variant("w8a16 64 channels (default gate|up)", default_tiling(34816, 5120), 1, 5120),
        launch_variant("w8a16 32 rows, split K", DecodeTiling(64, 256, 2, 4, 4), 32, 5120),
        launch_variant("w8a8 per K step (default LM head)", default_tiling(248320, 5120), 1, 5120),
        launch_variant(
            "w8a8 per K step, 64 rows, split K",
            DecodeTiling(128, 256, 3, 8, 4, act_fp8=True),
            64,
            17408,
        ),
        launch_variant("w8a8 x per token, 32 rows, split K", w8a8_per_token, 32, 5120),
        launch_variant(
            "w8a8 x per token, 16 rows",
            DecodeTiling(64, 128, 1, 4, 2, act_fp8=True, x_per_token=True),
            8,
            5120,
        ),
        *(
            launch_variant(f"bf16 {n}x{k} (preset)", t, 1, k, fp8=False)
            for (n, k), t in BF16_DECODE_TILINGS.items()
        ),
        launch_variant(
            "w8a16 bias, ragged K, split, PDL off",
            DecodeTiling(32, 256, 2, 2, 4),
            5,
            5000,
            bias=True,
            pdl=False,
        ),
        launch_variant(
            "w8a8 ragged K, split", DecodeTiling(64, 128, 2, 4, 3, act_fp8=True), 3, 5000
        ),
        launch_variant("bf16 bias", DecodeTiling(64, 128, 1, 4, 3), 1, 5120, fp8=False, bias=True),
    ]


def h200_tuning_variants() -> list[dict[str, Any] | None]:
    """Every GEMV tiling of the shipped H200 tuning file, at its shape."""
    data = tuning.read(tuning.HERE / "nvidia-h200.json")
    out = []
    for table, fp8 in (
        ("fp8_decode_tilings", True),
        ("fp8_wide_decode_tilings", True),
        ("bf16_decode_tilings", False),
    ):
        for key, fields in (data.get(table) or {}).items():
            _, k, *bucket = (int(part) for part in key.split("x"))  # wide: NxKxrows
            rows = bucket[0] if bucket else 1
            out.append(launch_variant(f"{table} {key}", DecodeTiling(**fields), rows, k, fp8=fp8))
    return out


def unique(variants: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
    """Variants that compile to different kernels (the first label of each)."""
    seen: dict[str, dict[str, Any]] = {}
    for v in variants:
        if v is not None:
            seen.setdefault(json.dumps({**v, "label": None}, sort_keys=True), v)
    return list(seen.values())


def test_gemv_kernel_compiles_for_hopper(tmp_path: Path) -> None:
    """Every `_gemv_kernel` variant compiles for sm_90 (a fresh triton cache: nothing is taken
    from an earlier run)."""
    variants = unique(code_path_variants() + h200_tuning_variants())
    # each path (fp8 weights, W8A8, x per token) is compiled whole and split
    covered = {(v["fp8"], v["act_fp8"], v["x_per_token"], v["split"]) for v in variants}
    for path in [
        (True, False, False),
        (True, True, False),
        (True, True, True),
        (False, False, False),
    ]:
        assert {(*path, False), (*path, True)} <= covered, path
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_HOPPER, json.dumps(variants)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    assert done.stdout.count("\n") == len(variants), done.stdout


# The down projection's input: silu(gate) * up rounded to e4m3 per row in one kernel.
_COMPILE_SILU_QUANT_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from worker.kernels.triton.fp8_gemm import _silu_mul_quantize_rows_kernel

signature = {"y": "*bf16", "q": "*fp8e4nv", "scales": "*fp32", "F": "i32", "stride_y": "i32",
             "BK": "constexpr", "FP8_MAX": "constexpr", "EXACT_E4M3": "constexpr",
             "PDL": "constexpr", "PAIRED": "constexpr"}
names = list(signature)
for paired in (0, 16):  # FP8's gate|up halves, int4-mma's paired tiles
    constexprs = {"BK": 4096, "FP8_MAX": 448.0, "EXACT_E4M3": False, "PDL": True, "PAIRED": paired}
    source = ASTSource(
        fn=_silu_mul_quantize_rows_kernel.compiled,
        signature=signature,
        constexprs={(names.index(k),): c for k, c in constexprs.items()},
        attrs={(names.index(k),): [["tt.divisibility", 16]] for k in ("y", "q", "scales", "F")},
    )
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
print("ok")
"""


# A DeltaNet decode step's conv update with its gates, from a, b or with their logits b|a formed
# in the same launch (BA).
_COMPILE_CONV_UPDATE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from worker.kernels.triton.conv1d import BA_COLUMNS, _conv_update_kernel

signature = {"x": "*bf16", "weight": "*bf16", "bias": "*bf16", "conv_state": "*bf16",
             "state_slots": "*i64", "out": "*bf16", "stride_xb": "i32", "C": "i32",
             "K": "constexpr", "KP": "constexpr", "BC": "constexpr", "HAS_BIAS": "constexpr",
             "SILU": "constexpr", "GATES": "constexpr", "gate_a": "*bf16", "gate_b": "*bf16",
             "A_log": "*fp32", "dt_bias": "*fp32", "g": "*fp32", "beta": "*bf16", "H": "i32",
             "stride_a": "i32", "stride_b": "i32", "BH": "constexpr", "BA": "constexpr",
             "hidden": "*bf16", "ba_weight": "*bf16", "HIDDEN": "i32", "stride_hidden": "i32",
             "stride_ba": "i32", "NCB": "i32", "BK": "constexpr", "PDL": "constexpr",
             "EARLY_RELEASE": "constexpr"}
names = list(signature)
for ba, early in ((False, False), (True, False), (True, True)):
    constexprs = {"K": 4, "KP": 4, "BC": 256, "HAS_BIAS": False, "SILU": True, "GATES": True,
                  "BH": 64, "BA": ba, "BK": BA_COLUMNS, "PDL": True, "EARLY_RELEASE": early}
    source = ASTSource(
        fn=_conv_update_kernel.compiled,
        signature=signature,
        constexprs={(names.index(k),): c for k, c in constexprs.items()},
        attrs={(names.index(k),): [["tt.divisibility", 16]]
               for k in ("x", "weight", "conv_state", "out", "hidden", "ba_weight", "C",
                         "stride_xb", "HIDDEN", "stride_hidden", "stride_ba")},
    )
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
print("ok")
"""


def test_conv_update_with_gates_compiles_for_hopper(tmp_path: Path) -> None:
    assert compile_in_a_fresh_interpreter(_COMPILE_CONV_UPDATE_FOR_HOPPER, tmp_path) == "ok\n"


# An attention layer's q/k norms and rotary, alone and writing k and v into an fp8 paged cache.
_COMPILE_QK_NORM_ROTARY_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from worker.kernels.triton.rotary import _qk_norm_rotary_kernel

signature = {"q": "*bf16", "k": "*bf16", "q_weight": "*bf16", "k_weight": "*bf16",
             "positions": "*i64", "cos": "*fp32", "sin": "*fp32", "q_out": "*bf16",
             "k_out": "*bf16", "HQ": "i32", "HK": "i32", "D": "i32", "stride_qt": "i32",
             "stride_qh": "i32", "stride_kt": "i32", "stride_kh": "i32", "stride_table": "i32",
             "eps": "fp32", "HALF": "constexpr", "BH": "constexpr", "BD": "constexpr",
             "UNIT_OFFSET": "constexpr", "WRITE_KV": "constexpr", "v": "*bf16",
             "k_cache": "*fp8e4nv", "v_cache": "*fp8e4nv", "slot_mapping": "*i64",
             "stride_vt": "i32", "stride_vh": "i32", "inv_k_scale": "fp32",
             "inv_v_scale": "fp32", "PDL": "constexpr"}
names = list(signature)
for write_kv in (False, True):
    constexprs = {"HALF": 32, "BH": 32, "BD": 256, "UNIT_OFFSET": True, "WRITE_KV": write_kv,
                  "PDL": True}
    source = ASTSource(
        fn=_qk_norm_rotary_kernel.compiled,
        signature=signature,
        constexprs={(names.index(k),): c for k, c in constexprs.items()},
        attrs={(names.index(k),): [["tt.divisibility", 16]]
               for k in ("q", "k", "q_out", "k_out", "v", "k_cache", "v_cache", "D",
                         "stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt",
                         "stride_vh")},
    )
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
print("ok")
"""


def test_qk_norm_rotary_compiles_for_hopper(tmp_path: Path) -> None:
    assert compile_in_a_fresh_interpreter(_COMPILE_QK_NORM_ROTARY_FOR_HOPPER, tmp_path) == "ok\n"


def compile_in_a_fresh_interpreter(script: str, tmp_path: Path) -> str:
    """Run `script` (it compiles for sm_90 and prints) where triton is not in interpreter mode;
    its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_silu_mul_quantize_rows_compiles_for_hopper(tmp_path: Path) -> None:
    assert compile_in_a_fresh_interpreter(_COMPILE_SILU_QUANT_FOR_HOPPER, tmp_path) == "ok\n"


# The W4A8 prefill GEMM at its default tiling: e4m3 operands on Hopper's FP8 tensor cores.
_COMPILE_W4A8_FOR_HOPPER = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from worker.kernels.triton.int4_gemm import W4A8_TILING as t, _w4a8_gemm_kernel

signature = {"a": "*fp8e4nv", "a_scale": "*fp32", "w": "*fp8e4nv", "w_scale": "*fp16",
             "bias": "*bf16", "out": "*bf16", "M": "i32", "N": "i32", "K": "i32",
             "stride_am": "i32", "stride_wn": "i32", "stride_om": "i32", "s_tile": "i32",
             "s_group": "i32", "s_row": "i32", "GROUP": "constexpr", "HAS_BIAS": "constexpr",
             "BM": "constexpr", "BN": "constexpr", "BK": "constexpr", "GROUP_M": "constexpr",
             "FP8_DOT": "constexpr", "DOT": "constexpr"}
names = list(signature)
constexprs = {"GROUP": 128, "HAS_BIAS": False, "BM": t.bm, "BN": t.bn, "BK": t.bk,
              "GROUP_M": t.group_m, "FP8_DOT": True, "DOT": tl.bfloat16}
divisible = ("a", "a_scale", "w", "w_scale", "out", "N", "K", "stride_am", "stride_wn",
             "stride_om", "s_tile", "s_group")
source = ASTSource(
    fn=_w4a8_gemm_kernel.compiled,
    signature=signature,
    constexprs={(names.index(k),): c for k, c in constexprs.items()},
    attrs={(names.index(k),): [["tt.divisibility", 16]] for k in divisible},
)
compiled = triton.compile(
    source, target=GPUTarget("cuda", 90, 32),
    options={"num_warps": t.num_warps, "num_stages": t.num_stages},
)
ptx = compiled.asm["ptx"]
print("wgmma e4m3" if "wgmma.mma_async" in ptx and "e4m3" in ptx else "no wgmma e4m3")
print(compiled.metadata.shared)
"""


def test_w4a8_gemm_compiles_to_fp8_wgmma_for_hopper(tmp_path: Path) -> None:
    lines = compile_in_a_fresh_interpreter(_COMPILE_W4A8_FOR_HOPPER, tmp_path).splitlines()
    assert lines[0] == "wgmma e4m3", lines
    assert int(lines[1]) <= 227 * 1024, f"{lines[1]} bytes of shared memory: past an SM's"


# The 17-64-row W4A8 GEMV: codes to e4m3 in registers, channels on wgmma's M side, x's rows on N.
_COMPILE_W4A8_WIDE_FOR_HOPPER = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from worker.kernels.triton.int4_gemm import _w4a8_wide_kernel

signature = {"a": "*fp8e4nv", "a_scale": "*fp32", "qw": "*u8", "scales": "*fp16",
             "bias": "*bf16", "out": "*bf16", "partial": "*fp32", "arrivals": "*i32",
             "M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32", "stride_am": "i32",
             "stride_qn": "i32", "stride_sn": "i32", "stride_om": "i32", "GROUP": "constexpr",
             "HAS_BIAS": "constexpr", "BM": "constexpr", "BN": "constexpr", "BK": "constexpr",
             "SPLIT": "constexpr", "FP8_DOT": "constexpr", "DOT": "constexpr",
             "FAST": "constexpr", "PDL": "constexpr"}
names = list(signature)
divisible = ("a", "a_scale", "qw", "scales", "out", "partial", "arrivals", "N", "K",
             "k_per_split", "stride_am", "stride_qn", "stride_sn", "stride_om")
for bm, split, bn in ((32, False, 64), (64, True, 64), (64, False, 128)):
    constexprs = {"GROUP": 128, "HAS_BIAS": split, "BM": bm, "BN": bn, "BK": 128,
                  "SPLIT": split, "FP8_DOT": True, "DOT": tl.bfloat16, "FAST": 2, "PDL": True}
    source = ASTSource(
        fn=_w4a8_wide_kernel.compiled,
        signature=signature,
        constexprs={(names.index(k),): c for k, c in constexprs.items()},
        attrs={(names.index(k),): [["tt.divisibility", 16]] for k in divisible},
    )
    ptx = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3}
    ).asm["ptx"]
    print(f"m64n{bm}k32.f32.e4m3" in ptx and ".local" not in ptx)
"""


def test_w4a8_wide_compiles_to_fp8_wgmma_for_hopper(tmp_path: Path) -> None:
    assert compile_in_a_fresh_interpreter(_COMPILE_W4A8_WIDE_FOR_HOPPER, tmp_path) == "True\n" * 3
