"""A typed asyncio client of the Coordinator (`specmesh.v1.CoordinatorService`).

    async with CoordinatorClient("127.0.0.1:50050") as client:
        async for chunk in client.generate("Explain rainbows.", max_new_tokens=64):
            print(chunk.text, end="")                # the last chunk has finish_reason and stats
        result = await client.collect([{"role": "user", "content": "Hi"}], mode="fused", temperature=0.7, seed=1)
        print(result.text, result.stats.summary())
        print((await client.stats()).num_requests, await client.health())

A `str` prompt is tokenized as-is; a list of chat messages ({"role", "content"}) goes through the
model's chat template on the coordinator. gRPC failures raise `CoordinatorError` (its `code` is the
status name, e.g. "UNAVAILABLE"); an error the coordinator reports in-band ends the stream with a
chunk whose `error_message` is set (`collect` keeps it in the result; it does not raise).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servicekit.channels import open_channel
from servicekit.streams import whole_answer_interval_ms
from specmesh.proto.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

MODES = {"": coordinator_pb2.GENERATION_MODE_UNSPECIFIED, "speculative": coordinator_pb2.GENERATION_MODE_SPECULATIVE,
         "fused": coordinator_pb2.GENERATION_MODE_FUSED, "skeleton": coordinator_pb2.GENERATION_MODE_SKELETON,
         "autoregressive": coordinator_pb2.GENERATION_MODE_AUTOREGRESSIVE}
DRAFTERS = ("", "service", "ngram")  # "" = the coordinator's default
FINISH_REASONS = {common_pb2.FINISH_REASON_EOS: "eos", common_pb2.FINISH_REASON_LENGTH: "length",
                  common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_CONTEXT: "context",
                  common_pb2.FINISH_REASON_CANCELLED: "cancelled", common_pb2.FINISH_REASON_ERROR: "error"}
DEFAULT_GENERATE_TIMEOUT_S = 600.0
DEFAULT_CALL_TIMEOUT_S = 10.0
Prompt = str | Sequence[dict[str, str]]


class CoordinatorError(Exception):
    """A failed call to the coordinator: `code` is the gRPC status name, `details` its message."""

    def __init__(self, address: str, code: str, details: str):
        super().__init__(f"{code}: {details}")
        self.address, self.code, self.details = address, code, details

    @property
    def unreachable(self) -> bool:
        """True when no connection could be made (nothing listens there, a wrong host, a TLS mismatch)."""
        text = self.details.lower()
        return self.code == "UNAVAILABLE" and any(s in text for s in ("failed to connect", "connection refused",
                                                                      "dns resolution", "handshake", "unreachable"))


@dataclass
class GenerationStats:
    """One request's speculation stats (`SpeculationStats`; vLLM's definitions)."""

    num_generated_tokens: int = 0
    num_drafts: int = 0  # verify rounds that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [max k] accepted count at draft position i
    mean_accepted_length: float = 1.0  # 1 + accepted / drafts
    tokens_per_s: float = 0.0  # as the coordinator measured it
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    num_target_forwards: int = 0
    seed: int = 0
    drafter: str = ""  # the drafter that finished the request ("" = target only)
    num_failovers: int = 0
    failovers: list[str] = field(default_factory=list)  # e.g. "draft -> ngram"
    cascade: list[str] = field(default_factory=list)  # per Stage service: "address: accepted/verified, rounds, sat out"
    lossy: bool = False  # an opt-in lossy mode produced some of the tokens
    plan: str = ""  # how the request ran (`specmesh.decoding.plan.Plan` value; docs/architecture.md)

    @classmethod
    def from_pb(cls, pb: common_pb2.SpeculationStats) -> GenerationStats:
        return cls(pb.num_generated_tokens, pb.num_drafts, pb.num_draft_tokens, pb.num_accepted_tokens,
                   list(pb.accepted_per_position), pb.mean_accepted_length or 1.0, pb.tokens_per_s, pb.draft_ms,
                   pb.verify_ms, pb.num_target_forwards, pb.seed, pb.drafter, pb.num_failovers, list(pb.failovers),
                   [f"{s.stage}: accepted {s.num_accepted_tokens}/{s.num_draft_tokens} in {s.num_rounds} rounds"
                    + (f", sat out {s.num_passed}" if s.num_passed else "") + (" (retired)" if s.retired else "")
                    for s in pb.cascade_stages], pb.lossy, pb.plan)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def accepted_per_draft(self) -> list[float]:
        """Per draft position: accepted count / drafts. Equal to the per-position acceptance when every
        round drafted that deep (fixed k); below it when rounds drafted fewer (adaptive k)."""
        return [a / self.num_drafts for a in self.accepted_per_position] if self.num_drafts else []

    def summary(self) -> str:
        failovers = f"; failovers: {', '.join(self.failovers)}" if self.num_failovers else ""
        cascade = f"; cascade: {'; '.join(self.cascade)}" if self.cascade else ""
        lossy = "; LOSSY (opt-in): not exactly the target's output" if self.lossy else ""
        return (f"{self.num_generated_tokens} tokens, {self.tokens_per_s:.1f} tok/s; acceptance {self.acceptance_rate:.0%}, "
                f"mean accepted length {self.mean_accepted_length:.2f}; drafter {self.drafter or 'none'}{failovers}{cascade}{lossy}")


@dataclass
class Chunk:
    """One streamed message: new text and the tokens behind it; the last one has finish_reason and stats."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # eos | length | stop | context | cancelled | error, on the last chunk
    stats: GenerationStats | None = None  # on the last chunk
    error_message: str = ""  # set when the coordinator ended this stream with an error
    branch_id: int = 0  # skeleton mode: 0 = the plan, i >= 1 = point i; -1 = the main stream (the answer)
    skeleton: coordinator_pb2.SkeletonStats | None = None  # skeleton mode: on the last chunk
    mode: str = ""  # on the last chunk: the mode that ran (a MODES key) ...
    mode_reason: str = ""  # ... and why ("requested", "the coordinator's default", or the router's rule)

    @classmethod
    def from_pb(cls, pb: coordinator_pb2.GenerateResponse) -> Chunk:
        mode = next((name for name, value in MODES.items() if value == pb.mode_choice.mode and name), "") \
            if pb.HasField("mode_choice") else ""
        return cls(pb.text, list(pb.token_ids), FINISH_REASONS.get(pb.finish_reason),
                   GenerationStats.from_pb(pb.stats) if pb.HasField("stats") else None, pb.error_message, pb.branch_id,
                   pb.skeleton if pb.HasField("skeleton") else None, mode,
                   pb.mode_choice.reason if pb.HasField("mode_choice") else "")


@dataclass
class Generation:
    """A collected `generate`: the whole text and tokens, with client-side timings."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: GenerationStats | None
    error_message: str = ""
    time_to_first_token_s: float = 0.0  # request sent -> first chunk with tokens
    latency_s: float = 0.0  # request sent -> last chunk


@dataclass
class ReplicaStatus:
    kind: str  # "draft" or "verify"
    address: str
    healthy: bool
    in_flight: int  # this coordinator's requests on it now
    num_readmissions: int = 0  # times the coordinator's health checks saw it back after it was out


@dataclass
class CoordinatorStats:
    """`GetStats`: totals since the coordinator started."""

    num_requests: int
    num_generated_tokens: int
    num_active_requests: int
    num_failed_requests: int
    num_failovers: int
    totals: GenerationStats
    replicas: list[ReplicaStatus]
    num_restarts: int = 0  # of the coordinator's own process, by its launcher
    last_exit: str = ""  # how the coordinator's previous process ended ("" on its first start)
    num_cancelled_requests: int = 0  # ended by their client (a cancel or its deadline), not failed

    @classmethod
    def from_pb(cls, pb: coordinator_pb2.GetStatsResponse) -> CoordinatorStats:
        return cls(pb.num_requests, pb.num_generated_tokens, pb.num_active_requests, pb.num_failed_requests,
                   pb.num_failovers, GenerationStats.from_pb(pb.totals),
                   [ReplicaStatus(r.kind, r.address, r.healthy, r.in_flight, r.num_readmissions) for r in pb.replicas],
                   num_restarts=pb.process.num_restarts, last_exit=pb.process.last_exit,
                   num_cancelled_requests=pb.num_cancelled_requests)


SOT_LAYOUTS = {"": common_pb2.BRANCH_LAYOUT_UNSPECIFIED, "batching": common_pb2.BRANCH_LAYOUT_BATCHING,
               "one_sequence": common_pb2.BRANCH_LAYOUT_ONE_SEQUENCE}  # skeleton mode ("" = the coordinator's)


def generate_request(prompt: Prompt, *, mode: str = "speculative", drafter: str = "", k: int = 0,
                     temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                     max_new_tokens: int = 128, stop: Sequence[str] = (), ignore_eos: bool = False,
                     request_id: str = "", cascade: str = "",
                     cascade_lambda: float | None = None, sot_layout: str = "",
                     stream_interval_ms: int | None = None) -> coordinator_pb2.GenerateRequest:
    """The `GenerateRequest` for these arguments; ValueError for a mode or drafter the client does not know."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(m for m in MODES if m)}")
    if drafter not in DRAFTERS:
        raise ValueError(f"unknown drafter {drafter!r}; choose one of {', '.join(d for d in DRAFTERS if d)}")
    if sot_layout not in SOT_LAYOUTS:
        raise ValueError(f"unknown skeleton layout {sot_layout!r}; choose one of {', '.join(x for x in SOT_LAYOUTS if x)}")
    if k < 0 or max_new_tokens < 0 or top_k < 0:
        raise ValueError("k, max_new_tokens and top_k must be >= 0")
    sampling = common_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, stop=list(stop),
                                         max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
    if seed is not None:
        sampling.seed = seed
    request = coordinator_pb2.GenerateRequest(sampling=sampling, mode=MODES[mode], num_draft_tokens=k,
                                              request_id=request_id, drafter=drafter, cascade=cascade,
                                              skeleton_layout=SOT_LAYOUTS[sot_layout])
    if cascade_lambda is not None:
        request.cascade_lambda = cascade_lambda
    if stream_interval_ms is not None:  # else the coordinator's
        if stream_interval_ms < 0:
            raise ValueError("stream_interval_ms must be >= 0")
        request.stream_interval_ms = stream_interval_ms
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.chat.messages.extend(coordinator_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
    return request


class CoordinatorClient:
    """One channel to a coordinator; TLS when `tls_ca` or a client certificate is named, `token` on every call."""

    def __init__(self, address: str, *, tls_ca: str = "", client_cert: str = "", client_key: str = "", token: str = ""):
        self.address = address
        self.channel = open_channel(address, tls_ca=tls_ca, client_cert=client_cert, client_key=client_key, token=token)
        self.stub = coordinator_pb2_grpc.CoordinatorServiceStub(self.channel)

    def _error(self, exc: grpc.aio.AioRpcError) -> CoordinatorError:
        return CoordinatorError(self.address, exc.code().name, exc.details() or "")

    async def generate(self, prompt: Prompt, *, timeout_s: float = DEFAULT_GENERATE_TIMEOUT_S,
                       **kwargs: Any) -> AsyncIterator[Chunk]:
        """Stream the answer (keyword arguments: `generate_request`'s). Leaving the loop early cancels
        the request, and the coordinator closes its downstream sessions."""
        call = self.stub.Generate(generate_request(prompt, **kwargs), timeout=timeout_s)
        try:
            async for response in call:
                yield Chunk.from_pb(response)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None
        finally:
            call.cancel()  # a no-op once the stream has ended

    async def collect(self, prompt: Prompt, *, on_text: Callable[[str], object] | None = None,
                      **kwargs: Any) -> Generation:
        """`generate`, collected: the answer (the main stream, branch -1: in skeleton mode the merged
        answer, not the plan and the branches as they grew), finish reason, stats and client-side
        timings; `on_text(delta)` sees the answer's text as it streams (a CLI prints it). Without
        `on_text` (and without a `stream_interval_ms` of the caller's) the request asks for no messages
        between its first tokens and its last (`servicekit.streams.whole_answer_interval_ms`)."""
        if on_text is None and "stream_interval_ms" not in kwargs:
            kwargs["stream_interval_ms"] = whole_answer_interval_ms(kwargs.get("stop", ()))
        start_s = time.perf_counter()
        texts: list[str] = []
        result = Generation("", [], None, None)
        first_token = True
        async for chunk in self.generate(prompt, **kwargs):
            if chunk.token_ids and first_token:  # any branch: when the first tokens came
                result.time_to_first_token_s, first_token = time.perf_counter() - start_s, False
            if chunk.error_message:
                result.error_message = chunk.error_message
            if chunk.branch_id != -1:
                continue
            if on_text is not None and chunk.text:
                on_text(chunk.text)
            texts.append(chunk.text)
            result.token_ids += chunk.token_ids
            if chunk.finish_reason is not None:
                result.finish_reason = chunk.finish_reason
            result.stats = chunk.stats or result.stats
        result.text = "".join(texts)
        result.latency_s = time.perf_counter() - start_s
        return result

    async def stats(self, timeout_s: float = DEFAULT_CALL_TIMEOUT_S) -> CoordinatorStats:
        try:
            return CoordinatorStats.from_pb(await self.stub.GetStats(coordinator_pb2.GetStatsRequest(), timeout=timeout_s))
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None

    async def health(self, service: str = "", timeout_s: float = DEFAULT_CALL_TIMEOUT_S) -> str:
        """grpc.health.v1 status name: "SERVING", "NOT_SERVING" (e.g. draining), ..."""
        try:
            response = await health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> CoordinatorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
