"""`make run-cluster` / specmesh-cluster: start each service of a cluster YAML as its own process.

    python -m client.cluster --config configs/local.yaml

The config format is in `client/cluster_config.py` (kinds draft | verify | stage | coordinator,
`replicas`, `torch_threads`). Programmatic use (tests, the demo):
    with Cluster.from_yaml("configs/local.yaml") as cluster:
        cluster.addresses["verify"]   # "127.0.0.1:50052", health SERVING
        cluster.addresses_of("verify")  # every verify replica
All processes start at once; the cluster is up when every one is SERVING and every coordinator
sees all its replicas healthy.

Supervision: the launcher (`main`) restarts a process that exits, as its service's `restart` policy
says (client/supervision.py: on-failure by default, with backoff and a cap), on the same port, its
log appended; the coordinator's health checks re-admit it. A restarted process is told its restart
count and how the last one ended (`SPECMESH_NUM_RESTARTS`, `SPECMESH_LAST_EXIT`), which its GetInfo
reports, so `specmesh health` shows it. Only Ctrl-C / SIGTERM to the launcher stops the cluster.
As a library, `Cluster` restarts nothing unless its caller calls `supervise()` (tests kill on purpose).

Model processes sharing this host's cores (more than one draft / verify / stage process) get
GOMP_SPINCOUNT=20000 unless the environment sets it: libgomp's default lets a process's OpenMP
threads spin for a long while after each forward, on the cores the next process's forward needs.
20000 spins keeps the spinning between the parallel regions of one forward (microseconds apart)
and frees the cores between forwards. Measured with bench/cluster.py's overhead part (2 cores,
Coordinator + Draft + Verify): cluster / in-process 1.105 / 1.114 / 1.090 / 1.131 with the default
against 1.094 / 1.065 / 1.065 / 1.050 with 20000 (target only, n-gram in the coordinator, n-gram
fused, bf16 Draft service), two runs back to back. OMP_WAIT_POLICY=PASSIVE (no spinning) was far
worse: 1.47-1.76.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.cluster_config import MODULES, ServiceSpec, link_coordinators, load_cluster_config
from client.supervision import RestartTracker
from servicekit.channels import open_channel
from servicekit.core_share import CoreBoard
from servicekit.options import to_argv
from servicekit.process import LAST_EXIT_ENV, NUM_RESTARTS_ENV
from specmesh.proto.v1 import coordinator_pb2, coordinator_pb2_grpc

MODEL_KINDS = ("draft", "verify", "stage")  # processes that run forwards
SHARED_CORES_SPINCOUNT = "20000"  # GOMP_SPINCOUNT of model processes sharing the host (module docstring)

__all__ = ["Cluster", "ServiceSpec", "free_port", "free_ports", "load_cluster_config", "wait_serving"]

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_PROMPT = "Explain how a rainbow forms."


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free ports: every socket stays bound until all are picked, since the kernel
    may hand a just-closed port out again (and gRPC servers would then share it, see server_options)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]


def wait_serving(address: str, deadline_s: float, process: subprocess.Popen | None = None, tls_cert: str = "", *,
                 tls_ca: str = "", client_cert: str = "", client_key: str = "") -> None:
    """Poll grpc.health.v1 until SERVING; raise if the process dies or the deadline passes. With
    `tls_cert` the service's own certificate is the trusted root (a self-signed cert works), `tls_ca`
    names another root; an mTLS service (--tls-client-ca) needs `client_cert` / `client_key`."""
    with open_channel(address, tls_ca=tls_ca or tls_cert, client_cert=client_cert, client_key=client_key,
                      aio=False) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"the service for {address} exited with code {process.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline_s:
                raise TimeoutError(f"{address} did not report SERVING in time")
            time.sleep(0.1)


def wait_replicas_healthy(address: str, deadline_s: float, process: subprocess.Popen | None = None,
                          tls_cert: str = "") -> None:
    """Poll a coordinator's GetStats until every replica it knows is healthy (its health checks
    re-admit a replica that came up after it). Returns at once if GetStats needs credentials."""
    with open_channel(address, tls_ca=tls_cert, aio=False) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        while True:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"the coordinator at {address} exited with code {process.returncode}")
            try:
                if all(r.healthy for r in stub.GetStats(coordinator_pb2.GetStatsRequest(), timeout=1.0).replicas):
                    return
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    return
            if time.monotonic() > deadline_s:
                raise TimeoutError(f"the coordinator at {address} did not see all its replicas healthy in time")
            time.sleep(0.1)


SETTLE_WAIT_S = 30.0  # longest start() waits for the model services to time their steps again (ProcessInfo.settling)


def wait_settled(kind: str, address: str, deadline_s: float, tls_cert: str = "") -> bool:
    """Poll a model service's GetInfo until its process no longer says `settling` (its steps timed again
    after start, in the gaps between requests: a request that came meanwhile would share the cores
    with that timing, and be priced by figures from the load). True once settled; False when the
    deadline passed first, or GetInfo failed (credentials this launcher lacks; the cluster serves either way)."""
    from client.health import MODEL_INFO_CALLS

    stub_type, request = MODEL_INFO_CALLS[kind]
    with open_channel(address, tls_ca=tls_cert, aio=False) as channel:
        stub = stub_type(channel)
        while time.monotonic() < deadline_s:
            try:
                if not stub.GetInfo(request(), timeout=2.0).process.settling:
                    return True
            except grpc.RpcError:  # it serves (start() saw it): the call needs what this launcher lacks
                return False
            time.sleep(0.2)
    return False


class Cluster:
    """Each service a subprocess (`python -m <module> --flag value ...`), logs in `log_dir`."""

    def __init__(self, specs: list[ServiceSpec], log_dir: str | Path | None = None, python: str = sys.executable):
        self.specs = specs
        self.python = python
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="specmesh-cluster-"))
        self.processes: dict[str, subprocess.Popen] = {}
        self.trackers = {spec.name: RestartTracker(spec.restart) for spec in specs}
        self._started_s: dict[str, float] = {}  # when each process was (re)started
        self._due_s: dict[str, tuple[float, str]] = {}  # restarts waiting out their backoff: name -> (time, last exit)
        self.down: dict[str, str] = {}  # processes left down, and why

    @classmethod
    def from_yaml(cls, path: str | Path, **kwargs) -> Cluster:
        return cls(load_cluster_config(path), **kwargs)

    @property
    def addresses(self) -> dict[str, str]:
        return {spec.name: spec.address for spec in self.specs}

    def addresses_of(self, kind: str) -> list[str]:
        return [spec.address for spec in self.specs if spec.kind == kind]

    def command(self, spec: ServiceSpec) -> list[str]:
        board = {"core_board": str(self.board_path)} if spec.core_slot >= 0 else {}
        return [self.python, "-m", MODULES[spec.kind], *to_argv({**spec.launch_options, **board, **spec.options})]

    @property
    def board_path(self) -> Path:
        """The core board of the processes that lend or borrow cores (`servicekit.core_share`)."""
        return self.log_dir / "cores.board"

    def environment(self, spec: ServiceSpec) -> dict[str, str]:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        if spec.torch_threads > 0:  # torch sizes its intra-op pool from OMP_NUM_THREADS at start
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(spec.torch_threads)
        num_model_processes = sum(s.kind in MODEL_KINDS for s in self.specs)
        if spec.kind in MODEL_KINDS and num_model_processes > 1 and "GOMP_SPINCOUNT" not in os.environ:
            env["GOMP_SPINCOUNT"] = SHARED_CORES_SPINCOUNT  # module docstring
        return env

    def _launch(self, spec: ServiceSpec, last_exit: str = "") -> None:
        env = self.environment(spec)
        num_restarts = self.trackers[spec.name].num_restarts
        if num_restarts:
            env.update({NUM_RESTARTS_ENV: str(num_restarts), LAST_EXIT_ENV: last_exit})
        with open(self.log_dir / f"{spec.name}.log", "ab" if num_restarts else "wb") as log:
            if num_restarts:
                log.write(f"\n--- restart {num_restarts} after {last_exit}\n".encode())
                log.flush()
            self.processes[spec.name] = subprocess.Popen(self.command(spec), stdout=log, stderr=subprocess.STDOUT,
                                                         cwd=ROOT, env=env, start_new_session=True,
                                                         preexec_fn=_pin(spec.affinity) if spec.affinity else None)
        self._started_s[spec.name] = time.monotonic()

    def supervise(self) -> list[str]:
        """One pass of supervision (the launcher calls it every few hundred ms): note every process
        that exited since the last pass, restart those whose backoff is over. Returns what happened,
        one line per event, for the launcher to log."""
        now_s, events = time.monotonic(), []
        for spec in self.specs:
            name = spec.name
            process = self.processes.get(name)
            if process is None or process.poll() is None or name in self._due_s or name in self.down:
                continue
            uptime_s = now_s - self._started_s.get(name, now_s)
            decision = self.trackers[name].on_exit(process.returncode, now_s, uptime_s)
            if decision.restart:
                self._due_s[name] = (now_s + decision.delay_s, decision.reason)
                events.append(f"{name} exited ({decision.reason}) after {uptime_s:.0f} s; restart "
                              f"{self.trackers[name].num_restarts} in {decision.delay_s:g} s (restart: {spec.restart.mode})")
            else:
                self.down[name] = decision.reason
                events.append(f"{name} exited after {uptime_s:.0f} s and stays down: {decision.reason}")
        for name, (due_s, last_exit) in list(self._due_s.items()):
            if now_s >= due_s:
                del self._due_s[name]
                spec = next(s for s in self.specs if s.name == name)
                self._launch(spec, last_exit)
                events.append(f"{name} restarted, pid {self.processes[name].pid}")
        return events

    @property
    def all_down(self) -> bool:
        """No process runs and none will be restarted: nothing is left to serve."""
        return not self._due_s and all(p.poll() is not None for p in self.processes.values())

    def start(self, timeout_s: float = 600.0) -> Cluster:
        """Start every process at once (a coordinator waits for its Verify replicas itself), wait until
        each is SERVING and each coordinator sees all its replicas healthy, then until the model services
        have timed their steps again (`wait_settled`, at most SETTLE_WAIT_S)."""
        deadline_s = time.monotonic() + timeout_s
        try:
            # ports picked here, all at once so no two are the same, and printed and passed on
            wanted = [(spec, "port") for spec in self.specs if not spec.options.get("port")]
            wanted += [(spec, "metrics_port") for spec in self.specs if int(spec.options.get("metrics_port", -1)) == 0]
            for (spec, key), port in zip(wanted, free_ports(len(wanted)), strict=True):
                spec.options[key] = port
            link_coordinators(self.specs)
            if any(spec.core_slot >= 0 for spec in self.specs):
                self.log_dir.mkdir(parents=True, exist_ok=True)
                CoreBoard.create(str(self.board_path))
            for spec in self.specs:
                self._launch(spec)
            for spec in self.specs:
                try:
                    if spec.kind == "gateway":  # HTTP: its /health answers 200 once its coordinator serves
                        from gateway.health import wait_healthy

                        wait_healthy(spec.address, deadline_s, self.processes[spec.name], tls_ca=spec.options.get("tls_cert", ""))
                    else:
                        wait_serving(spec.address, deadline_s, self.processes[spec.name], spec.options.get("tls_cert", ""))
                except RuntimeError as exc:  # it exited: say which, and how its log ends
                    raise RuntimeError(f"{spec.name}: {exc}; the end of its log ({self.log_dir / spec.name}.log):\n"
                                       f"{self.log_tail(spec.name)}") from None
            for spec in self.specs:
                if spec.kind == "coordinator":
                    wait_replicas_healthy(spec.address, deadline_s, self.processes[spec.name], spec.options.get("tls_cert", ""))
            settle_deadline_s = min(deadline_s, time.monotonic() + SETTLE_WAIT_S)
            for spec in self.specs:
                if spec.kind in MODEL_KINDS:
                    wait_settled(spec.kind, spec.address, settle_deadline_s, spec.options.get("tls_cert", ""))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every process (coordinators first, so they close their downstream sessions), then wait."""
        ordered = sorted(self.processes.items(), key=lambda item: self._kind(item[0]) != "coordinator")
        for _, process in ordered:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline_s = time.monotonic() + timeout_s
        for _, process in ordered:
            try:
                process.wait(max(0.1, deadline_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()
        self._due_s.clear()

    def _kind(self, name: str) -> str:
        return next((s.kind for s in self.specs if s.name == name), "")

    def log_tail(self, name: str, num_chars: int = 2000) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-num_chars:] if path.exists() else ""

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _pin(cpus: tuple[int, ...]):
    """Run in the child before exec: the service, its torch threads included, stays on `cpus`."""
    def pin() -> None:
        os.sched_setaffinity(0, cpus)

    return pin


def cli_command() -> str:
    """How to call the `specmesh` CLI of this interpreter: `.venv/bin/specmesh` when installed there."""
    script = Path(sys.executable).parent / "specmesh"
    if not script.exists():
        return f"{sys.executable} -m client.cli"
    try:
        return str(script.relative_to(Path.cwd()))
    except ValueError:
        return str(script)


def describe(cluster: Cluster) -> list[str]:
    """What `make run-cluster` prints once every service is SERVING: where each listens, and what to run."""
    lines = []
    for spec in cluster.specs:
        detail = spec.options.get("model", "default") if spec.kind != "coordinator" else (
            f"draft [{spec.options.get('draft_addresses', '')}] verify [{spec.options.get('verify_addresses', '')}]")
        metrics = f", metrics {spec.metrics_url}" if spec.metrics_url else ""
        threads = f", {spec.torch_threads} thread(s)" if spec.torch_threads else ""
        threads += f" on cpus {','.join(map(str, spec.cpus))}" if spec.cpus else ""
        threads += f" (+{len(spec.borrow_cpus)} on {','.join(map(str, spec.borrow_cpus))} while lent)" if spec.borrow_cpus else ""
        pid = cluster.processes[spec.name].pid if spec.name in cluster.processes else "-"
        lines.append(f"  {spec.name:<12} {spec.kind:<11} {spec.address:<21} pid {pid:<8} {detail}{threads}{metrics}")
    coordinators = cluster.addresses_of("coordinator")
    cli = cli_command()
    for gateway in cluster.addresses_of("gateway"):
        lines += [f"OpenAI-compatible API: http://{gateway}/v1", f"  curl -N http://{gateway}/v1/chat/completions -H 'content-type: "
                  f"application/json' -d '{{\"model\":\"default\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hi\"}}],"
                  f"\"stream\":true}}'"]
    if coordinators:
        address = "" if coordinators[0] == "127.0.0.1:50050" else f" --address {coordinators[0]}"
        lines += ["try:", f"  {cli} generate \"{SAMPLE_PROMPT}\"{address}", f"  {cli} chat{address}",
                  f"  {cli} stats{address}"]
    else:
        lines += ["try:", f"  {cli} health {' '.join(cluster.addresses.values())}"]
    return lines


def _on_ray(path: str) -> bool:
    try:
        return "ray" in (yaml.safe_load(Path(path).read_text()) or {})
    except (OSError, yaml.YAMLError):
        return False  # from_yaml names the problem


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="start a specmesh cluster from a YAML config")
    parser.add_argument("--config", default="configs/local.yaml")
    parser.add_argument("--log-dir", default=None, help="where each service's log goes (default: a temp folder)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="how long to wait for every service to be SERVING")
    args = parser.parse_args(argv)
    if _on_ray(args.config):  # make run-cluster CONFIG=configs/ray.yaml: the same file, placed by Ray
        from client.cli import main as specmesh

        print(f"{args.config} has a top-level `ray:` key: starting it on Ray (specmesh ray up)", flush=True)
        return specmesh(["ray", "up", args.config, "--timeout-s", str(args.timeout_s)])
    try:
        cluster = Cluster.from_yaml(args.config, log_dir=args.log_dir)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    def request_stop(signum, frame):
        raise KeyboardInterrupt

    # also when started with these signals ignored or blocked (nohup, or a parent process's threads: a
    # launcher spawned by a test process that had started grpc inherited a mask that kept Ctrl-C out)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        print(f"starting {len(cluster.specs)} process(es) from {args.config}; logs in {cluster.log_dir}", flush=True)
        cluster.start(args.timeout_s)
        print("\n".join(describe(cluster)), flush=True)
        print("serving; Ctrl-C to stop", flush=True)
        while True:
            for event in cluster.supervise():
                print(f"[launcher] {event}", flush=True)
            if cluster.all_down:
                print("every process has exited and none is to be restarted; stopping", file=sys.stderr)
                for name in cluster.processes:
                    print(f"--- {name}\n{cluster.log_tail(name)}", file=sys.stderr)
                return 1
            time.sleep(0.2)
    except KeyboardInterrupt:
        print("stopping", flush=True)
        return 0
    except Exception as exc:  # noqa: BLE001 - reported with the logs
        print(f"cluster failed: {exc}", file=sys.stderr)
        for name in cluster.processes:
            print(f"--- {name}\n{cluster.log_tail(name)}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
