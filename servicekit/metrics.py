"""Prometheus metrics of one service, in its own registry, served over HTTP on a separate port.

Names (prefix `specmesh_`): requests_total{method,code}, request_seconds{method}, batch_size
(sessions per engine forward), batch_tokens, queue_depth, sessions, forwards_total, drafts_total,
draft_tokens_total, accepted_tokens_total, accepted_per_position_total{position}, and the derived
mean accepted length = 1 + accepted_tokens_total / drafts_total; expired_sessions_total, and the KV
pool: kv_blocks_total, kv_blocks_free, kv_block_size; the engine's own counters (every forward,
prefills and forks included): engine_forwards, engine_sequences_forwarded, engine_attention_rows
(fewer rows than sequences when forks share one sequence: Skeleton-of-Thought's one-sequence layout).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class ServiceMetrics:
    def __init__(self, service: str):
        self.registry = CollectorRegistry()
        r, p = self.registry, "specmesh_"
        labels = dict(registry=r)
        self.service = service
        self.requests = Counter(p + "requests", "RPCs by method and status code", ["method", "code"], **labels)
        self.request_seconds = Histogram(p + "request_seconds", "RPC latency", ["method"], **labels)
        self.batch_size = Histogram(p + "batch_size", "sessions per engine forward", buckets=BATCH_BUCKETS, **labels)
        self.batch_tokens = Histogram(p + "batch_tokens", "tokens per batched verify forward",
                                      buckets=(1, 8, 32, 128, 512, 2048, 8192), **labels)
        self.queue_depth = Gauge(p + "queue_depth", "calls waiting for the engine", **labels)
        self.sessions = Gauge(p + "sessions", "open sessions", **labels)
        self.forwards = Counter(p + "forwards", "batched engine calls (verify or draft rounds)", **labels)
        self.drafts = Counter(p + "drafts", "rounds with at least one draft token", **labels)
        self.draft_tokens = Counter(p + "draft_tokens", "draft tokens proposed or verified", **labels)
        self.accepted_tokens = Counter(p + "accepted_tokens", "draft tokens accepted", **labels)
        self.accepted_per_position = Counter(p + "accepted_per_position", "accepted draft tokens by position",
                                             ["position"], **labels)
        self.expired_sessions = Counter(p + "expired_sessions", "sessions closed by the TTL reaper", **labels)
        self.kv_blocks_total = Gauge(p + "kv_blocks_total", "KV pool size in blocks", **labels)
        self.kv_blocks_free = Gauge(p + "kv_blocks_free", "unused KV blocks", **labels)
        self.kv_block_size = Gauge(p + "kv_block_size", "tokens per KV block", **labels)
        self.engine_counters = {
            name: Gauge(p + "engine_" + name, help_text, **labels) for name, help_text in (
                ("forwards", "engine forwards so far (prefills and forks included)"),
                ("sequences_forwarded", "sequences summed over engine forwards"),
                ("attention_rows", "attention rows summed over engine forwards (forks in one sequence share one)"))}

    def watch_ahead(self, served: Callable[[], int], dropped: Callable[[], int]) -> None:
        """Report a Draft service's drafts ahead, or a Stage service's tokens ahead (served from them, and thrown away), on every scrape."""
        p, labels = "specmesh_", dict(registry=self.registry)
        Gauge(p + "ahead_served_tokens", "tokens drafted ahead that became a proposal's", **labels).set_function(served)
        Gauge(p + "ahead_dropped_tokens", "tokens drafted ahead that the verdict made useless", **labels).set_function(dropped)

    def watch_core_share(self, share: Any) -> None:
        """Report a process's engine jobs on the launcher's core board (`servicekit.core_share.CoreShare`):
        how many ran, and how many of them ran on cores lent by another process as well."""
        p, labels = "specmesh_", dict(registry=self.registry)
        Gauge(p + "engine_jobs", "engine jobs run under the core board", **labels).set_function(lambda: share.num_jobs)
        Gauge(p + "engine_jobs_lent", "engine jobs that also ran on another process's lent cores",
              **labels).set_function(lambda: share.num_borrowed_jobs)

    def watch_kv_taken(self, taken: Callable[[], int]) -> None:
        """Report the context tokens a Draft service copied from a Verify service's shared cache instead of feeding them."""
        Gauge("specmesh_kv_taken_tokens", "context tokens whose KV was copied from the target's shared cache, not fed",
              registry=self.registry).set_function(taken)

    def watch_kv(self, kv_usage: Callable[[], Any]) -> None:
        """Report an engine's KV pool (`Engine.kv_usage`) on every scrape."""
        self.kv_blocks_total.set_function(lambda: kv_usage().total_blocks)
        self.kv_blocks_free.set_function(lambda: kv_usage().free_blocks)
        self.kv_block_size.set_function(lambda: kv_usage().block_size)

    def watch_engine(self, stats: Callable[[], Any]) -> None:
        """Report an engine's counters (`Engine.stats`) on every scrape."""
        for name, gauge in self.engine_counters.items():
            gauge.set_function(lambda name=name: getattr(stats(), "num_" + name))

    def record_verification(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        self.drafts.inc()
        self.draft_tokens.inc(num_drafted)
        self.accepted_tokens.inc(num_accepted)
        for position in range(num_accepted):
            self.accepted_per_position.labels(str(position)).inc()

    def serve(self, host: str, port: int):
        """Start the /metrics HTTP endpoint; returns (server, bound port). port 0 = any free port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server, server.server_port
