"""Native forward of the Llama family over packed tokens of a ragged batch, reading/writing paged KV.

Shapes: N = new tokens of the whole batch packed end to end, B = sequences, T = max new tokens of one
sequence, K = max keys (cached + new) of one sequence. Linear layers, norms and rope run on the packed
[N, ...] rows; only attention pads to [B, T] queries x [B, K] keys and masks (see `AttentionBatch`).

Per layer: x += o(attn(rope(q), rope(k), v)); x += down(silu(gate(x')) * up(x')), with RMSNorm before
each; q/k/v and gate/up are fused into one matrix each (fewer, larger matmuls).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specmesh.kv.cache import PagedKVCache
from specmesh.models import fastpath
from specmesh.models.config import LlamaFamilyConfig
from specmesh.models.fused import add_rms_norm, rms_norm, rope_and_write, silu_mul
from specmesh.models.linear import ConcatLinear, Linear, fused_linear, make_linear
from specmesh.models.lowbit.kernel import invariant_attention
from specmesh.models.lowbit.qlinear import QuantLinear
from specmesh.models.lowbit.qweight import QuantWeight
from specmesh.models.paged_attention import PagedBatch, paged_attention
from specmesh.models.rope import apply_rope, rope_tables
from specmesh.models.weights import load_tensors


@dataclass
class AttentionBatch:
    """Per-forward attention metadata, shared by every layer."""

    positions: torch.Tensor  # [N] rope position of each new token
    new_slots: torch.Tensor  # [N] KV slot each new token is written to
    key_slots: torch.Tensor | None  # [B, K] KV slots each sequence reads (padded with any valid slot)
    masks: dict  # sliding window (None = full) -> [B, 1, T, K] bool, True = may attend; or None
    query_index: torch.Tensor | None  # [B * T] packed row of each padded query (None: B == 1)
    output_index: torch.Tensor | None  # [N] padded row of each packed token (None: B == 1)
    batch_size: int
    max_new: int  # T
    key_range: tuple[int, int] | None = None  # (first slot, K) when B == 1 and its slots are contiguous
    # set instead of the masks, slots and indices above: the sequences split into parts by their number
    # of new tokens (decode rows apart from a draft's), each padded only to its own T; per part the
    # packed rows [n] of its tokens and its own attention batch
    parts: list[tuple[torch.Tensor, AttentionBatch]] | None = None


@dataclass
class DecoderLayer:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear | QuantLinear | ConcatLinear  # hidden -> (num_heads + 2 * num_kv_heads) * head_dim
    qk_norm: torch.Tensor | None  # [num_heads + num_kv_heads, head_dim]: Qwen3's q_norm per q head, k_norm per k head
    o: Linear | QuantLinear  # num_heads * head_dim -> hidden
    post_norm: torch.Tensor
    gate_up: Linear | QuantLinear | ConcatLinear  # hidden -> 2 * intermediate
    down: Linear | QuantLinear  # intermediate -> hidden
    sliding_window: int | None


class LlamaFamilyModel:
    def __init__(self, config: LlamaFamilyConfig, tensors: dict, dtype: torch.dtype, device: torch.device, kernel: str):
        """tensors: HF name -> tensor, or QuantWeight for low-bit matrices (float32 activations on CPU)."""
        self.config = config
        self.dtype = dtype
        self.device = device
        self.kernel = kernel
        c = config

        def take(name: str):
            value = tensors.pop(name)
            return value if isinstance(value, QuantWeight) else value.to(device=device, dtype=dtype)

        def maybe(name: str):
            return take(name) if name in tensors else None

        # the float32 fast path multiplies the row-major weights itself; a packed oneDNN copy beside them
        # serves the longer forwards (prefill), where its blocked matmul is faster than sgemm
        has_quantized = any(isinstance(v, QuantWeight) for v in tensors.values())
        fast = fastpath.eligible(c, dtype, device, kernel, has_quantized)

        self.embed = take("model.embed_tokens.weight")  # [vocab, hidden] (a QuantWeight when tied to a low-bit lm_head)
        self.layers: list[DecoderLayer] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            qkv_b = [take(p + f"self_attn.{n}_proj.bias") for n in "qkv"] if c.qkv_bias else None
            gate_up_b = [take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")] if c.mlp_bias else None
            self.layers.append(
                DecoderLayer(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv=fused_linear([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"], qkv_b, kernel, fast),
                    qk_norm=self._qk_norm(take, p) if c.qk_norm else None,
                    o=make_linear(take(p + "self_attn.o_proj.weight"), maybe(p + "self_attn.o_proj.bias"), kernel, fast),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=fused_linear([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], gate_up_b, kernel,
                                         fast),
                    down=make_linear(take(p + "mlp.down_proj.weight"), maybe(p + "mlp.down_proj.bias"), kernel, fast),
                    sliding_window=c.sliding_windows[i],
                )
            )
        self.final_norm = take("model.norm.weight")
        lm_head = maybe("lm_head.weight")
        if lm_head is None or c.tie_word_embeddings:
            lm_head = self.embed
        # int8-dynamic drafts keep the vocab projection in the model dtype: it is the most sensitive matmul
        self.lm_head = make_linear(lm_head, None, "onednn" if kernel == "int8-dynamic" else kernel, fast)
        self.cos, self.sin = rope_tables(c.rope_parameters, c.head_dim, c.max_context, dtype, device)
        self.scale = c.head_dim**-0.5
        # low-bit layers round activations to 8 bits, which would turn SDPA's batch-dependent last bits into
        # different codes: their attention is the fixed-order kernel (attention.cpp), so rows stay bit-identical
        self.invariant_attention = any(isinstance(layer.qkv, QuantLinear) for layer in self.layers)
        self.fast: fastpath.FastForward | None = fastpath.FastForward(self) if fast else None

    def _qk_norm(self, take, prefix: str) -> torch.Tensor:
        c = self.config
        q_norm = take(prefix + "self_attn.q_norm.weight").expand(c.num_heads, c.head_dim)
        k_norm = take(prefix + "self_attn.k_norm.weight").expand(c.num_kv_heads, c.head_dim)
        return torch.cat([q_norm, k_norm]).contiguous()

    @classmethod
    def from_folder(cls, folder: str | Path, hf_config, dtype: torch.dtype, device: torch.device, kernel: str) -> LlamaFamilyModel:
        config = LlamaFamilyConfig.from_hf(hf_config)
        return cls(config, load_tensors(folder, dtype), dtype, device, kernel)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads (embedding rows excluded, tied lm_head counted once)."""
        total = self.lm_head.nbytes
        for layer in self.layers:
            total += layer.qkv.nbytes + layer.o.nbytes + layer.gate_up.nbytes + layer.down.nbytes
        return total

    def forward(self, token_ids: torch.Tensor, batch: AttentionBatch, cache: PagedKVCache, logits_rows: torch.Tensor) -> torch.Tensor:
        """token_ids: [N] -> float32 logits [len(logits_rows), vocab] of the packed rows `logits_rows`."""
        c = self.config
        num_tokens = token_ids.shape[0]
        if isinstance(self.embed, QuantWeight):
            x = self.embed.dequantize(token_ids)  # [N, hidden]
        else:
            x = F.embedding(token_ids, self.embed)  # [N, hidden]
        cos = self.cos[batch.positions].unsqueeze(1)  # [N, 1, head_dim]
        sin = self.sin[batch.positions].unsqueeze(1)
        num_qk_heads = c.num_heads + c.num_kv_heads
        eps = c.rms_norm_eps
        for index, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, eps)
            qkv = layer.qkv(h).view(num_tokens, num_qk_heads + c.num_kv_heads, c.head_dim)
            qk = qkv[:, :num_qk_heads]  # q and k heads go through norm and rope together
            if layer.qk_norm is not None:
                qk = rms_norm(qk, layer.qk_norm, eps)
            qk = apply_rope(qk, cos, sin)
            q, k, v = qk[:, : c.num_heads], qk[:, c.num_heads :], qkv[:, num_qk_heads:]
            cache.write(index, batch.new_slots, k, v)
            attn = self._attention(index, q, batch, cache, layer.sliding_window)
            x = x + layer.o(attn)
            h = rms_norm(x, layer.post_norm, eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        h = rms_norm(x.index_select(0, logits_rows), self.final_norm, eps)
        return self.lm_head(h).float()

    def forward_paged(self, token_ids: torch.Tensor, positions: torch.Tensor, new_slots: torch.Tensor,
                      paged: PagedBatch, cache: PagedKVCache) -> torch.Tensor:
        """The fixed-shape step (specmesh/models/graphs.py): token_ids [B * T] -> float32 logits [B * T, vocab].
        The layers of `forward` with attention read in place through the block table (`paged_attention`) and
        the elementwise work fused (specmesh/models/fused.py); plain weights, no sliding windows."""
        c = self.config
        num_tokens = token_ids.shape[0]
        x = F.embedding(token_ids, self.embed)  # [N, hidden]
        num_qk_heads = c.num_heads + c.num_kv_heads
        eps = c.rms_norm_eps
        delta = None  # what the last layer adds to x
        for index, layer in enumerate(self.layers):
            x, h = add_rms_norm(x, delta, layer.input_norm, eps)
            qkv = layer.qkv(h).view(num_tokens, num_qk_heads + c.num_kv_heads, c.head_dim)
            qk = qkv[:, :num_qk_heads]
            if layer.qk_norm is not None:
                qk = rms_norm(qk, layer.qk_norm, eps)
            k_cache, v_cache = cache.k[index], cache.v[index]
            q = rope_and_write(qk, qkv[:, num_qk_heads:], self.cos, self.sin, positions, k_cache, v_cache, new_slots,
                               c.num_heads)
            x, h = add_rms_norm(x, layer.o(paged_attention(q, k_cache, v_cache, paged, self.scale)), layer.post_norm, eps)
            delta = layer.down(silu_mul(layer.gate_up(h)))
        return self.lm_head(add_rms_norm(x, delta, self.final_norm, eps)[1]).float()

    def _attention(self, layer_index: int, q: torch.Tensor, batch: AttentionBatch, cache: PagedKVCache,
                   window: int | None) -> torch.Tensor:
        """q: [N, heads, head_dim] -> [N, heads * head_dim]; `window`: the layer's sliding window (None: full)."""
        if batch.parts is not None:
            out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
            for rows, part in batch.parts:
                out.index_copy_(0, rows, self._attention(layer_index, q.index_select(0, rows), part, cache, window))
            return out
        mask = batch.masks[window]
        if self.invariant_attention:
            out = self._invariant_attention(layer_index, q, batch, cache, mask)
            if out is not None:
                return out
        if batch.key_range is not None:  # one sequence whose slots are contiguous: a view, no copy
            first, num_keys = batch.key_range
            keys = cache.k[layer_index, first : first + num_keys].unsqueeze(0)
            values = cache.v[layer_index, first : first + num_keys].unsqueeze(0)
        else:
            assert batch.key_slots is not None  # AttentionBatch sets key_range or key_slots
            keys, values = cache.gather(layer_index, batch.key_slots)  # [B, K, kv_heads, head_dim]
        num_batch, max_new = batch.batch_size, batch.max_new
        if batch.query_index is None:
            queries = q.unsqueeze(0)
        else:
            queries = q.index_select(0, batch.query_index).view(num_batch, max_new, *q.shape[1:])
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=True,
        )  # [B, heads, T, head_dim]
        out = out.transpose(1, 2).reshape(num_batch * max_new, -1)
        if batch.output_index is not None:
            out = out.index_select(0, batch.output_index)
        return out

    def _invariant_attention(self, layer_index: int, q: torch.Tensor, batch: AttentionBatch, cache: PagedKVCache, mask):
        if batch.key_range is not None:
            first, num_keys = batch.key_range
        else:
            assert batch.key_slots is not None
            first, num_keys = 0, batch.key_slots.shape[1]
        return invariant_attention(q, cache.k[layer_index], cache.v[layer_index], batch.key_slots, first, num_keys,
                                   mask, batch.max_new, batch.output_index, self.scale)
