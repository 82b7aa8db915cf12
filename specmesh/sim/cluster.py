"""The simulated cluster: clients, the coordinator's session loop, draft devices, target servers.

    result = Simulation(load_config("configs/sim/fleet.yaml")).run()
    result.summary["goodput_tokens_per_s"]

One request, as the Coordinator runs it (coordinator/driver.py over specmesh.decoding.state):
  client -> coordinator; the target router (`ReplicaSet` of specmesh.routing, as-is, on the virtual
  clock) picks a Verify replica for the session's whole life, and (distributed mode) the draft
  router a draft device, whose session opens beside the Verify session (its drafter prefills lazily, in the
  first Propose's forward; drafting ahead, at open);
  Verify.OpenSession: the prompt crosses the link, the prefill runs as engine jobs (chunked), the
  first token goes back;
  each round: k from the live drivers' own round state (`SpeculationState` with a fixed k:
    min(speculation.k, tokens left - 1), `round_state`);
    distributed: the accepted tokens go to the draft device and join its batcher's queue (Propose
      calls of many sessions share forwards, position by position); the draft goes to the target
      and joins the Verify batcher's queue;
    fused: the Step request goes to the target, the hosted drafter runs as one engine job, then
      the call joins the batcher's queue;
    autoregressive: k = 0, a one-token call joins the queue;
  the acceptance model draws n accepted; n + 1 tokens go back to the client;
  fused and autoregressive requests under the Coordinator's `server_rounds` (the config's, on by
  default) run as one Run instead (`Plan.server_steps`): its request goes down once, the rounds follow
  each other on the service (each still a job of the hosted drafter and a call in the batcher's queue),
  and their tokens go up in the stream's messages (`RunStream`: at most one per stream_interval_ms),
  handled by the coordinator while the service steps on;
  at the end the session leaves the target (no longer an expected caller) and the routers hear
  `finish(latency, tokens)` (weighted JSQ learns capacity from it).
Each service's forwards run on its own device, or on a shared host's cores (`hosts` in the config,
`threads` per group: processor sharing, servers.py); the summary's `hosts` gives each host's cores
and the share of them in use.
The coordinator's and the clients' own CPU (`coordinator` / `clients` in the config, off by default):
each message a process handles is a job on its one thread (FIFO), on a host's cores beside the
forwards. The coordinator handles, per request: the Generate request, Draft.OpenSession (request and
response), Verify.OpenSession (both), the first token out; per round: Propose (both; not when k = 0),
Verify (both), the round's tokens out; at the end: Draft and Verify CloseSession (both each): 10 + 5
per round in distributed mode, 6 + 3 per round in the others (no Draft), or in a Run 7 + 2 per
message of its stream. The tokens out are sent while the
session goes on (the live Coordinator reads ahead); the client process handles the request it sends
and each response it receives (2 + 1 per round), and a token counts as delivered once it has.
The Draft and Verify services' CPU outside their forwards (`cpu_ms_per_call` per group, off by
default): each RPC a service handles is a job on its RPC thread (FIFO, beside its engine thread, on
its host's cores), run when the request arrives, before the call's work: Verify.OpenSession before
the prefill, each Verify (Step) before it joins the batcher, each Propose before it joins the Draft
batcher (the first also carries Draft.OpenSession, whose round trip is not modelled), and each
service's CloseSession after the last reply, off the request's path. `engine_ms_per_call`: the
engine thread's work per Propose / Verify call outside the forward, added to its batch's job.
Not modelled: KV admission limits, failures and failover, Skeleton-of-Thought, adaptive k, the
session calls' own engine-thread work (live, Draft.OpenSession and both CloseSessions queue behind
forwards, and the client's stream ends only after the CloseSessions).
"""

from __future__ import annotations

import itertools
import random
import time
from pathlib import Path
from typing import Any

import simpy

from specmesh.decoding.adaptive import FixedK
from specmesh.decoding.ahead import AheadClock
from specmesh.decoding.plan import choose_plan
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.state import SpeculationState
from specmesh.routing.registry import make_router
from specmesh.routing.replica import Replica
from specmesh.routing.replica_set import ReplicaSet
from specmesh.sim.config import Link, ProcessCpu, SimConfig
from specmesh.sim.cost import CostModel, CostTable, LinearCost, RooflineCost, device_spec, model_dims
from specmesh.sim.results import DeviceRecord, RequestRecord, SimResult, summarize
from specmesh.sim.servers import (
    BatchingServer,
    DeviceEngine,
    DraftServer,
    Engine,
    Host,
    HostedEngine,
    NetLink,
    TargetServer,
    Window,
)
from specmesh.sim.workload import AcceptanceModel, conditional_from_marginal, load_trace, make_sampler


def build_cost(config: SimConfig, device: str, role: str) -> CostModel:
    """The cost model of `device` running the `role` model ("target" or "draft")."""
    spec = config.devices[device]
    kinds = [k for k in ("table", "roofline", "linear") if k in spec]
    if len(kinds) != 1:
        raise ValueError(f"device {device!r}: give exactly one of table / roofline / linear, got {sorted(spec)}")
    if "table" in spec:
        return CostTable.load(Path(config.base_dir) / spec["table"])
    if "linear" in spec:
        return LinearCost(**spec["linear"])
    model = spec.get("model", config.models.get(role))
    if model is None:
        raise ValueError(f"device {device!r}: a roofline needs models.{role} or a `model:` of its own")
    return RooflineCost(model_dims(model), device_spec(spec["roofline"]))


PLAN_MODES = {"distributed": "speculative", "fused": "fused", "autoregressive": "autoregressive"}  # sim mode -> Coordinator mode


def round_state(num_prompt: int, max_new_tokens: int, k: int) -> SpeculationState:
    """The round rule a simulated request steps: the live drivers' `SpeculationState` at a fixed k
    (0: autoregressive), with no EOS and a context that never fills, fed placeholder tokens."""
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    state = SpeculationState(params, num_prompt_tokens=num_prompt, max_context=num_prompt + max_new_tokens + k + 1,
                             k_policy=FixedK(k), has_drafter=k > 0)
    state.start(0)
    return state


class Process:
    """A process outside the engines (the coordinator, the clients) or a service's RPC thread: one
    thread whose every message (call) handled costs `s_per_message` of CPU, as a job on its engine (a
    host's cores, or a core of its own)."""

    def __init__(self, engine: Engine, s_per_message: float):
        self.engine = engine
        self.s_per_message = s_per_message
        self.num_messages = 0  # handled inside the window

    def run(self, num_messages: int, in_window: bool) -> simpy.Event:
        self.num_messages += num_messages if in_window else 0
        return self.engine.run(num_messages * self.s_per_message)


class AheadRun:
    """One session's drafting ahead (`DraftOptions.draft_ahead`): after each answer, the guess forward
    and then a forward per draft, each started only while `specmesh.decoding.ahead.forward_pays` says
    so (it ends before the session's next Propose is expected, or the guess usually holds). Its Draft server's `AheadBatcher` runs them."""

    def __init__(self, batcher: AheadBatcher):
        self.batcher = batcher
        self.clock = AheadClock()  # answer -> next Propose, and whether the verdict was the guess, as the service measures them
        self.k = 0
        self.context = 0  # the context if every draft is accepted and the guess holds
        self.forwards = 0  # forwards ahead since the last answer: the guess, then one per draft
        self.in_flight: simpy.Event | None = None
        self.stopped = True
        self.generation = 0

    def start(self, env: simpy.Environment, k: int, context: int) -> None:
        self.k, self.context, self.forwards, self.stopped = k, context, 0, False
        self.clock.answered(env.now)
        self.generation += 1
        self.batcher.add(self)

    def fed_tokens(self) -> int:
        """What its next forward feeds: the guess forward the last draft; the first draft ahead [last draft,
        guess] again, or the guess alone where the engine's steps equal its chains (the guess forward's KV
        stays); each later one the draft before it."""
        return 2 if self.forwards == 1 and not self.batcher.draft.steps_equal_chains else 1

    def forward_ms(self) -> float:
        return self.batcher.draft.cost.forward_ms(1, self.fed_tokens(), self.context + self.forwards - 1)

    def wants(self, now_s: float) -> bool:
        return (not self.stopped and self.forwards < self.k + 1
                and not self.clock.due(now_s, self.forward_ms(), guessed=self.forwards > 0))  # the guess forward: only what ends in time

    def on_propose(self, env: simpy.Environment, k: int, hit: bool):
        """At the next Propose: how many of its k drafts were drafted ahead (0 unless the guess held)."""
        if self.stopped:
            return 0
        self.clock.called(env.now)
        self.stopped = True
        if self.in_flight is not None:  # the forward under way ends first (the engine runs one job at a time)
            yield self.in_flight
        self.clock.judged(hit if self.forwards >= 1 else None)  # a guess was made: judged now
        return min(k, self.forwards - 1) if hit and self.forwards > 1 else 0


class AheadBatcher:
    """A Draft server's drafting ahead, as `DraftServicer._ahead_step` runs it: one forward at a time
    for every session with a forward ahead to run, started only while no Propose waits or runs."""

    def __init__(self, env: simpy.Environment, sim: Simulation, draft: DraftServer):
        self.env, self.sim, self.draft = env, sim, draft
        self.runs: list[AheadRun] = []
        self._wakeup: simpy.Event | None = None
        env.process(self._loop())

    def add(self, run: AheadRun) -> None:
        if run not in self.runs:
            self.runs.append(run)
        if self._wakeup is not None and not self._wakeup.triggered:
            self._wakeup.succeed()

    def _loop(self):
        env = self.env
        while True:
            self.runs = [run for run in self.runs if run.wants(env.now)]
            if not self.runs:
                self._wakeup = env.event()
                yield self._wakeup
                continue
            idle = self.draft.idle()
            if not idle.triggered:  # Propose calls first
                yield idle
                continue
            runs = [(run, run.generation) for run in self.runs]
            rows = len(runs)
            fed = sum(run.fed_tokens() for run, _ in runs) / rows
            context = sum(run.context + run.forwards for run, _ in runs) / rows
            job_ms = self.draft.cost.forward_ms(rows, fed, context)
            job = self.draft.run_job(job_ms / 1e3, self.draft.intensity(job_ms, self.draft.cost.forward_ms(1, 1, context)))
            for run, _ in runs:
                run.in_flight = job
            yield job
            self.sim.ahead_forwards += 1
            for run, generation in runs:
                if run.generation == generation:  # its token is drafted even if the Propose came meanwhile
                    run.in_flight = None
                    run.forwards += 1


class RunStream:
    """The messages of one Run (a `Plan.server_steps` plan: the service steps the rounds and streams
    them): a round's tokens are written at once when they are the stream's first or last, else once
    `stream_interval_ms` has passed since the last message (the rounds in between join it), as the
    Verify service's `read_ahead` does; each message costs the service's RPC thread, crosses the link
    and is handled by the coordinator, which sends its tokens to the client, while the service steps on."""

    def __init__(self, sim: Simulation, record: RequestRecord, link: NetLink, rpc: Process | None):
        self.sim, self.record, self.link, self.rpc = sim, record, link, rpc
        self.interval_s = sim.config.stream_interval_ms / 1e3
        self.last_sent_s: float | None = None
        self.pending = 0
        self.last: simpy.Process | None = None  # the latest message's: (coordinator done, delivery)

    def add(self, num_tokens: int, finished: bool) -> None:
        env = self.sim.env
        self.pending += num_tokens
        if finished or self.last_sent_s is None or env.now - self.last_sent_s >= self.interval_s:
            self.last = env.process(self._message(self.pending, finished))
            self.pending, self.last_sent_s = 0, env.now

    def _message(self, num_tokens: int, finished: bool):
        sim = self.sim
        num_bytes = sim._overhead + sim._bytes_per_token * num_tokens
        yield from sim._handle(self.rpc, sim.env.now, 1)  # the service writes it
        t = self.link.send_up(sim.env.now, num_bytes)
        t = yield from sim._handle(sim.coordinator, t, 1)
        return t, sim._to_client(self.record, t, num_tokens, num_bytes, False, finished)


class Simulation:
    def __init__(self, config: SimConfig):
        self.config = config
        self.env = simpy.Environment()
        self.window = Window(config.burn_in_s, config.duration_s)
        self.requests: list[RequestRecord] = []
        self.num_emitted_tokens = 0
        self.max_sessions_per_target = 0  # the most sessions one target held at once (inside the window)
        seed = config.seed
        self._arrival_rng = random.Random(f"{seed}/arrivals")
        net = config.network
        self._overhead = net.rpc_overhead_bytes
        self._bytes_per_token = net.bytes_per_token
        self._client_latency_s = net.client.latency_ms / 1e3
        self._client_s_per_byte = 8.0 / (net.client.bandwidth_mbps * 1e6) if net.client.bandwidth_mbps > 0 else 0.0
        # the live Coordinator's plan for this mode (`specmesh.decoding.plan`): who steps the rounds
        self.plan = choose_plan(PLAN_MODES[config.mode], drafter=config.mode != "autoregressive",
                                server_rounds=config.server_rounds)

        self.hosts: dict[str, Host] = {}
        self.rpc_threads: dict[str, Process] = {}  # service name -> its RPC thread, where its CPU per call is modelled
        self.coordinator = self._process("coordinator", config.coordinator)
        self.client_process = self._process("clients", config.clients)
        self.targets: dict[str, tuple[TargetServer, NetLink, float, CostModel | None]] = {}
        replicas = []
        for gi, group in enumerate(config.targets):
            cost = build_cost(config, group.device, "target")
            fused_cost = build_cost(config, group.fused_draft_device, "draft") if group.fused_draft_device else None
            for i in range(group.count):
                name = f"target{gi}.{i}"
                server = TargetServer(self.env, name, cost, self.window, group.max_batch_tokens, group.batch_window_ms,
                                      group.prefill_chunk_tokens, self._engine(name, group.host, group.threads, forwards=True))
                server.engine_s_per_call = group.engine_ms_per_call / 1e3
                self.targets[name] = (server, self._link(name, group.node), group.fused_draft_ms_per_token, fused_cost)
                self._add_rpc_thread(name, group.host, group.cpu_ms_per_call)
                replicas.append(Replica(name, weight=group.weight))
        self.target_set = ReplicaSet(replicas, make_router(**config.router), rng=random.Random(f"{seed}/router"),
                                     cooldown_s=None, clock=lambda: self.env.now)

        self.drafts: list[tuple[DraftServer, NetLink]] = []
        draft_replicas = []
        if config.mode == "distributed":
            for gi, dgroup in enumerate(config.drafts):
                cost = build_cost(config, dgroup.device, "draft")
                for i in range(dgroup.count):
                    name = f"draft{gi}.{i}"
                    drafter = DraftServer(self.env, name, cost, self.window, dgroup.max_batch_sessions, dgroup.batch_window_ms,
                                          self._engine(name, dgroup.host, dgroup.threads, forwards=True))
                    drafter.engine_s_per_call = dgroup.engine_ms_per_call / 1e3
                    drafter.steps_equal_chains = dgroup.steps_equal_chains
                    self.drafts.append((drafter, self._link(name, dgroup.node)))
                    self._add_rpc_thread(name, dgroup.host, dgroup.cpu_ms_per_call)
                    draft_replicas.append(Replica(name, weight=dgroup.weight))
        self._draft_by_name = {d.name: (d, link) for d, link in self.drafts}
        self.draft_set = ReplicaSet(draft_replicas, make_router(**config.draft_router), rng=random.Random(f"{seed}/draft_router"),
                                    cooldown_s=None, clock=lambda: self.env.now)

        spec = config.speculation
        conditional = conditional_from_marginal(spec.acceptance_marginal) if spec.acceptance_marginal else spec.acceptance
        self.acceptance = AcceptanceModel(conditional, spec.acceptance_trace)
        self.draft_ahead = config.mode == "distributed" and spec.draft_ahead
        self.draft_shares_kv = config.mode == "distributed" and spec.draft_shares_kv
        self._guess_rate = spec.guess_rate or None  # None: the per-position acceptance after the k drafts
        self.ahead_served_tokens = 0  # inside and outside the window: a run's totals (tests, reports)
        self.ahead_forwards = 0  # forwards ahead run (each batches every session with one to run)
        self._ahead_batchers: dict[str, AheadBatcher] = {}
        # a recorded run replayed: the i-th request started gets the i-th list of accepted counts (cycling)
        self._request_traces = itertools.cycle(spec.acceptance_per_request) if spec.acceptance_per_request else None
        wl = config.workload
        self._prompt_tokens = make_sampler(wl.prompt_tokens, "workload.prompt_tokens")
        self._output_tokens = make_sampler(wl.output_tokens, "workload.output_tokens")
        self._turns = make_sampler(wl.turns, "workload.turns")
        self._followup_tokens = make_sampler(wl.followup_tokens, "workload.followup_tokens")

    def _engine(self, name: str, host: str, threads: int, forwards: bool = False) -> Engine:
        """A service's engine (`forwards`: a model's) or a process's thread: its own device, or `threads` of a
        shared host's cores."""
        if not host:
            return DeviceEngine(self.env, name, self.window)
        if host not in self.hosts:
            spec = self.config.hosts.get(host)
            self.hosts[host] = Host(self.env, host, self.config.host_cores(host), self.window, spec.background_threads if spec else 0.0,
                                    spec.memory_contention if spec else 0.0)
        return HostedEngine(self.env, self.hosts[host], threads, self.window, forwards)

    def _process(self, name: str, spec: ProcessCpu) -> Process | None:
        """A process's one thread and its CPU per message; None when its CPU is not modelled."""
        if spec.cpu_ms_per_message <= 0:
            return None
        return Process(self._engine(name, spec.host, 1), spec.cpu_ms_per_message / 1e3)

    def _add_rpc_thread(self, service: str, host: str, cpu_ms_per_call: float) -> None:
        """A Draft / Verify service's RPC thread (1 thread of its host), when its CPU per call is modelled."""
        if cpu_ms_per_call > 0:
            self.rpc_threads[service] = Process(self._engine(f"{service}/rpc", host, 1), cpu_ms_per_call / 1e3)

    def _handle(self, process: Process | None, at_s: float, num_messages: int):
        """`num_messages` reach `process` at `at_s` (now or later) and it handles them (one job, FIFO
        on its thread); returns the time it is done. Without the process: at once, `at_s`."""
        if process is None or not num_messages:
            return at_s
        if at_s > self.env.now:
            yield self.env.timeout(at_s - self.env.now)
        yield process.run(num_messages, self.env.now in self.window)
        return self.env.now

    def _to_client(self, record: RequestRecord, t_s: float, num_tokens: int, num_bytes: float, first: bool,
                   last: bool) -> simpy.Process | None:
        """The coordinator sends `num_tokens` to the client from `t_s`: they count once the client has
        them (the first token: TTFT; `last`: the request's end). With a process's CPU modelled, its
        job joins the coordinator's queue now (`t_s` is now: the response it answers was just handled)
        and the returned process ends at delivery; else plain arithmetic, as without processes."""
        if self.coordinator is None and self.client_process is None:
            at_s = t_s + self._client_s(num_bytes)
            self._emit(num_tokens, at_s)
            if first:
                record.first_token_s = at_s
            return None
        sent = self.coordinator.run(1, self.env.now in self.window) if self.coordinator is not None else None

        def deliver():
            if sent is not None:
                yield sent
            elif t_s > self.env.now:
                yield self.env.timeout(t_s - self.env.now)
            done_s = yield from self._handle(self.client_process, self.env.now + self._client_s(num_bytes), 1)
            if done_s > self.env.now:
                yield self.env.timeout(done_s - self.env.now)
            self._emit(num_tokens, done_s)
            if first:
                record.first_token_s = done_s
            if last:
                record.end_s = done_s

        return self.env.process(deliver())

    def _link(self, name: str, node: str) -> NetLink:
        net = self.config.network
        spec: Link = net.same_node if node == net.coordinator_node else net.cross_node
        return NetLink(name, spec.latency_ms, spec.bandwidth_mbps, self.window)

    def _client_s(self, num_bytes: float) -> float:
        return self._client_latency_s + num_bytes * self._client_s_per_byte

    # workload
    def _start_workload(self) -> None:
        wl, env = self.config.workload, self.env
        if wl.arrival == "poisson":
            env.process(self._poisson())
        elif wl.arrival == "closed":
            for client in range(wl.num_clients):
                env.process(self._closed_client(client))
        else:
            trace = wl.trace or load_trace(Path(self.config.base_dir) / wl.trace_file)
            env.process(self._replay(trace))

    def _poisson(self):
        rate, conv_id = self.config.workload.rate_per_s, 0
        while True:
            yield self.env.timeout(self._arrival_rng.expovariate(rate))
            self.env.process(self._conversation(conv_id))
            conv_id += 1

    def _closed_client(self, client: int):
        wl = self.config.workload
        conv_id, num_done = client, 0
        while not wl.num_requests_per_client or num_done < wl.num_requests_per_client:
            yield from self._conversation(conv_id)
            conv_id += wl.num_clients
            num_done += 1

    def _replay(self, trace: list[dict[str, float]]):
        for conv_id, item in enumerate(sorted(trace, key=lambda r: r["arrival_s"])):
            if item["arrival_s"] > self.env.now:
                yield self.env.timeout(item["arrival_s"] - self.env.now)
            rng = random.Random(self.config.seed * 1_000_003 + conv_id)
            self.env.process(self._request(conv_id, rng, int(item["prompt_tokens"]), int(item["output_tokens"])))

    def _conversation(self, conv_id: int):
        wl = self.config.workload
        rng = random.Random(self.config.seed * 1_000_003 + conv_id)
        num_turns = self._turns(rng)
        history = 0
        for turn in range(num_turns):
            prompt = history + (self._prompt_tokens(rng) if turn == 0 else self._followup_tokens(rng))
            output = min(self._output_tokens(rng), wl.max_context - 1)
            prompt = max(1, min(prompt, wl.max_context - output))
            yield from self._request(conv_id, rng, prompt, output)
            history = prompt + output
            if wl.think_time_s > 0 and turn + 1 < num_turns:
                yield self.env.timeout(rng.expovariate(1.0 / wl.think_time_s))

    # one request
    def _emit(self, num_tokens: int, at_s: float) -> None:
        if at_s in self.window:
            self.num_emitted_tokens += num_tokens

    def _request(self, conv_id: int, rng: random.Random, num_prompt: int, max_new_tokens: int):
        env, config = self.env, self.config
        mode, overhead, per_token = config.mode, self._overhead, self._bytes_per_token
        record = RequestRecord(env.now, num_prompt, max_new_tokens)
        self.requests.append(record)
        own_trace = next(self._request_traces) if self._request_traces is not None else None  # in start order
        coordinator = self.coordinator
        yield from self._handle(self.client_process, env.now, 1)  # the client sends the request
        yield env.timeout(self._client_s(overhead + per_token * num_prompt))
        open_s = env.now
        replica = self.target_set.acquire()
        if env.now in self.window and replica.num_in_flight > self.max_sessions_per_target:
            self.max_sessions_per_target = replica.num_in_flight
        server, link, fused_ms_per_token, fused_cost = self.targets[replica.id]
        record.target = replica.id
        target_rpc = self.rpc_threads.get(server.name)
        draft: DraftServer | None = None
        draft_link: NetLink | None = None
        draft_replica: Replica | None = None
        draft_rpc: Process | None = None
        if mode == "distributed":
            if config.draft_assignment == "routed":
                draft_replica = self.draft_set.acquire()
                draft, draft_link = self._draft_by_name[draft_replica.id]
            else:
                draft, draft_link = self.drafts[conv_id % len(self.drafts)]
            record.draft = draft.name
            draft_rpc = self.rpc_threads.get(draft.name)
            draft.num_sessions += 1

        # the driver opens the Draft session beside the Verify session and awaits it before the first Propose
        draft_opening = None
        if draft is not None and max_new_tokens > 1:
            assert draft_link is not None
            draft_opening = env.process(self._draft_open(draft, draft_link, draft_rpc, env.now, num_prompt))
        # Generate, the Verify.OpenSession request
        yield from self._handle(coordinator, env.now, 2)
        yield env.timeout(link.send_down(env.now, overhead + per_token * num_prompt) - env.now)
        yield from self._handle(target_rpc, env.now, 1)  # Verify.OpenSession at the service
        for job_ms in server.prefill_jobs_ms(num_prompt):
            yield server.run_job(job_ms / 1e3, server.intensity(job_ms, server.cost.forward_ms(1, 1, num_prompt)))
        server.num_sessions += 1
        t = link.send_up(env.now, overhead + per_token)
        t = yield from self._handle(coordinator, t, 1)  # the first token comes back
        delivery = self._to_client(record, t, 1, overhead + per_token, True, max_new_tokens <= 1)
        generated, new_input = 1, 1  # tokens out; tokens emitted by the last round (what the drafter is told)
        # what the drafter's next first forward feeds (ModelDrafter._absorb): the prompt and the first token, or
        # drafting ahead, which prefilled the prompt at open but its last token, those two
        # (sharing the target's KV, only the last of them: the rest is copied)
        draft_feed = 1 if self.draft_shares_kv else 2 if self.draft_ahead else num_prompt + 1
        k_max = config.speculation.k if mode != "autoregressive" else 0
        q_bytes = config.speculation.q_bytes_per_draft_token
        trace_offset = conv_id % len(self.acceptance.trace) if self.acceptance.trace else 0  # sessions start apart
        fused_opened = False
        draft_opened = draft_opening is not None
        if draft_opening is not None:
            t = max(t, (yield draft_opening))
        rounds = round_state(num_prompt, max_new_tokens, k_max)
        ahead = AheadRun(self._ahead_batcher(draft)) if self.draft_ahead and draft is not None else None
        last_hit = False  # the last round accepted every draft and the drafter's guess
        stepped = self.plan.server_steps and not rounds.finished  # one Run: the service steps every round itself
        if stepped:  # the Run request goes out once; rounds then follow each other on the service
            t = yield from self._handle(coordinator, t, 1)
            yield env.timeout(link.send_down(t, overhead) - env.now)
            yield from self._handle(target_rpc, env.now, 1)
        stream = RunStream(self, record, link, target_rpc) if stepped else None
        while not rounds.finished:
            k = rounds.next_k()
            context = num_prompt + generated
            num_handled = 1  # before the Verify call goes out: its request
            if mode == "distributed" and k > 0:
                assert draft is not None and draft_link is not None
                t = yield from self._handle(coordinator, t, 1)  # the Propose request
                yield env.timeout(draft_link.send_down(t, overhead + per_token * new_input) - env.now)
                yield from self._handle(draft_rpc, env.now, 1)  # the Propose
                served = 0
                if ahead is not None:  # the drafting ahead stops; a forward under way ends first
                    served = yield from ahead.on_propose(env, k, last_hit)
                    self.ahead_served_tokens += served
                if served < k:
                    yield draft.propose(1 if served else draft_feed, k - served, context + served - (0 if served else draft_feed))
                t = draft_link.send_up(env.now, overhead + (per_token + q_bytes) * k)
                if ahead is not None:
                    ahead.start(env, k, context + k + 1)
                num_handled = 2  # and the Propose response
            if not stepped:
                t = yield from self._handle(coordinator, t, num_handled)
                yield env.timeout(link.send_down(t, overhead + (per_token + q_bytes) * k) - env.now)
                yield from self._handle(target_rpc, env.now, 1)  # the Verify (Step) call at the service
            if mode == "fused" and k > 0:
                draft_ms = k * fused_ms_per_token
                if fused_cost is not None:
                    draft_ms += k * fused_cost.forward_ms(1, 1, context)
                    if not fused_opened:
                        draft_ms += fused_cost.forward_ms(1, num_prompt, 0)
                fused_opened = True
                yield server.run_job(draft_ms / 1e3)
            yield server.verify(1 + k, context)
            if not k:
                num_accepted = 0
            elif own_trace:
                num_accepted = min(k, own_trace[record.num_rounds % len(own_trace)])
            else:
                num_accepted = self.acceptance.num_accepted(k, rng, record.num_rounds, trace_offset)
            last_hit = ahead is not None and k > 0 and num_accepted == k and rng.random() < self._guess_probability(k)
            new_input = num_accepted + 1
            rounds.record(k, num_accepted, [0] * new_input)
            # the drafter kept its first k - 1 draft tokens; it feeds the target's token (and the last
            # draft token when all k were accepted); without a draft this round, everything new
            draft_feed = 1 if self.draft_shares_kv else (1 if num_accepted < k else 2) if k else draft_feed + new_input
            generated += new_input
            record.num_rounds += 1
            record.num_draft_tokens += k
            record.num_accepted_tokens += num_accepted
            if stream is not None:  # written to the stream while the service steps on
                stream.add(new_input, generated >= max_new_tokens)
                continue
            t = link.send_up(env.now, overhead + per_token * new_input)
            t = yield from self._handle(coordinator, t, 1)  # the Verify response
            delivery = self._to_client(record, t, new_input, overhead + per_token * new_input, False, generated >= max_new_tokens)
        if stream is not None:  # the coordinator has the stream's last message
            t, delivery = yield stream.last
        server.num_sessions -= 1
        if ahead is not None:
            ahead.stopped = True
        if draft is not None:
            draft.num_sessions -= 1
        record.num_output_tokens = generated
        # the driver closes its sessions (Verify, then Draft) before the client's stream ends: each a call
        # whose job on the service's engine waits behind the forwards queued there
        t = yield from self._session_call(server, link, target_rpc, t)
        if draft_opened:
            assert draft is not None and draft_link is not None
            t = yield from self._session_call(draft, draft_link, draft_rpc, t)
        if delivery is None:
            record.end_s = t + self._client_s(overhead + per_token)
        if t > env.now:
            yield env.timeout(t - env.now)
        self.target_set.finish(replica, env.now - open_s, generated)
        if draft_replica is not None:
            self.draft_set.finish(draft_replica, env.now - open_s, generated)
        if delivery is not None:
            yield delivery  # sets end_s: the last tokens reached the client
            record.end_s = max(record.end_s, t + self._client_s(overhead))  # and so did the stream's end
        elif record.end_s > env.now:
            yield env.timeout(record.end_s - env.now)

    def _session_call(self, server: BatchingServer, link: NetLink, rpc: Process | None, t_s: float, job_ms: float = 0.0):
        """The coordinator's OpenSession / CloseSession call to a service, sent from `t_s`: its request and
        response handled by the coordinator and the service's RPC thread, and a job of `job_ms` (none: of no
        work) on the service's engine, which runs once the engine's queued jobs have; returns when the
        coordinator has the response."""
        env = self.env
        t = yield from self._handle(self.coordinator, t_s, 1)  # the request
        yield env.timeout(link.send_down(t, self._overhead) - env.now)
        yield from self._handle(rpc, env.now, 1)
        yield server.run_job(job_ms / 1e3)
        t = link.send_up(env.now, self._overhead)
        return (yield from self._handle(self.coordinator, t, 1))  # the response

    def _draft_open(self, draft: DraftServer, link: NetLink, rpc: Process | None, t_s: float, num_prompt: int):
        """Draft.OpenSession, sent from `t_s` beside the Verify session's: it records the prompt (the first
        Propose prefills it), or, drafting ahead, prefills it but its last token (`ModelDrafter.prefill`);
        returns when the coordinator has the response."""
        prefill_ms = draft.cost.forward_ms(1, num_prompt - 1, 0) if self.draft_ahead and num_prompt > 1 else 0.0
        return (yield from self._session_call(draft, link, rpc, t_s, prefill_ms))

    def _ahead_batcher(self, draft: DraftServer) -> AheadBatcher:
        if draft.name not in self._ahead_batchers:
            self._ahead_batchers[draft.name] = AheadBatcher(self.env, self, draft)
        return self._ahead_batchers[draft.name]

    def _guess_probability(self, k: int) -> float:
        if self._guess_rate is not None:
            return self._guess_rate
        conditional = self.acceptance.conditional
        return conditional[min(k, len(conditional) - 1)]

    # run
    def run(self) -> SimResult:
        start = time.perf_counter()
        self._start_workload()
        self.env.run(until=self.config.duration_s)
        wall_s = time.perf_counter() - start
        w = self.window
        in_system_area = sum(w.overlap_s(r.arrival_s, r.end_s if r.end_s >= 0 else w.end_s) for r in self.requests)
        summary: dict[str, Any] = summarize(self.requests, w.start_s, w.end_s, self.num_emitted_tokens, in_system_area,
                                            self.config.slo.ttft_ms, self.config.slo.tpot_ms)
        devices = []
        for name, (server, _, _, _) in self.targets.items():
            group_cap = server.max_batch_cost
            batches = server.num_batches
            devices.append(DeviceRecord(
                name, "target", server.busy_s, server.num_jobs, server.busy_s / w.length_s, batches,
                server.num_batch_rows / batches if batches else 0.0, server.num_batch_cost / batches if batches else 0.0,
                server.num_batch_cost / batches / group_cap if batches else 0.0, server.queue_depth.mean(w.end_s),
                server.queue_depth.max_value))
        for d, _ in self.drafts:
            batches = d.num_batches
            devices.append(DeviceRecord(d.name, "draft", d.busy_s, d.num_jobs, d.busy_s / w.length_s, batches,
                                        d.num_batch_rows / batches if batches else 0.0, 0.0, 0.0, d.queue_depth.mean(w.end_s),
                                        d.queue_depth.max_value))
        targets = [d for d in devices if d.kind == "target"]
        drafts = [d for d in devices if d.kind == "draft"]
        summary.update({
            "mode": self.config.mode,
            "router": self.config.router.get("name"),
            "num_targets": len(targets),
            "num_drafts": len(drafts),
            "target_utilisation_mean": sum(d.utilisation for d in targets) / len(targets),
            "draft_utilisation_mean": sum(d.utilisation for d in drafts) / len(drafts) if drafts else 0.0,
            "batch_rows_mean": sum(d.mean_batch_rows * d.num_batches for d in targets) / max(1, sum(d.num_batches for d in targets)),
            "batch_token_utilisation_mean": sum(d.batch_token_utilisation * d.num_batches for d in targets)
            / max(1, sum(d.num_batches for d in targets)),
            "queue_depth_mean": sum(d.queue_depth_mean for d in targets) / len(targets),
            "queue_depth_max": max(d.queue_depth_max for d in targets),
            "sessions_per_target_max": self.max_sessions_per_target,
            "hosts": {name: {"cores": h.cores, "core_utilisation": h.core_utilisation()}
                      for name, h in self.hosts.items()},
            "processes": {name: {"num_messages": p.num_messages, "cpu_s": p.num_messages * p.s_per_message,
                                 "busy_s": p.engine.busy_s}  # busy: wall time with a job running (slowed when shared)
                          for name, p in (("coordinator", self.coordinator), ("clients", self.client_process),
                                          *((f"{service}/rpc", rpc) for service, rpc in self.rpc_threads.items())) if p is not None},
            "virtual_s": self.config.duration_s,
            "wall_s": wall_s,
            "virtual_s_per_wall_s": self.config.duration_s / wall_s if wall_s > 0 else float("inf"),
        })
        return SimResult(summary, self.requests, devices)


def simulate(config: SimConfig) -> SimResult:
    return Simulation(config).run()
