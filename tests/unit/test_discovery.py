"""Discovery: the pure diff (`specmesh.routing.discovery`), the address-list parser, and a pool that
applies answers (fake channels, no server: what is routed, pending, drained and forgotten)."""

from __future__ import annotations

import asyncio
import doctest

import pytest

import coordinator.discovery
import specmesh.routing.discovery
from coordinator.discovery import DnsSource, RaySource, StaticSource, UnionSource, parse_entry, source_for
from coordinator.pools import ServicePool
from specmesh.routing.discovery import DiscoveryPlan, plan_refresh


def test_docstring_examples():
    for module in (specmesh.routing.discovery, coordinator.discovery):
        assert doctest.testmod(module).failed == 0


@pytest.mark.parametrize("known, draining, discovered, expected", [
    (["a"], [], ["a"], DiscoveryPlan()),                                           # nothing changed
    (["a"], [], ["a", "b"], DiscoveryPlan(to_add=["b"])),                          # scale up
    (["a", "b"], [], ["b"], DiscoveryPlan(to_drain=["a"])),                        # scale down
    (["a", "b"], [], ["c", "b"], DiscoveryPlan(to_add=["c"], to_drain=["a"])),     # a pod replaced
    (["b"], ["a"], ["a", "b"], DiscoveryPlan(to_restore=["a"])),                   # back while draining
    (["a", "b"], [], [], DiscoveryPlan()),                                         # empty answer: keep all
    ([], [], ["a", "a", " b "], DiscoveryPlan(to_add=["a", "b"])),                 # duplicates, blanks
    (["a", "b", "c"], [], ["c"], DiscoveryPlan(to_drain=["a", "b"])),              # known order kept
])
def test_plan_refresh_table(known, draining, discovered, expected):
    assert plan_refresh(known, draining, discovered) == expected


def test_plan_refresh_rejects_a_replica_both_known_and_draining():
    with pytest.raises(ValueError, match="known and draining"):
        plan_refresh(["a"], ["a"], ["a"])


def test_plans_converge_to_the_answer():
    """Applying each plan to (known, draining) makes known equal the answer, whatever came before."""
    known, draining = ["a", "b"], ["c"]
    for answer in (["b", "c", "d"], ["d"], ["d", "a"], ["e"], ["e"]):
        plan = plan_refresh(known, draining, answer)
        draining = [d for d in draining if d not in plan.to_restore] + plan.to_drain
        known = [k for k in known if k not in plan.to_drain] + plan.to_restore + plan.to_add
        assert sorted(known) == sorted(answer)
        assert not set(known) & set(draining)


def test_parse_entries():
    assert parse_entry("dns:verify:7") == DnsSource("verify", 7)
    assert parse_entry("ray:///verify") == RaySource("verify", "specmesh")
    for bad in ("dns:///verify", "dns:///verify:http", "dns://8.8.8.8/verify:7", "ray:"):
        with pytest.raises(ValueError):
            parse_entry(bad)
    union = source_for(["a:1", "dns:///v:2", "b:3"], resolve_name=lambda name: ["10.0.0.1", "fd00::1"])
    assert isinstance(union, UnionSource) and union.dynamic
    assert union.resolve() == ["a:1", "b:3", "10.0.0.1:2", "[fd00::1]:2"]
    assert source_for([]) == StaticSource([])


class FakeChannel:
    def __init__(self, address: str, serving: set[str]):
        self.address, self.serving, self.closed = address, serving, False

    async def close(self) -> None:
        self.closed = True


class Answer:
    """A discovery source whose answer the test sets."""

    dynamic = True

    def __init__(self, addresses: list[str]):
        self.addresses = addresses

    def resolve(self) -> list[str]:
        return list(self.addresses)


def _pool(answer: Answer, serving: set[str], checks_open: asyncio.Event | None = None) -> tuple[ServicePool, dict[str, FakeChannel]]:
    """A pool over fake channels; health checks wait for `checks_open` (when given) and pass for `serving`."""
    channels: dict[str, FakeChannel] = {}

    def open_channel(address: str) -> FakeChannel:
        channels[address] = FakeChannel(address, serving)
        return channels[address]

    pool = ServicePool("verify", [], "round_robin", open_channel, source=answer)

    async def check_each(replicas) -> None:  # the health check, without a server: `serving` says who answers
        if checks_open is not None:
            await checks_open.wait()
        for replica in replicas:
            pool.replicas.set_health(replica, replica.id in serving)

    pool._check_each = check_each  # type: ignore[method-assign]
    return pool, channels


async def _until(predicate) -> None:
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def test_pool_adds_after_health_check_and_drains_without_cutting_sessions():
    async def run() -> None:
        serving = {"a:1"}
        answer = Answer(["a:1"])
        checks_open = asyncio.Event()
        checks_open.set()
        pool, channels = _pool(answer, serving, checks_open)
        assert [r.healthy for r in pool.replicas.replicas] == [True]  # the answer at start: trusted, as a static list
        held = pool.acquire()
        assert held.id == "a:1"

        answer.addresses = ["a:1", "b:1", "c:1"]  # b does not serve yet, c never does: both pending, not routed
        checks_open.clear()  # while their first health check is under way, they get no session
        refreshing = asyncio.ensure_future(pool.refresh())
        await _until(lambda: len(pool.replicas.replicas) == 3)
        assert {pool.acquire().id for _ in range(3)} == {"a:1"}
        checks_open.set()
        plan = await refreshing
        assert (plan.to_add, plan.to_drain) == (["b:1", "c:1"], [])
        serving.add("b:1")
        await pool.check_health()
        assert {pool.acquire().id for _ in range(6)} == {"a:1", "b:1"}

        answer.addresses = ["b:1", "c:1"]  # a leaves: no new session, the open ones keep their channel
        await pool.refresh()
        assert [r.id for r in pool.draining] == ["a:1"] and held.num_in_flight == 7
        assert {pool.acquire().id for _ in range(4)} == {"b:1"}
        assert pool.channel(held) is channels["a:1"] and not channels["a:1"].closed
        for _ in range(6):
            pool.release(held, 1.0, 10)
        assert not channels["a:1"].closed
        pool.fail(held)  # the last session on a failed over: a is forgotten, its channel closed
        assert pool.draining == [] and "a:1" not in [r.id for r in pool.replicas.replicas]
        await asyncio.sleep(0)
        assert channels["a:1"].closed

        answer.addresses = []  # an empty answer drains nothing
        assert (await pool.refresh()).is_empty and len(pool.replicas.replicas) == 2

        def broken() -> list[str]:
            raise OSError("lookup failed")

        answer.resolve = broken  # type: ignore[method-assign]
        assert (await pool.refresh()).is_empty and len(pool.replicas.replicas) == 2
        await pool.close()

    asyncio.run(run())


def test_pool_restores_a_draining_replica_as_pending():
    async def run() -> None:
        serving = {"a:1", "b:1"}
        answer = Answer(["a:1", "b:1"])
        pool, _ = _pool(answer, serving)
        await pool.check_health()
        held = pool.acquire()
        answer.addresses = ["b:1"]
        await pool.refresh()
        serving.discard(held.id)  # back in the answer, but not serving yet: it stays out
        answer.addresses = ["a:1", "b:1"]
        await pool.refresh()
        assert pool.draining == [] and held in pool.replicas.replicas and not held.healthy
        assert held.num_in_flight == 1  # its session's count carried over
        serving.add(held.id)
        await pool.check_health()
        assert held.healthy
        await pool.close()

    asyncio.run(run())


def test_static_list_is_trusted_at_once_and_never_refreshed():
    async def run() -> None:
        pool, _ = _pool(Answer([]), set())
        static = ServicePool("draft", ["x:1"], "round_robin", lambda address: FakeChannel(address, set()))
        assert static.acquire().id == "x:1" and not static.source.dynamic and bool(static)
        assert bool(pool) and not ServicePool("draft", [], "jsq2", lambda address: None)
        await pool.close()

    asyncio.run(run())
