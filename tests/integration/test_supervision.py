"""A cluster started the documented way (`python -m client.cluster`, what `make run-cluster` runs)
stays up when one of its processes dies: SIGKILL the Draft mid-stream, then the Verify replica that
holds a stream; every stream in flight completes with the target-only greedy tokens, the next
requests succeed, the launcher restarts the killed process within 30 s and the coordinator re-admits
it; `specmesh health` and `stats` show the restart. A replica drained with SIGTERM (exit 0) stays
down under `restart: on-failure` while the rest keeps serving. Also the restart policy on its own."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time

import grpc
import pytest
import yaml
from service_helpers import target_only_greedy, wait_for

from client.cluster_config import load_cluster_config
from client.coordinator_client import CoordinatorClient
from client.health import Target, probe
from client.launcher_process import LauncherProcess
from client.supervision import RestartPolicy
from specmesh.proto.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, verify_pb2, verify_pb2_grpc

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
MAX_NEW_TOKENS = 80
BACK_WITHIN_S = 30.0


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return str(tiny_model_dir("llama", init_std=0.2))


@pytest.fixture(scope="module")
def reference(target):
    return target_only_greedy(target, PROMPT, MAX_NEW_TOKENS)


@contextlib.contextmanager
def _supervised(target: str, folder):
    """`python -m client.cluster`: a Draft, two Verify replicas and a coordinator, restart on-failure."""
    config = folder / "cluster.yaml"
    config.write_text(yaml.safe_dump({"defaults": {"model": target, "dtype": "float64", "port": 0}, "services": {
        "draft": {"kind": "draft", "drafter": "model", "torch_threads": 1},
        "verify": {"kind": "verify", "replicas": 2, "torch_threads": 1},
        "coordinator": {"kind": "coordinator", "health_interval_s": 0.2},
    }}))
    launcher = LauncherProcess(config, folder)
    try:
        launcher.read_until("serving; Ctrl-C to stop")
        yield launcher
    finally:
        if launcher.process.poll() is None:
            launcher.process.send_signal(signal.SIGINT)
            try:
                launcher.process.wait(30)
            except subprocess.TimeoutExpired:
                launcher.process.kill()
                launcher.process.wait()


@pytest.fixture(scope="module")
def launched(target, tmp_path_factory):
    with _supervised(target, tmp_path_factory.mktemp("supervised")) as launcher:
        yield launcher


def _services(launcher: LauncherProcess) -> dict[str, tuple[str, int]]:
    """name -> (address, current pid)."""
    return {name: (s.address, s.pid) for name, s in launcher.services().items()}


async def _stream(coordinator: str, kill_after: int = 0, kill=None, *, mode: int = coordinator_pb2.GENERATION_MODE_SPECULATIVE,
                  **sampling) -> tuple[list[int], coordinator_pb2.GenerateResponse]:
    speculative = mode == coordinator_pb2.GENERATION_MODE_SPECULATIVE  # k fixed: every round drafts with the Draft service
    request = coordinator_pb2.GenerateRequest(prompt=PROMPT, mode=mode, drafter="service" if speculative else "",
                                              num_draft_tokens=4 if speculative else 0,
                                              sampling=common_pb2.SamplingParams(**{
                                                  "temperature": 0, "ignore_eos": True, "max_new_tokens": MAX_NEW_TOKENS, **sampling}))
    async with grpc.aio.insecure_channel(coordinator) as channel:
        tokens, last = [], None
        async for response in coordinator_pb2_grpc.CoordinatorServiceStub(channel).Generate(request, timeout=60):
            tokens += response.token_ids
            last = response
            if kill is not None and len(tokens) >= kill_after:
                kill()
                kill = None
        return tokens, last


def _busy_verify(services: dict[str, tuple[str, int]]) -> str:
    def used(address: str) -> int:
        with grpc.insecure_channel(address) as channel:
            kv = verify_pb2_grpc.VerifyServiceStub(channel).GetInfo(verify_pb2.VerifyGetInfoRequest(), timeout=5).kv
            return kv.total_blocks - kv.free_blocks

    return max(("verify-0", "verify-1"), key=lambda name: used(services[name][0]))


def _restarted(launcher: LauncherProcess, name: str) -> int:
    """Wait for the launcher's line saying `name` is back; its new pid."""
    launcher.read_until(f"[launcher] {name} restarted", timeout_s=BACK_WITHIN_S)
    return launcher.services()[name].pid


def _back_in_the_coordinator(coordinator: str, address: str, timeout_s: float) -> bool:
    """Wait until the coordinator has re-admitted the replica at `address` after it was out."""
    async def back() -> bool:
        async with CoordinatorClient(coordinator) as client:
            stats = await client.stats()
        return any(r.address == address and r.healthy and r.num_readmissions >= 1 for r in stats.replicas)

    return wait_for(lambda: asyncio.run(back()), timeout_s)


def _all_healthy(coordinator: str, timeout_s: float) -> bool:
    """Wait until the coordinator counts every Verify replica healthy."""
    async def healthy() -> bool:
        async with CoordinatorClient(coordinator) as client:
            stats = await client.stats()
        return bool(stats.replicas) and all(r.healthy for r in stats.replicas)

    return wait_for(lambda: asyncio.run(healthy()), timeout_s)


def _kill_and_check_back(launcher: LauncherProcess, reference: list[int], choose_victim) -> tuple[str, list[str]]:
    services = _services(launcher)
    coordinator = services["coordinator"][0]
    victim: list[str] = []

    def kill() -> None:
        victim.append(choose_victim(services))
        os.kill(services[victim[0]][1], signal.SIGKILL)

    tokens, last = asyncio.run(_stream(coordinator, 10, kill))
    killed_s = time.monotonic()
    assert tokens == reference  # the stream in flight completes exactly: nothing lost or repeated
    assert victim[0].split("-")[0] in " ".join(last.stats.failovers)
    pid = _restarted(launcher, victim[0])
    assert pid != services[victim[0]][1]
    address = services[victim[0]][0]

    assert _back_in_the_coordinator(coordinator, address, BACK_WITHIN_S - (time.monotonic() - killed_s))
    report = asyncio.run(probe(Target(address)))
    assert report.ok and "killed by SIGKILL" in str(report.details.get("restarts")), report.line()
    for _ in range(2):  # the next requests succeed, exactly
        assert asyncio.run(_stream(coordinator))[0] == reference
    return victim[0], launcher.lines


def test_a_killed_draft_comes_back_and_nothing_is_lost(launched, reference):
    name, lines = _kill_and_check_back(launched, reference, lambda services: "draft")
    assert any("[launcher] draft exited (killed by SIGKILL)" in line for line in lines)


def test_a_killed_verify_replica_comes_back_and_nothing_is_lost(launched, reference):
    name, _ = _kill_and_check_back(launched, reference, _busy_verify)
    assert name.startswith("verify-")


def test_a_seeded_stream_keeps_its_tokens_when_its_replica_is_killed(launched):
    """Seeded sampling (the coupled rule, the default with a seed): the speculative stream whose Verify
    replica is SIGKILLed mid-stream gives the tokens of autoregressive decoding with that seed."""
    coordinator = _services(launched)["coordinator"][0]
    seeded = {"temperature": 0.9, "seed": 1234}
    expected, _ = asyncio.run(_stream(coordinator, mode=coordinator_pb2.GENERATION_MODE_AUTOREGRESSIVE, **seeded))
    victim: list[str] = []

    def kill() -> None:
        services = _services(launched)
        victim.append(_busy_verify(services))
        os.kill(services[victim[0]][1], signal.SIGKILL)

    tokens, last = asyncio.run(_stream(coordinator, 10, kill, **seeded))
    assert "verify" in " ".join(last.stats.failovers)
    assert tokens == expected
    _restarted(launched, victim[0])
    assert _back_in_the_coordinator(coordinator, _services(launched)[victim[0]][0], BACK_WITHIN_S)


def test_a_drained_replica_stays_down_and_the_rest_serves(target, reference, tmp_path):
    with _supervised(target, tmp_path) as launched:  # a cluster of its own: the drained replica stays down
        _drain_one(launched, reference)


def _drain_one(launched: LauncherProcess, reference: list[int]) -> None:
    services = _services(launched)
    coordinator = services["coordinator"][0]
    assert _all_healthy(coordinator, BACK_WITHIN_S), "a replica is not healthy before the drain"
    try:
        os.kill(services["verify-1"][1], signal.SIGTERM)  # a drain: the process finishes and exits 0
    except ProcessLookupError:
        time.sleep(2)  # what the launcher prints about it, for the report
        launched.poll_lines()
        raise AssertionError(f"verify-1 (pid {services['verify-1'][1]}) is not running:\n"
                             + "".join(launched.lines) + launched.log_tails()) from None
    launched.read_until("[launcher] verify-1 exited", timeout_s=30)
    assert "stays down: exit code 0; restart on-failure" in launched.lines[-1]
    assert asyncio.run(_stream(coordinator))[0] == reference
    assert launched.process.poll() is None  # the launcher serves on


def test_restart_policy_from_the_yaml(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"defaults": {"restart": "always", "max_restarts": 2}, "services": {
        "verify": {"kind": "verify", "replicas": 2, "restart_window_s": 10},
        "draft": {"kind": "draft", "restart": "never"}}}))
    specs = {s.name: s for s in load_cluster_config(config)}
    assert specs["verify-1"].restart == RestartPolicy("always", max_restarts=2, window_s=10)
    assert specs["draft"].restart == RestartPolicy("never", max_restarts=2)
    assert "restart" not in specs["draft"].options  # the launcher's key, never a service flag
    config.write_text(yaml.safe_dump({"services": {"verify": {"kind": "verify", "restart": "sometimes"}}}))
    with pytest.raises(ValueError, match="'verify': restart must be one of on-failure, always, never"):
        load_cluster_config(config)
