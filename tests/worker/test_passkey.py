"""The staged-KV quality gate (bench/quality/passkey.py): passkey prompts, the chunked prefill-only
scorer through the engine's runner and block manager, and the gate itself. The default suite
runs it on a tiny random Llama with a character tokenizer; the real gate (SmolLM2-135M-Instruct
at 2K / 4K / 8K) is slow."""

from __future__ import annotations

import math
import os

import pytest
import torch

from bench.quality import passkey as pk
from worker.engine.engine import EngineConfig, LLMEngine
from worker.models import build_random, presets
from worker.quantize.perplexity import negative_log_likelihood

pytestmark = pytest.mark.usefixtures("one_thread")


class CharTokenizer:
    """One id per character (ids < 128): enough for prompts a tiny model can read."""

    eos_token_id = 0

    def encode(self, text: str) -> list[int]:
        return [min(ord(c), 127) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


@pytest.fixture(scope="module")
def tiny():
    return build_random(presets.TINY_LLAMA, "cpu", torch.float32, seed=2)


def test_prompts_have_the_length_and_the_needle_at_its_depth():
    tok = CharTokenizer()
    items = pk.trials(tok, [600, 900], 4, seed=3)
    assert [t.length for t in items] == [600] * 4 + [900] * 4
    assert len({t.key for t in items}) == 8
    for t in items:
        assert len(t.prompt) == t.length
        text = tok.decode(t.prompt)
        assert text.startswith(pk.INTRO) and text.endswith(pk.QUESTION)
        assert text.count(t.key) == 2
        filler = t.length - len(pk.INTRO) - len(pk.NEEDLE.format(key=t.key)) - len(pk.QUESTION)
        at = text.index(pk.NEEDLE.format(key=t.key)) - len(pk.INTRO)
        assert abs(at - t.depth * filler) <= 1
    assert [round(t.depth, 3) for t in items[:4]] == [0.125, 0.375, 0.625, 0.875]
    with pytest.raises(ValueError, match="no room"):
        pk.build_prompt(tok, 50, 0.5, "12345")


def test_an_answer_counts_only_as_the_exact_number():
    tok = CharTokenizer()
    assert pk.answered(tok, tok.encode(" 48213. Yes"), "48213")
    assert not pk.answered(tok, tok.encode(" 482134"), "48213")
    assert not pk.answered(tok, tok.encode(" 4821"), "48213")
    assert not pk.answered(tok, tok.encode(" none"), "48213")


def test_staged_mode_names_carry_the_engine_setting():
    assert pk.mode_overrides("staged-k4v3+k4v4@7,8-w16")["kv_staging"] == "k4v3+k4v4@7,8"
    assert pk.mode_overrides("staged-k4v3+k4v4@7,8-w16")["kv_staging_window_pages"] == 16
    assert pk.mode_overrides("staged-k3v4-a2") == {
        "kv_dtype": pk.FP8,
        "kv_staging": "k3v4",
        "kv_staging_anchor_pages": 2,
    }
    with pytest.raises(ValueError, match="unknown KV mode"):
        pk.mode_overrides("staged-k4v3+k4v4")


def test_chunked_scoring_equals_one_window_prefill_and_staging_moves_it(tiny):
    ids = [(i * 37 + 11) % 500 + 1 for i in range(400)]
    cfg = pk.engine_config(len(ids), 64, kv_staging_window_pages=2)
    plain = LLMEngine(tiny, None, cfg)
    total, count = pk.chunked_nll(plain, ids, 64)
    want, want_count = negative_log_likelihood(tiny, ids, window=len(ids))
    assert count == want_count == len(ids) - 1
    assert math.isclose(total, want, rel_tol=1e-4)
    assert plain.block_manager.num_free_blocks == plain.block_manager.num_blocks  # freed

    whole = pk.engine_config(len(ids), 64, kv_staging="k4v3", kv_staging_window_pages=200)
    staged_whole, _ = pk.chunked_nll(LLMEngine(tiny, None, whole), ids, 64)
    assert math.isclose(staged_whole, total, rel_tol=1e-6)  # nothing compressed: same pages

    staged_engine = LLMEngine(tiny, None, pk.engine_config(len(ids), 64, kv_staging="k1v1"))
    coarse, _ = pk.chunked_nll(staged_engine, ids, 64)
    assert staged_engine.runner.restaged_pages > 0
    # the compressed pages are what it read (a random model's NLL moves by ~1e-4 only)
    assert abs(coarse - total) > max(1e-6 * total, 10 * abs(staged_whole - total))
    bm = staged_engine.block_manager
    assert bm.num_free_compressed_blocks == bm.num_compressed_blocks


def test_gate_runs_every_mode_and_applies_its_rules(tiny):
    result = pk.gate(tiny, CharTokenizer(), [400], 2, ppl_tokens=300, chunk=128)
    assert set(result["passkey"]) == {"16-bit", "fp8", "staged"}
    assert set(result["checks"]) == {"passkey@400", "perplexity"}
    ppl = result["perplexity"]
    assert ppl["fp8"] > 1 and ppl["staged"] > 1
    # a random model's perplexity barely moves with its KV; the rule is +1% against FP8
    assert result["checks"]["perplexity"] == (ppl["staged"] <= ppl["fp8"] * 1.01)
    assert "passkey @ 400" in pk.table(result)


# ---------------------------------------------------------------- the real gate (slow)


def sizes() -> tuple[list[int], int, int]:
    """Lengths, trials per length and perplexity tokens of the slow gate: by default what a
    2-core CPU runs in minutes (a 2K trial ~1 min per KV mode, 8K ~4-8x that); the full gate
    is `python -m bench.quality.passkey` (or TOKENMILL_PASSKEY_TRIALS=20)."""
    lengths = [int(x) for x in os.environ.get("TOKENMILL_PASSKEY_LENGTHS", "2048").split(",")]
    trials = int(os.environ.get("TOKENMILL_PASSKEY_TRIALS", "4"))
    ppl = int(os.environ.get("TOKENMILL_PASSKEY_PPL_TOKENS", "2048"))
    return lengths, trials, ppl


@pytest.mark.slow
def test_smollm2_staged_kv_passes_the_quality_gate():
    model, tokenizer = pk.load_smollm2()
    lengths, trials, ppl_tokens = sizes()
    result = pk.gate(model, tokenizer, lengths, trials, ppl_tokens)
    print(pk.table(result))
    assert result["checks"] and result["ok"], pk.table(result)
    # the model does retrieve at these lengths with 16-bit KV: the gate is not vacuous
    assert sum(result["passkey"]["16-bit"]["correct"].values()) >= len(lengths) * trials // 2


def test_the_kv_pool_is_sized_as_on_a_cpu_whatever_the_device(tiny):
    """Explicit block counts equal to what a CPU engine sizes by itself, so a GPU run reads the
    same pages instead of a pool sized from the GPU's free memory."""
    for mode in ("fp8", "staged"):
        cfg = pk.engine_config(1000, 128, 4, **pk.MODES[mode])
        assert cfg.num_kv_blocks is not None
        auto = EngineConfig(**{**vars(cfg), "num_kv_blocks": None})
        got = LLMEngine(tiny, None, cfg).block_manager
        want = LLMEngine(tiny, None, auto).block_manager
        assert (got.num_blocks, got.num_compressed_blocks) == (
            want.num_blocks,
            want.num_compressed_blocks,
        )
        assert got.num_blocks + got.num_compressed_blocks == cfg.num_kv_blocks
        if mode == "staged":
            assert got.num_compressed_blocks == -(-4 * 1000 // 16)  # whole sequences


def test_the_model_is_rebuilt_from_its_pieces_or_refused(tmp_path, monkeypatch):
    import hashlib

    data = os.urandom(3000)
    parts = []
    for i, piece in enumerate((data[:1000], data[1000:])):
        parts.append(tmp_path / f"m.part{i}")
        parts[-1].write_bytes(piece)
    monkeypatch.setattr(pk, "SMOLLM2_SHA256", hashlib.sha256(data).hexdigest())
    joined = pk.join_parts(parts, tmp_path / "out" / "m.gguf")
    assert joined.read_bytes() == data
    with pytest.raises(SystemExit, match="sha256"):
        pk.join_parts(parts[::-1], tmp_path / "m2.gguf")  # wrong order: another file
    with pytest.raises(SystemExit, match="missing"):
        pk.join_parts([tmp_path / "absent", parts[1]], tmp_path / "m3.gguf")
