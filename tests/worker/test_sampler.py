"""Sampler: greedy, temperature, top-k, top-p, seeds; and the token-level stop rules."""

from __future__ import annotations

import pytest
import torch

from worker.engine.sampler import Sampler, stop_by_token
from worker.engine.sequence import FinishReason, SamplingParams, Sequence


def seqs_with(*params: SamplingParams) -> list[Sequence]:
    return [Sequence(i, f"r{i}", [1], p) for i, p in enumerate(params)]


def draw(logits: torch.Tensor, params: SamplingParams, n: int) -> list[int]:
    """n draws from one row, each from a fresh sequence with these params."""
    sampler = Sampler()
    return [sampler(logits[None], seqs_with(params))[0] for _ in range(n)]


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])  # best is 5, then 0, then 1


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    out = Sampler()(logits, seqs_with(*[SamplingParams(temperature=0)] * 4))
    assert out == logits.argmax(-1).tolist()


def test_top_k_one_and_tiny_top_p_are_greedy_even_when_hot():
    assert set(draw(LOGITS, SamplingParams(temperature=5.0, top_k=1), 30)) == {5}
    assert set(draw(LOGITS, SamplingParams(temperature=5.0, top_p=0.01), 30)) == {5}


def test_top_k_limits_the_support():
    got = set(draw(LOGITS, SamplingParams(temperature=10.0, top_k=2), 200))
    assert got == {5, 0}


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probabilities: 0.5, 0.3, 0.2 -> top_p 0.75 keeps the first two (0.5 < 0.75 <= 0.8)
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    got = set(draw(logits, SamplingParams(temperature=1.0, top_p=0.75), 300))
    assert got == {0, 1}


def test_temperature_one_follows_the_softmax():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    n = 3000
    counts = torch.bincount(
        torch.tensor(draw(logits, SamplingParams(temperature=1.0), n)), minlength=3
    )
    freq = counts.float() / n
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.04)


def test_seeded_rows_repeat_and_do_not_depend_on_neighbours():
    torch.manual_seed(1)
    logits = torch.randn(3, 1000)
    seeded = SamplingParams(temperature=1.0, seed=42)
    other = SamplingParams(temperature=1.0)

    def run(batch_logits: torch.Tensor, params: list[SamplingParams], row: int) -> list[int]:
        seqs = seqs_with(*params)
        return [Sampler()(batch_logits, seqs)[row] for _ in range(10)]

    alone = run(logits[1:2], [seeded], 0)
    in_batch = run(logits, [other, seeded, other], 1)
    assert alone == in_batch
    assert len(set(alone)) > 1  # the generator advances: not the same token every time
    assert run(logits[1:2], [SamplingParams(temperature=1.0, seed=43)], 0) != alone


def test_rows_and_sequences_must_match():
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 5), seqs_with(SamplingParams()))


def test_invalid_params_are_refused():
    for bad in (
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(top_k=-1),
        dict(max_tokens=0),
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_stop_by_token():
    eos = frozenset({99})
    s = seqs_with(SamplingParams(max_tokens=3, stop_token_ids=[7]))[0]
    s.append_token(5)
    assert stop_by_token(s, 5, eos, max_model_len=100) is None
    s.append_token(99)
    assert stop_by_token(s, 99, eos, 100) is FinishReason.STOP
    s.append_token(7)
    assert stop_by_token(s, 7, eos, 100) is FinishReason.STOP
    s.output_token_ids = [5, 5, 5]
    assert stop_by_token(s, 5, eos, 100) is FinishReason.LENGTH
    s.output_token_ids = [5]
    assert stop_by_token(s, 5, eos, max_model_len=2) is FinishReason.LENGTH  # prompt 1 + 1
    ignoring = seqs_with(SamplingParams(ignore_eos=True))[0]
    ignoring.append_token(99)
    assert stop_by_token(ignoring, 99, eos, 100) is None
