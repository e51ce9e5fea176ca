"""The engine sections' phases: the decode step as a graph replay and eager, a per-kernel profile
of the eager step (kernels grouped), the prefill step, and the step log of a load point."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from bench.common import cuda_time, median, sync
from worker.engine.engine import LLMEngine
from worker.engine.sequence import SamplingParams


def mean_ms(values: list[float]) -> float | None:
    return 1e3 * sum(values) / len(values) if values else None


class StepLog:
    """Wraps runner.execute: wall time of every step, tagged prefill (any prefill chunk) or
    decode (the number of decodes). The sampler's host copy ends every step, so wall = GPU.
    Also wraps runner.launch_forward (overlapped decode, which does not wait for its step):
    the time from one launch to the next is that step's wall time."""

    def __init__(self, runner: Any) -> None:
        self.runner, self.inner = runner, runner.execute
        self.inner_launch = runner.launch_forward
        self.steps: list[tuple[str, int, float]] = []
        # beside each step: the pages restaged just before it (staged KV; 0 otherwise)
        self.restaged: list[int] = []
        self._restaged_since = 0
        self.restage_host_s = 0.0  # host time in runner.restage (the block manager's scan too)
        self.inner_restage = getattr(runner, "restage", None)
        if self.inner_restage is not None:
            runner.restage = self.restage
        self.profile_prefill = False  # profile the next prefill step's kernels (once)
        self.prefill_profile: dict[str, Any] | None = None
        # (decodes, start, pages restaged before it) of the last launch
        self.last_launch: tuple[int, float, int] | None = None
        runner.execute = self
        runner.launch_forward = self.launch

    def restage(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        moves = self.inner_restage(*args, **kwargs)  # type: ignore[misc]
        self.restage_host_s += time.perf_counter() - t0
        self._restaged_since += len(moves)
        return moves

    def _log(self, kind: str, n: int, wall: float, restaged: int) -> None:
        self.steps.append((kind, n, wall))
        self.restaged.append(restaged)

    def launch(self, batch: Any) -> Any:
        t0 = time.perf_counter()
        if self.last_launch is not None:
            n, started, restaged = self.last_launch
            self._log("overlapped", n, t0 - started, restaged)
        self.last_launch = (len(batch.decodes), t0, self._restaged_since)
        self._restaged_since = 0
        return self.inner_launch(batch)

    def __call__(self, batch: Any) -> Any:
        self.last_launch = None  # a synchronous step ends the chain of launches
        if batch.prefills and self.profile_prefill and torch.cuda.is_available():
            self.profile_prefill = False
            box: list[Any] = []
            self.prefill_profile = profile_step(
                lambda: box.append(self.inner(batch)), steps=1, warm=False
            )
            return box[-1]
        t0 = time.perf_counter()
        out = self.inner(batch)
        kind = "prefill" if batch.prefills else "decode"
        self._log(kind, batch.num_tokens, time.perf_counter() - t0, self._restaged_since)
        self._restaged_since = 0
        return out

    def clear(self) -> None:
        self.steps.clear()
        self.restaged.clear()
        self.restage_host_s = 0.0

    def summary(self) -> dict[str, Any]:
        full = self.runner.sizes[-1]
        decode = [s for k, n, s in self.steps if k == "decode" and n == full]
        overlapped = [s for k, n, s in self.steps if k == "overlapped" and n == full]
        prefill = [s for k, _, s in self.steps if k == "prefill"]
        after_restage = [
            s
            for (k, n, s), pages in zip(self.steps, self.restaged, strict=True)
            if k == "overlapped" and n == full and pages
        ]
        return {
            "decode_steps": len(decode),
            "decode_step_wall_ms_p50": median(decode, 1e3),
            "overlapped_decode_steps": len(overlapped),
            "overlapped_decode_step_wall_ms_p50": median(overlapped, 1e3),
            # where a round's time goes past the medians: the mean, the steps that restaged
            # pages (staged KV), and every logged step's wall summed
            "overlapped_decode_step_wall_ms_mean": mean_ms(overlapped),
            "overlapped_decode_steps_after_restage": len(after_restage),
            "overlapped_decode_step_after_restage_wall_ms_mean": mean_ms(after_restage),
            "steps_wall_s_sum": sum(s for _, _, s in self.steps),
            "restage_host_s_sum": self.restage_host_s,
            "prefill_steps": len(prefill),
            "prefill_step_wall_ms_p50": median(prefill, 1e3),
            "prefill_tokens_per_step_max": max(
                (n for k, n, _ in self.steps if k == "prefill"), default=0
            ),
        }


class SlowSteps:
    """Wraps engine.step: every call over `limit_s` (the wall time the engine's own slow-step
    log measures: a running decode waited that long), with its batch, until close()."""

    def __init__(self, engine: LLMEngine, limit_s: float = 0.25) -> None:
        self.engine, self.inner, self.limit_s = engine, engine.step, limit_s
        self.found: list[dict[str, Any]] = []
        engine.step = self  # type: ignore[method-assign]

    def __call__(self) -> Any:
        t0 = time.perf_counter()
        out = self.inner()
        took = time.perf_counter() - t0
        b = self.engine._last_batch
        if took > self.limit_s and b is not None:
            self.found.append(
                {
                    "s": round(took, 3),
                    "prefill_chunks": len(b.prefills),
                    "prefill_tokens": sum(e.num_tokens for e in b.prefills),
                    "decodes": len(b.decodes),
                }
            )
        return out

    def close(self) -> list[dict[str, Any]]:
        del self.engine.step  # the instance attribute: the class's method again
        return self.found


KERNEL_GROUPS = (
    ("fp8 gemv (one launch)", ("_gemv_kernel",)),
    ("fused elementwise (silu*mul, gdn gates, rotary)", ("_silu_mul", "_gdn_gates", "_rotary")),
    ("fp8 w8a16", ("w8a16",)),
    ("fp8 quantize rows", ("quantize_rows",)),
    ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "sm90_xmma", "splitk", "scaled_mm")),
    ("gdn decode", ("gdn", "delta", "recurrent")),
    ("conv1d", ("conv",)),
    ("paged attention", ("decode_partition", "combine", "paged")),
    ("kv write", ("write_kv",)),
    ("norms", ("rms_norm",)),
)


def kernel_group(name: str) -> str:
    low = name.lower()
    for group, keys in KERNEL_GROUPS:
        if any(k in low for k in keys):
            return group
    return "other (elementwise, copies, index)"


def profile_step(fn: Callable[[], Any], steps: int, warm: bool = True) -> dict[str, Any]:
    """Per-kernel GPU time of `fn` (eager), per step: the top kernels and the groups."""
    from torch.profiler import ProfilerActivity, profile

    if warm:
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kernels = []
    for e in prof.key_averages():
        # self time: a CPU op's device total would count its kernels a second time
        device_us = float(getattr(e, "self_device_time_total", 0) or 0)
        if device_us <= 0:
            continue
        kernels.append((e.key, e.count / steps, device_us / steps))
    kernels.sort(key=lambda k: -k[2])
    groups: dict[str, dict[str, float]] = {}
    for name, count, us in kernels:
        g = groups.setdefault(kernel_group(name), {"ms": 0.0, "launches": 0.0})
        g["ms"] += us / 1e3
        g["launches"] += count
    return {
        "total_ms": sum(k[2] for k in kernels) / 1e3,
        "groups": dict(sorted(groups.items(), key=lambda g: -g[1]["ms"])),
        "top": [
            {"kernel": name[:120], "launches": count, "ms": us / 1e3}
            for name, count, us in kernels[:25]
        ],
    }


def stage_padding(inputs: Any, rows: int, own_states: bool) -> None:
    """Every row of the padded decode inputs padding (scratch block, one-token contexts);
    `own_states`: rows [0, rows) on idle state slots 0..rows-1 instead of the scratch slot."""
    inputs.fill_padding(0, inputs.max_rows)
    if own_states:
        inputs.host["state_slots"][:rows] = torch.arange(rows)
    inputs.upload()


def engine_phases(
    engine: LLMEngine, rows: int | None = None, pdl: bool = True, own_states: bool = False
) -> dict[str, Any]:
    """Decode step (batch `rows`, default max_num_seqs) as a graph replay and eager, and a kernel
    profile; `pdl` also times the step re-captured without PDL. All rows are padding (scratch
    block, one-token contexts), none touches a sequence; `own_states` gives row i the idle
    state slot i instead of the shared scratch slot, so the DeltaNet states stream from memory
    as a real batch's do (an idle engine: no slot is in use)."""
    runner = engine.runner
    inputs: Any = runner.decode_inputs
    if inputs is None:
        return {"error": "no padded decode path"}
    rows = rows or runner.sizes[-1]
    stage_padding(inputs, rows, own_states)
    ids, meta = inputs.input_ids(rows), inputs.meta(rows)
    phases: dict[str, Any] = {"batch": rows, "graph_error": runner.graph_error}
    with torch.inference_mode():
        if rows in runner.graphs:
            graph = runner.graphs[rows][0]
            phases["decode_step_graph_ms"] = 1e3 * cuda_time(graph.replay, iters=20, warmup=3)
            if not own_states:
                # the same step with each row on a state slot of its own, as a served batch's
                # rows are: what streaming the DeltaNet states adds to the shared scratch slot's
                # (L2-resident) step, a candidate for the load point's step wall over its replay
                stage_padding(inputs, rows, own_states=True)
                phases["decode_step_graph_ms_own_states"] = 1e3 * cuda_time(
                    graph.replay, iters=20, warmup=3
                )
                stage_padding(inputs, rows, own_states=False)
            # host side of one step: the replay call alone, then the staging upload alone
            sync()
            t0 = time.perf_counter()
            graph.replay()
            phases["graph_replay_call_host_ms"] = 1e3 * (time.perf_counter() - t0)
            sync()
            t0 = time.perf_counter()
            for _ in range(20):
                inputs.upload(rows)
            phases["staging_upload_host_ms"] = 1e3 * (time.perf_counter() - t0) / 20
            sync()
            if pdl:
                phases.update(graph_step_without_pdl(runner, rows))
        eager = lambda: runner._logits(ids, meta)  # noqa: E731
        phases["decode_step_eager_ms"] = 1e3 * cuda_time(eager, iters=5, warmup=1)
        if torch.cuda.is_available():
            phases["decode_step_eager_profile"] = profile_step(eager, steps=3)
    return phases


def graph_step_without_pdl(runner: Any, rows: int) -> dict[str, Any]:
    """The same padded decode step captured again with programmatic dependent launch off, timed,
    then captured back with it on: what PDL buys one whole step."""
    from worker.kernels.pdl import pdl_enabled, set_pdl

    if not pdl_enabled(runner.device):
        return {"pdl": "off (TOKENMILL_PDL=0, a pre-Hopper GPU, or capture fell back)"}
    result: dict[str, Any] = {"pdl": "on"}
    try:
        set_pdl(False)
        runner.graphs.clear()
        runner.capture_graphs()
        if rows in runner.graphs:
            graph = runner.graphs[rows][0]
            result["decode_step_graph_ms_without_pdl"] = 1e3 * cuda_time(
                graph.replay, iters=20, warmup=3
            )
    finally:
        set_pdl(True)
        runner.graphs.clear()
        runner.capture_graphs()
    return result


def overlap_check(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, Any]:
    """The same greedy requests served synchronously and overlapped must get the same tokens
    (the overlapped path feeds the graph's own argmax back on the device)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    served: dict[bool, list[list[int]]] = {}
    enabled = engine.overlap_decode
    try:
        for overlap in (False, True):
            engine.overlap_decode = overlap and enabled
            served[overlap] = [o.new_token_ids for o in engine.generate(prompts, params)]
    finally:
        engine.overlap_decode = enabled
    return {
        "overlap_enabled": enabled,
        "tokens_compared": sum(len(t) for t in served[False]),
        "equal": served[False] == served[True],
    }
