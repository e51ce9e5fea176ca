"""Routing requests to workers: by load (queue depth, then KV pressure), around dead workers,
and by prompt-prefix affinity within a tenant; real worker processes on real NATS, through
the real app. Plus `tokenmill worker --gpu N`."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from typing import Any

import openai
import pytest
from nats.aio.client import Client as NATS

from control_plane.dataplane.dispatch import Router, RoutingSettings, WorkerRegistry
from control_plane.embedded import EmbeddedNats
from tests.dataplane.harness import ROOT, Stack, stop_process
from tests.dataplane.test_openai_api import MESSAGES, async_client, expected_text, tenant_client
from worker import protocol as p
from worker.serve import _parse_args, use_gpu

# Not among the contract tests run both ways (tests/dataplane/conftest.py): the default only.
pytestmark = [pytest.mark.timeout(120), pytest.mark.fast_path_only]


def chat(sku: str, tenant: str, messages: list[p.ChatMessage]) -> p.GenerateRequest:
    return p.GenerateRequest(
        request_id=uuid.uuid4().hex,
        tenant_id=tenant,
        key_id="k",
        sku_id=sku,
        model="m",
        messages=messages,
        reply_to="",
        admitted_at=time.time(),
    )


async def presence(nc: NATS, prefix: str, *messages: p.WorkerAnnounce | p.WorkerHeartbeat) -> None:
    for m in messages:
        subject = (
            p.announce_subject(prefix)
            if isinstance(m, p.WorkerAnnounce)
            else p.heartbeat_subject(prefix, m.sku_id)
        )
        await nc.publish(subject, p.encode(m))
    await nc.flush()
    await asyncio.sleep(0.1)  # through NATS to the registry's subscription


def announce(wid: str, sku: str, capacity: int = 8) -> p.WorkerAnnounce:
    return p.WorkerAnnounce(
        worker_id=wid, sku_id=sku, model="m", backend="b", capacity=capacity, direct=True
    )


def beat(wid: str, sku: str, running: int, waiting: int, kv: float) -> p.WorkerHeartbeat:
    return p.WorkerHeartbeat(
        worker_id=wid, sku_id=sku, running=running, waiting=waiting, kv_pressure=kv, ts=0
    )


async def test_the_pick_follows_queue_depth_then_kv_pressure_and_skips_the_dead(
    nc: NATS, stream_prefix: str
) -> None:
    registry = WorkerRegistry(nc, stream_prefix, dead_after_s=0.5)
    await registry.start()
    router = Router(registry, RoutingSettings(affinity_entries=2))
    sku = "sku_pick"
    await presence(
        nc,
        stream_prefix,
        announce("a", sku),
        announce("b", sku),
        announce("c", sku),
        beat("a", sku, running=8, waiting=1, kv=0.3),  # a queue: worst, whatever its KV
        beat("b", sku, running=4, waiting=0, kv=0.9),
        beat("c", sku, running=2, waiting=0, kv=0.5),
    )
    assert [router.pick(sku, None).worker_id for _ in range(3)] == ["c"] * 3  # type: ignore[union-attr]

    # Requests this gateway sent since the last heartbeat count: c's KV estimate rises by its
    # average share per request (0.25) until it passes b's.
    registry.workers["c"].local += 2
    assert router.pick(sku, None).worker_id == "b"  # type: ignore[union-attr]
    # A heartbeat takes them in.
    await presence(nc, stream_prefix, beat("c", sku, running=4, waiting=0, kv=0.5))
    assert router.pick(sku, None).worker_id == "c"  # type: ignore[union-attr]

    # Equals are taken in turn.
    await presence(
        nc,
        stream_prefix,
        *(beat(w, sku, running=1, waiting=0, kv=0.1) for w in "abc"),
    )
    assert {router.pick(sku, None).worker_id for _ in range(6)} == {"a", "b", "c"}  # type: ignore[union-attr]

    # Only b keeps heartbeating: the others are dead past the liveness bound.
    for _ in range(8):
        await presence(nc, stream_prefix, beat("b", sku, running=7, waiting=3, kv=1.0))
    assert {router.pick(sku, None).worker_id for _ in range(4)} == {"b"}  # type: ignore[union-attr]
    await registry.close()


def test_the_prefix_key_is_the_conversations_start_salted_by_tenant() -> None:
    router = Router(WorkerRegistry(None, "X"), RoutingSettings())  # type: ignore[arg-type]
    sys_, u1 = p.ChatMessage("system", "be terse"), p.ChatMessage("user", "count")
    turn1 = chat("s", "t1", [sys_, u1])
    turn2 = chat(
        "s", "t1", [sys_, u1, p.ChatMessage("assistant", "1 2"), p.ChatMessage("user", "more")]
    )
    assert router.prefix_key(turn1) == router.prefix_key(turn2) is not None
    assert router.prefix_key(chat("s", "t2", [sys_, u1])) != router.prefix_key(turn1)
    assert router.prefix_key(chat("s", "t1", [sys_, p.ChatMessage("user", "other")])) != (
        router.prefix_key(turn1)
    )
    shared = Router(WorkerRegistry(None, "X"), RoutingSettings(affinity_cross_tenant=True))  # type: ignore[arg-type]
    assert shared.prefix_key(chat("s", "t2", [sys_, u1])) == shared.prefix_key(turn1)

    # The map is an LRU with a bound.
    small = Router(WorkerRegistry(None, "X"), RoutingSettings(affinity_entries=2))  # type: ignore[arg-type]
    for k in (b"1", b"2", b"1", b"3"):
        small.served(k, "w" + k.decode())
    assert list(small._affinity) == [b"1", b"3"]


async def served_by(stack: Stack, response_ids: list[str]) -> list[str]:
    rows = await stack.ledger_rows([r.removeprefix("chatcmpl-") for r in response_ids])
    return [rows[r.removeprefix("chatcmpl-")]["worker_id"] for r in response_ids]


def start_named(stack: Stack, sku_id: str, name: str, **config: Any) -> tuple[str, Any]:
    wid = f"{name}-{uuid.uuid4().hex[:6]}"
    return wid, stack.start_worker(sku_id, env={"TOKENMILL_WORKER_ID": wid}, **config)


async def test_the_faster_worker_gets_more_requests(stack: Stack) -> None:
    sku = await stack.publish_sku("speeds-" + uuid.uuid4().hex[:6])
    # 10-token answers: 0.2 s on the fast worker, 2 s on the slow one (long next to the
    # gateway's own time per request, which is the same on both).
    fast, fast_proc = start_named(stack, sku["sku_id"], "fast", tokens_per_s=50, output_tokens=10)
    slow, slow_proc = start_named(stack, sku["sku_id"], "slow", tokens_per_s=5, output_tokens=10)
    await stack.wait_served(sku["sku_id"], count=2)
    client = await tenant_client(stack)
    ids: list[str] = []

    async def user(n: int) -> None:
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            # Each conversation its own: affinity plays no part here.
            messages = [{"role": "user", "content": f"count {n} {uuid.uuid4().hex}"}]
            r = await client.chat.completions.create(model=sku["name"], messages=messages)  # type: ignore[arg-type]
            assert r.choices[0].message.content == expected_text(10)
            ids.append(r.id)

    await asyncio.gather(*(user(n) for n in range(12)))
    counts = Counter(await served_by(stack, ids))
    # Equal in flight on each, the fast one finishes 10 times as many; the gateway's own
    # time per request and the heartbeats' lag blur that, but not below 2.5 (a random or
    # round-robin pick gives about 1).
    assert counts[slow] > 0 and counts[fast] >= 2.5 * counts[slow], counts
    assert set(counts) == {fast, slow}
    for proc in (fast_proc, slow_proc):
        stop_process(proc)


async def test_a_killed_worker_fails_its_streams_metered_and_new_requests_go_to_the_other(
    stack: Stack,
) -> None:
    sku = await stack.publish_sku("kill-" + uuid.uuid4().hex[:6])
    doomed, doomed_proc = start_named(
        stack, sku["sku_id"], "doomed", tokens_per_s=20, output_tokens=100
    )
    other, other_proc = start_named(
        stack, sku["sku_id"], "other", tokens_per_s=20, output_tokens=100
    )
    await stack.wait_served(sku["sku_id"], count=2)
    client = await tenant_client(stack)
    streams = [
        await client.chat.completions.create(
            model=sku["name"],
            messages=[{"role": "user", "content": f"stream {i}"}],
            stream=True,
            max_tokens=40,
        )
        for i in range(4)
    ]
    chunks = [s.__aiter__() for s in streams]
    received: list[list[str]] = [[] for _ in streams]
    request_ids = [""] * len(streams)

    async def read(i: int, until: int | None) -> str | None:
        """Reads stream i (up to `until` chunks); the error's message if it fails."""
        try:
            while until is None or len(received[i]) < until:
                chunk = await chunks[i].__anext__()
                request_ids[i] = chunk.id.removeprefix("chatcmpl-")
                if chunk.choices and chunk.choices[0].delta.content:
                    received[i].append(chunk.choices[0].delta.content)
        except StopAsyncIteration:
            return None
        except openai.APIError as e:
            return str(e.message)
        return None

    await asyncio.gather(*(read(i, 3) for i in range(len(streams))))
    doomed_proc.send_signal(signal.SIGKILL)
    await asyncio.to_thread(doomed_proc.wait)
    await asyncio.sleep(0.05)
    # Sent at once, while the gateway still counts the dead worker live (its heartbeat has
    # not been missed for long yet): every one is served, by the other.
    after = await asyncio.gather(
        *(
            client.chat.completions.create(
                model=sku["name"],
                messages=[{"role": "user", "content": f"after {i}"}],
                max_tokens=3,
            )
            for i in range(4)
        )
    )
    assert [r.choices[0].message.content for r in after] == [expected_text(3)] * 4
    assert await served_by(stack, [r.id for r in after]) == [other] * 4

    errors = await asyncio.gather(*(read(i, None) for i in range(len(streams))))
    rows = await stack.ledger_rows(request_ids)
    lost = [i for i, e in enumerate(errors) if e is not None]
    # Streams on both workers: two on each when the loads they report tie, which a heartbeat
    # landing between the four requests can break on a loaded machine (routing by load, as it
    # should); which stream failed is checked against the ledger below.
    assert 1 <= len(lost) <= 3, errors
    for i in range(len(streams)):
        row = rows[request_ids[i]]
        text = "".join(received[i])
        if i in lost:
            assert "worker" in str(errors[i])
            assert row["worker_id"] == doomed and row["finish_reason"] == "error"
            assert row["completion_tokens"] == len(received[i]) and text == expected_text(
                len(received[i])
            )
        else:
            assert row["worker_id"] == other and row["finish_reason"] == "length"
            assert text == expected_text(40)
    stop_process(other_proc)


async def test_a_conversation_stays_on_its_worker_but_not_across_tenants(stack: Stack) -> None:
    sku = await stack.publish_sku("affinity-" + uuid.uuid4().hex[:6])
    procs = [
        start_named(stack, sku["sku_id"], name, tokens_per_s=50, output_tokens=200, capacity=8)[1]
        for name in ("w1", "w2")
    ]
    await stack.wait_served(sku["sku_id"], count=2)
    _, key_a = await stack.tenant_with_key()
    _, key_b = await stack.tenant_with_key()
    a, b = async_client(stack, key_a["key"]), async_client(stack, key_b["key"])

    first = await a.chat.completions.create(model=sku["name"], messages=MESSAGES, max_tokens=2)
    [home] = await served_by(stack, [first.id])
    # A long answer in the same conversation holds the same worker (affinity) and makes it the
    # more loaded one: by load alone, the next request would go to the other.
    long = await a.chat.completions.create(model=sku["name"], messages=MESSAGES, stream=True)
    async for _ in long:
        break
    await asyncio.sleep(0.3)  # heartbeats show it
    second_turn = [
        *MESSAGES,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And on?"},
    ]
    second = await a.chat.completions.create(
        model=sku["name"],
        messages=second_turn,  # type: ignore[arg-type]
        max_tokens=2,
    )
    # Another tenant's identical prompt is routed by load: to the idle worker.
    other_tenant = await b.chat.completions.create(
        model=sku["name"], messages=MESSAGES, max_tokens=2
    )
    # That worker is idle again once its heartbeat says so: before that, a heartbeat sent while
    # it answered can show it as loaded as the home worker, and a tie goes either way.
    await asyncio.sleep(0.3)
    # And so is tenant A's new conversation.
    fresh = await a.chat.completions.create(
        model=sku["name"],
        messages=[{"role": "user", "content": "A new topic"}],
        max_tokens=2,
    )
    await long.close()
    served = await served_by(stack, [second.id, other_tenant.id, fresh.id])
    assert served[0] == home
    assert served[1] != home and served[2] != home
    for proc in procs:
        stop_process(proc)


def test_gpu_pins_the_worker_to_one_visible_gpu() -> None:
    environ: dict[str, str] = {}
    s = _parse_args(
        [
            "--sku-id", "s", "--backend", "torch_runtime", "--worker-id", "host-1",
            "--config", '{"model_path": "m.gguf", "dtype": "bfloat16"}', "--gpu", "1",
        ],
        environ,
    )  # fmt: skip
    assert environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert s.backend_config == {"model_path": "m.gguf", "dtype": "bfloat16", "device": "cuda:0"}
    assert s.worker_id == "host-1-gpu1"

    # An index into the GPUs already visible to the process (a container's, say).
    environ = {"CUDA_VISIBLE_DEVICES": "4,5,6"}
    use_gpu(s, 2, environ)
    assert environ["CUDA_VISIBLE_DEVICES"] == "6"
    with pytest.raises(SystemExit):
        use_gpu(s, 3, {"CUDA_VISIBLE_DEVICES": "4,5,6"})
    with pytest.raises(SystemExit):
        use_gpu(
            _parse_args(["--backend", "torch_runtime", "--config", '{"device": "cpu"}'], {}),
            0,
            {},
        )
    # Without --gpu nothing changes.
    environ = {}
    assert _parse_args(["--worker-id", "w"], environ).worker_id == "w" and environ == {}


async def test_tokenmill_worker_gpu_announces_its_suffixed_id(
    nc: NATS, nats_server: EmbeddedNats, stream_prefix: str, tmp_path: Any
) -> None:
    """The argument through the real command line, on a host with no GPU (fixed-rate backend)."""
    registry = WorkerRegistry(nc, stream_prefix)
    await registry.start()
    env = {
        **os.environ,
        "TOKENMILL_NATS_URL": nats_server.url,
        "TOKENMILL_STREAM_PREFIX": stream_prefix,
        "TOKENMILL_LOG_LEVEL": "WARNING",
    }
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = await asyncio.to_thread(
        subprocess.Popen,
        [
            sys.executable, "-m", "tokenmill.cli", "--data-dir", str(tmp_path), "worker",
            "--sku-id", "sku_gpu", "--backend", "fixed_rate", "--worker-id", "box", "--gpu", "3",
            "--heartbeat-s", "0.1",
        ],
        cwd=ROOT,
        env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while not registry.live_workers("sku_gpu"):
            assert time.monotonic() < deadline and proc.poll() is None
            await asyncio.sleep(0.05)
        assert [w.worker_id for w in registry.live_workers("sku_gpu")] == ["box-gpu3"]
    finally:
        stop_process(proc)
        await registry.close()


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.timeout(900)
async def test_two_gpu_workers_of_one_host_share_a_skus_load(stack: Stack, tmp_path: Any) -> None:
    """The 2-GPU benchmark: `tokenmill worker --gpu 0` and `--gpu 1` with our runtime, one SKU,
    concurrent chats through the gateway. Needs two CUDA GPUs; the model is
    TOKENMILL_ROUTING_BENCH_MODEL (default: random weights at the 27B's shape)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    model = os.environ.get("TOKENMILL_ROUTING_BENCH_MODEL", "random:qwen3.6-27b")
    sku = await stack.publish_sku("gpus-" + uuid.uuid4().hex[:6])
    config = f'{{"model_path": "{model}", "dtype": "bfloat16", "max_num_seqs": 16}}'
    env = {
        **os.environ,
        "TOKENMILL_NATS_URL": stack.nats_url,
        "TOKENMILL_STREAM_PREFIX": stack.prefix,
        "TOKENMILL_LOG_LEVEL": "WARNING",
    }
    procs = [
        await asyncio.to_thread(
            subprocess.Popen,
            [
                sys.executable,
                "-m",
                "tokenmill.cli",
                "--data-dir",
                str(tmp_path),
                "worker",
                "--sku-id",
                sku["sku_id"],
                "--model",
                model,
                "--backend",
                "torch_runtime",
                "--config",
                config,
                "--worker-id",
                "bench",
                "--gpu",
                str(gpu),
                "--heartbeat-s",
                "0.1",
            ],
            cwd=ROOT,
            env=env,
        )  # fmt: skip
        for gpu in (0, 1)
    ]
    try:
        await stack.wait_served(sku["sku_id"], count=2, within=600)
        client = await tenant_client(stack)
        ids: list[str] = []
        tokens = 0

        async def user(n: int) -> None:
            nonlocal tokens
            for turn in range(4):
                messages = [{"role": "user", "content": f"Tell story {n}.{turn} {uuid.uuid4()}"}]
                r = await client.chat.completions.create(
                    model=sku["name"],
                    messages=messages,  # type: ignore[arg-type]
                    max_tokens=128,
                    temperature=0,
                )
                ids.append(r.id)
                tokens += r.usage.completion_tokens if r.usage else 0

        began = time.monotonic()
        await asyncio.gather(*(user(n) for n in range(32)))
        elapsed = time.monotonic() - began
        counts = Counter(await served_by(stack, ids))
        print(f"2 GPUs: {tokens / elapsed:.0f} output tokens/s over {elapsed:.1f} s; {counts}")
        assert set(counts) == {"bench-gpu0", "bench-gpu1"}
        assert min(counts.values()) >= 0.3 * len(ids), counts
    finally:
        for proc in procs:
            stop_process(proc)
