"""Logprobs: the raw model distribution (before temperature and masks) per sampled token, in
the engine's outputs and the backend's Progress (OpenAI's shape), top_logprobs up to 20."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.worker.test_structured import make_engine, tokenizer  # noqa: F401 (fixture)
from tests.worker.test_tool_calls import backend_for, collect, request
from worker.backends.base import InvalidRequest
from worker.engine.sampler import Sampler
from worker.engine.sequence import SamplingParams, Sequence
from worker.protocol import SamplingParams as WireSampling
from worker.structured import response_format_grammar
from worker.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_sampler_reports_the_raw_distribution_whatever_the_temperature() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    raw = torch.log_softmax(logits, dim=-1)
    seqs = [
        Sequence(0, "a", [1], SamplingParams(temperature=0, logprobs=5)),
        Sequence(1, "b", [1], SamplingParams(temperature=2.0, seed=1, logprobs=0)),
        Sequence(2, "c", [1], SamplingParams(temperature=0)),  # asks for none
    ]
    tokens = Sampler()(logits.clone(), seqs)
    (a,), (b,) = seqs[0].pending_logprobs, seqs[1].pending_logprobs
    assert seqs[2].pending_logprobs == []
    assert a.token_id == tokens[0] == int(raw[0].argmax())
    assert a.logprob == pytest.approx(float(raw[0, tokens[0]]), abs=1e-6)
    top_values, top_ids = torch.topk(raw[0], 5)
    assert [t for t, _ in a.top] == top_ids.tolist()
    assert [v for _, v in a.top] == pytest.approx(top_values.tolist(), abs=1e-6)
    # temperature 2 samples from a flatter distribution; the logprob is still the raw one
    assert b.logprob == pytest.approx(float(raw[1, tokens[1]]), abs=1e-6)
    assert b.logprob != pytest.approx(float(torch.log_softmax(logits[1] / 2, -1)[tokens[1]]))
    assert b.top == []


def test_logprobs_are_before_the_grammar_mask(tokenizer: Tokenizer) -> None:  # noqa: F811
    engine = make_engine(tokenizer)
    spec = response_format_grammar("json_object")
    out = engine.generate(
        ["x"], SamplingParams(temperature=0, max_tokens=12, logprobs=3, grammar=spec)
    )[0]
    assert len(out.logprobs) == len(out.new_token_ids)
    assert [e.token_id for e in out.logprobs] == out.new_token_ids
    # the first token must be "{" under the grammar, though noise prefers others: its raw
    # logprob is below the raw top-1 the entry lists
    first = out.logprobs[0]
    assert tokenizer.decode([first.token_id]).startswith("{")
    assert first.top[0][1] >= first.logprob and first.top[0][0] != first.token_id
    assert all(e.logprob <= 0 for e in out.logprobs)


def test_a_sequence_with_logprobs_is_not_greedy_on_the_device() -> None:
    # overlapped decode takes the device's argmax and skips the sampler: logprobs and masks
    # need the host, so such sequences must not run it
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0, logprobs=0).greedy
    assert not SamplingParams(temperature=0, grammar=response_format_grammar("json_object")).greedy
    with pytest.raises(ValueError):
        SamplingParams(logprobs=21)


def test_backend_progress_carries_openai_logprobs(tokenizer: Tokenizer) -> None:  # noqa: F811
    backend = backend_for(tokenizer)
    req = request(logprobs=True, top_logprobs=2, sampling=WireSampling(temperature=0, max_tokens=8))
    progress = asyncio.run(collect(backend, req))
    entries = [e for p in progress for e in p.logprobs or []]
    assert len(entries) == progress[-1].completion_tokens == 8  # no end token met: one per token
    assert "".join(e.token for e in entries) == "".join(p.text for p in progress)
    for e in entries:
        assert e.bytes == list(e.token.encode())
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)  # greedy: the top one
    plain = asyncio.run(collect(backend_for(tokenizer), request()))
    assert all(p.logprobs is None for p in plain)
    with pytest.raises(InvalidRequest) as info:
        asyncio.run(collect(backend_for(tokenizer), request(logprobs=True, top_logprobs=21)))
    assert info.value.param == "top_logprobs"
