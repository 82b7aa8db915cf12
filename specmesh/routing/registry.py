"""Routers by name, for config files: `router: {name: weighted_jsq, ema_weight: 0.3}`.

    >>> type(make_router("jsq2")).__name__
    'JSQ2'
    >>> make_router("weighted_jsq2").num_choices
    2
    >>> make_router("fastest")
    Traceback (most recent call last):
    ...
    ValueError: unknown router 'fastest'; known: jsq2, random, round_robin, weighted_jsq, weighted_jsq2
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from specmesh.routing.policies import JSQ2, RandomChoice, RoundRobin, Router
from specmesh.routing.weighted import WeightedJSQ

ROUTERS: dict[str, Callable[..., Router]] = {
    "random": RandomChoice,
    "round_robin": RoundRobin,
    "jsq2": JSQ2,
    "weighted_jsq": WeightedJSQ,
    "weighted_jsq2": functools.partial(WeightedJSQ, num_choices=2),
}


def make_router(name: str, **options: Any) -> Router:
    """A new router (each keeps its own state: cursor, measured capacities) from its name and options."""
    try:
        factory = ROUTERS[name]
    except KeyError:
        raise ValueError(f"unknown router {name!r}; known: {', '.join(sorted(ROUTERS))}") from None
    return factory(**options)
