"""Requests larger than one NATS message (the server's max_payload, 1 MiB by default) within
the /v1 body limit: the gateway carries them through the JetStream object store, the worker
serves the whole prompt, and no body is left behind (worker/request_bodies.py)."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import nats
import openai
import pytest
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from control_plane.dataplane.dispatch import BodyStoreUnavailable, WorkerClient, WorkerRegistry
from control_plane.embedded import EmbeddedNats
from tests.dataplane.harness import Stack
from tests.dataplane.test_openai_api import async_client, expected_text
from worker import protocol as p
from worker.request_bodies import RequestBodies

pytestmark = pytest.mark.timeout(120)

WORDS = 300_000  # " word" x 300K: 1.5 MB of prompt, a token a word for the fixed-rate worker


@pytest.fixture(scope="module")
async def long_sku(stack: Stack) -> dict[str, Any]:
    sku, _ = await stack.served_sku("long-", tokens_per_s=2000.0, max_context=1_000_000)
    return sku


def generate_request(sku_id: str, **fields: Any) -> p.GenerateRequest:
    """A request of tenant "t", key "k" for `sku_id`, admitted now, with `fields`."""
    return p.GenerateRequest(
        **{
            "request_id": f"r{time.monotonic_ns()}",
            "tenant_id": "t",
            "key_id": "k",
            "sku_id": sku_id,
            "model": "m",
            "reply_to": "",
            "admitted_at": time.time(),
            **fields,
        }
    )


async def bodies_left(stack: Stack) -> list[str]:
    nc = await nats.connect(stack.nats_url)
    try:
        store = await nc.jetstream().object_store(p.request_bodies_bucket(stack.prefix))
        try:
            return [info.name for info in await store.list(ignore_deletes=True)]
        except NotFoundError:  # an empty bucket
            return []
    finally:
        await nc.close()


async def test_a_prompt_larger_than_a_message_is_served_whole(
    stack: Stack, long_sku: dict[str, Any]
) -> None:
    _, key = await stack.tenant_with_key()
    client = async_client(stack, key["key"])
    prompt = " word" * WORDS
    assert len(prompt) > 1024 * 1024
    r = await client.completions.create(model=long_sku["name"], prompt=prompt, max_tokens=3)
    assert r.choices[0].text == expected_text(3)
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (WORDS, 3)
    row = await stack.ledger_row(r.id.removeprefix("cmpl-"))
    assert (row["prompt_tokens"], row["completion_tokens"]) == (WORDS, 3)
    # chat too, streamed: the messages travel the same way
    stream = await client.chat.completions.create(
        model=long_sku["name"],
        messages=[{"role": "user", "content": prompt}],
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == expected_text(2)
    assert parts[-1].usage is not None and parts[-1].usage.prompt_tokens == WORDS + 3
    assert await bodies_left(stack) == []


async def test_a_large_prompt_over_the_context_is_refused_as_such(
    stack: Stack, sku: dict[str, Any]
) -> None:
    """The worker of 4,096 tokens reads the whole body and refuses it before any work."""
    _, key = await stack.tenant_with_key()
    with pytest.raises(openai.BadRequestError) as e:
        await async_client(stack, key["key"]).completions.create(
            model=sku["name"], prompt=" word" * WORDS, max_tokens=3
        )
    assert e.value.code == "context_length_exceeded"
    assert await bodies_left(stack) == []


async def test_a_stub_whose_body_is_gone_ends_in_an_error_not_a_hang(
    stack: Stack, sku: dict[str, Any]
) -> None:
    """A worker that cannot read a stub's body (expired, deleted) answers as for any failure:
    Accepted, then Finished with an error, 0 tokens (and its usage record says so)."""
    nc = await nats.connect(stack.nats_url)
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        stub = generate_request(sku["sku_id"], reply_to=inbox, body_object="never-stored")
        await nc.publish(p.work_subject(stack.prefix, sku["sku_id"]), p.encode(stub), reply=inbox)
        replies = [p.decode_reply((await sub.next_msg(timeout=10)).data) for _ in range(2)]
        assert isinstance(replies[0], p.Accepted)
        assert isinstance(replies[1], p.Finished)
        assert replies[1].finish_reason == "error" and replies[1].completion_tokens == 0
    finally:
        await nc.close()


async def test_no_store_for_a_large_request_is_a_503_before_any_work(
    nats_server: EmbeddedNats, stream_prefix: str
) -> None:
    """The bucket's stream exists but takes none of the object store's subjects (as when
    JetStream cannot store): the dispatch fails as BodyStoreUnavailable, nothing in flight,
    nothing published to workers."""
    nc = await nats.connect(nats_server.url)
    try:
        bucket = p.request_bodies_bucket(stream_prefix)
        await nc.jetstream().add_stream(name=f"OBJ_{bucket}", subjects=[f"{stream_prefix}.nothing"])
        seen: list[bytes] = []

        async def worker(msg: Msg) -> None:
            seen.append(msg.data)

        await nc.subscribe(p.work_subject(stream_prefix, "sku_big"), queue="q", cb=worker)
        registry = WorkerRegistry(nc, stream_prefix, dead_after_s=1.0)
        await registry.start()
        client = WorkerClient(nc, stream_prefix, registry)
        await client.start()
        big = generate_request("sku_big", prompt=" word" * WORDS)
        with pytest.raises(BodyStoreUnavailable):
            await client.dispatch(big)
        assert client.in_flight() == 0
        await nc.flush()
        assert seen == []
        await client.close()
        await registry.close()
    finally:
        await nc.close()


async def test_a_stub_carries_nothing_large(nats_server: EmbeddedNats, stream_prefix: str) -> None:
    """Whatever made the request large (prompt, tools, a schema) stays in the store: the stub
    fits a message whatever the request held, and the worker's side reads the request back."""
    big = " word" * WORDS
    request = generate_request(
        "s",
        request_id="r1",
        messages=[p.ChatMessage(role="user", content=big)],
        tools=[p.Tool(name="f", parameters=big)],
        response_format=p.ResponseFormat(type="json_schema", schema=big),
        reply_to="inbox.r1",
        gateway_id="gw",
    )
    gateway, worker = await nats.connect(nats_server.url), await nats.connect(nats_server.url)
    try:
        stub = await RequestBodies(gateway, stream_prefix).put(request, p.encode(request))
        assert len(p.encode(stub)) < 1024
        assert (stub.request_id, stub.reply_to, stub.gateway_id, stub.body_object) == (
            "r1",
            "inbox.r1",
            "gw",
            "r1",
        )
        rerouted = msgspec.structs.replace(stub, reply_to="inbox.other")
        assert await RequestBodies(worker, stream_prefix).take(rerouted) == msgspec.structs.replace(
            request, reply_to="inbox.other"
        )
    finally:
        await gateway.close()
        await worker.close()
