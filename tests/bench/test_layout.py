"""The bench packages import on CPU, every script's --help works, the GPU suite's sections are
registered by name, and results are named <date>-<gpu>-<short sha>-<bench>.json."""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import bench
from bench import common

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted(m.name for m in pkgutil.walk_packages(bench.__path__, "bench."))
ENTRY_POINTS = [
    m.name
    for m in pkgutil.walk_packages(bench.__path__, "bench.")
    if not m.ispkg
    and 'if __name__ == "__main__":' in (ROOT / (m.name.replace(".", "/") + ".py")).read_text()
]
RESULT_NAME = re.compile(r"\d{4}-\d\d-\d\d-[a-z0-9-]+-([0-9a-f]{7}|nosha)-\w+\.(json|log)")


@pytest.mark.parametrize("module", MODULES)
def test_every_bench_module_imports(module: str) -> None:
    importlib.import_module(module)


def test_the_folders_are_packages_by_subject() -> None:
    folders = {p.name for p in (ROOT / "bench").iterdir() if (p / "__init__.py").exists()}
    assert {"kernels", "engine", "endpoint", "gateway", "ledger", "quality"} <= folders
    assert {p.name for p in (ROOT / "bench").glob("*.py")} == {"__init__.py", "common.py"}
    assert (ROOT / "bench" / "endpoint" / "wheels.txt").exists()


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_every_script_answers_help(module: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout


def test_the_suite_runs_sections_by_name() -> None:
    from bench.engine import suite

    wanted = ["roofline", "gemv", "fp8", "w4", "preflight", "w4_gemv", "fp8_gemm", "bf16", "hf"]
    assert set(wanted) <= set(suite.SECTIONS)
    assert {"gdn", "l2_probe", "sweep_fp8", "sweep_w4"} <= set(suite.SECTIONS)
    assert all(0 < share <= 1 for _, share in suite.SECTIONS.values())
    with pytest.raises(SystemExit) as exit_:
        suite.main(["--sections", "roofline,nope"])
    assert exit_.value.code == 2


def test_results_are_named_by_date_gpu_and_sha(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_GIT_SHA", "35cc97c0123")
    assert common.gpu_tag("NVIDIA H200") == "h200"
    assert common.gpu_tag("cpu") == "cpu"
    name = common.result_name("gpu_suite", "NVIDIA H200")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d-h200-35cc97c-gpu_suite\.json", name)
    monkeypatch.setenv("OUT", "/tmp/out")
    assert common.result_path("staged_kv", gpu="cpu").parent == Path("/tmp/out")
    assert common.result_path("staged_kv", "elsewhere", "cpu").parent == Path("elsewhere")


def test_committed_results_follow_the_naming() -> None:
    names = [p.name for p in (ROOT / "bench" / "results").iterdir()]
    assert names
    assert [n for n in names if not RESULT_NAME.fullmatch(n)] == []


def test_percentile_median_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert common.percentile([], 50) != common.percentile([], 50)  # NaN
    assert common.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert common.median([], 1e3) is None
    assert common.median([0.001, 0.003, 0.002], 1e3) == 2.0
    common.print_table(("", "a", "b"), [("row", 1.0, "x")], (6, 6, 4))
    assert capsys.readouterr().out.splitlines() == ["           a   b", "row     1.00   x"]


def test_soak_gives_variables_to_the_processes_named() -> None:
    from bench.gateway.soak import parser, process_env

    args = parser().parse_args(
        [
            *("--env", "scheduler:TOKENMILL_BILLING_CAPACITY_INTERVAL_S=60"),
            *("--env", "all:TOKENMILL_LOG_LEVEL=INFO"),
            *("--memory-profile", "/tmp/mem", "--memory-profile-every-s", "30"),
            *("--memory-profile-processes", "scheduler,gateway0"),
        ]
    )
    env = process_env(args)
    assert env["*"] == {"TOKENMILL_LOG_LEVEL": "INFO"}
    assert env["scheduler"]["TOKENMILL_BILLING_CAPACITY_INTERVAL_S"] == "60"
    assert env["scheduler"]["TOKENMILL_MEMORY_PROFILE"] == "/tmp/mem/scheduler.txt"
    assert env["gateway0"]["TOKENMILL_MEMORY_PROFILE_EVERY_S"] == "30.0"
    assert set(env) == {"*", "scheduler", "gateway0"}
    with pytest.raises(SystemExit):
        process_env(parser().parse_args(["--env", "TOKENMILL_X=1"]))
