"""The simulator against the live local cluster: aggregate tokens/s, p50 / p95 latency and TTFT.

    .venv/bin/python bench/sim_validate.py [--concurrency 1 4 16] [--requests-per-client 4] [--max-new-tokens 64] [--k 4]
                                           [--threads 1] [--cores N] [--repeats 2] [--quick]
    .venv/bin/python bench/sim_validate.py --resimulate bench/results/sim_validate.json   # the sim side again, no live run

1. Profile the default model in this process under the services' thread setting (`--threads`, each
   model process pinned to that many torch threads): the target in float32, the drafter in bfloat16
   (the Draft service's self-draft), on a grid covering the batches and prompts the run will see.
   With 1 thread the tables hold each forward's thread CPU time (`profile_engine(clock=
   "thread_cpu")`): its time on a core of its own, however loaded the machine is (it is shared).
   The grid spans the prompts, so it holds both sides of the forward's cost steps (`tokens_axis`):
   priced between 32 and 64 tokens, a 37-token bf16 prefill came out at 135 ms against 63 measured,
   and the Draft service's CPU read 15-17% below its forwards. Then the memory contention
   (`measure_contention`): an fp32 verify forward on one core and a bf16 draft forward on the other,
   each alone and then side by side, in alternating 2 s phases (measured once, alone then together,
   it read anywhere from 0.01 to 0.33 within an hour); the simulated host's `memory_contention` takes
   it (runs before 2026-11-28 had neither and read 0).
2. Start the cluster (Draft with the bf16 self-draft, Verify fp32, Coordinator; loopback, as
   `make run-cluster` does; Prometheus metrics on) and, per concurrency level c, run c closed-loop
   clients of `--requests-per-client` requests each through `specmesh bench`'s `run_level`
   (the levels run `--repeats` times, interleaved: 1 4 16 1 4 16 ...)
   (speculative mode, the Draft service, fixed k, greedy). Measured per request: latency, TTFT,
   prompt and answer lengths (EOS ends some early), rounds, accepted tokens by position; per level:
   mean Propose / Verify RPC time and rows per batch (the services' metrics), and the machine's
   other load (/proc: CPU use of everything but the cluster and this process; runnable threads
   other than the Draft and Verify services', sampled every 0.2 s).
3. Simulate each level (each repeat) with the same clients and the same requests replayed in the order they
   started (`{sequence: [...]}` sizes, `speculation.acceptance_per_request` from each request's
   accepted tokens by position), from the tables of step 1. The Draft and Verify processes share
   one host of `--cores` cores (this machine's count by default), each asking `--threads` of them
   per forward (processor sharing, specmesh/sim/servers.py): with 1 thread each on 2 cores their
   forwards run side by side, as live, each slowed by the measured memory contention. Host variants, the main one first: every process's CPU
   outside the forwards on the host's cores, measured in the level, not fitted: the Coordinator's and
   the bench client's per message (`coordinator` / `clients` in the sim config): the process's utime
   + stime (/proc/<pid>/stat), less its rate with no request (5 s before the levels), over the
   messages it handled (the Coordinator: 2 per Draft / Verify session call, from the services'
   metrics, + the client's; the client: its request, the first token and one response per Verify
   round, per request); the Draft and Verify services' per call (`cpu_ms_per_call`): the process's
   utime + stime less its idle rate and less its forwards' CPU (`forwards_cpu_s`: the services'
   batch counts and shapes priced by the profile tables), over its RPCs (the metrics' counts, health
   checks aside); then the Coordinator's and client's alone; then none: the cores are the cluster's alone; plus the
   other load's measured CPU use as background threads; plus its measured runnable threads
   (demand). Per variant one parameter is fitted, on c = 1 only: the per-message latency
   (`network.same_node.latency_ms`: the gRPC + asyncio cost per hop, which no forward-time table
   holds), by bisection on tokens/s (the median over the c = 1 repeats against the live median);
   c = 4 and 16 are predictions. Live figures are the medians over the repeats (spread: min-max),
   the sim's the median of the repeats' simulations.
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
import statistics
import subprocess
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
from specmesh.sim.cost import CostTable  # noqa: E402

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


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (utime + stime) so far of each live thread of a process, by thread id."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    out = {}
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    return out


def engine_thread_cpu_s(pid: int, before: dict[int, float], after: dict[int, float]) -> float:
    """The CPU a service's engine thread took between two `thread_cpu_s` readings: the busiest thread
    but the main one (the asyncio loop; `servicekit.engine_thread` runs every forward on a worker)."""
    return max((cpu - before.get(tid, 0.0) for tid, cpu in after.items() if tid != pid), default=0.0)


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


CONTENTION_PHASE_S = 2.0  # the contention measurement alternates phases this long: verify alone, draft alone, both
CONTENTION_CYCLES = 6


def forward_loop(folder: str, dtype: str, num_tokens: int, cpu: int, start_at: float, active: str) -> dict[str, list[float]]:
    """One process's part of `measure_contention`: pinned to core `cpu`, 1 torch thread, from wall time
    `start_at`, CONTENTION_CYCLES cycles of three phases (verify alone, draft alone, both), active in the
    phases whose digit in `active` is 1 ("101": the first and the third): forwards of `num_tokens` new
    tokens (logits at each) after a 60-token prompt, truncated back each time, none started in a phase's
    last 0.15 s (so the other process's phase alone stays alone). Per cycle, the median thread CPU ms of a
    forward in each active phase ("alone", "both")."""
    import torch

    from specmesh.models.engine import SeqInput
    from specmesh.models.load import load_engine

    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    engine = load_engine(folder, dtype=dtype)
    seq = engine.new_sequence()
    engine.forward([SeqInput(seq, [100] * 60, [59])])
    out: dict[str, list[float]] = {"alone": [], "both": []}
    for cycle in range(CONTENTION_CYCLES):
        for phase, on in enumerate(active):
            phase_start = start_at + (cycle * len(active) + phase) * CONTENTION_PHASE_S
            if on != "1":
                continue
            time.sleep(max(0.0, phase_start - time.time()))
            samples, stop = [], phase_start + CONTENTION_PHASE_S - 0.15
            while time.time() < stop:
                begin = time.thread_time()
                engine.forward([SeqInput(seq, [200] * num_tokens, list(range(num_tokens)))])
                samples.append((time.thread_time() - begin) * 1e3)
                engine.truncate(seq, 60)
            out["both" if phase == len(active) - 1 else "alone"].append(statistics.median(samples[1:] or samples))
    return out


def measure_contention(folder: str, k: int, threads: int) -> dict:
    """How much forwards on two cores slow each other (the simulated host's `memory_contention`): the
    Verify service's forward (fp32, k + 1 tokens) on core 0 and the Draft service's (bf16, 1 token) on
    core 1, each process 1 thread, in CONTENTION_CYCLES cycles of three 2 s phases: verify alone, draft
    alone, both at once. Each cycle gives each side a slowdown (both / alone, that cycle's medians:
    phases seconds apart, so the machine's drift over a minute does not enter it); "c" = the mean of the
    two sides' median slowdowns, less 1, as measured (the simulated host's c weighs it by the verify
    forward's intensity: `host_contention`). Thread CPU time counts a core's cycles stalled on memory, so
    the slowdown shows in it. Needs 2 cores and 1 thread per model process; else c = 0."""
    if threads != 1 or len(os.sched_getaffinity(0)) < 2:
        return {"c": 0.0, "why": "measured only with 1 thread per model process on 2+ cores"}
    cpus = sorted(os.sched_getaffinity(0))[:2]
    roles = {"verify": ("float32", k + 1, cpus[0], "101"), "draft": ("bfloat16", 1, cpus[1], "011")}
    start_at = time.time() + 15.0  # after both processes have loaded the model
    procs = {name: subprocess.Popen([sys.executable, __file__, "--forward-loop", folder, *map(str, role[:3]), str(start_at),
                                     role[3]], stdout=subprocess.PIPE, text=True) for name, role in roles.items()}
    medians = {name: json.loads(proc.communicate()[0].strip().splitlines()[-1]) for name, proc in procs.items()}
    slowdown = {name: statistics.median(both / alone for alone, both in zip(m["alone"], m["both"])) for name, m in medians.items()}
    return {"c": max(0.0, statistics.fmean(slowdown.values()) - 1.0), "slowdown": slowdown, "per_cycle_ms": medians,
            "cpus": cpus, "phase_s": CONTENTION_PHASE_S, "cycles": CONTENTION_CYCLES}


def host_contention(out: dict) -> float:
    """The simulated host's `memory_contention` from `measure_contention`'s slowdowns: the simulator slows a
    forward of intensity i beside others of summed intensity S by 1 + c i S (specmesh/sim/servers.py), and
    the measurement ran a one-token draft forward (intensity 1) beside a (k + 1)-token verify, whose
    intensity is the target table's one-token time over its (k + 1)-token time at the loops' context (60),
    so c = (each side's slowdown - 1) / that intensity, the mean of the two."""
    measured = out.get("memory_contention", {})
    if "slowdown" not in measured:
        return 0.0
    target = CostTable.from_json(out["tables"]["target"])
    verify_intensity = min(1.0, target.forward_ms(1, 1, 60) / target.forward_ms(1, out["k"] + 1, 60))
    return max(0.0, statistics.fmean(s - 1.0 for s in measured["slowdown"].values()) / verify_intensity)


def steps_equal_chains(folder: str, dtype: str) -> bool:
    """Whether the Draft service's engine (this model and dtype, here) keeps a guess forward's KV when it
    drafts ahead (`NativeEngine.steps_equal_chains`); the simulated Draft server is told the same."""
    from specmesh.models.load import load_engine

    return bool(getattr(load_engine(folder, dtype=dtype), "steps_equal_chains", False))


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


def sim_config(out: dict, tables: dict[str, str], level: dict, latency_ms: float, background_threads: float = 0.0,
               cpu_ms_per_message: dict[str, float] | None = None, cpu_ms_per_call: dict[str, float] | None = None,
               engine_ms_per_call: dict[str, float] | None = None) -> dict:
    """The level as run: its clients, its requests in start order (sizes and, where recorded, each one's
    accepted counts per round), one host of `out["cores"]` cores with `background_threads` of other load
    and, with `cpu_ms_per_message` ({"coordinator": ms, "clients": ms}), those processes' CPU on it;
    with `cpu_ms_per_call` ({"draft": ms, "verify": ms}), the services' CPU outside their forwards on
    their RPC threads, and with `engine_ms_per_call`, on their engine threads."""
    requests = level["requests"]
    speculation: dict = {"k": out["k"], "acceptance_marginal": level["acceptance_marginal"] or [0.0]}
    if out.get("draft_ahead"):
        speculation.update(draft_ahead=True, guess_rate=guess_rate(level["acceptance_marginal"]))
    if out.get("draft_shares_kv"):  # runs before the Verify service shared its KV (2026-11-28) fed their context
        speculation["draft_shares_kv"] = True
    if all(r["rounds"] for r in requests):
        speculation["acceptance_per_request"] = [
            round_counts(r["rounds"], r["accepted_per_position"], r["index"]) if r.get("accepted_per_position") is not None
            else even_round_counts(r["rounds"], r["output_tokens"], out["k"]) for r in requests]
    threads = out["threads"]
    per_call, engine = cpu_ms_per_call or {}, engine_ms_per_call or {}
    return {
        "mode": "distributed", "duration_s": 3600, "burn_in_s": 0, "seed": 0,
        "devices": {"target": {"table": tables["target"]}, "draft": {"table": tables["draft"]}},
        "targets": [{"count": 1, "device": "target", "node": "host", "host": "localhost", "threads": threads,
                     "cpu_ms_per_call": per_call.get("verify", 0.0), "engine_ms_per_call": engine.get("verify", 0.0)}],
        "drafts": [{"count": 1, "device": "draft", "node": "host", "host": "localhost", "threads": threads,
                    "cpu_ms_per_call": per_call.get("draft", 0.0), "engine_ms_per_call": engine.get("draft", 0.0),
                    "steps_equal_chains": bool(out.get("draft_steps_equal_chains"))}],
        "hosts": {"localhost": {"cores": out["cores"], "background_threads": background_threads,
                                "memory_contention": host_contention(out)}},
        "network": {"coordinator_node": "host", "same_node": {"latency_ms": latency_ms}, "client": {"latency_ms": latency_ms}},
        **{name: {"host": "localhost", "cpu_ms_per_message": ms} for name, ms in (cpu_ms_per_message or {}).items()},
        "speculation": speculation,
        "workload": {"arrival": "closed", "num_clients": level["clients"], "num_requests_per_client": out["requests_per_client"],
                     "prompt_tokens": {"sequence": [r["prompt_tokens"] for r in requests]},
                     "output_tokens": {"sequence": [r["output_tokens"] for r in requests]}},
    }


def guess_rate(marginal: list[float]) -> float:
    """How often a draft ahead's guess of the target's token after the k drafts holds (given all k were
    accepted), for the simulator: the measured acceptance at the last drafted position given the one
    before, marginal[k-1] / marginal[k-2] (the position after the k drafts is not measured)."""
    if len(marginal) < 2 or marginal[-2] <= 0:
        return marginal[0] if marginal else 0.0
    return min(1.0, marginal[-1] / marginal[-2])


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
            "ahead_served_tokens": sim.ahead_served_tokens,
            **{f"{name}_cores": process["cpu_s"] / makespan for name, process in result.summary["processes"].items()}}


# not per-session messages: the pools' health checks; a ProposeStream (its rounds are counted as the Propose calls they
# are; the Draft service had it when the runs of 060f489 recorded their metrics, and --resimulate reads those files)
NOT_MESSAGES = ("GetInfo", "ProposeStream")


def messages_handled(level: dict) -> dict[str, int]:
    """The messages the bench client and the Coordinator handled in a live level, counted as the
    simulator counts them (specmesh/sim/cluster.py): the client, per request, its request, the first
    token and one response per Verify round; the Coordinator, the client's plus a request and a
    response per Draft / Verify session call (OpenSession, Propose, Verify, CloseSession; not the
    pools' GetInfo health checks)."""
    services = level["services"]
    calls = sum(count for service in services.values() for key, count in service.items()
                if key.endswith("_calls") and not key.startswith(NOT_MESSAGES))
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


def forwards_cpu_s(level: dict, tables: dict[str, CostTable], k: int) -> dict[str, float]:
    """The CPU seconds the Draft and Verify services' forwards took in a live level, priced by the
    profile tables (thread CPU time per forward) at the level's batches as the services' metrics
    count them, each at the level's mean shape (rows per batch; context: the mean over rounds):
    Verify: a prefill per request (its prompt; one chunk) + batches x forward(rows, tokens per row);
    Draft: a prefill per request (the first Propose feeds the prompt) + batches x (a first forward
    feeding 1 token per row, 2 when all k were accepted, + one 1-token forward per later position,
    k = the mean drafted per call). Approximate: ragged batches are priced at their mean shape (a
    fractional mean row count: the table interpolates linearly between row counts)."""
    requests, services = level["requests"], level["services"]
    num_rounds = sum(r["rounds"] for r in requests)
    context = sum(r["rounds"] * (r["prompt_tokens"] + (r["output_tokens"] + 1) / 2) for r in requests) / max(1, num_rounds)
    target, drafter = tables["target"], tables["draft"]
    verify, draft = services["verify"], services["draft"]
    verify_batches = verify.get("batches", verify["Verify_calls"] / verify["rows_per_batch_mean"])
    rows = verify["Verify_calls"] / verify_batches
    tokens_per_row = verify.get("tokens_per_row_mean", 1 + draft.get("draft_tokens", k * draft["Propose_calls"]) / verify["Verify_calls"])
    verify_ms = (sum(target.forward_ms(1, r["prompt_tokens"], 0) for r in requests)
                 + verify_batches * target.forward_ms(rows, tokens_per_row, context))
    draft_batches = draft.get("batches", draft["Propose_calls"] / draft["rows_per_batch_mean"])
    rows = draft["Propose_calls"] / draft_batches
    k_mean = draft.get("draft_tokens", k * draft["Propose_calls"]) / draft["Propose_calls"]
    marginal = level["acceptance_marginal"]
    per_batch = drafter.forward_ms(rows, 1 + (marginal[k - 1] if len(marginal) >= k else 0.0), context)
    position, later = 1, k_mean - 1
    while later > 0:
        per_batch += min(1.0, later) * drafter.forward_ms(rows, 1, context + position)
        position, later = position + 1, later - 1
    draft_ms = sum(drafter.forward_ms(1, r["prompt_tokens"] + 1, 0) for r in requests) + draft_batches * per_batch
    return {"draft": draft_ms / 1e3, "verify": verify_ms / 1e3}


def service_cpu(level: dict, idle_cores: dict[str, float], tables: dict[str, CostTable], k: int) -> dict[str, dict[str, float]]:
    """Measured, per level and service (draft, verify): the process's CPU (/proc utime + stime), less
    its idle rate over the level's wall time, less its forwards' CPU (`forwards_cpu_s`), over the RPCs
    it handled (the metrics' counts, GetInfo health checks aside: they are in the idle rate):
    `ms_per_call` (negative when the tables price the forwards above the whole process). Split by
    thread where recorded: the engine thread's CPU less the forwards', over the Propose / Verify calls
    (`engine_ms_per_call`: sampling, acceptance, KV bookkeeping), and the other threads' (the asyncio
    loop, gRPC) less the idle rate, over every RPC (`rpc_ms_per_call`). The `sim_*` values, what the
    simulation gets, are floored at 0."""
    forwards = forwards_cpu_s(level, tables, k)
    out = {}
    for name, batched in (("draft", "Propose_calls"), ("verify", "Verify_calls")):
        service = level["services"][name]
        calls = sum(count for key, count in service.items() if key.endswith("_calls") and not key.startswith(NOT_MESSAGES))
        cpu_s, idle_s = level["cpu"]["process_cpu_s"][name], idle_cores.get(name, 0.0) * level["wall_s"]
        ms = (cpu_s - idle_s - forwards[name]) / calls * 1e3
        d = {"cpu_s": cpu_s, "idle_s": idle_s, "forwards_cpu_s": forwards[name], "calls": calls, "ms_per_call": ms,
             "sim_ms_per_call": max(0.0, ms)}
        engine_s = level["cpu"].get("engine_thread_cpu_s", {}).get(name)
        if engine_s is not None:
            engine_ms = (engine_s - forwards[name]) / service[batched] * 1e3
            rpc_ms = (cpu_s - engine_s - idle_s) / calls * 1e3
            d.update({"engine_thread_cpu_s": engine_s, "batched_calls": service[batched], "engine_ms_per_call": engine_ms,
                      "rpc_ms_per_call": rpc_ms, "sim_engine_ms_per_call": max(0.0, engine_ms), "sim_rpc_ms_per_call": max(0.0, rpc_ms)})
        out[name] = d
    return out


def fit_latency(make_configs, target_tokens_per_s: float, high: float = 500.0) -> float:
    """The value (per-message latency in ms, or background threads) at which the simulated c = 1 runs
    (`make_configs(value)`: one config per repeat; their median tokens/s) match the measured tokens/s;
    `high` when even that is too fast, 0 when even 0 is too slow."""
    low = 0.0
    for _ in range(24):
        mid = (low + high) / 2
        if statistics.median(simulate_level(config)["tokens_per_s"] for config in make_configs(mid)) > target_tokens_per_s:
            low = mid
        else:
            high = mid
    return (low + high) / 2


METRIC = re.compile(r'^specmesh_(request_seconds_sum|request_seconds_count|batch_size_sum|batch_size_count|batch_tokens_sum|'
                    r'forwards_total|draft_tokens_total|ahead_served_tokens|ahead_dropped_tokens)(?:\{method="(\w+)"\})? (\S+)$')


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
    """Per level: mean RPC seconds by method (ms) and calls; engine batches, mean rows and (Verify)
    tokens per row; draft tokens proposed."""
    diff = {key: after[key] - before.get(key, 0.0) for key in after}
    out = {}
    for key, count in diff.items():
        if key.startswith("request_seconds_count/") and count > 0:
            method = key.split("/", 1)[1]
            out[f"{method}_ms_mean"] = diff[f"request_seconds_sum/{method}"] / count * 1e3
            out[f"{method}_calls"] = count
    if diff.get("batch_size_count", 0) > 0:
        out["rows_per_batch_mean"] = diff["batch_size_sum"] / diff["batch_size_count"]
        out["batches"] = diff["batch_size_count"]
        if diff.get("batch_tokens_sum", 0) > 0:
            out["tokens_per_row_mean"] = diff["batch_tokens_sum"] / diff["batch_size_sum"]
    if "draft_tokens_total" in diff:
        out["draft_tokens"] = diff["draft_tokens_total"]
    for name in ("ahead_served_tokens", "ahead_dropped_tokens"):
        if name in diff:
            out[name] = diff[name]
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
    parser.add_argument("--repeats", type=int, default=2, help="run the live levels this many times (interleaved); "
                        "the comparison takes the medians")
    parser.add_argument("--quick", action="store_true", help="concurrency 1 4, 2 requests per client, 32 new tokens")
    parser.add_argument("--draft-ahead", action="store_true", help="the Draft service drafts ahead (`draft_ahead`), and "
                        "so does the simulated one; results in sim_validate_ahead.{md,json} unless --name says otherwise")
    parser.add_argument("--tables-from", metavar="JSON", help="take the cost tables (and their profile's CPU figures) from "
                        "this results file instead of profiling again (validation runs of one calibration)")
    parser.add_argument("--name", help="results file stem under bench/results (default sim_validate[_ahead])")
    parser.add_argument("--summarize", metavar="JSON", nargs="+", help="no run: one table of these results files' errors "
                        "(the main host model), each run against the 15%% goal; writes sim_validate_runs.{md,json}")
    parser.add_argument("--resimulate", metavar="JSON", help="skip the profile and the live run: simulate again the tables and "
                        "live levels kept in this results file (e.g. after a simulator change)")
    parser.add_argument("--forward-loop", nargs=6, metavar=("MODEL", "DTYPE", "TOKENS", "CPU", "START", "ACTIVE"),
                        help=argparse.SUPPRESS)  # one process of measure_contention
    args = parser.parse_args()
    if args.forward_loop:
        folder, dtype, tokens, cpu, start_at, active = args.forward_loop
        print(json.dumps(forward_loop(folder, dtype, int(tokens), int(cpu), float(start_at), active)))
        return 0
    if args.summarize:
        summarize([Path(p) for p in args.summarize])
        return 0
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
                 "draft_ahead": args.draft_ahead, "draft_shares_kv": True, "name": args.name or ("sim_validate_ahead" if args.draft_ahead else "sim_validate"),
                 "load_average_before": os.getloadavg(), "quick": args.quick, "repeats": args.repeats,
                 "max_new_tokens": args.max_new_tokens, "requests_per_client": args.requests_per_client, "levels": []}
    with tempfile.TemporaryDirectory() as tmp:
        if args.tables_from:
            kept = json.loads(Path(args.tables_from).read_text())
            out["tables"], out["profile_cpu"], out["tables_from"] = kept["tables"], kept.get("profile_cpu", {}), args.tables_from
            out["memory_contention"] = kept.get("memory_contention", {"c": 0.0, "why": "not in the tables' file"})
        else:
            tables, out["profile_cpu"] = profile_tables(folder, args.threads, max(prompt_lengths), args.max_new_tokens,
                                                        max(args.concurrency), Path(tmp))
            out["tables"] = {role: json.loads(Path(path).read_text()) for role, path in tables.items()}
            out["memory_contention"] = measure_contention(folder, args.k, args.threads)
            print(f"memory contention: {out['memory_contention']}", flush=True)
        if args.draft_ahead:  # how the live Draft service drafts ahead (the first draft ahead feeds 1 or 2 tokens)
            out["draft_steps_equal_chains"] = steps_equal_chains(folder, "bfloat16")
        RESULTS.mkdir(parents=True, exist_ok=True)
        common = {"model": folder, "port": 0, "torch_threads": args.threads, "metrics_port": 0}
        cluster_yaml = Path(tmp) / "cluster.yaml"
        cluster_yaml.write_text(yaml.safe_dump({"defaults": {"device": "cpu", "host": "127.0.0.1"}, "services": {
            "draft": {"kind": "draft", "drafter": "model", "dtype": "bfloat16", "draft_ahead": args.draft_ahead, **common},
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
            for repeat, c in ((r, c) for r in range(args.repeats) for c in args.concurrency):
                before = {name: scrape(url) for name, url in metrics_urls.items()}
                load_before = os.getloadavg()[0]
                cpu_before = {name: process_cpu_s(pid) for name, pid in pids.items()}
                threads_before = {name: thread_cpu_s(pids[name]) for name in ("draft", "verify")}
                meter.start()
                sampler.start()
                rows, wall_s = asyncio.run(live_level(address, prompts, c, args.requests_per_client, args.k, args.max_new_tokens))
                cpu = {**meter.stop(), **sampler.stop()}
                cpu["process_cpu_s"] = {name: process_cpu_s(pid) - cpu_before[name] for name, pid in pids.items()}
                cpu["engine_thread_cpu_s"] = {name: engine_thread_cpu_s(pids[name], before_threads, thread_cpu_s(pids[name]))
                                              for name, before_threads in threads_before.items()}
                services = {name: service_means(before[name], scrape(url)) for name, url in metrics_urls.items()}
                done = [r for r in rows if not r.error]
                per_position: list[int] = []
                num_drafts = sum(r.num_drafts for r in done)
                for r in done:
                    for i, count in enumerate(int(x) for x in r.accepted_per_position.split()):
                        per_position.extend([0] * (i + 1 - len(per_position)))
                        per_position[i] += count
                live.append({"clients": c, "repeat": repeat, "tokens_per_s": sum(r.num_tokens for r in done) / wall_s,
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
                print(f"live c={c} (repeat {repeat + 1} of {args.repeats}): {live[-1]['tokens_per_s']:.1f} tok/s, p50 {live[-1]['p50_s']:.2f} s, cpu {cpu}, {services}", flush=True)

        out["live"] = live
        (RESULTS / f"{out['name']}.json").write_text(json.dumps(out, indent=1) + "\n")  # the live data, kept even if the sim fails
        compare(out)
    return 0


VARIANTS = {  # how the simulated host sees the rest of the machine's load (everything but the services' forwards)
    "measured_cpu": "every process's CPU outside the forwards on the host's cores, as measured in each level (not fitted): the "
                    "Coordinator's and the bench client's per message, the Draft and Verify services' per call (`service_cpu`) "
                    "as a job on each service's RPC thread",
    "measured_cpu_by_thread": "as the main variant, with each service's CPU per call split as measured by thread: the engine "
                              "thread's (less the forwards') added to each call's batch, the other threads' on the RPC thread",
    "process_cpu": "the Coordinator's and the bench client's CPU on the host's cores, at their CPU per message measured in "
                   "each level (/proc utime + stime over the messages handled; not fitted); the services' only in their forwards",
    "alone": "the host's cores are the cluster's alone (the Coordinator's and the client's CPU only in the per-message latency)",
    "measured_load": "plus the other users' CPU use during the level (/proc: all busy CPU less the cluster's and the bench's) as background threads",
    "measured_demand": "plus the other load's demand during the level (runnable threads not of the Draft / Verify services, "
                       "sampled every 0.2 s) as background threads",
    "fitted_background": "DIAGNOSTIC, not the issue's protocol: the per-message latency measured at c = 1 (live round - Propose - "
                         "Verify, over 4 messages) and the background threads fitted at c = 1 instead, held for c = 4 and 16",
}
FIGURES = ("tokens_per_s", "p50_s", "p95_s", "ttft_p50_s", "round_ms_mean")  # compared live (median) against the sim


def by_clients(live: list[dict]) -> list[list[dict]]:
    """The live levels grouped by concurrency (one per repeat), in the order first run."""
    groups: dict[int, list[dict]] = {}
    for level in live:
        groups.setdefault(level["clients"], []).append(level)
    return list(groups.values())


def live_figures(group: list[dict]) -> dict[str, float]:
    """Medians over a concurrency's repeats: the compared figures and the services' metrics."""
    def median(values) -> float:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else float("nan")

    figures = {key: median(level[key] for level in group) for key in FIGURES}
    for name, service, key in (("propose_ms", "draft", "Propose_ms_mean"), ("verify_ms", "verify", "Verify_ms_mean"),
                               ("draft_rows", "draft", "rows_per_batch_mean"), ("verify_rows", "verify", "rows_per_batch_mean"),
                               ("draft_open_ms", "draft", "OpenSession_ms_mean"), ("draft_close_ms", "draft", "CloseSession_ms_mean"),
                               ("verify_close_ms", "verify", "CloseSession_ms_mean"),
                               ("ahead_served", "draft", "ahead_served_tokens"), ("ahead_dropped", "draft", "ahead_dropped_tokens")):
        figures[name] = median(level["services"].get(service, {}).get(key) for level in group)
    return figures


def median_dict(dicts: list) -> dict | None:
    """Key by key, the median of dicts of numbers (nested dicts alike); None when they are None."""
    if dicts[0] is None:
        return None
    return {key: median_dict([d[key] for d in dicts]) if isinstance(dicts[0][key], dict) else statistics.median(d[key] for d in dicts)
            for key in dicts[0]}


def variant_applies(variant: str, live: list[dict]) -> bool:
    """Whether the results hold what the variant needs (older results files lack some measurements)."""
    cpu = [level.get("cpu", {}) for level in live]
    if variant in ("measured_load", "measured_demand"):
        return all({"measured_load": "others_cores", "measured_demand": "others_runnable"}[variant] in c for c in cpu)
    if variant == "process_cpu":
        return all("process_cpu_s" in c for c in cpu)
    if variant in ("measured_cpu", "measured_cpu_by_thread"):
        return all("draft" in c.get("process_cpu_s", {}) and "Propose_calls" in level["services"].get("draft", {})
                   and "Verify_calls" in level["services"].get("verify", {})
                   and (variant == "measured_cpu" or "engine_thread_cpu_s" in c) for c, level in zip(cpu, live))
    if variant == "fitted_background":
        return "Propose_ms_mean" in live[0]["services"].get("draft", {})
    return True


def variant_inputs(variant: str, level: dict, out: dict, cost_tables: dict[str, CostTable], fitted_background: float) -> dict:
    """`sim_config`'s keyword arguments for a level under a variant: the other load and the processes' CPU."""
    idle = out.get("idle_cores", {})
    if variant == "measured_cpu":
        return {"cpu_ms_per_message": cpu_ms_per_message(level, idle),
                "cpu_ms_per_call": {name: v["sim_ms_per_call"] for name, v in service_cpu(level, idle, cost_tables, out["k"]).items()}}
    if variant == "measured_cpu_by_thread":
        services = service_cpu(level, idle, cost_tables, out["k"])
        return {"cpu_ms_per_message": cpu_ms_per_message(level, idle),
                "cpu_ms_per_call": {name: v["sim_rpc_ms_per_call"] for name, v in services.items()},
                "engine_ms_per_call": {name: v["sim_engine_ms_per_call"] for name, v in services.items()}}
    if variant == "process_cpu":
        return {"cpu_ms_per_message": cpu_ms_per_message(level, idle)}
    if variant == "measured_load":
        return {"background_threads": level["cpu"]["others_cores"]}
    if variant == "measured_demand":
        return {"background_threads": level["cpu"]["others_runnable"]}
    if variant == "fitted_background":
        return {"background_threads": fitted_background}
    return {}


def with_spread(group: list[dict], key: str, fmt: str, scale: float = 1.0) -> str:
    """The live median, and the repeats' min-max when there are several."""
    values = [level[key] * scale for level in group]
    text = format(statistics.median(values), fmt)
    return f"{text} ({format(min(values), fmt)}-{format(max(values), fmt)})" if len(values) > 1 else text


def measured_cpu_table(out: dict, result: dict) -> list[str]:
    """The measured CPU outside the forwards per level (medians over the repeats), and the CPU live and in the sim."""
    idle = out.get("idle_cores", {})
    lines = ["The CPU outside the forwards, measured per level (medians over the repeats; /proc utime + stime over the level). "
             "Per service: the process's CPU, less its idle rate (over "
             f"{IDLE_S:.0f} s with no request before the levels: Draft {idle.get('draft', 0.0):.3f} cores, Verify "
             f"{idle.get('verify', 0.0):.3f}), less its forwards' CPU (`forwards_cpu_s`: the metrics' batches priced by the profile "
             "tables) = the rest, over the RPCs it handled (OpenSession, Propose / Verify, CloseSession): ms per RPC, what the main "
             "variant gives each RPC thread (a negative rest, the tables pricing the forwards above the whole process, as 0). "
             "By thread (/proc/<pid>/task): the engine thread's CPU less the forwards', per Propose / Verify call, and the other "
             "threads' less the idle rate, per RPC (the by-thread variant's inputs).", "",
             "| clients | service | CPU s | idle s | forwards s | rest s | RPCs | ms per RPC | engine thread s | engine - forwards, ms per call "
             "| other threads - idle, ms per RPC |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for lv in result["levels"]:
        for name in ("draft", "verify"):
            d = lv["service_cpu"][name]
            split = (f"{d['engine_thread_cpu_s']:.2f} | {d['engine_ms_per_call']:.2f} | {d['rpc_ms_per_call']:.2f}"
                     if "engine_thread_cpu_s" in d else "- | - | -")
            lines.append(f"| {lv['clients']} | {name} | {d['cpu_s']:.2f} | {d['idle_s']:.2f} | {d['forwards_cpu_s']:.2f} | "
                         f"{d['cpu_s'] - d['idle_s'] - d['forwards_cpu_s']:+.2f} | {d['calls']:.0f} | {d['ms_per_call']:.2f} | {split} |")
    lines += ["", "The Coordinator's and the client's CPU per message (`cpu_ms_per_message`, net of idle: Coordinator "
              f"{idle.get('coordinator', 0.0):.3f} cores, bench {idle.get('bench', 0.0):.3f}); the two services' CPU live (over the "
              "level's wall time) against the sim's forwards and RPC threads (over its makespan).", "",
              "| clients | Coordinator / client ms per message | Draft + Verify cores live / sim (of which RPC threads) |", "|---:|---:|---:|"]
    for lv in result["levels"]:
        b, per_message = lv["sim"], lv["cpu_ms_per_message"]
        rpc_cores = sum(value for key, value in b.items() if key.endswith("/rpc_cores"))
        sim_cores = b["core_utilisation"] * out["cores"] - b.get("coordinator_cores", 0.0) - b.get("clients_cores", 0.0)
        lines.append(f"| {lv['clients']} | {per_message['coordinator']:.2f} / {per_message['clients']:.2f} | "
                     f"{lv['services_cores_live']:.2f} / {sim_cores:.2f} ({rpc_cores:.2f}) |")
    return [*lines, ""]


def reading(out: dict) -> list[str]:
    """What the main variant's measurements say, in figures of this run."""
    if "measured_cpu" not in out["variants"]:
        return []
    main, levels = out["variants"]["measured_cpu"], out["variants"]["measured_cpu"]["levels"]
    per_call = {name: [lv["service_cpu"][name]["ms_per_call"] for lv in levels] for name in ("draft", "verify")}
    top = levels[-1]
    lines = [f"The main variant adds the Draft and Verify services' CPU outside their forwards, measured: Draft "
             f"{min(per_call['draft']):.2f} to {max(per_call['draft']):.2f} ms per call, Verify {min(per_call['verify']):.2f} to "
             f"{max(per_call['verify']):.2f} ms over the levels (c = {', '.join(str(lv['clients']) for lv in levels)}: Draft "
             f"{', '.join(f'{v:.2f}' for v in per_call['draft'])}; Verify {', '.join(f'{v:.2f}' for v in per_call['verify'])}). "
             f"The residual per-message latency fitted at c = 1 is {main['fitted_latency_ms']:.2f} ms"]
    if "process_cpu" in out["variants"]:
        other = out["variants"]["process_cpu"]
        lines[0] += (f", against {other['fitted_latency_ms']:.2f} ms with the Coordinator's and client's CPU only; at c = {top['clients']} "
                     f"tok/s / p50 / p95 errors go from {other['levels'][-1]['error']['tokens_per_s']:+.0%} / "
                     f"{other['levels'][-1]['error']['p50_s']:+.0%} / {other['levels'][-1]['error']['p95_s']:+.0%} to "
                     f"{top['error']['tokens_per_s']:+.0%} / {top['error']['p50_s']:+.0%} / {top['error']['p95_s']:+.0%}")
    if "measured_cpu_by_thread" in out["variants"]:
        split = out["variants"]["measured_cpu_by_thread"]["levels"]
        engine = {name: [lv["service_cpu"][name]["engine_ms_per_call"] for lv in split] for name in ("draft", "verify")}
        lines[0] += (f". By thread, the engine threads' share is Draft {', '.join(f'{v:.2f}' for v in engine['draft'])} and Verify "
                     f"{', '.join(f'{v:.2f}' for v in engine['verify'])} ms per Propose / Verify call; with it on the engine threads "
                     f"(the by-thread variant) c = {split[-1]['clients']} errors are {split[-1]['error']['tokens_per_s']:+.0%} / "
                     f"{split[-1]['error']['p50_s']:+.0%} / {split[-1]['error']['p95_s']:+.0%}")
    lines[0] += (f". What is left at c = {top['clients']} in the main variant: the sim's mean round {top['error']['round_ms_mean']:+.0%} "
                 f"and TTFT {top['error']['ttft_p50_s']:+.0%} against live.")
    live = top["live"]
    lines += ["", "The session calls on the request's path: the client's stream ends only after the Coordinator's CloseSession "
              "calls (Verify, then Draft; its driver closes in `finally`), and the Draft.OpenSession after the first token is "
              "awaited before the first Propose; each runs on its service's engine thread, queued behind forwards. At c = "
              f"{top['clients']} the services' metrics give them {live['verify_close_ms']:.0f} + {live['draft_close_ms']:.0f} ms "
              f"(closes) and {live['draft_open_ms']:.0f} ms (Draft open) per request, against a live p50 of "
              f"{live['p50_s'] * 1e3:.0f} ms; the sim has them too (a turn of no work on each engine, since 2026-11-28).", ""]
    return lines


def compare(out: dict) -> None:
    """Per variant: fit on c = 1, simulate every level (each repeat); write the JSON and the markdown tables."""
    live = out["live"]
    groups = by_clients(live)
    first = groups[0]
    out["variants"] = {}
    cost_tables = {role: CostTable.from_json(table) for role, table in out["tables"].items()}
    with tempfile.TemporaryDirectory() as tmp:
        tables = {}
        for role, table in out["tables"].items():
            tables[role] = str(Path(tmp) / f"{role}.json")
            Path(tables[role]).write_text(json.dumps(table))
        for variant in VARIANTS:
            if not variant_applies(variant, live):
                continue
            fitted_background, first_live = 0.0, live_figures(first)
            if variant == "fitted_background":
                latency_ms = max(0.0, (first_live["round_ms_mean"] - first_live["propose_ms"] - first_live["verify_ms"]) / 4)
                fitted_background = fit_latency(lambda threads, ms=latency_ms: [sim_config(out, tables, lv, ms, threads) for lv in first],
                                                first_live["tokens_per_s"], high=32.0)
            inputs = {id(lv): variant_inputs(variant, lv, out, cost_tables, fitted_background) for lv in live}
            if variant != "fitted_background":
                latency_ms = fit_latency(lambda ms, inputs=inputs: [sim_config(out, tables, lv, ms, **inputs[id(lv)]) for lv in first],
                                         first_live["tokens_per_s"])
            levels = []
            for group in groups:
                sims = [simulate_level(sim_config(out, tables, lv, latency_ms, **inputs[id(lv)])) for lv in group]
                keys = {key: None for s in sims for key in s}  # a process's cores only where it ran in that repeat
                sim = {key: statistics.median(s.get(key, 0.0) for s in sims) for key in keys}
                figures = live_figures(group)
                given = [inputs[id(lv)] for lv in group]
                level = {"clients": group[0]["clients"], "repeats": len(group), "live": figures,
                         "live_spread": {key: [min(lv[key] for lv in group), max(lv[key] for lv in group)] for key in FIGURES},
                         "sim": sim, "sim_repeats": sims, "error": {key: sim[key] / figures[key] - 1 for key in FIGURES},
                         "fitted_here": group is first,
                         "background_threads": statistics.median(g.get("background_threads", 0.0) for g in given),
                         "cpu_ms_per_message": median_dict([g.get("cpu_ms_per_message") for g in given]),
                         "cpu_ms_per_call": median_dict([g.get("cpu_ms_per_call") for g in given]),
                         "engine_ms_per_call": median_dict([g.get("engine_ms_per_call") for g in given])}
                if variant in ("measured_cpu", "measured_cpu_by_thread"):
                    level["service_cpu"] = median_dict([service_cpu(lv, out.get("idle_cores", {}), cost_tables, out["k"]) for lv in group])
                    level["services_cores_live"] = statistics.median(
                        (lv["cpu"]["process_cpu_s"]["draft"] + lv["cpu"]["process_cpu_s"]["verify"]) / lv["wall_s"] for lv in group)
                levels.append(level)
            out["variants"][variant] = {"fitted_latency_ms": latency_ms, "levels": levels}
    name = out.get("name", "sim_validate")  # results files before --name: sim_validate
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=1) + "\n")

    def cpu_note(group: list[dict]) -> str:
        cpus = [level.get("cpu") for level in group]
        if not all(cpus):
            return ""
        demand = (f", {statistics.median(c['others_runnable'] for c in cpus):.2f} other runnable threads"
                  if all("others_runnable" in c for c in cpus) else "")
        return (f"c = {group[0]['clients']}: {statistics.median(c['others_cores'] for c in cpus):.2f} others' / "
                f"{statistics.median(c['ours_cores'] for c in cpus):.2f} ours{demand}")

    profile_cpu = out.get("profile_cpu", {})
    replayed = ("sizes and accepted tokens per round" if live[0]["requests"][0].get("accepted_per_position") is not None
                else "sizes, and each request's accepted total over its rounds")
    slowed = ", ".join(f"{role} {table['meta'].get('wall_over_cpu', float('nan')):.2f}" for role, table in out["tables"].items())
    loads = ", ".join(f"{level['load_average_1m'][0]:.1f}" for level in live)
    repeats = max(len(group) for group in groups)
    flags = ((" --quick" if out["quick"] else "") + (f" --repeats {repeats}" if repeats != 2 else "")
             + (" --draft-ahead" if out.get("draft_ahead") else "")
             + (f" --tables-from {out['tables_from']}" if out.get("tables_from") else "")
             + (f" --name {name}" if name not in ("sim_validate", "sim_validate_ahead") else ""))
    lines = ["# Simulator vs the live cluster", "",
             f"`.venv/bin/python bench/sim_validate.py{flags}`: default model, Draft (bf16 self-draft"
             f"{', drafting ahead: the simulated one too, guess rate from the measured acceptance' if out.get('draft_ahead') else ''}) + "
             f"Verify (fp32) + Coordinator on loopback, {out['threads']} torch thread(s) per model process, k = {out['k']}, greedy, "
             f"{out['requests_per_client']} requests per client, up to {out['max_new_tokens']} new tokens; the levels run {repeats} "
             f"time(s), interleaved: live figures are the medians over the repeats (min-max in brackets), each repeat is simulated "
             f"with its own requests and measured inputs and the sim figure is the median. Simulated as one host of "
             f"{out['cores']} cores (processor sharing, specmesh/sim/servers.py), the measured requests replayed in start order "
             f"({replayed}). Cost tables: {out['tables']['target']['meta'].get('clock', 'wall')} time (the profile's wall / cpu: "
             f"{slowed}). Machine load (1-min average) before the profile {out['load_average_before'][0]:.1f}, before each level: "
             f"{loads}.", ""]
    slowdown = out.get("memory_contention", {}).get("slowdown")
    if slowdown:
        lines += [f"Memory contention (`measure_contention`): side by side on two cores the verify forward ran "
                  f"{slowdown['verify']:.2f}x and the draft forward {slowdown['draft']:.2f}x their time alone; the simulated "
                  f"host's memory_contention c = {host_contention(out):.2f} (specmesh/sim/servers.py).", ""]
    if profile_cpu or any("cpu" in level for level in live):
        others = ", ".join(f"{role} {cpu['others_cores']:.2f}" for role, cpu in profile_cpu.items())
        lines += [f"CPU in use (cores) on this {out['cores']}-core machine, from /proc: other users' during the profile: {others}; "
                  f"during the live levels (medians): {'; '.join(cpu_note(group) for group in groups)}.", ""]
    for variant, result in out["variants"].items():
        fitted = (f"per-message latency {result['fitted_latency_ms']:.2f} ms (measured), background {result['levels'][0]['background_threads']:.2f} "
                  "threads (fitted)" if variant == "fitted_background" else f"per-message latency {result['fitted_latency_ms']:.2f} ms")
        lines += [f"## Host model: {VARIANTS[variant]}", "", f"Fitted on c = 1: {fitted}.", "",
                  "| clients | live tok/s | sim tok/s | error | live p50 s | sim p50 s | error | live p95 s | sim p95 s | error |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for group, lv in zip(groups, result["levels"]):
            b, e = lv["sim"], lv["error"]
            lines.append(f"| {lv['clients']}{' (fit)' if lv['fitted_here'] else ''} | {with_spread(group, 'tokens_per_s', '.1f')} | "
                         f"{b['tokens_per_s']:.1f} | {e['tokens_per_s']:+.0%} | {with_spread(group, 'p50_s', '.2f')} | {b['p50_s']:.2f} | "
                         f"{e['p50_s']:+.0%} | {with_spread(group, 'p95_s', '.2f')} | {b['p95_s']:.2f} | {e['p95_s']:+.0%} |")
        lines += ["", "Where the time goes (live: client timings and the services' Prometheus metrics, medians; sim: the same runs "
                  "simulated). Round = (latency - TTFT) / rounds; Propose / Verify = mean RPC time at the service (queue + batch "
                  "window + forward), sim = mean engine time of one batch.", "",
                  "| clients | TTFT p50 live / sim ms | round live / sim ms | Propose live ms / sim draft batch ms | "
                  "Verify live ms / sim verify job ms | rows per draft batch live / sim | rows per verify batch live / sim | sim host cores busy |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for lv in result["levels"]:
            a, b = lv["live"], lv["sim"]
            lines.append(f"| {lv['clients']} | {a['ttft_p50_s'] * 1e3:.0f} / {b['ttft_p50_s'] * 1e3:.0f} | {a['round_ms_mean']:.0f} / "
                         f"{b['round_ms_mean']:.0f} | {a['propose_ms']:.0f} / {b['draft_batch_ms_mean']:.0f} | "
                         f"{a['verify_ms']:.0f} / {b['verify_batch_ms_mean']:.0f} | {a['draft_rows']:.2f} / {b['draft_rows_mean']:.2f} | "
                         f"{a['verify_rows']:.2f} / {b['verify_rows_mean']:.2f} | {b['core_utilisation']:.0%} |")
        lines.append("")
        if out.get("draft_ahead"):
            served = "; ".join(f"c = {lv['clients']}: {lv['live']['ahead_served']:.0f} / {lv['sim']['ahead_served_tokens']:.0f}"
                               for lv in result["levels"])
            dropped = ", ".join(f"{lv['live']['ahead_dropped']:.0f}" for lv in result["levels"])
            lines += [f"Draft tokens served from drafts ahead, live / sim (medians over the repeats): {served}; "
                      f"drafted ahead and dropped live: {dropped}.", ""]
        if variant == "measured_cpu":
            lines += measured_cpu_table(out, result)
    lines += ["## Reading the tables", "", *reading(out),
              "This machine is shared: other users' jobs ran throughout (their CPU use and runnable threads above). The kernel "
              "shares the cores between autogroups (/proc/sys/kernel/sched_autogroup_enabled = 1; the cluster starts each service "
              "in a session of its own), not between threads, so neither the others' CPU use (what they got: too little) nor "
              "their runnable threads (what they asked, counted per thread: too much) is the background a per-thread "
              "processor-sharing host sees; the truth lies between the two variants. With the cores to the cluster alone the "
              "per-message fit has to absorb the other load at c = 1, and cannot carry it to c = 4 and 16. The diagnostic "
              "variant shows what is left once the background is known: it fits the background on c = 1 in place of the "
              "message latency (measured instead, from the services' metrics)."]
    text = "\n".join(lines) + "\n"
    (RESULTS / f"{name}.md").write_text(text)
    print(text)


GOAL = 0.15  # the simulator's figures within 15% of the live ones
COMPARED = ("tokens_per_s", "p50_s", "p95_s")


def summarize(paths: list[Path]) -> None:
    """Validation runs side by side: per run (a results file), the main host model's error on each
    compared figure at each concurrency, and whether all of them are within GOAL."""
    variant = next(iter(VARIANTS))
    runs = []
    for path in paths:
        out = json.loads(path.read_text())
        levels = out["variants"][variant]["levels"]
        errors = {lv["clients"]: {key: lv["error"][key] for key in COMPARED} for lv in levels}
        runs.append({"file": str(path.relative_to(ROOT) if path.is_absolute() else path), "draft_ahead": bool(out.get("draft_ahead")),
                     "errors": errors, "within_goal": all(abs(e) <= GOAL for level in errors.values() for e in level.values()),
                     "worst": max(abs(e) for level in errors.values() for e in level.values()),
                     "live_tokens_per_s": {lv["clients"]: lv["live"]["tokens_per_s"] for lv in levels},
                     "ahead_served": {lv["clients"]: lv["live"].get("ahead_served") for lv in levels}})
    (RESULTS / "sim_validate_runs.json").write_text(json.dumps({"goal": GOAL, "variant": variant, "runs": runs}, indent=1) + "\n")
    clients = sorted({c for run in runs for c in run["errors"]})
    lines = ["# The simulator against the live cluster: validation runs side by side", "",
             f"Command: `.venv/bin/python bench/sim_validate.py --summarize {' '.join(run['file'] for run in runs)}`. Each row is one "
             f"validation run (its own live cluster and requests; its file says how it ran), simulated with the main host model "
             f"({VARIANTS[variant]}). Error = sim / live - 1 on aggregate tokens/s, p50 and p95 latency; the goal: every one within "
             f"{GOAL:.0%}. At 1 client tokens/s is the fitted figure: error 0 unless the fit meets its floor (the sim slower "
             f"than live with no per-message latency at all).", "",
             "| run | draft ahead | " + " | ".join(f"c = {c}: tok/s, p50, p95" for c in clients) + " | worst | within goal |",
             "|---|---|" + "---|" * len(clients) + "---:|---|"]
    for run in runs:
        cells = [", ".join(f"{run['errors'][c][key]:+.0%}" for key in COMPARED) if c in run["errors"] else "" for c in clients]
        lines.append(f"| [{Path(run['file']).stem}]({Path(run['file']).with_suffix('.md').name}) | "
                     f"{'yes' if run['draft_ahead'] else 'no'} | " + " | ".join(cells) + f" | {run['worst']:.0%} | "
                     f"{'yes' if run['within_goal'] else 'NO'} |")
    for ahead in (False, True):
        group = [run for run in runs if run["draft_ahead"] is ahead]
        if group:
            lines.append(f"{'' if ahead else chr(10)}- {'with' if ahead else 'without'} drafting ahead: {sum(r['within_goal'] for r in group)} of "
                         f"{len(group)} runs within {GOAL:.0%}.")
    served = "; ".join(f"{Path(r['file']).stem}: " + ", ".join(f"c = {c}: {v:.0f}" for c, v in r["ahead_served"].items() if v is not None)
                       for r in runs if r["draft_ahead"])
    if served:
        lines.append(f"- draft tokens served from drafts ahead, live: {served}.")
    text = "\n".join(lines) + "\n"
    (RESULTS / "sim_validate_runs.md").write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
