"""The gateway's Prometheus metrics, in its own registry, served at GET /metrics on the gateway's port.

Names (prefix `specmesh_gateway_`): requests_total{route,status}, request_seconds{route} (until the
last byte), in_flight_requests, time_to_first_token_seconds (streams), prompt_tokens_total,
generated_tokens_total, draft_tokens_total, accepted_tokens_total, disconnects_total (clients that
left before the end; their Coordinator streams are cancelled).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r, p = self.registry, "specmesh_gateway_"
        self.requests = Counter(p + "requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.request_seconds = Histogram(p + "request_seconds", "HTTP request time until the last byte", ["route"],
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge(p + "in_flight_requests", "HTTP requests being served", registry=r)
        self.time_to_first_token = Histogram(p + "time_to_first_token_seconds", "streams: request to first text",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter(p + "generated_tokens", "tokens generated for clients", registry=r)
        self.draft_tokens = Counter(p + "draft_tokens", "draft tokens proposed for finished requests", registry=r)
        self.accepted_tokens = Counter(p + "accepted_tokens", "draft tokens accepted for finished requests", registry=r)
        self.disconnects = Counter(p + "disconnects", "clients that left before their response ended", registry=r)


class MetricsMiddleware:
    """ASGI middleware: counts every HTTP request by route (the known paths, else "other") and status."""

    def __init__(self, app, metrics: GatewayMetrics, routes: frozenset[str]):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in self.routes else "other"
        status = 500
        start = time.perf_counter()

        async def send_and_note(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.request_seconds.labels(route).observe(time.perf_counter() - start)
