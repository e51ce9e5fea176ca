"""The hf section: transformers Qwen3_5ForCausalLM bf16 (sdpa; fla kernels when importable),
static batch, the comparison row of the results table (method recorded in the JSON)."""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from bench.common import GIB, sync


def hf_config(config: Any) -> Any:
    import transformers

    return transformers.Qwen3_5TextConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        layer_types=list(config.layer_types),
        linear_num_key_heads=config.linear_num_key_heads,
        linear_num_value_heads=config.linear_num_value_heads,
        linear_key_head_dim=config.linear_key_head_dim,
        linear_value_head_dim=config.linear_value_head_dim,
        linear_conv_kernel_dim=config.linear_conv_kernel_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def hf_baseline(args: argparse.Namespace, config: Any, budget: float) -> dict[str, Any]:
    import transformers

    began = time.perf_counter()
    result: dict[str, Any] = {"transformers": transformers.__version__}
    try:
        import fla  # noqa: F401

        result["fla"] = getattr(fla, "__version__", "present")
    except Exception as exc:
        result["fla"] = f"not importable ({type(exc).__name__}): torch fallback kernels"
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    with torch.device(args.device):
        model = transformers.Qwen3_5ForCausalLM._from_config(
            hf_config(config), dtype=dtype, attn_implementation="sdpa"
        )
    model.eval()
    result["weights_gib"] = sum(p.numel() * p.element_size() for p in model.parameters()) / GIB
    result["build_s"] = time.perf_counter() - began
    batch = torch.randint(0, config.vocab_size, (args.concurrency, args.prompt_len))
    ids = batch.to(args.device)

    def generate(n: int) -> float:
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        sync()
        return time.perf_counter() - t0

    generate(2)  # warm: kernel compilation, allocator
    first = generate(1)
    left = budget - (time.perf_counter() - began)
    # decode tokens to time: as many as fit in half of what is left (at most 64, at least 4)
    step_guess = max(first / 4, 0.02)
    d = int(max(4, min(64, (left * 0.5 - first) / step_guess)))
    longer = generate(1 + d)
    step = (longer - first) / d
    e2e = first + (args.max_tokens - 1) * step
    result.update(
        {
            "method": (
                f"static batch {args.concurrency}: t(1 token) = prefill + 1 step; decode step = "
                f"(t(1+{d}) - t(1)) / {d}; e2e for {args.max_tokens} tokens extrapolated as "
                f"t(1) + {args.max_tokens - 1} x step; tok/s = batch x tokens / e2e; TTFT = t(1)"
            ),
            "decode_tokens_timed": d,
            "t1_s": first,
            "decode_step_ms": step * 1e3,
            "ttft_p50_s": first,
            "ttft_p95_s": first,
            "e2e_p50_s": e2e,
            "e2e_p95_s": e2e,
            "output_tok_s": args.concurrency * args.max_tokens / e2e,
            "gpu_hours_per_1m_output_tokens": 1e6
            / (args.concurrency * args.max_tokens / e2e)
            / 3600,
        }
    )
    return result  # the model goes with this frame
