"""How a request runs, as a value: the execution plan, chosen once by one pure function.

    plan = choose_plan("speculative", drafter=True, cascade=False, server_rounds=True)
    plan                  # Plan.CLIENT_ROUNDS_PLAIN_RUNS
    async for event in speculative_stream_async(verifier, drafter, prompt_ids, params, plan=plan): ...

The plans (where the draft comes from; who steps the rounds):
  CLIENT_ROUNDS             a Verify call per round, drafted by the drafter beside the driver
  CLIENT_ROUNDS_PLAIN_RUNS  the same, but a plain stretch (rounds where drafting does not pay,
                            `SpeculationState.plain_rounds_from_here`) goes to the verifier as one Run
  CASCADE                   client rounds whose drafter is a cascade of Stage services (each stage
                            verifies the level below and drafts for the one above)
  CASCADE_PLAIN_RUNS        the same, a plain stretch going to the verifier as one Run (as above)
  FUSED_STEP                the verifier drafts with its hosted drafter and verifies: one Step per round
  FUSED_RUN                 the verifier drafts and steps every round itself, streaming them (one Run)
  PLAIN_ROUNDS              no draft: a Verify call per target token (plain decoding, driven here)
  SERVER_RUN                no draft: the verifier steps every plain round itself (one Run)
  SKELETON                  Skeleton-of-Thought: a plan stream, then branches, each run as one of the above

The async driver (`specmesh.decoding.async_driver`) dispatches on the plan to one small driver per
shape; the Coordinator chooses the plan (`choose_plan`) and reports it in the request's final stats.

>>> choose_plan("speculative", drafter=True, server_rounds=False).value
'client_rounds'
>>> choose_plan("speculative", drafter=True, server_rounds=True, drafter_on_verify=True).value
'fused_run'
>>> choose_plan("autoregressive", drafter=False, server_rounds=True).value
'server_run'
>>> choose_plan("fused", drafter=False, cascade=True, server_rounds=True)
Traceback (most recent call last):
ValueError: a cascade runs in speculative mode, not fused
"""

from __future__ import annotations

import enum

MODES = ("speculative", "fused", "autoregressive", "skeleton")


class Plan(enum.Enum):
    CLIENT_ROUNDS = "client_rounds"
    CLIENT_ROUNDS_PLAIN_RUNS = "client_rounds_plain_runs"
    CASCADE = "cascade"
    CASCADE_PLAIN_RUNS = "cascade_plain_runs"
    FUSED_STEP = "fused_step"
    FUSED_RUN = "fused_run"
    PLAIN_ROUNDS = "plain_rounds"
    SERVER_RUN = "server_run"
    SKELETON = "skeleton"

    @property
    def drafts_here(self) -> bool:
        """The driver calls a drafter of its own (else the verifier drafts, or nothing does)."""
        return self in (Plan.CLIENT_ROUNDS, Plan.CLIENT_ROUNDS_PLAIN_RUNS, Plan.CASCADE, Plan.CASCADE_PLAIN_RUNS)

    @property
    def plain_runs(self) -> bool:
        """Client rounds whose plain stretches (`SpeculationState.plain_rounds_from_here`) go to the
        verifier as one Run each."""
        return self in (Plan.CLIENT_ROUNDS_PLAIN_RUNS, Plan.CASCADE_PLAIN_RUNS)

    @property
    def fused(self) -> bool:
        """The verifier drafts with its hosted drafter."""
        return self in (Plan.FUSED_STEP, Plan.FUSED_RUN)

    @property
    def server_steps(self) -> bool:
        """The verifier steps the rounds itself (one streamed Run for the whole generation)."""
        return self in (Plan.FUSED_RUN, Plan.SERVER_RUN)


def choose_plan(mode: str, *, drafter: bool, server_rounds: bool, cascade: bool = False,
                drafter_on_verify: bool = False) -> Plan:
    """The plan of a request in `mode` (a `MODES` name).
    `drafter`: the request drafts (speculative mode; False for drafter "none"); `drafter_on_verify`:
    its drafter is hosted by the Verify service (an n-gram lookup placed there), so the verifier
    drafts; `cascade`: the request runs through Stage services (its drafter is the cascade);
    `server_rounds`: the verifier may step rounds itself (a Verify service's Run).
    ValueError for a combination that cannot run."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; one of {', '.join(MODES)}")
    if cascade and mode != "speculative":
        raise ValueError(f"a cascade runs in speculative mode, not {mode}")
    if mode == "skeleton":
        return Plan.SKELETON
    if mode == "speculative" and cascade:
        return Plan.CASCADE_PLAIN_RUNS if server_rounds else Plan.CASCADE
    if mode == "fused" or (mode == "speculative" and drafter and drafter_on_verify):
        return Plan.FUSED_RUN if server_rounds else Plan.FUSED_STEP
    if mode == "speculative" and drafter:
        return Plan.CLIENT_ROUNDS_PLAIN_RUNS if server_rounds else Plan.CLIENT_ROUNDS
    return Plan.SERVER_RUN if server_rounds else Plan.PLAIN_ROUNDS
