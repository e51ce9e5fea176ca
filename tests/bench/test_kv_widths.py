"""The codec variants bench.quality.kv_widths compares: its default rule is the codec's own
decode, and the norm-preserving rule gives every decoded vector the norm of its input."""

from __future__ import annotations

import pytest
import torch

from bench.quality.kv_widths import coded
from worker.kvcache import turboquant as tq


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_the_default_rule_is_the_codecs_decode(bits: int) -> None:
    x = torch.randn(3, 40, 64, generator=torch.Generator().manual_seed(bits))
    expected = tq.decode(tq.encode(x, bits), bits, 64)
    torch.testing.assert_close(coded(x, bits, norm_preserving=False), expected)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_norm_preserving_codes_keep_the_norm_and_not_the_shrink(bits: int) -> None:
    x = 5 * torch.randn(3, 40, 64, generator=torch.Generator().manual_seed(10 + bits))
    kept = coded(x, bits, norm_preserving=True).norm(dim=-1)
    torch.testing.assert_close(kept, x.norm(dim=-1), rtol=2e-3, atol=0)  # fp16 norms
    shrunk = coded(x, bits, norm_preserving=False).norm(dim=-1) / x.norm(dim=-1)
    assert float(shrunk.mean()) < 1 - tq.expected_unit_mse(64, bits) / 4  # MSE codes shrink
