"""Cluster YAML -> one `ServiceSpec` per process (replicas expanded, options checked, threads shared).

    defaults:              # options every service gets, where its kind has that option
      device: cpu
    services:
      verify:              # a name of your choice
        kind: verify       # draft | verify | stage | coordinator
        model: default
        port: 50052        # replica i listens on port + i; 0 = a free port each
        replicas: 2        # -> processes "verify-0" (:50052) and "verify-1" (:50053)
        device: [cuda:0, cuda:1]  # a list: one value per replica
        torch_threads: 4   # intra-op threads (OMP_NUM_THREADS); default: this host's cores shared
        cpus: "2-5"        # pin its process to these cores ("0", "0,2", "2-5", a list per replica, or
                           # auto: each model process its own slice of this host's cores); torch_threads follows
        borrow_cpus: auto  # draft and verify: cores it may also run on, a thread each, for an engine job
                           # while the processes pinned there run none (servicekit/core_share.py; auto: a
                           # verify service the draft services' cores, a draft service the verify services')
        restart: on-failure  # when its process exits: on-failure (default) | always | never
        max_restarts: 5    # at most this many restarts in restart_window_s (300); client/supervision.py
        ...                # any option of that kind (python -m target_service --help)
      coordinator:
        kind: coordinator  # draft_addresses / verify_addresses: every draft / verify replica above,
                           # cascade_stages: every stage service above in file order (or names / addresses),
                           # unless given; model: the verify service's, unless given

`replicas`, `torch_threads`, `cpus`, `borrow_cpus` and the restart keys are read by the launcher, every other key is
passed as a flag (`borrow_cpus` as the service's `borrow_threads`, one per borrowed core, unless given, and
its slot and its lenders' slots on the launcher's core board; by the local launcher only: on Ray or
Kubernetes each process is placed apart, with nothing to borrow).
A `defaults` key that a kind lacks (a coordinator has no `device`) is not passed to it; a service's
own unknown key is an error, named before any process starts.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from client.supervision import RestartPolicy
from servicekit.core_share import SLOTS

MODULES = {"draft": "draft_service", "verify": "target_service", "stage": "stage_service", "coordinator": "coordinator",
           "gateway": "gateway"}
OPTION_CLASSES = {"draft": "draft_service.options:DraftOptions", "verify": "target_service.options:VerifyOptions",
                  "stage": "stage_service.options:StageOptions", "coordinator": "coordinator.options:CoordinatorOptions",
                  "gateway": "gateway.options:GatewayOptions"}
FRONT_KINDS = ("coordinator", "gateway")  # no model of their own: one thread each, the model services get the cores
LAUNCHER_KEYS = ("replicas", "torch_threads", "cpus", "borrow_cpus", "restart", "max_restarts",
                 "restart_window_s")  # read here, never passed on
BORROWING_KINDS = ("verify", "draft")  # kinds that may borrow cores (--borrow-threads, servicekit/core_share.py)
LENDERS_OF = {"verify": "draft", "draft": "verify"}  # borrow_cpus: auto, the cores of the services of that kind
AUTO_CPUS = "auto"  # cpus: auto, each model process its own slice of the host's cores
RESTART_KEYS = {"restart": "mode", "max_restarts": "max_restarts", "restart_window_s": "window_s"}  # -> RestartPolicy
PLACEMENT_KEYS = ("ray", "k8s")  # a service's placement on Ray / Kubernetes: read by `specmesh ray|k8s`, not here
COORDINATOR_THREADS = 1  # the coordinator tokenizes and schedules; the model services get the cores


@dataclass
class ServiceSpec:
    name: str  # the config's name, or "<name>-<i>" for replica i of several
    kind: str  # draft | verify | stage | coordinator
    options: dict = field(default_factory=dict)  # flags of that service, e.g. {"model": "default", "port": 50051}
    torch_threads: int = 0  # intra-op threads of its process; 0 = not set (torch's own default)
    group: str = ""  # the config entry it comes from (replicas share it)
    restart: RestartPolicy = field(default_factory=RestartPolicy)  # what the launcher does when its process exits
    cpus: tuple[int, ...] = ()  # cores its process is pinned to; () = not pinned
    borrow_cpus: tuple[int, ...] = ()  # cores it may also run on while lent (`borrow_cpus`); not in `cpus`
    core_slot: int = -1  # its slot on the launcher's core board (it lends or borrows); -1 = none
    lender_slots: tuple[int, ...] = ()  # the slots of the processes pinned to its borrowed cores

    @property
    def launch_options(self) -> dict:
        """Flags this launcher adds when it starts the process on this host (under `options`, which win):
        a thread per borrowed core, its slot and its lenders' on the core board (whose file the
        launcher adds). Not for platforms that place each process apart (Ray, Kubernetes)."""
        options: dict = {"borrow_threads": len(self.borrow_cpus)} if self.borrow_cpus else {}
        if self.core_slot >= 0:
            options.update(core_slot=self.core_slot, lender_slots=",".join(map(str, self.lender_slots)))
        return options

    @property
    def affinity(self) -> tuple[int, ...]:
        """The cores its process is pinned to: its own and the borrowed ones; () = not pinned."""
        return tuple(sorted({*self.cpus, *self.borrow_cpus})) if self.cpus else ()

    @property
    def address(self) -> str:
        host = self.options.get("host", "127.0.0.1")
        return f"{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{self.options['port']}"

    @property
    def metrics_url(self) -> str:
        """`http://host:port/metrics`, or "" when the service serves no metrics or the port is picked at run time."""
        port = int(self.options.get("metrics_port", -1))
        return f"http://{self.address.rsplit(':', 1)[0]}:{port}/metrics" if port > 0 else ""


def option_names(kind: str) -> set[str]:
    module, name = OPTION_CLASSES[kind].split(":")
    return {f.name for f in dataclasses.fields(getattr(importlib.import_module(module), name))}


def host_cores() -> int:
    return len(host_cpus())


def host_cpus() -> list[int]:
    """The cores this launcher may run on (its affinity), in order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return list(range(os.cpu_count() or 1))


def parse_cpus(text: str | int) -> tuple[int, ...]:
    """A core list as taskset writes it: "0", "0,2", "2-5", "0-1,4".

    >>> parse_cpus("0-2,5"), parse_cpus(3)
    ((0, 1, 2, 5), (3,))
    """
    cpus: set[int] = set()
    for part in str(text).replace(" ", "").split(","):
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()) or (last and int(last) < int(first)):
            raise ValueError(f"cpus: {text!r} is not a core list like 0, 0,2 or 2-5")
        cpus.update(range(int(first), int(last or first) + 1))
    return tuple(sorted(cpus))


def auto_cpus(num_model_processes: int, available: list[int]) -> list[tuple[int, ...]]:
    """`cpus: auto`: consecutive slices of the available cores, one per model process, the same size;
    no pinning (empty tuples) when there are fewer cores than processes.

    >>> auto_cpus(2, [0, 1]), auto_cpus(3, [0, 1, 2, 3, 4, 5, 6]), auto_cpus(3, [0, 1])
    ([(0,), (1,)], [(0, 1), (2, 3), (4, 5)], [(), (), ()])
    """
    size = len(available) // max(1, num_model_processes)
    if size == 0:
        return [()] * num_model_processes
    return [tuple(available[i * size:(i + 1) * size]) for i in range(num_model_processes)]


def default_torch_threads(num_model_processes: int, cores: int | None = None) -> int:
    """Model services on one host share its cores: max(1, cores // number of model processes)."""
    return max(1, (cores or host_cores()) // max(1, num_model_processes))


def _replicas(path, name: str, entry: dict) -> int:
    replicas = entry.pop("replicas", 1)
    if not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"{path}: service {name!r}: replicas must be an integer >= 1, got {replicas!r}")
    for key, value in entry.items():
        if isinstance(value, list) and len(value) != replicas:
            raise ValueError(f"{path}: service {name!r}: {key} lists {len(value)} values for {replicas} replica(s)")
    return replicas


def _replica_options(options: dict, index: int) -> dict:
    """Replica `index` listens on port + index (and metrics_port + index); port 0 stays 0 (free port
    each). A list value gives one item per replica (e.g. `device: [cuda:0, cuda:1]`)."""
    options = {key: value[index] if isinstance(value, list) else value for key, value in options.items()}
    for key in ("port", "metrics_port"):
        if int(options.get(key, 0) or 0) > 0:
            options[key] = int(options[key]) + index
    return options


def load_cluster_config(path: str | Path, cores: int | None = None) -> list[ServiceSpec]:
    config = yaml.safe_load(Path(path).read_text()) or {}
    defaults = dict(config.get("defaults") or {})
    services = config.get("services") or {}
    if not services:
        raise ValueError(f"{path}: no services")
    default_threads = defaults.pop("torch_threads", 0)
    default_cpus = defaults.pop("cpus", None)
    default_restart = {key: defaults.pop(key) for key in RESTART_KEYS if key in defaults}
    entries = []
    for name, entry in services.items():
        entry = {k: v for k, v in (entry or {}).items() if k not in PLACEMENT_KEYS}
        kind = entry.pop("kind", name)
        if kind not in MODULES:
            raise ValueError(f"{path}: service {name!r} has unknown kind {kind!r}; choose one of {', '.join(MODULES)}")
        restart = _restart_policy(path, name, {**default_restart, **{k: entry.pop(k) for k in RESTART_KEYS if k in entry}})
        cpus = entry.get("cpus", default_cpus if kind not in FRONT_KINDS else None)
        replicas = _replicas(path, name, entry)  # checks a list of cpus too, one per replica
        entry.pop("cpus", None)
        borrow = entry.pop("borrow_cpus", None)
        if borrow not in (None, "") and kind not in BORROWING_KINDS:
            raise ValueError(f"{path}: service {name!r} ({kind}): borrow_cpus is for {', '.join(BORROWING_KINDS)} services")
        entries.append((name, kind, entry, replicas, entry.pop("torch_threads", default_threads), restart, cpus, borrow))
    num_model_processes = sum(replicas for _, kind, _, replicas, _, _, _, _ in entries if kind not in FRONT_KINDS)
    available = list(range(cores)) if cores else host_cpus()
    num_auto = sum(replicas for _, _, _, replicas, _, _, cpus, _ in entries if cpus == AUTO_CPUS)
    auto_slices = iter(auto_cpus(num_auto, available))
    specs, borrowing = [], []
    for name, kind, entry, replicas, threads, restart, cpus, borrow in entries:
        known = option_names(kind)
        unknown = sorted(set(entry) - known)
        if unknown:
            raise ValueError(f"{path}: service {name!r} ({kind}) has no option(s) {', '.join(unknown)}")
        options = {**{k: v for k, v in defaults.items() if k in known}, **entry}
        for index in range(replicas):
            replica_name = name if replicas == 1 else f"{name}-{index}"
            pinned = _pinned(path, name, cpus[index] if isinstance(cpus, list) else cpus, auto_slices, available)
            replica_threads = threads or (len(pinned) if pinned else COORDINATOR_THREADS if kind in FRONT_KINDS
                                          else default_torch_threads(num_model_processes, cores))
            specs.append(ServiceSpec(replica_name, kind, _replica_options(options, index), int(replica_threads), group=name,
                                     restart=restart, cpus=pinned))
            if borrow not in (None, ""):
                borrowing.append((specs[-1], borrow[index] if isinstance(borrow, list) else borrow))
    _lend_cores(path, specs, borrowing, available)
    _inherit_target_model(specs, services)
    return specs


def _lend_cores(path, specs: list[ServiceSpec], borrowing: list[tuple[ServiceSpec, str]], available: list[int]) -> None:
    """Each replica's `borrow_cpus` as its borrowed cores (auto: those pinned to the services it borrows
    from, `LENDERS_OF`, known once every spec is), less its own; the launcher passes them on as
    `borrow_threads` (`ServiceSpec.launch_options`). Every process that lends or borrows gets a slot on
    the core board, and each borrower its lenders' slots: the processes pinned to its borrowed cores."""
    for spec, value in borrowing:
        if value == AUTO_CPUS:
            cores = sorted({core for other in specs if other.kind == LENDERS_OF[spec.kind] for core in other.cpus})
        else:
            cores = list(_pinned(path, spec.group, value, iter(()), available))
        spec.borrow_cpus = tuple(core for core in cores if core not in spec.cpus)
    lenders = {id(spec): [other for other in specs if other is not spec and set(other.cpus) & set(spec.borrow_cpus)]
               for spec in specs if spec.borrow_cpus}
    on_board = [spec for spec in specs if id(spec) in lenders or any(spec in found for found in lenders.values())]
    if len(on_board) > SLOTS:
        raise ValueError(f"{path}: {len(on_board)} processes lend or borrow cores; the core board holds {SLOTS}")
    for slot, spec in enumerate(on_board):
        spec.core_slot = slot
    for spec in on_board:
        spec.lender_slots = tuple(sorted(lender.core_slot for lender in lenders.get(id(spec), [])))


def _pinned(path, name: str, cpus, auto_slices, available: list[int]) -> tuple[int, ...]:
    """A replica's `cpus` value as a core tuple; a core this host does not offer is an error."""
    if cpus is None or cpus == "":
        return ()
    if cpus == AUTO_CPUS:
        return next(auto_slices)
    try:
        pinned = parse_cpus(cpus)
    except ValueError as exc:
        raise ValueError(f"{path}: service {name!r}: {exc}") from None
    missing = sorted(set(pinned) - set(available))
    if missing:
        raise ValueError(f"{path}: service {name!r}: cpus {cpus!r} names core(s) {missing} this host does not offer "
                         f"(it has {available[0]}-{available[-1]})" if available else f"{path}: no cores")
    return pinned


def _restart_policy(path, name: str, keys: dict) -> RestartPolicy:
    try:
        return RestartPolicy(**{RESTART_KEYS[key]: value for key, value in keys.items()})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: service {name!r}: {exc}") from None


def _inherit_target_model(specs: list[ServiceSpec], services: dict) -> None:
    """A coordinator tokenizes with its target's tokenizer: the first verify service's model unless it names one."""
    verify_models = [s.options["model"] for s in specs if s.kind == "verify" and "model" in s.options]
    for spec in specs:
        if spec.kind in FRONT_KINDS and "model" not in (services[spec.group] or {}) and verify_models:
            spec.options["model"] = verify_models[0]


def _cascade_stages(configured: str | None, specs: list[ServiceSpec]) -> dict[str, str]:
    """A coordinator's cascade: the stage services of the file, in file order (cheapest first), unless
    it names its own; there a stage service's config name stands for its (first) replica's address.

    >>> specs = [ServiceSpec("int8", "stage", {"port": 7}, group="int8"), ServiceSpec("bf16", "stage", {"port": 8}, group="bf16")]
    >>> _cascade_stages(None, specs)
    {'cascade_stages': '127.0.0.1:7, 127.0.0.1:8'}
    >>> _cascade_stages("bf16 extend=2", specs)
    {'cascade_stages': '127.0.0.1:8 extend=2'}
    """
    first: dict[str, str] = {}
    for s in specs:
        if s.kind == "stage":
            first.setdefault(s.group or s.name, s.address)
    if configured is None:
        return {"cascade_stages": ", ".join(first.values())} if first else {}
    parts = []
    for part in configured.split(","):
        words = part.split()
        if words and words[0] in first:
            words[0] = first[words[0]]
        parts.append(" ".join(words))
    return {"cascade_stages": ", ".join(p for p in parts if p)}


def link_coordinators(specs: list[ServiceSpec]) -> None:
    """Fill each coordinator's draft_addresses / verify_addresses with every draft / verify replica of
    the cluster, unless the config names them (call once every port is known)."""
    for spec in specs:
        if spec.kind != "coordinator":
            continue
        for kind in ("draft", "verify"):
            key = f"{kind}_addresses"
            addresses = [s.address for s in specs if s.kind == kind]
            if key not in spec.options and addresses:
                spec.options[key] = ",".join(addresses)
        spec.options.update(_cascade_stages(spec.options.get("cascade_stages"), specs))
    coordinators = [s for s in specs if s.kind == "coordinator"]
    for spec in specs:  # a gateway fronts the cluster's (first) coordinator unless the config names one
        if spec.kind == "gateway" and "coordinator" not in spec.options and coordinators:
            spec.options["coordinator"] = coordinators[0].address
