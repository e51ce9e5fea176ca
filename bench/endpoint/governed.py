"""Output tokens per second through the governed endpoint, against the same worker called directly.

The whole product in its own processes: NATS and PostgreSQL (embedded unless
TOKENMILL_NATS_URL / TOKENMILL_DATABASE_URL are set), `tokenmill serve` (auth, admission,
metering, the /v1 gateway), `tokenmill project`, and one `worker.serve` running our engine
(`torch_runtime`) on a `random:` model: random weights at a preset's shape with the Qwen3.6
vocabulary, FP8 weights and FP8 KV by default. The load point is the engine benchmark's
(docs/performance.md): N requests, C in flight, a P-token prompt and M output tokens, greedy.

After one warm-up round of each, rounds alternate (direct first, then gateway first): direct
is the gateway's own WorkerClient over NATS (no HTTP, auth, admission or gateway metering);
the other goes through the gateway (streamed /v1/completions over HTTP, usage
included). Then one more gateway round with some clients hanging up mid-stream, reconciled
request by request against the usage ledger.

    python -m bench.endpoint.governed                           # on the H200: Qwen3.6-27B shape
    python -m bench.endpoint.governed --preset tiny-qwen3.5 --device cpu --dtype float32 \\
        --quantize none --kv-dtype none --requests 4 --prompt-tokens 32 --max-tokens 8

`--sweep 1,2,4,8,16,32,64` then measures each concurrency C (2 x C requests, one warm round
through the gateway first), direct and governed, on the same worker (its max_num_seqs is the
largest C). The worker logs every engine step over `--slow-step-s` (with the kernel compiles
it waited on); the report counts those after the worker's warm-up.

Prints a table and writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import time
import uuid
from contextlib import AsyncExitStack, ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import msgspec

from bench.common import percentile, print_table, result_path, write_result
from bench.gateway.overhead import Bench, reconciled


def prompt_text(tokens: int, seed: int) -> str:
    """About `tokens` Qwen tokens of plain words (the exact count comes back in usage)."""
    rng = random.Random(seed)
    words = ["river", "stone", "light", "north", "green", "table", "music", "paper"]
    return " ".join(rng.choice(words) for _ in range(tokens))


def summary(results: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    e2e = [r["e2e_s"] for r in ok]
    tokens = sum(r["completion_tokens"] for r in ok)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "first_errors": [r["error"] for r in results if not r["ok"]][:3],
        "completion_tokens": tokens,
        "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in ok) if ok else 0,
        "wall_s": wall_s,
        "output_tokens_per_s": tokens / wall_s if wall_s else float("nan"),
        "ttft_s_p50": percentile(ttft, 50),
        "ttft_s_p95": percentile(ttft, 95),
        "e2e_s_p50": percentile(e2e, 50),
        "e2e_s_p95": percentile(e2e, 95),
    }


async def through_gateway(
    url: str, key: str, model: str, prompts: list[str], a: argparse.Namespace, hang_up: set[int]
) -> tuple[list[dict[str, Any]], float]:
    queue = list(enumerate(prompts))
    results: list[dict[str, Any]] = []
    began = 0.0  # the round's start, set below (each request records when it was sent)

    async def one(client: httpx.AsyncClient, i: int, prompt: str) -> dict[str, Any]:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": a.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0 = time.perf_counter()
        out: dict[str, Any] = {"ok": False, "ttft_s": None, "completion_tokens": 0}
        out.update(prompt_tokens=0, e2e_s=0.0, error="", cancelled=False, sent_s=t0 - began)
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                out["error"] = f"{r.status_code} {(await r.aread())[:200]!r}"
                return out
            texts = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = msgspec.json.decode(line[6:])
                if "error" in chunk:
                    out["error"] = str(chunk["error"])
                    return out
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    texts += 1
                    if out["ttft_s"] is None:
                        out["ttft_s"] = time.perf_counter() - t0
                    if i in hang_up and texts == a.max_tokens // 4:
                        out.update(ok=True, cancelled=True, e2e_s=time.perf_counter() - t0)
                        return out  # leaving the block closes the connection mid-stream
                if chunk.get("usage"):
                    out["completion_tokens"] = chunk["usage"]["completion_tokens"]
                    out["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
        out.update(ok=True, e2e_s=time.perf_counter() - t0)
        return out

    async def user(client: httpx.AsyncClient) -> None:
        while queue:
            i, prompt = queue.pop(0)
            try:
                results.append(await one(client, i, prompt))
            except httpx.HTTPError as exc:
                results.append({"ok": False, "error": repr(exc), "completion_tokens": 0})

    # Each user's client is built and connected before the clock starts, as direct() connects
    # to NATS before its clock: building an httpx client takes 20-40 ms of the event loop (its
    # TLS context), which inside the round delayed every other stream of the first wave.
    headers = {"authorization": f"Bearer {key}"}
    async with AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(
                httpx.AsyncClient(base_url=url, headers=headers, timeout=600)
            )
            for _ in range(a.concurrency)
        ]
        await asyncio.gather(*(c.get("/v1/models") for c in clients))
        began = time.perf_counter()
        await asyncio.gather(*(user(c) for c in clients))
        return results, time.perf_counter() - began


async def direct(
    b: Bench, sku: dict[str, Any], prompts: list[str], a: argparse.Namespace
) -> tuple[list[dict[str, Any]], float]:
    import nats

    from control_plane.dataplane.dispatch import WorkerClient, WorkerRegistry
    from worker import protocol as p

    nc = await nats.connect(b.nats_url)
    registry = WorkerRegistry(nc, b.prefix)
    client = WorkerClient(nc, b.prefix, registry)
    await registry.start()
    await client.start()
    while not registry.live_workers(sku["sku_id"]):  # noqa: ASYNC110 (filled by heartbeats)
        await asyncio.sleep(0.05)
    queue = list(prompts)
    results: list[dict[str, Any]] = []
    began = 0.0

    async def user() -> None:
        while queue:
            prompt = queue.pop(0)
            request = p.GenerateRequest(
                request_id=uuid.uuid4().hex,
                tenant_id="bench-direct",
                key_id="bench-direct",
                sku_id=sku["sku_id"],
                model=sku["name"],
                prompt=prompt,
                sampling=p.SamplingParams(max_tokens=a.max_tokens, temperature=0),
                reply_to="",
                admitted_at=time.time(),
            )
            t0, ttft = time.perf_counter(), None
            d = await client.dispatch(request)
            try:
                async for chunk in d.chunks():
                    if chunk.text and ttft is None:
                        ttft = time.perf_counter() - t0
                results.append(
                    {"ok": True, "ttft_s": ttft, "e2e_s": time.perf_counter() - t0}
                    | {"sent_s": t0 - began}
                    | {"request_id": request.request_id}
                    | {"completion_tokens": d.completion_tokens, "prompt_tokens": d.prompt_tokens}
                )
            except Exception as exc:
                results.append({"ok": False, "error": repr(exc), "completion_tokens": 0})

    began = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(a.concurrency)))
    wall = time.perf_counter() - began
    await client.close()
    await registry.close()
    await nc.close()
    return results, wall


async def worker_view(b: Bench, results: list[dict[str, Any]]) -> None:
    """Adds the worker's own TTFT and E2E (its usage events, in the ledger) to direct results:
    a request slow for the client but not for the worker waited outside the engine."""
    import asyncpg

    ids = [r["request_id"] for r in results if r.get("request_id")]
    conn = await asyncpg.connect(b.database_url)
    try:
        deadline = time.monotonic() + 60
        while True:
            rows = await conn.fetch(
                "SELECT request_id, ttft_ms, e2e_ms FROM usage_ledger WHERE request_id = ANY($1)",
                ids,
            )
            if len(rows) >= len(ids) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
    finally:
        await conn.close()
    seen = {r["request_id"]: r for r in rows}
    for r in results:
        row = seen.get(r.get("request_id", ""))
        if row is not None:
            r["worker_ttft_s"] = None if row["ttft_ms"] is None else row["ttft_ms"] / 1000
            r["worker_e2e_s"] = row["e2e_ms"] / 1000


def worker_config(a: argparse.Namespace) -> dict[str, Any]:
    """The torch_runtime backend's config: what the worker and the engine-alone rounds run."""
    config: dict[str, Any] = {
        "model_path": f"random:{a.preset}",
        "device": a.device,
        "dtype": a.dtype,
        "max_num_seqs": max([a.concurrency, *a.sweep]),
        "max_model_len": max(a.prompt_tokens * 2 + a.max_tokens, a.long_prompt_tokens + 256),
    }
    if a.quantize != "none":
        config["quantize"] = a.quantize
    if a.kv_dtype != "none":
        config["kv_dtype"] = a.kv_dtype
    return config


def engine_alone(a: argparse.Namespace, prompts: list[str]) -> dict[str, Any]:
    """The worker's engine (its backend's config, warm-up and all) in this process, before the
    stack starts: one warm round, then `--engine-rounds` timed rounds of the load point, with
    the same prompts tokenized; its GPU memory is given back before the worker starts."""
    import gc

    import torch

    from bench.engine.load_point import run_round
    from worker.backends.torch_runtime import TorchRuntimeBackend
    from worker.engine.sequence import SamplingParams

    began = time.perf_counter()
    llm, tokenizer = TorchRuntimeBackend(**worker_config(a)).build_engine()
    build_s = time.perf_counter() - began
    ids = [list(tokenizer.encode(p)) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    run_round(llm, ids, a.concurrency, params)
    rounds = []
    for i in range(a.engine_rounds):
        r = run_round(llm, ids, a.concurrency, params)
        rounds.append(r)
        print(f"engine alone round {i + 1}: {r.output_tok_s:.1f} tok/s", flush=True)
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "build_s": build_s,
        "output_tokens_per_s": statistics.median(r.output_tok_s for r in rounds),
        "output_tokens_per_s_rounds": [r.output_tok_s for r in rounds],
        "ttft_s_p50": percentile([t for r in rounds for t in r.ttft_s], 50),
        "completion_tokens": sum(r.completion_tokens for r in rounds),
    }


def long_prompt_through_gateway(b: Bench, sku: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """One prompt of ~`--long-prompt-tokens` tokens, streamed through the gateway with 16 output
    tokens, alone on the worker, then reconciled against the ledger."""
    one = argparse.Namespace(**{**vars(a), "max_tokens": 16, "concurrency": 1})
    since = datetime.now(UTC)
    text = prompt_text(a.long_prompt_tokens, 7)
    results, wall = asyncio.run(through_gateway(b.url, b.key, sku["name"], [text], one, set()))
    report = b.reconcile(1, since)
    return {
        **results[0],
        "prompt_chars": len(text),
        "wall_s": wall,
        **reconciled(report, mismatches_kept=5),
    }


def start_worker(b: Bench, a: argparse.Namespace) -> dict[str, Any]:
    name = f"{a.preset}-{a.quantize}".replace("none", "bf16")
    sku = b.admin(
        "POST",
        "/skus",
        {"name": name, "model": a.preset, "runtime": "torch_runtime", "gpu_type": a.gpu_type},
    )
    config = worker_config(a)
    b.env = {**b.env, "TOKENMILL_ENGINE_SLOW_STEP_S": str(a.slow_step_s)}
    b.spawn(
        "-m", "worker.serve", "--nats-url", b.nats_url, "--prefix", b.prefix, "--sku-id", sku["sku_id"],
        "--model", name, "--backend", "torch_runtime", "--config", json.dumps(config), log="worker.log",
    )  # fmt: skip
    deadline = time.monotonic() + a.load_timeout_s
    while True:  # served once a one-token request succeeds (the model builds meanwhile)
        r = httpx.post(
            b.url + "/v1/completions",
            json={"model": name, "prompt": "hi", "max_tokens": 1},
            headers={"authorization": f"Bearer {b.key}"},
            timeout=60,
        )
        if r.status_code == 200:
            return sku
        if time.monotonic() > deadline:
            log = (b.tmp / "worker.log").read_text()[-3000:]
            raise TimeoutError(f"no worker for {name}: {r.text}\n{log}")
        time.sleep(1.0)


def slow_steps(worker_log: str, since: datetime) -> list[str]:
    """The worker's slow-step warnings logged after `since` (local time, as the worker's log
    lines are stamped): the worker announced itself only after its warm-up, so these are the
    steps a user waited on."""
    found = []
    for line in worker_log.splitlines():
        if "slow engine step" not in line:
            continue
        try:
            stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
        except ValueError:
            stamp = since  # unstamped: count it
        if stamp >= since:
            found.append(line.strip())
    return found


class SlowStepWatch:
    """Prints the worker's slow-step warnings as they appear (after each round and sweep point),
    so a run cut short by a time limit still shows the ones it met."""

    def __init__(self, worker_log: Path, since: datetime) -> None:
        self.worker_log, self.since, self.seen = worker_log, since, 0

    def report(self, where: str) -> None:
        found = slow_steps(self.worker_log.read_text(errors="replace"), self.since)
        for line in found[self.seen :]:
            print(f"slow step ({where}): {line}", flush=True)
        self.seen = len(found)


def median_of_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary from a mode's rounds: each number the median over them, errors summed."""
    merged: dict[str, Any] = {"rounds": len(rounds)}
    for key, value in rounds[0].items():
        if key == "errors":
            merged[key] = sum(r[key] for r in rounds)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            merged[key] = statistics.median(r[key] for r in rounds)
        else:
            merged[key] = value
    return merged


def concurrency_sweep(
    b: Any, sku: dict[str, Any], a: argparse.Namespace, watch: SlowStepWatch, deadline: float
) -> list[dict[str, Any]]:
    """Each concurrency C: 2 x C requests, a warm gateway round, then `--sweep-rounds` rounds
    alternating direct and governed (medians; the rounds are kept beside them). Points left
    when the clock passes `deadline` (time.perf_counter) are skipped, and said so."""
    rows = []
    load_point = a.concurrency
    for c in a.sweep:
        if time.perf_counter() > deadline:
            print(f"sweep C={c}: skipped, past --budget-s", flush=True)
            rows.append({"concurrency": c, "skipped": "past --budget-s"})
            continue
        a.concurrency = c
        prompts = [prompt_text(a.prompt_tokens, 1000 * c + i) for i in range(2 * c)]
        asyncio.run(through_gateway(b.url, b.key, sku["name"], prompts, a, set()))
        direct_rounds, gateway_rounds = [], []
        for _ in range(a.sweep_rounds):
            direct_rounds.append(summary(*asyncio.run(direct(b, sku, prompts, a))))
            gateway_rounds.append(
                summary(*asyncio.run(through_gateway(b.url, b.key, sku["name"], prompts, a, set())))
            )
        d, g = median_of_rounds(direct_rounds), median_of_rounds(gateway_rounds)
        rows.append({
            "concurrency": c, "direct": d, "gateway": g,
            "direct_rounds": direct_rounds, "gateway_rounds": gateway_rounds,
        })  # fmt: skip
        print(
            f"sweep C={c}: direct {d['output_tokens_per_s']:.1f} tok/s, governed "
            f"{g['output_tokens_per_s']:.1f} tok/s, TTFT p50 {g['ttft_s_p50']:.3f} s "
            f"(medians of {a.sweep_rounds})",
            flush=True,
        )
        watch.report(f"sweep C={c}")
    a.concurrency = load_point
    return rows


def print_sweep(rows: list[dict[str, Any]]) -> None:
    print(f"{'C':>4}{'direct tok/s':>14}{'governed tok/s':>16}{'gov/direct':>12}"
          f"{'TTFT p50':>10}{'TTFT p95':>10}{'errors':>8}")  # fmt: skip
    for r in rows:
        if "skipped" in r:
            print(f"{r['concurrency']:>4}  skipped: {r['skipped']}")
            continue
        d, g = r["direct"], r["gateway"]
        ratio = g["output_tokens_per_s"] / d["output_tokens_per_s"]
        print(
            f"{r['concurrency']:>4}{d['output_tokens_per_s']:>14.1f}{g['output_tokens_per_s']:>16.1f}"
            f"{ratio:>12.3f}{g['ttft_s_p50']:>10.3f}{g['ttft_s_p95']:>10.3f}"
            f"{d['errors'] + g['errors']:>8}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", default="qwen3.6-27b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantize", default="fp8", choices=["fp8", "w4", "none"])
    ap.add_argument("--kv-dtype", default="fp8", choices=["fp8", "none"])
    ap.add_argument("--gpu-type", default="H200")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--hang-up", type=int, default=4, help="clients of the last round that hang up")
    ap.add_argument("--load-timeout-s", type=float, default=900)
    ap.add_argument("--out", type=Path, default=result_path("gpu_endpoint"))
    ap.add_argument("--sweep", default="", help="concurrencies to measure after the load point")
    ap.add_argument("--sweep-rounds", type=int, default=1, help="rounds of each mode a point")
    ap.add_argument("--slow-step-s", type=float, default=0.25, help="worker steps logged as slow")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=0,
        help="skip the sweep points left once this many seconds have passed (0: no limit), so a "
        "run under a time limit still writes its JSON",
    )
    ap.add_argument(
        "--long-prompt-tokens",
        type=int,
        default=0,
        help="then one prompt of about this many tokens through the gateway (16 output tokens), "
        "reconciled; the worker's context limit is raised to fit it",
    )
    ap.add_argument(
        "--engine-rounds",
        type=int,
        default=0,
        help="rounds of the worker's engine alone in this process first (the worker's ceiling)",
    )
    a = ap.parse_args()
    a.sweep = [int(c) for c in a.sweep.split(",") if c]
    a.uvloop = False
    prompts = [prompt_text(a.prompt_tokens, i) for i in range(a.requests)]
    runs: dict[str, list[tuple[list[dict[str, Any]], float]]] = {"direct": [], "gateway": []}
    alone = engine_alone(a, prompts) if a.engine_rounds else None
    began = time.perf_counter()
    with ExitStack() as stack:
        b = Bench(a, stack)
        b.start()
        t0 = time.perf_counter()
        sku = start_worker(b, a)
        load_s = time.perf_counter() - t0
        ready_at = datetime.now()
        print(f"worker ready in {load_s:.0f} s", flush=True)
        watch = SlowStepWatch(b.tmp / "worker.log", ready_at)

        def one_round(mode: str) -> tuple[list[dict[str, Any]], float]:
            if mode == "direct":
                return asyncio.run(direct(b, sku, prompts, a))
            return asyncio.run(through_gateway(b.url, b.key, sku["name"], prompts, a, set()))

        # A whole warm-up round of each: the first prefill batches of each composition compile
        # kernels (seconds, once), which would otherwise land on whichever mode runs first.
        one_round("direct")
        one_round("gateway")
        for i in range(a.rounds):
            for mode in ("direct", "gateway") if i % 2 == 0 else ("gateway", "direct"):
                runs[mode].append(one_round(mode))
                s = summary(*runs[mode][-1])
                print(
                    f"round {i + 1} {mode}: {s['output_tokens_per_s']:.1f} tok/s, "
                    f"TTFT p50 {s['ttft_s_p50']:.3f} s p95 {s['ttft_s_p95']:.3f} s",
                    flush=True,
                )
                watch.report(f"round {i + 1} {mode}")
        asyncio.run(worker_view(b, [r for rs, _ in runs["direct"] for r in rs]))
        since = datetime.now(UTC)
        hang_up = set(range(0, a.requests, max(1, a.requests // max(1, a.hang_up))))
        recon_results, _ = asyncio.run(
            through_gateway(b.url, b.key, sku["name"], prompts, a, hang_up)
        )
        report = b.reconcile(len(prompts), since)
        long_prompt = long_prompt_through_gateway(b, sku, a) if a.long_prompt_tokens else None
        deadline = began + a.budget_s if a.budget_s > 0 else float("inf")
        sweep_rows = concurrency_sweep(b, sku, a, watch, deadline) if a.sweep else []
        worker_log = (b.tmp / "worker.log").read_text(errors="replace")
    modes = {
        mode: summary([r for rs, _ in rr for r in rs], sum(w for _, w in rr))
        for mode, rr in runs.items()
    }
    cost = 100 * (
        1 - modes["gateway"]["output_tokens_per_s"] / modes["direct"]["output_tokens_per_s"]
    )
    result = {
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "config": {k: str(v) for k, v in vars(a).items()},
        "worker_load_s": load_s,
        **modes,
        "rounds": {mode: [summary(*run) for run in rr] for mode, rr in runs.items()},
        # Every request of every round, in completion order (sent_s from the round's start, ttft_s,
        # e2e_s, tokens, errors).
        "requests_by_round": {mode: [run[0] for run in rr] for mode, rr in runs.items()},
        "gateway_cost_pct": cost,
        "reconciliation": {
            "requests": report.requests,
            "client_hung_up": sum(bool(r.get("cancelled")) for r in recon_results),
            "errors": sum(not r["ok"] for r in recon_results),
            **reconciled(report, mismatches_kept=20),
        },
    }
    result["sweep"] = sweep_rows
    result["long_prompt"] = long_prompt
    if alone is not None:
        result["engine_alone"] = alone
        result["worker_vs_engine"] = (
            modes["direct"]["output_tokens_per_s"] / alone["output_tokens_per_s"]
        )
    result["slow_steps_after_warm_up"] = slow_steps(worker_log, ready_at)
    if a.device == "cuda":
        import torch

        result["machine"]["gpu"] = torch.cuda.get_device_name()
    write_result(a.out, result)
    print(
        f"\n{a.preset} ({a.quantize} weights, {a.kv_dtype} KV) on {a.device}: {a.requests} requests, "
        f"{a.concurrency} in flight, ~{a.prompt_tokens} + {a.max_tokens} tokens, {a.rounds} rounds"
    )
    rows = (
        ("output tok/s", "output_tokens_per_s", "{:.1f}"),
        ("TTFT p50 (s)", "ttft_s_p50", "{:.3f}"),
        ("TTFT p95 (s)", "ttft_s_p95", "{:.3f}"),
        ("E2E p50 (s)", "e2e_s_p50", "{:.3f}"),
        ("errors", "errors", "{}"),
    )
    print_table(
        ("", "direct (NATS)", "governed endpoint"),
        [
            (label, f.format(modes["direct"][key]), f.format(modes["gateway"][key]))
            for label, key, f in rows
        ],
        (22, 16, 20),
    )
    slow = [
        r
        for rs, _ in runs["direct"]
        for r in rs
        if r["ok"]
        and (r["ttft_s"] or 0)
        > 4 * percentile([x["ttft_s"] for x in rs if x["ok"] and x["ttft_s"]], 50)
    ]
    if slow:
        print(
            f"direct requests with TTFT over 4x their round's p50: {len(slow)}; client / worker "
            "TTFT (s): "
            + ", ".join(
                f"{r['ttft_s']:.2f}/{r.get('worker_ttft_s') or float('nan'):.2f}" for r in slow[:8]
            )
        )
    rc = result["reconciliation"]
    slow_list = result["slow_steps_after_warm_up"]
    print(f"worker steps over {a.slow_step_s} s after its warm-up: {len(slow_list)}")
    for line in slow_list[:5]:
        print("  " + line)
    if sweep_rows:
        print_sweep(sweep_rows)
    if long_prompt is not None:
        lp = long_prompt
        print(
            f"long prompt through the gateway: {lp['prompt_tokens']} prompt tokens, TTFT "
            f"{lp['ttft_s']} s, E2E {lp['e2e_s']:.1f} s, {lp['completion_tokens']} output tokens, "
            f"error {lp['error'] or 'none'}; reconciled {lp['match_rate_pct']:.2f}%"
        )
    print(f"gateway cost: {cost:.2f}% of output tok/s")
    if alone is not None:
        print(
            f"engine alone: {alone['output_tokens_per_s']:.1f} tok/s (median of "
            f"{a.engine_rounds}); worker (direct) / engine {result['worker_vs_engine']:.3f}"
        )
    print(
        f"reconciliation: {rc['requests']} requests ({rc['client_hung_up']} hung up): "
        f"{rc['match_rate_pct']:.2f}% matched, {len(report.mismatches)} mismatches, {rc['pending']} pending"
    )
    print(f"JSON: {a.out}")
    return 0 if not report.mismatches and not modes["gateway"]["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
