"""Forward-time cost models: what one engine forward costs on one device, in milliseconds.

A forward is described as the batcher sees it: `rows` sequences, `tokens_per_row` new tokens each
(1 for a decode step, 1 + k for a verify, a chunk for a prefill; a ragged batch uses its mean) and
`context` cached tokens per row (the mean). Two sources:

- `CostTable`: times measured on the real engine (`specmesh.sim.profile.profile_engine`) on a grid
  of (rows, tokens_per_row, context), multilinear interpolation between grid points and linear
  extrapolation past the last two (compute grows linearly with tokens), never below the smallest
  time measured.
- `RooflineCost`: for devices we do not have. time = max(FLOPs / (peak FLOP/s * mfu),
  bytes / (bandwidth * mbu)) + overhead_ms, from the model's dimensions (`ModelDims`) and the
  device's specs (`DeviceSpec`). Bytes are the weights (read once per forward, whatever the batch)
  plus every row's KV cache; FLOPs are 2 per parameter per token plus attention over the context.

Logits: a verify needs the next-token logits at every new token, a prefill only at the last. Both
the profiler and the roofline take logits at every new token when `tokens_per_row <=
VERIFY_LOGITS_MAX_TOKENS`, else at the last one (the LM head is a large share of a small model).

Worked example (`LinearCost`, the test double): base 5 ms + 0.5 ms per token in the batch:
    >>> LinearCost(base_ms=5.0, per_token_ms=0.5).forward_ms(rows=4, tokens_per_row=3, context=100)
    11.0
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

VERIFY_LOGITS_MAX_TOKENS = 32  # up to this many new tokens per row, logits at every one (a verify)


def logits_rows(rows: int, tokens_per_row: float) -> float:
    """How many rows of logits a forward computes (the LM head's share of the work)."""
    return rows * tokens_per_row if tokens_per_row <= VERIFY_LOGITS_MAX_TOKENS else float(rows)


class CostModel(Protocol):
    def forward_ms(self, rows: int, tokens_per_row: float, context: float) -> float:
        """Milliseconds of one forward of `rows` sequences, `tokens_per_row` new tokens each, after
        `context` cached tokens each."""
        ...


@dataclass
class LinearCost:
    """base_ms + per_token_ms * (all new tokens) + per_context_ms * (all cached tokens): for tests and
    back-of-envelope configs."""

    base_ms: float = 1.0
    per_token_ms: float = 0.0
    per_context_ms: float = 0.0

    def forward_ms(self, rows: int, tokens_per_row: float, context: float) -> float:
        return self.base_ms + self.per_token_ms * rows * tokens_per_row + self.per_context_ms * rows * context


def _bracket(axis: Sequence[float], x: float) -> tuple[int, int, float]:
    """Indices (i, j) of the grid points around x and x's weight toward j; past either end, the
    last two points and a weight outside [0, 1] (linear extrapolation). A one-point axis: (0, 0, 0).

    >>> _bracket([1, 2, 4], 3), _bracket([1, 2, 4], 8), _bracket([1, 2, 4], 0)
    ((1, 2, 0.5), (1, 2, 3.0), (0, 1, -1.0))
    """
    if len(axis) == 1:
        return 0, 0, 0.0
    j = min(max(bisect.bisect_right(axis, x), 1), len(axis) - 1)
    i = j - 1
    return i, j, (x - axis[i]) / (axis[j] - axis[i])


@dataclass
class CostTable:
    """Measured forward times on a grid; see the module docstring for the interpolation."""

    rows: list[int]  # [R] ascending
    tokens_per_row: list[int]  # [T] ascending
    context: list[int]  # [C] ascending
    times_ms: list[list[list[float]]]  # [R][T][C] measured medians
    meta: dict[str, Any] = field(default_factory=dict)  # model, device, dtype, threads, when

    def __post_init__(self):
        shape = (len(self.rows), len(self.tokens_per_row), len(self.context))
        if min(shape) < 1:
            raise ValueError(f"a cost table needs at least one point per axis, got shape {shape}")
        for name in ("rows", "tokens_per_row", "context"):
            axis = getattr(self, name)
            if sorted(set(axis)) != list(axis):
                raise ValueError(f"cost table axis {name} must be strictly ascending, got {axis}")
        if len(self.times_ms) != shape[0] or any(len(t) != shape[1] or any(len(c) != shape[2] for c in t) for t in self.times_ms):
            raise ValueError(f"cost table forward_ms must have shape {shape}")
        self._floor_ms = min(v for t in self.times_ms for c in t for v in c)

    def forward_ms(self, rows: int, tokens_per_row: float, context: float) -> float:
        r0, r1, wr = _bracket(self.rows, rows)
        t0, t1, wt = _bracket(self.tokens_per_row, tokens_per_row)
        c0, c1, wc = _bracket(self.context, context)
        table = self.times_ms

        def along_context(r: int, t: int) -> float:
            row = table[r][t]
            return row[c0] + wc * (row[c1] - row[c0])

        def along_tokens(r: int) -> float:
            a = along_context(r, t0)
            return a + wt * (along_context(r, t1) - a)

        low = along_tokens(r0)
        return max(self._floor_ms, low + wr * (along_tokens(r1) - low))

    def to_json(self) -> dict[str, Any]:
        return {"rows": self.rows, "tokens_per_row": self.tokens_per_row, "context": self.context,
                "forward_ms": self.times_ms, "meta": self.meta}

    def save(self, path: str | Path) -> None:
        """JSON with one line per row count (each a [tokens_per_row][context] block, in ms)."""
        times = ",\n".join("  " + json.dumps([[round(v, 4) for v in by_context] for by_context in block]) for block in self.times_ms)
        head = ", ".join(f'"{k}": {json.dumps(getattr(self, k))}' for k in ("rows", "tokens_per_row", "context"))
        Path(path).write_text(f'{{{head},\n "meta": {json.dumps(self.meta)},\n "forward_ms": [\n{times}\n ]}}\n')

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CostTable:
        return cls(list(data["rows"]), list(data["tokens_per_row"]), list(data["context"]), data["forward_ms"],
                   dict(data.get("meta", {})))

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        return cls.from_json(json.loads(Path(path).read_text()))


@dataclass(frozen=True)
class ModelDims:
    """A decoder-only transformer's sizes (Llama family: gated MLP, grouped-query attention)."""

    num_layers: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    d_ffn: int
    vocab_size: int
    bytes_per_param: float = 2.0  # 2 = bf16/fp16, 4 = fp32, ~0.56 = 4.5-bit quantized
    tied_embeddings: bool = False

    @property
    def params_per_layer(self) -> int:
        attn = self.d_model * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)  # q, o, k, v
        return attn + 3 * self.d_model * self.d_ffn

    @property
    def weight_bytes(self) -> float:
        """Bytes one forward reads: every layer's weights and the LM head (embedding lookups are a few rows)."""
        return (self.num_layers * self.params_per_layer + self.vocab_size * self.d_model) * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_param

    @classmethod
    def from_hf_config(cls, path_or_spec: str, bytes_per_param: float = 2.0) -> ModelDims:
        """Dimensions from a model folder's config.json (or any spec `resolve_model_spec` takes)."""
        from transformers import AutoConfig

        from specmesh.models.resolve import resolve_model_spec

        c = AutoConfig.from_pretrained(resolve_model_spec(path_or_spec))
        heads = c.num_attention_heads
        return cls(c.num_hidden_layers, c.hidden_size, heads, getattr(c, "num_key_value_heads", None) or heads,
                   getattr(c, "head_dim", None) or c.hidden_size // heads, c.intermediate_size, c.vocab_size, bytes_per_param,
                   bool(getattr(c, "tie_word_embeddings", False)))


@dataclass(frozen=True)
class DeviceSpec:
    """Peak numbers from a datasheet and the fractions of them a serving engine reaches."""

    flops_per_s: float  # dense peak at the serving dtype
    bandwidth_bytes_per_s: float  # memory bandwidth
    mfu: float = 0.5  # achieved fraction of peak FLOP/s in large forwards
    mbu: float = 0.7  # achieved fraction of peak bandwidth in small forwards
    overhead_ms: float = 0.0  # per forward: kernel launches, Python, sampling


@dataclass
class RooflineCost:
    model: ModelDims
    device: DeviceSpec

    def forward_ms(self, rows: int, tokens_per_row: float, context: float) -> float:
        m, d = self.model, self.device
        num_tokens = rows * tokens_per_row
        attn_flops = 4.0 * m.num_layers * m.num_heads * m.head_dim * num_tokens * (context + tokens_per_row / 2)
        flops = 2.0 * (num_tokens * m.num_layers * m.params_per_layer + logits_rows(rows, tokens_per_row) * m.vocab_size * m.d_model)
        flops += attn_flops
        num_bytes = m.weight_bytes + rows * (context + tokens_per_row) * m.kv_bytes_per_token
        seconds = max(flops / (d.flops_per_s * d.mfu), num_bytes / (d.bandwidth_bytes_per_s * d.mbu))
        return seconds * 1e3 + d.overhead_ms


# Public model cards (config.json of each); bytes_per_param is the serving dtype's (bf16 unless named).
MODEL_PRESETS: dict[str, ModelDims] = {
    "smollm2-135m": ModelDims(30, 576, 9, 3, 64, 1536, 49152, tied_embeddings=True),
    "smollm2-360m": ModelDims(32, 960, 15, 5, 64, 2560, 49152, tied_embeddings=True),
    "llama3.2-1b": ModelDims(16, 2048, 32, 8, 64, 8192, 128256, tied_embeddings=True),
    "llama3.1-8b": ModelDims(32, 4096, 32, 8, 128, 14336, 128256),
    "llama3.1-70b": ModelDims(80, 8192, 64, 8, 128, 28672, 128256),
    "qwen2.5-0.5b": ModelDims(24, 896, 14, 2, 64, 4864, 151936, tied_embeddings=True),
    "qwen2.5-7b": ModelDims(28, 3584, 28, 4, 128, 18944, 152064),
}
# Datasheet peaks (dense bf16/fp16 FLOP/s, memory bytes/s); the phone and laptop numbers are their GPUs'.
DEVICE_PRESETS: dict[str, DeviceSpec] = {
    "h100-sxm": DeviceSpec(989e12, 3.35e12, overhead_ms=3.0),
    "h200": DeviceSpec(989e12, 4.8e12, overhead_ms=3.0),
    "a100-80g": DeviceSpec(312e12, 2.0e12, overhead_ms=3.0),
    "l4": DeviceSpec(121e12, 300e9, overhead_ms=3.0),
    "rtx4090": DeviceSpec(165e12, 1.0e12, overhead_ms=2.0),
    "m2-laptop": DeviceSpec(3.6e12, 100e9, mfu=0.4, mbu=0.6, overhead_ms=2.0),
    "phone": DeviceSpec(2e12, 50e9, mfu=0.3, mbu=0.5, overhead_ms=3.0),
    "cpu-2core": DeviceSpec(100e9, 20e9, mfu=0.3, mbu=0.5, overhead_ms=1.0),
}


def model_dims(spec: str | dict[str, Any]) -> ModelDims:
    """A preset name, or a mapping of `ModelDims` fields (optionally `preset:` plus overrides)."""
    if isinstance(spec, str):
        if spec not in MODEL_PRESETS:
            raise ValueError(f"unknown model preset {spec!r}; known: {', '.join(MODEL_PRESETS)} (or give its dimensions)")
        return MODEL_PRESETS[spec]
    spec = dict(spec)
    base = asdict(model_dims(spec.pop("preset"))) if "preset" in spec else {}
    return ModelDims(**{**base, **spec})


def device_spec(spec: str | dict[str, Any]) -> DeviceSpec:
    """A preset name, or a mapping of `DeviceSpec` fields (optionally `preset:` plus overrides)."""
    if isinstance(spec, str):
        if spec not in DEVICE_PRESETS:
            raise ValueError(f"unknown device preset {spec!r}; known: {', '.join(DEVICE_PRESETS)} (or give its specs)")
        return DEVICE_PRESETS[spec]
    spec = dict(spec)
    base = asdict(device_spec(spec.pop("preset"))) if "preset" in spec else {}
    return DeviceSpec(**{**base, **{k: float(v) for k, v in spec.items()}})
