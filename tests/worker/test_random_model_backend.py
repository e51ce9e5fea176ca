"""The benchmark fixture model (`random:<preset>`) and the backend's FP8 options, on CPU: what
bench/endpoint/governed.py serves on the GPU, end to end through the worker's backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.worker.helpers import generate_greedy
from worker.backends.torch_runtime import TorchRuntimeBackend
from worker.loading import load_model
from worker.models.fp8 import Fp8Linear


def test_a_random_model_takes_every_id_of_its_tokenizer() -> None:
    model, tokenizer = load_model("random:tiny-qwen3_5", "cpu", torch.float32)
    assert model.config.vocab_size >= tokenizer.vocab_size  # widened from the preset's 512
    assert model.config.num_hidden_layers == 4  # the preset's shape otherwise
    ids = tokenizer.encode("river stone light")
    assert max(ids) >= 512  # ids a 512-token vocabulary could not embed
    with torch.no_grad():
        assert torch.isfinite(model.model.embed_tokens(torch.tensor(ids))).all()


@pytest.mark.parametrize("source", ["random:tiny-llama", "random:no-such-preset"])
def test_a_random_source_must_name_a_qwen_preset(source: str) -> None:
    with pytest.raises(ValueError, match="not a Qwen preset"):
        load_model(source, "cpu", torch.float32)


@pytest.mark.parametrize(("option", "value"), [("quantize", "int4"), ("kv_dtype", "fp16")])
def test_unknown_quantization_options_are_refused(option: str, value: str) -> None:
    with pytest.raises(ValueError, match=option):
        TorchRuntimeBackend(model_path="random:tiny-qwen3_5", **{option: value})  # type: ignore[arg-type]


async def test_fp8_weights_and_kv_serve_a_request_to_its_length() -> None:
    backend = TorchRuntimeBackend(
        model_path="random:tiny-qwen3_5", quantize="fp8", kv_dtype="fp8", max_model_len=128
    )
    await backend.start()
    try:
        llm = backend.engine.engine
        assert llm.runner.kv_dtype == torch.float8_e4m3fn
        assert any(isinstance(m, Fp8Linear) for m in llm.model.modules())
        progress = await generate_greedy(backend, "river stone light north", 6)
    finally:
        await backend.close()
    last = progress[-1]
    assert last.finish_reason in ("length", "stop")
    assert last.prompt_tokens == len(backend.tokenizer.encode("river stone light north"))
    assert 1 <= last.completion_tokens <= 6


@pytest.mark.slow
@pytest.mark.e2e
def test_the_governed_endpoint_bench_runs_end_to_end_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "endpoint.json"
    argv = [
        "--preset", "tiny-qwen3.5", "--device", "cpu", "--dtype", "float32", "--quantize", "fp8",
        "--kv-dtype", "fp8", "--requests", "4", "--concurrency", "2", "--prompt-tokens", "16",
        "--max-tokens", "8", "--rounds", "1", "--hang-up", "2", "--engine-rounds", "1",
        "--long-prompt-tokens", "600", "--out", str(out),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    subprocess.run(
        [sys.executable, "-m", "bench.endpoint.governed", *argv], check=True, timeout=600, env=env
    )
    report = json.loads(out.read_text())
    for mode in ("direct", "gateway"):
        assert report[mode]["errors"] == 0 and report[mode]["requests"] == 4
        assert report[mode]["completion_tokens"] > 0
        # The users start together: no client is built on the clock (an httpx client takes
        # 20-60 ms of the event loop, which spread a round's first wave apart).
        sent = sorted(r["sent_s"] for r in report["requests_by_round"][mode][0])
        assert sent[1] - sent[0] < 0.015, sent
    alone = report["engine_alone"]  # the worker's engine in the bench's process first
    assert alone["completion_tokens"] > 0 and alone["output_tokens_per_s"] > 0
    assert report["worker_vs_engine"] > 0
    long = report["long_prompt"]  # past the load point's context, through the gateway
    assert long["ok"] and not long["error"] and long["completion_tokens"] > 0
    assert long["prompt_tokens"] >= 500 and long["match_rate_pct"] == 100.0
    recon = report["reconciliation"]
    assert recon["client_hung_up"] == 2 and recon["match_rate_pct"] == 100.0
    assert recon["billed_completion_tokens"] == recon["delivered_completion_tokens"]
