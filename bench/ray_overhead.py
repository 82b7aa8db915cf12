"""Ray's overhead: the same cluster config under `specmesh ray up` (a local Ray node, every replica an
actor running the service process, the Coordinator discovering replicas through the Ray registry)
and under `make run-cluster` (client/cluster.py, plain processes, a static replica list).

1. Aggregate tokens/s at 1, 4 and 16 concurrent clients (greedy, speculative with the Draft
   service): each client asks REQUESTS_PER_CLIENT prompts one after the other; total generated
   tokens / wall time. The launchers run one after the other on the same machine, never together.
2. Restore time: SIGKILL the draft actor's process, then generate short requests until one drafts
   with the Draft service again (Ray restarted the actor, the service loaded its model, registered,
   the Coordinator read the registry and health-checked it): seconds from the kill.

    .venv/bin/python bench/ray_overhead.py       # writes bench/results/ray.{json,md}
    SPECMESH_BENCH_MODEL=/path/to/model SPECMESH_BENCH_CLIENTS=1,4 SPECMESH_BENCH_OUT=/tmp/out .venv/bin/python bench/ray_overhead.py
Needs the `ray` extra. CPU heavy: the model services get the machine's cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from client.cluster import Cluster  # noqa: E402
from client.ray_cluster import RayCluster, load_ray_config  # noqa: E402
from servicekit.channels import open_channel as channel  # noqa: E402
from specmesh.proto.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc  # noqa: E402

MODEL = os.environ.get("SPECMESH_BENCH_MODEL", "default")
CLIENTS = [int(n) for n in os.environ.get("SPECMESH_BENCH_CLIENTS", "1,4,16").split(",")]
REQUESTS_PER_CLIENT = int(os.environ.get("SPECMESH_BENCH_REQUESTS", "4"))
MAX_NEW_TOKENS = int(os.environ.get("SPECMESH_BENCH_TOKENS", "64"))
NAMESPACE = "specmesh-bench"
PROMPTS = ["Explain how a rainbow forms.", "List three uses of copper.", "Why is the sky blue?",
           "Describe a good breakfast.", "What does a compiler do?", "Name the planets in order."]
RESULTS = Path(os.environ.get("SPECMESH_BENCH_OUT", ROOT / "bench" / "results"))


def config(folder: Path) -> dict:
    threads = max(1, (os.cpu_count() or 2) // 2)
    return {
        "ray": {"namespace": NAMESPACE, "log_dir": str(folder / "ray-logs"),
                "local": {"num_cpus": 2 * threads + 1, "resources": {"edge": 1, "target": 1}}},
        "defaults": {"model": MODEL, "dtype": "float32", "port": 0},
        "services": {
            "draft": {"kind": "draft", "drafter": "model", "dtype": "bfloat16", "torch_threads": threads,
                      "ray": {"num_cpus": threads, "resources": {"edge": 1}, "max_restarts": -1}},
            "verify": {"kind": "verify", "torch_threads": threads,
                       "ray": {"num_cpus": threads, "resources": {"target": 1}, "max_restarts": -1}},
            "coordinator": {"kind": "coordinator", "health_interval_s": 0.5, "discovery_interval_s": 0.5,
                            "ray": {"num_cpus": 1}},
        }}


def plain_config(raw: dict) -> dict:
    """The same config without its `ray:` keys (what client/cluster.py reads)."""
    plain = {key: value for key, value in raw.items() if key != "ray"}
    plain["services"] = {name: {k: v for k, v in entry.items() if k != "ray"} for name, entry in raw["services"].items()}
    return plain


async def one_request(address: str, prompt: str, max_new_tokens: int) -> coordinator_pb2.GenerateResponse:
    request = coordinator_pb2.GenerateRequest(prompt=prompt, mode=coordinator_pb2.GENERATION_MODE_SPECULATIVE, drafter="service",
                                              sampling=common_pb2.SamplingParams(temperature=0, ignore_eos=True,
                                                                                 max_new_tokens=max_new_tokens))
    async with channel(address) as ch:
        last = coordinator_pb2.GenerateResponse()
        async for response in coordinator_pb2_grpc.CoordinatorServiceStub(ch).Generate(request, timeout=600):
            last = response
        return last


async def aggregate(address: str, num_clients: int) -> dict:
    async def client(index: int) -> int:
        tokens = 0
        for i in range(REQUESTS_PER_CLIENT):
            last = await one_request(address, PROMPTS[(index + i) % len(PROMPTS)], MAX_NEW_TOKENS)
            tokens += last.stats.num_generated_tokens
        return tokens

    await one_request(address, PROMPTS[0], 8)  # warm
    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(client(i) for i in range(num_clients))))
    wall_s = time.perf_counter() - start
    return {"clients": num_clients, "tokens": tokens, "wall_s": round(wall_s, 3), "tokens_per_s": round(tokens / wall_s, 2)}


def restore_time(cluster: RayCluster, address: str) -> dict:
    """Seconds from SIGKILL of the draft actor's process to the first request drafted by the Draft service again."""
    before = cluster.info("draft")
    killed_s = time.monotonic()
    os.kill(before["actor_pid"], signal.SIGKILL)
    after = cluster.info("draft", timeout_s=600)
    restarted_s = time.monotonic() - killed_s
    while True:
        last = asyncio.run(one_request(address, PROMPTS[1], 8))
        if last.stats.drafter == "draft-service" and not last.stats.failovers:
            break
        time.sleep(0.05)
    return {"actor_restarted_s": round(restarted_s, 2), "speculation_restored_s": round(time.monotonic() - killed_s, 2),
            "old_actor_pid": before["actor_pid"], "new_actor_pid": after["actor_pid"]}


def render(out: dict) -> str:
    lines = ["# Ray vs the plain launcher", "", f"Model `{out['model']}`, {out['max_new_tokens']} new tokens per request, "
             f"{out['requests_per_client']} requests per client, greedy, speculative (Draft service). {out['machine']}.", "",
             "| clients | plain tok/s | Ray tok/s | Ray overhead |", "|---:|---:|---:|---:|"]
    for plain, on_ray in zip(out["plain"], out["ray"]):
        overhead = 1 - on_ray["tokens_per_s"] / plain["tokens_per_s"]
        lines.append(f"| {plain['clients']} | {plain['tokens_per_s']:.1f} | {on_ray['tokens_per_s']:.1f} | {overhead:+.1%} |")
    restore = out["restore"]
    lines += ["", f"Killed draft actor: Ray restarted it in {restore['actor_restarted_s']} s; speculation with the Draft "
              f"service restored {restore['speculation_restored_s']} s after the kill (model load, registration, "
              "discovery read and health check included).", ""]
    return "\n".join(lines)


def main() -> int:
    import ray

    folder = Path(tempfile.mkdtemp(prefix="specmesh-bench-ray-"))
    raw = config(folder)
    (folder / "ray.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    (folder / "plain.yaml").write_text(yaml.safe_dump(plain_config(raw), sort_keys=False))
    out: dict = {"model": MODEL, "max_new_tokens": MAX_NEW_TOKENS, "requests_per_client": REQUESTS_PER_CLIENT,
                 "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores", "plain": [], "ray": []}

    (folder / "plain-logs").mkdir()
    with Cluster.from_yaml(folder / "plain.yaml", log_dir=folder / "plain-logs") as plain:
        address = plain.addresses["coordinator"]
        for n in CLIENTS:
            out["plain"].append(asyncio.run(aggregate(address, n)))
            print("plain", out["plain"][-1], flush=True)

    ray_config = load_ray_config(folder / "ray.yaml")
    ray.init(namespace=NAMESPACE, log_to_driver=False, **ray_config.local)
    cluster = RayCluster(ray_config).up()
    try:
        address = cluster.info("coordinator")["address"]
        for n in CLIENTS:
            out["ray"].append(asyncio.run(aggregate(address, n)))
            print("ray", out["ray"][-1], flush=True)
        out["restore"] = restore_time(cluster, address)
        print("restore", out["restore"], flush=True)
    finally:
        cluster.down(grace_s=5.0)
        ray.shutdown()

    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "ray.json").write_text(json.dumps(out, indent=2))
    (RESULTS / "ray.md").write_text(render(out))
    print(render(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
