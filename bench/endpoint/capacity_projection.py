"""Capacity projection table for a measured throughput or a benchmark's results file.

    python -m bench.endpoint.capacity_projection        # the reference: 387.6 tok/s, $2.00/GPU-h
    python -m bench.endpoint.capacity_projection --bench results.json --gpu-hour-cost 3.50 \
        --output-price 3.00

Arguments are those of `tokenmill capacity` (pricing/cli.py); with none, prints the reference
check at 50/70/90% busy: 387.6 tok/s at 70% -> ~703M tokens / 30 days, 0.717 GPU-h per 1M."""

from __future__ import annotations

import sys

from pricing.cli import capacity_main

REFERENCE = [
    "--sku", "qwen3.6-27b-w4", "--tok-s", "387.6", "--gpu-hour-cost", "2.00",
    "--output-price", "3.00", "--busy", "0.50", "--busy", "0.70", "--busy", "0.90",
]  # fmt: skip

if __name__ == "__main__":
    sys.exit(capacity_main(sys.argv[1:] or REFERENCE))
