"""The skeleton format as a byte-level DFA: a bounded regular grammar, so every run ends.

The format (one plan line per point; ids count up from 1; a point depends on earlier points only):

    [PLAN]\\n
    1.<est_tokens><tool>[deps]Title\\n        tool: <None> | <Search>;  deps: [-] | [1,2] (increasing)
    ...
    [END]
  or
    [DIRECT]short reason[END]

Bounds, all from `SkeletonFormat`: at most `max_points` lines, est_tokens of 1..`max_est_digits`
digits (no leading zero), a title of 1..`max_title_bytes` bytes (UTF-8; first byte not a space, no
control characters), a direct reason of at most `max_direct_bytes` bytes without '['. The DFA is
therefore acyclic and `max_bytes` bounds every accepted string. States that cannot reach `[END]` are
trimmed, so from every live state some byte continues towards acceptance: a run that only takes
allowed bytes can never get stuck.

A state is a small int; `DEAD_STATE` (0) refuses everything, `START_STATE` (1) is the start.
`transitions[state, byte]` is the next state.

Worked example (max_points=2):
    >>> auto = build_skeleton_automaton(SkeletonFormat(max_points=2))
    >>> state = auto.walk(START_STATE, b"[PLAN]\\n1.<40><None>[-]Why")
    >>> auto.step(state, ord("\\n")) != DEAD_STATE, auto.step(state, ord("[")) != DEAD_STATE
    (True, True)
    >>> state = auto.walk(state, b"\\n2.<9><Search>[1]How\\n")
    >>> auto.walk(state, b"3.") == DEAD_STATE          # a third point exceeds max_points
    True
    >>> auto.is_accepting(auto.walk(state, b"[END]"))
    True
    >>> auto.walk(START_STATE, b"[PLAN]\\n1.<40><None>[1]") == DEAD_STATE   # point 1 cannot depend on 1
    True
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

import numpy as np

DEAD_STATE = 0
START_STATE = 1
NUM_BYTES = 256

# UTF-8 position inside a character (the states of a strict UTF-8 validator, RFC 3629 table 3-7).
_U_OK, _U_NEED1, _U_NEED2, _U_NEED3, _U_E0, _U_ED, _U_F0, _U_F4 = range(8)
_CONTINUATION = {  # pending state -> (allowed byte range, next pending state)
    _U_NEED1: ((0x80, 0xBF), _U_OK),
    _U_NEED2: ((0x80, 0xBF), _U_NEED1),
    _U_NEED3: ((0x80, 0xBF), _U_NEED2),
    _U_E0: ((0xA0, 0xBF), _U_NEED1),
    _U_ED: ((0x80, 0x9F), _U_NEED1),
    _U_F0: ((0x90, 0xBF), _U_NEED2),
    _U_F4: ((0x80, 0x8F), _U_NEED2),
}
_LEAD = (  # lead byte range, pending state after it, bytes in the whole character
    ((0xC2, 0xDF), _U_NEED1, 2),
    ((0xE0, 0xE0), _U_E0, 3),
    ((0xE1, 0xEC), _U_NEED2, 3),
    ((0xED, 0xED), _U_ED, 3),
    ((0xEE, 0xEF), _U_NEED2, 3),
    ((0xF0, 0xF0), _U_F0, 4),
    ((0xF1, 0xF3), _U_NEED3, 4),
    ((0xF4, 0xF4), _U_F4, 4),
)


@dataclass(frozen=True)
class SkeletonFormat:
    """The bounds of the grammar; `validate()` before building from client input."""

    max_points: int = 8
    max_title_bytes: int = 60
    max_est_digits: int = 3  # est_tokens <= 999
    max_direct_bytes: int = 200

    def validate(self) -> None:
        for name, low, high in (("max_points", 1, 99), ("max_title_bytes", 1, 1000),
                                ("max_est_digits", 1, 6), ("max_direct_bytes", 0, 10_000)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


DEFAULT_FORMAT = SkeletonFormat()


@dataclass(frozen=True)
class ByteAutomaton:
    transitions: np.ndarray  # [num_states, 256] int32; DEAD_STATE where a byte is refused
    accepting: np.ndarray  # [num_states] bool
    max_bytes: int  # the longest accepted string

    @property
    def num_states(self) -> int:
        return int(self.transitions.shape[0])

    def is_accepting(self, state: int) -> bool:
        return bool(self.accepting[state])

    def step(self, state: int, byte: int) -> int:
        return int(self.transitions[state, byte])

    def walk(self, state: int, data: bytes) -> int:
        for byte in data:
            state = int(self.transitions[state, byte])
        return state


def build_skeleton_automaton(fmt: SkeletonFormat, usable_bytes: Iterable[int] = range(NUM_BYTES)) -> ByteAutomaton:
    """The trimmed DFA of the format. `usable_bytes`: bytes the vocabulary can emit one at a time;
    others are refused, so every live state can still finish with single-byte tokens."""
    fmt.validate()
    builder = _Builder(fmt)
    refused = np.setdiff1d(np.arange(NUM_BYTES), np.fromiter(usable_bytes, dtype=np.int64))
    table = np.stack(builder.rows).astype(np.int32)
    table[:, refused] = DEAD_STATE
    return _trim(table, np.array(builder.accepting))


class _Builder:
    """Expands states from their keys, breadth first from ("start",)."""

    def __init__(self, fmt: SkeletonFormat):
        self.fmt = fmt
        self.index: dict[Hashable, int] = {}
        self.rows: list[np.ndarray] = []
        self.accepting: list[bool] = []
        self.queue: deque[Hashable] = deque()
        self.state(("dead",))
        self.state(("start",))
        while self.queue:
            key = self.queue.popleft()
            self._expand(key, self.index[key])

    def state(self, key: Hashable) -> int:
        if key not in self.index:
            self.index[key] = len(self.rows)
            self.rows.append(np.zeros(NUM_BYTES, dtype=np.int32))
            self.accepting.append(key == ("accept",))
            if key != ("dead",):
                self.queue.append(key)
        return self.index[key]

    def edge(self, src: int, low: int, high: int, dst_key: Hashable) -> None:
        row = self.rows[src]
        assert not row[low:high + 1].any(), "the grammar must stay deterministic"
        row[low:high + 1] = self.state(dst_key)

    def literal(self, src_key: Hashable, text: bytes, dst_key: Hashable) -> None:
        """Spell `text` from src to dst; intermediate states are keyed by (src, prefix), so literals
        from one state that share a prefix share its states (a trie)."""
        key = src_key
        for i, byte in enumerate(text):
            nxt = dst_key if i == len(text) - 1 else ("lit", src_key, text[:i + 1])
            row = self.rows[self.state(key)]
            if row[byte] == DEAD_STATE:
                self.edge(self.index[key], byte, byte, nxt)
            assert row[byte] == self.state(nxt), "the grammar must stay deterministic"
            key = nxt

    def _expand(self, key: Hashable, src: int) -> None:
        fmt = self.fmt
        assert isinstance(key, tuple)
        kind = key[0]
        if kind == "start":
            self.literal(key, b"[PLAN]\n", ("line", 1))
            self.literal(key, b"[DIRECT]", ("direct", 0, _U_OK))
        elif kind == "line":  # the start of a line, before point i or [END]
            i = key[1]
            if i <= fmt.max_points:
                self.literal(key, f"{i}.<".encode(), ("est", i, 0))
            if i >= 2:
                self.literal(key, b"[END]", ("accept",))
        elif kind == "est":  # est_tokens with n digits so far
            i, n = key[1], key[2]
            if n < fmt.max_est_digits:
                self.edge(src, ord("1") if n == 0 else ord("0"), ord("9"), ("est", i, n + 1))
            if n >= 1:
                self.edge(src, ord(">"), ord(">"), ("tool", key[1]))
        elif kind == "tool":
            self.literal(key, b"<None>[", ("deps", key[1]))
            self.literal(key, b"<Search>[", ("deps", key[1]))
        elif kind == "deps":  # after '['
            i = key[1]
            self.literal(key, b"-]", ("title", i, 0, _U_OK))
            for digit in range(1, min(i - 1, 9) + 1):
                self.edge(src, ord("0") + digit, ord("0") + digit, ("dep", i, 0, digit))
        elif kind == "dep":  # typing dependency `value`; `prev` is the last one finished (0: none)
            i, prev, value = key[1], key[2], key[3]
            for digit in range(10):
                if value * 10 + digit < i:
                    self.edge(src, ord("0") + digit, ord("0") + digit, ("dep", i, prev, value * 10 + digit))
            if prev < value:  # strictly increasing ids: no duplicates, a bounded list
                self.edge(src, ord(","), ord(","), ("dep_next", i, value))
                self.edge(src, ord("]"), ord("]"), ("title", i, 0, _U_OK))
        elif kind == "dep_next":  # after ','
            i, prev = key[1], key[2]
            for digit in range(1, min(i - 1, 9) + 1):
                self.edge(src, ord("0") + digit, ord("0") + digit, ("dep", i, prev, digit))
        elif kind == "title":
            i, count, pending = key[1], key[2], key[3]
            first = 0x21 if count == 0 else 0x20  # no leading space
            self._text(src, lambda c, u: ("title", i, c, u), count, pending, fmt.max_title_bytes, [(first, 0x7E)])
            if count >= 1 and pending == _U_OK:
                self.edge(src, ord("\n"), ord("\n"), ("line", i + 1))
        elif kind == "direct":
            count, pending = key[1], key[2]
            ascii_ranges = [(ord("\t"), ord("\n")), (0x20, ord("[") - 1), (ord("[") + 1, 0x7E)]
            self._text(src, lambda c, u: ("direct", c, u), count, pending, fmt.max_direct_bytes, ascii_ranges)
            if pending == _U_OK:
                self.literal(key, b"[END]", ("accept",))
        else:
            assert kind in ("lit", "accept"), key

    def _text(self, src: int, key_of: Callable[[int, int], Hashable], count: int, pending: int, max_count: int,
              ascii_ranges: list[tuple[int, int]]) -> None:
        """Free text: at most max_count bytes of valid UTF-8; key_of(count, pending) names a text state."""
        if pending != _U_OK:
            (low, high), after = _CONTINUATION[pending]
            self.edge(src, low, high, key_of(count + 1, after))
            return
        if count + 1 <= max_count:
            for low, high in ascii_ranges:
                self.edge(src, low, high, key_of(count + 1, _U_OK))
        for (low, high), after, length in _LEAD:
            if count + length <= max_count:
                self.edge(src, low, high, key_of(count + 1, after))


def _trim(table: np.ndarray, accepting: np.ndarray) -> ByteAutomaton:
    """Keep the states reachable from START that can reach acceptance; renumber, DEAD and START first;
    compute the longest accepted string (the DFA is acyclic)."""
    num_states = table.shape[0]
    successors = [np.unique(row[row != DEAD_STATE]).tolist() for row in table]
    predecessors: list[list[int]] = [[] for _ in range(num_states)]
    for state, nexts in enumerate(successors):
        for nxt in nexts:
            predecessors[nxt].append(state)
    alive = _closure(np.flatnonzero(accepting).tolist(), predecessors)
    reachable = _closure([START_STATE], [[n for n in nexts if n in alive] for nexts in successors])
    if START_STATE not in alive:
        raise ValueError("the vocabulary cannot spell a complete skeleton one byte at a time")
    keep = [DEAD_STATE] + sorted(reachable)  # START_STATE (1) stays at index 1
    renumber = np.zeros(num_states, dtype=np.int32)
    renumber[keep] = np.arange(len(keep), dtype=np.int32)
    live = np.zeros(num_states, dtype=bool)
    live[keep[1:]] = True
    trimmed = np.where(live[table], renumber[table], DEAD_STATE)[keep]
    trimmed[DEAD_STATE] = DEAD_STATE
    return ByteAutomaton(trimmed.astype(np.int32), accepting[keep], _longest_path(trimmed, accepting[keep]))


def _closure(seeds: list[int], edges: list[list[int]]) -> set[int]:
    seen, stack = set(seeds), list(seeds)
    while stack:
        for nxt in edges[stack.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def _longest_path(table: np.ndarray, accepting: np.ndarray) -> int:
    """Longest accepted string from START (Kahn's order over the live DAG; asserts acyclicity)."""
    num_states = table.shape[0]
    successors = [np.unique(row[row != DEAD_STATE]).tolist() for row in table]
    indegree = np.zeros(num_states, dtype=np.int64)
    for nexts in successors:
        indegree[nexts] += 1
    longest = np.full(num_states, -1, dtype=np.int64)
    longest[START_STATE] = 0
    order = deque(s for s in range(1, num_states) if indegree[s] == 0)
    num_done = 0
    while order:
        state = order.popleft()
        num_done += 1
        for nxt in successors[state]:
            if longest[state] >= 0:
                longest[nxt] = max(longest[nxt], longest[state] + 1)
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                order.append(nxt)
    assert num_done == num_states - 1, "the skeleton grammar must be acyclic"
    return int(longest[accepting].max())
