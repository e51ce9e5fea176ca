"""Token selection (greedy, temperature, top-k, top-p, seeded, grammar-masked), logprobs, and
the token-level stop rules."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from worker.engine.sequence import FinishReason, Sequence

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TokenLogprobs:
    """A sampled token's logprob and the `params.logprobs` most likely tokens', from the
    log-softmax of the raw logits: before temperature, top-k/top-p and any grammar mask (what
    OpenAI and vLLM report: the model's own distribution, not the one sampled from)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class Sampler:
    """Picks one token per row of logits for the given sequences.

    Every row is processed on its own (sort, filter, draw), so a seeded request gets the same
    tokens whatever else is in the batch. A seeded request draws from its own generator,
    created on first use and kept on the sequence (it survives preemption).

    A constrained sequence (`seq.grammar`) has the tokens its grammar forbids masked to -inf
    first, whatever its temperature (its mask is filled here, on the engine's thread, while the
    device computes the forward); after the draw its grammar accepts the token (see
    `worker.structured.grammar`). Sequences that
    ask for logprobs get `TokenLogprobs` appended to `seq.pending_logprobs`.
    """

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        if logits.shape[0] != len(seqs):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(seqs)} sequences")
        logprob_rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
        raw_logprobs = None
        if logprob_rows:  # before masking: the mask below writes the logits in place
            rows = torch.tensor(logprob_rows, device=logits.device)
            raw_logprobs = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)
        grammar_rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
        if grammar_rows:
            from worker.structured import apply_masks

            apply_masks(logits, grammar_rows, [seqs[i].grammar.next_mask() for i in grammar_rows])

        tokens = self._pick(logits, seqs)
        if raw_logprobs is not None:
            self._record_logprobs(raw_logprobs, logprob_rows, seqs, tokens)
        for i in grammar_rows:
            if not seqs[i].grammar.accept(tokens[i]):
                log.error(
                    "sequence %d: the grammar refused its sampled token %d",
                    seqs[i].seq_id,
                    tokens[i],
                )
        return tokens

    def _pick(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        # One argmax over all rows and one device-to-host copy; sampled rows are overwritten.
        tokens: list[int] = torch.argmax(logits, dim=-1).tolist()
        sampled_rows = [i for i, seq in enumerate(seqs) if seq.params.temperature != 0]
        if not sampled_rows:
            return tokens

        rows = torch.tensor(sampled_rows, device=logits.device)
        params = [seqs[i].params for i in sampled_rows]
        temps = torch.tensor([p.temperature for p in params], device=logits.device)
        scaled = logits.index_select(0, rows).float() / temps[:, None]
        sorted_logits, sorted_ids = torch.sort(scaled, dim=-1, descending=True)
        vocab = scaled.shape[-1]
        rank = torch.arange(vocab, device=logits.device)
        top_k = torch.tensor([p.top_k or vocab for p in params], device=logits.device)
        sorted_logits.masked_fill_(rank[None, :] >= top_k[:, None], float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        # Top-p: drop a token when the tokens ranked above it already reach top_p (the most
        # likely token always stays).
        top_p = torch.tensor([p.top_p for p in params], device=logits.device)
        mass_above = torch.cumsum(probs, dim=-1) - probs
        probs.masked_fill_(mass_above >= top_p[:, None], 0.0)

        for j, i in enumerate(sampled_rows):
            seq = seqs[i]
            generator = None
            if seq.params.seed is not None:
                if seq.generator is None:
                    seq.generator = torch.Generator(device=logits.device)
                    seq.generator.manual_seed(seq.params.seed)
                generator = seq.generator
            pick = torch.multinomial(probs[j], 1, generator=generator)
            tokens[i] = int(sorted_ids[j, pick])
        return tokens

    @staticmethod
    def _record_logprobs(
        raw: torch.Tensor, rows: list[int], seqs: list[Sequence], tokens: list[int]
    ) -> None:
        k = max(seqs[i].params.logprobs or 0 for i in rows)  # one top-k for the widest request
        chosen = [tokens[i] for i in rows]
        for i, entry in zip(rows, _logprobs_of(raw, chosen, k), strict=True):
            entry.top = entry.top[: seqs[i].params.logprobs or 0]
            seqs[i].pending_logprobs.append(entry)


def _logprobs_of(raw: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprobs]:
    """Per row of log-softmaxed `raw`: the logprob of its token, and the k most likely."""
    chosen = torch.tensor(tokens, device=raw.device)
    picked = raw.gather(1, chosen[:, None])[:, 0].tolist()
    top_values: list[list[float]] = [[] for _ in tokens]
    top_ids: list[list[int]] = [[] for _ in tokens]
    if k:
        values, ids = torch.topk(raw, k, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    return [
        TokenLogprobs(t, picked[j], list(zip(top_ids[j], top_values[j], strict=True)))
        for j, t in enumerate(tokens)
    ]


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprobs]:
    """Per row of raw `logits`: the logprob of its token in `tokens` and the k most likely
    tokens' (the log-softmax of the raw logits, as for sampled tokens)."""
    return _logprobs_of(torch.log_softmax(logits.float(), dim=-1), tokens, k)


def stop_by_token(
    seq: Sequence, token_id: int, eos_token_ids: frozenset[int], max_model_len: int
) -> FinishReason | None:
    """Why `seq` stops after emitting `token_id` (already appended), judged on tokens alone."""
    params = seq.params
    if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids):
        return FinishReason.STOP
    if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
