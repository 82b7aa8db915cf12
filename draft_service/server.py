"""create_server(options) -> (handle, port): load the drafter and start the Draft service."""

from __future__ import annotations

from draft_service.options import DRAFTERS, DraftOptions
from draft_service.servicer import DraftServicer
from servicekit.core_share import core_share_from
from servicekit.engine_thread import EngineThread, single_threaded_here
from servicekit.metrics import ServiceMetrics
from servicekit.model import load_service_engine, model_shape
from servicekit.server import ServiceHandle, start_service
from specmesh.drafters.model import ModelDrafter
from specmesh.drafters.ngram import NgramStoreDrafter, PromptLookupDrafter
from specmesh.proto.v1 import draft_pb2_grpc

SERVICE_NAME = "specmesh.v1.DraftService"


def build_drafter(options: DraftOptions):
    """(drafter factory: q transform -> drafter, engine or None, vocab_size, max_context, model folder)"""
    if options.drafter not in DRAFTERS:
        raise ValueError(f"unknown drafter {options.drafter!r}; choose one of {', '.join(DRAFTERS)}")
    if options.drafter == "model":
        engine, folder = load_service_engine(options)
        return (lambda q_transform: ModelDrafter(engine, q_transform)), engine, engine.vocab_size, engine.max_context, folder
    vocab_size, max_context, folder = model_shape(options.model)
    if options.drafter == "ngram":
        drafter = PromptLookupDrafter(options.ngram_min_n, options.ngram_max_n)
    else:
        drafter = NgramStoreDrafter(options.ngram_min_n, options.ngram_max_n, options.ngram_max_branching)
    return (lambda q_transform: drafter), None, vocab_size, max_context, folder  # q is None: nothing to round


async def create_server(options: DraftOptions) -> tuple[ServiceHandle, int]:
    metrics = ServiceMetrics("draft")
    engine_thread = EngineThread("draft-engine")  # the model is loaded and run on it (servicekit.engine_thread)
    engine_thread.core_share = core_share_from(options)
    single_threaded_here()
    drafter, engine, vocab_size, max_context, folder = await engine_thread.run(build_drafter, options)
    servicer = DraftServicer(options, drafter, engine, vocab_size, max_context, folder, metrics, engine_thread)
    servicer.sessions.start_reaper(options.reaper_interval_s)
    handle = await start_service(options, metrics, servicer, [(draft_pb2_grpc.add_DraftServiceServicer_to_server, SERVICE_NAME)],
                                 on_stop=[servicer.shutdown])
    if engine is not None:
        engine_thread.time_apart(engine.stats)  # lent and unlent drafts priced apart (DraftServicer._ms_per_token)
        servicer.time_step_when_lent(engine)
    return handle, handle.port
