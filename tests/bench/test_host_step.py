"""The host-step bench builds sequences whose aged-out pages are all compressed (the steady
state it times) and times both parts at every point."""

from __future__ import annotations

from pathlib import Path

from bench.engine.host_step import main


def test_every_point_is_timed_in_the_steady_state(tmp_path: Path) -> None:
    result = main(["--points", "2x320,3x500", "--repeats", "1", "--out", str(tmp_path)])
    assert [(p["rows"], p["tokens"]) for p in result["points"]] == [(2, 320), (3, 500)]
    for p in result["points"]:
        # per sequence: 1 anchor and 8 window pages stay FP8, the rest is compressed
        assert p["compressed_pages"] == p["pages"] - 9 * p["rows"]
        assert p["restage_ms"] > 0 and p["fill_ms"] > 0
    assert len(list(tmp_path.glob("*-host_step.json"))) == 1
