"""Where a streamed request's time to first token goes inside the gateway, step by step.

The benchmark's stack (bench/gateway_overhead.py) with the gateway run under this module,
which patches `time.perf_counter()` stamps into the first-token path from outside the tree
(uvicorn's read callback, the request's NATS write, the reply's read and the first chunk's
write) and, for one request in N, marks inside the request path (auth, body parse, admission,
dispatch). The load generator's per-request send time and TTFT (same clock: CLOCK_MONOTONIC)
are joined with the gateway's stamps on the request id.

    python -m bench.gateway_trace                       # 100 streams, 2 x 500 requests a mode
    python -m bench.gateway_trace --rounds 1 --requests 300

Prints the step table (p50/p90/p99), the request path's marks (offset from the read, p50) and
a calibration: one fixed JSON body decoded at the start of each request's read callback, then
again at once: how much slower code runs cold, on this machine, than warm. The stamps cost a
few microseconds each; compare runs of this tool with each other, not with the benchmark.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

STEPS = (
    "client's write -> gateway reads it",
    "head and body parsed (uvicorn)",
    "-> just before the NATS write",
    "the NATS write",
    "NATS -> worker -> NATS",
    "reply read -> handler called",
    "first chunk + head written",
    "written -> client has parsed it",
    "TTFT through the gateway",
)


def serve(argv: list[str]) -> int:
    """`tokenmill serve` with stamps; SIGUSR1 writes them to $TRACE_OUT and starts over."""
    import msgspec
    from uvicorn.protocols.http import httptools_impl

    from control_plane.admission import admission
    from control_plane.dataplane import auth, dispatch, gateway, requests, routes
    from control_plane.dataplane.fast_path import nats as fast_nats
    from control_plane.dataplane.fast_path import uvicorn as fast_uvicorn
    from tokenmill.cli import main
    from worker import protocol as wp

    clock = time.perf_counter
    now: dict[str, float] = {"read": 0.0, "complete": 0.0, "nats": 0.0}
    stamps: dict[str, list[float]] = {}
    marks: dict[str, list[tuple[str, float]]] = {}
    current: list[tuple[str, float]] = []
    calibration: list[tuple[float, float]] = []
    body = msgspec.json.encode(
        {"model": "m", "messages": [{"role": "user", "content": "Count."}], "max_tokens": 8}
    )
    seen = [0]
    every = int(os.environ.get("TRACE_MARK_EVERY", "1"))

    def mark(label: str) -> None:
        current.append((label, clock()))

    def wrap_sync(owner: Any, name: str, label: str) -> None:
        f = getattr(owner, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            mark(label + ">")
            try:
                return f(*a, **k)
            finally:
                mark(label + "<")

        setattr(owner, name, wrapper)

    def wrap_async(owner: Any, name: str, label: str) -> None:
        f = getattr(owner, name)

        async def wrapper(*a: Any, **k: Any) -> Any:
            mark(label + ">")
            try:
                return await f(*a, **k)
            finally:
                mark(label + "<")

        setattr(owner, name, wrapper)

    protocol = httptools_impl.HttpToolsProtocol
    data_received = protocol.data_received

    def traced_data_received(self: Any, data: bytes) -> None:
        if data.startswith(b"POST /v1/"):
            t0 = clock()
            requests.parse_chat(body)
            t1 = clock()
            requests.parse_chat(body)
            calibration.append((t1 - t0, clock() - t1))
            seen[0] += 1
        current.clear()
        now["read"] = clock()
        data_received(self, data)

    protocol.data_received = traced_data_received  # type: ignore[method-assign]
    message_complete = fast_uvicorn.FastPathProtocol.on_message_complete

    def traced_message_complete(self: Any) -> None:
        now["complete"] = clock()
        message_complete(self)

    fast_uvicorn.FastPathProtocol.on_message_complete = traced_message_complete  # type: ignore[method-assign]
    for owner, name, label in (
        (protocol, "on_headers_complete", "head"),
        (fast_uvicorn, "start_eagerly", "start"),
        (auth.Authorizer, "caller", "auth"),
        (routes, "parse_chat", "parse"),
        (auth.Authorizer, "sku", "sku"),
        (wp, "encode", "encode"),
    ):
        wrap_sync(owner, name, label)
    for owner, name, label in (
        (admission.Admission, "admit", "admit"),
        (gateway.Gateway, "open", "open"),
    ):
        wrap_async(owner, name, label)
    publish_now = fast_nats.publish_now

    def traced_publish_now(nc: Any, subject: str, payload: bytes, reply: str = "") -> bool:
        t = clock()
        sent = publish_now(nc, subject, payload, reply)
        if reply:
            rid = reply.rsplit(".", 1)[-1]
            stamps[rid] = [now["read"], now["complete"], t, clock()]
            if seen[0] % every == 0:
                marks[rid] = [(label, x - now["read"]) for label, x in current]
        return sent

    fast_nats.publish_now = traced_publish_now
    parse = fast_nats._InlineParser.parse

    async def traced_parse(self: Any, data: bytes = b"") -> None:
        now["nats"] = clock()
        await parse(self, data)

    fast_nats._InlineParser.parse = traced_parse  # type: ignore[method-assign]
    on_reply = dispatch.WorkerClient._on_reply

    def traced_on_reply(self: Any, subject: str, data: bytes, headers: Any) -> None:
        t = clock()
        on_reply(self, subject, data, headers)
        s = stamps.get(subject.rsplit(".", 1)[-1])
        if s is not None and len(s) == 4 and b"\xa5chunk" in data[:20]:  # the first TokenChunk
            s += [now["nats"], t, clock()]

    dispatch.WorkerClient._on_reply = traced_on_reply  # type: ignore[method-assign]

    def dump(*_: Any) -> None:
        out = {"stamps": stamps, "marks": marks, "calibration": calibration}
        Path(os.environ["TRACE_OUT"]).write_text(json.dumps(out))
        stamps.clear()
        marks.clear()
        calibration.clear()

    signal.signal(signal.SIGUSR1, dump)
    return main(["serve", *argv])


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q / 100 * len(v)))] if v else float("nan")


def report(results: dict[str, list[dict[str, Any]]], trace: dict[str, Any]) -> dict[str, Any]:
    direct = [r["ttft_s"] * 1e3 for r in results["direct"] if r["ttft_s"]]
    through = [r["ttft_s"] * 1e3 for r in results["gateway"] if r["ttft_s"]]
    added = pct(through, 50) - pct(direct, 50)
    print(f"direct TTFT p50 {pct(direct, 50):.3f} ms, through the gateway {pct(through, 50):.3f}")
    print(f"added p50 {added:.3f} ms, p99 {pct(through, 99) - pct(direct, 99):.3f} ms\n")
    steps: dict[str, list[float]] = {s: [] for s in STEPS}
    for r in results["gateway"]:
        s = trace["stamps"].get(r["request_id"])
        if not s or len(s) < 7 or not r["ttft_s"]:
            continue
        read, complete, pub0, pub1, nats_read, reply0, reply1 = s[:7]
        sent, got = r["sent_at"], r["sent_at"] + r["ttft_s"]
        times = (read, complete, pub0, pub1, nats_read, reply0, reply1, got)
        spans = [b - a for a, b in zip((sent, *times), times, strict=False)] + [got - sent]
        for step, span in zip(STEPS, spans, strict=True):
            steps[step].append(span * 1e6)
    n = len(steps[STEPS[0]])
    print(f"{'step (us)':40}{'p50':>8}{'p90':>8}{'p99':>8}   n={n}")
    for step, v in steps.items():
        print(f"{step:40}{pct(v, 50):8.0f}{pct(v, 90):8.0f}{pct(v, 99):8.0f}")
    offsets: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
    for request_marks in trace["marks"].values():
        count: collections.Counter[str] = collections.Counter()
        for label, x in request_marks:
            count[label] += 1
            offsets[(label, count[label])].append(x * 1e6)
    print("\nrequest path, offset from the read (p50, us):")
    for (label, _), v in sorted(offsets.items(), key=lambda kv: pct(kv[1], 50)):
        print(f"  {label:10}{pct(v, 50):8.1f}")
    cold = [c[0] * 1e6 for c in trace["calibration"]]
    warm = [c[1] * 1e6 for c in trace["calibration"]]
    print(
        f"\ncalibration: one JSON body decoded at the read: {pct(cold, 50):.1f} us, "
        f"again at once: {pct(warm, 50):.1f} us (p50)"
    )
    return {
        "ttft_added_ms_p50": added,
        "steps_us": {
            s: {"p50": pct(v, 50), "p90": pct(v, 90), "p99": pct(v, 99)} for s, v in steps.items()
        },
        "marks_us_p50": {f"{label}#{i}": pct(v, 50) for (label, i), v in offsets.items()},
        "calibration_us_p50": {"cold": pct(cold, 50), "again": pct(warm, 50)},
        "direct_mean_ms": statistics.mean(direct) if direct else None,
    }


def run(a: argparse.Namespace) -> int:
    from bench.gateway_overhead import Bench, wait_http

    trace_out = Path(os.environ.get("TRACE_OUT", "/tmp/tokenmill-gateway-trace.json"))

    class TracedBench(Bench):
        def start(self) -> None:
            self.env["TRACE_OUT"] = str(trace_out)
            self.env["TRACE_MARK_EVERY"] = str(a.mark_every)
            port = str(self.port)
            self.serve = self.spawn(
                "-m", "bench.gateway_trace", "serve", "--port", port, log="serve.log"
            )
            self.spawn("-m", "tokenmill.cli", "project", log="project.log")
            wait_http(self.url + "/healthz")
            tenant = self.admin("POST", "/tenants", {"name": "bench"})
            self.key = self.admin("POST", f"/tenants/{tenant['tenant_id']}/keys", {})["key"]

    a.uvloop = False
    results: dict[str, list[dict[str, Any]]] = {"direct": [], "gateway": []}
    with ExitStack() as stack:
        b = TracedBench(a, stack)
        b.start()
        sku = b.worker_sku("trace-fixed", a.rate, a.tokens)
        b.load("gateway", sku, a.concurrency, a.tokens)  # warm-up
        b.load("direct", sku, a.concurrency, a.tokens)
        os.kill(b.serve.pid, signal.SIGUSR1)  # the warm-up's stamps are dropped
        time.sleep(0.5)
        for _ in range(a.rounds):
            for mode in ("direct", "gateway"):
                run = b.load(mode, sku, a.requests, a.tokens, stagger_s=a.tokens / a.rate)
                results[mode] += run["results"]
        os.kill(b.serve.pid, signal.SIGUSR1)
        time.sleep(1.0)
    summary = report(results, json.loads(trace_out.read_text()))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) for k, v in vars(a).items()}
    a.out.write_text(json.dumps({"config": config, **summary}, indent=2) + "\n")
    print(f"JSON: {a.out}")
    return 0


def main() -> int:
    if sys.argv[1:2] == ["serve"]:
        return serve(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=100)
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--mark-every", type=int, default=1, help="marks for one request in N")
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "gateway_trace.json"
    )
    return run(ap.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
