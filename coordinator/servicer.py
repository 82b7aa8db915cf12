"""CoordinatorService: the user-facing Generate stream, driven over the Draft and Verify services.

Each request is one `speculative_stream_async` (the one speculation state) over the failover
wrappers of `coordinator.driver`. Many requests run at once as asyncio tasks; their Verify calls
meet in the Verify service's batcher (one target forward for the sessions whose calls arrive
together) and their Propose calls in the Draft service's. Skeleton mode is `coordinator.skeleton`:
a plan, then branches forked from it, streamed side by side. The Coordinator authenticates its callers
(the server edge) and calls downstream on their behalf: with its own credentials and the caller as
`specmesh-end-user`, so session ownership and quotas downstream are per end user.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Sequence

import grpc

from coordinator.cascade import NO_CASCADE, CascadeStages, NamedCascade, adaptive_stats, cascade_stats_pb, request_stages
from coordinator.driver import Calls, DraftCosts, FailoverDrafter, Failovers, FailoverVerifier
from coordinator.mode_choice import PLAIN_MODE, ModeChoice, choose_mode, request_question
from coordinator.options import DRAFTERS, CoordinatorOptions
from coordinator.pools import ServicePool
from coordinator.skeleton import Links, SkeletonAnswer, SkeletonRequest
from servicekit.auth import ANONYMOUS, END_USER_KEY, current_principal
from servicekit.convert import FINISH_TO_PB, sampling_from_pb, stats_to_pb
from servicekit.errors import Downstream, Unavailable, rpc_method
from servicekit.metrics import ServiceMetrics
from servicekit.process import process_info_pb
from servicekit.streams import check_stream_interval, read_ahead
from specmesh.decoding.adaptive import AcceptanceMemories, FixedK
from specmesh.decoding.async_driver import AsyncDrafter, TargetInfo, speculative_stream_async
from specmesh.decoding.plan import Plan, choose_plan
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.stats import SpecStats
from specmesh.decoding.verifier import validate_prompt
from specmesh.models.chat import chat_messages_ids, check_chat_roles
from specmesh.proto.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from specmesh.routing.replica import NoHealthyReplica
from specmesh.skeleton.automaton import SkeletonFormat
from specmesh.skeleton.gate import PROBE_MAX_NEW_TOKENS, PROBE_QUESTION, SkeletonGate

NGRAM_ON_VERIFY = "ngram@verify"  # the stats' drafter of n-gram drafts placed on the Verify service
MODEL_ON_VERIFY = "model@verify"  # ... of model drafts placed there (model_placement: verify)
log = logging.getLogger("specmesh.coordinator")
READ_AHEAD_RESPONSES = 8  # rounds a stream may run ahead of a slow client before it waits


def is_final(response: coordinator_pb2.GenerateResponse) -> bool:
    """The request's last response: the main stream's (branch -1) with a finish reason."""
    return response.branch_id == -1 and response.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED


def _join_responses(responses: list[coordinator_pb2.GenerateResponse]) -> coordinator_pb2.GenerateResponse:
    """Consecutive messages of the main stream as one: their text and tokens in order; the rest (finish
    reason, stats: only the last message of a stream has them) the last one's."""
    joined = coordinator_pb2.GenerateResponse()
    joined.CopyFrom(responses[-1])
    joined.text = "".join(r.text for r in responses)
    del joined.token_ids[:]
    for response in responses:
        joined.token_ids.extend(response.token_ids)
    return joined


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    def __init__(self, options: CoordinatorOptions, tokenizer, info: TargetInfo, verify: ServicePool, draft: ServicePool,
                 metrics: ServiceMetrics, cascade: CascadeStages | None = None, *,
                 decoder_prompt_ids: Sequence[int] | None = None, verify_drafter: str = ""):
        import torch

        self.options = options
        self.tokenizer = tokenizer
        self.info = info
        self.verify = verify
        self.draft = draft
        self.draft_costs = DraftCosts()  # what the Draft sessions said at open: deferred opens' prior (coordinator.driver)
        # the acceptance of client rounds drafted by the Draft service or a cascade, per drafter and cascade ("service",
        # "service+cascade:NAME"), greedy and sampled apart: the next such request's adaptive k starts from it
        self.acceptance = AcceptanceMemories()
        self.metrics = metrics
        self.cascade = cascade or CascadeStages()  # no stages configured: a request naming one is refused
        # an encoder-decoder target (T5, BART, ...): the request's text is the encoder's input, and every
        # generation starts from this decoder prompt; None for a decoder-only target
        self.decoder_prompt_ids = list(decoder_prompt_ids) if decoder_prompt_ids is not None else None
        # a speculative request's n-gram drafts are made on the Verify service when it hosts that drafter
        # (an n-gram lookup reads only the session's own tokens, which live there): its rounds then run as
        # fused ones, with no round trip per draft; else (or ngram_placement: coordinator) here. Model drafts
        # likewise with model_placement: verify, where it hosts a model drafter; else on the Draft service
        hosted = {name.strip() for name in verify_drafter.split(",")}
        self.on_verify = {"ngram": "ngram" if options.ngram_placement == "verify" and "ngram" in hosted else "",
                          "service": "model" if options.model_placement == "verify" and "model" in hosted else ""}
        self.q_dtype = getattr(torch, options.q_dtype)
        self.totals = SpecStats()
        self.num_requests = self.num_active = self.num_failed = self.num_cancelled = self.num_failovers = 0
        self.num_generated_tokens = 0
        # whether auto may pick SoT here: measured (specmesh/skeleton/gate.py); a probe at start when asked
        self.skeleton_gate = SkeletonGate(probing=self.probes_skeleton)

    @property
    def probes_skeleton(self) -> bool:
        """`default_mode: auto` measures SoT against plain answers at start (`probe_skeleton`)."""
        return self.options.default_mode == "auto" and self.options.skeleton_probe and self.decoder_prompt_ids is None

    @property
    def max_context(self) -> int:
        return self.info.max_context

    def _encoder_input_ids(self, request: coordinator_pb2.GenerateRequest) -> list[int]:
        """An encoder-decoder target's encoder input: the prompt, or the last user message of a chat
        (such models have no chat template), tokenized with the model's special tokens."""
        which = request.WhichOneof("input")
        if which is None or (which == "chat" and not request.chat.messages):
            raise ValueError("a GenerateRequest needs a prompt or chat messages")
        ids = list(self.tokenizer(request_question(request)).input_ids)
        if not ids:
            raise ValueError("the encoder input is empty")
        return ids

    def _prompt_ids(self, request: coordinator_pb2.GenerateRequest) -> list[int]:
        which = request.WhichOneof("input")
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages] if which == "chat" else []
        if which == "chat":  # only the chat template's roles, whatever the target (ValueError -> INVALID_ARGUMENT)
            check_chat_roles(self.tokenizer, messages)
        if self.decoder_prompt_ids is not None:
            return list(self.decoder_prompt_ids)
        if which == "chat":
            if not messages:
                raise ValueError("chat needs at least one message")
            ids = chat_messages_ids(self.tokenizer, messages)  # special-token text in a content stays text
        elif which == "prompt":
            ids = list(self.tokenizer.encode(request.prompt, add_special_tokens=False))
        else:
            raise ValueError("a GenerateRequest needs a prompt or chat messages")
        return validate_prompt(ids, self.info.max_context, self.info.vocab_size)

    def _mode_and_drafter(self, request: coordinator_pb2.GenerateRequest) -> tuple[ModeChoice, str]:
        choice = choose_mode(request, self.options.default_mode, request_question(request),
                             skeleton_ok=self.decoder_prompt_ids is None,  # an encoder-decoder target runs no SoT
                             skeleton_closed=self.skeleton_gate.closed_reason())
        drafter = request.drafter or self.options.default_drafter
        if drafter not in DRAFTERS:
            raise ValueError(f"unknown drafter {drafter!r}; choose one of {', '.join(DRAFTERS)}")
        return choice, drafter

    def _calls(self, context) -> Calls:
        remaining = context.time_remaining() if context is not None else None
        timeout_s = self.options.call_timeout_s if remaining is None else max(0.001, min(self.options.call_timeout_s, remaining))
        principal = current_principal()
        return Calls(timeout_s, [(END_USER_KEY, principal)] if principal != ANONYMOUS else [],
                     deadline_at=None if remaining is None else time.monotonic() + remaining)

    @rpc_method
    async def Generate(self, request: coordinator_pb2.GenerateRequest, context):
        choice, drafter_kind = self._mode_and_drafter(request)
        mode = choice.mode
        prompt_ids = self._prompt_ids(request)
        encoder_ids = self._encoder_input_ids(request) if self.decoder_prompt_ids is not None else []
        if encoder_ids and (mode == "skeleton" or request.cascade not in ("", NO_CASCADE)):
            raise ValueError("an encoder-decoder target runs the speculative, fused and autoregressive modes only "
                             "(no skeleton, no cascade)")
        params = sampling_from_pb(request.sampling, self.info.vocab_size, self.options.default_max_new_tokens)
        calls, failovers = self._calls(context), Failovers()
        interval_ms = self._stream_interval_ms(request)
        source = self._answer(request, mode, drafter_kind, prompt_ids, params, calls, failovers, choice.reason, encoder_ids,
                              interval_ms)
        # the next round runs while this one is written; with an interval, the main stream's messages are joined
        joinable = mode != "skeleton" and interval_ms > 0
        responses = read_ahead(source, READ_AHEAD_RESPONSES, merge=_join_responses if joinable else None,
                               interval_s=interval_ms / 1e3 if joinable else 0.0, urgent=is_final)
        started_s = time.perf_counter()
        self.num_requests += 1
        self.num_active += 1
        finished = cancelled = False
        try:
            async for response in responses:
                finished = is_final(response)
                if finished:
                    response.mode_choice.CopyFrom(coordinator_pb2.ModeChoice(mode=choice.pb_mode, reason=choice.reason,
                                                                             routed=choice.routed))
                    self._measured(mode, started_s, response)
                yield response
        except (asyncio.CancelledError, GeneratorExit):  # the client cancelled, or its deadline passed
            cancelled = True
            raise
        except NoHealthyReplica as exc:
            raise Unavailable(f"no healthy replica: {exc}") from exc
        except grpc.aio.AioRpcError as exc:
            raise Downstream(exc.code(), f"downstream: {exc.details()}") from exc
        finally:
            await responses.aclose()
            self.num_active -= 1
            self.num_failovers += len(failovers.events)
            if cancelled and not finished:
                self.num_cancelled += 1
            elif not finished:
                self.num_failed += 1

    def _stream_interval_ms(self, request: coordinator_pb2.GenerateRequest) -> int:
        """The request's stream_interval_ms, else this coordinator's (ValueError past the bound)."""
        interval_ms = request.stream_interval_ms if request.HasField("stream_interval_ms") else self.options.stream_interval_ms
        check_stream_interval(interval_ms)
        return interval_ms

    async def _plain(self, request: coordinator_pb2.GenerateRequest, mode: str, drafter_kind: str, prompt_ids: list[int],
                     params: SamplingParams, calls: Calls, failovers: Failovers,
                     encoder_ids: Sequence[int] = (), stream_interval_ms: int = 0,
                     ) -> AsyncGenerator[coordinator_pb2.GenerateResponse, None]:
        """The speculative, fused and autoregressive modes: one stream, on the main branch (-1)."""
        named_cascade = request.cascade not in ("", NO_CASCADE)
        # a request whose drafter this coordinator places on the Verify service runs fused there, with that drafter
        fused_name = self.on_verify.get(drafter_kind, "") if mode == "speculative" and not named_cascade else ""
        on_verify = bool(fused_name)
        stages_here = mode == "speculative" and not encoder_ids and not on_verify  # "" = the configured stages
        cascade = bool(request_stages(request.cascade, self.cascade.configured)) if stages_here else named_cascade
        plan = choose_plan(mode, drafter=drafter_kind != "none", cascade=cascade, server_rounds=self.options.server_rounds,
                           drafter_on_verify=on_verify)
        verifier = FailoverVerifier(self.verify, self.info, calls, failovers, sparse_q=self.options.sparse_q,
                                    encoder_input_ids=encoder_ids, stream_interval_ms=stream_interval_ms,
                                    fused_drafter=fused_name)
        drafter = None
        if plan.drafts_here and drafter_kind != "none":
            drafter = FailoverDrafter(self.draft, calls, failovers, use_service=drafter_kind == "service" and bool(self.draft),
                                      q_dtype=self.q_dtype, sparse_q=self.options.sparse_q, encoder_input_ids=encoder_ids,
                                      costs=self.draft_costs, target_kv=verifier.target_kv)
        outer: AsyncDrafter | None = drafter
        if stages_here:  # the drafter under the request's Stage services (CASCADE); refuses a lambda without stages
            outer = await self.cascade.wrap(drafter, request.cascade, calls, failovers, self.info.vocab_size,
                                            sparse_q=self.options.sparse_q,
                                            cascade_lambda=request.cascade_lambda if request.HasField("cascade_lambda") else None)
        k_policy = FixedK(request.num_draft_tokens) if request.num_draft_tokens and mode != "autoregressive" else None
        if k_policy is None and outer is not None and (drafter_kind == "service" or cascade):  # a model drafts here
            k_policy = self.acceptance.policy(f"{drafter_kind}+cascade:{request.cascade}" if cascade else drafter_kind, params.is_greedy)
        stream = speculative_stream_async(verifier, outer, prompt_ids, params, plan=plan, k_policy=k_policy,
                                          decode=self._decode)
        try:
            async for event in stream:
                response = coordinator_pb2.GenerateResponse(text=event.text, token_ids=event.token_ids, branch_id=-1)
                if event.finish_reason is not None:
                    response.finish_reason = FINISH_TO_PB[event.finish_reason]
                    response.stats.CopyFrom(self._final_stats(event.stats, plan, drafter, failovers))
                    if on_verify:
                        response.stats.drafter = NGRAM_ON_VERIFY if fused_name == "ngram" else MODEL_ON_VERIFY
                    if isinstance(outer, NamedCascade):
                        response.stats.cascade_stages.extend(cascade_stats_pb(outer))
                        response.stats.lossy |= bool(adaptive_stats(outer)["lossy"])
                yield response
        finally:
            await stream.aclose()

    def _answer(self, request: coordinator_pb2.GenerateRequest, mode: str, drafter_kind: str, prompt_ids: list[int],
                params: SamplingParams, calls: Calls, failovers: Failovers, route_reason: str,
                encoder_ids: Sequence[int] = (), stream_interval_ms: int = 0,
                ) -> AsyncGenerator[coordinator_pb2.GenerateResponse, None]:
        """The responses of `request` answered in `mode`: Skeleton-of-Thought, or one plain stream."""
        if mode == "skeleton":
            return self._skeleton(request, prompt_ids, params, calls, failovers, drafter_kind, route_reason)
        return self._plain(request, mode, drafter_kind, prompt_ids, params, calls, failovers, encoder_ids, stream_interval_ms)

    def _measured(self, mode: str, started_s: float, final: coordinator_pb2.GenerateResponse) -> None:
        """A finished answer's wall time per answer token, for the SoT gate (plain: the mode auto runs instead)."""
        wall_ms = (time.perf_counter() - started_s) * 1e3
        if mode == "skeleton":
            summary = final.skeleton
            num_tokens = (sum(b.num_tokens for b in summary.branches) if summary.branches
                          else final.stats.num_generated_tokens - summary.num_skeleton_tokens)
            self.skeleton_gate.record_skeleton(wall_ms, num_tokens, summary.direct_reason)
        elif mode == PLAIN_MODE:
            self.skeleton_gate.record_plain(wall_ms, final.stats.num_generated_tokens)

    async def probe_skeleton(self) -> None:
        """Under `default_mode: auto`, at start: one plain and one SoT answer of a list question
        (greedy, `PROBE_MAX_NEW_TOKENS`), measured as any answer is, so the first routed question
        already goes where this target is faster. Auto answers plainly until it is done."""
        error = ""
        try:
            request = coordinator_pb2.GenerateRequest(chat=coordinator_pb2.ChatMessages(
                messages=[coordinator_pb2.ChatMessage(role="user", content=PROBE_QUESTION)]))
            request.sampling.max_new_tokens = PROBE_MAX_NEW_TOKENS
            prompt_ids = self._prompt_ids(request)
            params = sampling_from_pb(request.sampling, self.info.vocab_size, self.options.default_max_new_tokens)
            drafter_kind = self.options.default_drafter
            for mode in (PLAIN_MODE, "skeleton"):
                started_s = time.perf_counter()
                final = None
                async for response in self._answer(request, mode, drafter_kind, prompt_ids, params, self._calls(None),
                                                   Failovers(), "the start-up probe"):
                    if is_final(response):
                        final = response
                if final is None:
                    raise RuntimeError(f"the {mode} answer did not finish")
                self._measured(mode, started_s, final)
        except Exception as exc:  # noqa: BLE001 - the gate says why, and auto answers plainly
            error = f"{type(exc).__name__}: {exc}"
        self.skeleton_gate.probe_done(error)
        reason = self.skeleton_gate.closed_reason()
        log.info("SoT probe done: auto %s", f"answers plainly ({reason})" if reason else "may pick SoT for list questions")

    def _skeleton(self, request: coordinator_pb2.GenerateRequest, prompt_ids: list[int], params: SamplingParams, calls: Calls,
                  failovers: Failovers, drafter_kind: str, route_reason: str) -> AsyncGenerator[coordinator_pb2.GenerateResponse, None]:
        """Skeleton-of-Thought (`coordinator.skeleton`) for this request."""
        question = request_question(request)
        max_parallel = request.max_parallel or self.options.skeleton_max_parallel
        links = Links(self.verify, self.draft, self.info, calls, failovers,
                      drafter_kind="service" if drafter_kind == "service" and self.draft else drafter_kind, q_dtype=self.q_dtype,
                      sparse_q=self.options.sparse_q,
                      k_policy=lambda: FixedK(request.num_draft_tokens) if request.num_draft_tokens else None,
                      draft_costs=self.draft_costs)

        def final_stats(stats: SpecStats) -> common_pb2.SpeculationStats:
            pb = self._final_stats(stats, Plan.SKELETON, None, failovers)
            pb.drafter = links.drafter_names
            return pb

        answer = SkeletonAnswer(SkeletonRequest(question, prompt_ids, params, SkeletonFormat(self.options.skeleton_max_points),
                                                max_parallel, request.skeleton_prefix, list(request.documents), route_reason,
                                                self._skeleton_layout(request)),
                                self.tokenizer, links, final_stats)
        return answer.responses()

    def _skeleton_layout(self, request: coordinator_pb2.GenerateRequest) -> int:
        """The request's BranchLayout, or the coordinator's configured one when it names none."""
        layout = request.skeleton_layout
        if layout == common_pb2.BRANCH_LAYOUT_UNSPECIFIED:
            return common_pb2.BranchLayout.Value("BRANCH_LAYOUT_" + self.options.skeleton_layout.upper())
        if layout not in common_pb2.BranchLayout.values():
            raise ValueError(f"unknown skeleton_layout {layout}")
        return layout

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def _final_stats(self, stats: SpecStats | None, plan: Plan, drafter: FailoverDrafter | None,
                     failovers: Failovers) -> common_pb2.SpeculationStats:
        if stats is None:
            return common_pb2.SpeculationStats()
        self.totals.merge(stats)
        self.num_generated_tokens += stats.num_generated_tokens
        pb = stats_to_pb(stats)
        pb.drafter = drafter.current if drafter is not None else ("fused" if plan.fused else "")
        pb.plan = plan.value
        pb.num_failovers = len(failovers.events)
        pb.failovers.extend(failovers.events)
        return pb

    @rpc_method
    async def SetCascadeLambda(self, request, context) -> coordinator_pb2.SetCascadeLambdaResponse:
        """The adaptive cascade's default lambda from now on (ValueError -> INVALID_ARGUMENT: negative, NaN,
        or finite without a predictor configured)."""
        self.cascade.set_default_lambda(request.cascade_lambda)
        return coordinator_pb2.SetCascadeLambdaResponse(cascade_lambda=self.cascade.default_lambda)

    @rpc_method
    async def GetStats(self, request, context) -> coordinator_pb2.GetStatsResponse:
        replicas = [coordinator_pb2.ReplicaStatus(kind=pool.kind, address=r.id, healthy=r.healthy, in_flight=r.num_in_flight,
                                                  num_readmissions=pool.num_readmissions.get(r.id, 0))
                    for pool in (self.draft, self.verify) for r in pool.replicas.replicas]
        return coordinator_pb2.GetStatsResponse(
            num_requests=self.num_requests, num_generated_tokens=self.num_generated_tokens, totals=stats_to_pb(self.totals),
            num_active_requests=self.num_active, num_failed_requests=self.num_failed, num_failovers=self.num_failovers,
            num_cancelled_requests=self.num_cancelled, max_context_tokens=self.info.max_context,
            replicas=replicas, process=process_info_pb())
