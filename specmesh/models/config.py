"""The few numbers the native Llama-family forward needs, read from a transformers config.

One dataclass covers Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3 and SmolLM2 (a Llama); the families
differ only in flags: `qkv_bias` (Qwen2), `qk_norm` (Qwen3), rope scaling (Llama 3.x), sliding
windows (Mistral; Qwen layers marked "sliding_attention").
"""

from __future__ import annotations

from dataclasses import dataclass

NATIVE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class LlamaFamilyConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_context: int  # tokens
    rope_parameters: dict  # transformers 5 `rope_parameters` (rope_type, rope_theta, scaling keys)
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_windows: tuple[int | None, ...]  # [num_layers] window in tokens, None = full attention

    @classmethod
    def from_hf(cls, hf_config) -> LlamaFamilyConfig:
        model_type = hf_config.model_type
        if model_type not in NATIVE_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} has no native forward ({', '.join(NATIVE_MODEL_TYPES)})")
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"native forward supports hidden_act silu, not {hf_config.hidden_act!r}")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        num_layers = hf_config.num_hidden_layers
        rope = _rope_parameters(hf_config)
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("native forward does not support partial rotary embeddings")
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_context=hf_config.max_position_embeddings,
            rope_parameters=rope,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or (attention_bias and model_type != "mistral"),
            o_bias=attention_bias and model_type in ("llama", "qwen3"),
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_windows=_sliding_windows(hf_config, num_layers),
        )


def _rope_parameters(hf_config) -> dict:
    rope = getattr(hf_config, "rope_parameters", None)
    if rope is None:  # transformers 4.x names
        rope = dict(getattr(hf_config, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope = dict(rope)
    if "full_attention" in rope:  # per layer-type parameters; Llama-family models use one set
        rope = dict(rope["full_attention"])
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    return rope


def _sliding_windows(hf_config, num_layers: int) -> tuple[int | None, ...]:
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if hf_config.model_type == "mistral":
        return (window,) * num_layers
    if window is None or not layer_types:
        return (None,) * num_layers
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
