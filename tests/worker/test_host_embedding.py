"""Token embeddings from a table in pinned host memory (`HostEmbedding`, `ops.embedding`).

On CPU the gather kernel runs under the triton interpreter against the reference, and the
refusals are checked; with `-m gpu` the table moves to pinned host memory and the model's greedy
tokens and logits must equal those of the table on the GPU, eagerly and in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from tests.worker.model_driver import ModelDriver
from tests.worker.triton_env import GPU, needs_cuda
from worker.kernels import ops, reference
from worker.kernels.triton.embedding import embedding
from worker.models import build_random
from worker.models.layers import HostEmbedding
from worker.models.presets import TINY_LLAMA, TINY_QWEN3_5


@pytest.mark.parametrize("hidden", [96, 2048 + 40])  # one column block, and a ragged second
def test_gather_kernel_matches_the_reference(hidden: int) -> None:
    table = torch.randn(50, hidden).bfloat16()
    ids = torch.tensor([3, 0, 49, 3, 17])
    out = embedding(ids, table)
    assert torch.equal(out, reference.embedding(ids, table))
    assert embedding(ids[:0], table).shape == (0, hidden)


def test_registry_runs_the_kernel_on_cuda_only() -> None:
    names = [impl.name for impl in ops.implementations("embedding")]
    assert names == ["triton.embedding", "reference"]
    assert ops.select("embedding", torch.device("cpu"), torch.bfloat16).name == "reference"
    assert ops.select("embedding", torch.device("cuda"), torch.bfloat16).name == names[0]


def test_a_tied_head_or_a_cpu_model_keeps_its_table() -> None:
    tied = build_random(TINY_LLAMA, "cpu", torch.float32)
    with pytest.raises(ValueError, match="tied"):
        tied.embeddings_to_host()
    untied = build_random(TINY_QWEN3_5, "cpu", torch.float32)
    with pytest.raises(ValueError, match="not a GPU"):
        untied.embeddings_to_host()
    assert isinstance(untied.model.embed_tokens, torch.nn.Embedding)


@GPU
@needs_cuda
def test_gpu_host_table_serves_the_same_tokens() -> None:
    on_gpu = build_random(TINY_QWEN3_5, "cuda", torch.bfloat16, seed=3)
    on_host = build_random(TINY_QWEN3_5, "cuda", torch.bfloat16, seed=3)
    before = torch.cuda.memory_allocated()
    on_host.embeddings_to_host()
    table = on_host.model.embed_tokens.weight
    assert isinstance(on_host.model.embed_tokens, HostEmbedding)
    assert table.device.type == "cpu" and table.is_pinned()
    assert torch.cuda.memory_allocated() <= before - table.numel() * table.element_size()
    assert on_host.device.type == "cuda"
    prompt = [5, 9, 200, 3, 77, 1, 42]
    want = ModelDriver(on_gpu, num_blocks=24, block_size=16).generate(prompt, 24)
    got = ModelDriver(on_host, num_blocks=24, block_size=16).generate(prompt, 24)
    assert got.generated == want.generated
    for position, logits in want.logits.items():
        assert torch.equal(got.logits[position], logits)


@GPU
@needs_cuda
def test_gpu_host_table_inside_a_cuda_graph() -> None:
    table = torch.randn(1000, 5120, dtype=torch.bfloat16, device="cuda")
    module = HostEmbedding(table)
    ids = torch.zeros(8, dtype=torch.int64, device="cuda")
    module(ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = module(ids)
    for draw in range(3):
        ids.copy_(torch.randint(0, 1000, (8,), generator=torch.Generator().manual_seed(draw)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, table[ids])


def test_auto_keeps_the_table_on_a_cpu_and_for_16_bit_weights() -> None:
    from worker.models.causal_lm import place_embeddings

    model = build_random(TINY_QWEN3_5, "cpu", torch.float32)
    assert place_embeddings(model, "auto", "w4") == "device"  # not a GPU
    assert place_embeddings(model, "device", "w4") == "device"
    with pytest.raises(ValueError, match="embeddings='gpu'"):
        place_embeddings(model, "gpu", None)


@GPU
@needs_cuda
def test_gpu_auto_puts_int4_models_tables_on_the_host() -> None:
    from worker.models.causal_lm import place_embeddings

    model = build_random(TINY_QWEN3_5, "cuda", torch.bfloat16)
    assert place_embeddings(model, "auto", None) == "device"
    assert place_embeddings(model, "auto", "w4") == "host"
    assert isinstance(model.model.embed_tokens, HostEmbedding)
    tied = build_random(TINY_LLAMA, "cuda", torch.bfloat16)
    assert place_embeddings(tied, "auto", "w4") == "device"


def test_the_backend_option_is_checked() -> None:
    from worker.backends.torch_runtime import TorchRuntimeBackend

    assert TorchRuntimeBackend("random:tiny-qwen3.5", embeddings="host").embeddings == "host"
    with pytest.raises(ValueError, match="embeddings='gpu'"):
        TorchRuntimeBackend("random:tiny-qwen3.5", embeddings="gpu")
