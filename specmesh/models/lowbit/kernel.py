"""The fused dequantize-matmul (kernel.cpp), built once per machine and cached; a torch fallback.

The C++ file has no torch headers, so it compiles in about two seconds with the system g++
(`$CXX` to pick another) and is loaded with ctypes; OpenMP comes from the libgomp torch has already
loaded. The library lands in `$SPECMESH_HOME/kernels/lowbit-<hash>.so`, the hash covering the
source, the flags, the compiler and the CPU's feature flags (it is built with -march=native), and is
written to a temporary name then renamed, so concurrent first uses are safe.

Without a compiler (or with SPECMESH_LOWBIT_KERNEL=torch) every call dequantizes the weight and
multiplies with `F.linear`: correct, batch-invariant only up to float rounding, and slow.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from specmesh.models.lowbit.qweight import QuantWeight

SOURCE = Path(__file__).with_name("kernel.cpp")
FLAGS = ["-std=c++20", "-O3", "-fopenmp", "-shared", "-fPIC"]
ARCH_FLAGS: tuple[list[str], ...] = (["-march=native"], [])  # the second try is for compilers without -march=native
ENV_KERNEL = "SPECMESH_LOWBIT_KERNEL"  # "torch" forces the fallback

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "lowbit_q4_f16": [_P, _I64, _I64, _P, _P, _P, _I64, _P, _INT],
    "lowbit_q4_f32": [_P, _I64, _I64, _P, _P, _P, _I64, _P, _INT],
    "lowbit_q8g32_f16": [_P, _I64, _I64, _P, _P, _I64, _P, _INT],
    "lowbit_q8g32_f32": [_P, _I64, _I64, _P, _P, _I64, _P, _INT],
    "lowbit_q8g16_f32": [_P, _I64, _I64, _P, _P, _I64, _P, _INT],
}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def _compiler_version(compiler: str) -> str:
    result = subprocess.run([compiler, "--version"], capture_output=True, text=True)
    return result.stdout.splitlines()[0] if result.returncode == 0 and result.stdout else ""


def _build(compiler: str, cache_dir: Path) -> Path:
    source = SOURCE.read_bytes()
    version = _compiler_version(compiler)
    errors = []
    for arch in ARCH_FLAGS:
        flags = FLAGS + arch
        key = hashlib.sha1(b"\0".join([source, " ".join(flags).encode(), version.encode(), _cpu_flags().encode()])).hexdigest()[:16]
        library = cache_dir / f"lowbit-{key}.so"
        if library.is_file():
            return library
        cache_dir.mkdir(parents=True, exist_ok=True)
        handle, staging = tempfile.mkstemp(prefix=".lowbit-", suffix=".so", dir=cache_dir)
        os.close(handle)
        result = subprocess.run([compiler, *flags, "-o", staging, str(SOURCE)], capture_output=True, text=True)
        if result.returncode == 0:
            os.replace(staging, library)
            return library
        os.unlink(staging)
        errors.append(result.stderr.strip().splitlines()[-1:] or ["failed"])
    raise RuntimeError(f"{compiler} could not build {SOURCE.name}: {errors}")


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None (fallback) when it cannot be built; warns once."""
    if os.environ.get(ENV_KERNEL, "").lower() == "torch":
        return None
    from specmesh.models.resolve import specmesh_home

    compiler = os.environ.get("CXX", "g++")
    try:
        if shutil.which(compiler) is None:
            raise RuntimeError(f"no C++ compiler {compiler!r} on PATH")
        lib = ctypes.CDLL(str(_build(compiler, specmesh_home() / "kernels")))
    except (OSError, RuntimeError) as exc:
        warnings.warn(f"low-bit kernel unavailable, using the slow torch fallback: {exc}", RuntimeWarning, stacklevel=2)
        return None
    for name, argtypes in _SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = None
    return lib


def _entry(lib: ctypes.CDLL, weight: QuantWeight):
    scale = "f16" if weight.scales.dtype == torch.float16 else "f32"
    if weight.layout == "q4":
        return getattr(lib, f"lowbit_q4_{scale}")
    name = f"lowbit_q8g{weight.group_size}_{scale}"
    return getattr(lib, name) if name in _SIGNATURES else None


def fused_matmul(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor | None:
    """x: float32 [M, in] -> [M, out] through the compiled kernel, or None when it cannot serve the call."""
    lib = library()
    if lib is None or x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    entry = _entry(lib, weight)
    if entry is None:
        return None
    x = x.contiguous()
    num_rows = x.shape[0]
    y = torch.empty(num_rows, weight.out_features, dtype=torch.float32)
    threads = torch.get_num_threads()
    if weight.layout == "q4":
        assert weight.offsets is not None
        entry(x.data_ptr(), num_rows, weight.in_features, weight.codes.data_ptr(), weight.scales.data_ptr(),
              weight.offsets.data_ptr(), weight.out_features, y.data_ptr(), threads)
    else:
        entry(x.data_ptr(), num_rows, weight.in_features, weight.codes.data_ptr(), weight.scales.data_ptr(),
              weight.out_features, y.data_ptr(), threads)
    return y


def reference_matmul(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """Dequantize, then `F.linear`: the fallback, and the prefill path (many rows)."""
    return torch.nn.functional.linear(x, weight.dequantize().to(x.dtype))
