"""Incremental detokenization that never emits half a character or half a stop string.

Works with any tokenizer that has `decode(ids) -> str`. Each new token is decoded together with
a few tokens before it, and the new text is the difference; this keeps the spaces and byte
merges that depend on neighbours right. Text is held back while

- the decode ends in U+FFFD (a multi-byte UTF-8 character split across tokens), or
- its end could be the start of a stop string.

A complete stop string ends the text just before it.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Decoder,
        stop: list[str] | None = None,
        prompt_token_ids: list[int] | None = None,
        context_tokens: int = 4,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self._max_stop = max((len(s) for s in self.stop), default=0)
        context = list(prompt_token_ids or [])[-context_tokens:]
        if context and tokenizer.decode(context).endswith(REPLACEMENT):
            context = []  # the prompt ends mid-character: no clean text to diff against
        self._ids = context
        self._prefix_offset = 0  # _ids[prefix:read] decodes to text already taken
        self._read_offset = len(context)
        self._text = ""  # all text decoded so far (emitted and held back)
        self._emitted = 0  # characters of _text handed out
        self.stopped = False  # a stop string matched

    @property
    def text(self) -> str:
        """The text handed out so far."""
        return self._text[: self._emitted]

    def add(self, token_ids: list[int]) -> str:
        """Feed new output tokens; returns the text that became safe to show."""
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        new_text = self._decode_new()
        if not new_text or new_text.endswith(REPLACEMENT):
            return ""  # nothing new yet, or an unfinished character
        self._text += new_text
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._release()

    def flush(self) -> str:
        """At the end of the sequence: hand out whatever was held back."""
        if self.stopped:
            return ""
        if self._read_offset < len(self._ids):  # an unfinished character: shown as U+FFFD
            self._text += self._decode_new()
            self._prefix_offset = self._read_offset = len(self._ids)
        return self._release(final=True)

    def _decode_new(self) -> str:
        prefix_text = self.tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self.tokenizer.decode(self._ids[self._prefix_offset :])
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""

    def _release(self, final: bool = False) -> str:
        if self.stop:
            search_from = self._emitted  # held-back text covers any partial match
            hits = [i for s in self.stop if (i := self._text.find(s, search_from)) >= 0]
            if hits:
                self._text = self._text[: min(hits)]
                self.stopped = True
                return self._take(len(self._text))
        held = 0 if final else self._partial_stop_len()
        return self._take(len(self._text) - held)

    def _partial_stop_len(self) -> int:
        """Length of the longest end of the text that starts some stop string."""
        pending = len(self._text) - self._emitted
        for k in range(min(self._max_stop - 1, pending), 0, -1):
            tail = self._text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def _take(self, upto: int) -> str:
        out = self._text[self._emitted : upto]
        self._emitted = max(self._emitted, upto)
        return out
