"""The tiny-model factory: each family loads with transformers and generates with its tokenizer."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specmesh.models.tiny import FAMILIES

EXPECTED_CLASS = {
    "llama": "LlamaForCausalLM",
    "llama3": "LlamaForCausalLM",
    "smollm2": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_family_loads_and_generates(tiny_model_dir, family):
    folder = tiny_model_dir(family)
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert type(model).__name__ == EXPECTED_CLASS[family]
    assert model.config.vocab_size == len(tokenizer)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "name three capitals"}], add_generation_prompt=True, return_tensors="pt"
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 5)
    assert tokenizer.decode(ids[0]).startswith("<|im_start|>user")


def test_seed_fixes_weights(tmp_path):
    from specmesh.models.tiny import make_tiny_model

    a = AutoModelForCausalLM.from_pretrained(make_tiny_model("qwen2", tmp_path / "a", seed=3))
    b = AutoModelForCausalLM.from_pretrained(make_tiny_model("qwen2", tmp_path / "b", seed=3))
    c = AutoModelForCausalLM.from_pretrained(make_tiny_model("qwen2", tmp_path / "c", seed=4))
    wa, wb, wc = (m.model.layers[0].self_attn.q_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
