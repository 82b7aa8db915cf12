"""Cascade mode in the Coordinator: a request's drafter becomes base drafter -> Stage services.

The target's round is untouched: `wrap` turns the request's ordinary drafter (the Draft service, the
coordinator's n-gram, or none) into a `specmesh.cascade.pipeline.AsyncCascadeDrafter` whose stages
are Stage services (`servicekit.remote_stage.RemoteStage`), so `speculative_stream_async` steps it
as any drafter. Output is exactly the target's (lossless; `specmesh.cascade.plan`).

Configuration: the pipeline, cheapest stage first, as one option (a YAML key of the coordinator in
the cluster file, or `--cascade-stages`): stages separated by commas, each an address followed by
optional `extend=m` (the stage's own tokens per round, default 1; `extend=fill`: as many as bring its
proposal to the level above's k, `StageSpec.fill`) and `draft=k` (most draft tokens it verifies per
round, default the target's k):

    cascade_stages: "127.0.0.1:50053 extend=1, 127.0.0.1:50054 extend=2 draft=6"

>>> [(e.address, e.spec.num_extend_tokens, e.spec.num_draft_tokens, e.spec.fill)
...  for e in parse_cascade_stages("10.0.0.1:50053, 10.0.0.2:50054 extend=2 draft=6, 10.0.0.3:50055 extend=fill")]
[('10.0.0.1:50053', 1, None, False), ('10.0.0.2:50054', 2, 6, False), ('10.0.0.3:50055', 1, None, True)]

Per request (a string in the same syntax): "" = the configured pipeline, "none" = no cascade, else
the stages to use, in order, each one of the configured addresses (a request never makes the
Coordinator dial an address of its choosing) with its own extend / draft if given.

A Stage replica that fails mid-request (UNAVAILABLE, DEADLINE_EXCEEDED, ...: `replica_failed`) is
dropped for the rest of that request and the failover is reported; the output stays exact.

Adaptive (lossy, opt-in; `specmesh.cascade.chunk_stopping`): with a predictor configured
(`load_stopper`), a request's lambda (`check_cascade_lambda`; unset = the service's default, which
`set_default_lambda` changes at run time; inf = lossless) lets the cascade stop below the target on a
chunk; the driver then commits the chunk without verification and the Verify service takes it as
forced tokens with the next round. A finite lambda needs the configured stages (the predictor was
trained for them); `adaptive_stats` says what happened (lossy, chunks stopped per stage, agreement).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from coordinator.driver import Calls, Failovers, replica_failed
from servicekit.remote_stage import RemoteStage, StageInfo
from specmesh.cascade.costs import chunk_costs_from_forward_costs
from specmesh.cascade.pipeline import AsyncCascadeDrafter
from specmesh.cascade.plan import StageSpec
from specmesh.cascade.policy import AdaptiveStopper
from specmesh.cascade.predictor import AgreementPredictor
from specmesh.decoding.async_driver import AsyncDrafter
from specmesh.proto.v1 import common_pb2, stage_pb2, stage_pb2_grpc

NO_CASCADE = "none"
_KEYS = {"extend": "num_extend_tokens", "draft": "num_draft_tokens"}


@dataclass(frozen=True)
class StageEntry:
    address: str  # host:port of a Stage service
    spec: StageSpec


def parse_cascade_stages(text: str) -> list[StageEntry]:
    """'addr [extend=m|fill] [draft=k], ...' -> the stages, cheapest first (module docstring); ValueError
    naming what is wrong."""
    entries = []
    for part in text.split(","):
        words = part.split()
        if not words:
            continue
        address, settings = words[0], {}
        if "=" in address:
            raise ValueError(f"cascade stage {part.strip()!r} must start with the stage's address (host:port)")
        for word in words[1:]:
            key, sep, value = word.partition("=")
            if not sep or key not in _KEYS:
                raise ValueError(f"cascade stage {address}: unknown setting {word!r}; use extend=m|fill and draft=k")
            if key == "extend" and value == "fill":
                settings["fill"] = True
                continue
            if not value.isdigit():
                raise ValueError(f"cascade stage {address}: {key} must be a non-negative integer, got {value!r}")
            settings[_KEYS[key]] = int(value)
        entries.append(StageEntry(address, StageSpec(**settings)))
    return entries


def request_stages(request_text: str, configured: Sequence[StageEntry]) -> list[StageEntry]:
    """The stages one request uses (module docstring).

    >>> configured = parse_cascade_stages("a:1, b:2 extend=2")
    >>> [e.address for e in request_stages("", configured)], request_stages("none", configured)
    (['a:1', 'b:2'], [])
    >>> request_stages("b:2 extend=3", configured)[0].spec.num_extend_tokens
    3
    """
    text = request_text.strip()
    if not text:
        return list(configured)
    if text == NO_CASCADE:
        return []
    known = {entry.address for entry in configured}
    entries = parse_cascade_stages(text)
    unknown = [entry.address for entry in entries if entry.address not in known]
    if unknown:
        raise ValueError(f"cascade stage {unknown[0]} is not one of the configured stages "
                         f"({', '.join(sorted(known)) or 'none configured'})")
    return entries


def check_cascade_lambda(value: float | None) -> float | None:
    """A request's lambda (None: the service's default), or ValueError: >= 0, inf = lossless.

    >>> check_cascade_lambda(None), check_cascade_lambda(2.5), check_cascade_lambda(float("inf"))
    (None, 2.5, inf)
    """
    if value is not None and (math.isnan(value) or value < 0):
        raise ValueError(f"cascade_lambda must be >= 0 (inf = lossless), got {value}")
    return value


def load_stopper(predictor_path: str | Path, configured: Sequence[StageEntry], default_lambda: float = math.inf) -> AdaptiveStopper:
    """The adaptive stopper for the configured stages: the predictor file's measured per-forward costs
    (`specmesh cascade collect`) times each stage's extension, the target's forward = 1. The file's stage
    fingerprints are not checked here (the Stage services do not report weight fingerprints): it must be
    trained for the configured stages, in order."""
    predictor = AgreementPredictor.load(predictor_path)
    costs = predictor.info.stage_forward_costs
    if not costs:
        raise ValueError(f"{predictor_path}: the predictor records no measured stage costs (collect it again)")
    stage_costs = chunk_costs_from_forward_costs(costs, [entry.spec.num_extend_tokens for entry in configured])
    lam = check_cascade_lambda(default_lambda)
    assert lam is not None
    return AdaptiveStopper(predictor, stage_costs, lam)


def adaptive_stats(cascade: AsyncCascadeDrafter) -> dict:
    """What the adaptive cascade did in the request it opened last: lossy, chunks stopped at each stage
    and at the target, and the agreement measured on the chunks that went on (per stage)."""
    state = cascade.last_state
    if state is None:
        return {"lossy": False, "chunks_stopped": [], "chunks_to_target": 0, "agreement": []}
    return {"lossy": state.lossy, "chunks_stopped": [s.num_chunks_stopped for s in state.stage_stats],
            "chunks_to_target": state.num_chunks_to_target,
            "agreement": [(s.num_chunks_agreed, s.num_chunks_judged) for s in state.stage_stats]}


class NamedCascade(AsyncCascadeDrafter):
    """The cascade of one request, with its stages' addresses (for the stats)."""

    def __init__(self, names: Sequence[str], *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.names = list(names)


def cascade_stats_pb(cascade: NamedCascade) -> list[common_pb2.CascadeStageStats]:
    """The stages' work in the request that opened `cascade` last, cheapest first."""
    state = cascade.last_state
    if state is None:
        return []
    return [common_pb2.CascadeStageStats(stage=name, num_rounds=s.num_rounds, num_draft_tokens=s.num_draft_tokens,
                                         num_accepted_tokens=s.num_accepted_tokens, num_proposed_tokens=s.num_proposed_tokens,
                                         stage_ms=s.stage_ms, retired=s.retired, num_chunks_stopped=s.num_chunks_stopped,
                                         num_chunks_judged=s.num_chunks_judged, num_chunks_agreed=s.num_chunks_agreed,
                                         num_passed=s.num_passed)
            for name, s in zip(cascade.names, state.stage_stats)]


class CascadeStages:
    """The configured Stage services: one channel per address (opened once) and each one's model info
    (asked once, on first use)."""

    def __init__(self, configured: Sequence[StageEntry] = (), open_channel: Callable[[str], grpc.aio.Channel] | None = None,
                 stopper: AdaptiveStopper | None = None):
        self.configured = list(configured)
        if self.configured and open_channel is None:
            raise ValueError("configured cascade stages need a way to open channels")
        if stopper is not None and stopper.num_stages != len(self.configured) + 1:
            raise ValueError(f"the adaptive predictor is for {stopper.num_stages - 1} stages; {len(self.configured)} are configured")
        self.stopper = stopper  # adaptive cascades (None: lossless only); shared by every request, so it learns
        self.default_lambda = stopper.lam if stopper is not None else math.inf
        self._channels = {entry.address: open_channel(entry.address) for entry in self.configured} if open_channel else {}
        self._info: dict[str, StageInfo] = {}

    def __bool__(self) -> bool:
        return bool(self.configured)

    def set_default_lambda(self, value: float) -> None:
        """The lambda of requests that give none, from now on (a service RPC's handler calls this)."""
        lam = check_cascade_lambda(value)
        assert lam is not None
        if not math.isinf(lam) and self.stopper is None:
            raise ValueError("no adaptive predictor is configured: only lambda = inf (lossless) is served")
        self.default_lambda = lam

    def request_lambda(self, value: float | None, entries: Sequence[StageEntry]) -> float:
        """The lambda one request runs with; ValueError when a finite one cannot be served."""
        lam = self.default_lambda if check_cascade_lambda(value) is None else value
        assert lam is not None
        if not math.isinf(lam):
            if self.stopper is None:
                raise ValueError("cascade_lambda: no adaptive predictor is configured (lossless cascades only)")
            if [e.address for e in entries] != [e.address for e in self.configured] or \
                    [e.spec for e in entries] != [e.spec for e in self.configured]:
                raise ValueError("cascade_lambda: the adaptive cascade runs on the configured stages only "
                                 "(its predictor was trained for them)")
        return lam

    async def wrap(self, base: AsyncDrafter | None, request_text: str, calls: Calls, failovers: Failovers,
                   vocab_size: int, *, sparse_q: bool = False, cascade_lambda: float | None = None) -> AsyncDrafter | None:
        """The request's drafter: `base` when the request uses no stages, else the cascade over it
        (adaptive when `cascade_lambda`, or the default, is finite). ValueError for a bad request spec,
        a lambda that cannot be served, or a stage whose vocabulary is not the target's."""
        entries = request_stages(request_text, self.configured)
        if not entries:
            if cascade_lambda is not None and not math.isinf(cascade_lambda):
                raise ValueError("cascade_lambda needs a cascade (this request uses no stages)")
            return base
        lam = self.request_lambda(cascade_lambda, entries)
        stages = []
        for entry in entries:
            stub = stage_pb2_grpc.StageServiceStub(self._channels[entry.address])
            info = await self._stage_info(entry.address, stub, calls)
            if info.vocab_size != vocab_size:
                raise ValueError(f"cascade stage {entry.address} has a vocabulary of {info.vocab_size}, "
                                 f"the target {vocab_size}")
            stages.append(RemoteStage(stub, timeout_s=calls.timeout_s, sparse_q=sparse_q, metadata=calls.metadata,
                                      info=info))

        def stage_failed(index: int, exc: BaseException) -> bool:
            if not replica_failed(exc):
                return False
            failovers.add(f"stage {entries[index].address} -> skipped")
            return True

        stopper = self.stopper if not math.isinf(lam) else None  # inf: exactly the lossless cascade
        return NamedCascade([entry.address for entry in entries], base, stages, [entry.spec for entry in entries],
                            is_stage_failure=stage_failed, stopper=stopper, lam=lam if stopper is not None else None)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()

    async def _stage_info(self, address: str, stub: stage_pb2_grpc.StageServiceStub, calls: Calls) -> StageInfo:
        if address not in self._info:
            model = (await stub.GetInfo(stage_pb2.StageGetInfoRequest(), timeout=calls.timeout_s,
                                        metadata=tuple(calls.metadata) or None)).model
            self._info[address] = StageInfo(model.vocab_size, model.max_context_tokens, model.tokenizer_fingerprint)
        return self._info[address]
