"""How the GPU suite spends its time and picks tilings. The tiling in use keeps its place
unless a candidate beats it by KEEP_MARGIN, so timings within noise at the swept row count do
not churn the tuning file (the rows it does not time, 9-16, follow whatever it picks); the last
section run gets all the time left."""

from __future__ import annotations

import pytest

from bench.engine.gemv import KEEP_MARGIN, incumbent_first, keep_or_replace


def test_the_fastest_wins_without_an_incumbent() -> None:
    assert keep_or_replace({"a": 10.0, "b": 9.0, "c": 9.5}, None) == "b"
    assert keep_or_replace({}, "a") is None


@pytest.mark.parametrize(
    ("incumbent_time", "kept"),
    [(9.0, True), (9.0 * (1 + KEEP_MARGIN) - 1e-9, True), (9.0 * (1 + KEEP_MARGIN) + 1e-6, False)],
)
def test_the_incumbent_stays_within_the_margin(incumbent_time: float, kept: bool) -> None:
    times = {"new": 9.0, "old": incumbent_time, "other": 12.0}
    assert keep_or_replace(times, "old") == ("old" if kept else "new")


def test_an_incumbent_not_timed_correct_is_replaced() -> None:
    # the tuning file's tiling failed its check (absent from the correct timings)
    assert keep_or_replace({"new": 9.0}, "old") == "new"


def test_two_launches_are_an_incumbent_like_any_tiling() -> None:
    # the fused activation's choice: None is the two-launch path, a valid incumbent
    assert keep_or_replace({None: 10.0, "fused": 9.9}, None) is None
    assert keep_or_replace({None: 10.0, "fused": 9.0}, None) == "fused"
    # nothing chosen before: a fresh sentinel matches no key
    assert keep_or_replace({None: 10.0, "fused": 9.9}, object()) == "fused"


def test_the_incumbent_is_timed_first_and_once() -> None:
    assert incumbent_first("b", ["a", "b", "c"]) == ["b", "a", "c"]
    assert incumbent_first(None, ["a", "b"]) == ["a", "b"]


def test_the_suites_last_section_gets_all_the_time_left() -> None:
    from bench.engine.suite import SECTIONS, section_shares

    shares = section_shares(["sweep_fp8", "gemv", "w4"])  # run in SECTIONS' order
    assert list(shares) == [name for name in SECTIONS if name in {"sweep_fp8", "gemv", "w4"}]
    *first, last = shares
    assert shares[last] == 1.0
    assert all(shares[name] == SECTIONS[name][1] for name in first)
    assert section_shares(["fp8"]) == {"fp8": 1.0}


def test_the_w4a8_sections_switch_both_paths_on_and_back() -> None:
    from bench.engine.suite import SECTIONS, with_w4a8
    from worker.kernels.triton import int4_gemm

    assert {"w4a8", "sweep_w4a8"} <= set(SECTIONS)
    before = int4_gemm.INT4_PREFILL, int4_gemm.INT4_W4A8_ROWS
    seen = with_w4a8(lambda: {"paths": (int4_gemm.INT4_PREFILL, int4_gemm.INT4_W4A8_ROWS)})
    assert seen == {"paths": ("w4a8", 17), "int4_prefill": "w4a8", "int4_w4a8_rows": 17}
    assert (int4_gemm.INT4_PREFILL, int4_gemm.INT4_W4A8_ROWS) == before


def test_the_x8_and_early_release_sections_switch_on_and_back() -> None:
    """`w4_x8` and the `*_early` sections run the engine with their switch on (graphs are
    captured inside), then leave it as it was."""
    from bench.engine.suite import SECTIONS, with_early_release, with_x8
    from worker.kernels import pdl
    from worker.kernels.cuda import int4_mma

    assert {"w4_x8", "w4_x8_down", "fp8_early", "w4_early"} <= set(SECTIONS)
    seen = with_x8(lambda: {"on": int4_mma.x8_enabled(), "down": int4_mma.x8_enabled(True)})
    assert seen == {"on": True, "down": False, "int4_x8": True} and not int4_mma.x8_enabled()
    seen = with_x8(lambda: {"down": int4_mma.x8_enabled(True)}, down=True)
    assert seen == {"down": True, "int4_x8": "with down"} and not int4_mma.x8_enabled(True)
    seen = with_early_release(lambda: {"on": pdl._state["early"]})
    assert seen == {"on": True, "pdl_early_release": True} and not pdl._state["early"]


def test_the_ba_in_conv_sections_switch_on_and_back() -> None:
    """`w4_ba_conv` runs the engine with the DeltaNet's b|a formed in the conv update's launch,
    `w4_x8_early_ba` with every decode switch at once; each leaves them as they were."""
    from bench.engine.suite import (
        SECTIONS,
        W4_VARIANTS,
        with_ba_in_conv,
        with_early_release,
        with_x8,
    )
    from worker.kernels import pdl
    from worker.kernels.cuda import int4_mma
    from worker.models import deltanet

    assert {"w4_ba_conv", "w4_x8_early_ba"} <= set(SECTIONS) & set(W4_VARIANTS)
    seen = with_ba_in_conv(lambda: {"on": deltanet.ba_in_conv_enabled()})
    assert seen == {"on": True, "gdn_ba_in_conv": True} and not deltanet.ba_in_conv_enabled()
    seen = with_ba_in_conv(
        with_early_release,
        with_x8,
        lambda: {
            "all": (deltanet.ba_in_conv_enabled(), pdl._state["early"], int4_mma.x8_enabled())
        },
    )
    assert seen["all"] == (True, True, True)
    assert not (deltanet.ba_in_conv_enabled() or pdl._state["early"] or int4_mma.x8_enabled())
