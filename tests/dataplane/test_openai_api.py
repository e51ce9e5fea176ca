"""/v1 through the official openai client (sync and async, streamed and not), against the real
app, NATS, Postgres and a fixed-rate worker process; every answer checked against the ledger."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import httpx
import openai
import pytest

from tests.dataplane.harness import Stack

pytestmark = pytest.mark.timeout(120)


def expected_text(n: int) -> str:
    """What the fixed-rate worker says in n tokens."""
    return "".join(f" t{i}" for i in range(n))


def sync_client(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.v1, api_key=key, max_retries=0, timeout=30)


def async_client(stack: Stack, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.v1, api_key=key, max_retries=0, timeout=30)


async def tenant_client(stack: Stack) -> openai.AsyncOpenAI:
    """A client with the key of a new tenant."""
    _, key = await stack.tenant_with_key()
    return async_client(stack, key["key"])


MESSAGES: list[Any] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Count for me please"},
]
# The fixed-rate worker counts words, plus 3 per message.
MESSAGES_PROMPT_TOKENS = 3 + 3 + 4 + 3


async def test_chat_sync_not_streamed(stack: Stack, sku: dict[str, Any]) -> None:
    tenant, key = await stack.tenant_with_key()
    client = sync_client(stack, key["key"])
    r = await asyncio.to_thread(
        client.chat.completions.create, model=sku["name"], messages=MESSAGES
    )
    assert r.object == "chat.completion" and r.model == sku["name"]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected_text(32)
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        MESSAGES_PROMPT_TOKENS,
        32,
        MESSAGES_PROMPT_TOKENS + 32,
    )
    assert (
        r.usage.prompt_tokens_details is not None
        and r.usage.prompt_tokens_details.cached_tokens == 0
    )
    row = await stack.ledger_row(r.id.removeprefix("chatcmpl-"))
    assert (
        row["tenant_id"] == tenant["tenant_id"]
        and row["key_id"] == key["key_id"]
        and row["sku_id"] == sku["sku_id"]
    )
    assert (row["prompt_tokens"], row["completion_tokens"], row["finish_reason"]) == (
        MESSAGES_PROMPT_TOKENS,
        32,
        "stop",
    )
    assert row["ttft_ms"] is not None and row["e2e_ms"] >= row["ttft_ms"]


async def test_chat_async_streamed_with_usage(stack: Stack, sku: dict[str, Any]) -> None:
    client = await tenant_client(stack)
    stream = await client.chat.completions.create(
        model=sku["name"],
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True},
        max_completion_tokens=10,
    )
    text, finish, usage, ids, roles = [], None, None, set(), []
    async for chunk in stream:
        ids.add(chunk.id)
        if chunk.choices:
            delta = chunk.choices[0].delta
            roles.append(delta.role)
            text.append(delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        else:
            usage = chunk.usage
    assert "".join(text) == expected_text(10)
    assert finish == "length" and roles[0] == "assistant"
    assert (
        usage is not None
        and usage.completion_tokens == 10
        and usage.prompt_tokens == MESSAGES_PROMPT_TOKENS
    )
    (cid,) = ids
    row = await stack.ledger_row(cid.removeprefix("chatcmpl-"))
    assert (row["completion_tokens"], row["finish_reason"]) == (10, "length")


async def test_streamed_usage_is_recorded_without_include_usage(
    stack: Stack, sku: dict[str, Any]
) -> None:
    _, key = await stack.tenant_with_key()
    stream = await async_client(stack, key["key"]).chat.completions.create(
        model=sku["name"], messages=MESSAGES, stream=True, max_tokens=5
    )
    chunks = [c async for c in stream]
    assert all(c.usage is None for c in chunks)
    row = await stack.ledger_row(chunks[0].id.removeprefix("chatcmpl-"))
    assert row["completion_tokens"] == 5
    delivered = await stack.delivery_rows([row["request_id"]])
    assert delivered[row["request_id"]]["completion_tokens"] == 5


async def test_completions_sync_and_async(stack: Stack, sku: dict[str, Any]) -> None:
    _, key = await stack.tenant_with_key()
    r = await asyncio.to_thread(
        sync_client(stack, key["key"]).completions.create, model=sku["name"], prompt="one two three"
    )
    # The legacy endpoint's default max_tokens is 16.
    assert (
        r.object == "text_completion"
        and r.choices[0].text == expected_text(16)
        and r.choices[0].finish_reason == "length"
    )
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (3, 16)
    stream = await async_client(stack, key["key"]).completions.create(
        model=sku["name"],
        prompt="a b",
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts = [c async for c in stream]
    assert "".join(c.choices[0].text for c in parts if c.choices) == expected_text(4)
    assert parts[-1].usage is not None and parts[-1].usage.total_tokens == 6
    rows = await stack.ledger_rows([r.id.removeprefix("cmpl-"), parts[0].id.removeprefix("cmpl-")])
    assert sorted(row["completion_tokens"] for row in rows.values()) == [4, 16]


async def test_stop_sequence_cuts_the_answer(stack: Stack, sku: dict[str, Any]) -> None:
    client = await tenant_client(stack)
    r = await client.chat.completions.create(
        model=sku["name"],
        messages=MESSAGES,
        stop=[" t3", "never"],
        seed=7,
        temperature=0.5,
        top_p=0.9,
    )
    assert r.choices[0].message.content == expected_text(3) and r.choices[0].finish_reason == "stop"
    stream = await client.chat.completions.create(
        model=sku["name"], messages=MESSAGES, stop=" t5", stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == expected_text(5)


async def test_models_lists_what_the_key_may_call(stack: Stack, sku: dict[str, Any]) -> None:
    other = await stack.publish_sku("other-" + uuid.uuid4().hex[:6])
    _, key = await stack.tenant_with_key()
    _, scoped = await stack.tenant_with_key(scopes=[other["name"]])
    names = {m.id async for m in async_client(stack, key["key"]).models.list()}
    assert {sku["name"], other["name"]} <= names
    scoped_names = [m.id async for m in async_client(stack, scoped["key"]).models.list()]
    assert scoped_names == [other["name"]]
    m = await async_client(stack, key["key"]).models.retrieve(sku["name"])
    assert m.id == sku["name"] and m.owned_by == "tokenmill"


# -- errors ----------------------------------------------------------------------------------


async def test_401_for_a_wrong_or_missing_key(stack: Stack, sku: dict[str, Any]) -> None:
    with pytest.raises(openai.AuthenticationError) as e:
        await async_client(stack, "tm_nope_nope").chat.completions.create(
            model=sku["name"], messages=MESSAGES
        )
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    body = e.value.body
    assert isinstance(body, dict) and set(body) == {"message", "type", "param", "code"}
    async with httpx.AsyncClient() as http:
        r = await http.post(
            stack.v1 + "/chat/completions", json={"model": sku["name"], "messages": MESSAGES}
        )
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


async def test_403_for_a_model_outside_the_key_scopes(stack: Stack, sku: dict[str, Any]) -> None:
    other = await stack.publish_sku("scoped-" + uuid.uuid4().hex[:6])
    _, scoped = await stack.tenant_with_key(scopes=[other["name"]])
    with pytest.raises(openai.PermissionDeniedError) as e:
        await asyncio.to_thread(
            sync_client(stack, scoped["key"]).chat.completions.create,
            model=sku["name"],
            messages=MESSAGES,
        )
    assert (
        e.value.status_code == 403
        and e.value.code == "model_not_allowed"
        and e.value.param == "model"
    )


async def test_404_for_an_unknown_model(stack: Stack, sku: dict[str, Any]) -> None:
    _, key = await stack.tenant_with_key()
    with pytest.raises(openai.NotFoundError) as e:
        await async_client(stack, key["key"]).chat.completions.create(
            model="no-such-model", messages=MESSAGES
        )
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        await async_client(stack, key["key"]).models.retrieve("no-such-model")


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
        ({"n": 17}, "n", None),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", None),
        ({"frequency_penalty": 0.5}, "frequency_penalty", "unsupported_parameter"),
        ({"temperature": 3}, "temperature", None),
        ({"top_p": 0}, "top_p", None),
        ({"max_tokens": -1}, "max_tokens", None),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", None),
        ({"no_such_thing": 1}, "no_such_thing", "unknown_parameter"),
        ({"stream_options": {"include_usage": True}}, "stream_options", None),
    ],
)
async def test_400_for_unsupported_or_invalid_parameters(
    stack: Stack, sku: dict[str, Any], extra: dict[str, Any], param: str, code: str | None
) -> None:
    _, key = await stack.tenant_with_key()
    with pytest.raises(openai.BadRequestError) as e:
        await async_client(stack, key["key"]).chat.completions.create(
            model=sku["name"], messages=MESSAGES, extra_body=extra
        )
    assert e.value.status_code == 400 and e.value.param == param and e.value.code == code
    assert isinstance(e.value.body, dict) and e.value.body["type"] == "invalid_request_error"


async def test_400_for_bodies_that_are_not_requests(stack: Stack, sku: dict[str, Any]) -> None:
    _, key = await stack.tenant_with_key()
    headers = {"authorization": f"Bearer {key['key']}"}
    async with httpx.AsyncClient(base_url=stack.v1, headers=headers) as http:
        not_json = await http.post(
            "/chat/completions", content=b"{nope", headers={"content-type": "application/json"}
        )
        no_messages = await http.post("/chat/completions", json={"model": sku["name"]})
        empty = await http.post("/chat/completions", json={"model": sku["name"], "messages": []})
        bad_role = await http.post(
            "/chat/completions",
            json={"model": sku["name"], "messages": [{"role": "tool", "content": "x"}]},
        )
        two_prompts = await http.post(
            "/completions", json={"model": sku["name"], "prompt": ["a", "b"]}
        )
    for r in (not_json, no_messages, empty, bad_role, two_prompts):
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert no_messages.json()["error"]["param"] == "messages"


async def test_400_when_the_prompt_exceeds_the_context(stack: Stack, sku: dict[str, Any]) -> None:
    """The worker refuses it (context 4096 in the fixed-rate worker): nothing runs, nothing is metered."""
    _, key = await stack.tenant_with_key()
    with pytest.raises(openai.BadRequestError) as e:
        await async_client(stack, key["key"]).completions.create(
            model=sku["name"], prompt="w " * 5000, stream=True
        )
    assert e.value.code == "context_length_exceeded"


async def test_503_when_no_worker_serves_the_model(stack: Stack) -> None:
    idle = await stack.publish_sku("idle-" + uuid.uuid4().hex[:6])
    _, key = await stack.tenant_with_key()
    for stream in (False, True):
        with pytest.raises(openai.InternalServerError) as e:
            await async_client(stack, key["key"]).chat.completions.create(
                model=idle["name"], messages=MESSAGES, stream=stream
            )
        assert e.value.status_code == 503 and e.value.code == "model_unavailable"


# -- governance changes take effect within a second -------------------------------------------


async def _refused_within(
    stack: Stack,
    key: dict[str, Any],
    sku: dict[str, Any],
    error: type[openai.APIStatusError],
    change: Any,
) -> float:
    """Seconds from `change` until `key` is refused with `error` (served before it)."""
    client, model = async_client(stack, key["key"]), sku["name"]
    await client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1)
    t0 = time.monotonic()
    await change()
    while True:
        try:
            await client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1)
        except error:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < 1.0, "still served a second after the change"
        await asyncio.sleep(0.01)


async def test_a_revoked_key_is_refused_within_a_second(stack: Stack, sku: dict[str, Any]) -> None:
    tenant, key = await stack.tenant_with_key()
    path = f"/tenants/{tenant['tenant_id']}/keys/{key['key_id']}/revoke"
    elapsed = await _refused_within(
        stack, key, sku, openai.AuthenticationError, lambda: stack.admin("POST", path)
    )
    assert elapsed < 1.0


async def test_a_suspended_tenant_is_refused_within_a_second(
    stack: Stack, sku: dict[str, Any]
) -> None:
    tenant, key = await stack.tenant_with_key()
    _, bystander = await stack.tenant_with_key()
    path = f"/tenants/{tenant['tenant_id']}/suspend"
    elapsed = await _refused_within(
        stack, key, sku, openai.PermissionDeniedError, lambda: stack.admin("POST", path, {})
    )
    assert elapsed < 1.0
    # Another tenant is untouched.
    r = await async_client(stack, bystander["key"]).chat.completions.create(
        model=sku["name"], messages=MESSAGES, max_tokens=1
    )
    assert r.usage is not None and r.usage.completion_tokens == 1


# -- admission (the governance extension) on the request path ---------------------------------


async def test_rate_limits_are_enforced_and_reported_on_v1(
    stack: Stack, sku: dict[str, Any]
) -> None:
    tenant, key = await stack.tenant_with_key()
    await stack.admin("PUT", f"/tenants/{tenant['tenant_id']}/limits", {"requests_per_minute": 2})
    client = async_client(stack, key["key"])
    for _ in range(100):  # the limit reaches the gateway through the control stream
        r = await client.chat.completions.with_raw_response.create(
            model=sku["name"], messages=MESSAGES, max_tokens=1
        )
        if r.headers.get("x-ratelimit-limit-requests") == "2":
            break
        await asyncio.sleep(0.01)
    assert (
        r.headers["x-ratelimit-limit-requests"] == "2"
        and "x-ratelimit-remaining-tokens" in r.headers
    )
    with pytest.raises(openai.RateLimitError) as e:
        for _ in range(3):
            await client.chat.completions.create(
                model=sku["name"], messages=MESSAGES, max_tokens=1, stream=True
            )
    assert e.value.code == "rate_limit_exceeded" and "retry-after" in e.value.response.headers
