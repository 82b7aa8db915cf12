"""The low-bit kernels (kernel.cpp: the matmul over 8-bit activations and low-bit weights; attention.cpp:
the fixed-order attention), built once per machine and cached; a torch fallback.

The C++ files have no torch headers, so they compile in about three seconds with the system g++
(`$CXX` to pick another) and are loaded with ctypes; OpenMP comes from the libgomp torch has already
loaded. The library lands in `$SPECMESH_HOME/kernels/lowbit-<hash>.so`, the hash covering the
sources, the flags, the compiler and the CPU's feature flags (it is built with -march=native), and is
written to a temporary name then renamed, so concurrent first uses are safe.

SPECMESH_LOWBIT_KERNEL picks the build: unset (or `native`) for -march=native, which takes the AVX-512
VNNI path where the CPU has it and the AVX2 path where it has AVX2; `avx2` (x86-64-v3) and `portable`
(x86-64-v2: plain loops) build for an older CPU to compare against; every build gives the same numbers
bit for bit. Without a compiler (or with SPECMESH_LOWBIT_KERNEL=torch) every matmul quantizes the activations,
dequantizes the weight and multiplies with `F.linear` (`reference_matmul`), and attention is SDPA:
the same model up to float rounding, batch-invariant only up to that rounding, and slow.
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

SOURCES = [Path(__file__).with_name("kernel.cpp"), Path(__file__).with_name("attention.cpp")]
FLAGS = ["-std=c++20", "-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]  # no fusing but what the source spells
ARCH_FLAGS: tuple[list[str], ...] = (["-march=native"], [])  # the second try is for compilers without -march=native
ENV_KERNEL = "SPECMESH_LOWBIT_KERNEL"  # "torch" forces the fallback; a key of BUILDS picks the build
BUILDS: dict[str, tuple[list[str], ...]] = {
    "native": ARCH_FLAGS,
    "avx2": (["-march=x86-64-v3"],),  # AVX2, FMA, F16C; no AVX-512
    "portable": (["-march=x86-64-v2"],),  # no AVX2: the plain loops
}
ACTIVATION_BLOCK = 32  # inputs per activation scale (kernel.cpp's BLOCK)

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "lowbit_q4_f16": [_P, _I64, _I64, _P, _P, _P, _I64, _P, _INT],
    "lowbit_q4_f32": [_P, _I64, _I64, _P, _P, _P, _I64, _P, _INT],
    "lowbit_q8g32_f16": [_P, _I64, _I64, _P, _P, _I64, _P, _INT],
    "lowbit_q8g32_f32": [_P, _I64, _I64, _P, _P, _I64, _P, _INT],
    "lowbit_q8g16_f32": [_P, _I64, _I64, _P, _P, _I64, _P, _INT],
    "lowbit_q8g16_f16": [_P, _I64, _I64, _P, _P, _I64, _P, _INT],
    "lowbit_attention": [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _I64, _I64, _P, _I64, _P, ctypes.c_float, _P, _INT],
}


def cpu_flags() -> str:
    """This CPU's feature-flags line of /proc/cpuinfo ("" where there is none)."""
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


def build(compiler: str, cache_dir: Path, arch_flags: tuple[list[str], ...] = ARCH_FLAGS,
          sources: list[Path] = SOURCES, name: str = "lowbit") -> Path:
    """The shared library `name`-<hash>.so of `sources` for the first of `arch_flags` the compiler
    accepts (cached by content hash)."""
    source = b"\0".join(path.read_bytes() for path in sources)
    version = _compiler_version(compiler)
    errors = []
    for arch in arch_flags:
        flags = FLAGS + arch
        key = hashlib.sha1(b"\0".join([source, " ".join(flags).encode(), version.encode(), cpu_flags().encode()])).hexdigest()[:16]
        library = cache_dir / f"{name}-{key}.so"
        if library.is_file():
            return library
        cache_dir.mkdir(parents=True, exist_ok=True)
        handle, staging = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=cache_dir)
        os.close(handle)
        result = subprocess.run([compiler, *flags, "-o", staging, *map(str, sources)], capture_output=True, text=True)
        if result.returncode == 0:
            os.replace(staging, library)
            return library
        os.unlink(staging)
        errors.append(result.stderr.strip().splitlines()[-1:] or ["failed"])
    raise RuntimeError(f"{compiler} could not build {', '.join(p.name for p in sources)}: {errors}")


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None (fallback) when it cannot be built; warns once."""
    choice = os.environ.get(ENV_KERNEL, "").lower() or "native"
    if choice == "torch":
        return None
    if choice not in BUILDS:
        raise ValueError(f"{ENV_KERNEL}={choice!r}: expected one of {', '.join([*BUILDS, 'torch'])}")
    from specmesh.models.resolve import specmesh_home

    compiler = os.environ.get("CXX", "g++")
    try:
        if shutil.which(compiler) is None:
            raise RuntimeError(f"no C++ compiler {compiler!r} on PATH")
        return load(build(compiler, specmesh_home() / "kernels", BUILDS[choice]))
    except (OSError, RuntimeError) as exc:
        warnings.warn(f"low-bit kernel unavailable, using the slow torch fallback: {exc}", RuntimeWarning, stacklevel=2)
        return None


def load(path: Path) -> ctypes.CDLL:
    """A built kernel library with its entry points typed."""
    lib = ctypes.CDLL(str(path))
    for name, argtypes in _SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = None
    lib.lowbit_has_vnni.restype = ctypes.c_int
    lib.lowbit_has_avx2.restype = ctypes.c_int
    return lib


def _entry(lib: ctypes.CDLL, weight: QuantWeight):
    scale = "f16" if weight.scales.dtype == torch.float16 else "f32"
    if weight.layout == "q4":
        return getattr(lib, f"lowbit_q4_{scale}")
    name = f"lowbit_q8g{weight.group_size}_{scale}"
    return getattr(lib, name) if name in _SIGNATURES else None


class BoundMatmul:
    """x: float32 [M, in] -> [M, out] through one entry point of the compiled kernel, with the weight's
    pointers resolved once (it holds the weight, so they stay valid)."""

    def __init__(self, entry, weight: QuantWeight):
        self.entry, self.weight = entry, weight
        tensors = [weight.codes, weight.scales] + ([] if weight.offsets is None else [weight.offsets])
        self.pointers = [t.data_ptr() for t in tensors]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.weight.out_features, dtype=torch.float32)
        self.entry(x.data_ptr(), x.shape[0], self.weight.in_features, *self.pointers, self.weight.out_features,
                   y.data_ptr(), torch.get_num_threads())
        return y


def bind_matmul(weight: QuantWeight, lib: ctypes.CDLL | None = None) -> BoundMatmul | None:
    """The kernel bound to `weight` (`lib`, default the cached build); None when it cannot serve this weight."""
    lib = lib or library()
    entry = None if lib is None or weight.codes.device.type != "cpu" else _entry(lib, weight)
    return None if entry is None else BoundMatmul(entry, weight)


def fused_matmul(x: torch.Tensor, weight: QuantWeight, lib: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """One call through the compiled kernel, or None when it cannot serve it (see `bind_matmul`)."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    matmul = bind_matmul(weight, lib)
    return None if matmul is None else matmul(x)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] with each row's blocks of 32 rounded to int8 codes times one scale (what the kernel multiplies).

    Per block: d = max|x| / 127, q = round(x * (127 / max|x|)) clamped to -127..127 (0 for an all-zero block);
    returns d * q in float32. The operations match kernel.cpp's, so the kernel's integer dot products meet the
    same codes.
    """
    rows, inputs = x.shape
    blocks = x.float().reshape(rows, inputs // ACTIVATION_BLOCK, ACTIVATION_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = amax / 127.0
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inverse).clamp_(-127.0, 127.0)
    return (codes * scale).reshape(rows, inputs)


def reference_matmul(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """The kernel's numbers with sgemm: quantize the activations, dequantize the weight, `F.linear`.

    Equal to the kernel up to float rounding; the fallback without a compiler, and the prefill path (many rows).
    """
    return torch.nn.functional.linear(quantize_activations(x), weight.dequantize()).to(x.dtype)


def invariant_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_slots: torch.Tensor | None,
                        first_slot: int, num_keys: int, mask: torch.Tensor | None, max_new: int,
                        rows: torch.Tensor | None, scale: float, lib: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """attention.cpp over the cache layer: q [N, heads, head_dim] float32 (rows may be strided) -> [N, heads *
    head_dim]; None when the compiled library is unavailable.

    keys, values: [slots, kv_heads, head_dim]; key_slots [B, num_keys] (None: first_slot + j); mask [B, 1,
    max_new, num_keys] bool (None: every key visible); rows [N] the padded row b * max_new + t of each query
    (None: one sequence, no padding). lib: a built kernel library (default the cached build).
    """
    lib = lib or library()
    if lib is None or q.device.type != "cpu" or q.dtype != torch.float32 or keys.dtype != torch.float32:
        return None
    num_rows, heads, head_dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    assert keys.is_contiguous() and values.is_contiguous()
    mask = None if mask is None else mask.contiguous()
    key_slots = None if key_slots is None else key_slots.contiguous()
    rows = None if rows is None else rows.contiguous()
    out = torch.empty(num_rows, heads * head_dim, dtype=torch.float32)
    lib.lowbit_attention(q.data_ptr(), num_rows, q.stride(0), heads, keys.shape[1], head_dim, keys.data_ptr(),
                         values.data_ptr(), None if key_slots is None else key_slots.data_ptr(), first_slot, num_keys,
                         None if mask is None else mask.data_ptr(), max_new, None if rows is None else rows.data_ptr(),
                         scale, out.data_ptr(), torch.get_num_threads())
    return out
