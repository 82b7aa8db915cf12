"""`make demo`: the most that works today, on the embedded default model (SmolLM2-135M-Instruct).

1. In-process speculative decoding, streamed: a chat answer drafted by the target's own weights in
   bf16, and a passage rewrite drafted by prompt lookup; each followed by its stats and by plain
   decoding of the same prompt, measured there and then (speedup, and the exactness check).
2. Over the wire: the local cluster (configs/local.yaml: a Draft and a Verify service, each its own
   process, on free loopback ports) is started, a speculative generation is driven through it with
   gRPC, and the cluster is stopped.
"""

from __future__ import annotations

import sys
import time

from specmesh.decoding.sampling import SamplingParams

CHAT_PROMPT = "Give me three tips for writing clear code."
PASSAGE = (
    "The Rhine begins in the Swiss Alps, flows along the border between Germany and France, and reaches "
    "the North Sea in the Netherlands. Barges carry coal, grain and containers between Rotterdam and Basel."
)
GROUNDED_PROMPT = f"Rewrite the following passage as a numbered list of facts, one per line, in its own words.\n\n{PASSAGE}"
MAX_NEW_TOKENS = 96


def _section(title: str) -> None:
    print(f"\n=== {title} ===", flush=True)


def _speculative_vs_plain(generator, prompt: str, drafter: str) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)
    print(f"user: {prompt}\nassistant: ", end="", flush=True)
    start = time.perf_counter()
    text = ""
    for delta in generator.stream_text(prompt, params, drafter=drafter):
        text += delta
        print(delta, end="", flush=True)
    spec_s = time.perf_counter() - start
    spec_stats = generator.last_stats
    print(f"\n[speculative, {drafter} drafts] {spec_stats.summary()}")
    print(f"  per-position acceptance: {[f'{a:.2f}' for a in spec_stats.per_position_acceptance()[:8]]}")
    start = time.perf_counter()
    plain = "".join(generator.stream_text(prompt, params, drafter="none"))
    plain_s = time.perf_counter() - start
    plain_stats = generator.last_stats
    same = "identical" if plain == text else "DIFFERENT"
    print(f"[plain decoding] {plain_stats.summary()}")
    print(f"  -> speedup {plain_s / spec_s:.2f}x wall time ({spec_stats.num_generated_tokens} tokens); "
          f"output {same} to plain decoding")


def _over_the_wire(tokenizer_prompt_ids) -> None:
    from client.cluster import Cluster, load_cluster_config
    from client.wire_loop import run_wire_generation

    specs = load_cluster_config("configs/local.yaml")
    for spec in specs:  # free ports, so the demo never collides with a running cluster
        spec.options["port"] = 0
        spec.options.pop("metrics_port", None)
    print("starting the local cluster (one process per service) ...", flush=True)
    start = time.perf_counter()
    with Cluster(specs) as cluster:
        print(f"  ready in {time.perf_counter() - start:.1f} s: {cluster.addresses}")
        draft_addr = next(s.address for s in specs if s.kind == "draft")
        verify_addr = next(s.address for s in specs if s.kind == "verify")
        params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)
        tokens, stats = run_wire_generation(draft_addr, verify_addr, tokenizer_prompt_ids, params, k=None)
        print(f"[over gRPC: Draft -> Verify] {stats.summary()}")
    return tokens


def main() -> int:
    from client.local import LocalGenerator

    _section("default model")
    generator = LocalGenerator("default", drafter="bf16")
    print("SmolLM2-135M-Instruct, fp32 target on our native engine. On a CPU a bf16 self-draft step costs")
    print("~0.7-0.9 of a target step, so it barely pays; prompt lookup is free and pays where the answer")
    print("reuses the prompt. Adaptive k falls back towards plain decoding when drafting does not pay.")

    _section("1a. speculative decoding, bf16 self-draft (chat)")
    _speculative_vs_plain(generator, CHAT_PROMPT, "bf16")
    _section("1b. speculative decoding, prompt-lookup drafts (input-grounded)")
    _speculative_vs_plain(generator, GROUNDED_PROMPT, "ngram")

    _section("2. over the wire: Draft and Verify services as separate processes")
    tokens = _over_the_wire(generator.prompt_ids(CHAT_PROMPT))
    print(generator.tokenizer.decode(tokens, skip_special_tokens=True))
    print("cluster stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
