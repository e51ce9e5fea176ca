"""n > 1: every choice its own sequence of the prompt, outputs tagged by index, usage summed;
and the protocol's new fields: old messages (without them) still decode, new ones round-trip."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from tests.worker.helpers import REQUEST_IDS
from tests.worker.test_structured import tokenizer  # noqa: F401 (fixture)
from tests.worker.test_tool_calls import backend_for, collect, request
from worker import protocol as p
from worker.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_n_choices_are_tagged_and_usage_sums_them(tokenizer: Tokenizer) -> None:  # noqa: F811
    backend = backend_for(tokenizer)
    req = request(n=3, sampling=p.SamplingParams(temperature=1.0, seed=7, max_tokens=10))
    progress = asyncio.run(collect(backend, req))
    by_choice: dict[int, list] = {}
    for item in progress:
        by_choice.setdefault(item.index, []).append(item)
    assert sorted(by_choice) == [0, 1, 2]
    texts = ["".join(x.text for x in by_choice[i]) for i in range(3)]
    assert len(set(texts)) == 3  # seeded per choice: three different samples
    for items in by_choice.values():  # each choice ends once, on its last item
        assert [x.finish_reason for x in items] == [None] * (len(items) - 1) + ["length"]
    assert progress[-1].completion_tokens == 30  # all choices: 3 x max_tokens
    counts = [x.completion_tokens for x in progress]
    assert counts == sorted(counts)
    # the same seed repeats the whole set of choices
    again = asyncio.run(collect(backend_for(tokenizer), req))
    assert ["".join(x.text for x in again if x.index == i) for i in range(3)] == texts


def test_n_one_is_unchanged(tokenizer: Tokenizer) -> None:  # noqa: F811
    progress = asyncio.run(collect(backend_for(tokenizer), request()))
    assert {x.index for x in progress} == {0}
    reasons = [x.finish_reason for x in progress]
    assert reasons[:-1] == [None] * (len(reasons) - 1) and reasons[-1] in ("stop", "length")


class OldGenerateRequest(msgspec.Struct, frozen=True, kw_only=True, tag="generate"):
    """GenerateRequest as it was before tools, formats, logprobs and n."""

    request_id: str
    tenant_id: str
    key_id: str
    sku_id: str
    model: str
    prompt: str | None = None
    messages: list[OldChatMessage] | None = None
    sampling: p.SamplingParams = p.SamplingParams()
    reply_to: str
    admitted_at: float


class OldChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str


class OldTokenChunk(msgspec.Struct, frozen=True, kw_only=True, tag="chunk"):
    request_id: str
    seq: int
    text: str
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int = 0


class OldFinished(msgspec.Struct, frozen=True, kw_only=True, tag="finished"):
    request_id: str
    seq: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str
    error: str | None = None


def test_old_messages_decode_with_the_defaults() -> None:
    old = OldGenerateRequest(
        request_id="r",
        **REQUEST_IDS,
        messages=[OldChatMessage("user", "hi")],
        reply_to="x",
        admitted_at=1.0,
    )
    new = p.decode_request(msgspec.msgpack.encode(old))
    assert new.messages == [p.ChatMessage("user", "hi")]
    assert (new.response_format, new.tools, new.tool_choice) == (None, None, "auto")
    assert (new.logprobs, new.top_logprobs, new.n, new.parallel_tool_calls) == (False, 0, 1, True)
    chunk = p.decode_reply(
        msgspec.msgpack.encode(
            OldTokenChunk(request_id="r", seq=0, text="a", completion_tokens=1, prompt_tokens=2)
        )
    )
    assert isinstance(chunk, p.TokenChunk)
    assert (chunk.index, chunk.logprobs, chunk.tool_calls, chunk.finish_reason) == (
        0,
        None,
        None,
        None,
    )
    fin = p.decode_reply(
        msgspec.msgpack.encode(
            OldFinished(
                request_id="r",
                seq=1,
                prompt_tokens=2,
                cached_tokens=0,
                completion_tokens=1,
                finish_reason="stop",
            )
        )
    )
    assert isinstance(fin, p.Finished) and fin.finish_reasons == []


def test_new_messages_round_trip_and_old_readers_skip_the_new_fields() -> None:
    req = p.GenerateRequest(
        request_id="r",
        **REQUEST_IDS,
        reply_to="x",
        admitted_at=1.0,
        messages=[
            p.ChatMessage(
                "assistant", "", tool_calls=[p.ToolCall(id="call_1", name="f", arguments="{}")]
            ),
            p.ChatMessage("tool", "42", tool_call_id="call_1"),
        ],
        response_format=p.ResponseFormat(
            type="json_schema", schema='{"type": "object"}', strict=True
        ),
        tools=[p.Tool(name="f", parameters='{"type": "object"}')],
        tool_choice=p.ToolChoiceFunction(name="f"),
        logprobs=True,
        top_logprobs=3,
        n=2,
    )
    assert p.decode_request(p.encode(req)) == req
    chunk = p.TokenChunk(
        request_id="r",
        seq=0,
        text="",
        completion_tokens=1,
        prompt_tokens=1,
        index=1,
        logprobs=[
            p.TokenLogprob(
                token="a",
                logprob=-0.5,
                bytes=[97],
                top_logprobs=[p.TopLogprob(token="a", logprob=-0.5)],
            )
        ],
        tool_calls=[p.ToolCallDelta(index=0, id="call_2", name="f")],
        finish_reason="tool_calls",
    )
    assert p.decode_reply(p.encode(chunk)) == chunk
    old = msgspec.msgpack.decode(p.encode(chunk), type=OldTokenChunk | OldFinished)
    assert isinstance(old, OldTokenChunk) and old.completion_tokens == 1
    assert (
        p.decode_request(p.encode(msgspec.structs.replace(req, tool_choice="required"))).tool_choice
        == "required"
    )
