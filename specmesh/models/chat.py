"""Prompt text -> token ids with the model's chat template (one user turn, generation prompt added).

transformers returns a plain list or a BatchEncoding depending on its version and arguments; this is
the one place that smooths that over. Tokenizers without a chat template encode the text as-is.
"""

from __future__ import annotations


def chat_prompt_ids(tokenizer, user_text: str) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        return list(tokenizer.encode(user_text))
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": user_text}], add_generation_prompt=True)
    return list(encoded if isinstance(encoded, list) else encoded["input_ids"])
