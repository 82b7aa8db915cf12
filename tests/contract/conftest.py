"""The protocol as a client with nothing but the .proto files meets it.

These tests drive live services (real subprocesses on loopback, port 0) through stubs that protoc
generates from `protos/specmesh/v1/*.proto` at test time, as a client in any language would. The
test process imports nothing of this repository (`specmesh`, `servicekit`, the services, `client`):
a session finalizer checks. The tiny model is built and the services are started as subprocesses,
the way a user runs our tools.

Why this suite runs alone: the generated modules are flat (`verify_pb2`, ...) and register the
same message names (`specmesh.v1.*`) as the project's own stubs (`specmesh.proto.v1`), so the two
cannot share one protobuf descriptor pool. `make test` runs `pytest tests/contract` as a pytest
process of its own after the main run (plain `pytest`); mixed into another run, as in that one,
these tests skip themselves.

Services are shared by the whole suite (starting one costs seconds); every test opens its own
sessions. Every RPC carries a deadline (`contract_helpers.DEADLINE_S`).
"""

from __future__ import annotations

import importlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from contract_helpers import AUTH_TOKENS, Wire
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "protos" / "specmesh" / "v1"
HERE = Path(__file__).resolve().parent
PROJECT_MODULES = ("specmesh", "servicekit", "target_service", "draft_service", "stage_service", "client")
STUB_MODULES = ("common_pb2", "verify_pb2", "verify_pb2_grpc", "draft_pb2", "draft_pb2_grpc", "stage_pb2", "stage_pb2_grpc")
START_DEADLINE_S = 120.0  # four services load torch at once on a small shared machine
STOP_GRACE_S = 5.0
LISTENING = re.compile(r"listening on ([\w.\-]+):(\d+)")
SMALL = ["--port", "0", "--dtype", "float32", "--max-kv-tokens", "4096", "--session-ttl-s", "120"]


def pytest_collection_modifyitems(config, items):
    """Mixed into a run with other tests, skip: the descriptor pools would clash (module docstring)."""
    if all(HERE in item.path.parents for item in items):
        return
    skip = pytest.mark.skip(reason="the contract suite runs in a pytest process of its own: pytest tests/contract")
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def no_project_imports():
    """At the end: nothing of this repository was imported by the test process."""
    yield
    leaked = sorted(name for name in sys.modules if name.split(".")[0].startswith(PROJECT_MODULES))
    assert not leaked, f"the contract suite must use only the .proto files, but imported {leaked}"


@pytest.fixture(scope="session")
def pb(tmp_path_factory):
    """Flat stubs generated from the .proto files: pb.common, pb.verify, pb.verify_grpc, pb.draft, ..."""
    out = tmp_path_factory.mktemp("stubs")
    for proto in sorted(PROTO_DIR.glob("*.proto")):
        text = re.sub(r'import "specmesh/v1/(\w+\.proto)";', r'import "\1";', proto.read_text())
        (out / proto.name).write_text(text)
    protos = sorted(p.name for p in out.glob("*.proto"))
    result = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{out}", f"--python_out={out}",
                             f"--grpc_python_out={out}", *protos], cwd=out, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"protoc failed:\n{result.stderr}"
    sys.path.insert(0, str(out))
    modules = {name: importlib.import_module(name) for name in STUB_MODULES}
    return SimpleNamespace(**{name.removesuffix("_pb2").replace("_pb2_grpc", "_grpc"): module
                              for name, module in modules.items()})


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random llama folder, built by the project's tool in a subprocess (peaked logits)."""
    path = tmp_path_factory.mktemp("model") / "tiny-llama"
    code = f"from specmesh.models.tiny import make_tiny_model; print(make_tiny_model('llama', {str(path)!r}, init_std=0.2))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env=_service_env())
    assert result.returncode == 0, f"building the tiny model failed:\n{result.stderr[-4000:]}"
    return path


@dataclass
class ServiceProcess:
    """A service started as `python -m <module>`; `address` once it printed its listening line."""

    name: str
    process: subprocess.Popen
    log_path: Path
    lines: queue.Queue = field(default_factory=queue.Queue)
    address: str = ""
    failure: str = ""  # why it never became ready

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:] if self.log_path.exists() else ""

    def wait_ready(self, deadline_s: float = START_DEADLINE_S) -> str:
        """The service's address once it listens and its health check says SERVING."""
        if not self.address and not self.failure:
            self.failure = self._wait(deadline_s)
        if self.failure:
            pytest.fail(self.failure)
        return self.address

    def _wait(self, deadline_s: float) -> str:
        """The empty string once ready, else the reason it is not."""
        end = time.monotonic() + deadline_s
        while not self.address:
            if time.monotonic() > end:
                return f"{self.name} printed no listening line within {deadline_s:.0f} s:\n{self.log_tail()}"
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.process.poll() is not None and self.lines.empty():
                    return f"{self.name} exited with {self.process.returncode} before listening:\n{self.log_tail()}"
                continue
            match = LISTENING.search(line)
            if match:
                self.address = f"{match[1]}:{match[2]}"
        if not _serving(self.address, end):
            self.address = ""
            return f"{self.name} never reported SERVING:\n{self.log_tail()}"
        return ""

    def stop(self, deadline: float) -> None:
        """SIGTERM (sent by the caller to every service first), then SIGKILL past `deadline`."""
        try:
            self.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(STOP_GRACE_S)


def _service_env() -> dict[str, str]:
    # one intra-op thread: tiny models gain nothing from more, and the services share two cores
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def _launch(name: str, module: str, args: list[str], log_dir: Path) -> ServiceProcess:
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=_service_env(),
                                   stdout=subprocess.PIPE, stderr=log, text=True)
    service = ServiceProcess(name, process, log_path)

    def pump():  # keeps the pipe drained for the service's whole life
        for line in process.stdout:
            service.lines.put(line)

    threading.Thread(target=pump, name=f"{name}-stdout", daemon=True).start()
    return service


def _serving(address: str, end: float) -> bool:
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < end:
            try:
                status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    return False


@pytest.fixture(scope="session")
def services(model_dir, tmp_path_factory):
    """Every service of the suite, all started at once (their start-ups overlap); stopped at the end."""
    log_dir = tmp_path_factory.mktemp("logs")
    tokens = log_dir / "tokens.yaml"
    tokens.write_text("".join(f"{name}: {token}\n" for name, token in AUTH_TOKENS.items()))
    model = ["--model", str(model_dir)]
    started = {}
    try:
        started["verify"] = _launch("verify", "target_service", [*model, *SMALL], log_dir)
        started["draft"] = _launch("draft", "draft_service", [*model, *SMALL, "--drafter", "model"], log_dir)
        started["stage"] = _launch("stage", "stage_service", [*model, *SMALL], log_dir)
        started["verify_auth"] = _launch("verify_auth", "target_service",
                                         [*model, *SMALL, "--auth-token-file", str(tokens)], log_dir)
        yield started
    finally:
        for service in started.values():
            if service.process.poll() is None:
                service.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for service in started.values():
            service.stop(deadline)


@pytest.fixture(scope="session")
def wire(pb, services):
    """Stubs on the Verify (fused n-gram drafter), Draft (model drafter) and Stage services."""
    client = Wire(pb, {name: services[name].wait_ready for name in ("verify", "draft", "stage")})
    yield client
    client.close_channels()


@pytest.fixture(scope="session")
def auth_address(services) -> str:
    """A Verify service with `--auth-token-file` (principals alice and bob, AUTH_TOKENS)."""
    return services["verify_auth"].wait_ready()
