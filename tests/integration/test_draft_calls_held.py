"""The Coordinator's drafter sends no Propose that asks for nothing while the Draft session owes no verdict
(coordinator.driver.FailoverDrafter): a request's last round after plain decoding (k capped at 0) would make
a model drafter prefill the whole context for nothing. Held tokens go with the next call, so the drafts are
the ones a session told everything in one call makes. A live Draft service (tiny random model, loopback)."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.driver import Calls, FailoverDrafter, Failovers
from coordinator.pools import ServicePool
from draft_service.options import DraftOptions
from draft_service.server import create_server as create_draft
from servicekit.background import BackgroundServices
from servicekit.channels import open_channel
from specmesh.decoding.sampling import SamplingParams

PROMPT = [5, 9, 12, 7, 30, 18, 4, 11]
PLAIN = [21, 3, 17, 8]  # tokens the target emitted while the request decoded plainly
MORE = [26, 2]


@pytest.fixture(scope="module")
def draft(tiny_model_dir):
    with BackgroundServices() as services:
        yield services.start(create_draft(DraftOptions(model=str(tiny_model_dir("llama", init_std=0.2)), dtype="float64",
                                                       port=0)))


async def session(draft, params: SamplingParams, calls: list[tuple[list[int], int]]) -> tuple[list[list[int]], list[int]]:
    """One request's drafter making `calls` (tokens, k): each call's drafts, and the Propose calls sent after each."""
    pool = ServicePool("draft", [f"127.0.0.1:{draft.port}"], "round_robin", lambda address: open_channel(address))
    drafter = FailoverDrafter(pool, Calls(timeout_s=30), Failovers(), use_service=True)
    handle = await drafter.open(PROMPT, params)
    drafts, sent = [], []
    for tokens, k in calls:
        drafts.append((await drafter.propose(handle, tokens, k)).token_ids)
        assert handle.remote_session is not None
        sent.append(handle.remote_session.rounds[0])
    await drafter.close(handle)
    await pool.close()
    return drafts, sent


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_call_for_nothing_waits_for_the_next(draft, temperature):
    params = SamplingParams(temperature=temperature, max_new_tokens=32, seed=11)
    drafts, sent = asyncio.run(session(draft, params, [(PLAIN, 0), (MORE, 4)]))
    assert drafts[0] == [] and sent[0] == 0  # not sent
    assert sent[1] == 1 and len(drafts[1]) == 4
    together, _ = asyncio.run(session(draft, params, [(PLAIN + MORE, 4)]))
    assert drafts[1] == together[0]  # held tokens went with the draft call: the same drafts


def test_a_verdict_is_always_sent(draft):
    """After a draft, the next call carries its verdict, even asking for nothing (the session must cut its draft)."""
    params = SamplingParams(temperature=0.0, max_new_tokens=32, seed=1)
    drafts, sent = asyncio.run(session(draft, params, [(PLAIN, 3), (MORE, 0), ([7], 0)]))
    assert len(drafts[0]) == 3 and sent == [1, 2, 2]  # the verdict sent; the call after it (nothing owed) held
