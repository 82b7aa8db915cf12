"""The simulator's configuration, from YAML (see configs/sim/*.yaml for annotated examples).

    config = load_config("configs/sim/fleet.yaml", overrides={"workload.rate_per_s": 40})

Sections: `mode`, `duration_s`, `burn_in_s`, `seed`; `models` (target / draft dimensions for
roofline costs); `devices` (name -> a cost: `table: file.json`, `roofline: {preset | specs}`, or
`linear: {base_ms, per_token_ms, per_context_ms}`); `targets` (server groups); `drafts` (device
groups and how sessions find one); `hosts` (machines shared by several services: their cores);
`network` (links by placement); `router` / `draft_router` (`specmesh.routing` names and options);
`speculation` (k, acceptance); `workload`; `slo`.
Unknown keys are errors, so a typo does not silently fall back to a default.

Who steps the rounds is the live Coordinator's plan (`specmesh.decoding.plan.choose_plan`): with
`server_rounds` (true, as the Coordinator ships) a fused or autoregressive request is one Run, the
Verify service stepping its rounds back to back and streaming them at most every `stream_interval_ms`;
without, a Step / Verify call per round goes through the Coordinator. Distributed requests are client
rounds either way.

Hosts: a target or draft group with `host: NAME` (count 1: one process) runs on that machine's
cores, shared with the other services naming it; its `threads` (torch threads, 1 by default: the
setting its cost table was profiled with) are the cores one of its forwards asks for. Forwards run
side by side at full speed while the threads asked fit in the cores and slow down in proportion past
that (servers.py). `hosts: {NAME: {cores: 2, background_threads: 0.5, memory_contention: 0.2}}` (the second:
other load on the machine, e.g. measured as its CPU use; the third: how much model forwards side by side slow each
other, the cores sharing one memory bus, weighed by how much each streams weights (servers.py), e.g.
measured with two processes pinned to two cores); a host not listed gets as many cores as its largest
service has threads (services that each use every core: they share them as if taking turns).
A group without `host:` has its device to itself.

Processes outside the engines: `coordinator: {host: NAME, cpu_ms_per_message: 0.4}` and the same for
`clients` (one process running every client, as `specmesh bench` does) put their CPU work on a host:
each message the process handles (a request or response it sends or receives) is a job of that many
ms of one core, FIFO on the process's one thread, sharing the host's cores with the forwards. No
host: a core of its own (the work still queues). 0 (the default): not modelled, as before; the
per-message cost then lives only in the link latency.
The Draft and Verify services' own CPU outside their forwards (gRPC, protobuf, validation, the
batcher): `cpu_ms_per_call` on a target or draft group, a job of that many ms of one core per RPC
the service handles, on the service's RPC thread (beside its engine thread) and its host's cores;
`engine_ms_per_call`, the engine thread's own work per Propose / Verify call outside the forward
(sampling, acceptance, KV bookkeeping), added to the job of the batch the call rides in. 0 (the
defaults): not modelled.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

MODES = ("distributed", "fused", "autoregressive")
ARRIVALS = ("poisson", "closed", "trace")
DRAFT_ASSIGNMENTS = ("routed", "per_client")


@dataclass
class TargetGroup:
    count: int = 1
    device: str = "target"  # a key of `devices`
    node: str = "target"  # placement: links between different nodes use network.cross_node
    host: str = ""  # services with the same non-empty host share its cores (`hosts`, servers.py); count must be 1
    threads: int = 1  # torch threads of its engine (as profiled): cores a forward asks of its host
    weight: float = 1.0  # the router's prior capacity (specmesh.routing.Replica.weight)
    max_batch_tokens: int = 4096  # VerifyOptions.max_batch_tokens
    batch_window_ms: float = 2.0  # VerifyOptions.batch_window_ms
    prefill_chunk_tokens: int = 512  # VerifyOptions.prefill_chunk_tokens; 0 = one forward
    fused_draft_device: str = ""  # cost of the hosted drafter (fused mode); "" = `fused_draft_ms_per_token`
    fused_draft_ms_per_token: float = 0.0  # an n-gram drafter costs about nothing
    cpu_ms_per_call: float = 0.0  # CPU (ms of one core) per RPC handled outside the forwards; 0 = not modelled
    engine_ms_per_call: float = 0.0  # engine-thread CPU per Verify call outside the forward, added to its batch's job


@dataclass
class DraftGroup:
    count: int = 1
    device: str = "draft"
    node: str = "edge"  # a draft device's own node unless it shares the coordinator's
    host: str = ""  # as for targets: shares the cores of this host with its other services; count must be 1
    threads: int = 1  # as for targets
    weight: float = 1.0
    max_batch_sessions: int = 64  # DraftOptions.max_batch_sessions
    batch_window_ms: float = 2.0  # DraftOptions.batch_window_ms
    cpu_ms_per_call: float = 0.0  # as for targets
    engine_ms_per_call: float = 0.0  # as for targets, per Propose call
    # its engine's steps equal its chains bit for bit (`NativeEngine.steps_equal_chains`: the CPU fast path), so
    # drafting ahead keeps the guess forward's KV and the first draft ahead feeds one token, not two
    steps_equal_chains: bool = False


@dataclass
class HostSpec:
    cores: int = 1  # cores the forwards of this machine's services share (processor sharing past them)
    background_threads: float = 0.0  # other processes' runnable threads (a time average), sharing the cores alike
    # c: a forward streaming weights a share i of its time runs at 1 / (1 + c i S) beside forwards of summed share S
    # (the cores share one memory bus: servers.py); 0 = forwards on different cores do not slow each other
    memory_contention: float = 0.0


@dataclass
class ProcessCpu:
    host: str = ""  # the host whose cores its one thread shares; "" = a core of its own
    cpu_ms_per_message: float = 0.0  # CPU (ms of one core) per message it handles; 0 = not modelled


@dataclass
class Link:
    latency_ms: float = 0.0  # one way
    bandwidth_mbps: float = 0.0  # megabits per second per direction; 0 = unlimited


@dataclass
class Network:
    coordinator_node: str = "target"
    same_node: Link = field(default_factory=lambda: Link(0.05, 0.0))
    cross_node: Link = field(default_factory=lambda: Link(0.5, 10_000.0))
    client: Link = field(default_factory=Link)  # client <-> coordinator
    rpc_overhead_bytes: int = 200  # headers and framing of one message
    bytes_per_token: int = 4


@dataclass
class Speculation:
    k: int = 4  # draft tokens per round (the coordinator's FixedK); capped by max_new_tokens like SpeculationState
    acceptance: list[float] = field(default_factory=lambda: [0.8])  # P(position i accepted | all before it were); last repeats
    acceptance_marginal: list[float] = field(default_factory=list)  # instead: P(position i accepted), as `specmesh stats` prints
    acceptance_trace: list[int] = field(default_factory=list)  # instead: accepted tokens of recorded rounds, replayed
    acceptance_per_request: list[list[int]] = field(default_factory=list)  # instead: request i started gets round counts [i]
    q_bytes_per_draft_token: int = 0  # sampled sessions send the draft distributions q (e.g. 4 * vocab)
    # distributed mode: the Draft service drafts ahead (DraftOptions.draft_ahead; rule: specmesh.decoding.ahead)
    draft_ahead: bool = False
    # P(the drafter's guess is the target's token | all k accepted); 0 = the per-position acceptance at
    # position k + 1 (a trace has none: give it)
    guess_rate: float = 0.0
    # distributed mode: the Draft service copies its context's KV from the Verify service's shared cache (`share_kv`,
    # the same model on one host; specmesh/kv/shared.py): a Propose feeds one token, the copies are not priced
    draft_shares_kv: bool = False


@dataclass
class Workload:
    arrival: str = "poisson"  # poisson (open loop, conversations) | closed (fixed clients) | trace
    rate_per_s: float = 1.0  # poisson: conversations started per second
    num_clients: int = 1  # closed: clients, each sending its next request when the last ends (+ think time)
    num_requests_per_client: int = 0  # closed: each client stops after this many requests; 0 = never
    trace: list[dict[str, float]] = field(default_factory=list)  # [{arrival_s, prompt_tokens, output_tokens}]
    trace_file: str = ""  # or a JSON / CSV file of them
    prompt_tokens: Any = 128  # int | [choices] | {uniform: [lo, hi]} | {lognormal: {median, sigma}}
    output_tokens: Any = 128
    turns: Any = 1  # requests per conversation
    think_time_s: float = 0.0  # mean (exponential) pause between a conversation's turns
    followup_tokens: Any = 32  # new user tokens per later turn (the history is prefilled again)
    max_context: int = 8192  # the history is cut to fit prompt + output in this


@dataclass
class Slo:
    ttft_ms: float = 1000.0
    tpot_ms: float = 100.0


@dataclass
class SimConfig:
    mode: str = "distributed"
    duration_s: float = 60.0  # virtual seconds simulated, burn-in included
    burn_in_s: float = 5.0  # excluded from every metric
    seed: int = 0
    models: dict[str, Any] = field(default_factory=lambda: {"target": "smollm2-135m", "draft": "smollm2-135m"})
    devices: dict[str, dict[str, Any]] = field(default_factory=dict)
    targets: list[TargetGroup] = field(default_factory=lambda: [TargetGroup()])
    drafts: list[DraftGroup] = field(default_factory=lambda: [DraftGroup()])
    hosts: dict[str, HostSpec] = field(default_factory=dict)  # host name -> its cores; see the module docstring
    coordinator: ProcessCpu = field(default_factory=ProcessCpu)  # its CPU per message, on a host or not at all
    clients: ProcessCpu = field(default_factory=ProcessCpu)  # the clients' process, likewise
    draft_assignment: str = "routed"  # routed: the draft_router picks per session | per_client: conversation i -> device i mod n
    network: Network = field(default_factory=Network)
    router: dict[str, Any] = field(default_factory=lambda: {"name": "jsq2"})
    draft_router: dict[str, Any] = field(default_factory=lambda: {"name": "jsq2"})
    speculation: Speculation = field(default_factory=Speculation)
    workload: Workload = field(default_factory=Workload)
    slo: Slo = field(default_factory=Slo)
    # the Coordinator's `server_rounds`: fused and autoregressive requests run as one Run, the Verify service
    # stepping every round and streaming them (`specmesh.decoding.plan`); False: a Step / Verify call per round
    server_rounds: bool = True
    stream_interval_ms: float = 50.0  # a Run's messages at most this often (its first and last at once)
    base_dir: str = "."  # table and trace paths are relative to the config file

    def host_cores(self, host: str) -> int:
        """The cores of `host`: as listed under `hosts`, else its largest service's threads."""
        if host in self.hosts:
            return self.hosts[host].cores
        groups: list[TargetGroup | DraftGroup] = [*self.targets, *self.drafts]
        return max((g.threads for g in groups if g.host == host), default=1)  # else only 1-thread processes run there

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.workload.arrival not in ARRIVALS:
            raise ValueError(f"workload.arrival must be one of {ARRIVALS}, got {self.workload.arrival!r}")
        if self.draft_assignment not in DRAFT_ASSIGNMENTS:
            raise ValueError(f"draft_assignment must be one of {DRAFT_ASSIGNMENTS}, got {self.draft_assignment!r}")
        if not 0 <= self.burn_in_s < self.duration_s:
            raise ValueError(f"need 0 <= burn_in_s < duration_s, got {self.burn_in_s} and {self.duration_s}")
        if not self.targets or any(g.count < 1 for g in self.targets):
            raise ValueError("targets: at least one group, each with count >= 1")
        if self.mode == "distributed" and (not self.drafts or any(g.count < 1 for g in self.drafts)):
            raise ValueError("distributed mode needs draft groups, each with count >= 1")
        if self.stream_interval_ms < 0:
            raise ValueError(f"stream_interval_ms must be >= 0, got {self.stream_interval_ms}")
        if self.speculation.k < 0:
            raise ValueError(f"speculation.k must be >= 0, got {self.speculation.k}")
        if any(not 0 <= p <= 1 for p in self.speculation.acceptance + self.speculation.acceptance_marginal):
            raise ValueError("acceptance probabilities must be in [0, 1]")
        spec = self.speculation
        if not 0 <= spec.guess_rate <= 1:
            raise ValueError(f"speculation.guess_rate must be in [0, 1], got {spec.guess_rate}")
        if spec.draft_ahead and not spec.guess_rate and (spec.acceptance_trace or spec.acceptance_per_request):
            raise ValueError("speculation.draft_ahead with an acceptance trace needs speculation.guess_rate")
        groups: list[TargetGroup | DraftGroup] = [*self.targets, *self.drafts]
        if any(g.host and g.count != 1 for g in groups):
            raise ValueError("a group with `host:` stands for one process on that host: count must be 1")
        if any(g.threads < 1 for g in groups) or any(h.cores < 1 or h.background_threads < 0 or h.memory_contention < 0
                                                  for h in self.hosts.values()):
            raise ValueError("threads and hosts' cores must be >= 1, background_threads and memory_contention >= 0")
        if any(g.cpu_ms_per_call < 0 or g.engine_ms_per_call < 0 for g in groups):
            raise ValueError("cpu_ms_per_call and engine_ms_per_call of targets and drafts must be >= 0")
        processes = {"coordinator": self.coordinator, "clients": self.clients}
        for name, process in processes.items():
            if process.cpu_ms_per_message < 0:
                raise ValueError(f"{name}.cpu_ms_per_message must be >= 0, got {process.cpu_ms_per_message}")
        named = {g.host for g in groups} | {p.host for p in processes.values() if p.cpu_ms_per_message > 0}
        unused = sorted(set(self.hosts) - named)
        if unused:
            raise ValueError(f"hosts {unused} are named by no target or draft group nor a process with CPU (`host:`)")
        used = {g.device for g in self.targets} | {g.fused_draft_device for g in self.targets if g.fused_draft_device}
        if self.mode == "distributed":
            used |= {g.device for g in self.drafts}
        missing = sorted(used - set(self.devices))
        if missing:
            raise ValueError(f"devices not defined under `devices`: {missing}")


def _build(cls: type, data: Any, where: str) -> Any:
    """A dataclass from a mapping, nested dataclasses and lists of them included; unknown keys raise."""
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'config'}: expected a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where or 'config'}: unknown keys {unknown}; known: {sorted(fields)}")
    kwargs: dict[str, Any] = {}
    nested = {"targets": TargetGroup, "drafts": DraftGroup}
    for name, value in data.items():
        f = fields[name]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        key = f"{where}.{name}" if where else name
        if name in nested and cls is SimConfig:
            kwargs[name] = [_build(nested[name], item, f"{key}[{i}]") for i, item in enumerate(value or [])]
        elif name == "hosts" and cls is SimConfig:
            kwargs[name] = {str(host): _build(HostSpec, spec, f"{key}.{host}") for host, spec in (value or {}).items()}
        elif dataclasses.is_dataclass(default):
            kwargs[name] = _build(type(default), value, key)
        else:
            kwargs[name] = value
    return cls(**kwargs)


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """data["a"]["b"] = value for key "a.b"; a list index is a number ("targets.0.count")."""
    parts = key.split(".")
    node: Any = data
    for part in parts[:-1]:
        if isinstance(node, list):
            node = node[int(part)]
        else:
            node = node.setdefault(part, {})
    if isinstance(node, list):
        node[int(parts[-1])] = value
    else:
        node[parts[-1]] = value


def config_from_dict(data: dict[str, Any], overrides: dict[str, Any] | None = None, base_dir: str = ".") -> SimConfig:
    data = copy.deepcopy(data)
    for key, value in (overrides or {}).items():
        set_dotted(data, key, value)
    data.setdefault("base_dir", base_dir)
    config = _build(SimConfig, data, "")
    config.validate()
    return config


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> SimConfig:
    data = yaml.safe_load(Path(path).read_text()) or {}
    return config_from_dict(data, overrides, str(Path(path).parent))
