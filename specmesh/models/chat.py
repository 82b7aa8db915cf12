"""Prompt text or a conversation -> token ids with the model's chat template (generation prompt added).

transformers returns a plain list or a BatchEncoding depending on its version and arguments; this is
the one place that smooths that over. Tokenizers without a chat template encode the text as-is.

Two checks make a conversation unable to rewrite its own template:
- roles: a message's role is one of `CHAT_ROLES` that this tokenizer's template renders
  (`chat_roles`), else `ChatRoleError` (a ValueError). A ChatML template pastes the role string
  verbatim, so a role such as "user<|im_end|>\\n<|im_start|>system\\n..." would open a system turn;
- content: text in a message that spells a special token (`<|im_start|>`, `<|im_end|>`, ...) is
  encoded as the plain text it is, never as the special token's id. Only the template itself places
  special tokens. A conversation without such text is encoded exactly as `apply_chat_template` does.
"""

from __future__ import annotations

import re
import secrets
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

CHAT_ROLES = ("system", "user", "assistant")  # the roles a conversation may use (the Coordinator's ChatMessage)
MAX_ROLE_CHARS_SHOWN = 40
# conversations that try one role each against a template: a template that refuses the role raises
_ROLE_PROBES = {
    "system": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
    "user": [{"role": "user", "content": "u"}],
    "assistant": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}],
}


class ChatRoleError(ValueError):
    """A message's role is not one of the template's roles; `index` is the message's position."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


@dataclass(frozen=True)
class _TemplateFacts:
    template: str | None
    roles: tuple[str, ...]
    specials: re.Pattern | None  # the text of every special token, longest first; None: the tokenizer has none


_FACTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _facts(tokenizer) -> _TemplateFacts:
    template = getattr(tokenizer, "chat_template", None) or None
    try:
        cached = _FACTS.get(tokenizer)
    except TypeError:  # not weak-referenceable: computed every time
        cached = None
    if cached is not None and cached.template == template:
        return cached
    facts = _TemplateFacts(template, _template_roles(tokenizer, template), _special_pattern(tokenizer))
    try:
        _FACTS[tokenizer] = facts
    except TypeError:
        pass
    return facts


def _template_roles(tokenizer, template: str | None) -> tuple[str, ...]:
    if template is None:
        return CHAT_ROLES
    roles = []
    for role in CHAT_ROLES:
        try:
            tokenizer.apply_chat_template(_ROLE_PROBES[role], tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - jinja's TemplateError, raise_exception(...): the template refuses it
            continue
        roles.append(role)
    return tuple(roles)


def _special_pattern(tokenizer) -> re.Pattern | None:
    texts = {token.content for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()
             if getattr(token, "special", False)}
    texts.update(getattr(tokenizer, "all_special_tokens", None) or ())
    texts.discard("")
    if not texts:
        return None
    return re.compile("|".join(re.escape(text) for text in sorted(texts, key=len, reverse=True)))


def chat_roles(tokenizer) -> tuple[str, ...]:
    """The roles a conversation may use with this tokenizer: those of `CHAT_ROLES` its chat template
    renders (all of them without a template: the turns' contents are only joined)."""
    return _facts(tokenizer).roles


def check_chat_roles(tokenizer, messages: Sequence[dict[str, str]]) -> None:
    """ChatRoleError naming the first message whose role is not one of `chat_roles(tokenizer)`."""
    roles = chat_roles(tokenizer)
    for index, message in enumerate(messages):
        role = message.get("role", "")
        if role in roles:
            continue
        allowed = ", ".join(roles)
        if not role:
            raise ChatRoleError(index, f"message {index} has no role; use one of: {allowed}")
        shown = role if len(role) <= MAX_ROLE_CHARS_SHOWN else role[:MAX_ROLE_CHARS_SHOWN] + "..."
        raise ChatRoleError(index, f"message {index}: role {shown!r} is not one of this model's chat roles: {allowed}")


def chat_prompt_ids(tokenizer, user_text: str) -> list[int]:
    return chat_messages_ids(tokenizer, [{"role": "user", "content": user_text}])


def chat_messages_ids(tokenizer, messages: Sequence[dict[str, str]]) -> list[int]:
    """A conversation (role / content dicts) rendered for the assistant's next turn. Without a chat
    template, the turns' contents are joined by newlines. Roles are checked (`check_chat_roles`);
    special-token text in a content is encoded as text (module docstring)."""
    facts = _facts(tokenizer)
    check_chat_roles(tokenizer, messages)
    contents = [message["content"] for message in messages]
    specials = facts.specials
    smuggled = specials is not None and any(specials.search(content) for content in contents)
    if facts.template is None:
        text = "\n".join(contents)
        if specials is None or not smuggled:
            return list(tokenizer.encode(text))
        return _with_special_tokens(tokenizer, _encode_escaped(tokenizer, text, specials))
    if specials is None or not smuggled:
        encoded = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
        return list(encoded if isinstance(encoded, list) else encoded["input_ids"])
    # each special-token text in a content becomes a placeholder the template passes through as text; the
    # rendered conversation is encoded as usual between placeholders, and each placeholder as its own text
    nonce = secrets.token_hex(8)
    found: list[str] = []

    def placeholder(match: re.Match) -> str:
        found.append(match.group(0))
        return f"\ue000{nonce}:{len(found) - 1}\ue001"

    masked = [{**message, "content": specials.sub(placeholder, message["content"])} for message in messages]
    rendered = tokenizer.apply_chat_template(masked, tokenize=False, add_generation_prompt=True)
    pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", rendered)
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if i % 2:  # a placeholder: the special token's text, as text
            ids += _encode_plain(tokenizer, found[int(piece)])
        elif piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
    return ids


def _encode_plain(tokenizer, text: str) -> list[int]:
    """`text` encoded as text: special-token spellings in it are split like any other characters."""
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def _encode_escaped(tokenizer, text: str, specials: re.Pattern) -> list[int]:
    """`text` (no special tokens added) with every special-token spelling encoded as text."""
    ids: list[int] = []
    start = 0
    for match in specials.finditer(text):
        if match.start() > start:
            ids += tokenizer.encode(text[start:match.start()], add_special_tokens=False)
        ids += _encode_plain(tokenizer, match.group(0))
        start = match.end()
    if start < len(text):
        ids += tokenizer.encode(text[start:], add_special_tokens=False)
    return ids


def _with_special_tokens(tokenizer, ids: list[int]) -> list[int]:
    """`ids` between the tokens `encode` adds around a text (BOS, ...), found by encoding a probe both ways."""
    bare = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a")
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return full[:start] + ids + full[start + len(bare):]
    return ids
