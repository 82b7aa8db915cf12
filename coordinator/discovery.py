"""Where the replicas of a service come from: the I/O of each discovery source. What to do with an
answer is `specmesh.routing.discovery` (pure); `coordinator.pools.ServicePool` applies it.

An address list (`--verify-addresses`, `--draft-addresses`) is comma-separated; each entry is one of
    host:port                 static: this replica, for the life of the process (as before)
    dns:///name:port          DNS: the A/AAAA records of `name` are the replicas, each at `port` (a
    dns:name:port               Kubernetes headless Service); gRPC's naming syntax, no authority
    ray:kind                  Ray: the replicas of service kind `kind` registered in the Ray cluster's
    ray:namespace/kind          specmesh registry (`specmesh ray up`), namespace "specmesh" unless given;
                                the cluster is $RAY_ADDRESS, else "auto" (the one on this node)
Entries combine: the answer is their union. Only a list with a dns: or ray: entry is re-read while
serving (every `--discovery-interval-s`); a static list is read once.

    source = source_for(["dns:///verify.specmesh.svc.cluster.local:50052"])
    source.resolve()    # ['10.0.0.7:50052', '10.0.0.9:50052']; blocking: the pool runs it in a thread

Every `resolve` raises on a failed lookup (the pool then keeps its replicas as they are). Tests
inject DNS answers with `DnsSource(..., resolve=fake)` or by replacing `resolve_host` in this module.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from specmesh.routing.discovery import unique

log = logging.getLogger("specmesh.coordinator")
DEFAULT_RAY_NAMESPACE = "specmesh"
REGISTRY_NAME = "specmesh-registry"  # the Ray actor `specmesh ray up` registers replicas in (client/ray_cluster.py)
RAY_TIMEOUT_S = 5.0  # one registry read


class DiscoverySource(Protocol):
    @property
    def dynamic(self) -> bool:
        """False: the answer never changes (a static list): read once, its replicas trusted at once."""
        ...

    def resolve(self) -> list[str]:
        """The replicas' addresses ("host:port") now. Blocking I/O; raises when the lookup fails."""
        ...


def resolve_host(name: str) -> list[str]:
    """The system resolver: every A/AAAA address of `name`, sorted (raises socket.gaierror)."""
    infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def host_port(ip: str, port: int) -> str:
    """'10.0.0.7', 50052 -> '10.0.0.7:50052'; an IPv6 address in brackets, as gRPC targets want it.

    >>> host_port("fd00::7", 50052)
    '[fd00::7]:50052'
    """
    try:
        is_v6 = ipaddress.ip_address(ip).version == 6
    except ValueError:
        is_v6 = False
    return f"[{ip}]:{port}" if is_v6 else f"{ip}:{port}"


@dataclass
class StaticSource:
    addresses: list[str]
    dynamic: bool = False

    def resolve(self) -> list[str]:
        return list(self.addresses)


@dataclass
class DnsSource:
    """The A/AAAA records of `name`, each at `port`. `resolve`: name -> IP addresses (tests inject one)."""

    name: str
    port: int
    resolve_name: Callable[[str], list[str]] | None = None
    dynamic: bool = True

    def resolve(self) -> list[str]:
        resolver = self.resolve_name or resolve_host  # looked up per call, so a replaced `resolve_host` applies
        return [host_port(ip, self.port) for ip in resolver(self.name)]


@dataclass
class RaySource:
    """The addresses of service kind `kind` in the registry actor of a Ray namespace (`specmesh ray up`)."""

    kind: str
    namespace: str = DEFAULT_RAY_NAMESPACE
    address: str = field(default_factory=lambda: os.environ.get("RAY_ADDRESS", "") or "auto")
    dynamic: bool = True

    def resolve(self) -> list[str]:
        import ray

        if not ray.is_initialized():
            ray.init(address=self.address, namespace=self.namespace, log_to_driver=False, logging_level=logging.WARNING)
        registry: Any = ray.get_actor(REGISTRY_NAME, namespace=self.namespace)
        return list(ray.get(registry.addresses.remote(self.kind), timeout=RAY_TIMEOUT_S))


@dataclass
class UnionSource:
    sources: list[DiscoverySource]

    @property
    def dynamic(self) -> bool:
        return any(source.dynamic for source in self.sources)

    def resolve(self) -> list[str]:
        return unique(address for source in self.sources for address in source.resolve())


def parse_entry(entry: str, resolve_name: Callable[[str], list[str]] | None = None) -> DiscoverySource:
    """One address-list entry -> its source (module docstring).

    >>> parse_entry("dns:///verify.default.svc:50052")
    DnsSource(name='verify.default.svc', port=50052, resolve_name=None, dynamic=True)
    >>> parse_entry("ray:prod/draft").namespace, parse_entry("ray:draft").namespace
    ('prod', 'specmesh')
    >>> parse_entry("10.0.0.7:50052")
    StaticSource(addresses=['10.0.0.7:50052'], dynamic=False)
    """
    if entry.startswith("dns:"):
        rest = entry[len("dns:"):]
        if rest.startswith("//"):
            authority, _, rest = rest[2:].partition("/")
            if authority:
                raise ValueError(f"{entry!r}: a DNS server authority is not supported (the system resolver is used): "
                                 f"write dns:///{rest}")
        name, sep, port = rest.rpartition(":")
        if not sep or not name or not port.isdigit():
            raise ValueError(f"{entry!r}: a dns: address needs a name and a port, e.g. dns:///verify.default.svc:50052")
        return DnsSource(name, int(port), resolve_name)
    if entry.startswith("ray:"):
        namespace, _, kind = entry[len("ray:"):].strip("/").rpartition("/")
        if not kind:
            raise ValueError(f"{entry!r}: a ray: address names a service kind, e.g. ray:verify or ray:my-namespace/verify")
        return RaySource(kind, namespace or DEFAULT_RAY_NAMESPACE)
    return StaticSource([entry])  # host:port, or any other gRPC target (unix:path)


def source_for(entries: Sequence[str], resolve_name: Callable[[str], list[str]] | None = None) -> DiscoverySource:
    """The source of a whole address list: plain entries together as one static source, the others each
    their own; one source alone as itself.

    >>> source_for(["a:1", "b:2"])
    StaticSource(addresses=['a:1', 'b:2'], dynamic=False)
    >>> source_for(["a:1", "dns:///v:2"]).dynamic
    True
    """
    static: list[str] = []
    sources: list[DiscoverySource] = []
    for entry in entries:
        source = parse_entry(entry, resolve_name)
        if isinstance(source, StaticSource):
            static += source.addresses
        else:
            sources.append(source)
    if not sources:
        return StaticSource(static)
    if static:
        sources.insert(0, StaticSource(static))
    return sources[0] if len(sources) == 1 else UnionSource(sources)
