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


def test_slow_steps_are_printed_once_each_as_they_appear(tmp_path, capsys) -> None:
    from datetime import datetime

    from bench.endpoint.governed import SlowStepWatch

    log = tmp_path / "worker.log"
    before = (
        "2026-12-03 16:00:00,000 worker.engine.engine WARNING slow engine step 3: 4.1 s (warm-up)"
    )
    log.write_text(before + "\n")
    watch = SlowStepWatch(log, datetime(2026, 12, 3, 16, 1))
    watch.report("round 1 direct")
    assert capsys.readouterr().out == ""  # before the worker announced itself
    step = "2026-12-03 16:02:00,000 worker.engine.engine WARNING slow engine step 90: 0.36 s"
    log.write_text(before + "\n" + step + "\nother line\n")
    watch.report("round 1 gateway")
    watch.report("round 2 direct")
    assert capsys.readouterr().out == f"slow step (round 1 gateway): {step}\n"


def test_the_sweep_skips_the_points_left_past_its_deadline(capsys) -> None:
    import argparse

    from bench.endpoint.governed import concurrency_sweep

    a = argparse.Namespace(sweep=[16, 32], concurrency=8)
    rows = concurrency_sweep(None, {}, a, None, deadline=0.0)  # type: ignore[arg-type]
    assert rows == [
        {"concurrency": 16, "skipped": "past --budget-s"},
        {"concurrency": 32, "skipped": "past --budget-s"},
    ]
    assert a.concurrency == 8
    assert "sweep C=16: skipped" in capsys.readouterr().out
