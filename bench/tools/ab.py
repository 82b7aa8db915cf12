"""Before/after: run one benchmark script on a base commit and on this tree, interleaved, and compare.

    .venv/bin/python bench/tools/ab.py --base b9ee577 --runs 5 bench/speculative.py --quick

The base commit is checked out into a temporary git worktree. Runs alternate base, this tree, base,
... (so drift in machine speed hits both alike); each run's JSON result (bench/results/NAME.json in
its own tree) is flattened into numeric figures, and the report gives per figure the median of the
runs on each side and the ratio of the medians. Not a test; a tool for a change's closing note.
Writes bench/results/ab_NAME.json and bench/results/ab_NAME.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"


def flatten(value, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a JSON value keyed by their path; list items keyed by index, or by a
    'sessions' / 'case' field when they have one (so rows line up across runs)."""
    out: dict[str, float] = {}
    if isinstance(value, bool):
        return out
    if isinstance(value, (int, float)):
        return {prefix: float(value)}
    if isinstance(value, dict):
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            label = item.get("sessions", item.get("case", index)) if isinstance(item, dict) else index
            out.update(flatten(item, f"{prefix}[{label}]"))
    return out


def run_once(tree: Path, script: str, args: list[str]) -> tuple[dict[str, float], float]:
    start = time.perf_counter()
    subprocess.run([sys.executable, str(tree / script), *args], cwd=tree, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall_s = time.perf_counter() - start
    result = tree / "bench" / "results" / (Path(script).stem + ".json")
    return flatten(json.loads(result.read_text())), wall_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="commit to compare against")
    parser.add_argument("--runs", type=int, default=5, help="runs on each side")
    parser.add_argument("script", help="benchmark script, relative to the repository root")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    args = parser.parse_args()
    name = Path(args.script).stem
    with tempfile.TemporaryDirectory(prefix="specmesh-ab-") as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), args.base], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            runs: dict[str, list[dict[str, float]]] = {"base": [], "head": []}
            walls: dict[str, list[float]] = {"base": [], "head": []}
            for index in range(args.runs):
                for side, tree in (("base", base_tree), ("head", ROOT)):
                    figures, wall_s = run_once(tree, args.script, args.args)
                    runs[side].append(figures)
                    walls[side].append(wall_s)
                    print(f"run {index + 1}/{args.runs} {side}: {wall_s:.0f} s", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, check=False)
    keys = [k for k in runs["head"][0] if all(k in r for r in runs["base"] + runs["head"])]
    rows = []
    for key in keys:
        base = statistics.median(r[key] for r in runs["base"])
        head = statistics.median(r[key] for r in runs["head"])
        rows.append({"figure": key, "base_median": base, "head_median": head,
                     "head_over_base": head / base if base else None})
    head_commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    out = {"script": args.script, "args": args.args, "base": args.base, "head": head_commit, "runs": args.runs,
           "wall_s": walls, "figures": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"ab_{name}.json").write_text(json.dumps(out, indent=2))
    command = " ".join(["bench/tools/ab.py", "--base", args.base, "--runs", str(args.runs), args.script, *args.args])
    lines = [f"# Before/after: {args.script} {' '.join(args.args)}", "",
             f"`{command}`: base {args.base}, head {head_commit} (with uncommitted changes, if any), "
             f"{args.runs} interleaved runs each; medians per figure. Whole-run wall time: base "
             f"{statistics.median(walls['base']):.0f} s, head {statistics.median(walls['head']):.0f} s.", "",
             "| figure | base | head | head / base |", "|---|---|---|---|"]
    lines += [f"| {r['figure']} | {r['base_median']:.4g} | {r['head_median']:.4g} | "
              f"{'' if r['head_over_base'] is None else format(r['head_over_base'], '.3f')} |" for r in rows]
    (RESULTS / f"ab_{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
