"""The load generator of bench/gateway/overhead.py, run in its own process.

It calls a fixed-rate worker with C concurrent streams, either through the gateway (HTTP/1.1
SSE on keep-alive connections, with a minimal client so that the client's own cost does not
pass for the gateway's) or directly over NATS (the gateway's own WorkerClient, no HTTP, no
auth, no metering by the gateway). It prints one JSON object: per-request TTFT, tokens and
outcome, and the wall time.

    python -m bench.gateway.load --mode gateway --url http://127.0.0.1:8080 --key KEY --model SKU ...
    python -m bench.gateway.load --mode direct --nats-url nats://... --prefix TM --sku-id SKU ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

import msgspec


@dataclass
class Result:
    ok: bool
    ttft_s: float | None
    tokens: int
    cancelled: bool = False
    request_id: str = ""
    error: str = ""
    # When the request was sent (time.perf_counter(), CLOCK_MONOTONIC on Linux: comparable
    # with the other processes' clocks when tracing where the time goes).
    sent_at: float = 0.0


class SSEConnection:
    """One keep-alive HTTP/1.1 connection that POSTs and reads a chunked SSE answer."""

    def __init__(self, host: str, port: int, key: str) -> None:
        self.host, self.port, self.key = host, port, key
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def stream(self, path: str, body: bytes, hang_up_after: int | None) -> Result:
        if self.writer is None:
            await self._connect()
        assert self.reader is not None and self.writer is not None
        # The request's bytes are ready before the clock starts, as the direct mode's
        # GenerateRequest is: TTFT counts the call, not the client building it.
        request = (
            f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\nauthorization: Bearer {self.key}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        reader = self.reader
        t0 = time.perf_counter()
        self.writer.write(request)
        # The response head in one read (one await, not one per header line).
        head = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
        status = int(head[0].split()[1])
        headers = {}
        for line in head[1:-2]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if status != 200 or headers.get("transfer-encoding") != "chunked":
            data = await reader.readexactly(int(headers.get("content-length", "0")))
            return Result(False, None, 0, error=f"{status} {data[:200]!r}")
        ttft, tokens, request_id, buf = None, 0, headers.get("x-request-id", ""), b""
        while True:
            size = int((await reader.readline()).strip(), 16)
            if size == 0:
                await reader.readline()
                return Result(
                    False, ttft, tokens, request_id=request_id, error="stream ended without [DONE]"
                )
            buf += (await reader.readexactly(size + 2))[:-2]
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                data = event.removeprefix(b"data: ")
                if data == b"[DONE]":
                    await reader.readline()  # the last chunk (size 0) and its CRLF
                    await reader.readline()
                    return Result(True, ttft, tokens, request_id=request_id, sent_at=t0)
                chunk = msgspec.json.decode(data)
                if "error" in chunk:
                    self.close()
                    return Result(
                        False, ttft, tokens, request_id=request_id, error=str(chunk["error"])
                    )
                choices = chunk.get("choices") or []
                if choices and (choices[0].get("delta") or {}).get("content"):
                    tokens += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    if tokens == hang_up_after:
                        self.close()  # the client goes away mid-stream
                        return Result(True, ttft, tokens, cancelled=True, request_id=request_id)


async def run_gateway(a: argparse.Namespace, rng: random.Random) -> tuple[list[Result], float]:
    url = urlsplit(a.url)
    body = msgspec.json.encode(
        {
            "model": a.model,
            "messages": [{"role": "user", "content": "Count."}],
            "stream": True,
            "max_tokens": a.max_tokens,
        }
    )
    remaining = a.requests
    results: list[Result] = []

    async def user(i: int) -> None:
        nonlocal remaining
        await asyncio.sleep(i * a.stagger_s / a.concurrency)
        conn = SSEConnection(url.hostname or "127.0.0.1", url.port or 80, a.key)
        while remaining > 0:
            remaining -= 1
            hang_up = (
                rng.randint(1, max(1, a.max_tokens // 2)) if rng.random() < a.cancel_frac else None
            )
            try:
                results.append(await conn.stream("/v1/chat/completions", body, hang_up))
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                conn.close()
                results.append(Result(False, None, 0, error=repr(exc)))
        conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(user(i) for i in range(a.concurrency)))
    return results, time.perf_counter() - t0


async def run_direct(a: argparse.Namespace) -> tuple[list[Result], float]:
    import nats

    from control_plane.dataplane.dispatch import WorkerClient, WorkerRegistry
    from worker import protocol as p

    nc = await nats.connect(a.nats_url)
    registry = WorkerRegistry(nc, a.prefix)
    client = WorkerClient(nc, a.prefix, registry)
    await registry.start()
    await client.start()
    for _ in range(200):  # the registry fills from heartbeats
        if registry.live_workers(a.sku_id):
            break
        await asyncio.sleep(0.05)
    remaining = a.requests
    results: list[Result] = []
    messages = [p.ChatMessage("user", "Count.")]

    async def user(i: int) -> None:
        nonlocal remaining
        await asyncio.sleep(i * a.stagger_s / a.concurrency)
        while remaining > 0:
            remaining -= 1
            request = p.GenerateRequest(
                request_id=uuid.uuid4().hex,
                tenant_id="bench",
                key_id="bench",
                sku_id=a.sku_id,
                model="bench",
                messages=messages,
                sampling=p.SamplingParams(max_tokens=a.max_tokens),
                reply_to="",
                admitted_at=time.time(),
            )
            t0 = time.perf_counter()
            ttft, tokens = None, 0
            d = await client.dispatch(request)
            try:
                async for chunk in d.chunks():
                    if chunk.text:
                        tokens += 1
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                results.append(
                    Result(True, ttft, tokens, request_id=request.request_id, sent_at=t0)
                )
            except Exception as exc:
                results.append(Result(False, ttft, tokens, error=repr(exc)))

    t0 = time.perf_counter()
    await asyncio.gather(*(user(i) for i in range(a.concurrency)))
    wall = time.perf_counter() - t0
    await client.close()
    await nc.close()
    return results, wall


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["gateway", "direct"], required=True)
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--key", default="")
    ap.add_argument("--model", default="")
    ap.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    ap.add_argument("--prefix", default="TM")
    ap.add_argument("--sku-id", default="")
    ap.add_argument("--concurrency", type=int, default=100)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--cancel-frac", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1)
    # Users start spread over this many seconds (one answer's duration gives a steady state
    # of `concurrency` streams instead of one burst of them).
    ap.add_argument("--stagger-s", type=float, default=0.0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    results, wall = asyncio.run(run_gateway(a, rng) if a.mode == "gateway" else run_direct(a))
    out = {
        "mode": a.mode,
        # From the first user's start to the last answer: the same span in both modes (not
        # the direct mode's imports, NATS connection and worker discovery before it).
        "wall_s": wall,
        "cpu_s": time.process_time(),  # the load generator's own CPU: is it the bottleneck?
        "results": [asdict(r) for r in results],
    }
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
