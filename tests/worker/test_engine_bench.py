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
