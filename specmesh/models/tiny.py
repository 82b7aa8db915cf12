"""Tiny random-weight models of each supported family, written to a folder in seconds.

Tests build these instead of downloading real checkpoints: the architecture code paths are the
same as a real model's, only the sizes are small and the weights random. Each folder is a normal HF
folder (config.json + model.safetensors + tokenizer), so anything that loads a real model loads it.

    path = make_tiny_model("qwen3", tmp_path / "qwen3")
    model = AutoModelForCausalLM.from_pretrained(path)

The tokenizer is a byte-level BPE trained on the fly on a small built-in corpus, with the ChatML
special tokens and chat template that SmolLM2 uses, so chat-template code paths work too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3", "smollm2", "gpt2")
NATIVE_FAMILIES = FAMILIES[:-1]  # the Llama family the native engine runs; gpt2 takes the HF fallback

TINY_VOCAB_SIZE = 384
CHAT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """
Speculative decoding lets a small draft model guess several tokens while the large target model
checks them all in one forward pass. The target keeps the longest prefix it agrees with and adds
one token of its own, so the output is exactly what the target would have written alone.
The quick brown fox jumps over the lazy dog. A list has points: first, second, third, fourth.
Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of Italy.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20. def main(): return 42
The cache keeps keys and values for every layer; blocks of sixteen tokens are shared on fork.
"""


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(CHAT_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def tiny_config(family: str, vocab_size: int = TINY_VOCAB_SIZE, num_layers: int = 2, hidden_size: int = 64):
    """A small config of `family` (one of FAMILIES). GQA everywhere it exists (4 heads, 2 kv heads);
    `hidden_size` 256 gives rows K-quant blocks (256 inputs) can hold."""
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if family == "smollm2":
        return LlamaConfig(**common, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    if family == "llama3":
        common["max_position_embeddings"] = 1024
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        }
        return LlamaConfig(**common, tie_word_embeddings=True, rope_parameters=rope)
    if family == "mistral":
        return MistralConfig(**common, tie_word_embeddings=False, sliding_window=None)
    if family == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=16, tie_word_embeddings=False)
    if family == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size, n_embd=64, n_layer=num_layers, n_head=4, n_positions=512,
            bos_token_id=1, eos_token_id=2,
        )
    raise ValueError(f"unknown tiny family {family!r}; choose one of {', '.join(FAMILIES)}")


def randomize_weights(model, init_std: float) -> None:
    """Matrices and biases ~ N(0, init_std); norm weights around 1, so activations keep their scale."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2 or name.endswith("bias"):
                param.normal_(0.0, init_std)
            else:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))


def make_tiny_model(
    family: str,
    path: str | Path,
    seed: int = 0,
    num_layers: int = 2,
    init_std: float = 0.02,
    hidden_size: int = 64,
) -> Path:
    """Write a random `family` model + tokenizer to `path` and return it.

    `init_std` scales the random weights; a larger value (e.g. 0.2) gives peaked logits, which keeps
    greedy comparisons away from fp near-ties.
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(TINY_VOCAB_SIZE)
    config = tiny_config(family, vocab_size=len(tokenizer), num_layers=num_layers, hidden_size=hidden_size)
    config.initializer_range = init_std
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, init_std)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
