"""Drafting ahead on this machine: the Draft and the Verify process each pinned to a core of its own,
the Draft service drafting ahead or not, against the same algorithm in one process on both cores.

Greedy, default model (fp32 target, bf16 self-draft), k = 4 fixed (so every side runs the same rounds)
and adaptive k, the chat prompts of bench/cluster.py, 64 new tokens, medians over prompts and repeats;
the ratios are per prompt within one repeat, then the median. Rows:
- in-process, 2 threads: target only; bf16 self-draft (k = 4, adaptive)
- cluster, Draft on core 0 and Verify on core 1 (1 thread each): target only; bf16 self-draft k = 4 with
  and without drafting ahead; adaptive k with drafting ahead (the measured costs decide whether to draft)
- cluster, the same placement, each process lending its core to the other while it runs no job
  (`borrow_cpus` both ways, as configs/local.yaml ships; servicekit/core_share.py): target only; bf16
  self-draft k = 4 and adaptive k, taking turns on both cores

    .venv/bin/python bench/draft_ahead.py     # ~10 minutes; writes bench/results/draft_ahead.{json,md}
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from cluster import PROMPTS, default_pair, in_process, through_cluster  # noqa: E402

from client.cluster import Cluster, free_ports  # noqa: E402
from specmesh.drafters.model import self_draft  # noqa: E402
from specmesh.models.chat import chat_prompt_ids  # noqa: E402
from specmesh.proto.v1 import coordinator_pb2  # noqa: E402

REPEATS = int(os.environ.get("SPECMESH_BENCH_REPEATS", "2"))
SPEC, AR = coordinator_pb2.GENERATION_MODE_SPECULATIVE, coordinator_pb2.GENERATION_MODE_AUTOREGRESSIVE
K = 4
# name: (where, coordinator or in-process drafter, mode, k)
ROWS = {
    "target only, in-process": ("local", "none", AR, 0),
    "bf16 self-draft k=4, in-process": ("local", "bf16", SPEC, K),
    "bf16 self-draft adaptive k, in-process": ("local", "bf16", SPEC, 0),
    "target only, cluster": ("cluster", "plain", AR, 0),
    "bf16 self-draft k=4, cluster": ("cluster", "plain", SPEC, K),
    "bf16 self-draft k=4, cluster, drafting ahead": ("cluster", "ahead", SPEC, K),
    "bf16 self-draft adaptive k, cluster, drafting ahead": ("cluster", "ahead", SPEC, 0),
    "target only, cluster, lending cores": ("cluster", "lend", AR, 0),
    "bf16 self-draft k=4, cluster, lending cores": ("cluster", "lend", SPEC, K),
    "bf16 self-draft adaptive k, cluster, lending cores": ("cluster", "lend", SPEC, 0),
}


def config(folder: str) -> dict:
    plain, ahead, verify, lend_draft, lend_verify = free_ports(5)
    draft = {"kind": "draft", "drafter": "model", "dtype": "bfloat16", "model": folder, "cpus": "0"}
    target = {"kind": "verify", "dtype": "float32", "model": folder, "cpus": "1"}
    links = {"kind": "coordinator", "port": 0, "model": folder, "verify_addresses": f"127.0.0.1:{verify}"}
    return {"defaults": {"device": "cpu", "host": "127.0.0.1"}, "services": {
        "draft": {**draft, "port": plain}, "draft-ahead": {**draft, "port": ahead, "draft_ahead": True},
        "verify": {**target, "port": verify},
        # the lending pair borrows from every process pinned to the other core (idle ones lend at once)
        "draft-lend": {**draft, "port": lend_draft, "borrow_cpus": "1"},
        "verify-lend": {**target, "port": lend_verify, "borrow_cpus": "0"},
        "plain": {**links, "draft_addresses": f"127.0.0.1:{plain}"},
        "ahead": {**links, "draft_addresses": f"127.0.0.1:{ahead}"},
        "lend": {**links, "draft_addresses": f"127.0.0.1:{lend_draft}", "verify_addresses": f"127.0.0.1:{lend_verify}"},
    }}


def main() -> None:
    folder, tokenizer, verifier, bf16 = default_pair(2)
    runs: dict[str, list[dict]] = {name: [] for name in ROWS}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cluster.yaml"
        path.write_text(yaml.safe_dump(config(folder)))
        with Cluster.from_yaml(path, log_dir=tmp) as cluster:
            addresses = cluster.addresses
            for coordinator in ("plain", "ahead", "lend"):  # warm-up
                asyncio.run(through_cluster(addresses[coordinator], PROMPTS[0], SPEC, "service", 8, K))
            for repeat in range(REPEATS):
                for prompt in PROMPTS:
                    ids = chat_prompt_ids(tokenizer, prompt)
                    for name, (where, who, mode, k) in ROWS.items():
                        if where == "local":
                            run = in_process(verifier, None if who == "none" else self_draft(bf16, verifier.engine), ids, k)
                        else:
                            run = asyncio.run(through_cluster(addresses[who], prompt, mode, "service" if mode == SPEC else "",
                                                              64, k))
                        run["prompt"], run["repeat"] = prompt, repeat
                        runs[name].append(run)
                print(f"repeat {repeat + 1}/{REPEATS} done", flush=True)

    def ms_per_token(run: dict) -> float:
        return run["wall_s"] * 1e3 / max(1, len(run["tokens"]))

    reference = runs["target only, in-process"]
    base = runs["bf16 self-draft k=4, in-process"]
    rows = []
    for name, name_runs in runs.items():
        exact = all(r["tokens"] == ref["tokens"] for r, ref in zip(name_runs, reference))
        ratios = [ms_per_token(r) / ms_per_token(b) for r, b in zip(name_runs, base)]
        per_prompt = {p: statistics.median(x for x, r in zip(ratios, name_runs) if r["prompt"] == p) for p in PROMPTS}
        rows.append({"row": name, "exact": exact, "ms_per_token": statistics.median(map(ms_per_token, name_runs)),
                     "over_in_process_k4": statistics.median(ratios), "highest_prompt": max(per_prompt.values()),
                     "tokens_per_round": statistics.median(len(r["tokens"]) / r["rounds"] for r in name_runs),
                     "draft_ms_per_round": statistics.median(r["draft_ms_per_round"] for r in name_runs),
                     "verify_ms_per_round": statistics.median(r["verify_ms_per_round"] for r in name_runs)})
        print(f"  {name}: {rows[-1]['ms_per_token']:.1f} ms/token, {rows[-1]['over_in_process_k4']:.3f}x in-process k=4", flush=True)
    out = {"command": ".venv/bin/python bench/draft_ahead.py", "machine": platform.machine(), "cores": os.cpu_count(),
           "repeats": REPEATS, "prompts": PROMPTS, "k": K, "rows": rows, "date": time.strftime("%Y-%m-%d")}
    results = ROOT / "bench" / "results"
    (results / "draft_ahead.json").write_text(json.dumps(out, indent=1))
    lines = ["# Drafting ahead: Draft and Verify on cores of their own vs one process on both", "",
             f"`{out['command']}`: default model, fp32 target, bf16 self-draft, greedy, 64 new tokens, "
             f"{len(PROMPTS)} chat prompts x {REPEATS}; {out['cores']} cores; cluster: Draft pinned to core 0, Verify to core 1, "
             "1 thread each (lending cores: each also runs on the other's core, a thread more, while the other runs no "
             "job); in-process: 2 threads. Ratios: per prompt and repeat over in-process bf16 k=4, median "
             "(highest prompt). Draft / verify ms per round: what the coordinator (or the loop) waited for each.", "",
             "| row | exact | ms/token | / in-process k=4 | highest prompt | tokens/round | draft ms/round | verify ms/round |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['row']} | {r['exact']} | {r['ms_per_token']:.1f} | {r['over_in_process_k4']:.3f} | "
                     f"{r['highest_prompt']:.3f} | {r['tokens_per_round']:.2f} | {r['draft_ms_per_round']:.1f} | "
                     f"{r['verify_ms_per_round']:.1f} |")
    (results / "draft_ahead.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
