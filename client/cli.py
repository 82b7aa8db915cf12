"""`specmesh` command line: talks to the Coordinator (`make run-cluster` starts one on 127.0.0.1:50050).

    specmesh generate "Explain rainbows." [--mode speculative|fused|autoregressive] [--drafter service|ngram]
                      [--k N (0 = adaptive)] [--temperature 0] [--top-k 0] [--top-p 1] [--seed N]
                      [--max-new-tokens 128] [--stop STR ...] [--raw] [--json]
    specmesh generate "..." --local [--model default] [--drafter bf16|int8|ngram|none]   # in-process, no services
    specmesh chat                    # interactive; /help lists the commands
    specmesh bench --concurrency 1 4 16 --requests 32 --out bench-out
    specmesh health [ADDRESS ...] [--config configs/local.yaml]
    specmesh stats [--json]
    specmesh sim run|sweep|profile ...   # the cluster simulator (specmesh/sim/cli.py); needs no services
Every command but `generate --local` takes --address (default $SPECMESH_ADDRESS or 127.0.0.1:50050),
--tls-ca, --client-cert / --client-key and --token / --token-file (default $SPECMESH_TOKEN).
Exit codes: 0 done, 1 the request failed, 2 bad arguments, 3 the coordinator cannot be reached,
130 interrupted. What the commands share (flags, exit codes, `run_async`) is `client/cli_common.py`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from client.branch_view import watch
from client.cli_common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    LOCAL_DRAFTERS,
    connection_parser,
    explain,
    fail,
    make_client,
    run_async,
    sampling_kwargs,
    sampling_parser,
    stats_line,
)
from client.coordinator_client import DRAFTERS, CoordinatorError


async def _generate_remote(args: argparse.Namespace) -> int:
    prompt = args.prompt if args.raw else [{"role": "user", "content": args.prompt}]
    async with make_client(args) as client:
        view = await watch(client.generate(prompt, **sampling_kwargs(args)), None if args.json else sys.stdout)
    result = view.generation()
    if args.json:
        print(json.dumps({**asdict(result), "stats": asdict(result.stats) if result.stats else None}))
    else:
        print()
        print(stats_line(result), file=sys.stderr)
        for line in view.summary_lines():
            print(line, file=sys.stderr)
    if result.error_message:
        return fail(f"the generation failed: {result.error_message}", EXIT_FAILED)
    return EXIT_OK


def _generate_local(args: argparse.Namespace) -> int:
    from client.local import LocalGenerator
    from specmesh.decoding.sampling import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            max_new_tokens=args.max_new_tokens, stop=tuple(args.stop))
    try:
        params.validate()
        generator = LocalGenerator(args.model, drafter=args.drafter or "bf16", dtype=args.dtype, quantize=args.quantize)
    except ValueError as exc:
        return fail(str(exc), EXIT_USAGE)
    if args.json:
        return _print_local_json(generator, generator.stream_text(args.prompt, params, args.k, chat=not args.raw))
    for text in generator.stream_text(args.prompt, params, args.k, chat=not args.raw):
        print(text, end="", flush=True)
    print()
    print(f"[{generator.last_stats.summary() if generator.last_stats else 'no stats'}]", file=sys.stderr)
    return EXIT_OK


def _print_local_json(generator, texts) -> int:
    """`--local --json`: the whole generation as one JSON object, with the remote path's keys."""
    import time

    from client.coordinator_client import Generation, GenerationStats
    from servicekit.convert import stats_to_pb

    start = time.perf_counter()
    parts, first_s = [], 0.0
    for text in texts:
        first_s = first_s or time.perf_counter() - start
        parts.append(text)
    stats = GenerationStats.from_pb(stats_to_pb(generator.last_stats)) if generator.last_stats else None
    if stats is not None and generator.drafter_name != "none":
        stats.drafter = generator.drafter_name
    result = Generation("".join(parts), generator.last_token_ids, generator.last_finish_reason, stats,
                        time_to_first_token_s=first_s, latency_s=time.perf_counter() - start)
    print(json.dumps({**asdict(result), "stats": asdict(stats) if stats else None}))
    return EXIT_OK


def _generate(args: argparse.Namespace) -> int:
    if args.prompt == "-":
        args.prompt = sys.stdin.read()
    if args.local:
        return _generate_local(args)
    if (args.drafter or "") not in DRAFTERS:
        return fail(f"--drafter {args.drafter!r}: the coordinator drafts with service | ngram "
                    f"(in-process drafters {', '.join(LOCAL_DRAFTERS)} need --local)", EXIT_USAGE)
    return run_async(_generate_remote(args))


async def _stats(args: argparse.Namespace) -> int:
    async with make_client(args) as client:
        stats = await client.stats()
    if args.json:
        print(json.dumps(asdict(stats)))
        return EXIT_OK
    t = stats.totals
    print(f"coordinator {args.address}: {stats.num_requests} requests ({stats.num_active_requests} active, "
          f"{stats.num_failed_requests} failed, {stats.num_cancelled_requests} cancelled), "
          f"{stats.num_generated_tokens} tokens generated")
    print(f"  acceptance {t.acceptance_rate:.0%} ({t.num_accepted_tokens}/{t.num_draft_tokens} draft tokens), "
          f"mean accepted length {t.mean_accepted_length:.2f}, {t.num_target_forwards} target forwards, "
          f"{stats.num_failovers} failovers")
    if t.accepted_per_position:
        print("  accepted per draft, by position: " + " ".join(f"{a:.2f}" for a in t.accepted_per_draft()))
    for r in stats.replicas:
        back = f", back {r.num_readmissions}x after being down" if r.num_readmissions else ""
        print(f"  {r.kind:<7} {r.address:<21} {'healthy' if r.healthy else 'UNHEALTHY':<9} in flight {r.in_flight}{back}")
    if stats.num_restarts:
        print(f"  the coordinator was restarted {stats.num_restarts}x by its launcher (last exit: {stats.last_exit})")
    return EXIT_OK


async def _health(args: argparse.Namespace) -> int:
    from client.health import Target, probe_all

    token = Path(args.token_file).read_text().strip() if args.token_file else args.token
    if args.config:
        from client.cluster_config import load_cluster_config

        specs = load_cluster_config(args.config)
        targets = [Target(s.address, s.kind, s.name, s.metrics_url, tls_ca=args.tls_ca or s.options.get("tls_cert", ""))
                   for s in specs if int(s.options.get("port", 0) or 0) > 0]
    elif args.addresses:
        targets = [Target(a, tls_ca=args.tls_ca) for a in args.addresses]
    else:  # the coordinator, and every replica it knows
        targets = [Target(args.address, "coordinator", "coordinator", tls_ca=args.tls_ca)]
        try:
            async with make_client(args) as client:
                targets += [Target(r.address, r.kind, tls_ca=args.tls_ca) for r in (await client.stats()).replicas]
        except CoordinatorError as exc:
            message, code = explain(exc)
            return fail(message, code)
    if not targets:
        return fail("no service to check (ports chosen at run time cannot be known from the config)", EXIT_USAGE)
    reports = await probe_all(targets, token=token, client_cert=args.client_cert, client_key=args.client_key)
    for report in reports:
        print(report.line())
    return EXIT_OK if all(r.ok for r in reports) else EXIT_FAILED


def build_parser() -> argparse.ArgumentParser:
    from client import bench_cli, cascade_cli, chat, k8s_cli, ray_cli
    from specmesh.sim import cli as sim_cli

    parser = argparse.ArgumentParser(prog="specmesh", description="specmesh: distributed speculative decoding")
    commands = parser.add_subparsers(dest="command", required=True)
    connection, sampling = connection_parser(), sampling_parser()
    gen = commands.add_parser("generate", parents=[connection, sampling], help="stream one answer from the coordinator")
    gen.add_argument("prompt", help="the prompt; - reads it from stdin")
    gen.add_argument("--raw", action="store_true", help="no chat template: the prompt is tokenized as-is")
    gen.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, stats) at the end")
    local = gen.add_argument_group("in-process (--local)")
    local.add_argument("--local", action="store_true", help="generate in this process: no services needed")
    local.add_argument("--model", default="default", help="default | HF folder | .gguf | hub id")
    local.add_argument("--dtype", default="float32")
    local.add_argument("--quantize", default="", help="low-bit target: gguf (the .gguf's own blocks; the default "
                       "model's Q4_1) | int8 | int4 | q4_0 | q4_1 | q8_0 | q4_k | q6_k; exact and batch-invariant")
    gen.set_defaults(handler=_generate)
    chat.add_parser(commands, [connection, sampling])
    bench_cli.add_parser(commands, [connection, sampling])
    health = commands.add_parser("health", parents=[connection], help="grpc health and GetInfo of every service")
    health.add_argument("addresses", nargs="*", help="services to check (default: the coordinator and its replicas)")
    health.add_argument("--config", default="", help="check every service of this cluster YAML")
    health.set_defaults(handler=lambda args: run_async(_health(args)))
    stats = commands.add_parser("stats", parents=[connection], help="the coordinator's totals and replicas")
    stats.add_argument("--json", action="store_true")
    stats.set_defaults(handler=lambda args: run_async(_stats(args)))
    sim_cli.add_parser(commands)
    k8s_cli.register(commands)
    ray_cli.register(commands)
    cascade_cli.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.handler(args)
        sys.stdout.flush()  # here, where a reader that left (`specmesh stats | head -1`) is handled
        return code
    except BrokenPipeError:
        return _stdout_gone()
    except OSError as exc:  # a token file, a certificate, a prompts file
        return fail(str(exc), EXIT_USAGE)


def _stdout_gone() -> int:
    """stdout's reader closed it early (`| head`): it wanted no more, so stop quietly. stdout goes to
    /dev/null first, else the interpreter's last flush at exit fails on the same pipe again."""
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # no real stdout to redirect (an embedding caller's stream)
        pass
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
