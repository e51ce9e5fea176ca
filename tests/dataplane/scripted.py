"""A SCRIPTED worker backend for tests (never a default, not registered with the worker CLI):
fixed token streams, so tool-call parsing, logprobs, n choices and streaming deltas can be
checked exactly through the real worker process, NATS and gateway.

The last user message picks the script (`script:<name>`, else `plain`):

- plain: tokens `" w0"`, `" w1"`, ... (`PLAIN_TOKENS` of them), finish "stop";
- tool: `Checking.` then a `<tool_call>` span calling `get_weather` with `{"city": "Paris"}`,
  written a few characters per token, parsed as the torch runtime parses it (finish
  "tool_calls");
- two_tools: two such calls (Paris, then Oslo);
- bad_tool: a span naming a function not in `tools`: it must come back as content;
- json: `{"answer": 42}`.

Token i of a choice has logprob `-(i + 1) / 10`; its top_logprobs are the token itself and
`"x"`, `"y"`, ... with lower ones. Each choice writes the same script; max_tokens (or the
gateway's budget) cuts each choice ("length"). A json_schema response_format is compiled by
the worker's grammar library (xgrammar), so a schema it cannot enforce is Rejected as by the
torch runtime. Prompt tokens: the words of every message plus 3 per message (as fixed_rate).

Completions may carry several prompts (texts, or token ids, id t being the word `<t>`; ids of
`VOCAB` and above are Rejected as by the torch runtime), n choices of each at index
prompt * n + choice. With `echo` each choice starts with its prompt; with logprobs too, the
prompt's words come first with logprob -0.5 each (the first null); max_tokens 0 gives the
prompt alone.

    python -m tests.dataplane.scripted --nats-url URL --prefix P --sku-id SKU
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from worker.backends.base import InvalidRequest, Load, Progress
from worker.protocol import GenerateRequest, TokenLogprob, ToolCallDelta, TopLogprob
from worker.serve import Worker, WorkerSettings
from worker.tokenizer.tool_calls import ToolCallParser

PLAIN_TOKENS = 12
VOCAB = 1000  # token ids a prompt may hold
PROMPT_LOGPROB = -0.5


def _pieces(text: str, size: int = 4) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def _call(name: str, city: str) -> str:
    args = json.dumps({"city": city})
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


SCRIPTS: dict[str, list[str]] = {
    "plain": [f" w{i}" for i in range(PLAIN_TOKENS)],
    "tool": ["Checking."] + _pieces(_call("get_weather", "Paris")),
    "two_tools": _pieces(_call("get_weather", "Paris") + "\n" + _call("get_weather", "Oslo")),
    "bad_tool": _pieces(_call("launch_rockets", "Paris")),
    "json": ['{"', "answer", '": ', "42", "}"],
}


def script_of(request: GenerateRequest) -> list[str]:
    text = request.prompt or ""
    for m in request.messages or []:
        if m.role == "user":
            text = m.content
    name = text.removeprefix("script:").strip() if text.startswith("script:") else "plain"
    return SCRIPTS.get(name, SCRIPTS["plain"])


def logprob_of(token: str, i: int, top: int) -> TokenLogprob:
    lp = -(i + 1) / 10
    others = [TopLogprob(token=c, logprob=lp - k - 1, bytes=[ord(c)]) for k, c in enumerate("xyz")]
    tops = [TopLogprob(token=token, logprob=lp, bytes=list(token.encode())), *others][:top]
    return TokenLogprob(token=token, logprob=lp, bytes=list(token.encode()), top_logprobs=tops)


def prompt_words(request: GenerateRequest) -> list[list[str]]:
    """Each prompt's tokens: its words (with the space before them, so they join back into
    the text), or `<t>` per token id t."""
    if request.prompt_token_ids is not None:
        return [[f"<{t}>" for t in ids] for ids in request.prompt_token_ids]
    texts = request.prompts if request.prompts is not None else [request.prompt or ""]
    return [re.findall(r"\s*\S+", text) for text in texts]


def echo_logprob(word: str, j: int, top: int) -> TokenLogprob:
    if j == 0:  # nothing predicts a prompt's first token
        return TokenLogprob(token=word, logprob=None, bytes=list(word.encode()))
    tops = [TopLogprob(token=word, logprob=PROMPT_LOGPROB, bytes=list(word.encode()))][:top]
    return TokenLogprob(
        token=word, logprob=PROMPT_LOGPROB, bytes=list(word.encode()), top_logprobs=tops
    )


def _check_format(request: GenerateRequest) -> None:
    f = request.response_format
    if f is None or f.type != "json_schema":
        return
    import xgrammar as xgr

    try:
        xgr.Grammar.from_json_schema(f.schema or "{}", strict_mode=f.strict)
    except Exception as exc:  # the library's own words, as the torch runtime reports them
        first = str(exc).strip().splitlines()[0]
        reason = first.rsplit(": ", 1)[-1] if ": " in first else first
        raise InvalidRequest(
            f"the JSON schema cannot be enforced: {reason}", param="response_format"
        ) from None


@dataclass
class ScriptedBackend:
    token_delay_s: float = 0.005
    capacity: int = 64
    max_context: int | None = 4096
    name: str = "scripted"

    def __post_init__(self) -> None:
        self._running = 0

    async def start(self) -> None:
        # xgrammar takes seconds to import: not on the first request's clock.
        self._warm = asyncio.create_task(asyncio.to_thread(__import__, "xgrammar"))

    async def close(self) -> None:
        return None

    def load(self) -> Load:
        return Load(running=self._running, kv_pressure=min(1.0, self._running / self.capacity))

    @staticmethod
    def count_prompt_tokens(request: GenerateRequest) -> int:
        if request.messages is not None:
            return sum(len(m.content.split()) + 3 for m in request.messages)
        return sum(len(words) for words in prompt_words(request))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Progress]:
        await asyncio.to_thread(_check_format, request)
        prompt_tokens = self.count_prompt_tokens(request)
        for ids in request.prompt_token_ids or []:
            bad = next((t for t in ids if not 0 <= t < VOCAB), None)
            if bad is not None:
                raise InvalidRequest(
                    f"the token id {bad} is outside the vocabulary", "prompt", "invalid_prompt"
                )
        words = prompt_words(request)
        tokens = script_of(request)
        cap = request.sampling.max_new_tokens(None)
        budget = len(tokens) if cap is None else min(len(tokens), cap)
        parse = bool(request.chat and request.tools and request.tool_choice != "none")
        names = [t.name for t in request.tools or []]
        choices = request.num_choices
        parsers = [ToolCallParser(names) if parse else None for _ in range(choices)]
        top = request.top_logprobs
        if budget == 0:  # max_tokens 0 with echo: the prompt alone
            for choice in range(choices):
                prompt = words[choice // request.n] if request.echo else []
                entries = [echo_logprob(w, j, top) for j, w in enumerate(prompt)]
                yield Progress(
                    "".join(prompt),
                    0,
                    prompt_tokens,
                    finish_reason="length",
                    index=choice,
                    logprobs=entries if request.logprobs else None,
                )
            return
        self._running += 1
        generated = 0
        try:
            for i in range(budget):
                for choice in range(choices):  # choices interleave, as batched sequences do
                    await asyncio.sleep(self.token_delay_s)
                    generated += 1
                    token = tokens[i]
                    last = i + 1 == budget
                    text, calls = token, None
                    echo: list[TokenLogprob] = []
                    if request.echo and i == 0:
                        prompt = words[choice // request.n]
                        text = "".join(prompt) + text
                        echo = [echo_logprob(w, j, top) for j, w in enumerate(prompt)]
                    finish: Any = None
                    if last:
                        finish = "stop" if budget == len(tokens) else "length"
                    parser = parsers[choice]
                    if parser is not None:
                        parsed = parser.feed(token)
                        if last:
                            rest = parser.finish()
                            parsed.content += rest.content
                            parsed.tool_calls += rest.tool_calls
                            if finish == "stop" and parser.calls:
                                finish = "tool_calls"
                        text = parsed.content
                        calls = [
                            ToolCallDelta(
                                index=d.index, id=d.id, name=d.name, arguments=d.arguments
                            )
                            for d in parsed.tool_calls
                        ] or None
                    yield Progress(
                        text,
                        generated,
                        prompt_tokens,
                        finish_reason=finish,
                        index=choice,
                        logprobs=[*echo, logprob_of(token, i, top)] if request.logprobs else None,
                        tool_calls=calls,
                    )
        finally:
            self._running -= 1


def start_scripted_worker(stack: Any, sku_id: str, **config: Any) -> subprocess.Popen[bytes]:
    """A worker process serving `sku_id` from the scripted backend (stopped with the stack)."""
    from tests.dataplane.harness import HEARTBEAT_S, ROOT

    proc = subprocess.Popen(
        [
            sys.executable, "-m", "tests.dataplane.scripted", "--nats-url", stack.nats_url,
            "--prefix", stack.prefix, "--sku-id", sku_id, "--heartbeat-s", str(HEARTBEAT_S),
            "--config", json.dumps(config),
        ],
        cwd=ROOT,
        env={**os.environ, "TOKENMILL_LOG_LEVEL": "WARNING"},
    )  # fmt: skip
    stack.workers.append(proc)
    return proc


async def _serve(args: argparse.Namespace) -> None:
    settings = WorkerSettings(
        nats_url=args.nats_url,
        stream_prefix=args.prefix,
        sku_id=args.sku_id,
        model="scripted-test",
        backend="scripted",
        heartbeat_s=args.heartbeat_s,
        drain_s=2.0,
    )
    worker = Worker(settings, ScriptedBackend(**json.loads(args.config)))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, worker.stop)
    await worker.run()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--nats-url", required=True)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--sku-id", required=True)
    ap.add_argument("--heartbeat-s", type=float, default=0.1)
    ap.add_argument("--config", default="{}")
    asyncio.run(_serve(ap.parse_args()))
