"""The CPU fast path: a whole forward of a few rows in one call of fastpath.cpp, for float32 and bfloat16 models.

Why: a decode step of the default model (30 layers, 135M parameters) is ~540 MB of weights streamed once;
at the machine's ~17-25 GB/s that is 22-31 ms. Torch's eager forward adds ~900 operator calls per step (a few
microseconds of Python and dispatch each) on top of oneDNN's one-row matmuls. fastpath.cpp runs the layers,
the attention over the paged cache (reading each row's keys through its block table, no gather copies),
the KV writes and the lm head in one ctypes call, its threads splitting each matmul's outputs. Its matrices
are packed once into panels of 16 outputs (`packed`), so each input value meets a panel's weights in fused
multiply-adds with no horizontal sums: one row streams the weights at the memory's pace, and a batch of rows
(16 sessions' decode steps, a verify chain) reuses each loaded panel across a tile of rows (up to 6 with AVX2,
16 with AVX-512; fastpath.cpp's gemv). The packed copies
sit beside the torch path's weights (long prefills use those): the fast path doubles a float32 model's memory.

Used by `NativeEngine.forward` for a batch of at most `MAX_ROWS` new tokens (decode steps, verify chains and
trees, a batch of sessions' rounds), and for short prefills (`serves`) where it beats the torch path on this
machine (`long_prefill_on_fast_path`); longer forwards keep the torch path.
Each row's numbers do not depend on the other rows or on the thread count (fastpath.cpp says how), so a
verify forward gives bit for bit what one-token steps would: speculative decoding equals plain decoding.
Float rounding differs from the torch path's in the last bits, as oneDNN's differs from MKL's.

A bfloat16 model's matrices, embedding and KV cache stay bfloat16 (half the bytes a step streams: the default
model's step 7 ms against float32's 11 on 2 cores of the AVX-512 VM, 12.8 against 21.5 on one), widened to
float32 as they are read; its activations are float32, where the torch path rounds each to bfloat16, so its
logits are closer to the float32 forward of the same weights than the torch path's (tests/engine/
test_fastpath_rows.py). That is what a bfloat16 self-draft runs.

Eligible: float32 or bfloat16 on the CPU, plain float weights (no low-bit layers: those keep their batch-invariant
kernels), SiLU MLP, every matrix's outer size a multiple of 4 and inner size a multiple of 8. Built once
per machine with the system g++ like the low-bit kernels (specmesh/models/lowbit/kernel.py), cached under
$SPECMESH_HOME/kernels; without a compiler, or with SPECMESH_FASTPATH=0, the torch path serves everything.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from specmesh.models.rope import rope_tables

SOURCE = Path(__file__).with_name("fastpath.cpp")
ENV_FASTPATH = "SPECMESH_FASTPATH"  # "0": the torch path only
ENV_PREFILL = "SPECMESH_FASTPATH_PREFILL"  # fast | torch: where long float32 prefills go (`long_prefill_on_fast_path`)
MAX_ROWS = 32  # forwards of at most this many new tokens always take the fast path (decode, verify, batches)
MAX_MEAN_KEYS = 64  # longer ones when their rows see at most this many keys on average (`serves`)
STORAGE = (torch.float32, torch.bfloat16)  # model dtypes it serves: fastpath.cpp's `forward<float>`, `forward<bf16>`
PANEL = 16  # outputs per packed weight panel (fastpath.cpp's PANEL)
LAYER_FIELDS = 12  # fastpath.cpp's LAYER_FIELDS
HEADER = ("n", "num_seqs", "max_blocks", "block_size", "num_logits", "tree_width", "cache_slots")

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def enabled() -> bool:
    return os.environ.get(ENV_FASTPATH, "1") != "0"


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled fast path, or None (the torch path) when it cannot be built; warns once."""
    from specmesh.models.lowbit.kernel import build
    from specmesh.models.resolve import specmesh_home

    compiler = os.environ.get("CXX", "g++")
    try:
        if shutil.which(compiler) is None:
            raise RuntimeError(f"no C++ compiler {compiler!r} on PATH")
        return load(build(compiler, specmesh_home() / "kernels", sources=[SOURCE], name="fastpath"))
    except (OSError, RuntimeError) as exc:
        warnings.warn(f"CPU fast path unavailable, using the torch forward: {exc}", RuntimeWarning, stacklevel=2)
        return None


def load(path: Path) -> ctypes.CDLL:
    """A build of fastpath.cpp (`library`'s, or one for another instruction set: the tests'), its entries typed."""
    lib = ctypes.CDLL(str(path))
    for entry in (lib.fastpath_forward, lib.fastpath_forward_bf16):
        entry.argtypes = [_P, ctypes.c_float, ctypes.c_float, _P, _P, _P, _P, _INT]
        entry.restype = None
    lib.fastpath_layer_fields.restype = _I64
    assert lib.fastpath_layer_fields() == LAYER_FIELDS
    return lib


def serves(num_rows: int, attention_pairs: int, dtype: torch.dtype = torch.float32) -> bool:
    """Whether a forward of `num_rows` new tokens whose rows see `attention_pairs` keys in all takes the fast
    path: a few rows always (so a verify chain gives its one-token steps' numbers); a float32 prefill when its
    rows see few keys, since the matmuls here beat the torch path's at any row count but the attention is a
    plain loop over keys. Measured on the default model (2 cores, torch path vs this one): a 37-token prompt
    186 vs 85-108 ms, 64 tokens 247 vs 157, 128 tokens 376 vs 346, 16 prompts of ~50 tokens (799 rows)
    2.8-3.5 vs 2.1-2.7 s; 512 tokens 1.3 vs 1.7 s, and 512 after 1536 cached 2.2 vs 5.4 s. A bfloat16 prefill
    goes to the torch path where the CPU multiplies bfloat16 itself (`bf16_matmul_in_hardware`): oneDNN's
    bf16 matmuls then beat these widening loops (AVX-512 VM, 2 cores: 55 tokens 54 vs 87 ms, 128 tokens
    99 vs 206)."""
    if num_rows <= MAX_ROWS:
        return True
    if dtype == torch.bfloat16 and bf16_matmul_in_hardware():
        return False
    return attention_pairs <= num_rows * MAX_MEAN_KEYS


@functools.lru_cache(maxsize=1)
def bf16_matmul_in_hardware() -> bool:
    """Whether this CPU has bfloat16 dot products (AVX-512 BF16 or AMX), which oneDNN's bf16 matmuls use."""
    from specmesh.models.lowbit.kernel import cpu_flags

    flags = cpu_flags().split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def eligible(config, dtype: torch.dtype, device: torch.device, kernel: str, has_quantized: bool) -> bool:
    """Whether a model of this config, dtype, device and linear kernel can run on the fast path."""
    c = config
    if not enabled() or dtype not in STORAGE or device.type != "cpu" or has_quantized:
        return False
    if kernel not in ("plain", "onednn"):  # int8-dynamic drafts keep their own kernel
        return False
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    if any(size % 4 for size in (qkv, c.hidden_size, c.intermediate_size, c.vocab_size)):
        return False
    if any(size % 8 for size in (c.hidden_size, c.num_heads * c.head_dim, c.intermediate_size, c.head_dim)):
        return False
    if c.num_heads % c.num_kv_heads:
        return False
    return library() is not None


def long_prefill_on_fast_path(key: str, measure: Callable[[], tuple[float, float] | None]) -> bool:
    """Whether float32 forwards of more than MAX_ROWS rows that `serves` takes (prefills of short prompts, alone
    or batched) go to the fast path on this machine, or to the torch path's oneDNN matmuls. Which is faster
    depends on the CPU: on an AVX2 VM the fast path (16 prompts' prefill 2.1-2.7 s against 2.8-3.5); on an
    AVX-512 Xeon oneDNN's while fastpath.cpp multiplied and added apart (16 prompts of 60 tokens 0.89 s against
    1.47, one of 64 tokens 89 ms against 106), and since it fuses them the fast path (0.96 s against 0.96, one of
    64 tokens 72 ms against 97).
    So it is measured, once per machine, model shape (`key`) and build of fastpath.cpp, by `measure` -> (fast s,
    torch s), and remembered under $SPECMESH_HOME/kernels: a machine keeps its choice, so its outputs stay reproducible
    across restarts (`measure` -> None: it could not measure; the fast path, not remembered).
    $SPECMESH_FASTPATH_PREFILL = fast | torch decides instead."""
    forced = os.environ.get(ENV_PREFILL, "")
    if forced in ("fast", "torch"):
        return forced == "fast"
    if forced:
        raise ValueError(f"${ENV_PREFILL} must be fast or torch, not {forced!r}")
    from specmesh.models.lowbit.kernel import cpu_flags
    from specmesh.models.resolve import specmesh_home

    lib = library()  # its file name carries the build's hash: a changed kernel is measured afresh
    build = Path(lib._name).name if lib is not None else ""
    key = hashlib.sha1(f"{key}|{cpu_flags()}|{torch.get_num_threads()}|{build}".encode()).hexdigest()[:16]
    path = specmesh_home() / "kernels" / "long-prefill.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key] == "fast"
    measured = measure()
    if measured is None:
        return True
    fast_s, torch_s = measured
    choice = "fast" if fast_s <= torch_s else "torch"
    try:  # another process of this machine (a second replica, the Draft service) may have measured meanwhile:
        known = json.loads(path.read_text())  # its choice stands, so processes of one machine agree
    except (OSError, ValueError):
        pass
    choice = known.setdefault(key, choice)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_suffix(f".{os.getpid()}.tmp")
        staging.write_text(json.dumps(known, indent=1, sort_keys=True))
        staging.replace(path)
    except OSError:
        pass  # a read-only home: measured again by the next process
    return choice == "fast"


def packed(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] matrix as fastpath.cpp's gemv reads it: panels of PANEL outputs, [panel][in][PANEL], the last
    panel padded with zero rows, in the matrix's dtype. A copy beside the original, which the torch path keeps
    using."""
    out, inner = weight.shape
    panels = -(-out // PANEL)
    padded = torch.zeros(panels * PANEL, inner, dtype=weight.dtype)
    padded[:out] = weight.detach()
    return padded.view(panels, PANEL, inner).transpose(1, 2).contiguous()


class FastForward:
    """One model's fast path: the pointer table of its weights, built once (it holds the tensors)."""

    def __init__(self, model):
        c = model.config
        lib = library()
        assert lib is not None
        self.lib: ctypes.CDLL = lib
        self.vocab_size = c.vocab_size
        self.eps = float(c.rms_norm_eps)
        self.scale = float(model.scale)
        self.dtype = model.dtype  # the matrices', the embedding's and the KV cache's
        self.entry = lib.fastpath_forward if self.dtype == torch.float32 else lib.fastpath_forward_bf16
        self._keep: list[torch.Tensor] = []
        # the rope tables in float32 whatever the model's dtype: the fast path's activations are float32
        cos, sin = rope_tables(c.rope_parameters, c.head_dim, c.max_context, torch.float32, model.device)
        fields = [c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                  c.vocab_size, self._matrix(model.embed), self._ptr(model.final_norm),
                  self._matrix(packed(model.lm_head.weight)), self._ptr(cos), self._ptr(sin)]
        inter = c.intermediate_size
        for layer in model.layers:
            gate_up = layer.gate_up.weight
            fields += [self._ptr(layer.input_norm), self._matrix(packed(layer.qkv.weight)), self._ptr(layer.qkv.bias),
                       self._ptr(layer.qk_norm), self._matrix(packed(layer.o.weight)), self._ptr(layer.o.bias),
                       self._ptr(layer.post_norm),
                       self._matrix(torch.cat([packed(gate_up[:inter]), packed(gate_up[inter:])])),
                       self._ptr(layer.gate_up.bias), self._matrix(packed(layer.down.weight)), self._ptr(layer.down.bias),
                       layer.sliding_window or 0]
        self.table = torch.tensor(fields, dtype=torch.long)

    def _ptr(self, tensor: torch.Tensor | None) -> int:
        """A float32 vector's address (norms, biases, rope tables: a float32 copy of a bfloat16 model's)."""
        if tensor is None:
            return 0
        return self._keep_address(tensor.float().contiguous())

    def _matrix(self, tensor: torch.Tensor) -> int:
        """A matrix's (or the embedding's) address, in the model's dtype."""
        assert tensor.dtype == self.dtype
        return self._keep_address(tensor)

    def _keep_address(self, tensor: torch.Tensor) -> int:
        assert tensor.device.type == "cpu" and tensor.is_contiguous()
        self._keep.append(tensor)
        return tensor.data_ptr()

    def __call__(self, cache, meta: list[int], num_logits: int) -> torch.Tensor:
        """meta: fastpath.cpp's per-call layout -> float32 logits [num_logits, vocab]."""
        meta_t = torch.tensor(meta, dtype=torch.long)
        logits = torch.empty(num_logits, self.vocab_size, dtype=torch.float32)
        assert cache.k.is_contiguous() and cache.v.is_contiguous() and cache.k.dtype == self.dtype
        self.entry(self.table.data_ptr(), self.eps, self.scale, cache.k.data_ptr(), cache.v.data_ptr(),
                                  meta_t.data_ptr(), logits.data_ptr(), torch.get_num_threads())
        return logits
