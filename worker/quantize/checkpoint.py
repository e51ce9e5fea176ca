"""Quantized checkpoints from HF safetensors directories or GGUF files.

A quantized checkpoint is a directory: `config.json` (the source's, or one derived from GGUF
metadata) with a `quantization_config` entry (`worker.quantize.scheme`), the tokenizer files,
and safetensors shards holding `<prefix>.qweight` / `.scales` (/ `.mins`) for int4 modules,
`<prefix>.weight` (e4m3) / `.weight_scale` for FP8 ones, and every other tensor in 16-bit under
its name. The whole source is checked before anything is written, and the output is built in a
hidden sibling directory renamed into place at the end, so a failed or interrupted run leaves
no half-written checkpoint.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from worker.loading.config import config_from_hf, config_to_hf
from worker.loading.safetensors import checkpoint_name_to_param
from worker.models.causal_lm import CausalLM
from worker.models.config import ModelConfig
from worker.models.fp8 import quantize_weight
from worker.models.int4 import Int4Tensors, quantize_rtn
from worker.quantize.scheme import FP8, INT4, Scheme

SHARD_BYTES = 4 << 30
# Files of a source directory that are weights (rewritten) rather than metadata (copied).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
_INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A source that cannot be quantized: missing, partial, unreadable or of unknown tensors."""


def _param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter names and shapes for `config` (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = CausalLM(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


@dataclass
class Source:
    """A checkpoint to quantize: its HF config, tensor names (as they will be written) mapped to
    our parameter names (None: carried through untouched), and a reader per tensor."""

    hf_config: dict[str, Any]
    config: ModelConfig
    targets: dict[str, str | None]
    read: Callable[[str], torch.Tensor]
    write_tokenizer: Callable[[Path], None]
    # GGUF sources are read whole into a model up front; GPTQ reuses it.
    model: CausalLM | None = field(default=None, repr=False)
    path: Path = Path()


def open_source(path: str | Path) -> Source:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_source(path)
    if path.is_dir():
        return _hf_source(path)
    raise CheckpointError(f"{path}: neither a .gguf file nor a checkpoint directory")


def _hf_source(path: Path) -> Source:
    config_file = path / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"{path}: no config.json")
    try:
        hf_config = json.loads(config_file.read_text())
        config = config_from_hf(hf_config, name=path.name)
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{config_file}: {e}") from e
    index = path / _INDEX
    expected: dict[str, str] | None = None
    if index.exists():
        try:
            expected = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from e
        files = sorted({path / shard for shard in expected.values()})
        absent = [f.name for f in files if not f.exists()]
        if absent:
            raise CheckpointError(f"{path}: missing shard(s) {absent} named in {_INDEX}")
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no .safetensors files")

    location: dict[str, Path] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    location[name] = file
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except Exception as e:  # safetensors raises its own error types for a bad header
            raise CheckpointError(f"{file}: unreadable safetensors file ({e})") from e
    if expected is not None:
        lost = sorted(n for n, shard in expected.items() if location.get(n) != path / shard)
        if lost:
            raise CheckpointError(
                f"{path}: {len(lost)} indexed tensors not in their shard: {lost[:4]}"
            )

    params = _param_shapes(config)
    targets: dict[str, str | None] = {}
    unknown, wrong = [], []
    for name in location:
        target = checkpoint_name_to_param(name)
        if target is not None and target not in params:
            if target == "lm_head.weight" and config.tie_word_embeddings:
                target = None  # a tied head saved anyway: the loader ignores it too
            else:
                unknown.append(name)
                continue
        if target is not None and shapes[name] != params[target]:
            wrong.append(f"{name} {shapes[name]} != {params[target]}")
        targets[name] = target
    if unknown:
        raise CheckpointError(f"{path}: unknown tensors {sorted(unknown)[:8]} ({len(unknown)})")
    if wrong:
        raise CheckpointError(f"{path}: tensors of the wrong shape: {wrong[:4]}")
    missing = sorted(set(params) - {t for t in targets.values() if t})
    if missing:
        raise CheckpointError(
            f"{path}: partial checkpoint, lacks {missing[:8]} ({len(missing)} tensors)"
        )

    def read(name: str) -> torch.Tensor:
        with safe_open(str(location[name]), framework="pt", device="cpu") as f:
            return f.get_tensor(name)

    def write_tokenizer(dst: Path) -> None:
        for item in sorted(path.iterdir()):
            if item.is_file() and item.suffix not in _WEIGHT_SUFFIXES:
                if item.name not in ("config.json", _INDEX):
                    shutil.copy2(item, dst / item.name)

    return Source(hf_config, config, targets, read, write_tokenizer, path=path)


_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def hf_config_from_model_config(config: ModelConfig) -> dict[str, Any]:
    """An HF config.json for a dense model (what GGUF metadata describes), which
    `config_from_hf` reads back into the same ModelConfig."""
    if config.family not in _ARCHITECTURES:
        raise CheckpointError(f"no HF config for family {config.family!r}")
    eos = list(config.eos_token_ids)
    out: dict[str, Any] = {"architectures": [_ARCHITECTURES[config.family]], **config_to_hf(config)}
    # As the Hugging Face checkpoints of these families have it: a lone eos id as a number,
    # the dtype, and no partial rotary factor (they rotate the whole head).
    del out["partial_rotary_factor"]
    out["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
    out["torch_dtype"] = "bfloat16"
    return out


def _gguf_source(path: Path) -> Source:
    from gguf import GGUFReader

    from worker.loading.gguf import config_from_gguf, load_gguf_model
    from worker.tokenizer.gguf import tokenizer_from_gguf

    try:
        reader = GGUFReader(str(path))
        config = config_from_gguf(reader, name=path.stem)
        del reader
        # Dequantized once, in fp32: the GGUF grid's values are exact there.
        model = load_gguf_model(path, "cpu", torch.float32)
    except (ValueError, KeyError, OSError) as e:
        raise CheckpointError(f"{path}: {e}") from e
    state = dict(model.named_parameters())
    targets: dict[str, str | None] = {name: name for name in state}

    def read(name: str) -> torch.Tensor:
        return state[name].detach()

    def write_tokenizer(dst: Path) -> None:
        tokenizer, eos, bos, template = tokenizer_from_gguf(path)
        tokenizer.save(str(dst / "tokenizer.json"))
        tok_config: dict[str, Any] = {"eos_token": eos, "add_bos_token": bos is not None}
        if bos is not None:
            tok_config["bos_token"] = bos
        if template:
            tok_config["chat_template"] = template
        (dst / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")

    return Source(
        hf_config_from_model_config(config),
        config,
        targets,
        read,
        write_tokenizer,
        model=model,
        path=path,
    )


class ShardWriter:
    """Tensors into safetensors shards of at most `shard_bytes` (one tensor may exceed it),
    named `model-0000i-of-0000n.safetensors` with an index once there are several."""

    def __init__(self, directory: Path, shard_bytes: int = SHARD_BYTES) -> None:
        self.directory = directory
        self.shard_bytes = shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.shard_bytes:
            self._flush()
        self.pending[name] = tensor.detach().to("cpu").contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        file = self.directory / f"shard-{len(self.shards):05d}.tmp"
        save_file(self.pending, str(file), metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[Path]:
        if self.pending or not self.shards:
            self._flush()
        n = len(self.shards)
        names = (
            ["model.safetensors"]
            if n == 1
            else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        for i, name in enumerate(names):
            (self.directory / f"shard-{i:05d}.tmp").rename(self.directory / name)
        if n > 1:
            weight_map = {t: names[i] for i, shard in enumerate(self.shards) for t in shard}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.directory / _INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return [self.directory / name for name in names]


def int4_tensors(prefix: str, q: Int4Tensors) -> Iterator[tuple[str, torch.Tensor]]:
    yield f"{prefix}.qweight", q.qweight
    yield f"{prefix}.scales", q.scales
    if q.mins is not None:
        yield f"{prefix}.mins", q.mins


def sixteen_bit(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Floating tensors wider than 16 bits narrowed to `dtype`; 16-bit and integer ones kept."""
    if tensor.dtype.is_floating_point and tensor.element_size() > 2:
        return tensor.to(dtype)
    return tensor


@torch.no_grad()
def write_quantized(
    source: Source,
    directory: Path,
    scheme: Scheme,
    method: str,
    computed: dict[str, Int4Tensors] | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    shard_bytes: int = SHARD_BYTES,
    progress: Callable[[Iterator[str], int], Iterator[str]] | None = None,
) -> dict[str, str]:
    """Write every tensor of `source` into `directory` (which must exist): int4 modules from
    `computed` (our module name -> GPTQ result) or else round-to-nearest, FP8 ones per
    channel, the rest 16-bit; then config.json and the tokenizer. Returns the modules map."""
    writer = ShardWriter(directory, shard_bytes)
    modules: dict[str, str] = {}
    names: Iterator[str] = iter(source.targets)
    if progress is not None:
        names = progress(names, len(source.targets))
    for name in names:
        target = source.targets[name]
        tensor = source.read(name)
        kind = None if target is None else scheme.kind(target, tuple(tensor.shape))
        prefix = name[: -len(".weight")]
        if kind == INT4:
            assert target is not None
            q = (computed or {}).get(target[: -len(".weight")])
            if q is None:
                q = quantize_rtn(tensor.to(device), scheme.group_size, scheme.symmetric)
            for key, value in int4_tensors(prefix, q):
                writer.add(key, value)
        elif kind == FP8:
            weight, scale = quantize_weight(tensor.to(device))
            writer.add(f"{prefix}.weight", weight)
            writer.add(f"{prefix}.weight_scale", scale)
        else:
            writer.add(name, sixteen_bit(tensor, dtype))
        if kind is not None:
            modules[prefix] = kind
        del tensor
    writer.close()
    hf_config = dict(source.hf_config)
    hf_config["quantization_config"] = scheme.quantization_config(method, modules)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    source.write_tokenizer(directory)
    return modules
