"""Replica routing: each policy's rule, health and re-admission, seeded determinism, and simulated
load (sessions opening and closing in a fake clock) where the policies must beat their baselines."""

from __future__ import annotations

import heapq
import random
from collections import Counter

import pytest

from specmesh.routing.policies import JSQ2, RoundRobin
from specmesh.routing.registry import ROUTERS, make_router
from specmesh.routing.replica import NoHealthyReplica, Replica
from specmesh.routing.replica_set import ReplicaSet
from specmesh.routing.weighted import WeightedJSQ


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def make_set(ids, router, seed=0, **kwargs) -> tuple[ReplicaSet, FakeClock]:
    clock = FakeClock()
    replicas = [r if isinstance(r, Replica) else Replica(r) for r in ids]
    return ReplicaSet(replicas, router, rng=random.Random(seed), clock=clock, **kwargs), clock


def open_close_sim(router: str, num_replicas=20, mean_life_s=200.0, num_sessions=8000, burn_in=2000, seed=0) -> int:
    """One session opens per second, lives an exponential time; returns the longest queue seen.

    Every replica is equally fast (50 tokens/s per session), so a weighted router measures no
    difference between them.
    """
    rng, (rs, clock) = random.Random(seed), make_set([f"r{i}" for i in range(num_replicas)], router, seed=seed + 1)
    ends: list[tuple[float, int, Replica, float]] = []  # (end_s, tiebreak, replica, start_s)
    max_in_flight = 0
    for n in range(num_sessions):
        clock.now_s = float(n)
        while ends and ends[0][0] <= clock.now_s:
            end_s, _, replica, start_s = heapq.heappop(ends)
            rs.finish(replica, end_s - start_s, num_tokens=max(1, round(50 * (end_s - start_s))))
        replica = rs.acquire()
        heapq.heappush(ends, (clock.now_s + rng.expovariate(1 / mean_life_s), n, replica, clock.now_s))
        if n >= burn_in:
            max_in_flight = max(max_in_flight, max(r.num_in_flight for r in rs.replicas))
    return max_in_flight


def processor_sharing_sim(router: str, tokens_per_step: list[float], load=0.8, num_tokens=20, num_steps=10000, burn_in=1000, seed=0):
    """Replica i makes `tokens_per_step[i]` tokens per step, shared by its open sessions; sessions of
    `num_tokens` arrive at `load` times the total capacity. Both replicas are configured with weight 1:
    a weighted router must learn the difference from `finish`. Returns (share of sessions per replica,
    longest queue seen)."""
    rng, (rs, clock) = random.Random(seed), make_set(["r0", "r1"], router, seed=seed + 1)
    remaining: dict[str, list[list[float]]] = {r.id: [] for r in rs.replicas}  # [tokens left, start step]
    arrival_p = load * sum(tokens_per_step) / num_tokens
    counts: Counter[str] = Counter()
    max_in_flight = 0
    for step in range(num_steps):
        clock.now_s = float(step)
        if rng.random() < arrival_p:
            replica = rs.acquire()
            remaining[replica.id].append([num_tokens, step])
            if step >= burn_in:
                counts[replica.id] += 1
        for replica, speed in zip(rs.replicas, tokens_per_step):
            sessions = remaining[replica.id]
            for session in sessions:
                session[0] -= speed / len(sessions)
            for session in [s for s in sessions if s[0] <= 1e-9]:
                rs.finish(replica, step + 1 - session[1], num_tokens)
            remaining[replica.id] = [s for s in sessions if s[0] > 1e-9]
        if step >= burn_in:
            max_in_flight = max(max_in_flight, max(r.num_in_flight for r in rs.replicas))
    total = sum(counts.values())
    return {rid: counts[rid] / total for rid in remaining}, max_in_flight


# --- round robin -------------------------------------------------------------------------------


def test_round_robin_cycles_in_list_order():
    rs, _ = make_set(["a", "b", "c"], "round_robin")
    assert [rs.acquire().id for _ in range(7)] == ["a", "b", "c", "a", "b", "c", "a"]


def test_round_robin_skips_unhealthy_and_gives_the_turn_back():
    rs, _ = make_set(["a", "b", "c"], "round_robin")
    rs.set_health(rs.get("b"), False)
    assert [rs.pick().id for _ in range(4)] == ["a", "c", "a", "c"]
    rs.set_health(rs.get("b"), True)
    assert [rs.pick().id for _ in range(3)] == ["a", "b", "c"]


def test_round_robin_draws_nothing_from_rng():
    rng = random.Random(5)
    state = rng.getstate()
    RoundRobin().pick([Replica("a"), Replica("b")], rng)
    assert rng.getstate() == state


# --- JSQ(2) ------------------------------------------------------------------------------------


def test_jsq2_picks_the_shorter_of_its_two_samples():
    for seed in range(200):
        replicas = [Replica(f"r{i}", num_in_flight=random.Random(1000 + seed).randrange(5)) for i in range(6)]
        replicas[seed % 6].healthy = False
        first, second = random.Random(seed).sample([r for r in replicas if r.healthy], 2)  # what the policy samples
        chosen = JSQ2().pick(replicas, random.Random(seed))
        assert chosen is (second if second.num_in_flight < first.num_in_flight else first)


def test_jsq2_with_two_replicas_always_joins_the_shorter_queue():
    short, long = Replica("short", num_in_flight=2), Replica("long", num_in_flight=3)
    rng = random.Random(0)
    assert all(JSQ2().pick([long, short], rng) is short for _ in range(50))


def test_jsq2_with_one_healthy_replica_picks_it():
    alone = Replica("alone", num_in_flight=9)
    assert JSQ2().pick([Replica("down", healthy=False), alone], random.Random(0)) is alone


def test_jsq2_balances_open_close_load_better_than_random():
    # 20 replicas, ~10 sessions each: random choice's busiest replica holds ~24, JSQ(2)'s ~14.
    seeds = range(3)
    random_max = [open_close_sim("random", seed=s) for s in seeds]
    jsq2_max = [open_close_sim("jsq2", seed=s) for s in seeds]
    assert max(jsq2_max) < min(random_max), (jsq2_max, random_max)
    assert max(jsq2_max) <= 17, jsq2_max
    assert min(random_max) >= 19, random_max


# --- weighted JSQ ------------------------------------------------------------------------------


def test_weighted_jsq_fills_replicas_in_proportion_to_configured_weight():
    rs, _ = make_set([Replica("big", weight=3.0), Replica("small", weight=1.0)], "weighted_jsq")
    for _ in range(400):
        rs.acquire()
    assert abs(rs.get("big").num_in_flight - 300) <= 1


def test_weighted_jsq_idle_tie_goes_to_the_faster_replica():
    slow, fast = Replica("slow"), Replica("fast", weight=1.5)
    assert WeightedJSQ().pick([slow, fast], random.Random(0)) is fast


def test_weighted_jsq_learns_capacity_from_finished_sessions():
    router = WeightedJSQ(ema_weight=0.2)
    fast, slow = Replica("fast"), Replica("slow")
    rng = random.Random(0)
    for _ in range(200):  # 100 tokens per session; fast makes 30 tokens/s, slow 10, each +-20% noise
        router.on_finish(fast, latency_s=100 / 30 * rng.uniform(0.8, 1.2), num_tokens=100)
        router.on_finish(slow, latency_s=100 / 10 * rng.uniform(0.8, 1.2), num_tokens=100)
    fast_cap, slow_cap = router.estimator.capacity(fast), router.estimator.capacity(slow)
    assert fast_cap is not None and slow_cap is not None
    assert fast_cap / slow_cap == pytest.approx(3.0, rel=0.15)
    rs = ReplicaSet([fast, slow], router, rng=random.Random(1))
    for _ in range(400):
        rs.acquire()
    assert fast.num_in_flight / 400 == pytest.approx(0.75, abs=0.04)


def test_weighted_jsq_sends_three_quarters_to_a_replica_three_times_as_fast():
    # Both configured equal; the speed difference is learned from finished sessions.
    for seed in range(3):
        share, max_in_flight = processor_sharing_sim("weighted_jsq", [3.0, 1.0], seed=seed)
        assert share["r0"] == pytest.approx(0.75, abs=0.05), (seed, share)
        assert max_in_flight < 30
    _, round_robin_max = processor_sharing_sim("round_robin", [3.0, 1.0], seed=0)
    assert round_robin_max > 200  # half the load on the slow replica is 1.6x what it can serve


def test_weighted_jsq_balances_equal_replicas_at_least_as_well_as_jsq2():
    assert open_close_sim("weighted_jsq", seed=0) <= open_close_sim("jsq2", seed=0)


def test_weighted_jsq2_samples_by_capacity_so_a_big_replica_is_not_capped():
    # Uniform sampling would show the big replica to a pick 2 times in 10, capping it near 20%.
    big = Replica("big", weight=9.0)
    rs, _ = make_set([big] + [Replica(f"s{i}") for i in range(9)], "weighted_jsq2")
    for _ in range(1800):
        rs.acquire()
    assert big.num_in_flight / 1800 == pytest.approx(0.5, abs=0.02)


def test_unmeasured_replica_gets_the_fleet_prior():
    router = WeightedJSQ()
    measured, new = Replica("measured"), Replica("new", weight=2.0)
    router.on_finish(measured, latency_s=2.0, num_tokens=100)  # 50 tokens/s
    assert router.estimator.capacities([measured, new]) == pytest.approx([50.0, 100.0])
    router.on_finish(measured, latency_s=0.0, num_tokens=100)  # a clock too coarse: ignored
    assert router.estimator.capacity(measured) == pytest.approx(50.0)


# --- health, errors, registry ------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_no_healthy_replica_raises(name):
    rs, _ = make_set(["a", "b"], name, cooldown_s=None)
    rs.set_health(rs.get("a"), False)
    rs.fail(rs.acquire())  # b
    with pytest.raises(NoHealthyReplica, match="none of 2 replicas"):
        rs.acquire()
    with pytest.raises(NoHealthyReplica):
        make_router(name).pick([], random.Random(0))


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_unhealthy_replica_is_never_picked_and_comes_back_after_a_passing_check(name):
    rs, _ = make_set(["a", "b", "c"], name, cooldown_s=None)
    b = rs.get("b")
    rs.set_health(b, False)
    assert b not in {rs.pick() for _ in range(100)}
    rs.set_health(b, True)
    assert b in {rs.pick() for _ in range(100)}


def test_failed_replica_is_readmitted_after_the_cooldown():
    rs, clock = make_set(["a", "b"], "round_robin", cooldown_s=5.0)
    a = rs.acquire()
    rs.fail(a)
    assert (a.healthy, a.num_in_flight, a.last_failure_s) == (False, 0, 0.0)
    clock.now_s = 4.9
    assert {rs.pick().id for _ in range(4)} == {"b"}
    clock.now_s = 5.0
    assert {rs.pick().id for _ in range(4)} == {"a", "b"}
    rs.start(a)
    rs.fail(a)  # fails again: out for another cool-down from now
    clock.now_s = 9.9
    assert {rs.pick().id for _ in range(4)} == {"b"}


def test_health_checks_failing_more_often_than_the_cooldown_keep_a_replica_out():
    rs, clock = make_set(["a", "b"], "round_robin", cooldown_s=5.0)
    a = rs.get("a")
    for second in range(0, 20, 2):  # a checker every 2 s says a is down
        clock.now_s = float(second)
        rs.set_health(a, False)
        assert {rs.pick().id for _ in range(4)} == {"b"}
    clock.now_s = 23.0  # the checks stopped 5 s ago: a is tried again
    assert {rs.pick().id for _ in range(4)} == {"a", "b"}


def test_without_cooldown_only_a_health_check_readmits():
    rs, clock = make_set(["a", "b"], "round_robin", cooldown_s=None)
    a = rs.acquire()
    rs.fail(a)
    clock.now_s = 1e9
    assert {rs.pick().id for _ in range(4)} == {"b"}
    rs.set_health(a, True)
    assert {rs.pick().id for _ in range(4)} == {"a", "b"}


def test_replica_set_counts_sessions_in_flight():
    rs, _ = make_set(["a", "b"], "jsq2")
    a = rs.get("a")
    rs.start(a)
    rs.start(a)
    rs.finish(a, latency_s=1.0, num_tokens=10)
    assert a.num_in_flight == 1
    rs.fail(a)
    assert a.num_in_flight == 0
    with pytest.raises(ValueError, match="no session in flight"):
        rs.finish(a, latency_s=1.0)


class RecordingRouter(RoundRobin):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple] = []

    def on_start(self, replica):
        self.events.append(("start", replica.id))

    def on_finish(self, replica, latency_s, num_tokens=1):
        self.events.append(("finish", replica.id, latency_s, num_tokens))

    def on_failure(self, replica):
        self.events.append(("failure", replica.id))

    def on_health(self, replica, healthy):
        self.events.append(("health", replica.id, healthy))


def test_replica_set_forwards_every_event_to_the_router():
    router = RecordingRouter()
    rs = ReplicaSet(["a", "b"], router, rng=random.Random(0))
    a, b = rs.acquire(), rs.acquire()
    rs.finish(a, latency_s=2.0, num_tokens=7)
    rs.fail(b)
    rs.set_health(b, True)
    assert router.events == [("start", "a"), ("start", "b"), ("finish", "a", 2.0, 7), ("failure", "b"), ("health", "b", True)]


def test_bad_configuration_is_rejected():
    with pytest.raises(ValueError, match="unique"):
        ReplicaSet(["a", "a"])
    with pytest.raises(ValueError, match="weight"):
        Replica("a", weight=0.0)
    with pytest.raises(ValueError, match="unknown router 'fastest'"):
        make_router("fastest")
    with pytest.raises(ValueError, match="num_choices"):
        WeightedJSQ(num_choices=0)
    assert make_router("weighted_jsq", ema_weight=0.5).estimator.ema_weight == 0.5


# --- determinism -------------------------------------------------------------------------------


def run_script(name: str, seed: int) -> list[str]:
    """A fixed mix of opens, closes, failures and health reports; the ids picked."""
    rs, clock = make_set([Replica(f"r{i}", weight=1.0 + i % 3) for i in range(6)], name, seed=seed, cooldown_s=3.0)
    script_rng = random.Random(99)  # the workload is the same for every seed
    open_sessions: list[Replica] = []
    picked = []
    for step in range(300):
        clock.now_s = step * 0.5
        action = script_rng.random()
        if action < 0.5 or not open_sessions:
            replica = rs.acquire()
            open_sessions.append(replica)
            picked.append(replica.id)
        elif action < 0.9:
            rs.finish(open_sessions.pop(script_rng.randrange(len(open_sessions))), latency_s=script_rng.uniform(0.5, 2.0), num_tokens=32)
        elif action < 0.95:
            rs.fail(open_sessions.pop(script_rng.randrange(len(open_sessions))))
        else:
            rs.set_health(rs.replicas[script_rng.randrange(6)], script_rng.random() < 0.5)
    return picked


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_same_seed_same_choices(name):
    assert run_script(name, seed=7) == run_script(name, seed=7)
    if name != "round_robin":  # the only policy that draws nothing
        assert run_script(name, seed=7) != run_script(name, seed=8)
