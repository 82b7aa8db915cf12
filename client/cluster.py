"""`make run-cluster` / specmesh-cluster: start each service of a cluster YAML as its own process.

    python -m client.cluster --config configs/local.yaml

Config format (see configs/local.yaml):
    defaults:            # options every service gets unless it sets its own
      device: cpu
    services:
      draft:             # a name of your choice
        kind: draft      # draft | verify | stage
        model: default
        port: 50051      # 0 = pick a free port
        ...              # any option of that service (python -m draft_service --help)
Programmatic use (tests, the demo):
    with Cluster.from_yaml("configs/local.yaml") as cluster:
        cluster.addresses["verify"]   # "127.0.0.1:50052", health SERVING
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servicekit.channels import open_channel
from servicekit.options import to_argv

MODULES = {"draft": "draft_service", "verify": "target_service", "stage": "stage_service"}
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class ServiceSpec:
    name: str
    kind: str  # draft | verify | stage
    options: dict = field(default_factory=dict)  # flags of that service, e.g. {"model": "default", "port": 50051}

    @property
    def address(self) -> str:
        host = self.options.get("host", "127.0.0.1")
        return f"{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{self.options['port']}"


def load_cluster_config(path: str | Path) -> list[ServiceSpec]:
    config = yaml.safe_load(Path(path).read_text()) or {}
    defaults = config.get("defaults") or {}
    services = config.get("services") or {}
    if not services:
        raise ValueError(f"{path}: no services")
    specs = []
    for name, entry in services.items():
        entry = dict(entry or {})
        kind = entry.pop("kind", name)
        if kind not in MODULES:
            raise ValueError(f"{path}: service {name!r} has unknown kind {kind!r}; choose one of {', '.join(MODULES)}")
        specs.append(ServiceSpec(name, kind, {**defaults, **entry}))
    return specs


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


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
            time.sleep(0.2)


class Cluster:
    """Each service a subprocess (`python -m <module> --flag value ...`), logs in `log_dir`."""

    def __init__(self, specs: list[ServiceSpec], log_dir: str | Path | None = None, python: str = sys.executable):
        self.specs = specs
        self.python = python
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="specmesh-cluster-"))
        self.processes: dict[str, subprocess.Popen] = {}

    @classmethod
    def from_yaml(cls, path: str | Path, **kwargs) -> Cluster:
        return cls(load_cluster_config(path), **kwargs)

    @property
    def addresses(self) -> dict[str, str]:
        return {spec.name: spec.address for spec in self.specs}

    def command(self, spec: ServiceSpec) -> list[str]:
        return [self.python, "-m", MODULES[spec.kind], *to_argv(spec.options)]

    def start(self, timeout_s: float = 600.0) -> Cluster:
        deadline_s = time.monotonic() + timeout_s
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        try:
            for spec in self.specs:
                if not spec.options.get("port"):
                    spec.options["port"] = free_port()
                log = open(self.log_dir / f"{spec.name}.log", "wb")
                self.processes[spec.name] = subprocess.Popen(self.command(spec), stdout=log, stderr=subprocess.STDOUT,
                                                             cwd=ROOT, env=env, start_new_session=True)
                log.close()
            for spec in self.specs:
                wait_serving(spec.address, deadline_s, self.processes[spec.name], spec.options.get("tls_cert", ""))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = 15.0) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline_s = time.monotonic() + timeout_s
        for process in self.processes.values():
            try:
                process.wait(max(0.1, deadline_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()

    def log_tail(self, name: str, num_chars: int = 2000) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-num_chars:] if path.exists() else ""

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="start a specmesh cluster from a YAML config")
    parser.add_argument("--config", default="configs/local.yaml")
    parser.add_argument("--log-dir", default=None, help="where each service's log goes (default: a temp folder)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="how long to wait for every service to be SERVING")
    args = parser.parse_args(argv)
    cluster = Cluster.from_yaml(args.config, log_dir=args.log_dir)
    stop = {"requested": False}

    def request_stop(signum, frame):
        stop["requested"] = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, request_stop)
    try:
        print(f"starting {len(cluster.specs)} service(s) from {args.config}; logs in {cluster.log_dir}", flush=True)
        cluster.start(args.timeout_s)
        for spec in cluster.specs:
            metrics = spec.options.get("metrics_port", -1)
            metrics_text = f", metrics http://{spec.address.rsplit(':', 1)[0]}:{metrics}/metrics" if int(metrics) > 0 else ""
            print(f"  {spec.name:<10} {spec.kind:<7} {spec.options.get('model', 'default')} on {spec.address}{metrics_text}", flush=True)
        print("serving; Ctrl-C to stop", flush=True)
        while True:
            for name, process in cluster.processes.items():
                if process.poll() is not None:
                    print(f"{name} exited with code {process.returncode}:\n{cluster.log_tail(name)}", file=sys.stderr)
                    return 1
            time.sleep(0.5)
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
