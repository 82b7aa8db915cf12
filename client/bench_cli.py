"""`specmesh bench`: concurrent sessions through the coordinator, measured from the client.

    specmesh bench [--prompts FILE] --concurrency 1 4 16 [--requests 32 | --duration-s 30] [--out DIR]
                   [--mode ...] [--drafter ...] [--k N] [--temperature X] [--max-new-tokens N]

For each concurrency level, N workers each run one request after another (prompts taken in turn
from the file, one per line, or a small built-in set) until the level has run --requests requests
or --duration-s has passed (requests under way then finish). A progress line on stderr; in --out:
  requests.csv   one row per request: latency, time to first token, tokens, tokens/s, acceptance, ...
  summary.json   per level: aggregate tokens/s, latency percentiles, acceptance (per draft position),
                 and the coordinator's GetStats after the run
  *.png          latency CDF, tokens/s vs concurrency (several levels), acceptance per position;
                 only when matplotlib can be imported (it is not a dependency of specmesh)
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from client.cli_common import EXIT_OK, fail, make_client, run_async, sampling_kwargs
from client.coordinator_client import CoordinatorClient, CoordinatorError

DEFAULT_PROMPTS = (
    "Explain how a rainbow forms.",
    "Give me three tips for writing clear code.",
    "Summarise the water cycle in two sentences.",
    "Write a haiku about the sea.",
    "List the planets of the solar system in order from the sun.",
    "What is the difference between a list and a tuple in Python?",
    "Rewrite as a numbered list: the Rhine begins in the Swiss Alps, flows along the border between Germany "
    "and France, and reaches the North Sea in the Netherlands.",
    "Translate 'good morning, how are you?' into French and Spanish.",
)


@dataclass
class RequestRow:
    concurrency: int
    index: int  # order of start within its level
    prompt_index: int
    start_s: float  # since the level started
    latency_s: float = 0.0
    time_to_first_token_s: float = 0.0
    num_tokens: int = 0
    tokens_per_s: float = 0.0  # this request's tokens / its latency
    acceptance_rate: float = 0.0
    mean_accepted_length: float = 0.0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: str = ""  # space-separated counts, [max k]
    drafter: str = ""
    num_failovers: int = 0
    finish_reason: str = ""
    error: str = ""


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summarise(concurrency: int, rows: list[RequestRow], wall_s: float) -> dict:
    done = [r for r in rows if not r.error]
    latencies = [r.latency_s for r in done]
    num_drafts = sum(r.num_drafts for r in done)
    per_position: list[int] = []
    for r in done:
        for i, count in enumerate(int(c) for c in r.accepted_per_position.split()):
            per_position.extend([0] * (i + 1 - len(per_position)))
            per_position[i] += count
    num_tokens = sum(r.num_tokens for r in done)
    drafted = sum(r.num_draft_tokens for r in done)
    return {
        "concurrency": concurrency, "num_requests": len(rows), "num_failed": len(rows) - len(done), "wall_s": wall_s,
        "num_tokens": num_tokens, "tokens_per_s": num_tokens / wall_s if wall_s else 0.0,
        "requests_per_s": len(done) / wall_s if wall_s else 0.0,
        "latency_s": {**{f"p{q}": percentile(latencies, q) for q in (50, 90, 99)},
                      "mean": statistics.fmean(latencies) if latencies else 0.0},
        "time_to_first_token_s": {f"p{q}": percentile([r.time_to_first_token_s for r in done], q) for q in (50, 90, 99)},
        "acceptance_rate": sum(r.num_accepted_tokens for r in done) / drafted if drafted else 0.0,
        "mean_accepted_length": 1 + sum(r.num_accepted_tokens for r in done) / num_drafts if num_drafts else 1.0,
        "accepted_per_draft_by_position": [c / num_drafts for c in per_position] if num_drafts else [],
    }


class Progress:
    """One status line on stderr: redrawn in place on a terminal, a line now and then otherwise."""

    def __init__(self, concurrency: int, num_requests: int | None, duration_s: float | None, out=None):
        self.concurrency, self.num_requests, self.duration_s = concurrency, num_requests, duration_s
        self.out = out or sys.stderr
        self.start_s = self.last_draw_s = time.perf_counter()
        self.done = self.failed = self.tokens = 0
        self.tty = self.out.isatty()

    def update(self, row: RequestRow) -> None:
        self.done += 1
        self.failed += bool(row.error)
        self.tokens += row.num_tokens
        now = time.perf_counter()
        if now - self.last_draw_s >= (0.1 if self.tty else 5.0):
            self.draw(now)

    def draw(self, now: float, final: bool = False) -> None:
        self.last_draw_s = now
        elapsed = now - self.start_s
        fraction = self.done / self.num_requests if self.num_requests else min(1.0, elapsed / (self.duration_s or 1))
        bar = "#" * int(fraction * 20)
        target = f"/{self.num_requests}" if self.num_requests else ""
        line = (f"[c={self.concurrency}] [{bar:<20}] {self.done}{target} requests, {self.failed} failed, {self.tokens} tokens, "
                f"{self.tokens / elapsed if elapsed else 0:.1f} tok/s, {elapsed:.1f} s")
        self.out.write(("\r" + line + ("\n" if final else "")) if self.tty else line + "\n")
        self.out.flush()


async def run_level(client: CoordinatorClient, prompts: list, concurrency: int, num_requests: int | None,
                    duration_s: float | None, kwargs: dict) -> tuple[list[RequestRow], float]:
    rows: list[RequestRow] = []
    progress = Progress(concurrency, num_requests, duration_s)
    start_s = time.perf_counter()
    counter = iter(range(sys.maxsize))

    async def worker() -> None:
        while True:
            index = next(counter)
            if (num_requests is not None and index >= num_requests) or (
                    duration_s is not None and time.perf_counter() - start_s >= duration_s):
                return
            row = RequestRow(concurrency, index, index % len(prompts), time.perf_counter() - start_s)
            try:
                result = await client.collect(prompts[row.prompt_index], **kwargs)
            except CoordinatorError as exc:
                if exc.unreachable:
                    raise
                row.error, row.latency_s = f"{exc.code}: {exc.details}", time.perf_counter() - start_s - row.start_s
            else:
                s = result.stats
                row.latency_s, row.time_to_first_token_s = result.latency_s, result.time_to_first_token_s
                row.num_tokens, row.finish_reason, row.error = len(result.token_ids), result.finish_reason or "", result.error_message
                row.tokens_per_s = row.num_tokens / row.latency_s if row.latency_s else 0.0
                if s is not None:
                    row.acceptance_rate, row.mean_accepted_length = s.acceptance_rate, s.mean_accepted_length
                    row.num_drafts, row.num_draft_tokens, row.num_accepted_tokens = s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens
                    row.accepted_per_position = " ".join(map(str, s.accepted_per_position))
                    row.drafter, row.num_failovers = s.drafter, s.num_failovers
            rows.append(row)
            progress.update(row)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall_s = time.perf_counter() - start_s
    progress.draw(time.perf_counter(), final=True)
    return sorted(rows, key=lambda r: r.index), wall_s


def load_prompts(path: str, raw: bool) -> list:
    texts = [line.strip() for line in Path(path).read_text().splitlines()] if path else list(DEFAULT_PROMPTS)
    texts = [t for t in texts if t]
    if not texts:
        raise ValueError(f"{path}: no prompts (one per line)")
    return texts if raw else [[{"role": "user", "content": t}] for t in texts]


def write_csv(path: Path, rows: list[RequestRow]) -> None:
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=[f.name for f in fields(RequestRow)])
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)


async def bench(args: argparse.Namespace) -> int:
    prompts = load_prompts(args.prompts, args.raw)
    num_requests = None if args.duration_s else (args.requests or max(8, 2 * max(args.concurrency)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = sampling_kwargs(args)
    async with make_client(args) as client:
        await client.health()  # fail fast when nothing listens there
        levels, rows = [], []
        for concurrency in args.concurrency:
            level_rows, wall_s = await run_level(client, prompts, concurrency, num_requests, args.duration_s, kwargs)
            rows += level_rows
            levels.append(summarise(concurrency, level_rows, wall_s))
        coordinator = asdict(await client.stats())
    summary = {"address": args.address, "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "num_prompts": len(prompts),
               "settings": {k: v for k, v in kwargs.items() if k != "stop"}, "levels": levels, "coordinator": coordinator}
    write_csv(out / "requests.csv", rows)
    try:
        from client.bench_plots import write_plots

        summary["plots"] = [p.name for p in write_plots(out, levels, rows)]
    except ImportError:
        summary["plots"] = []
        print("matplotlib is not installed: no PNG plots (pip install matplotlib; it is not a specmesh dependency)",
              file=sys.stderr)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for level in levels:
        print(f"concurrency {level['concurrency']:>3}: {level['num_requests']} requests ({level['num_failed']} failed), "
              f"{level['tokens_per_s']:.1f} tok/s, latency p50 {level['latency_s']['p50']:.2f} s "
              f"p90 {level['latency_s']['p90']:.2f} s, acceptance {level['acceptance_rate']:.0%}")
    print(f"wrote {out / 'requests.csv'}, {out / 'summary.json'}" + "".join(f", {out / p}" for p in summary["plots"]))
    return EXIT_OK


def add_parser(commands, parents) -> None:
    parser = commands.add_parser("bench", parents=parents, help="concurrent sessions: latency, tokens/s, acceptance")
    parser.add_argument("--prompts", default="", help="a file with one prompt per line (default: a built-in set)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1], help="concurrent sessions; several values: one run each")
    amount = parser.add_mutually_exclusive_group()
    amount.add_argument("--requests", type=int, default=0, help="requests per concurrency level (default max(8, 2 x concurrency))")
    amount.add_argument("--duration-s", "--duration", dest="duration_s", type=float, default=None,
                        help="run each level this long instead")
    parser.add_argument("--raw", action="store_true", help="prompts tokenized as-is, no chat template")
    parser.add_argument("--out", default="specmesh-bench", help="output folder (CSV, JSON, PNG)")
    parser.set_defaults(handler=_main)


def _main(args: argparse.Namespace) -> int:
    if min(args.concurrency) < 1 or args.requests < 0 or (args.duration_s is not None and args.duration_s <= 0):
        return fail("--concurrency and --duration-s must be positive, --requests >= 0", 2)
    return run_async(bench(args))
