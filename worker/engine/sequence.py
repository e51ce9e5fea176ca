"""Sequence state: what the decide side knows about one request while it is being served."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# OpenAI's ceiling for top_logprobs.
MAX_TOP_LOGPROBS = 20


# Stands in for a token sampled by a decode step the host has launched but not yet read back
# (overlapped decode, see LLMEngine): the GPU feeds the real id to the next step itself.
PENDING_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no KV blocks and no state slot
    RUNNING = "running"  # holds KV blocks and a state slot, scheduled every step
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_tokens or the model's context length
    CANCELLED = "cancelled"  # aborted by the client
    ERROR = "error"  # the step that served it failed


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop (OpenAI request fields, plus top_k and seed)."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus: smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    seed: int | None = None  # per-request generator: same seed, same tokens
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the text)
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to the EOS tokens
    ignore_eos: bool = False  # keep generating past EOS (benchmarks)
    # Logprobs of each sampled token and of the `logprobs` most likely ones (0..20); None: off.
    logprobs: int | None = None
    # Logprobs of every prompt token after the first, given the tokens before it, and of the
    # `prompt_logprobs` most likely ones there (0..20), computed as the prompt is prefilled
    # (such a sequence computes its whole prompt: it takes nothing from the prefix cache);
    # None: off.
    prompt_logprobs: int | None = None
    # Grammar-constrained decoding (`worker.structured.GrammarSpec`): only tokens the grammar
    # allows are sampled. The engine compiles it in add_request (an error before any token).
    grammar: Any = None
    # Prefix caching: requests share cached prompt blocks only under an equal salt (a tenant id,
    # say); None is a namespace of its own.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} must be in 0..{MAX_TOP_LOGPROBS}")

    @property
    def greedy(self) -> bool:
        """The device's argmax is all the host needs: temperature 0 and nothing to do per token
        on the host (a grammar mask, logprobs). Such sequences, and greedy ones under a grammar
        (whose masked argmax the engine queues itself), run overlapped decode, whose tokens
        never pass through the Sampler."""
        return self.temperature == 0 and self.grammar is None and self.logprobs is None


class Sequence:
    """One request's tokens and its resources.

    Tokens are computed (in the KV cache / DeltaNet state) up to `num_computed_tokens`; the rest
    are fed in the next steps. After a token is sampled it is appended to the output but not yet
    computed, so a decode step feeds exactly one token. Preemption by recompute sets
    `num_computed_tokens` back to 0: prompt and output so far are fed again as one long prefill.
    """

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("a prompt needs at least one token")
        self.seq_id = seq_id
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.block_table: list[int] = []  # KV block ids, in position order
        self.state_slot: int | None = None  # DeltaNet recurrent + conv state slot
        self.num_computed_tokens = 0
        # Prefix caching: chain hashes of the leading full blocks of block_table, and the prompt
        # tokens the first admission took from the cache instead of computing them
        self.block_hashes: list[int] = []
        self.num_cached_tokens = 0
        # Its tail checkpoint while running (StateCheckpoints.hold): the slot holding a copy of
        # its DeltaNet state after its first `checkpoint_tokens` tokens (a block boundary)
        self.checkpoint_slot: int | None = None
        self.checkpoint_tokens = 0
        self.num_preemptions = 0
        self.generator: torch.Generator | None = None  # seeded sampling, made on first use
        # worker.structured.GrammarState of a constrained sequence (set by the engine)
        self.grammar: Any = None
        # Logprobs the sampler recorded since the engine last took them (TokenLogprobs)
        self.pending_logprobs: list[Any] = []
        # With params.prompt_logprobs: TokenLogprobs of prompt tokens 1, 2, ... as computed
        self.prompt_logprobs: list[Any] = []
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_ids(self, start: int = 0, end: int | None = None) -> list[int]:
        """Tokens at positions [start, end) of prompt + output."""
        n_prompt = len(self.prompt_token_ids)
        end = self.num_tokens if end is None else end
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    def append_token(self, token_id: int, now: float | None = None) -> None:
        if not self.output_token_ids:
            self.first_token_time = time.perf_counter() if now is None else now
        self.output_token_ids.append(token_id)

    @property
    def num_sampled_tokens(self) -> int:
        """Output tokens the host has seen (not counting those still in flight)."""
        n = len(self.output_token_ids)
        while n and self.output_token_ids[n - 1] == PENDING_TOKEN:
            n -= 1
        return n

    def drop_pending_tokens(self) -> None:
        """Forget tokens still in flight (they are never emitted nor counted)."""
        while self.output_token_ids and self.output_token_ids[-1] == PENDING_TOKEN:
            self.output_token_ids.pop()

    def finish(self, reason: FinishReason, now: float | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = time.perf_counter() if now is None else now

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
