"""POST /v1/responses (stateless) through the official client's `responses.create` and
`responses.stream`, against the scripted worker; bills checked against the ledger."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.dataplane.harness import Stack
from tests.dataplane.scripted import PLAIN_TOKENS, SCRIPTS
from tests.dataplane.test_openai_api import tenant_client
from tests.dataplane.test_openai_surface import scripted  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(120)

TOOL: Any = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": False,
}


async def test_create_and_stream_text(stack: Stack, scripted: dict[str, Any]) -> None:  # noqa: F811
    client = await tenant_client(stack)
    r = await client.responses.create(
        model=scripted["name"], input="hi", instructions="Be terse.", store=False
    )
    assert r.status == "completed" and r.output_text == "".join(SCRIPTS["plain"])
    assert r.usage is not None and r.usage.output_tokens == PLAIN_TOKENS
    row = await stack.ledger_row(r.id.removeprefix("resp_"))
    assert row["completion_tokens"] == PLAIN_TOKENS
    async with client.responses.stream(
        model=scripted["name"], input=[{"role": "user", "content": "hi"}], max_output_tokens=4
    ) as stream:
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == "".join(SCRIPTS["plain"][:4])


async def test_function_calls_and_json_schema(stack: Stack, scripted: dict[str, Any]) -> None:  # noqa: F811
    client = await tenant_client(stack)
    async with client.responses.stream(
        model=scripted["name"], input="script:two_tools", tools=[TOOL]
    ) as stream:
        final = await stream.get_final_response()
    calls = [o for o in final.output if o.type == "function_call"]
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert all(c.call_id.startswith("call_") and c.name == "get_weather" for c in calls)
    assert final.usage is not None and final.usage.output_tokens == len(SCRIPTS["two_tools"])
    schema: dict[str, Any] = {"type": "object", "properties": {"answer": {"type": "integer"}}}
    r = await client.responses.create(
        model=scripted["name"], input="script:json",
        text={"format": {"type": "json_schema", "name": "a", "schema": schema}},
    )  # fmt: skip
    assert json.loads(r.output_text) == {"answer": 42}


async def test_store_true_and_bad_input_are_400s(stack: Stack, scripted: dict[str, Any]) -> None:  # noqa: F811
    client = await tenant_client(stack)
    for extra, param in (
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_x"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(model=scripted["name"], input="hi", extra_body=extra)
        assert e.value.param == param
