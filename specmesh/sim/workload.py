"""What the simulated clients ask for, and how much of each draft the target accepts.

Glossary (as in specmesh.decoding): a round drafts k tokens; the target *accepts* the longest
prefix it agrees with (n of them, 0 <= n <= k) and adds one token of its own (the recovered or
bonus token), so a round emits n + 1 tokens.

Acceptance per position is conditional: `acceptance[i]` is P(draft token i accepted | tokens 0..i-1
were). `specmesh stats` prints marginal rates P(token i accepted) = prod(acceptance[:i+1]);
`conditional_from_marginal` converts. Worked example: marginal [0.8, 0.6, 0.3] ->
conditional [0.8, 0.75, 0.5].
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def conditional_from_marginal(marginal: Sequence[float]) -> list[float]:
    """Per-position acceptance given the earlier positions, from marginal rates.

    >>> conditional_from_marginal([0.8, 0.6, 0.3])
    [0.8, 0.75, 0.5]
    """
    out, before = [], 1.0
    for rate in marginal:
        out.append(round(rate / before, 12) if before > 0 else 0.0)
        before = rate
    return out


class AcceptanceModel:
    """Draws the accepted count of one round: per-position Bernoulli trials, or a replayed trace."""

    def __init__(self, conditional: Sequence[float] = (), trace: Sequence[int] = ()):
        if not conditional and not trace:
            raise ValueError("acceptance needs per-position probabilities or a trace")
        self.conditional = list(conditional)
        self.trace = list(trace)

    def num_accepted(self, k: int, rng: random.Random, round_index: int, offset: int) -> int:
        """Accepted tokens of k drafted. A trace is replayed from `offset` (per session) and capped at
        k: a recorded round with more accepted than this k would also have accepted these k."""
        if self.trace:
            return min(k, self.trace[(offset + round_index) % len(self.trace)])
        probs, last = self.conditional, len(self.conditional) - 1
        n = 0
        while n < k and rng.random() < probs[min(n, last)]:
            n += 1
        return n


def make_sampler(spec: Any, name: str):
    """A function rng -> int from a size spec: 128 | [64, 128, 256] (drawn) | {uniform: [lo, hi]} |
    {lognormal: {median: 200, sigma: 0.8}} (rounded, at least 1) | {sequence: [40, 31, 55]}: the
    values in order, one per call, cycling (a recorded run replayed: the i-th request started gets
    the i-th prompt and, from a second sampler, the i-th output length).

    >>> import random
    >>> sample = make_sampler({"sequence": [3, 1, 2]}, "output_tokens")
    >>> [sample(random.Random(0)) for _ in range(4)]
    [3, 1, 2, 3]
    """
    if isinstance(spec, bool):
        raise ValueError(f"{name}: not a size: {spec!r}")
    if isinstance(spec, int | float):
        value = int(spec)
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {spec}")
        return lambda rng: value
    if isinstance(spec, list) and spec:
        choices = [int(v) for v in spec]
        return lambda rng: rng.choice(choices)
    if isinstance(spec, dict) and len(spec) == 1:
        ((kind, args),) = spec.items()
        if kind == "uniform":
            low, high = int(args[0]), int(args[1])
            return lambda rng: rng.randint(low, high)
        if kind == "lognormal":
            mu, sigma = math.log(float(args["median"])), float(args["sigma"])
            return lambda rng: max(1, round(rng.lognormvariate(mu, sigma)))
        if kind == "sequence" and isinstance(args, list) and args and all(int(v) >= 1 for v in args):
            values = itertools.cycle([int(v) for v in args])
            return lambda rng: next(values)
    raise ValueError(f"{name}: expected an int, a list, {{uniform: [lo, hi]}}, {{lognormal: {{median, sigma}}}} "
                     f"or {{sequence: [...]}}, got {spec!r}")


def load_trace(path: str | Path) -> list[dict[str, float]]:
    """Requests from JSON (a list of objects) or CSV with columns arrival_s, prompt_tokens, output_tokens."""
    path = Path(path)
    if path.suffix == ".csv":
        with path.open() as f:
            rows: list[dict[str, Any]] = list(csv.DictReader(f))
    else:
        rows = json.loads(path.read_text())
    return [{"arrival_s": float(r["arrival_s"]), "prompt_tokens": int(r["prompt_tokens"]), "output_tokens": int(r["output_tokens"])}
            for r in rows]
