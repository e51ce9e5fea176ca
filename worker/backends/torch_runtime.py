"""Our runtime: a model loaded by `worker.loading` (GGUF or a Hugging Face checkpoint) served by
the engine (`worker.engine`: scheduler, paged KV cache, continuous batching) on its own thread.

The tokenizer renders chats (tools included) with the model's own template and counts prompt
tokens; the engine applies stop strings, sampling, grammars (response_format, forced tool calls)
and max_tokens, and aborts a request whose iterator is left (a client that hung up). Tool calls
are parsed out of each choice's text here; n > 1 runs n sequences of the prompt, and a request
of several prompts (texts or token ids) n of each. With `echo` each choice starts with its
prompt, and with logprobs too the prompt tokens' logprobs, computed as the prompt is prefilled.

Size: The torch runtime's side of every request shape (chat and text, several prompts, token
ids, n choices, echo, logprobs, tools, grammars) over the one engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from tokenmill.tasks import cancel_and_wait
from worker.backends.base import InvalidRequest, Load, Progress
from worker.protocol import (
    ChatMessage,
    GenerateRequest,
    TokenLogprob,
    Tool,
    ToolCallDelta,
    ToolChoiceFunction,
    TopLogprob,
)

log = logging.getLogger("tokenmill.worker.torch")

QUANTIZE_OPTIONS = (None, "fp8", "w4")
LM_HEAD_OPTIONS = ("fp8", "int4", "none")


def quantize_model(
    model: Any,
    quantize: str | None,
    lm_head: str = "fp8",
    group_size: int = 128,
    as_stored: bool = False,
) -> Any:
    """Apply a `quantize` option to a loaded model, in place. `as_stored`: the model came from a
    quantized checkpoint directory, whose per-tensor precisions were chosen when it was written;
    "w4" keeps them and "fp8" is refused. A GGUF's native 4-bit layers stay as they are and "w4"
    converts the 16-bit linear layers left (a file's Q8_0 or F16 ones)."""
    if quantize is None:
        return model
    already = getattr(model, "quantization_config", None) is not None
    if quantize == "fp8":
        if already:
            raise ValueError("quantize='fp8' on a checkpoint that is already quantized")
        from worker.models.fp8 import quantize_fp8

        return quantize_fp8(model)
    from worker.models.int4 import quantize_int4, weight_bytes

    if not as_stored:
        quantize_int4(model, group_size, None if lm_head == "none" else lm_head)
    sizes = {k: f"{v / 2**30:.2f} GiB" for k, v in weight_bytes(model).items()}
    log.info("int4 weights: %s", sizes)
    return model


@dataclass
class TorchRuntimeBackend:
    model_path: str  # a .gguf file or a Hugging Face checkpoint directory
    device: str = "cpu"
    dtype: str = "float32"  # CPUs run float32 fastest; "bfloat16" on GPUs
    max_num_seqs: int = 8
    max_model_len: int = 2048
    # "fp8": every linear layer's weight to FP8 e4m3 with per-channel scales as the model loads
    # (for a 16-bit checkpoint or a `random:` benchmark model). "w4": int4 weights
    # (`worker.models.int4.quantize_int4`: group 128 symmetric RTN, DeltaNet's in_proj_a/b
    # 16-bit, the head per `quantize_lm_head`); a GGUF file's Q4_0/Q4_1 weights are kept as
    # stored. None: as loaded (a quantized checkpoint directory always loads as stored).
    quantize: str | None = None
    # With "w4": the LM head as "fp8" (default), "int4" (the 27B payload under 15 GiB: 14.7
    # against 15.3 GiB) or "none" (16-bit).
    quantize_lm_head: str = "fp8"
    quantize_group_size: int = 128
    # "fp8": the attention KV cache in FP8 e4m3; None: the model's dtype.
    kv_dtype: str | None = None
    # "host": the token embedding table in pinned host memory, read row by row over PCIe
    # (`CausalLM.embeddings_to_host`; a GPU and an untied LM head), "device": on the GPU,
    # "auto": host for "w4" weights where it can (`place_embeddings`), else device.
    embeddings: str = "auto"
    name: str = "torch_runtime"

    def __post_init__(self) -> None:
        if self.quantize not in QUANTIZE_OPTIONS:
            raise ValueError(f"quantize={self.quantize!r}: expected one of {QUANTIZE_OPTIONS}")
        if self.kv_dtype not in (None, "fp8"):
            raise ValueError(f"kv_dtype={self.kv_dtype!r}: expected 'fp8' or nothing")
        from worker.models.causal_lm import EMBEDDINGS_OPTIONS

        if self.embeddings not in EMBEDDINGS_OPTIONS:
            raise ValueError(
                f"embeddings={self.embeddings!r}: expected one of {EMBEDDINGS_OPTIONS}"
            )
        if self.quantize_lm_head not in LM_HEAD_OPTIONS:
            raise ValueError(
                f"quantize_lm_head={self.quantize_lm_head!r}: expected one of {LM_HEAD_OPTIONS}"
            )
        self.engine: Any = None  # AsyncLLMEngine, once started
        self.tokenizer: Any = None

    @property
    def capacity(self) -> int:
        return self.max_num_seqs

    @property
    def max_context(self) -> int:
        return self.max_model_len

    async def start(self) -> None:
        self.engine, self.tokenizer = await asyncio.to_thread(self._load)

    def _load(self) -> tuple[Any, Any]:
        from worker.engine.async_engine import AsyncLLMEngine

        llm, tokenizer = self.build_engine()
        engine = AsyncLLMEngine(llm)
        engine.start()
        log.info("loaded %s on %s (%s)", self.model_path, self.device, self.dtype)
        return engine, tokenizer

    def build_engine(self) -> tuple[Any, Any]:
        """(LLMEngine, tokenizer) as this backend serves them, warmed up: also what a
        benchmark runs to compare the engine alone with the worker around it."""
        import torch

        from worker.engine.engine import EngineConfig, LLMEngine
        from worker.loading import load_model
        from worker.models.causal_lm import place_embeddings

        model, tokenizer = load_model(
            self.model_path,
            self.device,
            getattr(torch, self.dtype),
            native_int4=self.quantize == "w4",
        )
        from worker.loading.quantized import is_quantized_checkpoint

        as_stored = not self.model_path.startswith("random:") and is_quantized_checkpoint(
            self.model_path
        )
        quantize_model(
            model, self.quantize, self.quantize_lm_head, self.quantize_group_size, as_stored
        )
        placed = place_embeddings(model, self.embeddings, self.quantize)
        log.info("embedding table on the %s", "host" if placed == "host" else self.device)
        config = EngineConfig.from_env(
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            kv_dtype=torch.float8_e4m3fn if self.kv_dtype == "fp8" else None,
        )
        llm = LLMEngine(model, tokenizer, config)
        if config.warm_up:
            began = time.perf_counter()
            compositions = llm.warm_up()
            log.info(
                "warmed up %d batch compositions in %.1f s",
                len(compositions),
                time.perf_counter() - began,
            )
        return llm, tokenizer

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.close()

    def load(self) -> Load:
        if self.engine is None:
            return Load()
        # Read without the engine thread's lock: a heartbeat may be one step stale, no more.
        llm = self.engine.engine
        blocks = llm.block_manager
        return Load(
            running=len(llm.scheduler.running),
            waiting=len(llm.scheduler.waiting),
            kv_pressure=blocks.num_used_blocks / blocks.num_blocks if blocks.num_blocks else 0.0,
        )

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        if request.messages is not None:
            messages = [_message(m) for m in request.messages]
            if request.tools and request.tool_choice != "none":
                tools = [_tool(t) for t in request.tools]
                return list(self.tokenizer.encode_chat(messages, tools=tools))
            return list(self.tokenizer.encode_chat(messages))
        return list(self.tokenizer.encode(request.prompt or ""))

    def prompts(self, request: GenerateRequest) -> list[list[int]]:
        """Every prompt's token ids, in order; token ids outside the model's vocabulary are
        refused (param "prompt")."""
        if request.prompt_token_ids is None:
            if request.prompts is None:
                return [self.prompt_ids(request)]
            return [list(self.tokenizer.encode(text)) for text in request.prompts]
        vocab = self.vocab_size
        for i, ids in enumerate(request.prompt_token_ids):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                where = "prompt" if len(request.prompt_token_ids) == 1 else f"prompt[{i}]"
                raise InvalidRequest(
                    f"{where} holds the token id {bad}, outside this model's vocabulary "
                    f"(0..{vocab - 1}).",
                    param="prompt",
                    code="invalid_prompt",
                )
        return [list(ids) for ids in request.prompt_token_ids]

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold: the tokenizer's and the model's logits width, the
        narrower (a padded logits row has ids no tokenizer writes, an embedding none reads)."""
        config = getattr(self.engine.engine.model, "config", None)
        width = getattr(config, "vocab_size", None) or self.tokenizer.vocab_size
        return int(min(width, self.tokenizer.vocab_size))

    def echo_texts(self, request: GenerateRequest, prompts: list[list[int]]) -> list[str]:
        """What each prompt's choices start with under `echo`: the text as sent, or the ids'."""
        if request.prompt_token_ids is not None:
            return [self.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]
        return list(request.prompts) if request.prompts is not None else [request.prompt or ""]

    def grammar(self, request: GenerateRequest) -> Any:
        """The GrammarSpec the request's reply must follow (None: free text): tool calls when
        tool_choice forces them, else the response_format."""
        from worker.structured import GrammarError, response_format_grammar, tool_calls_grammar

        choice = request.tool_choice
        forced = choice == "required" or isinstance(choice, ToolChoiceFunction)
        try:
            if forced:
                if not request.tools:
                    raise GrammarError("tool_choice needs tools", "tool_choice")
                only = choice.name if isinstance(choice, ToolChoiceFunction) else None
                tools = [(t.name, t.parameters) for t in request.tools]
                return tool_calls_grammar(tools, only, request.parallel_tool_calls)
            if request.response_format is not None:
                f = request.response_format
                return response_format_grammar(f.type, f.schema, f.strict)
        except GrammarError as exc:
            raise InvalidRequest(exc.message, param=exc.param) from None
        return None

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Progress]:
        from worker.engine.sequence import MAX_TOP_LOGPROBS, SamplingParams
        from worker.structured import GrammarError
        from worker.tokenizer.tool_calls import ToolCallParser

        assert self.engine is not None, "the backend is not started"
        if request.n < 1:
            raise InvalidRequest("n must be at least 1.", param="n")
        if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(
                f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}.", param="top_logprobs"
            )
        prompts = self.prompts(request)
        param = "messages" if request.chat else "prompt"
        s = request.sampling
        max_new: list[int] = []  # per prompt
        for ids in prompts:
            if not ids:
                raise InvalidRequest("The prompt is empty.", param=param, code="invalid_prompt")
            room = self.max_model_len - len(ids)
            if room < 1 or (s.max_tokens is not None and s.max_tokens > room):
                raise InvalidRequest(
                    f"This model's maximum context length is {self.max_model_len} tokens; the "
                    f"prompt has {len(ids)} tokens and asks for {s.max_tokens or 'at least 1'} "
                    "more.",
                    param=param,
                )
            max_new.append(s.max_new_tokens(room) or 0)
        spec = self.grammar(request)
        if spec is not None:  # compiled off the engine thread; the engine then hits the cache
            try:
                await asyncio.to_thread(self.engine.engine.grammars.compile, spec)
            except GrammarError as exc:
                raise InvalidRequest(exc.message, param=exc.param) from None
        n = request.n
        prompt_tokens = sum(len(ids) for ids in prompts)
        # `echo`: each choice's first Progress starts with its prompt (and its logprobs)
        echoes: list[str | None] = [None] * len(prompts)
        if request.echo:
            echoes = list(self.echo_texts(request, prompts))
        want_prompt_logprobs = request.echo and request.logprobs
        # Nothing to generate (max_tokens 0 with echo, or the gateway's budget is spent): the
        # prompt alone, and its logprobs from a prefill whose one sampled token is dropped.
        prompt_only = not any(max_new)
        if prompt_only and not want_prompt_logprobs:
            for i in range(request.num_choices):
                yield Progress(
                    echoes[i // n] or "", 0, prompt_tokens, finish_reason="length", index=i
                )
            return
        # choice c of prompt p at index p * n + c; a prompt's choices are seeded as if it came
        # alone (seed + c), so a list of prompts answers as its prompts one by one would
        params = [
            SamplingParams(
                temperature=s.temperature,
                top_p=s.top_p,
                # choices of a seeded request differ from each other, and repeat as a whole
                seed=None if s.seed is None else s.seed + c,
                max_tokens=max(1, max_new[p]),
                stop=list(s.stop),
                logprobs=request.top_logprobs if request.logprobs else None,
                prompt_logprobs=request.top_logprobs if want_prompt_logprobs else None,
                grammar=spec,
                # cached prompt blocks are shared within a tenant only: another tenant could
                # otherwise tell from its first-token time that a prompt is cached
                cache_salt=request.tenant_id,
            )
            for p in range(len(prompts))
            for c in range(n)
        ]
        parse_tools = bool(request.chat and request.tools and request.tool_choice != "none")
        names = [t.name for t in request.tools or []]
        parsers = [ToolCallParser(names) if parse_tools else None for _ in params]
        generated = [0] * len(params)
        cached = [0] * len(prompts)  # what the prefix cache gave each prompt (its latest choice)
        started = [False] * len(params)
        inputs = [prompts[i // n] for i in range(len(params))]
        async for i, out in self._choices(inputs, params, request.request_id):
            finish = None
            if out.finished:
                if out.finish_reason not in ("stop", "length"):
                    raise RuntimeError(out.error or f"generation ended: {out.finish_reason}")
                finish = str(out.finish_reason)
            text, entries, generated[i] = out.text, out.logprobs, out.usage.completion_tokens
            if prompt_only:  # the sampled token is not part of the answer
                text, entries, generated[i] = "", [], 0
                finish = "length" if out.finished else None
            calls = None
            parser = parsers[i]
            if parser is not None:
                parsed = parser.feed(text)
                if out.finished:
                    rest = parser.finish()
                    parsed.content += rest.content
                    parsed.tool_calls += rest.tool_calls
                    if finish == "stop" and parser.calls:
                        finish = "tool_calls"
                text = parsed.content
                calls = [
                    ToolCallDelta(index=d.index, id=d.id, name=d.name, arguments=d.arguments)
                    for d in parsed.tool_calls
                ] or None
            cached[i // n] = out.usage.cached_tokens
            logprobs = self._logprobs(entries) if request.logprobs else None
            echo = echoes[i // n]
            if echo is not None and not started[i]:
                text = echo + text
                if logprobs is not None:
                    logprobs = self._prompt_logprobs(out.prompt_logprobs, inputs[i]) + logprobs
            started[i] = True
            yield Progress(
                text,
                sum(generated),
                prompt_tokens,
                sum(cached),
                finish_reason=finish,  # type: ignore[arg-type]
                index=i,
                logprobs=logprobs,
                tool_calls=calls,
            )

    async def _choices(
        self, prompts: list[list[int]], params: list[Any], request_id: str
    ) -> AsyncIterator[tuple[int, Any]]:
        """Each choice's engine outputs, tagged with its index, as they come. Choices are
        separate sequences, `prompts[i]` the prompt of choice i (each prefills it), added to the
        engine together so they batch."""
        assert self.engine is not None
        if len(params) == 1:
            async for out in self.engine.generate(prompts[0], params[0], request_id):
                yield 0, out
            return
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(i: int, p: Any) -> None:
            try:
                async for out in self.engine.generate(prompts[i], p, f"{request_id}/{i}"):
                    await queue.put((i, out))
            except Exception as exc:  # the request fails as a whole
                await queue.put((i, exc))

        tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(params)]
        try:
            left = len(params)
            while left:
                i, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                yield i, item
                left -= item.finished
        finally:  # cancelling a pump leaves its engine stream, which aborts that choice
            await asyncio.gather(*map(cancel_and_wait, tasks), return_exceptions=True)

    def _prompt_logprobs(self, entries: list[Any] | None, ids: list[int]) -> list[TokenLogprob]:
        """The prompt's tokens as OpenAI echoes them: every one with its text, the first with
        no logprob, the others as the engine computed them (none if it did not)."""
        out = []
        for j, token_id in enumerate(ids):
            token = self._token_text(token_id)
            e = entries[j] if entries is not None and j < len(entries) else None
            top = [] if e is None else self._top(e.top)
            out.append(
                TokenLogprob(
                    token=token,
                    logprob=None if e is None else e.logprob,
                    bytes=list(token.encode()),
                    top_logprobs=top,
                )
            )
        return out

    def _top(self, top: list[tuple[int, float]]) -> list[TopLogprob]:
        return [
            TopLogprob(token=(t := self._token_text(i)), logprob=lp, bytes=list(t.encode()))
            for i, lp in top
        ]

    def _logprobs(self, entries: list[Any]) -> list[TokenLogprob]:
        eos = self.tokenizer.eos_token_ids
        out = []
        for e in entries:
            if e.token_id in eos:  # the end token is not part of the text
                continue
            token = self._token_text(e.token_id)
            top = self._top(e.top)
            out.append(
                TokenLogprob(
                    token=token, logprob=e.logprob, bytes=list(token.encode()), top_logprobs=top
                )
            )
        return out

    def _token_text(self, token_id: int) -> str:
        cache: dict[int, str] = self.__dict__.setdefault("_token_texts", {})
        text = cache.get(token_id)
        if text is None:
            text = cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def _message(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def _tool(t: Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": t.name}
    if t.description is not None:
        function["description"] = t.description
    function["parameters"] = (
        json.loads(t.parameters) if t.parameters else {"type": "object", "properties": {}}
    )
    return {"type": "function", "function": function}
