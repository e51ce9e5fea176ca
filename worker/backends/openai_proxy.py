"""An adapter to any external OpenAI-compatible engine (a vLLM or SGLang server, another
tokenmill): requests are forwarded as streamed completions and metered like our own.

Token counts come from the upstream's final usage chunk (we always ask for
`stream_options.include_usage`); until it arrives each content chunk counts as one token,
which is what vLLM sends. A request cancelled before the usage chunk is metered with that
count and zero prompt tokens: the upstream never told us more."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from worker.backends.base import InvalidRequest, Load, Progress, serves_one_choice
from worker.protocol import GenerateRequest


@dataclass
class OpenAIProxyBackend:
    base_url: str  # the upstream's /v1 URL, e.g. http://vllm:8000/v1
    model: str  # the upstream's model name
    # The upstream key: better by the name of an environment variable than in the SKU config.
    api_key: str | None = None
    api_key_env: str | None = None
    capacity: int = 64
    max_context: int | None = None
    timeout_s: float = 600.0
    name: str = "openai_proxy"

    def __post_init__(self) -> None:
        self._http: httpx.AsyncClient | None = None
        self._running = 0

    async def start(self) -> None:
        key = self.api_key or (os.environ.get(self.api_key_env) if self.api_key_env else None)
        headers = {"authorization": f"Bearer {key}"} if key else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(self.timeout_s, connect=10.0),
            limits=httpx.Limits(
                max_connections=self.capacity * 2, max_keepalive_connections=self.capacity
            ),
        )

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()

    def load(self) -> Load:
        return Load(
            running=min(self._running, self.capacity), waiting=max(0, self._running - self.capacity)
        )

    def _body(self, request: GenerateRequest) -> tuple[str, dict[str, Any]]:
        s = request.sampling
        body: dict[str, Any] = {
            "model": self.model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": s.temperature,
            "top_p": s.top_p,
        }
        if s.max_tokens is not None:
            body["max_tokens"] = s.max_tokens
        if s.stop:
            body["stop"] = list(s.stop)
        if s.seed is not None:
            body["seed"] = s.seed
        if request.messages is not None:
            body["messages"] = [{"role": m.role, "content": m.content} for m in request.messages]
            return "/chat/completions", body
        body["prompt"] = request.prompt or ""
        return "/completions", body

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Progress]:
        assert self._http is not None, "the backend is not started"
        serves_one_choice(request, self.name)
        path, body = self._body(request)
        # The gateway's budget is enforced here when it is tighter than what upstream was asked.
        s = request.sampling
        cut_at = (
            s.token_budget
            if s.token_budget is not None
            and (s.max_tokens is None or s.token_budget < s.max_tokens)
            else None
        )
        prompt_tokens = cached_tokens = completion_tokens = 0
        finish: str | None = None
        self._running += 1
        try:
            async with self._http.stream("POST", path, json=body) as response:
                if response.status_code >= 400:
                    await response.aread()
                    error = _error_of(response)
                    if response.status_code == 400:
                        raise InvalidRequest(
                            error.get("message") or response.text, param=error.get("param")
                        )
                    raise RuntimeError(
                        f"upstream answered {response.status_code}: {error.get('message') or response.text[:200]}"
                    )
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        raise RuntimeError(f"upstream error: {chunk['error']}")
                    usage = chunk.get("usage")
                    if usage:  # the last chunk, or every chunk with vLLM's continuous usage stats
                        prompt_tokens = usage.get("prompt_tokens", 0)
                        completion_tokens = usage.get("completion_tokens", completion_tokens)
                        cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                            "cached_tokens"
                        ) or 0
                    for choice in chunk.get("choices") or []:
                        text = (
                            (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                        )
                        finish = choice.get("finish_reason") or finish
                        if text:
                            completion_tokens += 0 if usage else 1
                            yield Progress(text, completion_tokens, prompt_tokens, cached_tokens)
                    if cut_at is not None and completion_tokens >= cut_at and finish is None:
                        finish = "length"  # leaving the stream cancels the upstream request
                        break
            # Tool calls or content filters end a generation normally too; for billing, "stop".
            yield Progress(
                "",
                completion_tokens,
                prompt_tokens,
                cached_tokens,
                finish_reason="length" if finish == "length" else "stop",
            )
        finally:
            self._running -= 1


def _error_of(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {}
