"""Blocking work beside the engine runs on single-threaded torch threads (servicekit.engine_thread)."""

import asyncio

import torch

from servicekit.engine_thread import EngineThread, run_aside


def test_aside_threads_run_torch_on_one_thread_and_leave_the_engine_thread_its_own():
    engine = EngineThread("test-aside", num_threads=2)

    async def main():
        aside = await run_aside(torch.get_num_threads)
        on_engine = await engine.run(torch.get_num_threads)
        return aside, on_engine

    try:
        assert asyncio.run(main()) == (1, 2)
    finally:
        engine.shutdown()


def test_the_verify_service_compiles_grammars_aside(tiny_model_dir, monkeypatch):
    """A skeleton grammar is compiled off the loop, and not on a default-executor thread, whose
    multi-threaded torch ops would slow every later forward of the engine thread."""
    from servicekit.engine_thread import EngineThread as Thread
    from target_service.grammars import SkeletonGrammars

    threads_seen = []
    original = SkeletonGrammars.get

    def recording(self, fmt):
        threads_seen.append(torch.get_num_threads())
        return original(self, fmt)

    monkeypatch.setattr(SkeletonGrammars, "get", recording)
    from servicekit.metrics import ServiceMetrics
    from specmesh.models.load import load_engine
    from specmesh.proto.v1 import verify_pb2
    from target_service.options import VerifyOptions
    from target_service.servicer import VerifyServicer

    folder = str(tiny_model_dir("llama"))
    engine_thread = Thread("test-verify", num_threads=2)
    servicer = VerifyServicer(VerifyOptions(model=folder), load_engine(folder), folder, ServiceMetrics("verify"),
                              engine_thread=engine_thread)
    try:
        asyncio.run(servicer._constraint(verify_pb2.SkeletonConstraint(max_points=2), [5, 6, 7]))
    finally:
        engine_thread.shutdown()
    assert threads_seen == [1]


def test_a_threads_count_survives_another_thread_setting_its_own():
    """torch applies the process-wide count (the last any thread set) at a thread's first op: a thread
    set to 1 whose first op came after an engine thread set 2 ran with 2 (the grammar test above failed
    so in a full suite run). `threads_here` makes the count the thread's own."""
    from concurrent.futures import ThreadPoolExecutor

    from servicekit.engine_thread import threads_here

    single = ThreadPoolExecutor(1, initializer=threads_here, initargs=(1,))
    double = ThreadPoolExecutor(1, initializer=threads_here, initargs=(2,))
    try:
        single.submit(lambda: None).result()  # its thread starts: count 1, no torch op yet
        double.submit(lambda: None).result()  # another thread sets 2 after it
        assert single.submit(torch.get_num_threads).result() == 1
        assert double.submit(torch.get_num_threads).result() == 2
    finally:
        single.shutdown()
        double.shutdown()
