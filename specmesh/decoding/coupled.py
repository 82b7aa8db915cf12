"""Coupled sampling: every sampled token is a Gumbel-max draw under noise that is a pure function of
(seed, position), so a seeded request's tokens do not depend on how they were grouped into rounds.

Paper: Daliri, Musco, Suresh 2024, "Coupling without Communication and Drafter-Invariant Speculative
Decoding". Words (draft, accepted, recovered, bonus, final token) are those of the glossary in
`specmesh.decoding.rejection`.

Glossary
- position t: the absolute index of a token in its sequence: prompt tokens are 0..P-1, the first
  generated token is P. Both the drafter and the target know it (context length + offset).
- noise of position t: E_t [vocab], i.i.d. standard exponential, E_t[i] = -log u_t[i], where u_t is
  the uniform stream of a Philox4x64 generator whose key is (seed, t) (numpy's, on the CPU: the same
  numbers on every machine and device; all 64 bits of the seed count). The Gumbel noise of the
  Gumbel-max trick is g_t = -log E_t.
- coupled sample of a processed distribution r at position t: argmax_i r_i / E_t[i], which is
  argmax_i log r_i + g_t[i] over the support (entries with r_i = 0 score 0 and never win). It is a
  draw from r (the Gumbel-max trick), and a pure function of (r, seed, t).
- the target's token at t: y_t, the coupled sample of its processed p_t.

The coupled rule (`AcceptanceRule.COUPLED`, chains and trees alike):
- the drafter draws its token at t as the coupled sample of its own processed q_t (a deterministic
  drafter, e.g. n-gram, proposes what it proposes: its q is one-hot);
- draft token x_t is accepted iff x_t == y_t, in order; the first mismatch is replaced by y_t (the
  recovered token); if every draft token is accepted, y at the next position is the bonus token.
So a round emits y_P', y_P'+1, ... exactly, whatever was drafted: the rule is `verify_greedy` with y
in place of the argmax. Plain (target-only) decoding emits y_t too: a seeded request gives the same
tokens autoregressively, speculatively (any drafter, any k, fixed or adaptive), fused, batched with
anything, and after a failover replays its sequence on another replica (the noise is stateless).

Why the output follows p exactly: given the prefix, p_t is fixed and E_t is independent of every
noise that shaped the prefix (other positions), so y_t ~ p_t. The draft never changes y_t; it only
decides how many y's one target forward confirms. A drafter that uses the same noise agrees with the
target with probability P(argmax q/E == argmax p/E) = sum_i 1 / sum_j max(p_j / p_i, q_j / q_i) >=
(1 - TV) / (1 + TV) (TV: total variation distance of p and q), against 1 - TV for the standard rule's
min(1, p/q) test: the price of reproducibility (`coupled_agreement`; bench/acceptance_rules.py
measures it on the default model). The verifier never reads q, so none travels.

Worked example (vocab of 3, one position): p = [0.5, 0.3, 0.2], q = [0.2, 0.6, 0.2], E = [1.2, 0.4, 2.0]
    p / E = [0.417, 0.75, 0.1]   -> y = 1          q / E = [0.167, 1.5, 0.1]  -> x = 1: accepted
With E = [0.3, 0.4, 2.0]: p / E = [1.67, 0.75, 0.1] -> y = 0, q / E = [0.67, 1.5, 0.1] -> x = 1:
rejected, and the round emits y = 0.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from specmesh.decoding.rejection import verify_greedy
from specmesh.decoding.tree import verify_tree_greedy
from specmesh.decoding.types import NO_PARENT, VerifyOutcome

MAX_KEY = 2**64 - 1  # Philox keys are two 64-bit words: (seed, position)
NOISE_CACHE_BYTES = 64 * 2**20  # recently used noise rows kept (the drafter and the target read the same rows)
NOISE_CACHE_ROWS = 2**15  # and at most this many (tiny vocabularies)
_THREAD = threading.local()


def position_uniforms(seed: int, position: int, vocab_size: int) -> np.ndarray:
    """u_t [vocab] float64 in (0, 1): the Philox4x64 stream keyed by (seed, position), 52 bits per
    value, offset by half a step (exactly: (m + 1/2) / 2**52 fits float64's 53 bits) so that no value
    is 0 or 1 and every E_t[i] is finite and > 0.

    >>> u = position_uniforms(7, 3, 4)
    >>> bool(((u > 0) & (u < 1)).all()), bool((u == position_uniforms(7, 3, 4)).all())
    (True, True)
    """
    if not 0 <= seed <= MAX_KEY or not 0 <= position <= MAX_KEY:
        raise ValueError(f"seed and position must lie in [0, 2**64), got {seed}, {position}")
    raw = _philox(seed, position).random_raw(vocab_size)  # [vocab] uint64
    return ((raw >> np.uint64(12)).astype(np.float64) + 0.5) * 2.0**-52


def _philox(seed: int, position: int) -> np.random.Philox:
    """This thread's Philox bit generator set to key (seed, position), counter 0: the state
    `np.random.Philox(key=[seed, position])` starts in, without building one (a sixth of the cost)."""
    bit_generator = getattr(_THREAD, "philox", None)
    if bit_generator is None:
        bit_generator = _THREAD.philox = np.random.Philox(0)
    bit_generator.state = {
        "bit_generator": "Philox",
        "state": {"counter": np.zeros(4, dtype=np.uint64), "key": np.array([seed, position], dtype=np.uint64)},
        "buffer": np.zeros(4, dtype=np.uint64), "buffer_pos": 4, "has_uint32": 0, "uinteger": 0,
    }
    return bit_generator


def exponential_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """E_t [vocab] float64 on the CPU (module glossary); recently used rows come from a cache."""
    key = (seed, position, vocab_size)
    cached = _CACHE.get(key)
    if cached is not None:
        return cached
    noise = torch.from_numpy(-np.log(position_uniforms(seed, position, vocab_size)))
    _CACHE.put(key, noise)
    return noise


def gumbel_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """g_t [vocab] float64: the standard Gumbel noise of position t (for reading; sampling uses E_t)."""
    return -torch.log(exponential_noise(seed, position, vocab_size))


def noise_rows(seed: int, positions: Sequence[int], vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[len(positions), vocab] float64 on `device`: E_t for each position, in order."""
    if not positions:
        return torch.empty((0, vocab_size), dtype=torch.float64, device=device)
    return torch.stack([exponential_noise(seed, int(t), vocab_size) for t in positions]).to(device)


def coupled_sample(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The coupled sample of each row: probs [n, vocab] (processed, >= 0, each row with positive
    mass; need not be normalised), noise [n, vocab] E rows on the same device -> ids [n] int64.

    >>> p = torch.tensor([[0.5, 0.3, 0.2]]); q = torch.tensor([[0.2, 0.6, 0.2]])
    >>> e = torch.tensor([[1.2, 0.4, 2.0]], dtype=torch.float64)
    >>> coupled_sample(p, e).tolist(), coupled_sample(q, e).tolist()
    ([1], [1])
    """
    if probs.shape != noise.shape:
        raise ValueError(f"probs {tuple(probs.shape)} and noise {tuple(noise.shape)} must have one shape")
    return (probs.double() / noise).argmax(dim=-1)


def sample_at(probs: torch.Tensor, seed: int, positions: Sequence[int]) -> torch.Tensor:
    """Coupled samples of rows probs [n, vocab] at `positions` [n] -> ids [n] int64."""
    return coupled_sample(probs, noise_rows(seed, positions, probs.shape[-1], probs.device))


def row_positions(first_position: int, parents: Sequence[int] | None, num_tokens: int) -> list[int]:
    """[1 + k] the position each verify row samples: row 0 (after the pending token) samples
    `first_position`, the row after draft node i samples first_position + depth(i) (a chain's
    node i has depth i + 1).

    >>> row_positions(10, None, 3)                # chain of 3
    [10, 11, 12, 13]
    >>> row_positions(10, [-1, 0, -1, 2], 4)      # two branches of depth 2
    [10, 11, 12, 11, 12]
    """
    if parents is None:
        return [first_position + j for j in range(num_tokens + 1)]
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent == NO_PARENT else depths[parent] + 1)
    return [first_position, *(first_position + depth for depth in depths)]


def verify_coupled(draft_ids: Sequence[int], target_ids: Sequence[int], parents: Sequence[int] | None = None
                   ) -> VerifyOutcome:
    """The coupled rule given the target's token of every row (target_ids [1 + k], row layout of
    `row_positions`): walk from the root, accept the child whose token is the row's y, stop at the
    first row with none; that row's y is the final token. The same walk as greedy verification."""
    if parents is None:
        return verify_greedy(draft_ids, target_ids)
    return verify_tree_greedy(draft_ids, parents, target_ids)


def coupled_agreement(p: torch.Tensor, q: torch.Tensor) -> float:
    """P(coupled sample of p == coupled sample of q) at one position, exactly:
    sum_i 1 / sum_j max(p_j / p_i, q_j / q_i) over the tokens in both supports (module docstring).

    In O(vocab log vocab): with r = q / p, max(p_j / p_i, q_j / q_i) is p_j / p_i when r_j <= r_i and
    q_j / q_i otherwise (ties give the same value either way), so after sorting by r the inner sum is
    (mass of p up to i) / p_i + (mass of q after i) / q_i.

    >>> coupled_agreement(torch.tensor([0.5, 0.5]), torch.tensor([0.5, 0.5]))
    1.0
    >>> round(coupled_agreement(torch.tensor([0.5, 0.5]), torch.tensor([1.0, 0.0])), 6)   # 1 - TV = 0.5
    0.5
    >>> round(coupled_agreement(torch.tensor([0.6, 0.4]), torch.tensor([0.4, 0.6])), 6)   # 2 / (1 + 1.5)
    0.8
    >>> p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.3, 0.5])
    >>> round(coupled_agreement(p, q), 4), round(standard_agreement(p, q), 4)   # below 1 - TV from 3 tokens on
    (0.6308, 0.7)
    """
    p, q = p.double().flatten(), q.double().flatten()
    either = (p > 0) | (q > 0)
    p, q = p[either], q[either]
    ratio = torch.where(p > 0, q / p, torch.full_like(p, float("inf")))  # [n] r_j; inf where p_j = 0
    order = torch.argsort(ratio)
    p_sorted, q_sorted = p[order], q[order]
    p_up_to = p_sorted.cumsum(0)  # sum of p_j over r_j <= r_i (i's place in the order)
    q_after = q_sorted.sum() - q_sorted.cumsum(0)  # sum of q_j over r_j > r_i
    both = (p_sorted > 0) & (q_sorted > 0)
    inner = p_up_to[both] / p_sorted[both] + q_after[both] / q_sorted[both]
    return float((1.0 / inner).sum())


def standard_agreement(p: torch.Tensor, q: torch.Tensor) -> float:
    """The standard rule's acceptance probability of a draft from q: sum_i min(p_i, q_i) = 1 - TV."""
    return float(torch.minimum(p.double(), q.double()).sum())


class _NoiseCache:
    """A small LRU of noise rows, bounded in bytes; thread-safe (a service's engine thread and its
    event loop's n-gram drafts may both sample)."""

    def __init__(self, max_bytes: int, max_rows: int):
        self.max_bytes = max_bytes
        self.max_rows = max_rows
        self._rows: OrderedDict[tuple[int, int, int], torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple[int, int, int]) -> torch.Tensor | None:
        with self._lock:
            row = self._rows.get(key)
            if row is not None:
                self._rows.move_to_end(key)
            return row

    def put(self, key: tuple[int, int, int], row: torch.Tensor) -> None:
        size = row.numel() * row.element_size()
        with self._lock:
            if key in self._rows or size > self.max_bytes:
                return
            self._rows[key] = row
            self._bytes += size
            while self._bytes > self.max_bytes or len(self._rows) > self.max_rows:
                _, old = self._rows.popitem(last=False)
                self._bytes -= old.numel() * old.element_size()

    def clear(self) -> None:
        with self._lock:
            self._rows.clear()
            self._bytes = 0


_CACHE = _NoiseCache(NOISE_CACHE_BYTES, NOISE_CACHE_ROWS)
