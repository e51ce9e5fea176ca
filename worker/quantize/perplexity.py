"""Perplexity of our CausalLM models over a token sequence, and the fixed texts the quantizer
calibrates and is judged on, built from the Python standard library's docstrings (every install
has them, nothing is downloaded).

The models run through a paged cache; full-sequence logits come from prefill-only batches: each
window of the text is a fresh sequence (position 0, zero DeltaNet state) fed whole in one step,
and the final hidden state of every token, not just the last, goes through the head.
"""

from __future__ import annotations

import ast
import inspect
import math
import re
import sysconfig
import zlib
from collections.abc import Iterator, Sequence
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from worker.engine.batch import BatchMetadata
from worker.models.cache import ModelCache
from worker.models.causal_lm import CausalLM

BLOCK_SIZE = 16


def prefill_batch(
    model: CausalLM, sequences: Sequence[Sequence[int]], block_size: int = BLOCK_SIZE
) -> tuple[torch.Tensor, BatchMetadata, ModelCache]:
    """(flat input ids [T], metadata, a cache just large enough) for one step that prefills every
    sequence from position 0: sequence i takes state slot i and its own run of KV blocks."""
    device = model.device
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu = [0]
    tables: list[list[int]] = []
    next_block = 0
    for seq in sequences:
        n = len(seq)
        if n == 0:
            raise ValueError("cannot prefill an empty sequence")
        blocks = list(range(next_block, next_block + -(-n // block_size)))
        next_block += len(blocks)
        ids += seq
        positions += range(n)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(n)]
        cu.append(cu[-1] + n)
        tables.append(blocks)
    width = max(len(t) for t in tables)
    b = len(sequences)
    meta = BatchMetadata(
        seq_ids=list(range(b)),
        num_prefills=b,
        query_lens=[len(s) for s in sequences],
        context_lens=torch.tensor([len(s) for s in sequences], dtype=torch.int32, device=device),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
        ),
        state_slots=torch.arange(b, dtype=torch.int64, device=device),
        has_initial_state=torch.zeros(b, dtype=torch.bool, device=device),
        logits_indices=torch.tensor(cu[1:], dtype=torch.int64, device=device) - 1,
    )
    cache_ = model.allocate_cache(next_block, block_size, b, model.dtype, device)
    return torch.tensor(ids, dtype=torch.int64, device=device), meta, cache_


def windows(token_ids: Sequence[int], window: int) -> list[list[int]]:
    """Consecutive non-overlapping windows of `window` tokens; a last piece shorter than two
    tokens predicts nothing and is dropped."""
    out = [list(token_ids[i : i + window]) for i in range(0, len(token_ids), window)]
    return [w for w in out if len(w) >= 2]


def batches(items: list[list[int]], max_tokens: int) -> Iterator[list[list[int]]]:
    """Groups of windows with at most `max_tokens` tokens each (at least one window)."""
    group: list[list[int]] = []
    for item in items:
        if group and sum(map(len, group)) + len(item) > max_tokens:
            yield group
            group = []
        group.append(item)
    if group:
        yield group


@torch.no_grad()
def negative_log_likelihood(
    model: CausalLM, token_ids: Sequence[int], window: int = 512, batch_tokens: int = 4096
) -> tuple[float, int]:
    """(sum of -log p(token | the tokens before it in its window), tokens predicted): each window
    is scored on all of its tokens but the first."""
    total, count = 0.0, 0
    for group in batches(windows(token_ids, window), batch_tokens):
        ids, meta, cache_ = prefill_batch(model, group)
        hidden = model(ids, meta, cache_)
        for i, seq in enumerate(group):
            start = int(meta.cu_seqlens[i])
            # one window's logits at a time: [window, vocab] fp32 is the big temporary
            logits = model.compute_logits(hidden[start : start + len(seq) - 1])
            targets = ids[start + 1 : start + len(seq)]
            total += float(F.cross_entropy(logits, targets, reduction="sum"))
            count += len(seq) - 1
    return total, count


def perplexity(
    model: CausalLM, token_ids: Sequence[int], window: int = 512, batch_tokens: int = 4096
) -> float:
    """exp(mean negative log-likelihood) over `token_ids`, cut into independent windows of
    `window` tokens (so every model sees the same contexts, whatever its cache)."""
    total, count = negative_log_likelihood(model, token_ids, window, batch_tokens)
    if count == 0:
        raise ValueError("perplexity needs at least two tokens")
    return math.exp(total / count)


# Fixed texts ---------------------------------------------------------------------------------

# Parts of the standard library that some installs leave out (Debian splits tkinter, the test
# suite, idle, ensurepip, distutils into other packages) or that are not the library at all.
_EXCLUDED = {
    "test",
    "tests",
    "idlelib",
    "tkinter",
    "turtledemo",
    "lib2to3",
    "distutils",
    "ensurepip",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "__phello__",
}
_EXCLUDED_FILES = {"turtle.py", "this.py", "antigravity.py"}
# One source file in this many holds out: a split by file, so no module's docstrings land on
# both sides.
_HELD_OUT_EVERY = 4


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if set(rel.parts[:-1]) & _EXCLUDED or rel.name in _EXCLUDED_FILES:
            continue
        if rel.parts[0].startswith("config-"):
            continue
        files.append(rel)
    return [root / rel for rel in sorted(files, key=lambda p: p.as_posix())]


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, OSError):
        return []
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, _DOC_NODES))]
    out = []
    for node in nodes:
        doc = ast.get_docstring(node, clean=False)
        if doc and len(doc) >= 40:  # one-liners ("Return self.") are mostly noise
            out.append(inspect.cleandoc(doc))
    return out


_DOC_NODES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


@cache
def _split_texts() -> tuple[str, str]:
    """(held-out text, calibration text): the stdlib's docstrings in sorted file order, split
    by file, each distinct paragraph once (modules copy paragraphs from one another, and a
    paragraph on both sides would be calibrated on and then judged)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    held: list[str] = []
    calib: list[str] = []
    seen: set[str] = set()
    for path in _stdlib_files():
        key = zlib.crc32(path.relative_to(root).as_posix().encode())
        side = held if key % _HELD_OUT_EVERY == 0 else calib
        for doc in _docstrings(path):
            for paragraph in _PARAGRAPH_BREAK.split(doc):
                paragraph = paragraph.strip()
                if paragraph and paragraph not in seen:
                    seen.add(paragraph)
                    side.append(paragraph)
    return "\n\n".join(held), "\n\n".join(calib)


_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")


def held_out_text(max_chars: int | None = 200_000) -> str:
    """A fixed text for judging models (the same on every run of one Python version): docstrings
    of a quarter of the standard library's source files, never used for calibration."""
    text = _split_texts()[0]
    return text if max_chars is None else text[:max_chars]


def calibration_text(max_chars: int | None = None) -> str:
    """A fixed calibration text: docstrings of the other three quarters of the standard
    library's files (disjoint from `held_out_text`)."""
    text = _split_texts()[1]
    return text if max_chars is None else text[:max_chars]
