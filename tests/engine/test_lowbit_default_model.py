"""The default model served from its own Q4_1 GGUF blocks (slow: reads the real model)."""

from __future__ import annotations

import pytest
import torch

from specmesh.decoding.adaptive import FixedK
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.speculative import generate
from specmesh.decoding.verifier import TargetVerifier
from specmesh.drafters.ngram import PromptLookupDrafter
from specmesh.models.load import load_engine
from specmesh.models.lowbit.qlinear import QuantLinear
from specmesh.models.lowbit.qweight import QuantWeight
from specmesh.models.weights import load_tensors

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def q4_engine():
    return load_engine("default", quantize="gguf")


def test_gguf_blocks_are_the_converted_weights(q4_engine, default_model_dir):
    """Dequantized, our blocks equal transformers' conversion of the same file, bit for bit."""
    model = q4_engine.model
    reference = load_tensors(default_model_dir, torch.float32, prefix_filter="model.layers.0.")
    layer = model.layers[0]
    assert isinstance(layer.qkv, QuantLinear) and layer.qkv.weight.source == "q4_1"
    qkv = torch.cat([reference[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(layer.qkv.weight.dequantize(), qkv)
    assert isinstance(model.embed, QuantWeight) and model.embed.source == "q8_0"
    assert model.weight_bytes < 100e6  # 538 MB in float32


def test_ngram_speculation_on_q4_equals_its_plain_decoding(q4_engine):
    from transformers import AutoTokenizer

    from specmesh.models.resolve import resolve_model_spec

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_spec("default"))
    text = "The cache keeps keys and values for every layer. Repeat: the cache keeps keys and values for"
    prompt = tokenizer(text)["input_ids"]
    verifier = TargetVerifier(q4_engine)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    plain = generate(verifier, None, prompt, params)
    spec = generate(verifier, PromptLookupDrafter(min_n=1, max_n=3), prompt, params, k_policy=FixedK(6))
    assert spec.token_ids == plain.token_ids
