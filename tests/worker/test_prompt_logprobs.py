"""Prompt logprobs (OpenAI `echo` with `logprobs`) computed by the engine as it prefills, checked
against the model fed one token at a time; and the backend's several prompts (texts or token
ids), each with its n choices at index prompt * n + choice, echoed with their logprobs."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.worker.model_driver import ModelDriver
from tests.worker.test_structured import tokenizer  # noqa: F401 (fixture)
from tests.worker.test_tool_calls import backend_for, collect, request
from worker import protocol as p
from worker.backends.base import InvalidRequest
from worker.engine.engine import EngineConfig, LLMEngine
from worker.engine.sequence import SamplingParams
from worker.loading import load_model
from worker.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "river stone light north wind over the grey sea"


@pytest.fixture(scope="module")
def random_model() -> tuple[object, object]:
    torch.manual_seed(0)
    return load_model("random:tiny-qwen3_5", "cpu", torch.float32)


def reference_logprobs(model: object, ids: list[int]) -> list[torch.Tensor]:
    """log-softmax of the logits after each prefix ids[:i+1], fed one token at a time (the
    decode path: a computation independent of the prefill chunks the engine runs)."""
    driver = ModelDriver(model, num_blocks=16, block_size=16)  # type: ignore[arg-type]
    driver.add(0, ids)
    for _ in ids:
        driver.step({0: 1})
    seq = driver.remove(0)
    return [torch.log_softmax(seq.logits[i].float(), -1) for i in range(len(ids))]


@pytest.mark.parametrize(("chunk", "caching"), [(256, False), (5, True)])
def test_prompt_logprobs_equal_a_token_by_token_forward(
    random_model: tuple[object, object], chunk: int, caching: bool
) -> None:
    model, tok = random_model
    ids = list(tok.encode(PROMPT))  # type: ignore[attr-defined]
    ref = reference_logprobs(model, ids)
    config = EngineConfig(
        block_size=4,
        max_num_seqs=2,
        max_num_batched_tokens=chunk,  # 5: the prompt prefills in several chunks
        max_model_len=64,
        enable_prefix_caching=caching,
    )
    engine = LLMEngine(model, tok, config)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    # twice: the second finds the prompt cached, yet computes it for its logprobs
    for out in (engine.generate([ids], params)[0], engine.generate([ids], params)[0]):
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
        assert out.prompt_logprobs[0] is None  # nothing predicts the first token
        assert out.usage.cached_tokens == 0
        for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
            assert entry is not None and entry.token_id == ids[i]
            assert entry.logprob == pytest.approx(float(ref[i - 1][ids[i]]), abs=1e-4)
            values, top = torch.topk(ref[i - 1], 3)
            assert [t for t, _ in entry.top] == top.tolist()
            assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)


def test_a_one_token_prompt_has_one_null_logprob(random_model: tuple[object, object]) -> None:
    model, tok = random_model
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, max_num_seqs=2, max_model_len=64))
    out = engine.generate([[5]], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    assert out[0].prompt_logprobs == [None]
    plain = engine.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=1))[0]
    assert plain.prompt_logprobs is None  # not asked for


def by_index(progress: list) -> dict[int, list]:
    out: dict[int, list] = {}
    for item in progress:
        out.setdefault(item.index, []).append(item)
    return out


def test_several_prompts_have_n_choices_each(tokenizer: Tokenizer) -> None:  # noqa: F811
    sampling = p.SamplingParams(temperature=1.0, seed=3, max_tokens=4)
    texts = ["north wind", "the grey sea over"]
    req = request(messages=None, prompts=texts, n=2, sampling=sampling)
    progress = asyncio.run(collect(backend_for(tokenizer), req))
    choices = by_index(progress)
    assert sorted(choices) == [0, 1, 2, 3]  # prompt 0: 0, 1; prompt 1: 2, 3
    assert progress[-1].prompt_tokens == sum(len(tokenizer.encode(t)) for t in texts)
    assert progress[-1].completion_tokens == 4 * 4
    # each prompt answers as it would alone: choices 2 and 3 are prompt 1's two choices
    alone = asyncio.run(
        collect(
            backend_for(tokenizer), request(messages=None, prompt=texts[1], n=2, sampling=sampling)
        )
    )
    alone_choices = by_index(alone)
    for c in (0, 1):
        assert "".join(x.text for x in choices[2 + c]) == "".join(x.text for x in alone_choices[c])


def test_token_id_prompts_echo_with_their_logprobs(tokenizer: Tokenizer) -> None:  # noqa: F811
    ids = [list(tokenizer.encode("north wind")), list(tokenizer.encode("grey sea"))]
    req = request(
        messages=None,
        prompt_token_ids=ids,
        echo=True,
        logprobs=True,
        top_logprobs=2,
        sampling=p.SamplingParams(temperature=0, max_tokens=3),
    )
    progress = asyncio.run(collect(backend_for(tokenizer), req))
    choices = by_index(progress)
    assert sorted(choices) == [0, 1]
    for i, items in choices.items():
        first = items[0]
        echo = tokenizer.decode(ids[i], skip_special_tokens=False)
        assert first.text.startswith(echo)
        entries = [e for x in items for e in x.logprobs or []]
        prompt, completion = entries[: len(ids[i])], entries[len(ids[i]) :]
        assert prompt[0].logprob is None and prompt[0].top_logprobs == []
        assert all(e.logprob is not None and e.logprob <= 0 for e in prompt[1:])
        assert all(len(e.top_logprobs) == 2 for e in prompt[1:] + completion)
        assert "".join(e.token for e in prompt) == echo
        assert len(completion) == 3
    assert progress[-1].prompt_tokens == sum(map(len, ids))


def test_max_tokens_0_with_echo_gives_the_prompt_and_its_logprobs_only(
    tokenizer: Tokenizer,  # noqa: F811
) -> None:
    ids = list(tokenizer.encode("north wind over"))
    req = request(
        messages=None,
        prompt="north wind over",
        echo=True,
        logprobs=True,
        sampling=p.SamplingParams(temperature=0, max_tokens=0),
    )
    progress = asyncio.run(collect(backend_for(tokenizer), req))
    assert [(x.text, x.finish_reason, x.completion_tokens) for x in progress] == [
        ("north wind over", "length", 0)
    ]
    entries = progress[0].logprobs or []
    assert len(entries) == len(ids) and entries[0].logprob is None
    assert all(e.logprob is not None for e in entries[1:])


def test_echo_without_logprobs_writes_the_prompt_text(tokenizer: Tokenizer) -> None:  # noqa: F811
    req = request(
        messages=None, prompt="north wind", echo=True, sampling=p.SamplingParams(max_tokens=2)
    )
    progress = asyncio.run(collect(backend_for(tokenizer), req))
    assert progress[0].text.startswith("north wind")
    assert all(x.logprobs is None for x in progress)


@pytest.mark.parametrize("ids", [[[1, 2, 10**6]], [[1], [-1]]])
def test_token_ids_outside_the_vocabulary_are_refused(
    tokenizer: Tokenizer,  # noqa: F811
    ids: list[list[int]],
) -> None:
    req = request(messages=None, prompt_token_ids=ids)
    with pytest.raises(InvalidRequest) as refused:
        asyncio.run(collect(backend_for(tokenizer), req))
    assert refused.value.param == "prompt" and refused.value.code == "invalid_prompt"


def test_the_new_fields_round_trip_and_old_requests_decode_to_one_prompt() -> None:
    req = request(
        messages=None,
        prompt_token_ids=[[1, 2], [3]],
        echo=True,
        n=2,
    )
    back = p.decode_request(p.encode(req))
    assert back == req and back.num_prompts == 2 and back.num_choices == 4
    plain = p.decode_request(p.encode(request(messages=None, prompt="a", n=3)))
    assert (plain.prompts, plain.prompt_token_ids, plain.echo) == (None, None, False)
    assert plain.num_choices == 3
    entry = p.TokenLogprob(token="a", logprob=None, bytes=[97])
    chunk = p.TokenChunk(
        request_id="r", seq=0, text="a", completion_tokens=0, prompt_tokens=1, logprobs=[entry]
    )
    assert p.decode_reply(p.encode(chunk)) == chunk
