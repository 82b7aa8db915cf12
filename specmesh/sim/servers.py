"""Devices and links in virtual time: FIFO engines, network links, and the target's Verify batcher.

A FIFO single server needs no events of its own: a job handed over at `now` starts when the server
frees up and ends `service_s` later, so `reserve` returns its end time and the caller sleeps until
then (one SimPy timeout). This holds as long as jobs reach a server in the order they are reserved:
true for a target's engine (the batcher and prefills reserve at `now`) and for a link or draft
device reserved ahead of time through one link of fixed latency (arrival times then keep the order
of reservation).

`BatchingServer.run` is `servicekit.batching.WindowBatcher._run` in virtual time: take calls first
in, first out, up to `max_batch_cost` (at least one call); before each batch sleep `batch_window_ms`
unless every open session already has a call queued; run the batch as one engine job. The Verify
service (`TargetServer`) counts tokens against `max_batch_tokens`; the Draft service
(`DraftServer`) counts sessions against `max_batch_sessions`. Prefill chunks are engine jobs too
(`target_service.servicer._prefill`), so they interleave with batches in FIFO order, each delaying
the rounds queued behind it by one chunk.

Services on one host (`host:` in the config) share one engine: their forwards do not overlap. That is
how processes that each use every core of the host share it (each forward runs at full speed, one at
a time: the same total throughput as time-slicing), and how to profile them: one process, all cores.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import simpy

from specmesh.sim.cost import CostModel


class Window:
    """The measured interval [start_s, end_s): burn-in before it, the end of the run after it."""

    def __init__(self, start_s: float, end_s: float):
        self.start_s, self.end_s = start_s, end_s

    @property
    def length_s(self) -> float:
        return self.end_s - self.start_s

    def overlap_s(self, a: float, b: float) -> float:
        return max(0.0, min(b, self.end_s) - max(a, self.start_s))

    def __contains__(self, t: float) -> bool:
        return self.start_s <= t < self.end_s


class FifoServer:
    """One device (or one direction of a link) serving jobs one at a time, first come first served."""

    def __init__(self, name: str, window: Window):
        self.name = name
        self.window = window
        self.free_at_s = 0.0
        self.busy_s = 0.0  # inside the window
        self.num_jobs = 0  # started inside the window

    def reserve(self, now_s: float, service_s: float) -> float:
        """The end time of a job handed over at `now_s`."""
        start = now_s if now_s > self.free_at_s else self.free_at_s
        end = start + service_s
        self.free_at_s = end
        self.busy_s += self.window.overlap_s(start, end)
        if start in self.window:
            self.num_jobs += 1
        return end


class NetLink:
    """A two-way link: fixed one-way latency, and per direction a bandwidth shared FIFO by messages."""

    def __init__(self, name: str, latency_ms: float, bandwidth_mbps: float, window: Window):
        self.latency_s = latency_ms / 1e3
        self.s_per_byte = 8.0 / (bandwidth_mbps * 1e6) if bandwidth_mbps > 0 else 0.0
        self.up = FifoServer(f"{name}/up", window)  # toward the coordinator
        self.down = FifoServer(f"{name}/down", window)

    def send_up(self, now_s: float, num_bytes: float) -> float:
        """Arrival time at the coordinator of a message sent at `now_s`."""
        if self.s_per_byte:
            now_s = self.up.reserve(now_s, num_bytes * self.s_per_byte)
        return now_s + self.latency_s

    def send_down(self, now_s: float, num_bytes: float) -> float:
        if self.s_per_byte:
            now_s = self.down.reserve(now_s, num_bytes * self.s_per_byte)
        return now_s + self.latency_s


class TimeAverage:
    """The time-weighted mean and the max of a quantity that changes at events, inside a window."""

    def __init__(self, window: Window):
        self.window = window
        self.value = 0
        self.max_value = 0
        self._since_s = 0.0
        self._area = 0.0

    def set(self, now_s: float, value: int) -> None:
        self._area += self.value * self.window.overlap_s(self._since_s, now_s)
        self.value, self._since_s = value, now_s
        if value > self.max_value and now_s in self.window:
            self.max_value = value

    def mean(self, end_s: float) -> float:
        self.set(end_s, self.value)
        return self._area / self.window.length_s


@dataclass
class Call:
    cost: int  # what counts against max_batch_cost: tokens (Verify) or 1 per session (Propose)
    payload: tuple  # what the batch's cost function reads
    done: simpy.Event


class BatchingServer:
    """A service with one engine thread and `servicekit.batching.WindowBatcher` in front of it."""

    def __init__(self, env: simpy.Environment, name: str, window: Window, max_batch_cost: int, batch_window_ms: float,
                 engine: FifoServer | None = None):
        self.env = env
        self.name = name
        self.window = window
        self.engine = engine or FifoServer(name, window)  # shared by the services of one host (`host:` in config)
        self.busy_s = 0.0  # this service's own engine time inside the window
        self.num_jobs = 0
        self.max_batch_cost = max_batch_cost
        self.window_s = batch_window_ms / 1e3
        self.num_sessions = 0  # open sessions: the batcher's expected callers
        self.queue: deque[Call] = deque()
        self.queue_depth = TimeAverage(window)
        self.num_batches = 0  # inside the window, as for the rest
        self.num_batch_rows = 0
        self.num_batch_cost = 0
        self._idle: simpy.Event | None = None
        env.process(self.run())

    def batch_ms(self, payloads: list[tuple]) -> float:
        """Engine milliseconds of one batch."""
        raise NotImplementedError

    def run_job(self, now_s: float, service_s: float) -> float:
        """Hand the engine a job (a batch, a prefill chunk); its end time."""
        end = self.engine.reserve(now_s, service_s)
        self.busy_s += self.window.overlap_s(end - service_s, end)
        if end - service_s in self.window:
            self.num_jobs += 1
        return end

    def submit(self, cost: int, payload: tuple) -> simpy.Event:
        """Queue one call; the event fires when its batch has run."""
        call = Call(cost, payload, self.env.event())
        self.queue.append(call)
        self.queue_depth.set(self.env.now, len(self.queue))
        if self._idle is not None:
            self._idle.succeed()
            self._idle = None
        return call.done

    def _take(self) -> list[Call]:
        batch: list[Call] = []
        budget = self.max_batch_cost
        queue = self.queue
        while queue:
            cost = queue[0].cost
            if batch and cost > budget:
                break
            batch.append(queue.popleft())
            budget -= cost
        self.queue_depth.set(self.env.now, len(queue))
        return batch

    def run(self):
        env = self.env
        while True:
            if not self.queue:
                self._idle = env.event()
                yield self._idle
            if self.window_s > 0 and len(self.queue) < self.num_sessions:
                yield env.timeout(self.window_s)
            batch = self._take()
            end = self.run_job(env.now, self.batch_ms([c.payload for c in batch]) / 1e3)
            if env.now in self.window:
                self.num_batches += 1
                self.num_batch_rows += len(batch)
                self.num_batch_cost += sum(c.cost for c in batch)
            yield env.timeout(end - env.now)
            for call in batch:
                call.done.succeed()


class TargetServer(BatchingServer):
    """A Verify service. A call is (1 + k tokens, the session's context); a batch is one forward."""

    def __init__(self, env: simpy.Environment, name: str, cost: CostModel, window: Window, max_batch_tokens: int,
                 batch_window_ms: float, prefill_chunk_tokens: int, engine: FifoServer | None = None):
        super().__init__(env, name, window, max_batch_tokens, batch_window_ms, engine)
        self.cost = cost
        self.prefill_chunk_tokens = prefill_chunk_tokens

    def verify(self, num_tokens: int, context: int) -> simpy.Event:
        return self.submit(num_tokens, (num_tokens, context))

    def batch_ms(self, payloads: list[tuple]) -> float:
        rows = len(payloads)
        return self.cost.forward_ms(rows, sum(p[0] for p in payloads) / rows, sum(p[1] for p in payloads) / rows)

    def prefill_jobs_ms(self, num_prompt_tokens: int) -> list[float]:
        """The engine jobs of one prefill: chunks of `prefill_chunk_tokens`, then the rest, which
        also samples the first token."""
        jobs, cached, chunk = [], 0, self.prefill_chunk_tokens
        while 0 < chunk < num_prompt_tokens - cached:
            jobs.append(self.cost.forward_ms(1, chunk, cached))
            cached += chunk
        jobs.append(self.cost.forward_ms(1, num_prompt_tokens - cached, cached))
        return jobs


class DraftServer(BatchingServer):
    """A Draft service (or a device drafting for its own user). A call is (tokens fed first, k,
    context); a batch drafts position by position (`ModelDrafter.propose_many`): the first forward
    feeds every row's pending tokens (the whole prompt on a session's first call: the drafter
    prefills lazily), each later one a token per row still drafting."""

    def __init__(self, env: simpy.Environment, name: str, cost: CostModel, window: Window, max_batch_sessions: int,
                 batch_window_ms: float, engine: FifoServer | None = None):
        super().__init__(env, name, window, max_batch_sessions, batch_window_ms, engine)
        self.cost = cost

    def propose(self, num_fed_tokens: int, k: int, context: int) -> simpy.Event:
        return self.submit(1, (num_fed_tokens, k, context))

    def batch_ms(self, payloads: list[tuple]) -> float:
        rows = len(payloads)
        context = sum(p[2] for p in payloads) / rows
        total = self.cost.forward_ms(rows, sum(p[0] for p in payloads) / rows, context)
        for position in range(1, max(p[1] for p in payloads)):
            total += self.cost.forward_ms(sum(1 for p in payloads if p[1] > position), 1, context + position)
        return total
