"""A Verify service that borrows cores (`borrow_threads`, the launcher's `borrow_cpus`). Without a core
board its forwards get the borrowed threads while every open session is in a Run, and only its own while
any session is between client rounds (its drafts may be being made on the lent cores); with one, while
the lender runs no job. In-process service, port 0, loopback."""

from __future__ import annotations

import asyncio

import pytest
import torch

from servicekit.background import BackgroundServices
from servicekit.channels import open_channel as channel
from servicekit.core_share import CoreBoard, CoreShare
from specmesh.proto.v1 import common_pb2, verify_pb2, verify_pb2_grpc
from target_service.options import VerifyOptions
from target_service.server import create_server as create_verify

PROMPT = [5, 17, 33, 5, 17, 40]
GREEDY = common_pb2.SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=64)
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def service(tiny_model_dir):
    options = VerifyOptions(model=str(tiny_model_dir("llama")), dtype="float32", port=0, fused_drafter="", borrow_threads=1)
    with BackgroundServices() as background:
        handle = background.start(create_verify(options))
        yield handle, f"127.0.0.1:{handle.port}"


def test_forwards_borrow_threads_only_while_every_session_is_in_a_run(service):
    handle, address = service
    servicer = handle.servicer
    own = servicer.engine_thread.num_threads
    seen: list[int] = []
    verify_many = servicer.verifier.verify_many

    def recording(*args, **kwargs):  # engine thread: the threads its forward runs with
        seen.append(torch.get_num_threads())
        return verify_many(*args, **kwargs)

    servicer.verifier.verify_many = recording
    fitted: list[int] = []  # the threads of the forwards the verifier's cost fit took in
    observe = servicer.verifier._round_costs.observe

    def fitting(tokens, ms):
        fitted.append(torch.get_num_threads())
        observe(tokens, ms)

    servicer.verifier._round_costs.observe = fitting

    async def main() -> dict[str, list[int]]:
        threads = {}
        async with channel(address) as ch:
            stub = verify_pb2_grpc.VerifyServiceStub(ch)
            a = await _open(stub)
            seen.clear()
            await stub.Verify(verify_pb2.VerifyRequest(session_id=a.session_id, draft_token_ids=[3, 4]), timeout=TIMEOUT_S)
            threads["client round"] = list(seen)
            seen.clear()
            async for _ in stub.Run(verify_pb2.RunRequest(session_id=a.session_id, max_rounds=3), timeout=TIMEOUT_S):
                pass
            threads["the only session, in a Run"] = list(seen)
            b = await _open(stub)
            seen.clear()
            async for _ in stub.Run(verify_pb2.RunRequest(session_id=a.session_id, max_rounds=3), timeout=TIMEOUT_S):
                pass
            threads["a Run while another session is between calls"] = list(seen)
            seen.clear()
            await asyncio.gather(*(_drain(stub.Run(verify_pb2.RunRequest(session_id=s, max_rounds=3), timeout=TIMEOUT_S))
                                   for s in (a.session_id, b.session_id)))
            threads["both sessions in Runs"] = list(seen)
            for s in (a.session_id, b.session_id):
                await stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=s), timeout=TIMEOUT_S)
        return threads

    try:
        threads = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    finally:
        servicer.verifier.verify_many = verify_many
        servicer.verifier._round_costs.observe = observe
    assert fitted and set(fitted) == {own}  # the client round's, and Runs' on its own threads; never a borrowed one
    assert threads["client round"] == [own]
    assert threads["the only session, in a Run"] == [own + 1] * 3
    assert threads["a Run while another session is between calls"] == [own] * 3
    # (a forward may come before the second Run starts, or after the first ends)
    assert own + 1 in threads["both sessions in Runs"]


async def _open(stub: verify_pb2_grpc.VerifyServiceStub) -> verify_pb2.VerifyOpenSessionResponse:
    return await stub.OpenSession(verify_pb2.VerifyOpenSessionRequest(prompt_token_ids=PROMPT, sampling=GREEDY),
                                  timeout=TIMEOUT_S)


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def test_with_a_core_board_forwards_borrow_while_the_lender_runs_nothing(tiny_model_dir, tmp_path):
    """With the launcher's core board the rule is the lender's: a client round's verify runs on the
    lent threads while the process on those cores runs no job (a Propose and its Verify take turns), on
    its own while one does; the cost fit then prices the borrowed forwards, what a lone session's
    rounds run with."""
    board = str(tmp_path / "cores.board")
    CoreBoard.create(board)
    lender = CoreShare(CoreBoard(board), slot=0, lenders=(), borrow_threads=0)  # stands for the Draft service
    options = VerifyOptions(model=str(tiny_model_dir("llama")), dtype="float32", port=0, fused_drafter="", borrow_threads=1,
                            core_board=board, core_slot=1, lender_slots="0")
    with BackgroundServices() as background:
        handle = background.start(create_verify(options))
        servicer, address = handle.servicer, f"127.0.0.1:{handle.port}"
        own = servicer.engine_thread.num_threads
        seen: list[int] = []
        fitted: list[int] = []
        verify_many, observe = servicer.verifier.verify_many, servicer.verifier._round_costs.observe
        servicer.verifier.verify_many = lambda *a, **k: (seen.append(torch.get_num_threads()), verify_many(*a, **k))[1]
        servicer.verifier._round_costs.observe = lambda t, ms: (fitted.append(torch.get_num_threads()), observe(t, ms))[1]

        async def main() -> dict[str, list[int]]:
            threads = {}
            async with channel(address) as ch:
                stub = verify_pb2_grpc.VerifyServiceStub(ch)
                a = await _open(stub)
                for lender_busy in (False, True):
                    if lender_busy:
                        lender.begin(may_borrow=False)
                    seen.clear()
                    await stub.Verify(verify_pb2.VerifyRequest(session_id=a.session_id, draft_token_ids=[3, 4]),
                                      timeout=TIMEOUT_S)
                    threads["lender busy" if lender_busy else "lender idle"] = list(seen)
                lender.end()
                await stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=a.session_id), timeout=TIMEOUT_S)
            return threads

        threads = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
        share, registry = servicer.engine_thread.core_share, servicer.metrics.registry
        assert share.num_borrowed_jobs >= 1
        # the metrics say so (read between two looks at the counts: the lent-step timings may run a job meanwhile)
        before = (share.num_jobs, share.num_borrowed_jobs)
        scraped = (registry.get_sample_value("specmesh_engine_jobs"), registry.get_sample_value("specmesh_engine_jobs_lent"))
        after = (share.num_jobs, share.num_borrowed_jobs)
        assert all(b <= s <= a for b, s, a in zip(before, scraped, after)) and before[0] > before[1]
    assert threads == {"lender idle": [own + 1], "lender busy": [own]}
    assert fitted == [own + 1]  # the round on lent threads; not the one on its own


def test_the_lent_step_timings_run_between_requests_and_getinfo_says_until_they_are_done(tiny_model_dir, tmp_path,
                                                                                           monkeypatch):
    """With a core board the service times its target's and its hosted model drafter's steps again on the
    lent threads, never while a session is open (the timing's forwards would run between its rounds), and
    says `settling` in GetInfo until both are timed (the launcher waits for that before it calls a cluster
    ready). Each timing is recorded with the number of sessions open as it ran: the first may come before
    the session opens, so what is checked is that none runs while it is open and each engine's are done
    after the close."""
    import specmesh.models.engine as engine_module

    board = str(tmp_path / "cores.board")
    CoreBoard.create(board)
    options = VerifyOptions(model=str(tiny_model_dir("llama")), dtype="float32", port=0, fused_drafter="ngram,model",
                            borrow_threads=1, core_board=board, core_slot=1, lender_slots="0")
    timed: list[tuple[object, int, str]] = []  # (engine, sessions open, phase) as each timing that ran began
    phase = ["before"]
    holder: dict[str, object] = {}
    measure_step = engine_module.measure_step

    def recording(engine, *args, **kwargs):  # engine thread; a timing stopped part way raises, unrecorded
        servicer = holder.get("servicer")
        started = (engine, len(servicer.sessions) if servicer is not None else 0, phase[0])
        result = measure_step(engine, *args, **kwargs)
        timed.append(started)
        return result

    monkeypatch.setattr(engine_module, "measure_step", recording)
    with BackgroundServices() as background:
        handle = background.start(create_verify(options))
        servicer, address = handle.servicer, f"127.0.0.1:{handle.port}"
        holder["servicer"] = servicer
        engines = [servicer.engine, servicer.fused_drafters["model"].engine]

        async def main():
            async with channel(address) as ch:
                stub = verify_pb2_grpc.VerifyServiceStub(ch)
                settling_at_start = (await stub.GetInfo(verify_pb2.VerifyGetInfoRequest(), timeout=TIMEOUT_S)).process.settling
                a = await _open(stub)
                phase[0] = "open"
                await asyncio.sleep(1.0)
                phase[0] = "after"
                await stub.CloseSession(verify_pb2.VerifyCloseSessionRequest(session_id=a.session_id), timeout=TIMEOUT_S)
                for _ in range(150):
                    if not (await stub.GetInfo(verify_pb2.VerifyGetInfoRequest(), timeout=TIMEOUT_S)).process.settling:
                        break
                    await asyncio.sleep(0.2)
                settled = not (await stub.GetInfo(verify_pb2.VerifyGetInfoRequest(), timeout=TIMEOUT_S)).process.settling
            return settling_at_start, settled

        settling_at_start, settled = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    assert settling_at_start and settled
    assert [t for t in timed if t[2] == "open" or t[1] > 0] == []  # none while the session was open
    assert all(any(e is engine and p == "after" for e, _, p in timed) for engine in engines)  # each timed after the close
