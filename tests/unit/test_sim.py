"""The cluster simulator against closed forms, hand-worked schedules and specmesh.decoding's accounting."""

from __future__ import annotations

import math

import pytest

from specmesh.decoding.adaptive import FixedK
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.state import SpeculationState
from specmesh.sim import Simulation, config_from_dict, simulate

ZERO_NETWORK = {"same_node": {"latency_ms": 0}, "cross_node": {"latency_ms": 0}, "client": {"latency_ms": 0}}


def base_config(**overrides) -> dict:
    config = {
        "duration_s": 60, "burn_in_s": 5, "seed": 0,
        "devices": {"target": {"linear": {"base_ms": 10.0}}, "draft": {"linear": {"base_ms": 1.0}}},
        "targets": [{"count": 1, "device": "target"}], "drafts": [{"count": 1, "device": "draft", "node": "target"}],
        "network": ZERO_NETWORK,
    }
    config.update(overrides)
    return config


def test_md1_queue_matches_closed_form():
    """One-token requests on one target: each is one deterministic 10 ms prefill job, Poisson
    arrivals -> M/D/1, mean wait rho / (2 mu (1 - rho)) = 5 ms at rho = 0.5."""
    service_s, rate = 0.010, 50.0
    result = simulate(config_from_dict(base_config(
        mode="autoregressive", duration_s=400, burn_in_s=20,
        workload={"arrival": "poisson", "rate_per_s": rate, "prompt_tokens": 10, "output_tokens": 1})))
    rho, mu = rate * service_s, 1 / service_s
    expected_wait_ms = rho / (2 * mu * (1 - rho)) * 1e3
    measured_wait_ms = result.summary["ttft"]["mean_ms"] - service_s * 1e3
    assert result.summary["num_requests_done"] > 15_000
    assert measured_wait_ms == pytest.approx(expected_wait_ms, rel=0.1)
    assert result.summary["target_utilisation_mean"] == pytest.approx(rho, rel=0.03)


@pytest.mark.parametrize("mode", ["distributed", "fused", "autoregressive"])
def test_littles_law(mode):
    """Time-average requests in flight = arrival rate x mean time in the system."""
    result = simulate(config_from_dict(base_config(
        mode=mode, duration_s=300, burn_in_s=20, speculation={"k": 3, "acceptance": [0.7]},
        targets=[{"count": 2, "device": "target", "fused_draft_ms_per_token": 0.5}],
        workload={"arrival": "poisson", "rate_per_s": 2.0, "prompt_tokens": {"uniform": [20, 200]}, "output_tokens": [8, 32],
                  "turns": [1, 2], "think_time_s": 1.0})))
    s = result.summary
    assert s["num_requests_done"] > 500
    assert s["in_system_mean"] == pytest.approx(s["arrival_rate_per_s"] * s["e2e"]["mean_ms"] / 1e3, rel=0.05)


def test_hand_worked_schedule():
    """One request, k = 3, max_new_tokens = 10, accepted counts replayed 2, 0, 3; target forward 10 ms,
    draft forward 1 ms, no network:
        t = 1.000  arrives; draft prefill [1.000, 1.001]; target prefill [1.000, 1.010] -> token 1
        round 1: draft 3 x 1 ms -> 1.013; verify -> 1.023; 2 accepted + 1  -> 4 tokens
        round 2: draft -> 1.026; verify -> 1.036; 0 accepted + 1          -> 5
        round 3: draft -> 1.039; verify -> 1.049; 3 accepted + 1          -> 9
        round 4: k = min(3, 10 - 9 - 1) = 0: verify alone -> 1.059; 1     -> 10
    """
    result = simulate(config_from_dict(base_config(
        duration_s=3, burn_in_s=0, speculation={"k": 3, "acceptance_trace": [2, 0, 3]},
        workload={"arrival": "trace", "trace": [{"arrival_s": 1.0, "prompt_tokens": 16, "output_tokens": 10}]})))
    (r,) = result.requests
    assert (r.num_output_tokens, r.num_rounds, r.num_draft_tokens, r.num_accepted_tokens) == (10, 4, 9, 5)
    assert r.ttft_s == pytest.approx(0.010)
    assert r.e2e_s == pytest.approx(0.059)
    assert r.tpot_s == pytest.approx(0.049 / 9)
    target = next(d for d in result.devices if d.kind == "target")
    assert target.busy_s == pytest.approx(0.050)  # prefill + 4 verifies
    assert result.summary["throughput_tokens_per_s"] == pytest.approx(10 / 3)


@pytest.mark.parametrize("accepted, k, max_new", [([2, 0, 3], 3, 10), ([4, 4, 1, 0, 2], 4, 23), ([0], 2, 7), ([5, 5], 5, 12)])
def test_accounting_matches_speculation_state(accepted, k, max_new):
    """The sim's round accounting is SpeculationState's (k capped by max_new_tokens, n + 1 emitted)."""
    result = simulate(config_from_dict(base_config(
        duration_s=5, burn_in_s=0, speculation={"k": k, "acceptance_trace": accepted},
        workload={"arrival": "trace", "trace": [{"arrival_s": 0.0, "prompt_tokens": 8, "output_tokens": max_new}]})))
    (r,) = result.requests
    state = SpeculationState(SamplingParams(max_new_tokens=max_new, ignore_eos=True), num_prompt_tokens=8, max_context=4096,
                             k_policy=FixedK(k))
    state.start(0)
    rounds = 0
    while not state.finished:
        drafted = state.next_k()
        n = min(drafted, accepted[rounds % len(accepted)])
        state.record(drafted, n, [1] * (n + 1))
        rounds += 1
    assert r.num_output_tokens == len(state.generated) == max_new
    assert r.num_rounds == rounds
    assert (r.num_draft_tokens, r.num_accepted_tokens) == (state.stats.num_draft_tokens, state.stats.num_accepted_tokens)


def test_batcher_merges_concurrent_rounds():
    """Eight closed-loop clients on one target: rounds ride together; a lone session skips the window."""
    result = simulate(config_from_dict(base_config(
        mode="autoregressive", targets=[{"count": 1, "device": "target", "batch_window_ms": 2}],
        workload={"arrival": "closed", "num_clients": 8, "prompt_tokens": 8, "output_tokens": 64})))
    assert result.summary["batch_rows_mean"] > 6
    single = simulate(config_from_dict(base_config(
        mode="autoregressive", duration_s=2, burn_in_s=0,
        workload={"arrival": "trace", "trace": [{"arrival_s": 0.0, "prompt_tokens": 8, "output_tokens": 5}]})))
    assert single.requests[0].e2e_s == pytest.approx(0.050)  # prefill + 4 one-token rounds, no window waits


def test_draft_service_batches_propose_calls():
    """Eight sessions routed to one Draft service: their Propose calls share forwards (position by
    position): with drafting the bottleneck (10 ms a forward, the target 1 ms), eight sessions get
    several times one session's throughput, where unbatched Proposes would give about the same."""
    def run(clients: int):
        return simulate(config_from_dict(base_config(
            draft_assignment="routed", devices={"target": {"linear": {"base_ms": 1.0}}, "draft": {"linear": {"base_ms": 10.0}}}, speculation={"k": 4, "acceptance": [0.7]},
            workload={"arrival": "closed", "num_clients": clients, "prompt_tokens": 16, "output_tokens": 64})))

    one, eight = run(1), run(8)
    draft = next(d for d in eight.devices if d.kind == "draft")
    assert draft.mean_batch_rows > 2.5
    assert eight.summary["throughput_tokens_per_s"] > 3 * one.summary["throughput_tokens_per_s"]


def test_services_on_one_core_share_it():
    """A Draft and a Verify service with `host: box` and no `hosts:` entry: the host gets one core
    (their threads), so their forwards share it: the core is busy at most the whole window, and the
    pipelining of separate machines is gone."""
    def run(host: str):
        return simulate(config_from_dict(base_config(
            targets=[{"count": 1, "device": "target", "host": host}], drafts=[{"count": 1, "device": "draft", "node": "target", "host": host}],
            devices={"target": {"linear": {"base_ms": 10.0}}, "draft": {"linear": {"base_ms": 5.0}}},
            draft_assignment="routed", speculation={"k": 2, "acceptance": [0.5]},
            workload={"arrival": "closed", "num_clients": 8, "prompt_tokens": 16, "output_tokens": 64})))

    apart, shared = run(""), run("box")
    box = shared.summary["hosts"]["box"]
    assert box["cores"] == 1
    assert 0.95 < box["core_utilisation"] <= 1 + 1e-9  # saturated: eight clients keep the one core busy
    assert shared.summary["throughput_tokens_per_s"] < 0.9 * apart.summary["throughput_tokens_per_s"]


def host_schedule(cores: int):
    """Two requests, each: target prefill 10 ms, one draft forward 4 ms (k = 1), one verify 10 ms; a
    Draft and a Verify service of 1 thread each on one host; no batch window, no network."""
    return simulate(config_from_dict(base_config(
        duration_s=1, burn_in_s=0, speculation={"k": 1, "acceptance_trace": [1]},
        devices={"target": {"linear": {"base_ms": 10.0}}, "draft": {"linear": {"base_ms": 4.0}}},
        targets=[{"count": 1, "device": "target", "host": "box", "batch_window_ms": 0}],
        drafts=[{"count": 1, "device": "draft", "node": "target", "host": "box", "batch_window_ms": 0}],
        hosts={"box": {"cores": cores}},
        workload={"arrival": "trace", "trace": [{"arrival_s": 0.0, "prompt_tokens": 8, "output_tokens": 3},
                                                {"arrival_s": 0.010, "prompt_tokens": 8, "output_tokens": 3}]})))


def test_two_services_on_two_cores_overlap():
    """2 cores, 1 thread each: the draft and verify forwards run side by side at full speed, as on
    separate devices:
        A: prefill [0, 10]; draft [10, 14]; verify waits for B's prefill: [20, 30]; its
           Verify.CloseSession waits for the engine to finish B's verify              -> e2e 40 ms
        B: prefill [10, 20] (beside A's draft); draft [20, 24] (beside A's verify);
           verify [30, 40]                                                       -> e2e 30 ms
    """
    result = host_schedule(cores=2)
    a, b = result.requests
    assert (a.e2e_s, b.e2e_s) == (pytest.approx(0.040), pytest.approx(0.030))
    assert (a.ttft_s, b.ttft_s) == (pytest.approx(0.010), pytest.approx(0.010))
    target, draft = sorted(result.devices, key=lambda d: d.kind, reverse=True)
    assert (target.busy_s, draft.busy_s) == (pytest.approx(0.040), pytest.approx(0.008))
    assert result.summary["hosts"]["box"]["core_utilisation"] == pytest.approx(0.048 / 2)


def test_two_services_on_one_core_share_it():
    """The same on 1 core: overlapping forwards each run at half speed.
        B's prefill and A's draft start at 10: both at 1/2; A's draft (4 ms) ends at 18; B's prefill
          has 6 ms left, alone: ends at 24 (B's first token: ttft 14 ms)
        A's verify waits for the target's engine: [24, ...]; B's draft starts at 24 beside it, both
          at 1/2: B's draft ends at 32, A's verify has 6 ms left: ends at 38
        B's verify takes the engine at 38: [38, 48], ahead of A's Verify.CloseSession -> A e2e 48 ms
                                                                                  -> B e2e 38 ms
    The core is busy 48 ms (all the work) of the 1 s window."""
    result = host_schedule(cores=1)
    a, b = result.requests
    assert (a.e2e_s, b.e2e_s) == (pytest.approx(0.048), pytest.approx(0.038))
    assert (a.ttft_s, b.ttft_s) == (pytest.approx(0.010), pytest.approx(0.014))
    target, draft = sorted(result.devices, key=lambda d: d.kind, reverse=True)
    assert (target.busy_s, draft.busy_s) == (pytest.approx(0.010 + 0.014 + 0.014 + 0.010), pytest.approx(0.008 + 0.008))
    assert result.summary["hosts"]["box"]["core_utilisation"] == pytest.approx(0.048)


def test_three_single_thread_services_on_two_cores():
    """Three Verify services (1 thread each) on a 2-core host, one one-token request each (a 10 ms
    prefill), arriving at 0, 0 and 5 ms (round robin: one per service):
        [0, 5]: two forwards, 2 threads on 2 cores: full speed; each has 5 ms of work left
        from 5: three forwards on 2 cores: each at 2/3 speed; the first two end at 5 + 5 / (2/3) = 12.5
        the third did 7.5 * 2/3 = 5 ms of work by then; 5 ms left, alone: ends at 17.5 (ttft 12.5)
    """
    result = simulate(config_from_dict(base_config(
        mode="autoregressive", duration_s=1, burn_in_s=0, router={"name": "round_robin"},
        targets=[{"count": 1, "device": "target", "host": "box"} for _ in range(3)], hosts={"box": {"cores": 2}},
        workload={"arrival": "trace", "trace": [{"arrival_s": t, "prompt_tokens": 8, "output_tokens": 1} for t in (0.0, 0.0, 0.005)]})))
    assert [r.ttft_s for r in result.requests] == [pytest.approx(0.0125), pytest.approx(0.0125), pytest.approx(0.0125)]
    assert [r.end_s for r in result.requests] == [pytest.approx(0.0125), pytest.approx(0.0125), pytest.approx(0.0175)]
    assert result.summary["hosts"]["box"]["core_utilisation"] == pytest.approx(0.030 / 2)


def test_memory_contention_slows_forwards_side_by_side():
    """Two Verify services (1 thread each) on a 2-core host sharing one memory bus (memory_contention 0.5),
    one 10 ms prefill each, arriving at 0 and 5 ms:
        [0, 5]: the first alone, full speed: 5 ms of work left
        from 5: two forwards side by side, each at 1 / (1 + 0.5) speed: the first ends at 5 + 5 * 1.5 = 12.5
        the second did 7.5 / 1.5 = 5 ms of work by then; 5 ms left, alone: ends at 17.5 (ttft 12.5)
    Without contention the two cores run them apart at full speed: 10 and 15 ms. A forward leans on the
    bus as much as it streams weights: priced 2 ms + 1 ms a token, an 8-token prefill (10 ms) reads the
    weights once where a one-token forward would take 3 ms (intensity 0.3): side by side each runs at
    1 / (1 + 0.5 * 0.3 * 0.3): the first ends at 5 + 5 * 1.045 = 10.225, the second at 15.225."""
    def ends(contention: float, per_token_ms: float = 0.0) -> list[float]:
        result = simulate(config_from_dict(base_config(
            mode="autoregressive", duration_s=1, burn_in_s=0, router={"name": "round_robin"},
            devices={"target": {"linear": {"base_ms": 10.0 - 8 * per_token_ms, "per_token_ms": per_token_ms}}},
            targets=[{"count": 1, "device": "target", "host": "box"} for _ in range(2)],
            hosts={"box": {"cores": 2, "memory_contention": contention}},
            workload={"arrival": "trace", "trace": [{"arrival_s": t, "prompt_tokens": 8, "output_tokens": 1} for t in (0.0, 0.005)]})))
        return [r.end_s for r in result.requests]

    assert ends(0.5) == [pytest.approx(0.0125), pytest.approx(0.0175)]
    assert ends(0.0) == [pytest.approx(0.010), pytest.approx(0.015)]
    assert ends(0.5, per_token_ms=1.0) == [pytest.approx(0.010225), pytest.approx(0.015225)]


def test_background_load_shares_the_cores():
    """Other processes' load counts as threads asked: one 10 ms prefill (1 thread) on 2 cores beside
    2 background threads runs at 2 / 3 speed and takes 15 ms; beside 1, it fits and takes 10 ms."""
    def ttft_s(background: float) -> float:
        result = simulate(config_from_dict(base_config(
            mode="autoregressive", duration_s=1, burn_in_s=0, targets=[{"count": 1, "device": "target", "host": "box"}],
            hosts={"box": {"cores": 2, "background_threads": background}},
            workload={"arrival": "trace", "trace": [{"arrival_s": 0.0, "prompt_tokens": 8, "output_tokens": 1}]})))
        return result.requests[0].ttft_s

    assert ttft_s(2.0) == pytest.approx(0.015)
    assert ttft_s(1.0) == pytest.approx(0.010)


def test_enough_cores_is_the_same_as_separate_devices():
    """With cores for every thread, a host changes nothing: the same run as separate devices."""
    def run(hosts: dict, host: str):
        return simulate(config_from_dict(base_config(
            duration_s=20, targets=[{"count": 1, "device": "target", "host": host, "threads": 2}],
            drafts=[{"count": 1, "device": "draft", "node": "target", "host": host}], hosts=hosts,
            speculation={"k": 3, "acceptance": [0.7]},
            workload={"arrival": "closed", "num_clients": 4, "prompt_tokens": [16, 40], "output_tokens": [20, 50]})))

    apart, shared = run({}, ""), run({"box": {"cores": 3}}, "box")
    assert [r.end_s for r in shared.requests] == pytest.approx([r.end_s for r in apart.requests], abs=1e-9)
    tight = run({"box": {"cores": 2}}, "box")  # 3 threads asked of 2 cores when both run
    assert tight.summary["throughput_tokens_per_s"] < apart.summary["throughput_tokens_per_s"]


def test_jsq2_balances_better_than_random():
    """The routers of specmesh.routing, as-is: JSQ(2)'s busiest target holds fewer sessions."""
    def busiest(router: str) -> int:
        result = simulate(config_from_dict(base_config(
            mode="autoregressive", duration_s=120, burn_in_s=10, router={"name": router},
            targets=[{"count": 16, "device": "target"}],
            workload={"arrival": "poisson", "rate_per_s": 8.0, "prompt_tokens": 16, "output_tokens": {"uniform": [50, 300]}})))
        return result.summary["sessions_per_target_max"]

    assert busiest("jsq2") < busiest("random")


def test_seeded_runs_repeat():
    def run(seed: int) -> dict:
        result = simulate(config_from_dict(base_config(
            seed=seed, duration_s=60, speculation={"k": 4, "acceptance": [0.9, 0.6]}, targets=[{"count": 3, "device": "target"}],
            workload={"arrival": "poisson", "rate_per_s": 3.0, "prompt_tokens": {"lognormal": {"median": 100, "sigma": 0.5}},
                      "output_tokens": 40})))
        return {k: v for k, v in result.summary.items() if k not in ("wall_s", "virtual_s_per_wall_s")}

    first = run(1)
    assert first == run(1)
    assert first != run(2)
    assert not math.isnan(first["acceptance_rate"])


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="workload: unknown keys \\['rate'\\]"):
        config_from_dict(base_config(workload={"rate": 3}))
    with pytest.raises(ValueError, match="not defined under `devices`"):
        config_from_dict(base_config(targets=[{"device": "gpu"}]))
    with pytest.raises(ValueError, match="mode must be"):
        config_from_dict(base_config(mode="cascade"))
    with pytest.raises(ValueError, match="named by no target or draft"):
        config_from_dict(base_config(hosts={"box": {"cores": 2}}))
    with pytest.raises(ValueError, match="coordinator.cpu_ms_per_message must be >= 0"):
        config_from_dict(base_config(coordinator={"cpu_ms_per_message": -1}))
    config_from_dict(base_config(hosts={"box": {"cores": 2}}, coordinator={"host": "box", "cpu_ms_per_message": 0.5}))  # names it
    with pytest.raises(ValueError, match="hosts.box: unknown keys \\['core'\\]"):
        config_from_dict(base_config(targets=[{"host": "box"}], hosts={"box": {"core": 2}}))


def test_coordinator_cpu_on_its_own_core_adds_its_messages():
    """test_hand_worked_schedule with the coordinator's CPU at 1 ms per message on a core of its own:
        t = 1.000  Generate, Verify.OpenSession request: 2 ms -> 1.002; target prefill -> 1.012;
                   its response -> 1.013; the first token out -> 1.014 (TTFT 14 ms)
                   Draft.OpenSession beside it: its request and response handled during the prefill
        round 1: Propose request -> 1.015; draft 3 x 1 ms -> 1.018; Propose response and Verify
                 request -> 1.020; verify -> 1.030; its response -> 1.031; the tokens out -> 1.032
        rounds 2 and 3 alike: 18 ms each -> 1.050, 1.068
        round 4 (k = 0, no Propose): Verify request -> 1.069; verify -> 1.079; response, out -> 1.081
        Verify.CloseSession, then Draft.CloseSession (2 messages each) -> 1.085: the stream ends
    e2e 85 ms (59 + 26 on the path); 28 messages handled: 10 + 5 per round, less the Propose's 2 in round 4."""
    result = simulate(config_from_dict(base_config(
        duration_s=3, burn_in_s=0, speculation={"k": 3, "acceptance_trace": [2, 0, 3]},
        coordinator={"cpu_ms_per_message": 1.0},
        workload={"arrival": "trace", "trace": [{"arrival_s": 1.0, "prompt_tokens": 16, "output_tokens": 10}]})))
    (r,) = result.requests
    assert r.ttft_s == pytest.approx(0.014)
    assert r.e2e_s == pytest.approx(0.085)
    coordinator = result.summary["processes"]["coordinator"]
    assert coordinator["num_messages"] == 28
    assert (coordinator["busy_s"], coordinator["cpu_s"]) == (pytest.approx(0.028), pytest.approx(0.028))  # alone: never slowed


def coordinator_on_one_core(cpu_ms_per_message: float):
    """Two one-token requests (a 10 ms prefill each, arriving at 0 and 6 ms) and the coordinator, on
    one core; autoregressive, no network."""
    return simulate(config_from_dict(base_config(
        mode="autoregressive", duration_s=1, burn_in_s=0, targets=[{"count": 1, "device": "target", "host": "box"}],
        hosts={"box": {"cores": 1}}, coordinator={"host": "box", "cpu_ms_per_message": cpu_ms_per_message},
        workload={"arrival": "trace", "trace": [{"arrival_s": t, "prompt_tokens": 8, "output_tokens": 1} for t in (0.0, 0.006)]})))


def test_coordinator_cpu_shares_the_host_with_forwards():
    """The coordinator's messages (2 ms each) and the prefills share the one core. A: Generate and the
    Verify.OpenSession request [0, 4]; prefill from 4. B: its 2 messages (4 ms) from 6 beside A's
    prefill (8 ms left): both at 1/2 speed, B's job ends at 14, A's prefill has 4 ms left, alone: 18.
    B's prefill waits for the engine: from 18, beside A's OpenSession response [18, 22] and A's token
    out [22, 26] (1/2 speed: B's prefill has 6 ms left at 26) -> A's first token at 26 ms.
    A's CloseSession request [26, 30] beside B's prefill, both at 1/2: B's prefill has 4 ms left,
    alone: 34; then the close's turn on the engine (no work); B's response [34, 36], A's close response
    [36, 38] -> A's stream ends at 38; B's token out [38, 40] -> B's TTFT 34 ms; B's CloseSession
    [40, 44] -> its stream ends at 44. Without the coordinator's CPU: A's TTFT 10 ms, B's 14 ms (B's
    prefill waits for A's)."""
    a, b = coordinator_on_one_core(2.0).requests
    assert (a.ttft_s, b.ttft_s) == (pytest.approx(0.026), pytest.approx(0.034))
    assert (a.end_s, b.end_s) == (pytest.approx(0.038), pytest.approx(0.044))
    result = coordinator_on_one_core(2.0)
    assert result.summary["hosts"]["box"]["core_utilisation"] == pytest.approx(0.020 + 0.024)  # prefills + 12 messages
    a, b = coordinator_on_one_core(0.0).requests
    assert (a.ttft_s, b.ttft_s) == (pytest.approx(0.010), pytest.approx(0.014))


def test_zero_process_cpu_changes_nothing():
    """`coordinator` / `clients` at 0 ms per message (the default) give the run as without them."""
    def run(**processes):
        return simulate(config_from_dict(base_config(
            duration_s=20, targets=[{"count": 1, "device": "target", "host": "box"}],
            drafts=[{"count": 1, "device": "draft", "node": "target", "host": "box"}], hosts={"box": {"cores": 1}},
            speculation={"k": 3, "acceptance": [0.7]}, network={"same_node": {"latency_ms": 0.3}, "client": {"latency_ms": 0.2}},
            workload={"arrival": "closed", "num_clients": 4, "prompt_tokens": [16, 40], "output_tokens": [20, 50]}, **processes)))

    plain = run()
    zero = run(coordinator={"host": "box", "cpu_ms_per_message": 0.0}, clients={"host": "box", "cpu_ms_per_message": 0.0})
    assert [(r.first_token_s, r.end_s) for r in zero.requests] == [(r.first_token_s, r.end_s) for r in plain.requests]
    assert "processes" not in plain.summary or not plain.summary["processes"]
    slowed = run(coordinator={"host": "box", "cpu_ms_per_message": 1.0}, clients={"host": "box", "cpu_ms_per_message": 0.5})
    assert slowed.summary["throughput_tokens_per_s"] < plain.summary["throughput_tokens_per_s"]
    clients = slowed.summary["processes"]["clients"]
    assert clients["busy_s"] > clients["cpu_s"] == pytest.approx(clients["num_messages"] * 0.0005)  # slowed on the shared core


def test_service_cpu_per_call_on_its_own_core():
    """test_hand_worked_schedule with each service's CPU at 1 ms per call, its RPC thread on a core of
    its own (no host), so every call delays its work by 1 ms:
        t = 1.000  Verify.OpenSession [1.000, 1.001]; prefill -> 1.011 (TTFT 11 ms); Draft.OpenSession
                   beside them [1.000, 1.001]
        round 1: the Propose -> 1.012; draft 3 x 1 ms -> 1.015; Verify call -> 1.016; verify -> 1.026
        rounds 2 and 3: 1 + 3 + 1 + 10 ms each -> 1.041, 1.056
        round 4 (k = 0): Verify call -> 1.057; verify -> 1.067
        Verify.CloseSession -> 1.068, Draft.CloseSession -> 1.069: the stream ends
    e2e 69 ms (59 + 10 calls on the path). Calls handled: Verify 1 + 4 + 1, Draft 1 + 3 + 1."""
    result = simulate(config_from_dict(base_config(
        duration_s=3, burn_in_s=0, speculation={"k": 3, "acceptance_trace": [2, 0, 3]},
        targets=[{"count": 1, "device": "target", "cpu_ms_per_call": 1.0}],
        drafts=[{"count": 1, "device": "draft", "node": "target", "cpu_ms_per_call": 1.0}],
        workload={"arrival": "trace", "trace": [{"arrival_s": 1.0, "prompt_tokens": 16, "output_tokens": 10}]})))
    (r,) = result.requests
    assert r.ttft_s == pytest.approx(0.011)
    assert r.e2e_s == pytest.approx(0.069)
    processes = result.summary["processes"]
    assert (processes["target0.0/rpc"]["num_messages"], processes["draft0.0/rpc"]["num_messages"]) == (6, 5)
    assert processes["target0.0/rpc"]["cpu_s"] == pytest.approx(0.006)


def service_cpu_on_one_core(cpu_ms_per_call: float):
    """Two one-token requests (a 10 ms prefill each, arriving at 0 and 6 ms) to a Verify service on
    one core, its CPU per call on the same core; autoregressive, no network."""
    return simulate(config_from_dict(base_config(
        mode="autoregressive", duration_s=1, burn_in_s=0,
        targets=[{"count": 1, "device": "target", "host": "box", "cpu_ms_per_call": cpu_ms_per_call}], hosts={"box": {"cores": 1}},
        workload={"arrival": "trace", "trace": [{"arrival_s": t, "prompt_tokens": 8, "output_tokens": 1} for t in (0.0, 0.006)]})))


def test_service_cpu_per_call_shares_the_core_with_forwards():
    """The Verify service's calls (4 ms each, on its RPC thread) and its prefills share the one core.
    A: OpenSession [0, 4] alone; prefill from 4. B: its OpenSession from 6 beside A's prefill (8 ms
    left): both at 1/2 speed: B's call ends at 14 (4 ms late), A's prefill has 4 ms left, alone: ends
    at 18 (4 ms late) -> A's first token. A's CloseSession (4 ms) from 18 beside B's prefill (which
    waited for the engine), both at 1/2: the call ends at 26, B's prefill has 6 ms left, alone: 32
    -> B's TTFT 26 ms; A's close has its turn on the engine then: A's stream ends at 32. B's
    CloseSession [32, 36]. Without the CPU per call: A's TTFT 10 ms, B's 14 ms."""
    result = service_cpu_on_one_core(4.0)
    a, b = result.requests
    assert (a.ttft_s, b.ttft_s) == (pytest.approx(0.018), pytest.approx(0.026))
    assert (a.end_s, b.end_s) == (pytest.approx(0.032), pytest.approx(0.036))
    assert result.summary["hosts"]["box"]["core_utilisation"] == pytest.approx(0.020 + 0.016)  # prefills + 4 calls
    assert result.summary["processes"]["target0.0/rpc"]["busy_s"] == pytest.approx(0.004 + 0.008 + 0.008 + 0.004)
    a, b = service_cpu_on_one_core(0.0).requests
    assert (a.ttft_s, b.ttft_s) == (pytest.approx(0.010), pytest.approx(0.014))


def test_zero_service_cpu_changes_nothing():
    """`cpu_ms_per_call: 0` and `engine_ms_per_call: 0` (the defaults) on both services give the run
    as without the keys."""
    def run(cpu_ms_per_call: float | None):
        extra = {} if cpu_ms_per_call is None else {"cpu_ms_per_call": cpu_ms_per_call, "engine_ms_per_call": cpu_ms_per_call}
        return simulate(config_from_dict(base_config(
            duration_s=20, targets=[{"count": 1, "device": "target", "host": "box", **extra}],
            drafts=[{"count": 1, "device": "draft", "node": "target", "host": "box", **extra}], hosts={"box": {"cores": 2}},
            speculation={"k": 3, "acceptance": [0.7]}, network={"same_node": {"latency_ms": 0.3}, "client": {"latency_ms": 0.2}},
            coordinator={"host": "box", "cpu_ms_per_message": 0.3},
            workload={"arrival": "closed", "num_clients": 4, "prompt_tokens": [16, 40], "output_tokens": [20, 50]})))

    plain, zero = run(None), run(0.0)
    assert [(r.first_token_s, r.end_s) for r in zero.requests] == [(r.first_token_s, r.end_s) for r in plain.requests]
    assert list(zero.summary["processes"]) == ["coordinator"]
    slowed = run(2.0)
    assert slowed.summary["throughput_tokens_per_s"] < plain.summary["throughput_tokens_per_s"]
    with pytest.raises(ValueError, match="cpu_ms_per_call and engine_ms_per_call of targets and drafts must be >= 0"):
        config_from_dict(base_config(targets=[{"count": 1, "device": "target", "cpu_ms_per_call": -1}]))


def test_engine_ms_per_call_lengthens_each_batch():
    """test_hand_worked_schedule with 2 ms of engine-thread work per call at the Verify service and
    1 ms at the Draft service: each round's Propose batch (one call) takes 1 ms more and each verify
    2 ms more; the prefill is not a call: TTFT stays 10 ms; 3 Proposes + 4 verifies: e2e 59 + 3 + 8 =
    70 ms."""
    def run(target_ms: float, draft_ms: float):
        return simulate(config_from_dict(base_config(
            duration_s=3, burn_in_s=0, speculation={"k": 3, "acceptance_trace": [2, 0, 3]},
            targets=[{"count": 1, "device": "target", "engine_ms_per_call": target_ms}],
            drafts=[{"count": 1, "device": "draft", "node": "target", "engine_ms_per_call": draft_ms}],
            workload={"arrival": "trace", "trace": [{"arrival_s": 1.0, "prompt_tokens": 16, "output_tokens": 10}]})))

    (r,) = run(2.0, 1.0).requests
    assert (r.ttft_s, r.e2e_s) == (pytest.approx(0.010), pytest.approx(0.070))


def _one_request(ahead: bool, draft_ms: float, output_tokens: int = 21):
    """One request at a time (a closed client), k = 3, every draft and every guess right, target forward
    10 ms, draft forward `draft_ms`, no network."""
    from specmesh.sim import Simulation

    sim = Simulation(config_from_dict(base_config(
        duration_s=10, burn_in_s=0, devices={"target": {"linear": {"base_ms": 10.0}}, "draft": {"linear": {"base_ms": draft_ms}}},
        speculation={"k": 3, "acceptance": [1.0], "draft_ahead": ahead, "guess_rate": 1.0},
        workload={"arrival": "closed", "num_clients": 1, "num_requests_per_client": 1, "prompt_tokens": 10,
                  "output_tokens": output_tokens})))
    result = sim.run()
    assert result.summary["num_requests_done"] == 1
    return result.requests[0], sim


def test_drafts_ahead_answer_the_next_propose():
    """Each round emits 4 tokens, so 21 tokens are the prefill's and 5 rounds. Drafting ahead (1 ms a
    forward), the guess and 3 drafts (4 ms) fit in each 10 ms verify: rounds 2-5 get their 3 drafts
    at once, saving 4 x 3 ms; drafted on demand, the same rounds."""
    plain, _ = _one_request(False, 1.0)
    ahead, sim = _one_request(True, 1.0)
    assert (ahead.num_rounds, ahead.num_draft_tokens, ahead.num_output_tokens) == (plain.num_rounds, plain.num_draft_tokens, 21)
    assert sim.ahead_served_tokens == 4 * 3
    assert (plain.e2e_s - ahead.e2e_s) * 1e3 == pytest.approx(4 * 3.0, abs=1e-6)


def test_no_forward_ahead_outlasts_the_verify_round():
    """A draft forward (25 ms, whatever it feeds) longer than the time from an answer to the next Propose
    (10 ms): the first round's guess forward is started (nothing measured yet) and delays round 2's
    Propose by 15 ms; once the gap is measured, nothing more is drafted ahead. And the Draft session's
    prompt, prefilled at open beside the target's 10 ms prefill, is a forward more at this cost: 15 ms
    more before the first Propose, which then feeds the prompt's last token and the first token."""
    plain, _ = _one_request(False, 25.0)
    ahead, sim = _one_request(True, 25.0)
    assert sim.ahead_forwards == 1 and sim.ahead_served_tokens == 0
    assert (ahead.e2e_s - plain.e2e_s) * 1e3 == pytest.approx(15.0 + 15.0, abs=1e-6)


def test_drafting_ahead_with_a_trace_needs_a_guess_rate():
    with pytest.raises(ValueError, match="guess_rate"):
        config_from_dict(base_config(speculation={"k": 3, "acceptance_trace": [3, 1], "draft_ahead": True}))


def test_the_first_draft_ahead_feeds_one_token_where_the_draft_engines_steps_equal_its_chains():
    """`drafts[].steps_equal_chains`: the guess forward's KV stays, so the first draft ahead feeds the
    guess alone (1 token), as the Draft service does on the CPU fast path; else [last draft, guess]."""
    from types import SimpleNamespace

    from specmesh.sim.cluster import AheadRun

    class PerToken:
        def forward_ms(self, rows, tokens, context):
            return 10.0 * tokens

    draft = SimpleNamespace(cost=PerToken(), steps_equal_chains=False)
    run = AheadRun(SimpleNamespace(draft=draft))
    assert [run.forward_ms() for run.forwards in (0, 1, 2)] == [10.0, 20.0, 10.0]
    draft.steps_equal_chains = True
    assert [run.forward_ms() for run.forwards in (0, 1, 2)] == [10.0, 10.0, 10.0]
    assert config_from_dict(base_config(drafts=[{"steps_equal_chains": True}])).drafts[0].steps_equal_chains


def test_a_draft_sharing_the_targets_kv_feeds_one_token_a_propose():
    """`speculation.draft_shares_kv` (the live Draft service copying its context from the Verify service's shared
    cache): k = 3, every draft right, a draft forward 1 ms + 1 ms per token fed. Feeding its context, the first
    Propose feeds the 10-token prompt and the first token (12 ms for its first forward) and each later one the
    last draft and the target's token (3 ms); sharing, each feeds one token (2 ms): 10 + 4 x 1 ms saved over
    the 5 rounds of 21 tokens, the rounds unchanged."""
    from specmesh.sim import Simulation

    def one(shares: bool):
        sim = Simulation(config_from_dict(base_config(
            duration_s=10, burn_in_s=0,
            devices={"target": {"linear": {"base_ms": 10.0}}, "draft": {"linear": {"base_ms": 1.0, "per_token_ms": 1.0}}},
            speculation={"k": 3, "acceptance": [1.0], "draft_shares_kv": shares},
            workload={"arrival": "closed", "num_clients": 1, "num_requests_per_client": 1, "prompt_tokens": 10,
                      "output_tokens": 21})))
        (request,) = sim.run().requests
        return request

    fed, shared = one(False), one(True)
    assert (shared.num_rounds, shared.num_output_tokens) == (fed.num_rounds, 21) == (5, 21)
    assert (fed.e2e_s - shared.e2e_s) * 1e3 == pytest.approx(10.0 + 4 * 1.0, abs=1e-6)


def stepped_request(server_rounds: bool, **overrides):
    """One plain request of 5 tokens, target forward 10 ms, 1 ms each way between the coordinator and
    the Verify service."""
    return simulate(config_from_dict(base_config(
        mode="autoregressive", duration_s=1, burn_in_s=0, server_rounds=server_rounds,
        network={**ZERO_NETWORK, "same_node": {"latency_ms": 1.0}},
        workload={"arrival": "trace", "trace": [{"arrival_s": 0.0, "prompt_tokens": 8, "output_tokens": 5}]}, **overrides)))


def test_a_run_steps_the_rounds_on_the_service():
    """The Coordinator's plan for a plain request (`choose_plan`): with `server_rounds`, one Run whose
    rounds follow each other on the Verify service, without, a Verify call per round through the
    Coordinator. Both: OpenSession down [0, 1], prefill [1, 11], the first token up [11, 12] (TTFT).
    Rounds through the Coordinator: down 1 + verify 10 + up 1 each: 24, 36, 48, 60; CloseSession down
    and up: the stream ends at 62. One Run: its request down [12, 13], the rounds back to back: 23, 33,
    43, 53; the first round's token is written at once (up at 24), the next two join the last message
    (50 ms apart at most: they came 10 and 20 ms after it), which is up at 54; CloseSession: 56."""
    from specmesh.decoding.plan import Plan

    rounds, run = stepped_request(False), stepped_request(True)
    assert (rounds.requests[0].ttft_s, run.requests[0].ttft_s) == (pytest.approx(0.012), pytest.approx(0.012))
    assert (rounds.requests[0].end_s, run.requests[0].end_s) == (pytest.approx(0.062), pytest.approx(0.056))
    assert [r.num_rounds for r in (rounds.requests[0], run.requests[0])] == [4, 4]
    assert Simulation(config_from_dict(base_config(mode="autoregressive"))).plan is Plan.SERVER_RUN
    assert Simulation(config_from_dict(base_config(mode="fused"))).plan is Plan.FUSED_RUN
    assert Simulation(config_from_dict(base_config(mode="fused", server_rounds=False))).plan is Plan.FUSED_STEP


def test_a_runs_messages_cost_the_coordinator_once_per_interval():
    """With the coordinator's CPU modelled (1 ms a message, a core of its own), a Run's rounds are not
    slowed by it (they go on while the coordinator handles the stream), and it handles fewer messages
    the longer the stream interval: every round's (interval 0) against the first and the last (50 ms)."""
    every = stepped_request(True, stream_interval_ms=0, coordinator={"cpu_ms_per_message": 1.0})
    joined = stepped_request(True, coordinator={"cpu_ms_per_message": 1.0})
    count = [r.summary["processes"]["coordinator"]["num_messages"] for r in (every, joined)]
    assert count[0] - count[1] == 4  # rounds 2 and 3 joined the last message: two fewer in, two fewer out
    assert every.requests[0].end_s == pytest.approx(joined.requests[0].end_s)  # the last round ends at the same time
