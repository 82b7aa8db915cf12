"""create_server(options) -> (handle, port): the tokenizer, the downstream pools, the Coordinator service."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc

from coordinator.cascade import CascadeStages, load_stopper, parse_cascade_stages
from coordinator.options import DRAFTERS, MODEL_PLACEMENTS, MODES, NGRAM_PLACEMENTS, SKELETON_LAYOUTS, CoordinatorOptions
from coordinator.pools import ServicePool, parse_addresses
from coordinator.servicer import CoordinatorServicer
from servicekit.channels import DEFAULT_OPTIONS, open_channel
from servicekit.metrics import ServiceMetrics
from servicekit.server import ServiceHandle, start_service
from specmesh.decoding.async_driver import TargetInfo
from specmesh.proto.v1 import verify_pb2, verify_pb2_grpc
from specmesh.skeleton.automaton import SkeletonFormat

SERVICE_NAME = "specmesh.v1.CoordinatorService"
INFO_WAIT_S = 60.0  # how long to wait for a Verify replica to answer GetInfo at start


def _check(options: CoordinatorOptions) -> None:
    if options.default_mode not in MODES:
        raise ValueError(f"unknown default_mode {options.default_mode!r}; choose one of {', '.join(MODES)}")
    if options.default_drafter not in DRAFTERS:
        raise ValueError(f"unknown default_drafter {options.default_drafter!r}; choose one of {', '.join(DRAFTERS)}")
    if options.ngram_placement not in NGRAM_PLACEMENTS:
        raise ValueError(f"unknown ngram_placement {options.ngram_placement!r}; choose one of {', '.join(NGRAM_PLACEMENTS)}")
    if options.model_placement not in MODEL_PLACEMENTS:
        raise ValueError(f"unknown model_placement {options.model_placement!r}; choose one of {', '.join(MODEL_PLACEMENTS)}")
    if options.q_dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"q_dtype must be float32, float16 or bfloat16, got {options.q_dtype!r}")
    if options.skeleton_max_parallel < 1:
        raise ValueError(f"skeleton_max_parallel must be >= 1, got {options.skeleton_max_parallel}")
    SkeletonFormat(max_points=options.skeleton_max_points).validate()
    if options.skeleton_layout not in SKELETON_LAYOUTS:
        raise ValueError(f"unknown skeleton_layout {options.skeleton_layout!r}; choose one of {', '.join(SKELETON_LAYOUTS)}")
    if not parse_addresses(options.verify_addresses):
        raise ValueError("the coordinator needs at least one Verify service (--verify-addresses host:port)")


def _channel_factory(options: CoordinatorOptions):
    token = Path(options.downstream_token_file).read_text().strip() if options.downstream_token_file else ""

    def open_downstream(address: str) -> grpc.aio.Channel:
        return open_channel(address, tls_ca=options.downstream_tls_ca, client_cert=options.downstream_client_cert,
                            client_key=options.downstream_client_key, token=token, options=DEFAULT_OPTIONS)

    return open_downstream


async def target_info(pool: ServicePool, deadline_s: float) -> tuple[TargetInfo, list[int] | None, str]:
    """The target's vocab, context and EOS ids, from the first Verify replica that answers; for an
    encoder-decoder target the decoder prompt its generations start from (None: decoder-only); and
    the drafters the Verify service hosts (comma-separated, "" for none; replicas of one service share
    their config)."""
    last_error: Exception | None = None
    while time.monotonic() < deadline_s:
        for replica in pool.replicas.replicas:
            try:
                response = await verify_pb2_grpc.VerifyServiceStub(pool.channel(replica)).GetInfo(
                    verify_pb2.VerifyGetInfoRequest(), timeout=2.0)
                model = response.model
                decoder_prompt = list(response.decoder_prompt_ids) if response.is_encoder_decoder else None
                info = TargetInfo(model.vocab_size, model.max_context_tokens, tuple(model.eos_token_ids))
                return info, decoder_prompt, response.fused_drafter
            except grpc.aio.AioRpcError as exc:
                last_error = exc
        await asyncio.sleep(0.5)
    raise RuntimeError(f"no Verify service answered GetInfo: {last_error}")


async def create_server(options: CoordinatorOptions) -> tuple[ServiceHandle, int]:
    from transformers import AutoTokenizer

    from specmesh.models.resolve import resolve_model_spec

    _check(options)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_spec(options.model))
    open_downstream = _channel_factory(options)
    verify = ServicePool("verify", parse_addresses(options.verify_addresses), options.router, open_downstream,
                         discovery_interval_s=options.discovery_interval_s)
    draft = ServicePool("draft", parse_addresses(options.draft_addresses), options.router, open_downstream,
                        discovery_interval_s=options.discovery_interval_s)
    for pool in (verify, draft):  # before GetInfo: a dns / ray source that is empty at start is re-read meanwhile
        pool.start_health_checks(options.health_interval_s)
    info, decoder_prompt_ids, verify_drafter = await target_info(verify, time.monotonic() + INFO_WAIT_S)
    metrics = ServiceMetrics("coordinator")
    stages = parse_cascade_stages(options.cascade_stages)
    stopper = load_stopper(options.cascade_predictor, stages, options.cascade_lambda) if options.cascade_predictor else None
    cascade = CascadeStages(stages, open_downstream, stopper=stopper)
    if stopper is None and options.cascade_lambda != float("inf"):
        raise ValueError("a finite cascade_lambda needs a cascade_predictor (specmesh cascade train)")
    servicer = CoordinatorServicer(options, tokenizer, info, verify, draft, metrics, cascade,
                                   decoder_prompt_ids=decoder_prompt_ids, verify_drafter=verify_drafter)

    async def close_pools() -> None:
        await verify.close()
        await draft.close()
        await cascade.close()

    handle = await start_service(options, metrics, servicer, [SERVICE_NAME], on_stop=[close_pools])
    if servicer.probes_skeleton:
        probe = asyncio.create_task(servicer.probe_skeleton())

        async def stop_probe() -> None:
            probe.cancel()
            await asyncio.gather(probe, return_exceptions=True)

        handle.on_stop.insert(0, stop_probe)
    return handle, handle.port
