"""The simulator against the live local cluster: aggregate tokens/s, p50 / p95 latency and TTFT.

    .venv/bin/python bench/sim_validate.py [--concurrency 1 4 16] [--requests-per-client 4] [--max-new-tokens 64] [--k 4]
                                           [--threads 1] [--cores N] [--quick]
    .venv/bin/python bench/sim_validate.py --resimulate bench/results/sim_validate.json   # the sim side again, no live run

1. Profile the default model in this process under the services' thread setting (`--threads`, each
   model process pinned to that many torch threads): the target in float32, the drafter in bfloat16
   (the Draft service's self-draft), on a grid covering the batches and prompts the run will see.
   With 1 thread the tables hold each forward's thread CPU time (`profile_engine(clock=
   "thread_cpu")`): its time on a core of its own, however loaded the machine is (it is shared).
2. Start the cluster (Draft with the bf16 self-draft, Verify fp32, Coordinator; loopback, as
   `make run-cluster` does; Prometheus metrics on) and, per concurrency level c, run c closed-loop
   clients of `--requests-per-client` requests each through `specmesh bench`'s `run_level`
   (speculative mode, the Draft service, fixed k, greedy). Measured per request: latency, TTFT,
   prompt and answer lengths (EOS ends some early), rounds, accepted tokens by position; per level:
   mean Propose / Verify RPC time and rows per batch (the services' metrics), and the machine's
   other load (/proc: CPU use of everything but the cluster and this process; runnable threads
   other than the Draft and Verify services', sampled every 0.2 s).
3. Simulate each level with the same clients and the same requests replayed in the order they
   started (`{sequence: [...]}` sizes, `speculation.acceptance_per_request` from each request's
   accepted tokens by position), from the tables of step 1. The Draft and Verify processes share
   one host of `--cores` cores (this machine's count by default), each asking `--threads` of them
   per forward (processor sharing, specmesh/sim/servers.py): with 1 thread each on 2 cores their
   forwards run side by side, as live. Host variants, the main one first: the Coordinator's and the
   bench client's CPU on the host's cores (`coordinator` / `clients` in the sim config), at the CPU
   per message measured in the level: the process's utime + stime (/proc/<pid>/stat), less its rate
   with no request (5 s before the levels), over the messages it handled (the Coordinator: 2 per Draft / Verify session call, from the services'
   metrics, + the client's; the client: its request, the first token and one response per Verify
   round, per request), not fitted; then, without them: the cores are the cluster's alone; plus the
   other load's measured CPU use as background threads; plus its measured runnable threads
   (demand). Per variant one parameter is fitted, on c = 1 only: the per-message latency
   (`network.same_node.latency_ms`: the gRPC + asyncio cost per hop, which no forward-time table
   holds), by bisection on tokens/s; c = 4 and 16 are predictions.
   Every core per process is worse live (measured earlier: two OpenMP teams contend and c = 4 fell
   from 33.5 to 3.4 tokens/s), so the default is 1 thread per model process, as profiled.
Writes bench/results/sim_validate.json (the live data first, then the comparison) and .md with the
error per level; goal: within 15%.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import re
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from client.bench_cli import DEFAULT_PROMPTS, run_level  # noqa: E402
from client.cluster import Cluster  # noqa: E402
from client.coordinator_client import CoordinatorClient  # noqa: E402
from specmesh.sim.cluster import Simulation  # noqa: E402
from specmesh.sim.config import config_from_dict  # noqa: E402

RESULTS = ROOT / "bench" / "results"
IDLE_S = 5.0  # the cluster left idle this long before the levels: each process's CPU without requests


def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)] if ordered else float("nan")


def process_cpu_s(pid: int) -> float:
    """CPU seconds (utime + stime, every thread) of a live process so far; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """Cores in use on this machine between `start` and `stop`, split into ours (the given processes,
    all their threads) and the others' (everything else: other users' jobs), from /proc."""

    HZ = os.sysconf("SC_CLK_TCK")

    def __init__(self, pids: list[int]):
        self.pids = pids

    def _read(self) -> tuple[float, float, float]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
        return time.perf_counter(), busy / self.HZ, sum(process_cpu_s(pid) for pid in self.pids)

    def start(self) -> None:
        self._start = self._read()

    def stop(self) -> dict[str, float]:
        wall, busy, ours = (b - a for a, b in zip(self._start, self._read()))
        return {"ours_cores": ours / wall, "others_cores": max(0.0, busy - ours) / wall, "wall_s": wall}


class RunnableSampler:
    """The other load's demand: every `period_s`, runnable threads on the machine (/proc/stat
    procs_running) less this sampler's own and those of `pids` (the Draft and Verify services: the
    forwards the simulator models). The mean is what the simulated host gets as background threads;
    it counts everything else that wants a core: other users' jobs, the coordinator, the bench client.
    Demand, not use: under contention the others get less CPU than they ask for."""

    def __init__(self, pids: list[int], period_s: float = 0.2):
        self.pids, self.period_s = pids, period_s
        self._samples: list[tuple[int, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _ours_running(self) -> int:
        count = 0
        for pid in self.pids:
            try:
                tasks = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tasks:
                try:
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        count += f.read().rsplit(")", 1)[1].split()[0] == "R"
                except OSError:
                    pass
        return count

    def _run(self) -> None:
        start_cpu_s = time.thread_time()
        while not self._stop.wait(self.period_s):
            with open("/proc/stat") as f:
                running = next(int(line.split()[1]) for line in f if line.startswith("procs_running"))
            self._samples.append((running, self._ours_running()))
        self._cpu_s = time.thread_time() - start_cpu_s  # its own CPU, not the bench client's

    def start(self) -> None:
        self._samples, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, float]:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        n = max(1, len(self._samples))
        return {"others_runnable": sum(max(0, r - 1 - o) for r, o in self._samples) / n,
                "services_runnable": sum(o for _, o in self._samples) / n, "num_samples": len(self._samples),
                "sampler_cpu_s": self._cpu_s}


def profile_tables(folder: str, threads: int, max_prompt: int, max_new: int, max_rows: int, out_dir: Path) -> tuple[dict[str, str], dict]:
    import torch

    from specmesh.models.load import load_engine
    from specmesh.sim.profile import profile_engine

    torch.set_num_threads(threads)
    context = sorted({16, max_prompt, max_prompt + max_new})
    tables, cpu = {}, {}
    rows = [1, 2, 4, 8, 16][: max(1, max_rows.bit_length())]  # both batch across sessions: up to `max_rows` rows
    clock = "thread_cpu" if threads == 1 else "wall"  # 1 thread: the forward's time on a core of its own, whatever else runs
    for role, dtype, tokens in [("target", "float32", [1, 3, 5, 8, 32, max_prompt]), ("draft", "bfloat16", [1, 2, 5, 32, max_prompt])]:
        engine = load_engine(folder, dtype=dtype)
        start = time.perf_counter()
        meter = CpuMeter([os.getpid()])
        meter.start()
        table = profile_engine(engine, rows, sorted(set(tokens)), context, repeats=3, meta={"model": "default", "role": role},
                               clock=clock)
        cpu[role] = meter.stop()
        path = out_dir / f"{role}.json"
        table.save(path)
        tables[role] = str(path)
        print(f"profiled the {role} ({dtype}) in {time.perf_counter() - start:.0f} s: one-token forward "
              f"{table.forward_ms(1, 1, context[0]):.1f} ms ({clock}; wall / cpu {table.meta['wall_over_cpu']:.2f}; "
              f"others' load {cpu[role]['others_cores']:.2f} cores)", flush=True)
        del engine
    return tables, cpu


def even_round_counts(num_rounds: int, num_output_tokens: int, k: int) -> list[int]:
    """A request's accepted counts per round when only its rounds and length were recorded: the
    accepted total (each round emits accepted + 1 tokens after the prefill's first) spread evenly.

    >>> even_round_counts(4, 16, 4)  # 16 - 1 - 4 = 11 accepted over 4 rounds
    [3, 3, 3, 2]
    """
    total = min(max(0, num_output_tokens - 1 - num_rounds), k * num_rounds)
    return [total // num_rounds + (i < total % num_rounds) for i in range(num_rounds)]


def round_counts(num_rounds: int, accepted_per_position: str, seed: int) -> list[int]:
    """One request's accepted count per round, from its count of rounds and accepted tokens by position
    (rounds accepting >= i + 1 tokens = count at position i; the order, which the stats do not keep, seeded).

    >>> sorted(round_counts(5, "4 3 1 1", 0))  # 1 round accepted none, 1 one, 2 two, 1 all four
    [0, 1, 2, 2, 4]
    """
    counts = [int(x) for x in accepted_per_position.split()]
    out: list[int] = []
    for n in range(len(counts) + 1):
        at_least_n = num_rounds if n == 0 else counts[n - 1]
        at_least_next = counts[n] if n < len(counts) else 0
        out.extend([n] * max(0, at_least_n - at_least_next))
    random.Random(seed).shuffle(out)
    return out


def sim_config(out: dict, tables: dict[str, str], level: dict, latency_ms: float, background_threads: float,
               cpu_ms_per_message: dict[str, float] | None = None) -> dict:
    """The level as run: its clients, its requests in start order (sizes and, where recorded, each one's
    accepted counts per round), one host of `out["cores"]` cores with `background_threads` of other load
    and, with `cpu_ms_per_message` ({"coordinator": ms, "clients": ms}), those processes' CPU on it."""
    requests = level["requests"]
    speculation: dict = {"k": out["k"], "acceptance_marginal": level["acceptance_marginal"] or [0.0]}
    if all(r["rounds"] for r in requests):
        speculation["acceptance_per_request"] = [
            round_counts(r["rounds"], r["accepted_per_position"], r["index"]) if r.get("accepted_per_position") is not None
            else even_round_counts(r["rounds"], r["output_tokens"], out["k"]) for r in requests]
    threads = out["threads"]
    return {
        "mode": "distributed", "duration_s": 3600, "burn_in_s": 0, "seed": 0,
        "devices": {"target": {"table": tables["target"]}, "draft": {"table": tables["draft"]}},
        "targets": [{"count": 1, "device": "target", "node": "host", "host": "localhost", "threads": threads}],
        "drafts": [{"count": 1, "device": "draft", "node": "host", "host": "localhost", "threads": threads}],
        "hosts": {"localhost": {"cores": out["cores"], "background_threads": background_threads}},
        "network": {"coordinator_node": "host", "same_node": {"latency_ms": latency_ms}, "client": {"latency_ms": latency_ms}},
        **{name: {"host": "localhost", "cpu_ms_per_message": ms} for name, ms in (cpu_ms_per_message or {}).items()},
        "speculation": speculation,
        "workload": {"arrival": "closed", "num_clients": level["clients"], "num_requests_per_client": out["requests_per_client"],
                     "prompt_tokens": {"sequence": [r["prompt_tokens"] for r in requests]},
                     "output_tokens": {"sequence": [r["output_tokens"] for r in requests]}},
    }


def simulate_level(config: dict) -> dict:
    sim = Simulation(config_from_dict(config))
    result = sim.run()
    done = [r for r in sim.requests if r.end_s >= 0]
    makespan = max(r.end_s for r in done) - min(r.arrival_s for r in done)
    latencies = [r.e2e_s for r in done]
    rounds = sum(r.num_rounds for r in done)
    devices = {d.kind: d for d in result.devices}
    return {"tokens_per_s": sum(r.num_output_tokens for r in done) / makespan, "p50_s": nearest_rank(latencies, 50),
            "p95_s": nearest_rank(latencies, 95), "ttft_p50_s": nearest_rank([r.ttft_s for r in done], 50),
            "round_ms_mean": sum(r.e2e_s - r.ttft_s for r in done) / max(1, rounds) * 1e3, "num_requests": len(done),
            "num_rounds": rounds, "acceptance_rate": sum(r.num_accepted_tokens for r in done) / max(1, sum(r.num_draft_tokens for r in done)),
            "draft_batch_ms_mean": devices["draft"].busy_s / max(1, devices["draft"].num_batches) * 1e3,
            "verify_batch_ms_mean": devices["target"].busy_s / max(1, devices["target"].num_jobs) * 1e3,
            "draft_rows_mean": devices["draft"].mean_batch_rows, "verify_rows_mean": devices["target"].mean_batch_rows,
            "core_utilisation": result.summary["hosts"]["localhost"]["core_utilisation"] * result.summary["window_s"] / makespan,
            **{f"{name}_cores": process["cpu_s"] / makespan for name, process in result.summary["processes"].items()}}


def messages_handled(level: dict) -> dict[str, int]:
    """The messages the bench client and the Coordinator handled in a live level, counted as the
    simulator counts them (specmesh/sim/cluster.py): the client, per request, its request, the first
    token and one response per Verify round; the Coordinator, the client's plus a request and a
    response per Draft / Verify session call (OpenSession, Propose, Verify, CloseSession; not the
    pools' GetInfo health checks)."""
    services = level["services"]
    calls = sum(count for service in services.values() for key, count in service.items()
                if key.endswith("_calls") and not key.startswith("GetInfo"))
    client = 2 * level["num_requests"] + int(services["verify"]["Verify_calls"])
    return {"clients": client, "coordinator": int(2 * calls) + client}


def cpu_ms_per_message(level: dict, idle_cores: dict[str, float]) -> dict[str, float]:
    """Measured, per level: the Coordinator's and the bench client's CPU (/proc utime + stime; the
    bench's less its /proc sampler thread), less what the process burns idle over the level's wall
    time (health checks, timers: not per message), over the messages each handled."""
    cpu_s, messages, wall_s = level["cpu"]["process_cpu_s"], messages_handled(level), level["wall_s"]
    coordinator_s = cpu_s["coordinator"] - idle_cores.get("coordinator", 0.0) * wall_s
    client_s = cpu_s["bench"] - level["cpu"]["sampler_cpu_s"] - idle_cores.get("bench", 0.0) * wall_s
    return {"coordinator": max(0.0, coordinator_s) / messages["coordinator"] * 1e3,
            "clients": max(0.0, client_s) / messages["clients"] * 1e3}


def fit_latency(make_config, target_tokens_per_s: float, high: float = 500.0) -> float:
    """The value (per-message latency in ms, or background threads) at which the simulated c = 1 run
    matches the measured tokens/s; `high` when even that is too fast, 0 when even 0 is too slow."""
    low = 0.0
    for _ in range(24):
        mid = (low + high) / 2
        if simulate_level(make_config(mid))["tokens_per_s"] > target_tokens_per_s:
            low = mid
        else:
            high = mid
    return (low + high) / 2


METRIC = re.compile(r'^specmesh_(request_seconds_sum|request_seconds_count|batch_size_sum|batch_size_count|forwards_total)(?:\{method="(\w+)"\})? (\S+)$')


def scrape(url: str) -> dict[str, float]:
    """The counters of one service's /metrics that the comparison reads, by name[/method]."""
    out: dict[str, float] = {}
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
    except (OSError, ValueError) as exc:  # the comparison goes on without the services' figures
        print(f"could not scrape {url!r}: {exc}", flush=True)
        return out
    for line in text.splitlines():
        match = METRIC.match(line)
        if match:
            name, method, value = match.groups()
            out[f"{name}/{method}" if method else name] = float(value)
    return out


def service_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per level: mean RPC seconds by method (ms) and mean rows per engine batch."""
    diff = {key: after[key] - before.get(key, 0.0) for key in after}
    out = {}
    for key, count in diff.items():
        if key.startswith("request_seconds_count/") and count > 0:
            method = key.split("/", 1)[1]
            out[f"{method}_ms_mean"] = diff[f"request_seconds_sum/{method}"] / count * 1e3
            out[f"{method}_calls"] = count
    if diff.get("batch_size_count", 0) > 0:
        out["rows_per_batch_mean"] = diff["batch_size_sum"] / diff["batch_size_count"]
    return out


async def live_level(address: str, prompts: list, clients: int, requests_per_client: int, k: int, max_new: int) -> tuple[list, float]:
    async with CoordinatorClient(address) as client:
        kwargs = dict(mode="speculative", drafter="service", k=k, temperature=0.0, top_k=0, top_p=1.0, seed=None,
                      max_new_tokens=max_new, stop=(), timeout_s=600.0)
        return await run_level(client, prompts, clients, clients * requests_per_client, None, kwargs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each model process and of the profiling")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="cores of the simulated host (this machine's)")
    parser.add_argument("--quick", action="store_true", help="concurrency 1 4, 2 requests per client, 32 new tokens")
    parser.add_argument("--resimulate", metavar="JSON", help="skip the profile and the live run: simulate again the tables and "
                        "live levels kept in this results file (e.g. after a simulator change)")
    args = parser.parse_args()
    if args.resimulate:
        compare(json.loads(Path(args.resimulate).read_text()))
        return 0
    if args.quick:
        args.concurrency, args.requests_per_client, args.max_new_tokens = [1, 4], 2, 32
    from transformers import AutoTokenizer

    from specmesh.models.chat import chat_prompt_ids
    from specmesh.models.resolve import resolve_model_spec

    folder = str(resolve_model_spec("default"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [[{"role": "user", "content": t}] for t in DEFAULT_PROMPTS]
    prompt_lengths = [len(chat_prompt_ids(tokenizer, t)) for t in DEFAULT_PROMPTS]
    out: dict = {"machine": platform.processor() or platform.machine(), "cores": args.cores, "threads": args.threads, "k": args.k,
                 "load_average_before": os.getloadavg(), "quick": args.quick,
                 "max_new_tokens": args.max_new_tokens, "requests_per_client": args.requests_per_client, "levels": []}
    with tempfile.TemporaryDirectory() as tmp:
        tables, out["profile_cpu"] = profile_tables(folder, args.threads, max(prompt_lengths), args.max_new_tokens, max(args.concurrency),
                                                    Path(tmp))
        out["tables"] = {role: json.loads(Path(path).read_text()) for role, path in tables.items()}
        RESULTS.mkdir(parents=True, exist_ok=True)
        common = {"model": folder, "port": 0, "torch_threads": args.threads, "metrics_port": 0}
        cluster_yaml = Path(tmp) / "cluster.yaml"
        cluster_yaml.write_text(yaml.safe_dump({"defaults": {"device": "cpu", "host": "127.0.0.1"}, "services": {
            "draft": {"kind": "draft", "drafter": "model", "dtype": "bfloat16", **common},
            "verify": {"kind": "verify", "dtype": "float32", **common},
            "coordinator": {"kind": "coordinator", "port": 0, "torch_threads": 1},
        }}))
        live = []
        with Cluster.from_yaml(cluster_yaml, log_dir=tmp) as cluster:
            address = cluster.addresses["coordinator"]
            metrics_urls = {spec.name: spec.metrics_url for spec in cluster.specs if spec.kind in ("draft", "verify")}
            meter = CpuMeter([os.getpid(), *(proc.pid for proc in cluster.processes.values())])
            sampler = RunnableSampler([cluster.processes[name].pid for name in ("draft", "verify")])
            pids = {**{name: proc.pid for name, proc in cluster.processes.items()}, "bench": os.getpid()}
            asyncio.run(live_level(address, prompts, 1, 1, args.k, 8))  # warm-up
            idle_before, idle_start = {name: process_cpu_s(pid) for name, pid in pids.items()}, time.perf_counter()
            time.sleep(IDLE_S)  # the processes' CPU with no request: health checks, timers (not per message)
            idle_wall_s = time.perf_counter() - idle_start
            out["idle_cores"] = {name: (process_cpu_s(pid) - idle_before[name]) / idle_wall_s for name, pid in pids.items()}
            for c in args.concurrency:
                before = {name: scrape(url) for name, url in metrics_urls.items()}
                load_before = os.getloadavg()[0]
                cpu_before = {name: process_cpu_s(pid) for name, pid in pids.items()}
                meter.start()
                sampler.start()
                rows, wall_s = asyncio.run(live_level(address, prompts, c, args.requests_per_client, args.k, args.max_new_tokens))
                cpu = {**meter.stop(), **sampler.stop()}
                cpu["process_cpu_s"] = {name: process_cpu_s(pid) - cpu_before[name] for name, pid in pids.items()}
                services = {name: service_means(before[name], scrape(url)) for name, url in metrics_urls.items()}
                done = [r for r in rows if not r.error]
                per_position: list[int] = []
                num_drafts = sum(r.num_drafts for r in done)
                for r in done:
                    for i, count in enumerate(int(x) for x in r.accepted_per_position.split()):
                        per_position.extend([0] * (i + 1 - len(per_position)))
                        per_position[i] += count
                live.append({"clients": c, "tokens_per_s": sum(r.num_tokens for r in done) / wall_s,
                             "p50_s": nearest_rank([r.latency_s for r in done], 50), "p95_s": nearest_rank([r.latency_s for r in done], 95),
                             "num_requests": len(done), "num_failed": len(rows) - len(done),
                             "acceptance_marginal": [n / num_drafts for n in per_position] if num_drafts else [],
                             "acceptance_rate": sum(r.num_accepted_tokens for r in done) / max(1, sum(r.num_draft_tokens for r in done)),
                             "ttft_p50_s": nearest_rank([r.time_to_first_token_s for r in done], 50),
                             "round_ms_mean": sum(r.latency_s - r.time_to_first_token_s for r in done) / max(1, sum(r.num_drafts for r in done)) * 1e3,
                             "num_rounds": sum(r.num_drafts for r in done), "wall_s": wall_s,
                             "sum_latency_s": sum(r.latency_s for r in done), "services": services,
                             "load_average_1m": [load_before, os.getloadavg()[0]], "cpu": cpu,
                             "requests": [{"index": r.index, "start_s": r.start_s, "prompt_tokens": prompt_lengths[r.prompt_index],
                                           "output_tokens": r.num_tokens, "latency_s": r.latency_s, "ttft_s": r.time_to_first_token_s,
                                           "rounds": r.num_drafts, "accepted_per_position": r.accepted_per_position} for r in done]})
                print(f"live c={c}: {live[-1]['tokens_per_s']:.1f} tok/s, p50 {live[-1]['p50_s']:.2f} s, cpu {cpu}, {services}", flush=True)

        out["live"] = live
        (RESULTS / "sim_validate.json").write_text(json.dumps(out, indent=1) + "\n")  # the live data, kept even if the sim fails
        compare(out)
    return 0


VARIANTS = {  # how the simulated host sees the rest of the machine's load (everything but the services' forwards)
    "process_cpu": "the Coordinator's and the bench client's CPU on the host's cores, at their CPU per message measured in "
                   "each level (/proc utime + stime over the messages handled; not fitted)",
    "alone": "the host's cores are the cluster's alone (the Coordinator's and the client's CPU only in the per-message latency)",
    "measured_load": "plus the other users' CPU use during the level (/proc: all busy CPU less the cluster's and the bench's) as background threads",
    "measured_demand": "plus the other load's demand during the level (runnable threads not of the Draft / Verify services, "
                       "sampled every 0.2 s) as background threads",
    "fitted_background": "DIAGNOSTIC, not the issue's protocol: the per-message latency measured at c = 1 (live round - Propose - "
                         "Verify, over 4 messages) and the background threads fitted at c = 1 instead, held for c = 4 and 16",
}


def process_cpu_table(out: dict, result: dict) -> list[str]:
    """The main variant's measured inputs, and the CPU each process got live and in the sim."""
    idle = out.get("idle_cores", {})
    idle_note = (f"; ms per message is net of the process's idle CPU (over {IDLE_S:.0f} s with no request before the levels: "
                 f"Coordinator {idle.get('coordinator', 0.0):.3f} cores, bench {idle.get('bench', 0.0):.3f})" if idle else "")
    lines = ["The processes' CPU (/proc utime + stime over the level; cores = CPU s / the level's wall time). Messages are counted "
             f"as the simulator counts them (`messages_handled`){idle_note}; the sim's cores are its jobs' CPU over its makespan. "
             "Draft + Verify: the two service processes' whole CPU live, against the sim's forwards alone (the rest of the host's "
             "busy cores).", "",
             "| clients | Coordinator CPU s / messages | ms per message | Coordinator cores live / sim | bench client CPU s / messages | "
             "ms per message | client cores live / sim | Draft + Verify cores live / sim forwards |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for a, lv in zip(out["live"], result["levels"]):
        cpu, b, ms, messages = a["cpu"], lv["sim"], lv["cpu_ms_per_message"], messages_handled(a)
        coordinator_s, client_s = cpu["process_cpu_s"]["coordinator"], cpu["process_cpu_s"]["bench"] - cpu["sampler_cpu_s"]
        services_cores = (cpu["process_cpu_s"]["draft"] + cpu["process_cpu_s"]["verify"]) / a["wall_s"]
        forwards_cores = b["core_utilisation"] * out["cores"] - b.get("coordinator_cores", 0.0) - b.get("clients_cores", 0.0)
        lines.append(f"| {a['clients']} | {coordinator_s:.2f} / {messages['coordinator']} | {ms['coordinator']:.2f} | "
                     f"{coordinator_s / a['wall_s']:.2f} / {b.get('coordinator_cores', 0.0):.2f} | {client_s:.2f} / {messages['clients']} | "
                     f"{ms['clients']:.2f} | {client_s / a['wall_s']:.2f} / {b.get('clients_cores', 0.0):.2f} | "
                     f"{services_cores:.2f} / {forwards_cores:.2f} |")
    return [*lines, ""]


def process_cpu_reading(out: dict) -> list[str]:
    """What the main variant's measurements say, in figures of this run."""
    if "process_cpu" not in out["variants"]:
        return []
    live, levels = out["live"], out["variants"]["process_cpu"]["levels"]
    per_message = [lv["cpu_ms_per_message"]["coordinator"] for lv in levels]
    cores = [(a["cpu"]["process_cpu_s"]["coordinator"] + a["cpu"]["process_cpu_s"]["bench"] - a["cpu"]["sampler_cpu_s"]) / a["wall_s"]
             for a in live]
    services = [(a["cpu"]["process_cpu_s"]["draft"] + a["cpu"]["process_cpu_s"]["verify"]) / a["wall_s"] for a in live]
    forwards = [lv["sim"]["core_utilisation"] * out["cores"] - lv["sim"].get("coordinator_cores", 0.0) - lv["sim"].get("clients_cores", 0.0)
                for lv in levels]
    top = live[-1]["clients"]
    return [f"The main variant puts the Coordinator's and the bench client's CPU on the host, as measured: the Coordinator "
            f"{min(per_message):.2f}-{max(per_message):.2f} ms per message, and the two processes together "
            f"{min(cores):.2f}-{max(cores):.2f} of the {out['cores']} cores over the levels. That is too little to be the missing "
            f"contention at c = {top}: the per-message cost is mostly wall time that is not these processes' CPU (the fitted residual "
            f"latency, {out['variants']['process_cpu']['fitted_latency_ms']:.2f} ms, against "
            f"{out['variants']['alone']['fitted_latency_ms']:.2f} ms without them), and what the variant adds is mostly the queueing "
            "of messages on the Coordinator's one thread. Nor does the sim under-count the services' CPU: the Draft and Verify "
            f"processes' whole CPU live at c = {top} is {services[-1]:.2f} cores, the sim's forwards {forwards[-1]:.2f}. What is "
            f"left at c = {top} (the sim's mean round {levels[-1]['error']['round_ms_mean']:+.0%} against live) these "
            "measurements do not locate.", ""]


def compare(out: dict) -> None:
    """Per variant: fit on c = 1, simulate every level; write the JSON and the markdown tables."""
    live = out["live"]
    out["variants"] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tables = {}
        for role, table in out["tables"].items():
            tables[role] = str(Path(tmp) / f"{role}.json")
            Path(tables[role]).write_text(json.dumps(table))
        for variant in VARIANTS:
            key = {"measured_load": "others_cores", "measured_demand": "others_runnable"}.get(variant)
            if key is not None and not all(key in level.get("cpu", {}) for level in live):
                continue
            if variant == "process_cpu" and not all("process_cpu_s" in level.get("cpu", {}) for level in live):
                continue  # a results file from before the processes' CPU was measured

            def processes(level: dict, variant: str = variant) -> dict[str, float] | None:
                return cpu_ms_per_message(level, out.get("idle_cores", {})) if variant == "process_cpu" else None

            fitted_background = 0.0
            if variant == "fitted_background":
                if "Propose_ms_mean" not in live[0]["services"].get("draft", {}):
                    continue
                services = live[0]["services"]
                latency_ms = max(0.0, (live[0]["round_ms_mean"] - services["draft"]["Propose_ms_mean"]
                                       - services["verify"]["Verify_ms_mean"]) / 4)
                fitted_background = fit_latency(lambda threads: sim_config(out, tables, live[0], latency_ms, threads),
                                                live[0]["tokens_per_s"], high=32.0)

            def background(level: dict, key: str | None = key) -> float:
                return level["cpu"][key] if key is not None else fitted_background

            if variant != "fitted_background":
                latency_ms = fit_latency(lambda ms: sim_config(out, tables, live[0], ms, background(live[0]), processes(live[0])),
                                         live[0]["tokens_per_s"])
            levels = []
            for level in live:
                sim = simulate_level(sim_config(out, tables, level, latency_ms, background(level), processes(level)))
                errors = {key: sim[key] / level[key] - 1 for key in ("tokens_per_s", "p50_s", "p95_s", "ttft_p50_s", "round_ms_mean")}
                levels.append({"clients": level["clients"], "background_threads": background(level), "sim": sim, "error": errors,
                               "fitted_here": level is live[0], "cpu_ms_per_message": processes(level)})
            out["variants"][variant] = {"fitted_latency_ms": latency_ms, "levels": levels}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sim_validate.json").write_text(json.dumps(out, indent=1) + "\n")

    def cpu_note(level: dict) -> str:
        cpu = level.get("cpu")
        if not cpu:
            return ""
        demand = f", {cpu['others_runnable']:.2f} other runnable threads" if "others_runnable" in cpu else ""
        return f"c = {level['clients']}: {cpu['others_cores']:.2f} others' / {cpu['ours_cores']:.2f} ours{demand}"

    profile_cpu = out.get("profile_cpu", {})
    replayed = ("sizes and accepted tokens per round" if live[0]["requests"][0].get("accepted_per_position") is not None
                else "sizes, and each request's accepted total over its rounds")
    slowed = ", ".join(f"{role} {table['meta'].get('wall_over_cpu', float('nan')):.2f}" for role, table in out["tables"].items())
    loads = ", ".join(f"{level['load_average_1m'][0]:.1f}" for level in live)
    lines = ["# Simulator vs the live cluster", "",
             f"`.venv/bin/python bench/sim_validate.py{' --quick' if out['quick'] else ''}`: default model, Draft (bf16 self-draft) + "
             f"Verify (fp32) + Coordinator on loopback, {out['threads']} torch thread(s) per model process, k = {out['k']}, greedy, "
             f"{out['requests_per_client']} requests per client, up to {out['max_new_tokens']} new tokens. Simulated as one host of "
             f"{out['cores']} cores (processor sharing, specmesh/sim/servers.py), the measured requests replayed in start order "
             f"({replayed}). Cost tables: {out['tables']['target']['meta'].get('clock', 'wall')} time (the profile's wall / cpu: "
             f"{slowed}). Machine load (1-min average) before the profile {out['load_average_before'][0]:.1f}, before each level: "
             f"{loads}.", ""]
    if profile_cpu or any("cpu" in level for level in live):
        others = ", ".join(f"{role} {cpu['others_cores']:.2f}" for role, cpu in profile_cpu.items())
        lines += [f"CPU in use (cores) on this {out['cores']}-core machine, from /proc: other users' during the profile: {others}; "
                  f"during the live levels: {'; '.join(cpu_note(level) for level in live)}.", ""]
    for variant, result in out["variants"].items():
        fitted = (f"per-message latency {result['fitted_latency_ms']:.2f} ms (measured), background {result['levels'][0]['background_threads']:.2f} "
                  "threads (fitted)" if variant == "fitted_background" else f"per-message latency {result['fitted_latency_ms']:.2f} ms")
        lines += [f"## Host model: {VARIANTS[variant]}", "", f"Fitted on c = 1: {fitted}.", "",
                  "| clients | live tok/s | sim tok/s | error | live p50 s | sim p50 s | error | live p95 s | sim p95 s | error |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for a, lv in zip(live, result["levels"]):
            b, e = lv["sim"], lv["error"]
            lines.append(f"| {lv['clients']}{' (fit)' if lv['fitted_here'] else ''} | {a['tokens_per_s']:.1f} | {b['tokens_per_s']:.1f} | "
                         f"{e['tokens_per_s']:+.0%} | {a['p50_s']:.2f} | {b['p50_s']:.2f} | {e['p50_s']:+.0%} | {a['p95_s']:.2f} | "
                         f"{b['p95_s']:.2f} | {e['p95_s']:+.0%} |")
        lines += ["", "Where the time goes (live: client timings and the services' Prometheus metrics; sim: the same run simulated). "
                  "Round = (latency - TTFT) / rounds; Propose / Verify = mean RPC time at the service (queue + batch window + forward), "
                  "sim = mean engine time of one batch.", "",
                  "| clients | TTFT p50 live / sim ms | round live / sim ms | Propose live ms / sim draft batch ms | "
                  "Verify live ms / sim verify job ms | rows per draft batch live / sim | rows per verify batch live / sim | sim host cores busy |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for a, lv in zip(live, result["levels"]):
            b = lv["sim"]
            draft, verify = a["services"].get("draft", {}), a["services"].get("verify", {})
            lines.append(f"| {lv['clients']} | {a['ttft_p50_s'] * 1e3:.0f} / {b['ttft_p50_s'] * 1e3:.0f} | {a['round_ms_mean']:.0f} / "
                         f"{b['round_ms_mean']:.0f} | {draft.get('Propose_ms_mean', float('nan')):.0f} / {b['draft_batch_ms_mean']:.0f} | "
                         f"{verify.get('Verify_ms_mean', float('nan')):.0f} / {b['verify_batch_ms_mean']:.0f} | "
                         f"{draft.get('rows_per_batch_mean', float('nan')):.2f} / {b['draft_rows_mean']:.2f} | "
                         f"{verify.get('rows_per_batch_mean', float('nan')):.2f} / {b['verify_rows_mean']:.2f} | {b['core_utilisation']:.0%} |")
        lines.append("")
        if variant == "process_cpu":
            lines += process_cpu_table(out, result)
    lines += ["## Reading the tables", "", *process_cpu_reading(out),
              "This machine is shared: other users' jobs ran throughout (their CPU use and runnable threads above). The kernel "
              "shares the cores between autogroups (/proc/sys/kernel/sched_autogroup_enabled = 1; the cluster starts each service "
              "in a session of its own), not between threads, so neither the others' CPU use (what they got: too little) nor "
              "their runnable threads (what they asked, counted per thread: too much) is the background a per-thread "
              "processor-sharing host sees; the truth lies between the two variants. With the cores to the cluster alone the "
              "per-message fit has to absorb the other load at c = 1, and cannot carry it to c = 4 and 16. The diagnostic "
              "variant shows what is left once the background is known: it fits the background on c = 1 in place of the "
              "message latency (measured instead, from the services' metrics)."]
    text = "\n".join(lines) + "\n"
    (RESULTS / "sim_validate.md").write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
