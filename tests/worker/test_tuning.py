"""Per-GPU kernel tuning files: applied when they match, ignored with a reason when they do not,
an error naming the file when corrupt."""

from __future__ import annotations

import json

import pytest

from worker.kernels import tuning
from worker.kernels.triton import delta_rule, fp8_gemm, int4_gemm

GPU = "NVIDIA H200"


@pytest.fixture
def tables():
    """Restore every table a test may change."""
    saved = (
        dict(fp8_gemm.DECODE_TILINGS),
        dict(fp8_gemm.WIDE_DECODE_TILINGS),
        dict(fp8_gemm.BF16_DECODE_TILINGS),
        dict(int4_gemm.INT4_DECODE_TILINGS),
        dict(fp8_gemm.SILU_MUL_TILINGS),
        dict(delta_rule.DECODE_LAUNCH),
    )
    yield
    for table, old in zip(
        (
            fp8_gemm.DECODE_TILINGS,
            fp8_gemm.WIDE_DECODE_TILINGS,
            fp8_gemm.BF16_DECODE_TILINGS,
            int4_gemm.INT4_DECODE_TILINGS,
            fp8_gemm.SILU_MUL_TILINGS,
            delta_rule.DECODE_LAUNCH,
        ),
        saved,
        strict=True,
    ):
        table.clear()
        table.update(old)


def test_a_snapshot_written_then_applied_restores_the_settings(tmp_path, tables):
    fp8_gemm.DECODE_TILINGS[(5120, 17408)] = fp8_gemm.DecodeTiling(32, 256, 7, 2, 4)
    wide = fp8_gemm.DecodeTiling(64, 128, 2, 4, 3, act_fp8=True)
    fp8_gemm.WIDE_DECODE_TILINGS[(5120, 17408, 64)] = wide
    int4_gemm.INT4_DECODE_TILINGS[(34816, 5120)] = int4_gemm.Int4Tiling(64, 128, 2, 4, 3)
    delta_rule.DECODE_LAUNCH["num_warps"] = 8
    path = tuning.path_for(GPU, tmp_path)
    assert path.name == "nvidia-h200.json"
    tuning.write(path, tuning.snapshot(GPU, "test"))
    assert "5120x17408x64" in tuning.read(path)["fp8_wide_decode_tilings"]
    fp8_gemm.DECODE_TILINGS.clear()
    fp8_gemm.WIDE_DECODE_TILINGS.clear()
    int4_gemm.INT4_DECODE_TILINGS.clear()
    delta_rule.DECODE_LAUNCH["num_warps"] = 4
    applied = tuning.apply_file(path, GPU)
    assert applied.path == path and applied.reason == "applied"
    assert fp8_gemm.DECODE_TILINGS[(5120, 17408)] == fp8_gemm.DecodeTiling(32, 256, 7, 2, 4)
    assert fp8_gemm.WIDE_DECODE_TILINGS[(5120, 17408, 64)] == wide
    assert int4_gemm.INT4_DECODE_TILINGS[(34816, 5120)].splits == 2
    assert delta_rule.DECODE_LAUNCH["num_warps"] == 8


def test_another_gpus_or_a_stale_file_is_ignored_with_the_reason(tmp_path, tables, caplog):
    data = tuning.snapshot("NVIDIA H100 80GB HBM3")
    data["fp8_decode_tilings"] = {"64x64": {"bn": 16}}
    path = tmp_path / "nvidia-h200.json"
    tuning.write(path, data)
    with caplog.at_level("WARNING"):
        applied = tuning.apply_file(path, GPU)
    assert applied.path is None and "H100" in applied.reason and "ignored" in caplog.text
    assert (64, 64) not in fp8_gemm.DECODE_TILINGS
    data = tuning.snapshot(GPU)
    data["kernels_version"] = tuning.KERNELS_VERSION - 1
    data["fp8_decode_tilings"] = {"64x64": {"bn": 16}}
    tuning.write(path, data)
    applied = tuning.apply_file(path, GPU)
    assert applied.path is None and "kernels version" in applied.reason
    assert (64, 64) not in fp8_gemm.DECODE_TILINGS


def test_a_missing_file_means_defaults():
    applied = tuning.apply_file(tuning.HERE / "no-such-gpu.json", "No Such GPU")
    assert applied.path is None and "defaults" in applied.reason


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not a readable tuning file"),
        (json.dumps({"format": 99}), "not a tuning file of format"),
        (json.dumps({"format": 1, "gpu": GPU, "colour": "red"}), "unknown keys"),
    ],
)
def test_a_corrupt_file_is_an_error_naming_it(tmp_path, content, message):
    path = tmp_path / "nvidia-h200.json"
    path.write_text(content)
    with pytest.raises(tuning.TuningFileError, match=message) as err:
        tuning.apply_file(path, GPU)
    assert str(path) in str(err.value)


def test_a_bad_entry_changes_no_table(tmp_path, tables):
    data = tuning.snapshot(GPU)
    data["fp8_decode_tilings"] = {"64x64": {"bn": 16}, "128x64": {"bn": 16, "colour": 1}}
    path = tmp_path / "nvidia-h200.json"
    tuning.write(path, data)
    with pytest.raises(tuning.TuningFileError, match=r"128x64.*unknown tiling fields"):
        tuning.apply_file(path, GPU)
    assert (64, 64) not in fp8_gemm.DECODE_TILINGS


def test_the_packaged_files_parse():
    for path in sorted(tuning.HERE.glob("*.json")):
        data = tuning.read(path)
        assert tuning.path_for(data["gpu"]) == path  # named after the GPU they were measured on


def test_the_int8_gemv_tilings_round_trip(tmp_path):
    """`int4_mma_x8_tilings` (the int4 GEMV's int8 products) is applied like the 16-bit table,
    and the int8 products run it where it is set, their 16-bit tiling elsewhere."""
    from worker.kernels.cuda import int4_mma

    saved = dict(int4_mma.MMA_X8_TILINGS), dict(int4_mma.MMA_DECODE_TILINGS)
    try:
        int4_mma.MMA_DECODE_TILINGS[(16384, 5120)] = int4_mma.MmaTiling(2, 4, 1, 3, 9)
        int4_mma.MMA_X8_TILINGS[(16384, 5120)] = int4_mma.MmaTiling(2, 8, 2, 3, 9)
        path = tuning.path_for(GPU, tmp_path)
        tuning.write(path, tuning.snapshot(GPU, "test"))
        assert tuning.read(path)["int4_mma_x8_tilings"]["16384x5120"]["warps"] == 8
        int4_mma.MMA_X8_TILINGS.clear()
        assert int4_mma.x8_tiling(16384, 5120, 8, 128) == int4_mma.MmaTiling(2, 4, 1, 3, 9)
        assert tuning.apply_file(path, GPU).reason == "applied"
        assert int4_mma.x8_tiling(16384, 5120, 8, 128) == int4_mma.MmaTiling(2, 8, 2, 3, 9)
        assert int4_mma.x8_tiling(16384, 5120, 24, 128) is None  # past 16 rows: 16-bit x
    finally:
        for table, old in zip((int4_mma.MMA_X8_TILINGS, int4_mma.MMA_DECODE_TILINGS), saved, strict=True):  # fmt: skip
            table.clear()
            table.update(old)
