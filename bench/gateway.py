"""Gateway benchmark: tokens/s of the OpenAI-compatible gateway's SSE stream vs the Coordinator's gRPC
stream, for one session and for 16 concurrent, in one run.

The cluster runs as in production, one process each: a Verify service (default model, CPU), a
Coordinator (n-gram drafts made in the coordinator) and the gateway. This process is the client of
both paths: gRPC `Generate` straight to the Coordinator, and `POST /v1/completions` with
`stream: true` to the gateway (httpx, every event parsed as JSON). Same prompts, greedy, the same
number of new tokens (ignore_eos), so both paths do the same decoding work; the texts are checked
equal. A repetition runs each path once, back to back (which goes first alternates); the table gives
the medians over repetitions of each path's tokens/s (a wave's tokens over its wall time) and of
the per-repetition ratio, which cancels load that drifts slower than a repetition (shared machines).

Writes bench/results/gateway.json and gateway.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from client.cluster import free_ports, wait_serving  # noqa: E402
from gateway.health import wait_healthy  # noqa: E402 - the package at the root, not this script
from servicekit.channels import open_channel  # noqa: E402
from specmesh.proto.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc  # noqa: E402

MODEL = "default"
TEXTS = [
    "List the planets of the solar system in order: Mercury, Venus, Earth, Mars, Jupiter, Saturn, Uranus, Neptune. "
    "Now list them again in order:",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Monday, Tuesday,",
]
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 600.0


def cpu_s(pid: int) -> float:
    """A process's CPU seconds from /proc (Linux); 0 elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def prompts(n: int) -> list[str]:
    return [TEXTS[i % len(TEXTS)] + f" ({i})" for i in range(n)]


class Processes:
    """Verify, Coordinator and gateway as subprocesses on free loopback ports; logs in a temp dir."""

    def __init__(self, model: str):
        self.log_dir = Path(tempfile.mkdtemp(prefix="specmesh-bench-gateway-"))
        self.procs: list[subprocess.Popen] = []
        self.pids: dict[str, int] = {}
        verify_port, coordinator_port, self.gateway_port = free_ports(3)
        self.verify = f"127.0.0.1:{verify_port}"
        self.coordinator = f"127.0.0.1:{coordinator_port}"
        self.url = f"http://127.0.0.1:{self.gateway_port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        verify = self._start("verify", ["target_service", "--model", model, "--port", self.verify.split(":")[1]], threads=0)
        wait_serving(self.verify, deadline, verify)
        coordinator = self._start("coordinator", ["coordinator", "--model", model, "--port", self.coordinator.split(":")[1],
                                                  "--verify-addresses", self.verify, "--default-drafter", "ngram"])
        wait_serving(self.coordinator, deadline, coordinator)
        gateway = self._start("gateway", ["gateway", "--model", model, "--port", str(self.gateway_port),
                                          "--coordinator", self.coordinator])
        wait_healthy(f"127.0.0.1:{self.gateway_port}", deadline, gateway)

    def _start(self, name: str, args: list[str], threads: int = 1) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        if threads:  # the coordinator and the gateway do no tensor work: leave the cores to the Verify service
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
        log = open(self.log_dir / f"{name}.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        self.pids[name] = proc.pid
        return proc

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds (user + system) each process has used so far, and this one's (the client)."""
        return {**{name: cpu_s(pid) for name, pid in self.pids.items()}, "client": time.process_time()}

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


async def grpc_one(stub, prompt: str, max_tokens: int) -> tuple[str, int, float]:
    request = coordinator_pb2.GenerateRequest(prompt=prompt, sampling=common_pb2.SamplingParams(
        temperature=0.0, max_new_tokens=max_tokens, ignore_eos=True))
    start, first, texts, num_tokens = time.perf_counter(), 0.0, [], 0
    async for response in stub.Generate(request, timeout=REQUEST_TIMEOUT_S):
        if response.token_ids and not first:
            first = time.perf_counter() - start
        texts.append(response.text)
        num_tokens += len(response.token_ids)
    return "".join(texts), num_tokens, first


async def http_one(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[str, int, float]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "specmesh": {"ignore_eos": True}}
    start, first, texts, num_tokens = time.perf_counter(), 0.0, [], 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line:
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                break
            event = json.loads(data)
            for choice in event["choices"]:
                if choice["text"] and not first:
                    first = time.perf_counter() - start
                texts.append(choice["text"])
            if event.get("usage"):
                num_tokens = event["usage"]["completion_tokens"]
    return "".join(texts), num_tokens, first


async def wave(path: str, procs: Processes, batch: list[str], max_tokens: int) -> dict:
    """All of `batch` at once through `path`; aggregate tokens/s over the wave's wall time."""
    cpu_before = procs.cpu_s()
    if path == "grpc":
        async with open_channel(procs.coordinator) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            start = time.perf_counter()
            results = await asyncio.gather(*(grpc_one(stub, p, max_tokens) for p in batch))
            wall_s = time.perf_counter() - start
    else:
        limits = httpx.Limits(max_connections=len(batch), max_keepalive_connections=len(batch))
        async with httpx.AsyncClient(base_url=procs.url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
            start = time.perf_counter()
            results = await asyncio.gather(*(http_one(client, p, max_tokens) for p in batch))
            wall_s = time.perf_counter() - start
    num_tokens = sum(r[1] for r in results)
    cpu_after = procs.cpu_s()
    cpu_ms_per_token = {name: (cpu_after[name] - cpu_before[name]) * 1e3 / num_tokens for name in cpu_after}
    return {"texts": [r[0] for r in results], "tokens": num_tokens, "wall_s": wall_s, "tokens_per_s": num_tokens / wall_s,
            "ttft_ms": statistics.median(r[2] for r in results) * 1e3, "cpu_ms_per_token": cpu_ms_per_token}


def run(procs: Processes, scenarios: list[tuple[int, int]], reps: int) -> dict:
    out: dict = {}
    for path in ("grpc", "http"):  # warm-up: each path once, short
        asyncio.run(wave(path, procs, prompts(4), 8))
    for rep in range(reps):
        for concurrency, max_tokens in scenarios:
            batch = prompts(concurrency)
            order = ("grpc", "http") if rep % 2 == 0 else ("http", "grpc")
            got = {path: asyncio.run(wave(path, procs, batch, max_tokens)) for path in order}
            if got["grpc"]["texts"] != got["http"]["texts"]:
                raise AssertionError(f"the gateway's text differs from the coordinator's at concurrency {concurrency}")
            for path, result in got.items():
                result.pop("texts")
                out.setdefault(str(concurrency), {"max_tokens": max_tokens, "grpc": [], "http": []})[path].append(result)
            print(f"rep {rep}, {concurrency} session(s): grpc {got['grpc']['tokens_per_s']:.1f} tok/s, "
                  f"gateway {got['http']['tokens_per_s']:.1f} tok/s", flush=True)
    for row in out.values():
        for path in ("grpc", "http"):
            row[f"{path}_tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in row[path])
            row[f"{path}_ttft_ms"] = statistics.median(r["ttft_ms"] for r in row[path])
            row[f"{path}_cpu_ms_per_token"] = {name: statistics.median(r["cpu_ms_per_token"][name] for r in row[path])
                                               for name in row[path][0]["cpu_ms_per_token"]}
        row["ratios"] = [h["tokens_per_s"] / g["tokens_per_s"] for g, h in zip(row["grpc"], row["http"])]
        row["ratio"] = statistics.median(row["ratios"])
        row["overhead_pct"] = (1 - row["ratio"]) * 100
    return out


def render_markdown(out: dict) -> str:
    lines = ["# Gateway benchmark", "",
             f"Model {out['model']} (SmolLM2-135M-Instruct), CPU ({out['cpus']} cores), one process each for the Verify "
             "service, the Coordinator (n-gram drafts made there, adaptive k) and the gateway; greedy, ignore_eos. "
             "gRPC: `Generate` straight to the Coordinator; gateway: `POST /v1/completions` with `stream: true`, "
             "every event parsed. Texts equal on both paths. Tokens/s = a wave's tokens / its wall time; medians of "
             f"{out['reps']} repetitions, each running both paths back to back (alternating which goes first); "
             "gateway / gRPC is the median of the per-repetition ratios. Overhead = 1 - that ratio.", "",
             "| sessions | new tokens each | gRPC tokens/s | gateway tokens/s | gateway / gRPC | overhead | "
             "TTFT gRPC ms | TTFT gateway ms |",
             "|---|---|---|---|---|---|---|---|"]
    for concurrency, row in out["results"].items():
        lines.append(f"| {concurrency} | {row['max_tokens']} | {row['grpc_tokens_per_s']:.1f} | {row['http_tokens_per_s']:.1f} | "
                     f"{row['ratio']:.3f}x | {row['overhead_pct']:+.1f}% | {row['grpc_ttft_ms']:.0f} | {row['http_ttft_ms']:.0f} |")
    lines += ["", "CPU per generated token (ms, medians; user + system time of each process during the wave; the "
              "client is this benchmark, parsing protobuf or server-sent events):", "",
              "| sessions | path | verify | coordinator | gateway | client |", "|---|---|---|---|---|---|"]
    for concurrency, row in out["results"].items():
        for path, label in (("grpc", "gRPC"), ("http", "gateway")):
            cpu = row[f"{path}_cpu_ms_per_token"]
            lines.append(f"| {concurrency} | {label} | {cpu['verify']:.2f} | {cpu['coordinator']:.2f} | {cpu['gateway']:.2f} | "
                         f"{cpu['client']:.2f} |")
    lines += ["", "Every repetition (tokens/s, gRPC / gateway):", ""]
    for concurrency, row in out["results"].items():
        pairs = ", ".join(f"{g['tokens_per_s']:.1f} / {h['tokens_per_s']:.1f}" for g, h in zip(row["grpc"], row["http"]))
        lines.append(f"- {concurrency} session(s): {pairs}")
    lines += ["", f"Command: `{out['command']}` ({out['elapsed_s']:.0f} s).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--single-tokens", type=int, default=32, help="new tokens of the one-session runs")
    parser.add_argument("--concurrent", type=int, default=16)
    parser.add_argument("--concurrent-tokens", type=int, default=16, help="new tokens per session of the concurrent runs")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    procs = Processes(args.model)
    try:
        results = run(procs, [(1, args.single_tokens), (args.concurrent, args.concurrent_tokens)], args.reps)
    finally:
        procs.close()
    out = {"model": args.model, "reps": args.reps, "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
           "command": " ".join(["python bench/gateway.py", *(argv if argv is not None else sys.argv[1:])]),
           "elapsed_s": time.perf_counter() - started, "results": results}
    target = ROOT / "bench" / "results"
    target.mkdir(parents=True, exist_ok=True)
    (target / "gateway.json").write_text(json.dumps(out, indent=2))
    text = render_markdown(out)
    (target / "gateway.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
