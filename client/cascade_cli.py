"""`specmesh cascade`: data, training and evaluation of the adaptive cascade's agreement predictor.

    specmesh cascade collect [--stages default@int8 default@bf16 default@fp32] [--prompts FILE]
                             [--max-new-tokens 64] [--chunk-tokens 4] [--temperature 0] --out rows.jsonl
    specmesh cascade train rows.jsonl --out predictor.json [--eval-every 4] [--epochs 400] [--hidden 32]
    specmesh cascade eval predictor.json rows.jsonl [--split held-out|train|all]

collect runs the stages in-process (the engines load as `load_engine(model, dtype=, quantize=)` does
for the services' --dtype / --quantize) on every prompt and writes one labelled row per stage and
chunk; the default prompts are bench/speculative.py's input-grounded and chat sets. train fits the
predictor on the training prompts, prints the held-out calibration and saves it with the stages'
identities; eval prints calibration (Brier, ECE, reliability bins) and AUC. Registered by
client/cli.py through `register(subparsers)`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

EXIT_OK, EXIT_USAGE = 0, 2
DEFAULT_STAGES = ("default@int8", "default@bf16", "default@fp32")  # the default model's CPU stages
DEFAULT_EVAL_EVERY = 4  # hold out prompts 3, 7, 11, ...
BENCH_PROMPTS = Path(__file__).resolve().parent.parent / "bench" / "speculative.py"


def bench_prompts() -> list[str]:
    """bench/speculative.py's input-grounded then chat prompts (needs the source tree)."""
    if not BENCH_PROMPTS.exists():
        raise ValueError(f"{BENCH_PROMPTS} not found (an installed package has no bench/); pass --prompts FILE")
    spec = importlib.util.spec_from_file_location("_specmesh_bench_speculative", BENCH_PROMPTS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.GROUNDED_PROMPTS) + list(module.CHAT_PROMPTS)


def read_prompts(path: str) -> list[str]:
    """A JSON list of strings, or one prompt per non-empty line."""
    text = Path(path).read_text()
    if text.lstrip().startswith("["):
        prompts = json.loads(text)
        if not all(isinstance(p, str) for p in prompts):
            raise ValueError(f"{path}: expected a JSON list of strings")
        return prompts
    return [line for line in text.splitlines() if line.strip()]


def _collect(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from specmesh.cascade.features import FeatureSchema
    from specmesh.cascade.identity import parse_stage_spec, stage_identity
    from specmesh.cascade.stage_model import StageModel
    from specmesh.cascade.training import Dataset, collect_prompt, stage_forward_costs, write_dataset
    from specmesh.decoding.sampling import SamplingParams
    from specmesh.models.chat import chat_prompt_ids
    from specmesh.models.load import load_engine
    from specmesh.models.resolve import resolve_model_spec

    if args.threads:
        torch.set_num_threads(args.threads)
    specs = [parse_stage_spec(s) for s in args.stages]
    if len(specs) < 2:
        raise ValueError("a cascade has at least 2 stages (--stages)")
    if args.chunk_tokens < 1 or args.max_new_tokens < 1:
        raise ValueError("--chunk-tokens and --max-new-tokens must be >= 1")
    params = SamplingParams(temperature=args.temperature, seed=args.seed, max_new_tokens=args.max_new_tokens)
    params.validate()
    texts = read_prompts(args.prompts) if args.prompts else bench_prompts()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_spec(specs[-1].model))
    prompts = [chat_prompt_ids(tokenizer, t) for t in texts]
    print(f"loading {len(specs)} stages: {', '.join(s.name for s in specs)} ...", file=sys.stderr, flush=True)
    engines = [load_engine(s.model, dtype=s.dtype, quantize=s.quantize, device=args.device) for s in specs]
    if len({e.vocab_size for e in engines}) != 1:
        raise ValueError("the stages' vocabularies differ: a cascade needs one tokenizer")
    stages = [StageModel(e) for e in engines]
    identities = [stage_identity(s) for s in specs]
    schema = FeatureSchema(len(stages))
    eos = list(engines[-1].eos_token_ids)
    list(collect_prompt(stages, chat_prompt_ids(tokenizer, "Hi"), -1, schema, params, args.chunk_tokens,
                        2 * args.chunk_tokens, eos))  # warm-up: first-call allocations and kernel selection
    ms: list[list[float]] = [[] for _ in stages]
    rows = []
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        rows += list(collect_prompt(stages, prompt, index, schema, params, args.chunk_tokens, args.max_new_tokens, eos, ms))
        print(f"  prompt {index + 1}/{len(prompts)}: {len(rows)} rows, {time.perf_counter() - start:.0f} s",
              file=sys.stderr, flush=True)
    costs = stage_forward_costs(ms)
    header = {"stage_specs": [s.name for s in specs], "chunk_tokens": args.chunk_tokens, "temperature": args.temperature,
              "max_new_tokens": args.max_new_tokens, "num_prompts": len(prompts), "device": args.device,
              "torch_threads": torch.get_num_threads()}
    dataset = Dataset(schema, identities, rows, costs, header)
    write_dataset(args.out, dataset)
    rates = dataset.agreement_rates()
    print(f"wrote {len(rows)} rows to {args.out}; agreement per stage " + ", ".join(f"{r:.2f}" for r in rates)
          + "; cost per forward (target = 1) " + ", ".join(f"{c:.2f}" for c in costs))
    return EXIT_OK


def _train(args: argparse.Namespace) -> int:
    from specmesh.cascade.predictor import FitConfig
    from specmesh.cascade.training import read_dataset, train_predictor

    dataset = read_dataset(args.rows)
    start = time.perf_counter()
    config = FitConfig(hidden=args.hidden, epochs=args.epochs, lr=args.lr, weight_decay=args.weight_decay, seed=args.seed)
    predictor, report = train_predictor(dataset, args.eval_every, config)
    predictor.save(args.out)
    train_rows, held = dataset.split(args.eval_every)
    print(f"trained on {len(train_rows)} rows in {time.perf_counter() - start:.1f} s; saved {args.out}")
    if report is None:
        print("no held-out rows with both labels: nothing evaluated")
    else:
        print(f"held-out prompts ({len(held)} rows):")
        print("\n".join(report.lines()))
    return EXIT_OK


def _eval(args: argparse.Namespace) -> int:
    from specmesh.cascade.predictor import AgreementPredictor
    from specmesh.cascade.training import evaluate, read_dataset

    dataset = read_dataset(args.rows)
    predictor = AgreementPredictor.load(args.predictor, expected_stages=dataset.stages)
    train_rows, held = dataset.split(args.eval_every)
    rows = {"held-out": held, "train": train_rows, "all": dataset.rows}[args.split]
    result = evaluate(predictor, dataset, rows)
    print(f"{args.split} rows of {args.rows}:")
    print("\n".join(result.overall.lines()))
    print(f"baseline (-mean chunk entropy alone): AUC {result.baseline_auc:.3f}")
    for stage, report in result.per_stage.items():
        observed, product = result.final_agreement[stage]
        print(f"stage {stage}: rows {report.num_rows}, agreement {report.positive_rate:.3f}, AUC {report.auc:.3f}, "
              f"Brier {report.brier:.4f}, ECE {report.ece:.4f}; P(final agrees) observed {observed:.3f} "
              f"vs product of rates {product:.3f}")
    return EXIT_OK


def _guarded(handler):
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except (ValueError, OSError) as exc:  # PredictorMismatchError is a ValueError
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_USAGE

    return run


def register(subparsers) -> None:
    """Add `cascade collect|train|eval` to an argparse subparsers object (imports no torch)."""
    cascade = subparsers.add_parser("cascade", help="adaptive cascade: collect labelled rows, train and evaluate the predictor")
    sub = cascade.add_subparsers(dest="cascade_command", required=True)
    collect = sub.add_parser("collect", help="run the stages on a prompt set; write labelled rows (JSON lines)")
    collect.add_argument("--stages", nargs="+", default=list(DEFAULT_STAGES),
                         help="MODEL[@dtype|@quantize], cheapest first, the final stage last (default: %(default)s)")
    collect.add_argument("--prompts", default="", help="JSON list or one prompt per line (default: bench's grounded + chat sets)")
    collect.add_argument("--max-new-tokens", type=int, default=64)
    collect.add_argument("--chunk-tokens", type=int, default=4, help="tokens per stopping decision")
    collect.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    collect.add_argument("--seed", type=int, default=None)
    collect.add_argument("--device", default="cpu")
    collect.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    collect.add_argument("--out", default="cascade-rows.jsonl")
    collect.set_defaults(handler=_guarded(_collect))
    train = sub.add_parser("train", help="fit the agreement predictor; save it with the stages it was trained for")
    train.add_argument("rows")
    train.add_argument("--out", default="cascade-predictor.json")
    train.add_argument("--eval-every", type=int, default=DEFAULT_EVAL_EVERY, help="hold out every Nth prompt (<= 1: none)")
    train.add_argument("--hidden", type=int, default=32)
    train.add_argument("--epochs", type=int, default=400)
    train.add_argument("--lr", type=float, default=0.01)
    train.add_argument("--weight-decay", type=float, default=1e-3)
    train.add_argument("--seed", type=int, default=0)
    train.set_defaults(handler=_guarded(_train))
    ev = sub.add_parser("eval", help="calibration (Brier, ECE, reliability bins) and AUC of a saved predictor")
    ev.add_argument("predictor")
    ev.add_argument("rows")
    ev.add_argument("--split", choices=("held-out", "train", "all"), default="held-out", help="which prompts' rows")
    ev.add_argument("--eval-every", type=int, default=DEFAULT_EVAL_EVERY)
    ev.set_defaults(handler=_guarded(_eval))
