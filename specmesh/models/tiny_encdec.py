"""Tiny random encoder-decoder models (T5, BART) written to a folder in seconds, for tests.

As `specmesh.models.tiny` does for decoder-only families: a normal HF folder (config.json +
model.safetensors + the same on-the-fly byte-level BPE tokenizer), so anything that loads a real
T5 or BART loads it. The tokenizer's ids: pad 0, bos 1, eos 2. T5 starts the decoder on pad (0);
BART on eos (2) and, as BART-large does, forces bos (1) as the first token.

    target = make_tiny_encdec("t5", tmp_path / "t5", init_std=0.2)
    draft = perturbed_copy(target, tmp_path / "t5-draft", noise_std=0.05)   # agrees with it often
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specmesh.models.tiny import TINY_VOCAB_SIZE, _train_tokenizer, randomize_weights

ENCDEC_FAMILIES = ("t5", "bart")


def tiny_encdec_config(family: str, vocab_size: int = TINY_VOCAB_SIZE, num_layers: int = 2, hidden_size: int = 64):
    from transformers import BartConfig, T5Config

    special: dict[str, Any] = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # the tiny tokenizer's ids
    if family == "t5":  # the decoder starts on pad (T5Config takes it as a plain kwarg)
        return T5Config(vocab_size=vocab_size, d_model=hidden_size, d_kv=hidden_size // 4, d_ff=2 * hidden_size,
                        num_layers=num_layers, num_decoder_layers=num_layers, num_heads=4,
                        **(special | {"decoder_start_token_id": 0}))
    if family == "bart":  # the decoder starts on eos
        return BartConfig(vocab_size=vocab_size, d_model=hidden_size, encoder_layers=num_layers, decoder_layers=num_layers,
                          encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=2 * hidden_size,
                          decoder_ffn_dim=2 * hidden_size, max_position_embeddings=512,
                          **special, decoder_start_token_id=2, forced_eos_token_id=None)
    raise ValueError(f"unknown tiny encoder-decoder family {family!r}; choose one of {', '.join(ENCDEC_FAMILIES)}")


def make_tiny_encdec(family: str, path: str | Path, seed: int = 0, num_layers: int = 2, init_std: float = 0.02,
                     hidden_size: int = 64, vocab_size: int = TINY_VOCAB_SIZE) -> Path:
    """Write a random `family` model + tokenizer to `path` and return it. A larger `init_std` (0.2)
    gives peaked logits (greedy tests away from near-ties); `vocab_size` trains a tokenizer of that size."""
    from transformers import AutoModelForSeq2SeqLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(vocab_size)
    config = tiny_encdec_config(family, vocab_size=len(tokenizer), num_layers=num_layers, hidden_size=hidden_size)
    torch.manual_seed(seed)
    model = AutoModelForSeq2SeqLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, init_std)
    if family == "bart":
        model.generation_config.forced_bos_token_id = 1  # as BART-large: a forced first token
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def perturbed_copy(source: str | Path, path: str | Path, noise_std: float, seed: int = 1) -> Path:
    """`source`'s model with gaussian noise (std `noise_std`, relative to each matrix's std) on its
    matrices, same tokenizer: a draft that agrees with the source on some tokens, not all."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = AutoModelForSeq2SeqLM.from_pretrained(source, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.add_(noise_std * param.std() * torch.randn(param.shape, generator=generator))
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(source).save_pretrained(path)
    return path
