"""load_engine: a model folder (or spec) -> an Engine, native for the Llama family, HF otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specmesh.models.config import NATIVE_MODEL_TYPES
from specmesh.models.encdec import is_encoder_decoder_config, load_encdec_engine
from specmesh.models.engine import DEFAULT_MAX_KV_TOKENS, Engine, config_max_context
from specmesh.models.weights import load_tensors

BACKENDS = ("auto", "native", "hf")
# quantize=: weight-only low-bit kinds (batch-invariant: targets and drafters), "gguf" (the GGUF's own
# blocks), and "int8-dynamic" (fbgemm, activations quantized per call: NOT batch-invariant, drafters only)
QUANTIZE_KINDS = ("int8", "int4", "q4_0", "q4_1", "q8_0", "q4_k", "q6_k", "gguf", "int8-dynamic")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
DTYPES.update({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64})


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}") from None


def eos_token_ids(folder: Path, hf_config) -> tuple[int, ...]:
    """EOS ids from config.json and generation_config.json, deduplicated, config's first."""
    ids: list[int] = []
    sources = [getattr(hf_config, "eos_token_id", None)]
    generation_config = folder / "generation_config.json"
    if generation_config.exists():
        sources.append(json.loads(generation_config.read_text()).get("eos_token_id"))
    for source in sources:
        for token in source if isinstance(source, (list, tuple)) else [source]:
            if token is not None and token not in ids:
                ids.append(int(token))
    return tuple(ids)


def load_engine(
    path_or_dir: str | Path,
    backend: str = "auto",
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    max_kv_tokens: int = DEFAULT_MAX_KV_TOKENS,
    quantize: str | None = None,
    block_size: int = 16,
) -> Engine:
    """Load a model as an Engine.

    path_or_dir: a local HF folder (config.json + safetensors), or any spec `resolve_model_spec`
    accepts ("default", a .gguf path, a hub id). backend: "native" (Llama family only), "hf" or "auto"
    (native when config.model_type is llama/mistral/qwen2/qwen3); an encoder-decoder model (T5, BART, ...)
    is an `EncDecEngine` on the hf backend (see specmesh/models/encdec.py). quantize (native backend, CPU, float32
    activations): None; "int8" / "int4" / "q4_0" / "q4_1" / "q8_0" / "q4_k" / "q6_k" (weight-only
    low-bit, see specmesh/models/lowbit/quantize.py); "gguf" (serve a .gguf spec's, or the default
    model's, own quantized blocks); "int8-dynamic" (fast but batch-variant: drafters only).
    """
    from transformers import AutoConfig

    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if quantize is not None and quantize not in QUANTIZE_KINDS:
        raise ValueError(f"unknown quantize {quantize!r}; choose one of {', '.join(QUANTIZE_KINDS)}")
    from specmesh.models.resolve import resolve_model_spec

    folder = resolve_model_spec(str(path_or_dir))
    torch_dtype = parse_dtype(dtype)
    torch_device = torch.device(device)
    hf_config = AutoConfig.from_pretrained(folder)
    eos = eos_token_ids(folder, hf_config)
    if is_encoder_decoder_config(hf_config):  # T5, BART, Marian, ...: the transformers backend (specmesh.models.encdec)
        if backend == "native" or quantize is not None:
            raise ValueError(f"{hf_config.model_type!r} is an encoder-decoder model: it runs on the hf backend, "
                             "without quantize (the native backend and quantize are for the Llama family)")
        return load_encdec_engine(folder, hf_config, torch_dtype, torch_device, max_kv_tokens, eos)
    if backend == "auto":
        backend = "native" if hf_config.model_type in NATIVE_MODEL_TYPES else "hf"
    if backend == "native":
        from specmesh.models.config import LlamaFamilyConfig
        from specmesh.models.linear import default_kernel
        from specmesh.models.llama import LlamaFamilyModel
        from specmesh.models.native_engine import NativeEngine

        kernel = default_kernel(torch_dtype, torch_device)
        config = LlamaFamilyConfig.from_hf(hf_config)
        if quantize is not None and (torch_device.type != "cpu" or torch_dtype != torch.float32):
            raise ValueError(f"quantize={quantize!r} needs device cpu and dtype float32")
        if quantize == "gguf":
            from specmesh.models.lowbit.gguf_file import read_gguf
            from specmesh.models.resolve import gguf_file

            tensors: dict = read_gguf(gguf_file(str(path_or_dir)), config)
        else:
            tensors = load_tensors(folder, torch_dtype)
        if quantize == "int8-dynamic":
            kernel = "int8-dynamic"
        elif quantize not in (None, "gguf"):
            from specmesh.models.lowbit.quantize import quantize_checkpoint

            tensors = quantize_checkpoint(tensors, quantize, config.tie_word_embeddings)
        model = LlamaFamilyModel(config, tensors, torch_dtype, torch_device, kernel)
        return NativeEngine(model, max_kv_tokens=max_kv_tokens, block_size=block_size, eos_token_ids=eos)
    if quantize is not None:
        raise ValueError("quantize is only available with the native backend")
    from transformers import AutoModelForCausalLM

    from specmesh.models.hf_engine import HFEngine

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype).to(torch_device)  # type: ignore[arg-type]
    return HFEngine(model, max_context=config_max_context(hf_config.get_text_config()), eos_token_ids=eos, max_kv_tokens=max_kv_tokens)
