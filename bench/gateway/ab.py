"""Two gateways, one stack: does a change to the data plane move gateway-added TTFT?

Plain runs of bench/gateway/overhead.py spread by ~0.2 ms p50 on a shared 2-core machine, so a
0.1 ms change hides in them. Here the gateway of this tree (A) and the gateway of another
checkout (B: `--b-dir`, or `--b-rev` checked out into a temporary git worktree) serve the same
NATS, Postgres, projector and fixed-rate worker, and their rounds are interleaved with direct
rounds, so all three see the same machine at the same time.

    python -m bench.gateway.ab --b-rev HEAD~1                 # this tree (A) against HEAD~1 (B)
    python -m bench.gateway.ab --b-dir /tmp/old --rounds 8 --requests 300

Prints each round's gateway-added TTFT p50 for A and B, the pooled p50/p99 and in how many
rounds A was ahead; writes JSON (`--out`)."""

from __future__ import annotations

import argparse
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench.common import percentile, print_table, result_path, write_result
from bench.gateway.overhead import ROOT, Bench, free_port, summarize, wait_http


def checkout(rev: str, stack: ExitStack) -> Path:
    where = Path(tempfile.mkdtemp(prefix="tokenmill-ab-")) / "b"
    subprocess.run(["git", "worktree", "add", "--detach", str(where), rev], cwd=ROOT, check=True)
    stack.callback(
        lambda: subprocess.run(
            ["git", "worktree", "remove", "--force", str(where)], cwd=ROOT, check=False
        )
    )
    return where


def wait_port(port: int, within: float = 60) -> None:
    deadline = time.monotonic() + within
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--b-dir", type=Path, help="a checkout whose gateway is B")
    which.add_argument("--b-rev", help="a git revision of this repository whose gateway is B")
    which.add_argument(
        "--b-cmd",
        help="any server as B (an experiment): a command line with {port}, run with the stack's "
        "TOKENMILL_* environment",
    )
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=300, help="requests per round and mode")
    ap.add_argument("--concurrency", type=int, default=100)
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--uvloop", action="store_true")
    ap.add_argument("--out", type=Path, default=result_path("gateway_ab", gpu="cpu"))
    a = ap.parse_args()

    with ExitStack() as stack:
        b_dir = a.b_dir.resolve() if a.b_dir else checkout(a.b_rev, stack) if a.b_rev else ROOT
        bench = Bench(a, stack)
        bench.start()
        url_a = bench.url
        port_b = free_port()
        url_b = f"http://127.0.0.1:{port_b}"
        out = open(bench.tmp / "serve-b.log", "ab")  # noqa: SIM115 (the child writes it)
        cmd_b = [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port_b)]
        if a.b_cmd:
            cmd_b = shlex.split(a.b_cmd.format(port=port_b))
        serve_b = subprocess.Popen(
            cmd_b,
            cwd=b_dir,
            env={**bench.env, "PYTHONPATH": str(b_dir)},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        stack.callback(serve_b.terminate)
        if a.b_cmd:
            wait_port(port_b)
        else:
            wait_http(url_b + "/healthz")
        sku = bench.worker_sku("ab-fixed", a.rate, a.tokens)
        stagger = a.tokens / a.rate
        urls = {"A": url_a, "B": url_b}
        servers = {"A": bench.serve, "B": serve_b}

        def load(mode: str, requests: int) -> dict[str, Any]:
            if mode != "direct":  # (the CPU it reports is this mode's gateway's)
                bench.url, bench.serve = urls[mode], servers[mode]
            return bench.load(
                "direct" if mode == "direct" else "gateway",
                sku,
                requests,
                a.tokens,
                stagger_s=stagger,
            )

        for mode in ("A", "B", "direct"):  # warm-up: connections, caches
            load(mode, a.concurrency)
        rounds: list[dict[str, dict[str, Any]]] = []
        orders = (("direct", "A", "B"), ("B", "A", "direct"), ("A", "direct", "B"))
        for i in range(a.rounds):
            runs = {mode: load(mode, a.requests) for mode in orders[i % len(orders)]}
            r = {mode: summarize([run]) for mode, run in runs.items()}
            rounds.append(r)
            d = r["direct"]["ttft_ms_p50"]
            print(
                f"round {i + 1}: direct p50 {d:.3f} ms, added A {r['A']['ttft_ms_p50'] - d:+.3f}"
                f" B {r['B']['ttft_ms_p50'] - d:+.3f} ms",
                flush=True,
            )
        bench.url = url_a

    pooled: dict[str, list[float]] = {"direct": [], "A": [], "B": []}
    for r in rounds:
        for mode in pooled:
            pooled[mode].append(r[mode]["ttft_ms_p50"])
    ahead = sum(r["A"]["ttft_ms_p50"] < r["B"]["ttft_ms_p50"] for r in rounds)
    summary = {
        mode: {
            "median_round_p50_ms": percentile(values, 50),
            "median_round_p99_ms": percentile([r[mode]["ttft_ms_p99"] for r in rounds], 50),
            "gateway_cpu_ms_per_1k_tokens": percentile(
                [r[mode]["gateway_cpu_ms_per_1k_tokens"] for r in rounds], 50
            ),
        }
        for mode, values in pooled.items()
    }
    d50 = summary["direct"]["median_round_p50_ms"]
    d99 = summary["direct"]["median_round_p99_ms"]
    print()
    print_table(
        ("", "added p50", "added p99", "CPU ms/1k tok"),
        [
            (
                mode,
                f"{summary[mode]['median_round_p50_ms'] - d50:.3f}",
                f"{summary[mode]['median_round_p99_ms'] - d99:.3f}",
                f"{summary[mode]['gateway_cpu_ms_per_1k_tokens']:.1f}",
            )
            for mode in ("A", "B")
        ],
        (10, 12, 12, 16),
    )
    print(f"A ahead of B in {ahead} of {len(rounds)} rounds (medians over rounds)")
    write_result(
        a.out,
        {
            "config": {k: str(v) for k, v in vars(a).items()},
            "summary": summary,
            "a_ahead_rounds": ahead,
            "rounds": [
                {m: {k: v for k, v in s.items() if k != "first_errors"} for m, s in r.items()}
                for r in rounds
            ],
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
