"""`specmesh sim`: run, sweep and profile (registered by client/cli.py).

    specmesh sim run configs/sim/fleet.yaml [--out sim-out] [--set workload.rate_per_s=40 ...]
    specmesh sim sweep configs/sim/fleet.yaml --param router.name=random,jsq2 --param workload.rate_per_s=10,20,40
    specmesh sim profile --model default --out table.json [--rows 1 2 4 8] [--tokens 1 2 4 8 64 512] [--context 64 512]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from specmesh.sim.profile import PROFILE_CONTEXT, PROFILE_ROWS, PROFILE_TOKENS_PER_ROW

EXIT_OK, EXIT_USAGE = 0, 2


def _overrides(items: list[str]) -> dict:
    from specmesh.sim.report import parse_param

    out = {}
    for item in items:
        key, values = parse_param(item)
        if len(values) != 1:
            raise ValueError(f"--set takes one value, got {item!r} (use sweep --param for several)")
        out[key] = values[0]
    return out


def _headline(summary: dict) -> str:
    s = summary
    return (f"{s['mode']} {s['router']}: {s['throughput_tokens_per_s']:.1f} tok/s, goodput {s['goodput_tokens_per_s']:.1f} tok/s "
            f"(SLO met {s['slo_attainment']:.0%}), {s['num_requests_done']} requests; TTFT p50/p95 {s['ttft']['p50_ms']:.0f}/"
            f"{s['ttft']['p95_ms']:.0f} ms, TPOT p50/p95 {s['tpot']['p50_ms']:.1f}/{s['tpot']['p95_ms']:.1f} ms, e2e p50/p95 "
            f"{s['e2e']['p50_ms']:.0f}/{s['e2e']['p95_ms']:.0f} ms; target busy {s['target_utilisation_mean']:.0%}, "
            f"batch rows {s['batch_rows_mean']:.1f}; {s['virtual_s_per_wall_s']:.0f} virtual s per wall s")


def _run(args: argparse.Namespace) -> int:
    from specmesh.sim.cluster import simulate
    from specmesh.sim.config import config_from_dict
    from specmesh.sim.report import write_result

    data = yaml.safe_load(Path(args.config).read_text()) or {}
    config = config_from_dict(data, _overrides(args.set), str(Path(args.config).parent))
    result = simulate(config)
    paths = write_result(result, args.out, data)
    print(_headline(result.summary))
    print("wrote " + ", ".join(map(str, paths)), file=sys.stderr)
    return EXIT_OK


def _sweep(args: argparse.Namespace) -> int:
    from specmesh.sim.report import parse_param, progress_line, sweep, write_sweep

    data = yaml.safe_load(Path(args.config).read_text()) or {}
    for key, value in _overrides(args.set).items():
        from specmesh.sim.config import set_dotted

        set_dotted(data, key, value)
    params = dict(parse_param(p) for p in args.param)
    if not params:
        raise ValueError("sweep needs at least one --param KEY=V1,V2,...")
    rows = sweep(data, params, str(Path(args.config).parent), on_progress=None if args.quiet else progress_line)
    paths = write_sweep(rows, args.out, list(params))
    for row in rows:
        point = " ".join(f"{k}={row[k]}" for k in params)
        print(f"{point}: {row['throughput_tokens_per_s']:.1f} tok/s, goodput {row['goodput_tokens_per_s']:.1f}, "
              f"e2e p95 {row['e2e.p95_ms']:.0f} ms, target busy {row['target_utilisation_mean']:.0%}")
    print("wrote " + ", ".join(map(str, paths)), file=sys.stderr)
    return EXIT_OK


def _profile(args: argparse.Namespace) -> int:
    import torch

    from specmesh.models.load import load_engine
    from specmesh.sim.profile import profile_engine

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = load_engine(args.model, backend=args.backend, dtype=args.dtype, quantize=args.quantize or None)

    def progress(done: int, total: int) -> None:
        sys.stderr.write(f"\rprofiling {done}/{total} grid points\033[K" + ("\n" if done == total else ""))

    table = profile_engine(engine, args.rows, args.tokens, args.context, repeats=args.repeats, on_point=progress,
                           meta={"model": args.model, "quantize": args.quantize})
    table.save(args.out)
    print(json.dumps({"out": args.out, "one_token_ms": table.forward_ms(1, 1, args.context[0]), **table.meta}))
    return EXIT_OK


def add_parser(commands) -> None:
    """Register `sim` and its subcommands on an argparse subparsers object."""
    sim = commands.add_parser("sim", help="cluster simulator: run / sweep a YAML config, profile an engine's costs")
    sub = sim.add_subparsers(dest="sim_command", required=True)
    run = sub.add_parser("run", help="simulate one config; write summary.json, requests.csv, devices.csv")
    run.add_argument("config")
    run.add_argument("--out", default="sim-out")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key (dotted)")
    run.set_defaults(handler=_guarded(_run))
    sw = sub.add_parser("sweep", help="simulate a grid of config values; write sweep.csv / sweep.json")
    sw.add_argument("config")
    sw.add_argument("--param", action="append", default=[], metavar="KEY=V1,V2", help="a swept key (repeatable: the grid)")
    sw.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    sw.add_argument("--out", default="sim-sweep")
    sw.add_argument("--quiet", action="store_true", help="no progress line")
    sw.set_defaults(handler=_guarded(_sweep))
    prof = sub.add_parser("profile", help="measure the engine's forward times into a cost table (JSON)")
    prof.add_argument("--model", default="default", help="default | HF folder | .gguf | hub id")
    prof.add_argument("--out", default="cost-table.json")
    prof.add_argument("--backend", default="auto")
    prof.add_argument("--dtype", default="float32")
    prof.add_argument("--quantize", default="")
    prof.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default); match the service's")
    prof.add_argument("--rows", type=int, nargs="+", default=list(PROFILE_ROWS))
    prof.add_argument("--tokens", type=int, nargs="+", default=list(PROFILE_TOKENS_PER_ROW))
    prof.add_argument("--context", type=int, nargs="+", default=list(PROFILE_CONTEXT))
    prof.add_argument("--repeats", type=int, default=3)
    prof.set_defaults(handler=_guarded(_profile))


def _guarded(handler):
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_USAGE

    return run
