"""Token id -> the bytes the token adds to the text, for grammar masks that work on bytes.

A token's text can be a fragment of a UTF-8 character (byte-level BPE splits "é" into two tokens),
so a grammar over decoded strings would mis-judge it; over bytes it is exact.

Two vocabulary schemes are read:
- byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2): each byte is written as one printable character
  (the GPT-2 `bytes_to_unicode` table), so a token string maps back to its bytes one for one;
- SentencePiece (Llama 2, Mistral): "▁" is a space and "<0xNN>" a byte-fallback token.
Special tokens (EOS, chat markers) map to None: they add no text and a grammar never allows them
(EOS is handled separately). Added tokens that are not special are their content in UTF-8.

>>> byte_level_decoder()["Ġ"], byte_level_decoder()["Ċ"], byte_level_decoder()["a"]
(32, 10, 97)
>>> token_bytes_from_strings(["Ġthe", "Ċ", "Ã", "©"], scheme="byte_level")
[b' the', b'\\n', b'\\xc3', b'\\xa9']
>>> token_bytes_from_strings(["▁the", "<0x0A>", "é"], scheme="sentencepiece")
[b' the', b'\\n', b'\\xc3\\xa9']
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SENTENCEPIECE_SPACE = "\u2581"


@functools.cache
def byte_level_decoder() -> dict[str, int]:
    """GPT-2's printable character per byte, inverted: printable latin-1 bytes stand for themselves,
    the others are shifted to 256 + n in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    shifted = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + shifted)
            shifted += 1
    return {chr(char): byte for byte, char in zip(printable, chars)}


def token_bytes_from_strings(token_strings: Sequence[str | None], scheme: str) -> list[bytes | None]:
    """Vocabulary strings (None for a hole) -> bytes; `scheme` "byte_level" or "sentencepiece"."""
    decoder = byte_level_decoder()
    table: list[bytes | None] = []
    for token in token_strings:
        if not token:
            table.append(None)
        elif scheme == "byte_level":
            table.append(bytes(decoder[ch] for ch in token) if all(ch in decoder for ch in token) else None)
        elif scheme == "sentencepiece":
            match = _BYTE_FALLBACK.fullmatch(token)
            table.append(bytes([int(match.group(1), 16)]) if match else token.replace(SENTENCEPIECE_SPACE, " ").encode())
        else:
            raise ValueError(f"unknown vocabulary scheme {scheme!r}")
    return table


def token_bytes_table(tokenizer) -> list[bytes | None]:
    """A transformers tokenizer's vocabulary as bytes, indexed by token id (len(tokenizer) entries)."""
    num_tokens = len(tokenizer)
    strings: list[str | None] = list(tokenizer.convert_ids_to_tokens(list(range(num_tokens))))
    added = {int(i): token for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    special = set(tokenizer.all_special_ids) | {i for i, token in added.items() if getattr(token, "special", False)}
    regular = [s for i, s in enumerate(strings) if s and i not in added]
    decoder = byte_level_decoder()
    if all(ch in decoder for s in regular for ch in s):
        scheme = "byte_level"
    elif any(SENTENCEPIECE_SPACE in s for s in regular):
        scheme = "sentencepiece"
    else:
        raise ValueError("unsupported vocabulary: neither byte-level BPE nor SentencePiece")
    table = token_bytes_from_strings([None if i in added else s for i, s in enumerate(strings)], scheme)
    for i, token in added.items():
        if i < num_tokens and i not in special:
            table[i] = str(getattr(token, "content", token)).encode() or None
    for i in special:
        if 0 <= i < num_tokens:
            table[i] = None
    return table
