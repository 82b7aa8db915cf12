"""Discovery: the replica set of a service follows what a source (a static list, DNS, the Ray
registry) says exists. Pure: this module only compares address sets; the Coordinator resolves the
source, health-checks, and changes its replica set (`coordinator/discovery.py`, `coordinator/pools.py`).

A replica's life in a discovered set:
    new ----(passing health check)----> in (routed to)
     ^                                     |
     |                       (gone from the source's answer)
     |                                     v
     +------(back in the answer)------ draining: no new sessions; its open sessions go on there,
                                        or fail over as any failure does; forgotten at zero in flight

- `to_add`: in the answer, not known: join as *pending* (not routed) until a health check passes,
  so a replica that is listed before it serves (a pod not ready yet, an actor restarting) gets no
  session that would only fail over.
- `to_restore`: in the answer again while still draining: re-joins as pending (its open sessions and
  counts kept, since the same object comes back).
- `to_drain`: known, not in the answer: out of routing at once.
- An empty answer drains nothing: a lookup that briefly returns no record (every pod rolling, a DNS
  hiccup) would otherwise strand the Coordinator with no replica at all, while replicas that are
  really gone fail their health checks and leave routing anyway. A failed lookup is not an answer;
  the caller keeps the set as it is.

Worked example: known a, b (routed) and c (draining); the source now answers b, c, d.
    >>> plan = plan_refresh(known=["a:1", "b:1"], draining=["c:1"], discovered=["b:1", "c:1", "d:1"])
    >>> plan.to_add, plan.to_restore, plan.to_drain
    (['d:1'], ['c:1'], ['a:1'])
    >>> plan_refresh(known=["a:1"], draining=[], discovered=[]).is_empty    # an empty answer keeps a
    True
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DiscoveryPlan:
    """What to change in a replica set after one answer of a discovery source (addresses, in answer
    order for additions and in known order for drains)."""

    to_add: list[str] = field(default_factory=list)  # new: join pending, routed after a passing health check
    to_restore: list[str] = field(default_factory=list)  # draining but listed again: join pending
    to_drain: list[str] = field(default_factory=list)  # known but gone: no new sessions

    @property
    def is_empty(self) -> bool:
        return not (self.to_add or self.to_restore or self.to_drain)


def unique(addresses: Iterable[str]) -> list[str]:
    """First occurrence of each address, blanks dropped, in order.

    >>> unique(["b:1", " a:1", "b:1", ""])
    ['b:1', 'a:1']
    """
    seen: dict[str, None] = {}
    for address in addresses:
        address = address.strip()
        if address:
            seen.setdefault(address, None)
    return list(seen)


def plan_refresh(known: Iterable[str], draining: Iterable[str], discovered: Iterable[str]) -> DiscoveryPlan:
    """Compare the source's answer `discovered` with the `known` replicas (routed or pending) and the
    `draining` ones (gone from an earlier answer, sessions still open). See the module docstring."""
    known_list, draining_set, answer = unique(known), set(unique(draining)), unique(discovered)
    overlap = draining_set.intersection(known_list)
    if overlap:
        raise ValueError(f"a replica cannot be known and draining at once: {sorted(overlap)}")
    if not answer:
        return DiscoveryPlan()
    known_set, answer_set = set(known_list), set(answer)
    return DiscoveryPlan(
        to_add=[a for a in answer if a not in known_set and a not in draining_set],
        to_restore=[a for a in answer if a in draining_set],
        to_drain=[a for a in known_list if a not in answer_set],
    )
