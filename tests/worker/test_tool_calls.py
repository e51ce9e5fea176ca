"""Tool calls: the incremental `<tool_call>` parser against a scripted token stream (deltas
checked exactly), unparsable spans kept as content, tools in chat templates, and forced calls
through the torch runtime backend (grammar, parser, finish reason "tool_calls")."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.worker.helpers import REQUEST_IDS
from tests.worker.test_structured import NoiseLM, tokenizer  # noqa: F401 (fixture)
from worker.backends.torch_runtime import TorchRuntimeBackend
from worker.engine.async_engine import AsyncLLMEngine
from worker.engine.engine import EngineConfig, LLMEngine
from worker.protocol import (
    ChatMessage,
    GenerateRequest,
    SamplingParams,
    Tool,
    ToolCall,
    ToolChoiceFunction,
)
from worker.tokenizer import Tokenizer
from worker.tokenizer.chat import ChatTemplate
from worker.tokenizer.tool_calls import ToolCallDelta, ToolCallParser, parse_tool_calls

pytestmark = pytest.mark.usefixtures("one_thread")

# How a model's tokens would arrive: markers split across pieces, arguments in small bites.
STREAM = [
    "Let me ",
    "check.",
    "\n<tool",
    "_call>",
    "\n{",
    '"name": "get_',
    'weather", ',
    '"arguments": ',
    '{"city": "Par',
    'is", "days": [1, ',
    '{"x": "}"}]',
    "}}",
    "\n</tool_",
    "call>",
    "\n",
    "<tool_call>\n",
    '{"name": "get_time", "arguments": {}}\n</tool_call>',
]


def ids():
    n = iter(range(100))
    return lambda: f"call_{next(n)}"


def test_scripted_stream_gives_exact_deltas() -> None:
    parser = ToolCallParser(["get_weather", "get_time"], new_id=ids())
    outs = [parser.feed(piece) for piece in STREAM] + [parser.finish()]
    assert [o.content for o in outs] == ["Let me ", "check.", "\n"] + [""] * (len(STREAM) - 2)
    deltas = [(i, d) for i, o in enumerate(outs) for d in o.tool_calls]
    assert deltas == [
        # announced once the head is whole: the name, and where the arguments start
        (7, ToolCallDelta(0, "call_0", "get_weather", "")),
        (8, ToolCallDelta(0, arguments='{"city": "Par')),
        (9, ToolCallDelta(0, arguments='is", "days": [1, ')),
        (10, ToolCallDelta(0, arguments='{"x": "}"}]')),  # a brace inside a string is text
        (11, ToolCallDelta(0, arguments="}")),  # the outer object's brace is not arguments
        (16, ToolCallDelta(1, "call_1", "get_time", "{}")),  # a whole call in one piece
    ]
    arguments = [c.arguments for c in parser.calls]
    assert json.loads(arguments[0]) == {"city": "Paris", "days": [1, {"x": "}"}]}
    assert arguments[1] == "{}"


def test_the_stream_and_the_whole_text_agree_whatever_the_split() -> None:
    text = "".join(STREAM)
    content, calls = parse_tool_calls(text, ["get_weather", "get_time"])
    for size in (1, 2, 3, 7):
        parser = ToolCallParser(["get_weather", "get_time"])
        outs = [parser.feed(text[i : i + size]) for i in range(0, len(text), size)]
        outs.append(parser.finish())
        assert "".join(o.content for o in outs) == content == "Let me check.\n"
        joined: dict[int, str] = {}
        for o in outs:
            for d in o.tool_calls:
                joined[d.index] = joined.get(d.index, "") + d.arguments
        assert [joined[i] for i in sorted(joined)] == [c.arguments for c in calls]


def test_unparsable_spans_are_content_never_dropped() -> None:
    names = ["get_weather"]
    for text in [
        "<tool_call>not json</tool_call> after",
        '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        "a < b and <tool_c without end",
        '<tool_call>{"name": "get_wea',  # ended before the name was whole
    ]:
        content, calls = parse_tool_calls(text, names)
        assert (content, calls) == (text, []), text
    # name first, arguments later, and whole only at the end: still a call
    content, calls = parse_tool_calls(
        '<tool_call>{"arguments": {"city": "Rome"}, "name": "get_weather"}</tool_call>', names
    )
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Rome"})
    ]
    # arguments as a JSON string of JSON: OpenAI's arguments are the inner text
    _, calls = parse_tool_calls(
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>'
    )
    assert calls[0].arguments == '{"city": "Rome"}'
    # cut by max_tokens after the call was announced: the call stays, arguments truncated
    content, calls = parse_tool_calls('<tool_call>{"name": "get_weather", "arguments": {"ci', names)
    assert content == "" and calls[0].arguments == '{"ci'
    assert calls[0].id.startswith("call_") and len(calls[0].id) == 29


QWEN_LIKE = (  # the shape of Qwen's template: tools into the system turn, calls, tool turns
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools><|im_end|>\n{% endif %}{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    '{% for c in m.tool_calls or [] %}<tool_call>\n{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n'
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Rome?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_a_template_that_knows_tools_gets_them_and_calls_as_objects() -> None:
    text = ChatTemplate(QWEN_LIKE).render(HISTORY, tools=[TOOL])
    assert '<tools>{"type": "function", "function": {"name": "get_weather"' in text
    # arguments arrive as JSON text and reach the template as an object
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in text
    )
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>" in text


def test_a_template_without_tools_gets_them_written_out(tokenizer: Tokenizer) -> None:  # noqa: F811
    template = tokenizer.chat_template
    assert template is not None and not template.knows_tools
    text = tokenizer.apply_chat_template(HISTORY, tools=[TOOL])
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": <function-name>' in text  # the instructions
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
        in text
    )
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>" in text
    # without tools nothing changes
    plain = [{"role": "user", "content": "hi"}]
    assert (
        tokenizer.apply_chat_template(plain)
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


WEATHER = Tool(
    name="get_weather",
    description="Weather of a city",
    parameters=json.dumps(
        {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        }
    ),
)


def backend_for(tok: Tokenizer) -> TorchRuntimeBackend:
    backend = TorchRuntimeBackend("unused", max_model_len=2048)
    model = NoiseLM(tok.vocab_size, next(iter(tok.eos_token_ids)))
    config = EngineConfig(
        block_size=16, max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=2048
    )
    backend.engine = AsyncLLMEngine(LLMEngine(model, tok, config))
    backend.tokenizer = tok
    return backend


def request(**kw: Any) -> GenerateRequest:
    base: dict[str, Any] = dict(
        request_id="r1",
        **REQUEST_IDS,
        messages=[ChatMessage("user", "Weather in Rome?")],
        reply_to="inbox",
        admitted_at=0.0,
        sampling=SamplingParams(temperature=0, max_tokens=120),
    )
    return GenerateRequest(**(base | kw))


async def collect(backend: TorchRuntimeBackend, req: GenerateRequest) -> list:
    try:
        return [p async for p in backend.generate(req)]
    finally:
        await backend.close()


def test_forced_tool_call_through_the_backend(tokenizer: Tokenizer) -> None:  # noqa: F811
    backend = backend_for(tokenizer)
    req = request(tools=[WEATHER], tool_choice=ToolChoiceFunction(name="get_weather"))
    progress = asyncio.run(collect(backend, req))
    assert "".join(p.text for p in progress) == ""  # no content: only the call
    deltas = [d for p in progress for d in p.tool_calls or []]
    assert deltas[0].name == "get_weather" and deltas[0].id.startswith("call_")
    assert {d.index for d in deltas} == {0}
    args = json.loads("".join(d.arguments for d in deltas))
    assert args["city"] in ("Paris", "Rome")
    assert progress[-1].finish_reason == "tool_calls"
    assert [p.finish_reason for p in progress[:-1]] == [None] * (len(progress) - 1)


def test_history_with_calls_renders_and_unforced_text_stays_content(tokenizer: Tokenizer) -> None:  # noqa: F811
    backend = backend_for(tokenizer)
    messages = [
        ChatMessage("user", "Weather in Rome?"),
        ChatMessage(
            "assistant",
            "",
            tool_calls=[ToolCall(id="call_1", name="get_weather", arguments='{"city": "Rome"}')],
        ),
        ChatMessage("tool", "18 C", tool_call_id="call_1"),
    ]
    req = request(
        messages=messages, tools=[WEATHER], sampling=SamplingParams(temperature=0, max_tokens=20)
    )
    ids = backend.prompt_ids(req)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert "<tool_response>\n18 C\n</tool_response>" in text and "# Tools" in text
    progress = asyncio.run(collect(backend, req))
    assert all(not p.tool_calls for p in progress)  # noise never writes a call: plain content
    assert progress[-1].finish_reason == "length"
    assert "".join(p.text for p in progress)


def test_tool_choice_errors_are_invalid_requests(tokenizer: Tokenizer) -> None:  # noqa: F811
    from worker.backends.base import InvalidRequest

    backend = backend_for(tokenizer)
    for req, param in [
        (request(tool_choice="required"), "tool_choice"),
        (request(tools=[WEATHER], tool_choice=ToolChoiceFunction(name="nope")), "tool_choice"),
        (request(tools=[Tool(name="f", parameters="{oops")]), None),
    ]:
        if param is None:  # bad parameters JSON breaks only when tools are rendered
            with pytest.raises(ValueError):
                asyncio.run(collect(backend_for(tokenizer), req))
            continue
        with pytest.raises(InvalidRequest) as info:
            asyncio.run(collect(backend_for(tokenizer), req))
        assert info.value.param == param
    asyncio.run(backend.close())
