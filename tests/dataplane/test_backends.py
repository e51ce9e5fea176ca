"""The pluggable backends behind the worker: the OpenAI-compatible proxy (pointed at another
tokenmill SKU as its "external engine") and the stop-string matcher the backends share."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import openai
import pytest

from tests.dataplane.harness import Stack
from tests.dataplane.test_openai_api import (
    MESSAGES,
    MESSAGES_PROMPT_TOKENS,
    async_client,
    expected_text,
)
from worker.backends.base import StopMatcher

# Not among the contract tests run both ways (tests/dataplane/conftest.py): the default only.
pytestmark = [pytest.mark.timeout(120), pytest.mark.fast_path_only]


@pytest.fixture(scope="module")
async def proxied(stack: Stack, sku: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A SKU whose worker forwards to the fixed-rate SKU through this same /v1, with its own key
    (so the upstream is metered too, under the proxy's tenant)."""
    proxy_tenant, upstream_key = await stack.tenant_with_key()
    proxy_sku = await stack.publish_sku("proxy-" + uuid.uuid4().hex[:6])
    stack.start_worker(
        proxy_sku["sku_id"],
        backend="openai_proxy",
        env={"TM_TEST_UPSTREAM_KEY": upstream_key["key"]},
        base_url=stack.v1,
        model=sku["name"],
        api_key_env="TM_TEST_UPSTREAM_KEY",
        max_context=4096,
    )
    await stack.wait_served(proxy_sku["sku_id"])
    return proxy_sku, proxy_tenant


async def test_the_proxy_relays_and_meters_like_our_own_worker(
    stack: Stack, proxied: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    proxy_sku, proxy_tenant = proxied
    tenant, key = await stack.tenant_with_key()
    client = async_client(stack, key["key"])
    r = await client.chat.completions.create(
        model=proxy_sku["name"], messages=MESSAGES, max_tokens=12
    )
    assert (
        r.choices[0].message.content == expected_text(12) and r.choices[0].finish_reason == "length"
    )
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (
        MESSAGES_PROMPT_TOKENS,
        12,
    )
    row = await stack.ledger_row(r.id.removeprefix("chatcmpl-"))
    assert (row["tenant_id"], row["sku_id"]) == (tenant["tenant_id"], proxy_sku["sku_id"])
    assert (row["prompt_tokens"], row["completion_tokens"], row["finish_reason"]) == (
        MESSAGES_PROMPT_TOKENS,
        12,
        "length",
    )
    upstream = await stack.services.pool.fetch(
        "SELECT * FROM usage_ledger WHERE tenant_id = $1", proxy_tenant["tenant_id"]
    )
    assert [(u["completion_tokens"], u["finish_reason"]) for u in upstream] == [(12, "length")]

    stream = await client.completions.create(
        model=proxy_sku["name"], prompt="x y z", max_tokens=5, stream=True, stop=[" t4"]
    )
    text = "".join([c.choices[0].text async for c in stream if c.choices])
    assert text == expected_text(4)


async def test_a_hang_up_through_the_proxy_cancels_upstream_too(
    stack: Stack, proxied: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    proxy_sku, proxy_tenant = proxied
    _, key = await stack.tenant_with_key()
    before = await stack.services.pool.fetchval(
        "SELECT count(*) FROM usage_ledger WHERE tenant_id = $1", proxy_tenant["tenant_id"]
    )
    stream = await async_client(stack, key["key"]).chat.completions.create(
        model=proxy_sku["name"], messages=MESSAGES, stream=True
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    await stream.close()
    row = await stack.ledger_row(chunk.id.removeprefix("chatcmpl-"))
    assert row["finish_reason"] == "cancelled" and 1 <= row["completion_tokens"] < 32
    delivered = await stack.delivery_rows([row["request_id"]])
    assert delivered[row["request_id"]]["completion_tokens"] == row["completion_tokens"]
    for _ in range(100):  # the upstream request, cancelled when the proxy closed its stream
        upstream = await stack.services.pool.fetch(
            "SELECT * FROM usage_ledger WHERE tenant_id = $1 ORDER BY finished_at",
            proxy_tenant["tenant_id"],
        )
        if len(upstream) > before:
            break
        await asyncio.sleep(0.05)
    assert upstream[-1]["finish_reason"] == "cancelled" and upstream[-1]["completion_tokens"] < 32


async def test_an_upstream_400_reaches_the_client_as_a_400(
    stack: Stack, proxied: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    proxy_sku, _ = proxied
    _, key = await stack.tenant_with_key()
    with pytest.raises(openai.BadRequestError) as e:
        await async_client(stack, key["key"]).completions.create(
            model=proxy_sku["name"], prompt="w " * 5000
        )
    assert "maximum context length" in e.value.message


@pytest.mark.parametrize(
    ("pieces", "stops", "emitted", "stopped"),
    [
        ([" t0", " t1", " t2"], [" t1"], " t0", True),
        ([" t0", " t", "1"], [" t1"], " t0", True),  # a stop string split across tokens
        ([" a", " t", "x"], [" t1"], " a tx", False),  # a false start is released
        (["hello", " wor", "ld"], ["world"], "hello ", True),
        (["abc"], [], "abc", False),
    ],
)
def test_stop_matcher(pieces: list[str], stops: list[str], emitted: str, stopped: bool) -> None:
    m = StopMatcher(stops)
    out = ""
    for piece in pieces:
        out += m.feed(piece)
        if m.stopped:
            break
    if not m.stopped:
        out += m.flush()
    assert (out, m.stopped) == (emitted, stopped)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompts": ["a", "b"]}, "prompt"),
        ({"prompt_token_ids": [[7, 8]]}, "prompt"),
        ({"prompt": "a", "echo": True}, "echo"),
        ({"prompt": "a", "n": 2}, "n"),
    ],
)
@pytest.mark.parametrize("backend", ["fixed_rate", "openai_proxy"])
async def test_one_prompt_backends_refuse_what_they_cannot_serve(
    backend: str, fields: dict[str, Any], param: str
) -> None:
    from worker.backends.base import InvalidRequest
    from worker.backends.fixed_rate import FixedRateBackend
    from worker.backends.openai_proxy import OpenAIProxyBackend
    from worker.protocol import GenerateRequest

    b: Any = FixedRateBackend() if backend == "fixed_rate" else OpenAIProxyBackend("http://x", "m")
    b._http = object()  # never reached: the request is refused first
    request = GenerateRequest(
        request_id="r", tenant_id="t", key_id="k", sku_id="s", model="m", reply_to="",
        admitted_at=0.0, **fields,
    )  # fmt: skip
    with pytest.raises(InvalidRequest) as refused:
        await anext(b.generate(request))
    assert refused.value.param == param and refused.value.code == "unsupported_parameter"
