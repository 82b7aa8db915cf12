"""Measured stage costs for the adaptive cascade, in target-forward equivalents per chunk.

The stopper (`policy.AdaptiveStopper`) weighs what running one more level costs against lambda times
the quality it buys, so its costs must be the pipeline's own, measured on the machine that serves it:

    c_j (stage j < S)  = (one verify forward over k + 1 tokens + (m_j - 1) one-token forwards) of stage j
                         / one verify forward of the target over k + 1 tokens
    c_S (the target)   = 1.0
(m_j: the stage's extension, `StageSpec.num_extend_tokens`; a stage runs one verify-and-extend forward
and m_j - 1 plain decoding forwards per chunk). `measure_forward_ms` times a forward of the engine on
a given number of new tokens after a given cached context (medians over repeats, after a warm-up).

Worked example: forward ms (k + 1 = 5 tokens) int8 24, target 33; one-token int8 21; m = 4:
    c_0 = (24 + 3 * 21) / 33 = 2.64,  c_1 = 1.0
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from specmesh.models.engine import Engine, SeqInput


def measure_forward_ms(engine: Engine, num_new_tokens: int, num_cached_tokens: int, repeats: int = 7,
                       token_id: int = 1) -> float:
    """Median ms of one forward feeding `num_new_tokens` after `num_cached_tokens` cached tokens."""
    if num_new_tokens < 1 or num_cached_tokens < 0 or repeats < 1:
        raise ValueError("need num_new_tokens >= 1, num_cached_tokens >= 0, repeats >= 1")
    if num_cached_tokens + num_new_tokens > engine.max_context:
        raise ValueError("the measured forward does not fit in the context window")
    seq = engine.new_sequence()
    try:
        if num_cached_tokens:
            engine.forward([SeqInput(seq, [token_id] * num_cached_tokens, [])])
        times = []
        for i in range(repeats + 1):  # the first is a warm-up
            start = time.perf_counter()
            engine.forward([SeqInput(seq, [token_id] * num_new_tokens, [num_new_tokens - 1])])
            if i:
                times.append((time.perf_counter() - start) * 1e3)
            engine.truncate(seq, num_cached_tokens)
        return statistics.median(times)
    finally:
        engine.free(seq)


def chunk_stage_costs(verify_ms: Sequence[float], step_ms: Sequence[float], extend_tokens: Sequence[int]) -> list[float]:
    """Per-chunk costs c_0..c_S (module docstring) from each level's verify-forward ms (stages then the
    target: S + 1 values), the stages' one-token forward ms (S values) and their extensions (S values).

    >>> [round(c, 2) for c in chunk_stage_costs([24.0, 33.0], [21.0], [4])]
    [2.64, 1.0]
    """
    num_stages = len(verify_ms) - 1
    if num_stages < 1 or len(step_ms) != num_stages or len(extend_tokens) != num_stages:
        raise ValueError(f"need S + 1 verify times and S step times and extensions, got {len(verify_ms)}, "
                         f"{len(step_ms)}, {len(extend_tokens)}")
    if any(m < 1 for m in extend_tokens) or any(t <= 0 for t in [*verify_ms, *step_ms]):
        raise ValueError("extensions are >= 1 and times > 0")
    target = verify_ms[-1]
    return [(verify_ms[j] + (extend_tokens[j] - 1) * step_ms[j]) / target for j in range(num_stages)] + [1.0]


def chunk_costs_from_forward_costs(forward_costs: Sequence[float], extend_tokens: Sequence[int]) -> list[float]:
    """Per-chunk costs from per-forward costs in target-forward equivalents (a predictor file's
    `info.stage_forward_costs`, measured by `specmesh cascade collect`: S stages then the target), for
    stages extending `extend_tokens`: c_j = forward_costs[j] * m_j (a stage's verify forward counted as
    one of its plain forwards), c_S = 1.0.

    >>> chunk_costs_from_forward_costs([0.7, 1.0], [4])
    [2.8, 1.0]
    """
    num_stages = len(extend_tokens)
    if len(forward_costs) != num_stages + 1:
        raise ValueError(f"{len(forward_costs)} forward costs for {num_stages} stages and the target")
    if any(c <= 0 for c in forward_costs) or any(m < 1 for m in extend_tokens):
        raise ValueError("forward costs are > 0 and extensions >= 1")
    return [forward_costs[j] * extend_tokens[j] for j in range(num_stages)] + [1.0]

