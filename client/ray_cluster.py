"""A cluster YAML on Ray: each service replica a Ray actor that runs the service's own process.

    specmesh ray up configs/ray.yaml [--address auto|ray://head:10001]   # place every service
    specmesh ray down [--namespace specmesh] [--address auto]            # drain, then stop

Why actors and not Ray Serve deployments. A speculative session lives on one Verify (and one Draft)
replica for its whole life: its KV cache is there and never crosses the wire, so the Coordinator
routes by session, once, and every later call of the session must reach that replica. Serve's gRPC
ingress routes each call to any replica of a deployment (through a proxy: one more hop on every
round of the draft/verify loop) and runs its own servicer wiring instead of the services' servers.
An actor per replica keeps the services exactly as `make run-cluster` runs them (`python -m
target_service ...`, its own gRPC port, health, drain on SIGTERM) and hands Ray what Ray is good at:
placement by resources (`num_gpus`, `num_cpus`, custom resources such as `edge: 1`), restarts
(`max_restarts`), and a place to register replicas for discovery.

How it fits together:
- `ServiceRegistry` (actor "specmesh-registry" in the namespace, `coordinator.discovery.REGISTRY_NAME`):
  replica name -> (kind, address).
  A replica registers once its server is SERVING (it prints "listening on host:port" after health is
  SERVING), again after every restart (new port); `down` unregisters before stopping.
- `ServiceReplica` (actor "<service>-<i>"): starts the service process on its node, bound to the
  node's IP (unless the YAML sets `host`), port from the YAML (0 = any free port, read back from the
  process). The process dies with the actor (PR_SET_PDEATHSIG on Linux) and the actor with the
  process (it exits, so Ray restarts it: a restart is a new process, a new port, a new registration).
- The Coordinator's addresses default to `ray:<namespace>/draft` and `ray:<namespace>/verify`:
  it reads the registry every `discovery_interval_s` (`coordinator/discovery.py`).

Per service, a `ray:` key (read here, never passed to the service):
    ray: {num_cpus: 1, num_gpus: 0, resources: {edge: 1}, max_restarts: -1}
and at the top level:
    ray: {namespace: specmesh, log_dir: /tmp/specmesh-ray, local: {num_cpus: 4, resources: {edge: 1, target: 2}}}
where `local` is what the Ray node that `up` starts itself (no --address) advertises.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from client.cluster_config import MODULES, ServiceSpec, load_cluster_config
from coordinator.discovery import DEFAULT_RAY_NAMESPACE, REGISTRY_NAME
from servicekit.options import to_argv

log = logging.getLogger("specmesh.deploy")

DEFAULT_NAMESPACE = DEFAULT_RAY_NAMESPACE  # the namespace `ray:kind` discovery reads when the address names none
DEFAULT_LOG_DIR = "/tmp/specmesh-ray"
LISTENING = re.compile(rb"listening on (\S+):(\d+)(?:, metrics on :(\d+))?")  # what serve_main prints once SERVING
START_TIMEOUT_S = 900.0  # loading a model; a replica not serving by then fails its actor
FRONT_KINDS = ("coordinator", "gateway")  # started after the model services, stopped before them
RAY_KEYS = {"num_cpus", "num_gpus", "resources", "max_restarts", "memory"}
PR_SET_PDEATHSIG = 1
STOP_MARGIN_S = 10.0  # after the drain grace: the server's own shutdown, before SIGKILL


@dataclass
class RaySpec:
    """A service's `ray:` key: what each replica's actor asks of Ray."""

    num_cpus: float = 1.0  # logical CPUs reserved (also the default torch threads of the process)
    num_gpus: float = 0.0  # GPUs; Ray sets CUDA_VISIBLE_DEVICES, so `device: cuda` is the assigned one
    resources: dict[str, float] = field(default_factory=dict)  # custom resources, e.g. {"edge": 1}
    max_restarts: int = -1  # restarts of a dead replica; -1: always
    memory: int = 0  # bytes reserved; 0: no reservation


@dataclass
class Replica:
    """One service replica to place: its launcher spec (name, kind, flags) and its Ray requests."""

    spec: ServiceSpec
    ray: RaySpec


@dataclass
class RayClusterConfig:
    replicas: list[Replica]
    namespace: str = DEFAULT_NAMESPACE
    log_dir: str = DEFAULT_LOG_DIR  # on each node: <log_dir>/<namespace>/<replica>.log
    local: dict[str, Any] = field(default_factory=dict)  # ray.init(...) keywords of a local cluster (no --address)

    def groups(self) -> dict[str, list[Replica]]:
        groups: dict[str, list[Replica]] = {}
        for replica in self.replicas:
            groups.setdefault(replica.spec.group, []).append(replica)
        return groups


def _ray_spec(path: str | Path, name: str, raw: Any) -> RaySpec:
    raw = dict(raw or {})
    unknown = sorted(set(raw) - RAY_KEYS)
    if unknown:
        raise ValueError(f"{path}: service {name!r}: unknown ray key(s) {', '.join(unknown)}; known: {', '.join(sorted(RAY_KEYS))}")
    spec = RaySpec(**raw)
    spec.resources = {str(k): float(v) for k, v in spec.resources.items()}
    return spec


def load_ray_config(path: str | Path) -> RayClusterConfig:
    """The cluster YAML with its `ray:` keys taken out; the rest is read by `load_cluster_config` (the
    same checks, replicas and model inheritance as `make run-cluster`)."""
    config = yaml.safe_load(Path(path).read_text()) or {}
    top = dict(config.pop("ray", None) or {})
    services = config.get("services") or {}
    rays = {name: _ray_spec(path, name, (entry or {}).pop("ray", None)) for name, entry in services.items()}
    explicit_threads = {name for name, entry in services.items() if "torch_threads" in (entry or {})}
    if "torch_threads" in (config.get("defaults") or {}):
        explicit_threads = set(services)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as plain:
        yaml.safe_dump(config, plain, sort_keys=False)
        plain.flush()
        specs = load_cluster_config(plain.name)
    namespace = str(top.pop("namespace", DEFAULT_NAMESPACE))
    replicas = []
    for spec in specs:
        ray_spec = rays[spec.group]
        if spec.group not in explicit_threads and spec.kind not in FRONT_KINDS:
            spec.torch_threads = max(1, int(ray_spec.num_cpus))  # the process gets the CPUs it reserved
        if spec.kind == "coordinator":
            for kind in ("draft", "verify"):
                if f"{kind}_addresses" not in spec.options and any(s.kind == kind for s in specs):
                    spec.options[f"{kind}_addresses"] = f"ray:{namespace}/{kind}"
        replicas.append(Replica(spec, ray_spec))
    return RayClusterConfig(replicas, namespace, str(top.pop("log_dir", DEFAULT_LOG_DIR)), dict(top.pop("local", None) or {}))


class ServiceRegistry:
    """Ray actor: the replicas that serve, by kind (what `ray:kind` discovery reads)."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[str, str]] = {}  # replica name -> (kind, "host:port")

    def register(self, kind: str, name: str, address: str) -> None:
        self._entries[name] = (kind, address)

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    def addresses(self, kind: str) -> list[str]:
        return sorted(address for k, address in self._entries.values() if k == kind)

    def entries(self) -> dict[str, tuple[str, str]]:
        return dict(self._entries)


def _die_with_parent() -> None:
    """In the service process before exec: SIGKILL it when the actor process that started it dies."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class ServiceReplica:
    """Ray actor: one service process on this node, registered while it serves (module docstring)."""

    def __init__(self, name: str, kind: str, options: dict, torch_threads: int, namespace: str, log_dir: str,
                 register: bool = True):
        import ray

        self.name, self.kind, self.namespace, self.register = name, kind, namespace, register
        self.node_id = ray.get_runtime_context().get_node_id()
        node_ip = ray.util.get_node_ip_address()
        options = dict(options)
        if options.get("host") in (None, "", "0.0.0.0"):
            options.setdefault("host", node_ip)
        self.host = node_ip if options["host"] in ("", "0.0.0.0") else options["host"]
        options.setdefault("port", 0)
        self.log_path = Path(log_dir) / namespace / f"{name}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._stopping = False
        self._ready = threading.Event()
        root = Path(__file__).resolve().parents[1]  # the repository: the service runs `python -m <its package>` from it
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
               "RAY_NAMESPACE": namespace}
        gcs_address = ray.get_runtime_context().gcs_address
        if gcs_address:
            env["RAY_ADDRESS"] = gcs_address  # a coordinator's ray: discovery connects to this cluster
        if torch_threads > 0:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(torch_threads)
        command = [sys.executable, "-m", MODULES[kind], *to_argv(options)]
        # the thread that starts the process must live as long as it (PR_SET_PDEATHSIG follows the thread)
        threading.Thread(target=self._supervise, args=(command, env, str(root)), daemon=True, name=f"{name}-supervisor").start()
        if not self._ready.wait(START_TIMEOUT_S) or self.port is None:
            raise RuntimeError(f"{name} did not start serving within {START_TIMEOUT_S:.0f} s:\n{self.log_tail()}")
        if register:
            ray.get(ray.get_actor(REGISTRY_NAME, namespace=namespace).register.remote(kind, name, self.address()))

    def _supervise(self, command: list[str], env: dict[str, str], cwd: str) -> None:
        with open(self.log_path, "ab") as log_file:
            log_file.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} actor pid {os.getpid()}: {' '.join(command)}\n".encode())
            log_file.flush()
            self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                            preexec_fn=_die_with_parent)
            assert self.process.stdout is not None
            for line in self.process.stdout:  # until the process exits
                log_file.write(line)
                log_file.flush()
                match = LISTENING.search(line)
                if match and self.port is None:
                    self.port = int(match.group(2))
                    self.metrics_port = int(match.group(3)) if match.group(3) else None
                    self._ready.set()
            code = self.process.wait()
            log_file.write(f"--- service process exited with code {code}\n".encode())
        self._ready.set()
        if not self._stopping:  # it died under us: so does the actor, and Ray restarts it
            os._exit(1)

    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "address": self.address(), "node_id": self.node_id,
                "actor_pid": os.getpid(), "service_pid": self.process.pid,
                "metrics_port": self.metrics_port, "log": str(self.log_path)}

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:] if self.log_path.exists() else ""

    def stop(self, grace_s: float) -> int | None:
        """Unregister, SIGTERM the service (it drains for up to its --drain-grace-s), wait `grace_s`
        (plus STOP_MARGIN_S for its shutdown), then SIGKILL. The process's exit code."""
        import ray

        self._stopping = True
        if self.register:
            try:
                ray.get(ray.get_actor(REGISTRY_NAME, namespace=self.namespace).unregister.remote(self.name), timeout=10)
            except Exception as exc:  # noqa: BLE001 - the registry gone first: nothing to unregister from
                log.warning("%s: could not unregister: %s", self.name, exc)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(grace_s + STOP_MARGIN_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


def actor_options(replica: Replica, namespace: str, detached: bool) -> dict[str, Any]:
    """`.options(...)` of a replica's actor: resources, restarts, its name in the namespace."""
    options: dict[str, Any] = dict(name=replica.spec.name, namespace=namespace, num_cpus=replica.ray.num_cpus,
                                   num_gpus=replica.ray.num_gpus, max_restarts=replica.ray.max_restarts, max_concurrency=4)
    if replica.ray.resources:
        options["resources"] = dict(replica.ray.resources)
    if replica.ray.memory:
        options["memory"] = replica.ray.memory
    if detached:
        options["lifetime"] = "detached"
    return options


class RayCluster:
    """The services of a `RayClusterConfig` as actors in a Ray cluster this process is connected to.

        cluster = RayCluster(load_ray_config("configs/ray.yaml")).up()
        cluster.addresses["coordinator"]     # "10.0.0.5:50050"
        cluster.add_replica("verify")        # one more Verify replica; the Coordinator discovers it
        cluster.down()
    `detached`: the actors outlive this process (`specmesh ray up --address ...` returns; `down` later).
    """

    def __init__(self, config: RayClusterConfig, detached: bool = False):
        self.config = config
        self.detached = detached
        self.actors: dict[str, Any] = {}
        self.replicas: dict[str, Replica] = {}
        self._registry: Any = None

    def registry(self) -> Any:
        import ray

        return ray.remote(ServiceRegistry).options(name=REGISTRY_NAME, namespace=self.config.namespace, get_if_exists=True,
                                                   num_cpus=0, max_restarts=-1,
                                                   lifetime="detached" if self.detached else None).remote()

    def up(self, timeout_s: float = START_TIMEOUT_S) -> RayCluster:
        """Place every replica: the model services first (all at once), then coordinators, then gateways
        (a gateway fronts the first coordinator unless the YAML names one). Returns when all serve."""
        import ray

        self._registry = self.registry()  # held: a registry no handle refers to is collected (unless detached)
        ray.get(self._registry.entries.remote(), timeout=timeout_s)
        try:
            for front in (False, True):
                batch = [r for r in self.config.replicas if (r.spec.kind in FRONT_KINDS) == front]
                for replica in sorted(batch, key=lambda r: r.spec.kind == "gateway"):
                    if replica.spec.kind == "gateway" and "coordinator" not in replica.spec.options:
                        coordinators = [n for n, r in self.replicas.items() if r.spec.kind == "coordinator"]
                        if coordinators:
                            replica.spec.options["coordinator"] = self.info(coordinators[0], timeout_s)["address"]
                    self._start(replica)
                    if replica.spec.kind == "coordinator":
                        self.info(replica.spec.name, timeout_s)
                for replica in batch:
                    self.info(replica.spec.name, timeout_s)
        except BaseException:
            self.down(grace_s=1.0)
            raise
        return self

    def _start(self, replica: Replica) -> None:
        import ray

        spec = replica.spec
        actor_cls = ray.remote(ServiceReplica).options(**actor_options(replica, self.config.namespace, self.detached))
        self.actors[spec.name] = actor_cls.remote(spec.name, spec.kind, spec.options, spec.torch_threads, self.config.namespace,
                                                  self.config.log_dir, register=spec.kind not in FRONT_KINDS)
        self.replicas[spec.name] = replica

    def info(self, name: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """The replica's name, kind, address, node id, actor and service process ids, log path (waits
        while it starts or restarts)."""
        import ray

        deadline_s = time.monotonic() + timeout_s
        while True:
            try:
                return ray.get(self.actors[name].info.remote(), timeout=max(0.1, deadline_s - time.monotonic()))
            except ray.exceptions.ActorUnavailableError:  # restarting: Ray answers at once, so ask again
                if time.monotonic() > deadline_s:
                    raise
                time.sleep(0.2)

    @property
    def addresses(self) -> dict[str, str]:
        return {name: self.info(name)["address"] for name in self.actors}

    def add_replica(self, group: str, timeout_s: float = START_TIMEOUT_S) -> str:
        """One more replica of service `group` (named "<group>-<n>"); returns its name once it serves
        and is registered (the Coordinator routes to it after its next discovery read and health check)."""
        template = self.config.groups()[group][0]
        taken = {r.spec.name for r in self.config.replicas}
        index = next(i for i in range(len(taken) + 1) if f"{group}-{i}" not in taken)
        spec = dataclasses.replace(template.spec, name=f"{group}-{index}", options=dict(template.spec.options))
        if int(spec.options.get("port", 0) or 0) > 0:
            spec.options["port"] = 0  # a fixed port may be taken by a sibling on the same node
        replica = Replica(spec, template.ray)
        self.config.replicas.append(replica)
        self._start(replica)
        self.info(spec.name, timeout_s)
        return spec.name

    def remove_replica(self, name: str, grace_s: float = 30.0) -> None:
        """Drain one replica: unregistered (the Coordinator stops routing to it), SIGTERM, its actor killed."""
        import ray

        ray.get(self.actors[name].stop.remote(grace_s), timeout=grace_s + STOP_MARGIN_S + 30)
        ray.kill(self.actors.pop(name), no_restart=True)
        self.config.replicas = [r for r in self.config.replicas if r.spec.name != name]
        self.replicas.pop(name, None)

    def down(self, grace_s: float = 30.0) -> None:
        import ray

        stop_actors(dict(self.actors), {name: self.replicas[name].spec.kind for name in self.actors}, grace_s)
        self.actors.clear()
        if self._registry is not None:
            ray.kill(self._registry, no_restart=True)
            self._registry = None


def stop_actors(actors: dict[str, Any], kinds: dict[str, str], grace_s: float) -> None:
    """Drain and stop: coordinators and gateways first (their streams end within the grace), then the
    model services (each unregisters, then drains its open sessions), then every actor is killed."""
    import ray

    for front in (True, False):
        names = [n for n in actors if (kinds.get(n, "") in FRONT_KINDS) == front]
        stopping = {name: actors[name].stop.remote(grace_s) for name in names}
        for name, ref in stopping.items():
            try:
                ray.get(ref, timeout=grace_s + STOP_MARGIN_S + 30)
            except Exception as exc:  # noqa: BLE001 - a dead or restarting replica: killed below anyway
                log.warning("%s did not stop cleanly: %s", name, exc)
    for actor in actors.values():
        ray.kill(actor, no_restart=True)


def named_actors(namespace: str) -> Iterator[tuple[str, Any]]:
    import ray

    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == namespace:
            yield entry["name"], ray.get_actor(entry["name"], namespace=namespace)


def down(namespace: str = DEFAULT_NAMESPACE, grace_s: float = 30.0) -> list[str]:
    """Stop every specmesh actor of `namespace` in the connected Ray cluster (`specmesh ray down`):
    drain as `stop_actors` does, then the registry. Returns the stopped replicas' names."""
    import ray

    actors = dict(named_actors(namespace))
    registry = actors.pop(REGISTRY_NAME, None)
    registered: dict[str, tuple[str, str]] = {}
    if registry is not None:
        registered = ray.get(registry.entries.remote(), timeout=30)
    kinds: dict[str, str] = {}
    for name, actor in actors.items():
        try:
            kinds[name] = ray.get(actor.info.remote(), timeout=10)["kind"]
        except Exception:  # noqa: BLE001 - dead or still restarting: the registry may know its kind
            kinds[name] = registered.get(name, ("", ""))[0]
    stop_actors(actors, kinds, grace_s)
    if registry is not None:
        ray.kill(registry, no_restart=True)
    return sorted(actors)
