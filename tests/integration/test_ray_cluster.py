"""The cluster on Ray, live: a local three-raylet Ray cluster (`ray.cluster_utils.Cluster`: a head,
an "edge" node and a "target" node, each advertising its own custom resource), tiny models.

- placement: the draft replica runs on the edge node, the verify replicas on the target node, as
  the YAML's `ray:` resources ask;
- greedy generation through the Coordinator (which finds its replicas through the Ray registry)
  equals target-only decoding;
- SIGKILL the draft actor's process mid-stream: the stream completes exact (n-gram failover), Ray
  restarts the draft (a new process, a new port) and the Coordinator drafts with it again;
- a verify replica added at run time receives sessions (its own OpenSession counter moves).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
import urllib.request

import pytest
import yaml

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster as RayTestCluster  # noqa: E402
from service_helpers import target_only_greedy  # noqa: E402

from client.ray_cluster import RayCluster, load_ray_config  # noqa: E402
from servicekit.channels import open_channel as channel  # noqa: E402
from specmesh.proto.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
MAX_NEW_TOKENS = 60
NAMESPACE = "specmesh-test"
OBJECT_STORE_BYTES = 80 * 1024 * 1024


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return str(tiny_model_dir("llama", init_std=0.2))


@pytest.fixture(scope="module")
def reference(target):
    return target_only_greedy(target, PROMPT, MAX_NEW_TOKENS)


def _start_raylets(attempts: int = 3):
    """Head, edge and target raylets. Ray gives a raylet a fixed 30 s to register with its GCS; on a
    loaded 2-core machine that start-up (not our code) can miss it (a fresh-clone run missed it twice
    in a row), so a failed start is retried on fresh processes and ports, up to `attempts` in all."""
    for attempt in range(attempts):
        nodes = RayTestCluster()
        try:
            nodes.add_node(num_cpus=2, resources={"head": 1}, object_store_memory=OBJECT_STORE_BYTES)
            edge = nodes.add_node(num_cpus=2, resources={"edge": 1}, object_store_memory=OBJECT_STORE_BYTES)
            target_node = nodes.add_node(num_cpus=4, resources={"target": 4}, object_store_memory=OBJECT_STORE_BYTES)
            return nodes, edge, target_node
        except Exception:
            nodes.shutdown()
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def ray_nodes():
    """Three raylets on this machine; logical CPUs only (the real load is the service processes)."""
    nodes, edge, target_node = _start_raylets()
    ray.init(address=nodes.address, namespace=NAMESPACE, log_to_driver=False)
    try:
        yield {"edge": edge.node_id, "target": target_node.node_id}
    finally:
        ray.shutdown()
        nodes.shutdown()


@pytest.fixture(scope="module")
def cluster(ray_nodes, target, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ray")
    config = folder / "ray.yaml"
    config.write_text(yaml.safe_dump({
        "ray": {"namespace": NAMESPACE, "log_dir": str(folder / "logs")},
        "defaults": {"model": target, "dtype": "float64", "port": 0, "drain_grace_s": 2},
        "services": {
            "draft": {"kind": "draft", "drafter": "model", "torch_threads": 1, "metrics_port": 0,
                      "ray": {"num_cpus": 0.5, "resources": {"edge": 1}, "max_restarts": -1}},
            "verify": {"kind": "verify", "replicas": 2, "torch_threads": 1, "metrics_port": 0,
                       "ray": {"num_cpus": 0.5, "resources": {"target": 1}, "max_restarts": 2}},
            "coordinator": {"kind": "coordinator", "router": "round_robin", "health_interval_s": 0.2,
                            "discovery_interval_s": 0.2, "ray": {"num_cpus": 0.5, "resources": {"head": 1}}},
        }}, sort_keys=False))
    running = RayCluster(load_ray_config(config)).up(timeout_s=120)
    try:
        yield running
    finally:
        running.down(grace_s=2.0)


async def _stream(address: str, kill_after: int = 0, kill=None) -> tuple[list[int], coordinator_pb2.GenerateResponse]:
    request = coordinator_pb2.GenerateRequest(prompt=PROMPT, mode=coordinator_pb2.GENERATION_MODE_SPECULATIVE, drafter="service",
                                              num_draft_tokens=2, sampling=common_pb2.SamplingParams(
                                                  temperature=0, ignore_eos=True, max_new_tokens=MAX_NEW_TOKENS))
    async with channel(address) as ch:
        tokens: list[int] = []
        last: coordinator_pb2.GenerateResponse | None = None
        async for response in coordinator_pb2_grpc.CoordinatorServiceStub(ch).Generate(request, timeout=60):
            tokens += response.token_ids
            last = response
            if kill is not None and len(tokens) >= kill_after:
                kill()
                kill = None
        assert last is not None
        return tokens, last


def _sessions_opened(info: dict) -> int:
    """OpenSession calls a replica answered OK, from its own Prometheus counter."""
    host = info["address"].rsplit(":", 1)[0]
    text = urllib.request.urlopen(f"http://{host}:{info['metrics_port']}/metrics", timeout=5).read().decode()
    return sum(int(float(m.group(2))) for m in re.finditer(r'^specmesh_requests_total\{([^}]*)\} (\S+)$', text, re.MULTILINE)
               if 'method="OpenSession"' in m.group(1) and 'code="OK"' in m.group(1))


def test_ray_cluster_places_restarts_and_scales(cluster, ray_nodes, reference):
    coordinator = cluster.info("coordinator")["address"]
    draft = cluster.info("draft")
    assert draft["node_id"] == ray_nodes["edge"]
    assert {cluster.info(f"verify-{i}")["node_id"] for i in range(2)} == {ray_nodes["target"]}

    tokens, last = asyncio.run(_stream(coordinator))
    assert tokens == reference
    assert last.stats.drafter == "draft-service" and not last.stats.failovers

    # the draft actor's process dies mid-stream: the stream stays exact, Ray restarts the draft
    tokens, last = asyncio.run(_stream(coordinator, 10, lambda: os.kill(draft["actor_pid"], signal.SIGKILL)))
    assert tokens == reference
    assert last.stats.drafter == "ngram" and [f.split()[0] for f in last.stats.failovers] == ["draft"]
    restarted = cluster.info("draft", timeout_s=90)
    assert restarted["actor_pid"] != draft["actor_pid"] and restarted["node_id"] == ray_nodes["edge"]
    deadline = time.monotonic() + 30
    while True:  # the Coordinator reads the new registration, health-checks it, drafts with it again
        tokens, last = asyncio.run(_stream(coordinator))
        assert tokens == reference
        if last.stats.drafter == "draft-service" and not last.stats.failovers:
            break
        assert time.monotonic() < deadline, f"the restarted draft was not picked up: {list(last.stats.failovers)}"
        time.sleep(0.3)

    # a verify replica added at run time receives sessions
    added = cluster.info(cluster.add_replica("verify", timeout_s=90))
    assert added["node_id"] == ray_nodes["target"]
    before = _sessions_opened(added)
    deadline = time.monotonic() + 30
    while _sessions_opened(added) == before:
        assert time.monotonic() < deadline, "the added verify replica received no session"

        async def three_at_once() -> list[list[int]]:
            return [tokens for tokens, _ in await asyncio.gather(*(_stream(coordinator) for _ in range(3)))]

        assert all(tokens == reference for tokens in asyncio.run(three_at_once()))
