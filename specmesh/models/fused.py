"""The fixed-shape step's elementwise work in fewer kernels (specmesh/models/graphs.py).

A decode step of a small model on a GPU is mostly tiny elementwise kernels, a few microseconds each
even when a CUDA graph launches them: per layer a residual add, two norms of four kernels each, rope
(five), two KV writes and a copy of q, silu and a product. Three fused kernels do that work:
- `add_rms_norm`: x + delta, then RMSNorm of the sum (both written): one kernel for add and norm;
- `rope_and_write`: rope on q and k, K and V written to their cache slots, q out contiguous;
- `silu_mul`: silu(gate) * up.
Each rounds where the eager ops round (to the model dtype after the add, after the norm, after each
product of rope, after silu), so on the same inputs they give the eager ops' values.

Triton kernels on CUDA (specmesh/models/fused_triton.py); elsewhere these torch references, the
eager ops themselves (CPU tests of the static step run them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specmesh.models.paged_attention import triton_runs
from specmesh.models.rope import apply_rope


def _kernels(x: torch.Tensor):
    """The Triton module where it runs (`triton_runs`), else None."""
    if triton_runs(x):
        from specmesh.models import fused_triton

        return fused_triton
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalise in at least float32, cast back, then scale."""
    compute = x if x.dtype in (torch.float32, torch.float64) else x.float()
    return weight * F.rms_norm(compute, compute.shape[-1:], None, eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)); delta None: (x, rms_norm(x)). x, delta: [N, hidden]."""
    kernels = _kernels(x)
    if kernels is not None:
        return kernels.add_rms_norm(x, delta, weight, eps)
    total = x if delta is None else x + delta
    return total, rms_norm(total, weight, eps)


def rope_and_write(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int) -> torch.Tensor:
    """qk: [N, heads + kv_heads, head_dim] (q heads first), v: [N, kv_heads, head_dim]; cos, sin: the
    model's tables [positions, head_dim]. Writes rope(k) and v at `slots` of the layer's caches
    [slots, kv_heads, head_dim] and returns rope(q) [N, heads, head_dim], contiguous."""
    kernels = _kernels(qk)
    if kernels is not None:
        return kernels.rope_and_write(qk, v, cos, sin, positions, k_cache, v_cache, slots, num_heads)
    qk = apply_rope(qk, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    k_cache.index_copy_(0, slots, qk[:, num_heads:])
    v_cache.index_copy_(0, slots, v)
    return qk[:, :num_heads].contiguous()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [N, 2 * intermediate] (gate half first) -> silu(gate) * up [N, intermediate]."""
    kernels = _kernels(gate_up)
    if kernels is not None:
        return kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
