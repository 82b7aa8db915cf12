"""specmesh.skeleton.rounds.RoundGate: sibling branches' rounds leave together, with a time bound."""

from __future__ import annotations

import asyncio

import pytest

from specmesh.skeleton.rounds import RoundGate


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 5.0))


def test_a_round_leaves_when_every_member_has_arrived():
    async def main():
        gate = RoundGate(max_wait_s=5.0)
        gate.join(1), gate.join(2)
        first = asyncio.create_task(gate.arrive(1))
        await asyncio.sleep(0.01)
        assert not first.done()  # 2 has not arrived
        await gate.arrive(2)
        await first
        return gate.num_releases, gate.num_timeouts

    assert run(main()) == (1, 0)


def test_a_member_that_leaves_is_not_waited_for():
    async def main():
        gate = RoundGate(max_wait_s=5.0)
        for member in (1, 2, 3):
            gate.join(member)
        waiting = [asyncio.create_task(gate.arrive(m)) for m in (1, 2)]
        await asyncio.sleep(0.01)
        assert not any(t.done() for t in waiting)
        gate.leave(3)  # its stream ended
        await asyncio.gather(*waiting)
        gate.leave(2)
        await gate.arrive(1)  # alone now: no wait
        return gate.num_releases

    assert run(main()) == 2


def test_a_stalled_member_holds_a_round_at_most_max_wait_s():
    async def main():
        gate = RoundGate(max_wait_s=0.05)
        gate.join(1), gate.join(2)
        start = asyncio.get_running_loop().time()
        await gate.arrive(1)  # 2 never comes
        return asyncio.get_running_loop().time() - start, gate.num_timeouts

    waited_s, num_timeouts = run(main())
    assert 0.04 <= waited_s < 1.0 and num_timeouts == 1


def test_a_non_member_passes_straight_through():
    async def main():
        gate = RoundGate(max_wait_s=5.0)
        gate.join(1)
        await gate.arrive(7)
        return gate.num_releases

    assert run(main()) == 0


def test_a_cancelled_waiter_does_not_block_the_others_once_it_leaves():
    async def main():
        gate = RoundGate(max_wait_s=5.0)
        gate.join(1), gate.join(2), gate.join(3)
        cancelled = asyncio.create_task(gate.arrive(1))
        other = asyncio.create_task(gate.arrive(2))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        assert 1 not in gate.waiting and not other.done()
        gate.leave(1)  # the branch's finally
        await gate.arrive(3)
        await other

    run(main())


def test_drifting_branches_go_out_together_every_round():
    """Three branches whose per-round work takes different times: every round, all three leave the
    gate in the same event-loop turn (so their Verify calls go out together)."""
    async def branch(gate: RoundGate, member: int, delay_s: float, num_rounds: int, log: list[tuple[int, int]]):
        try:
            for round_index in range(num_rounds):
                await asyncio.sleep(delay_s)  # drafting, response handling: it differs per branch
                await gate.arrive(member)
                log.append((round_index, member))
                await asyncio.sleep(0)  # the Verify call
        finally:
            gate.leave(member)

    async def main():
        gate = RoundGate(max_wait_s=5.0)
        log: list[tuple[int, int]] = []
        for member in (1, 2, 3):
            gate.join(member)
        await asyncio.gather(branch(gate, 1, 0.001, 4, log), branch(gate, 2, 0.01, 4, log), branch(gate, 3, 0.004, 2, log))
        return gate, log

    gate, log = run(main())
    rounds = [r for r, _ in log]
    assert rounds == sorted(rounds)  # no branch ran ahead of a sibling's round
    assert [sorted(m for r, m in log if r == i) for i in range(4)] == [[1, 2, 3], [1, 2, 3], [1, 2], [1, 2]]
    assert (gate.num_releases, gate.num_timeouts) == (4, 0)


def test_max_wait_s_must_not_be_negative():
    with pytest.raises(ValueError):
        RoundGate(max_wait_s=-1)
