"""Check and time the triton kernels at the Qwen3.6-27B shapes (batch 8) on one GPU.

For each kernel (and a few block-size variants): relative error against its plain-PyTorch
reference on fresh random inputs, time per call, the bytes it must move (each input read once,
each output written once) and so the achieved bandwidth against the copy roofline.

Decode kernels are timed as CUDA-graph replays of many back-to-back calls (which is how the
engine runs them, and which removes the CPU launch cost); prefill kernels, which read sequence
lengths on the host, are timed eagerly with `triton.testing.do_bench` (median); paged prefill
attention reads nothing on the host, so its default tiles are timed both ways. Calls rotate over
several input sets whose total size is several times the L2 cache, so no timing measures L2.

    python -m bench.kernels.triton_kernels     # on a CUDA machine; JSON to $OUT or bench/results/
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.testing

from bench import common
from bench.common import graph_time, rel_err, result_path, write_result
from worker.kernels import reference
from worker.kernels.triton import (
    causal_conv1d_prefill,
    causal_conv1d_update,
    conv_update_with_ba_gates,
    conv_update_with_gates,
    gated_delta_rule_decode,
    gated_delta_rule_prefill,
    gated_rms_norm,
    linear,
    paged_attention_decode,
    paged_attention_prefill,
    qk_norm_rotary,
    qk_norm_rotary_write_kv,
    rms_norm,
    write_kv_cache,
)

ROOFLINE_GBS = 4270.0  # measured copy bandwidth of this H200 (bytes read + written)
L2_BYTES = 60 * 2**20

# Qwen3.6-27B text shape
HIDDEN = 5120
HQ, HKV, HEAD_DIM = 24, 4, 256
HK, HV, DK, DV = 16, 48, 128, 128
CONV_DIM = 2 * HK * DK + HV * DV
CONV_K = 4
BATCH = 8
PROMPT = 512
BLOCK_SIZE = 16
EPS = 1e-6

Inputs = dict[str, Any]


@dataclass
class Case:
    name: str
    shape: str
    make: Callable[[], Inputs]  # one fresh random input set
    run: Callable[[Inputs], Any]  # the triton kernel
    ref: Callable[[Inputs], Any]  # its reference (same signature and effects)
    bytes_moved: int
    flops: int = 0
    graph: bool = True  # decode kernels: captured in a CUDA graph
    mutated: tuple[str, ...] = ()  # inputs the op updates in place (states), compared too
    time_ref: bool = True


@dataclass
class Result:
    name: str
    shape: str
    us: float
    eager_us: float | None
    ref_us: float | None
    mbytes: float
    gbs: float
    roofline_pct: float
    tflops: float | None
    rel_err: float
    state_rel_err: float | None
    extra: dict[str, Any] = field(default_factory=dict)


def clone_inputs(inputs: Inputs) -> Inputs:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def footprint(inputs: Inputs) -> int:
    return sum(v.numel() * v.element_size() for v in inputs.values() if isinstance(v, torch.Tensor))


def input_sets(case: Case) -> list[Inputs]:
    """Enough input sets that cycling through them streams from HBM, not L2."""
    first = case.make()
    count = max(2, min(8, math.ceil(4 * L2_BYTES / max(footprint(first), 1))))
    return [first] + [case.make() for _ in range(count - 1)]


def time_graph(fn: Callable[[Inputs], Any], sets: list[Inputs], calls: int = 64) -> float:
    """Microseconds per call, from replays of one CUDA graph of `calls` back-to-back calls."""
    return 1e6 * graph_time(lambda i: fn(sets[i % len(sets)]), calls, median_replay=True)


def time_eager(fn: Callable[[Inputs], Any], sets: list[Inputs], rep_ms: int = 200) -> float:
    counter = [0]

    def call() -> None:
        fn(sets[counter[0] % len(sets)])
        counter[0] += 1

    return float(triton.testing.do_bench(call, warmup=25, rep=rep_ms, return_mode="median")) * 1000


def graph_matches_eager(case: Case) -> bool:
    """A captured call computes what an eager call computes (no host reads, fixed grid)."""
    inputs = case.make()
    eager_inputs = clone_inputs(inputs)
    expected = case.run(eager_inputs)
    case.run(clone_inputs(inputs))  # compile before capture
    torch.cuda.synchronize()
    captured_inputs = clone_inputs(inputs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = case.run(captured_inputs)
    graph.replay()
    torch.cuda.synchronize()
    same = torch.equal(out, expected)
    for name in case.mutated:
        same = same and torch.equal(captured_inputs[name], eager_inputs[name])
    return same


def kernel_breakdown(fn: Callable[[Inputs], Any], sets: list[Inputs]) -> dict[str, float]:
    """Device microseconds per call of each kernel one call launches (torch profiler)."""
    calls = 4
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fn(sets[i % len(sets)])
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if total:
            times[event.key[:60]] = total / calls
    return dict(sorted(times.items(), key=lambda kv: -kv[1])[:5])


def measure(case: Case) -> Result:
    inputs = case.make()
    mine, theirs = clone_inputs(inputs), clone_inputs(inputs)
    out = case.run(mine)
    expected = case.ref(theirs)
    torch.cuda.synchronize()
    err = rel_err(out, expected)
    state_err = max((rel_err(mine[n], theirs[n]) for n in case.mutated), default=None)
    del inputs, mine, theirs, out, expected
    sets = input_sets(case)
    eager = time_eager(case.run, sets)
    us = time_graph(case.run, sets) if case.graph else eager
    ref_us = time_eager(case.ref, sets[:2], rep_ms=100) if case.time_ref else None
    extra: dict[str, Any] = {"kernels_us": kernel_breakdown(case.run, sets)}
    if case.graph:
        extra["graph_equals_eager"] = graph_matches_eager(case)
    gbs = case.bytes_moved / us / 1e3
    return Result(
        name=case.name,
        shape=case.shape,
        us=us,
        eager_us=eager if case.graph else None,
        ref_us=ref_us,
        mbytes=case.bytes_moved / 1e6,
        gbs=gbs,
        roofline_pct=100 * gbs / ROOFLINE_GBS,
        tflops=case.flops / us / 1e6 if case.flops else None,
        rel_err=err,
        state_rel_err=state_err,
        extra=extra,
    )


# ---------------------------------------------------------------- cases


def bf16(*shape: int) -> torch.Tensor:
    return torch.randn(shape, device="cuda", dtype=torch.bfloat16)


def norm_cases() -> list[Case]:
    cases = []
    for rows in (BATCH, BATCH * PROMPT):
        cases.append(
            Case(
                "rms_norm (1+w)",
                f"[{rows}, {HIDDEN}]",
                lambda rows=rows: {"x": bf16(rows, HIDDEN), "w": bf16(HIDDEN) * 0.1},
                lambda i: rms_norm(i["x"], i["w"], EPS, True),
                lambda i: reference.rms_norm(i["x"], i["w"], EPS, True),
                bytes_moved=2 * rows * HIDDEN * 2 + HIDDEN * 2,
            )
        )
    cases.append(
        Case(
            "rms_norm q/k heads",
            f"[{BATCH}, {HQ}, {HEAD_DIM}]",
            lambda: {"x": bf16(BATCH, HQ, HEAD_DIM), "w": bf16(HEAD_DIM) * 0.1},
            lambda i: rms_norm(i["x"], i["w"], EPS, True),
            lambda i: reference.rms_norm(i["x"], i["w"], EPS, True),
            bytes_moved=2 * BATCH * HQ * HEAD_DIM * 2,
        )
    )
    rotary_dim = HEAD_DIM // 4  # Qwen3.6's partial rotary
    angles = torch.outer(
        torch.arange(4096.0, device="cuda"),
        1.0 / 1e7 ** (torch.arange(0, rotary_dim, 2, device="cuda") / rotary_dim),
    )
    tables = (angles.cos(), angles.sin())
    for tokens in (BATCH, BATCH * PROMPT):

        def make_qk(tokens: int = tokens) -> Inputs:
            return {
                "q": bf16(tokens, HQ, 2 * HEAD_DIM)[..., :HEAD_DIM],  # the gate's half beside
                "k": bf16(tokens, HKV, HEAD_DIM),
                "wq": bf16(HEAD_DIM) * 0.1,
                "wk": bf16(HEAD_DIM) * 0.1,
                "pos": torch.randint(0, 4096, (tokens,), device="cuda"),
            }

        def qk_args(i: Inputs) -> tuple[Any, ...]:
            return (i["q"], i["k"], i["wq"], i["wk"], EPS, True, i["pos"], tables, rotary_dim)

        cases.append(
            Case(
                "q/k norms + rotary (one launch; unfused: 4)",
                f"[{tokens}, {HQ}+{HKV}, {HEAD_DIM}]",
                make_qk,
                lambda i: qk_norm_rotary(*qk_args(i)),
                lambda i: reference.qk_norm_rotary(*qk_args(i)),
                bytes_moved=2 * tokens * (HQ + HKV) * HEAD_DIM * 2,
            )
        )

        def make_qkv(tokens: int = tokens) -> Inputs:
            fp8 = torch.float8_e4m3fn
            return {
                **make_qk(tokens),
                "v": bf16(tokens, HKV, HEAD_DIM),
                "k_cache": torch.zeros(tokens, 1, HKV, HEAD_DIM, device="cuda", dtype=fp8),
                "v_cache": torch.zeros(tokens, 1, HKV, HEAD_DIM, device="cuda", dtype=fp8),
                "slots": torch.randperm(tokens, device="cuda"),
            }

        def cache_args(i: Inputs) -> tuple[Any, ...]:
            return (i["k_cache"], i["v_cache"], i["slots"], 0.5, 0.5)

        def two_launches(i: Inputs) -> torch.Tensor:
            q, k = qk_norm_rotary(*qk_args(i))
            write_kv_cache(k, i["v"], *cache_args(i))
            return q

        def fused_args(i: Inputs) -> tuple[Any, ...]:
            return (i["q"], i["k"], i["v"], *qk_args(i)[2:], *cache_args(i))

        bytes_qkv = tokens * (2 * (HQ + HKV) * HEAD_DIM * 2 + HKV * HEAD_DIM * (2 + 2))
        # the prologue with the paged cache's write: two launches, or one
        # (`qk_norm_rotary_write_kv`, the default)
        for name, run in (
            ("q/k norms + rotary, then write_kv_cache", two_launches),
            ("q/k norms + rotary writing k, v (one launch)",
             lambda i: qk_norm_rotary_write_kv(*fused_args(i))),
        ):  # fmt: skip
            cases.append(
                Case(
                    name,
                    f"[{tokens}, {HQ}+{HKV}+{HKV}, {HEAD_DIM}] fp8 cache",
                    make_qkv,
                    run,
                    lambda i: reference.qk_norm_rotary_write_kv(*fused_args(i)),
                    bytes_moved=bytes_qkv,
                    mutated=("k_cache", "v_cache"),
                )
            )
    for rows in (BATCH * HV, BATCH * PROMPT * HV):
        cases.append(
            Case(
                "gated_rms_norm",
                f"[{rows}, {DV}]",
                lambda rows=rows: {"x": bf16(rows, DV), "z": bf16(rows, DV), "w": bf16(DV)},
                lambda i: gated_rms_norm(i["x"], i["z"], i["w"], EPS),
                lambda i: reference.gated_rms_norm(i["x"], i["z"], i["w"], EPS),
                bytes_moved=3 * rows * DV * 2,
            )
        )
    return cases


def conv_cases() -> list[Case]:
    slots = 4 * BATCH

    def make_update() -> Inputs:
        return {
            "x": bf16(BATCH, CONV_DIM),
            "w": bf16(CONV_DIM, CONV_K),
            "state": bf16(slots, CONV_DIM, CONV_K - 1),
            "slots": torch.randperm(slots, device="cuda")[:BATCH],
        }

    def make_prefill() -> Inputs:
        lens = [PROMPT] * BATCH
        return {
            "x": bf16(BATCH * PROMPT, CONV_DIM),
            "w": bf16(CONV_DIM, CONV_K),
            "cu": reference.cu_seqlens_of(lens, "cuda"),
            "state": bf16(slots, CONV_DIM, CONV_K - 1),
            "slots": torch.randperm(slots, device="cuda")[:BATCH],
            "init": torch.zeros(BATCH, dtype=torch.bool, device="cuda"),
        }

    def make_gates() -> Inputs:
        return {
            **make_update(),
            "hidden": bf16(BATCH, HIDDEN),
            "ba_w": bf16(2 * HV, HIDDEN) * HIDDEN**-0.5,
            "A_log": torch.randn(HV, device="cuda"),
            "dt_bias": torch.randn(HV, device="cuda"),
        }

    def gates_by_two_launches(i: Inputs) -> torch.Tensor:
        """A W4 DeltaNet layer's decode step today: the 16-bit b|a GEMV, then the conv update
        with the gates (g returned: what the two ways compute differently)."""
        ba = linear(i["hidden"], i["ba_w"], None)
        return conv_update_with_gates(
            i["x"], i["w"], i["state"], i["slots"], ba[:, HV:], ba[:, :HV], i["A_log"], i["dt_bias"]
        )[1]

    def gates_in_one_launch(i: Inputs) -> torch.Tensor:
        args = (i["hidden"], i["ba_w"], i["A_log"], i["dt_bias"])
        return conv_update_with_ba_gates(i["x"], i["w"], i["state"], i["slots"], *args)[1]

    def gates_ref(i: Inputs) -> torch.Tensor:
        args = (i["hidden"], i["ba_w"], i["A_log"], i["dt_bias"])
        return reference.conv_update_with_ba_gates(i["x"], i["w"], i["state"], i["slots"], *args)[1]

    state_bytes = 2 * BATCH * CONV_DIM * (CONV_K - 1) * 2
    gates_bytes = 2 * BATCH * CONV_DIM * 2 + state_bytes + 2 * HV * HIDDEN * 2
    return [
        # the DeltaNet's 16-bit b|a beside int4 qkv|z: its GEMV and the conv update as two
        # launches, or b|a formed by the conv update's own programs
        # (`TOKENMILL_GDN_BA_IN_CONV=1`)
        Case(
            "b|a gemv + conv_update_with_gates",
            f"[{BATCH}, {CONV_DIM}] + b|a [{2 * HV}, {HIDDEN}]",
            make_gates,
            gates_by_two_launches,
            gates_ref,
            bytes_moved=gates_bytes,
            mutated=("state",),
            time_ref=False,
        ),
        Case(
            "conv_update_with_ba_gates",
            f"[{BATCH}, {CONV_DIM}] + b|a [{2 * HV}, {HIDDEN}]",
            make_gates,
            gates_in_one_launch,
            gates_ref,
            bytes_moved=gates_bytes,
            mutated=("state",),
        ),
        Case(
            "causal_conv1d_update",
            f"[{BATCH}, {CONV_DIM}] K={CONV_K}",
            make_update,
            lambda i: causal_conv1d_update(i["x"], i["w"], None, i["state"], i["slots"]),
            lambda i: reference.causal_conv1d_update(i["x"], i["w"], None, i["state"], i["slots"]),
            bytes_moved=2 * BATCH * CONV_DIM * 2 + state_bytes + CONV_DIM * CONV_K * 2,
            mutated=("state",),
        ),
    ] + [
        Case(
            f"causal_conv1d_prefill bt={bt} bc={bc}",
            f"[{BATCH}x{PROMPT}, {CONV_DIM}]",
            make_prefill,
            lambda i, bt=bt, bc=bc: causal_conv1d_prefill(
                i["x"],
                i["w"],
                None,
                i["cu"],
                i["state"],
                i["slots"],
                i["init"],
                block_t=bt,
                block_c=bc,
            ),  # fmt: skip
            lambda i: reference.causal_conv1d_prefill(
                i["x"], i["w"], None, i["cu"], i["state"], i["slots"], i["init"]
            ),
            bytes_moved=2 * BATCH * PROMPT * CONV_DIM * 2 + state_bytes,
            mutated=("state",),
            time_ref=bt == 32 and bc == 128,
        )
        for bt, bc in ((32, 128), (64, 64), (16, 256))
    ]


def delta_inputs(tokens: int, slots: int) -> Inputs:
    packed = bf16(tokens, CONV_DIM)
    return {
        "q": packed[:, : HK * DK].view(tokens, HK, DK),
        "k": packed[:, HK * DK : 2 * HK * DK].view(tokens, HK, DK),
        "v": packed[:, 2 * HK * DK :].view(tokens, HV, DV),
        "g": -F.softplus(torch.randn(tokens, HV, device="cuda") - 1.0),
        "beta": torch.rand(tokens, HV, device="cuda").bfloat16(),
        "state": torch.randn(slots, HV, DK, DV, device="cuda") * 0.05,
        "slots": torch.randperm(slots, device="cuda")[:BATCH],
    }


def delta_cases() -> list[Case]:
    scale = DK**-0.5
    state_bytes = BATCH * HV * DK * DV * 4
    decode_bytes = 2 * state_bytes + BATCH * (2 * HK * DK + 2 * HV * DV) * 2 + BATCH * HV * 6

    # the positional arguments the kernels and their references share
    def decode_args(i: Inputs) -> tuple[Any, ...]:
        return i["q"], i["k"], i["v"], i["g"], i["beta"], i["state"], i["slots"], scale, True

    def prefill_args(i: Inputs) -> tuple[Any, ...]:
        qkv_gates = i["q"], i["k"], i["v"], i["g"], i["beta"]
        return *qkv_gates, i["cu"], i["state"], i["slots"], i["init"], scale, True

    cases = []
    for block_v, warps in ((32, 4), (64, 4), (64, 8), (32, 2)):
        cases.append(
            Case(
                f"gdn_decode bv={block_v} w={warps}",
                f"B={BATCH} Hv={HV} {DK}x{DV}",
                lambda: delta_inputs(BATCH, BATCH),
                lambda i, bv=block_v, w=warps: gated_delta_rule_decode(
                    *decode_args(i), block_v=bv, num_warps=w
                ),
                lambda i: reference.gated_delta_rule_decode(*decode_args(i)),
                bytes_moved=decode_bytes,
                flops=BATCH * HV * DK * DV * 8,
                mutated=("state",),
            )
        )

    def make_prefill() -> Inputs:
        inputs = delta_inputs(BATCH * PROMPT, BATCH)
        lens = [PROMPT] * BATCH
        inputs["cu"] = reference.cu_seqlens_of(lens, "cuda")
        inputs["init"] = torch.zeros(BATCH, dtype=torch.bool, device="cuda")
        return inputs

    tokens = BATCH * PROMPT
    io_bytes = tokens * (2 * HK * DK + 2 * HV * DV) * 2 + tokens * HV * 6 + 2 * state_bytes
    variants = (
        # chunk, block_v, bf16 dots, prepare warps, scan warps
        (32, 64, False, 4, 4),
        (16, 64, False, 4, 4),
        (64, 64, False, 4, 4),
        (32, 64, True, 4, 4),
        (64, 64, True, 4, 4),
        (32, 32, True, 4, 4),
        (64, 128, True, 4, 8),
        (32, 64, True, 2, 4),
        (16, 32, True, 2, 4),
    )
    for chunk, block_v, dot16, pw, sw in variants:
        flops = 2 * tokens * HV * (3 * DK * DV + chunk * (2 * DK + 2 * DV) + chunk * chunk // 3)
        cases.append(
            Case(
                f"gdn_prefill BT={chunk} bv={block_v}{' bf16' if dot16 else ''} w={pw}/{sw}",
                f"{BATCH}x{PROMPT} tok, Hv={HV}",
                make_prefill,
                lambda i, c=chunk, bv=block_v, d=dot16, pw=pw, sw=sw: gated_delta_rule_prefill(
                    *prefill_args(i),
                    chunk_size=c,
                    block_v=bv,
                    dot16=d,
                    prepare_warps=pw,
                    scan_warps=sw,
                ),
                lambda i: reference.gated_delta_rule_prefill_chunked(*prefill_args(i)),
                bytes_moved=io_bytes,
                flops=flops,
                mutated=("state",),
                time_ref=(chunk, block_v, dot16) == (32, 64, False),
            )
        )
    return cases


def attention_cases() -> list[Case]:
    cases = []
    for context, partitions in ((PROMPT + 256, (None, 64, 128)), (4096, (None, 512))):
        for fp8 in (False, True):
            for partition in partitions:
                cases.append(attention_case(context, fp8, partition))
    return cases


def paged_kv_cache(blocks_per_seq: int, fp8: bool, k_scale: float, v_scale: float) -> Inputs:
    """BATCH sequences' K and V caches ("k", "v", fp8 at the given scales or bf16) in shuffled
    blocks of BLOCK_SIZE, and their block tables ("tables")."""
    num_blocks = BATCH * blocks_per_seq + 8
    tables = torch.randperm(num_blocks, device="cuda")[: BATCH * blocks_per_seq].int()
    k_cache = bf16(num_blocks, BLOCK_SIZE, HKV, HEAD_DIM)
    v_cache = bf16(num_blocks, BLOCK_SIZE, HKV, HEAD_DIM)
    if fp8:
        k_cache = (k_cache.float() / k_scale).to(torch.float8_e4m3fn)
        v_cache = (v_cache.float() / v_scale).to(torch.float8_e4m3fn)
    return {"k": k_cache, "v": v_cache, "tables": tables.view(BATCH, blocks_per_seq)}


def attention_case(context: int, fp8: bool, partition: int | None) -> Case:
    blocks_per_seq = -(-context // BLOCK_SIZE)
    # every sequence near `context` tokens, as at the load point's end of decode
    lens = [context - 37 * i for i in range(BATCH)]
    k_scale, v_scale = (0.02, 0.02) if fp8 else (1.0, 1.0)
    elt = 1 if fp8 else 2

    def make() -> Inputs:
        return {
            **paged_kv_cache(blocks_per_seq, fp8, k_scale, v_scale),
            "q": bf16(BATCH, HQ, HEAD_DIM),
            "lens": torch.tensor(lens, device="cuda", dtype=torch.int32),
        }

    def args(i: Inputs) -> tuple[Any, ...]:
        return (i["q"], i["k"], i["v"], i["lens"], i["tables"], HEAD_DIM**-0.5, k_scale, v_scale)

    kv_bytes = sum(lens) * HKV * HEAD_DIM * 2 * elt
    return Case(
        f"paged_decode {'fp8' if fp8 else 'bf16'} part={partition or 'auto'}",
        f"B={BATCH} ctx~{context} {HQ}/{HKV}x{HEAD_DIM}",
        make,
        lambda i: paged_attention_decode(*args(i), partition=partition),
        lambda i: reference.paged_attention_decode(*args(i)),
        bytes_moved=kv_bytes + 2 * BATCH * HQ * HEAD_DIM * 2,
        flops=4 * sum(lens) * HQ * HEAD_DIM,
        time_ref=partition is None,
    )


def prefill_attention_cases() -> list[Case]:
    """Prefill attention at the load point: BATCH fresh prompts of PROMPT tokens. The default
    tiles also run as a CUDA graph (the op makes no host sync); the tile variants eagerly."""
    cases = []
    variants = (
        # block_m, block_n, warps, stages; None: the op's defaults
        (None, None, None, 2),  # 128 x 32, 8 warps at D = 256
        (128, 32, 8, 3),
        (128, 64, 8, 2),
        (64, 32, 8, 2),
        (64, 64, 8, 2),
        (64, 32, 4, 2),
        (32, 64, 4, 2),
    )
    for fp8 in (False, True):
        for bm, bn, warps, stages in variants:
            cases.append(prefill_attention_case(fp8, bm, bn, warps, stages))
    return cases


def prefill_attention_case(
    fp8: bool, block_m: int | None, block_n: int | None, warps: int | None, stages: int
) -> Case:
    tokens = BATCH * PROMPT
    blocks_per_seq = -(-PROMPT // BLOCK_SIZE)
    k_scale, v_scale = (0.02, 0.02) if fp8 else (1.0, 1.0)
    elt = 1 if fp8 else 2

    def make() -> Inputs:
        return {
            **paged_kv_cache(blocks_per_seq, fp8, k_scale, v_scale),
            "q": bf16(tokens, HQ, HEAD_DIM),
            "cu": reference.cu_seqlens_of([PROMPT] * BATCH, "cuda"),
            "lens": torch.full((BATCH,), PROMPT, device="cuda", dtype=torch.int32),
            "positions": torch.arange(PROMPT, device="cuda").repeat(BATCH),
        }

    def args(i: Inputs) -> tuple[Any, ...]:
        return (i["q"], i["k"], i["v"], i["cu"], i["lens"], i["tables"], i["positions"],
                HEAD_DIM**-0.5, k_scale, v_scale)  # fmt: skip

    default = block_m is None
    tiles = "auto" if default else f"{block_m}x{block_n} w={warps} s={stages}"
    return Case(
        f"paged_prefill {'fp8' if fp8 else 'bf16'} {tiles}",
        f"{BATCH}x{PROMPT} tok {HQ}/{HKV}x{HEAD_DIM}",
        make,
        lambda i: paged_attention_prefill(
            *args(i), block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages
        ),
        lambda i: reference.paged_attention_prefill(*args(i)),
        bytes_moved=2 * tokens * HQ * HEAD_DIM * 2 + 2 * tokens * HKV * HEAD_DIM * elt,
        flops=4 * BATCH * (PROMPT * (PROMPT + 1) // 2) * HQ * HEAD_DIM,
        graph=default,
        time_ref=default,
    )


def copy_bandwidth() -> float:
    """GB/s of a large device-to-device copy, bytes read + written (the roofline check)."""
    return common.copy_bandwidth(warmup=25, rep=200) / 1e9


def decode_step_budget(results: list[Result]) -> dict[str, float]:
    """Kernel microseconds these ops add to one decode step of the 64-layer model at batch 8."""

    def best(prefix: str) -> float:
        return min(r.us for r in results if r.name.startswith(prefix) and r.shape.startswith("B="))

    def shape(name: str, shape_prefix: str) -> float:
        return next(r.us for r in results if r.name == name and r.shape.startswith(shape_prefix))

    per_deltanet = (
        best("gdn_decode")
        + shape("causal_conv1d_update", f"[{BATCH},")
        + shape("gated_rms_norm", f"[{BATCH * HV},")
    )
    load_point = f"ctx~{PROMPT + 256} "
    attn_bf16 = min(
        r.us for r in results if r.name.startswith("paged_decode bf16") and load_point in r.shape
    )
    attn_fp8 = min(
        r.us for r in results if r.name.startswith("paged_decode fp8") and load_point in r.shape
    )
    norms = 2 * 64 * shape("rms_norm (1+w)", f"[{BATCH},") + 16 * 2 * shape(
        "rms_norm q/k heads", "["
    )
    return {
        "deltanet_layers_us": 48 * per_deltanet,
        "attention_layers_bf16_us": 16 * attn_bf16,
        "attention_layers_fp8_us": 16 * attn_fp8,
        "norms_us": norms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", help="folder for the JSON (default $OUT, else bench/results)")
    parser.add_argument(
        "--only", default="", help="run cases whose name contains one of these (comma-separated)"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    started = time.time()
    bandwidth = copy_bandwidth()
    cases = (
        norm_cases() + conv_cases() + delta_cases() + attention_cases() + prefill_attention_cases()
    )
    results = []
    for case in cases:
        if args.only and not any(part in case.name for part in args.only.split(",")):
            continue
        try:
            result = measure(case)
        except Exception as exc:  # one broken variant must not lose the rest of the run
            print(f"FAILED {case.name} {case.shape}: {type(exc).__name__}: {exc}", flush=True)
            continue
        results.append(result)
        print(
            f"{result.name:<30} {result.shape:<28} {result.us:9.1f} us {result.gbs:7.0f} GB/s "
            f"err {result.rel_err:.1e}",
            flush=True,
        )
    header = (
        f"{'kernel':<30} {'shape':<28} {'us':>8} {'eager':>8} {'ref':>9} {'MB':>7} "
        f"{'GB/s':>6} {'%roof':>6} {'TF/s':>6} {'rel err':>8} {'state':>8}"
    )
    print(f"\ncopy bandwidth {bandwidth:.0f} GB/s; roofline used {ROOFLINE_GBS:.0f} GB/s")
    print(header)
    for r in results:
        state = f"{r.state_rel_err:.1e}" if r.state_rel_err is not None else "-"
        print(
            f"{r.name:<30} {r.shape:<28} {r.us:8.1f} "
            f"{(f'{r.eager_us:.1f}' if r.eager_us else '-'):>8} "
            f"{(f'{r.ref_us:.1f}' if r.ref_us else '-'):>9} {r.mbytes:7.1f} {r.gbs:6.0f} "
            f"{r.roofline_pct:5.0f}% {(f'{r.tflops:.1f}' if r.tflops else '-'):>6} "
            f"{r.rel_err:8.1e} {state:>8}"
            + ("" if r.extra.get("graph_equals_eager", True) else "  GRAPH MISMATCH")
        )
    print("\nper-kernel device time (us per call, torch profiler, eager):")
    for r in results:
        parts = ", ".join(f"{k.split('(')[0]} {v:.1f}" for k, v in r.extra["kernels_us"].items())
        print(f"  {r.name:<34} {parts}")
    budget: dict[str, float] = {}
    try:
        budget = decode_step_budget(results)
        print("decode-step kernel budget (64 layers, batch 8):", json.dumps(budget))
    except (StopIteration, ValueError):
        pass
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "copy_bandwidth_gbs": bandwidth,
        "roofline_gbs": ROOFLINE_GBS,
        "seconds": time.time() - started,
        "decode_step_budget_us": budget,
        "results": [asdict(r) for r in results],
    }
    write_result(result_path("kernels_bench", args.out), report, indent=1)


if __name__ == "__main__":
    main()
