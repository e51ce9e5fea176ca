"""A `tokenizers` byte-level BPE rebuilt from GGUF metadata (tokens, merges, token types,
pre-tokenizer name), with the special tokens, BOS/EOS and the chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# Pre-tokenizer regexes by llama.cpp's `tokenizer.ggml.pre` name.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTROL, _USER_DEFINED = 3, 4  # gguf TokenType values of special tokens


def _pre_tokenizer(name: str) -> Any:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if name == "smollm":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if name in ("llama-bpe", "llama3"):
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), "isolated"), byte_level]
        )
    if name in ("qwen2", "qwen35"):
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_QWEN2_PATTERN), "isolated"), byte_level]
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2


def tokenizer_from_gguf(path: str | Path) -> tuple[HFTokenizer, str | None, str | None, str | None]:
    """(tokenizer, eos token, bos token, chat template) of a GGUF file."""
    reader = GGUFReader(str(path))

    def get(key: str) -> Any:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    if get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(
            f"GGUF tokenizer {get('tokenizer.ggml.model')!r} is not supported (gpt2 BPE only)"
        )
    tokens: list[str] = get("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges")]
    types: list[int] = get("tokenizer.ggml.token_type") or [1] * len(tokens)
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    tokenizer = HFTokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(get("tokenizer.ggml.pre") or "")
    tokenizer.decoder = decoders.ByteLevel()
    specials = [
        t for t, kind in zip(tokens, types, strict=True) if kind in (_CONTROL, _USER_DEFINED)
    ]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])

    def token(key: str) -> str | None:
        index = get(key)
        return None if index is None else tokens[index]

    bos = token("tokenizer.ggml.bos_token_id") if get("tokenizer.ggml.add_bos_token") else None
    return tokenizer, token("tokenizer.ggml.eos_token_id"), bos, get("tokenizer.chat_template")
