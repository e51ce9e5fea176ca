"""The staged attention kernels compiled ahead of time for sm_90, no GPU needed: the CPU suite
runs them under triton's interpreter, which neither type-checks nor allocates registers. The
direct prefill at its tiling (`staged_prefill_tiles`) and the decode at its defaults must
compile without spilling (128 x 64 prefill tiles spill 840 bytes a thread)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.worker.test_gemv_compiles_for_hopper import compile_in_a_fresh_interpreter

pytest.importorskip("triton")

_SCRIPT = """
import json
from bench.kernels.decode_sass import VARIANTS, analyse
from worker.kernels.triton.turboquant import staged_prefill_tiles
assert (VARIANTS["staged_prefill"].bm, VARIANTS["staged_prefill"].bn,
        VARIANTS["staged_prefill"].warps) == staged_prefill_tiles(256)
out = {}
for name in ("default", "staged_prefill"):
    r = analyse(name, VARIANTS[name])
    out[name] = {k: r[k] for k in ("registers", "stack_bytes", "executed_per_tile")}
print(json.dumps(out))
"""


def test_staged_decode_and_direct_prefill_compile_without_spills(tmp_path: Path) -> None:
    result = json.loads(compile_in_a_fresh_interpreter(_SCRIPT, tmp_path).strip().splitlines()[-1])
    for name, r in result.items():
        assert r["registers"] <= 255 and r["stack_bytes"] == 0, (name, r)
        assert r["executed_per_tile"] > 0, name
