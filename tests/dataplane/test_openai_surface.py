"""Tools, structured output, logprobs, n, echo and completions' prompt shapes (texts, token ids,
several of either) through the official openai client, against a
scripted worker process (fixed token streams: every delta is known) over real NATS, Postgres
and the gateway; bills checked against the ledger and reconciled."""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from typing import Any

import openai
import pytest

from pricing.reconcile import reconcile
from tests.dataplane.harness import Stack, read_then_hang_up
from tests.dataplane.scripted import PLAIN_TOKENS, SCRIPTS, start_scripted_worker
from tests.dataplane.test_openai_api import tenant_client

pytestmark = pytest.mark.timeout(120)

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def user(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
async def scripted(stack: Stack) -> dict[str, Any]:
    sku = await stack.publish_sku("scripted-" + uuid.uuid4().hex[:6], model="scripted-test")
    start_scripted_worker(stack, str(sku["sku_id"]))
    await stack.wait_served(str(sku["sku_id"]))
    return sku


async def chat(stack: Stack, scripted: dict[str, Any], text: str, **fields: Any) -> Any:
    """The scripted SKU's whole answer to `text`, asked by a new tenant."""
    client = await tenant_client(stack)
    return await client.chat.completions.create(  # type: ignore[call-overload]
        model=scripted["name"], messages=user(text), **fields
    )


async def test_a_tool_call_comes_back_as_tool_calls_and_is_billed(
    stack: Stack, scripted: dict[str, Any]
) -> None:
    r = await chat(stack, scripted, "script:tool", tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    assert calls[0].id.startswith("call_") and calls[0].type == "function"
    assert calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    assert r.usage is not None and r.usage.completion_tokens == len(SCRIPTS["tool"])
    row = await stack.ledger_row(r.id.removeprefix("chatcmpl-"))
    assert row["completion_tokens"] == len(SCRIPTS["tool"])
    assert row["finish_reason"] == "stop"  # the bill knows no "tool_calls"


async def test_tool_calls_stream_as_deltas_and_history_is_accepted(
    stack: Stack, scripted: dict[str, Any]
) -> None:
    client = await tenant_client(stack)
    history: list[Any] = [
        *user("What is the weather in Rome?"),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        *user("script:two_tools"),
    ]
    stream = await client.chat.completions.create(
        model=scripted["name"], messages=history, tools=TOOLS, tool_choice="auto",
        parallel_tool_calls=True, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    calls: dict[int, dict[str, str]] = {}
    finish, usage = None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            assert not c.delta.content  # the calls are all there is
            for d in c.delta.tool_calls or []:
                if d.id is not None:  # the first delta of a call: id and name
                    assert d.index not in calls and d.function is not None
                    calls[d.index] = {"id": d.id, "name": d.function.name or "", "args": ""}
                calls[d.index]["args"] += (d.function.arguments if d.function else None) or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert [json.loads(c["args"]) for c in calls.values()] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert all(c["id"].startswith("call_") and c["name"] == "get_weather" for c in calls.values())
    assert len({c["id"] for c in calls.values()}) == 2
    assert usage is not None and usage.completion_tokens == len(SCRIPTS["two_tools"])


async def test_a_span_that_is_not_a_call_is_returned_as_content(
    stack: Stack, scripted: dict[str, Any]
) -> None:
    r = await chat(stack, scripted, "script:bad_tool", tools=TOOLS)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == "".join(SCRIPTS["bad_tool"])
    assert r.choices[0].finish_reason == "stop"


async def test_chat_logprobs_in_openai_shape(stack: Stack, scripted: dict[str, Any]) -> None:
    client = await tenant_client(stack)
    r = await client.chat.completions.create(
        model=scripted["name"], messages=user("hi"), logprobs=True, top_logprobs=2, max_tokens=5
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == 5
    assert [e.token for e in lp.content] == SCRIPTS["plain"][:5]
    assert [e.logprob for e in lp.content] == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5])
    assert lp.content[0].bytes == list(b" w0")
    assert [t.token for t in lp.content[0].top_logprobs] == [" w0", "x"]
    assert r.choices[0].finish_reason == "length"
    stream = await client.chat.completions.create(
        model=scripted["name"], messages=user("hi"), logprobs=True, max_tokens=3, stream=True
    )
    streamed = [
        e.token
        async for chunk in stream
        for c in chunk.choices
        for e in ((c.logprobs.content or []) if c.logprobs else [])
    ]
    assert streamed == SCRIPTS["plain"][:3]


async def test_n_choices_have_their_index_and_usage_sums_them(
    stack: Stack, scripted: dict[str, Any]
) -> None:
    client = await tenant_client(stack)
    r = await client.chat.completions.create(model=scripted["name"], messages=user("hi"), n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content == "".join(SCRIPTS["plain"]) for c in r.choices)
    assert r.usage is not None and r.usage.completion_tokens == 3 * PLAIN_TOKENS
    stream = await client.chat.completions.create(
        model=scripted["name"], messages=user("hi"), n=3, max_tokens=4, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    texts: list[str] = ["", "", ""]
    finishes: list[str | None] = [None, None, None]
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finishes[c.index] = c.finish_reason or finishes[c.index]
    assert texts == ["".join(SCRIPTS["plain"][:4])] * 3 and finishes == ["length"] * 3
    assert usage is not None and usage.completion_tokens == 12
    row = await stack.ledger_row(chunk.id.removeprefix("chatcmpl-"))
    assert row["completion_tokens"] == 12


async def test_completions_logprobs_and_echo(stack: Stack, scripted: dict[str, Any]) -> None:
    client = await tenant_client(stack)
    r = await client.completions.create(
        model=scripted["name"], prompt="say", max_tokens=3, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens == SCRIPTS["plain"][:3]
    assert lp.token_logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert lp.text_offset == [0, 3, 6]
    assert lp.top_logprobs is not None and list(lp.top_logprobs[0]) == [" w0", "x"]
    echoed = await client.completions.create(
        model=scripted["name"], prompt="say", max_tokens=2, echo=True
    )
    assert echoed.choices[0].text == "say w0 w1"
    stream = await client.completions.create(
        model=scripted["name"], prompt="say", max_tokens=2, echo=True, stream=True
    )
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == "say w0 w1"


async def test_json_mode_passes_through(stack: Stack, scripted: dict[str, Any]) -> None:
    client = await tenant_client(stack)
    schema: dict[str, Any] = {"type": "object", "properties": {"answer": {"type": "integer"}}}
    r = await client.chat.completions.create(
        model=scripted["name"], messages=user("script:json"),
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert json.loads(r.choices[0].message.content or "") == {"answer": 42}


BAD = [
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"n": 17}, "n"),
    # A supported parameter beside an invalid one: the invalid one is named.
    ({"parallel_tool_calls": False, "n": 17}, "n"),
    ({"n": 0}, "n"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"description": "x" * 70_000}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "string", "pattern": "(?<=a)b"}}}}, "response_format"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param"), BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
async def test_bad_tools_formats_and_bounds_are_a_400_naming_the_field(
    stack: Stack, scripted: dict[str, Any], extra: dict[str, Any], param: str
) -> None:
    client = await tenant_client(stack)
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(
            model=scripted["name"], messages=user("hi"), extra_body=extra
        )
    assert e.value.param == param, e.value.body
    if "pattern" in json.dumps(extra):  # the worker's grammar library says why
        assert "Lookbehind is not supported" in str(e.value.message)


# OpenAI's prompt shapes: (prompt, n, what each choice starts with under echo by index, the
# prompt tokens of all prompts). The scripted worker's token id t is the word `<t>`.
PROMPTS = [
    ("north wind", 2, ["north wind"] * 2, 2),
    (["north wind", "grey sea over"], 2, ["north wind"] * 2 + ["grey sea over"] * 2, 5),
    ([7, 8, 9], 1, ["<7><8><9>"], 3),
    ([[7, 8], [9]], 2, ["<7><8>"] * 2 + ["<9>"] * 2, 3),
    ([[7, 8], [9], [10, 11, 12]], 1, ["<7><8>", "<9>", "<10><11><12>"], 6),
]


async def completion_choices(stream: bool, **fields: Any) -> tuple[dict[int, Any], Any]:
    """Each choice's (text, finish reason, logprobs entries) by index, and the usage, of a
    completion asked whole or streamed."""
    client: openai.AsyncOpenAI = fields.pop("client")
    if not stream:
        r = await client.completions.create(**fields)
        return {c.index: (c.text, c.finish_reason, c.logprobs) for c in r.choices}, r.usage
    chunks = await client.completions.create(
        stream=True, stream_options={"include_usage": True}, **fields
    )
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    logprobs: dict[int, dict[str, list[Any]]] = {}
    usage = None
    async for chunk in chunks:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
            if c.logprobs is not None:
                acc = logprobs.setdefault(c.index, {})
                for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    acc.setdefault(name, []).extend(getattr(c.logprobs, name) or [])
    return {i: (texts[i], reasons.get(i), logprobs.get(i)) for i in texts}, usage


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("prompt", "n", "starts", "prompt_tokens"), PROMPTS)
async def test_every_prompt_shape_has_n_choices_per_prompt_in_openai_order(
    stack: Stack,
    scripted: dict[str, Any],
    stream: bool,
    prompt: Any,
    n: int,
    starts: list[str],
    prompt_tokens: int,
) -> None:
    client = await tenant_client(stack)
    choices, usage = await completion_choices(
        stream, client=client, model=scripted["name"], prompt=prompt, n=n, max_tokens=2, echo=True
    )
    # choice c of prompt p at index p * n + c, each starting with its prompt
    assert {i: text for i, (text, _, _) in choices.items()} == {
        i: start + " w0 w1" for i, start in enumerate(starts)
    }
    assert {reason for _, reason, _ in choices.values()} == {"length"}
    assert usage is not None
    assert usage.prompt_tokens == prompt_tokens  # every prompt once, whatever n
    assert usage.completion_tokens == 2 * len(starts)  # every choice
    plain, _ = await completion_choices(
        stream, client=client, model=scripted["name"], prompt=prompt, n=n, max_tokens=2
    )
    assert [plain[i][0] for i in range(len(starts))] == [" w0 w1"] * len(starts)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("prompt", ["say hello", [[7, 8]]], ids=["text", "ids"])
async def test_echo_with_logprobs_gives_the_prompt_tokens_first(
    stack: Stack, scripted: dict[str, Any], stream: bool, prompt: Any
) -> None:
    client = await tenant_client(stack)
    choices, _ = await completion_choices(
        stream, client=client, model=scripted["name"], prompt=prompt, max_tokens=2, logprobs=1,
        echo=True,
    )  # fmt: skip
    text, _, lp = choices[0]
    words = ["say", " hello"] if prompt == "say hello" else ["<7>", "<8>"]
    assert text == "".join(words) + " w0 w1"
    get = (lambda name: lp[name]) if stream else (lambda name: getattr(lp, name))
    assert get("tokens") == [*words, " w0", " w1"]
    assert get("token_logprobs") == pytest.approx([None, -0.5, -0.1, -0.2])
    tops = get("top_logprobs")
    assert tops[0] is None and list(tops[1]) == [words[1]] and list(tops[2]) == [" w0"]
    assert get("text_offset") == [0, len(words[0]), len(words[0] + words[1]), len(text) - 3]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_max_tokens_0_with_echo_scores_the_prompt_alone(
    stack: Stack, scripted: dict[str, Any], stream: bool
) -> None:
    client = await tenant_client(stack)
    fields: dict[str, Any] = {"model": scripted["name"], "max_tokens": 0, "echo": True}
    choices, usage = await completion_choices(
        stream, client=client, prompt=["say hello", "north"], logprobs=1, **fields
    )
    assert {i: c[0] for i, c in choices.items()} == {0: "say hello", 1: "north"}
    lp = choices[0][2]
    tokens = lp["tokens"] if stream else lp.tokens
    token_logprobs = lp["token_logprobs"] if stream else lp.token_logprobs
    assert tokens == ["say", " hello"] and token_logprobs == [None, -0.5]
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (3, 0)
    plain, _ = await completion_choices(stream, client=client, prompt="say hello", **fields)
    assert plain[0][0] == "say hello" and plain[0][2] is None
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model=scripted["name"], prompt="say", max_tokens=0)
    assert e.value.param == "max_tokens"


BAD_PROMPTS = [
    [],  # no prompt
    [[]],  # a prompt of no tokens
    [[7], []],
    ["a"] * 17,  # more prompts than one request takes
    [[7]] * 17,
    ["a", 7],  # shapes mixed
    [-1],  # no vocabulary has these ids
    [2**30],
    [[7], [1000]],  # past the scripted model's vocabulary: the worker refuses it
]


@pytest.mark.parametrize("prompt", BAD_PROMPTS, ids=[str(i) for i in range(len(BAD_PROMPTS))])
async def test_bad_prompts_are_a_400_naming_the_prompt(
    stack: Stack, scripted: dict[str, Any], prompt: Any
) -> None:
    client = await tenant_client(stack)
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model=scripted["name"], prompt=prompt, max_tokens=2)
    assert e.value.param == "prompt", e.value.body
    assert e.value.type == "invalid_request_error"
    assert e.value.code != "context_length_exceeded"


async def test_prompts_times_n_is_bounded(stack: Stack, scripted: dict[str, Any]) -> None:
    client = await tenant_client(stack)
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model=scripted["name"], prompt=["a"] * 5, n=16)
    assert e.value.param == "n"


async def test_several_prompts_reserve_and_bill_every_choice(
    stack: Stack, scripted: dict[str, Any]
) -> None:
    client = await client_with_quota(stack, scripted["sku_id"], 300)
    # 2 prompts x n=2 x 50 tokens fit the quota; 4 x 2 x 50 do not
    ok = await client.completions.create(
        model=scripted["name"], prompt=["a b", "c"], n=2, max_tokens=50
    )
    assert len(ok.choices) == 4
    row = await stack.ledger_row(ok.id.removeprefix("cmpl-"))
    assert row["prompt_tokens"] == 3 and row["completion_tokens"] == 4 * PLAIN_TOKENS
    with pytest.raises(openai.RateLimitError):
        await client.completions.create(
            model=scripted["name"], prompt=["a", "b", "c", "d"], n=2, max_tokens=50
        )


async def test_several_prompts_and_hang_ups_reconcile_exactly(
    stack: Stack, scripted: dict[str, Any]
) -> None:
    client = await tenant_client(stack)
    rng = random.Random(5)
    kinds: list[dict[str, Any]] = [
        {"prompt": ["north wind", "grey sea"], "n": 2},
        {"prompt": [[7, 8], [9]], "echo": True, "logprobs": 1},
        {"prompt": "say", "echo": True, "logprobs": 2, "n": 3},
    ]

    async def one(i: int) -> str:
        args = kinds[i % len(kinds)]
        if i % 3 == 0:
            r = await client.completions.create(model=scripted["name"], max_tokens=4, **args)
            return r.id.removeprefix("cmpl-")
        stream = await client.completions.create(
            model=scripted["name"], max_tokens=4, stream=True, **args
        )
        return await read_then_hang_up(stream, rng.choice([None, 1, 3]))

    ids = await asyncio.gather(*(one(i) for i in range(12)))
    await stack.ledger_rows(ids)
    await stack.delivery_rows(ids)
    report = await reconcile(stack.services.pool)
    assert report.mismatches == [] and report.pending == 0, report.lines()
    assert report.match_rate == 1.0


@pytest.mark.fast_path_only
async def test_the_torch_runtime_echoes_token_id_prompts_with_their_logprobs(
    stack: Stack,
) -> None:
    """The real engine behind the stack (random weights at a tiny Qwen3.5 shape, on CPU):
    prompt logprobs as the model fed one token at a time computes them."""
    import torch

    from tests.worker.test_prompt_logprobs import reference_logprobs
    from worker.loading import load_model

    sku = await stack.publish_sku("torch-" + uuid.uuid4().hex[:6], model="random-tiny")
    config: dict[str, Any] = {
        "model_path": "random:tiny-qwen3_5",
        "max_model_len": 64,
        "max_num_seqs": 4,
    }
    stack.start_worker(str(sku["sku_id"]), backend="torch_runtime", **config)
    model, tokenizer = await asyncio.to_thread(
        load_model, "random:tiny-qwen3_5", "cpu", torch.float32
    )
    await stack.wait_served(str(sku["sku_id"]), within=120)
    prompts = [list(tokenizer.encode("north wind over the sea")), list(tokenizer.encode("grey"))]
    client = await tenant_client(stack)
    r = await client.completions.create(
        model=sku["name"], prompt=prompts, n=2, max_tokens=3, temperature=0, echo=True,
        logprobs=2,
    )  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage is not None and r.usage.prompt_tokens == sum(map(len, prompts))
    for c in r.choices:
        ids = prompts[c.index // 2]
        assert c.text.startswith(tokenizer.decode(ids, skip_special_tokens=False))
        lp = c.logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        ref = reference_logprobs(model, ids)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = [float(ref[i - 1][ids[i]]) for i in range(1, len(ids))]
        assert lp.token_logprobs[1 : len(ids)] == pytest.approx(want, abs=1e-3)
        assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert r.choices[0].text == r.choices[1].text  # greedy: a prompt's choices agree
    row = await stack.ledger_row(r.id.removeprefix("cmpl-"))
    assert row["prompt_tokens"] == r.usage.prompt_tokens
    assert row["completion_tokens"] == r.usage.completion_tokens


async def client_with_quota(stack: Stack, sku_id: str, quota: int) -> openai.AsyncOpenAI:
    """A new tenant's client, once its token quota has reached admission."""
    tenant, key = await stack.tenant_with_key()
    await stack.admin("PUT", f"/tenants/{tenant['tenant_id']}/limits", {"token_quota": quota})
    admission = stack.plane.admission
    assert admission is not None
    deadline = time.monotonic() + 10
    while not admission.limits.applicable(tenant["tenant_id"], key["key_id"], sku_id):
        assert time.monotonic() < deadline, "the limit never reached admission"
        await asyncio.sleep(0.05)
    return openai.AsyncOpenAI(base_url=stack.v1, api_key=key["key"], max_retries=0)


async def test_n_times_max_tokens_is_reserved_and_refused_over_quota(
    stack: Stack, scripted: dict[str, Any]
) -> None:
    client = await client_with_quota(stack, scripted["sku_id"], 300)
    ok = await client.chat.completions.create(
        model=scripted["name"], messages=user("hi"), n=4, max_tokens=50
    )
    assert len(ok.choices) == 4
    with pytest.raises(openai.RateLimitError):
        await client.chat.completions.create(
            model=scripted["name"], messages=user("hi"), n=8, max_tokens=50
        )


async def test_tools_json_n_and_hang_ups_reconcile_exactly(
    stack: Stack, scripted: dict[str, Any]
) -> None:
    client = await tenant_client(stack)
    rng = random.Random(11)
    kinds: list[dict[str, Any]] = [
        {"messages": user("script:tool"), "tools": TOOLS},
        {"messages": user("script:json"), "response_format": {"type": "json_object"}},
        {"messages": user("hi"), "n": 3},
        {"messages": user("script:two_tools"), "tools": TOOLS, "n": 3, "logprobs": True},
    ]

    async def one(i: int) -> str:
        args = kinds[i % len(kinds)]
        if i % 3 == 0:  # whole answers
            r = await client.chat.completions.create(model=scripted["name"], **args)  # type: ignore[call-overload]
            return r.id.removeprefix("chatcmpl-")
        stream = await client.chat.completions.create(model=scripted["name"], stream=True, **args)  # type: ignore[call-overload]
        return await read_then_hang_up(stream, rng.choice([None, 1, 3]))

    ids = await asyncio.gather(*(one(i) for i in range(24)))
    await stack.ledger_rows(ids)
    await stack.delivery_rows(ids)
    report = await reconcile(stack.services.pool)
    assert report.mismatches == [] and report.pending == 0, report.lines()
    assert report.match_rate == 1.0
