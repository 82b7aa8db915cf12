"""Devices and links in virtual time: engines, shared hosts, network links, and the Verify batcher.

A FIFO single server needs no events of its own: a job handed over at `now` starts when the server
frees up and ends `service_s` later, so `reserve` returns its end time and the caller sleeps until
then (one SimPy timeout). This holds as long as jobs reach a server in the order they are reserved:
true for a link or draft device reserved ahead of time through one link of fixed latency (arrival
times then keep the order of reservation) and for an engine (jobs are handed over at `now`).

Engines. Each service has one engine thread (DESIGN.md): its forwards run one at a time, first come
first served. A service alone on its device (`DeviceEngine`) runs each forward in its table's time.
Services that name the same `host:` in the config run on that host's `cores` (`Host`): a service
has `threads` (its torch threads, the setting its cost table was measured with), and while a forward
runs it asks for that many cores. Processor sharing: while the running forwards ask for at most
`cores` in all, each runs at full speed (a 2-core host runs a 1-thread draft forward and a 1-thread
verify forward side by side); past that, every running forward slows by cores / (threads asked),
as a fair OS scheduler gives each runnable thread the same share of the cores (other processes'
load, `background_threads`, counts as threads asked). Worked example
(`tests/unit/test_sim.py`): three 1-thread services on 2 cores, 10 ms forwards starting at 0, 0 and
5 ms -> the first two run at full speed to 5 ms, then all three at 2/3 speed: the first two end at
5 + 5 / (2/3) = 12.5 ms; the third has done 7.5 * 2/3 = 5 ms of its work by then, runs the rest
alone at full speed and ends at 17.5 ms. No randomness: the same run gives the same schedule.
Memory: the host's cores share one memory bus, and a model forward streams its weights, so forwards side
by side slow each other even on cores of their own, as much as each leans on the bus. A forward's
`intensity` is the share of its time spent streaming its weights: its one-row one-token time (the weights
read once, per forward it holds) over its time, 1 for a decode step, less for a verify chain, a batch of
rows or a prefill, which reuse each weight they read. With `memory_contention` c, a forward of intensity
i runs at 1 / (1 + c i S) of its core share, S the summed intensity of the other forwards running (the
processes' CPU jobs neither slow nor are slowed: they touch little memory). Measured on the 2-core
AVX-512 VM, each process pinned to a core: an fp32 5-token verify (intensity about 0.67) 35.8 -> 42.1 ms
beside bf16 one-token forwards (1), which went 13.6 -> 17.4 ms (c about 0.3-0.4); live, at 16 clients
(batches of 3-5 rows), the services' CPU stayed within 7% of their forwards' priced alone.
Assumptions: a forward's time scales with the share of the cores it gets (exact for 1-thread forwards
time-sliced on a core; optimistic for multi-thread OpenMP teams that oversubscribe cores, which spin
and lose more than their share); caches are not shared. CPU outside
the forwards is on the host only where the config gives it: the coordinator's and the clients' per
message, the services' per call on their RPC threads (`Process` in cluster.py): 1-thread
`HostedEngine` jobs; otherwise it lives in the per-message latency.

`BatchingServer.run` is `servicekit.batching.WindowBatcher._run` in virtual time: take calls first
in, first out, up to `max_batch_cost` (at least one call); before each batch sleep `batch_window_ms`
unless every open session already has a call queued; run the batch as one engine job (its forwards,
plus `engine_ms_per_call` per call it holds: the engine thread's own work outside the forwards). The Verify
service (`TargetServer`) counts tokens against `max_batch_tokens`; the Draft service
(`DraftServer`) counts sessions against `max_batch_sessions`. Prefill chunks are engine jobs too
(`target_service.servicer._prefill`), so they interleave with batches in FIFO order, each delaying
the rounds queued behind it by one chunk. So are the sessions' OpenSession / CloseSession calls (jobs of
no work that wait their turn): the driver awaits the Draft session's opening before the first Propose
and closes both sessions before the client's stream ends (cluster.py `_session_call`).
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
        self.num_jobs = 0  # started inside the window (those of no work, a session call's turn, aside)

    def reserve(self, now_s: float, service_s: float) -> float:
        """The end time of a job handed over at `now_s`."""
        start = now_s if now_s > self.free_at_s else self.free_at_s
        end = start + service_s
        self.free_at_s = end
        self.busy_s += self.window.overlap_s(start, end)
        if start in self.window and service_s > 0:
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


class DeviceEngine:
    """The engine thread of a service alone on its device: forwards one at a time, in table time."""

    def __init__(self, env: simpy.Environment, name: str, window: Window):
        self.env = env
        self.fifo = FifoServer(name, window)

    @property
    def busy_s(self) -> float:
        return self.fifo.busy_s

    @property
    def num_jobs(self) -> int:
        return self.fifo.num_jobs

    def run(self, service_s: float, intensity: float = 1.0) -> simpy.Event:
        """A forward of `service_s` handed over now; the event fires when it ends (`intensity`: for a host)."""
        return self.env.timeout(self.fifo.reserve(self.env.now, service_s) - self.env.now)


@dataclass(eq=False)
class _Job:
    engine: HostedEngine
    remaining_s: float  # work left, in seconds at full speed
    done: simpy.Event
    start_s: float
    intensity: float = 1.0  # a forward's share of its time streaming weights (module docstring)


class Host:
    """A machine's cores, shared by the forwards of the services on it (processor sharing; see the
    module docstring). Event-driven: each change of the running set advances every job's work at the
    old speed and schedules a timer for the next job to end; a superseded timer is ignored."""

    DONE_S = 1e-9  # work left under this (float rounding of the clock) counts as finished

    def __init__(self, env: simpy.Environment, name: str, cores: int, window: Window, background_threads: float = 0.0,
                 memory_contention: float = 0.0):
        self.env = env
        self.name = name
        self.cores = cores
        self.background_threads = background_threads  # other load: runnable threads that share the cores alike
        self.memory_contention = memory_contention  # c of the memory bus's slowdown, 1 / (1 + c i S) (module docstring)
        self.window = window
        self.running: list[_Job] = []
        self.threads_asked = 0  # of the running jobs
        self.forwards_intensity = 0.0  # of the running jobs, the summed intensity of model engines' forwards
        self.core_busy_s = 0.0  # core-seconds in use inside the window
        self._since_s = 0.0
        self._timer_id = 0

    def speed(self) -> float:
        """The share of the cores every running job gets now (the fraction of full speed of a job that is
        not a forward slowed by the others beside it: `job_speed`)."""
        demand = self.threads_asked + self.background_threads
        return 1.0 if demand <= self.cores else self.cores / demand

    def job_speed(self, job: _Job) -> float:
        """The fraction of full speed `job` runs at now: its share of the cores, less, for a forward, the
        memory bus it shares with the other forwards running."""
        if not job.engine.forwards:
            return self.speed()
        others = max(0.0, self.forwards_intensity - job.intensity)
        return self.speed() / (1.0 + self.memory_contention * job.intensity * others)

    def _advance(self) -> None:
        now = self.env.now
        elapsed = now - self._since_s
        if elapsed > 0 and self.running:
            for job in self.running:
                job.remaining_s -= elapsed * self.job_speed(job)
            self.core_busy_s += self.threads_asked * self.speed() * self.window.overlap_s(self._since_s, now)
        self._since_s = now

    def core_utilisation(self) -> float:
        """The mean share of the cores in use by the services' forwards over the window, up to now."""
        self._advance()
        return self.core_busy_s / (self.cores * self.window.length_s)

    def _schedule(self) -> None:
        self._timer_id += 1
        if self.running:
            timer_id = self._timer_id
            first_s = min(max(0.0, job.remaining_s) / self.job_speed(job) for job in self.running)
            timer = self.env.timeout(first_s)
            timer.callbacks.append(lambda _event: self._on_timer(timer_id))

    def admit(self, job: _Job) -> None:
        self._advance()
        self.running.append(job)
        self.threads_asked += job.engine.threads
        self.forwards_intensity += job.intensity if job.engine.forwards else 0.0
        self._schedule()

    def _on_timer(self, timer_id: int) -> None:
        if timer_id != self._timer_id:
            return
        self._advance()
        finished = [job for job in self.running if job.remaining_s <= self.DONE_S]
        self.running = [job for job in self.running if job.remaining_s > self.DONE_S]
        self.threads_asked -= sum(job.engine.threads for job in finished)
        self.forwards_intensity -= sum(job.intensity for job in finished if job.engine.forwards)
        self._schedule()
        for job in finished:
            job.engine.finished(job)


class HostedEngine:
    """The engine thread of a service on a shared `Host`: its own forwards one at a time, FIFO, each
    asking the host for `threads` cores while it runs (`forwards`: a model's, which share the memory bus;
    else a process's thread)."""

    def __init__(self, env: simpy.Environment, host: Host, threads: int, window: Window, forwards: bool = False):
        self.env = env
        self.host = host
        self.threads = threads
        self.forwards = forwards
        self.window = window
        self.busy_s = 0.0  # wall time with a forward running, inside the window
        self.num_jobs = 0
        self._running = False
        self._pending: deque[tuple[float, simpy.Event, float]] = deque()

    def run(self, service_s: float, intensity: float = 1.0) -> simpy.Event:
        if not self._running and service_s <= 0:  # no work, nothing ahead of it: done now (as on a `DeviceEngine`)
            return self.env.timeout(0)
        done = self.env.event()
        if self._running:
            self._pending.append((service_s, done, intensity))
        else:
            self._start(service_s, done, intensity)
        return done

    def _start(self, service_s: float, done: simpy.Event, intensity: float) -> None:
        self._running = True
        if self.env.now in self.window:
            self.num_jobs += 1
        self.host.admit(_Job(self, service_s, done, self.env.now, intensity))

    def finished(self, job: _Job) -> None:
        self.busy_s += self.window.overlap_s(job.start_s, self.env.now)
        job.done.succeed()
        self._running = False
        while self._pending and self._pending[0][0] <= 0:  # jobs of no work (a session call's turn) end as they start
            self._pending.popleft()[1].succeed()
        if self._pending:
            self._start(*self._pending.popleft())


Engine = DeviceEngine | HostedEngine


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
                 engine: Engine | None = None):
        self.env = env
        self.name = name
        self.window = window
        self.engine: Engine = engine or DeviceEngine(env, name, window)
        self.max_batch_cost = max_batch_cost
        self.window_s = batch_window_ms / 1e3
        self.engine_s_per_call = 0.0  # engine-thread CPU per call outside the forward (sampling, acceptance), added to its batch
        self.num_sessions = 0  # open sessions: the batcher's expected callers
        self.queue: deque[Call] = deque()
        self.queue_depth = TimeAverage(window)
        self.num_batches = 0  # inside the window, as for the rest
        self.num_batch_rows = 0
        self.num_batch_cost = 0
        self._idle: simpy.Event | None = None
        self._running = False  # a batch taken from the queue has not finished
        self._idle_waiters: list[simpy.Event] = []
        env.process(self.run())

    def idle(self) -> simpy.Event:
        """Fires once no call waits and no batch runs (`WindowBatcher.wait_idle`): at once if so now."""
        event = self.env.event()
        if self.queue or self._running:
            self._idle_waiters.append(event)
        else:
            event.succeed()
        return event

    def batch_ms(self, payloads: list[tuple]) -> float:
        """Engine milliseconds of one batch."""
        raise NotImplementedError

    def floor_ms(self, payloads: list[tuple]) -> float:
        """What the batch's forwards take when each is one row of one token: its weights streamed once per
        forward (its `intensity` is this over its time)."""
        raise NotImplementedError

    def intensity(self, job_ms: float, floor_ms: float) -> float:
        """A job's share of its time streaming weights (servers.py module docstring: memory)."""
        return 1.0 if job_ms <= 0 else min(1.0, floor_ms / job_ms)

    @property
    def busy_s(self) -> float:
        """Wall time this service's engine ran a forward, inside the window."""
        return self.engine.busy_s

    @property
    def num_jobs(self) -> int:
        return self.engine.num_jobs

    def run_job(self, service_s: float, intensity: float = 1.0) -> simpy.Event:
        """Hand the engine a job (a batch, a prefill chunk) now; the event fires when it ends."""
        return self.engine.run(service_s, intensity)

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
            self._running = True
            payloads = [c.payload for c in batch]
            job_ms = self.batch_ms(payloads)
            done = self.run_job(job_ms / 1e3 + len(batch) * self.engine_s_per_call, self.intensity(job_ms, self.floor_ms(payloads)))
            if env.now in self.window:
                self.num_batches += 1
                self.num_batch_rows += len(batch)
                self.num_batch_cost += sum(c.cost for c in batch)
            yield done
            self._running = False
            for call in batch:
                call.done.succeed()
            if not self.queue:
                waiters, self._idle_waiters = self._idle_waiters, []
                for waiter in waiters:
                    waiter.succeed()


class TargetServer(BatchingServer):
    """A Verify service. A call is (1 + k tokens, the session's context); a batch is one forward."""

    def __init__(self, env: simpy.Environment, name: str, cost: CostModel, window: Window, max_batch_tokens: int,
                 batch_window_ms: float, prefill_chunk_tokens: int, engine: Engine | None = None):
        super().__init__(env, name, window, max_batch_tokens, batch_window_ms, engine)
        self.cost = cost
        self.prefill_chunk_tokens = prefill_chunk_tokens

    def verify(self, num_tokens: int, context: int) -> simpy.Event:
        return self.submit(num_tokens, (num_tokens, context))

    def batch_ms(self, payloads: list[tuple]) -> float:
        rows = len(payloads)
        return self.cost.forward_ms(rows, sum(p[0] for p in payloads) / rows, sum(p[1] for p in payloads) / rows)

    def floor_ms(self, payloads: list[tuple]) -> float:
        return self.cost.forward_ms(1, 1, sum(p[1] for p in payloads) / len(payloads))

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
                 batch_window_ms: float, engine: Engine | None = None):
        super().__init__(env, name, window, max_batch_sessions, batch_window_ms, engine)
        self.cost = cost
        self.steps_equal_chains = False  # drafting ahead: see `DraftGroup.steps_equal_chains`

    def propose(self, num_fed_tokens: int, k: int, context: int) -> simpy.Event:
        return self.submit(1, (num_fed_tokens, k, context))

    def batch_ms(self, payloads: list[tuple]) -> float:
        rows = len(payloads)
        context = sum(p[2] for p in payloads) / rows
        total = self.cost.forward_ms(rows, sum(p[0] for p in payloads) / rows, context)
        for position in range(1, max(p[1] for p in payloads)):
            total += self.cost.forward_ms(sum(1 for p in payloads if p[1] > position), 1, context + position)
        return total

    def floor_ms(self, payloads: list[tuple]) -> float:
        context = sum(p[2] for p in payloads) / len(payloads)
        return sum(self.cost.forward_ms(1, 1, context + position) for position in range(max(1, max(p[1] for p in payloads))))
