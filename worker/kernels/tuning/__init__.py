"""Kernel settings as product data: the tilings and launch settings a GPU's sweep chose, in one
JSON file per GPU model beside this module (`<gpu>.json`, e.g. `nvidia-h200.json`).

The worker applies the file for its GPU when the engine starts (`apply`), so `tokenmill worker`
runs the settings the benchmark measured; without a file it logs that it runs the kernels'
built-in defaults. `python -m bench.engine.suite --write-tuning` regenerates the file on a new GPU
from the sweeps it runs.

What a file holds (every part optional): `pdl` (programmatic dependent launch on/off),
`fp8_decode_tilings` / `bf16_decode_tilings` / `int4_decode_tilings` / `int4_silu_mul_tilings` /
`int4_mma_decode_tilings` / `int4_mma_x8_tilings` ("NxK" -> tiling fields), `fp8_wide_decode_tilings` ("NxKxM" for 32- and
64-row decode batches), `fp8_silu_mul_tilings` ("2FxK" -> fields, or null for two launches),
`gdn_decode_launch` / `gdn_wide_decode_launch` (over 16 sequences) / `gdn_prefill_launch` (DeltaNet
launch settings).

A file is ignored, with the reason logged, when it was measured on another GPU or for another
`KERNELS_VERSION` (bump it when a kernel change makes old tilings meaningless); a file that is
not valid JSON or names unknown fields is an error naming the file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

FORMAT = 1
KERNELS_VERSION = 1
HERE = Path(__file__).parent


class TuningFileError(ValueError):
    pass


@dataclasses.dataclass
class Applied:
    path: Path | None = None
    reason: str = "not applied"


state = Applied()


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def path_for(gpu_name: str, folder: Path = HERE) -> Path:
    return folder / f"{gpu_slug(gpu_name)}.json"


def _tables() -> dict[str, tuple[dict[Any, Any], type]]:
    from worker.kernels.cuda import int4_mma
    from worker.kernels.triton import fp8_gemm, int4_gemm

    return {
        "int4_mma_decode_tilings": (int4_mma.MMA_DECODE_TILINGS, int4_mma.MmaTiling),
        "int4_mma_x8_tilings": (int4_mma.MMA_X8_TILINGS, int4_mma.MmaTiling),
        "fp8_decode_tilings": (fp8_gemm.DECODE_TILINGS, fp8_gemm.DecodeTiling),
        "fp8_wide_decode_tilings": (fp8_gemm.WIDE_DECODE_TILINGS, fp8_gemm.DecodeTiling),
        "bf16_decode_tilings": (fp8_gemm.BF16_DECODE_TILINGS, fp8_gemm.DecodeTiling),
        "int4_decode_tilings": (int4_gemm.INT4_DECODE_TILINGS, int4_gemm.Int4Tiling),
        "int4_silu_mul_tilings": (int4_gemm.INT4_SILU_MUL_TILINGS, int4_gemm.Int4Tiling),
    }


def _shape(key: str, path: Path) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in key.split("x"))
    except ValueError:
        raise TuningFileError(f"{path}: shape {key!r} is not NxK") from None


def _tiling(cls: type, fields: Any, where: str) -> Any:
    if not isinstance(fields, dict):
        raise TuningFileError(f"{where}: a tiling is an object of fields, got {fields!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(fields) - known
    if unknown:
        raise TuningFileError(f"{where}: unknown tiling fields {sorted(unknown)}")
    return cls(**fields)


def read(path: Path) -> dict[str, Any]:
    """The file's settings, parsed and checked (TuningFileError naming the file otherwise)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TuningFileError(f"{path}: not a readable tuning file ({exc})") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise TuningFileError(f"{path}: not a tuning file of format {FORMAT}")
    known = {"format", "gpu", "kernels_version", "measured_by", "pdl", "fp8_silu_mul_tilings"}
    known |= {"gdn_decode_launch", "gdn_wide_decode_launch", "gdn_prefill_launch", *_TABLE_NAMES}
    unknown = set(data) - known
    if unknown:
        raise TuningFileError(f"{path}: unknown keys {sorted(unknown)}")
    return data


_TABLE_NAMES = (
    "int4_mma_decode_tilings",
    "int4_mma_x8_tilings",
    "fp8_decode_tilings",
    "fp8_wide_decode_tilings",
    "bf16_decode_tilings",
    "int4_decode_tilings",
    "int4_silu_mul_tilings",
)


def apply(device: torch.device | str, folder: Path = HERE) -> Applied:
    """Load the tuning file of `device`'s GPU into the kernels' tables (once per process; a
    benchmark that swept in this process keeps its own choices: see `mark_swept`)."""
    global state
    device = torch.device(device)
    if state.path is not None or state.reason == "swept in this process":
        return state
    if device.type != "cuda":
        state = Applied(None, "no GPU: kernel defaults")
        return state
    name = torch.cuda.get_device_name(device)
    state = apply_file(path_for(name, folder), name)
    return state


def apply_file(path: Path, gpu_name: str) -> Applied:
    if not path.exists():
        log.warning(
            "no kernel tuning file for %s (%s): running the kernels' defaults", gpu_name, path
        )
        return Applied(None, f"no file {path.name}: defaults")
    data = read(path)
    if data.get("gpu") != gpu_name:
        reason = f"{path} was measured on {data.get('gpu')!r}, not {gpu_name!r}: ignored"
        log.warning("%s", reason)
        return Applied(None, reason)
    if data.get("kernels_version") != KERNELS_VERSION:
        reason = (
            f"{path} is for kernels version {data.get('kernels_version')}, these are "
            f"{KERNELS_VERSION}: ignored (regenerate with python -m bench.engine.suite --write-tuning)"
        )
        log.warning("%s", reason)
        return Applied(None, reason)
    _load(data, path)
    log.info("kernel tuning from %s", path)
    return Applied(path, "applied")


def _load(data: dict[str, Any], path: Path) -> None:
    from worker.kernels.pdl import set_pdl
    from worker.kernels.triton import delta_rule, fp8_gemm

    parsed: dict[str, dict[Any, Any]] = {}
    tables = _tables()
    for name in _TABLE_NAMES:
        entries = data.get(name) or {}
        cls = tables[name][1]
        parsed[name] = {
            _shape(key, path): None
            if fields is None
            else _tiling(cls, fields, f"{path}: {name}[{key}]")
            for key, fields in entries.items()
        }
    silu = {}
    for key, fields in (data.get("fp8_silu_mul_tilings") or {}).items():
        two_f, k = _shape(key, path)
        tiling = (
            None if fields is None else _tiling(fp8_gemm.DecodeTiling, fields, f"{path}: {key}")
        )
        silu[(two_f, k, True)] = tiling
    # all parsed before any table changes: a bad entry leaves the defaults whole
    for name, entries in parsed.items():
        tables[name][0].update(entries)
    fp8_gemm.SILU_MUL_TILINGS.update(silu)
    for key, launch in (("gdn_decode_launch", delta_rule.DECODE_LAUNCH),
                        ("gdn_wide_decode_launch", delta_rule.WIDE_DECODE_LAUNCH),
                        ("gdn_prefill_launch", delta_rule.PREFILL_LAUNCH)):  # fmt: skip
        launch.update({k: int(v) for k, v in (data.get(key) or {}).items()})
    if "pdl" in data:
        set_pdl(bool(data["pdl"]))


def mark_swept() -> None:
    """A benchmark chose this process's settings by measuring them: `apply` keeps them."""
    global state
    state = Applied(None, "swept in this process")


def snapshot(gpu_name: str, measured_by: str = "") -> dict[str, Any]:
    """This process's settings as a tuning file's contents (what `--write-tuning` writes)."""
    from worker.kernels.pdl import _state as pdl_state
    from worker.kernels.triton import delta_rule, fp8_gemm

    data: dict[str, Any] = {
        "format": FORMAT,
        "gpu": gpu_name,
        "kernels_version": KERNELS_VERSION,
        "measured_by": measured_by,
        "pdl": bool(pdl_state["on"]),
    }
    for name, (table, _) in _tables().items():
        data[name] = {  # None: the shape runs another path (e.g. two launches)
            "x".join(map(str, key)): None if t is None else dataclasses.asdict(t)
            for key, t in sorted(table.items())
        }
    data["fp8_silu_mul_tilings"] = {
        f"{two_f}x{k}": None if t is None else dataclasses.asdict(t)
        for (two_f, k, fp8), t in sorted(fp8_gemm.SILU_MUL_TILINGS.items())
        if fp8
    }
    data["gdn_decode_launch"] = dict(delta_rule.DECODE_LAUNCH)
    data["gdn_wide_decode_launch"] = dict(delta_rule.WIDE_DECODE_LAUNCH)
    data["gdn_prefill_launch"] = dict(delta_rule.PREFILL_LAUNCH)
    return data


def write(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
