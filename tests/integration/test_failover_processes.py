"""Failover against live processes started the way `make run-cluster` starts them (client.cluster):
SIGKILL the Draft process mid-stream (it drafts ahead), then one of two Verify replicas mid-stream; every stream
completes with exactly the target-only greedy tokens, none repeated or lost, and the stats say what
failed over. With no Verify replica left, a request gets UNAVAILABLE within its deadline."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest
import yaml
from service_helpers import target_only_greedy

from client.cluster import Cluster
from servicekit.channels import open_channel as channel
from specmesh.proto.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
MAX_NEW_TOKENS = 80
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return str(tiny_model_dir("llama", init_std=0.2))


@pytest.fixture(scope="module")
def reference(target):
    return target_only_greedy(target, PROMPT, MAX_NEW_TOKENS)


@pytest.fixture
def cluster(target, tmp_path):
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({"defaults": {"model": target, "dtype": "float64", "port": 0}, "services": {
        "draft": {"kind": "draft", "drafter": "model", "torch_threads": 1, "draft_ahead": True},  # killed mid-draft-ahead
        "verify": {"kind": "verify", "replicas": 2, "torch_threads": 1},
        "coordinator": {"kind": "coordinator", "health_interval_s": 0.2},
    }}))
    with Cluster.from_yaml(config, log_dir=tmp_path) as running:
        yield running


def _kill(cluster: Cluster, name: str) -> None:
    os.kill(cluster.processes[name].pid, signal.SIGKILL)
    cluster.processes[name].wait(10)


async def _stream(cluster: Cluster, kill_after: int = 0, kill=None) -> tuple[list[int], coordinator_pb2.GenerateResponse]:
    request = coordinator_pb2.GenerateRequest(prompt=PROMPT, mode=coordinator_pb2.GENERATION_MODE_SPECULATIVE, drafter="service",
                                              num_draft_tokens=2, sampling=common_pb2.SamplingParams(
                                                  temperature=0, ignore_eos=True, max_new_tokens=MAX_NEW_TOKENS))
    async with channel(cluster.addresses["coordinator"]) as ch:
        tokens, last = [], None
        async for response in coordinator_pb2_grpc.CoordinatorServiceStub(ch).Generate(request, timeout=TIMEOUT_S):
            tokens += response.token_ids
            last = response
            if kill is not None and len(tokens) >= kill_after:
                kill()
                kill = None
        return tokens, last


def _busy_verify(cluster: Cluster) -> str:
    """The Verify replica holding the stream's session (its /proc shows nothing useful: ask each for
    its open sessions through GetInfo's KV usage)."""
    from specmesh.proto.v1 import verify_pb2, verify_pb2_grpc

    def used(address: str) -> int:
        with grpc.insecure_channel(address) as ch:
            kv = verify_pb2_grpc.VerifyServiceStub(ch).GetInfo(verify_pb2.VerifyGetInfoRequest(), timeout=5).kv
            return kv.total_blocks - kv.free_blocks

    return max(("verify-0", "verify-1"), key=lambda name: used(cluster.addresses[name]))


def test_killed_draft_and_verify_processes_lose_no_token(cluster, reference):
    tokens, last = asyncio.run(_stream(cluster, 10, lambda: _kill(cluster, "draft")))
    assert tokens == reference
    assert last.stats.drafter == "ngram" and [f.split()[0] for f in last.stats.failovers] == ["draft"]

    killed: list[str] = []

    def kill_busy_verify() -> None:
        killed.append(_busy_verify(cluster))
        _kill(cluster, killed[0])

    tokens, last = asyncio.run(_stream(cluster, 10, kill_busy_verify))
    assert tokens == reference  # no token repeated or lost across the move
    assert "verify" in " ".join(last.stats.failovers)

    _kill(cluster, next(name for name in ("verify-0", "verify-1") if name not in killed))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(asyncio.wait_for(_stream(cluster), 30))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
