"""Cascade mode in the Coordinator: a request's drafter becomes base drafter -> Stage services.

The target's round is untouched: `wrap` turns the request's ordinary drafter (the Draft service, the
coordinator's n-gram, or none) into a `specmesh.cascade.pipeline.AsyncCascadeDrafter` whose stages
are Stage services (`servicekit.remote_stage.RemoteStage`), so `speculative_stream_async` steps it
as any drafter. Output is exactly the target's (lossless; `specmesh.cascade.plan`).

Configuration: the pipeline, cheapest stage first, as one option (a YAML key of the coordinator in
the cluster file, or `--cascade-stages`): stages separated by commas, each an address followed by
optional `extend=m` (the stage's own tokens per round, default 1) and `draft=k` (most draft tokens
it verifies per round, default the target's k):

    cascade_stages: "127.0.0.1:50053 extend=1, 127.0.0.1:50054 extend=2 draft=6"

>>> [(e.address, e.spec.num_extend_tokens, e.spec.num_draft_tokens)
...  for e in parse_cascade_stages("10.0.0.1:50053, 10.0.0.2:50054 extend=2 draft=6")]
[('10.0.0.1:50053', 1, None), ('10.0.0.2:50054', 2, 6)]

Per request (a string in the same syntax): "" = the configured pipeline, "none" = no cascade, else
the stages to use, in order, each one of the configured addresses (a request never makes the
Coordinator dial an address of its choosing) with its own extend / draft if given.

A Stage replica that fails mid-request (UNAVAILABLE, DEADLINE_EXCEEDED, ...: `replica_failed`) is
dropped for the rest of that request and the failover is reported; the output stays exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from coordinator.driver import Calls, Failovers, replica_failed
from servicekit.remote_stage import RemoteStage, StageInfo
from specmesh.cascade.pipeline import AsyncCascadeDrafter
from specmesh.cascade.plan import StageSpec
from specmesh.decoding.async_driver import AsyncDrafter
from specmesh.proto.v1 import common_pb2, stage_pb2, stage_pb2_grpc

NO_CASCADE = "none"
_KEYS = {"extend": "num_extend_tokens", "draft": "num_draft_tokens"}


@dataclass(frozen=True)
class StageEntry:
    address: str  # host:port of a Stage service
    spec: StageSpec


def parse_cascade_stages(text: str) -> list[StageEntry]:
    """'addr [extend=m] [draft=k], ...' -> the stages, cheapest first (module docstring); ValueError
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
                raise ValueError(f"cascade stage {address}: unknown setting {word!r}; use extend=m and draft=k")
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
                                         stage_ms=s.stage_ms, retired=s.retired)
            for name, s in zip(cascade.names, state.stage_stats)]


class CascadeStages:
    """The configured Stage services: one channel per address (opened once) and each one's model info
    (asked once, on first use)."""

    def __init__(self, configured: Sequence[StageEntry] = (), open_channel: Callable[[str], grpc.aio.Channel] | None = None):
        self.configured = list(configured)
        if self.configured and open_channel is None:
            raise ValueError("configured cascade stages need a way to open channels")
        self._channels = {entry.address: open_channel(entry.address) for entry in self.configured} if open_channel else {}
        self._info: dict[str, StageInfo] = {}

    def __bool__(self) -> bool:
        return bool(self.configured)

    async def wrap(self, base: AsyncDrafter | None, request_text: str, calls: Calls, failovers: Failovers,
                   vocab_size: int, *, sparse_q: bool = False) -> AsyncDrafter | None:
        """The request's drafter: `base` when the request uses no stages, else the cascade over it.
        ValueError for a bad request spec or a stage whose vocabulary is not the target's."""
        entries = request_stages(request_text, self.configured)
        if not entries:
            return base
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

        return NamedCascade([entry.address for entry in entries], base, stages, [entry.spec for entry in entries],
                            is_stage_failure=stage_failed)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()

    async def _stage_info(self, address: str, stub: stage_pb2_grpc.StageServiceStub, calls: Calls) -> StageInfo:
        if address not in self._info:
            model = (await stub.GetInfo(stage_pb2.StageGetInfoRequest(), timeout=calls.timeout_s,
                                        metadata=tuple(calls.metadata) or None)).model
            self._info[address] = StageInfo(model.vocab_size, model.max_context_tokens, model.tokenizer_fingerprint)
        return self._info[address]
