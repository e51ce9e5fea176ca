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
