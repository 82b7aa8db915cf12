"""Sibling branches' calls in one RPC: the Verify calls (and Forks) that a skeleton answer's branches
make in one event-loop turn leave as one call per Verify replica instead of one call each.

    siblings = SiblingCalls()
    # in each branch's task, when it opens (a fork of the plan's session) and after each gate release:
    child_id, first = await siblings.fork(remote, parent_id, num_prefix, tail, sampling, layout, timeout_s)
    outcome, finish = await siblings.verify(remote, session_id, proposal)

A call is queued and, the first time in a turn, a flush is scheduled for the end of the turn
(`loop.call_soon`: it runs after every task woken in that turn, e.g. all that
`specmesh.skeleton.rounds.RoundGate` released, has queued its call). The flush groups the queue:
- Verify calls by replica: a group of one is a plain Verify; a larger group is one VerifyBatch (one
  forward on the service, the one the separate calls would have met in; which calls share a forward
  never changes a row's logits);
- Forks by (replica, parent session, shared prefix, layout): one Fork with a `child_appends` entry
  per branch, so every branch's first token comes from one forward instead of one forward each.
A failure of a whole RPC reaches every call of its group as that RPC's error, an item's own failure
reaches its call alone, each as the AioRpcError the single call would have raised, so each branch's
failover (`coordinator.driver.FailoverVerifier`, the fork's prefill fallback) handles them as
before. A child made for a caller that was cancelled meanwhile is closed. Measured on
bench/skeleton.py (4 branches, 2 CPU cores): the README's Skeleton-of-Thought section.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from servicekit.remote import RemoteVerifier
from specmesh.decoding.proposal import DraftProposal
from specmesh.decoding.state import FinishReason
from specmesh.decoding.types import VerifyOutcome
from specmesh.proto.v1 import common_pb2, verify_pb2

VerifyResult = tuple[VerifyOutcome, FinishReason | None]


@dataclass
class _Call:
    key: Hashable  # calls with one key share an RPC
    send: Callable[[list[_Call]], Coroutine[Any, Any, None]]
    args: tuple
    future: asyncio.Future


@dataclass
class SiblingCalls:
    num_verify_batches: int = 0  # VerifyBatch RPCs sent
    num_batched_rounds: int = 0  # rounds that rode in them
    num_fork_rpcs: int = 0  # Fork RPCs sent
    num_forked: int = 0  # children they made
    _queued: list[_Call] = field(default_factory=list)
    _tasks: set[asyncio.Task] = field(default_factory=set)

    async def verify(self, remote: RemoteVerifier, session_id: str, proposal: DraftProposal) -> VerifyResult:
        return await self._queue(("verify", id(remote)), self._send_verify, (remote, session_id, proposal))

    async def fork(self, remote: RemoteVerifier, parent_id: str, num_prefix: int, tail: Sequence[int],
                   sampling: common_pb2.SamplingParams, layout: int, timeout_s: float) -> tuple[str, int]:
        """A child of `parent_id` keeping its first `num_prefix` tokens, `tail` appended: (its id, its first token)."""
        key = ("fork", id(remote), parent_id, num_prefix, layout)
        return await self._queue(key, self._send_fork, (remote, parent_id, num_prefix, list(tail), sampling, layout, timeout_s))

    async def _queue(self, key: Hashable, send, args: tuple):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._queued:
            loop.call_soon(self._flush)
        self._queued.append(_Call(key, send, args, future))
        return await future

    def _flush(self) -> None:
        queued, self._queued = self._queued, []
        groups: dict[Hashable, list[_Call]] = {}
        for call in queued:
            if not call.future.done():  # a caller cancelled before the flush sends nothing
                groups.setdefault(call.key, []).append(call)
        for calls in groups.values():
            task = asyncio.get_running_loop().create_task(self._send(calls))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, calls: list[_Call]) -> None:
        try:
            await calls[0].send(calls)
        except (grpc.aio.AioRpcError, ValueError) as exc:
            for call in calls:
                _settle(call, exc)
        except BaseException as exc:  # cancelled, or a bug: every caller hears of it
            for call in calls:
                _settle(call, exc if isinstance(exc, Exception) else asyncio.CancelledError())
            raise

    async def _send_verify(self, calls: list[_Call]) -> None:
        remote = calls[0].args[0]
        if len(calls) == 1:
            results: list[VerifyResult | grpc.aio.AioRpcError] = [await remote.verify(*calls[0].args[1:])]
        else:
            self.num_verify_batches += 1
            self.num_batched_rounds += len(calls)
            results = await remote.verify_batch([call.args[1:] for call in calls])
        for call, result in zip(calls, results):
            _settle(call, result)

    async def _send_fork(self, calls: list[_Call]) -> None:
        remote, parent_id, num_prefix, _, _, layout, timeout_s = calls[0].args
        request = verify_pb2.ForkRequest(
            session_id=parent_id, num_children=len(calls), num_prefix_tokens=num_prefix, layout=layout,
            child_sampling=[call.args[4] for call in calls],
            child_appends=[verify_pb2.ChildAppend(token_ids=call.args[3]) for call in calls])
        self.num_fork_rpcs += 1
        self.num_forked += len(calls)
        response = await remote.stub.Fork(request, timeout=timeout_s, metadata=remote.metadata)
        for call, child_id, first in zip(calls, response.child_session_ids, response.next_token_ids):
            if call.future.done():  # its caller is gone: nobody will close this child but us
                await remote.close(child_id)
            else:
                call.future.set_result((child_id, first))


def _settle(call: _Call, result: Any) -> None:
    """Hand a call its result, or raise `result` in it if it is an exception; a call already done
    (its caller cancelled) is left alone."""
    if call.future.done():
        return
    if isinstance(result, BaseException):
        call.future.set_exception(result)
    else:
        call.future.set_result(result)
