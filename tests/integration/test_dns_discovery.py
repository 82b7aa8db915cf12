"""DNS discovery, live: three Verify processes on 127.0.0.1/2/3 at one port (a headless Service's
pods: one port, many addresses), a Coordinator in this process whose verify address is
`dns:///verify.test:<port>`, and a resolver the test controls answering for `verify.test`.

While three clients stream without pause, the answer changes: a replica is added (it receives
sessions), one that is listed but does not serve never does, and one is removed (drained: no new
session, the sessions open on it finish there). Every stream equals target-only greedy decoding:
no token lost or repeated, and no failover was needed."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from service_helpers import target_only_greedy

import coordinator.discovery
from client.cluster import Cluster, ServiceSpec
from coordinator.options import CoordinatorOptions
from coordinator.server import create_server
from servicekit.channels import open_channel as channel
from specmesh.proto.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
MAX_NEW_TOKENS = 120
NAME = "verify.test"
HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
NOT_SERVING = "127.0.0.4"  # listed in DNS, nothing listens there
PHASE_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return str(tiny_model_dir("llama", init_std=0.2))


@pytest.fixture(scope="module")
def reference(target):
    return target_only_greedy(target, PROMPT, MAX_NEW_TOKENS)


def _port_free_on_every_host() -> int:
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((HOSTS[0], 0))
            port = probe.getsockname()[1]
        try:
            for host in HOSTS[1:]:
                with socket.socket() as other:
                    other.bind((host, port))
        except OSError:
            continue
        return port
    raise RuntimeError("no port free on every loopback address")


@pytest.fixture(scope="module")
def replicas(target, tmp_path_factory):
    port = _port_free_on_every_host()
    specs = [ServiceSpec(f"verify-{i}", "verify", {"model": target, "dtype": "float64", "host": host, "port": port,
                                                   "drain_grace_s": 2}, torch_threads=1)
             for i, host in enumerate(HOSTS)]
    with Cluster(specs, log_dir=tmp_path_factory.mktemp("dns-logs")) as running:
        yield port, running


async def _stream(address: str) -> tuple[list[int], coordinator_pb2.GenerateResponse]:
    request = coordinator_pb2.GenerateRequest(prompt=PROMPT, mode=coordinator_pb2.GENERATION_MODE_SPECULATIVE, drafter="ngram",
                                              sampling=common_pb2.SamplingParams(temperature=0, ignore_eos=True,
                                                                                 max_new_tokens=MAX_NEW_TOKENS))
    async with channel(address) as ch:
        tokens: list[int] = []
        last: coordinator_pb2.GenerateResponse | None = None
        async for response in coordinator_pb2_grpc.CoordinatorServiceStub(ch).Generate(request, timeout=60):
            tokens += response.token_ids
            last = response
        assert last is not None
        return tokens, last


async def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_replicas_added_and_drained_while_streams_run(replicas, target, reference, monkeypatch):
    port, _ = replicas
    a, b, c, dead = (f"{host}:{port}" for host in (*HOSTS, NOT_SERVING))
    answer = {NAME: [HOSTS[0]]}
    monkeypatch.setattr(coordinator.discovery, "resolve_host", lambda name: list(answer[name]))

    async def run() -> None:
        handle, coordinator_port = await create_server(CoordinatorOptions(
            model=target, port=0, verify_addresses=f"dns:///{NAME}:{port}", draft_addresses="", default_drafter="ngram",
            # n-gram drafts made here, a Verify call per round: a stream outlasts a discovery interval, so one
            # is still in flight on a when a leaves the DNS answer (drafted on the Verify service, it may end first)
            ngram_placement="coordinator", router="round_robin", health_interval_s=0.1, discovery_interval_s=0.1))
        pool = handle.servicer.verify
        opened: list[tuple[str, frozenset[str]]] = []  # (replica chosen, the replicas routed to at that moment)
        pick = pool.acquire

        def recording_acquire():
            replica = pick()
            opened.append((replica.id, frozenset(r.id for r in pool.replicas.replicas)))
            return replica

        pool.acquire = recording_acquire
        results: list[tuple[list[int], coordinator_pb2.GenerateResponse]] = []
        stop = asyncio.Event()

        async def client() -> None:
            while not stop.is_set():
                results.append(await _stream(f"127.0.0.1:{coordinator_port}"))

        clients = [asyncio.create_task(client()) for _ in range(3)]
        try:
            await _until(lambda: len(results) >= 3, "streams on the first replica")

            answer[NAME] = [HOSTS[0], HOSTS[1], NOT_SERVING]  # b appears (and a listed address that does not serve)
            await _until(lambda: sum(chosen == b for chosen, _ in opened) >= 3, "sessions on the added replica")

            replica_a = pool.replicas.get(a)
            await _until(lambda: replica_a.num_in_flight > 0, "a session on a")
            answer[NAME] = [HOSTS[1], HOSTS[2], NOT_SERVING]  # a goes, c comes
            await _until(lambda: a not in {r.id for r in pool.replicas.replicas}, "a drained")
            assert replica_a in pool.draining  # its sessions go on
            num_opened_at_drain = len(opened)
            await _until(lambda: replica_a.num_in_flight == 0 and not pool.draining, "a's sessions to end")
            await _until(lambda: sum(chosen == c for chosen, _ in opened[num_opened_at_drain:]) >= 3, "sessions on c")
            assert a not in [chosen for chosen, _ in opened[num_opened_at_drain:]]  # no new session on a drained replica
        finally:
            stop.set()
            outcomes = await asyncio.gather(*clients, return_exceptions=True)
            await handle.stop(0)
        assert not [o for o in outcomes if isinstance(o, BaseException)]

        assert all(chosen in members for chosen, members in opened)
        assert dead not in [chosen for chosen, _ in opened]  # listed but never healthy: never routed to
        assert {chosen for chosen, _ in opened} == {a, b, c}
        assert len(results) >= 9
        for tokens, last in results:
            assert tokens == reference
            assert not last.stats.failovers  # drained, not failed: every session ended where it opened

    asyncio.run(run())
