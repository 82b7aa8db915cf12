"""`specmesh` command line.

    specmesh generate "Explain rainbows." [--model default] [--drafter bf16|int8|ngram|none]
                      [--max-new-tokens 128] [--temperature 0] [--top-k 0] [--top-p 1] [--seed N]
                      [--num-draft-tokens 0 (adaptive)] [--stop STR ...] [--raw]
"""

from __future__ import annotations

import argparse
import sys

from client.local import DRAFTERS


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _generate(args) -> int:
    from client.local import LocalGenerator
    from specmesh.decoding.sampling import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            max_new_tokens=args.max_new_tokens, stop=tuple(args.stop))
    try:
        params.validate()
        generator = LocalGenerator(args.model, drafter=args.drafter, dtype=args.dtype)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for text in generator.stream_text(args.prompt, params, args.num_draft_tokens, chat=not args.raw):
        print(text, end="", flush=True)
    print()
    print(f"[{generator.last_stats.summary()}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specmesh", description="specmesh: distributed speculative decoding")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text in-process (speculative by default)")
    gen.add_argument("prompt")
    gen.add_argument("--model", default="default", help="default | HF folder | .gguf | hub id")
    gen.add_argument("--drafter", default="bf16", choices=DRAFTERS)
    gen.add_argument("--dtype", default="float32")
    gen.add_argument("--num-draft-tokens", type=int, default=0, help="fixed k; 0 = adaptive")
    gen.add_argument("--raw", action="store_true", help="no chat template")
    _sampling_args(gen)
    gen.set_defaults(handler=_generate)
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
