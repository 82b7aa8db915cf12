"""What the `specmesh` CLI's commands share: connection and generation flags, the client they make,
exit codes, error lines, the stats line, a streaming printer, and `run_async`.

`client/cli.py` builds the parser and registers its plug-ins (`chat`, `bench_cli`, `cascade_cli`,
`k8s_cli`, `ray_cli`, `specmesh.sim.cli`); the plug-ins import these helpers from here, never
`client.cli`, so the registry and its plug-ins do not import each other.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from client.coordinator_client import MODES, CoordinatorClient, CoordinatorError, Generation, GenerationStats

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
DEFAULT_ADDRESS = "127.0.0.1:50050"
LOCAL_DRAFTERS = ("none", "ngram", "bf16", "int8", "q4_1")  # specmesh.generator.DRAFTERS (not imported: torch)
USAGE_CODES = ("INVALID_ARGUMENT", "OUT_OF_RANGE")


def connection_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("connection")
    group.add_argument("--address", default=os.environ.get("SPECMESH_ADDRESS", DEFAULT_ADDRESS),
                       help="the coordinator's host:port (default $SPECMESH_ADDRESS or %(default)s)")
    group.add_argument("--tls-ca", default="", help="PEM roots: speak TLS to the coordinator")
    group.add_argument("--client-cert", default="", help="PEM client certificate (mTLS), with --client-key")
    group.add_argument("--client-key", default="")
    tokens = group.add_mutually_exclusive_group()
    tokens.add_argument("--token", default=os.environ.get("SPECMESH_TOKEN", ""), help="bearer token (default $SPECMESH_TOKEN)")
    tokens.add_argument("--token-file", default="", help="a file holding the bearer token")
    return parser


def sampling_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("generation")
    group.add_argument("--mode", default="", choices=[m for m in MODES if m], help="default: the coordinator's")
    group.add_argument("--drafter", default=None,
                       help="speculative mode: service | ngram (default: the coordinator's); --local: " + " | ".join(LOCAL_DRAFTERS))
    group.add_argument("--k", "--num-draft-tokens", dest="k", type=int, default=0, help="draft tokens per round; 0 = adaptive")
    group.add_argument("--max-new-tokens", type=int, default=128)
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    group.add_argument("--top-k", type=int, default=0, help="0 = off")
    group.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    group.add_argument("--seed", type=int, default=None)
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--cascade", default="", help='Stage services the draft climbs before the target: "" = the '
                                                     'coordinator\'s cascade_stages, "none" = off, or "addr [extend=m], ..."')
    group.add_argument("--cascade-lambda", type=float, default=None,
                       help="adaptive cascade, LOSSY (opt-in): target-forward equivalents one expected disagreement is "
                            "worth; inf = lossless; default: the coordinator's")
    group.add_argument("--sot-layout", default="", choices=["batching", "one_sequence"],
                       help="skeleton mode: branches as sequences of their own, or as regions of one sequence "
                            "(the same text either way); default: the coordinator's")
    group.add_argument("--stream-interval-ms", type=int, default=None,
                       help="at most one streamed message per this many ms (text joined; the first and last at once); "
                            "0 = every round; default: the coordinator's")
    group.add_argument("--timeout-s", type=float, default=600.0, help="deadline of one generation")
    return parser


def sampling_kwargs(args: argparse.Namespace) -> dict:
    """`CoordinatorClient.generate` keywords from the generation flags."""
    return dict(mode=args.mode, drafter=args.drafter or "", k=args.k, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, seed=args.seed, max_new_tokens=args.max_new_tokens, stop=tuple(args.stop),
                timeout_s=args.timeout_s, cascade=args.cascade, cascade_lambda=args.cascade_lambda,
                sot_layout=getattr(args, "sot_layout", ""), stream_interval_ms=getattr(args, "stream_interval_ms", None))


def make_client(args: argparse.Namespace) -> CoordinatorClient:
    """A client for the connection flags (call inside the event loop that will use it)."""
    token = Path(args.token_file).read_text().strip() if args.token_file else args.token
    return CoordinatorClient(args.address, tls_ca=args.tls_ca, client_cert=args.client_cert, client_key=args.client_key,
                             token=token)


def explain(error: CoordinatorError) -> tuple[str, int]:
    """One line for the user and the exit code."""
    where = f"the coordinator at {error.address}"
    if error.unreachable:
        return (f"cannot reach {where} ({error.details}); start it with `make run-cluster` "
                "or point --address at a running one", EXIT_UNREACHABLE)
    if error.code in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
        return f"{where} refused the credentials ({error.code}: {error.details}); see --token / --token-file", EXIT_FAILED
    if error.code == "UNIMPLEMENTED":
        return f"{where} does not support this yet: {error.details}", EXIT_FAILED
    if error.code == "DEADLINE_EXCEEDED":
        return f"no answer from {where} within the deadline (--timeout-s): {error.details}", EXIT_FAILED
    return f"{where} answered {error.code}: {error.details}", EXIT_USAGE if error.code in USAGE_CODES else EXIT_FAILED


def fail(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def stats_line(result: Generation) -> str:
    """What follows each answer: acceptance, mean accepted length, tokens/s, drafter, failovers."""
    stats = result.stats or GenerationStats(num_generated_tokens=len(result.token_ids))
    tokens_per_s = stats.tokens_per_s or (len(result.token_ids) / result.latency_s if result.latency_s else 0.0)
    parts = [f"{len(result.token_ids)} tokens", f"{tokens_per_s:.1f} tok/s", f"acceptance {stats.acceptance_rate:.0%}",
             f"mean accepted length {stats.mean_accepted_length:.2f}", f"drafter {stats.drafter or 'none'}",
             *([f"plan {stats.plan}"] if stats.plan else []),
             f"failovers {stats.num_failovers}" + (f" ({', '.join(stats.failovers)})" if stats.failovers else ""),
             f"finish {result.finish_reason or '?'}", f"first token {result.time_to_first_token_s * 1e3:.0f} ms"]
    return "[" + ", ".join(parts) + "]"


def printer(out=None):
    """An `on_text` that streams to `out` (default: the current sys.stdout)."""

    def write(text: str) -> None:
        stream = out or sys.stdout
        stream.write(text)
        stream.flush()

    return write


def run_async(coroutine) -> int:
    """Run a command's coroutine; gRPC failures become one line on stderr and an exit code."""
    try:
        return asyncio.run(coroutine)
    except CoordinatorError as exc:
        message, code = explain(exc)
        return fail(message, code)
    except ValueError as exc:
        return fail(str(exc), EXIT_USAGE)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
