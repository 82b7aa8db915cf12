"""SiblingCalls: sibling rounds queued in one event-loop turn leave as one VerifyBatch per replica."""

import asyncio

import grpc
import pytest

from coordinator.siblings import SiblingCalls
from specmesh.decoding.proposal import DraftProposal
from specmesh.proto.v1 import common_pb2, verify_pb2


def rpc_error(code=grpc.StatusCode.UNAVAILABLE, details="replica down"):
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class FakeRemote:
    """Answers each session with (its id, its draft); records which RPC carried which sessions."""

    def __init__(self, fail_batch: Exception | None = None, failing_items: frozenset = frozenset()):
        self.rpcs: list[tuple[str, list[str]]] = []
        self.fail_batch = fail_batch
        self.failing_items = failing_items

    async def verify(self, session_id, proposal):
        self.rpcs.append(("Verify", [session_id]))
        return (session_id, proposal.token_ids), None

    async def verify_batch(self, items):
        self.rpcs.append(("VerifyBatch", [session_id for session_id, _ in items]))
        await asyncio.sleep(0)
        if self.fail_batch is not None:
            raise self.fail_batch
        return [rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "KV full") if session_id in self.failing_items
                else ((session_id, proposal.token_ids), None) for session_id, proposal in items]


def run_round(batch, calls):
    async def main():
        return await asyncio.gather(*(batch.verify(remote, session_id, DraftProposal([n]))
                                      for n, (remote, session_id) in enumerate(calls)), return_exceptions=True)
    return asyncio.run(main())


def test_calls_of_one_turn_go_as_one_batch_per_replica():
    a, b = FakeRemote(), FakeRemote()
    batch = SiblingCalls()
    results = run_round(batch, [(a, "s1"), (b, "t1"), (a, "s2"), (a, "s3")])
    assert results == [(("s1", [0]), None), (("t1", [1]), None), (("s2", [2]), None), (("s3", [3]), None)]
    assert a.rpcs == [("VerifyBatch", ["s1", "s2", "s3"])]
    assert b.rpcs == [("Verify", ["t1"])]  # alone on its replica: a plain Verify
    assert (batch.num_verify_batches, batch.num_batched_rounds) == (1, 3)


def test_a_whole_batch_failure_reaches_every_call_and_an_item_failure_only_its_own():
    down = FakeRemote(fail_batch=rpc_error())
    results = run_round(SiblingCalls(), [(down, "s1"), (down, "s2")])
    assert all(isinstance(r, grpc.aio.AioRpcError) and r.code() == grpc.StatusCode.UNAVAILABLE for r in results)

    partial = FakeRemote(failing_items=frozenset({"s2"}))
    results = run_round(SiblingCalls(), [(partial, "s1"), (partial, "s2"), (partial, "s3")])
    assert results[0] == (("s1", [0]), None) and results[2] == (("s3", [2]), None)
    assert isinstance(results[1], grpc.aio.AioRpcError) and results[1].code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_calls_of_later_turns_form_their_own_batches():
    remote = FakeRemote()
    batch = SiblingCalls()

    async def main():
        first = asyncio.gather(batch.verify(remote, "s1", DraftProposal([1])), batch.verify(remote, "s2", DraftProposal([2])))
        await asyncio.sleep(0.01)
        second = await batch.verify(remote, "s3", DraftProposal([3]))
        return await first, second

    (one, two), three = asyncio.run(main())
    assert remote.rpcs == [("VerifyBatch", ["s1", "s2"]), ("Verify", ["s3"])]
    assert three == (("s3", [3]), None)


def test_a_cancelled_caller_is_left_out_of_the_flush():
    remote = FakeRemote()
    batch = SiblingCalls()

    async def main():
        loop = asyncio.get_running_loop()
        keep = loop.create_task(batch.verify(remote, "s1", DraftProposal([1])))
        drop = loop.create_task(batch.verify(remote, "s2", DraftProposal([2])))
        await asyncio.sleep(0)  # both queued
        drop.cancel()
        result = await keep
        with pytest.raises(asyncio.CancelledError):
            await drop
        return result

    assert asyncio.run(main()) == (("s1", [1]), None)
    assert remote.rpcs == [("Verify", ["s1"])]


class FakeForkRemote:
    """A Verify replica whose Fork makes children "c0", "c1", ... and records requests and closes."""

    metadata = None

    def __init__(self):
        self.forks: list = []
        self.closed: list[str] = []
        remote = self

        class Stub:
            async def Fork(self, request, timeout, metadata):
                remote.forks.append(request)
                await asyncio.sleep(0.01)
                n = len(request.child_appends)
                return verify_pb2.ForkResponse(child_session_ids=[f"c{i}" for i in range(n)],
                                               next_token_ids=[100 + i for i in range(n)])

        self.stub = Stub()

    async def close(self, session_id):
        self.closed.append(session_id)


def test_forks_of_one_turn_share_one_fork_rpc_and_an_orphaned_child_is_closed():
    remote = FakeForkRemote()
    siblings = SiblingCalls()
    sampling = common_pb2.SamplingParams(temperature=0.0)

    async def main():
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(siblings.fork(remote, "plan", 30, tail, sampling, common_pb2.BRANCH_LAYOUT_ONE_SEQUENCE, 5.0))
                 for tail in ([1, 2], [3], [4, 5, 6])]
        other_prefix = loop.create_task(siblings.fork(remote, "plan", 29, [7], sampling, 0, 5.0))
        await asyncio.sleep(0.001)  # every fork queued and sent; cancel one caller while its Fork is in flight
        tasks[1].cancel()
        results = await asyncio.gather(*tasks, other_prefix, return_exceptions=True)
        return results

    results = asyncio.run(main())
    assert results[0] == ("c0", 100) and results[2] == ("c2", 102) and results[3] == ("c0", 100)
    assert isinstance(results[1], asyncio.CancelledError)
    assert len(remote.forks) == 2  # the three branches sharing 30 prefix tokens, and the one with 29
    shared = remote.forks[0]
    assert shared.num_children == 3 and shared.num_prefix_tokens == 30 and shared.layout == common_pb2.BRANCH_LAYOUT_ONE_SEQUENCE
    assert [list(c.token_ids) for c in shared.child_appends] == [[1, 2], [3], [4, 5, 6]]
    assert remote.closed == ["c1"]
    assert (siblings.num_fork_rpcs, siblings.num_forked) == (2, 4)
