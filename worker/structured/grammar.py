"""Grammar-constrained decoding: OpenAI `response_format` (json_object, json_schema) and forced
tool calls, as token masks applied to the logits before sampling.

The library is xgrammar (over llguidance and outlines-core), chosen by measurement and reach:

- speed: on the SmolLM2 vocabulary (49,152 tokens) a nested schema's mask takes 30 us at the
  median per sequence against llguidance's 190 us, on Qwen3.6's (248,077) 47 against 191 us
  (`bench/engine/structured_masks.py`; xgrammar precomputes the context-independent tokens of every
  grammar position when it compiles, llguidance computes each mask lazily). Its compile costs
  more (36 ms / 260 ms for that schema), which the per-schema cache below pays once.
- CPU and GPU: masks are filled on the host either way; applying them has a CUDA kernel, a
  Triton one and a CPU one behind one call (`apply_token_bitmask_inplace`), so the sampler
  has no device-specific code. outlines-core gives an index and leaves masking to the caller.
- forced tool calls: its structural tags express "one or more `<tool_call>` spans, each a
  JSON object naming one of the tools with arguments matching its parameter schema" directly.
- wheels for CPython 3.11 and 3.12 on Linux x86-64 and aarch64 (and macOS), as do the other
  two; it is what vLLM and SGLang default to, so models' JSON quirks are met there first.

The cost: it depends on torch (here already) and transformers (only for tokenizers we do not
use it for: `tokenizer_info` builds the vocabulary from our own tokenizer).

Overlap: a sequence's next mask depends only on the tokens it has accepted. In overlapped
decode the engine launches a step's forward, then reads the previous step's tokens, has the
grammars accept them and fills their masks (`GrammarState.next_mask`, on the engine's thread,
`TOKENMILL_GRAMMAR_FILL=lazy`, the default) while that forward runs; a synchronous step's
sampler fills them likewise after its forward is launched. `thread` fills in a background
thread after each token instead: it measured no better on one H200 (its fills wait for the GIL,
which a thread gets back only at Python's switch interval while the engine's thread runs
Python). On one H200 json_schema decoding runs at 0.996 of unconstrained at the load point
(docs/performance.md, "Structured output at the load point").
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from worker.engine.batch import index_on

if TYPE_CHECKING:
    import xgrammar

GrammarKind = Literal["json_object", "json_schema", "tool_calls"]

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# JSON as OpenAI and Python's json.dumps write it: ", " and ": ", no newlines. Free whitespace
# lets a small model loop on spaces until max_tokens.
SEPARATORS = (", ", ": ")


class GrammarError(ValueError):
    """The format cannot be enforced (a schema the library cannot compile, invalid JSON):
    raised before any token, for the gateway to answer 400 naming `param`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True)
class GrammarSpec:
    """What a constrained sequence must produce. `source` is the JSON schema text (json_schema)
    or the structural tag text (tool_calls); `param` is the request field blamed on error."""

    kind: GrammarKind
    source: str = ""
    strict: bool = False
    param: str = "response_format"

    @property
    def key(self) -> str:
        text = f"{self.kind}\0{int(self.strict)}\0{self.source}"
        return hashlib.sha256(text.encode()).hexdigest()


def response_format_grammar(
    type: str, schema: str | None = None, strict: bool = False
) -> GrammarSpec | None:
    """The grammar of an OpenAI response_format; None for plain text."""
    if type == "text":
        return None
    if type == "json_object":
        return GrammarSpec("json_object")
    if type != "json_schema":
        raise GrammarError(f"response_format type {type!r} is not supported", "response_format")
    if not schema:
        raise GrammarError("response_format json_schema needs a schema", "response_format")
    parsed = _json(schema, "response_format.json_schema.schema")
    if not isinstance(parsed, dict | bool):
        raise GrammarError(
            "response_format.json_schema.schema must be a JSON Schema object", "response_format"
        )
    return GrammarSpec("json_schema", schema, strict)


def tool_call_tag(name: str) -> str:
    """The text before a call's arguments: how the chat templates and the parser write it."""
    return f'{TOOL_CALL_START}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


def tool_calls_grammar(
    tools: list[tuple[str, str | None]], only: str | None = None, parallel: bool = True
) -> GrammarSpec:
    """A reply of tool calls only (tool_choice "required", or `only` for a named function):
    `<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>` spans joined by newlines,
    at least one, ARGS matching that tool's parameter schema (JSON text, None: an object).
    `parallel` False: exactly one call."""
    tags = []
    for name, parameters in tools:
        if only is not None and name != only:
            continue
        schema = _json(parameters, f"tools[{name}].parameters") if parameters else {}
        if not schema:  # a function without parameters takes none: `{}`
            schema = {"type": "object", "properties": {}, "additionalProperties": False}
        tags.append(
            {
                "type": "tag",
                "begin": tool_call_tag(name),
                "content": {"type": "json_schema", "json_schema": schema},
                "end": "}\n" + TOOL_CALL_END,
            }
        )
    if not tags:
        what = f"the function {only!r}" if only is not None else "any function"
        raise GrammarError(f"tool_choice names {what}, which is not in tools", "tool_choice")
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": "\n",
            "at_least_one": True,
            "stop_after_first": not parallel,
        },
    }
    return GrammarSpec("tool_calls", json.dumps(tag, ensure_ascii=False), True, "tools")


def _json(text: str | None, where: str) -> Any:
    try:
        return json.loads(text or "")
    except ValueError as exc:
        raise GrammarError(f"{where} is not valid JSON: {exc}", where.split(".")[0]) from None


# xgrammar's messages start with "[time] /path/file.cc:line: ": the client needs the rest.
_LOCATION = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")


def _library_message(exc: BaseException) -> str:
    return _LOCATION.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))


def tokenizer_info(tokenizer: Any, vocab_size: int) -> xgrammar.TokenizerInfo:
    """xgrammar's view of our tokenizer (`worker.tokenizer.Tokenizer`): every id's bytes, the
    stop tokens, and `vocab_size` = the width of the model's logits (padding ids never match).
    Special tokens other than the tool-call markers are never allowed inside a format."""
    import xgrammar as xgr

    backend = tokenizer.backend
    stop = sorted(tokenizer.eos_token_ids)
    keep = {TOOL_CALL_START, TOOL_CALL_END}
    qwen = getattr(backend, "qwen", None)
    if qwen is not None:  # tiktoken ranks: the bytes of each id are the vocabulary itself
        encoding = qwen._tokenizer
        raw: list[bytes] = [b""] * encoding.n_vocab
        for token, rank in encoding._mergeable_ranks.items():
            raw[rank] = token
        for text, rank in encoding._special_tokens.items():
            raw[rank] = text.encode() if text in keep else b""
        return xgr.TokenizerInfo(raw, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop)
    hf = backend.tokenizer  # tokenizers.Tokenizer
    n = hf.get_vocab_size(with_added_tokens=True)
    vocab = [hf.id_to_token(i) or "" for i in range(n)]
    for i, added in hf.get_added_tokens_decoder().items():
        if added.special and added.content not in keep and i < n:
            vocab[i] = ""  # empty: xgrammar never allows it
    try:
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(hf.to_str())
        vocab_type, prefix_space = meta["vocab_type"], meta["add_prefix_space"]
    except Exception:  # an unusual tokenizer.json: byte-level BPE is the common case
        vocab_type, prefix_space = xgr.VocabType.BYTE_LEVEL, False
    return xgr.TokenizerInfo(
        vocab,
        vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=stop,
        add_prefix_space=prefix_space,
    )


_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def fill_mode() -> str:
    """Where masks are filled (`TOKENMILL_GRAMMAR_FILL`): "lazy" (default) on the caller's
    thread when the sampler asks, or "thread" in a background thread right after a token."""
    mode = os.environ.get("TOKENMILL_GRAMMAR_FILL", "lazy").strip().lower() or "lazy"
    if mode not in ("lazy", "thread"):
        raise ValueError(f"TOKENMILL_GRAMMAR_FILL={mode!r}: expected lazy or thread")
    return mode


def mask_threads() -> int:
    """Background fill threads (`TOKENMILL_GRAMMAR_THREADS`, default 1; fill mode "thread").
    On one H200 4 threads did no better than 1 (0.71 against 0.72 of unconstrained decoding
    without overlap), each fill slower."""
    raw = os.environ.get("TOKENMILL_GRAMMAR_THREADS", "").strip()
    return max(1, int(raw)) if raw else 1


def _mask_executor() -> ThreadPoolExecutor:
    """The pool that fills sequences' next masks in the background (fill mode "thread")."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(mask_threads(), thread_name_prefix="grammar-mask")
        return _executor


class GrammarState:
    """One sequence's matcher and its next-token bitmask (int32 words, bit j of word w allows
    token 32 w + j), filled for each next token: when asked (`overlap`, fill mode "lazy"), in
    the background after the token is accepted ("thread"), or at once (`overlap=False`)."""

    def __init__(self, compiled: xgrammar.CompiledGrammar, words: int, overlap: bool = True):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.mask = torch.full((1, words), -1, dtype=torch.int32)
        self.overlap = overlap
        self.lazy = overlap and fill_mode() == "lazy"
        self.rejected: int | None = None  # a sampled token the grammar refused (a bug)
        self.fill_seconds = 0.0  # time spent filling masks (benchmarks)
        self.fills = 0
        self._pending: Future[None] | None = None
        self._stale = False  # lazy: the mask is for an earlier token
        self._prepare()

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def _fill(self) -> None:
        import time

        began = time.perf_counter()
        self.matcher.fill_next_token_bitmask(self.mask, 0)
        self.fill_seconds += time.perf_counter() - began
        self.fills += 1

    def _prepare(self) -> None:
        if self.terminated:
            return
        if self.lazy:
            self._stale = True
        elif self.overlap:
            self._pending = _mask_executor().submit(self._fill)
        else:
            self._fill()

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def next_mask(self) -> torch.Tensor:
        """[1, words]: the tokens allowed next (filled now if lazy, else waits for the fill)."""
        self._wait()
        if self._stale:
            self._stale = False
            if not self.terminated:
                self._fill()
        return self.mask

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; the next mask is filled when asked (lazy), started in the
        background (thread) or filled now (no overlap)."""
        self._wait()  # the matcher must not move while a fill reads it
        if self.terminated:
            return True  # tokens past the end (ignore_eos, stop strings) are not the grammar's
        if not self.matcher.accept_token(token_id):
            self.rejected = token_id
            return False
        self._prepare()
        return True


def apply_masks(
    logits: torch.Tensor,
    rows: list[int],
    masks: list[torch.Tensor],
    index: torch.Tensor | None = None,
) -> None:
    """Set to -inf, in place, the logits of `rows` that their mask (same order) forbids;
    `index`: `index_on(logits.device, rows)` when the caller has it. On a GPU the bitmask also
    travels from pinned memory, without waiting."""
    import xgrammar as xgr

    words = masks[0].shape[1]
    on_host = logits.device.type == "cpu"
    bitmask = torch.empty((logits.shape[0], words), dtype=torch.int32, pin_memory=not on_host)
    bitmask.fill_(-1)
    bitmask[rows] = torch.cat(masks)
    indices: Any = rows  # xgrammar's GPU kernels take a device tensor too (its hint says a list)
    if not on_host:
        bitmask = bitmask.to(logits.device, non_blocking=True)
        indices = index_on(logits.device, rows) if index is None else index
    width = min(logits.shape[1], words * 32)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=width, indices=indices)


class Grammars:
    """Compiles GrammarSpecs for one tokenizer and logits width, once per spec: compiled
    grammars are kept by spec hash (least recently used dropped past `cache_size`), shared by
    every sequence that asks for the same format. Thread-safe: the worker compiles in a thread
    before it hands a request to the engine, so a new schema never stalls the engine's steps."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, cache_size: int = 256, threads: int = 2
    ) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.cache_size, self.threads = cache_size, threads
        self._compiler: Any = None
        self._cache: OrderedDict[str, xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # cache misses (tests, metrics)

    @property
    def words(self) -> int:
        return (self.vocab_size + 31) // 32

    def _get_compiler(self) -> Any:
        if self._compiler is None:  # the vocabulary scan takes 0.1-1 s: only when first needed
            import xgrammar as xgr

            info = tokenizer_info(self.tokenizer, self.vocab_size)
            self._compiler = xgr.GrammarCompiler(
                info, max_threads=self.threads, cache_enabled=False
            )
        return self._compiler

    def compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            compiler = self._get_compiler()
        try:
            if spec.kind == "json_object":
                compiled = compiler.compile_json_schema(
                    '{"type": "object"}',
                    any_whitespace=False,
                    separators=SEPARATORS,
                    strict_mode=False,
                )
            elif spec.kind == "json_schema":
                compiled = compiler.compile_json_schema(
                    spec.source,
                    any_whitespace=False,
                    separators=SEPARATORS,
                    strict_mode=spec.strict,
                )
            else:
                compiled = compiler.compile_structural_tag(spec.source)
        except Exception as exc:  # the library names what it cannot do; keep its words
            what = "the JSON schema" if spec.kind == "json_schema" else "the tools' schemas"
            raise GrammarError(
                f"{what} cannot be enforced: {_library_message(exc)}", spec.param
            ) from None
        with self._lock:
            self.compiles += 1
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def state(self, spec: GrammarSpec, overlap: bool = True) -> GrammarState:
        return GrammarState(self.compile(spec), self.words, overlap)
