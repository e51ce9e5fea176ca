"""Token selection (greedy, temperature, top-k, top-p, seeded) and the token-level stop rules."""

from __future__ import annotations

import torch

from worker.engine.sequence import FinishReason, Sequence


class Sampler:
    """Picks one token per row of logits for the given sequences.

    Every row is processed on its own (sort, filter, draw), so a seeded request gets the same
    tokens whatever else is in the batch. A seeded request draws from its own generator,
    created on first use and kept on the sequence (it survives preemption).
    """

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        if logits.shape[0] != len(seqs):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(seqs)} sequences")
        # One argmax over all rows and one device-to-host copy; sampled rows are overwritten.
        tokens: list[int] = torch.argmax(logits, dim=-1).tolist()
        sampled_rows = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
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
