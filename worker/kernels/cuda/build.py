"""Build a CUDA C++ source of this package into a shared library with `nvcc`, once per source,
compiler and GPU architecture (cached on disk), and load it with ctypes.

Why not `torch.utils.cpp_extension`: these kernels take raw pointers and a stream, so they need
no torch headers; a plain `nvcc -shared` build takes seconds instead of a minute of compiling
torch's headers, needs no ninja, and the library works with any torch build. The cache
directory is `TOKENMILL_KERNEL_CACHE` (default `~/.cache/tokenmill/kernels`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

_lock = threading.Lock()
_loaded: dict[tuple[str, str], ctypes.CDLL] = {}


def nvcc() -> str | None:
    """The CUDA compiler: `$CUDA_HOME/bin/nvcc`, else the one on PATH."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def missing(device: torch.device, capability: tuple[int, int], needs: str, source: Path) -> str:
    """Why kernels built from `source` cannot run on `device` ("" when they can): a CUDA
    device of at least `capability` (`needs` says for what) and nvcc."""
    if device.type != "cuda":
        return f"needs CUDA, got {device.type}"
    if torch.cuda.get_device_capability(device) < capability:
        return f"needs {needs}"
    if nvcc() is None:
        return f"needs nvcc to build {source.name} (set CUDA_HOME or put nvcc on PATH)"
    return ""


def cache_dir() -> Path:
    return Path(
        os.environ.get("TOKENMILL_KERNEL_CACHE", Path.home() / ".cache" / "tokenmill" / "kernels")
    )


def load(source: Path, arch: str) -> ctypes.CDLL:
    """The library built from `source` for `arch` (e.g. "90" for sm_90), building it if needed.
    Raises RuntimeError with the compiler's output when the build fails."""
    key = (str(source), arch)
    with _lock:
        lib = _loaded.get(key)
        if lib is not None:
            return lib
        compiler = nvcc()
        if compiler is None:
            raise RuntimeError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, check=True
        ).stdout
        digest = hashlib.sha256(source.read_bytes() + version.encode() + arch.encode()).hexdigest()
        out = cache_dir() / f"{source.stem}-sm{arch}-{digest[:16]}.so"
        if out.exists():
            try:
                lib = _loaded[key] = ctypes.CDLL(str(out))
                return lib
            except OSError:  # built on another machine whose libraries differ: rebuild here
                out.unlink(missing_ok=True)
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
                part = Path(tmp) / out.name
                cmd = [
                    compiler, "-O3", "-shared", "-Xcompiler", "-fPIC", "-std=c++17",
                    f"-gencode=arch=compute_{arch},code=sm_{arch}", "-o", str(part), str(source),
                ]  # fmt: skip
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode:
                    raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
                os.replace(part, out)  # atomic: concurrent builders never load a partial file
        lib = _loaded[key] = ctypes.CDLL(str(out))
        return lib
