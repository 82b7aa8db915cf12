"""create_server(options) -> (handle, port) for the Stage service."""

from __future__ import annotations

from servicekit.engine_thread import EngineThread, single_threaded_here
from servicekit.metrics import ServiceMetrics
from servicekit.model import load_service_engine
from servicekit.server import ServiceHandle, start_service
from specmesh.proto.v1 import stage_pb2_grpc
from stage_service.options import StageOptions
from stage_service.servicer import StageServicer

SERVICE_NAME = "specmesh.v1.StageService"


async def create_server(options: StageOptions) -> tuple[ServiceHandle, int]:
    metrics = ServiceMetrics("stage")
    engine_thread = EngineThread("stage-engine")  # the model is loaded and run on it (servicekit.engine_thread)
    single_threaded_here()
    engine, folder = await engine_thread.run(load_service_engine, options)
    servicer = StageServicer(options, engine, folder, metrics, engine_thread)
    servicer.sessions.start_reaper(options.reaper_interval_s)
    handle = await start_service(options, metrics, servicer, [(stage_pb2_grpc.add_StageServiceServicer_to_server, SERVICE_NAME)],
                                 on_stop=[servicer.shutdown])
    servicer.time_step_when_settled(engine)  # the figure its OpenSession reports (a filling stage's token)
    return handle, handle.port
