"""Builders the worker tests share: requests, engines, prompts and a trained tokenizer."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

from tests.worker.engine_fakes import VOCAB
from worker.backends.base import Progress
from worker.engine.engine import EngineConfig, LLMEngine
from worker.engine.sequence import SamplingParams
from worker.protocol import GenerateRequest
from worker.protocol import SamplingParams as RequestSampling

# The ids of a request in these tests: nothing routes or meters by them.
REQUEST_IDS: dict[str, str] = dict(tenant_id="t", key_id="k", sku_id="s", model="m")

# The small engine the CPU tests run, with 4-token blocks; a test names what it changes.
SMALL_ENGINE: dict[str, Any] = dict(
    block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64
)

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)


def small_engine(model: Any, tokenizer: Any = None, **config: Any) -> LLMEngine:
    return LLMEngine(model, tokenizer, EngineConfig(**(SMALL_ENGINE | config)))


async def generate_greedy(backend: Any, prompt: str, max_tokens: int) -> list[Progress]:
    """Everything a started backend reports for one greedy request of `prompt`."""
    request = GenerateRequest(
        request_id="r1",
        **REQUEST_IDS,
        prompt=prompt,
        sampling=RequestSampling(max_tokens=max_tokens, temperature=0),
        reply_to="",
        admitted_at=time.time(),
    )
    return [p async for p in backend.generate(request)]


def random_prompts(n: int, lo: int, hi: int, seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def generate_counting_preemptions(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, max_used_blocks: int
) -> tuple[list[list[int]], int]:
    """Step `engine` until every prompt finished, checking after each step that at most
    `max_used_blocks` KV blocks are in use; each prompt's tokens and the preemptions."""
    ids = [engine.add_request(p, params) for p in prompts]
    results: dict[str, list[int]] = {i: [] for i in ids}
    preemptions = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id] += out.new_token_ids
            if out.finished:
                preemptions += out.metrics.num_preemptions
        assert engine.block_manager.num_used_blocks <= max_used_blocks
    return [results[i] for i in ids], preemptions


def byte_bpe_dir(path: Path, corpus: list[str], vocab_size: int) -> Path:
    """A byte-level BPE (every byte is a token, so any text can be written) trained on
    `corpus`, saved under `path` as a Hugging Face tokenizer directory with a ChatML template."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    bpe = HFTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(corpus, trainer)
    bpe.save(str(path / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path
