"""Incremental detokenization: the text of a growing token sequence, with stop strings.

Decoding the whole output again after every round costs O(n) per token, O(n^2) per generation.
`TextStream` decodes only a short window instead (the prefix / read offset technique):

    ids:      ... | prefix_offset ... | read_offset ... len(ids)
                    already shown       new tokens
    new text = decode(ids[prefix_offset:]) minus decode(ids[prefix_offset:read_offset])

The window starts one chunk back so that a tokenizer's context rules (a leading space dropped at the
start of a decode, bytes merged into one character) see the same neighbours as in a full decode. The
window moves on (prefix_offset <- read_offset <- len(ids)) whenever its text does not end in
U+FFFD, the replacement character a decoder writes for bytes of a character not yet complete. So
every token costs one decode of a few tokens, plus one more when the window moves.

`prompt_ids` seeds the window with the last few prompt tokens, so the first generated token is
decoded in context (" Hello" after a prompt, not "Hello").

Stop strings. After each token the text that token could have completed is searched: the last
`max(len(stop)) - 1` characters of the settled text plus the unsettled text of the window. The first
token whose text completes a stop string ends the stream; the visible text ends where the earliest
match starts. The result equals the rule "shortest prefix of the generated tokens whose decode
contains a stop string", without decoding any prefix in full.

A worked example with a toy byte-level vocabulary (token 3 and 4 are the two bytes of "é"):

>>> pieces = [b"Hel", b"lo", b" w", b"\\xc3", b"\\xa9", b"!", b" E", b"ND", b" more"]
>>> def decode(ids):
...     return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")
>>> stream = TextStream(decode, stop=[" END"])
>>> stream.add([0, 1]), stream.take_delta()
(None, 'Hello')
>>> stream.add([2, 3]), stream.take_delta()      # half of "é": held back
(None, ' w')
>>> stream.add([4, 5, 6]), stream.take_delta()   # " E" may start " END": held back
(None, 'é!')
>>> stream.add([7, 8])                           # "ND" completes " END": keep 1 of these 2 tokens
1
>>> stream.take_delta(), stream.finish(), stream.text
('', '', 'Hello wé!')

Text held back because it might start a stop string is released by `finish`:

>>> stream = TextStream(decode, stop=[" END"])
>>> stream.add([0, 1, 6]), stream.take_delta(), stream.finish(), stream.text
(None, 'Hello', ' E', 'Hello E')
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["NUM_PROMPT_CONTEXT_TOKENS", "REPLACEMENT_CHAR", "TextStream"]

REPLACEMENT_CHAR = "\ufffd"  # what a decoder writes for the bytes of an unfinished character
NUM_PROMPT_CONTEXT_TOKENS = 4  # prompt tokens kept in the first window, for context rules


class TextStream:
    """Text of a growing token sequence, decoded incrementally, with stop strings."""

    def __init__(
        self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = (), prompt_ids: Sequence[int] = ()
    ):
        if isinstance(stop, str):
            raise ValueError("stop must be a list of strings, not a single string")
        for stop_string in stop:
            if not isinstance(stop_string, str) or not stop_string:
                raise ValueError(f"every stop string must be a non-empty string, got {stop_string!r}")
        self._decode = decode
        self._stops = tuple(stop)
        self._max_tail_chars = max((len(s) for s in self._stops), default=1) - 1
        self._ids: list[int] = list(prompt_ids[max(0, len(prompt_ids) - NUM_PROMPT_CONTEXT_TOKENS):])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = decode(self._ids) if self._ids else ""  # decode(ids[prefix_offset:read_offset])
        self._settled_tail = ""  # the last _max_tail_chars characters of the settled text
        self._unsent = ""  # visible text not yet returned (settled, or final after a stop)
        self._sent: list[str] = []  # every string returned so far
        self._stopped = False  # a stop string matched: the text is final
        self._finished = False

    def add(self, token_ids: Sequence[int]) -> int | None:
        """Append tokens. If a stop string completes inside them, return how many of THESE tokens to keep
        (up to and including the token that completes the earliest stop match; later ones are dropped) and
        refuse further add() calls (ValueError); else None."""
        if self._stopped:
            raise ValueError("a stop string already ended this stream")
        if self._finished:
            raise ValueError("this stream is finished")
        for num_kept, token_id in enumerate(token_ids, start=1):
            self._ids.append(token_id)
            window_text = self._decode(self._ids[self._prefix_offset:])
            new_text = window_text[len(self._prefix_text):]  # the text of ids[read_offset:]
            if self._stops and self._cut_at_stop(new_text):
                return num_kept
            if not window_text.endswith(REPLACEMENT_CHAR):
                self._settle(new_text)
        return None

    def take_delta(self) -> str:
        """Visible text not returned before: never a partial character (decode output ending in U+FFFD),
        never any part of a matched stop string, and held back while the tail could still be the start
        of a stop string."""
        num_held = 0 if self._stopped or self._finished else self._num_chars_to_hold()
        delta = self._unsent[:len(self._unsent) - num_held]
        self._unsent = self._unsent[len(delta):]
        if delta:
            self._sent.append(delta)
        return delta

    def finish(self) -> str:
        """At the end of generation: release what take_delta held back (but never a stop string itself)."""
        if not self._stopped and not self._finished and self._read_offset < len(self._ids):
            window_text = self._decode(self._ids[self._prefix_offset:])
            self._unsent += window_text[len(self._prefix_text):]  # unfinished characters included
        self._finished = True
        return self.take_delta()

    @property
    def text(self) -> str:
        """all visible text so far (the stop string and anything after it excluded)"""
        return "".join(self._sent) + self._unsent

    def _settle(self, new_text: str) -> None:
        """The window's text is complete: keep it and move the window on."""
        self._unsent += new_text
        if self._max_tail_chars:
            self._settled_tail = (self._settled_tail + new_text)[-self._max_tail_chars:]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset:])

    def _cut_at_stop(self, new_text: str) -> bool:
        """If a stop string completes in the settled tail + `new_text`, end the visible text where the
        earliest match starts and return True. The settled text alone holds no match (it was searched
        token by token), so every new match ends in `new_text`."""
        searched = self._settled_tail + new_text
        starts = [start for start in map(searched.find, self._stops) if start >= 0]
        if not starts:
            return False
        cut = min(starts) - len(self._settled_tail)  # relative to the end of the settled text
        if cut < 0:  # the match starts in settled text, which _num_chars_to_hold kept unsent
            self._unsent = self._unsent[:cut]
        else:
            self._unsent += new_text[:cut]
        self._stopped = True
        return True

    def _num_chars_to_hold(self) -> int:
        """Length of the longest end of the unsent text that a stop string starts with. (It never reaches
        into sent text: that text's end was checked the same way when it was sent.)"""
        for length in range(min(self._max_tail_chars, len(self._unsent)), 0, -1):
            end = self._unsent[-length:]
            if any(stop.startswith(end) for stop in self._stops):
                return length
        return 0
