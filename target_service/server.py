"""create_server(options) -> (handle, port): load the target (and fused drafter), start the Verify service."""

from __future__ import annotations

from servicekit.core_share import core_share_from
from servicekit.engine_thread import EngineThread, single_threaded_here
from servicekit.metrics import ServiceMetrics
from servicekit.model import load_service_engine
from servicekit.server import ServiceHandle, start_service
from specmesh.drafters.model import ModelDrafter, self_draft
from specmesh.drafters.ngram import NgramStoreDrafter, PromptLookupDrafter
from specmesh.proto.v1 import verify_pb2_grpc
from target_service.options import VerifyOptions, fused_drafter_names
from target_service.servicer import VerifyServicer

SERVICE_NAME = "specmesh.v1.VerifyService"


def build_fused_drafters(options: VerifyOptions, target=None, target_folder: str | None = None) -> dict:
    """The drafters Step and Run host, by name, in `fused_drafter`'s order (the first is the default)."""
    return {name: build_fused_drafter(options, target, target_folder, name) for name in fused_drafter_names(options.fused_drafter)}


def build_fused_drafter(options: VerifyOptions, target=None, target_folder: str | None = None, name: str | None = None):
    """The hosted drafter `name` (default: the first of `fused_drafter`; None when that is ""); a model
    drafter is checked against `target` (an Engine) when given: same kind (decoder-only /
    encoder-decoder) and vocabulary (IncompatibleDraftError otherwise)."""
    if name is None:
        names = fused_drafter_names(options.fused_drafter)
        name = names[0] if names else ""
    if name == "ngram":
        return PromptLookupDrafter()
    if name == "ngram-store":
        return NgramStoreDrafter()
    if name == "model":
        from servicekit.model import resolve_folder
        from specmesh.models.engine import measure_step
        from specmesh.models.load import load_engine
        from specmesh.models.pairing import check_draft_compatible

        folder = resolve_folder(options.fused_drafter_model or options.model)
        engine = load_engine(folder, dtype=options.fused_drafter_dtype, device=options.device, max_kv_tokens=options.max_kv_tokens)
        if target is not None:
            check_draft_compatible(target, engine, target_folder, folder)
        measure_step(engine)  # fused rounds' k policy prior: what a draft token costs here
        if target is not None and not options.fused_drafter_model:  # the target's own weights: it takes the target's KV
            return self_draft(engine, target)
        return ModelDrafter(engine)
    return None


def share_kv(options: VerifyOptions, engine, folder: str):
    """The target's KV cache moved into shared memory for a Draft service on this host (`specmesh.kv.shared`;
    answers then carry `target_kv`): CPU native engines, with `share_kv` on."""
    from specmesh.kv.shared import share_cache
    from specmesh.models.encdec import is_encoder_decoder
    from specmesh.models.native_engine import NativeEngine

    if not options.share_kv or not isinstance(engine, NativeEngine) or is_encoder_decoder(engine) or engine.device.type != "cpu":
        return None
    return share_cache(engine.cache, folder)


async def create_server(options: VerifyOptions) -> tuple[ServiceHandle, int]:
    metrics = ServiceMetrics("verify")
    engine_thread = EngineThread("verify-engine")  # the model is loaded and run on it (servicekit.engine_thread)
    engine_thread.core_share = core_share_from(options)
    single_threaded_here()
    engine, folder = await engine_thread.run(load_service_engine, options)
    shared = await engine_thread.run(share_kv, options, engine, folder)
    fused = await engine_thread.run(build_fused_drafters, options, engine, folder)
    servicer = VerifyServicer(options, engine, folder, metrics, fused, engine_thread, shared_kv=shared)
    servicer.sessions.start_reaper(options.reaper_interval_s)
    handle = await start_service(options, metrics, servicer, [(verify_pb2_grpc.add_VerifyServiceServicer_to_server, SERVICE_NAME)],
                                 on_stop=[servicer.shutdown])
    drafter_engines = [d.engine for d in fused.values() if getattr(d, "engine", None) is not None]
    servicer.time_step_when_lent(engine, *drafter_engines)  # a model drafter's step priced on lent threads too
    return handle, handle.port
