"""`make run-cluster` (python -m client.cluster) with a coordinator and two Verify replicas: what it
prints, that the coordinator is wired to every replica, that requests spread over them and equal
target-only greedy decoding, per-process torch threads, and Ctrl-C stopping everything. Also the
cluster config rules (replicas, ports, threads, options per kind) without processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import urllib.request

import pytest
import yaml

from client.cluster import ROOT
from client.cluster_config import default_torch_threads, link_coordinators, load_cluster_config
from client.coordinator_client import CoordinatorClient
from client.launcher_process import LISTENING, LauncherProcess
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.speculative import generate
from specmesh.decoding.verifier import TargetVerifier
from specmesh.models.load import load_engine

PROMPT = "one two three four one two three four one two"


def write_config(path, services: dict, defaults: dict | None = None):
    path.write_text(yaml.safe_dump({"defaults": defaults or {}, "services": services}, sort_keys=False))
    return path


def test_config_replicas_ports_threads_and_options_per_kind(tmp_path):
    config = write_config(tmp_path / "c.yaml", defaults={"device": "cpu", "dtype": "bfloat16", "model": "m"}, services={
        "draft": {"kind": "draft", "port": 50051, "metrics_port": 9151},
        "verify": {"kind": "verify", "port": 50052, "metrics_port": 9152, "replicas": 3, "model": "big",
                   "device": ["cuda:0", "cuda:1", "cuda:2"]},
        "coordinator": {"kind": "coordinator", "port": 50050, "torch_threads": 2},
    })
    specs = load_cluster_config(config, cores=16)
    assert [(s.name, s.options["port"], s.options.get("metrics_port")) for s in specs] == [
        ("draft", 50051, 9151), ("verify-0", 50052, 9152), ("verify-1", 50053, 9153), ("verify-2", 50054, 9154),
        ("coordinator", 50050, None)]
    assert [s.torch_threads for s in specs] == [4, 4, 4, 4, 2]  # 16 cores over 4 model processes
    assert [s.options.get("device") for s in specs] == ["cpu", "cuda:0", "cuda:1", "cuda:2", None]
    coordinator = specs[-1]
    assert "device" not in coordinator.options and "dtype" not in coordinator.options  # defaults it has no option for
    assert coordinator.options["model"] == "big"  # the target's tokenizer
    link_coordinators(specs)
    assert coordinator.options["draft_addresses"] == "127.0.0.1:50051"
    assert coordinator.options["verify_addresses"] == "127.0.0.1:50052,127.0.0.1:50053,127.0.0.1:50054"
    assert default_torch_threads(3, cores=2) == 1


def test_config_keeps_given_addresses_and_names_mistakes(tmp_path):
    specs = load_cluster_config(write_config(tmp_path / "c.yaml", {
        "verify": {"kind": "verify", "port": 7000},
        "coordinator": {"kind": "coordinator", "verify_addresses": "target-host:50052", "model": "tok"}}))
    link_coordinators(specs)
    assert specs[1].options["verify_addresses"] == "target-host:50052" and specs[1].options["model"] == "tok"
    assert "draft_addresses" not in specs[1].options
    with pytest.raises(ValueError, match="'verify' \\(verify\\) has no option\\(s\\) batch_size"):
        load_cluster_config(write_config(tmp_path / "bad.yaml", {"verify": {"kind": "verify", "batch_size": 4}}))
    with pytest.raises(ValueError, match="replicas must be an integer >= 1"):
        load_cluster_config(write_config(tmp_path / "bad2.yaml", {"verify": {"kind": "verify", "replicas": 0}}))
    with pytest.raises(ValueError, match="device lists 1 values for 2 replica"):
        load_cluster_config(write_config(tmp_path / "bad4.yaml", {"verify": {"kind": "verify", "replicas": 2, "device": ["cuda:0"]}}))
    with pytest.raises(ValueError, match="unknown kind 'router'"):
        load_cluster_config(write_config(tmp_path / "bad3.yaml", {"gw": {"kind": "router"}}))


def shipped_configs():
    return sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", shipped_configs(), ids=lambda p: p.name)
def test_shipped_configs_load_with_a_coordinator(path):
    specs = load_cluster_config(path)
    link_coordinators(specs)
    coordinator = next(s for s in specs if s.kind == "coordinator")
    assert coordinator.options["verify_addresses"]
    assert all(s.torch_threads >= 1 for s in specs)


@contextlib.contextmanager
def _run_cluster(target: str, folder):
    """`python -m client.cluster` on a config of two Verify replicas, a coordinator and a gateway:
    (launcher, name -> (kind, address, pid, line)); stopped at exit if still running."""
    config = write_config(folder / "cluster.yaml", defaults={"model": target, "device": "cpu", "dtype": "float64", "port": 0,
                                                             "cpus": "auto"}, services={
        "verify": {"kind": "verify", "replicas": 2, "metrics_port": 0, "fused_drafter": "ngram", "torch_threads": 1},
        "coordinator": {"kind": "coordinator", "default_drafter": "ngram"},
        "gateway": {"kind": "gateway"},
    })
    launcher = LauncherProcess(config, folder)
    try:
        launcher.read_until("serving; Ctrl-C to stop")
        yield launcher, {m[1]: (m[2], m[3], int(m[4]), m[5]) for m in (LISTENING.match(line) for line in launcher.lines) if m}
    finally:
        if launcher.process.poll() is None:  # a failed test: stop the services too, not only the launcher
            launcher.process.send_signal(signal.SIGINT)
            try:
                launcher.process.wait(30)
            except subprocess.TimeoutExpired:
                launcher.process.kill()
                launcher.process.wait()


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return str(tiny_model_dir("llama", init_std=0.2))


@pytest.fixture(scope="module")
def launched(target, tmp_path_factory):
    with _run_cluster(target, tmp_path_factory.mktemp("run-cluster")) as (launcher, services):
        yield launcher, services, target


def test_run_cluster_prints_every_process_and_a_sample_command(launched):
    launcher, services, _ = launched
    assert {name: kind for name, (kind, *_) in services.items()} == {"verify-0": "verify", "verify-1": "verify",
                                                                     "coordinator": "coordinator", "gateway": "gateway"}
    coordinator = services["coordinator"][1]
    assert f"verify [{services['verify-0'][1]},{services['verify-1'][1]}]" in services["coordinator"][3]
    assert all("/metrics" in services[name][3] for name in ("verify-0", "verify-1"))
    text = "".join(launcher.lines)
    assert f'generate "Explain how a rainbow forms." --address {coordinator}' in text


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="reads /proc")
def test_each_process_gets_its_torch_threads(launched):
    _, services, _ = launched
    for name, (_, _, pid, _) in services.items():
        environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        assert b"OMP_NUM_THREADS=1" in environ, name  # verify: torch_threads 1; the coordinator: 1 by default


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux affinity")
def test_cpus_auto_pins_each_model_process_to_its_own_cores(launched):
    _, services, _ = launched
    cores = {name: os.sched_getaffinity(pid) for name, (_, _, pid, _) in services.items()}
    host = os.sched_getaffinity(0)
    if len(host) < 2:
        pytest.skip("one core: model processes share it")
    assert cores["verify-0"] and cores["verify-1"] and not cores["verify-0"] & cores["verify-1"]
    assert cores["coordinator"] == host  # front processes are not pinned
    assert f"on cpus {','.join(map(str, sorted(cores['verify-0'])))}" in services["verify-0"][3]


def test_requests_spread_over_replicas_and_equal_greedy(launched):
    _, services, target = launched

    async def run_all():
        async with CoordinatorClient(services["coordinator"][1]) as client:
            jobs = [client.collect(PROMPT, mode=mode, max_new_tokens=16) for mode in ("fused", "speculative") * 3]
            results = await asyncio.gather(*jobs)
            for _ in range(100):  # the last chunk may arrive before the coordinator releases the replica
                stats = await client.stats()
                if all(r.in_flight == 0 for r in stats.replicas):
                    break
                await asyncio.sleep(0.05)
            return results, stats

    results, stats = asyncio.run(run_all())
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(target).encode(PROMPT, add_special_tokens=False)
    expected = generate(TargetVerifier(load_engine(target, dtype="float64")), None, prompt_ids,
                        SamplingParams(temperature=0, max_new_tokens=16)).token_ids
    assert all(r.token_ids == expected and not r.error_message for r in results)
    assert {r.stats.drafter for r in results} == {"fused", "ngram@verify"}  # no Draft service: n-grams where the Verify service has them
    assert sorted(r.address for r in stats.replicas if r.kind == "verify") == sorted(
        services[name][1] for name in ("verify-0", "verify-1"))
    assert all(r.healthy and r.in_flight == 0 for r in stats.replicas)
    opened = []
    for name in ("verify-0", "verify-1"):
        url = re.search(r"metrics (http://\S+/metrics)", services[name][3])[1]
        page = urllib.request.urlopen(url, timeout=5).read().decode()
        opened.append(sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                          if line.startswith("specmesh_requests_total{") and 'method="OpenSession"' in line))
    assert all(count > 0 for count in opened), opened  # JSQ(2) used both replicas


def test_the_gateway_is_started_linked_to_the_coordinator(launched):
    import json

    launcher, services, target = launched
    address = services["gateway"][1]
    with urllib.request.urlopen(f"http://{address}/health", timeout=10) as response:
        assert response.status == 200
    with urllib.request.urlopen(f"http://{address}/v1/models", timeout=10) as response:
        assert [m["id"] for m in json.load(response)["data"]] == [target]
    assert any(f"http://{address}/v1" in line for line in launcher.lines)


def test_ctrl_c_stops_every_process(target, tmp_path):
    with _run_cluster(target, tmp_path) as (launcher, services):  # a cluster of its own: it stops it
        launcher.process.send_signal(signal.SIGINT)
        assert launcher.process.wait(90) == 0  # the launcher SIGKILLs what has not stopped 15 s after SIGTERM
        assert "stopping" in launcher.rest()
        for _, _, pid, _ in services.values():
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
