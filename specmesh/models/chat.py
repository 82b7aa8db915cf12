"""Prompt text or a conversation -> token ids with the model's chat template (generation prompt added).

transformers returns a plain list or a BatchEncoding depending on its version and arguments; this is
the one place that smooths that over. Tokenizers without a chat template encode the text as-is.
"""

from __future__ import annotations


def chat_prompt_ids(tokenizer, user_text: str) -> list[int]:
    return chat_messages_ids(tokenizer, [{"role": "user", "content": user_text}])


def chat_messages_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """A conversation (role / content dicts) rendered for the assistant's next turn. Without a chat
    template, the turns' contents are joined by newlines."""
    if not getattr(tokenizer, "chat_template", None):
        return list(tokenizer.encode("\n".join(m["content"] for m in messages)))
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(encoded if isinstance(encoded, list) else encoded["input_ids"])
