"""Adaptive draft length: choose k from measured acceptance and measured costs.

With per-token acceptance rate a (Leviathan et al. 2023), a round that drafts k tokens emits on
average E(k) = (1 - a^(k+1)) / (1 - a) tokens. It costs k * d (d = draft ms per token) plus the
verify forward v(k) = v1 * (1 + beta * k) (v1 = a one-token forward; beta = extra cost per verified
token, a fixed prior: small because decoding is memory-bound; `bench/engine.py` measures it). k = 0 is plain decoding: 1 token for v1.
The policy picks the k in {0} ∪ [k_min, k_max] with the most tokens per ms. When k = 0 wins, a
probe round with k_min is still made every `probe_every` rounds so a change in acceptance
(a repetitive stretch of text, say) is noticed.

Estimates are exponential moving averages. The acceptance estimate treats a round as a run of
Bernoulli trials: n accepted of k drafted is n successes and (n < k) one failure.

Worked example: a = 0.8, d = 1 ms, v1 = 10 ms, beta = 0.1
    k=0: 1 / 10 = 0.100 tok/ms      k=4: 3.36 / (4 + 14) = 0.187      k=8: 4.33 / (8 + 18) = 0.167
    -> k = 4 (k=5: 3.69 / 20 = 0.184 is already worse)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class KPolicy(Protocol):
    """Chooses the draft length of the next round from what the previous rounds measured."""

    def next_k(self) -> int: ...

    def update(self, num_drafted: int, num_accepted: int, draft_ms: float, verify_ms: float) -> None: ...


def expected_tokens(acceptance: float, k: int) -> float:
    """E(k) = 1 + a + ... + a^k: tokens per round with k drafts at per-token acceptance a."""
    return sum(acceptance**i for i in range(k + 1))


@dataclass
class AdaptiveK:
    k_init: int = 4
    k_min: int = 1
    k_max: int = 16
    allow_zero: bool = True  # may fall back to plain decoding when drafting does not pay
    ema_weight: float = 0.3  # weight of the newest observation
    beta: float = 0.1  # verify cost growth per verified token (fixed; see the module docstring)
    probe_every: int = 8  # rounds at k = 0 between probes

    def __post_init__(self):
        if not 1 <= self.k_min <= self.k_init <= self.k_max:
            raise ValueError(f"need 1 <= k_min <= k_init <= k_max, got {self.k_min}, {self.k_init}, {self.k_max}")
        self.acceptance = 0.7  # prior until rounds are observed
        self.draft_ms_per_token: float | None = None
        self.decode_ms: float | None = None  # v1
        self._rounds_at_zero = 0
        self._k = self.k_init

    def next_k(self) -> int:
        return self._k

    def update(self, num_drafted: int, num_accepted: int, draft_ms: float, verify_ms: float) -> None:
        """Fold one round in and choose the next k."""
        if num_drafted > 0:
            trials = num_accepted + (1 if num_accepted < num_drafted else 0)
            observed = num_accepted / trials
            self.acceptance = self._ema(self.acceptance, observed)
            self.draft_ms_per_token = self._ema(self.draft_ms_per_token, draft_ms / num_drafted)
        self.decode_ms = self._ema(self.decode_ms, verify_ms / (1.0 + self.beta * num_drafted))
        self._k = self._choose(num_drafted)

    def speed(self, k: int) -> float:
        """Expected tokens per ms at draft length k under the current estimates."""
        decode_ms = self.decode_ms or 1.0
        draft_ms = (self.draft_ms_per_token or 0.0) * k
        return expected_tokens(min(self.acceptance, 0.999), k) / (draft_ms + decode_ms * (1 + self.beta * k))

    def _choose(self, last_k: int) -> int:
        candidates = list(range(self.k_min, self.k_max + 1))
        if self.allow_zero:
            candidates.append(0)
        best = max(candidates, key=self.speed)
        if best == 0:
            self._rounds_at_zero = self._rounds_at_zero + 1 if last_k == 0 else 1
            if self._rounds_at_zero >= self.probe_every:
                self._rounds_at_zero = 0
                return self.k_min
        return best

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.ema_weight) * old + self.ema_weight * new


@dataclass
class FixedK:
    """Always the same k (benchmarks, tests, or a user who knows best)."""

    k: int

    def next_k(self) -> int:
        return self.k

    def update(self, num_drafted: int, num_accepted: int, draft_ms: float, verify_ms: float) -> None:
        return None
