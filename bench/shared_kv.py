"""The Draft service taking its context's KV from the Verify service's shared cache (`share_kv`,
specmesh/kv/shared.py) against the same Draft service feeding its context, and both against one process.

Placement as `configs/local.yaml` ships it: Draft pinned to core 0, Verify to core 1, each lending its core
to the other while it runs no job. Two Verify services (one shares its cache, one does not) behind two
Coordinators and one Draft service, so both sides of a pair run on the same processes but the Verify's.
Greedy, default model (fp32 target, bf16 self-draft), the chat prompts of bench/cluster.py, 64 new tokens,
k = 4 fixed (both sides run the same rounds) and adaptive k; each prompt's requests run back to back
(the order rotating per repeat), and the ratios are per prompt and repeat, then the median.

    .venv/bin/python bench/shared_kv.py     # ~5 minutes; writes bench/results/shared_kv.{json,md}
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

REPEATS = int(os.environ.get("SPECMESH_BENCH_REPEATS", "3"))
SPEC = coordinator_pb2.GENERATION_MODE_SPECULATIVE
K = 4
SIDES = ("in-process", "cluster, KV taken", "cluster, KV fed")  # in-process: self_draft, which takes the target's KV


def config(folder: str) -> dict:
    draft_port, shared_port, private_port = free_ports(3)
    target = {"kind": "verify", "dtype": "float32", "model": folder, "cpus": "1", "borrow_cpus": "0"}
    links = {"kind": "coordinator", "port": 0, "model": folder, "draft_addresses": f"127.0.0.1:{draft_port}"}
    return {"defaults": {"device": "cpu", "host": "127.0.0.1"}, "services": {
        "draft": {"kind": "draft", "drafter": "model", "dtype": "bfloat16", "model": folder, "cpus": "0", "borrow_cpus": "1",
                  "port": draft_port},
        "verify-shared": {**target, "port": shared_port},
        "verify-private": {**target, "port": private_port, "share_kv": False},
        "taken": {**links, "verify_addresses": f"127.0.0.1:{shared_port}"},
        "fed": {**links, "verify_addresses": f"127.0.0.1:{private_port}"},
    }}


def main() -> None:
    folder, tokenizer, verifier, bf16 = default_pair(2)
    runs: dict[tuple[str, int], list[dict]] = {(side, k): [] for side in SIDES for k in (K, 0)}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cluster.yaml"
        path.write_text(yaml.safe_dump(config(folder)))
        with Cluster.from_yaml(path, log_dir=tmp) as cluster:
            addresses = {"cluster, KV taken": cluster.addresses["taken"], "cluster, KV fed": cluster.addresses["fed"]}
            for address in addresses.values():  # warm-up
                asyncio.run(through_cluster(address, PROMPTS[0], SPEC, "service", 8, K))
            for repeat in range(REPEATS):
                for p, prompt in enumerate(PROMPTS):
                    ids = chat_prompt_ids(tokenizer, prompt)
                    for k in (K, 0):
                        turn = (repeat + p) % len(SIDES)
                        for side in SIDES[turn:] + SIDES[:turn]:
                            if side == "in-process":
                                run = in_process(verifier, self_draft(bf16, verifier.engine), ids, k, plain_stretches=True)
                            else:
                                run = asyncio.run(through_cluster(addresses[side], prompt, SPEC, "service", 64, k))
                            run["prompt"] = prompt
                            runs[side, k].append(run)
                print(f"repeat {repeat + 1}/{REPEATS} done", flush=True)

    def ms_per_token(run: dict) -> float:
        return run["wall_s"] * 1e3 / max(1, len(run["tokens"]))

    def paired(a: list[dict], b: list[dict]) -> tuple[float, float, float]:
        ratios = sorted(ms_per_token(x) / ms_per_token(y) for x, y in zip(a, b))
        return ratios[0], statistics.median(ratios), ratios[-1]

    rows = []
    for k in (K, 0):
        reference = runs["in-process", k]
        for side in SIDES:
            mine = runs[side, k]
            rows.append({"side": side, "k": k or "adaptive", "exact": all(r["tokens"] == x["tokens"] for r, x in zip(mine, reference)),
                         "ms_per_token": statistics.median(map(ms_per_token, mine)),
                         "over_in_process": paired(mine, reference),
                         "taken_over_fed": paired(mine, runs["cluster, KV fed", k]) if side == "cluster, KV taken" else None,
                         "tokens_per_round": statistics.median(len(r["tokens"]) / r["rounds"] for r in mine),
                         "draft_ms_per_round": statistics.median(r["draft_ms_per_round"] for r in mine),
                         "verify_ms_per_round": statistics.median(r["verify_ms_per_round"] for r in mine)})
            print(f"  k={k or 'adaptive'} {side}: {rows[-1]['ms_per_token']:.1f} ms/token, "
                  f"{rows[-1]['over_in_process'][1]:.3f}x in-process", flush=True)
    out = {"command": ".venv/bin/python bench/shared_kv.py", "machine": platform.processor() or platform.machine(),
           "cores": os.cpu_count(), "repeats": REPEATS, "prompts": PROMPTS, "rows": rows, "date": time.strftime("%Y-%m-%d %H:%M")}
    results = ROOT / "bench" / "results"
    (results / "shared_kv.json").write_text(json.dumps(out, indent=1))
    lines = ["# The Draft service taking the target's KV from the Verify service's shared cache", "",
             f"`{out['command']}` ({out['date']}): default model, fp32 target, bf16 self-draft, greedy, 64 new tokens, "
             f"{len(PROMPTS)} chat prompts x {REPEATS}; {out['cores']} cores; cluster as configs/local.yaml places it (Draft on "
             "core 0, Verify on core 1, each lending its core while it runs no job); in-process: 2 threads, the self-draft "
             "taking the target's KV. Ratios of ms per token, per prompt and repeat (requests back to back): "
             "lowest / median / highest.", "",
             "| k | side | exact | ms/token | / in-process | KV taken / KV fed | tokens/round | draft ms/round | verify ms/round |",
             "|---|---|---|---|---|---|---|---|---|"]

    def spread(r: tuple[float, float, float] | None) -> str:
        return "" if r is None else f"{r[0]:.2f} / **{r[1]:.3f}** / {r[2]:.2f}"

    for r in rows:
        lines.append(f"| {r['k']} | {r['side']} | {r['exact']} | {r['ms_per_token']:.1f} | {spread(r['over_in_process'])} | "
                     f"{spread(r['taken_over_fed'])} | {r['tokens_per_round']:.2f} | {r['draft_ms_per_round']:.1f} | "
                     f"{r['verify_ms_per_round']:.1f} |")
    (results / "shared_kv.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
