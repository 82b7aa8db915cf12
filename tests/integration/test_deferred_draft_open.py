"""A speculative request opens its Draft session when it first drafts (coordinator.driver.FailoverDrafter,
`DraftCosts`): once a Draft session has said what a draft token costs, a request that never drafts costs
the Draft service nothing, and one that drafts late gets exactly the drafts an early session would have
made. A live Draft service (tiny random model, loopback); the drafter driven as the Coordinator drives it."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.driver import Calls, DraftCosts, FailoverDrafter, Failovers
from coordinator.pools import ServicePool
from draft_service.options import DraftOptions
from draft_service.server import create_server as create_draft
from servicekit.background import BackgroundServices
from servicekit.channels import open_channel
from specmesh.decoding.sampling import SamplingParams

PROMPT = [5, 9, 12, 7, 30, 18, 4, 11]
LATER = [21, 3, 17, 8, 26, 2]  # tokens the target emitted while the request decoded plainly


@pytest.fixture(scope="module")
def draft(tiny_model_dir):
    with BackgroundServices() as services:
        yield services.start(create_draft(DraftOptions(model=str(tiny_model_dir("llama", init_std=0.2)), dtype="float64",
                                                       port=0)))


def opened_sessions(draft) -> int:
    return draft.servicer.num_sessions


async def requests(draft, costs: DraftCosts, params: SamplingParams, *, draft_later: bool):
    """Three requests through one Coordinator's pool: the first opens as it starts (no cost known yet); the
    second never drafts; the third drafts only after decoding plainly (`LATER`). What each saw."""
    pool = ServicePool("draft", [f"127.0.0.1:{draft.port}"], "round_robin", lambda address: open_channel(address))
    seen: dict = {}

    def drafter() -> FailoverDrafter:
        return FailoverDrafter(pool, Calls(timeout_s=30), Failovers(), use_service=True, costs=costs)

    first = drafter()
    handle = await first.open(PROMPT, params)
    seen["first_opened"] = opened_sessions(draft)
    seen["first_cost"] = first.opened_ms_per_token(handle)
    await first.close(handle)

    quiet = drafter()
    handle = await quiet.open(PROMPT, params)
    seen["quiet_open"] = opened_sessions(draft)
    seen["quiet_cost"] = quiet.opened_ms_per_token(handle)
    await quiet.close(handle)
    seen["quiet_closed"] = opened_sessions(draft)

    late = drafter()
    handle = await late.open(PROMPT, params)
    if draft_later:  # told the first tokens by a call that drafts nothing (k = 0), the rest by its first draft
        seen["told_nothing"] = (await late.propose(handle, LATER[:2], 0)).token_ids
        seen["opened_by_k0"] = opened_sessions(draft)
        seen["late_drafts"] = (await late.propose(handle, LATER[2:], 4)).token_ids
        seen["late_opened"] = opened_sessions(draft)
    await late.close(handle)
    await pool.close()
    return seen


def test_a_request_that_never_drafts_opens_no_draft_session(draft):
    costs = DraftCosts()
    seen = asyncio.run(requests(draft, costs, SamplingParams(temperature=0.0, max_new_tokens=32, seed=3), draft_later=False))
    assert seen["first_opened"] == 1 and seen["first_cost"] is not None  # nothing known yet: opened with the request
    assert costs.ms_per_token == seen["first_cost"]
    assert seen["quiet_open"] == 0 and seen["quiet_closed"] == 0  # no session on the Draft service, ever
    assert seen["quiet_cost"] == seen["first_cost"]  # the k policy's prior all the same


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_session_opened_at_the_first_draft_drafts_what_an_early_one_would(draft, temperature):
    params = SamplingParams(temperature=temperature, max_new_tokens=32, seed=11)
    costs = DraftCosts()
    deferred = asyncio.run(requests(draft, costs, params, draft_later=True))
    # the cost follows the Propose answers: what an OpenSession would report now (the next request's prior)
    assert costs.ms_per_token == draft.servicer.drafter.ms_per_token is not None
    assert deferred["told_nothing"] == [] and deferred["opened_by_k0"] == 0  # a call for no draft opens nothing
    assert deferred["late_opened"] == 1  # opened by its first draft, told the prompt and every token since

    async def early() -> list[int]:  # no costs: the session opens with the request, then the same Propose
        pool = ServicePool("draft", [f"127.0.0.1:{draft.port}"], "round_robin", lambda address: open_channel(address))
        drafter = FailoverDrafter(pool, Calls(timeout_s=30), Failovers(), use_service=True)
        handle = await drafter.open(PROMPT, params)
        assert opened_sessions(draft) == 1
        tokens = (await drafter.propose(handle, LATER, 4)).token_ids
        await drafter.close(handle)
        await pool.close()
        return tokens

    assert deferred["late_drafts"] == asyncio.run(early())
    assert len(deferred["late_drafts"]) == 4
