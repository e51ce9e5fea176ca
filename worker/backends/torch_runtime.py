"""Our runtime: a model loaded by `worker.loading` (GGUF or a Hugging Face checkpoint) served by
the engine (`worker.engine`: scheduler, paged KV cache, continuous batching) on its own thread.

The tokenizer renders chats with the model's own template and counts prompt tokens; the
engine applies stop strings, sampling and max_tokens, and aborts a request whose iterator is
left (a client that hung up)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from worker.backends.base import InvalidRequest, Load, Progress
from worker.protocol import GenerateRequest

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
    name: str = "torch_runtime"

    def __post_init__(self) -> None:
        if self.quantize not in QUANTIZE_OPTIONS:
            raise ValueError(f"quantize={self.quantize!r}: expected one of {QUANTIZE_OPTIONS}")
        if self.kv_dtype not in (None, "fp8"):
            raise ValueError(f"kv_dtype={self.kv_dtype!r}: expected 'fp8' or nothing")
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
        import torch

        from worker.engine.async_engine import AsyncLLMEngine
        from worker.engine.engine import EngineConfig, LLMEngine
        from worker.loading import load_model

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
        engine = AsyncLLMEngine(llm)
        engine.start()
        log.info("loaded %s on %s (%s)", self.model_path, self.device, self.dtype)
        return engine, tokenizer

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
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
            return list(self.tokenizer.encode_chat(messages))
        return list(self.tokenizer.encode(request.prompt or ""))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Progress]:
        from worker.engine.sequence import SamplingParams

        assert self.engine is not None, "the backend is not started"
        ids = self.prompt_ids(request)
        param = "messages" if request.chat else "prompt"
        if not ids:
            raise InvalidRequest("The prompt is empty.", param=param)
        room = self.max_model_len - len(ids)
        s = request.sampling
        if room < 1 or (s.max_tokens is not None and s.max_tokens > room):
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(ids)} tokens and asks for {s.max_tokens or 'at least 1'} more.",
                param=param,
            )
        max_new = s.max_new_tokens(room) or 0
        if max_new == 0:
            yield Progress("", 0, len(ids), finish_reason="length")
            return
        params = SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            max_tokens=max_new,
            stop=list(s.stop),
        )
        async for out in self.engine.generate(ids, params, request.request_id):
            finish = None
            if out.finished:
                if out.finish_reason not in ("stop", "length"):
                    raise RuntimeError(out.error or f"generation ended: {out.finish_reason}")
                finish = str(out.finish_reason)
            yield Progress(
                out.text,
                out.usage.completion_tokens,
                out.usage.prompt_tokens,
                out.usage.cached_tokens,
                finish_reason=finish,  # type: ignore[arg-type]
            )
