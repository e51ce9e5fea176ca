"""EngineConfig: what an engine is built with, each field documented beside what it tunes, and
the sizing rules that turn it into a KV pool and a context limit (plain Python: the
scheduler's and block manager's tests build engines from it on CPU). `EngineConfig.from_env`
reads the TOKENMILL_ENGINE_* variables with the helpers of tokenmill.settings."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.settings import env, env_bool, env_float, env_int


def _env_int(name: str) -> int | None:
    return env_int(name, 0) if env(name) is not None else None


def _env_float(name: str) -> float | None:
    return env_float(name, 0.0) if env(name) is not None else None


def _env_bool(name: str) -> bool | None:
    return env_bool(name) if env(name) is not None else None


_STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _env_dtype(name: str) -> torch.dtype | None:
    value = (env(name) or "").strip().lower()
    if not value:
        return None
    if value not in _STATE_DTYPES:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(_STATE_DTYPES)}")
    return _STATE_DTYPES[value]


GIB = 1 << 30
# The context limit of a model whose config does not give max_position_embeddings.
DEFAULT_MAX_MODEL_LEN = 4096


def kv_budget_bytes(free_bytes: int, fraction: float, state_bytes: int) -> int:
    """Bytes the KV pool may take on a GPU: `fraction` of the memory free at start-up (after
    the weights), less what the DeltaNet state slots take; the rest is left to activations,
    CUDA graphs and the allocator."""
    if not 0 < fraction <= 1:
        raise ValueError(f"gpu_memory_fraction={fraction}: expected a fraction in (0, 1]")
    return max(0, int(free_bytes * fraction) - state_bytes)


def check_kv_pool(
    num_blocks: int, block_size: int, max_model_len: int, bytes_per_token: int, source: str
) -> None:
    """Refuse a KV pool too small for one sequence of max_model_len, saying by how much."""
    if num_blocks * block_size >= max_model_len:
        return
    need = -(-max_model_len // block_size)
    sizes = ""
    if bytes_per_token:
        have = size_text(num_blocks * block_size * bytes_per_token)
        needs = size_text(need * block_size * bytes_per_token)
        sizes = f" ({have} at {bytes_per_token} bytes per token; it needs {needs})"
    raise ValueError(
        f"the KV pool ({source}) holds {num_blocks} blocks of {block_size} tokens = "
        f"{num_blocks * block_size} tokens{sizes}, so it cannot hold one sequence of "
        f"max_model_len={max_model_len} ({need} blocks): lower max_model_len "
        f"(TOKENMILL_ENGINE_MAX_MODEL_LEN) or give the KV pool more memory"
    )


def size_text(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.2f} MiB"


def context_limit(config: EngineConfig, model: Any) -> int:
    """max_model_len as configured, else the model's positions; never past the model's."""
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if config.max_model_len <= 0:
        return int(positions or DEFAULT_MAX_MODEL_LEN)
    if positions is not None and config.max_model_len > positions:
        raise ValueError(
            f"max_model_len={config.max_model_len} is past the model's "
            f"max_position_embeddings={positions}"
        )
    return config.max_model_len


# Tokens a step by default: the load point's 8 x 512 prompt tokens prefill in one step (vLLM's
# API server takes 8,192 on GPUs of 70 GiB and more). On one H200 a 4,096-token step takes
# ~0.23 s with FP8 weights and ~0.28 s with int4 (their blockwise W4A8 GEMM is ~30% slower
# than FP8's); halving it for int4 split each wave's prefill in two, so its sequences finished
# out of step and decoded at part batches: 14% fewer W4 tokens a second at the load point
# (857 against 999, docs/performance.md). An operator who wants shorter stalls lowers it.
DEFAULT_STEP_TOKENS = 4096


def step_token_budget(config: EngineConfig) -> int:
    """max_num_batched_tokens as configured, else DEFAULT_STEP_TOKENS."""
    if config.max_num_batched_tokens > 0:
        return config.max_num_batched_tokens
    return DEFAULT_STEP_TOKENS


_WIDTHS = r"k([1-4])v([1-4])"


def kv_staging_bits(setting: str | None) -> tuple[int, int] | None:
    """(K bits, V bits) of a kv_staging setting such as "k4v3" (its default widths when it
    names layers too, "k4v3+k4v4@3,7"); None when off ("", "off")."""
    value = (setting or "").strip().lower()
    if value in ("", "0", "off", "none", "false"):
        return None
    match = re.fullmatch(_WIDTHS, value.split("+")[0])
    if match is None:
        raise ValueError(f"kv_staging={setting!r}: expected k<bits>v<bits>, 1-4 bits, e.g. k4v3")
    kv_staging_layer_bits(setting)  # the layers' part is checked with the rest
    return int(match[1]), int(match[2])


def kv_staging_layer_bits(setting: str | None) -> dict[int, tuple[int, int]]:
    """Model layer index -> (K bits, V bits) for the layers a kv_staging setting gives widths of
    their own: "k4v3+k4v4@3,7" stages layers 3 and 7 at K4/V4, every other attention layer at
    K4/V3 (`python -m bench.quality.kv_widths` ranks the layers by what a wider V buys)."""
    parts = (setting or "").strip().lower().split("+")[1:]
    out: dict[int, tuple[int, int]] = {}
    for part in parts:
        match = re.fullmatch(_WIDTHS + r"@(\d+(?:,\d+)*)", part)
        if match is None:
            raise ValueError(
                f"kv_staging={setting!r}: expected k<bits>v<bits>+k<bits>v<bits>@<layer>,<layer>"
                ", e.g. k4v3+k4v4@3,7"
            )
        for layer in map(int, match[3].split(",")):
            if layer in out:
                raise ValueError(f"kv_staging={setting!r}: layer {layer} is given widths twice")
            out[layer] = (int(match[1]), int(match[2]))
    return out


class ContextLengthExceeded(ValueError):
    """A request that can never run: its prompt alone reaches the context limit."""

    code = "context_length_exceeded"

    def __init__(self, prompt_tokens: int, max_model_len: int) -> None:
        self.prompt_tokens, self.max_model_len = prompt_tokens, max_model_len
        super().__init__(
            f"the prompt has {prompt_tokens} tokens; this model serves at most {max_model_len} "
            f"tokens of prompt and output together, so a prompt may have {max_model_len - 1} "
            f"({prompt_tokens - max_model_len + 1} fewer)"
        )


@dataclass
class EngineConfig:
    """Engine sizing. Every field can be set from the environment (see `from_env`)."""

    block_size: int = 16  # tokens per KV block (TOKENMILL_ENGINE_BLOCK_SIZE)
    # KV cache size: a block count (TOKENMILL_ENGINE_NUM_KV_BLOCKS), else a byte budget
    # (TOKENMILL_ENGINE_KV_CACHE_BYTES), else on a GPU gpu_memory_fraction of the memory free
    # when the engine starts (weights loaded) less the DeltaNet state slots, else (CPU) room
    # for max_num_seqs full-length sequences. Sequences share the pool: a long context takes
    # what short ones leave, the scheduler preempts when it runs out.
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_fraction: float = 0.9  # TOKENMILL_ENGINE_GPU_MEMORY_FRACTION
    max_num_seqs: int = (
        8  # running sequences = DeltaNet state slots (TOKENMILL_ENGINE_MAX_NUM_SEQS)
    )
    # Tokens per step (TOKENMILL_ENGINE_MAX_NUM_BATCHED_TOKENS); 0: DEFAULT_STEP_TOKENS
    # (`step_token_budget`), resolved in place when the engine starts. A larger budget makes
    # longer prefill steps, which the running decodes wait on.
    max_num_batched_tokens: int = 0
    # prompt + output tokens (TOKENMILL_ENGINE_MAX_MODEL_LEN); 0: the model's
    # max_position_embeddings (262,144 for Qwen3.6), resolved in place when the engine starts.
    # An operator may lower it, never raise it past the model's positions.
    max_model_len: int = 0
    kv_dtype: torch.dtype | None = None  # default: the model's dtype
    # Staged KV (TOKENMILL_ENGINE_KV_STAGING=k4v3; default off): full-attention pages past a
    # sequence's first kv_staging_anchor_pages and last kv_staging_window_pages
    # (TOKENMILL_ENGINE_KV_STAGING_ANCHOR_PAGES / _WINDOW_PAGES) are re-encoded, a step after
    # their last write, from kv_dtype pages to TurboQuant codes of K and V bits ("k4v3": 4 and 3
    # bits per coordinate, 1-4 each; worker/kvcache/), ~2.2x fewer bytes per token than FP8 KV;
    # "k4v3+k4v4@3,7" gives model layers 3 and 7 widths of their own (kv_staging_layer_bits).
    # Off by default: on one H200 the Triton decode over mixed pages takes 1.9x FP8 KV's time
    # at 8 x 32K, and the load point runs at 0.955x FP8 KV's output tok/s (docs/performance.md).
    kv_staging: str | None = None
    kv_staging_window_pages: int = 8
    kv_staging_anchor_pages: int = 1
    # DeltaNet recurrent state in the slot pool (TOKENMILL_ENGINE_STATE_DTYPE=float32|bfloat16|
    # float16; default: the model's dtype, as vLLM's mamba_ssm_cache_dtype=auto). Kernels compute
    # in fp32 either way; a 16-bit pool halves the 2 x 3 MiB per layer and sequence a 27B decode
    # step moves (docs/perf-notes.md run 11). fp32 keeps every step's state exact.
    state_dtype: torch.dtype | None = None
    device: str | None = None  # default: where the model's parameters are
    eos_token_ids: list[int] | None = None  # default: from the tokenizer, else the model config
    # Decode-only steps as CUDA-graph replays on a GPU (TOKENMILL_ENGINE_CUDA_GRAPHS=0 turns off).
    cuda_graphs: bool = True
    # Decode-only steps through the padded static buffers even without graphs (default: with
    # graphs only); eager padded steps give the same tokens as unpadded ones (tested on CPU).
    pad_decode: bool | None = None
    # Sibling projections (q|k|v, DeltaNet qkv|z|b|a, gate|up) concatenated into one GEMM each
    # when the engine takes the model (TOKENMILL_ENGINE_FUSE_PROJECTIONS=0 turns off); the model's
    # parameter names then no longer match checkpoint names.
    fuse_projections: bool = True
    # Overlapped decode (TOKENMILL_ENGINE_OVERLAP_DECODE=0 turns off; default: on wherever decode
    # runs through the padded buffers): while the GPU runs greedy decode step N, the host reads
    # back, detokenizes and stop-checks step N-1 and schedules and launches step N+1, whose
    # input ids the GPU takes from step N's tokens. Stop rules apply one step late: a token
    # computed past a stop is discarded, never emitted nor counted.
    overlap_decode: bool | None = None
    # Constrained sequences (a grammar mask, temperature 0) in overlapped decode too
    # (TOKENMILL_ENGINE_OVERLAP_CONSTRAINED=0 turns off): the step's forward is launched first,
    # then the host reads step N-1's tokens, advances the grammars, fills their masks while the
    # forward runs and queues a masked argmax of their rows behind it. Off: they run in
    # synchronous steps, the GPU idle while the host samples and schedules.
    overlap_constrained: bool = True
    # Before serving, one step of each kernel specialization class (`LLMEngine.warm_up`), so
    # that kernels compile then, not under a user's request (TOKENMILL_ENGINE_WARM_UP; default:
    # on for a CUDA device, off elsewhere, where no kernel compiles). Its steps are short: no
    # context length is a class of its own.
    warm_up: bool | None = None
    # Prefill gathering (Scheduler): an idle engine holds new arrivals while they keep coming,
    # until a gap of prefill_gather_gap_s with none (TOKENMILL_ENGINE_PREFILL_GATHER_GAP_MS) and
    # at most prefill_gather_s (TOKENMILL_ENGINE_PREFILL_GATHER_MS), so that requests spread by
    # HTTP are prefilled together. 0 here; `from_env` (the worker) defaults to 3 ms gaps within
    # 25 ms: a wave of 8 clients through the gateway arrived over ~10-15 ms on the H200 machine.
    prefill_gather_s: float = 0.0
    prefill_gather_gap_s: float | None = None
    # Prefix caching (TOKENMILL_ENGINE_PREFIX_CACHING=1; default off; not with kv_staging): full
    # KV blocks are shared by content (chained block hashes, salted by SamplingParams.cache_salt)
    # and kept in an LRU once unheld, evicted only when the pool runs out. With DeltaNet layers
    # a prefix resumes only where a state checkpoint exists too: one every
    # prefix_checkpoint_blocks blocks (TOKENMILL_ENGINE_PREFIX_CHECKPOINT_BLOCKS; 32 = 512
    # tokens at block_size 16; prefill chunks end there, so the spacing is also the longest
    # chunk), and each sequence's tail one, at the last block boundary it computed (its answer
    # included), kept when it stops running. They share a pool of prefix_checkpoint_slots state
    # slots beside the running ones (TOKENMILL_ENGINE_PREFIX_CHECKPOINT_SLOTS; default 2 x
    # max_num_seqs: a tail per running sequence and as many keyed; at most half are tails), each
    # one sequence's DeltaNet state: 74.8 MiB for the 27B shape with 16-bit state, the KV of
    # 2,394 FP8 tokens; on a GPU the pool comes out of the KV budget.
    enable_prefix_caching: bool = False
    prefix_checkpoint_blocks: int = 32
    prefix_checkpoint_slots: int | None = None

    @classmethod
    def from_env(cls, **overrides: Any) -> EngineConfig:
        given: dict[str, Any] = {
            "block_size": _env_int("TOKENMILL_ENGINE_BLOCK_SIZE"),
            "num_kv_blocks": _env_int("TOKENMILL_ENGINE_NUM_KV_BLOCKS"),
            "kv_cache_bytes": _env_int("TOKENMILL_ENGINE_KV_CACHE_BYTES"),
            "gpu_memory_fraction": _env_float("TOKENMILL_ENGINE_GPU_MEMORY_FRACTION"),
            "max_num_seqs": _env_int("TOKENMILL_ENGINE_MAX_NUM_SEQS"),
            "max_num_batched_tokens": _env_int("TOKENMILL_ENGINE_MAX_NUM_BATCHED_TOKENS"),
            "max_model_len": _env_int("TOKENMILL_ENGINE_MAX_MODEL_LEN"),
            "cuda_graphs": _env_bool("TOKENMILL_ENGINE_CUDA_GRAPHS"),
            "fuse_projections": _env_bool("TOKENMILL_ENGINE_FUSE_PROJECTIONS"),
            "overlap_decode": _env_bool("TOKENMILL_ENGINE_OVERLAP_DECODE"),
            "overlap_constrained": _env_bool("TOKENMILL_ENGINE_OVERLAP_CONSTRAINED"),
            "warm_up": _env_bool("TOKENMILL_ENGINE_WARM_UP"),
            "prefill_gather_s": env_float("TOKENMILL_ENGINE_PREFILL_GATHER_MS", 25) / 1e3,
            "prefill_gather_gap_s": env_float("TOKENMILL_ENGINE_PREFILL_GATHER_GAP_MS", 3) / 1e3,
            "state_dtype": _env_dtype("TOKENMILL_ENGINE_STATE_DTYPE"),
            "kv_staging": env("TOKENMILL_ENGINE_KV_STAGING"),
            "kv_staging_window_pages": _env_int("TOKENMILL_ENGINE_KV_STAGING_WINDOW_PAGES"),
            "kv_staging_anchor_pages": _env_int("TOKENMILL_ENGINE_KV_STAGING_ANCHOR_PAGES"),
            "enable_prefix_caching": _env_bool("TOKENMILL_ENGINE_PREFIX_CACHING"),
            "prefix_checkpoint_blocks": _env_int("TOKENMILL_ENGINE_PREFIX_CHECKPOINT_BLOCKS"),
            "prefix_checkpoint_slots": _env_int("TOKENMILL_ENGINE_PREFIX_CHECKPOINT_SLOTS"),
        }
        return cls(**{k: v for k, v in given.items() if v is not None}, **overrides)
