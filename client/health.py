"""`specmesh health`: each service's grpc health, what it serves (GetInfo) and, where its /metrics
port is known, its load (open sessions, queue depth, mean batch size, acceptance).

    reports = await probe_all([Target("127.0.0.1:50052"), Target("127.0.0.1:50051", kind="draft")])
A target without a kind is asked which specmesh service it serves (health per service name).
"""

from __future__ import annotations

import asyncio
import urllib.request
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servicekit.channels import open_channel
from specmesh.proto.v1 import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    draft_pb2,
    draft_pb2_grpc,
    stage_pb2,
    stage_pb2_grpc,
    verify_pb2,
    verify_pb2_grpc,
)

SERVICE_NAMES = {"coordinator": "specmesh.v1.CoordinatorService", "verify": "specmesh.v1.VerifyService",
                 "draft": "specmesh.v1.DraftService", "stage": "specmesh.v1.StageService"}
TIMEOUT_S = 5.0


@dataclass
class Target:
    address: str
    kind: str = ""  # "" = ask the service
    name: str = ""
    metrics_url: str = ""  # http://host:port/metrics, when known
    tls_ca: str = ""


@dataclass
class HealthReport:
    target: Target
    kind: str
    status: str  # SERVING | NOT_SERVING | UNREACHABLE | ...
    details: dict[str, object] = field(default_factory=dict)
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "SERVING"

    def line(self) -> str:
        name = self.target.name or self.kind or "?"
        text = ", ".join(f"{k} {v}" for k, v in self.details.items())
        return f"{name:<12} {self.kind or '?':<11} {self.target.address:<21} {self.status:<11} {text or self.error}"


def _process_details(process) -> dict[str, object]:
    """`ProcessInfo` as health details: uptime, and restarts by the launcher when there were any."""
    details: dict[str, object] = {"up": f"{process.uptime_s:.0f}s"}
    if process.num_restarts:
        details["restarts"] = f"{process.num_restarts} (last exit: {process.last_exit or 'unknown'})"
    if process.settling:
        details["settling"] = "timing its step again after start"
    return details


def _model_details(model, kv=None) -> dict[str, object]:
    details: dict[str, object] = {"model": model.model, "device": model.device, "dtype": model.dtype}
    if kv is not None and kv.total_blocks:
        details["kv free"] = f"{kv.free_blocks}/{kv.total_blocks} blocks"
    return details


# a model service's GetInfo, by kind: (stub, request)
MODEL_INFO_CALLS = {"verify": (verify_pb2_grpc.VerifyServiceStub, verify_pb2.VerifyGetInfoRequest),
                    "draft": (draft_pb2_grpc.DraftServiceStub, draft_pb2.DraftGetInfoRequest),
                    "stage": (stage_pb2_grpc.StageServiceStub, stage_pb2.StageGetInfoRequest)}


async def _info(channel, kind: str) -> dict[str, object]:
    if kind in MODEL_INFO_CALLS:
        stub, request = MODEL_INFO_CALLS[kind]
        info = await stub(channel).GetInfo(request(), timeout=TIMEOUT_S)
        details = _model_details(info.model, info.kv)
        if kind == "verify":
            details["fused drafter"] = info.fused_drafter or "none"
        if kind == "draft":
            details = {"drafter": info.drafter, **details}
        return {**details, **_process_details(info.process)}
    if kind == "coordinator":
        c = await coordinator_pb2_grpc.CoordinatorServiceStub(channel).GetStats(coordinator_pb2.GetStatsRequest(),
                                                                               timeout=TIMEOUT_S)
        healthy = sum(r.healthy for r in c.replicas)
        back = sum(r.num_readmissions for r in c.replicas)
        return {"requests": c.num_requests, "active": c.num_active_requests, "replicas healthy": f"{healthy}/{len(c.replicas)}",
                **({"replicas back after down": back} if back else {}), **_process_details(c.process)}
    return {}


def metric_values(url: str) -> dict[str, float]:
    """A service's Prometheus page as {sample name: value} (blocking; a few ms on loopback): unlabelled
    samples, and the per-position acceptance summed over positions."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels or sample.name.startswith("specmesh_accepted_per_position"):
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def scrape_metrics(url: str, kind: str = "") -> dict[str, object]:
    """Load figures from a service's Prometheus page. Acceptance is counted where drafts are verified
    (a Draft service never learns it)."""
    values = metric_values(url)
    details: dict[str, object] = {"sessions": int(values.get("specmesh_sessions", 0)),
                                  "queue": int(values.get("specmesh_queue_depth", 0))}
    if values.get("specmesh_batch_size_count"):
        details["mean batch"] = f"{values['specmesh_batch_size_sum'] / values['specmesh_batch_size_count']:.2f}"
    if kind != "draft" and values.get("specmesh_draft_tokens_total"):
        details["acceptance"] = f"{values.get('specmesh_accepted_tokens_total', 0) / values['specmesh_draft_tokens_total']:.0%}"
    return details


async def _detect_kind(stub: health_pb2_grpc.HealthStub) -> str:
    for kind, service in SERVICE_NAMES.items():
        try:
            await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S)
            return kind
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
    return ""


async def probe(target: Target, *, token: str = "", client_cert: str = "", client_key: str = "") -> HealthReport:
    async with open_channel(target.address, tls_ca=target.tls_ca, client_cert=client_cert, client_key=client_key,
                            token=token) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            kind = target.kind or await _detect_kind(stub)
            response = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            status = "UNREACHABLE" if exc.code() == grpc.StatusCode.UNAVAILABLE else exc.code().name
            return HealthReport(target, target.kind, status, error=exc.details() or "")
        report = HealthReport(target, kind, health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))
        try:
            report.details.update(await _info(channel, kind))
        except grpc.aio.AioRpcError as exc:
            report.error = f"GetInfo: {exc.code().name}: {exc.details()}"
    if target.metrics_url:
        try:
            report.details.update(await asyncio.to_thread(scrape_metrics, target.metrics_url, kind))
        except OSError as exc:
            report.error = f"metrics: {exc}"
    return report


async def probe_all(targets: list[Target], **kwargs) -> list[HealthReport]:
    return list(await asyncio.gather(*(probe(t, **kwargs) for t in targets)))
