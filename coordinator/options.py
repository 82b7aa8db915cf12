"""Coordinator options (flags / YAML keys), on top of every service's server options."""

from __future__ import annotations

from dataclasses import dataclass

from servicekit.options import ServerOptions

MODES = ("speculative", "fused", "autoregressive", "auto")
DRAFTERS = ("service", "ngram", "none")
NGRAM_PLACEMENTS = ("verify", "coordinator")
MODEL_PLACEMENTS = ("draft", "verify")
SKELETON_LAYOUTS = ("batching", "one_sequence")  # common.proto BranchLayout, as config names


@dataclass
class CoordinatorOptions(ServerOptions):
    port: int = 50050
    model: str = "default"  # where the tokenizer and chat template come from (the target's spec)
    draft_addresses: str = ""  # Draft service replicas, comma-separated host:port ("" = none: n-gram drafts)
    verify_addresses: str = "127.0.0.1:50052"  # Verify service replicas, comma-separated host:port
    router: str = "jsq2"  # replica choice at session open: round_robin | jsq2 | weighted_jsq (specmesh.routing)
    default_mode: str = "speculative"  # speculative | fused | autoregressive | auto (per question: coordinator/mode_choice.py)
    default_drafter: str = "service"  # speculative / skeleton mode: service (the Draft service) | ngram (prompt lookup) | none
    # where a speculative request's n-gram drafts are made: verify (on the Verify service when it hosts
    # the n-gram drafter: it steps the rounds itself, no round trip per draft) | coordinator (here)
    ngram_placement: str = "verify"
    # where a speculative request's model drafts (drafter "service") are made: draft (the Draft service, a
    # Propose and a Verify call per round) | verify (on the Verify service when it hosts a model drafter,
    # `fused_drafter: ...,model`: it drafts and steps the rounds itself, as one process would)
    model_placement: str = "draft"
    default_max_new_tokens: int = 256
    q_dtype: str = "float32"  # how draft distributions travel: float32 | float16 | bfloat16
    sparse_q: bool = False  # send only q's support
    call_timeout_s: float = 60.0  # deadline of each downstream call
    # fused and target-only requests: the Verify service steps the rounds and streams them (Run);
    # speculative ones hand it their plain stretches (rounds where drafting does not pay)
    server_rounds: bool = True
    # a plain or speculative stream: at most one message per this many ms to the client, and from a
    # Verify service's Run (the first and the last at once; text waits at most this long). 0 = every
    # round as it lands. Per request: GenerateRequest.stream_interval_ms
    stream_interval_ms: int = 0
    skeleton_max_parallel: int = 4  # skeleton mode: branches decoded at once when the request says 0
    skeleton_max_points: int = 8  # skeleton mode: the most points a plan may have (the grammar's bound)
    # default_mode auto: measure one plain and one SoT answer at start before routing any question to SoT
    # (specmesh/skeleton/gate.py); false: the first routed list question tries SoT
    skeleton_probe: bool = True
    skeleton_layout: str = "one_sequence"  # skeleton mode: one_sequence (regions of one sequence; faster here) | batching
    health_interval_s: float = 1.0  # downstream health checks
    cascade_predictor: str = ""  # adaptive cascade (lossy, opt-in): a predictor file trained for cascade_stages (specmesh cascade train)
    cascade_lambda: float = float("inf")  # its default lambda (inf = lossless); per request: GenerateRequest.cascade_lambda
    cascade_stages: str = ""  # Stage services, cheapest first: "host:port [extend=m] [draft=k], ..." (coordinator/cascade.py); "" = off
    discovery_interval_s: float = 2.0  # how often dns:///name:port and ray:kind address entries are re-read (coordinator/discovery.py)
    downstream_token_file: str = ""  # a file holding the token this coordinator presents downstream
    downstream_tls_ca: str = ""  # PEM roots for downstream TLS ("" = plaintext)
    downstream_client_cert: str = ""  # mTLS client certificate toward the services
    downstream_client_key: str = ""
