"""The in-process driver of the speculation round: `speculative_stream` steps a `SpeculationState`
with a local drafter and a `TargetVerifier`; `generate` collects it.

    for event in speculative_stream(verifier, drafter, prompt_ids, params):
        print(event.token_ids)            # tokens accepted this round, ready to stream
    result = generate(verifier, drafter, prompt_ids, params)   # the same loop, collected

The round itself (k, finish rules, stats) is `specmesh.decoding.state`; this file only calls the
drafter and the verifier. With no drafter (or k = 0) a round is one plain decoding step, so plain
autoregressive decoding is this loop with `drafter=None`. A proposal marked `unverified` (a lossy
adaptive cascade's early stop, opt-in) is emitted without a verify forward; the target takes it as
context in its next one.

Randomness: the request's seed is resolved first (`resolve_seed`: drawn when missing, the acceptance
rule pinned); the target and the drafter each get a generator seeded from it (`draft_seed` derives
the drafter's), the same split the distributed services use, so a seeded run is reproducible
in-process and over the wire. With the coupled rule neither reads its generator: every token is a
pure function of (seed, position), whatever this loop's rounds (`specmesh.decoding.coupled`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from specmesh.decoding.adaptive import KPolicy
from specmesh.decoding.proposal import Drafter, DraftProposal
from specmesh.decoding.sampling import SamplingParams, make_generator, resolve_seed
from specmesh.decoding.state import FinishReason, SpeculationState, StepEvent, draft_seed
from specmesh.decoding.stats import SpecStats
from specmesh.decoding.verifier import TargetVerifier

__all__ = ["FinishReason", "GenerationResult", "StepEvent", "draft_seed", "generate", "speculative_stream"]


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens (prompt excluded); includes the EOS / stop-completing token
    finish_reason: FinishReason
    stats: SpecStats
    events: list[StepEvent] = field(default_factory=list)

    @property
    def lossy(self) -> bool:
        """True when some tokens were committed without the target's verification (opt-in lossy mode)."""
        return any(event.unverified for event in self.events)

    @property
    def text(self) -> str:
        """The visible text, when the stream decoded (a `decode` was given)."""
        return "".join(event.text for event in self.events)


def speculative_stream(
    verifier: TargetVerifier,
    drafter: Drafter | None,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    k_policy: KPolicy | None = None,
    eos_token_ids: Sequence[int] | None = None,
    decode: Callable[[Sequence[int]], str] | None = None,
    plain_stretches: bool = False,
) -> Iterator[StepEvent]:
    """Generate with speculative decoding (plain decoding when `drafter` is None); see module doc.
    `plain_stretches`: the state's plain stretches (`SpeculationState.plain_rounds`), as a remote
    driver with `plain_runs` makes them (the same rounds in-process, for comparisons)."""
    engine = verifier.engine
    params = resolve_seed(params)
    target_generator, seed = make_generator(params.seed, engine.device)
    state = SpeculationState(
        params, num_prompt_tokens=len(prompt_ids), max_context=engine.max_context,
        eos_token_ids=engine.eos_token_ids if eos_token_ids is None else eos_token_ids,
        k_policy=k_policy, has_drafter=drafter is not None, decode=decode, prompt_ids=prompt_ids, seed=seed,
        vocab_size=engine.vocab_size, plain_stretches=plain_stretches,
    )
    # a self-draft on the target's own model takes what it was not told from the target's KV (drafters/model.py)
    shares_kv = drafter is not None and getattr(drafter, "kv_source", None) is engine
    if drafter is not None:  # this process's measured costs, if any
        catch_up_ms = 0.0 if shares_kv else getattr(drafter, "catch_up_ms_per_token", None)  # (a copy, not a forward)
        state.prior_costs(getattr(drafter, "ms_per_token", None), engine.stats.step_ms, catch_up_ms, verifier.forward_cost())
    start = time.perf_counter()
    session = verifier.open(prompt_ids, params, target_generator)
    draft_state = None
    try:
        yield state.start(session.pending_token_id, (time.perf_counter() - start) * 1e3)
        if drafter is not None:
            draft_generator, _ = make_generator(draft_seed(seed), drafter.device)
            draft_state = drafter.open(prompt_ids)
            if shares_kv:
                drafter.share_kv(draft_state, session.seq_id)  # type: ignore[attr-defined]  # (a ModelDrafter: kv_source)
        while not state.finished:
            k = state.next_k()
            proposal, draft_ms, step = DraftProposal(token_ids=[]), 0.0, state.draft_step(k)
            if step.asks:
                assert drafter is not None  # has_drafter
                start = time.perf_counter()
                drafted = drafter.propose(draft_state, step.new_tokens, k, params, draft_generator)
                draft_ms = (time.perf_counter() - start) * 1e3
                proposal = step.take(drafted, getattr(drafter, "ms_per_token", None))  # its figure after these forwards
            if proposal.unverified:  # lossy, opt-in: the cascade stopped early; the target catches up next forward
                verifier.append_unverified(session, proposal.token_ids)
                yield state.record_unverified(proposal.token_ids, draft_ms)
                continue
            start = time.perf_counter()
            # with no drafter every round is plain: the next one's forward may be launched ahead (verifier.py)
            outcome = verifier.verify(session, proposal, plain_next=drafter is None and state.max_draft_tokens > 0)
            verify_ms = (time.perf_counter() - start) * 1e3
            yield state.record(proposal.num_tokens, outcome.num_accepted, outcome.token_ids, draft_ms, verify_ms,
                               verifier.forward_cost())
    finally:
        verifier.close(session)
        if drafter is not None and draft_state is not None:
            drafter.close(draft_state)


def generate(
    verifier: TargetVerifier,
    drafter: Drafter | None,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    **kwargs,
) -> GenerationResult:
    """`speculative_stream`, collected."""
    events = list(speculative_stream(verifier, drafter, prompt_ids, params, **kwargs))
    last = events[-1]
    assert last.finish_reason is not None and last.stats is not None  # the state's last event says both
    return GenerationResult([t for event in events for t in event.token_ids], last.finish_reason, last.stats, events)
