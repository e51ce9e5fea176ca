"""The engine bench runs end to end on CPU with tiny settings and reports sane numbers."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("worker.models.presets")
from bench.engine.load_point import main, percentile  # noqa: E402


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("preset", "kv_bytes", "state_bytes"),
    [
        # 1 attention layer x K and V x 2 heads x 32 x fp32
        ("tiny-qwen3_5", 1 * 2 * 2 * 32 * 4, 3 * (4 * 32 * 32 * 4 + (2 * 64 + 128) * 3 * 4)),
        ("tiny-llama", 4 * 2 * 2 * 32 * 4, 0),
    ],
)
def test_tiny_bench_reports_the_load_point(
    tmp_path, capsys, one_thread, preset, kv_bytes, state_bytes
):
    out = tmp_path / "bench.json"
    argv = [
        "--preset", preset, "--device", "cpu", "--num-requests", "6", "--concurrency", "3",
        "--prompt-len", "40", "--max-tokens", "5", "--repeats", "2", "--threads", "1",
        "--max-num-batched-tokens", "64", "--out", str(out),
    ]  # fmt: skip
    main(argv)
    report = json.loads(out.read_text())
    assert report["completion_tokens"] == 6 * 5 * 2  # ignore_eos: every request runs to max_tokens
    assert len(report["output_tok_s_repeats"]) == 2
    assert report["output_tok_s"] > 0
    assert 0 < report["ttft_p50_s"] <= report["ttft_p95_s"]
    assert report["ttft_p50_s"] <= report["e2e_p50_s"] <= report["e2e_p95_s"]
    assert report["kv_bytes_per_token"] == kv_bytes
    assert report["deltanet_state_bytes_per_sequence"] == state_bytes
    assert report["weights_bytes"] > 0
    table = capsys.readouterr().out
    assert "output tok/s" in table and "TTFT p50 / p95" in table


def test_percentile_interpolates():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 95) == 5.0
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)


@pytest.mark.slow
def test_structured_section_constrains_every_token_in_every_round(tmp_path, one_thread):
    """The suite's structured section on CPU (tiny Qwen3.5 widened to the Qwen3.6 vocabulary):
    each mode serves the same token counts and every json_schema token is sampled under a
    mask, none refused, no document done early (15-60 s on 2 cores)."""
    pytest.importorskip("xgrammar")
    from bench.engine import suite

    torch.set_num_threads(1)
    argv = [
        "--sections", "structured", "--preset", "tiny-qwen3_5", "--device", "cpu",
        "--num-requests", "2", "--concurrency", "2", "--prompt-len", "16", "--max-tokens", "6",
        "--repeats", "1", "--out", str(tmp_path),
    ]  # fmt: skip
    r = suite.main(argv)["sections"]["structured"]
    assert "error" not in r, r.get("error")
    assert r["repeats"] == 1
    for mode in ("free", "free_sync", "json_schema", "json_schema_sync"):
        assert r["modes"][mode]["completion_tokens"] == 2 * 6, mode
        assert r["modes"][mode]["output_tok_s"] > 0
    for mode in ("json_schema", "json_schema_sync"):
        j = r["modes"][mode]
        assert (j["requests"], j["constrained_tokens"], j["constrained_fraction"]) == (2, 12, 1.0)
        assert j["rejected_tokens"] == 0 and j["documents_completed"] == 0
        assert j["fill_us_per_token_p50"] > 0 and j["fill_ms_per_step_mean"] > 0
    j = r["modes"]["json_schema"]
    assert r["sample_reply"].startswith('{"export_id')
    assert r["ratio_json_vs_free"] == pytest.approx(
        j["output_tok_s"] / r["modes"]["free"]["output_tok_s"]
    )


def test_the_suites_fp8_section_counts_compiles_and_slow_steps_of_its_timed_rounds(
    tmp_path, one_thread
):
    """The load-point section reports what the no-stall target reads: kernel compiles and steps
    over 250 ms in its timed rounds (none on CPU, whose kernels are interpreted)."""
    from bench.engine import suite

    argv = [
        "--sections", "fp8", "--preset", "tiny-qwen3_5", "--device", "cpu", "--num-requests", "2",
        "--concurrency", "2", "--prompt-len", "16", "--max-tokens", "6", "--repeats", "1",
        "--out", str(tmp_path),
    ]  # fmt: skip
    r = suite.main(argv)["sections"]["fp8"]
    assert "error" not in r, r.get("error")
    assert r["compiles_after_warm_up"] == 0
    assert r["steps_over_250ms"] == []


def test_slow_steps_are_recorded_with_their_batch_and_the_engine_is_given_back():
    from bench.engine.profiler import SlowSteps
    from tests.worker.engine_fakes import FakeCausalLM
    from worker.engine.engine import EngineConfig, LLMEngine
    from worker.engine.sequence import SamplingParams

    engine = LLMEngine(FakeCausalLM(), None, EngineConfig(max_num_seqs=2, max_model_len=64))
    every = SlowSteps(engine, limit_s=0.0)
    engine.add_request([1] * 9, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.add_request([2] * 5, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    found = every.close()
    assert found[0] == {"s": found[0]["s"], "prefill_chunks": 2, "prefill_tokens": 14, "decodes": 0}
    assert any(f["decodes"] == 2 and f["prefill_chunks"] == 0 for f in found)
    assert engine.step.__func__ is LLMEngine.step  # unwrapped
    none = SlowSteps(engine, limit_s=60.0)
    engine.add_request([3] * 4, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert none.close() == []
