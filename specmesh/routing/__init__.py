"""Replica choice: which replica of a service takes a new session. Pure code, shared as-is by the
Coordinator (live, wall clock) and the cluster simulator (virtual time): no grpc, no asyncio, no I/O;
randomness only from the `random.Random` passed in, time only from the clock passed in.

  replica.py      `Replica` (id, weight, num_in_flight, healthy, last_failure_s), `NoHealthyReplica`
  policies.py     the `Router` protocol: `pick(replicas, rng)` and the hooks `on_start`, `on_finish`,
                  `on_failure`, `on_health`; `RandomChoice`, `RoundRobin`, `JSQ2`
  weighted.py     `WeightedJSQ`: least (in flight + 1) / capacity, capacity measured per replica
  registry.py     `make_router(name, **options)`: "round_robin", "jsq2", "weighted_jsq", ...
  replica_set.py  `ReplicaSet`: in-flight counts and health (with the re-admission rule) kept for
                  the caller, who calls `acquire` / `finish` / `fail` / `set_health`

Session affinity. A speculative session lives on one verify replica for its whole life: its KV cache
is there and never crosses the wire. So the router chooses once, when the session opens, and every
round of that session goes to the same replica; "in flight" counts open sessions, not calls. Only a
failure moves a session: the Coordinator re-opens it on another replica from the prompt and the
tokens already streamed (a fresh prefill), after `ReplicaSet.fail` took the dead one out. A draft
replica holds the drafter's KV for the session in the same way.
"""
