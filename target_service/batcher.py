"""Cross-session continuous batching of Verify calls: concurrent calls from different sessions are
merged into ONE `TargetVerifier.verify_many` forward.

A call costs 1 + k tokens (the pending token and its draft); a batch holds calls first in, first out
up to `max_batch_tokens` (at least one call). The collection window (`window_ms`) only delays the
first call of an idle service; under load the calls that arrive while a forward runs ride in the next.
If a batched forward fails (e.g. the KV pool is full), each call is retried alone so the error reaches
only the calls it belongs to (the engine rolls a failed forward back completely).
Each result carries the `ForwardCost` the verifier fits over its rounds' forwards
(`TargetVerifier.forward_cost`), so the clients' adaptive k counts what a draft token costs the whole batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from servicekit.batching import WindowBatcher
from servicekit.engine_thread import EngineThread
from servicekit.metrics import ServiceMetrics
from specmesh.decoding.adaptive import ForwardCost
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.types import VerifyOutcome
from specmesh.decoding.verifier import TargetSession, TargetVerifier


@dataclass
class VerifyCall:
    session: TargetSession
    proposal: DraftProposal

    @property
    def num_tokens(self) -> int:
        return 1 + self.proposal.num_tokens


@dataclass
class VerifyResult:
    outcome: VerifyOutcome
    batch_size: int  # sessions in the forward this call rode in
    verify_ms: float  # wall time of that forward + acceptance
    batch_tokens: int = 0  # tokens in that forward
    cost: ForwardCost | None = None  # the service's fit of a forward's cost, when determined


def run_verify_batch(verifier: TargetVerifier, calls: Sequence[VerifyCall],
                     plain_next: bool = False) -> list[VerifyResult | Exception]:
    """Engine thread: one verify_many forward for all calls (per-call retries if it fails), with the
    verifier's fitted forward cost as this batch's share. `plain_next`: `TargetVerifier.verify_many`'s."""
    start = time.perf_counter()
    try:
        outcomes = verifier.verify_many([c.session for c in calls], [c.proposal for c in calls], plain_next=plain_next)
    except Exception as batch_error:  # noqa: BLE001 - attributed below
        if len(calls) == 1:
            return [batch_error]
        results: list[VerifyResult | Exception] = []
        for call in calls:
            single_start = time.perf_counter()
            try:
                outcome = verifier.verify(call.session, call.proposal)
                results.append(VerifyResult(outcome, 1, (time.perf_counter() - single_start) * 1e3, call.num_tokens))
            except Exception as exc:  # noqa: BLE001 - this call's own error
                results.append(exc)
        return results
    verify_ms = (time.perf_counter() - start) * 1e3
    tokens = sum(c.num_tokens for c in calls)
    cost = verifier.forward_cost(len(calls))
    return [VerifyResult(outcome, len(calls), verify_ms, tokens, cost) for outcome in outcomes]


BATCH_SIZE_WEIGHT = 0.2  # of the newest batch in `VerifyBatcher.recent_batch_size`


class VerifyBatcher(WindowBatcher):
    def __init__(self, engine_thread: EngineThread, verifier: TargetVerifier, window_ms: float, max_batch_tokens: int,
                 metrics: ServiceMetrics, expected_callers: Callable[[], int] | None = None):
        def on_batch(calls: Sequence[VerifyCall]) -> None:
            self.recent_batch_size += BATCH_SIZE_WEIGHT * (len(calls) - self.recent_batch_size)
            metrics.forwards.inc()
            metrics.batch_size.observe(len(calls))
            metrics.batch_tokens.observe(sum(c.num_tokens for c in calls))

        self.recent_batch_size = 1.0  # sessions per forward, a moving average (what a new session will share)
        super().__init__(
            engine_thread, lambda calls: run_verify_batch(verifier, calls), window_ms, max_batch_tokens,
            cost=lambda call: call.num_tokens, on_batch=on_batch, on_queue_depth=metrics.queue_depth.set,
            expected_callers=expected_callers,
        )

    async def verify(self, session: TargetSession, proposal: DraftProposal) -> VerifyResult:
        return await self.submit(VerifyCall(session, proposal))
