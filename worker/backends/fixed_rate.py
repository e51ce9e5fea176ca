"""A LOAD-TEST backend: emits tokens at a fixed rate without a model. A test and benchmark
fixture, never a default: it lets the data plane be measured without the engine's noise.

Output token i (counted from 0) is the text `" t{i}"`, so a client can check token by token
what it received. Prompt tokens are the whitespace-separated words of the prompt (of every
message's content, plus 3 per message for the role framing)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from worker.backends.base import InvalidRequest, Load, Progress, StopMatcher, serves_one_choice
from worker.protocol import GenerateRequest


@dataclass
class FixedRateBackend:
    tokens_per_s: float = 50.0  # per request
    ttft_ms: float = 0.0  # delay before the first token ("prefill")
    output_tokens: int = 32  # length of a full answer, finish "stop"; max_tokens cuts it ("length")
    capacity: int = 256
    max_context: int | None = 4096
    name: str = "fixed_rate"

    def __post_init__(self) -> None:
        self._running = 0

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def load(self) -> Load:
        # No KV cache: a request in flight holds one of `capacity` slots, which stands in for
        # its share of the KV blocks (so routing sees the same signal as from the engine).
        return Load(
            running=min(self._running, self.capacity),
            waiting=max(0, self._running - self.capacity),
            kv_pressure=min(1.0, self._running / self.capacity) if self.capacity else 0.0,
        )

    @staticmethod
    def count_prompt_tokens(request: GenerateRequest) -> int:
        if request.messages is not None:
            return sum(len(m.content.split()) + 3 for m in request.messages)
        return len((request.prompt or "").split())

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Progress]:
        serves_one_choice(request, self.name)
        prompt_tokens = self.count_prompt_tokens(request)
        max_tokens = request.sampling.max_tokens
        if self.max_context is not None and prompt_tokens + (max_tokens or 0) > self.max_context:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_context} tokens; the request "
                f"has {prompt_tokens} prompt tokens and asks for {max_tokens} more.",
                param="messages" if request.chat else "prompt",
            )
        cap = request.sampling.max_new_tokens(None)
        budget = self.output_tokens if cap is None else min(self.output_tokens, cap)
        stop = StopMatcher(request.sampling.stop)
        self._running += 1
        try:
            start = time.monotonic() + self.ttft_ms / 1000
            for i in range(budget):
                # Sleep to an absolute schedule so a slow loop does not stretch the rate.
                delay = start + i / self.tokens_per_s - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                text = stop.feed(f" t{i}")
                last = i + 1 == budget or stop.stopped
                finish = None
                if last:
                    text += "" if stop.stopped else stop.flush()
                    finish = "stop" if stop.stopped or budget == self.output_tokens else "length"
                yield Progress(text, i + 1, prompt_tokens, finish_reason=finish)  # type: ignore[arg-type]
                if last:
                    return
            yield Progress("", 0, prompt_tokens, finish_reason="length")  # max_tokens == 0
        finally:
            self._running -= 1
