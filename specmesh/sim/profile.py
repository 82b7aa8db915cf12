"""Measure an engine's forward times on a grid and write them as a `CostTable`.

    engine = load_engine("default")
    table = profile_engine(engine, rows=[1, 2, 4, 8], tokens_per_row=[1, 2, 4, 8, 64, 512], context=[64, 512])
    table.save("cpu-smollm2.json")

For each context length, `max(rows)` sequences are prefilled once to that length; every grid point
then times one ragged forward of the first `rows` of them with `tokens_per_row` new tokens each
(logits as `cost.logits_rows` says) and truncates them back, so the KV pool never grows. The grid is
swept `warmup` times unrecorded, then `repeats` times (every context length's sequences held at once
where the KV pool has room, else a group of lengths at a time), and each point keeps the median of its sweeps:
a point's runs lie a sweep apart, so a stretch of slow machine (a shared host's neighbours) spoils one
of them, not all (timed back to back, one 30 s stretch made a whole context's column 25-60% dear).

A forward's cost steps where its work changes kind: past `VERIFY_LOGITS_MAX_TOKENS` new tokens it computes
one row of logits instead of all, and an engine may take another path past some count (`engine.cost_steps`:
the native engine's CPU fast path serves up to `fastpath.MAX_ROWS` new tokens; a bfloat16 prefill past it
runs oneDNN's matmuls, a 33-token one 58 ms on one core of the AVX-512 VM against 99 for 32 tokens). The
table interpolates linearly, so a grid whose range spans a step gets both sides of it (`tokens_axis`):
without them a 37-token prompt was priced between 32 and 64 tokens, more than twice what it takes. Run it under the thread
settings the service will use (torch.set_num_threads): processes on one host share its cores.

`clock`: "wall" times the forward (what it took on this machine as loaded now); "thread_cpu" takes
the calling thread's CPU time, which with 1 torch thread (the forward runs on the calling thread) is
the forward's time on a core of its own, whatever else runs on the machine: the full-speed time the
simulator's host model expects (servers.py). `meta["wall_over_cpu"]` is the mean ratio of the two,
how much other load slowed the profile.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from specmesh.sim.cost import VERIFY_LOGITS_MAX_TOKENS, CostTable

if TYPE_CHECKING:  # torch is imported when profiling, not by `specmesh sim run` or the CLI's start
    from specmesh.models.engine import Engine

PROFILE_ROWS = (1, 2, 4, 8, 16)
PROFILE_TOKENS_PER_ROW = (1, 2, 4, 8, 16, 64, 256)
PROFILE_CONTEXT = (32, 256, 1024)


def tokens_axis(tokens_per_row: Sequence[int], steps: Sequence[int]) -> list[int]:
    """The tokens-per-row points to measure: those asked for, plus both sides of each step (a count after
    which a forward's cost jumps) that lies inside their range, so no interpolation crosses a step.

    >>> tokens_axis([1, 5, 64], steps=[32])
    [1, 5, 32, 33, 64]
    >>> tokens_axis([1, 8], steps=[32])  # the step is past the grid: nothing to add
    [1, 8]
    """
    axis = set(tokens_per_row)
    low, high = min(axis), max(axis)
    for step in steps:
        if low <= step < high:
            axis |= {step, step + 1}
    return sorted(axis)


def _context_groups(engine: Engine, context: Sequence[int], num_seqs: int, max_new: int) -> list[list[int]]:
    """The context lengths' indices in groups whose sequences the KV pool holds at once (all of them in
    one group when it can: each sweep then crosses the whole grid)."""
    usage = engine.kv_usage()
    groups: list[list[int]] = [[]]
    used = 0
    for ci, num_context in enumerate(context):
        need = num_seqs * -(-(num_context + max_new) // usage.block_size)
        if groups[-1] and used + need > usage.free_blocks:
            groups.append([])
            used = 0
        groups[-1].append(ci)
        used += need
    return groups


def profile_engine(
    engine: Engine,
    rows: Sequence[int] = PROFILE_ROWS,
    tokens_per_row: Sequence[int] = PROFILE_TOKENS_PER_ROW,
    context: Sequence[int] = PROFILE_CONTEXT,
    repeats: int = 3,
    warmup: int = 1,
    meta: dict[str, Any] | None = None,
    on_point: Callable[[int, int], None] | None = None,
    clock: str = "wall",
) -> CostTable:
    """The table of median forward times (ms); `on_point(done, total)` after each timed forward."""
    import torch

    from specmesh.models.engine import SeqInput

    if clock not in ("wall", "thread_cpu"):
        raise ValueError(f"clock must be wall or thread_cpu, got {clock!r}")
    if clock == "thread_cpu" and torch.get_num_threads() != 1:
        raise ValueError("clock thread_cpu needs 1 torch thread (the forward then runs on the calling thread)")
    ratios: list[float] = []

    steps = (VERIFY_LOGITS_MAX_TOKENS, *getattr(engine, "cost_steps", ()))
    rows, tokens_per_row, context = sorted(set(rows)), tokens_axis(tokens_per_row, steps), sorted(set(context))
    if max(context) + max(tokens_per_row) > engine.max_context:
        raise ValueError(f"context {max(context)} + {max(tokens_per_row)} new tokens exceed the model's {engine.max_context}")
    times = [[[0.0] * len(context) for _ in tokens_per_row] for _ in rows]
    samples: dict[tuple[int, int, int], list[float]] = {}
    total, done = len(rows) * len(tokens_per_row) * len(context) * (warmup + repeats), 0
    token_id = min(100, engine.vocab_size - 1)  # any ordinary token: the cost does not depend on which
    for group in _context_groups(engine, context, max(rows), max(tokens_per_row)):
        seqs = {ci: [engine.new_sequence() for _ in range(max(rows))] for ci in group}
        try:
            for ci, group_seqs in seqs.items():
                engine.forward([SeqInput(s, [token_id] * context[ci], [context[ci] - 1]) for s in group_seqs])
            for sweep in range(warmup + repeats):
                for ci, group_seqs in seqs.items():
                    for ri, num_rows in enumerate(rows):
                        for ti, num_new in enumerate(tokens_per_row):
                            logits_at = list(range(num_new)) if num_new <= VERIFY_LOGITS_MAX_TOKENS else [num_new - 1]
                            start, start_cpu = time.perf_counter(), time.thread_time()
                            engine.forward([SeqInput(s, [token_id] * num_new, logits_at) for s in group_seqs[:num_rows]])
                            wall_ms, cpu_ms = (time.perf_counter() - start) * 1e3, (time.thread_time() - start_cpu) * 1e3
                            for s in group_seqs[:num_rows]:
                                engine.truncate(s, context[ci])
                            if sweep >= warmup:
                                samples.setdefault((ri, ti, ci), []).append(cpu_ms if clock == "thread_cpu" else wall_ms)
                                ratios.append(wall_ms / cpu_ms if cpu_ms > 0 else 1.0)
                            done += 1
                            if on_point is not None:
                                on_point(done, total)
        finally:
            for group_seqs in seqs.values():
                for s in group_seqs:
                    engine.free(s)
    for (ri, ti, ci), values in samples.items():
        times[ri][ti][ci] = statistics.median(values)
    info = {"backend": engine.backend, "dtype": str(engine.dtype), "device": str(engine.device),
            "torch_threads": torch.get_num_threads(), "repeats": repeats, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "clock": clock, "wall_over_cpu": round(statistics.fmean(ratios), 3)}
    return CostTable(list(rows), list(tokens_per_row), list(context), times, {**info, **(meta or {})})
