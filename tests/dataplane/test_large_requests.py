"""Requests larger than one NATS message (the server's max_payload, 1 MiB by default) within
the /v1 body limit: the gateway carries them through the JetStream object store, the worker
serves the whole prompt, and no body is left behind (worker/request_bodies.py)."""

from __future__ import annotations

from typing import Any

import nats
import openai
import pytest
from nats.js.errors import NotFoundError

from tests.dataplane.harness import Stack
from tests.dataplane.test_openai_api import async_client, expected_text
from worker import protocol as p

pytestmark = pytest.mark.timeout(120)

WORDS = 300_000  # " word" x 300K: 1.5 MB of prompt, a token a word for the fixed-rate worker


@pytest.fixture(scope="module")
async def long_sku(stack: Stack) -> dict[str, Any]:
    sku, _ = await stack.served_sku("long-", tokens_per_s=2000.0, max_context=1_000_000)
    return sku


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
