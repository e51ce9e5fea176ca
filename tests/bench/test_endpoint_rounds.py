"""The endpoint sweep's summary of several rounds a point: medians, errors summed."""

from __future__ import annotations

from bench.endpoint.governed import median_of_rounds


def test_median_of_rounds_takes_each_number_s_median_and_sums_errors() -> None:
    rounds = [
        {"output_tokens_per_s": 100.0, "ttft_s_p50": 0.3, "errors": 0, "first_errors": []},
        {"output_tokens_per_s": 90.0, "ttft_s_p50": 0.2, "errors": 1, "first_errors": ["x"]},
        {"output_tokens_per_s": 120.0, "ttft_s_p50": 0.5, "errors": 2, "first_errors": []},
    ]
    merged = median_of_rounds(rounds)
    assert merged["output_tokens_per_s"] == 100.0
    assert merged["ttft_s_p50"] == 0.3
    assert merged["errors"] == 3
    assert merged["rounds"] == 3
